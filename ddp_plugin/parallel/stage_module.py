"""One pipeline stage's module: the model's own ``forward`` with only the stage's modules in place, its outputs
narrowed where the next stage is on another node (``pipeline_activations``: a 16-bit cast, or int8 with a scale
per row packed into a 16-bit carrier), and the bytes it sends counted."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from ddp_plugin.codecs.int8 import dequantize_int8, quantize_int8
from ddp_plugin.parallel.stages import StagePlan, get_path, left_out, set_path, stage_blocks, stage_forward


class StageModule(nn.Module):
    """One stage as ``torch.distributed.pipelining`` runs it: the model's own ``forward`` with only this stage's
    modules in place. The modules are the model's (registered here as well, so ``parameters()`` are this
    stage's); the model is not copied."""

    def __init__(self, owner: nn.Module, plan: StagePlan, stage: int) -> None:
        super().__init__()
        self.__dict__["_owner"] = owner  # not a child: its parameters are the LightningModule's
        blocks = get_path(owner, plan.blocks)
        self._blocks = {i: blocks._modules[plan.key(i)] for i in plan.stage_blocks[stage]}
        held = {name: get_path(owner, name) for name in plan.before + plan.after}
        mine = {name for name in held if (name in plan.before and stage == 0)
                or (name in plan.after and stage == plan.num_stages - 1)}
        self._keep = {name: held[name] if name in mine else left_out(plan) for name in held}
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
        self.receive_dtype: torch.dtype | None = None
        """With ``widen``: the stage before's ``send_dtype`` (``torch.int8``: its inputs arrive packed)."""

    def forward(self, *received: Any, **kwargs: Any) -> Any:
        args = received
        if self.widen:
            dtype = next((p.dtype for p in self.parts.parameters() if p.is_floating_point()),
                         torch.get_default_dtype())
            unpack = self.receive_dtype is torch.int8
            args = tuple(Int8Rows.unpack(a, dtype) if unpack and _is_carrier(a) else _widened(a, dtype)
                         for a in received)
        out = self._forward(*args, **kwargs)
        if self.send_dtype is torch.int8:
            out = _packed(out)
        elif self.send_dtype is not None:
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
        saved = {name: get_path(owner, name) for name in (*self._keep, self._blocks_name)}
        try:
            for name, m in self._keep.items():
                set_path(owner, name, m)
            set_path(owner, self._blocks_name, self._stage_blocks)
            if self._kind == "transformers":
                return stage_forward(owner, self.first, self._output, *args, **kwargs)
            return _call_forward(owner, *args, **kwargs)
        finally:
            for name, m in saved.items():
                set_path(owner, name, m)


ACTIVATION_DTYPES = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16, "int8": torch.int8}
"""``pipeline_activations`` -> the dtype sent between stages on different nodes (``None``: as computed)."""

CARRIER = torch.float16
"""The dtype int8 rows travel in: the schedule sends tensors whose gradients come back through it, which an int8
tensor cannot have, so the int8 values and each row's fp32 scale are reinterpreted (bit for bit, not converted) as
a 16-bit floating tensor. Its gradient is the gradient's rows packed the same way. Nothing computes on a carrier:
it is made, sent, received and unpacked."""


class Int8Rows(torch.autograd.Function):
    """A floating tensor ``x`` of shape ``(..., d)`` (``d`` even) as int8 with a scale per row (its absolute maximum
    over 127, in fp32), packed into a :data:`CARRIER` tensor of shape ``(..., (d + 4) / 2)``; its backward unpacks
    the carrier's gradient, packed the same way by the receiving stage (:class:`_Unpack`). A row with a non-finite
    value unpacks to NaN (its scale is not finite), so a loss scaler still sees the overflow."""

    @staticmethod
    def forward(ctx: Any, x: Tensor) -> Tensor:
        ctx.dtype = x.dtype
        return pack_rows(x)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Tensor:
        return unpack_rows(grad, ctx.dtype)

    @staticmethod
    def unpack(carrier: Tensor, dtype: torch.dtype) -> Tensor:
        """A received carrier as a ``dtype`` tensor (its gradient goes back packed)."""
        return _Unpack.apply(carrier, dtype)


class _Unpack(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, carrier: Tensor, dtype: torch.dtype) -> Tensor:
        return unpack_rows(carrier, dtype)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        return pack_rows(grad), None


def pack_rows(x: Tensor) -> Tensor:
    """``x`` (``(..., d)``, ``d`` even) as int8 rows with their fp32 scales (the int8 codec's quantization, a block
    per row), in a :data:`CARRIER` tensor. A row holding inf or NaN has a non-finite scale: it comes back NaN."""
    d = x.shape[-1]
    q, scales = quantize_int8(x.detach().reshape(-1, d))
    packed = torch.empty(q.shape[0], d + 4, dtype=torch.int8, device=x.device)
    packed[:, :d] = q
    packed[:, d:] = scales.view(torch.int8).view(-1, 4)
    return packed.view(CARRIER).reshape(*x.shape[:-1], (d + 4) // 2)


def unpack_rows(carrier: Tensor, dtype: torch.dtype) -> Tensor:
    """:func:`pack_rows` undone: a ``dtype`` tensor of shape ``(..., d)``."""
    width = carrier.shape[-1] * 2
    packed = carrier.reshape(-1, carrier.shape[-1]).contiguous().view(torch.int8)
    scales = packed[:, width - 4 :].contiguous().view(torch.float32).squeeze(1)
    rows = dequantize_int8(packed[:, : width - 4], scales)
    return rows.to(dtype).reshape(*carrier.shape[:-1], width - 4)


def _is_carrier(value: Any) -> bool:
    return isinstance(value, Tensor) and value.dtype == CARRIER and value.dim() > 0


def _packed(value: Any) -> Any:
    """``value``'s floating tensors wider than 8 bits as int8 rows in a carrier (:class:`Int8Rows`)."""
    from torch.utils._pytree import tree_map

    def pack(t: Any) -> Any:
        if not (isinstance(t, Tensor) and t.is_floating_point() and t.element_size() > 1):
            return t
        if t.dim() == 0 or t.shape[-1] % 2:
            raise ValueError(
                f"`pipeline_activations='int8'` packs each row of a stage's outputs with its scale, and needs their"
                f" last dimension even; this stage sends a tensor of shape {tuple(t.shape)}. Use"
                " `pipeline_activations='bf16'` (or 'fp16') for this model."
            )
        return Int8Rows.apply(t)

    return tree_map(pack, value)


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
