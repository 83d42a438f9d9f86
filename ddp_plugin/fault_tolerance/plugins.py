"""The plugins of a ``fit`` with replica groups, on the hook contract: :class:`ReplicaGroupMember` answers the hooks
of members that come and go (the transport, each step's quorum and commit, the fit's own state a returning group
receives, its replicas made one), and :func:`replica_group_plugins` gives it with the implementations of the
protocols the built-in plugins own for their steps between members (:class:`ReplicaGroupPlugins`): the reducer's
and the ZeRO sharder's cross stage, the sync mode's transport (through torchft). Every other plugin hands over and
loads its own state (``on_member_state``): the ZeRO sharder its shards, the codec its shared state, the sync mode
its global copy."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from ddp_plugin.fault_tolerance.healing import (
    advance_fit,
    fit_state,
    load_fit_state,
    load_synced_fit_state,
    sync_module_state,
    synced_fit_state,
    unify_group,
)
from ddp_plugin.fault_tolerance.reducer import ReplicaGroupCrossStage
from ddp_plugin.fault_tolerance.sync import ReplicaGroupTransport
from ddp_plugin.hookspecs import hookimpl

if TYPE_CHECKING:

    import lightning.pytorch as pl
    from pluggy import HookRelay
    from torch.optim import Optimizer

    from ddp_plugin.fault_tolerance.communicator import ReplicaGroupCommunicator
    from ddp_plugin.fault_tolerance.replicas import ReplicaGroups
    from ddp_plugin.hookspecs import Communicator, Options, Topology
    from ddp_plugin.plugins.cross_stage import CrossStage
    from ddp_plugin.sync.transport import SyncTransport

NAME = "replica_groups"
"""The name :class:`ReplicaGroupMember` is registered under (``plugin_manager.get_plugin(NAME)``)."""


class ReplicaGroupMember:
    """This rank's replica group among the live ones (``replicas``, its torchft Manager) on the hook contract.

    ``module`` and ``optimizers()``: what the fit itself hands a returning group (the module less what other
    plugins' state covers, the optimizers, the schedulers, the loss scaler and the loop's counters), handed over
    and loaded after every other plugin's part (``trylast``)."""

    def __init__(self, replicas: ReplicaGroups, module: pl.LightningModule, optimizers: Callable[[], list[Optimizer]],
                 topology: Topology) -> None:
        self.__name__ = NAME  # (the name pluggy registers it under)
        self.replicas = replicas
        self.module = module
        self.optimizers = optimizers
        self.topology = topology
        self._started = False
        self._synced: dict[str, Any] | None = None
        self._pending: dict[str, Any] | None = None
        """The fit's position at the last sync applied (what a group joining between syncs takes)."""
        self._synced_at: float | None = None
        self._interval_s = 0.0
        replicas.on_skip = lambda steps: advance_fit(self.module, steps)

    @hookimpl
    def on_transport(self, comm: Communicator) -> ReplicaGroupCommunicator:
        # The strategy's collectives as `comm`'s, and a codec's across groups on torchft's process group.
        return self.replicas.communicator(comm)

    @hookimpl
    def on_setup(self, hook: HookRelay, options: Options) -> None:
        self.replicas.hook = hook
        self.replicas.coded = options.cross_node_codec is not None

    # ------------------------------------------------------------------ a step's quorum and commit

    @hookimpl
    def on_step_start(self) -> None:
        if not self._started:
            self._started = True
            # A group whose peers are past a sync takes their state in the background (none of them waits).
            self.replicas.heal_in_background(group=None)
            if self.replicas.watch is not None:
                self.replicas.watch.arm()  # (dynamic steps: a peer asking for the first sync, or the next, is seen)
        if self.replicas.snapshot_due:
            # A sync was sent in the last step: the fit's position now (where it was sent from).
            self._pending = synced_fit_state(self.module, self.optimizers())
            self.replicas.snapshot_due = False
        if self._pending is not None and self.replicas.outer_done:
            # Its outer step is done too (and committed or not, torchft's step with it): what the heal server
            # serves is whole again.
            now = time.monotonic()
            if self._synced_at is not None:
                self._interval_s = now - self._synced_at
            self._synced_at = now
            self._synced = {**self._pending, "ft": {**self.replicas.manager.state_dict(), "interval_s": self._interval_s}}
            self._pending = None
            self.replicas.outer_done = False
            self.replicas.version.written()
        if self.replicas.per_step:
            self.replicas.start_step()  # (the quorum is computed while the forward runs)

    @hookimpl
    def on_step_gated(self) -> bool | None:
        return self.replicas.per_step or None

    @hookimpl
    def on_commit_step(self) -> bool | None:
        # (asked again after the closure: a sync mode's warm-up step may find at its quorum that the peers are past
        # the warm-up, and commit in the sync after it instead: ReplicaGroups.on_first_quorum)
        if not self.replicas.per_step:
            return None
        committed = self.replicas.commit()
        if not committed:
            self.replicas.steps_lost += 1
        return committed

    # ------------------------------------------------------------------ the fit's own state

    @hookimpl(trylast=True)
    def on_member_state(self, covers: set[int]) -> dict[str, Any]:
        return {"fit": fit_state(self.module, self.optimizers(), covers)}

    @hookimpl(trylast=True)
    def on_load_member_state(self, state: Mapping[str, Any], covers: set[int]) -> None:
        load_fit_state(self.module, self.optimizers(), state["fit"], covers)

    @hookimpl(trylast=True)
    def on_member_sync_state(self, covers: set[int]) -> dict[str, Any] | None:
        if self._synced is None:
            return None
        return {"fit": self._synced, "module": sync_module_state(self.module, self._synced, covers),
                "ft": self._synced["ft"]}

    @hookimpl(trylast=True)
    def on_load_member_sync_state(self, state: Mapping[str, Any], covers: set[int]) -> None:
        load_synced_fit_state(self.module, self.optimizers(), state, covers)

    @hookimpl(trylast=True)
    def on_member_unify(self, covers: set[int]) -> None:
        t = self.topology
        unify_group(self.module, self.optimizers(), covers, t.side_world_group, t.tensor_parallel_group,
                    self.replicas.ties)

    @hookimpl
    def on_collect_metrics(self) -> dict[str, float]:
        return self.replicas.metrics()

    @hookimpl(trylast=True)
    def on_teardown(self, failed: bool) -> None:
        self.replicas.close()  # (last: a sync mode applies its syncs in flight first)


@dataclasses.dataclass(frozen=True)
class ReplicaGroupPlugins:
    """A fit's plugins with replica groups: ``plugins``, registered as the user's are (the member, the cross stage,
    with a sync mode its transport: each answers hooks of its own), and the protocols' implementations the
    built-in plugins take at construction."""

    plugins: list[object]
    cross_stage: CrossStage
    """The hierarchical reducer's and the ZeRO sharder's stage between nodes: among a group's nodes, then across
    the live groups (the reducer always the hierarchical one)."""
    sync_transport: SyncTransport | None
    """With a sync mode, how its syncs cross groups."""


def replica_group_plugins(replicas: ReplicaGroups, member: ReplicaGroupMember, sync_mode: bool) -> ReplicaGroupPlugins:
    """The fit's plugins with replica groups: ``member``, the cross stage and, with a sync mode (``sync_mode``), its
    transport (the gradients' stage then among the group's own nodes only)."""
    cross = ReplicaGroupCrossStage(replicas)
    transport = ReplicaGroupTransport(replicas) if sync_mode else None
    return ReplicaGroupPlugins([member, cross, *([transport] if transport is not None else [])], cross, transport)
