"""Worker for the single-device codec test: every built-in codec on one device's tensors over a real process
group of one rank (NCCL on CUDA, gloo on CPU), step by step beside the same codec on CPU tensors over gloo.

    python tests/workers/device_codecs.py OUT.pt cuda     # CUDA over NCCL beside CPU over gloo
    python tests/workers/device_codecs.py OUT.pt cpu      # both on CPU over gloo

A codec skips a group of one rank (there is nothing to average), so this calls ``Codec.reduce`` itself: the
quantization, the NCCL collectives on the packed data and the error feedback all run, with the mean of one.
Saves, per codec: the outputs and final state on both devices, the device/dtype of what came back, and the
inputs, for tests/test_single_device.py to judge.
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist
from torch import nn

from ddp_plugin import Bucket
from ddp_plugin.codecs import BUILTIN_CODECS, dequantize_int8, quantize_int8
from ddp_plugin.runtime.comm import TracedCommunicator
from ddp_plugin.testing.ranks import init_one_rank

OPTIONS = {
    "fp16": {},
    "bf16": {},
    "int8": {"block_size": 128},
    "topk": {"ratio": 0.05},
    "powersgd": {"rank": 2, "start_iter": 0},
    "sparse": {"density": 0.05, "chunk": 128, "bits": 4},
}
STEPS, SHAPE = 5, (48, 40)


def bucket_on(device: torch.device) -> Bucket:
    param = nn.Parameter(torch.zeros(SHAPE, device=device))
    return Bucket(index=0, buffer=torch.zeros(param.numel(), device=device), params=(param,), names=("w",),
                  offsets=(0,))


def run(name: str, device: torch.device, group: dist.ProcessGroup, data: torch.Tensor) -> dict:
    codec = BUILTIN_CODECS[name](**OPTIONS[name])
    codec.on_setup(comm=TracedCommunicator())
    bucket = bucket_on(device)
    outs = []
    for step in range(STEPS):
        tensor = data[step].to(device, copy=True)
        codec.reduce(tensor, group, 1, bucket, 0, codec.bucket_state(0, tensor)).wait()
        outs.append(tensor)
    if device.type == "cuda":
        torch.cuda.synchronize()
    fields = codec.states[0].as_dict() if 0 in codec.states else {}
    # Copied: the codec updates its residuals in place on the next reduction (below).
    state = {k: v.detach().cpu().clone() if torch.is_tensor(v) else v for k, v in fields.items()}
    state_devices = sorted({str(v.device) for v in fields.values() if torch.is_tensor(v)})
    saved, rank_saved = codec.on_save_state_dict(), codec.on_save_rank_state_dict()
    resumed = BUILTIN_CODECS[name](**OPTIONS[name])
    resumed.on_setup(comm=TracedCommunicator())
    if saved is not None or rank_saved is not None:  # fp16 and bf16 keep no state
        resumed.on_load_state_dict(state=saved or {}, rank_state=rank_saved)
    again = [data[0].to(device, copy=True), data[0].to(device, copy=True)]
    for c, t in zip((codec, resumed), again):
        c.reduce(t, group, 1, bucket, 0, c.bucket_state(0, t)).wait()
    return {
        "outs": torch.stack([o.cpu() for o in outs]),
        "out_devices": sorted({str(o.device) for o in outs}),
        "out_dtypes": sorted({str(o.dtype) for o in outs}),
        "state": state,
        "state_devices": state_devices,
        "resumed_equal": torch.equal(again[0], again[1]),
    }


def main() -> None:
    out = sys.argv[1]
    device = init_one_rank(sys.argv[2])
    gloo = dist.new_group(backend="gloo")
    data = torch.randn(STEPS, SHAPE[0] * SHAPE[1], generator=torch.Generator().manual_seed(3))
    results: dict = {"backend": dist.get_backend(), "data": data, "codecs": {}}
    for name in BUILTIN_CODECS:
        results["codecs"][name] = {"device": run(name, device, dist.group.WORLD, data),
                                   "cpu": run(name, torch.device("cpu"), gloo, data)}
    x = torch.randn(64, 256, generator=torch.Generator().manual_seed(4)) * torch.logspace(-3, 2, 64)[:, None]
    q_cpu, s_cpu = quantize_int8(x)
    q_dev, s_dev = quantize_int8(x.to(device))
    results["int8_blocks"] = {
        "q_equal": torch.equal(q_cpu, q_dev.cpu()),
        "scales_equal": torch.equal(s_cpu, s_dev.cpu()),
        "roundtrip_equal": torch.equal(dequantize_int8(q_cpu, s_cpu), dequantize_int8(q_dev, s_dev).cpu()),
    }
    torch.save(results, out)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
