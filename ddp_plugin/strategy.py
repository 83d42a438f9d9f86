"""``HierarchicalZeroStrategy``: the Lightning side. It follows the Trainer's lifecycle and turns Lightning's
calls into hook calls; tensors and collectives are the plugins' business."""

from __future__ import annotations

import atexit
import dataclasses
import functools
import gc
import logging
import math
import os
import shutil
import weakref
from collections.abc import Callable, Generator, Iterable, Mapping
from contextlib import contextmanager
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Literal

import pluggy
import torch
import torch.distributed as dist
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.plugins.environments import MPIEnvironment
from lightning.fabric.strategies import _StrategyRegistry
from lightning.fabric.utilities.distributed import (
    _distributed_is_initialized,
    _get_default_process_group_backend_for_device,
    _init_dist_connection,
    _sync_ddp_if_available,
)
from lightning.fabric.utilities.distributed import group as _group
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.fabric.utilities.seed import reset_seed
from lightning.fabric.utilities.types import ReduceOp
from lightning.pytorch.overrides.distributed import _sync_module_states
from lightning.pytorch.strategies.launchers import _MultiProcessingLauncher, _SubprocessScriptLauncher
from lightning.pytorch.strategies.parallel import ParallelStrategy
from lightning.pytorch.strategies.strategy import TBroadcast
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.data import extract_batch_size
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_only, rank_zero_warn
from lightning_utilities.core.rank_zero import rank_zero_only as utils_rank_zero_only
from torch import Tensor
from torch.optim import Optimizer
from typing_extensions import override

from ddp_plugin import collectives, cpu_memory, health, sharded_checkpoint
from ddp_plugin.checkpoint_io import (
    AtomicCheckpointIO,
    agree_with_rank_0,
    deferred_storages,
    diagnosed,
    is_local_path,
    local_path,
    materialize,
    not_a_checkpoint,
    produce_all,
)
from ddp_plugin.engine import GradientEngine
from ddp_plugin.plugin_manager import build_plugin_manager
from ddp_plugin.plugins.zero_sharder import SHARD_SCOPES, check_auto_wrap_policy
from ddp_plugin.topology import Layout, build_topology, connect_timeout, new_group, set_collective_timeout

if TYPE_CHECKING:
    import lightning.pytorch as pl
    from lightning.pytorch.plugins.precision import Precision
    from torch.nn import Module

    from ddp_plugin.hookspecs import Topology

log = logging.getLogger(__name__)

ZERO_STAGES = (0, 1, 2, 3)
START_METHODS = ("popen", "spawn", "fork", "forkserver")
WEIGHTINGS = ("rank", "sample")
CHECKPOINT_MODES = ("master", "sharded")
# Flags a DeepSpeed config can set, and their defaults. In the signature they default to None, "not set", so that
# a value the user passed wins over the config even when it equals the default; LightningCLI passes every
# parameter, the ones a YAML file leaves out as their signature default, so None must mean "not set" there too.
_CONFIG_FLAGS: dict[str, Any] = {
    "zero_stage": 0, "shard_scope": "global", "bucket_size_mb": 25, "compression": None, "gradient_clip_norm": None,
}
MAX_BUCKET_SIZE_MB = 2**20  # 1 TiB: no device holds a bucket near that; inf overflowed `int(mb * 2**20)`
MAX_TIMEOUT = timedelta(days=365)  # much beyond, torch's deadlines (int64 nanoseconds) overflow: about 292 years
CHECKPOINT_KEY = "ddp_plugin"


