"""The lifetime of the strategy's process groups.

Every ``fit`` needs the data-parallel ``(node, local)`` mesh's groups (:class:`~ddp_plugin.hookspecs.Topology`),
a world-sized group for the engine's bookkeeping (a sync mode also one per node), and, for a module that
parallelizes itself in ``configure_model``, Lightning's ``("data_parallel", "tensor_parallel")`` device mesh. One
:class:`ProcessGroups` per validated :class:`~ddp_plugin.runtime.topology.Layout` builds them all, once, and every part
of the strategy asks it. They are created once per process, default group, layout and
timeout, and shared by every ``fit`` of the process: gloo groups destroyed mid-run abort at exit. Every one
fails its collectives after the strategy's ``timeout`` (torch gives a new group 30 minutes, and a hung rank
hung every other rank on such a group).

At interpreter exit they are released while the interpreter is still whole: torch asks for
``destroy_process_group()``, but for gloo that only unregisters the groups, and their worker threads live on
until the last Python reference goes, which for a trainer kept in a global is during finalization, where a gloo
thread releasing a tensor cannot take the GIL any more and the process aborts after a successful run
("terminate called without an active exception", about 1 run in 100 here).
"""

from __future__ import annotations

import atexit
import dataclasses
import gc
import os
import weakref
from datetime import timedelta
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

import torch
import torch.distributed as dist

from ddp_plugin import health
from ddp_plugin.runtime.topology import (
    Layout,
    build_device_mesh,
    build_topology,
    connect_timeout,
    new_group,
    set_collective_timeout,
)

if TYPE_CHECKING:
    from lightning.fabric.plugins import ClusterEnvironment
    from torch.distributed.device_mesh import DeviceMesh

    from ddp_plugin.hookspecs import Topology


class UsesProcessGroups(Protocol):
    def release_process_groups(self) -> None:
        """Drop every reference to process groups (the fit's plugins and engine included)."""


