"""This rank's place among the replica groups: a torchft ``Manager`` per rank, its quorum per step, the commit
that gates the optimizer step, and the state a returning group heals from.

A replica group is one Lightning world (one node's ranks, launched on its own, with its own rendezvous). Rank
``r`` of every live group meets rank ``r`` of the others on torchft's process group, which the Manager
reconfigures over the live groups at each quorum. torchft swallows a failed collective there (the peer died):
the step is then committed nowhere, and the next quorum goes on without the lost group.

(About 430 lines: the quorum, its bounded wait, the commit and both heals read and write the same state of one
Manager, in an order that is the protocol; split, each part would reach into the others' fields.)
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch

from ddp_plugin.fault_tolerance import background, pace, torchft_adapter
from ddp_plugin.runtime.answers import merged_answers

if TYPE_CHECKING:
    from pluggy import HookRelay
    from torch import Tensor

    from ddp_plugin.fault_tolerance.communicator import ReplicaGroupCommunicator
    from ddp_plugin.fault_tolerance.options import FaultTolerance
    from ddp_plugin.hookspecs import Bucket, Communicator

log = logging.getLogger(__name__)

DISCOVERY_TIMEOUT = timedelta(seconds=10)
"""How long a returning group waits for a live group's store to name its heal server."""

QUORUM_SLACK_S = 10.0
"""What a quorum's wait allows beyond the limits of its steps in torchft (:attr:`ReplicaGroups.quorum_wait_limit_s`)."""

HEAL_ATTEMPTS = 8
"""Downloads a background heal tries before healing in the next quorum instead (each one that overlapped a sync
on the peer, or found the group's ranks holding different syncs' states, is taken again)."""


