"""``HierarchicalZeroStrategy``: the Lightning side. It follows the Trainer's lifecycle and orchestrates: its
settings are one validated :class:`~ddp_plugin.config.StrategyConfig`, its process groups a
:class:`~ddp_plugin.process_groups.ProcessGroups`, each parallelism a component of
:mod:`ddp_plugin.parallel.components`, the setup's steps :mod:`ddp_plugin.assembly`, and what exists during a
``fit`` a :class:`~ddp_plugin.session.FitSession`, whose plugins do the tensors and collectives. Its methods
come from four mixins: :class:`~ddp_plugin.checkpointing.CheckpointRouting` (saving and loading),
:class:`~ddp_plugin.inspection.FitInspection` (what a user asks about the fit),
:class:`~ddp_plugin.stepping.StepRouting` (the steps, backward and optimizer step) and
:class:`~ddp_plugin.environment.DistributedEnvironment` (ranks, launcher, rendezvous, mesh); the class itself
holds the flags (about 90 lines of its docstring, which LightningCLI and jsonargparse read for ``--help``), the
setup and the teardown."""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Callable, Generator, Iterable
from contextlib import contextmanager
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Literal

import torch
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.strategies import _StrategyRegistry
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.trainer.states import TrainerFn
from torch.optim import Optimizer
from typing_extensions import override

from ddp_plugin import activation_checkpointing, assembly, pretrained
from ddp_plugin.checkpoint_io import AtomicCheckpointIO
from ddp_plugin.checkpointing import CheckpointRouting
from ddp_plugin.config import CONFIG_FLAGS, UNSET, StrategyConfig, flag_names
from ddp_plugin.environment import DistributedEnvironment
from ddp_plugin.inspection import FitInspection
from ddp_plugin.materialize import has_meta_tensors
from ddp_plugin.parallel import tensor_parallel
from ddp_plugin.parallel.components import PipelineParallel, TensorParallel
from ddp_plugin.precision import ShardedGradientClipping, with_sharded_clipping
from ddp_plugin.process_groups import ProcessGroups
from ddp_plugin.session import FitSession
from ddp_plugin.stepping import StepRouting

if TYPE_CHECKING:
    import lightning.pytorch as pl

    from ddp_plugin.parallel.pipeline import PipelineRunner

log = logging.getLogger(__name__)
_FLAGS = frozenset(flag_names())