class HierarchicalZeroStrategy(ParallelStrategy):
    """Data-parallel training for clusters whose inter-node links are the bottleneck.

    Gradients are synchronized by plugins behind a pluggy hook contract (:mod:`ddp_plugin.hookspecs`): the
    strategy owns the Lightning lifecycle, the process groups and the ``(node, local)`` device mesh; the
    gradient engine buckets gradients and launches each bucket during backward; reducer and codec plugins
    decide how a bucket is averaged.

    The flags a DeepSpeed ``config`` can set (``zero_stage``, ``shard_scope``, ``bucket_size_mb``,
    ``compression``, ``gradient_clip_norm``) default to ``None``, "not set": the config's value if it has one,
    else the default named below. Any other value passed wins over the config, also one equal to the default.

    Args:
        zero_stage: 0 (default) is plain data parallelism; 1 shards the optimizer state, 2 also the gradients, 3
            also the parameters (:class:`~ddp_plugin.plugins.ZeroSharder`).
        shard_scope: ``"global"`` (default) shards over every rank (least memory); ``"node"`` shards over the
            ranks of a node and replicates across nodes, so parameter all-gathers never cross the slow link (HSDP,
            DeepSpeed ZeRO++ hpZ).
        auto_wrap_policy: stage 3 units, whose parameters are gathered together before their forward and
            backward: module classes (or class names) whose instances become units, or a parameter count
            (modules are grouped bottom-up into units of at least that many parameters; default 1,000,000). A
            unit is always made of modules that are called: a container (``nn.ModuleList``, ``nn.ModuleDict``)
            is never one; the blocks inside it are grouped into units instead.
        gradient_clip_norm: clip gradients to this global 2-norm before every step (across shards at stages
            1-3); default: no clipping. ``Trainer(gradient_clip_val=...)`` works too.
        checkpoint: ``"master"``: global rank 0 writes one consolidated file (full model, optimizer state in the
            layout an unsharded optimizer has), atomically, which any world size, stage, or plain Lightning in
            one process can load. ``"sharded"``: every rank writes its own part through
            ``torch.distributed.checkpoint`` into a directory (no gathering, nothing large on rank 0); loading
            reshards to the current world size and stage (:mod:`ddp_plugin.sharded_checkpoint`). Both kinds
            load in either mode.
        release_cpu_memory: on CPU, make glibc give buffers of 1 MiB or more back to the operating system as
            soon as they are freed (``mallopt(M_MMAP_THRESHOLD)``, process-wide), so that the buffers stages 2
            and 3 free every step do not fragment the heap and grow the resident memory. ``None`` (default):
            on at stages 2 and 3 on CPU; costs page faults (measured: +6% to +17% step time on the 2x2
            benchmark). No effect on CUDA or without glibc.
        config: a DeepSpeed config (path to a JSON file, or a dict) whose ZeRO settings become these flags;
            flags passed explicitly (not ``None``) win, and every key that has no counterpart is named in a
            warning.
        devices_per_node: ranks per node. ``None`` takes the launcher's (``devices=``); set it to simulate
            several nodes on one machine. Must divide the world size.
        hierarchical: reduce inside each node, then across nodes with 1/k of the data, then gather inside
            the node (:class:`~ddp_plugin.plugins.HierarchicalReducer`). ``None`` (default): on when there are
            several nodes of several ranks. ``False``: one flat all-reduce over every rank, like DDP.
        compression: the name of a built-in or installed codec plugin (entry-point group ``ddp_plugin``);
            default: none.
        compression_options: the codec's options, passed to plugins through ``on_setup(options=...)``. Without
            ``compression`` they are refused unless a plugin given in ``plugins`` (or an installed one) takes
            ``options`` in its ``on_setup``.
        bucket_size_mb: gradient bucket capacity in MiB (default 25, as DDP; at most 1 TiB).
        plugins: extra plugin objects; pluggy calls them before the built-ins.
        broadcast_buffers: broadcast module buffers (e.g. BatchNorm statistics) from rank 0 before each
            training step, as DDP does.
        skip_nonfinite: when any rank's gradients hold a NaN or Inf, every rank skips that optimizer step (one
            flag travels with the engine's bookkeeping all-reduce); counted in ``skipped_steps`` and logged as
            ``train/skipped_steps``.
        weighting: ``"rank"`` averages the ranks' gradients (DDP's mean); ``"sample"`` weights each rank by the
            samples in its batch, so uneven batches give exactly the gradient of the mean loss over their union.
        progress_bar_metrics: also show the synchronization metrics (``comm/...``) in the progress bar.
        process_group_backend: ``"nccl"``, ``"gloo"`` or ``"mpi"``; default NCCL on CUDA, gloo on CPU, MPI
            when launched by ``mpirun`` and torch has MPI support.
        timeout: collective timeout, a ``timedelta`` or seconds (positive, at most 365 days).
        start_method: ``"popen"`` (re-run the script per rank, the default), ``"spawn"``, ``"fork"`` or
            ``"forkserver"``, as for Lightning's ``DDPStrategy``.
    """

    strategy_name = "hierarchical_zero"

    def __init__(
        self,
        zero_stage: int | None = None,
        shard_scope: Literal["global", "node"] | None = None,
        auto_wrap_policy: Any = None,
        gradient_clip_norm: float | None = None,
        config: str | os.PathLike | dict[str, Any] | None = None,
        checkpoint: Literal["master", "sharded"] = "master",
        release_cpu_memory: bool | None = None,
        devices_per_node: int | None = None,
        hierarchical: bool | None = None,
        compression: str | None = None,
        compression_options: dict[str, Any] | None = None,
        bucket_size_mb: float | None = None,
        plugins: Iterable[object] = (),
        broadcast_buffers: bool = True,
        progress_bar_metrics: bool = False,
        skip_nonfinite: bool = False,
        weighting: Literal["rank", "sample"] = "rank",
        process_group_backend: str | None = None,
        timeout: timedelta | float | None = default_pg_timeout,
        start_method: Literal["popen", "spawn", "fork", "forkserver"] = "popen",
        accelerator: pl.accelerators.Accelerator | None = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision_plugin: Precision | None = None,
    ) -> None:
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
        )
        # None is "not set": the config's value, else the default. Anything else was passed and wins.
        passed = {k: v for k, v in locals().items() if k in _CONFIG_FLAGS and v is not None}
        self._hpz_partition_size: int | None = None
        merged = dict(_CONFIG_FLAGS)
        if config is not None:
            mapped = _from_deepspeed_config(config)
            self._hpz_partition_size = mapped.hpz_partition_size
            merged.update(mapped.flags)
        merged.update(passed)
        zero_stage, shard_scope, bucket_size_mb, compression, gradient_clip_norm = (
            merged[k] for k in ("zero_stage", "shard_scope", "bucket_size_mb", "compression", "gradient_clip_norm")
        )
        self.zero_stage = _check_zero_stage(zero_stage)
        self.checkpoint = _check_choice("checkpoint", checkpoint, CHECKPOINT_MODES)
        if release_cpu_memory is not None and not isinstance(release_cpu_memory, bool):
            raise ValueError(
                f"`release_cpu_memory={release_cpu_memory!r}` is not supported; allowed values: None, True, False."
            )
        self.release_cpu_memory = release_cpu_memory
        self.shard_scope = _check_choice("shard_scope", shard_scope, SHARD_SCOPES)
        self.auto_wrap_policy = check_auto_wrap_policy(auto_wrap_policy)
        self.gradient_clip_norm = (
            None if gradient_clip_norm is None else _check_positive_number("gradient_clip_norm", gradient_clip_norm)
        )
        self.devices_per_node = _check_devices_per_node(devices_per_node)
        self.hierarchical = None if hierarchical is None else _check_bool("hierarchical", hierarchical, none=True)
        self.compression_options = _check_mapping("compression_options", compression_options)
        self.bucket_size_mb = _check_positive_number(
            "bucket_size_mb", bucket_size_mb, maximum=MAX_BUCKET_SIZE_MB, unit=" MiB (1 TiB)"
        )
        self.compression = compression
        self.extra_plugins = list(plugins)
        # Assemble the plugins once now, so an unknown codec or a misspelled hook fails here, not on the ranks.
        pm = build_plugin_manager(
            self.compression, self.extra_plugins, compression_options=self.compression_options, **self._zero_kwargs()
        )
        _check_options_are_read(self.compression, self.compression_options, pm)
        self.broadcast_buffers = _check_bool("broadcast_buffers", broadcast_buffers)
        self.progress_bar_metrics = _check_bool("progress_bar_metrics", progress_bar_metrics)
        self.skip_nonfinite = _check_bool("skip_nonfinite", skip_nonfinite)
        self.weighting = _check_choice("weighting", weighting, WEIGHTINGS)
        self.skipped_steps = 0
        self._heartbeat: health.Heartbeat | None = None
        self._sample_weight: tuple[Any, Tensor, int] | None = None
        self._process_group_backend = _check_backend(process_group_backend)
        self._timeout = _check_timeout(timeout)
        self._start_method = _check_choice("start_method", start_method, START_METHODS)
        self._num_nodes = 1
        self.topology: Topology | None = None
        self._flags_group: dist.ProcessGroup | None = None
        self._plugin_manager: pluggy.PluginManager | None = None
        self._engine: GradientEngine | None = None
        self._pending_plugin_state: dict[str, Any] | None = None
        self._metric_sums: dict[str, float] = {}
        self._metric_steps = 0
        _live_strategies.add(self)

    # ------------------------------------------------------------------ properties

    @property
    @override
    def root_device(self) -> torch.device:
        assert self.parallel_devices is not None
        if self.local_rank >= len(self.parallel_devices):
            if all(d.type == "cpu" for d in self.parallel_devices):
                # More ranks on this node than `devices`: let it reach the collective layout check, which fails
                # on every rank with one message instead of this rank alone with an IndexError.
                return torch.device("cpu")
            raise ValueError(
                f"This node runs local rank {self.local_rank}, but `devices={len(self.parallel_devices)}`: start"
                " as many processes per node as `devices` says (e.g. torchrun's `--nproc_per_node`)."
            )
        return self.parallel_devices[self.local_rank]

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
        return {"num_replicas": self.num_nodes * self.num_processes, "rank": self.global_rank}

    @property
    def process_group_backend(self) -> str | None:
        return self._process_group_backend

    @property
    def plugin_manager(self) -> pluggy.PluginManager | None:
        """The pluggy plugin manager of the current or last ``fit`` (``None`` before the first)."""
        return self._plugin_manager

    @property
    def engine(self) -> GradientEngine | None:
        """The gradient engine of the current ``fit`` (``None`` outside of it)."""
        return self._engine

    # ------------------------------------------------------------------ environment

    @override
    def _configure_launcher(self) -> None:
        assert self.cluster_environment is not None
        # Lightning calls this in the Trainer's constructor, when devices and num_nodes are known: a layout
        # that cannot work fails there, before any process starts.
        if self.num_processes:
            self._layout()
        if self._start_method == "popen":
            self._launcher = _SubprocessScriptLauncher(self.cluster_environment, self.num_processes, self.num_nodes)
        else:
            self._launcher = _MultiProcessingLauncher(self, start_method=self._start_method)

    def _layout(self) -> Layout:
        return Layout(world_size=self.num_nodes * self.num_processes, ranks_per_node=self.devices_per_node or self.num_processes)

    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        self.setup_distributed()

    def setup_distributed(self) -> None:
        reset_seed()
        self.set_world_ranks()
        self._process_group_backend = self._get_process_group_backend()
        assert self.cluster_environment is not None
        initializing = not dist.is_initialized()
        # The rendezvous waits for the other ranks at least minutes (a rank still importing on a loaded machine is
        # late, not dead); `timeout` bounds the collectives that follow.
        kwargs: dict[str, Any] = {"timeout": connect_timeout(self._timeout)}
        kwargs["device_id"] = self.root_device if self.root_device.type != "cpu" else None
        _init_dist_connection(self.cluster_environment, self._process_group_backend, **kwargs)
        if initializing:  # a default group the user created keeps the timeout they gave it
            set_collective_timeout(dist.group.WORLD, self._timeout)

    def _check_ranks_per_node(self) -> None:
        """Every node must run the same number of ranks, numbered node by node, or the (node, local) mesh would
        put ranks of one machine on different "nodes". Launchers that know their node's size (torchrun sets
        LOCAL_WORLD_SIZE) are checked against the layout; all ranks agree on the verdict, so all fail together."""
        if self.devices_per_node is not None:
            return  # simulated nodes: the user chose the layout on purpose
        assert self.cluster_environment is not None
        mine = (self.cluster_environment.node_rank(), int(os.environ.get("LOCAL_WORLD_SIZE", self.num_processes)))
        every: list[Any] = [None] * self.world_size
        dist.all_gather_object(every, mine)
        per_node: dict[int, int] = {}
        for node, size in every:
            per_node[node] = size
        k = self.num_processes
        misplaced = [r for r, (node, _) in enumerate(every) if r // k != node]
        if set(per_node.values()) != {k} or misplaced:
            sizes = ", ".join(f"node {n}: {size}" for n, size in sorted(per_node.items()))
            raise ValueError(
                f"Every node must run the same number of ranks, `devices={k}` each, numbered node by node; the"
                f" launcher reports {sizes}. Start the same number of processes on every node (e.g. the same"
                " `--nproc_per_node` for torchrun) and set `devices` to it."
            )

    def _get_process_group_backend(self) -> str:
        if self._process_group_backend:
            return self._process_group_backend
        if isinstance(self.cluster_environment, MPIEnvironment) and dist.is_mpi_available():
            return "mpi"
        return _get_default_process_group_backend_for_device(self.root_device)

    def set_world_ranks(self) -> None:
        if self.cluster_environment is not None:
            self.cluster_environment.set_global_rank(self.node_rank * self.num_processes + self.local_rank)
            self.cluster_environment.set_world_size(self.num_nodes * self.num_processes)
        rank_zero_only.rank = utils_rank_zero_only.rank = self.global_rank

    # ------------------------------------------------------------------ setup / teardown

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        assert self.accelerator is not None
        assert self.model is not None
        # Collectives, so here rather than in `setup_environment`, which (as DDPStrategy's) only creates the
        # process group: code that mocks its creation, as Lightning's tests do, must not reach a collective.
        self._check_ranks_per_node()
        self.topology, self._flags_group = _process_groups(
            self._layout(), self.root_device, self._process_group_backend, id(dist.group.WORLD), self._timeout
        )
        self.accelerator.setup(trainer)
        fitting = trainer.state.fn == TrainerFn.FITTING
        if fitting and self._layer_sync:
            self.model = self._layer_sync.apply(self.model)
        self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        # Every rank starts from rank 0's parameters and buffers.
        _sync_module_states(self.model)

        if fitting:
            self._release_cpu_memory()
            self._setup_plugins()
            self.setup_optimizers(trainer)
            assert self._plugin_manager is not None
            for optimizer in self.optimizers:
                self._plugin_manager.hook.on_setup_optimizer(optimizer=optimizer)
        self.setup_precision_plugin()
        self._route_gradient_clipping()
        if fitting:
            _optimizers_to_device(self.optimizers, self.root_device)

    def _release_cpu_memory(self) -> None:
        wanted = self.zero_stage >= 2 if self.release_cpu_memory is None else self.release_cpu_memory
        if wanted and self.root_device.type == "cpu" and cpu_memory.release_freed_buffers():
            log.info("ddp_plugin: glibc's mmap threshold fixed at 1 MiB (release_cpu_memory)")

    def _zero_kwargs(self) -> dict[str, Any]:
        return {"zero_stage": self.zero_stage, "shard_scope": self.shard_scope, "auto_wrap_policy": self.auto_wrap_policy}

    def _setup_plugins(self) -> None:
        assert self.topology is not None and self.model is not None
        self._metric_sums, self._metric_steps = {}, 0
        if self._hpz_partition_size is not None and self._hpz_partition_size != self.topology.ranks_per_node:
            raise ValueError(
                f"The DeepSpeed config's `zero_optimization.zero_hpz_partition_size={self._hpz_partition_size}`"
                f" maps to `shard_scope='node'`, which shards over the {self.topology.ranks_per_node} ranks of a"
                " node; set it to the ranks per node (or drop it and pass `shard_scope`/`devices_per_node`)."
            )
        pm = build_plugin_manager(
            self.compression,
            self.extra_plugins,
            hierarchical=self.uses_hierarchical_reducer,
            compression_options=self.compression_options,
            **self._zero_kwargs(),
        )
        self._plugin_manager = pm
        self._engine = GradientEngine(
            self.model,
            hook=pm.hook,
            bucket_cap_bytes=int(self.bucket_size_mb * 2**20),
            flags_group=self._flags_group,
            device=self.root_device,
            # Sharded buckets split into equal shards without copies.
            pad_multiple=self.topology.world_size if self.zero_stage else 1,
        )
        self._engine.check_finite = self.skip_nonfinite
        if self._heartbeat is None or not self._heartbeat.is_alive():
            # (One that ended with its process group, if setup ran without teardown, is replaced.)
            self._heartbeat = health.Heartbeat()
        self.skipped_steps = 0
        pm.hook.on_setup(
            topology=self.topology, buckets=self._engine.buckets, hook=pm.hook, options=self._options(), module=self.model
        )
        if self._pending_plugin_state is not None:
            pm.hook.on_load_state_dict(state=self._pending_plugin_state)
            self._pending_plugin_state = None

    def _release_process_groups(self) -> None:
        """Drop every reference this strategy and its plugins hold to process groups (at interpreter exit)."""
        if self._heartbeat is not None:
            self._heartbeat.stop()
            self._heartbeat = None
        if self.topology is not None:
            for field in dataclasses.fields(self.topology):
                if field.name == "mesh" or field.name.endswith("group"):
                    object.__setattr__(self.topology, field.name, None)
        self.topology = None
        self._flags_group = None
        self._engine = None
        self._plugin_manager = None

    @property
    def uses_hierarchical_reducer(self) -> bool:
        """Whether gradients are reduced in node, cross-node and gather stages (decided once the layout is known)."""
        if self.hierarchical is not None:
            return self.hierarchical
        layout = self._layout()
        return layout.num_nodes > 1 and layout.ranks_per_node > 1

    def _options(self) -> dict[str, Any]:
        return {
            "zero_stage": self.zero_stage,
            "shard_scope": self.shard_scope,
            "devices_per_node": self.devices_per_node,
            "hierarchical": self.uses_hierarchical_reducer,
            "compression": self.compression,
            "compression_options": dict(self.compression_options),
            "bucket_size_mb": self.bucket_size_mb,
            "broadcast_buffers": self.broadcast_buffers,
        }

    @override
    def teardown(self) -> None:
        if self._engine is not None:
            assert self._plugin_manager is not None
            self._plugin_manager.hook.on_teardown()
            self._engine.remove()
            self._print_metric_summary()
        if self._heartbeat is not None:
            self._heartbeat.stop()
            self._heartbeat = None
        # The plugin manager stays until the next `fit`: `trainer.save_checkpoint` after `fit` still needs the
        # plugins' state, and a sharder's layout to consolidate the optimizer state, which stays sharded.
        self._engine = None
        if self.lightning_module is not None and self.lightning_module._trainer is not None:
            if self.lightning_module.trainer.state.fn == TrainerFn.FITTING and self._layer_sync:
                self.model = self._layer_sync.revert(self.model)
        super().teardown()

    @override
    def model_to_device(self) -> None:
        assert self.model is not None
        self.model.to(self.root_device)

    # ------------------------------------------------------------------ training

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        if self.broadcast_buffers and self._engine is not None and dist.get_world_size() > 1:
            assert self.model is not None
            buffers = [b for b in self.model.buffers()]
            if buffers:
                dist._broadcast_coalesced(dist.group.WORLD, buffers, 250 * 2**20, 0)
        if self.weighting == "sample" and self._engine is not None and args:
            # Overlaps the forward pass; backward waits for it to weight the loss.
            count = torch.tensor([float(extract_batch_size(args[0]))], dtype=torch.float64, device=self.root_device)
            total = count.clone()
            work = collectives.all_reduce(total, group=self._flags_group, async_op=True)
            self._sample_weight = (work, total, int(count.item()))
        return super().training_step(*args, **kwargs)

    @override
    def pre_backward(self, closure_loss: Tensor) -> None:
        # Sample weighting scales the gradient that flows into the loss instead of overriding `backward`, which
        # Lightning (and its tests, wrapping `Strategy.backward` in a Mock) expect to be the base class's.
        if self._sample_weight is None:
            return
        work, total, count = self._sample_weight
        self._sample_weight = None
        try:
            work.wait()
        except Exception as err:
            raise RuntimeError(health.diagnose(err)) from err
        if closure_loss.requires_grad:
            # Each rank's loss is a mean over its own samples; scaled by N * n_r / sum(n), the average over ranks
            # the reducers compute becomes the mean over every sample of the step. A hook on the loss scales its
            # gradient, so every hook and logger still sees the loss the user returned.
            weight = self.world_size * count / total.item()
            closure_loss.register_hook(lambda grad: grad * weight)

    @contextmanager
    @override
    def block_backward_sync(self) -> Generator[None, None, None]:
        """Inner steps of gradient accumulation: gradients accumulate in the buckets, nothing is sent."""
        if self._engine is None:
            yield None
            return
        self._engine.require_sync = False
        try:
            yield None
        finally:
            self._engine.require_sync = True

    @override
    def post_backward(self, closure_loss: Tensor) -> None:
        # The engine's autograd callback has normally synchronized already; this catches a backward that ended
        # without reaching it.
        if self._engine is not None:
            self._engine.finish()

    @override
    def optimizer_step(
        self,
        optimizer: Optimizer,
        closure: Callable[[], Any],
        model: pl.LightningModule | Module | None = None,
        **kwargs: Any,
    ) -> Any:
        pm = self._plugin_manager
        if pm is None or self._engine is None:
            return super().optimizer_step(optimizer, closure, model, **kwargs)

        def closure_then_hook() -> Any:
            result = closure()
            pm.hook.on_pre_optimizer_step(optimizer=optimizer)
            if self.gradient_clip_norm is not None:
                self._clip_grad_norm(optimizer, self.gradient_clip_norm)
            return result

        if self.skip_nonfinite:
            # Run forward and backward first: whether to step is known only after the gradients are synchronized.
            result = closure_then_hook()
            if self._engine.nonfinite:
                self.skipped_steps += 1
                optimizer.zero_grad(set_to_none=True)
                self._log_metrics(pm)
                return result
            output = super().optimizer_step(optimizer, lambda: result, model, **kwargs)
        else:
            output = super().optimizer_step(optimizer, closure_then_hook, model, **kwargs)
        pm.hook.on_after_optimizer_step(optimizer=optimizer)
        self._log_metrics(pm)
        if self._heartbeat is not None:
            self._heartbeat.step += 1
        return output

    # ------------------------------------------------------------------ gradient clipping

    def _clip_grad_norm(self, optimizer: Optimizer, max_norm: float) -> Tensor:
        """Clip by the global 2-norm: a sharder answers (each rank holds a shard), else torch's clip."""
        pm = self._plugin_manager
        norm = pm.hook.on_clip_grad_norm(optimizer=optimizer, max_norm=max_norm) if pm is not None else None
        if norm is None:
            params = [p for group in optimizer.param_groups for p in group["params"]]
            norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
        return norm

    def _route_gradient_clipping(self) -> None:
        """``Trainer(gradient_clip_val=..., gradient_clip_algorithm="norm")`` reaches the precision plugin's
        ``clip_grad_by_norm``, which would clip each shard by its own norm; send it through the plugins.
        ``gradient_clip_algorithm="value"`` clamps each element, which is right on shards as it is; the module's
        own ``.grad`` (whole at ZeRO stage 1, where the optimizer's pieces are slices of it) is clamped too, so it
        shows what the optimizer applies."""
        plugin = self.precision_plugin
        if getattr(plugin, "_ddp_plugin_routed", False):
            return

        def clip_grad_by_norm(optimizer: Optimizer, clip_val: float) -> None:
            if self._engine is None:
                return type(plugin).clip_grad_by_norm(plugin, optimizer, clip_val)
            self._clip_grad_norm(optimizer, float(clip_val))
            return None

        def clip_grad_by_value(optimizer: Optimizer, clip_val: float) -> None:
            type(plugin).clip_grad_by_value(plugin, optimizer, clip_val)
            if self._engine is not None and self.zero_stage and self.model is not None:
                # Clamping twice is clamping once: the slices the optimizer's pieces share are not clipped twice.
                whole = [p for p in self.model.parameters() if p.grad is not None]
                if whole:  # (none at stages 2-3; torch's clip_grad_value_ fails on an empty list)
                    torch.nn.utils.clip_grad_value_(whole, clip_val)

        plugin.clip_grad_by_norm = clip_grad_by_norm  # type: ignore[method-assign]
        plugin.clip_grad_by_value = clip_grad_by_value  # type: ignore[method-assign]
        plugin._ddp_plugin_routed = True  # type: ignore[attr-defined]

    @contextmanager
    def full_parameters(self) -> Generator[None, None, None]:
        """Inside, every module parameter holds its full value on every rank (at ZeRO stage 3 they are
        all-gathered, and freed again on exit; call it on every rank). Read-only: changes are not kept."""
        with self._lent("on_gather_full_parameters"):
            yield

    @contextmanager
    def full_gradients(self) -> Generator[None, None, None]:
        """Inside, every module parameter's ``.grad`` holds its whole gradient on every rank, as under DDP: the
        global mean after a synchronizing backward (clipped once clipping ran), ``None`` where the optimizer has
        none. At ZeRO stages 2 and 3 the gradient shards are all-gathered into a buffer of the gradients' size
        (freed on exit, when each ``.grad`` is restored); at stages 0 and 1 ``.grad`` is whole anyway and nothing
        happens. Call it on every rank (``on_after_backward``, ``on_before_optimizer_step``,
        ``on_train_batch_end``). Read-only: changes are not applied. For norms alone, :meth:`grad_norm` needs no
        gather."""
        with self._lent("on_gather_full_gradients"):
            yield

    @contextmanager
    def _lent(self, hook_name: str) -> Generator[None, None, None]:
        """Call the gather hook ``hook_name`` with ``gather=True`` on entry and ``False`` on exit, during a fit."""
        pm = self._plugin_manager if self._engine is not None else None
        hook = getattr(pm.hook, hook_name) if pm is not None else None
        if hook is not None:
            hook(gather=True)
        try:
            yield
        finally:
            if hook is not None:
                hook(gather=False)

    def grad_norm(self, norm_type: float | int | str = 2, group_separator: str = "/") -> dict[str, Tensor]:
        """``lightning.pytorch.utilities.grad_norm(module, norm_type)`` of the LightningModule, at every ZeRO
        stage: each parameter's gradient norm (``grad_{p}_norm/{name}``) and their total
        (``grad_{p}_norm_total``), ready for ``self.log_dict``. At stages 2 and 3 computed from the shards with one
        all-reduce of two numbers per parameter (call it on every rank); elsewhere it reads ``.grad``."""
        from lightning.pytorch.utilities import grad_norm

        module = self.lightning_module
        assert module is not None
        norm_type = float(norm_type)
        if norm_type <= 0:
            raise ValueError(f"`norm_type` must be a positive number or 'inf' (infinity norm). Got {norm_type}")
        pm = self._plugin_manager if self._engine is not None else None
        per_param = pm.hook.on_grad_norms(module=module, norm_type=norm_type) if pm is not None else None
        if per_param is None:
            return grad_norm(module, norm_type, group_separator)
        norms = {f"grad_{norm_type}_norm{group_separator}{name}": value for name, value in per_param.items()}
        if norms:
            norms[f"grad_{norm_type}_norm_total"] = torch.tensor([float(v) for v in norms.values()]).norm(norm_type)
        return norms

    # ------------------------------------------------------------------ memory

    def memory_bytes(self) -> dict[str, int]:
        """This rank's bytes of parameters, gradients and optimizer state, measured on the live tensors (each
        storage counted once, released ones as zero): module parameters and the optimizers' (sharded) ones,
        gradient buckets and every ``.grad``, and every tensor in the optimizers' state."""
        seen: set[int] = set()

        def size(tensors: Iterable[Tensor | None]) -> int:
            total = 0
            for t in tensors:
                if t is None:
                    continue
                storage = t.untyped_storage()
                if storage.nbytes() == 0 or storage.data_ptr() in seen:
                    continue
                seen.add(storage.data_ptr())
                total += storage.nbytes()
            return total

        module_params = list(self.model.parameters()) if self.model is not None else []
        opt_params = [p for opt in self.optimizers for g in opt.param_groups for p in g["params"]]
        params = size([*module_params, *opt_params])
        buckets = [b.buffer for b in self._engine.buckets] if self._engine is not None else []
        grads = size([*buckets, *(p.grad for p in module_params), *(p.grad for p in opt_params)])
        state = size(
            v for opt in self.optimizers for st in opt.state.values() for v in st.values() if isinstance(v, Tensor)
        )
        return {"params": params, "grads": grads, "optimizer_state": state, "total": params + grads + state}

    # ------------------------------------------------------------------ metrics

    def _log_metrics(self, pm: pluggy.PluginManager) -> None:
        metrics: dict[str, float] = {}
        for part in pm.hook.on_collect_metrics():
            metrics.update(part or {})
        if self.skip_nonfinite:
            metrics["train/skipped_steps"] = float(self.skipped_steps)
        memory = self.memory_bytes()
        metrics.update({f"memory/{name}_MB": value / 1e6 for name, value in memory.items()})
        if not metrics:
            return
        for name, value in metrics.items():
            self._metric_sums[name] = self._metric_sums.get(name, 0.0) + value
        self._metric_steps += 1
        module = self.lightning_module
        if module is not None and module._current_fx_name is not None:
            # Through LightningModule.log, so every logger and `log_every_n_steps` apply as to the user's metrics.
            module.log_dict(metrics, on_step=True, on_epoch=False, prog_bar=self.progress_bar_metrics)

    @property
    def metric_totals(self) -> dict[str, float]:
        """Sums of the plugins' per-step metrics over the current or last ``fit`` (this rank's values)."""
        return dict(self._metric_sums)

    @property
    def metric_means(self) -> dict[str, float]:
        """Per-step means of the plugins' metrics over the current or last ``fit`` (this rank's values)."""
        return {name: total / max(self._metric_steps, 1) for name, total in self._metric_sums.items()}

    def _print_metric_summary(self) -> None:
        if not self._metric_steps:
            return
        rows = "\n".join(f"  {name:<24} {value:12.3f}" for name, value in sorted(self.metric_means.items()))
        rank_zero_info(f"ddp_plugin: per-step means over {self._metric_steps} optimizer steps (rank 0):\n{rows}")

    @override
    def on_exception(self, exception: BaseException) -> None:
        # The other ranks' failing collectives will name this rank and this error.
        health.report_exception(exception)

    # ------------------------------------------------------------------ collectives for Lightning

    @override
    def barrier(self, name: str | None = None, *args: Any, **kwargs: Any) -> None:
        if not _distributed_is_initialized():
            return
        try:
            if dist.get_backend() == "nccl":
                dist.barrier(device_ids=[self.root_device.index])
            else:
                dist.barrier()
        except Exception as err:
            # E.g. rank 0 died while writing a checkpoint: say which rank, not only gloo's "connection reset".
            raise RuntimeError(health.diagnose(err, what=f"the barrier {name or ''}".rstrip())) from err

    @override
    def broadcast(self, obj: TBroadcast, src: int = 0) -> TBroadcast:
        if not _distributed_is_initialized():
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src, group=_group.WORLD)
        return box[0]

    @override
    def reduce(self, tensor: Tensor, group: Any | None = None, reduce_op: ReduceOp | str | None = "mean") -> Tensor:
        if isinstance(tensor, Tensor):
            return _sync_ddp_if_available(tensor, group, reduce_op=reduce_op)
        return tensor

    # ------------------------------------------------------------------ checkpoints

    @override
    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        assert self.lightning_module is not None
        state = checkpoint["state_dict"]
        missing, unexpected, mismatched = _compare_state_dicts(self.lightning_module.state_dict(), state)
        if strict and (missing or unexpected or mismatched):
            details = []
            if missing:
                details.append(f"missing from the checkpoint: {_some(missing)}")
            if unexpected:
                details.append(f"not in this model: {_some(unexpected)}")
            if mismatched:
                details.append(f"different shapes: {_some(mismatched)}")
            raise ValueError(
                f"The checkpoint does not fit {type(self.lightning_module).__name__}: {'; '.join(details)}. Was it"
                " saved from another model (or other hyperparameters)?"
            )
        self.lightning_module.load_state_dict(state, strict=strict)

    # The plugins of the last `fit` answer the state hooks during it and after it (until the next `fit`): the
    # sharder's layout and the sharded optimizer outlive `teardown`, so `trainer.save_checkpoint` after `fit` (or
    # after `validate`/`test`) writes what a save during `fit` writes.

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        pm = self._plugin_manager
        if self.checkpoint == "sharded":
            state = None
            if pm is not None:
                state = pm.hook.on_local_module_state_dict(module=self.lightning_module)
            assert self.lightning_module is not None
            return state if state is not None else self.lightning_module.state_dict()
        if pm is not None:
            with diagnosed("the checkpoint's gather of the model to rank 0"):
                state = pm.hook.on_module_state_dict(module=self.lightning_module)
            if state is not None:
                return state
        return super().lightning_module_state_dict()

    @override
    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        pm = self._plugin_manager
        optimizer = getattr(optimizer, "_optimizer", optimizer)  # a LightningOptimizer wraps the user's
        if self.checkpoint == "sharded":
            local = None
            if pm is not None:
                local = pm.hook.on_local_optimizer_state_dict(optimizer=optimizer)
            if local is None:
                sd = optimizer.state_dict()
                flat = {f"{i}/{k}": v for i, st in sd["state"].items() for k, v in st.items()}
                local = {"state": flat, "param_groups": sd["param_groups"], "shapes": {}}
            return local
        if pm is not None:
            with diagnosed("the checkpoint's gather of the optimizer state's layout to rank 0"):
                state = pm.hook.on_optimizer_state_dict(optimizer=optimizer)
            if state is not None:
                return state
        return super().optimizer_state(optimizer)

    @override
    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        pm = self._plugin_manager
        if pm is None or self._engine is None:
            return super().load_optimizer_state_dict(checkpoint)
        for optimizer, state in zip(self.optimizers, checkpoint["optimizer_states"]):
            if not pm.hook.on_load_optimizer_state_dict(optimizer=optimizer, state_dict=state):
                optimizer.load_state_dict(state)
            _optimizers_to_device([optimizer], self.root_device)
        return None

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None) -> None:
        if self._plugin_manager is not None:
            checkpoint[CHECKPOINT_KEY] = self._plugin_state()
        if self.checkpoint == "sharded":
            self._save_sharded(checkpoint, filepath)
            return
        # A sharder's optimizer state arrives as deferred tensors: rank 0 produces and writes them one at a
        # time (AtomicCheckpointIO) while every other rank produces its part of each, in the same order. Every
        # rank then learns whether rank 0's write succeeded, so that all fail together, naming the cause. (At
        # stages 1-3 on every rank: with shard_scope="node" the ranks of other nodes have nothing to produce.)
        deferred = deferred_storages(checkpoint)
        if not deferred and not self.zero_stage:
            super().save_checkpoint(checkpoint, filepath, storage_options=storage_options)
            return
        what = f"write the checkpoint `{filepath}`"
        if not self.is_global_zero:
            produce_all(deferred)
            agree_with_rank_0(None, what)
            return
        error: Exception | None = None
        try:
            if deferred and not isinstance(self.checkpoint_io, AtomicCheckpointIO):
                checkpoint = materialize(checkpoint)  # another CheckpointIO gets ordinary tensors
            super().save_checkpoint(checkpoint, filepath, storage_options=storage_options)
        except Exception as err:  # noqa: BLE001 - raised below, after the other ranks are told
            error = err
        agree_with_rank_0(error, what)

    def _save_sharded(self, checkpoint: dict[str, Any], filepath: Any) -> None:
        assert self.lightning_module is not None
        if not is_local_path(filepath):
            raise ValueError(f'`checkpoint="sharded"` writes to a local (or shared) filesystem; got `{filepath}`.')
        shapes: dict[str, tuple[int, ...]] = {
            f"model/{name}": tuple(value.shape)
            for name, value in self.lightning_module.state_dict(keep_vars=True).items()
            if isinstance(value, Tensor)
        }
        optimizers = checkpoint.get("optimizer_states", [])
        for j, opt in enumerate(optimizers):
            shapes.update({f"optim/{j}/{k}": v for k, v in opt.get("shapes", {}).items()})
        sharded_checkpoint.save(checkpoint, checkpoint["state_dict"], optimizers, shapes, local_path(filepath))

    @override
    def remove_checkpoint(self, filepath: Any) -> None:
        if self.is_global_zero and sharded_checkpoint.is_sharded_checkpoint(filepath):
            shutil.rmtree(str(filepath))
            return
        super().remove_checkpoint(filepath)

    def _plugin_state(self) -> dict[str, Any]:
        assert self._plugin_manager is not None
        merged: dict[str, Any] = {}
        for part in self._plugin_manager.hook.on_save_state_dict():
            if not part:
                continue
            clash = merged.keys() & part.keys()
            if clash:
                raise RuntimeError(f"Two plugins saved state under the same key(s) {sorted(clash)}; keys must be unique.")
            merged.update(part)
        return merged

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        if is_local_path(checkpoint_path) and not os.path.exists(local_path(checkpoint_path)):
            raise FileNotFoundError(
                f"Checkpoint not found: `{checkpoint_path}` does not exist (resolved from the current directory"
                f" {os.getcwd()}). Pass the path of a `.ckpt` file written by `trainer.save_checkpoint` or"
                " `ModelCheckpoint`."
            )
        if is_local_path(checkpoint_path) and sharded_checkpoint.is_sharded_checkpoint(local_path(checkpoint_path)):
            checkpoint = sharded_checkpoint.load(local_path(checkpoint_path))
        else:
            try:
                checkpoint = super().load_checkpoint(checkpoint_path, weights_only=weights_only)
            except Exception as err:
                # Empty, random or cut-short files make torch.load say "Ran out of input" or suggest
                # `weights_only=False`: say what it is instead.
                bad = not_a_checkpoint(checkpoint_path, err) if is_local_path(checkpoint_path) else None
                if bad is not None:
                    raise bad from err
                raise
        state = checkpoint.get(CHECKPOINT_KEY)
        if state is not None:
            if self._engine is not None:
                assert self._plugin_manager is not None
                self._plugin_manager.hook.on_load_state_dict(state=state)
            else:
                # Lightning restores before `setup`; hand the state to this fit's plugins once they exist.
                self._pending_plugin_state = state
        return checkpoint

    # ------------------------------------------------------------------ registry

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: _StrategyRegistry) -> None:
        entries = [
            ("hierarchical_zero", {}, "hierarchical data parallel, stage 0"),
            ("hierarchical_zero_spawn", {"start_method": "spawn"}, "hierarchical data parallel, spawn start method"),
        ] + [
            (f"hierarchical_zero_stage_{stage}", {"zero_stage": stage}, f"hierarchical data parallel, ZeRO stage {stage}")
            for stage in (1, 2, 3)
        ]
        for name, init_params, description in entries:
            strategy_registry.register(name, cls, description=description, **init_params)