class ReplicaGroups:
    """The torchft Manager of this rank (group rank ``rank`` of ``size``), created when the fit starts.

    What a returning group receives from a live peer is what the fit's plugins hand over (``on_member_state``,
    called by torchft on a live peer's quorum thread while it runs its forward; ``on_load_member_state`` on the
    returning group's ranks inside :meth:`commit`, before the optimizer steps), through :attr:`hook`, the fit's
    plugin hooks (set at ``on_setup``).

    ``per_step``: a quorum and a commit per optimizer step (the synchronous route, and a sync mode's warm-up steps,
    whose plugin turns it off once they are over); without, a sync mode's plugin asks for them once per outer sync
    (:class:`~ddp_plugin.fault_tolerance.sync.ReplicaGroupTransport`)."""

    def __init__(self, options: FaultTolerance, rank: int, size: int, device: torch.device,
                 timeout: timedelta | None, per_step: bool = True, sync_mode: bool = False) -> None:
        timeout = timeout or timedelta(seconds=60)
        self.options = options
        self.rank = rank
        self.device = device
        self.timeout = timeout
        self.per_step = per_step
        self.steps_lost = 0
        """Optimizer steps whose work no group applied (a group was lost in them, or too few were live)."""
        self.uncommitted = 0
        """Quorums whose step or sync was committed nowhere (a sync mode redoes them over the live groups)."""
        self.heals = 0
        self.healed_bytes = 0
        """What the healings received, in bytes of tensors."""
        self.background_heals = 0
        self.heal_s = 0.0
        """Seconds this group spent downloading its peers' state before its first step (a background heal)."""
        self.catching_up = False
        """Whether this group healed in the background and has asked for the quorum of its peers' next sync (a sync
        mode then sends its sync as soon as that quorum is in: :class:`~ddp_plugin.fault_tolerance.sync.ReplicaGroupTransport`)."""
        self.on_skip: Callable[[int], None] | None = None
        """Called with a count of optimizer steps the fit's counters and schedulers skip (a group that healed in the
        background joins its peers' sync before its own schedule's: it takes their position after it)."""
        self.version = background.Version()
        """Odd while a sync writes what a heal server serves (the sync mode marks it)."""
        self.snapshot_due = False
        """Set by the sync mode once a sync is sent: the member records the fit's position at the next step's
        start, and marks the version written at a step's start once the sync's outer step is done too
        (:attr:`outer_done`, set by the outer thread)."""
        self.outer_done = False
        self.server: background.HealServer | None = None
        self.healed_from: set[str] | None = None
        """After a background heal, until its first committed sync: the live groups' replica ids it found."""
        self.served_in_quorum = 0
        """Healings this rank served inside a quorum (its group, and every group of that quorum, waiting for it)."""
        self.early_syncs = 0
        """Syncs this group sent before its schedule's step (a peer asked first: ``dynamic_steps``, or a
        background-healed group joining its peers' next sync)."""
        self.steps_skipped = 0
        """Optimizer steps this group's schedule skipped to stand where its peers do after such a sync."""
        self.quorums = 0
        self.quorum_s = 0.0
        """Seconds from asking for each quorum to its coming in (the lighthouse's answer, torchft's process group
        configured, a heal inside it), summed over :attr:`quorums`."""
        self.quorum_wait_s = 0.0
        """Seconds the training thread stood waiting for quorums (what of :attr:`quorum_s` the steps did not hide)."""
        self._training_thread = threading.get_ident()
        self.watch = (pace.PeerWatch(options.lighthouse) if sync_mode and options.dynamic_steps and rank == 0
                      else None)
        """On the group's rank 0 with ``dynamic_steps``: whether a peer has asked for the next sync's quorum."""
        self._started = False
        self._quorum_limit_s = options.quorum_timeout
        """The quorum asked for last: how long its lighthouse request may take (``quorum_timeout``, or longer)."""
        self.hook: HookRelay | None = None
        """The fit's plugin hooks (``on_member_state`` and the others of members that come and go)."""
        self._settle: HookRelay | None = None
        """The hooks of the codec this quorum's step or sync ran across groups (``on_cross_node_try``), to settle at
        its commit; ``None`` where it ran none."""
        host = advertised_host(os.environ["MASTER_ADDR"])
        if sync_mode and options.background_heal:
            rate = options.heal_rate * 2**20 if options.heal_rate else None
            self.server = background.HealServer(host, self._sync_state, self.version, rate)
        self.manager, pg = torchft_adapter.manager(
            device, load_state_dict=self._healed, state_dict=self._state, min_replica_size=options.min_replicas,
            rank=rank, world_size=size, replica_id=f"replica_group_{options.replica_group}",
            lighthouse_addr=options.lighthouse, timeout=timeout,
            quorum_timeout=timedelta(seconds=options.quorum_timeout), connect_timeout=timeout,
            # The group's own store (Lightning's and torchrun's rendezvous both serve one there), and the address
            # the other groups reach this group's manager at (to heal from it): the rendezvous host, unless that
            # is a loopback name.
            store_addr=os.environ["MASTER_ADDR"], store_port=int(os.environ["MASTER_PORT"]), hostname=host,
            # A lighthouse that does not answer (restarted, say) is asked again about once a second, up to
            # quorum_timeout (torchft's manager server retries; without, the first refusal fails the quorum).
            quorum_retries=max(1, int(options.quorum_timeout)),
        )
        if self.server is not None:  # (where a returning group finds it: the store the lighthouse shows for this group)
            torchft_adapter.publish_heal_address(f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}", rank,
                                                 self.server.address, timeout)
        self.pg = pg
        """torchft's process group of this group rank over the live groups (what a codec's collectives run on)."""
        self.comm: ReplicaGroupCommunicator | None = None
        self.coded = False
        """Whether a codec codes what crosses groups (set with the fit's plugins)."""
        self._first_commit = True
        self.heals_at_start = True  # (whether a quorum at torchft's step 0 heals all groups but one: init_sync)
        self.started_apart = False  # (the run's first sync found the groups apart: refused, retried healing)
        self.ties: list[Any] = []
        """The parameters several pipeline stages of this group hold (:class:`~ddp_plugin.parallel.ties.Tie`)."""
        self.on_first_quorum: Callable[[int], None] | None = None
        """Called with the quorum's count of committed steps once a per-step quorum this group started before its
        first commit is in, before the step's first collective: a sync mode with warm-up steps learns there
        whether its peers are past them (the quorum is then a sync's)."""

    def communicator(self, comm: Communicator) -> ReplicaGroupCommunicator:
        """The fit's communicator: the strategy's collectives (``comm``'s), and a codec's on :attr:`pg`."""
        from ddp_plugin.fault_tolerance.communicator import ReplicaGroupCommunicator

        self.comm = ReplicaGroupCommunicator(comm, self.pg, self.manager)
        return self.comm

    def _state(self) -> dict[str, Any]:
        """Every plugin's ``on_member_state``, merged (a key handed over twice is refused)."""
        self.served_in_quorum += 1
        return merged_answers(self.hook.on_member_state(covers=set()), "hand a returning replica group state")

    def _sync_state(self) -> dict[str, Any]:
        """Every plugin's ``on_member_sync_state``, merged (the heal server's state)."""
        return merged_answers(self.hook.on_member_sync_state(covers=set()), "hand a group joining between syncs state")

    def heal_in_background(self, group: Any) -> bool:
        """Before this group's first step: if live groups are past their first sync, download what every one of them
        holds the same between syncs from one of them (each group rank from the same rank of a group picked by rank),
        the group's ranks agreeing on one version over ``group`` (the group's world), and load it; then ask for
        the quorum of their next sync. ``False`` (nothing loaded): no group is live, or the download did not
        settle in :data:`HEAL_ATTEMPTS` tries (the group then heals in its first quorum, the old way)."""
        import torch.distributed as dist

        if self.server is None:
            return False
        started = time.monotonic()
        deadline = started + self.options.quorum_timeout
        mine = f"replica_group_{self.options.replica_group}"
        state, got, torn, attempt, address, served = None, 0, 0, 0, "", -1
        while True:
            # Each rank: 2 and the sync it holds (torchft's count), 1 (try again: a sync under way, a download torn by
            # one, a peer gone) or 0 (no live group, or none past a sync: not a returning group).
            status, version, ended = 0, -1, False
            try:
                page = torchft_adapter.status_page(self.options.lighthouse, 10.0)
                live = [m for m in torchft_adapter.previous_quorum(self.options.lighthouse, 10.0, page)
                        if m[0].split(":")[0] != mine]
                # (only those still beating: a group lost or ended serves nothing, and its address may take the whole
                # timeout to fail; none beating, none is live)
                beating = torchft_adapter.beating_ids(page)
                ended = bool(live) and not any(m[0] in beating for m in live)
                live = [m for m in live if m[0] in beating]
                if live:
                    peer = heal_source([m[0] for m in live], self.options.replica_group, self.rank, attempt)
                    address = torchft_adapter.heal_address(page, peer, self.rank, DISCOVERY_TIMEOUT)
                    if address is not None:
                        served, state, got = background.fetch(address, self.timeout.total_seconds())
                        # (the peer's count of committed syncs, the same on every group holding that sync's state;
                        # its server's version is its own. Version 0: it has sent no sync yet.)
                        status = 2 if served > 0 and "ft" in state else 0
                        version = state["ft"]["step"] if status == 2 else -1
                        if status == 2 and background.behind(version, live):
                            log.info("ddp_plugin: replica group %d: background heal: %s is behind its quorum",
                                     self.options.replica_group, peer)
                            status, version, torn = 1, -1, torn + 1
            except background.Torn as err:
                status, busy = 1, "under way" in str(err)
                torn += not busy
                log.info("ddp_plugin: replica group %d: background heal: %s", self.options.replica_group, err)
            except Exception as err:  # noqa: BLE001 - a peer gone: another one, or heal the old way
                status, torn = 1, torn + 1
                log.info("ddp_plugin: replica group %d: background heal: %s", self.options.replica_group, err)
            give_up = torn >= HEAL_ATTEMPTS or time.monotonic() > deadline
            # (what the group decides, each rank the same: every rank's answer reduced over the group)
            report = torch.tensor([status, -status, version, -version, -int(give_up)], dtype=torch.int64,
                                  device=self.device)
            dist.all_reduce(report, op=dist.ReduceOp.MIN, group=group)
            low, high, oldest, newest, stop = (report[0].item(), -report[1].item(), report[2].item(),
                                               -report[3].item(), -report[4].item())
            if high == 0:  # (no rank found a live group past a sync)
                if ended and self.rank == 0:
                    log.warning("ddp_plugin: replica group %d: no group of the last quorum beats any more (they ended"
                                " or were lost); not healing in the background", self.options.replica_group)
                return False
            if low == 2 and oldest == newest and self._still_served(address, served, group):
                break  # (and no peer has sent another sync since: the quorum asked for below is their next one)
            attempt += 1
            if stop:
                log.warning("ddp_plugin: replica group %d: the background heal did not settle (%d tries, %.0f s);"
                            " healing in the next quorum instead", self.options.replica_group, attempt,
                            time.monotonic() - started)
                return False
            time.sleep(0.2 if low == 1 else 0.0)  # (a sync under way on a peer: it ends soon)
        self.healed_from = {m[0] for m in live}
        self.hook.on_load_member_sync_state(state=state, covers=set())
        self.manager.load_state_dict({k: state["ft"][k] for k in ("step", "batches_committed")})
        self._first_commit = False  # (every rank loaded one version: the group is one replica)
        self.heals += 1
        self.background_heals += 1
        self.healed_bytes += got
        self.heal_s += time.monotonic() - started
        log.warning("ddp_plugin: replica group %d healed in the background from a live peer (%.1f MB a rank in %.1f s);"
                    " it joins their next sync", self.options.replica_group, got / 2**20, self.heal_s)
        # The quorum of the peers' next sync, asked for now: it is in once they ask (their previous quorum's members
        # all there: the lighthouse waits for no other group), up to a sync interval of theirs away.
        interval = float(state["ft"].get("interval_s", 0.0))
        self.start_step(timeout=timedelta(seconds=self.options.quorum_timeout + 2 * interval))
        self.catching_up = True
        return True

    def _still_served(self, address: str, version: int, group: Any) -> bool:
        """Whether every rank's peer still serves the version it downloaded (it has sent no sync since)."""
        import torch.distributed as dist

        try:
            same = background.version_of(address, DISCOVERY_TIMEOUT.total_seconds()) == version
        except Exception:  # noqa: BLE001 - the peer gone: download again
            same = False
        flag = torch.tensor([int(same)], dtype=torch.int64, device=self.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)
        return bool(flag.item())

    def init_sync(self, on: bool) -> None:
        """Whether this group's quorums heal every group but one at torchft's step 0 (its ``init_sync``): a sync
        mode's groups started alike need not (:class:`~ddp_plugin.fault_tolerance.start.StartCheck`)."""
        self.heals_at_start = on
        torchft_adapter.set_init_sync(self.manager, on)

    def quorum_ready(self) -> bool:
        return torchft_adapter.quorum_ready(self.manager)

    def peers_asked(self) -> bool:
        """With ``dynamic_steps``, on the group's rank 0: whether a group asked for a quorum since this group's last
        one came in (``False`` on the other ranks: the sync mode agrees over the group on rank 0's answer)."""
        return self.watch is not None and self.watch.asked

    def _healed(self, state: dict[str, Any]) -> None:
        self.heals += 1
        self.healed_bytes += state_bytes(state)
        log.warning("ddp_plugin: replica group %d healed from a live peer at step %d",
                    self.options.replica_group, self.manager.current_step())
        self.hook.on_load_member_state(state=state, covers=set())

    def start_step(self, shrink_only: bool = False, timeout: timedelta | None = None) -> None:
        """The quorum of the coming step, computed while the forward runs (once per optimizer step: the inner
        steps of gradient accumulation find it started). ``shrink_only``: of the last quorum's groups only (a
        group that asks meanwhile joins the next one, and heals there). ``timeout``: instead of
        ``quorum_timeout``."""
        if not self._started:
            if self.watch is not None:
                self.watch.disarm()  # (this group asks: its own request is no peer's)
            self.manager.start_quorum(shrink_only=shrink_only, timeout=timeout)
            torchft_adapter.on_quorum(self.manager, self._quorum_in)
            self._quorum_limit_s = timeout.total_seconds() if timeout is not None else self.options.quorum_timeout
            self._started = True
            if self.per_step and self._first_commit and self.on_first_quorum is not None:
                self.wait_quorum()
                self.on_first_quorum(self.manager.current_step())

    def _quorum_in(self, asked: float) -> None:
        """On torchft's quorum thread, once a quorum asked for at ``asked`` (monotonic seconds) is in or failed."""
        self.quorum_s += time.monotonic() - asked
        self.quorums += 1

    @property
    def quorum_wait_limit_s(self) -> float:
        """The longest this rank waits for a quorum it asked for: the lighthouse's answer (``quorum_timeout``),
        then the rendezvous of torchft's process group and a heal (``timeout`` each), and :data:`QUORUM_SLACK_S` to
        spare. torchft bounds each of those itself; this bounds their sum, whatever happens inside torchft."""
        return self._quorum_limit_s + 2 * self.timeout.total_seconds() + QUORUM_SLACK_S

    def wait_quorum(self) -> None:
        """Wait for the quorum started, at most :attr:`quorum_wait_limit_s`. One that failed (the lighthouse asked
        again for ``quorum_timeout``, in vain) or did not come in time names the lighthouse."""
        limit = self.quorum_wait_limit_s
        began = time.monotonic()
        try:
            torchft_adapter.wait_quorum(self.manager, limit)
            if threading.get_ident() == self._training_thread:
                self.quorum_wait_s += time.monotonic() - began
            if self.watch is not None:
                self.watch.arm()  # (every request the lighthouse held is answered: the next one is a peer's next sync)
        except torchft_adapter.QuorumStuck as err:
            raise RuntimeError(
                f"replica group {self.options.replica_group}: torchft's quorum did not return within {limit:g} s"
                f" (fault_tolerance['quorum_timeout'] for the lighthouse's answer, twice the strategy's `timeout` for"
                f" the rendezvous and a heal, and {QUORUM_SLACK_S:g} s): is the lighthouse at {self.options.lighthouse} up, and are"
                f" the groups of its last quorum reachable from here?"
            ) from err
        except Exception as err:  # (torchft raises the lighthouse client's error as it is)
            raise RuntimeError(
                f"replica group {self.options.replica_group}: no quorum within {self.options.quorum_timeout:g} s"
                f" (fault_tolerance['quorum_timeout']): is the lighthouse at {self.options.lighthouse} up, and"
                f" are at least min_replicas={self.options.min_replicas} groups running? torchft said: {err}"
            ) from err

    def allreduce(self, *tensors: Tensor) -> None:
        """Each tensor averaged over the live groups' rank of this group rank, in place (a group still healing
        adds zeros and is not counted), all in flight at once. A failure is swallowed: the quorum's step or sync
        will not commit."""
        self.wait_quorum()
        if self.comm is not None and not self.manager.errored():
            self.comm.count_allreduce(list(tensors))  # (a healing group sends its part too)
        for work in [self.manager.allreduce(t) for t in tensors]:
            work.wait()
            if self.manager.errored() is not None and hasattr(self.pg, "release"):
                self.pg.release()  # (now, not at the next quorum: the peers waiting on this rank fail at once)

    def reduce(self, hook: HookRelay, parts: list[tuple[Tensor, Bucket, int]]) -> None:
        """Each ``(tensor, bucket, offset)`` averaged over the live groups, in place: without a codec (:attr:`coded`)
        by :meth:`allreduce`; with one, through it (``on_cross_node_reduce`` on :attr:`pg`), except in a quorum where
        a group heals (it adds zeros, and its codec's state is not yet its peers'): every group then takes the
        plain all-reduce, and the codecs' state stays as it was. A failure is swallowed, as in :meth:`allreduce`."""
        self.wait_quorum()
        if not self.coded or (not self.manager.errored() and self.heals_in_quorum()):
            self.allreduce(*(tensor for tensor, _, _ in parts))
            return
        if self.manager.errored():
            return
        self._settle = hook
        for tensor, bucket, offset in parts:
            hook.on_cross_node_try(bucket=bucket)  # (the codec keeps its state: a try that fails is redone from it)
            hook.on_cross_node_reduce(tensor=tensor, group=self.pg, bucket=bucket, offset=offset).wait()

    def heals_in_quorum(self) -> bool:
        """Whether a group heals in this quorum, as every group of it sees it: one behind the others' step, or, at
        step 0 with :attr:`heals_at_start`, every group but the first (torchft makes them start from its state)."""
        return ((self.manager.current_step() == 0 and self.heals_at_start)
                or self.manager.num_participants() < self.pg.size())

    @property
    def unified(self) -> bool:
        """Whether this group has committed a quorum (its ranks then hold one replica: see ``on_member_unify``)."""
        return not self._first_commit

    def commit(self, what: str = "step") -> bool:
        """Whether every live group applies this quorum's step or sync (torchft's ``should_commit``; a returning
        group loads its peer's state here first). Every rank of the group calls it once per quorum."""
        self._started = False
        self.wait_quorum()
        if self.healed_from is not None and not self.healed_from & set(self.pg.quorums.members):
            # A quorum of groups that all returned since (every live one it healed from away): their sync would
            # commit apart from the live groups' next one, at the same step. Refused: retried, or dropped (every
            # group of it then keeps the global copy it loaded).
            self.manager.report_error(RuntimeError(
                "a background-healed group's first quorum holds none of the live groups it healed from"))
        committed = self.manager.should_commit()
        if self._settle is not None:
            self._settle, settle = None, self._settle
            settle.on_cross_node_settled(applied=committed)
        if committed:
            self.healed_from = None
        if committed and self._first_commit:
            self._first_commit = False
            self.hook.on_member_unify(covers=set())
        if not committed and not self.started_apart:  # (a refused try of groups started apart is no failure)
            self.uncommitted += 1
            log.warning("ddp_plugin: replica group %d: %s not committed (a group was lost, or fewer than"
                        " min_replicas=%d are live); the next quorum goes on with the live ones",
                        self.options.replica_group, what, self.options.min_replicas)
        self.started_apart = False
        return committed

    def metrics(self) -> dict[str, float]:
        return {"ft/replicas": float(self.manager.num_participants()), "ft/steps_lost": float(self.steps_lost),
                "ft/uncommitted": float(self.uncommitted), "ft/heals": float(self.heals),
                "ft/healed_MB": self.healed_bytes / 2**20, "ft/background_heals": float(self.background_heals),
                "ft/heal_s": self.heal_s, "ft/served_in_quorum": float(self.served_in_quorum),
                "ft/served_in_background": float(self.server.served if self.server is not None else 0),
                "ft/early_syncs": float(self.early_syncs), "ft/steps_skipped": float(self.steps_skipped),
                "ft/quorums": float(self.quorums), "ft/quorum_s": self.quorum_s, "ft/quorum_wait_s": self.quorum_wait_s,
                "ft/step": float(self.manager.current_step())}

    def close(self) -> None:
        if self.server is not None:
            self.server.close()
        if self.watch is not None:
            self.watch.close()
        self.manager.shutdown(wait=False)


