"""Flat shards: every gradient bucket's parameters as one flat tensor, cut into P equal shards (the engine pads
buckets to a multiple of the world size), this rank's shard, and the 1-D pieces of it the optimizer steps.

Every module parameter of a bucket becomes a view into the bucket's flat parameter tensor ``full``; ``shard`` is
this rank's part of it (a view, or at stage 3, where ``full``'s memory is released between uses, a tensor of its
own). A parameter cut by a shard boundary becomes two pieces on two ranks."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

from ddp_plugin.hookspecs import local_tensor, set_local_data
from ddp_plugin.runtime.storage import unallocated
from ddp_plugin.zero.layout import Scope

if TYPE_CHECKING:
    from collections.abc import Callable, Collection, Sequence

    from ddp_plugin.hookspecs import Bucket, Communicator
    from ddp_plugin.zero.layout import ShardLayout


@dataclass(eq=False)
class Piece:
    """A 1-D piece of one parameter inside this rank's shard."""

    param: nn.Parameter
    """The piece itself, a parameter the optimizer steps (a view of the shard)."""
    index: int
    """Index of the whole parameter in its bucket."""
    start: int
    """Element of the flattened whole parameter where the piece starts."""
    at: int
    """Element of the shard where the piece starts."""


@dataclass(eq=False)
class FlatShard:
    """One bucket's share on this rank."""

    full: Tensor
    shard: Tensor
    grad: Tensor | None = None
    """The reduced gradient of ``shard`` (stage 1: a slice of the bucket, which holds the whole mean)."""
    pieces: list[Piece] = field(default_factory=list)


class Shards:
    """The flat shards of every bucket, and the all-gathers that rebuild ``full`` from them."""

    def __init__(self, buckets: Sequence[Bucket], layout: ShardLayout, comm: Communicator,
                 release_gradients: bool = False, release_parameters: Collection[int] = (),
                 initialize: Callable[[Sequence[nn.Parameter]], bool | None] | None = None,
                 keep_shard: Callable[[int, Tensor], Tensor] | None = None) -> None:
        """Move every bucket's parameters into its flat tensor. Memory is given back bucket by bucket, so this
        never holds much more than the model once: with ``release_gradients`` (stages 2, 3) the bucket's
        gradient buffer until backward needs it, and for the bucket indices in ``release_parameters`` (stage 3
        units) the full parameters until forward does (the shard is then a tensor of its own).

        Parameters without memory yet (a model built on the meta device, ``materialize.unallocated``) get it here,
        in the flat tensor, and ``initialize`` (the hook ``on_initialize_parameters``) gives them their values, one bucket at
        a time: a unit is whole only until its shard is taken. ``keep_shard(b, shard)`` returns the tensor that
        keeps a released unit's shard (default: a copy in memory; offload: a copy in a file)."""
        self.buckets = list(buckets)
        self.layout = layout
        self.comm = comm
        self.entries: list[FlatShard] = []
        p_count, idx = layout.num_shards, layout.shard_index
        for bucket in self.buckets:
            if bucket.numel % p_count:
                raise RuntimeError(f"bucket {bucket.index} holds {bucket.numel} elements, not a multiple of {p_count}")
            c = bucket.numel // p_count
            full = torch.zeros_like(bucket.buffer)
            fresh = []
            for i, p in enumerate(bucket.params):
                local = local_tensor(p)  # (a tensor-parallel parameter's local shard)
                view = full[bucket.offsets[i] : bucket.offsets[i] + local.numel()].view_as(local)
                if unallocated(local):
                    fresh.append(p)
                else:
                    view.copy_(local.detach())
                set_local_data(p, view)
            if fresh and not (initialize is not None and initialize(fresh)):
                raise RuntimeError(
                    f"ZeRO stage 3: {len(fresh)} parameters of bucket {bucket.index} ({bucket.names[0]}, ...) have no"
                    " values yet (a model built on the meta device) and no plugin answers `on_initialize_parameters`."
                )
            lo = idx * c
            entry = FlatShard(full=full, shard=full[lo : lo + c])
            for i, p in enumerate(bucket.params):
                start, stop = max(bucket.offsets[i], lo), min(bucket.offsets[i] + local_tensor(p).numel(), lo + c)
                if start < stop:
                    entry.pieces.append(Piece(None, i, start - bucket.offsets[i], start - lo))  # type: ignore[arg-type]
            self.entries.append(entry)
            if release_gradients:
                bucket.release()
            if bucket.index in release_parameters:
                entry.shard = entry.shard.clone() if keep_shard is None else keep_shard(bucket.index, entry.shard)
                full.untyped_storage().resize_(0)

    def make_pieces(self) -> dict[int, list[nn.Parameter]]:
        """Create the pieces (1-D views of the shards, as they are now) and return ``id(parameter)`` -> its pieces
        on this rank, for every parameter of every bucket (empty where none of it is this rank's: the optimizer
        must not step such a parameter itself)."""
        pieces_of: dict[int, list[nn.Parameter]] = {id(p): [] for bucket in self.buckets for p in bucket.params}
        for bucket, entry in zip(self.buckets, self.entries):
            for piece in entry.pieces:
                n = min(local_tensor(bucket.params[piece.index]).numel() - piece.start, entry.shard.numel() - piece.at)
                piece.param = nn.Parameter(entry.shard[piece.at : piece.at + n], requires_grad=True)
                pieces_of[id(bucket.params[piece.index])].append(piece.param)
        return pieces_of

    def piece_starts(self) -> dict[int, int]:
        """``id(piece)`` -> the element of its parameter (flattened) where this rank's piece starts."""
        return {id(piece.param): piece.start for entry in self.entries for piece in entry.pieces}

    def gathered_bytes(self) -> int:
        """Bytes of flat parameters that hold memory now (stage 3 frees units' between uses)."""
        return sum(e.full.untyped_storage().nbytes() for e in self.entries)

    # ------------------------------------------------------------------ all-gather

    def gather(self, full: Tensor, shard: Tensor, async_op: bool = False) -> Any:
        """Gather every rank's ``shard`` into ``full`` (``shard`` must not alias ``full``), on the side groups
        (the training thread's). With ``async_op``, returns what :meth:`finish_gather` waits for."""
        t, comm = self.layout.topology, self.comm
        if self.layout.scope is Scope.NODE:
            if t.ranks_per_node == 1:
                full.copy_(shard)
                return None
            return (comm.all_gather(full, shard, group=t.side_intra_node_group, async_op=async_op), None)
        if self.layout.scope is Scope.WORLD:
            return (comm.all_gather(full, shard, group=t.side_world_group, async_op=async_op), None)
        # Two levels: this rank's node-peers' shards across nodes first (the block of local rank l), then the
        # blocks inside the node.
        block = full.new_empty(full.numel() // t.ranks_per_node)
        work = comm.all_gather(block, shard, group=t.side_inter_node_group, async_op=async_op)
        if not async_op:
            comm.all_gather(full, block, group=t.side_intra_node_group)
            return None
        return (work, block)

    def finish_gather(self, full: Tensor, pending: Any) -> None:
        if pending is None:
            return
        work, block = pending
        if work is not None:
            work.wait()
        if block is not None:
            self.comm.all_gather(full, block, group=self.layout.topology.side_intra_node_group)
