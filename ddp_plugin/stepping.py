"""How Lightning's calls during an epoch reach the fit's session and the parallelisms' components: each
``*_step`` (through the pipeline's schedule where there are stages, with a failed tensor-parallel collective
named by the split module it was in), the backward's hooks, gradient accumulation and the optimizer step. A mixin
of ``HierarchicalZeroStrategy``; outside a ``fit`` each does what Lightning's ``ParallelStrategy`` does."""

from __future__ import annotations

from collections.abc import Callable, Generator
from contextlib import contextmanager, nullcontext
from typing import TYPE_CHECKING, Any

from lightning.pytorch.strategies.parallel import ParallelStrategy
from torch import Tensor
from torch.optim import Optimizer
from typing_extensions import override

from ddp_plugin.parallel.components import PipelineParallel, TensorParallel, restore_zero_grad
from ddp_plugin.precision import loss_scaler

if TYPE_CHECKING:
    import lightning.pytorch as pl
    from torch.nn import Module

    from ddp_plugin.parallel.pipeline import PipelineRunner
    from ddp_plugin.session import FitSession


class StepRouting(ParallelStrategy):
    """The step methods of ``HierarchicalZeroStrategy``."""

    _tensor_parallel: TensorParallel
    _stages: PipelineParallel | None
    _pipeline: PipelineRunner | None
    _running: Callable[[], FitSession | None]  # (FitInspection's)

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        if session := self._running():
            session.before_training_step(self.model, args[0] if args else None)
        if self._pipeline is not None:
            return self._pipelined("training_step", args, kwargs, train=True)
        with self._tensor_parallel.diagnosed("the forward"):  # (the tensor-parallel collectives inside)
            return super().training_step(*args, **kwargs)

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._pipelined("validation_step", args, kwargs, train=False)

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._pipelined("test_step", args, kwargs, train=False)

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._pipelined("predict_step", args, kwargs, train=False)

    def _pipelined(self, step: str, args: tuple[Any, ...], kwargs: dict[str, Any], train: bool) -> Any:
        """Lightning's ``step``, through the pipeline's schedule where there are stages."""
        def call() -> Any:
            return getattr(super(StepRouting, self), step)(*args, **kwargs)

        if self._pipeline is None:
            return call()
        if step == "predict_step":
            return PipelineParallel.predict(self._pipeline, call, self._tensor_parallel)
        batch_idx = args[1] if len(args) > 1 else kwargs.get("batch_idx", 0)
        return self._stages.step(
            self._pipeline, call, step, batch_idx, train, self._running() if train else None, self.lightning_module,
            self.optimizers, self._tensor_parallel, loss_scaler(self.precision_plugin))

    @override
    def pre_backward(self, closure_loss: Tensor) -> None:
        if self._pipeline is not None:
            restore_zero_grad(self.lightning_module)
        if session := self._running():
            session.pre_backward(closure_loss)

    @contextmanager
    @override
    def block_backward_sync(self) -> Generator[None, None, None]:
        """Inner steps of gradient accumulation: gradients accumulate in the buckets, nothing is sent."""
        with session.no_sync() if (session := self._running()) else nullcontext():
            yield

    @override
    def post_backward(self, closure_loss: Tensor) -> None:
        # The engine's autograd callback has normally synchronized already; this catches a backward that ended
        # without reaching it.
        if session := self._running():
            session.engine.finish()

    @override
    def optimizer_step(self, optimizer: Optimizer, closure: Callable[[], Any],
                       model: pl.LightningModule | Module | None = None, **kwargs: Any) -> Any:
        def step(closure: Callable[[], Any]) -> Any:
            return super(StepRouting, self).optimizer_step(optimizer, closure, model, **kwargs)

        closure = self._tensor_parallel.named_backward(closure)
        session = self._running()
        return (session.optimizer_step(optimizer, closure, step, loss_scaler(self.precision_plugin)) if session
                else step(closure))
