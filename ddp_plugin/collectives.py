"""The collectives plugins use, with traffic accounting, and the torch-version differences in one place.

Each wrapper issues the torch.distributed collective and records what this rank sends and to whom, from the
algorithm the backend runs: a ring all-reduce sends 2(n-1)/n of the tensor to the next rank of the group, a
ring all-gather (n-1) input-sized chunks to the next rank, an all-to-all each chunk straight to its owner.
Whether a send stays inside a node or crosses to another follows from the two ranks' nodes. Plugins that
use these wrappers are counted by :class:`TrafficLedger`; collectives issued directly through
torch.distributed are not.

torch 2.13 renamed ``reduce_scatter_tensor``/``all_gather_into_tensor`` to ``reduce_scatter_single``/
``all_gather_single`` (the old names remain as deprecated aliases); the wrappers take whichever exists.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import torch
import torch.distributed as dist

_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


@dataclass
class Traffic:
    """Bytes this rank handed to the network, split by whether the receiver is on its node."""

    intra_node_bytes: int = 0
    cross_node_bytes: int = 0


class TrafficLedger:
    """Process-wide tally of the bytes the wrappers below send. ``ranks_per_node`` decides what crosses nodes
    (set by the strategy from its topology); ``take()`` returns the tally since the last call and resets it."""

    def __init__(self) -> None:
        self.ranks_per_node = 1
        self._traffic = Traffic()
        self._lock = threading.Lock()  # the communication thread and the training thread both record
        self._local = threading.local()

    def record(self, group: dist.ProcessGroup | None, sends: list[tuple[int, float]]) -> None:
        """``sends``: (destination rank within ``group``, bytes) pairs for this rank."""
        me = dist.get_rank() // self.ranks_per_node
        intra = cross = 0.0
        for dst, nbytes in sends:
            if dist.get_global_rank(group, dst) // self.ranks_per_node == me:
                intra += nbytes
            else:
                cross += nbytes
        with self._lock:
            self._traffic.intra_node_bytes += int(intra)
            self._traffic.cross_node_bytes += int(cross)
        self._local.sent = self.sent_by_this_thread() + int(intra + cross)

    def sent_by_this_thread(self) -> int:
        """Bytes recorded so far by the calling thread: the difference around a call is what that call sent."""
        return getattr(self._local, "sent", 0)

    def take(self) -> Traffic:
        with self._lock:
            traffic, self._traffic = self._traffic, Traffic()
        return traffic


ledger = TrafficLedger()


def _group(group: dist.ProcessGroup | None) -> dist.ProcessGroup:
    return group if group is not None else dist.group.WORLD


def _next_in_ring(group: dist.ProcessGroup) -> int:
    return (dist.get_rank(group) + 1) % dist.get_world_size(group)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def all_reduce(tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
    """Ring all-reduce: 2(n-1)/n of ``tensor`` to the next rank (reduce-scatter, then all-gather)."""
    group = _group(group)
    n = dist.get_world_size(group)
    if n > 1:
        ledger.record(group, [(_next_in_ring(group), 2 * (n - 1) / n * _nbytes(tensor))])
    return dist.all_reduce(tensor, op=op, group=group, async_op=async_op)


def reduce_scatter_single(output, input, op=dist.ReduceOp.SUM, group=None, async_op=False):  # noqa: A002
    """``output`` (numel = input.numel() / group size) receives this rank's chunk of the reduction of ``input``.

    NCCL runs a ring reduce-scatter, (n-1)/n of ``input`` to the next rank. gloo emulates it with a full
    all-reduce (2(n-1)/n): prefer :func:`all_to_all_single` plus a local sum there."""
    group = _group(group)
    n = dist.get_world_size(group)
    if n > 1:
        share = (n - 1) / n if dist.get_backend(group) == "nccl" else 2 * (n - 1) / n
        ledger.record(group, [(_next_in_ring(group), share * _nbytes(input))])
    return _reduce_scatter_single(output, input, op=op, group=group, async_op=async_op)


def all_gather_single(output, input, group=None, async_op=False):  # noqa: A002
    """``output`` receives every rank's ``input`` in rank order; ring: n-1 chunks to the next rank."""
    group = _group(group)
    n = dist.get_world_size(group)
    if n > 1:
        ledger.record(group, [(_next_in_ring(group), (n - 1) * _nbytes(input))])
    return _all_gather_single(output, input, group=group, async_op=async_op)


def all_to_all_single(output, input, group=None, async_op=False):  # noqa: A002
    """Equal splits: chunk j of ``input`` goes to rank j, which stores it as chunk ``rank`` of its ``output``."""
    group = _group(group)
    n = dist.get_world_size(group)
    if n > 1:
        me = dist.get_rank(group)
        chunk = _nbytes(input) / n
        ledger.record(group, [(dst, chunk) for dst in range(n) if dst != me])
    return dist.all_to_all_single(output, input, group=group, async_op=async_op)
