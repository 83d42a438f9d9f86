"""What a user (or a callback, or the precision plugin) asks the strategy about the ``fit`` in progress that takes
more than a look at its :class:`~ddp_plugin.strategy.fit_state.FitState`: gradient norms where gradients are sharded, the
clipping by value of what the optimizer holds, and memory. Outside a ``fit`` each answers as unsharded training
would."""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from ddp_plugin.hookspecs import local_tensor
from ddp_plugin.parallel import tensor_parallel

if TYPE_CHECKING:
    from torch.nn import Module
    from torch.optim import Optimizer

    from ddp_plugin.strategy.fit_state import FitState


def grad_norm(module: Module, fit: FitState, norm_type: float | int | str = 2, group_separator: str = "/"
              ) -> dict[str, Tensor]:
    """``lightning.pytorch.utilities.grad_norm(module, norm_type)`` at every ZeRO stage (see the strategy's)."""
    from lightning.pytorch.utilities import grad_norm as lightning_grad_norm

    norm_type = float(norm_type)
    if norm_type <= 0:
        raise ValueError(f"`norm_type` must be a positive number or 'inf' (infinity norm). Got {norm_type}")
    per_param = session.grad_norms(module, norm_type) if (session := fit.running()) else None
    if per_param is None:
        if not tensor_parallel.has_tensor_parallel_parameters(module):
            return lightning_grad_norm(module, norm_type, group_separator)
        per_param = tensor_parallel.grad_norms(module, norm_type, fit.tensor_parallel_group())
    norms = {f"grad_{norm_type}_norm{group_separator}{name}": value for name, value in per_param.items()}
    if norms:
        norms[f"grad_{norm_type}_norm_total"] = torch.tensor([float(v) for v in norms.values()]).norm(norm_type)
    return norms


def clip_grads_by_value(model: Module | None, fit: FitState, sharded: bool, clip_val: float) -> None:
    """Lightning's clipping by value where a sharder's optimizer holds pieces: the module's whole gradients."""
    if fit.running() and sharded and model is not None:
        # Clamping twice is clamping once: the slices the optimizer's pieces share are not clipped twice.
        whole = [p for p in model.parameters() if p.grad is not None]
        if whole:  # (none at stages 2-3; torch's clip_grad_value_ fails on an empty list)
            torch.nn.utils.clip_grad_value_(whole, clip_val)


def measured_memory(model: Module | None, optimizers: Iterable[Optimizer], fit: FitState) -> dict[str, int]:
    """The strategy's ``memory_bytes()``: :func:`memory_bytes` of the live tensors, and what plugins keep besides
    (``on_collect_memory``, e.g. a sync mode's ``outer_state``)."""
    session = fit.running()
    buckets = [b.buffer for b in session.engine.buckets] if session else []
    measured = memory_bytes(model.parameters() if model is not None else [], optimizers, buckets)
    if fit.plugin_manager is not None:
        for part in fit.plugin_manager.hook.on_collect_memory():
            for name, value in (part or {}).items():
                measured[name] = measured.get(name, 0) + value
                measured["total"] += value
    return measured


def memory_bytes(module_params: Iterable[Tensor], optimizers: Iterable[Optimizer], buckets: Iterable[Tensor]
                 ) -> dict[str, int]:
    """Bytes of parameters, gradients and optimizer state, measured on the live tensors (each storage counted
    once, released ones as zero): module parameters and the optimizers' (sharded) ones, gradient buckets and
    every ``.grad``, and every tensor in the optimizers' state."""
    seen: set[int] = set()
    optimizers = list(optimizers)

    def size(tensors: Iterable[Tensor | None]) -> int:
        total = 0
        for t in tensors:
            if t is None:
                continue
            storage = local_tensor(t).untyped_storage()  # (a DTensor's: its local shard's)
            if storage.nbytes() == 0 or storage.data_ptr() in seen:
                continue
            seen.add(storage.data_ptr())
            total += storage.nbytes()
        return total

    module_params = list(module_params)
    opt_params = [p for opt in optimizers for g in opt.param_groups for p in g["params"]]
    params = size([*module_params, *opt_params])
    grads = size([*buckets, *(p.grad for p in module_params), *(p.grad for p in opt_params)])
    state = size(v for opt in optimizers for st in opt.state.values() for v in st.values() if isinstance(v, Tensor))
    return {"params": params, "grads": grads, "optimizer_state": state, "total": params + grads + state}
