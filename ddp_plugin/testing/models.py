"""Tiny models for tests, benchmarks and examples: an MLP builder, one configurable LightningModule around any
network, and LARS, the optimizer that is *not* elementwise.

- :func:`mlp`: ``Linear(features, hidden)``, then ``layers`` hidden ``Linear(hidden, hidden)``, then
  ``Linear(hidden, out)``, an activation after each but the last.
- :class:`TinyModule`: ``training_step`` is a loss of ``net(x)`` against the batch's target,
  ``configure_optimizers`` one optimizer over every parameter; nothing else. Behaviour a test observes
  (recording gradients, memory, traffic) belongs in a callback beside it, so the model stays the same::

      model = TinyModule(mlp(8, 32, out=1, layers=0, activation=nn.Tanh), optimizer="sgd", lr=0.1, momentum=0.9)
      trainer.fit(model, DataLoader(sine_dataset(4096, 8, seed=3), batch_size=8))

- :class:`LARS`: SGD with a per-tensor trust ratio; ZeRO stages must refuse it unless declared elementwise.

Parameters are created in the order the layers are listed, so a model built after the same seed is the same model
whichever helper built it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

import lightning as L
import torch
from torch import Tensor, nn

__all__ = ["LARS", "OPTIMIZERS", "TinyModule", "mlp"]

OPTIMIZERS: dict[str, type[torch.optim.Optimizer]] = {
    "sgd": torch.optim.SGD,
    "adam": torch.optim.Adam,
    "adamw": torch.optim.AdamW,
}
"""Optimizer names :class:`TinyModule` accepts (any optimizer class works too)."""

LOSSES = ("mse", "cross_entropy", "mean_square")


def mlp(features: int, hidden: int, out: int, layers: int = 1,
        activation: Callable[[], nn.Module] = nn.ReLU) -> nn.Sequential:
    """A multilayer perceptron ``features -> hidden -> (layers x hidden) -> out`` with ``activation`` after every
    layer but the last. ``layers=0``: one hidden layer of width ``hidden``."""
    modules: list[nn.Module] = [nn.Linear(features, hidden), activation()]
    for _ in range(layers):
        modules += [nn.Linear(hidden, hidden), activation()]
    modules.append(nn.Linear(hidden, out))
    return nn.Sequential(*modules)


class LARS(torch.optim.SGD):
    """SGD with a per-tensor trust ratio (LARS): each tensor's gradient is scaled by ``||w|| / (||g|| + eps)``, a
    norm over the whole tensor, so stepping pieces of a tensor is not stepping the tensor. A subclass of SGD whose
    update is not elementwise: what ZeRO stages must refuse unless declared with ``allow_optimizer``."""

    def __init__(self, params: Iterable[Any], *args: Any, eps: float = 1e-12, **kwargs: Any) -> None:
        super().__init__(params, *args, **kwargs)
        self.eps = eps  # an attribute, not a hyperparameter: the optimizer's state_dict stays SGD's

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.grad.mul_(p.norm() / (p.grad.norm() + self.eps))
        return super().step(closure)


class TinyModule(L.LightningModule):
    """A LightningModule around ``net``, for tests that need *a* model rather than a particular one.

    Args:
        net: the network, kept as ``self.net`` (its parameters are named ``net.*``).
        loss: ``"mse"`` or ``"cross_entropy"`` of ``net(x)`` against ``y`` for batches ``(x, y)``, or
            ``"mean_square"``, ``net(x).pow(2).mean()``, for batches ``(x,)``.
        optimizer: a name from :data:`OPTIMIZERS`, or an optimizer class (any callable
            ``optimizer(params, **options)``).
        log_loss: where given, ``training_step`` logs the loss under this name with ``log_options``
            (e.g. ``{"prog_bar": True, "sync_dist": True}``).
        **options: the optimizer's keyword arguments (``lr``, ``momentum``, ...).
    """

    def __init__(self, net: nn.Module, loss: str = "mse",
                 optimizer: str | Callable[..., torch.optim.Optimizer] = "sgd", log_loss: str | None = None,
                 log_options: Mapping[str, Any] | None = None, **options: Any) -> None:
        super().__init__()
        if loss not in LOSSES:
            raise ValueError(f"loss={loss!r}: one of {', '.join(LOSSES)}")
        if isinstance(optimizer, str) and optimizer not in OPTIMIZERS:
            raise ValueError(f"optimizer={optimizer!r}: one of {', '.join(OPTIMIZERS)}, or an optimizer class")
        self.net = net
        self.loss_name = loss
        self.optimizer_factory = OPTIMIZERS[optimizer] if isinstance(optimizer, str) else optimizer
        self.optimizer_options = dict(options)
        self.log_loss = log_loss
        self.log_options = dict(log_options or {})

    def forward(self, x: Tensor) -> Tensor:
        return self.net(x)

    def compute_loss(self, batch: Any) -> Tensor:
        """The loss of one batch, ``(x, y)`` or ``(x,)``."""
        x, *target = batch
        out = self.net(x)  # the net itself, not self(x): no hooks of the LightningModule's own in between
        if self.loss_name == "mean_square":
            return out.pow(2).mean()
        if self.loss_name == "cross_entropy":
            return nn.functional.cross_entropy(out, target[0])
        return nn.functional.mse_loss(out, target[0])

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        loss = self.compute_loss(batch)
        if self.log_loss is not None:
            self.log(self.log_loss, loss, **self.log_options)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return self.optimizer_factory(self.parameters(), **self.optimizer_options)
