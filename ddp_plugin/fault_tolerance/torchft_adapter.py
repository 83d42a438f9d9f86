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
  groups reach (:func:`http_transport`): torchft 0.2 advertises the machine's host name.

Everything else (``Manager`` and its quorum, commit, all-reduce and error calls, ``ProcessGroupGloo``/``NCCL``,
``HTTPTransport``) is torchft's public API.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import torch

CHECKED_VERSIONS = ("0.2.0",)
"""The torchft releases this module was checked against."""


def manager(device: torch.device, *, hostname: str, timeout: timedelta, **options: Any) -> tuple[Any, Any]:
    """A torchft ``Manager`` (``options``: its keyword arguments) and its process group (NCCL on a CUDA ``device``,
    else gloo), with the rendezvous keyed by quorum step as well as id, the checkpoint transport advertised at
    ``hostname`` and the quorum recorder in place."""
    from torchft import Manager, ProcessGroupGloo, ProcessGroupNCCL

    pg = unique_rendezvous(ProcessGroupNCCL if device.type == "cuda" else ProcessGroupGloo)(timeout=timeout)
    made = Manager(pg=pg, hostname=hostname, timeout=timeout,
                   checkpoint_transport=http_transport(hostname, timeout), **options)
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


def http_transport(host: str, timeout: timedelta) -> Any:
    """torchft's HTTP checkpoint transport (what its Manager makes by default), advertised at ``host``: torchft 0.2
    advertises the machine's host name, which another node may not reach (a network namespace's, say)."""
    from torchft.checkpointing import HTTPTransport

    class Transport(HTTPTransport):
        def address(self) -> str:
            return f"http://{host}:{self._server.socket.getsockname()[1]}/checkpoint/"

    return Transport(timeout=timeout, num_chunks=0)


