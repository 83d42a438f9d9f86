"""This rank's place among the replica groups: a torchft ``Manager`` per rank, its quorum per step, the commit
that gates the optimizer step, and the state a returning group heals from.

A replica group is one Lightning world (one node's ranks, launched on its own, with its own rendezvous). Rank
``r`` of every live group meets rank ``r`` of the others on torchft's process group, which the Manager
reconfigures over the live groups at each quorum. torchft swallows a failed collective there (the peer died):
the step is then committed nowhere, and the next quorum goes on without the lost group.
"""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Callable
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch

from ddp_plugin.fault_tolerance import torchft_adapter
from ddp_plugin.gradients.plugin_manager import merged_answers

if TYPE_CHECKING:
    from pluggy import HookRelay
    from torch import Tensor

    from ddp_plugin.fault_tolerance.communicator import ReplicaGroupCommunicator
    from ddp_plugin.fault_tolerance.options import FaultTolerance
    from ddp_plugin.hookspecs import Bucket

log = logging.getLogger(__name__)


class ReplicaGroups:
    """The torchft Manager of this rank (group rank ``rank`` of ``size``), created when the fit starts.

    What a returning group receives from a live peer is what the fit's plugins hand over (``on_member_state``,
    called by torchft on a live peer's quorum thread while it runs its forward; ``on_load_member_state`` on the
    returning group's ranks inside :meth:`commit`, before the optimizer steps), through :attr:`hook`, the fit's
    plugin hooks (set at ``on_setup``).

    ``per_step``: a quorum and a commit per optimizer step (the synchronous route, and a sync mode's warm-up steps,
    whose plugin turns it off once they are over); without, a sync mode's plugin asks for them once per outer sync
    (:class:`~ddp_plugin.fault_tolerance.sync.ReplicaGroupSync`)."""

    def __init__(self, options: FaultTolerance, rank: int, size: int, device: torch.device,
                 timeout: timedelta | None, per_step: bool = True) -> None:
        timeout = timeout or timedelta(seconds=60)
        self.options = options
        self.per_step = per_step
        self.steps_lost = 0
        """Optimizer steps whose work no group applied (a group was lost in them, or too few were live)."""
        self.uncommitted = 0
        """Quorums whose step or sync was committed nowhere (a sync mode redoes them over the live groups)."""
        self.heals = 0
        self.healed_bytes = 0
        """What the healings received, in bytes of tensors."""
        self._started = False
        self.hook: HookRelay | None = None
        """The fit's plugin hooks (``on_member_state`` and the others of members that come and go)."""
        host = advertised_host(os.environ["MASTER_ADDR"])
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
        self.pg = pg
        """torchft's process group of this group rank over the live groups (what a codec's collectives run on)."""
        self.comm: ReplicaGroupCommunicator | None = None
        self.coded = False
        """Whether a codec codes what crosses groups (set with the fit's plugins)."""
        self._first_commit = True
        self.ties: list[Any] = []
        """The parameters several pipeline stages of this group hold (:class:`~ddp_plugin.parallel.ties.Tie`)."""
        self.on_first_quorum: Callable[[int], None] | None = None
        """Called with the quorum's count of committed steps once a per-step quorum this group started before its
        first commit is in, before the step's first collective: a sync mode with warm-up steps learns there
        whether its peers are past them (the quorum is then a sync's)."""

    def communicator(self, ranks_per_node: int, timeout: timedelta | None) -> ReplicaGroupCommunicator:
        """The fit's communicator: the strategy's collectives, and a codec's on :attr:`pg`."""
        from ddp_plugin.fault_tolerance.communicator import ReplicaGroupCommunicator

        self.comm = ReplicaGroupCommunicator(ranks_per_node, timeout, self.pg, self.manager)
        return self.comm

    def _state(self) -> dict[str, Any]:
        """Every plugin's ``on_member_state``, merged (a key handed over twice is refused)."""
        return merged_answers(self.hook.on_member_state(covers=set()), "hand a returning replica group state")

    def _healed(self, state: dict[str, Any]) -> None:
        self.heals += 1
        self.healed_bytes += state_bytes(state)
        log.warning("ddp_plugin: replica group %d healed from a live peer at step %d",
                    self.options.replica_group, self.manager.current_step())
        self.hook.on_load_member_state(state=state, covers=set())

    def start_step(self, shrink_only: bool = False) -> None:
        """The quorum of the coming step, computed while the forward runs (once per optimizer step: the inner
        steps of gradient accumulation find it started). ``shrink_only``: of the last quorum's groups only (a
        group that asks meanwhile joins the next one, and heals there)."""
        if not self._started:
            self.manager.start_quorum(shrink_only=shrink_only)
            self._started = True
            if self.per_step and self._first_commit and self.on_first_quorum is not None:
                self.wait_quorum()
                self.on_first_quorum(self.manager.current_step())

    def wait_quorum(self) -> None:
        """Wait for the quorum started. One that failed (the lighthouse asked again for ``quorum_timeout``, in
        vain) names the lighthouse."""
        try:
            self.manager.wait_quorum()
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
        for tensor, bucket, offset in parts:
            hook.on_cross_node_reduce(tensor=tensor, group=self.pg, bucket=bucket, offset=offset).wait()

    def heals_in_quorum(self) -> bool:
        """Whether a group heals in this quorum, as every group of it sees it: one behind the others' step, or, at
        step 0, every group but the first (torchft makes them start from its state)."""
        return self.manager.current_step() == 0 or self.manager.num_participants() < self.pg.size()

    @property
    def unified(self) -> bool:
        """Whether this group has committed a quorum (its ranks then hold one replica: see ``on_member_unify``)."""
        return not self._first_commit

    def commit(self, what: str = "step") -> bool:
        """Whether every live group applies this quorum's step or sync (torchft's ``should_commit``; a returning
        group loads its peer's state here first). Every rank of the group calls it once per quorum."""
        self._started = False
        self.wait_quorum()
        committed = self.manager.should_commit()
        if committed and self._first_commit:
            self._first_commit = False
            self.hook.on_member_unify(covers=set())
        if not committed:
            self.uncommitted += 1
            log.warning("ddp_plugin: replica group %d: %s not committed (a group was lost, or fewer than"
                        " min_replicas=%d are live); the next quorum goes on with the live ones",
                        self.options.replica_group, what, self.options.min_replicas)
        return committed

    def metrics(self) -> dict[str, float]:
        return {"ft/replicas": float(self.manager.num_participants()), "ft/steps_lost": float(self.steps_lost),
                "ft/uncommitted": float(self.uncommitted), "ft/heals": float(self.heals),
                "ft/healed_MB": self.healed_bytes / 2**20,
                "ft/step": float(self.manager.current_step())}

    def close(self) -> None:
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


def state_bytes(state: Any) -> int:
    """Bytes of the tensors in a (nested) state dict."""
    if isinstance(state, torch.Tensor):
        return state.numel() * state.element_size()
    if isinstance(state, dict):
        return sum(state_bytes(v) for v in state.values())
    if isinstance(state, (list, tuple)):
        return sum(state_bytes(v) for v in state)
    return 0