_live_strategies: "weakref.WeakSet[HierarchicalZeroStrategy]" = weakref.WeakSet()


def _destroy_process_groups_at_exit() -> None:
    # torch asks for destroy_process_group() before exit, but for gloo that only unregisters the groups: their
    # worker threads live on until the last Python reference goes, which for a trainer kept in a global is during
    # interpreter finalization, where a gloo thread releasing a tensor cannot take the GIL any more and the
    # process aborts after a successful run ("terminate called without an active exception", about 1 run in
    # 100 here). So the references are dropped here, while the interpreter is whole: our cache, every strategy's
    # groups and plugins (their state is of no use once the process exits), then the cycles that hold the rest.
    _process_groups.cache_clear()
    for strategy in list(_live_strategies):
        strategy._release_process_groups()
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    gc.collect()


@functools.lru_cache(maxsize=None)
def _process_groups(
    layout: Layout, device: torch.device, backend: str, world_id: int, timeout: timedelta | None
) -> tuple[Topology, dist.ProcessGroup]:
    """The mesh's groups and a world-sized group for the engine's bookkeeping, created once per process, default
    group and timeout: several `fit` calls in one script share them (gloo groups destroyed mid-run abort at exit).
    Every one fails its collectives after `timeout`: with torch's 30-minute default on any of them, a hung rank
    hung every other rank on it, and a rank that had failed could not exit while its bookkeeping all-reduce was
    still waiting (gloo joins its worker thread when a group is destroyed)."""
    atexit.register(_destroy_process_groups_at_exit)
    return build_topology(layout, device, timeout), new_group(backend=backend, timeout=timeout)


