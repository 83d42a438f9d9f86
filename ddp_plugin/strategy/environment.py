"""The process side of the strategy, as functions the strategy's Lightning methods call: devices and ranks, the
launcher, the rendezvous with its timeouts, the process groups and device mesh of the layout, and the collectives
Lightning itself calls (barrier, broadcast, reduce), with failures diagnosed. What Lightning's ``DDPStrategy`` does
for its processes; each takes the settings it reads (the strategy's ``config``) and what Lightning holds."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from lightning.fabric.plugins.environments import MPIEnvironment
from lightning.fabric.utilities.distributed import group as _group
from lightning.fabric.utilities.types import ReduceOp
from lightning.pytorch.strategies.strategy import TBroadcast
from torch import Tensor

from ddp_plugin.runtime import lightning_adapter
from ddp_plugin import health
from ddp_plugin.strategy.process_groups import ProcessGroups, check_ranks_per_node
from ddp_plugin.runtime.topology import Layout, connect_timeout, set_collective_timeout

if TYPE_CHECKING:
    from lightning.fabric.plugins import ClusterEnvironment
    from lightning.pytorch.strategies import ParallelStrategy
    from torch.distributed.device_mesh import DeviceMesh

    from ddp_plugin.strategy.config import StrategyConfig


def root_device(parallel_devices: list[torch.device] | None, local_rank: int) -> torch.device:
    assert parallel_devices is not None
    if local_rank >= len(parallel_devices):
        if all(d.type == "cpu" for d in parallel_devices):
            # More ranks on this node than `devices`: let it reach the collective layout check, which fails on every
            # rank with one message instead of this rank alone with an IndexError.
            return torch.device("cpu")
        raise ValueError(
            f"This node runs local rank {local_rank}, but `devices={len(parallel_devices)}`: start as many"
            " processes per node as `devices` says (e.g. torchrun's `--nproc_per_node`)."
        )
    return parallel_devices[local_rank]


def layout(config: StrategyConfig, num_nodes: int, num_processes: int) -> Layout:
    """The ranks' layout of ``config``'s flags on ``num_nodes`` x ``num_processes`` processes."""
    per_node = config.devices_per_node or num_processes
    tp = config.tensor_parallel_size
    return Layout(world_size=num_nodes * num_processes, ranks_per_node=per_node,
                  tensor_parallel_size=per_node if tp == "auto" else tp,
                  pipeline_parallel_size=config.pipeline_parallel_size)


def sampler_kwargs(config: StrategyConfig, layout: Layout, global_rank: int,
                   data_groups: list[int] | None = None) -> dict[str, Any]:
    """The DistributedSampler's split: the ranks of a tensor-parallel group, and the stages of a pipeline, read the
    same batch, so it splits over data-parallel ranks; with ``fault_tolerance`` every replica group its own part
    of the data: one of ``replica_groups``, live or not, or one of ``data_groups``, the live ones
    (``data_split="quorum"``: :mod:`ddp_plugin.fault_tolerance.data`)."""
    tp = layout.tensor_parallel_size
    rank = (global_rank % layout.stage_size) // tp
    ft = config.fault_tolerance
    if ft is not None:
        from ddp_plugin.fault_tolerance.data import sampler_split

        return sampler_split(ft, data_groups, layout.data_parallel_size, rank)
    return {"num_replicas": layout.data_parallel_size, "rank": rank}


def launcher(strategy: ParallelStrategy, config: StrategyConfig, cluster_environment: ClusterEnvironment,
             num_processes: int, num_nodes: int) -> Any:
    """Lightning's launcher for ``start_method``: its subprocess script launcher, or its multiprocessing one."""
    subprocess_script, multiprocessing = lightning_adapter.launcher_classes()
    if config.start_method == "popen":
        return subprocess_script(cluster_environment, num_processes, num_nodes)
    return multiprocessing(strategy, start_method=config.start_method)


def backend(config: StrategyConfig, cluster_environment: ClusterEnvironment | None, device: torch.device) -> str:
    if config.process_group_backend:
        return config.process_group_backend
    if isinstance(cluster_environment, MPIEnvironment) and dist.is_mpi_available():
        return "mpi"
    return lightning_adapter.default_backend(device)


def connect(cluster_environment: ClusterEnvironment | None, backend: str, device: torch.device,
            config: StrategyConfig) -> None:
    """The default process group, over the cluster environment's rendezvous."""
    if backend == "nccl":
        # On a failed or timed-out collective NCCL's watchdog aborts the communicators and lets the collective
        # raise (2, "CleanUpOnly"), where torch's default (3) ends the process without a word: the raised error is
        # what the survivors' diagnosis names the rank at fault from (ddp_plugin.health). Read when the group is
        # made; a value the user set is kept.
        os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "2")
    initializing = not dist.is_initialized()
    # The rendezvous waits for the other ranks at least minutes (a rank still importing on a loaded machine is
    # late, not dead); `timeout` bounds the collectives that follow.
    device_id = device if device.type != "cpu" else None
    lightning_adapter.init_dist_connection(cluster_environment, backend, timeout=connect_timeout(config.timeout), device_id=device_id)
    if initializing:  # a default group the user created keeps the timeout they gave it
        set_collective_timeout(dist.group.WORLD, config.timeout)


def process_groups(config: StrategyConfig, cluster_environment: ClusterEnvironment | None, num_processes: int,
                   world_size: int, layout: Layout, device: torch.device, backend: str | None) -> ProcessGroups:
    """The process groups and meshes of the layout. Collectives, so not made in ``setup_environment`` for a module
    that needs no device mesh: that (as DDPStrategy's) only creates the process group, and code that mocks its
    creation, as Lightning's tests do, must not reach a collective."""
    if config.devices_per_node is None:  # simulated nodes: the user chose the layout on purpose
        check_ranks_per_node(cluster_environment, num_processes, world_size)
    return ProcessGroups.get(layout, device, backend, config.timeout)


def device_mesh(groups: ProcessGroups | None) -> DeviceMesh:
    """Lightning's ``("data_parallel", "tensor_parallel")`` mesh, as ``ModelParallelStrategy`` has it."""
    if groups is None or not groups.has_device_mesh:
        raise RuntimeError(
            "The device mesh exists once the processes have connected, for a LightningModule that overrides"
            " `configure_model` (or with `tensor_parallel_size` > 1); read it in `configure_model`."
        )
    return groups.device_mesh()


# ------------------------------------------------------------------ collectives for Lightning


def barrier(device: torch.device, name: str | None = None) -> None:
    if not lightning_adapter.distributed_is_initialized():
        return
    # E.g. rank 0 died while writing a checkpoint: say which rank, not only gloo's "connection reset".
    with health.diagnosed(f"the barrier {name or ''}".rstrip()):
        if dist.get_backend() == "nccl":
            dist.barrier(device_ids=[device.index])
        else:
            dist.barrier()


def broadcast(obj: TBroadcast, src: int = 0) -> TBroadcast:
    if not lightning_adapter.distributed_is_initialized():
        return obj
    box = [obj]
    with health.diagnosed("a broadcast"):
        dist.broadcast_object_list(box, src, group=_group.WORLD)
    return box[0]


def reduce(tensor: Tensor, group: Any | None = None, reduce_op: ReduceOp | str | None = "mean") -> Tensor:
    if not isinstance(tensor, Tensor):
        return tensor
    with health.diagnosed("a reduce"):
        return lightning_adapter.sync_ddp_if_available(tensor, group, reduce_op=reduce_op)
