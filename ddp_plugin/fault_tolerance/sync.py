"""The sync modes across replica groups: a quorum per outer sync (per fragment's, streaming), the pseudo-gradients
averaged over the live groups through torchft, the outer step only where the sync commits, and a sync that failed
(a group lost inside it) redone at once over the groups still live."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import Tensor

from ddp_plugin.fault_tolerance.healing import take_from_first, unify_tie
from ddp_plugin.fault_tolerance.start import StartCheck
from ddp_plugin.hookspecs import hookimpl, is_tensor_parallel_shard
from ddp_plugin.sync import OuterSync
from ddp_plugin.sync.parts import InFlight, Update

if TYPE_CHECKING:
    from torch.optim import Optimizer

    from ddp_plugin.fault_tolerance.replicas import ReplicaGroups
    from ddp_plugin.hookspecs import Bucket
    from ddp_plugin.sync.parts import Piece

log = logging.getLogger(__name__)

RETRIES = 3
"""Quorums a sync may take after its first failed (a group lost inside it each time) before its round is dropped:
every group then takes the global copy back, as torchft's own DiLoCo does after a failed sync."""


class ReplicaGroupSync(OuterSync):
    """:class:`~ddp_plugin.sync.OuterSync` whose nodes are replica groups: each group is one node of the sync mode
    (its ranks keep their parts of the global copy and of the outer optimizer's state, as on one node), and each
    sync is a torchft step, on the outer thread:

    1. its quorum, waited for on the training thread when the sync is sent, which names the fragment it carries
       (:meth:`quorum_fragment`: the quorum's count of committed syncs, the same on every group of it, a returning
       group's included, whose own schedule is not yet its peers'), and whether a group heals in it;
    2. the pseudo-gradients ``x - s`` of that fragment averaged over the live groups' ranks of this group rank
       (torchft's all-reduce: a group still healing adds zeros and is not counted; with a codec, the codec on
       torchft's process group, except in a sync a group heals in);
    3. the commit: a returning group loads a live peer's state here (its replica, inner and outer optimizer,
       global copy, the schedule's position and the fit's counters); the outer optimizer steps on every group
       only if the sync committed everywhere. One that did not (a group died inside it) is redone over a new
       quorum from the same replicas (unchanged until a sync is applied), up to :data:`RETRIES` times; a round
       dropped after those leaves its fragment to be carried by the next sync.

    With ``max_staleness=d`` a sync runs behind the next ``d`` inner steps and is applied as without replica
    groups, except a sync a group heals in: the training thread waits for that one (the peers serve their state
    and the returning group loads it while no inner step runs), and every group's replica takes the global copy
    itself. A stale sync's retries are quorums of its own groups only. Each sync is applied before the next starts
    (``d < sync_every // sync_fragments``, checked at construction): torchft's Manager holds one quorum at a time.

    Nothing crosses groups between syncs (the groups' gradients stay inside them, as the sync modes' do inside a
    node). A group of several nodes is one replica: its gradients are averaged over all its nodes every step (the
    hierarchical reducer's stages, the one among its nodes plain), its nodes hold the same replica and global
    copy, and at a sync each node sends 1/M of its part across groups (:meth:`_across`)."""

    shards_outer_over_nodes = False  # (a group's nodes hold one replica: a rank's whole part on each)

    def __init__(self, replicas: ReplicaGroups, **sync: Any) -> None:
        super().__init__(**sync)
        self._replicas = replicas
        self._healed_step: int | None = None
        self._join = False
        """Whether this step's optimizer step is followed by a sync out of schedule: a returning group's first quorum
        was its peers' next sync (they are past the warm-up steps it thought it was in)."""
        if self.warmup:
            replicas.on_first_quorum = self._first_quorum
        # (the run's first sync heals no group where every group started from the same bits; warm-up steps keep
        # torchft's heal at the first)
        self._start = StartCheck(replicas) if not self.warmup else None
        self._carried: dict[int, int] = {}
        """After a background heal: the inner steps each fragment's replica carries until its first sync."""
        self._scale = 1.0
        """What the pseudo-gradients of the sync being sent are multiplied by (:meth:`_weigh`)."""
        self._early = False
        self._done = 0
        """Optimizer steps this group ran (:attr:`step`, the schedule's, counts the steps it skipped too)."""
        self._sent_at: dict[int, tuple[int, int]] = {}
        """Each fragment's last sync: the schedule's step it stood for and :attr:`_done` then."""
        self._agreement: Any = None
        self._synced_step = 0
        """The inner step of the last sync sent (where a group joining between syncs starts)."""
        self._sends = 0

    @hookimpl(trylast=True)
    def on_setup(self, topology: Any, buckets: Any, hook: Any, options: Any, module: Any, comm: Any) -> None:
        super().on_setup(topology=topology, buckets=buckets, hook=hook, options=options, module=module, comm=comm)
        if dist.get_world_size() > 1 and (self.dynamic or self._replicas.server is not None):
            # (the group's ranks agree once a step on whether the peers' sync is due: on a group of their own, gloo,
            # so that the integer stays on the CPU)
            self._agreement = comm.new_group(backend="gloo")
        if self._start is not None:
            self._start.setup(module, self.buckets, comm)

    @property
    def synchronous(self) -> bool:
        # A group of several nodes steps as one replica: its gradients cross its own nodes (not groups: the
        # reducer's and the sharder's cross stage, ReplicaGroupReducer.across, stops at the group).
        return self.topology.num_nodes > 1 or super().synchronous

    def send(self, fragment: int) -> None:
        # (`fragment`, the schedule's, is this group's own view: the quorum's is the one sent)
        self._replicas.start_step()
        flight = InFlight(self.quorum_fragment(), self.step, [], None)
        # What the heal server serves changes from here until the sync is applied. Not before the quorum is in: a group
        # healing in the background must be able to download the last sync's state and ask for this quorum while
        # this group waits in it, for the lighthouse may need it there (it forms no quorum of half the beating
        # groups or fewer: one live group of two, two of four).
        self._replicas.version.writing()
        # (a background-healed group's first sync of a fragment, or a sync sent before the schedule's step, carries
        # fewer steps than the schedule's)
        self._scale = self._weight_of(flight.fragment)
        self._sends += 1
        if self.schedule.staleness and self._replicas.unified and not self._replicas.heals_in_quorum():
            # Behind the next `max_staleness` inner steps, as without replica groups (applied as `now + x - s`).
            pieces = self.pieces_of(flight.fragment)
            flight.snapshots = [self.access.read(p.bucket, p.lo, p.hi) for p in pieces]
            flight.apply_after += self.schedule.staleness
            job = (self._sync_stale, flight, pieces)
        else:
            # A group heals in this sync (its peers serve their state, it loads theirs): the training thread waits
            # for it, and every group's replica takes the global copy itself.
            flight.written = True
            job = (self._sync, flight)
        flight.result = self.run_outer(*job)
        self.in_flight.append(flight)

    def _first_quorum(self, committed: int) -> None:
        """With warm-up steps (a quorum per step, then per sync), at this group's first quorum, before its first
        collective: the quorum's count of committed steps (a warm-up step or a sync each) says whether its peers
        are past the warm-up. If so, this quorum is their next sync's: the step's gradients stay inside the group,
        and a sync follows its optimizer step, in which the group heals (its first steps' own work is thrown away,
        as a returning group's first ``H`` steps are without warm-up)."""
        if self.step < self.warmup <= committed:
            self._join = True
            self._replicas.per_step = False

    def quorum_fragment(self) -> int:
        """The fragment the quorum started syncs: torchft's committed syncs (the quorum's highest, which a returning
        group takes at the quorum; less the warm-up steps, each committed too) modulo ``sync_fragments``. Without a
        failure that is the schedule's round-robin; a dropped round's fragment is carried by the next sync."""
        self._replicas.wait_quorum()
        return (self._replicas.manager.current_step() - self.warmup) % self.schedule.fragments

    def _sync(self, flight: InFlight) -> tuple[list[Update], float]:
        for attempt in range(RETRIES + 1):
            if attempt:  # over the groups still live, from the replicas as they were (a sync is applied only once done)
                # (the heal server serves the last sync again while the retry's quorum forms, as in send)
                self._replicas.version.written()
                self._replicas.start_step()
            flight.fragment = self.quorum_fragment()
            self._replicas.version.writing()
            pieces = self.pieces_of(flight.fragment)
            with torch.no_grad():
                pseudo = [torch.sub(p.outer.detach(), s, out=s)
                          for p, s in ((p, self.access.read(p.bucket, p.lo, p.hi)) for p in pieces)]
            committed, drift = self._attempt(pieces, pseudo)
            if committed:
                break
        else:
            self._dropped(flight)
        self._replicas.outer_done = True
        return [Update(p.bucket, p.lo, p.hi, p.outer.detach()) for p in pieces], drift

    def _sync_stale(self, flight: InFlight, pieces: list[Piece]) -> tuple[list[Update], float]:
        """A sync behind the next inner steps: the pseudo-gradients of the snapshots taken when it was sent; its
        retries are quorums of this sync's groups only (``shrink_only``): a group that asks meanwhile would heal
        while the peers' inner steps run, and joins the next sync instead."""
        for attempt in range(RETRIES + 1):
            if attempt:
                self._replicas.start_step(shrink_only=True)
                self._replicas.wait_quorum()
            pseudo = [torch.sub(p.outer.detach(), s) for p, s in zip(pieces, flight.snapshots)]
            committed, drift = self._attempt(pieces, pseudo)
            if committed:
                break
        else:
            self._dropped(flight)
        self._replicas.outer_done = True
        return self.updates(pieces, flight.snapshots, pseudo), drift

    def _attempt(self, pieces: list[Piece], pseudo: list[Tensor]) -> tuple[bool, float]:
        """One quorum's try at a sync: the pseudo-gradients averaged over the live groups, the outer step if the
        sync committed everywhere; and the group's drift (the norm of its pseudo-gradient)."""
        local = self.squared_norm(pseudo)
        if self.topology.ranks_per_node > 1:
            self.comm.all_reduce(local, group=self.intra)
        first = not self._replicas.unified
        if first and self._start is not None and not self._start.alike([p.outer for p in self.pieces]):
            # (torchft skips the collectives of an errored quorum: nothing crosses, and the sync is not committed)
            self._replicas.manager.report_error(RuntimeError("the replica groups started from different parameters"))
        self._weigh(pseudo)
        self._across([(g, piece.pseudo, piece.lo) for piece, g in zip(pieces, pseudo)])
        committed = self._replicas.commit("outer sync")
        if committed:
            self.outer_optimizer_step(pieces, pseudo)
            if first:
                self._unify_replicated()
        return committed, float(local.sqrt())

    def _serving_step(self) -> int:
        """The step this group's sync stands for: the schedule's, or for one sent before it, the step the schedule
        then skips to (the peers' own: a group healing in that sync takes it)."""
        return self._next_sync_step(self.step) if self._early else self.step

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
            return min(1.0, self._carried.pop(fragment) / self.schedule.every)
        if not self._early or target <= since_step:
            return 1.0
        return min(1.0, (self._done - since_done) / (target - since_step))

    def _weigh(self, pseudo: list[Tensor]) -> None:
        """The pseudo-gradients of a sync that carries fewer inner steps than its peers' scaled by
        :meth:`_weight_of`, so that the group counts for what it did; every other sync is unscaled."""
        if self._scale >= 1.0 or self._scale <= 0.0:
            return
        for g in pseudo:
            g.mul_(self._scale)

    def _across(self, parts: list[tuple[Tensor, Bucket, int]]) -> None:
        """The pseudo-gradients averaged over the live groups, in place. On a group of M nodes, which hold the same
        ones (one replica), each node sends its 1/M slice of every part across groups, and the averaged slices
        are all-gathered back over the group's nodes (the outer thread's group): what crosses groups is then the
        group's part once, as from a group of one node."""
        m = self.topology.num_nodes
        if m == 1:
            self._replicas.reduce(self.hook, parts)
            return
        node = self.topology.node_rank
        padded, slices = [], []
        for g, bucket, offset in parts:
            width = -(-g.numel() // m)
            full = g.new_zeros(width * m)
            full[: g.numel()].copy_(g)
            padded.append(full)
            slices.append((full[node * width : (node + 1) * width], bucket, offset + node * width))
        self._replicas.reduce(self.hook, slices)
        for (g, _, _), full, (mine, _, _) in zip(parts, padded, slices):
            self.comm.all_gather(full, mine, group=self.inter)
            g.copy_(full[: g.numel()])

    def _unify_replicated(self) -> None:
        """After this group's first committed sync, what several of its ranks hold the same of the global copy and
        outer state, taken from one of them: on a group of several nodes every rank's part, from node 0; with
        tensor parallelism the parameters every tensor-parallel rank holds whole, from tensor-parallel rank 0; with
        pipeline stages a tied parameter's copies, from the first stage. At that first quorum torchft may heal
        each group rank from another group (see :func:`~ddp_plugin.fault_tolerance.healing.unify_group`, which
        does the same for the module), and this sync's step already ran from each rank's own."""
        t = self.topology
        if t.num_nodes > 1:  # (the same on every node of the group, one replica: node 0's)
            take_from_first([p.outer for p in self.pieces], [self.outer], self.inter)
        if t.tensor_parallel_size > 1:
            whole = [p.outer for p in self.pieces if not is_tensor_parallel_shard(self.buckets[p.bucket].params[0])]
            take_from_first(whole, [self.outer], t.tensor_parallel_group)
        for tie in self._replicas.ties:
            if tie.param is not None:
                unify_tie(self, tie)

    def _dropped(self, flight: InFlight) -> None:
        self._replicas.steps_lost += self.schedule.every
        self._replicas.healed_from = None  # (no live group it healed from came: it goes on with those there are)
        log.warning("ddp_plugin: replica group %d: the outer sync of fragment %d after step %d failed %d times; every"
                    " group takes its global copy back (the inner steps since its last sync are lost)",
                    self._replicas.options.replica_group, flight.fragment, self.step, RETRIES + 1)

    @hookimpl(tryfirst=True)
    def on_after_optimizer_step(self, optimizer: Optimizer) -> None:
        self._take_healed_step()  # (healed in a warm-up step's commit: the peer's position before that step)
        for f in self._carried:
            self._carried[f] += 1
        self._done += 1
        sends = self._sends
        super().on_after_optimizer_step(optimizer)
        scheduled = self.step > self.warmup and bool(self.schedule.sent_after(self.step - self.warmup))
        catching_up = self._replicas.catching_up
        if scheduled:
            self._replicas.catching_up = False
        elif catching_up or (self.dynamic and self.step > self.warmup and not self.in_flight):
            # Healed in the background (it asked for the peers' next quorum: it is in), or dynamic local steps (a
            # group of the last quorum asked the lighthouse for the next): the peers' next sync is due, so this group's goes now, with the steps done since,
            # and the fit takes the peers' position after it. The group's ranks agree on what they saw.
            due = self._replicas.quorum_ready() if catching_up else self._replicas.peers_asked()
            if self._agreed(due):
                self._replicas.catching_up = False
                self._send_early()
        if self._sends != sends:  # (what the heal server serves is whole again once the sync is done: the member)
            self._synced_step = self.step
            self._replicas.snapshot_due = True
        if self._join:
            self._join = False
            self.send(0)
            self.apply_due()
        # (healed in a sync's commit: taken once the sync is applied, the training thread having read the old
        # position to place it)
        self._take_healed_step()
        if self.warmup:  # (a quorum per step until the warm-up is over, the healed position included)
            self._replicas.per_step = self.step < self.warmup

    @property
    def dynamic(self) -> bool:
        return self._replicas.options.dynamic_steps

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
        now = self.step
        self._early = True
        try:
            self.send(0)
        finally:
            self._early = False
        self.apply_due()
        self._replicas.early_syncs += 1
        if self._healed_step is None:  # (not healed inside that quorum after all)
            skip = self._next_sync_step(now) - now
            self.step += skip
            for flight in self.in_flight:  # (a sync behind the next inner steps: applied as the peers')
                flight.apply_after += skip
            self._replicas.steps_skipped += skip
            self._replicas.on_skip(skip)

    def _next_sync_step(self, step: int) -> int:
        """The first optimizer step after ``step`` whose schedule sends a sync."""
        return next(t for t in range(step + 1, step + self.schedule.every + 1)
                    if self.schedule.sent_after(t - self.warmup))

    def _take_healed_step(self) -> None:
        if self._healed_step is not None:
            self.step, self._healed_step = self._healed_step, None
            self._sent_at = {f: (self.step, self._done) for f in range(self.schedule.fragments)}

    @hookimpl
    def on_member_state(self) -> dict[str, Any]:
        """On a live peer, at the quorum of a sync: references to the global copy and the outer optimizer's state
        (the training thread waits for the sync; the outer thread steps them only after the commit, once the
        transfer is done)."""
        return {"sync": {"step": self._serving_step(), "syncs": self.syncs,
                         "outer": [p.outer.detach() for p in self.pieces], "optimizer": self.outer.state_dict()}}

    @hookimpl
    def on_load_member_state(self, state: Mapping[str, Any]) -> None:
        """On the returning group's ranks, inside the sync's commit (on the outer thread, the training thread
        waiting for it): the same group rank's pieces as the peer's (every group has the same layout)."""
        state = state["sync"]
        with torch.no_grad():
            for piece, value in zip(self.pieces, state["outer"], strict=True):
                piece.outer.copy_(value)
        self.outer.load_state_dict(state["optimizer"])
        self.syncs = self.syncs_logged = state["syncs"]
        self._healed_step = state["step"]

    @hookimpl
    def on_member_sync_state(self, covers: set[int]) -> dict[str, Any]:
        """On a live peer's heal server thread, between syncs: references to the global copy and the outer
        optimizer's state (changed only inside a sync), and the last sync's inner step; ``covers``: every synced
        parameter (a joining group's replica takes the global copy)."""
        covers.update(id(p) for bucket in self.buckets for p in bucket.params)
        return {"sync": {"step": self._synced_step, "syncs": self.syncs,
                         "outer": [p.outer.detach() for p in self.pieces], "optimizer": self.outer.state_dict()}}

    @hookimpl
    def on_load_member_sync_state(self, state: Mapping[str, Any], covers: set[int]) -> None:
        """On a group joining between syncs, before its first step: the global copy and outer state, the replica
        made the global copy (spread inside the group), the schedule at the last sync's step."""
        covers.update(id(p) for bucket in self.buckets for p in bucket.params)
        state = state["sync"]
        with torch.no_grad():
            for piece, value in zip(self.pieces, state["outer"], strict=True):
                piece.outer.copy_(value)
                self.access.write(piece.bucket, piece.own_lo, piece.own_hi, piece.outer.detach())
        self.outer.load_state_dict(state["optimizer"])
        self.syncs = self.syncs_logged = state["syncs"]
        self.step = self._synced_step = state["step"]
        self._carried = {f: 0 for f in range(self.schedule.fragments)}
        self._sent_at = {f: (self.step, self._done) for f in range(self.schedule.fragments)}
        self.access.publish([r for ranges in self.fragment_ranges.values() for r in ranges])
        self._replicas.per_step = self.step < self.warmup
