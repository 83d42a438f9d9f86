"""``HierarchicalZeroStrategy``: the Lightning side. It follows the Trainer's lifecycle and turns Lightning's
calls into hook calls; tensors and collectives are the plugins' business. Its settings are one validated
:class:`~ddp_plugin.config.StrategyConfig`, its process groups a :class:`~ddp_plugin.process_groups.
ProcessGroups`, what exists during a ``fit`` a :class:`~ddp_plugin.session.FitSession`, and its checkpoint
methods come from :class:`~ddp_plugin.checkpointing.CheckpointRouting`.

(Over 400 lines for a reason: about 90 of them are the class docstring's flags, which LightningCLI and
jsonargparse read for ``--help``, and each parallelism's part of the lifecycle is a component of
:mod:`ddp_plugin.parallel.components` that the methods here only call.)"""

from __future__ import annotations

import functools
import logging
import os
import sys
from collections.abc import Callable, Generator, Iterable
from contextlib import contextmanager, nullcontext
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Literal

import torch
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.strategies import _StrategyRegistry
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.model_helpers import is_overridden
from torch import Tensor
from torch.optim import Optimizer
from typing_extensions import override

from ddp_plugin import activation_checkpointing, cpu_memory, pretrained
from ddp_plugin.parallel import tensor_parallel
from ddp_plugin.parallel.ties import Tie, sync_ties
from ddp_plugin.checkpoint_io import AtomicCheckpointIO
from ddp_plugin.checkpointing import CheckpointRouting
from ddp_plugin.config import CONFIG_FLAGS, UNSET, StrategyConfig, flag_names
from ddp_plugin.environment import DistributedEnvironment
from ddp_plugin.inspection import FitInspection
from ddp_plugin.materialize import Deferred, has_meta_tensors, materialize
from ddp_plugin.parallel.components import PipelineParallel, TensorParallel, restore_zero_grad
from ddp_plugin.precision import ShardedGradientClipping, loss_scaler, with_sharded_clipping
from ddp_plugin.process_groups import ProcessGroups, check_ranks_per_node
from ddp_plugin.session import FitSession

if TYPE_CHECKING:
    from ddp_plugin.planning import CommPlan
    import lightning.pytorch as pl
    import pluggy
    from torch.distributed.device_mesh import DeviceMesh
    from torch.nn import Module

    from ddp_plugin.engine import GradientEngine
    from ddp_plugin.parallel.pipeline import PipelineRunner
    from ddp_plugin.hookspecs import Topology

log = logging.getLogger(__name__)
_FLAGS = frozenset(flag_names())


