"""The heartbeat: a daemon thread per rank that bumps the rank's counter on the rendezvous store, leaves its step and
process there, keeps what it reads of its peers for the diagnosis (:data:`~ddp_plugin.health.diagnosis.DIAGNOSIS`)
and, with a watch, looks for a reason to give up every beat (:class:`~ddp_plugin.health.watch.PeerWatch`)."""

from __future__ import annotations

import threading
import time
from typing import TYPE_CHECKING

import torch.distributed as dist

from ddp_plugin.health import store as on_store
from ddp_plugin.health.diagnosis import DIAGNOSIS
from ddp_plugin.health.processes import process_gone, process_id
from ddp_plugin.health.store import BEAT_INTERVAL_S, POLL_S, PREFIX, STORE_TIMEOUT_S

if TYPE_CHECKING:
    from ddp_plugin.health.watch import PeerWatch


class Heartbeat(threading.Thread):
    """A daemon thread that bumps this rank's counter on the store every ``BEAT_INTERVAL_S`` seconds.

    It ends on :meth:`stop`, or one beat after the default process group it was started under is destroyed: a
    strategy set up and never torn down (as some of Lightning's tests do) leaves nothing running beyond its
    process group. ``stop`` is also what tools that stop leftover daemon threads call."""

    def __init__(self, watch: PeerWatch | None = None) -> None:
        super().__init__(name="ddp_plugin-heartbeat", daemon=True)
        self.step = 0
        self.watch = watch
        """On NCCL: what this heartbeat also does every beat (see :class:`PeerWatch`)."""
        self._rank = dist.get_rank()
        self._world_size = dist.get_world_size()
        # An id, not a reference: the heartbeat must not keep a destroyed group alive.
        self._world = id(dist.group.WORLD)
        self._stopping = threading.Event()
        self.start()

    def _group_alive(self) -> bool:
        return dist.is_initialized() and id(dist.group.WORLD) == self._world

    def run(self) -> None:
        # The client lives and dies on this thread: sharing the default group's client with the training thread
        # made processes abort at exit now and then (~1 in 8 runs on the simulated cluster).
        try:
            store = on_store.connect()
            if (me := process_id()) is not None:
                store.set(f"{PREFIX}/process/{self._rank}", me)
        except Exception:  # noqa: BLE001 - no store, no heartbeat; diagnose() will say the store is gone
            return
        world = dist.get_world_size() if me is not None else 0
        DIAGNOSIS.begin()
        next_beat = time.monotonic() + BEAT_INTERVAL_S
        lost_since: float | None = None
        while self._group_alive():
            try:
                # The peers' process ids, kept here: when the store's host dies they cannot be read any more. Looked
                # for every POLL_S until all are known, since a rank may die in its first second.
                for r in range(world):
                    if r not in DIAGNOSIS.peer_processes and (entry := on_store.read(store, "process", r)) is not None:
                        DIAGNOSIS.peer_processes[r] = entry
                # Which peers of this machine have ended, and in what order (one that gave up after another is
                # not the cause): looked at every POLL_S, reading /proc only.
                for r, entry in DIAGNOSIS.peer_processes.items():
                    if r != self._rank and r not in DIAGNOSIS.ended_at and process_gone(entry):
                        DIAGNOSIS.ended_at[r] = time.monotonic()
                wait = min(next_beat - time.monotonic(), POLL_S)
                if self._stopping.wait(max(wait, 0.0)) or not self._group_alive():
                    break
                if time.monotonic() >= next_beat:
                    store.add(f"{PREFIX}/beat/{self._rank}", 1)
                    store.set(f"{PREFIX}/step/{self._rank}", str(self.step))
                    # Another rank's finding, kept here too: a rank whose collective times out after the store's
                    # host has exited (it raised after finding the gone rank) can still name the cause.
                    if not DIAGNOSIS.found_gone and store.check([f"{PREFIX}/gone"]):
                        DIAGNOSIS.found_gone.extend(int(r) for r in store.get(f"{PREFIX}/gone").decode().split(","))
                    if self.watch is not None:
                        self.watch.poll(store, self._rank, self._world_size, self.step, time.monotonic())
                    next_beat = time.monotonic() + BEAT_INTERVAL_S
            except Exception:  # noqa: BLE001 - the store's host is gone; diagnose() will say so
                if self.watch is None or self.watch.news_only or not self._group_alive() or self._stopping.is_set():
                    break
                # On NCCL nothing else would release this rank's waits: once the store has not answered for the
                # watch's stall time (not one slow reply), its host (rank 0 under Lightning's launcher) is gone.
                lost_since = lost_since if lost_since is not None else time.monotonic()
                if time.monotonic() - lost_since >= self.watch.stall_s:
                    self.watch.fire("the rendezvous store stopped answering (its host, rank 0 under Lightning's"
                                    " launcher, is gone or hung)")
                    break
                self._stopping.wait(BEAT_INTERVAL_S)
                try:
                    store = on_store.within(STORE_TIMEOUT_S + 1, on_store.connect)
                except Exception:  # noqa: BLE001 - still gone
                    pass
                continue
            lost_since = None
        del store

    def stop(self) -> None:
        self._stopping.set()
        # Joined, so the thread is never inside a store call while the process exits; unless the store is known to
        # be unreachable, when it may be stuck in one for good (its host stopped).
        if self is not threading.current_thread():
            self.join(timeout=0 if DIAGNOSIS.store_unreachable else 5)
