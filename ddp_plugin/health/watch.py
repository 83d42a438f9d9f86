"""Watching the peers while nothing has failed yet. On NCCL a failed peer makes nothing raise (a collective blocks the
host later, until NCCL's watchdog acts): :class:`PeerWatch` looks for a reason every beat and aborts this rank's
communicators. On gloo it watches the store's news only and releases this rank's waits on its communication
threads (:func:`wait`), which raise :class:`PeersFailed`."""

from __future__ import annotations

import concurrent.futures
import logging
import threading
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from ddp_plugin.health import store as on_store
from ddp_plugin.health.diagnosis import DIAGNOSIS
from ddp_plugin.health.store import POLL_S, PREFIX, WATCH_IDLE_S, WATCH_STALL_S, name_ranks

log = logging.getLogger("ddp_plugin.health")


class PeerWatch:
    """What a heartbeat does on NCCL, where a failed peer makes nothing raise (see the module's docstring): every
    beat, :meth:`poll` looks for a reason to give up, and :meth:`fire` calls ``abort`` (NCCL's abort of every
    communicator of this process) once, with the reason, after logging it. A reason is:

    - another rank's news on the store: a rank it found gone, an error a rank reported, a rank diagnosing a failed
      collective (its run is over; this rank's collectives with it will not complete);
    - a peer process on this machine that has ended;
    - this rank's step has not moved for ``idle_s``, and a peer's heartbeat counter has stood still for
      ``stall_s`` since (the peer is named gone on the store, for every rank's diagnosis);
    - this rank's step has not moved for ``timeout_s`` (the process group's timeout) while every peer beats: a
      collective that never completes (a deadlock, a mismatch); the diagnosis then names the ranks furthest
      behind.

    ``news_only`` (gloo, where collectives fail by themselves): the first reason only, the store's news.
    """

    def __init__(self, abort: Callable[[str], None], timeout_s: float | None, idle_s: float = WATCH_IDLE_S,
                 stall_s: float = WATCH_STALL_S, news_only: bool = False) -> None:
        self.abort = abort
        self.timeout_s, self.idle_s, self.stall_s = timeout_s, idle_s, stall_s
        self.news_only = news_only
        self.fired: str | None = None
        self._step: int | None = None
        self._progress_at = 0.0
        self._news: int | None = None
        self._before: on_store.News | None = None
        self._beats: dict[int, tuple[int, float]] = {}  # peer -> (counter, when it last moved)

    def poll(self, store: dist.Store, me: int, world: int, step: int, now: float) -> None:
        if self.fired is not None:
            return
        if step != self._step:
            self._step, self._progress_at = step, now
            self._beats.clear()
        reason = None
        news = store.add(f"{PREFIX}/news", 0)
        if self._news is None:
            # What the store held when this fit began (an earlier fit's in these processes) is not news.
            self._news, self._before = news, on_store.News(store, world)
        elif news != self._news:
            self._news = news
            found, before = on_store.News(store, world), self._before
            failed = {r: msg for r, msg in found.failed.items() if before.failed.get(r) != msg}
            DIAGNOSIS.found_failed.update(failed)  # (kept for a diagnosis after the store's host is gone)
            if found.gone and found.gone != before.gone:
                reason = f"{name_ranks(found.gone)} stopped responding (killed, crashed or hung), as another rank found"
            elif failed:
                reason = "; ".join(f"rank {r} failed with {msg}" for r, msg in sorted(failed.items()))
            elif found.victims - before.victims - {me}:
                reason = f"{name_ranks(sorted(found.victims - before.victims - {me}))} met a failed collective"
        if self.news_only:
            if reason is not None:
                self.fire(reason)
            return
        ended = [r for r in DIAGNOSIS.ended_at if r != me]
        if reason is None and ended:
            reason = f"{name_ranks(DIAGNOSIS.first_ended(sorted(ended)))} stopped responding (killed, crashed or hung): its process" \
                     " on this machine has ended"
        if reason is None and now - self._progress_at >= self.idle_s:
            for r in range(world):
                if r != me:
                    count = store.add(f"{PREFIX}/beat/{r}", 0)
                    if self._beats.get(r, (None,))[0] != count:
                        self._beats[r] = (count, now)
            stalled = [r for r, (_, since) in sorted(self._beats.items()) if now - since >= self.stall_s]
            if stalled:
                if not store.check([f"{PREFIX}/gone"]):
                    on_store.tell(store, f"{PREFIX}/gone", ",".join(map(str, stalled)))
                reason = f"{name_ranks(stalled)} stopped responding (killed, crashed or hung): no heartbeat for" \
                         f" {self.stall_s:.0f} s"
            elif self.timeout_s is not None and now - self._progress_at >= self.timeout_s:
                reason = f"every rank beats, but this rank's step has not moved for {self.timeout_s:.0f} s (the" \
                         " process group's timeout): a collective that never completes"
        if reason is not None:
            self.fire(reason)

    def fire(self, reason: str) -> None:
        if self.fired is not None:
            return
        self.fired = reason
        rank = dist.get_rank() if dist.is_initialized() else 0
        if self.news_only:
            log.info("ddp_plugin: rank %d: %s; releasing this rank's waits on its communication threads", rank,
                     reason)
        else:
            log.error("ddp_plugin: rank %d: %s; aborting this rank's NCCL communicators, so that its collectives"
                      " fail instead of waiting", rank, reason)
        self.abort(reason)


def abort_nccl(reason: str) -> None:
    """Abort every NCCL communicator of this process (torch's ``_abort_process_group``): their collectives in
    flight and to come fail (``DistBackendError``) instead of waiting."""
    try:
        dist.distributed_c10d._abort_process_group()
    except Exception as err:  # noqa: BLE001 - a torch without it, or groups already destroyed
        log.error("ddp_plugin: could not abort the NCCL communicators (%s): %s", reason, err)


def peer_watch(timeout_s: float | None) -> PeerWatch | None:
    """The heartbeat's watch for this process's default group (see :class:`PeerWatch`): on NCCL the whole watch,
    on gloo the store's news only, which releases :func:`wait`. Starts a fit: :func:`wait` waits again."""
    DIAGNOSIS.released.clear()
    if not dist.is_initialized():
        return None
    if dist.get_backend() == "nccl":
        return PeerWatch(abort_nccl, timeout_s)
    return PeerWatch(DIAGNOSIS.release, timeout_s, news_only=True)


class PeersFailed(dist.DistError):
    """Raised by :func:`wait` once the store says another rank failed: the awaited collective, on a thread of this
    rank's, will not complete in time (it waits on a rank whose run is over)."""


def wait(future: concurrent.futures.Future | torch.futures.Future) -> Any:
    """The result of ``future`` (of work on one of this rank's communication threads, or of a collective), or
    :class:`PeersFailed` as soon as the heartbeat's watch has found another rank's run over (on gloo: see the
    module's docstring); the thread it waited for is left to the end of the process."""
    if not future.done():  # (most buckets are done by the end of backward: no event, no callback)
        done = threading.Event()
        future.add_done_callback(lambda _: done.set())
        while not done.wait(POLL_S):
            if DIAGNOSIS.released.is_set():
                raise PeersFailed(f"waited on a collective that will not complete: {DIAGNOSIS.released_reason}")
    return future.result() if isinstance(future, concurrent.futures.Future) else future.wait()
