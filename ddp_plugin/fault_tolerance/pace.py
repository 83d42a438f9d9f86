"""Dynamic local steps (``fault_tolerance={"dynamic_steps": True}``): a sync is due when the first group asks for it.

Each group runs its inner steps until a peer has asked the lighthouse for the next sync's quorum (the fastest
group, at its schedule's step), then sends its own at the end of the step it is in, carrying the steps it did.
The group's rank 0 watches the lighthouse on a thread of its own (:class:`PeerWatch`); the group's ranks agree on
what it saw once a step (one integer all-reduced over the group), so they all send at the same step."""

from __future__ import annotations

import logging
import threading
import time

from ddp_plugin.fault_tolerance import torchft_adapter

log = logging.getLogger(__name__)

POLL_S = 0.1
"""Seconds between two looks at the lighthouse's status page while a sync may come (about 1 KB each)."""


class PeerWatch:
    """Watches the lighthouse for a group asking for its next quorum, from :meth:`arm` (this group's last quorum is
    in: every request the lighthouse held then was answered) until :meth:`disarm` (this group asks itself)."""

    def __init__(self, lighthouse: str, poll_s: float = POLL_S) -> None:
        self.lighthouse = lighthouse
        self.poll_s = poll_s
        self._armed_at: float | None = None
        self._seen = False
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._closed = False
        self._thread = threading.Thread(target=self._watch, name="ddp_plugin-peer-watch", daemon=True)
        self._thread.start()

    def arm(self) -> None:
        """From now on (a no-op while armed: every wait for one quorum arms it, the first counts)."""
        with self._lock:
            if self._armed_at is not None:
                return
            self._armed_at, self._seen = time.monotonic(), False
        self._wake.set()

    def disarm(self) -> None:
        with self._lock:
            self._armed_at, self._seen = None, False

    @property
    def asked(self) -> bool:
        """Whether a group asked for a quorum after :meth:`arm` (a look begun after it saw a request waiting)."""
        with self._lock:
            return self._seen

    def _watch(self) -> None:
        while not self._closed:
            with self._lock:
                armed = self._armed_at
            if armed is None or self._seen:
                self._wake.wait(self.poll_s)
                self._wake.clear()
                continue
            began = time.monotonic()
            try:
                waiting = torchft_adapter.waiting_members(self.lighthouse, timeout=max(1.0, 10 * self.poll_s))
            except Exception as err:  # noqa: BLE001 - the lighthouse away: the schedule's step still sends
                log.debug("ddp_plugin: the lighthouse's status page: %s", err)
                waiting = 0
            with self._lock:
                if waiting and self._armed_at is not None and began >= self._armed_at:
                    self._seen = True
            time.sleep(self.poll_s)

    def close(self) -> None:
        self._closed = True
        self._wake.set()
