"""The sync modes' outer optimizer (DiLoCo's Nesterov SGD, the plain average, or one of the user's) and the
optimizer-state helpers the sync mode's checkpoint state uses: which state keys the outer optimizer keeps, and a
rank's own inner optimizer state, saved and put back."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

from ddp_plugin.hookspecs import as_parameter_layout, local_tensor

if TYPE_CHECKING:
    from torch.optim import Optimizer

NESTEROV = {"lr": 0.7, "momentum": 0.9}
"""DiLoCo's outer optimizer (Douillard et al., 2023): SGD with Nesterov momentum."""


def build_outer_optimizer(spec: Any, params: list[nn.Parameter]) -> torch.optim.Optimizer:
    if spec == "average":
        return torch.optim.SGD(params, lr=1.0)
    if spec == "nesterov":
        return NesterovSGD(params, lr=NESTEROV["lr"], momentum=NESTEROV["momentum"], nesterov=True)
    optimizer = spec(params)
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"`outer_optimizer` must return a torch.optim.Optimizer, got {type(optimizer).__name__}.")
    return optimizer


class NesterovSGD(torch.optim.SGD):
    """``torch.optim.SGD`` with Nesterov momentum (no weight decay, no dampening), computed as torch computes it,
    the same bits, but with the Nesterov term added into the gradient's own memory: torch's ``grad.add(buf,
    alpha=momentum)`` allocates a tensor of the gradient's size per step (at a DiLoCo sync, S/k per rank). The
    gradients are pseudo-gradients this plugin made for the step, and are consumed by it."""

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> None:
        if closure is not None:
            raise ValueError("the outer optimizer takes no closure")
        for group in self.param_groups:
            lr, momentum = group["lr"], group["momentum"]
            for p in group["params"]:
                grad = p.grad
                if grad is None:
                    continue
                state = self.state[p]
                buf = state.get("momentum_buffer")
                if buf is None:
                    buf = state["momentum_buffer"] = torch.clone(grad).detach()
                else:
                    buf.mul_(momentum).add_(grad)
                grad.add_(buf, alpha=momentum)
                p.add_(grad, alpha=-lr)


def optimizer_state(optimizer: Optimizer) -> list[list[dict[str, Any]]]:
    """``optimizer``'s state by position (group, parameter), as this rank holds it, on the CPU."""
    # (a DTensor's local tensor: the file holds plain tensors, and a rank's own state is its own block)
    return [[{k: (local_tensor(v).detach().cpu().clone() if isinstance(v, Tensor) else v)
              for k, v in optimizer.state.get(p, {}).items()} for p in group["params"]]
            for group in optimizer.param_groups]


def load_optimizer_state(optimizer: Optimizer, saved: list[list[dict[str, Any]]], device: torch.device) -> bool:
    """Put :func:`optimizer_state`'s answer back; ``False`` (and nothing changed) when it does not fit."""
    groups = [group["params"] for group in optimizer.param_groups]
    if [len(g) for g in groups] != [len(g) for g in saved] or any(
        isinstance(v, Tensor) and v.dim() > 0 and v.shape != local_tensor(p).shape
        for g, sg in zip(groups, saved) for p, st in zip(g, sg) for v in st.values()
    ):
        return False
    for g, sg in zip(groups, saved):
        for p, st in zip(g, sg):
            if st:
                optimizer.state[p] = {k: (as_parameter_layout(v.to(device), p) if isinstance(v, Tensor)
                                          and v.dim() > 0 else v) for k, v in st.items()}
            else:
                optimizer.state.pop(p, None)
    return True


def state_kinds(spec: Any) -> tuple[dict[str, bool], dict[str, Any]]:
    """The state keys the outer optimizer keeps per parameter, each with whether it is a tensor of the
    parameter's shape (else a scalar, e.g. Adam's step), found by stepping one on a one-element parameter: the
    same on every rank, whether or not this rank holds a piece that has synchronized yet."""
    probe = nn.Parameter(torch.zeros(2, dtype=torch.float64), requires_grad=False)
    optimizer = build_outer_optimizer(spec, [probe])
    probe.grad = torch.ones_like(probe)
    optimizer.step()
    state = optimizer.state.get(probe, {})
    kinds = {k: isinstance(v, Tensor) and v.dim() > 0 for k, v in state.items()}
    return kinds, dict(state)


def scalar_like(example: Any, value: float) -> Any:
    if isinstance(example, Tensor):
        return torch.tensor(value, dtype=example.dtype, device=example.device)
    return type(example)(value)
