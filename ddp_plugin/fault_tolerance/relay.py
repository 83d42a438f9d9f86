"""A standby lighthouse: ``ddp-plugin-group --lighthouse http://a:29510,http://b:29510`` gives the group several
lighthouse addresses, and this relay, on the launcher's process, stands for them at ``127.0.0.1:<port>`` (what the
group's ranks are given as ``TORCHFT_LIGHTHOUSE``).

Each connection a rank opens (torchft's manager asking for a quorum or beating, the strategy reading the status
page) is forwarded to the lighthouse the relay used last; one that refuses it (killed, its machine gone) is passed
over for the next address that accepts, in the order given, which the relay then keeps to. So when a lighthouse
dies, every group's next request reaches the same standby (the first of the list still up), as if the lighthouse
had been started again there: the groups ride it as they ride a restart (docs/fault_tolerance.md). Every
:data:`WATCH_S` seconds the relay also reads each lighthouse's status page, and goes where the groups beat: to the
one that counts more beating groups than the one in use, cutting its connections so that the ranks connect again
there. So a group started while one lighthouse is down, or that connects to a lighthouse just started again and
empty (its peers having moved to the standby), joins its peers within seconds instead of waiting alone for a
quorum. (On a tie it stays; when none answers, it keeps to its choice.)

One lighthouse answers at a time as long as every group reaches the same ones; groups split by a network partition
between two lighthouses cannot both sync when the lighthouses' ``--min_replicas`` is a majority of the groups (the
smaller side waits ``quorum_timeout`` and stops with an error naming the lighthouse). The relay imports no torch (the
launcher's process holds it for the whole run).
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from urllib.parse import urlparse

log = logging.getLogger(__name__)

CONNECT_TIMEOUT_S = 2.0
"""How long the relay waits for one lighthouse to accept a connection before trying the next."""

WATCH_S = 2.0
"""Seconds between two reads of the lighthouses' status pages (a few KB each)."""


def addresses_of(text: str) -> list[str]:
    """``"http://a:1,http://b:2"`` -> the addresses, in order (the launcher checks each one's form)."""
    return [a.strip() for a in text.split(",") if a.strip()]


def _endpoint(address: str) -> tuple[str, int]:
    url = urlparse(address)
    return url.hostname or "127.0.0.1", url.port or 80


def beating_count(address: str, timeout: float) -> int:
    """How many groups the lighthouse at ``address`` counts as beating (-1 if it does not answer)."""
    from ddp_plugin.fault_tolerance.torchft_adapter import beating_groups

    try:
        return beating_groups(address, timeout)
    except OSError:
        return -1


class LighthouseRelay:
    """Listens on ``host`` (an ephemeral port unless ``port``); :attr:`address` is what the ranks are given. Each
    connection goes to :attr:`current`'s lighthouse, or the next of ``addresses`` that accepts (kept from then on).
    Stop it with :meth:`close`."""

    def __init__(self, addresses: list[str], host: str = "127.0.0.1", port: int = 0,
                 probe_timeout: float = CONNECT_TIMEOUT_S, watch_s: float = WATCH_S) -> None:
        if not addresses:
            raise ValueError("LighthouseRelay needs at least one lighthouse address")
        self.addresses = list(addresses)
        self.probe_timeout = probe_timeout
        self._lock = threading.Lock()
        self._open: set[socket.socket] = set()
        counts = self.counts()
        self.current = max(range(len(counts)), key=lambda i: (counts[i], -i))
        """The index of the lighthouse the relay forwards to first."""
        self.switches = 0
        """How many times the relay moved on to another lighthouse (one refused, or the groups beat at another)."""
        self._listener = socket.create_server((host, port))
        self._closed = False
        self.address = f"http://{host}:{self._listener.getsockname()[1]}"
        threading.Thread(target=self._accept, name="ddp_plugin-lighthouse-relay", daemon=True).start()
        if len(self.addresses) > 1:
            threading.Thread(target=self._watch, args=(watch_s,), name="ddp_plugin-lighthouse-watch",
                             daemon=True).start()

    def counts(self) -> list[int]:
        """Each lighthouse's count of beating groups (-1: it does not answer)."""
        return [beating_count(a, self.probe_timeout) for a in self.addresses]

    def _watch(self, every: float) -> None:
        while not self._closed:
            time.sleep(every)
            counts = self.counts()
            with self._lock:
                now = self.current
                best = max(range(len(counts)), key=lambda i: (counts[i], i == now))
                if self._closed or counts[best] <= counts[now]:
                    continue
                log.warning("ddp_plugin: the groups beat at the lighthouse %s (%d of them, %d at %s); going on with it",
                            self.addresses[best], counts[best], max(counts[now], 0), self.addresses[now])
                self.current = best
                self.switches += 1
                cut, self._open = self._open, set()
            for sock in cut:  # (the ranks connect again: to the lighthouse in use now)
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def _accept(self) -> None:
        while not self._closed:
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _upstream(self) -> socket.socket | None:
        """A connection to the lighthouse in use, or to the next of the list that accepts one (then the one in use)."""
        with self._lock:
            start = self.current
        n = len(self.addresses)
        for k in range(n):
            i = (start + k) % n
            try:
                up = socket.create_connection(_endpoint(self.addresses[i]), timeout=CONNECT_TIMEOUT_S)
            except OSError:
                continue
            up.settimeout(None)
            with self._lock:
                if i != self.current and self.current == start:
                    log.warning("ddp_plugin: the lighthouse at %s does not answer; going on with %s",
                                self.addresses[start], self.addresses[i])
                    self.current = i
                    self.switches += 1
            return up
        return None

    def _serve(self, conn: socket.socket) -> None:
        up = self._upstream()
        if up is None:  # (none answers: the rank's request fails as against a lighthouse that is down, and retries)
            conn.close()
            return
        ends = [2]
        lock = threading.Lock()
        with self._lock:
            self._open |= {conn, up}

        def pump(src: socket.socket, dst: socket.socket) -> None:
            """Bytes from ``src`` to ``dst``; its end passed on (a half close), an error closing both ways; the
            sockets closed once both directions are done."""
            try:
                while data := src.recv(65536):
                    dst.sendall(data)
                dst.shutdown(socket.SHUT_WR)
            except OSError:
                for x in (conn, up):
                    try:
                        x.shutdown(socket.SHUT_RDWR)
                    except OSError:
                        pass
            with lock:
                ends[0] -= 1
                last = ends[0] == 0
            if last:
                with self._lock:
                    self._open -= {conn, up}
                conn.close()
                up.close()

        for a, b in ((conn, up), (up, conn)):
            threading.Thread(target=pump, args=(a, b), daemon=True).start()

    def close(self) -> None:
        self._closed = True
        self._listener.close()
