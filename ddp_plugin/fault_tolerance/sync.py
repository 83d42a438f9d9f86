"""The sync modes across replica groups: a transport for :class:`~ddp_plugin.sync.OuterSync`
(:class:`~ddp_plugin.sync.transport.SyncTransport`) whose members are the live replica groups: a quorum per outer
sync (per fragment's, streaming), the pseudo-gradients averaged over the live groups through torchft, the outer
step only where the sync commits, and a sync that failed (a group lost inside it) redone at once over the groups
still live. The sync runs every round itself; this module only says how a round crosses groups and where a group
stands in the schedule (dynamic steps, a group healed or joining)."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from ddp_plugin.fault_tolerance.healing import take_from_first, unify_tie
from ddp_plugin.fault_tolerance.start import StartCheck
from ddp_plugin.hookspecs import hookimpl, is_tensor_parallel_shard
from ddp_plugin.sync.transport import Round

if TYPE_CHECKING:
    from torch import Tensor, nn

    from ddp_plugin.fault_tolerance.replicas import ReplicaGroups
    from ddp_plugin.hookspecs import Bucket
    from ddp_plugin.sync.transport import SyncSurface

log = logging.getLogger(__name__)

RETRIES = 3
"""Quorums a sync may take after its first failed (a group lost inside it each time) before its round is dropped:
every group then takes the global copy back, as torchft's own DiLoCo does after a failed sync."""

POSITION_KEY = "sync_position"
"""Under which key the transport hands over a group's place in the sync's schedule (``on_member_state``)."""


