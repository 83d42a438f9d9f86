"""The process side of the strategy: devices and ranks, the launcher, the rendezvous with its timeouts, the
process groups and device mesh of the layout, and the collectives Lightning itself calls (barrier, broadcast,
reduce), with failures diagnosed. What Lightning's ``DDPStrategy`` does for its processes, as the base class of
``HierarchicalZeroStrategy``; it reads the settings from the subclass's ``config``."""

from __future__ import annotations

import os

from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from lightning.fabric.plugins.environments import MPIEnvironment
from lightning.fabric.utilities.distributed import (
    _distributed_is_initialized,
    _get_default_process_group_backend_for_device,
    _init_dist_connection,
    _sync_ddp_if_available,
)
from lightning.fabric.utilities.distributed import group as _group
from lightning.fabric.utilities.seed import reset_seed
from lightning.fabric.utilities.types import ReduceOp
from lightning.pytorch.strategies.launchers import _MultiProcessingLauncher, _SubprocessScriptLauncher
from lightning.pytorch.strategies.parallel import ParallelStrategy
from lightning.pytorch.strategies.strategy import TBroadcast
from lightning.pytorch.utilities.rank_zero import rank_zero_only
from lightning_utilities.core.rank_zero import rank_zero_only as utils_rank_zero_only
from torch import Tensor
from typing_extensions import override

from ddp_plugin import health
from ddp_plugin.process_groups import ProcessGroups, check_ranks_per_node
from ddp_plugin.topology import Layout, connect_timeout, set_collective_timeout

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

    from ddp_plugin.config import StrategyConfig


class DistributedEnvironment(ParallelStrategy):
    """Ranks, launcher and rendezvous for ``config``'s flags (``start_method``, ``process_group_backend``,
    ``timeout``, ``devices_per_node``)."""

    config: StrategyConfig
    _groups: ProcessGroups | None = None
    _backend: str | None = None
    _num_nodes: int = 1

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
        # The ranks of a tensor-parallel group, and the stages of a pipeline, read the same batch: the sampler
        # splits over data-parallel ranks.
        layout = self._layout()
        tp = layout.tensor_parallel_size
        rank = (self.global_rank % layout.stage_size) // tp
        ft = self.config.fault_tolerance
        if ft is not None:  # every replica group its own part of the data, live or not (docs/fault_tolerance.md)
            n = layout.data_parallel_size
            return {"num_replicas": n * ft.replica_groups, "rank": ft.replica_group * n + rank}
        return {"num_replicas": layout.data_parallel_size, "rank": rank}

    @property
    def process_group_backend(self) -> str | None:
        return self._backend or self.config.process_group_backend

    # ------------------------------------------------------------------ launching and connecting

    @override
    def _configure_launcher(self) -> None:
        assert self.cluster_environment is not None
        # Lightning calls this in the Trainer's constructor, when devices and num_nodes are known: a layout
        # that cannot work fails there, before any process starts.
        if self.num_processes:
            self._layout()
        if self.config.start_method == "popen":
            self._launcher = _SubprocessScriptLauncher(self.cluster_environment, self.num_processes, self.num_nodes)
        else:
            self._launcher = _MultiProcessingLauncher(self, start_method=self.config.start_method)

    def _layout(self) -> Layout:
        per_node = self.config.devices_per_node or self.num_processes
        tp = self.config.tensor_parallel_size
        return Layout(world_size=self.num_nodes * self.num_processes, ranks_per_node=per_node,
                      tensor_parallel_size=per_node if tp == "auto" else tp,
                      pipeline_parallel_size=self.config.pipeline_parallel_size)

    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        self.setup_distributed()

    def setup_distributed(self) -> None:
        reset_seed()
        self.set_world_ranks()
        backend = self._backend = self._get_process_group_backend()
        if backend == "nccl":
            # On a failed or timed-out collective NCCL's watchdog aborts the communicators and lets the collective
            # raise (2, "CleanUpOnly"), where torch's default (3) ends the process without a word: the raised
            # error is what the survivors' diagnosis names the rank at fault from (ddp_plugin.health). Read when
            # the group is made; a value the user set is kept.
            os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "2")
        initializing = not dist.is_initialized()
        # The rendezvous waits for the other ranks at least minutes (a rank still importing on a loaded machine is
        # late, not dead); `timeout` bounds the collectives that follow.
        device_id = self.root_device if self.root_device.type != "cpu" else None
        _init_dist_connection(self.cluster_environment, backend, timeout=connect_timeout(self.config.timeout),
                              device_id=device_id)
        if initializing:  # a default group the user created keeps the timeout they gave it
            set_collective_timeout(dist.group.WORLD, self.config.timeout)

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

    def _connect(self) -> None:
        """The process groups and meshes of the layout. Collectives, so not in `setup_environment` for a module
        that needs no device mesh: that (as DDPStrategy's) only creates the process group, and code that mocks its
        creation, as Lightning's tests do, must not reach a collective."""
        if self.config.devices_per_node is None:  # simulated nodes: the user chose the layout on purpose
            check_ranks_per_node(self.cluster_environment, self.num_processes, self.world_size)
        self._groups = ProcessGroups.get(self._layout(), self.root_device, self._backend, self.config.timeout)

    def _get_process_group_backend(self) -> str:
        if self.config.process_group_backend:
            return self.config.process_group_backend
        if isinstance(self.cluster_environment, MPIEnvironment) and dist.is_mpi_available():
            return "mpi"
        return _get_default_process_group_backend_for_device(self.root_device)

    def set_world_ranks(self) -> None:
        if self.cluster_environment is not None:
            self.cluster_environment.set_global_rank(self.node_rank * self.num_processes + self.local_rank)
            self.cluster_environment.set_world_size(self.num_nodes * self.num_processes)
        rank_zero_only.rank = utils_rank_zero_only.rank = self.global_rank

    # ------------------------------------------------------------------ collectives for Lightning

    @override
    def on_exception(self, exception: BaseException) -> None:
        health.report_exception(exception)  # the other ranks' failing collectives will name this rank and error

    @override
    def barrier(self, name: str | None = None, *args: Any, **kwargs: Any) -> None:
        if not _distributed_is_initialized():
            return
        # E.g. rank 0 died while writing a checkpoint: say which rank, not only gloo's "connection reset".
        with health.diagnosed(f"the barrier {name or ''}".rstrip()):
            if dist.get_backend() == "nccl":
                dist.barrier(device_ids=[self.root_device.index])
            else:
                dist.barrier()

    @override
    def broadcast(self, obj: TBroadcast, src: int = 0) -> TBroadcast:
        if not _distributed_is_initialized():
            return obj
        box = [obj]
        with health.diagnosed("a broadcast"):
            dist.broadcast_object_list(box, src, group=_group.WORLD)
        return box[0]

    @override
    def reduce(self, tensor: Tensor, group: Any | None = None, reduce_op: ReduceOp | str | None = "mean") -> Tensor:
        if not isinstance(tensor, Tensor):
            return tensor
        with health.diagnosed("a reduce"):
            return _sync_ddp_if_available(tensor, group, reduce_op=reduce_op)

    @override
    def all_gather(self, tensor: Tensor, group: Any | None = None, sync_grads: bool = False) -> Tensor:
        # Between a sync mode's syncs no collective of ours crosses nodes, so a dead rank on another node is
        # often first met here (a callback's all_gather): name it, as the gradient synchronization does.
        with health.diagnosed("an all_gather"):
            return super().all_gather(tensor, group=group, sync_grads=sync_grads)
