"""The global copy and the outer optimizer's state sharded over the nodes (a sync mode with the plain mean across
nodes, :attr:`OuterSync.sharded_outer <ddp_plugin.sync.plugin.OuterSync.sharded_outer>`): each rank keeps 1/N of
its part's global copy and outer state instead of 1/k. The nodes' replicas are reduce-scattered over the nodes
into each rank's share, the outer step runs on the share, and the stepped shares travel back (broadcasts, or an
all-gather): the bytes of the all-reduce they replace."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import Tensor

from ddp_plugin.sync.parts import Update

if TYPE_CHECKING:
    from ddp_plugin.hookspecs import Communicator, Topology
    from ddp_plugin.sync.parts import ModuleChunks, Piece, ShardParts


class NodeShards:
    """A sync mode's pieces, sharded over the nodes: ``topology``'s, read and written through ``access`` (the
    module's chunks or the sharder's shards), reduced and gathered over ``inter`` (this rank's peers on the other
    nodes) and ``intra`` (its node's ranks), the sync mode's own groups."""

    def __init__(self, topology: Topology, comm: Communicator, access: ShardParts | ModuleChunks,
                 inter: dist.ProcessGroup | None, intra: dist.ProcessGroup | None) -> None:
        self.topology, self.comm, self.access = topology, comm, access
        self.inter, self.intra = inter, intra

    def read_padded(self, piece: Piece) -> Tensor:
        """The replica's values of the piece, padded to n shares of ``width`` (zeros past its end)."""
        buf = torch.empty(piece.width * self.topology.num_nodes, dtype=piece.outer.dtype, device=self.topology.device)
        self.read_into(piece.bucket, piece.lo, piece.hi, buf)
        return buf

    def outer_gradient(self, piece: Piece, window: int) -> Tensor:
        """The outer gradient of this rank's share of the piece, ``x - mean(s)``: the nodes' replicas of the piece
        reduce-scattered over the nodes ``window`` elements of a share at a time (the n shares' windows together:
        the same sums as the whole part's, element by element), in a buffer of the share's size."""
        n, device = self.topology.num_nodes, self.topology.device
        share = torch.empty(piece.width, dtype=piece.outer.dtype, device=device)
        buf = torch.empty(n * min(window, piece.width), dtype=share.dtype, device=device)
        for q, size, spans in self.windows(piece, window):
            win = buf[: n * size]
            for j, (a, z) in enumerate(spans):
                self.read_into(piece.bucket, a, z, win[j * size : (j + 1) * size])
            self.comm.reduce_scatter(share[q : q + size], win, group=self.inter)
        return self._gradient(piece, share)

    def _gradient(self, piece: Piece, share: Tensor) -> Tensor:
        """This rank's share of the replicas' sum over the nodes (``share``, reduce-scattered over them) turned, in
        its own memory, into the outer gradient of the share: ``x - mean(s)``."""
        g = share[: piece.own_hi - piece.own_lo].div_(self.topology.num_nodes)
        return torch.sub(piece.outer.detach(), g, out=g)

    def windows(self, piece: Piece, window: int) -> Iterator[tuple[int, int, list[tuple[int, int]]]]:
        """The piece's part in windows: for each offset ``q`` into the n shares, ``(q, size, spans)`` with
        ``spans[j] = (a, z)``, the replica's elements ``[a, z)`` of share j's window (empty past the part's end)."""
        n, w = self.topology.num_nodes, piece.width
        for q in range(0, w, window):
            size = min(window, w - q)
            spans = [(min(piece.lo + j * w + q, piece.hi), min(piece.lo + j * w + q + size, piece.hi))
                     for j in range(n)]
            yield q, size, spans

    def read_into(self, b: int, a: int, z: int, out: Tensor) -> None:
        """The replica's elements ``[a, z)`` of bucket ``b`` into ``out``, zeros past them."""
        if z > a:
            self.access.read(b, a, z, out=out[: z - a])
        out[max(z - a, 0) :].zero_()

    def take_global_copy(self, piece: Piece, window: int) -> Tensor:
        """The stepped global copy of the piece into this rank's replica, window by window from the nodes that keep
        its shares (broadcasts: the bytes of an all-gather); the squared norm of the replica's distance to it."""
        t = self.topology
        own = piece.own_hi - piece.own_lo
        drift = torch.zeros((), dtype=torch.float64, device=t.device)
        recv = torch.empty(min(window, piece.width), dtype=piece.outer.dtype, device=t.device)
        now = torch.empty_like(recv)
        for q, size, spans in self.windows(piece, window):
            for j, (a, z) in enumerate(spans):
                if j == t.node_rank:
                    mine = max(0, min(size, own - q))
                    recv[:mine].copy_(piece.outer.detach()[q : q + mine])
                    recv[mine:size].zero_()
                self.comm.broadcast(recv[:size], src=j, group=self.inter)
                if z > a:
                    self.access.read(piece.bucket, a, z, out=now[: z - a])
                    drift += torch.linalg.vector_norm(now[: z - a].sub_(recv[: z - a]),
                                                      dtype=torch.float32).double().square()
                    self.access.write(piece.bucket, a, z, recv[: z - a])
        return drift

    def outer_step(self, pieces: list[Piece], padded: list[Tensor], shares: list[Tensor], gathered: list[Tensor],
                   step: Callable[[list[Piece], list[Tensor]], None]) -> tuple[list[Update], float]:
        """A sync's outer step with staleness (on the outer thread; ``step``: the outer optimizer's step of the
        pieces with the given gradients): each piece's snapshot reduce-scattered over the nodes, the outer step on this rank's
        share (``x - mean(s)`` as its gradient), and the stepped global copy's shares all-gathered back (as many
        bytes again: those of the all-reduce it replaces, with 1/n of the state), less the snapshot. The drift is
        the norm of that update: the node's distance to the new global copy (its pseudo-gradient would need the
        old copy of the whole piece, which no rank keeps)."""
        t = self.topology
        for s, share in zip(padded, shares):
            self.comm.reduce_scatter(share, s, group=self.inter)
        step(pieces, [self._gradient(p, share) for p, share in zip(pieces, shares)])
        drift = torch.zeros((), dtype=torch.float64, device=t.device)
        updates = []
        for piece, s, full in zip(pieces, padded, gathered):
            values = self.gathered(piece, out=full).sub_(s)[: piece.hi - piece.lo]
            drift += torch.linalg.vector_norm(values, dtype=torch.float32).double().square()
            updates.append(Update(piece.bucket, piece.lo, piece.hi, values))
        if t.ranks_per_node > 1:
            self.comm.all_reduce(drift, group=self.intra)
        return updates, float(drift.sqrt())

    def gathered(self, piece: Piece, values: Tensor | None = None, out: Tensor | None = None) -> Tensor:
        """``values`` (default: the piece's global copy) of this rank's share of the piece, all-gathered over the
        nodes into a buffer of the piece's padded size (``out``, or a new one): the whole piece's values."""
        values = piece.outer.detach() if values is None else values
        n, me = self.topology.num_nodes, self.topology.node_rank
        full = torch.empty(piece.width * n, dtype=values.dtype, device=self.topology.device) if out is None else out
        share = full[me * piece.width : (me + 1) * piece.width]
        share[: values.numel()].copy_(values)
        share[values.numel() :].zero_()
        self.comm.all_gather(full, share, group=self.inter)
        return full
