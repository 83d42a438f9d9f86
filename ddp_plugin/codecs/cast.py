"""fp16 and bf16: cast, all-reduce, cast back. Half the bytes of a float32 all-reduce, no state."""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar

import torch

from ddp_plugin.codecs.base import Codec
from ddp_plugin.hookspecs import completed_future

if TYPE_CHECKING:
    from torch import Tensor


class _CastCodec(Codec):
    dtype: ClassVar[torch.dtype]

    def reduce(self, tensor: Tensor, group, n, bucket, offset, state) -> torch.futures.Future:
        # Divide before casting and summing (as torch's fp16 hook): the sum of n values each below
        # fp16's maximum (65504) / n stays finite, where summing first could overflow. The tensor is divided in
        # place (it receives the mean anyway) and cast into the communicator's arena: nothing is allocated per
        # bucket and step. Blocking, so the arena is free again when the next bucket is coded.
        low = self.comm.scratch(tensor.numel(), self.dtype, tensor.device)
        low.copy_(tensor.div_(n).view(-1))
        self.comm.all_reduce(low, group=group)
        tensor.view(-1).copy_(low)
        return completed_future(tensor)


class Fp16Codec(_CastCodec):
    """Cast to float16 after dividing by the group size, all-reduce, cast back in place. Half the bytes of a
    float32 all-reduce; about 3 significant digits, range 6e-8 (subnormal) to 65504. No options."""

    name = "fp16"
    dtype = torch.float16


class Bf16Codec(_CastCodec):
    """Like :class:`Fp16Codec` with bfloat16: float32's range (no overflow, no underflow of small gradients)
    with about 2-3 significant digits. No options."""

    name = "bf16"
    dtype = torch.bfloat16
