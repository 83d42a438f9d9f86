"""Codecs on a CUDA device never make the host wait for it (issue 44, item 5): every built-in codec's reduce runs
step by step on a one-rank NCCL group under ``torch.cuda.set_sync_debug_mode("error")``, so a ``.item()``, a
``bool(tensor)``, a boolean-mask index or a blocking copy from the host inside it raises; and it gives what the
same codec gives on CPU tensors over gloo, a non-finite step and PowerSGD's warm-up steps included.

The driver is this module run as a script, in a fresh process per device (a process group and the sync debug
mode belong to a process)::

    python -m tests.test_gpu_codecs OUT.pt cuda    # CUDA over NCCL, under the sync debug mode, beside CPU over gloo
    python -m tests.test_gpu_codecs OUT.pt cpu     # the same driver with both sides on CPU over gloo

A codec skips a group of one rank (there is nothing to average), so the driver calls ``Codec.reduce`` itself, as
tests/workers/device_codecs.py does. The CUDA cases skip without a CUDA device; the CPU ones run everywhere and
test the driver (both sides on the CPU: the same bits).
"""

from __future__ import annotations

import sys
import traceback
from contextlib import contextmanager

import pytest
import torch
import torch.distributed as dist
from torch import nn

from ddp_plugin import Bucket
from ddp_plugin.codecs import BUILTIN_CODECS, dequantize_int8, quantize_int8
from ddp_plugin.codecs.int8 import div_
from ddp_plugin.runtime.comm import TracedCommunicator
from ddp_plugin.testing.ranks import init_one_rank

CASES: dict[str, tuple[str, dict]] = {
    "fp16": ("fp16", {}),
    "bf16": ("bf16", {}),
    "int8": ("int8", {"block_size": 128}),
    "int8-no-feedback": ("int8", {"block_size": 128, "error_feedback": False}),
    "topk": ("topk", {"ratio": 0.05}),
    # Two exact warm-up steps, then the power iteration with a warm-started Q (a non-finite step replaces it).
    "powersgd": ("powersgd", {"rank": 2, "start_iter": 2}),
    "powersgd-gram-schmidt": ("powersgd", {"rank": 2, "start_iter": 2, "epsilon": 1e-8, "warm_start": False}),
    "sparse": ("sparse", {"density": 0.05, "chunk": 128, "bits": 4}),
}
"""Case id -> (codec name, options): every built-in codec, and the options that take other paths."""

SHAPES = [(48, 40), (40,), (24, 16), (9,)]  # PowerSGD compresses both matrices and sends the vectors as they are
NUMEL = sum(torch.Size(s).numel() for s in SHAPES)
STEPS, NAN_STEP, NAN_AT = 7, 4, 100  # one NaN in the first matrix at step 4; steps 5 and 6 must be finite again
DEVICES = [
    "cpu",
    pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")),
]
BACKEND = {"cpu": "gloo", "cuda": "nccl"}


# ---------------------------------------------------------------------- the tests


