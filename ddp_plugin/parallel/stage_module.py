"""One pipeline stage's module: the model's own ``forward`` with only the stage's modules in place, its outputs
narrowed where the next stage is on another node (``pipeline_activations``), and the bytes it sends counted."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from ddp_plugin.parallel import transformers_stages
from ddp_plugin.parallel.stage_plan import StagePlan, _get, _left_out, _set, stage_blocks


class StageModule(nn.Module):
    """One stage as ``torch.distributed.pipelining`` runs it: the model's own ``forward`` with only this stage's
    modules in place. The modules are the model's (registered here as well, so ``parameters()`` are this
    stage's); the model is not copied."""

    def __init__(self, owner: nn.Module, plan: StagePlan, stage: int) -> None:
        super().__init__()
        self.__dict__["_owner"] = owner  # not a child: its parameters are the LightningModule's
        blocks = _get(owner, plan.blocks)
        self._blocks = {i: blocks._modules[plan.key(i)] for i in plan.stage_blocks[stage]}
        held = {name: _get(owner, name) for name in plan.before + plan.after}
        mine = {name for name in held if (name in plan.before and stage == 0)
                or (name in plan.after and stage == plan.num_stages - 1)}
        self._keep = {name: held[name] if name in mine else _left_out(plan) for name in held}
        self._blocks_name = plan.blocks
        self._kind, self._output = plan.kind, plan.output
        self.__dict__["_stage_blocks"] = stage_blocks(plan, self._blocks)  # (made once; blocks registered in parts)
        self.parts = nn.ModuleList([held[name] for name in held if name in mine] + list(self._blocks.values()))
        self.first, self.last = stage == 0, stage == plan.num_stages - 1
        self.sent_forward: list[int] = []
        self.sent_backward: list[int] = []
        """Bytes each of this stage's training forwards sent on (its outputs) and their backwards sent back (its
        inputs' gradients), since the runner last counted them (one entry per call: the schedule's first step
        also runs one forward to infer the shapes, which sends none of them)."""
        self.send_dtype: torch.dtype | None = None
        """The dtype this stage's floating outputs are cast to before they are sent (their gradients come back in
        it): set where the next stage runs on another node (``pipeline_activations``); ``None``: as computed."""
        self.widen = False
        """Whether this stage's floating inputs, sent narrowed by the stage before, are cast back to the stage's
        compute dtype (its parameters')."""

    def forward(self, *received: Any, **kwargs: Any) -> Any:
        args = received
        if self.widen:
            dtype = next((p.dtype for p in self.parts.parameters() if p.is_floating_point()),
                         torch.get_default_dtype())
            args = tuple(_widened(a, dtype) for a in received)
        out = self._forward(*args, **kwargs)
        if self.send_dtype is not None:
            out = _narrowed(out, self.send_dtype)
        if torch.is_grad_enabled():
            if not self.last:
                self.sent_forward.append(_tensor_bytes(out))
            if not self.first:  # (their gradients go back in the dtype they came in)
                self.sent_backward.append(
                    _tensor_bytes([a for a in received if isinstance(a, Tensor) and a.requires_grad]))
        return out

    def _forward(self, *args: Any, **kwargs: Any) -> Any:
        owner = self._owner
        saved = {name: _get(owner, name) for name in (*self._keep, self._blocks_name)}
        try:
            for name, m in self._keep.items():
                _set(owner, name, m)
            _set(owner, self._blocks_name, self._stage_blocks)
            if self._kind == "transformers":
                return transformers_stages.stage_forward(owner, self.first, self._output, *args, **kwargs)
            return _call_forward(owner, *args, **kwargs)
        finally:
            for name, m in saved.items():
                _set(owner, name, m)


ACTIVATION_DTYPES = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}
"""``pipeline_activations`` -> the dtype sent between stages on different nodes (``None``: as computed)."""


def _narrowed(value: Any, dtype: torch.dtype) -> Any:
    """``value``'s floating tensors wider than ``dtype`` cast to it (a differentiable cast: the gradient that comes
    back is in ``dtype`` too, and is cast back to the tensor's own dtype by autograd)."""
    from torch.utils._pytree import tree_map

    return tree_map(lambda t: t.to(dtype) if isinstance(t, Tensor) and t.is_floating_point()
                    and t.element_size() > dtype.itemsize else t, value)


def _widened(value: Any, dtype: torch.dtype) -> Any:
    """A received tensor in a narrower floating dtype cast to ``dtype`` (the stage's compute dtype)."""
    if isinstance(value, Tensor) and value.is_floating_point() and value.element_size() < dtype.itemsize:
        return value.to(dtype)
    return value


def _tensor_bytes(value: Any) -> int:
    if isinstance(value, Tensor):
        return 0 if value.is_meta else value.numel() * value.element_size()
    if isinstance(value, (list, tuple)):
        return sum(_tensor_bytes(v) for v in value)
    return 0


def _call_forward(owner: nn.Module, *args: Any, **kwargs: Any) -> Any:
    # The class's forward, whatever the placeholder patch has put on the instance.
    return type(owner).forward(owner, *args, **kwargs)
