"""``HierarchicalZeroStrategy``: the Lightning side. It follows the Trainer's lifecycle and orchestrates: its
settings are one validated :class:`~ddp_plugin.strategy.config.StrategyConfig`, what it holds between Lightning's calls one
:class:`~ddp_plugin.strategy.fit_state.FitState` (process groups, the parallelisms' components, the pipeline's runner, the
fit's :class:`~ddp_plugin.strategy.session.FitSession`, whose plugins do the tensors and collectives), the setup's steps
:mod:`ddp_plugin.strategy.assembly`. Its Lightning methods hand each call to a collaborator it builds:
:class:`~ddp_plugin.strategy.checkpointing.Checkpoints` (saving and loading), :class:`~ddp_plugin.strategy.stepping.Steps` (the steps,
backward and optimizer step), :mod:`ddp_plugin.strategy.inspection` (what a user asks about the fit) and
:mod:`ddp_plugin.strategy.environment` (ranks, launcher, rendezvous, mesh).

(About 700 lines: the flags' documentation (about 110 lines of the class docstring, generated from
:data:`~ddp_plugin.strategy.config.FLAGS`, which LightningCLI and jsonargparse read for ``--help``), the flags as
typed attributes, and one method per Lightning hook the strategy answers, most of them a delegation of two lines,
so that the class reads as Lightning's own strategies do: one class in one file.)"""

from __future__ import annotations

import functools
import logging
import os
import sys
from collections.abc import Callable, Generator, Iterable, Mapping
from contextlib import contextmanager
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Literal

import torch
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.utilities.seed import reset_seed
from lightning.fabric.utilities.types import ReduceOp
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies.parallel import ParallelStrategy
from lightning.pytorch.strategies.strategy import TBroadcast
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_only
from lightning_utilities.core.rank_zero import rank_zero_only as utils_rank_zero_only
from torch import Tensor
from torch.optim import Optimizer
from typing_extensions import override

from ddp_plugin.runtime import lightning_adapter
from ddp_plugin import health

from ddp_plugin.checkpoints import pretrained
from ddp_plugin.fault_tolerance import data as ft_data

from ddp_plugin.parallel import activation_checkpointing

from ddp_plugin.strategy import assembly, environment, inspection
from ddp_plugin.checkpoints.checkpoint_io import AtomicCheckpointIO
from ddp_plugin.strategy.checkpointing import Checkpoints
from ddp_plugin.strategy.config import CONFIG_FLAGS, UNSET, Flag, StrategyConfig, flag_names
from ddp_plugin.strategy.fit_state import FitState
from ddp_plugin.parallel.materialize import has_meta_tensors
from ddp_plugin.parallel import tensor_parallel
from ddp_plugin.strategy.components import PipelineParallel
from ddp_plugin.strategy.precision import ShardedGradientClipping, loss_scaler, with_sharded_clipping
from ddp_plugin.strategy.process_groups import ProcessGroups
from ddp_plugin.strategy.session import FitInputs
from ddp_plugin.strategy.stepping import Steps
from ddp_plugin.zero import backward_step as zero_backward_step
from ddp_plugin.zero import offload as zero_offload

if TYPE_CHECKING:
    import lightning.pytorch as pl
    import pluggy
    from torch.amp import GradScaler
    from torch.distributed.device_mesh import DeviceMesh

    from ddp_plugin.gradients.engine import GradientEngine
    from ddp_plugin.hookspecs import Topology
    from ddp_plugin.gradients.planning import CommPlan
    from ddp_plugin.runtime.topology import Layout

log = logging.getLogger(__name__)
_FLAGS = frozenset(flag_names())