class ReplicaGroupTransport:
    """How :class:`~ddp_plugin.sync.OuterSync` crosses replica groups (through its
    :class:`~ddp_plugin.sync.transport.SyncSurface` only): each group is one member of the sync mode
    (its ranks keep their parts of the global copy and of the outer optimizer's state, as on one node), and each
    sync is a torchft step, on the outer thread:

    1. its quorum, waited for on the training thread when the sync is sent (:meth:`begin`), which names the
       fragment it carries (:meth:`quorum_fragment`: the quorum's count of committed syncs, the same on every group
       of it, a returning group's included, whose own schedule is not yet its peers'), and whether a group heals
       in it;
    2. the pseudo-gradients ``x - s`` of that fragment averaged over the live groups' ranks of this group rank
       (:meth:`reduce`: torchft's all-reduce; a group still healing adds zeros and is not counted; with a codec,
       the codec on torchft's process group, except in a sync a group heals in);
    3. the commit (:meth:`commit`): a returning group loads a live peer's state here (its replica, inner and outer
       optimizer, global copy, the schedule's position and the fit's counters); the outer optimizer steps on every
       group only if the sync committed everywhere. One that did not (a group died inside it) is redone over a new
       quorum from the same replicas (unchanged until a sync is applied), up to :data:`RETRIES` times; a round
       dropped after those leaves its fragment to be carried by the next sync.

    With ``max_staleness=d`` a sync runs behind the next ``d`` inner steps and is applied as without replica
    groups, except a sync a group heals in (the round is not stale): the training thread waits for that one (the
    peers serve their state and the returning group loads it while no inner step runs), and every group's replica
    takes the global copy itself. A stale sync's retries are quorums of its own groups only. Each sync is applied
    before the next starts (``d < sync_every // sync_fragments``, checked at construction): torchft's Manager holds
    one quorum at a time.

    Nothing crosses groups between syncs (the groups' gradients stay inside them, as the sync modes' do inside a
    node). A group of several nodes is one replica (``member_is_node = False``): its gradients are averaged over
    all its nodes every step (the reducer's cross stage among its nodes plain), its nodes hold the same replica and
    global copy, and at a sync each node sends 1/M of its part across groups (:meth:`reduce`).

    Registered as a plugin too: it hands over the group's place in the schedule (the sync hands over its own
    global copy and outer state)."""

    retries = RETRIES
    member_is_node = False

    def __init__(self, replicas: ReplicaGroups) -> None:
        self.replicas = replicas
        self.sync: SyncSurface | None = None
        self._healed_step: int | None = None
        self._join = False
        """Whether this step's optimizer step is followed by a sync out of schedule: a returning group's first quorum
        was its peers' next sync (they are past the warm-up steps it thought it was in)."""
        self._start: StartCheck | None = None
        self._carried: dict[int, int] = {}
        """After a background heal: the inner steps each fragment's replica carries until its first sync."""
        self._early = False
        self._done = 0
        """Optimizer steps this group ran (the schedule's ``step`` counts the steps it skipped too)."""
        self._sent_at: dict[int, tuple[int, int]] = {}
        """Each fragment's last sync: the schedule's step it stood for and :attr:`_done` then."""
        self._agreement: Any = None
        self._synced_step = 0
        """The inner step of the last sync sent (where a group joining between syncs starts)."""
        self._sends = 0
        self._sends_before = 0
        self._first = False
        """Whether the try under way is this group's first quorum to commit (its ranks are made one replica after)."""

    def setup(self, sync: SyncSurface, module: nn.Module) -> None:
        self.sync = sync
        replicas = self.replicas
        if sync.warmup:
            replicas.on_first_quorum = self._first_quorum
        else:
            # (the run's first sync heals no group where every group started from the same bits; warm-up steps
            # keep torchft's heal at the first)
            self._start = StartCheck(replicas)
        if dist.get_world_size() > 1 and (self.dynamic or replicas.server is not None):
            # (the group's ranks agree once a step on whether the peers' sync is due: on a group of their own, gloo,
            # so that the integer stays on the CPU)
            self._agreement = sync.comm.new_group(backend="gloo")
        if self._start is not None:
            self._start.setup(module, sync.buckets, sync.comm)

    # ------------------------------------------------------------------ a round

    def begin(self, fragment: int, stale: bool) -> Round:
        # (`fragment`, the schedule's, is this group's own view: the quorum's is the one sent)
        replicas = self.replicas
        replicas.start_step()
        fragment = self.quorum_fragment()
        # What the heal server serves changes from here until the sync is applied. Not before the quorum is in: a
        # group healing in the background must be able to download the last sync's state and ask for this quorum
        # while this group waits in it, for the lighthouse may need it there (it forms no quorum of half the
        # beating groups or fewer: one live group of two, two of four).
        replicas.version.writing()
        # (a background-healed group's first sync of a fragment, or a sync sent before the schedule's step, carries
        # fewer steps than the schedule's: scaled)
        scale = self._weight_of(fragment)
        self._sends += 1
        # Behind the next `max_staleness` inner steps, as without replica groups, unless a group heals in it: the
        # peers then serve their state, and every group's replica takes the global copy itself.
        return Round(fragment, stale=stale and replicas.unified and not replicas.heals_in_quorum(), scale=scale)

    def again(self, round: Round) -> None:
        replicas = self.replicas
        if round.stale:
            # Of this sync's groups only (`shrink_only`): a group that asks meanwhile would heal while the peers'
            # inner steps run, and joins the next sync instead.
            replicas.start_step(shrink_only=True)
            replicas.wait_quorum()
            return
        # Over the groups still live (the heal server serves the last sync again while the retry's quorum forms,
        # as in begin).
        replicas.version.written()
        replicas.start_step()
        round.fragment = self.quorum_fragment()
        replicas.version.writing()

    def reduce(self, parts: list[tuple[Tensor, Bucket, int]]) -> None:
        """The pseudo-gradients averaged over the live groups, in place. On a group of M nodes, which hold the same
        ones (one replica), each node sends its 1/M slice of every part across groups, and the averaged slices are
        all-gathered back over the group's nodes (the sync's outer-thread group): what crosses groups is then the
        group's part once, as from a group of one node."""
        sync, replicas = self.sync, self.replicas
        self._first = not replicas.unified
        if self._first and self._start is not None and not self._start.alike([p.outer for p in sync.pieces]):
            # (torchft skips the collectives of an errored quorum: nothing crosses, and the sync is not committed)
            replicas.manager.report_error(RuntimeError("the replica groups started from different parameters"))
        t = sync.topology
        m = t.num_nodes
        if m == 1:
            replicas.reduce(sync.hook, parts)
            return
        padded, slices = [], []
        for g, bucket, offset in parts:
            width = -(-g.numel() // m)
            full = g.new_zeros(width * m)
            full[: g.numel()].copy_(g)
            padded.append(full)
            slices.append((full[t.node_rank * width : (t.node_rank + 1) * width], bucket, offset + t.node_rank * width))
        replicas.reduce(sync.hook, slices)
        for (g, _, _), full, (mine, _, _) in zip(parts, padded, slices):
            sync.comm.all_gather(full, mine, group=sync.inter)
            g.copy_(full[: g.numel()])

    def commit(self) -> bool:
        return self.replicas.commit("outer sync")

    def stepped(self) -> None:
        if self._first:
            self._unify_replicated()

    def end(self, round: Round, committed: bool) -> None:
        if not committed:
            self.replicas.steps_lost += self.sync.schedule.every
            self.replicas.healed_from = None  # (no live group it healed from came: it goes on with those there are)
            log.warning("ddp_plugin: replica group %d: the outer sync of fragment %d after step %d failed %d times;"
                        " every group takes its global copy back (the inner steps since its last sync are lost)",
                        self.replicas.options.replica_group, round.fragment, self.sync.step, RETRIES + 1)
        self.replicas.outer_done = True

    def quorum_fragment(self) -> int:
        """The fragment the quorum started syncs: torchft's committed syncs (the quorum's highest, which a returning
        group takes at the quorum; less the warm-up steps, each committed too) modulo ``sync_fragments``. Without a
        failure that is the schedule's round-robin; a dropped round's fragment is carried by the next sync."""
        self.replicas.wait_quorum()
        return (self.replicas.manager.current_step() - self.sync.warmup) % self.sync.schedule.fragments

    def _first_quorum(self, committed: int) -> None:
        """With warm-up steps (a quorum per step, then per sync), at this group's first quorum, before its first
        collective: the quorum's count of committed steps (a warm-up step or a sync each) says whether its peers
        are past the warm-up. If so, this quorum is their next sync's: the step's gradients stay inside the group,
        and a sync follows its optimizer step, in which the group heals (its first steps' own work is thrown away,
        as a returning group's first ``H`` steps are without warm-up)."""
        if self.sync.step < self.sync.warmup <= committed:
            self._join = True
            self.replicas.per_step = False

    def _serving_step(self) -> int:
        """The step this group's sync stands for: the schedule's, or for one sent before it, the step the schedule
        then skips to (the peers' own: a group healing in that sync takes it)."""
        return self._next_sync_step(self.sync.step) if self._early else self.sync.step

    def _weight_of(self, fragment: int) -> float:
        """What a sync of ``fragment`` sent now weighs: 1 on the schedule's step. A group that healed in the
        background, at its first sync of each fragment: the inner steps it carries over the schedule's
        (``sync_every``, what its peers' carry). A sync sent before the schedule's step (``dynamic_steps``): the
        optimizer steps run since the fragment's last sync over the schedule's steps between that sync and the
        peers' (the step this group's schedule skips to). Nothing crosses groups for it."""
        target = self._serving_step()
        since_step, since_done = self._sent_at.get(fragment, (0, 0))
        self._sent_at[fragment] = (target, self._done)
        if fragment in self._carried:
            return min(1.0, self._carried.pop(fragment) / self.sync.schedule.every)
        if not self._early or target <= since_step:
            return 1.0
        return min(1.0, (self._done - since_done) / (target - since_step))

    def _unify_replicated(self) -> None:
        """After this group's first committed sync, what several of its ranks hold the same of the global copy and
        outer state, taken from one of them: on a group of several nodes every rank's part, from node 0; with
        tensor parallelism the parameters every tensor-parallel rank holds whole, from tensor-parallel rank 0; with
        pipeline stages a tied parameter's copies, from the first stage. At that first quorum torchft may heal
        each group rank from another group (see :func:`~ddp_plugin.fault_tolerance.healing.unify_group`, which
        does the same for the module), and this sync's step already ran from each rank's own."""
        sync = self.sync
        t = sync.topology
        if t.num_nodes > 1:  # (the same on every node of the group, one replica: node 0's)
            take_from_first([p.outer for p in sync.pieces], [sync.outer], sync.inter)
        if t.tensor_parallel_size > 1:
            whole = [p.outer for p in sync.pieces if not is_tensor_parallel_shard(sync.buckets[p.bucket].params[0])]
            take_from_first(whole, [sync.outer], t.tensor_parallel_group)
        for tie in self.replicas.ties:
            if tie.param is not None:
                unify_tie(sync, tie)

    # ------------------------------------------------------------------ the group's place in the schedule

    def before_step(self) -> None:
        self._take_healed_step()  # (healed in a warm-up step's commit: the peer's position before that step)
        for f in self._carried:
            self._carried[f] += 1
        self._done += 1
        self._sends_before = self._sends

    def after_step(self) -> None:
        sync, replicas = self.sync, self.replicas
        scheduled = sync.step > sync.warmup and bool(sync.schedule.sent_after(sync.step - sync.warmup))
        catching_up = replicas.catching_up
        if scheduled:
            replicas.catching_up = False
        elif catching_up or (self.dynamic and sync.step > sync.warmup and not sync.in_flight):
            # Healed in the background (it asked for the peers' next quorum: it is in), or dynamic local steps (a
            # group of the last quorum asked the lighthouse for the next): the peers' next sync is due, so this
            # group's goes now, with the steps done since, and the fit takes the peers' position after it. The
            # group's ranks agree on what they saw.
            due = replicas.quorum_ready() if catching_up else replicas.peers_asked()
            if self._agreed(due):
                replicas.catching_up = False
                self._send_early()
        if self._sends != self._sends_before:  # (what the heal server serves is whole again once the sync is done)
            self._synced_step = sync.step
            replicas.snapshot_due = True
        if self._join:
            self._join = False
            sync.send(0)
            sync.apply_due()
        # (healed in a sync's commit: taken once the sync is applied, the training thread having read the old
        # position to place it)
        self._take_healed_step()
        if sync.warmup:  # (a quorum per step until the warm-up is over, the healed position included)
            replicas.per_step = sync.step < sync.warmup

    @property
    def dynamic(self) -> bool:
        return self.replicas.options.dynamic_steps

    def _agreed(self, flag: bool) -> bool:
        """Whether any rank of the group saw ``flag`` (one integer all-reduced over the group's ranks)."""
        if self._agreement is None:
            return flag
        seen = torch.tensor([int(flag)], dtype=torch.int64)
        dist.all_reduce(seen, op=dist.ReduceOp.MAX, group=self._agreement)  # (not data: not counted)
        return bool(seen.item())

    def _send_early(self) -> None:
        """This group's sync, sent after this step (before its schedule's step: the peers' sync is due), then the
        schedule, the syncs behind it and the fit's counters moved to where the peers stand after it."""
        sync = self.sync
        now = sync.step
        self._early = True
        try:
            sync.send(0)
        finally:
            self._early = False
        sync.apply_due()
        self.replicas.early_syncs += 1
        if self._healed_step is None:  # (not healed inside that quorum after all)
            skip = self._next_sync_step(now) - now
            sync.skip(skip)  # (a sync behind the next inner steps: applied as the peers')
            self.replicas.steps_skipped += skip
            self.replicas.on_skip(skip)

    def _next_sync_step(self, step: int) -> int:
        """The first optimizer step after ``step`` whose schedule sends a sync."""
        schedule, warmup = self.sync.schedule, self.sync.warmup
        return next(t for t in range(step + 1, step + schedule.every + 1) if schedule.sent_after(t - warmup))

    def _take_healed_step(self) -> None:
        if self._healed_step is not None:
            self.sync.step, self._healed_step = self._healed_step, None
            self._sent_at = {f: (self.sync.step, self._done) for f in range(self.sync.schedule.fragments)}

    # ------------------------------------------------------------------ the place handed over

    @hookimpl
    def on_member_state(self) -> dict[str, Any]:
        """On a live peer, at the quorum of a sync: the step it stands for (the sync hands over its global copy
        and outer state)."""
        return {POSITION_KEY: {"step": self._serving_step()}}

    @hookimpl
    def on_load_member_state(self, state: Mapping[str, Any]) -> None:
        """On the returning group's ranks, inside the sync's commit: the peer's step, taken once the sync is
        applied (:meth:`after_step`)."""
        self._healed_step = state[POSITION_KEY]["step"]

    @hookimpl
    def on_member_sync_state(self, covers: set[int]) -> dict[str, Any]:
        """On a live peer's heal server thread, between syncs: the last sync's inner step."""
        return {POSITION_KEY: {"step": self._synced_step}}

    @hookimpl
    def on_load_member_sync_state(self, state: Mapping[str, Any], covers: set[int]) -> None:
        """On a group joining between syncs, before its first step: the schedule at the last sync's step, each
        fragment's first sync weighed by the steps it carries."""
        sync = self.sync
        sync.step = self._synced_step = state[POSITION_KEY]["step"]
        self._carried = {f: 0 for f in range(sync.schedule.fragments)}
        self._sent_at = {f: (sync.step, self._done) for f in range(sync.schedule.fragments)}
        self.replicas.per_step = sync.step < sync.warmup
