"""The CUDA path as far as one GPU shows it (one NCCL rank; tests/workers/gpu_ready.py): communication on a
stream of its own, device-time metrics, no host synchronization per bucket, fp16 with CUDA's loss scaler. The
CUDA cases skip without a GPU (CI has none); the CPU case runs the same worker, so the driver itself is tested
everywhere. Several GPUs: benchmarks/gpu_check.py (docs/testing.md)."""

from __future__ import annotations

import json

import pytest
import torch

from tests.support import WORKERS, run_python
from tests.workers.gpu_ready import LAYERS, SPIN_S

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (NCCL)")


def run(device: str, tmp_path) -> dict:
    out = tmp_path / "result.json"
    run_python(WORKERS / "gpu_ready.py", "--out", out, "--device", device, timeout=600)
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def cuda(tmp_path_factory) -> dict:
    return run("cuda", tmp_path_factory.mktemp("gpu"))


def test_the_worker_runs_on_cpu(tmp_path):
    result = run("cpu", tmp_path)
    assert result["streams"]["backend"] == "gloo" and result["streams"]["buckets"] == LAYERS
    assert result["streams"]["metric_means"]["comm/time_ms"] > 0
    assert result["syncs"] == {"8": 0.0, "2": 0.0}  # (CPU tensors never synchronize a device)


@needs_cuda
def test_communication_runs_on_a_stream_of_its_own_and_the_backward_does_not_wait_for_it(cuda):
    s = cuda["streams"]
    assert s["backend"] == "nccl" and s["buckets"] == LAYERS
    assert s["link_streams"] and s["default_stream"] not in s["link_streams"], s
    # From the first gradient to the last on the backward's stream: far below one bucket's 20 ms spin, which the
    # backward's kernels would queue behind on a shared stream.
    assert max(s["backward_ms"]) < SPIN_S * 1e3 / 2, s["backward_ms"]


@needs_cuda
def test_communication_time_is_device_time(cuda):
    means = cuda["streams"]["metric_means"]
    # Every bucket's spin runs before its all-reduce: a step's communication takes at least LAYERS spins.
    assert means["comm/time_ms"] > 0.8 * LAYERS * SPIN_S * 1e3, means
    assert means["comm/wait_ms"] > 0.5 * LAYERS * SPIN_S * 1e3, means


@needs_cuda
def test_no_host_synchronization_per_bucket(cuda):
    # About the same syncs per step with 8 buckets as with 2 (the finite checks of skip_nonfinite included): a sync
    # per bucket would add 6 a step. (On an H100, 2026-11-26: 9.67 and 9.5 a step, one sync in 6 steps apart.)
    assert abs(cuda["syncs"]["8"] - cuda["syncs"]["2"]) < 1, cuda["syncs"]


@needs_cuda
def test_fp16_with_cudas_loss_scaler_clips_as_lightning_does(cuda):
    f = cuda["fp16"]
    assert f["ours_scale"] == f["lightning_scale"]
    torch.testing.assert_close(torch.tensor(f["ours"]), torch.tensor(f["lightning"]), atol=1e-6, rtol=0)
