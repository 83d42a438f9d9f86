"""Top-k sparsification with error feedback: the largest values and their indices, all-gathered."""

from __future__ import annotations

import math
from typing import Any, ClassVar

import torch

from ddp_plugin.runtime.checks import check_bool, check_number
from ddp_plugin.codecs.base import BucketState, Codec
from ddp_plugin.codecs.int8 import finite_or_zero
from ddp_plugin.hookspecs import completed_future


class TopKState(BucketState):
    per_rank = ("residual",)


class TopKCodec(Codec):
    """Keep the ``ratio`` of values with the largest magnitude (after adding the residual), all-gather their
    values (float32) and indices (int32), and average locally: every rank scatters rank 0's, then rank 1's, ...
    entries into zeros and divides by n, so the float additions happen in the same order everywhere.

    Bytes per rank: (n-1) * 8 * k for k = ceil(ratio * numel) kept values (a float32 all-reduce sends
    2(n-1)/n * 4 * numel): worthwhile for small ratios and groups, which the cross-node group is.

    Error feedback: what was not sent (everything but the top k) is added to the next step's input, so small
    gradients accumulate until they are sent.

    Options: ``ratio`` (default 0.01; in (0, 1]), ``error_feedback`` (default True).
    """

    name = "topk"
    defaults: ClassVar[dict[str, Any]] = {"ratio": 0.01, "error_feedback": True}
    State = TopKState

    def __init__(self, **options: Any) -> None:
        super().__init__(**options)
        self.ratio = float(self.options["ratio"])
        self.error_feedback = self.options["error_feedback"]

    @classmethod
    def check_values(cls, options: dict[str, Any]) -> None:
        check_number("compression_options['ratio']", options["ratio"], minimum=0, maximum=1,
                     expected="a number in (0, 1]", context=cls.context())
        check_bool("compression_options['error_feedback']", options["error_feedback"], context=cls.context())

    @property
    def keeps_rank_state(self) -> bool:
        return self.error_feedback

    def kept(self, numel: int) -> int:
        return min(numel, max(1, math.ceil(self.ratio * numel)))

    def reduce(self, tensor, group, n, bucket, offset, state):
        numel = tensor.numel()
        k = self.kept(numel)
        x = tensor.float()  # the tensor itself when it is float32: only read unless error feedback copies it
        if self.error_feedback:
            # x = gradient + residual in the residual's own memory (the next residual): nothing bucket-sized is
            # allocated for it per step.
            residual = state.residual
            usable = residual is not None and residual.shape == x.shape and residual.device == x.device
            x = residual.add_(x) if usable else x.clone()
        magnitudes = self.comm.scratch(numel, torch.float32, x.device)
        indices = torch.abs(x, out=magnitudes).topk(k, sorted=False).indices
        values = x.index_select(0, indices)
        if self.error_feedback:
            x.index_fill_(0, indices, 0)
            state.residual = finite_or_zero(x)
        index_dtype = torch.int32 if numel < 2**31 else torch.int64
        all_values = values.new_empty(n * k)
        all_indices = indices.new_empty(n * k, dtype=index_dtype)
        works = [
            self.comm.all_gather(all_values, values, group=group, async_op=True),
            self.comm.all_gather(all_indices, indices.to(index_dtype), group=group, async_op=True),
        ]
        for work in works:
            work.wait()
        out = self.comm.scratch(numel, torch.float32, tensor.device).zero_()  # the magnitudes are done with
        # One rank's indices are distinct, so each index_add_ touches every slot at most once: the result does
        # not depend on the order of atomic adds (CUDA), only on the rank order, which is fixed.
        for r in range(n):
            out.index_add_(0, all_indices[r * k : (r + 1) * k].long(), all_values[r * k : (r + 1) * k])
        tensor.copy_(out.div_(n))
        return completed_future(tensor)
