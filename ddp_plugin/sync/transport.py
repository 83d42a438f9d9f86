"""How an outer sync crosses the members it averages over: the protocol :class:`~ddp_plugin.sync.plugin.OuterSync`
owns (:class:`SyncTransport`), and its plain implementation, the nodes through the cross-node hook
(:class:`NodeTransport`). Another way to keep members implements the protocol without reaching into the sync
(fault tolerance's: each member a group of nodes, a quorum per sync, a sync that failed
redone).

Every sync runs the same way in :class:`~ddp_plugin.sync.plugin.OuterSync` (the one copy of the algorithm)::

    round = transport.begin(fragment, stale)        # training thread, after the step that sends it
    # then on the outer thread, now or behind the next `max_staleness` inner steps where `round.stale`:
    for attempt in range(transport.retries + 1):
        if attempt:
            transport.again(round)                  # a new try: may name another fragment (not a stale round)
        pseudo = x - s                              # the round's fragment, scaled by round.scale
        transport.reduce([(pseudo, bucket, offset), ...])  # averaged over the members, in place
        if transport.commit():                      # every member applies it, or none
            outer step; transport.stepped(); break
    transport.end(round, committed)

A transport sees the sync through :class:`SyncSurface` (what it may read, move and call), nothing else.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import torch
    from pluggy import HookRelay
    from torch import Tensor, nn

    from ddp_plugin.hookspecs import Bucket, Communicator, Topology
    from ddp_plugin.sync.parts import InFlight, Piece
    from ddp_plugin.sync.schedule import SyncSchedule

Parts = list[tuple["Tensor", "Bucket", int]]
"""``(tensor, bucket, offset)`` triples: each tensor elements ``offset..`` of ``bucket``'s flat values."""


@dataclasses.dataclass
class Round:
    """One outer sync as its transport opened it."""

    fragment: int
    """The fragment it carries: the schedule's, or the one the members agree on."""
    stale: bool = False
    """Whether it runs behind the next ``max_staleness`` inner steps; a round that does not is applied in the step
    that sent it, the global copy written over the replica's part."""
    scale: float = 1.0
    """What this member's pseudo-gradients are multiplied by (in ``(0, 1)``; 1: unscaled)."""


class SyncSurface(Protocol):
    """What a transport may use of :class:`~ddp_plugin.sync.plugin.OuterSync` (set up)."""

    step: int
    """The optimizer steps the schedule counts (a transport may move it: a member that takes its peers' place)."""
    warmup: int
    schedule: SyncSchedule
    topology: Topology
    comm: Communicator
    hook: HookRelay
    buckets: list[Bucket]
    pieces: list[Piece]
    outer: torch.optim.Optimizer
    inter: Any
    """The outer thread's group of the ranks with this local rank on every node."""
    intra: Any
    """The outer thread's group of this node's ranks."""
    in_flight: list[InFlight]

    def send(self, fragment: int) -> None:
        """Send a sync now (a transport's out of schedule)."""

    def apply_due(self) -> None:
        """Apply the syncs in flight whose step has come."""

    def skip(self, steps: int) -> None:
        """Move the schedule ahead, the syncs in flight with it."""


class SyncTransport(Protocol):
    """How an outer sync crosses its members (see the module docstring for the order of the calls)."""

    retries: int
    """Rounds a sync may redo after its first that did not commit, before it is dropped (0: every round commits)."""

    member_is_node: bool
    """Whether a member is one node (the plain sync modes: the gradients stay inside it between syncs, and the
    global copy may be sharded over the nodes). ``False``: a member is a group of nodes that steps as one replica
    (its gradients cross its own nodes every step, and each of its nodes keeps its ranks' whole parts)."""

    def setup(self, sync: SyncSurface, module: nn.Module) -> None:
        """At the end of the sync's ``on_setup``, on every rank (collective: a transport may make groups)."""

    def begin(self, fragment: int, stale: bool) -> Round:
        """On the training thread, after the optimizer step that sends the sync of ``fragment`` (the schedule's):
        the round (which may carry another fragment: the one the members agree on). ``stale``: the schedule runs
        syncs behind the next inner steps (``max_staleness``); the round may still not (``Round.stale``)."""

    def again(self, round: Round) -> None:
        """On the outer thread, before a round is tried again (its last try did not commit): set up the new try;
        a round that is not stale may change ``round.fragment``."""

    def reduce(self, parts: Parts) -> None:
        """On the outer thread: each part averaged over the members, in place."""

    def commit(self) -> bool:
        """On the outer thread, after :meth:`reduce`: whether every member applies this try (the outer optimizer
        steps only then)."""

    def stepped(self) -> None:
        """On the outer thread, after the outer optimizer's step of a committed try."""

    def end(self, round: Round, committed: bool) -> None:
        """On the outer thread, once the round is over (``committed``: by its last try; else it is dropped and the
        replica takes the global copy back)."""

    def before_step(self) -> None:
        """On the training thread, at the start of the sync's ``on_after_optimizer_step``."""

    def after_step(self) -> None:
        """On the training thread, at the end of the sync's ``on_after_optimizer_step`` (its syncs due sent and
        applied): a transport may send one out of schedule (``sync.send``), or move the schedule (``sync.skip``)."""


class NodeTransport:
    """The plain sync modes' transport: every node a member, each round over the cross-node hook on the sync's
    own group of the ranks with this local rank on every node (a codec answers it with fewer bytes), and every
    round commits."""

    retries = 0
    member_is_node = True

    def __init__(self) -> None:
        self._sync: SyncSurface | None = None

    def setup(self, sync: SyncSurface, module: nn.Module) -> None:
        self._sync = sync

    def begin(self, fragment: int, stale: bool) -> Round:
        return Round(fragment, stale)

    def again(self, round: Round) -> None:
        raise AssertionError("a round over the nodes commits at its first try")

    def reduce(self, parts: Parts) -> None:
        sync = self._sync
        for tensor, bucket, offset in parts:
            sync.hook.on_cross_node_reduce(tensor=tensor, group=sync.inter, bucket=bucket, offset=offset).wait()

    def commit(self) -> bool:
        return True

    def stepped(self) -> None:
        pass

    def end(self, round: Round, committed: bool) -> None:
        pass

    def before_step(self) -> None:
        pass

    def after_step(self) -> None:
        pass
