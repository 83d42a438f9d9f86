"""Tensor parallelism and pipeline stages as the strategy sees them (the contract: :mod:`ddp_plugin.parallel`).

- :class:`TensorParallel`: before ``setup`` touches the module, the checks of the flags and of what
  ``configure_model`` did, and the ties it broke restored; during the fit, which split module a failed collective
  was in (a forward, a backward), so the diagnosis names it.
- :class:`PipelineParallel`: this rank's stages kept (on the meta device where the model was built there) and the
  parameters several stages hold found; once materialized, the schedule's runner; each ``*_step`` with the
  model's call running the schedule.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Generator, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import torch
from lightning.pytorch.utilities.model_helpers import is_overridden

from ddp_plugin.health import diagnosed
from ddp_plugin.hookspecs import is_tensor_parallel_shard
from ddp_plugin.hookspecs.tensors import PIPELINE_COPIES_ATTRIBUTE
from ddp_plugin.parallel import pipeline, stages, tensor_parallel
from ddp_plugin.parallel import ties as stage_ties

if TYPE_CHECKING:
    import lightning.pytorch as pl
    from torch import Tensor
    from torch.nn import Module
    from torch.optim import Optimizer

    from ddp_plugin.strategy.config import StrategyConfig
    from ddp_plugin.strategy.process_groups import ProcessGroups
    from ddp_plugin.runtime.topology import Layout
    from ddp_plugin.strategy.session import FitSession

log = logging.getLogger(__name__)


class TensorParallel:
    """Tensor parallelism (``configure_model``'s ``parallelize_module`` on ``device_mesh["tensor_parallel"]``)."""

    def __init__(self) -> None:
        self.ties: list[tuple[str, ...]] = []
        """The module's shared parameters before ``configure_model`` ran (it may break them)."""
        self.whereabouts: tensor_parallel.Whereabouts | None = None

    def before_configure_model(self, module: pl.LightningModule | None, size: int) -> bool:
        """Before ``configure_model`` runs: refuse a ``size`` above 1 without one, and take note of the ties it
        may break (:func:`tensor_parallel.restore_ties`). Whether the module needs the device mesh (it overrides
        ``configure_model``, which reads it)."""
        configures = module is not None and is_overridden("configure_model", module)
        if size > 1 and not configures:
            raise TypeError(
                f"`tensor_parallel_size={size}` needs a LightningModule that overrides `configure_model` and splits"
                " its layers there on `self.device_mesh['tensor_parallel']` (`parallelize_module`, as for"
                " Lightning's ModelParallelStrategy); without it every rank would hold the whole model. Add"
                " `configure_model`, or set `tensor_parallel_size=1`."
            )
        self.ties = tensor_parallel.shared_parameters(module) if configures else []
        return configures

    def prepare(self, model: Module, groups: ProcessGroups, config: StrategyConfig) -> None:
        """After ``configure_model``, before anything is allocated: refuse what cannot work, tie again what it
        untied."""
        tensor_parallel.check_flags(groups.topology.tensor_parallel_size, config.zero_stage, config.compression)
        tensor_parallel.check_module(model, groups.device_mesh()["tensor_parallel"] if groups.has_device_mesh
                                     else None)
        for group in tensor_parallel.restore_ties(model, self.ties):
            log.info("ddp_plugin: %s tied again after `configure_model`", " = ".join(group))

    def watch(self, model: Module) -> None:
        """Follow which split module the model is in (for the diagnosis), once it is set up."""
        self.forget()
        if tensor_parallel.has_tensor_parallel_parameters(model):
            self.whereabouts = tensor_parallel.Whereabouts(model)

    def forget(self) -> None:
        if self.whereabouts is not None:
            self.whereabouts.remove()
            self.whereabouts = None

    def phase(self, outside: str) -> str:
        """The phase a failed collective was in: a split module's forward or backward where one was, else
        ``outside``."""
        return self.whereabouts.phase(outside) if self.whereabouts is not None else outside

    @contextmanager
    def diagnosed(self, outside: str, always: bool = False) -> Generator[None, None, None]:
        """A failed collective inside diagnosed and named by the split module it was in, else ``outside``
        (without tensor parallelism: only with ``always``)."""
        if self.whereabouts is None and not always:
            yield
            return
        if self.whereabouts is not None:
            self.whereabouts.where = None
        with diagnosed(lambda: self.phase(outside)):
            yield
        if self.whereabouts is not None:
            self.whereabouts.where = None  # (a backward's split modules are marked as their backward starts)

    def named_backward(self, closure: Callable[[], Any]) -> Callable[[], Any]:
        """Lightning's closure (training step, backward) with a failed collective of the backward named. (Around
        the closure and not in an override of ``backward``: Lightning's tests wrap ``Strategy.backward`` in a mock
        that calls the strategy's own, which would recurse.)"""
        if self.whereabouts is None:
            return closure

        def closure_with_phases() -> Any:
            with diagnosed(lambda: self.phase("the backward")):
                return closure()

        return closure_with_phases


class PipelineParallel:
    """Pipeline stages (``pipeline_parallel_size`` > 1) on the mesh's ``"pipeline_parallel"`` dimension."""

    def __init__(self, config: StrategyConfig, groups: ProcessGroups) -> None:
        self.config = config
        self.groups = groups

    def split(self, module: pl.LightningModule, device: torch.device) -> list[stage_ties.Tie]:
        """Keep this rank's stages of the module (split once per module: a second ``fit`` finds it split) and find
        the parameters several stages hold. Collective (the ties' groups)."""
        layout, topology = self.groups.layout, self.groups.topology
        stages.check_module(module, layout.pipeline_parallel_size)
        split = getattr(module, "_ddp_plugin_stages", None)
        if split is None:
            timer = None
            if self.config.pipeline_split == "time":  # the blocks timed on the data's first microbatch
                timer = stages.fit_timer(module, device, self.config.pipeline_microbatches
                                         or self.groups.layout.pipeline_parallel_size)
            plan = stages.plan_stages(module, self.config.pipeline_stages, self.config.pipeline_split, timer)
            shared = tensor_parallel.shared_parameters(module)
            split_ties = [t.names for t in stage_ties.find_ties(shared, plan, layout.pipeline_parallel_size)
                          if is_tensor_parallel_shard(module.get_parameter(t.names[0]))]
            if split_ties:  # (decided from the whole module: the same on every rank)
                raise NotImplementedError(
                    f"{' = '.join(f'`{n}`' for n in split_ties[0])} is split over the tensor-parallel ranks and held"
                    " by two pipeline stages (an embedding split by vocabulary and tied to the output head): not"
                    " supported with `pipeline_parallel_size` > 1 yet. Replicate it over the tensor-parallel ranks"
                    " (leave it out of the `parallelize_module` plan), or untie it."
                )
            order = [name for name, _ in module.named_parameters()]
            mine = range(topology.pipeline_parallel_rank, plan.num_stages, layout.pipeline_parallel_size)
            stages.split_module(module, plan, mine)
            split = module._ddp_plugin_stages = (plan, shared, order)
        plan, shared, _ = split
        ties = stage_ties.find_ties(shared, plan, layout.pipeline_parallel_size)
        held = dict(module.named_parameters(remove_duplicate=False))
        for tie in ties:
            tie.group = self.groups.stage_peers(tie.ranks)  # (every rank: creating groups is collective)
            if topology.pipeline_parallel_rank in tie.ranks:
                tie.param = next(held[name] for name in tie.names if name in held)
                setattr(tie.param, PIPELINE_COPIES_ATTRIBUTE, len(tie.ranks))
        if ties:
            log.info("ddp_plugin: shared across pipeline stages: %s", "; ".join(" = ".join(t.names) for t in ties))
        return ties

    def start(self, module: pl.LightningModule, ties: list[stage_ties.Tie], device: torch.device
              ) -> pipeline.PipelineRunner:
        """The schedule's runner over this rank's stages, once they are materialized."""
        topology = self.groups.topology
        plan, _, order = module._ddp_plugin_stages
        p = self.groups.layout.pipeline_parallel_size
        runner = pipeline.PipelineRunner(
            module, plan, self.config.pipeline_schedule, self.config.pipeline_microbatches or p, p,
            topology.pipeline_parallel_rank, topology.pipeline_parallel_group, device, ties, order,
            # the mean loss travels on a group of its own, beside the schedule's last sends
            loss_group=self.groups.stage_peers(tuple(range(p))), timeout=self.config.timeout,
            activations=self.config.pipeline_activations, nodes=stage_nodes(self.groups.layout))
        runner.call_outside_steps()  # (Lightning's model summary runs `example_input_array` through the module)
        return runner

    def step(self, runner: pipeline.PipelineRunner, call: Callable[[], Any], step: str, batch_idx: int,
             train: bool, session: FitSession | None, module: pl.LightningModule, optimizers: Sequence[Optimizer],
             tp: TensorParallel, scaler: Any) -> Any:
        """The user's ``step`` (``call``) with the model's call and ``pipeline_loss`` running the schedule (forward
        and, with a ``session``, backward of every microbatch, then the data-parallel sync of this stage)."""
        if session is not None:
            # Lightning zeroes the gradients between the training step and its backward, at the start of each
            # accumulation window; here the backward runs inside the step. So the zeroing (the module's own
            # `optimizer_zero_grad`) comes first, and Lightning's call after the step does nothing.
            restore_zero_grad(module)
            if batch_idx % module.trainer.accumulate_grad_batches == 0:
                for optimizer in optimizers:
                    module.optimizer_zero_grad(module.trainer.current_epoch, batch_idx, optimizer)
                module.optimizer_zero_grad = _no_zero_grad

        def schedule(output: pipeline.PipelineOutput, target: Any, scale: float) -> Tensor:
            # Its sends and receives, the tensor-parallel collectives inside the stages, the loss broadcast.
            with tp.diagnosed(f"the pipeline schedule of stage {runner.rank}", always=True):
                return runner.run(output, target, train=train, scale=scale, loss_scaler=scaler if train else None)

        def run(output: pipeline.PipelineOutput, target: Any) -> Tensor:
            if session is None:
                return schedule(output, target, 1.0)
            engine = session.engine
            # The loss scaled as Lightning scales it before its backward, which the schedule replaces.
            scale = session.sample_weight() / module.trainer.accumulate_grad_batches
            synchronizing, engine.require_sync = engine.require_sync, False
            try:
                loss = schedule(output, target, scale)
            finally:
                engine.require_sync = synchronizing
            if synchronizing:
                topology = self.groups.topology
                with diagnosed("the pipeline stage's gradient sync"):
                    # (summed during the sync, 1/D per data-parallel rank; not in a sync mode,
                    # whose nodes hold different replicas between syncs)
                    runner.synchronize(engine, None if self.config.sync_every > 1
                                       else (topology.side_world_group, topology.world_size, topology.rank))
            # Lightning's backward of the returned loss reaches no parameter: the schedule ran every microbatch's.
            return loss.requires_grad_()

        with runner.placeholders(run) as ran:
            output = call()
        if not ran[0]:
            raise TypeError(
                f"With `pipeline_parallel_size` > 1, `{step}` must compute its loss as"
                " `self.pipeline_loss(self.model(x), y)`: the strategy runs the pipeline there (docs/pipeline.md)."
            )
        return output

    @staticmethod
    def predict(runner: pipeline.PipelineRunner, call: Callable[[], Any], tp: TensorParallel) -> Any:
        """``predict_step`` (``call``) with the model's call running a forward-only schedule; its output, on the
        last stage, is sent to every stage (docs/pipeline.md)."""

        def forward(*inputs: Any, **named: Any) -> Any:
            with tp.diagnosed(f"the pipeline schedule of stage {runner.rank}", always=True):
                return runner.predict(inputs, named)

        with runner.model_call(forward):
            return call()


def stage_nodes(layout: Layout) -> list[int]:
    """The node each pipeline rank's stage starts on (a stage is whole nodes or a part of one node)."""
    return [p * layout.stage_size // layout.ranks_per_node for p in range(layout.pipeline_parallel_size)]


def _no_zero_grad(*args: Any, **kwargs: Any) -> None:
    """In place of ``optimizer_zero_grad`` between a pipelined training step and its backward (which reaches no
    parameter)."""


def restore_zero_grad(module: Any) -> None:
    """The module's own ``optimizer_zero_grad`` back, after a pipelined training step."""
    if module.__dict__.get("optimizer_zero_grad") is _no_zero_grad:
        del module.__dict__["optimizer_zero_grad"]

