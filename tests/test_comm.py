"""The communicator's gloo reduce-scatter on real ranks: the sum of every rank's chunk, in place or into a
buffer of its own, each chunk sent once, and a receive buffer of one piece (``RS_PIECE_BYTES``) instead of a
whole input."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import ddp_plugin.runtime.comm as comm_module
from ddp_plugin.runtime.comm import TracedCommunicator
from ddp_plugin.testing.ranks import RankPool

WORLD = 4


@pytest.fixture(scope="module")
def ranks():
    with RankPool(WORLD) as pool:
        yield pool


def data(numel: int) -> torch.Tensor:
    """Every rank's input, integer-valued so that any order of summing gives the same bits."""
    g = torch.Generator().manual_seed(numel)
    return torch.randint(-1000, 1000, (WORLD, numel), generator=g).float()


def reduce_scatter(rank, world, numel, piece_bytes, in_place):
    comm_module.RS_PIECE_BYTES = piece_bytes
    comm = TracedCommunicator(ranks_per_node=1)  # every rank its own node: all bytes count as cross-node
    x = data(numel)[rank].clone()
    c = numel // world
    out = x[rank * c : (rank + 1) * c] if in_place else torch.full((c,), float("nan"))
    result = comm.reduce_scatter(out, x, group=dist.group.WORLD)
    arena = comm._local.arenas[torch.device("cpu")]
    return result.clone(), x, comm.take_traffic().cross_node_bytes, arena.numel()


@pytest.mark.parametrize("in_place", [True, False], ids=["in_place", "own_buffer"])
@pytest.mark.parametrize("piece_bytes", [4 << 20, 24], ids=["one_piece", "pieces_of_6"])
def test_gloo_reduce_scatter_sums_each_chunk_receiving_one_piece_at_a_time(ranks, in_place, piece_bytes):
    numel = WORLD * 25  # chunks of 25 values: with pieces of 6 values the last piece is shorter
    results = ranks.run(reduce_scatter, numel, piece_bytes, in_place)
    expected = data(numel).sum(0).view(WORLD, -1)
    for rank, (out, x, sent, arena_bytes) in enumerate(results):
        assert torch.equal(out, expected[rank])
        if not in_place:  # the input is left as it was
            assert torch.equal(x, data(numel)[rank])
        assert sent == (WORLD - 1) * 25 * 4  # each other rank's chunk, once
        assert arena_bytes == min(piece_bytes, 25 * 4) + (-min(piece_bytes, 25 * 4)) % 8  # one piece, in words


def all_reduce_in_pieces(rank, world, numel, async_op):
    comm = TracedCommunicator(ranks_per_node=1)
    x = data(numel)[rank].clone()
    work = comm.all_reduce(x, group=dist.group.WORLD, async_op=async_op, piece_bytes=24)
    if async_op:
        assert len(work.works) == -(-numel // 6)  # pieces of 24 bytes, each its own collective
        assert work.get_future().wait() == [x]  # one work for them all, its value the whole tensor
    return x, comm.take_traffic().cross_node_bytes


@pytest.mark.parametrize("async_op", [False, True], ids=["blocking", "async"])
def test_gloo_all_reduce_in_pieces_sums_the_whole_tensor_and_counts_it_once(ranks, async_op):
    numel = 25  # pieces of 6 values: the last one shorter
    results = ranks.run(all_reduce_in_pieces, numel, async_op)
    for out, sent in results:
        assert torch.equal(out, data(numel).sum(0))
        assert sent == 2 * (WORLD - 1) / WORLD * numel * 4  # the ring's bytes for the whole tensor
