"""The 2-D layout of ranks: nodes x ranks per node, with its device mesh and process groups."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from ddp_plugin.hookspecs import Topology

if TYPE_CHECKING:
    from torch._C._distributed_c10d import Backend as C10dBackend

CONNECT_TIMEOUT_FLOOR = timedelta(minutes=5)
"""Creating a group (and the first rendezvous) waits at least this long for every member, whatever ``timeout``
is: a rank still importing on a loaded machine is late, not dead."""


@dataclass(frozen=True)
class Layout:
    """World size and ranks per node, validated up front; everything after trusts these numbers."""

    world_size: int
    ranks_per_node: int

    def __post_init__(self) -> None:
        if self.ranks_per_node < 1 or self.world_size % self.ranks_per_node != 0:
            raise ValueError(
                f"`devices_per_node={self.ranks_per_node}` does not divide the world size {self.world_size}: every"
                " node must run the same number of ranks. Set `devices_per_node` to a divisor of the world size"
                f" ({', '.join(str(d) for d in _divisors(self.world_size))}), or leave it None to use the"
                " launcher's ranks per node."
            )

    @property
    def num_nodes(self) -> int:
        return self.world_size // self.ranks_per_node


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
    """Build the ``(node, local)`` device mesh over the initialized default process group.

    Ranks are laid out row-major (global rank = node * ranks_per_node + local rank), as Lightning, torchrun and
    SLURM number them. Every rank must call this (creating subgroups is collective). Every group created here
    fails its collectives after ``timeout`` (the strategy's, which it also gives the default group when it creates
    that), so a hung rank cannot hang the others past it on any group.
    """
    rank = dist.get_rank()
    # A dimension spanning every rank reuses the default group, whose timeout the strategy has set; the others
    # get new groups, created with the connect timeout (torch's default is 30 minutes, whatever `timeout` is).
    options = None if timeout is None else _mesh_dim_options(dist.get_backend(), connect_timeout(timeout))
    sizes = {"node": layout.num_nodes, "local": layout.ranks_per_node}
    override = {dim: options for dim, size in sizes.items() if size < layout.world_size} if options else None
    mesh = init_device_mesh(
        device.type, (layout.num_nodes, layout.ranks_per_node), mesh_dim_names=("node", "local"),
        backend_override=override or None,
    )
    intra, inter = mesh.get_group("local"), mesh.get_group("node")
    k, m = layout.ranks_per_node, layout.num_nodes
    side_intra, _ = dist.new_subgroups_by_enumeration(
        [[n * k + l for l in range(k)] for n in range(m)], timeout=connect_timeout(timeout)
    )
    side_inter, _ = dist.new_subgroups_by_enumeration(
        [[n * k + l for n in range(m)] for l in range(k)], timeout=connect_timeout(timeout)
    )
    for group in (intra, inter, side_intra, side_inter):
        if group is not dist.group.WORLD:  # the default group's timeout is its creator's business
            set_collective_timeout(group, timeout)
    return Topology(
        world_size=layout.world_size,
        rank=rank,
        num_nodes=layout.num_nodes,
        ranks_per_node=layout.ranks_per_node,
        backend=dist.get_backend(),
        device=device,
        world_group=dist.group.WORLD,
        intra_node_group=intra,
        inter_node_group=inter,
        mesh=mesh,
        side_world_group=new_group(timeout=timeout),
        side_intra_node_group=side_intra,
        side_inter_node_group=side_inter,
        timeout=timeout,
    )
