"""Where a sync mode reads and writes this rank's part of the parameters: the pieces of each fragment it keeps a
global copy of, and the two views of the parameters (the module's own at ZeRO stage 0, the sharder's shards at
stages 1-3)."""

from __future__ import annotations

import concurrent.futures
import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn

from ddp_plugin.hookspecs import local_tensor

if TYPE_CHECKING:
    from ddp_plugin.hookspecs import Bucket, Communicator, ParameterShards, Topology


@dataclasses.dataclass(eq=False)
class Piece:
    """The part of fragment ``fragment`` in bucket ``bucket`` that this rank synchronizes: elements
    ``[lo, hi)`` of the bucket's flat parameters."""

    fragment: int
    bucket: int
    lo: int
    hi: int
    outer: nn.Parameter  # the global copy of elements [own_lo, own_hi)
    pseudo: Bucket  # what the codec sees: the bucket's layout, kind "pseudo_gradient", its own index
    own_lo: int  # the elements whose global copy (and outer optimizer state) this rank keeps: [lo, hi) itself,
    own_hi: int  # or with the outer state sharded over the nodes, this node's 1/n of it
    width: int  # with the outer state sharded, each node's share of [lo, hi) (the last one padded to it)


@dataclasses.dataclass
class InFlight:
    """A fragment sent and not applied yet: its snapshot ``s`` per piece and the future of its updates (the
    outer thread's ``(updates, drift)``)."""

    fragment: int
    apply_after: int
    snapshots: list[Tensor]
    result: concurrent.futures.Future
    written: bool = False
    """Whether its updates are the global copy itself, written over the replica's part even with staleness (a sync
    applied in the step that sent it: with fault tolerance, one a member heals in)."""


@dataclasses.dataclass
class Update:
    """Elements ``[lo, hi)`` of bucket ``bucket``'s flat parameters: ``values`` to write, or to add."""

    bucket: int
    lo: int
    hi: int
    values: Tensor


class ModuleChunks:
    """The parameter parts of ZeRO stage 0, where the module's parameters are whole on every rank: the ranks of a
    node split each bucket's flat parameters into k chunks (local rank l owns chunk l), read from and written to
    the module; :meth:`publish` broadcasts ranges of them inside the node."""

    def __init__(self, buckets: Sequence[Bucket], topology: Topology, comm: Communicator) -> None:
        self.buckets, self.topology, self.comm = list(buckets), topology, comm
        k, l = topology.ranks_per_node, topology.local_rank
        self.chunk = [-(-b.numel // k) for b in self.buckets]
        self.parts = [(l * c, min((l + 1) * c, b.numel)) for b, c in zip(self.buckets, self.chunk)]

    def _slices(self, b: int, lo: int, hi: int):
        bucket = self.buckets[b]
        for i, p in enumerate(bucket.params):
            p = local_tensor(p)  # (a tensor-parallel parameter's local shard)
            a, z = max(lo, bucket.offsets[i]), min(hi, bucket.offsets[i] + p.numel())
            if a < z:
                yield p, a - bucket.offsets[i], z - bucket.offsets[i], a - lo

    def read(self, b: int, lo: int, hi: int, out: Tensor | None = None) -> Tensor:
        if out is None:
            out = torch.zeros(hi - lo, dtype=self.buckets[b].buffer.dtype, device=self.topology.device)
        else:
            out.zero_()
        for p, a, z, at in self._slices(b, lo, hi):
            out[at : at + z - a].copy_(p.detach().reshape(-1)[a:z])
        return out

    def write(self, b: int, lo: int, hi: int, values: Tensor) -> None:
        with torch.no_grad():
            for p, a, z, at in self._slices(b, lo, hi):
                p.view(-1)[a:z].copy_(values[at : at + z - a])

    def add(self, b: int, lo: int, hi: int, values: Tensor) -> None:
        with torch.no_grad():
            for p, a, z, at in self._slices(b, lo, hi):
                p.view(-1)[a:z].add_(values[at : at + z - a])

    def _spans(self, b: int, lo: int, hi: int) -> list[tuple[int, int]]:
        """Each local rank's part of ``[lo, hi)`` in bucket ``b`` (its chunk's intersection; empty ones at lo)."""
        c = self.chunk[b]
        return [(max(lo, l * c), max(max(lo, l * c), min(hi, (l + 1) * c))) for l in range(self.topology.ranks_per_node)]

    def publish(self, ranges: Sequence[tuple[int, int, int]]) -> None:
        """Every rank of the node gets the elements ``[lo, hi)`` of bucket ``b`` (for each ``(b, lo, hi)``) from
        the ranks whose chunks hold them (on the training thread's side group): each rank's part broadcast from
        its parameters straight into the others', one parameter's slice at a time, so no buffer of a range's
        size is allocated (a DiLoCo sync publishes whole buckets)."""
        t = self.topology
        if t.ranks_per_node == 1:
            return
        for b, lo, hi in ranges:
            for l, (a, z) in enumerate(self._spans(b, lo, hi)):
                for p, pa, pz, _ in self._slices(b, a, z):
                    self.comm.broadcast(p.detach().view(-1)[pa:pz], src=l, group=t.side_intra_node_group)


class ShardParts:
    """The parameter parts of ZeRO stages 1-3 at node scope: the sharder's shards, written in place."""

    def __init__(self, shards: ParameterShards) -> None:
        self.shards = shards
        self.parts = [(offset, offset + part.numel()) for _, offset, part in shards.parts]

    def read(self, b: int, lo: int, hi: int, out: Tensor | None = None) -> Tensor:
        _, offset, part = self.shards.parts[b]
        if out is None:
            return part[lo - offset : hi - offset].clone()
        return out.copy_(part[lo - offset : hi - offset])

    def write(self, b: int, lo: int, hi: int, values: Tensor) -> None:
        _, offset, part = self.shards.parts[b]
        part[lo - offset : hi - offset].copy_(values)

    def add(self, b: int, lo: int, hi: int, values: Tensor) -> None:
        _, offset, part = self.shards.parts[b]
        part[lo - offset : hi - offset].add_(values)

    def publish(self, ranges: Sequence[tuple[int, int, int]]) -> None:
        self.shards.publish()