# ---------------------------------------------------------------------- validation at the door


def _check_choice(flag: str, value: Any, allowed: Iterable[Any]) -> Any:
    allowed = tuple(allowed)
    if value not in allowed:
        raise ValueError(f"`{flag}={value!r}` is not supported; allowed values: {', '.join(map(repr, allowed))}.")
    return value


def _compare_state_dicts(mine: Mapping[str, Tensor], theirs: Mapping[str, Any]) -> tuple[list[str], list[str], list[str]]:
    missing = [k for k in mine if k not in theirs]
    unexpected = [k for k in theirs if k not in mine]
    mismatched = [
        f"{k} {tuple(theirs[k].shape)} vs {tuple(v.shape)}"
        for k, v in mine.items()
        if k in theirs and isinstance(theirs[k], Tensor) and tuple(theirs[k].shape) != tuple(v.shape)
    ]
    return missing, unexpected, mismatched


def _some(names: list[str], limit: int = 5) -> str:
    shown = ", ".join(names[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")


def _check_zero_stage(stage: Any) -> int:
    if isinstance(stage, bool) or not isinstance(stage, int):
        raise ValueError(f"`zero_stage={stage!r}` must be an integer; allowed values: 0, 1, 2, 3.")
    return _check_choice("zero_stage", stage, ZERO_STAGES)


def _from_deepspeed_config(config: Any) -> Any:
    from ddp_plugin.deepspeed_config import describe_ignored, from_deepspeed_config

    mapped = from_deepspeed_config(config)
    message = describe_ignored(mapped)
    if message:
        rank_zero_warn(message)
    return mapped


def _check_devices_per_node(value: Any) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(
            f"`devices_per_node={value!r}` must be a positive integer that divides the world size, or None to"
            " use the launcher's ranks per node."
        )
    return value


def _check_mapping(flag: str, value: Any) -> dict[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ValueError(f"`{flag}` must be a dict of option names to values, got {type(value).__name__}.")
    return dict(value)


def _check_bool(flag: str, value: Any, none: bool = False) -> bool:
    # bool(...) would take "no" (and any non-empty string) for True.
    if not isinstance(value, bool):
        allowed = "None, True, False" if none else "True, False"
        raise ValueError(f"`{flag}={value!r}` must be a bool; allowed values: {allowed}.")
    return value


def _check_positive_number(flag: str, value: Any, maximum: float | None = None, unit: str = "") -> float:
    # `not value > 0` also refuses nan; inf passed that and broke later on every rank (an OverflowError).
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not value > 0
        or not math.isfinite(value)
        or (maximum is not None and value > maximum)
    ):
        limit = f" and at most {maximum}{unit}" if maximum is not None else ""
        raise ValueError(f"`{flag}={value!r}` must be a positive number, finite{limit}.")
    return value


def _check_options_are_read(compression: str | None, options: Mapping[str, Any], pm: pluggy.PluginManager) -> None:
    """Options without a codec are read by nobody, unless a plugin of the user's (or an installed one) takes the
    flags in ``on_setup(options=...)``: a forgotten ``compression=`` would otherwise train uncompressed, silently."""
    if compression is not None or not options:
        return
    readers = [
        impl.plugin for impl in pm.hook.on_setup.get_hookimpls()
        if "options" in impl.argnames and not type(impl.plugin).__module__.startswith("ddp_plugin.")
    ]
    if readers:
        return
    from ddp_plugin.plugin_manager import available_codecs

    allowed = ", ".join(map(repr, available_codecs()))
    raise ValueError(
        f"`compression_options={dict(options)!r}` has no effect: `compression` is not set, and no plugin reads the"
        f" options (a plugin of yours receives them in `on_setup(options=...)`). Set `compression` to the codec"
        f" they are for ({allowed}), or drop `compression_options`."
    )


def _check_backend(backend: Any) -> str | None:
    if backend is None:
        return None
    allowed = ("gloo", "nccl", "mpi")
    _check_choice("process_group_backend", backend, allowed)
    if backend == "mpi" and not dist.is_mpi_available():
        raise ValueError(
            "`process_group_backend='mpi'` needs a torch build with MPI support, and this one has none; use"
            " 'gloo' (CPU) or 'nccl' (CUDA). `mpirun` launches still work with those backends."
        )
    return backend


def _check_timeout(timeout: Any) -> timedelta | None:
    if timeout is None:
        return None
    if isinstance(timeout, timedelta):
        ok = timedelta(0) < timeout <= MAX_TIMEOUT
    else:
        ok = (
            not isinstance(timeout, bool)
            and isinstance(timeout, (int, float))
            and math.isfinite(timeout)
            and 0 < timeout <= MAX_TIMEOUT.total_seconds()
        )
    if not ok:
        # A negative timedelta used to fail only at connect, nan and inf with errors that did not name the flag.
        raise ValueError(
            f"`timeout={timeout!r}` must be a datetime.timedelta or a positive number of seconds, finite and at"
            f" most {MAX_TIMEOUT.days} days."
        )
    return timeout if isinstance(timeout, timedelta) else timedelta(seconds=timeout)
