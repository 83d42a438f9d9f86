"""Sparse, low-bit coding (``compression="sparse"``): top-k inside each chunk, the kept values in 2, 4 or 8 bits
with one scale per chunk, the indices in 16 bits, and error feedback with a decay. Meant for the pseudo-gradients
of a sync mode (SparseLoCo's coding: 1-3 % of each chunk, 2 bits, the decayed error-feedback accumulator), and
usable on gradients.

Each rank's payload (one byte buffer: the chunks' scales, the kept entries' indices in their chunk, the packed
levels) is all-gathered, and every rank decodes every rank's in rank order into zeros and divides by n: the same
bits everywhere (each rank keeps other indices, so the sum is gathered, not all-reduced).

Bytes a rank sends for a tensor of N elements in chunks of c, keeping k = ceil(density * c) a chunk:
(n - 1) * B, B = C * (4 + k * (2 + bits / 8)) with C = ceil(N / c) chunks (rounded up to whole bytes and to 4),
against a float32 ring all-reduce's 2 (n - 1) / n * 4 N. At density 1.5 %, 2 bits and chunks of 4096 that is
0.28 bits an element: 115x fewer bytes than fp32 on 2 nodes.
"""

from __future__ import annotations

import math
from typing import Any, ClassVar

import torch

from ddp_plugin.codecs.base import BucketState, Codec
from ddp_plugin.codecs.int8 import finite_or_zero
from ddp_plugin.runtime.checks import check_bool, check_int, check_number, invalid
from ddp_plugin.hookspecs import completed_future

INDEX_OFFSET = 2**15
"""An index in its chunk (0 to 65535) is sent as a 16-bit signed integer, less this."""


class SparseState(BucketState):
    per_rank = ("residual",)


