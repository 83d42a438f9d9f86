"""Scaled-sign (1-bit) gradient compression with error feedback (Seide et al. 2014; Karimireddy et al. 2019),
as a ddp_plugin codec installed through the entry-point group ``ddp_plugin``.

Per bucket and step: x = gradient + residual; each block of ``block_size`` values is sent as its signs (packed
8 to a byte) and one scale, the block's mean magnitude, which is the scale that minimizes the squared error of
``scale * sign(x)``. Every rank all-gathers the signs and scales, decodes them in rank order and averages, so
all ranks hold the same bits. The residual x - scale * sign(x) is added to the next step's gradient.

Bytes per rank: (n-1) * (S/32 + 4 S / (4 block_size)) for a tensor of S bytes, against 2(n-1)/n * S for a
float32 all-reduce: 1/16 of it on two ranks. Because it all-gathers, it suits the small cross-node group.

It uses only the public contract, ``ddp_plugin.hookspecs``: its options arrive in ``on_setup(options=...)``,
its collectives go through the communicator handed there (so the strategy's traffic accounting counts them),
and its residuals, which differ from rank to rank, are returned by ``on_save_rank_state_dict``: the strategy
collects every rank's into the checkpoint and hands each rank its own back on resume (none on another world
size, where the residuals start from zero).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
from ddp_plugin.hookspecs import Communicator, Options, completed_future, hookimpl

__all__ = ["OneBitCodec", "codec"]

_BIT_WEIGHTS = 2 ** torch.arange(8, dtype=torch.uint8)


def pack_signs(x: torch.Tensor) -> torch.Tensor:
    """``x >= 0`` as bits, 8 to a uint8 (``x.numel()`` must be a multiple of 8)."""
    bits = (x >= 0).view(-1, 8).to(torch.uint8)
    return (bits * _BIT_WEIGHTS.to(x.device)).sum(dim=1, dtype=torch.uint8)


def unpack_signs(packed: torch.Tensor) -> torch.Tensor:
    """The inverse of :func:`pack_signs`: +1.0 / -1.0 for every packed bit."""
    bits = (packed.unsqueeze(-1) >> torch.arange(8, device=packed.device, dtype=torch.uint8)) & 1
    return bits.flatten(-2).float() * 2 - 1


class OneBitCodec:
    """The codec. One instance is registered per process (the entry point names the module-level ``codec``);
    ``on_setup`` reads the options and starts every fit with empty residuals."""

    name = "onebit"

    def __init__(self) -> None:
        self.block_size = 2048
        self.residuals: dict[str, torch.Tensor] = {}
        self.comm: Communicator | None = None

    @hookimpl
    def on_setup(self, options: Options, comm: Communicator) -> None:
        self.comm = comm
        opts = dict(options.compression_options)
        unknown = sorted(set(opts) - {"block_size"})
        if unknown:
            raise ValueError(
                f"`compression_options[{unknown[0]!r}]` is not an option of `compression='onebit'`; accepted"
                " options: 'block_size'."
            )
        block_size = opts.get("block_size", 2048)
        if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size <= 0:
            raise ValueError(
                f"`compression_options['block_size']={block_size!r}` is not valid for `compression='onebit'`;"
                " allowed values: a positive integer."
            )
        self.block_size = block_size
        self.residuals = {}

    @hookimpl
    def on_cross_node_reduce(self, tensor: torch.Tensor, group: dist.ProcessGroup, bucket) -> torch.futures.Future:
        # (`offset`, where the tensor sits in the bucket, is not needed: signs and scales need no parameter shapes.)
        n = dist.get_world_size(group)
        if n == 1:
            return completed_future(tensor)
        numel = tensor.numel()
        blocks = math.ceil(numel / self.block_size)
        width = 8 * math.ceil(math.ceil(numel / blocks) / 8)  # whole bytes per block
        x = tensor.new_zeros(blocks * width, dtype=torch.float32)
        x[:numel] = tensor
        key = f"{bucket.kind}/{bucket.index}"  # gradient buckets, or a sync mode's pseudo-gradients
        residual = self.residuals.get(key)
        if residual is not None and residual.numel() == numel:
            x[:numel] += residual.to(x.device)
        x = x.view(blocks, width)
        scales = x.abs().mean(dim=1)
        decoded = torch.where(x >= 0, scales[:, None], -scales[:, None])
        residual = (x - decoded).flatten()[:numel]
        # A non-finite gradient (a skipped fp16 step) must not stay in the residual forever.
        self.residuals[key] = residual if torch.isfinite(residual).all() else torch.zeros_like(residual)

        packed = pack_signs(x)
        all_packed = packed.new_empty(n * packed.numel())
        all_scales = scales.new_empty(n * blocks)
        works = [
            self.comm.all_gather(all_packed, packed, group=group, async_op=True),
            self.comm.all_gather(all_scales, scales, group=group, async_op=True),
        ]
        for work in works:
            work.wait()
        signs = unpack_signs(all_packed.view(n, blocks, width // 8))  # (n, blocks, width)
        mean = (signs * all_scales.view(n, blocks, 1)).sum(dim=0).div_(n)
        tensor.copy_(mean.flatten()[:numel])
        return completed_future(tensor)

    @hookimpl
    def on_save_rank_state_dict(self) -> dict[str, Any]:
        return {"codec/onebit": {i: r.detach().cpu() for i, r in self.residuals.items()}}

    @hookimpl
    def on_load_state_dict(self, rank_state: Mapping[str, Any] | None) -> None:
        if rank_state is None or "codec/onebit" not in rank_state:
            return  # saved by another number of ranks (or without this codec): start from zero
        self.residuals = dict(rank_state["codec/onebit"])


codec = OneBitCodec()
