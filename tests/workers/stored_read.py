"""Worker for test_checkpoint_formats: one rank (gloo on CPU, NCCL on CUDA) saves a DTensor and a plain tensor in
the sharded layout and reads each back lazily into a DTensor on its device (``StoredTensor.read_like``).

    python tests/workers/stored_read.py OUT cpu|cuda
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from ddp_plugin.checkpoints import sharded_checkpoint
from ddp_plugin.testing.ranks import init_one_rank


def main(out: str, device_name: str) -> None:
    device = init_one_rank(device_name)
    try:
        mesh = init_device_mesh(device.type, (1,))
        whole = torch.randn(6, 4, generator=torch.Generator().manual_seed(0))
        split = distribute_tensor(whole.to(device), mesh, [Shard(0)])
        plain = torch.arange(5.0, device=device)
        path = os.path.join(out, "ckpt")
        sharded_checkpoint.save({}, {"w": split, "b": plain}, [], {"model/w": (6, 4), "model/b": (5,)}, path)
        state = sharded_checkpoint.load(path, lazy=True)["state_dict"]
        read_w = state["w"].read_like(distribute_tensor(torch.zeros(6, 4, device=device), mesh, [Shard(0)]))
        read_b = state["b"].read_like(distribute_tensor(torch.zeros(5, device=device), mesh, [Replicate()]))
        torch.save({
            "stored": [type(state[k]).__name__ for k in ("w", "b")],
            "dtensors": [isinstance(t, DTensor) for t in (read_w, read_b)],
            "devices": [str(t.to_local().device) for t in (read_w, read_b)],
            "w_equal": torch.equal(read_w.to_local().cpu(), whole),
            "b_equal": torch.equal(read_b.to_local().cpu(), plain.cpu()),
        }, os.path.join(out, "result.pt"))
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:3])