class SparseCodec(Codec):
    """Top-k per chunk, quantized, with error feedback (see the module docstring).

    Per step and bucket: ``x = decay * residual + g`` (with error feedback), cut into chunks of ``chunk`` elements
    (the last one padded with zeros); each chunk keeps its ``k`` entries of largest magnitude, quantized to
    ``2**bits`` levels spread evenly over ``[-s, s]`` (``s`` the chunk's largest kept magnitude, sent as float32);
    the residual is what was not sent, the quantization's error included.

    Options: ``density`` (0.015: the share of each chunk kept, in (0, 1]), ``bits`` (2, 4 or 8), ``chunk``
    (4096: elements a chunk, 2 to 65536), ``decay`` (1.0: the residual's factor each step, in [0, 1]; SparseLoCo
    uses 0.95, the accumulator then standing in for the outer momentum), ``error_feedback`` (True).
    """

    name = "sparse"
    defaults: ClassVar[dict[str, Any]] = {"density": 0.015, "bits": 2, "chunk": 4096, "decay": 1.0,
                                          "error_feedback": True}
    State = SparseState

    def __init__(self, **options: Any) -> None:
        super().__init__(**options)
        self.density = float(self.options["density"])
        self.bits = int(self.options["bits"])
        self.chunk = int(self.options["chunk"])
        self.decay = float(self.options["decay"])
        self.error_feedback = bool(self.options["error_feedback"])

    @classmethod
    def check_values(cls, options: dict[str, Any]) -> None:
        check_number("compression_options['density']", options["density"], minimum=0, maximum=1,
                     expected="a number in (0, 1]", context=cls.context())
        if options["bits"] not in (2, 4, 8) or isinstance(options["bits"], bool):
            raise invalid("compression_options['bits']", options["bits"], "2, 4 or 8", context=cls.context())
        check_int("compression_options['chunk']", options["chunk"], minimum=2, maximum=2**16,
                  expected="an integer from 2 to 65536", context=cls.context())
        check_number("compression_options['decay']", options["decay"], minimum=0, maximum=1,
                     strict=False, expected="a number in [0, 1]", context=cls.context())
        check_bool("compression_options['error_feedback']", options["error_feedback"], context=cls.context())
        if options["decay"] != 1.0 and not options["error_feedback"]:
            raise ValueError(f"`compression_options['decay']={options['decay']}` decays the error-feedback residual, and"
                             f" `error_feedback=False` keeps none ({cls.context()}): drop `decay`, or keep error feedback.")

    @property
    def keeps_rank_state(self) -> bool:
        return self.error_feedback

    def layout(self, numel: int) -> tuple[int, int, int]:
        """``(c, chunks, k)``: the chunk size for a tensor of ``numel`` elements (at most ``numel``), the number of
        chunks, and the entries each keeps."""
        c = min(self.chunk, numel)
        return c, -(-numel // c), min(c, max(1, math.ceil(self.density * c)))

    def payload_bytes(self, numel: int) -> int:
        """Bytes of one rank's payload for a tensor of ``numel`` elements."""
        _, chunks, k = self.layout(numel)
        return _round4(chunks * 4 + chunks * k * 2 + -(-chunks * k * self.bits // 8))

    def reduce(self, tensor, group, n, bucket, offset, state):
        numel = tensor.numel()
        c, chunks, k = self.layout(numel)
        padded = chunks * c
        x = self._accumulated(tensor, state, padded)
        rows = x.view(chunks, c)
        magnitudes = self.comm.scratch(padded, torch.float32, x.device).view(chunks, c)
        indices = torch.abs(rows, out=magnitudes).topk(k, dim=1, sorted=False).indices
        values = rows.gather(1, indices)
        scales = values.abs().amax(dim=1)
        levels = self._quantize(values, scales)
        if self.error_feedback:
            # What was not sent stays: everything but the kept entries, and their quantization's error.
            rows.scatter_(1, indices, values.sub_(self._dequantize(levels, scales)))
            state.residual = finite_or_zero(x)
        mine = self._pack(scales, indices, levels)
        gathered = mine.new_empty(n * mine.numel())
        self.comm.all_gather(gathered, mine, group=group)
        out = self.comm.scratch(padded, torch.float32, tensor.device).zero_()  # (the magnitudes are done with)
        total = out.view(chunks, c)
        for r in range(n):  # every rank's entries in rank order: the same sums, bit for bit, on every rank
            scales_r, indices_r, levels_r = self._unpack(gathered[r * mine.numel() : (r + 1) * mine.numel()],
                                                         chunks, k)
            total.scatter_add_(1, indices_r, self._dequantize(levels_r, scales_r))
        tensor.copy_(out[:numel].div_(n).view_as(tensor))
        return completed_future(tensor)

    def _accumulated(self, tensor: torch.Tensor, state: SparseState, padded: int) -> torch.Tensor:
        """``decay * residual + tensor`` in float32, padded with zeros to ``padded`` elements: in the residual's own
        memory (the next residual) with error feedback, else a new buffer."""
        numel = tensor.numel()
        residual = state.residual if self.error_feedback else None
        if residual is not None and residual.numel() == padded and residual.device == tensor.device:
            x = residual.mul_(self.decay) if self.decay != 1.0 else residual
            x[:numel].add_(tensor.reshape(-1).float())
            return x
        x = torch.zeros(padded, dtype=torch.float32, device=tensor.device)
        x[:numel].copy_(tensor.reshape(-1))
        return x

    def _quantize(self, values: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
        """Each value's level, 0 to ``2**bits - 1`` (level ``q`` decodes to ``(q - m) * step``, ``m`` the middle)."""
        top = 2**self.bits - 1
        step = scales * (2.0 / top)
        safe = torch.where(step > 0, step, torch.ones_like(step))
        return values.div(safe[:, None]).add_(top / 2).round_().clamp_(0, top).to(torch.uint8)

    def _dequantize(self, levels: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
        top = 2**self.bits - 1
        return levels.float().sub_(top / 2).mul_((scales * (2.0 / top))[:, None])

    def _pack(self, scales: torch.Tensor, indices: torch.Tensor, levels: torch.Tensor) -> torch.Tensor:
        """One byte buffer: the float32 scales, the int16 indices, the levels ``8 / bits`` to a byte."""
        per_byte = 8 // self.bits
        flat = levels.reshape(-1)
        if flat.numel() % per_byte:
            flat = torch.cat([flat, flat.new_zeros(per_byte - flat.numel() % per_byte)])
        flat = flat.view(-1, per_byte)
        packed = flat[:, 0].clone()
        for j in range(1, per_byte):
            packed |= flat[:, j] << (j * self.bits)
        parts = [scales.float().contiguous().view(torch.uint8),
                 (indices - INDEX_OFFSET).to(torch.int16).reshape(-1).view(torch.uint8), packed]
        size = sum(p.numel() for p in parts)
        return torch.cat(parts + [packed.new_zeros(_round4(size) - size)])

    def _unpack(self, payload: torch.Tensor, chunks: int, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        per_byte = 8 // self.bits
        scales = payload[: 4 * chunks].view(torch.float32)
        start = 4 * chunks
        indices = payload[start : start + 2 * chunks * k].view(torch.int16).long().add_(INDEX_OFFSET).view(chunks, k)
        start += 2 * chunks * k
        packed = payload[start : start + -(-chunks * k // per_byte)]
        mask = 2**self.bits - 1
        levels = torch.stack([(packed >> (j * self.bits)) & mask for j in range(per_byte)], dim=1).reshape(-1)
        return scales, indices, levels[: chunks * k].view(chunks, k)

    def residual_numel(self, numel: int) -> int:
        c, chunks, _ = self.layout(numel)
        return chunks * c  # (kept padded to whole chunks)


def _round4(nbytes: int) -> int:
    return -(-nbytes // 4) * 4
