"""Whether a tensor has memory behind its shape: the engine, the ZeRO sharder and tensor parallelism each skip or
allocate what a ZeRO stage 3 unit or a meta-built module left without it."""

from __future__ import annotations

import torch

from ddp_plugin.hookspecs import local_tensor


def unallocated(t: torch.Tensor) -> bool:
    """Whether ``t`` (a DTensor's local shard) has a shape but no memory: a parameter left for a ZeRO stage 3
    sharder to allocate (:func:`~ddp_plugin.parallel.materialize.materialize`'s ``deferred``), or a stage 3
    unit's freed between uses."""
    local = local_tensor(t)
    return not local.is_meta and local.numel() > 0 and local.untyped_storage().nbytes() == 0
