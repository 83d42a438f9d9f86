"""The layout of ranks: nodes x ranks per node, and inside a node, tensor-parallel groups of consecutive ranks;
the data-parallel device mesh and process groups over it."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from ddp_plugin.hookspecs import Topology

if TYPE_CHECKING:
    from torch._C._distributed_c10d import Backend as C10dBackend
    from torch.distributed.device_mesh import DeviceMesh

CONNECT_TIMEOUT_FLOOR = timedelta(minutes=5)
"""Creating a group (and the first rendezvous) waits at least this long for every member, whatever ``timeout``
is: a rank still importing on a loaded machine is late, not dead."""


@dataclass(frozen=True)
class Layout:
    """World size, ranks per node, tensor-parallel and pipeline-parallel sizes, validated up front; everything
    after trusts these numbers (torchtitan's ``ParallelDims``, for the three dimensions this strategy has).

    Global rank = (pipeline rank * D + data-parallel rank) * T + tensor-parallel rank (pipeline outermost, tensor
    innermost), and data-parallel rank = node of the stage * (ranks per node / T) + its index in the node: a
    tensor-parallel group is T consecutive ranks of one node, a pipeline stage D * T consecutive ranks, whole
    nodes or a part of one."""

    world_size: int
    ranks_per_node: int
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1

    def __post_init__(self) -> None:
        if self.ranks_per_node < 1 or self.world_size % self.ranks_per_node != 0:
            raise ValueError(
                f"`devices_per_node={self.ranks_per_node}` does not divide the world size {self.world_size}: every"
                " node must run the same number of ranks. Set `devices_per_node` to a divisor of the world size"
                f" ({', '.join(str(d) for d in _divisors(self.world_size))}), or leave it None to use the"
                " launcher's ranks per node."
            )
        t, k, p = self.tensor_parallel_size, self.ranks_per_node, self.pipeline_parallel_size
        if t < 1 or k % t != 0:
            raise ValueError(
                f"`tensor_parallel_size={t}` must divide the ranks per node, {k} (`devices_per_node`, or the"
                " launcher's devices per node): a tensor-parallel group is consecutive ranks inside one node, whose"
                " per-layer collectives need the fast links. Allowed values:"
                f" {', '.join(str(d) for d in _divisors(k))}."
            )
        stage = self.world_size // p if p >= 1 and self.world_size % p == 0 else 0
        if not stage or stage % t or (stage % k and k % stage):
            allowed = [d for d in _divisors(self.world_size)
                       if (self.world_size // d) % t == 0 and ((self.world_size // d) % k == 0 or k % (self.world_size // d) == 0)]
            raise ValueError(
                f"`pipeline_parallel_size={p}` does not fit {self.world_size} ranks of {k} per node with"
                f" `tensor_parallel_size={t}`: each pipeline stage is (world size / pipeline_parallel_size) consecutive"
                " ranks, a multiple of the tensor-parallel size, and either whole nodes or a part of one node that"
                f" divides it. Allowed values: {', '.join(str(d) for d in allowed)}."
            )

    @property
    def stage_size(self) -> int:
        """Ranks of one pipeline stage (data-parallel x tensor-parallel)."""
        return self.world_size // self.pipeline_parallel_size

    @property
    def num_nodes(self) -> int:
        return self.world_size // self.ranks_per_node

    @property
    def data_parallel_size(self) -> int:
        return self.stage_size // self.tensor_parallel_size

    @property
    def data_parallel_layout(self) -> Layout:
        """The data-parallel ranks that hold one stage's tensor-parallel shard, as a layout of their own: the
        stage's nodes (one when several stages share a node)."""
        per_node = min(self.ranks_per_node, self.stage_size) // self.tensor_parallel_size
        return Layout(self.data_parallel_size, per_node)

    def global_rank(self, node: int, local: int, tensor_parallel_rank: int = 0, pipeline_rank: int = 0) -> int:
        """The rank of the ``local``-th data-parallel rank of ``node`` (of the stage's data-parallel layout) in
        tensor-parallel position ``tensor_parallel_rank`` of pipeline stage ``pipeline_rank``."""
        per_node = self.data_parallel_layout.ranks_per_node
        return (pipeline_rank * self.stage_size + (node * per_node + local) * self.tensor_parallel_size
                + tensor_parallel_rank)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def connect_timeout(timeout: timedelta | None) -> timedelta | None:
    """How long connecting (the rendezvous, creating a group) may wait for the other ranks: ``timeout``, but never
    less than :data:`CONNECT_TIMEOUT_FLOOR`. ``None``: torch's default."""
    return None if timeout is None else max(timeout, CONNECT_TIMEOUT_FLOOR)


def set_collective_timeout(group: dist.ProcessGroup | None, timeout: timedelta | None) -> None:
    """Make ``group``'s collectives (gloo, NCCL) fail after ``timeout`` instead of the timeout it was created with;
    no-op for ``None``, for a rank outside the group, and for MPI (which has no timeouts)."""
    if timeout is None or group is None or group == dist.GroupMember.NON_GROUP_MEMBER:
        return
    if dist.get_backend(group) in ("gloo", "nccl"):
        # torch 2.15 made this public as dist.set_timeout and deprecated the private name.
        set_timeout = getattr(dist, "set_timeout", None) or dist.distributed_c10d._set_pg_timeout
        set_timeout(timeout, group)


def new_group(
    ranks: list[int] | None = None, *, backend: str | None = None, timeout: timedelta | None = None
) -> dist.ProcessGroup:
    """``dist.new_group`` whose creation waits :func:`connect_timeout` for its members and whose collectives then
    fail after ``timeout`` (without one, torch gives every new group 30 minutes, whatever the default group has).
    Plugins that create groups should use it with ``topology.timeout``."""
    group = dist.new_group(ranks, timeout=connect_timeout(timeout), backend=backend)
    set_collective_timeout(group, timeout)
    return group


def _mesh_dim_options(backend: str, timeout: timedelta) -> C10dBackend.Options | None:
    """Options that make ``init_device_mesh`` create a dimension's groups with ``timeout`` (it passes their
    ``_timeout`` on to ``new_group``); ``None`` for backends without timeouts (MPI)."""
    if backend == "nccl":
        options = dist.ProcessGroupNCCL.Options()
        options.is_high_priority_stream = False  # what new_group gives NCCL groups by default
    elif backend == "gloo":
        options = dist.ProcessGroupGloo._Options()
    else:
        return None
    options._timeout = timeout
    return options


def build_topology(layout: Layout, device: torch.device, timeout: timedelta | None = None) -> Topology:
    """Build the data-parallel ``(node, local)`` device mesh over the initialized default process group.

    Ranks are laid out row-major (global rank = node * ranks_per_node + local rank), as Lightning, torchrun and
    SLURM number them. With tensor parallelism the mesh is ``(node, local, tensor_parallel)`` and the topology
    describes this rank's data-parallel ranks, those holding the same tensor-parallel shard (see
    :class:`~ddp_plugin.hookspecs.Topology`). Every rank must call this (creating subgroups is collective). Every
    group created here fails its collectives after ``timeout`` (the strategy's, which it also gives the default
    group when it creates that), so a hung rank cannot hang the others past it on any group.
    """
    rank = dist.get_rank()
    dp = layout.data_parallel_layout
    m, k, tp = dp.num_nodes, dp.ranks_per_node, layout.tensor_parallel_size
    pp = layout.pipeline_parallel_size
    # A dimension spanning every rank reuses the default group, whose timeout the strategy has set; the others
    # get new groups, created with the connect timeout (torch's default is 30 minutes, whatever `timeout` is).
    sizes = ({"pipeline_parallel": pp} if pp > 1 else {}) | {"node": m, "local": k} \
        | ({"tensor_parallel": tp} if tp > 1 else {})
    mesh = init_device_mesh(device.type, tuple(sizes.values()), mesh_dim_names=tuple(sizes),
                            backend_override=_overrides(sizes, layout.world_size, timeout))
    intra, inter = mesh.get_group("local"), mesh.get_group("node")

    def enumerate_groups(groups: list[list[int]]) -> dist.ProcessGroup:
        mine, _ = dist.new_subgroups_by_enumeration(groups, timeout=connect_timeout(timeout))
        return mine

    at = layout.global_rank
    positions = [(t, p) for p in range(pp) for t in range(tp)]
    side_intra = enumerate_groups([[at(n, l, t, p) for l in range(k)] for n in range(m) for t, p in positions])
    side_inter = enumerate_groups([[at(n, l, t, p) for n in range(m)] for l in range(k) for t, p in positions])
    tp_group = pp_group = None
    if tp == 1 and pp == 1:
        world, side_world, dp_mesh = dist.group.WORLD, new_group(timeout=timeout), mesh
    else:
        replicas = [[at(n, l, t, p) for n in range(m) for l in range(k)] for t, p in positions]
        world, side_world = enumerate_groups(replicas), enumerate_groups(replicas)
        dp_mesh = mesh["node", "local"]
        tp_group = mesh.get_group("tensor_parallel") if tp > 1 else None
        pp_group = mesh.get_group("pipeline_parallel") if pp > 1 else None
    for group in (intra, inter, side_intra, side_inter, world, side_world, tp_group, pp_group):
        if group is not None and group is not dist.group.WORLD:  # the default group's timeout is its creator's
            set_collective_timeout(group, timeout)
    return Topology(
        world_size=dp.world_size,
        rank=(rank % layout.stage_size) // tp,
        num_nodes=m,
        ranks_per_node=k,
        backend=dist.get_backend(),
        device=device,
        world_group=world,
        intra_node_group=intra,
        inter_node_group=inter,
        mesh=dp_mesh,
        side_world_group=side_world,
        side_intra_node_group=side_intra,
        side_inter_node_group=side_inter,
        timeout=timeout,
        tensor_parallel_size=tp,
        tensor_parallel_rank=rank % tp,
        tensor_parallel_group=tp_group,
        pipeline_parallel_size=pp,
        pipeline_parallel_rank=rank // layout.stage_size,
        pipeline_parallel_group=pp_group,
    )


def _overrides(sizes: dict[str, int], world_size: int, timeout: timedelta | None) -> dict[str, Any] | None:
    """``init_device_mesh``'s ``backend_override`` that creates every dimension's groups with the connect timeout
    (a dimension spanning every rank reuses the default group)."""
    options = None if timeout is None else _mesh_dim_options(dist.get_backend(), connect_timeout(timeout))
    override = {dim: options for dim, size in sizes.items() if size < world_size} if options else None
    return override or None


def build_device_mesh(layout: Layout, device: torch.device, timeout: timedelta | None = None) -> DeviceMesh:
    """The ``("data_parallel", "tensor_parallel")`` device mesh of Lightning's ``ModelParallelStrategy``, which a
    module's ``configure_model`` reads as ``self.device_mesh``; with pipeline stages
    ``("pipeline_parallel", "data_parallel", "tensor_parallel")``. Collective."""
    sizes = ({"pipeline_parallel": layout.pipeline_parallel_size} if layout.pipeline_parallel_size > 1 else {}) \
        | {"data_parallel": layout.data_parallel_size, "tensor_parallel": layout.tensor_parallel_size}
    mesh = init_device_mesh(device.type, tuple(sizes.values()), mesh_dim_names=tuple(sizes),
                            backend_override=_overrides(sizes, layout.world_size, timeout))
    for dim in sizes:
        group = mesh.get_group(dim)
        if group is not dist.group.WORLD:
            set_collective_timeout(group, timeout)
    return mesh