@pytest.fixture(scope="module", params=DEVICES)
def device(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def results(device, tmp_path_factory) -> dict:
    from tests.support import run_python

    out = tmp_path_factory.mktemp("gpu_codecs") / "codecs.pt"
    run_python("-m", "tests.test_gpu_codecs", out, device)
    return torch.load(out)


def test_every_built_in_codec_has_a_case():
    assert {name for name, _ in CASES.values()} == set(BUILTIN_CODECS)


@pytest.mark.parametrize("case", list(CASES))
def test_codec_makes_no_synchronizing_call_on_the_device(device, results, case):
    assert results["backend"] == BACKEND[device]
    error = results["cases"][case]["device"]["sync_error"]
    assert error is None, f"{case} made the host wait for the device:\n{error}"


@pytest.mark.parametrize("case", list(CASES))
def test_codec_on_the_device_gives_what_it_gives_on_cpu(device, results, case):
    on_device, cpu = results["cases"][case]["device"], results["cases"][case]["cpu"]
    assert on_device["out_devices"] == [results["device"]] and cpu["out_devices"] == ["cpu"]
    # PowerSGD orthogonalizes with other kernels on a GPU (as tests/test_single_device.py allows); both sides on
    # the CPU run the same kernels: the same bits, NaN where the other has NaN.
    atol = 0.0 if device == "cpu" else 1e-3 if CASES[case][0] == "powersgd" else 1e-6
    torch.testing.assert_close(on_device["outs"], cpu["outs"], atol=atol, rtol=0, equal_nan=True)


@pytest.mark.parametrize("case", list(CASES))
def test_non_finite_step_reaches_the_output_and_later_steps_are_finite(device, results, case):
    outs = results["cases"][case]["device"]["outs"]
    assert not torch.isfinite(outs[NAN_STEP]).all()
    assert torch.isfinite(outs[:NAN_STEP]).all() and torch.isfinite(outs[NAN_STEP + 1 :]).all()


@pytest.mark.parametrize("case", [c for c, (name, o) in CASES.items()
                                  if name in ("int8", "topk", "powersgd", "sparse") and o.get("error_feedback", True)])
def test_codec_state_stays_on_the_device_and_finite(device, results, case):
    on_device = results["cases"][case]["device"]
    assert on_device["state_devices"] == [results["device"]]
    assert all(torch.isfinite(v).all() for v in on_device["state"].values() if v.is_floating_point())


def test_int8_quantizes_and_divides_to_the_cpu_bits_on_the_device(device, results):
    assert results["bits"] == {"q_equal": True, "scales_equal": True, "roundtrip_equal": True, "div_equal": True}


# ---------------------------------------------------------------------- the driver (python -m tests.test_gpu_codecs)


@contextmanager
def sync_debug(on: bool):
    """Raise at any synchronizing CUDA call inside (when ``on``)."""
    if not on:
        yield
        return
    torch.cuda.synchronize()  # what came before is done: only the codec's own calls count
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")


def bucket_on(device: torch.device) -> Bucket:
    params = tuple(nn.Parameter(torch.zeros(s, device=device)) for s in SHAPES)
    offsets = tuple(sum(torch.Size(s).numel() for s in SHAPES[:i]) for i in range(len(SHAPES)))
    return Bucket(index=0, buffer=torch.zeros(NUMEL, device=device), params=params,
                  names=tuple(f"p{i}" for i in range(len(params))), offsets=offsets)


def run_codec(case: str, device: torch.device, group: dist.ProcessGroup, data: torch.Tensor, debug: bool) -> dict:
    """Every step of ``data`` through a fresh codec of ``case`` on ``device``; with ``debug`` under the sync
    debug mode, and where that raised, again without it (so the outputs can still be compared)."""
    name, options = CASES[case]
    sync_error = None
    for checked in ((True, False) if debug else (False,)):
        codec = BUILTIN_CODECS[name](**options)
        codec.on_setup(comm=TracedCommunicator())
        bucket = bucket_on(device)
        tensors = [data[step].to(device, copy=True) for step in range(STEPS)]  # (copies from the host: outside)
        try:
            with sync_debug(checked):
                for tensor in tensors:
                    codec.reduce(tensor, group, 1, bucket, 0, codec.bucket_state(0, tensor)).wait()
        except RuntimeError as err:
            if not checked:
                raise
            sync_error = "".join(traceback.format_exception(err))[-4000:]
            continue
        break
    if device.type == "cuda":
        torch.cuda.synchronize()
    fields = codec.states[0].as_dict() if 0 in codec.states else {}
    return {
        "sync_error": sync_error,
        "outs": torch.stack([t.cpu() for t in tensors]),
        "out_devices": sorted({str(t.device) for t in tensors}),
        "state": {k: v.detach().cpu().clone() for k, v in fields.items() if torch.is_tensor(v)},
        "state_devices": sorted({str(v.device) for v in fields.values() if torch.is_tensor(v)}),
    }


def bits(device: torch.device) -> dict:
    """Whether int8 blocks quantize, and float32 values divide by a group size (the int8 codec's ``div_``), to
    the same bits on ``device`` as on the CPU."""
    g = torch.Generator().manual_seed(4)
    x = torch.randn(256, 512, generator=g) * torch.logspace(-30, 30, 256)[:, None]
    q_cpu, s_cpu = quantize_int8(x)
    q_dev, s_dev = quantize_int8(x.to(device))
    y = torch.randn(1 << 16, generator=g)
    div_equal = all(torch.equal(y / d, div_(y.to(device), d).cpu()) for d in (3, 5, 7, 127))
    return {
        "q_equal": torch.equal(q_cpu, q_dev.cpu()),
        "scales_equal": torch.equal(s_cpu, s_dev.cpu()),
        "roundtrip_equal": torch.equal(dequantize_int8(q_cpu, s_cpu), dequantize_int8(q_dev, s_dev).cpu()),
        "div_equal": div_equal,
    }


def main(out: str, device_name: str) -> None:
    device = init_one_rank(device_name)
    try:
        gloo = dist.new_group(backend="gloo")
        data = torch.randn(STEPS, NUMEL, generator=torch.Generator().manual_seed(3))
        data[NAN_STEP, NAN_AT] = float("nan")
        results: dict = {"backend": dist.get_backend(), "device": str(device), "cases": {}, "bits": bits(device)}
        for case in CASES:
            results["cases"][case] = {
                "device": run_codec(case, device, dist.group.WORLD, data, debug=device.type == "cuda"),
                "cpu": run_codec(case, torch.device("cpu"), gloo, data, debug=False),
            }
        torch.save(results, out)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:3])
