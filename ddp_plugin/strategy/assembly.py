"""The steps of the strategy's ``setup`` and ``teardown`` between Lightning and the components, in torchtitan's
order: the module was built (on the meta device under ``trainer.init_module(empty_init=True)``) and parallelized by
its ``configure_model``; it is split into pipeline stages (:class:`~ddp_plugin.strategy.components.
PipelineParallel`), wrapped (:func:`wrap`), materialized and made equal on its replicas (:func:`materialize`),
and sharded by the fit's session (:func:`start_session`, whose ZeRO sharder allocates stage 3 units one by one).
The strategy calls them in that order; each takes what it needs as arguments, not the strategy."""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

import torch

from ddp_plugin import fault_tolerance

from ddp_plugin.checkpoints import pretrained

from ddp_plugin.runtime import cpu_memory

from ddp_plugin.parallel import activation_checkpointing
from ddp_plugin.parallel.materialize import Deferred, has_meta_tensors
from ddp_plugin.parallel.materialize import materialize as allocate
from ddp_plugin.parallel import tensor_parallel
from ddp_plugin.parallel.ties import Tie, sync_ties
from ddp_plugin.strategy.session import FitInputs, FitSession

if TYPE_CHECKING:
    from lightning.pytorch.plugins.precision import Precision
    from torch.nn import Module

    from ddp_plugin.strategy.config import StrategyConfig
    from ddp_plugin.strategy.process_groups import ProcessGroups

log = logging.getLogger(__name__)


def wrap(model: Module, config: StrategyConfig, layer_sync: Any, precision: Precision, fitting: bool) -> Module:
    """Activation checkpointing, Lightning's layer sync (``sync_batchnorm``) and the precision's conversion; the
    model to use from then on (the layer sync may replace it)."""
    policy = config.activation_checkpointing_policy
    if policy is not None:
        checkpointed = activation_checkpointing.apply(model, policy)
        log.info("ddp_plugin: activation checkpointing on %d modules of this rank (%s)", len(checkpointed),
                 ", ".join(checkpointed[:3]) + (", ..." if len(checkpointed) > 3 else ""))
    if fitting and layer_sync:
        model = layer_sync.apply(model)
    precision.convert_module(model)
    return model


def materialize(model: Module, module: Any, groups: ProcessGroups, config: StrategyConfig, device: torch.device,
                fitting: bool, weights: pretrained.Plan | None, ties: list[Tie], seed_offset: int
                ) -> tuple[bool, Deferred | None]:
    """Allocate and initialize what is left on the meta device, read ``pretrained=`` weights into the
    LightningModule ``module``, and start every replica from the first one's values: each shard from
    data-parallel rank 0 of its tensor-parallel position, each pipeline stage from its first rank, every copy of a
    parameter several stages hold from the first stage. At ZeRO stage 3 (in ``fit``) the trainable parameters
    are left without memory, for the sharder to allocate and initialize unit by unit (the returned
    :class:`Deferred`; ``ddp_plugin.parallel.materialize``). Returns whether anything was on the meta device, and that.
    Collective."""
    topology, deferred, materialized = groups.topology, None, False
    if has_meta_tensors(model):
        # (each rank draws its own values; replicas and tied copies are made equal below)
        later = ([p for p in model.parameters() if p.requires_grad]
                 if fitting and config.zero_stage == 3 and weights is None and not ties else ())
        deferred = allocate(model, device, seed_offset=seed_offset, deferred=later)
        materialized = True
    model.to(device)
    if weights is not None:  # (before replicas and tied copies are made equal: a tie's first copy wins)
        read = pretrained.load(module, weights, topology.world_group)
        log.info("ddp_plugin: %d tensors of this rank read from %s", read, weights.path)
    replicas = functools.partial(tensor_parallel.sync_tensors, data_parallel_group=topology.world_group,
                                 plain_group=groups.bookkeeping if topology.pipeline_parallel_size > 1 else None)
    tensor_parallel.sync_module_states(model, **replicas.keywords)
    sync_ties(ties)
    if deferred is not None:
        deferred.sync = replicas  # (the sharder's units, as it allocates them)
    return materialized, deferred


def releases_cpu_memory(config: StrategyConfig, device: torch.device) -> bool:
    """Whether freed CPU buffers go back to the OS (``release_cpu_memory``; ``None``: at stages 2-3)."""
    release = config.release_cpu_memory
    return (config.zero_stage >= 2 if release is None else release) and device.type == "cpu"


def trim_after_setup(config: StrategyConfig, device: torch.device) -> None:
    """Where freed buffers go back to the OS: what the setup freed on the C heap too (``malloc_trim``). Building a
    model on meta and materializing it unit by unit frees much of what it allocates, some of it before the
    threshold is fixed; those pages stayed resident through training (up to 140 MB a rank measured on the
    101M-parameter GPT, on some ranks and not others)."""
    if releases_cpu_memory(config, device):
        cpu_memory.trim()


def start_session(inputs: FitInputs) -> FitSession:
    """The fit's session over the set-up model, in order: glibc's threshold where freed buffers are to go back to the
    OS (``release_cpu_memory``), a way to keep members where ``fault_tolerance`` asks (this rank's place among the
    replica groups, healing ``inputs.module`` and ``inputs.optimizers()``), the session itself (its plugins:
    reducer, codec, sharder, sync mode; its engine: :class:`FitSession`'s phases), and the pipeline runner's sends
    counted in its traffic (the tied sums through its codec, if any)."""
    config, device, groups = inputs.config, inputs.device, inputs.groups
    if releases_cpu_memory(config, device) and cpu_memory.release_freed_buffers():
        log.info("ddp_plugin: glibc's mmap threshold fixed at 1 MiB (release_cpu_memory)")
    members = None
    if config.fault_tolerance is not None:
        members = fault_tolerance.fit_plugins(
            config.fault_tolerance, inputs.module, inputs.optimizers, groups.topology, device, config.timeout,
            per_step=config.sync_every == 1 or config.sync_warmup_steps > 0, ties=inputs.ties,
            sync_mode=config.sync_every > 1)
    session = FitSession(inputs, members)
    if inputs.deferred is not None:
        log.info("ddp_plugin: ZeRO stage 3 allocated and initialized the model unit by unit (%d units)",
                 inputs.deferred.groups)
    if inputs.runner is not None:
        inputs.runner.attach(session.comm, session.plugin_manager.hook if session.options.cross_node_codec is not None
                             else None)
    return session


def teardown_after_failure(failing: BaseException, steps: Iterable[Callable[[], Any]]) -> None:
    """Lightning's teardown ``steps`` after the fit failed with ``failing``: each runs on its own, and one that
    fails too is logged, not raised (the error the user reads stays the first one)."""
    for step in steps:
        after(failing, step)


def after(failing: BaseException | None, step: Callable[[], Any]) -> None:
    """Run a teardown ``step``; after a failure (``failing``, the error the fit raises), an error of its own is
    logged instead of raised."""
    if failing is None:
        step()
        return
    try:
        step()
    except Exception as err:  # noqa: BLE001 - the fit's own error is the one to report
        log.warning("ddp_plugin: teardown after %s also failed, not raised: %s: %s", type(failing).__name__,
                    type(err).__name__, err)