# The docstring's Args are generated from ddp_plugin.strategy.config.FLAGS (`python -m ddp_plugin.strategy.flag_docs
# --write`); LightningCLI's --help shows them.
class HierarchicalZeroStrategy(ParallelStrategy):
    """Data-parallel training for clusters whose inter-node links are the bottleneck.

    Gradients are reduced inside each node, across nodes with 1/k of the data (optionally compressed), and
    optimizer state, gradients and parameters can be sharded (ZeRO), all by plugins behind a pluggy hook contract.

    The flags a DeepSpeed ``config`` can set default to ``None``, "not set": the config's value if it has one,
    else the default below. Any other value passed wins over the config, also one equal to the default. Every
    flag is checked here, and a bad value fails naming the flag and the allowed values. Each flag reads back as
    an attribute: ``strategy.zero_stage`` is ``strategy.config.zero_stage``.

    Args:
        zero_stage: ``0``: plain data parallelism; ``1``: shard the optimizer state; ``2``: also the gradients; ``3``:
            also the parameters (docs/zero.md). Default: ``0``; ``None``: the DeepSpeed ``config``'s value, else the
            default. Allowed: ``0``, ``1``, ``2``, ``3``.
        shard_scope: stages 1-3: shard over every rank, or over the ranks of a node with a replica per node, so
            parameter all-gathers never cross the slow link (HSDP, ZeRO++ hpZ). Default: ``"global"``; ``None``: the
            DeepSpeed ``config``'s value, else the default. Allowed: ``"global"``, ``"node"``.
        auto_wrap_policy: stage 3 units: ``None``: modules grouped into units of at least 1M parameters (an int sets
            it), or each instance of the classes given (docs/zero.md#stage-3-units). Modules are grouped into units
            bottom-up; containers are never units. Default: ``None``. Allowed: ``None``, a positive int, module classes
            or class names.
        prefetch_units: stage 3: units whose all-gathers run ahead of the one computing, in forward and backward. 1 as
            FSDP; with 2 a step took 1.12-1.20x ``ddp``'s, with 1 1.32-1.37x; each one more holds one more gathered
            unit. Default: ``2``. Allowed: ``0``, ``1``, ``2``.
        optimizer_in_backward: stages 2-3: step each bucket's shard once its gradient is reduced, in backward
            (docs/zero.md#the-step-in-backward). Its gradient is freed there, so a rank never holds all of its gradient
            shards; the same update, element by element. Not with clipping, ``skip_nonfinite``, a loss scaler, manual
            optimization, sync modes, fault tolerance, tensor or pipeline parallelism. Default: ``False``. Allowed:
            ``False``, ``True``.
        offload: stages 1-3: optimizer state in host memory or files (docs/zero.md#offload). ``"disk"`` (CPU ranks):
            each bucket's state in a mapped file in ``offload_dir``, read ahead of its step and written back behind it;
            ``"cpu"``: in pinned host memory, copied to the device for its step (on a CPU-only run the state is in host
            memory already). Default: ``None``; ``None``: the DeepSpeed ``config``'s value, else the default. Allowed:
            ``None``, ``"cpu"``, ``"disk"``.
        offload_dir: its directory. Each rank's files are unlinked as soon as they are mapped: nothing is left behind.
            Default: ``None``; ``None``: the DeepSpeed ``config``'s value, else the default. Allowed: a path (with
            ``"disk"``).
        offload_params: stage 3: parameter shards too. Default: ``False``; ``None``: the DeepSpeed ``config``'s value,
            else the default. Allowed: ``False``, ``True``.
        gradient_clip_norm: clip to this global 2-norm before every step, across shards at stages 1-3
            (``Trainer(gradient_clip_val=...)`` works too). Default: ``None`` (no clipping); ``None``: the DeepSpeed
            ``config``'s value, else the default. Allowed: positive finite number.
        config: a DeepSpeed config whose ZeRO settings become these flags; flags you pass win (migrating:
            docs/zero.md#migrating-from-deepspeed). Its other keys are named in a warning. Default: ``None``. Allowed:
            path to a JSON file, or a dict.
        checkpoint: ``"master"``: global rank 0 writes one consolidated file atomically; ``"sharded"``: every rank its
            part through ``torch.distributed.checkpoint`` (docs/checkpoints.md). A master file loads anywhere; sharded
            checkpoints are resharded on load. Default: ``"master"``. Allowed: ``"master"``, ``"sharded"``.
        release_cpu_memory: on CPU, return freed buffers of 1 MiB or more to the OS (process-wide); ``None``: on at
            stages 2-3 (why: docs/zero.md#memory). 1 MiB: glibc's mmap threshold. Default: ``None``. Allowed: ``None``,
            ``True``, ``False``.
        devices_per_node: ranks per node; ``None`` takes the launcher's. Set it to simulate nodes on one machine.
            Default: ``None``. Allowed: positive int dividing the world size.
        hierarchical: reduce inside nodes, cross nodes with 1/k of the data; ``False``: flat, like DDP; ``None``: chosen
            per bucket from measured links (docs/adaptive.md). ``None`` chooses only where the layout leaves a choice
            (several nodes of several ranks). Default: ``None``. Allowed: ``None``, ``True``, ``False``.
        compression: codec for the cross-node stage (docs/compression.md); ``"auto"``: per bucket, the fastest of
            ``compression_options["candidates"]`` as measured. Default: ``None``; ``None``: the DeepSpeed ``config``'s
            value, else the default. Allowed: ``None``, ``"auto"``, ``"fp16"``, ``"bf16"``, ``"int8"``, ``"topk"``,
            ``"powersgd"``, ``"sparse"``, an installed codec.
        compression_options: the codec's options, validated at construction, handed to plugins in
            ``on_setup(options=...)``; refused without ``compression`` unless a plugin takes them. Default: ``{}``.
            Allowed: dict.
        bucket_size_mb: gradient bucket capacity; ``"auto"``: from the measured link. In MiB; ``"auto"``: chosen by the
            link probe (docs/adaptive.md). Default: ``25``; ``None``: the DeepSpeed ``config``'s value, else the
            default. Allowed: positive number (at most 1 TiB), ``"auto"``.
        plugins: extra plugins; called before the built-ins. Default: ``()``. Allowed: plugin objects.
        broadcast_buffers: broadcast buffers from rank 0 before each step, as DDP. Default: ``True``. Allowed: bool.
        progress_bar_metrics: show ``comm/...`` in the bar too. Default: ``False``. Allowed: bool.
        skip_nonfinite: a NaN/Inf gradient on any rank skips the step everywhere (``train/skipped_steps``). Default:
            ``False``. Allowed: bool.
        weighting: ``"rank"``: DDP's mean over ranks; ``"sample"``: weighted by batch size (exact). Default: ``"rank"``.
            Allowed: ``"rank"``, ``"sample"``.
        process_group_backend: ``None``: NCCL on CUDA, gloo on CPU, MPI under mpirun if torch has it (PyPI's has not).
            Default: ``None``. Allowed: ``None``, ``"gloo"``, ``"nccl"``, ``"mpi"``.
        timeout: collective timeout. Connecting waits at least 5 minutes. Default: 30 min. Allowed: ``timedelta`` or
            seconds, positive, at most 365 days.
        start_method: as ``DDPStrategy``. Default: ``"popen"``. Allowed: ``"popen"``, ``"spawn"``, ``"fork"``,
            ``"forkserver"``.
        sync_every: nodes synchronize every H optimizer steps, ranks inside a node every step; 1: synchronous
            (docs/sync.md). Default: ``1``. Allowed: positive int.
        outer_optimizer: with ``sync_every > 1``: local SGD, DiLoCo (Nesterov, lr 0.7, momentum 0.9), or ``params ->
            torch.optim.Optimizer`` (YAML: ``class_path`` + ``init_args``). It moves the global copy by the averaged
            pseudo-gradient (the parameters' change): ``"average"`` is SGD with lr 1 (the global copy becomes the nodes'
            mean), ``"nesterov"`` SGD with Nesterov momentum; the callable's YAML is as for the model's optimizer.
            Default: ``"nesterov"``. Allowed: ``"average"``, ``"nesterov"``, callable.
        sync_fragments: sync the parameters in F staggered fragments: S/F every H/F steps. S: the gradient bytes.
            Streaming DiLoCo: the flat parameters (bucket order) are cut into F contiguous fragments of equal size,
            across parameter boundaries, each synced every H steps, H/F steps apart; F is at most the number of
            trainable parameters (checked at setup). Default: ``1``. Allowed: 1 to ``sync_every``.
        max_staleness: run each outer all-reduce behind the next steps and apply it this many steps late. 0: the outer
            sync blocks the step that starts it. Default: ``0``. Allowed: 0 to ``sync_every - 1``.
        sync_warmup_steps: with ``sync_every > 1``: train this many steps synchronously first, then start the sync mode.
            They average gradients over every rank, and the sync mode starts from the model they reached: post-local
            SGD, and the way DiLoCo is meant to be used (from a synchronously trained model). Default: ``0``. Allowed:
            int >= 0.
        tensor_parallel_size: split layers over this many ranks of a node (``configure_model`` on
            ``self.device_mesh["tensor_parallel"]``); other flags act over data-parallel ranks
            (docs/tensor_parallel.md). The module parallelizes itself as for Lightning's ``ModelParallelStrategy``
            (whose default is ``"auto"``); the data-parallel features run over ``"data_parallel"``, on the local shards.
            Default: ``1``. Allowed: positive int dividing the ranks per node, ``"auto"`` (all).
        pipeline_parallel_size: split the model's block list into P stages (``torch.distributed.pipelining`` schedules);
            other flags act per stage; a tied weight's gradient crosses once a step (docs/pipeline.md). P divides the
            world size; the mesh becomes ``("pipeline_parallel", "data_parallel", "tensor_parallel")``. Default: ``1``.
            Allowed: P: stages of whole nodes or part of one.
        pipeline_microbatches: M microbatches a batch. M is a positive int (``None``: P, ``pipeline_parallel_size``); a
            data-parallel rank's batch must split into M equal microbatches; M >= P with ``"1f1b"``, a multiple of P
            with ``"interleaved_1f1b"``. Default: P. Allowed: M.
        pipeline_schedule: schedule. One of ``torch.distributed.pipelining``'s; only ``"interleaved_1f1b"`` runs several
            stages per rank. Default: ``"1f1b"``. Allowed: ``"1f1b"``, ``"gpipe"``, ``"interleaved_1f1b"``.
        pipeline_virtual_stages: V stages a rank (interleaved: 2). V is a positive int; ``None``: 2 with
            ``"interleaved_1f1b"``, else 1 (the only schedule that runs several). Default: ``None``. Allowed: V.
        pipeline_split: where stages split. The blocks split into contiguous runs, one per stage: ``"parameters"``
            balances their parameter counts, ``"time"`` their compute (each block timed at setup on the data's first
            microbatch; a model built on meta one block at a time, each materialized alone), ``"uniform"`` their number,
            ``"type:<regex>"`` the number of blocks whose class name matches; or the module names of each stage
            (``[["tok", "blocks.0"], ["blocks.1", "head"]]``). Default: ``"parameters"``. Allowed: ``"parameters"``,
            ``"time"``, ``"uniform"``, ``"type:<regex>"``, names per stage (a block may be cut).
        pipeline_activations: the dtype sent between stages on two nodes (docs/pipeline.md#flags). The activations and
            their gradients: ``"fp32"`` as computed, ``"bf16"`` and ``"fp16"`` half the bytes, ``"int8"`` (a scale per
            row) about a quarter. Default: ``"fp32"``. Allowed: ``"fp32"``, ``"bf16"``, ``"fp16"``, ``"int8"``.
        activation_checkpointing_policy: these blocks recompute activations in the backward, on every layout
            (docs/activation_checkpointing.md). As ``FSDPStrategy``'s flag, e.g. ``{Block}``; ``None``: off. Default:
            ``None``. Allowed: classes or class names.
        pretrained: read at the first setup, each rank its part
            (docs/checkpoints.md#pretrained-weights-pretrained-safetensors). Hugging Face style, read after the model is
            split and materialized: each rank reads only its stages and its tensor-parallel slices. Skipped when
            ``ckpt_path`` resumes. Default: ``None``. Allowed: a ``.safetensors`` file or folder.
        fault_tolerance: torchft replica groups: a lost node stops none, one back heals from a peer (sync modes: in
            background); ``dynamic_steps``: none waits for a slow one; ``data_split="quorum"``: new groups join;
            built-in codecs, ZeRO, TP, PP (docs/fault_tolerance.md). A group is a node; ``True`` reads the groups from
            the environment (torchft's variables), a mapping or a ``ddp_plugin.fault_tolerance.FaultTolerance`` gives
            them. Default: ``None``. Allowed: ``None``, ``True``, a mapping.
    """

    strategy_name = "hierarchical_zero"

    def __init__(
        self,
        zero_stage: int | None = None,
        shard_scope: Literal["global", "node"] | None = None,
        auto_wrap_policy: Any = None,
        prefetch_units: int = 2,
        optimizer_in_backward: bool = False,
        offload: Literal["cpu", "disk"] | None = None,
        offload_dir: str | os.PathLike | None = None,
        offload_params: bool | None = None,
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
        self.fit = FitState()
        """What the strategy holds between Lightning's calls: groups, components, the fit's session."""
        self._checkpoints = Checkpoints(self, self.config, self.fit)
        self._steps = Steps(self, self.fit)
        self._backend: str | None = None
        self._num_nodes = 1
        super().__init__(accelerator=accelerator, parallel_devices=parallel_devices,
                         cluster_environment=cluster_environment, checkpoint_io=checkpoint_io,
                         precision_plugin=precision_plugin)
        ProcessGroups.track(self)

    # The flags read as attributes (`strategy.zero_stage`), as Lightning's strategies expose theirs: each is
    # `self.config.<flag>`, read-only, declared here one by one with its StrategyConfig field's type so that editors
    # and type checkers see it (tests/test_flags.py checks that every flag is here, with its field's type).
    # `process_group_backend` is a property below: the backend chosen at setup, else the flag.
    zero_stage = Flag[int]()
    shard_scope = Flag[str]()
    auto_wrap_policy = Flag[int | tuple[type | str, ...]]()
    prefetch_units = Flag[int]()
    optimizer_in_backward = Flag[bool]()
    offload = Flag[str | None]()
    offload_dir = Flag[str | None]()
    offload_params = Flag[bool]()
    gradient_clip_norm = Flag[float | None]()
    checkpoint = Flag[str]()
    release_cpu_memory = Flag[bool | None]()
    devices_per_node = Flag[int | None]()
    hierarchical = Flag[bool | None]()
    compression = Flag[str | None]()
    compression_options = Flag[dict[str, Any]]()
    bucket_size_mb = Flag[float | str]()
    plugins = Flag[tuple[object, ...]]()
    broadcast_buffers = Flag[bool]()
    progress_bar_metrics = Flag[bool]()
    skip_nonfinite = Flag[bool]()
    weighting = Flag[str]()
    timeout = Flag[timedelta | None]()
    start_method = Flag[str]()
    sync_every = Flag[int]()
    outer_optimizer = Flag[Any]()
    sync_fragments = Flag[int]()
    max_staleness = Flag[int]()
    sync_warmup_steps = Flag[int]()
    tensor_parallel_size = Flag[int | str]()
    pipeline_parallel_size = Flag[int]()
    pipeline_microbatches = Flag[int | None]()
    pipeline_schedule = Flag[str]()
    pipeline_virtual_stages = Flag[int | None]()
    pipeline_split = Flag[Any]()
    pipeline_activations = Flag[str]()
    activation_checkpointing_policy = Flag[tuple[type | str, ...] | None]()
    pretrained = Flag[str | None]()
    fault_tolerance = Flag[Any]()

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
        # Clipping by norm must see every shard; the Trainer's choice of plugin is kept (see ddp_plugin.strategy.precision).
        plugin = self._precision_plugin if self._precision_plugin is not None else Precision()
        if not isinstance(plugin, ShardedGradientClipping) or plugin.clipping is not self:
            plugin = self._precision_plugin = with_sharded_clipping(plugin, self)
        return plugin

    @precision_plugin.setter
    def precision_plugin(self, plugin: Precision | None) -> None:
        self._precision_plugin = None if plugin is None else with_sharded_clipping(plugin, self)

    # ------------------------------------------------------------------ processes (ddp_plugin.strategy.environment)

    @property
    @override
    def root_device(self) -> torch.device:
        return environment.root_device(self.parallel_devices, self.local_rank)

    @property
    def is_distributed(self) -> bool:
        """Tells Lightning's Trainer to shard dataloaders with a DistributedSampler, as for its own DDP."""
        return True

    @property
    def num_nodes(self) -> int:
        return self._num_nodes

    @num_nodes.setter
    def num_nodes(self, num_nodes: int) -> None:
        self._num_nodes = num_nodes

    @property
    def num_processes(self) -> int:
        return len(self.parallel_devices) if self.parallel_devices is not None else 0

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        return environment.sampler_kwargs(self.config, self._layout(), self.global_rank, self.fit.data_groups)

    @property
    def process_group_backend(self) -> str | None:
        return self._backend or self.config.process_group_backend

    @override
    def _configure_launcher(self) -> None:
        assert self.cluster_environment is not None
        # Lightning calls this in the Trainer's constructor, when devices and num_nodes are known: a layout that
        # cannot work fails there, before any process starts.
        if self.num_processes:
            self._layout()
        self._launcher = environment.launcher(self, self.config, self.cluster_environment, self.num_processes,
                                              self.num_nodes)

    def _layout(self) -> Layout:
        return environment.layout(self.config, self.num_nodes, self.num_processes)

    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        self.setup_distributed()
        self.fit.new_setup()
        module = self.lightning_module
        if self.fit.tensor_parallel.before_configure_model(module, self._layout().tensor_parallel_size):
            self._connect()  # (`configure_model` runs between this and `setup`, and reads the mesh)
            lightning_adapter.set_device_mesh(module, self.fit.groups.device_mesh())

    def setup_distributed(self) -> None:
        reset_seed()
        self.set_world_ranks()
        self._backend = environment.backend(self.config, self.cluster_environment, self.root_device)
        environment.connect(self.cluster_environment, self._backend, self.root_device, self.config)

    def set_world_ranks(self) -> None:
        if self.cluster_environment is not None:
            self.cluster_environment.set_global_rank(self.node_rank * self.num_processes + self.local_rank)
            self.cluster_environment.set_world_size(self.num_nodes * self.num_processes)
        rank_zero_only.rank = utils_rank_zero_only.rank = self.global_rank

    def _connect(self) -> None:
        self.fit.groups = environment.process_groups(self.config, self.cluster_environment, self.num_processes,
                                                     self.world_size, self._layout(), self.root_device,
                                                     self._backend)

    @property
    def device_mesh(self) -> DeviceMesh:
        """Lightning's ``("data_parallel", "tensor_parallel")`` mesh, as ``ModelParallelStrategy`` has it; the
        LightningModule reads it as ``self.device_mesh`` in ``configure_model``. Made when the processes connect,
        for a module that overrides ``configure_model`` or a ``tensor_parallel_size`` above 1."""
        return environment.device_mesh(self.fit.groups)

    @override
    def on_exception(self, exception: BaseException) -> None:
        health.report_exception(exception)  # the other ranks' failing collectives will name this rank and error

    @override
    def barrier(self, name: str | None = None, *args: Any, **kwargs: Any) -> None:
        environment.barrier(self.root_device, name)

    @override
    def broadcast(self, obj: TBroadcast, src: int = 0) -> TBroadcast:
        return environment.broadcast(obj, src)

    @override
    def reduce(self, tensor: Tensor, group: Any | None = None, reduce_op: ReduceOp | str | None = "mean") -> Tensor:
        return environment.reduce(tensor, group, reduce_op)

    @override
    def all_gather(self, tensor: Tensor, group: Any | None = None, sync_grads: bool = False) -> Tensor:
        # Between a sync mode's syncs no collective of ours crosses nodes, so a dead rank on another node is often
        # first met here (a callback's all_gather): name it, as the gradient synchronization does.
        with health.diagnosed("an all_gather"):
            return super().all_gather(tensor, group=group, sync_grads=sync_grads)

    # ------------------------------------------------------------------ setup / teardown

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
        return self.fit.materialized or (module is not None and has_meta_tensors(module))

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        # torchtitan's order (ddp_plugin.strategy.assembly): parallelized by `configure_model`, split into stages, wrapped,
        # materialized and made equal on the replicas, then sharded by the fit's session.
        assert self.accelerator is not None and self.model is not None
        fit = self.fit
        if fit.groups is None:
            self._connect()
        self.accelerator.setup(trainer)
        fitting = trainer.state.fn == TrainerFn.FITTING
        groups, config, module, device = fit.groups, self.config, self.lightning_module, self.root_device
        if fitting and config.optimizer_in_backward:
            zero_backward_step.check_trainer(trainer.gradient_clip_val, module.automatic_optimization,
                                             loss_scaler(self.precision_plugin) is not None)
        if fitting and config.offload is not None:
            zero_offload.check_trainer(loss_scaler(self.precision_plugin) is not None)
        fit.tensor_parallel.prepare(self.model, groups, config)
        weights = pretrained.first_plan(module, config.pretrained, trainer.ckpt_path)
        pipelined = groups.topology.pipeline_parallel_size > 1
        stages = fit.stages = PipelineParallel(config, groups) if pipelined else None
        if config.activation_checkpointing_policy is not None and not hasattr(self.model, "_ddp_plugin_stages"):
            activation_checkpointing.check_present(self.model, config.activation_checkpointing_policy)  # (unsplit)
        ties = stages.split(module, device) if stages is not None else []
        self.model = assembly.wrap(self.model, config, self._layer_sync, self.precision_plugin, fitting)
        materialized, deferred = assembly.materialize(self.model, module, groups, config, device, fitting, weights,
                                                      ties, seed_offset=self.global_rank)
        fit.materialized = fit.materialized or materialized
        fit.pipeline = stages.start(module, ties, device) if stages is not None else None
        fit.tensor_parallel.watch(self.model)
        if fitting:
            ft_data.attach(trainer, config.fault_tolerance, fit)
            fit.start(assembly.start_session(FitInputs(
                config=config, model=self.model, module=module, groups=groups, device=device,
                hierarchical=self._hierarchical_by_flags(), measure_memory=self.memory_bytes,
                optimizers=lambda: self.optimizers, runner=fit.pipeline, ties=tuple(ties), deferred=deferred)))
            fit.units_initialized = deferred.groups if deferred is not None else 0
            self.setup_optimizers(trainer)
            for optimizer in self.optimizers:
                if fit.pipeline is not None:  # (before a sharder replaces them with its pieces)
                    fit.pipeline.checkpoint.note_optimizer(optimizer)
                fit.session.plugin_manager.hook.on_setup_optimizer(optimizer=optimizer)
        self.setup_precision_plugin()
        if fitting:
            lightning_adapter.optimizers_to_device(self.optimizers, self.root_device)
            assembly.trim_after_setup(config, device)

    @override
    def teardown(self) -> None:
        # Lightning tears down inside its `except` when the fit failed: then the error the user reads must stay the
        # first one (ddp_plugin.strategy.assembly.after).
        failing = sys.exc_info()[1]
        ProcessGroups.failed = failing is not None
        fit = self.fit
        fit.tensor_parallel.forget()
        if fit.pipeline is not None:
            fit.pipeline.release()
        if session := fit.running():
            assembly.after(failing, lambda: session.close(failed=failing is not None))
        module = self.lightning_module
        if module is not None and lightning_adapter.has_trainer(module):
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
            self.cluster_environment.teardown, lambda: lightning_adapter.optimizers_to_device(self.optimizers, torch.device("cpu")),
            module.cpu if move else (lambda: None), self.precision_plugin.teardown, self.accelerator.teardown,
            self.checkpoint_io.teardown))

    def release_process_groups(self) -> None:
        """At interpreter exit: drop the fit's plugins and engine and the groups (see ddp_plugin.strategy.process_groups)."""
        self.fit.forget()

    @override
    def model_to_device(self) -> None:
        assert self.model is not None
        self.model.to(self.root_device)

    # ------------------------------------------------------------------ steps (ddp_plugin.strategy.stepping)

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._steps.training_step(functools.partial(super().training_step, *args, **kwargs), args, kwargs)

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._steps.step("validation_step", functools.partial(super().validation_step, *args, **kwargs),
                                args, kwargs, train=False)

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._steps.step("test_step", functools.partial(super().test_step, *args, **kwargs), args, kwargs,
                                train=False)

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._steps.step("predict_step", functools.partial(super().predict_step, *args, **kwargs), args,
                                kwargs, train=False)

    @override
    def pre_backward(self, closure_loss: Tensor) -> None:
        self._steps.pre_backward(closure_loss)

    @contextmanager
    @override
    def block_backward_sync(self) -> Generator[None, None, None]:
        """Inner steps of gradient accumulation: gradients accumulate in the buckets, nothing is sent."""
        with self._steps.no_sync():
            yield

    @override
    def post_backward(self, closure_loss: Tensor) -> None:
        self._steps.post_backward()

    @override
    def optimizer_step(self, optimizer: Optimizer, closure: Callable[[], Any],
                       model: pl.LightningModule | torch.nn.Module | None = None, **kwargs: Any) -> Any:
        step = functools.partial(super().optimizer_step, optimizer, model=model, **kwargs)
        return self._steps.optimizer_step(optimizer, closure, step)

    # ------------------------------------------------------------------ checkpoints (ddp_plugin.strategy.checkpointing)

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        state = self._checkpoints.module_state()
        return state if state is not None else super().lightning_module_state_dict()

    @override
    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        state = self._checkpoints.optimizer_state(optimizer)
        return state if state is not None else super().optimizer_state(optimizer)

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None) -> None:
        write = functools.partial(super().save_checkpoint, filepath=filepath, storage_options=storage_options)
        self._checkpoints.save(checkpoint, filepath, write)

    @override
    def remove_checkpoint(self, filepath: Any) -> None:
        if not self._checkpoints.remove(filepath):
            super().remove_checkpoint(filepath)

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        return self._checkpoints.load(checkpoint_path, weights_only, super().load_checkpoint)

    @override
    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        self._checkpoints.load_model_state(checkpoint, strict)

    @override
    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        self._checkpoints.load_optimizer_state(checkpoint, super().load_optimizer_state_dict)

    # ------------------------------------------------------------------ what a user asks (ddp_plugin.strategy.inspection)

    @property
    def topology(self) -> Topology | None:
        return self.fit.topology

    @property
    def plugin_manager(self) -> pluggy.PluginManager | None:
        """The pluggy plugin manager of the current or last ``fit`` (``None`` before the first)."""
        return self.fit.plugin_manager

    @property
    def engine(self) -> GradientEngine | None:
        """The gradient engine of the current ``fit`` (``None`` outside of it)."""
        return self.fit.engine

    @property
    def comm_plan(self) -> CommPlan | None:
        """What the link probe measured and decided, per bucket (docs/adaptive.md); ``None`` when nothing was left
        to decide (one rank, or every choice set by a flag) or before the first ``fit``."""
        return self.fit.comm_plan

    @property
    def uses_hierarchical_reducer(self) -> bool:
        """Whether gradients are reduced in node, cross-node and gather stages (decided once the layout is known;
        during a ``fit`` whose plan chooses per bucket: whether any bucket may be)."""
        return self.fit.hierarchical(self._hierarchical_by_flags())

    def _hierarchical_by_flags(self) -> bool:
        if self.config.hierarchical is not None:
            return self.config.hierarchical
        layout = self._layout().data_parallel_layout
        return layout.num_nodes > 1 and layout.ranks_per_node > 1

    @property
    def units_initialized(self) -> int:
        """ZeRO stage 3 units this fit's setup allocated and initialized one by one (a model built on meta)."""
        return self.fit.units_initialized

    @property
    def skipped_steps(self) -> int:
        """Optimizer steps ``skip_nonfinite`` skipped in the current or last ``fit``."""
        return self.fit.skipped_steps

    @property
    def metric_totals(self) -> dict[str, float]:
        """Sums of the plugins' per-step metrics over the current or last ``fit`` (this rank's values)."""
        return self.fit.metric_totals

    @property
    def metric_means(self) -> dict[str, float]:
        """Per-step means of the plugins' metrics over the current or last ``fit`` (this rank's values)."""
        return self.fit.metric_means

    def clip_grad_norm_sharded(self, optimizer: Optimizer, max_norm: float) -> Tensor | None:
        session = self.fit.running()
        return session.clip_grad_norm(optimizer, max_norm) if session else None

    def after_closure(self, optimizer: Optimizer, scaler: GradScaler | None) -> None:
        if session := self.fit.running():
            session.after_closure(optimizer, scaler)

    def before_update(self, optimizer: Optimizer) -> None:
        if session := self.fit.running():
            session.before_update(optimizer)

    def clip_module_grads_by_value(self, clip_val: float) -> None:
        inspection.clip_grads_by_value(self.model, self.fit, bool(self.config.zero_stage), clip_val)

    @contextmanager
    def full_parameters(self) -> Generator[None, None, None]:
        """Inside, every module parameter holds its full value on every rank (at ZeRO stage 3 they are
        all-gathered, and freed again on exit; call it on every rank). Read-only: changes are not kept."""
        with self.fit.lent("on_gather_full_parameters"):
            yield

    @contextmanager
    def full_gradients(self) -> Generator[None, None, None]:
        """Inside, every module parameter's ``.grad`` holds its whole gradient on every rank, as under DDP (the
        global mean after a synchronizing backward, clipped once clipping ran; ``None`` where the optimizer has
        none). At stages 2-3 the shards are all-gathered into a buffer freed on exit; at stages 0-1 nothing
        happens. Call it on every rank. Read-only: changes are not applied. For norms, :meth:`grad_norm`."""
        with self.fit.lent("on_gather_full_gradients"):
            yield

    def grad_norm(self, norm_type: float | int | str = 2, group_separator: str = "/") -> dict[str, Tensor]:
        """``lightning.pytorch.utilities.grad_norm(module, norm_type)`` of the LightningModule at every ZeRO
        stage, ready for ``self.log_dict``; at stages 2-3 from the shards with one small all-reduce (call it on
        every rank)."""
        return inspection.grad_norm(self.lightning_module, self.fit, norm_type, group_separator)

    def memory_bytes(self) -> dict[str, int]:
        """This rank's bytes of parameters, gradients and optimizer state, measured on the live tensors (each
        storage counted once): module and optimizer parameters, gradient buckets and ``.grad``, optimizer state;
        and what plugins report keeping besides (``on_collect_memory``, e.g. a sync mode's ``outer_state``)."""
        return inspection.measured_memory(self.model, self.optimizers, self.fit)

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: lightning_adapter.StrategyRegistry) -> None:
        entries = [
            ("hierarchical_zero", {}, "hierarchical data parallel, stage 0"),
            ("hierarchical_zero_spawn", {"start_method": "spawn"}, "hierarchical data parallel, spawn start method"),
        ] + [(f"hierarchical_zero_stage_{s}", {"zero_stage": s}, f"hierarchical data parallel, ZeRO stage {s}")
             for s in (1, 2, 3)]
        for name, init_params, description in entries:
            strategy_registry.register(name, cls, description=description, **init_params)
