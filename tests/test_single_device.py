"""One process on one device, over a real process group of one rank: gloo on CPU, and NCCL on CUDA where a GPU
exists (NCCL refuses two ranks on one GPU, so this is the NCCL path a one-GPU machine can run; the CUDA cases
skip elsewhere, CI included).

- Training under ``hierarchical_zero`` at stages 0-3 equals Lightning's own single-device training on the same
  device (C2 with N = 1), with the engine's buckets, the sharder's reduce-scatter/all-gather and stage 3's
  gather/free going through the device's backend.
- Every codec on the device's tensors matches the same codec on CPU tensors over gloo, keeps its state on the
  device, and error feedback carries what compression left out.
- A checkpoint saved at stage 3 on the device resumes at stage 0 (master) and at stage 3 (sharded) and equals
  the uninterrupted run.
"""

from __future__ import annotations

import pytest
import torch

from tests.support import WORKERS, run_python

DEVICES = [
    "cpu",
    pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (NCCL)")),
]
BACKEND = {"cpu": "gloo", "cuda": "nccl"}
DEVICE_NAME = {"cpu": "cpu", "cuda": "cuda:0"}
ACCELERATOR = {"cpu": "cpu", "cuda": "gpu"}
CONFIGS = ["plain", "everything"]
VARIANTS = "0:global:auto,1:global:auto,2:global:auto,3:global:auto"
TAGS = ["", "-1-global-auto", "-2-global-auto", "-3-global-auto"]
# Lightning on the same device is the reference; the same kernels run in the same order, and only the sharded
# optimizer's step over flat pieces (instead of per-parameter tensors) may round differently (6e-8 on CPU).
ATOL = 1e-5


@pytest.fixture(scope="module", params=DEVICES)
def device(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def training(device, tmp_path_factory) -> dict:
    ref, ours = tmp_path_factory.mktemp("reference"), tmp_path_factory.mktemp("ours")
    common = ["--accelerator", ACCELERATOR[device], "--configs", ",".join(CONFIGS)]
    run_python(WORKERS / "equivalence.py", "--out", ref, "--devices", "0", *common)
    run_python(WORKERS / "equivalence.py", "--out", ours, "--devices", "1", "--variants", VARIANTS, *common)
    return {
        "reference": {c: torch.load(ref / f"{c}-0.pt") for c in CONFIGS},
        "ours": {(c, t): torch.load(ours / f"{c}-1{t}.pt") for c in CONFIGS for t in TAGS},
    }


@pytest.mark.parametrize("config", CONFIGS)
@pytest.mark.parametrize("tag", TAGS, ids=["stage0", "stage1", "stage2", "stage3"])
def test_training_on_one_device_equals_lightning_on_that_device(device, training, config, tag):
    run, ref = training["ours"][(config, tag)], training["reference"][config]
    assert run["backend"] == BACKEND[device]
    assert run["device"] == DEVICE_NAME[device] and ref["device"] == DEVICE_NAME[device]
    torch.testing.assert_close(run["history"], ref["history"], atol=ATOL, rtol=0)
    assert (ref["history"][-1] - ref["history"][0]).abs().max() > 1e-2


@pytest.fixture(scope="module")
def codecs(device, tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("codecs") / "codecs.pt"
    run_python(WORKERS / "device_codecs.py", out, device)
    return torch.load(out)


@pytest.mark.parametrize("name", ["fp16", "bf16", "int8", "topk", "powersgd", "sparse"])
def test_codec_on_the_device_matches_it_on_cpu(device, codecs, name):
    assert codecs["backend"] == BACKEND[device]
    on_device, cpu = codecs["codecs"][name]["device"], codecs["codecs"][name]["cpu"]
    assert on_device["out_devices"] == [DEVICE_NAME[device]] and on_device["out_dtypes"] == ["torch.float32"]
    assert cpu["out_devices"] == ["cpu"]
    assert all(d == DEVICE_NAME[device] for d in on_device["state_devices"])
    # PowerSGD orthogonalizes with other kernels on a GPU; the other codecs compute the same numbers.
    atol = 1e-3 if name == "powersgd" and device == "cuda" else 1e-6
    torch.testing.assert_close(on_device["outs"], cpu["outs"], atol=atol, rtol=0)
    assert on_device["resumed_equal"] and cpu["resumed_equal"]


@pytest.mark.parametrize("name", ["int8", "topk", "powersgd", "sparse"])
def test_error_feedback_on_the_device_carries_what_compression_left_out(codecs, name):
    on_device, data = codecs["codecs"][name]["device"], codecs["data"]
    sent, exact = on_device["outs"].sum(0), data.sum(0)  # one rank: the mean is its own gradient
    owed = on_device["state"]["residual"][: data.shape[1]]  # (sparse keeps it padded to its chunks)
    if name == "int8":
        owed = owed + on_device["state"]["chunk_residual"].flatten()[: data.shape[1]]
    assert (sent - exact).abs().max() > 1e-2
    torch.testing.assert_close(sent + owed, exact, atol=1e-4, rtol=1e-4)


def test_int8_blocks_quantize_to_the_same_bits_on_the_device_and_cpu(codecs):
    assert codecs["int8_blocks"] == {"q_equal": True, "scales_equal": True, "roundtrip_equal": True}


@pytest.fixture(scope="module")
def checkpoints(device, tmp_path_factory) -> dict:
    d = tmp_path_factory.mktemp("checkpoints")
    common = ["--accelerator", ACCELERATOR[device], "--devices", "1", "--steps", "12", "--out", d]
    run_python(WORKERS / "checkpoint_run.py", *common, "--stage", "3", "--name", "full")
    run_python(WORKERS / "checkpoint_run.py", *common, "--stage", "3", "--name", "sharded", "--checkpoint", "sharded")
    run_python(WORKERS / "checkpoint_run.py", *common, "--stage", "0", "--name", "master_to_z0", "--no-save",
               "--resume", d / "full-step=6.ckpt")
    run_python(WORKERS / "checkpoint_run.py", *common, "--stage", "3", "--name", "sharded_to_z3", "--no-save",
               "--checkpoint", "sharded", "--resume", d / "sharded-step=6.ckpt")
    return {n: torch.load(d / f"{n}.pt") for n in ("full", "sharded", "master_to_z0", "sharded_to_z3")}


@pytest.mark.parametrize("resumed", ["master_to_z0", "sharded_to_z3"])
def test_checkpoint_saved_on_the_device_resumes_to_the_uninterrupted_run(checkpoints, resumed):
    full, run = checkpoints["full"], checkpoints[resumed]
    assert run["global_step"] == 12
    for name, value in full["params"].items():
        torch.testing.assert_close(run["params"][name], value, atol=1e-5, rtol=0)
    torch.testing.assert_close(torch.tensor(run["losses"]), torch.tensor(full["losses"][6:]), atol=1e-5, rtol=0)
