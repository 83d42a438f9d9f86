"""Where ddp_plugin reaches past torchft's public API: every use of its private attributes is in this module, so a
torchft release that changes them breaks here and nowhere else.

Checked against torchft 0.2.0 (the version ``pip install ddp_plugin[torchft]`` resolves today). What is used, and
why:

- ``Manager._client`` (its manager server's client) is wrapped by :class:`QuorumRecorder`, which reads the client's
  ``_quorum`` results and clears ``Manager._quorum_id``: torchft 0.2 reconfigures its process group only on a new
  quorum id, and a lighthouse started again hands ids out from 1 again.
- The process group's ``configure`` is given a store prefix with the quorum's step (:func:`unique_rendezvous`), for
  the same reason: its rendezvous keys are the quorum id's.
- ``HTTPTransport._server`` (the checkpoint transport's HTTP server) gives the port advertised at a host the other
  groups reach (:func:`http_transport`): torchft 0.2 advertises the machine's host name. The transport's metadata
  (what torchft's manager server hands a peer for a rank) also carries the rank's heal server
  (:mod:`~ddp_plugin.fault_tolerance.background`), after :data:`HEAL_SEPARATOR`.
- ``ManagerClient._checkpoint_metadata`` (a peer group's manager server, asked for a rank's transport metadata)
  finds a live peer's heal server (:func:`heal_address`), and the lighthouse's status page (its HTML, the only
  place torchft 0.2 shows the last quorum's members to a group outside it) which groups are live
  (:func:`previous_quorum`), whether one of them has asked for the next quorum (:func:`waiting_members`) and
  how many groups beat (:func:`beating_groups`).
- ``Manager._quorum_future`` says whether a quorum asked for is in (:func:`quorum_ready`).

Everything else (``Manager`` and its quorum, commit, all-reduce and error calls, ``ProcessGroupGloo``/``NCCL``,
``HTTPTransport``) is torchft's public API.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import torch

CHECKED_VERSIONS = ("0.2.0",)
"""The torchft releases this module was checked against."""

HEAL_SEPARATOR = "|heal="
"""Between torchft's checkpoint address and the heal server's in a rank's transport metadata."""


def manager(device: torch.device, *, hostname: str, timeout: timedelta, heal: str | None = None,
            **options: Any) -> tuple[Any, Any]:
    """A torchft ``Manager`` (``options``: its keyword arguments) and its process group (NCCL on a CUDA ``device``,
    else gloo), with the rendezvous keyed by quorum step as well as id, the checkpoint transport advertised at
    ``hostname`` (with ``heal``, this rank's heal server's address, in its metadata) and the quorum recorder in
    place."""
    from torchft import Manager, ProcessGroupGloo, ProcessGroupNCCL

    pg = unique_rendezvous(ProcessGroupNCCL if device.type == "cuda" else ProcessGroupGloo)(timeout=timeout)
    made = Manager(pg=pg, hostname=hostname, timeout=timeout,
                   checkpoint_transport=http_transport(hostname, timeout, heal), **options)
    pg.quorums = made._client = QuorumRecorder(made._client, made)
    return made, pg


class QuorumRecorder:
    """torchft's client of its manager server, keeping the step of the last quorum it returned (the highest step
    of its groups: every group of the quorum gets the same), and making the Manager reconfigure its process group
    for a quorum whose id it already has but whose groups differ: a lighthouse started again hands out ids from 1
    again, and torchft 0.2 reconfigures only on a new id."""

    def __init__(self, client: Any, manager: Any) -> None:
        self._client, self._manager = client, manager
        self.max_step = 0
        self._members: tuple[int, list[str]] | None = None

    def _quorum(self, *args: Any, **kwargs: Any) -> Any:
        quorum = self._client._quorum(*args, **kwargs)
        self.max_step = quorum.max_step
        members = (quorum.quorum_id, list(quorum.replica_ids))
        if self._members is not None and members[0] == self._members[0] and members[1] != self._members[1]:
            self._manager._quorum_id = None  # (read next by the Manager: a new id for it, so it reconfigures)
        self._members = members
        return quorum

    @property
    def members(self) -> list[str]:
        """The replica ids of the last quorum returned."""
        return list(self._members[1]) if self._members is not None else []

    def __getattr__(self, name: str) -> Any:
        return getattr(self._client, name)


def unique_rendezvous(base: type) -> type:
    """torchft's process group whose rendezvous keys, at each reconfiguration, are under the quorum's step as well
    as its id: torchft 0.2 keys them by quorum id only, which a lighthouse started again hands out from 1 again,
    and the stores still hold the keys of the first quorums under those (a reconfiguration then hangs on them)."""

    class UniqueRendezvous(base):
        quorums: QuorumRecorder | None = None

        def configure(self, store_addr: str, *args: Any, **kwargs: Any) -> None:
            step = self.quorums.max_step if self.quorums is not None else 0
            super().configure(f"{store_addr}/step{step}", *args, **kwargs)

    return UniqueRendezvous


def http_transport(host: str, timeout: timedelta, heal: str | None = None) -> Any:
    """torchft's HTTP checkpoint transport (what its Manager makes by default), advertised at ``host``: torchft 0.2
    advertises the machine's host name, which another node may not reach (a network namespace's, say). With
    ``heal``, its metadata names this rank's heal server too."""
    from torchft.checkpointing import HTTPTransport

    class Transport(HTTPTransport):
        def address(self) -> str:
            return f"http://{host}:{self._server.socket.getsockname()[1]}/checkpoint/"

        def metadata(self) -> str:
            return self.address() + (f"{HEAL_SEPARATOR}{heal}" if heal else "")

        def recv_checkpoint(self, src_rank: int, metadata: str, step: int, timeout: timedelta) -> Any:
            return super().recv_checkpoint(src_rank, metadata.split(HEAL_SEPARATOR)[0], step, timeout)

    return Transport(timeout=timeout, num_chunks=0)


def status_page(lighthouse: str, timeout: float) -> str:
    import urllib.request

    with urllib.request.urlopen(f"{lighthouse.rstrip('/')}/status", timeout=timeout) as response:  # noqa: S310
        return response.read().decode()


def previous_quorum(lighthouse: str, timeout: float, page: str | None = None) -> list[tuple[str, str, int]]:
    """The members of the lighthouse's last quorum, ``(replica id, manager address, step)`` each, read from its
    status page (empty before the first quorum)."""
    import re

    page = status_page(lighthouse, timeout) if page is None else page
    if "Previous Quorum" not in page:
        return []
    page = page.split("Previous Quorum", 1)[1].split("Heartbeats", 1)[0]
    return [(replica, address, int(step)) for replica, step, address in re.findall(
        r"<b>([^<]+)</b>\s*<br/>\s*Step:\s*(\d+)\s*<br/>\s*Manager:\s*(\S+)\s*<br/>", page)]


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


def heal_address(manager_address: str, rank: int, timeout: timedelta) -> str | None:
    """The heal server of group rank ``rank`` of the group whose manager server is at ``manager_address`` (what
    that rank's transport metadata names), or ``None`` if it names none."""
    from torchft._torchft import ManagerClient

    metadata = ManagerClient(manager_address, connect_timeout=timeout)._checkpoint_metadata(rank, timeout=timeout)
    return metadata.split(HEAL_SEPARATOR, 1)[1] if HEAL_SEPARATOR in metadata else None


def quorum_ready(made: Any) -> bool:
    """Whether the quorum ``made`` (a torchft Manager) asked for is in (``wait_quorum`` would not wait)."""
    future = made._quorum_future
    return future is not None and future.done()


