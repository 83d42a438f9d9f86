"""How Lightning's calls during an epoch reach the fit's session and the parallelisms' components: each
``*_step`` (through the pipeline's schedule where there are stages, with a failed tensor-parallel collective
named by the split module it was in), the backward's hooks, gradient accumulation and the optimizer step. The
strategy's methods hand each call here with Lightning's own as ``call``; outside a ``fit`` that is what runs."""

from __future__ import annotations

from collections.abc import Callable, Generator
from contextlib import contextmanager, nullcontext
from typing import TYPE_CHECKING, Any

from ddp_plugin.strategy.components import PipelineParallel, restore_zero_grad
from ddp_plugin.strategy.precision import loss_scaler

if TYPE_CHECKING:
    from lightning.pytorch.strategies import Strategy
    from torch import Tensor
    from torch.optim import Optimizer

    from ddp_plugin.strategy.fit_state import FitState


class Steps:
    """The steps of ``strategy`` (its model, LightningModule, optimizers and precision plugin), over ``fit``."""

    def __init__(self, strategy: Strategy, fit: FitState) -> None:
        self.strategy = strategy
        self.fit = fit

    def training_step(self, call: Callable[[], Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if session := self.fit.running():
            session.before_training_step(self.strategy.model, args[0] if args else None)
        if self.fit.pipeline is not None:
            return self.step("training_step", call, args, kwargs, train=True)
        with self.fit.tensor_parallel.diagnosed("the forward"):  # (the tensor-parallel collectives inside)
            return call()

    def step(self, name: str, call: Callable[[], Any], args: tuple[Any, ...], kwargs: dict[str, Any],
             train: bool) -> Any:
        """Lightning's step ``name`` (``call``), through the pipeline's schedule where there are stages."""
        fit, strategy = self.fit, self.strategy
        if fit.pipeline is None:
            return call()
        if name == "predict_step":
            return PipelineParallel.predict(fit.pipeline, call, fit.tensor_parallel)
        batch_idx = args[1] if len(args) > 1 else kwargs.get("batch_idx", 0)
        return fit.stages.step(fit.pipeline, call, name, batch_idx, train, fit.running() if train else None,
                               strategy.lightning_module, strategy.optimizers, fit.tensor_parallel,
                               loss_scaler(strategy.precision_plugin))

    def pre_backward(self, closure_loss: Tensor) -> None:
        if self.fit.pipeline is not None:
            restore_zero_grad(self.strategy.lightning_module)
        if session := self.fit.running():
            session.pre_backward(closure_loss)

    @contextmanager
    def no_sync(self) -> Generator[None, None, None]:
        """Inner steps of gradient accumulation: gradients accumulate in the buckets, nothing is sent."""
        with session.no_sync() if (session := self.fit.running()) else nullcontext():
            yield

    def post_backward(self) -> None:
        # The engine's autograd callback has normally synchronized already; this catches a backward that ended
        # without reaching it.
        if session := self.fit.running():
            session.engine.finish()

    def optimizer_step(self, optimizer: Optimizer, closure: Callable[[], Any],
                       step: Callable[[Callable[[], Any]], Any]) -> Any:
        """``step(closure)`` (Lightning's optimizer step), through the fit's session."""
        closure = self.fit.tensor_parallel.named_backward(closure)
        session = self.fit.running()
        return (session.optimizer_step(optimizer, closure, step, loss_scaler(self.strategy.precision_plugin))
                if session else step(closure))
