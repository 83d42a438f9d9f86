"""A sharded checkpoint read lazily (``sharded_checkpoint.load(path, lazy=True)``), as a model no rank holds whole
reads it: each tensor is a ``StoredTensor`` until asked for, and ``read_like(dtensor)`` reads only the
tensor-parallel blocks that overlap what this rank holds, assembling ZeRO pieces of a block where a block was
written in pieces. Here a checkpoint written by 2 tensor-parallel ranks (blocks along dim 0, one of them in ZeRO
pieces, and a tensor split along dim 1) is read by 4 gloo ranks with other splits; the values equal those of the
whole tensor split the same way, and each rank reads the blocks it needs and no others."""

from __future__ import annotations

import os
import warnings

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.tensor import Replicate, Shard, distribute_tensor
from torch.distributed.device_mesh import init_device_mesh

from ddp_plugin.checkpoints import sharded_checkpoint
from ddp_plugin.checkpoints.sharded_checkpoint import META_FILE, OPTIM_KEY, SHAPES_KEY, StoredTensor
from ddp_plugin.testing.ranks import RankPool

W = torch.arange(8 * 6, dtype=torch.float32).reshape(8, 6)  # written as 2 blocks of rows (the second in pieces)
V = -torch.arange(4 * 10, dtype=torch.float32).reshape(4, 10)  # written as 2 blocks of columns
B = torch.linspace(0, 1, 6)  # written whole


def write(path: str) -> None:
    flat = {
        "model/w@0:0": W[:4].clone(),
        "model/w@0:4#0": W[4:].reshape(-1)[:10].clone(), "model/w@0:4#10": W[4:].reshape(-1)[10:].clone(),
        "model/v@1:0": V[:, :5].clone(), "model/v@1:5": V[:, 5:].clone(),
        "model/b": B.clone(),
    }
    with warnings.catch_warnings():  # ("assuming the intent is to save in a single process": it is)
        warnings.simplefilter("ignore", UserWarning)
        dcp.save(flat, checkpoint_id=path, no_dist=True)
    shapes = {"model/w": (8, 6), "model/w@0:0": (4, 6), "model/w@0:4": (4, 6),
              "model/v": (4, 10), "model/v@1:0": (4, 5), "model/v@1:5": (4, 5)}
    torch.save({SHAPES_KEY: shapes, OPTIM_KEY: [], "epoch": 3}, os.path.join(path, META_FILE))


def rank_main(rank: int, world_size: int, path: str) -> None:
    mesh = init_device_mesh("cpu", (world_size,))
    checkpoint = sharded_checkpoint.load(path, lazy=True)
    state = checkpoint["state_dict"]
    assert checkpoint["epoch"] == 3 and set(state) == {"w", "v", "b"}
    assert all(isinstance(v, StoredTensor) for v in state.values())
    assert state["w"].shape == (8, 6) and state["v"].shape == (4, 10)
    read: list[list[str]] = []
    original = sharded_checkpoint._read

    def recording(flat, p):
        read.append(sorted(flat))
        return original(flat, p)

    sharded_checkpoint._read = recording
    try:
        read_each(rank, mesh, state, read)
    finally:
        sharded_checkpoint._read = original
    assert torch.equal(state["w"].load(), W) and torch.equal(state["v"].load(), V)
    assert torch.equal(sharded_checkpoint.materialized({"x": [state["b"]]})["x"][0], B)


def read_each(rank: int, mesh, state: dict, read: list[list[str]]) -> None:
    for name, whole, placement in (("w", W, Shard(0)), ("v", V, Shard(1)), ("w", W, Replicate()),
                                   ("v", V, Shard(0)), ("b", B, Shard(0))):
        like = distribute_tensor(torch.empty_like(whole), mesh, [placement], src_data_rank=None)
        read.clear()
        mine = state[name].read_like(like)
        expected = distribute_tensor(whole, mesh, [placement], src_data_rank=None)
        assert mine.placements == like.placements and mine.shape == whole.shape
        assert torch.equal(mine.to_local(), expected.to_local()), (rank, name, placement)
        keys = [k for batch in read for k in batch]
        if name == "w" and placement == Shard(0):  # rows 2r, 2r + 1: one block, the second in its pieces
            assert keys == (["model/w@0:0"] if rank < 2 else ["model/w@0:4#0", "model/w@0:4#10"]), (rank, keys)
        if name == "v" and placement == Shard(1):  # columns of 10 split 3, 3, 3, 1: block 0:5 or 5:10 or both
            wanted = [["model/v@1:0"], ["model/v@1:0", "model/v@1:5"], ["model/v@1:5"], ["model/v@1:5"]][rank]
            assert keys == wanted, (rank, keys)


def test_each_rank_reads_only_the_blocks_it_holds(tmp_path):
    path = str(tmp_path / "ckpt")
    write(path)
    with RankPool(4) as pool:  # (forked from a fork server that imported torch once, not 4 spawned interpreters)
        pool.run(rank_main, path)


def test_an_eager_load_assembles_the_same_tensors(tmp_path):
    path = str(tmp_path / "ckpt")
    write(path)
    state = sharded_checkpoint.load(path)["state_dict"]
    assert torch.equal(state["w"], W) and torch.equal(state["v"], V) and torch.equal(state["b"], B)