class HierarchicalZeroStrategy(CheckpointRouting, FitInspection, StepRouting, DistributedEnvironment):
    """Data-parallel training for clusters whose inter-node links are the bottleneck: gradients are reduced
    inside each node, across nodes with 1/k of the data (optionally compressed), and optimizer state, gradients
    and parameters can be sharded (ZeRO), all by plugins behind a pluggy hook contract.

    The flags a DeepSpeed ``config`` can set (``zero_stage``, ``shard_scope``, ``bucket_size_mb``,
    ``compression``, ``gradient_clip_norm``) default to ``None``, "not set": the config's value if it has one,
    else the default below. Any other value passed wins over the config, also one equal to the default. Every
    flag is checked here, and a bad value fails naming the flag and the allowed values.

    Args:
        zero_stage: 0 (default, plain data parallel); 1 shards the optimizer state, 2 also the gradients, 3 also
            the parameters.
        shard_scope: ``"global"`` (default) shards over every rank; ``"node"`` over the ranks of a node, with a
            replica per node, so parameter all-gathers never cross the slow link (HSDP, ZeRO++ hpZ).
        auto_wrap_policy: stage 3 units: module classes (or names) whose instances become units, or a parameter
            count (default 1,000,000) modules are grouped into bottom-up. Containers are never units.
        prefetch_units: stage 3: units all-gathered ahead of the one computing (0, 1 as FSDP, 2 by default: 1.12-1.20x
            ``ddp``'s step against 1.32-1.37x with 1), each holding a gathered unit more.
        gradient_clip_norm: clip to this global 2-norm before every step; default none.
        checkpoint: ``"master"`` (one consolidated file from global rank 0, loadable anywhere) or ``"sharded"``
            (each rank writes its part through ``torch.distributed.checkpoint``; resharded on load).
        release_cpu_memory: give freed buffers of 1 MiB or more back to the OS at once (glibc's mmap
            threshold); ``None``: on at stages 2-3 on CPU.
        config: a DeepSpeed config (JSON path or dict) whose ZeRO settings become these flags; other keys are
            named in a warning.
        devices_per_node: ranks per node; ``None`` takes the launcher's. Set it to simulate nodes on one machine.
        hierarchical: reduce in node, cross-node and gather stages; ``None``: when there are several nodes of
            several ranks.
        compression: a built-in (``"fp16"``, ``"bf16"``, ``"int8"``, ``"topk"``, ``"powersgd"``) or installed
            codec's name, for the cross-node stage; default none.
        compression_options: the codec's options (a plugin of yours may read them without ``compression``).
        bucket_size_mb: gradient bucket capacity in MiB (default 25, at most 1 TiB).
        plugins: extra plugin objects; pluggy calls them before the built-ins.
        broadcast_buffers: broadcast module buffers from rank 0 before each training step, as DDP.
        progress_bar_metrics: also show the ``comm/...`` metrics in the progress bar.
        skip_nonfinite: skip the step on every rank when any rank's gradients hold NaN/Inf.
        weighting: ``"rank"`` (DDP's mean over ranks) or ``"sample"`` (weighted by each rank's batch size).
        process_group_backend: ``"nccl"``, ``"gloo"`` or ``"mpi"``; default by device and launcher.
        timeout: collective timeout, a ``timedelta`` or seconds; connecting waits at least 5 minutes.
        start_method: ``"popen"`` (default), ``"spawn"``, ``"fork"`` or ``"forkserver"``, as ``DDPStrategy``.
        sync_every: synchronize across nodes every this many optimizer steps (default 1: every step, as DDP);
            inside a node ranks stay synchronous (docs/sync.md).
        outer_optimizer: with ``sync_every > 1``: ``"nesterov"`` (DiLoCo: SGD, lr 0.7, Nesterov momentum 0.9, on
            the averaged parameter change; default), ``"average"`` (local SGD), or a callable building a torch
            optimizer over the outer parameters (in LightningCLI YAML a ``class_path`` with ``init_args``, as
            for the model's optimizer).
        sync_fragments: split the parameters into this many fragments synchronized on staggered steps
            (Streaming DiLoCo), so the link carries 1/F of them at a time; at most ``sync_every``.
        max_staleness: apply an outer sync this many steps after it starts, the next inner steps running
            meanwhile (0: wait for it); less than ``sync_every``.
        sync_warmup_steps: with ``sync_every > 1``: train the first this many optimizer steps synchronously,
            then start the sync mode from the model they reached (post-local SGD; DiLoCo starts from a
            synchronously trained model). Default 0.
        tensor_parallel_size: ranks of a node that split each layer between them (default 1: none; ``"auto"``: all
            the ranks of a node). The module's ``configure_model`` parallelizes itself on
            ``self.device_mesh["tensor_parallel"]`` as for Lightning's ``ModelParallelStrategy``; the data-parallel
            features run over ``"data_parallel"``, on the local shards (docs/tensor_parallel.md).
        pipeline_parallel_size: pipeline stages (default 1: none), run by a ``torch.distributed.pipelining``
            schedule; the mesh becomes ``("pipeline_parallel", "data_parallel", "tensor_parallel")``, and every
            data-parallel feature runs per stage (docs/pipeline.md).
        pipeline_microbatches: microbatches per batch (default: the number of stages); a data-parallel rank's
            batch must split into them evenly.
        pipeline_schedule: ``"1f1b"`` (default), ``"gpipe"`` or ``"interleaved_1f1b"``.
        pipeline_virtual_stages: stages per rank with ``"interleaved_1f1b"`` (default 2).
        pipeline_split: how the blocks split into stages: ``"parameters"`` (balanced by parameter count, the
            default), ``"time"`` (by compute, each block timed at setup on the data's first microbatch),
            ``"uniform"`` (by block count), ``"type:<regex>"`` (by the count of blocks whose class name matches), or the module
            names of each stage (``[["tok", "blocks.0"], ["blocks.1", "head"]]``).
        pipeline_activations: the dtype of the activations and their gradients sent between stages on
            different nodes: ``"fp32"`` (as computed, default), ``"bf16"`` or ``"fp16"`` (half the bytes),
            ``"int8"`` (a scale per row: about a quarter).
        activation_checkpointing_policy: module classes (or their names) whose activations are recomputed in
            the backward instead of kept, as ``FSDPStrategy``'s flag: e.g. ``{Block}``; with every layout
            (docs/activation_checkpointing.md). Default ``None``: off.
        pretrained: a Hugging Face style ``.safetensors`` file (or a folder of them) read into the model at its
            first ``setup``, after it is split and materialized: each rank reads only its stages and its
            tensor-parallel slices (docs/checkpoints.md). Skipped when ``ckpt_path`` resumes. Default ``None``.
        fault_tolerance: replica groups on torchft (a node each): a lost group does not stop the others, a returning
            one heals from a live peer; a mapping, or ``True`` for the environment's (docs/fault_tolerance.md).
    """

    strategy_name = "hierarchical_zero"

    def __init__(
        self,
        zero_stage: int | None = None,
        shard_scope: Literal["global", "node"] | None = None,
        auto_wrap_policy: Any = None,
        prefetch_units: int = 2,
        gradient_clip_norm: float | None = None,
        config: str | os.PathLike | dict[str, Any] | None = None,
        checkpoint: Literal["master", "sharded"] = "master",
        release_cpu_memory: bool | None = None,
        devices_per_node: int | None = None,
        hierarchical: bool | None = None,
        compression: str | None = None,
        compression_options: dict[str, Any] | None = None,
        bucket_size_mb: float | str | None = None,
        plugins: Iterable[object] = (),
        broadcast_buffers: bool = True,
        progress_bar_metrics: bool = False,
        skip_nonfinite: bool = False,
        weighting: Literal["rank", "sample"] = "rank",
        process_group_backend: str | None = None,
        timeout: timedelta | float | None = default_pg_timeout,
        start_method: Literal["popen", "spawn", "fork", "forkserver"] = "popen",
        sync_every: int = 1,
        outer_optimizer: str | Callable[[Iterable], Optimizer] = "nesterov",
        sync_fragments: int = 1,
        max_staleness: int = 0,
        sync_warmup_steps: int = 0,
        tensor_parallel_size: int | Literal["auto"] = 1,
        pipeline_parallel_size: int = 1,
        pipeline_microbatches: int | None = None,
        pipeline_schedule: Literal["1f1b", "gpipe", "interleaved_1f1b"] = "1f1b",
        pipeline_virtual_stages: int | None = None,
        pipeline_split: str | list[list[str]] = "parameters",
        pipeline_activations: Literal["fp32", "bf16", "fp16", "int8"] = "fp32",
        activation_checkpointing_policy: Any = None,
        pretrained: str | os.PathLike | None = None,
        fault_tolerance: dict[str, Any] | bool | None = None,
        accelerator: pl.accelerators.Accelerator | None = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision_plugin: Precision | None = None,
    ) -> None:
        flags = {k: v for k, v in locals().items() if k in _FLAGS}
        flags.update({k: UNSET for k in CONFIG_FLAGS if flags[k] is None})  # None: "not set" (see the docstring)
        self.config = StrategyConfig.from_flags(config, **flags)
        self._session: FitSession | None = None
        self._groups: ProcessGroups | None = None
        self._pending_plugin_state = None
        self._tensor_parallel = TensorParallel()
        self._stages: PipelineParallel | None = None
        self._pipeline: PipelineRunner | None = None
        """The schedule's runner over this rank's stages (``_stages``), once they are materialized."""
        self._materialized = False  # this fit's setup materialized a model built on the meta device
        self.units_initialized = 0
        """ZeRO stage 3 units this fit's setup allocated and initialized one by one (a model built on meta)."""
        super().__init__(accelerator=accelerator, parallel_devices=parallel_devices,
                         cluster_environment=cluster_environment, checkpoint_io=checkpoint_io,
                         precision_plugin=precision_plugin)
        ProcessGroups.track(self)

    def __getattr__(self, name: str) -> Any:
        # The flags read as attributes (`strategy.zero_stage`), as Lightning's strategies expose theirs.
        config = self.__dict__.get("config")
        if config is not None and name in _FLAGS:
            return getattr(config, name)
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    @property
    @override
    def checkpoint_io(self) -> CheckpointIO:
        if self._checkpoint_io is None:
            self._checkpoint_io = AtomicCheckpointIO()
        return self._checkpoint_io

    @checkpoint_io.setter
    def checkpoint_io(self, io: CheckpointIO) -> None:
        self._checkpoint_io = io

    @property
    @override
    def precision_plugin(self) -> Precision:
        # Clipping by norm must see every shard; the Trainer's choice of plugin is kept (see ddp_plugin.precision).
        plugin = self._precision_plugin if self._precision_plugin is not None else Precision()
        if not isinstance(plugin, ShardedGradientClipping) or plugin.clipping is not self:
            plugin = self._precision_plugin = with_sharded_clipping(plugin, self)
        return plugin

    @precision_plugin.setter
    def precision_plugin(self, plugin: Precision | None) -> None:
        self._precision_plugin = None if plugin is None else with_sharded_clipping(plugin, self)

    # ------------------------------------------------------------------ setup / teardown

    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        self._groups, self._materialized = None, False
        module = self.lightning_module
        if self._tensor_parallel.before_configure_model(module, self._layout().tensor_parallel_size):
            self._connect()  # (`configure_model` runs between this and `setup`, and reads the mesh)
            module._device_mesh = self._groups.device_mesh()

    @override
    @contextmanager
    def tensor_init_context(self, empty_init: bool | None = None) -> Generator[None, None, None]:
        if not empty_init:
            with super().tensor_init_context(empty_init):
                yield
            return
        # `trainer.init_module(empty_init=True)`: on the meta device, as ModelParallelStrategy and FSDPStrategy;
        # `setup` materializes and initializes what this rank holds once it is split, parallelized and (ZeRO-3)
        # about to be sharded.
        with torch.device("meta"), self.precision_plugin.tensor_init_context():
            yield

    @property
    @override
    def restore_checkpoint_after_setup(self) -> bool:
        # A model built on the meta device takes `fit(ckpt_path=...)`'s checkpoint once `setup` has materialized it
        # (as under ModelParallelStrategy): loaded before, its values would land in no memory and training would
        # start from the initialization instead.
        module = self.lightning_module
        return self._materialized or (module is not None and has_meta_tensors(module))

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        # torchtitan's order (ddp_plugin.assembly): parallelized by `configure_model`, split into stages, wrapped,
        # materialized and made equal on the replicas, then sharded by the fit's session.
        assert self.accelerator is not None and self.model is not None
        if self._groups is None:
            self._connect()
        self.accelerator.setup(trainer)
        fitting = trainer.state.fn == TrainerFn.FITTING
        groups, config, module, device = self._groups, self.config, self.lightning_module, self.root_device
        self._tensor_parallel.prepare(self.model, groups, config)
        weights = pretrained.first_plan(module, config.pretrained, trainer.ckpt_path)
        pipelined = groups.topology.pipeline_parallel_size > 1
        stages = self._stages = PipelineParallel(config, groups) if pipelined else None
        if config.activation_checkpointing_policy is not None and not hasattr(self.model, "_ddp_plugin_stages"):
            activation_checkpointing.check_present(self.model, config.activation_checkpointing_policy)  # (unsplit)
        ties = stages.split(module, device) if stages is not None else []
        self.model = assembly.wrap(self.model, config, self._layer_sync, self.precision_plugin, fitting)
        materialized, deferred = assembly.materialize(self.model, module, groups, config, device, fitting, weights,
                                                      ties, seed_offset=self.global_rank)
        self._materialized = self._materialized or materialized
        self._pipeline = stages.start(module, ties, device) if stages is not None else None
        self._tensor_parallel.watch(self.model)
        if fitting:
            if self._running():
                self._session.close()  # a setup without teardown (as some of Lightning's tests do)
            self._session = assembly.start_session(config, self.model, groups, device, self._hierarchical_by_flags(),
                                                   self.memory_bytes, self._pipeline, ties, deferred, module,
                                                   lambda: self.optimizers)
            if self._pending_plugin_state is not None:
                self._session.load_plugin_state(*self._pending_plugin_state)
                self._pending_plugin_state = None
            self.units_initialized = deferred.groups if deferred is not None else 0
            self.setup_optimizers(trainer)
            for optimizer in self.optimizers:
                if self._pipeline is not None:  # (before a sharder replaces them with its pieces)
                    self._pipeline.checkpoint.note_optimizer(optimizer)
                self._session.plugin_manager.hook.on_setup_optimizer(optimizer=optimizer)
        self.setup_precision_plugin()
        if fitting:
            _optimizers_to_device(self.optimizers, self.root_device)

    @override
    def teardown(self) -> None:
        # Lightning tears down inside its `except` when the fit failed: then the error the user reads must stay the
        # first one (ddp_plugin.assembly.after).
        failing = sys.exc_info()[1]
        ProcessGroups.failed = failing is not None
        self._tensor_parallel.forget()
        if self._pipeline is not None:
            self._pipeline.release()
        if self._running():
            assembly.after(failing, lambda: self._session.close(failed=failing is not None))
        module = self.lightning_module
        if module is not None and module._trainer is not None:
            if module.trainer.state.fn == TrainerFn.FITTING and self._layer_sync:
                self.model = self._layer_sync.revert(self.model)
        if failing is None:
            super().teardown()
            return
        # Lightning's teardown steps (ParallelStrategy's, then Strategy's). Moving the model to the CPU is skipped
        # for a tensor-parallel model: after a failed collective its DTensor parameters are still referenced by
        # the broken step's autograd graph, and `module.cpu()` fails ("Couldn't swap Linear.weight").
        move = module is not None and not tensor_parallel.has_tensor_parallel_parameters(module)
        assembly.teardown_after_failure(failing, (
            self.cluster_environment.teardown, lambda: _optimizers_to_device(self.optimizers, torch.device("cpu")),
            module.cpu if move else (lambda: None), self.precision_plugin.teardown, self.accelerator.teardown,
            self.checkpoint_io.teardown))

    def release_process_groups(self) -> None:
        """At interpreter exit: drop the fit's plugins and engine and the groups (see ddp_plugin.process_groups)."""
        if self._session is not None:
            self._session.heartbeat.stop()
        self._session = self._pipeline = self._groups = None

    @override
    def model_to_device(self) -> None:
        assert self.model is not None
        self.model.to(self.root_device)

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: _StrategyRegistry) -> None:
        entries = [
            ("hierarchical_zero", {}, "hierarchical data parallel, stage 0"),
            ("hierarchical_zero_spawn", {"start_method": "spawn"}, "hierarchical data parallel, spawn start method"),
        ] + [(f"hierarchical_zero_stage_{s}", {"zero_stage": s}, f"hierarchical data parallel, ZeRO stage {s}")
             for s in (1, 2, 3)]
        for name, init_params, description in entries:
            strategy_registry.register(name, cls, description=description, **init_params)

