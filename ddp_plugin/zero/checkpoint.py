"""Checkpoints of a sharded model in two layouts: consolidated (what an unsharded model and optimizer would
save, gathered to global rank 0, so any world size, stage or plain Lightning resumes from it) and local (this
rank's part only, for ``checkpoint="sharded"``)."""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from ddp_plugin.runtime.comm import gather_flat_to_root
from ddp_plugin.hookspecs import (
    DeferredStorage,
    DeferredTensor,
    as_parameter_layout,
    block_key,
    local_part_of_whole,
    local_tensor,
    tensor_parallel_blocks,
)

if TYPE_CHECKING:
    from torch.optim import Optimizer

    from ddp_plugin.zero.optimizer import ShardedOptimizers
    from ddp_plugin.zero.shards import Shards
    from ddp_plugin.zero.units import Units

def _local_entry(shards: Shards, optimizer: Optimizer, b: int, k: str) -> Tensor:
    """This rank's shard of optimizer state entry ``k`` of bucket ``b``, flat (zeros where it has no piece)."""
    entry = shards.entries[b]
    buf = torch.zeros_like(entry.shard)
    for piece in entry.pieces:
        v = optimizer.state.get(piece.param, {}).get(k)
        if v is not None:
            buf[piece.at : piece.at + piece.param.numel()].copy_(v.reshape(-1))
    return buf


def _gather_state_entry(shards: Shards, optimizer: Optimizer, b: int, k: str) -> Tensor | None:
    """Optimizer state entry ``k`` of bucket ``b``, flat and whole, on global rank 0 (None elsewhere): the
    producer of a deferred checkpoint tensor."""
    group, index_of = shards.layout.shard_group()
    return gather_flat_to_root(_local_entry(shards, optimizer, b, k), group, index_of)


def _state_layout(shards: Shards, optimizer: Optimizer) -> dict[tuple[int, int], dict[str, Any]]:
    """What exists where, from every rank of the shard group (one object all-gather): per (bucket, parameter
    index), each state entry, ``"flat"`` for a sharded tensor and the value itself otherwise (e.g. Adam's step)."""
    group, _ = shards.layout.shard_group()
    local: dict[tuple[int, int], dict[str, Any]] = {}
    for b, entry in enumerate(shards.entries):
        for piece in entry.pieces:
            st = optimizer.state.get(piece.param)
            if st:
                local[(b, piece.index)] = {
                    k: ("flat" if isinstance(v, Tensor) and v.dim() > 0 and v.numel() == piece.param.numel() else v)
                    for k, v in st.items()
                }
    everyone: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, local, group=group)
    meta: dict[tuple[int, int], dict[str, Any]] = {}
    for part in everyone:
        for key, entries in part.items():
            meta.setdefault(key, {}).update(entries)
    return meta


def _unsharded_state(shards: Shards, optimizers: ShardedOptimizers, optimizer: Optimizer,
                     meta: dict[tuple[int, int], dict[str, Any]],
                     flat_entry: Any) -> dict[str, Any]:
    """``{"state", "param_groups"}`` in the unsharded optimizer's numbering: a sharded parameter's entries from
    ``meta``, each ``"flat"`` one as ``flat_entry(b, i, k)`` (called bucket by bucket, entry by entry, the same
    order on every rank); a parameter that is not sharded keeps its own state (the same on every rank)."""
    full_state: dict[tuple[int, int], dict[str, Any]] = {key: {} for key in meta}
    for b in range(len(shards.buckets)):
        for k in sorted({k for (bb, _), e in meta.items() if bb == b for k, v in e.items() if v == "flat"}):
            for (bb, i), e in meta.items():
                if bb == b and e.get(k) == "flat":
                    full_state[(b, i)][k] = flat_entry(b, i, k)
        for (bb, i), e in meta.items():
            if bb == b:
                full_state[(b, i)].update({k: v for k, v in e.items() if v != "flat"})
    where = {id(p): (b, i) for b, bucket in enumerate(shards.buckets) for i, p in enumerate(bucket.params)}
    state: dict[int, dict[str, Any]] = {}
    numbered, groups = optimizers.unsharded_numbering(optimizer)
    for index, p in numbered:
        if id(p) in where:
            if full_state.get(where[id(p)]):
                state[index] = full_state[where[id(p)]]
        elif optimizer.state.get(p):
            state[index] = optimizer.state[p]  # not sharded: the same on every rank
    return {"state": state, "param_groups": groups}


