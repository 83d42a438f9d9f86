"""Gradient clipping that knows about shards, and a loss scaler that every rank follows, as a ``Precision`` subclass.

``Trainer(gradient_clip_val=..., gradient_clip_algorithm="norm")`` reaches the precision plugin's
``clip_grad_by_norm``, which would clip each rank's shard by its own norm; here it goes through the strategy to
the plugins (one all-reduce of squared norms). ``gradient_clip_algorithm="value"`` clamps each element, which
is right on shards as it is; the module's own ``.grad`` (whole at ZeRO stage 1, where the optimizer's pieces
are slices of it) is clamped too, so that it shows what the optimizer applies.

Right after the closure (``_after_closure``: after a loss scaler's ``unscale_``, before the Trainer's clipping
and the scaler's ``step``), the strategy gets its turn (:meth:`GradientClipping.after_closure`): every rank's
scaler must skip the same steps, but at ZeRO stages 1-3 each rank's ``unscale_`` looked for infinities in its
own shard only, and each pipeline stage in its own parameters; and the strategy's ``gradient_clip_norm`` clips
there, on unscaled gradients (inside the closure it would clip the scaled ones).

The Trainer picks the precision plugin (``"32-true"``, ``"bf16-mixed"``, ...); the strategy hands it to
:func:`with_sharded_clipping`, which returns an instance of a subclass of that plugin's own class with these two
methods overridden, so every other behaviour (and every ``isinstance`` check) stays the Trainer's.
"""

from __future__ import annotations

import copy
import functools
from typing import TYPE_CHECKING, Any, Protocol

from lightning.pytorch.plugins.precision import Precision

if TYPE_CHECKING:
    from torch import Tensor
    from torch.amp import GradScaler
    from torch.optim import Optimizer


class GradientClipping(Protocol):
    """What the strategy offers the precision plugin while a ``fit`` runs."""

    def clip_grad_norm_sharded(self, optimizer: Optimizer, max_norm: float) -> Tensor | None:
        """Clip by the global norm through the plugins; ``None`` when no ``fit`` is running."""

    def clip_module_grads_by_value(self, clip_val: float) -> None:
        """Clamp the module's own ``.grad`` too (where it is whole and the optimizer steps pieces of it)."""

    def after_closure(self, optimizer: Optimizer, scaler: GradScaler | None) -> None:
        """After the closure (and ``scaler.unscale_``): agree on the scaler's skip over every rank, clip by the
        strategy's ``gradient_clip_norm``."""

    def before_update(self, optimizer: Optimizer) -> None:
        """After Lightning's ``on_before_optimizer_step`` hooks and clipping, right before the update."""


class ShardedGradientClipping(Precision):
    """The mixin: norm clipping through the strategy's plugins, value clipping of the module's gradients too."""

    clipping: GradientClipping | None = None

    def clip_grad_by_norm(self, optimizer: Optimizer, clip_val: int | float) -> None:
        if self.clipping is None or self.clipping.clip_grad_norm_sharded(optimizer, float(clip_val)) is None:
            super().clip_grad_by_norm(optimizer, clip_val)

    def _after_closure(self, model: Any, optimizer: Optimizer) -> None:
        if self.clipping is not None:
            self.clipping.after_closure(optimizer, loss_scaler(self))
        super()._after_closure(model, optimizer)
        if self.clipping is not None:
            self.clipping.before_update(optimizer)

    def clip_grad_by_value(self, optimizer: Optimizer, clip_val: int | float) -> None:
        super().clip_grad_by_value(optimizer, clip_val)
        if self.clipping is not None:
            self.clipping.clip_module_grads_by_value(float(clip_val))

    def __reduce_ex__(self, protocol: Any) -> tuple:
        # The subclass is made at run time; pickle (the spawn launcher pickles the trainer) names the Trainer's
        # class instead and makes the subclass again. The state comes third, so the cycle through the strategy
        # (`clipping`) pickles like any other.
        return _unpickle, (type(self).__bases__[1],), self.__dict__


def _unpickle(cls: type[Precision]) -> Precision:
    sub = _subclass(cls)
    return sub.__new__(sub)


@functools.cache
def _subclass(cls: type[Precision]) -> type[Precision]:
    return type(cls.__name__, (ShardedGradientClipping, cls), {"__module__": cls.__module__,
                                                                 "__qualname__": cls.__qualname__})


def loss_scaler(plugin: Precision) -> GradScaler | None:
    """The precision plugin's enabled loss scaler (``16-mixed``'s ``GradScaler``), if it has one."""
    scaler = getattr(plugin, "scaler", None)
    return scaler if scaler is not None and scaler.is_enabled() else None


def with_sharded_clipping(plugin: Precision, clipping: GradientClipping) -> Precision:
    """``plugin``, as an instance of a subclass of its class that clips through ``clipping`` (a copy sharing
    its state; ``plugin`` itself is left as it is)."""
    if isinstance(plugin, ShardedGradientClipping):
        plugin.clipping = clipping
        return plugin
    wrapped: Any = copy.copy(plugin)
    wrapped.__class__ = _subclass(type(plugin))
    wrapped.clipping = clipping
    return wrapped