def advertised_host(rendezvous_host: str) -> str:
    """Where the other replica groups reach this rank's torchft manager and checkpoint transport: this node's
    address on its route to the group's rendezvous host (on a group of one node, or on the rendezvous node, that
    host itself, as torchrun's ``--master_addr`` gives it; on the other nodes of a group, their own), or this
    machine's host name for a loopback rendezvous. (A UDP socket's connect sends nothing: it picks the route.)"""
    if rendezvous_host in ("localhost", "127.0.0.1", "::1") or rendezvous_host.startswith("127."):
        return socket.gethostname()
    try:
        family, kind, _, _, address = socket.getaddrinfo(rendezvous_host, 1, type=socket.SOCK_DGRAM)[0]
        with socket.socket(family, kind) as probe:
            probe.connect(address)
            return probe.getsockname()[0]
    except OSError:  # (no route from here: the rendezvous host, as given)
        return rendezvous_host


def heal_source(live: list[str], group: int, rank: int, attempt: int) -> str:
    """The live group (of ``live``, the replica ids in the lighthouse's order) that group rank ``rank`` of returning
    group ``group`` downloads from at its ``attempt``-th try: spread by group and rank, so that groups returning
    together, and the ranks of one, do not all download from the first live group."""
    return live[(group + rank + attempt) % len(live)]


def state_bytes(state: Any) -> int:
    """Bytes of the tensors in a (nested) state dict."""
    if isinstance(state, torch.Tensor):
        return state.numel() * state.element_size()
    if isinstance(state, dict):
        return sum(state_bytes(v) for v in state.values())
    if isinstance(state, (list, tuple)):
        return sum(state_bytes(v) for v in state)
    return 0