def consolidated_optimizer_state(shards: Shards, optimizers: ShardedOptimizers, optimizer: Optimizer
                                 ) -> dict[str, Any]:
    """The sharded optimizer state in the layout the unsharded optimizer would have (``{"state": {index:
    {...}}, "param_groups": [...]}``, parameters numbered across groups in order), for global rank 0. The
    sharded entries are :class:`DeferredTensor`\\ s, gathered one bucket and one entry at a time while rank 0
    writes the file; every rank whose shards rank 0 needs returns the same structure (its producers send), the
    ranks of other nodes (node scope) return ``{}`` at once."""
    group, _ = shards.layout.shard_group()
    if dist.get_global_rank(group, 0) != 0:
        return {}  # a node other than rank 0's (node scope): nothing of it is written, nothing to gather
    storages: dict[tuple[int, str], DeferredStorage] = {}

    def deferred(b: int, i: int, k: str) -> DeferredTensor:
        # Deferred: gathered when the checkpoint is written, one bucket's entry at a time, so rank 0 holds one
        # bucket of optimizer state beside what it writes, not the whole state.
        if (b, k) not in storages:
            entry = shards.entries[b]
            storages[(b, k)] = DeferredStorage(
                dtype=entry.shard.dtype, numel=entry.shard.numel() * shards.layout.num_shards,
                device=str(entry.shard.device), produce=functools.partial(_gather_state_entry, shards, optimizer, b, k),
            )
        bucket = shards.buckets[b]
        return DeferredTensor(storages[(b, k)], bucket.offsets[i], tuple(bucket.params[i].shape))

    return _unsharded_state(shards, optimizers, optimizer, _state_layout(shards, optimizer), deferred)


def gathered_optimizer_state(shards: Shards, optimizers: ShardedOptimizers, optimizer: Optimizer
                             ) -> dict[str, Any]:
    """The sharded optimizer state in the unsharded optimizer's layout, as :func:`consolidated_optimizer_state`,
    but whole on every rank (one all-gather per bucket and state entry) and with the entries of a tensor-parallel
    parameter as DTensors of its mesh and placements: with tensor parallelism each tensor-parallel position's
    data-parallel ranks hold other shards, which the strategy then makes whole over the tensor-parallel group.
    Collective."""
    gathered: dict[tuple[int, str], Tensor] = {}

    def whole(b: int, i: int, k: str) -> Tensor:
        bucket = shards.buckets[b]
        if (b, k) not in gathered:
            buf = _local_entry(shards, optimizer, b, k)
            gathered[(b, k)] = buf.new_empty(bucket.numel)
            shards.gather(gathered[(b, k)], buf)
        p = bucket.params[i]
        shape = local_tensor(p).shape
        value = gathered[(b, k)][bucket.offsets[i] : bucket.offsets[i] + shape.numel()].view(shape)
        return as_parameter_layout(value, p)

    return _unsharded_state(shards, optimizers, optimizer, _state_layout(shards, optimizer), whole)


def load_consolidated_optimizer_state(shards: Shards, optimizers: ShardedOptimizers, optimizer: Optimizer,
                                      state_dict: Mapping[str, Any]) -> None:
    """Take this rank's pieces of an unsharded optimizer state dict (any world size, stage or scope wrote it)."""
    originals = optimizers.original_groups[id(optimizer)]
    saved_groups = state_dict.get("param_groups", [])
    if [len(g["params"]) for g in saved_groups] != [len(ps) for ps in originals]:
        raise ValueError(
            "The checkpoint's optimizer state does not fit this model's optimizer: it has parameter groups of"
            f" {[len(g['params']) for g in saved_groups]} parameters, the optimizer of"
            f" {[len(ps) for ps in originals]}. Was it saved from another model or `configure_optimizers`?"
        )
    starts = shards.piece_starts()
    saved_state = state_dict.get("state", {})
    optimizer.state.clear()
    for group_dict, params, saved in zip(optimizer.param_groups, originals, saved_groups):
        group_dict.update({k: v for k, v in saved.items() if k != "params"})
        for p, index in zip(params, saved["params"]):
            st = saved_state.get(index)
            if not st:
                continue
            for k, v in st.items():
                if isinstance(v, Tensor) and v.dim() > 0 and v.shape != p.shape:
                    raise ValueError(
                        f"The checkpoint's optimizer state `{k}` has shape {tuple(v.shape)} for a parameter of"
                        f" shape {tuple(p.shape)}: it was saved from another model."
                    )
            pieces = optimizers.pieces_of.get(id(p))
            if pieces is None:
                optimizer.state[p] = {k: (v.to(p.device) if isinstance(v, Tensor) else v) for k, v in st.items()}
                continue
            # A tensor-parallel parameter's pieces are slices of this rank's local part of each entry.
            st = {k: (local_part_of_whole(v, p) if isinstance(v, Tensor) and v.dim() > 0 else v)
                  for k, v in st.items()}
            for piece in pieces:
                start = starts[id(piece)]
                optimizer.state[piece] = {
                    k: (v.detach().reshape(-1)[start : start + piece.numel()].to(piece.device, copy=True)
                        if isinstance(v, Tensor) and v.dim() > 0 else
                        (v.to(piece.device, copy=True) if isinstance(v, Tensor) else v))
                    for k, v in st.items()
                }


