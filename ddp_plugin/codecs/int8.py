"""Block-wise int8 quantization with two-sided error feedback: about a quarter of the float32 bytes."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar

import torch

from ddp_plugin.checks import check_bool, check_int
from ddp_plugin.codecs.base import BucketState, Codec
from ddp_plugin.hookspecs import completed_future

if TYPE_CHECKING:
    from torch import Tensor

INT8_MAX = 127


def quantize_int8(x: Tensor) -> tuple[Tensor, Tensor]:
    """Rows of ``x`` (one block each) to int8 with one float32 scale per row: ``q = round(x / s)``,
    ``s = max|row| / 127``; the rounding error is at most ``s / 2`` per value."""
    q, scales, _ = quantize_rows(x.float(), residual=False)
    return q, scales


def quantize_rows(x: Tensor, residual: bool) -> tuple[Tensor, Tensor, Tensor | None]:
    """:func:`quantize_int8` of the float32 rows ``x``, plus (``residual=True``) what rounding took,
    ``x - q * s``; ``None`` instead when a block holds a non-finite value, which makes its scale non-finite
    (see :func:`finite_or_zero`; checking the scales is one value per block, not one per value). One scratch
    buffer, rounded and then turned into the residual in place: the codec runs on every bucket of every
    step, and on the outer thread of every sync (measured on one core, 362k values with error feedback:
    1.5 ms a reduce against 3.4 ms with a fresh tensor per operation)."""
    scales = x.abs().amax(dim=1).div_(INT8_MAX)  # NaN and inf propagate
    # An all-zero block has scale 0; divide by the smallest normal float instead (q stays 0).
    tiny = torch.finfo(torch.float32).tiny
    y = torch.div(x, scales.clamp_min(tiny).unsqueeze(1)).round_().clamp_(-INT8_MAX, INT8_MAX)
    q = y.to(torch.int8)
    if not residual or not torch.isfinite(scales).all():
        return q, scales, None
    return q, scales, torch.addcmul(x, y, scales.unsqueeze(1), value=-1, out=y)


def dequantize_int8(q: Tensor, scales: Tensor, dtype: torch.dtype = torch.float32) -> Tensor:
    return q.to(dtype).mul_(scales.to(dtype).unsqueeze(-1))


def finite_or_zero(residual: Tensor) -> Tensor:
    """A non-finite gradient (an fp16 loss-scale overflow the optimizer will skip) must not poison every later
    step through the residual: drop the residual then. The non-finite values themselves still reach the
    output, so the overflow check after backward sees them."""
    if not torch.isfinite(residual).all():
        return torch.zeros_like(residual)
    return residual


class Int8State(BucketState):
    per_rank = ("residual", "chunk_residual")


class Int8Codec(Codec):
    """Block-wise int8 quantization, reduced in two shots (the traffic of an all-reduce, at a quarter of the
    bytes):

    1. each rank adds its residual, splits the tensor into n chunks of blocks of at most ``block_size`` values,
       quantizes every block with its own scale, and sends chunk j to rank j (all-to-all of int8 + scales);
    2. rank j dequantizes the n versions of its chunk, averages them in rank order, adds its second residual,
       quantizes the mean again, and all-gathers it (int8 + scales); every rank dequantizes the same bytes.

    Integers are never summed by a collective (they would overflow and carry no scale). Bytes per rank:
    2(n-1)/n * (S/4 + S/block_size) against 2(n-1)/n * S for float32 (S: bytes of the tensor).

    Error feedback on both quantizations (as DeepSpeed's compressed all-reduce): what rounding took from this
    rank's input (``residual``) and from this rank's chunk of the mean (``chunk_residual``) is added back the
    next step, so no gradient is lost for good, only delayed.

    Options: ``block_size`` (default 1024, values per scale; more values per scale, fewer scale bytes but
    coarser steps), ``error_feedback`` (default True).
    """

    name = "int8"
    defaults: ClassVar[dict[str, Any]] = {"block_size": 1024, "error_feedback": True}
    State = Int8State

    def __init__(self, **options: Any) -> None:
        super().__init__(**options)
        self.block_size = self.options["block_size"]
        self.error_feedback = self.options["error_feedback"]

    @classmethod
    def check_values(cls, options: dict[str, Any]) -> None:
        check_int("compression_options['block_size']", options["block_size"], minimum=1, context=cls.context())
        check_bool("compression_options['error_feedback']", options["error_feedback"], context=cls.context())

    @property
    def keeps_rank_state(self) -> bool:
        return self.error_feedback

    def layout(self, numel: int, n: int) -> tuple[int, int]:
        """(blocks per chunk, values per block): n equal chunks of equal blocks of at most ``block_size``,
        balanced so that padding stays below one value per block."""
        chunk = -(-numel // n)
        blocks = -(-chunk // self.block_size)
        return blocks, -(-chunk // blocks)

    def reduce(self, tensor, group, n, bucket, offset, state):
        numel = tensor.numel()
        blocks, width = self.layout(numel, n)
        x = torch.empty(n * blocks * width, dtype=torch.float32, device=tensor.device)
        if self.error_feedback and state.residual is not None:
            torch.add(tensor, state.residual, out=x[:numel])
        else:
            x[:numel].copy_(tensor)
        x[numel:].zero_()
        x = x.view(n * blocks, width)
        q, scales, residual = quantize_rows(x, residual=self.error_feedback)
        if self.error_feedback:
            state.residual = torch.zeros(numel, device=x.device) if residual is None else residual.view(-1)[:numel]

        # Shot 1: chunk j (blocks j*blocks ... ) to rank j.
        q_in, s_in = torch.empty_like(q), torch.empty_like(scales)
        works = [
            self.comm.all_to_all(q_in, q, group=group, async_op=True),
            self.comm.all_to_all(s_in, scales, group=group, async_op=True),
        ]
        for work in works:
            work.wait()
        chunk = dequantize_int8(q_in.view(n, blocks, width), s_in.view(n, blocks)).sum(dim=0).div_(n)
        if self.error_feedback and state.chunk_residual is not None:
            chunk += state.chunk_residual
        q2, s2, chunk_residual = quantize_rows(chunk, residual=self.error_feedback)
        if self.error_feedback:
            state.chunk_residual = torch.zeros_like(chunk) if chunk_residual is None else chunk_residual

        # Shot 2: everyone gets every rank's quantized chunk of the mean.
        q_all = q2.new_empty(n * blocks, width)
        s_all = s2.new_empty(n * blocks)
        works = [
            self.comm.all_gather(q_all, q2, group=group, async_op=True),
            self.comm.all_gather(s_all, s2, group=group, async_op=True),
        ]
        for work in works:
            work.wait()
        tensor.copy_(dequantize_int8(q_all, s_all).view(-1)[:numel])
        return completed_future(tensor)