class ProcessGroups:
    """The data-parallel mesh (``topology``), the bookkeeping groups and the device mesh of one layout over the
    current default group.

    The bookkeeping groups join every rank of the world (or of a node), tensor-parallel peers included: a step is
    skipped, and a batch's samples are counted, by every rank together."""

    _made: ClassVar[dict[tuple[Any, ...], ProcessGroups]] = {}
    _users: ClassVar[weakref.WeakSet] = weakref.WeakSet()
    _atexit_registered: ClassVar[bool] = False
    failed: ClassVar[bool] = False

    def __init__(self, layout: Layout, topology: Topology, bookkeeping: dist.ProcessGroup,
                 backend: str | None = None) -> None:
        self.layout = layout
        self.topology = topology
        self.bookkeeping = bookkeeping
        self._backend = backend
        self._node_bookkeeping: dist.ProcessGroup | None = None
        self._tensor_parallel_peers: dist.ProcessGroup | None = None
        self._device_mesh: DeviceMesh | None = None
        self._stage_peers: dict[tuple[int, ...], dist.ProcessGroup] = {}

    @property
    def has_device_mesh(self) -> bool:
        return self._device_mesh is not None

    def device_mesh(self) -> DeviceMesh:
        """Lightning's ``("data_parallel", "tensor_parallel")`` mesh (``ModelParallelStrategy``'s dimension names),
        tensor innermost. Created on first use: collective, every rank calls it at the same point."""
        if self._device_mesh is None:
            self._device_mesh = build_device_mesh(self.layout, self.topology.device, self.topology.timeout)
        return self._device_mesh

    def node_bookkeeping(self) -> dist.ProcessGroup | None:
        """A bookkeeping group of this rank's node, for the steps whose gradients stay inside the node (a sync
        mode's); ``None`` with one rank per node (nothing to agree on). Created on first use: collective, every
        rank calls it at the same point."""
        k = min(self.layout.ranks_per_node, self.layout.stage_size)  # (a node's ranks of this pipeline stage)
        if k == 1:
            return None
        if self._node_bookkeeping is None:
            self._node_bookkeeping = self._consecutive_group(k)
        return self._node_bookkeeping

    def tensor_parallel_peers(self) -> dist.ProcessGroup | None:
        """This rank's tensor-parallel group again, as a group of its own for the gradient engine's communication
        thread (``Topology.tensor_parallel_group`` is the training thread's, the device mesh's the module's);
        ``None`` without tensor parallelism. Created on first use: collective, every rank calls it at the same
        point."""
        t = self.layout.tensor_parallel_size
        if t == 1:
            return None
        if self._tensor_parallel_peers is None:
            self._tensor_parallel_peers = self._consecutive_group(t)
        return self._tensor_parallel_peers

    def stage_peers(self, stages: tuple[int, ...]) -> dist.ProcessGroup | None:
        """A group of this rank and the ranks in its data-parallel and tensor-parallel position on the pipeline
        stages ``stages`` (sorted): the copies of a parameter shared across those stages (a tied embedding) sum
        their gradients over it. ``None`` on a rank of another stage. Created on first use for each set of stages:
        collective, every rank calls it at the same point with the same ``stages``."""
        if stages not in self._stage_peers:  # (a rank outside every such group caches its None too)
            n = self.layout.stage_size
            group, _ = dist.new_subgroups_by_enumeration(
                [[p * n + position for p in stages] for position in range(n)],
                timeout=connect_timeout(self.topology.timeout), backend=self._backend)
            set_collective_timeout(group, self.topology.timeout)
            self._stage_peers[stages] = group
        return self._stage_peers[stages]

    def _consecutive_group(self, n: int) -> dist.ProcessGroup:
        """A new group of the ``n`` consecutive global ranks this rank is among (a node, a tensor-parallel group).
        Every rank takes part in creating every such group of the world, and keeps its own."""
        mine = None
        for first in range(0, self.layout.world_size, n):
            group = new_group(list(range(first, first + n)), backend=self._backend, timeout=self.topology.timeout)
            if first <= dist.get_rank() < first + n:
                mine = group
        return mine

    @classmethod
    def get(cls, layout: Layout, device: torch.device, backend: str, timeout: timedelta | None) -> ProcessGroups:
        """The groups for ``layout``, created on first use (collective: every rank calls it at the same point)."""
        key = (layout, device, backend, id(dist.group.WORLD), timeout)
        groups = cls._made.get(key)
        if groups is None:
            if not cls._atexit_registered:
                atexit.register(cls.release_all)
                cls._atexit_registered = True
            staged = layout.pipeline_parallel_size > 1
            groups = cls._made[key] = cls(layout, build_topology(layout, device, timeout),
                                          None if staged else new_group(backend=backend, timeout=timeout), backend)
            if staged:  # the ranks of a stage hold the same parameters: their bookkeeping agrees over the stage
                groups.bookkeeping = groups._consecutive_group(layout.stage_size)
        return groups

    @classmethod
    def track(cls, user: UsesProcessGroups) -> None:
        """Have ``user`` drop its references at exit, before the groups are destroyed."""
        cls._users.add(user)

    def release(self) -> None:
        """Empty the topology's group fields and drop the bookkeeping group, so that a plugin or a user still
        holding the topology keeps no group alive. (The owner of the groups is the one place that may write the
        contract's frozen value type.)"""
        for f in dataclasses.fields(self.topology):
            if f.name == "mesh" or f.name.endswith("group"):
                object.__setattr__(self.topology, f.name, None)
        self.bookkeeping = self._node_bookkeeping = self._device_mesh = None  # type: ignore[assignment]
        self._tensor_parallel_peers = None
        self._stage_peers = {}

    @classmethod
    def release_all(cls) -> None:
        """At exit: every strategy's references, every group's, then the default group and the cycles."""
        if cls.failed:
            health.linger_as_store_host()
        for user in list(cls._users):
            user.release_process_groups()
        for groups in cls._made.values():
            groups.release()
        cls._made.clear()
        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
        if not cls.failed:
            gc.collect()


def check_ranks_per_node(environment: ClusterEnvironment, ranks_per_node: int, world_size: int) -> None:
    """Every node must run the same number of ranks, numbered node by node, or the ``(node, local)`` mesh would
    put ranks of one machine on different "nodes". Launchers that know their node's size (torchrun sets
    ``LOCAL_WORLD_SIZE``) are checked against the layout; all ranks agree on the verdict, so all fail together.
    Collective."""
    mine = (environment.node_rank(), int(os.environ.get("LOCAL_WORLD_SIZE", ranks_per_node)))
    every: list[Any] = [None] * world_size
    dist.all_gather_object(every, mine)
    per_node: dict[int, int] = {}
    for node, size in every:
        per_node[node] = size
    k = ranks_per_node
    misplaced = [r for r, (node, _) in enumerate(every) if r // k != node]
    if set(per_node.values()) != {k} or misplaced:
        sizes = ", ".join(f"node {n}: {size}" for n, size in sorted(per_node.items()))
        raise ValueError(
            f"Every node must run the same number of ranks, `devices={k}` each, numbered node by node; the"
            f" launcher reports {sizes}. Start the same number of processes on every node (e.g. the same"
            " `--nproc_per_node` for torchrun) and set `devices` to it."
        )