def consolidated_module_state(shards: Shards, units: Units | None, module: nn.Module) -> dict[str, Any]:
    """The module's full state dict on global rank 0 (at stage 3 gathered one unit at a time and copied, so
    rank 0 holds the full model plus one unit; at stages 1-2 the parameters themselves); ``{}`` elsewhere."""
    me = dist.get_rank()
    names: dict[int, list[str]] = {}
    for name, value in module.state_dict(keep_vars=True).items():
        names.setdefault(id(value), []).append(name)
    copies: dict[str, Tensor] = {}
    for bucket in shards.buckets:
        unit = units.of_bucket.get(bucket.index) if units is not None else None
        gathered_here = unit is not None and not unit.gathered
        if gathered_here:
            units.gather(unit)
        if me == 0:
            for p in bucket.params:
                # A unit gathered only for this is freed below: copy it. Otherwise the parameter is whole
                # and stays so while the checkpoint is written (no copy: ~S less on rank 0).
                value = p.detach().clone() if gathered_here else p.detach()
                for name in names.get(id(p), []):
                    copies[name] = value
        if gathered_here:
            units.free(unit)
    if me != 0:
        return {}
    return {name: copies.get(name, value.detach()) for name, value in module.state_dict(keep_vars=True).items()}


def local_module_state(shards: Shards, units: Units | None, module: nn.Module) -> dict[str, Any]:
    """This rank's part of the module state, for ``checkpoint="sharded"``: at stage 3 the pieces of the
    sharded parameters as ``<name>#<start>`` (the slice of the flattened parameter from element ``start``),
    everything else whole (every rank holds it; written once)."""
    whole = module.state_dict(keep_vars=True)
    out: dict[str, Tensor] = {}
    sharded: set[str] = set()
    if units is not None:
        names: dict[int, list[str]] = {}
        for name, value in whole.items():
            names.setdefault(id(value), []).append(name)
        for bucket, entry in zip(shards.buckets, shards.entries):
            unit = units.of_bucket.get(bucket.index)
            if unit is None or unit.persistent or unit.gathered:
                continue
            for p in bucket.params:  # freed here: only this rank's pieces (if any) are valid
                sharded.update(names.get(id(p), []))
            for piece in entry.pieces:
                p = bucket.params[piece.index]
                for name in names.get(id(p), []):  # a piece of this rank's tensor-parallel block, if split
                    out[f"{block_key(name, p)}#{piece.start}"] = piece.param.detach()
    out.update({name: value.detach() for name, value in whole.items() if name not in sharded})
    return out


def local_optimizer_state(shards: Shards, optimizers: ShardedOptimizers, optimizer: Optimizer) -> dict[str, Any]:
    """This rank's part of ``optimizer``'s state, for ``checkpoint="sharded"``: ``{"state": {flat key: value},
    "param_groups": [...], "shapes": {...}}`` with the parameters numbered as in an unsharded
    ``optimizer.state_dict()``; a sharded state tensor is ``<index>/<key>#<start>``, the rest ``<index>/<key>``."""
    starts = shards.piece_starts()
    sharded = {id(p) for bucket in shards.buckets for p in bucket.params}
    state: dict[str, Any] = {}
    shapes: dict[str, tuple[int, ...]] = {}
    numbered, groups = optimizers.unsharded_numbering(optimizer)
    for index, p in numbered:
        if id(p) in sharded:
            # Every sharded parameter's shape, on every rank: rank 0 writes the metadata, and it may hold no
            # piece of this parameter (its state is then in other ranks' files only). Split by tensor
            # parallelism, the pieces are of this rank's block: the shape of every rank's block too.
            shapes[f"{index}"] = tuple(p.shape)
            for dim, offset, shape in tensor_parallel_blocks(p) or ():
                shapes[f"{index}@{dim}:{offset}"] = shape
        pieces = optimizers.pieces_of.get(id(p))
        if pieces is None:
            if id(p) not in sharded:
                for k, v in optimizer.state.get(p, {}).items():
                    state[f"{index}/{k}"] = v
            continue
        for piece in pieces:
            for k, v in optimizer.state.get(piece, {}).items():
                if isinstance(v, Tensor) and v.dim() > 0 and v.numel() == piece.numel():
                    state[f"{block_key(f'{index}/{k}', p)}#{starts[id(piece)]}"] = v
                else:
                    state[f"{index}/{k}"] = v  # the same on every rank (e.g. Adam's step)
    return {"state": state, "param_groups": groups, "shapes": shapes}
