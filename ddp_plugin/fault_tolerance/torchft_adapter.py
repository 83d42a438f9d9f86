"""Where ddp_plugin reaches past torchft's public API: every use of its private attributes is in this module, so a
torchft release that changes them breaks here and nowhere else.

Checked against torchft 0.2.0 (the version ``pip install ddp_plugin[torchft]`` resolves today). What is used, and
why:

- ``Manager._client`` (its manager server's client) is wrapped by :class:`QuorumRecorder`, which reads the client's
  ``_quorum`` results and clears ``Manager._quorum_id``: torchft 0.2 reconfigures its process group only on a new
  quorum id, and a lighthouse started again hands ids out from 1 again; cleared too after a configuration that
  failed, which torchft 0.2 would otherwise never retry for that id.
- The process group's ``configure`` is given a store prefix with the quorum's step (:func:`unique_rendezvous`), for
  the same reason: its rendezvous keys are the quorum id's; and its members first meet on that store
  (:func:`await_members`, ``torchft.process_group.create_store_client``), so that one lost after asking for the
  quorum fails it within seconds rather than the whole ``timeout``.
- ``HTTPTransport._server`` (the checkpoint transport's HTTP server) gives the port advertised at a host the other
  groups reach (:func:`http_transport`): torchft 0.2 advertises the machine's host name.
- The lighthouse's status page (its HTML, the only place torchft 0.2 shows the last quorum's members to a group
  outside it) says which groups are live (:func:`previous_quorum`), where their stores are (:func:`heal_address`
  reads a live peer's heal server there), whether one of them has asked for the next quorum
  (:func:`waiting_members`) and how many groups beat (:func:`beating_groups`).
- ``Manager._quorum_future`` says whether a quorum asked for is in (:func:`quorum_ready`), times it
  (:func:`on_quorum`), and is waited for with a limit (:func:`wait_quorum`).
- ``Manager._init_sync`` (what each quorum request asks for at step 0: every group but one healing from it) is
  turned off and on again by :func:`set_init_sync`: a sync mode's groups that started from the same bits skip that
  heal (torchft 0.2 takes it only as the Manager's argument, and reads the attribute at each quorum).

Everything else (``Manager`` and its quorum, commit, all-reduce and error calls, ``ProcessGroupGloo``/``NCCL``,
``HTTPTransport``) is torchft's public API.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from datetime import timedelta
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

CHECKED_VERSIONS = ("0.2.0",)
"""The torchft releases this module was checked against."""

HEAL_KEY = "ddp_plugin/heal/{rank}"
"""The key under which each group rank's heal server is in its group's store (the one the lighthouse shows)."""


def manager(device: torch.device, *, hostname: str, timeout: timedelta, **options: Any) -> tuple[Any, Any]:
    """A torchft ``Manager`` (``options``: its keyword arguments) and its process group (NCCL on a CUDA ``device``,
    else gloo), with the rendezvous keyed by quorum step as well as id, the checkpoint transport advertised at
    ``hostname`` and the quorum recorder in place."""
    from torchft import Manager, ProcessGroupGloo, ProcessGroupNCCL

    pg = unique_rendezvous(ProcessGroupNCCL if device.type == "cuda" else ProcessGroupGloo,
                           options.get("lighthouse_addr"))(timeout=timeout)
    made = Manager(pg=pg, hostname=hostname, timeout=timeout, checkpoint_transport=http_transport(hostname, timeout),
                   **options)
    pg.quorums = made._client = QuorumRecorder(made._client, made)
    return made, pg


class QuorumRecorder:
    """torchft's client of its manager server, keeping the step of the last quorum it returned (the highest step
    of its groups: every group of the quorum gets the same), and making the Manager reconfigure its process group
    for a quorum whose id it already has but whose groups differ, or which this group is behind (it heals): a
    lighthouse started again hands out ids from 1 again, and torchft 0.2 reconfigures only on a new id. One
    lighthouse never hands a group that is behind the id of its last quorum (its groups did not go on without it);
    a restarted one does, when the group missed its first quorums and the others took the id back up, and the
    others then configure a new process group while this one kept its old one."""

    def __init__(self, client: Any, manager: Any) -> None:
        self._client, self._manager = client, manager
        self.max_step = 0
        self._members: tuple[int, list[str]] | None = None

    def _quorum(self, *args: Any, **kwargs: Any) -> Any:
        quorum = self._client._quorum(*args, **kwargs)
        self.max_step = quorum.max_step
        members = (quorum.quorum_id, list(quorum.replica_ids))
        if self._members is not None and members[0] == self._members[0] and (
                members[1] != self._members[1] or getattr(quorum, "heal", False)):
            self._manager._quorum_id = None  # (read next by the Manager: a new id for it, so it reconfigures)
        self._members = members
        return quorum

    def forget(self) -> None:
        """Make the Manager configure its process group at the next quorum, whatever its id: torchft 0.2 takes a
        quorum's id before it configures, so a configuration that failed (a peer that never came to the rendezvous)
        left the group unconfigured, and the next quorum of that id (a restarted lighthouse hands ids out again)
        skipped it: every collective then raised "process group not initialized"."""
        self._manager._quorum_id = None
        self._members = None

    @property
    def members(self) -> list[str]:
        """The replica ids of the last quorum returned."""
        return list(self._members[1]) if self._members is not None else []

    def __getattr__(self, name: str) -> Any:
        return getattr(self._client, name)


def unique_rendezvous(base: type, lighthouse: str | None = None) -> type:
    """torchft's process group whose rendezvous keys, at each reconfiguration, are under the quorum's step as well
    as its id: torchft 0.2 keys them by quorum id only, which a lighthouse started again hands out from 1 again,
    and the stores still hold the keys of the first quorums under those (a reconfiguration then hangs on them).

    With ``lighthouse``, the members first meet on the store (:func:`await_members`): one that stopped beating at
    the lighthouse before it came (killed after asking for the quorum) fails the configuration within seconds,
    where torchft's rendezvous would wait for it the whole ``timeout``.

    Its ``rank()`` is this group's rank in the present quorum, that of the backend configured for it (torchft's
    public ``parent``): torchft 0.2's wrapper answers for the process group of rank 0 of 1 it is built on, and a
    codec that owns a share of what it reduces (``compression="sparse"``'s reduce-scatter) asks it which."""

    class UniqueRendezvous(base):
        quorums: QuorumRecorder | None = None
        _shape: tuple[int, int] | None = None
        """(rank, size) of the last configuration: what :meth:`rank` and :meth:`size` answer once released."""

        def configure(self, store_addr: str, *args: Any, **kwargs: Any) -> None:
            step = self.quorums.max_step if self.quorums is not None else 0
            address = f"{store_addr}/step{step}"
            if len(args) >= 3:
                self._shape = (args[1], args[2])
            try:
                if lighthouse is not None and self.quorums is not None and len(args) >= 3 and args[2] > 1:
                    await_members(address, args[1], args[2], self.quorums.members, lighthouse, self._timeout)
                super().configure(address, *args, **kwargs)
            except BaseException:
                if self.quorums is not None:
                    self.quorums.forget()
                raise

        def rank(self) -> int:
            try:
                return self.parent.rank()
            except AssertionError:  # (torchft's: no backend before the first quorum, or released)
                return self._shape[0] if self._shape is not None else super().rank()

        def size(self) -> int:
            try:
                return self.parent.size()
            except AssertionError:
                return self._shape[1] if self._shape is not None else 1

        def release(self) -> None:
            """Drop this quorum's process group now, once a collective on it failed (a member died inside it),
            rather than at the next quorum's configuration. Its sockets close, and so every peer waiting on this
            rank fails at once instead of after the strategy's ``timeout``, drops its own, and so on around the
            ring: a member killed inside an all-reduce otherwise held every live member that was not its neighbour
            for the whole ``timeout`` (gloo's abort does not end a wait; only closed sockets do). The next quorum
            configures afresh (:meth:`QuorumRecorder.forget`); until then the quorum's collectives are skipped (its
            Manager has an error)."""
            if self._pg is None:
                return
            try:
                self.abort(errored=False)
            finally:
                self._pg = None
                if self.quorums is not None:
                    self.quorums.forget()

    return UniqueRendezvous


MEMBERS_POLL_S = 0.1
"""How often :func:`await_members` looks at the store, and (ten times as long) at the lighthouse's heartbeats."""


class MemberGone(RuntimeError):
    """A quorum's member stopped beating at the lighthouse before it came to the quorum's rendezvous, or did not
    come within the timeout."""


def await_members(address: str, rank: int, world_size: int, members: list[str], lighthouse: str,
                  timeout: timedelta) -> None:
    """Meet the quorum's ``world_size`` members on the store at ``address`` (``host:port/prefix``, the rendezvous'
    own, under ``/arrived``) before torchft's rendezvous: each sets its rank and waits for the others', looking at
    the lighthouse's status page about once a second. A member (of ``members``, the quorum's replica ids) that the
    lighthouse no longer counts as beating, while not every member has come, raises :class:`MemberGone`; a
    lighthouse that does not answer is no news. Members that have not all come after ``timeout`` raise it too,
    naming those missing: torchft's rendezvous would wait for them a second ``timeout`` (a member that beats but
    does not come, such as one that kept an older process group, made every member of the quorum stand twice the
    ``timeout``)."""
    import time

    from torchft.process_group import create_store_client

    store = create_store_client(f"{address}/arrived", timeout)
    store.set(str(rank), "1")
    keys = [str(r) for r in range(world_size)]
    deadline = time.monotonic() + timeout.total_seconds()
    look = time.monotonic() + 10 * MEMBERS_POLL_S
    while not store.check(keys):
        now = time.monotonic()
        if now > deadline:
            missing = [r for r in range(world_size) if not store.check([str(r)])]
            names = [members[r] for r in missing if r < len(members)]
            raise MemberGone(f"the quorum's ranks {missing} (of its members {names}) did not come to its rendezvous"
                             f" within {timeout.total_seconds():g} s (the strategy's `timeout`): this quorum is given"
                             " up")
        if now >= look:
            look = now + 10 * MEMBERS_POLL_S
            try:
                beating = beating_ids(status_page(lighthouse, 2.0))
            except Exception:  # noqa: BLE001 - the lighthouse away (restarted, say): no news of the members
                beating = None
            gone = [m for m in members if beating is not None and m not in beating]
            if gone:
                raise MemberGone(f"the quorum's members {gone} stopped beating at the lighthouse before they came to"
                                 " its rendezvous (lost after asking for it): this quorum is given up")
        time.sleep(MEMBERS_POLL_S)


def http_transport(host: str, timeout: timedelta) -> Any:
    """torchft's HTTP checkpoint transport (what its Manager makes by default), advertised at ``host``: torchft 0.2
    advertises the machine's host name, which another node may not reach (a network namespace's, say)."""
    from torchft.checkpointing import HTTPTransport

    class Transport(HTTPTransport):
        def address(self) -> str:
            return f"http://{host}:{self._server.socket.getsockname()[1]}/checkpoint/"

    return Transport(timeout=timeout, num_chunks=0)


def status_page(lighthouse: str, timeout: float) -> str:
    import urllib.request

    with urllib.request.urlopen(f"{lighthouse.rstrip('/')}/status", timeout=timeout) as response:  # noqa: S310
        return response.read().decode()


def previous_quorum(lighthouse: str, timeout: float, page: str | None = None) -> list[tuple[str, str, int]]:
    """The members of the lighthouse's last quorum, ``(replica id, manager address, step)`` each, read from its
    status page (empty before the first quorum)."""
    import re

    section = _previous_quorum_section(status_page(lighthouse, timeout) if page is None else page)
    return [(replica, address, int(step)) for replica, step, address in re.findall(
        r"<b>([^<]+)</b>\s*<br/>\s*Step:\s*(\d+)\s*<br/>\s*Manager:\s*(\S+)\s*<br/>", section)]


def _previous_quorum_section(page: str) -> str:
    """The part of the lighthouse's status ``page`` that lists its last quorum's members (empty before one)."""
    return page.split("Previous Quorum", 1)[1].split("Heartbeats", 1)[0] if "Previous Quorum" in page else ""


def waiting_members(lighthouse: str, timeout: float) -> int:
    """How many of the groups in the lighthouse's last quorum have asked for its next one (and wait for it), read
    from its status page: the requests it holds (its next quorum's status ends ``[healthy/asked participants
    healthy]``) less the groups beating outside that quorum (a returning group may have asked early: counted as
    one that did)."""
    import re

    page = status_page(lighthouse, timeout)
    found = re.search(r"\[\d+/(\d+) participants healthy\]", page)
    if found is None:
        return 0
    members = {replica for replica, _, _ in previous_quorum(lighthouse, timeout, page)}
    return max(0, int(found.group(1)) - len(beating_ids(page) - members))


def beating_ids(page: str) -> set[str]:
    """The replica ids whose heartbeats the lighthouse's status ``page`` shows as recent."""
    import re

    return set(re.findall(r'<li class="heartbeat\s*">\s*([^\s<]+): seen', page.split("Heartbeats", 1)[-1]))


def beating_groups(lighthouse: str, timeout: float) -> int:
    """How many groups the lighthouse counts as beating (its next quorum's status ends ``[n heartbeating]``)."""
    import re

    found = re.search(r"\[(\d+) heartbeating\]", status_page(lighthouse, timeout))
    return int(found.group(1)) if found else 0


def member_stores(page: str) -> dict[str, str]:
    """``{replica id: its group's store, host:port}`` of the last quorum's members on the lighthouse's status
    ``page`` (the store torchft's Manager was given: the group's rendezvous store)."""
    import re

    return dict(re.findall(r"<b>([^<]+)</b>.*?TCPStore:\s*(\S+)\s*<br/>", _previous_quorum_section(page), flags=re.S))


def _store(address: str, timeout: timedelta) -> Any:
    from torch.distributed import TCPStore

    host, port = address.rsplit(":", 1)
    return TCPStore(host.strip("[]"), int(port), is_master=False, timeout=timeout, wait_for_workers=False)


def publish_heal_address(store_address: str, rank: int, address: str, timeout: timedelta) -> None:
    """Put group rank ``rank``'s heal server at ``address`` into its group's store (``host:port``)."""
    _store(store_address, timeout).set(HEAL_KEY.format(rank=rank), address)


def heal_address(page: str, replica_id: str, rank: int, timeout: timedelta) -> str | None:
    """The heal server of group rank ``rank`` of the last quorum's member ``replica_id``, as its group's store
    (which the lighthouse's status ``page`` names) holds it, or ``None`` if it holds none: the rendezvous store
    every group reaches already (torchft's process group across groups meets in one), through torch's public
    ``TCPStore``, rather than a private call to the group's torchft manager server."""
    store_address = member_stores(page).get(replica_id)
    if store_address is None:
        return None
    store = _store(store_address, timeout)
    key = HEAL_KEY.format(rank=rank)
    return store.get(key).decode() if store.check([key]) else None


def set_init_sync(made: Any, on: bool) -> None:
    """Whether the quorums ``made`` (a torchft Manager) asks for from now on heal every group but one at step 0
    (torchft's ``init_sync``; every group of a quorum must ask the same)."""
    made._init_sync = on


class QuorumStuck(Exception):
    """torchft's quorum thread did not return within the limit :func:`wait_quorum` was given."""


def wait_quorum(made: Any, seconds: float) -> None:
    """Wait for the quorum ``made`` (a torchft Manager) asked for, at most ``seconds`` (then :class:`QuorumStuck`),
    and raise what it raised: torchft 0.2 waits on its quorum thread's future without a limit, each step of that
    thread having its own (the lighthouse's answer, the rendezvous, a heal). (Not ``future.result(timeout)``: a
    quorum that failed in time raises ``TimeoutError`` too, torchft's lighthouse client's.)"""
    import concurrent.futures

    future = made._quorum_future
    if future is not None and not concurrent.futures.wait([future], timeout=seconds).done:
        raise QuorumStuck(f"torchft's quorum thread did not return within {seconds:g} s")
    made.wait_quorum()


def on_quorum(made: Any, done: Callable[[float], None]) -> None:
    """``done(asked)`` once the quorum ``made`` (a torchft Manager) was just asked for is in or failed, on torchft's
    quorum thread (``asked``: now, in monotonic seconds)."""
    asked = time.monotonic()
    future = made._quorum_future
    if future is not None:
        future.add_done_callback(lambda _: done(asked))


def quorum_ready(made: Any) -> bool:
    """Whether the quorum ``made`` (a torchft Manager) asked for is in (``wait_quorum`` would not wait)."""
    future = made._quorum_future
    return future is not None and future.done()