class HierarchicalZeroStrategy(CheckpointRouting, FitInspection, DistributedEnvironment):
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
        prefetch_units: stage 3: how many units' all-gathers run ahead of the unit computing, during forward
            and backward (0, 1 as FSDP, 2 by default: measured 1.12-1.20x ``ddp``'s step against 1.32-1.37x with 1);
            each one holds a gathered unit more.
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
            the ranks of a node, as ``ModelParallelStrategy``'s default). The module's
            ``configure_model`` parallelizes itself on ``self.device_mesh["tensor_parallel"]`` as for Lightning's
            ``ModelParallelStrategy``; every data-parallel feature above then runs over the
            ``"data_parallel"`` dimension, on the local shards (docs/tensor_parallel.md).
        pipeline_parallel_size: pipeline stages (default 1: none): the model's block list is split into this many
            runs balanced by parameter count, run by a ``torch.distributed.pipelining`` schedule; the mesh becomes
            ``("pipeline_parallel", "data_parallel", "tensor_parallel")``, and every data-parallel feature runs per
            stage (docs/pipeline.md).
        pipeline_microbatches: microbatches per batch (default: the number of stages); a data-parallel rank's
            batch must split into them evenly.
        pipeline_schedule: ``"1f1b"`` (default), ``"gpipe"`` or ``"interleaved_1f1b"``.
        pipeline_virtual_stages: stages per rank with ``"interleaved_1f1b"`` (default 2).
        pipeline_split: how the blocks split into stages: ``"parameters"`` (balanced by parameter count, the
            default), ``"time"`` (by compute, each block timed at setup on ``example_input_array``), ``"uniform"``
            (by block count), ``"type:<regex>"`` (by the count of blocks whose class name matches), or the module
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

    # ------------------------------------------------------------------ properties

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

    @property
    def device_mesh(self) -> DeviceMesh:
        """Lightning's ``("data_parallel", "tensor_parallel")`` mesh, as ``ModelParallelStrategy`` has it; the
        LightningModule reads it as ``self.device_mesh`` in ``configure_model``. Made when the processes connect,
        for a module that overrides ``configure_model`` or a ``tensor_parallel_size`` above 1."""
        if self._groups is None or not self._groups.has_device_mesh:
            raise RuntimeError(
                "The device mesh exists once the processes have connected, for a LightningModule that overrides"
                " `configure_model` (or with `tensor_parallel_size` > 1); read it in `configure_model`."
            )
        return self._groups.device_mesh()

    @property
    def topology(self) -> Topology | None:
        return self._groups.topology if self._groups is not None else None

    @property
    def plugin_manager(self) -> pluggy.PluginManager | None:
        """The pluggy plugin manager of the current or last ``fit`` (``None`` before the first)."""
        return self._session.plugin_manager if self._session is not None else None

    @property
    def engine(self) -> GradientEngine | None:
        """The gradient engine of the current ``fit`` (``None`` outside of it)."""
        return self._session.engine if self._running() else None

    @property
    def comm_plan(self) -> CommPlan | None:
        """What the link probe measured and decided, per bucket (docs/adaptive.md); ``None`` when nothing was left
        to decide (one rank, or every choice set by a flag) or before the first ``fit``."""
        return self._session.comm_plan if self._session is not None else None

    @property
    def uses_hierarchical_reducer(self) -> bool:
        """Whether gradients are reduced in node, cross-node and gather stages (decided once the layout is known;
        during a ``fit`` whose plan chooses per bucket: whether any bucket may be)."""
        if self._session is not None:
            return self._session.hierarchical
        return self._hierarchical_by_flags()

    def _hierarchical_by_flags(self) -> bool:
        if self.config.hierarchical is not None:
            return self.config.hierarchical
        layout = self._layout().data_parallel_layout
        return layout.num_nodes > 1 and layout.ranks_per_node > 1

    # ------------------------------------------------------------------ setup / teardown

    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        self._groups = None
        self._materialized = False
        module = self.lightning_module
        tp = self._layout().tensor_parallel_size
        if tp > 1 and (module is None or not is_overridden("configure_model", module)):
            raise TypeError(
                f"`tensor_parallel_size={tp}` needs a LightningModule that overrides `configure_model` and splits its"
                " layers there on `self.device_mesh['tensor_parallel']` (`parallelize_module`, as for Lightning's"
                " ModelParallelStrategy); without it every rank would hold the whole model. Add `configure_model`,"
                " or set `tensor_parallel_size=1`."
            )
        self._tensor_parallel.ties = []
        if module is not None and is_overridden("configure_model", module):
            # `configure_model` runs between this and `setup`, and reads the mesh; the ties it may break are
            # taken note of before (tensor_parallel.restore_ties).
            self._tensor_parallel.note_ties(module)
            self._connect()
            module._device_mesh = self._groups.device_mesh()

    def _connect(self) -> None:
        """The process groups and meshes of the layout. Collectives, so not in `setup_environment` for a module
        that needs no device mesh: that (as DDPStrategy's) only creates the process group, and code that mocks its
        creation, as Lightning's tests do, must not reach a collective."""
        if self.config.devices_per_node is None:  # simulated nodes: the user chose the layout on purpose
            check_ranks_per_node(self.cluster_environment, self.num_processes, self.world_size)
        self._groups = ProcessGroups.get(self._layout(), self.root_device, self._backend, self.config.timeout)

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
        # torchtitan's order: the module was built (on meta under `init_module(empty_init=True)`) and parallelized
        # by its `configure_model`; it is split into stages, materialized, made equal on its replicas, and sharded
        # by the fit's session.
        assert self.accelerator is not None and self.model is not None
        if self._groups is None:
            self._connect()
        self.accelerator.setup(trainer)
        fitting = trainer.state.fn == TrainerFn.FITTING
        groups, config = self._groups, self.config
        self._tensor_parallel.prepare(self.model, groups, config)
        weights = pretrained.first_plan(self.lightning_module, config.pretrained, trainer.ckpt_path)
        stages = self._stages = (PipelineParallel(config, groups) if groups.topology.pipeline_parallel_size > 1
                                 else None)
        policy = config.activation_checkpointing_policy
        if policy is not None and not hasattr(self.model, "_ddp_plugin_stages"):
            activation_checkpointing.check_present(self.model, policy)  # (the whole model, before a split)
        ties = stages.split(self.lightning_module, self.root_device) if stages is not None else []
        self._wrap(fitting)
        deferred = self._materialize(fitting, weights, ties)
        self._pipeline = stages.start(self.lightning_module, ties, self.root_device) if stages is not None else None
        self._tensor_parallel.watch(self.model)
        if fitting:
            self._start_session([t.param for t in ties if t.param is not None], deferred)
            self.units_initialized = deferred.groups if deferred is not None else 0
            if deferred is not None:
                log.info("ddp_plugin: ZeRO stage 3 allocated and initialized the model unit by unit (%d units)",
                         deferred.groups)
            self.setup_optimizers(trainer)
            for optimizer in self.optimizers:
                if self._pipeline is not None:  # (before a sharder replaces them with its pieces)
                    self._pipeline.checkpoint.note_optimizer(optimizer)
                self._session.plugin_manager.hook.on_setup_optimizer(optimizer=optimizer)
        self.setup_precision_plugin()
        if fitting:
            _optimizers_to_device(self.optimizers, self.root_device)

    def _wrap(self, fitting: bool) -> None:
        """Activation checkpointing, Lightning's layer sync (``sync_batchnorm``) and the precision's conversion."""
        policy = self.config.activation_checkpointing_policy
        if policy is not None:
            checkpointed = activation_checkpointing.apply(self.model, policy)
            log.info("ddp_plugin: activation checkpointing on %d modules of this rank (%s)", len(checkpointed),
                     ", ".join(checkpointed[:3]) + (", ..." if len(checkpointed) > 3 else ""))
        if fitting and self._layer_sync:
            self.model = self._layer_sync.apply(self.model)
        self.precision_plugin.convert_module(self.model)

    def _materialize(self, fitting: bool, weights: pretrained.Plan | None, ties: list[Tie]
                     ) -> Deferred | None:
        """Allocate and initialize what is left on the meta device, read ``pretrained=`` weights, and start every
        replica from the first one's values: each shard from data-parallel rank 0 of its tensor-parallel position,
        each pipeline stage from its first rank, every copy of a parameter several stages hold from the first
        stage. At ZeRO stage 3 (in ``fit``) the trainable parameters are left without memory, for the sharder to
        allocate and initialize unit by unit (the returned :class:`Deferred`; ``ddp_plugin.materialize``)."""
        topology, deferred = self._groups.topology, None
        if has_meta_tensors(self.model):
            # (each rank draws its own values; replicas and tied copies are made equal below)
            later = ([p for p in self.model.parameters() if p.requires_grad]
                     if fitting and self.config.zero_stage == 3 and weights is None and not ties else ())
            deferred = materialize(self.model, self.root_device, seed_offset=self.global_rank, deferred=later)
            self._materialized = True
        self.model_to_device()
        if weights is not None:  # (before replicas and tied copies are made equal: a tie's first copy wins)
            read = pretrained.load(self.lightning_module, weights, topology.world_group)
            log.info("ddp_plugin: %d tensors of this rank read from %s", read, weights.path)
        replicas = functools.partial(tensor_parallel.sync_tensors, data_parallel_group=topology.world_group,
                                     plain_group=self._groups.bookkeeping if topology.pipeline_parallel_size > 1
                                     else None)
        tensor_parallel.sync_module_states(self.model, **replicas.keywords)
        sync_ties(ties)
        if deferred is not None:
            deferred.sync = replicas  # (the sharder's units, as it allocates them)
        return deferred

    def _start_session(self, solo: Iterable[torch.nn.Parameter] = (), deferred: Deferred | None = None) -> None:
        if self._running():
            self._session.close()  # a setup without teardown (as some of Lightning's tests do)
        release = self.config.release_cpu_memory
        wanted = self.config.zero_stage >= 2 if release is None else release
        if wanted and self.root_device.type == "cpu" and cpu_memory.release_freed_buffers():
            log.info("ddp_plugin: glibc's mmap threshold fixed at 1 MiB (release_cpu_memory)")
        self._session = FitSession(self.config, self.model, self._groups.topology, self._groups.bookkeeping,
                                   self.root_device, self._hierarchical_by_flags(), self.memory_bytes,
                                   node_flags_group=self._groups.node_bookkeeping, layout=self._groups.layout,
                                   tensor_parallel_peers=self._groups.tensor_parallel_peers, solo=solo,
                                   extra_plugins=[deferred] if deferred is not None else [])
        if self._pipeline is not None:
            # (the schedule's sends counted in the traffic metrics; the tied sums through the codec, if any)
            self._pipeline.attach(self._session.comm, self._session.plugin_manager.hook
                                  if self._session.options.cross_node_codec is not None else None)
        if self._pending_plugin_state is not None:
            self._session.load_plugin_state(*self._pending_plugin_state)
            self._pending_plugin_state = None

    @override
    def teardown(self) -> None:
        # Lightning tears down inside its `except` when the fit failed: then the error the user reads must stay the
        # first one. Each step runs on its own, and one that fails too is logged, not raised.
        failing = sys.exc_info()[1]
        ProcessGroups.failed = failing is not None
        self._tensor_parallel.forget()
        if self._running():
            _after(failing, lambda: self._session.close(failed=failing is not None))
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
        for step in (self.cluster_environment.teardown,
                     lambda: _optimizers_to_device(self.optimizers, torch.device("cpu")),
                     module.cpu if move else (lambda: None),
                     self.precision_plugin.teardown, self.accelerator.teardown, self.checkpoint_io.teardown):
            _after(failing, step)

    def release_process_groups(self) -> None:
        """At interpreter exit: drop the fit's plugins and engine and the groups (see ddp_plugin.process_groups)."""
        if self._session is not None:
            self._session.heartbeat.stop()
        self._session = None
        self._pipeline = None
        self._groups = None

    @override
    def model_to_device(self) -> None:
        assert self.model is not None
        self.model.to(self.root_device)

    # ------------------------------------------------------------------ training

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
        if self._pipeline is not None:
            return self._pipelined("validation_step", args, kwargs, train=False)
        return super().validation_step(*args, **kwargs)

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        if self._pipeline is not None:
            return self._pipelined("test_step", args, kwargs, train=False)
        return super().test_step(*args, **kwargs)

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        if self._pipeline is None:
            return super().predict_step(*args, **kwargs)
        def call() -> Any:
            return super(HierarchicalZeroStrategy, self).predict_step(*args, **kwargs)

        return PipelineParallel.predict(self._pipeline, call, self._tensor_parallel)

    def _pipelined(self, step: str, args: tuple[Any, ...], kwargs: dict[str, Any], train: bool) -> Any:
        session = self._running() if train else None

        def call() -> Any:
            return getattr(super(HierarchicalZeroStrategy, self), step)(*args, **kwargs)

        batch_idx = args[1] if len(args) > 1 else kwargs.get("batch_idx", 0)
        return self._stages.step(
            self._pipeline, call, step, batch_idx, train, session, self.lightning_module, self.optimizers,
            self._tensor_parallel, loss_scaler(self.precision_plugin))

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
            return super(HierarchicalZeroStrategy, self).optimizer_step(optimizer, closure, model, **kwargs)

        closure = self._tensor_parallel.named_backward(closure)
        session = self._running()
        return (session.optimizer_step(optimizer, closure, step, loss_scaler(self.precision_plugin)) if session
                else step(closure))

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


def _after(failing: BaseException | None, step: Callable[[], Any]) -> None:
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
