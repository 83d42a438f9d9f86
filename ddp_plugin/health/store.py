"""The health protocol's side on the rendezvous store: its keys and timings, a client of its own, and the reads and
writes every part of :mod:`ddp_plugin.health` shares (see the package's docstring for the protocol).

Keys, under ``PREFIX``: ``beat/<rank>`` (a counter the heartbeat bumps), ``step/<rank>``, ``process/<rank>``
(:func:`~ddp_plugin.health.processes.process_id`), ``failed/<rank>`` (a rank's own error), ``victim/<rank>`` (a
rank diagnosing a failed collective), ``read/<rank>`` (its diagnosis is done), ``gone`` (the ranks a diagnosis or a
watch found gone) and ``news`` (a counter bumped with every such key, which watchers poll instead of every key).
"""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import TypeVar

import torch.distributed as dist

from ddp_plugin.health.processes import process_gone

_T = TypeVar("_T")

PREFIX = "ddp_plugin/health"
BEAT_INTERVAL_S = 0.5
# A rank whose counter has not moved for this long is gone: two beats missed, so one late beat (a busy machine)
# names nobody.
MISSED_BEATS_S = 2 * BEAT_INTERVAL_S
POLL_S = 0.1
STORE_TIMEOUT_S = 3.0
# PeerWatch: a rank whose step has not moved for WATCH_IDLE_S starts reading its peers' counters (one store
# read per peer and beat: only while it waits), and names a peer whose counter stood still for WATCH_STALL_S.
# Longer than the diagnosis's MISSED_BEATS_S: this acts on a run nothing has failed in yet.
WATCH_IDLE_S = 5.0
WATCH_STALL_S = 5.0
# After a failed fit, the rank hosting the store keeps it up at most this long for the others to read the cause.
LINGER_S = 5.0


def rank_0_hosts_store() -> bool:
    """Whether global rank 0 hosts the rendezvous store (Lightning's launcher), not torchrun's agent."""
    return os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True"


def connect(probe: bool = False) -> dist.Store:
    """A client of its own to the rendezvous store (MASTER_ADDR:MASTER_PORT, which every launcher Lightning
    supports sets); the default group's client is not shared with the heartbeat's thread. Falls back to the
    default group's store where those variables are missing. ``probe``: connect a plain socket first, so a store
    whose process is gone (the connection refused) raises at once instead of after the client's retries."""
    addr, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    if not addr or not port:
        return dist.distributed_c10d._get_default_store()
    if probe:
        socket.create_connection((addr, int(port)), timeout=STORE_TIMEOUT_S).close()
    # A short timeout: a client to a dead host retries its connection until the timeout, and every survivor
    # of a dead rank 0 (which hosts the store under Lightning's launcher) would wait that long to say so.
    return dist.TCPStore(addr, int(port), is_master=False, timeout=timedelta(seconds=STORE_TIMEOUT_S),
                         wait_for_workers=False)


def tell(store: dist.Store, key: str, value: str) -> None:
    """Set ``key`` and bump the news counter, which a watching diagnosis polls instead of every key."""
    store.set(key, value)
    store.add(f"{PREFIX}/news", 1)


def within(seconds: float, fn: Callable[[], _T]) -> _T:
    """``fn()``, run on a daemon thread and waited for at most ``seconds`` (then TimeoutError). A TCPStore client
    whose store's host is stopped (SIGSTOP), not dead, waits for its first reply forever, whatever its timeout:
    the host's kernel still accepts the connection. The thread is left behind; a daemon does not hold the exit."""
    result: list[_T] = []
    errors: list[BaseException] = []

    def run() -> None:
        try:
            result.append(fn())
        except BaseException as err:  # noqa: BLE001 - handed to the caller
            errors.append(err)

    thread = threading.Thread(target=run, name="ddp_plugin-health", daemon=True)
    thread.start()
    deadline = time.monotonic() + seconds
    while thread.is_alive() and (left := deadline - time.monotonic()) > 0:
        try:
            thread.join(min(left, 0.1))
        except Exception:  # noqa: BLE001 - e.g. Lightning's SIGTERM handler failing its own collective
            pass
    if errors:
        raise errors[0]
    if not result:
        raise TimeoutError(f"the rendezvous store did not answer within {seconds:.0f} s")
    return result[0]


def read(store: dist.Store, kind: str, rank: int) -> str | None:
    key = f"{PREFIX}/{kind}/{rank}"
    return store.get(key).decode() if store.check([key]) else None


class News:
    """What the other ranks left on the store: their errors, who is diagnosing, who was found gone."""

    def __init__(self, store: dist.Store, world: int) -> None:
        self.count = store.add(f"{PREFIX}/news", 0)
        self.failed = {r: msg for r in range(world) if (msg := read(store, "failed", r)) is not None}
        self.victims = {r for r in range(world) if read(store, "victim", r) is not None}
        gone_key = f"{PREFIX}/gone"
        self.gone = [int(r) for r in store.get(gone_key).decode().split(",")] if store.check([gone_key]) else []
        self.processes = {r: read(store, "process", r) for r in range(world)}

    def ended(self) -> list[int]:
        """Ranks of this machine whose process has ended, but for those that reported an error or gave up after
        a peer failed (their exit is a consequence)."""
        return [r for r, entry in self.processes.items()
                if r not in self.victims and r not in self.failed and process_gone(entry)]


def name_ranks(ranks: list[int]) -> str:
    return f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}"


def sleep(seconds: float) -> None:
    try:
        time.sleep(seconds)
    except Exception:  # noqa: BLE001 - e.g. Lightning's SIGTERM handler failing its own collective
        pass
