"""Collectives that differ across torch releases or backends, in one place.

torch 2.13 renamed ``reduce_scatter_tensor``/``all_gather_into_tensor`` to ``reduce_scatter_single``/
``all_gather_single`` (the old names remain as deprecated aliases); these wrappers take whichever exists.
"""

from __future__ import annotations

import torch.distributed as dist

_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def reduce_scatter_single(output, input, op=dist.ReduceOp.SUM, group=None, async_op=False):  # noqa: A002
    """``output`` (numel = input.numel() / group size) receives this rank's chunk of the reduction of ``input``."""
    return _reduce_scatter_single(output, input, op=op, group=group, async_op=async_op)


def all_gather_single(output, input, group=None, async_op=False):  # noqa: A002
    """``output`` receives the concatenation of every rank's ``input``, in rank order."""
    return _all_gather_single(output, input, group=group, async_op=async_op)
