"""Telling the user which rank broke when a collective fails, instead of a socket error from deep in gloo.

When a rank dies (killed, crashed, out of memory) its peers' next collective fails at once on gloo ("Connection
closed by peer") or, for ranks not talking to it directly, after the process group's timeout; when a rank hangs
(stopped, deadlocked), every peer's collective fails after the timeout. Neither error says which rank. So every
rank keeps a heartbeat on the rendezvous store (a counter a background thread bumps twice a second, with the
rank's step), and a rank that raises an exception of its own leaves it there. On a failure, :func:`diagnose`
watches the counters: a rank whose counter has not moved for two beat intervals is gone. A rank on the same
machine (the same boot and process namespace) whose process has ended is known gone at once: every rank leaves
its process id and start time on the store too, and its peers on that machine look it up. The watch ends sooner
when every rank is accounted for (seen beating, diagnosing a failure itself, or having reported its own error), or
as soon as another rank has reported an error or already found the gone ranks (then its finding is taken: a
failure spreads from rank to rank, and each would otherwise watch again). If every rank is alive, the ranks
furthest behind in steps are the stuck ones. Counters, not clocks, so hosts need not agree on the time.

On NCCL a failed peer raises nothing by itself: a collective returns once queued, ``wait()`` makes a stream
wait, and the host blocks later, in whatever reads a result, until NCCL's watchdog acts at the group's timeout.
So there the heartbeat also watches (:class:`PeerWatch`): once this rank's step has not moved for a while it
reads its peers' counters, and when a peer has stopped beating (or the store says a peer failed or was found
gone, or a peer process on this machine ended) it leaves the finding on the store and aborts this rank's NCCL
communicators (``ProcessGroupNCCL``'s abort, as torch's own error handling does): the blocked collective then
fails, and :func:`diagnose` names the rank as on gloo.

On gloo a rank's own collectives fail once a peer's process is gone, but a rank can also wait on a peer that is
alive and waiting in turn: the tensor-parallel peer whose broadcast of a bucket it waits for, when that peer's own
reduction of the bucket failed. That wait ends only when the peer's process ends and closes its connections,
seconds later (its teardown, its interpreter's exit). So on gloo the heartbeat watches the store's news only
(another rank failed, found a rank gone, or is diagnosing a failed collective): it then releases this rank's waits
on its communication threads (:func:`wait`), which raise :class:`PeersFailed`, diagnosed as any failed
collective.

(Over 600 lines for a reason: the heartbeat, the peer watch, the reports and the diagnosis are the two sides of one
protocol on the store, whose keys, timings and settling rules must agree; split, each side would read the other's
constants and private reads across modules.)
"""

from __future__ import annotations

import concurrent.futures
import logging
import os
import signal
import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import timedelta
from functools import cache
from typing import Any, TypeVar

import torch
import torch.distributed as dist

_T = TypeVar("_T")
log = logging.getLogger(__name__)

_PREFIX = "ddp_plugin/health"
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


def _store(probe: bool = False) -> dist.Store:
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
            store = _store()
            if (me := process_id()) is not None:
                store.set(f"{_PREFIX}/process/{self._rank}", me)
        except Exception:  # noqa: BLE001 - no store, no heartbeat; diagnose() will say the store is gone
            return
        world = dist.get_world_size() if me is not None else 0
        _peer_processes.clear()
        _found_gone.clear()
        _found_failed.clear()
        _ended_at.clear()
        next_beat = time.monotonic() + BEAT_INTERVAL_S
        lost_since: float | None = None
        while self._group_alive():
            try:
                # The peers' process ids, kept here: when the store's host dies they cannot be read any more. Looked
                # for every POLL_S until all are known, since a rank may die in its first second.
                for r in range(world):
                    if r not in _peer_processes and (entry := _read(store, "process", r)) is not None:
                        _peer_processes[r] = entry
                # Which peers of this machine have ended, and in what order (one that gave up after another is
                # not the cause): looked at every POLL_S, reading /proc only.
                for r, entry in _peer_processes.items():
                    if r != self._rank and r not in _ended_at and process_gone(entry):
                        _ended_at[r] = time.monotonic()
                wait = min(next_beat - time.monotonic(), POLL_S)
                if self._stopping.wait(max(wait, 0.0)) or not self._group_alive():
                    break
                if time.monotonic() >= next_beat:
                    store.add(f"{_PREFIX}/beat/{self._rank}", 1)
                    store.set(f"{_PREFIX}/step/{self._rank}", str(self.step))
                    # Another rank's finding, kept here too: a rank whose collective times out after the store's
                    # host has exited (it raised after finding the gone rank) can still name the cause.
                    if not _found_gone and store.check([f"{_PREFIX}/gone"]):
                        _found_gone.extend(int(r) for r in store.get(f"{_PREFIX}/gone").decode().split(","))
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
                    store = _within(STORE_TIMEOUT_S + 1, _store)
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
            self.join(timeout=0 if _store_unreachable else 5)


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
        self._before: _News | None = None
        self._beats: dict[int, tuple[int, float]] = {}  # peer -> (counter, when it last moved)

    def poll(self, store: dist.Store, me: int, world: int, step: int, now: float) -> None:
        if self.fired is not None:
            return
        if step != self._step:
            self._step, self._progress_at = step, now
            self._beats.clear()
        reason = None
        news = store.add(f"{_PREFIX}/news", 0)
        if self._news is None:
            # What the store held when this fit began (an earlier fit's in these processes) is not news.
            self._news, self._before = news, _News(store, world)
        elif news != self._news:
            self._news = news
            found, before = _News(store, world), self._before
            failed = {r: msg for r, msg in found.failed.items() if before.failed.get(r) != msg}
            _found_failed.update(failed)  # (kept for a diagnosis after the store's host is gone)
            if found.gone and found.gone != before.gone:
                reason = f"{_ranks(found.gone)} stopped responding (killed, crashed or hung), as another rank found"
            elif failed:
                reason = "; ".join(f"rank {r} failed with {msg}" for r, msg in sorted(failed.items()))
            elif found.victims - before.victims - {me}:
                reason = f"{_ranks(sorted(found.victims - before.victims - {me}))} met a failed collective"
        if self.news_only:
            if reason is not None:
                self.fire(reason)
            return
        ended = [r for r in _ended_at if r != me]
        if reason is None and ended:
            reason = f"{_ranks(_first_ended(sorted(ended)))} stopped responding (killed, crashed or hung): its process" \
                     " on this machine has ended"
        if reason is None and now - self._progress_at >= self.idle_s:
            for r in range(world):
                if r != me:
                    count = store.add(f"{_PREFIX}/beat/{r}", 0)
                    if self._beats.get(r, (None,))[0] != count:
                        self._beats[r] = (count, now)
            stalled = [r for r, (_, since) in sorted(self._beats.items()) if now - since >= self.stall_s]
            if stalled:
                if not store.check([f"{_PREFIX}/gone"]):
                    _tell(store, f"{_PREFIX}/gone", ",".join(map(str, stalled)))
                reason = f"{_ranks(stalled)} stopped responding (killed, crashed or hung): no heartbeat for" \
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


def _ranks(ranks: list[int]) -> str:
    return f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}"


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
    _released.clear()
    if not dist.is_initialized():
        return None
    if dist.get_backend() == "nccl":
        return PeerWatch(abort_nccl, timeout_s)
    return PeerWatch(_release_waits, timeout_s, news_only=True)


class PeersFailed(dist.DistError):
    """Raised by :func:`wait` once the store says another rank failed: the awaited collective, on a thread of this
    rank's, will not complete in time (it waits on a rank whose run is over)."""


_released = threading.Event()
_released_reason = ""


def _release_waits(reason: str) -> None:
    global _released_reason
    _released_reason = reason
    _released.set()


def wait(future: concurrent.futures.Future | torch.futures.Future) -> Any:
    """The result of ``future`` (of work on one of this rank's communication threads, or of a collective), or
    :class:`PeersFailed` as soon as the heartbeat's watch has found another rank's run over (on gloo: see the
    module's docstring); the thread it waited for is left to the end of the process."""
    if not future.done():  # (most buckets are done by the end of backward: no event, no callback)
        done = threading.Event()
        future.add_done_callback(lambda _: done.set())
        while not done.wait(POLL_S):
            if _released.is_set():
                raise PeersFailed(f"waited on a collective that will not complete: {_released_reason}")
    return future.result() if isinstance(future, concurrent.futures.Future) else future.wait()


def _start_time(pid: int) -> str | None:
    """Process ``pid``'s start time (clock ticks since boot, from ``/proc/<pid>/stat``), or None if it has ended
    (no such process, or a zombie)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return None if fields[0] in ("Z", "X") else fields[19]


@cache
def _machine() -> str | None:
    """This machine's boot and process namespace: processes with the same one see each other's process ids."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f"{f.read().strip()}/{os.stat('/proc/self/ns/pid').st_ino}"
    except OSError:
        return None  # not Linux: peers are only ever judged by their heartbeats


def process_id(pid: int | None = None) -> str | None:
    """``"<machine> <pid> <start time>"`` for process ``pid`` (this one by default), which :func:`process_gone`
    reads back on any process of the same machine; None where ``/proc`` is missing."""
    pid = os.getpid() if pid is None else pid
    start = _start_time(pid)
    return None if _machine() is None or start is None else f"{_machine()} {pid} {start}"


def process_gone(entry: str | None) -> bool:
    """Whether the process :func:`process_id` described as ``entry`` has ended: only known for a process of this
    machine (the same boot and process namespace; its id is not reused while the start time differs), else
    False."""
    if entry is None or _machine() is None:
        return False
    machine, pid, start = entry.split()
    return machine == _machine() and _start_time(int(pid)) != start


def _ended_peers(me: int, settle_s: float = 1.0) -> list[int]:
    """The peers of this machine whose processes have ended (as read by this rank's heartbeat). A killed process
    closes its sockets before it becomes a zombie, so a peer's connection may fail while it still looks alive: when
    rank 0 (the store's host under Lightning's launcher) is on this machine, this waits up to ``settle_s`` for it."""
    deadline = time.monotonic() + settle_s
    while True:
        ended = [r for r, entry in sorted(_peer_processes.items()) if r != me and process_gone(entry)]
        rank_0 = _peer_processes.get(0)
        if (0 in ended or me == 0 or rank_0 is None or rank_0.split()[0] != _machine()
                or time.monotonic() >= deadline):
            return ended
        time.sleep(0.02)


_diagnosed = False
_store_unreachable = False  # found by diagnose(): a heartbeat may be stuck in a store call, not worth waiting for
_peer_processes: dict[int, str] = {}  # rank -> process_id(), read by this rank's heartbeat
_found_gone: list[int] = []  # the gone ranks another rank's diagnosis found, as this rank's heartbeat read them
_found_failed: dict[int, str] = {}  # the errors other ranks reported, as this rank's heartbeat's watch read them
_ended_at: dict[int, float] = {}  # rank -> when this rank's heartbeat first saw its process (this machine) ended


def _first_ended(ranks: list[int]) -> list[int]:
    """Of ``ranks``, whose processes on this machine have ended, the ones that ended first: the cause, the others
    having given up after it. As this rank's heartbeat saw them end (it looks every ``POLL_S`` until the store is
    lost, so one it did not see ended later); where it saw none, rank 0 if it is among them (under Lightning's
    launcher it hosts the store, which the others then lost)."""
    seen = [_ended_at[r] for r in ranks if r in _ended_at]
    if seen:
        return [r for r in ranks if r in _ended_at and _ended_at[r] < min(seen) + POLL_S]
    return [0] if 0 in ranks else ranks

# What gloo and NCCL say when a peer is gone or a collective timed out; such an error is a consequence.
_COMM_ERROR_MARKS = ("gloo", "NCCL", "pair closure", "Connection closed", "Connection reset", "Timed out waiting",
                     "synchronization failed")


def is_communication_error(exc: BaseException) -> bool:
    """Whether ``exc`` (or an exception it was raised while handling) is a failed collective rather than a cause:
    torchrun SIGTERMs the survivors of a dead rank, and Lightning's SIGTERM handler then fails its own broadcast
    with a bare "Application timeout caused pair closure"."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, (dist.DistBackendError, KeyboardInterrupt)) or any(m in str(exc) for m in _COMM_ERROR_MARKS):
            return True
        exc = exc.__cause__ or exc.__context__
    return False


def shield_sigterm_handler() -> None:
    """Keep the SIGTERM handler in place (Lightning's notifier broadcasts to the other ranks) from replacing a
    diagnosis with its own failed collective. torchrun SIGTERMs the survivors of a dead rank; arriving while a
    survivor diagnoses the failure (or just before), the handler's broadcast fails too, and its raw gloo error
    used to be what the survivor raised. The shielded handler lets a communication error of the handler pass:
    the collective this rank is in (or its next) fails as well and names the rank at fault. Call it on the main
    thread once the Trainer has installed its handlers (the strategy does, at the first training step)."""
    if threading.current_thread() is not threading.main_thread():
        return
    current = signal.getsignal(signal.SIGTERM)
    if not callable(current) or getattr(current, "_ddp_plugin_shield", False):
        return

    def shielded(signum: int, frame: object) -> None:
        try:
            current(signum, frame)
        except Exception as err:
            if not is_communication_error(err):
                raise

    shielded._ddp_plugin_shield = True  # type: ignore[attr-defined]
    signal.signal(signal.SIGTERM, shielded)


def report_exception(exc: BaseException) -> None:
    """Leave this rank's error on the store for the other ranks' diagnosis; never raises. A rank that already
    diagnosed a peer's failure reports nothing: what it raises next (say, from Lightning's SIGTERM handler's own
    broadcast) is a consequence, not a cause."""
    if _diagnosed or is_communication_error(exc):
        return
    try:
        if dist.is_initialized():
            key, value = f"{_PREFIX}/failed/{dist.get_rank()}", f"{type(exc).__name__}: {exc}"[:500]
            _within(STORE_TIMEOUT_S + 1, lambda: _tell(_store(), key, value))
    except Exception:  # noqa: BLE001 - the store may be gone too; the original error is what matters
        pass


def _tell(store: dist.Store, key: str, value: str) -> None:
    """Set ``key`` and bump the news counter, which a watching :func:`diagnose` polls instead of every key."""
    store.set(key, value)
    store.add(f"{_PREFIX}/news", 1)


def _within(seconds: float, fn: Callable[[], _T]) -> _T:
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


def _read(store: dist.Store, kind: str, rank: int) -> str | None:
    key = f"{_PREFIX}/{kind}/{rank}"
    return store.get(key).decode() if store.check([key]) else None


_PHASE = "_ddp_plugin_phase"  # set on an error `diagnosed` raised: the phase it was diagnosed or noted in


def is_collective_failure(exc: BaseException) -> bool:
    """Whether ``exc`` says a collective failed or timed out (a peer or a link is the cause), rather than this
    rank's own code raising (a bug, a bad value)."""
    return isinstance(exc, (dist.DistError, TimeoutError)) or is_communication_error(exc)


@contextmanager
def diagnosed(what: str | Callable[[], str] = "gradient synchronization",
              error: type[Exception] = RuntimeError) -> Iterator[None]:
    """Re-raise a failed collective inside ``what`` (the phase, or a callable that tells it when the failure
    comes) as an ``error`` (a checkpoint's: ``CheckpointCollectiveError``) that names the ranks that failed, died
    or are stuck (:func:`diagnose`), the original chained. Any other exception is this rank's own, and is re-raised as it is, with its traceback and a
    note naming the rank and ``what``; it is left on the store first, so the ranks waiting for this one in a
    collective name it and quote it. Either passes a phase around this one as it is."""
    try:
        yield
    except Exception as err:
        if getattr(err, _PHASE, None) is not None:
            raise  # diagnosed, or noted, by a phase inside
        if callable(what):
            what = what()
        if is_collective_failure(err):
            diagnosis = error(diagnose(err, what=what))
            setattr(diagnosis, _PHASE, what)
            raise diagnosis from err
        report_exception(err)
        setattr(err, _PHASE, what)
        if hasattr(err, "add_note"):  # Python 3.11+
            rank = dist.get_rank() if dist.is_initialized() else 0
            err.add_note(f"ddp_plugin: raised on rank {rank} in {what} (by code running on this rank; no collective"
                         " failed)")
        raise


class _News:
    """What the other ranks left on the store: their errors, who is diagnosing, who was found gone."""

    def __init__(self, store: dist.Store, world: int) -> None:
        self.count = store.add(f"{_PREFIX}/news", 0)
        self.failed = {r: msg for r in range(world) if (msg := _read(store, "failed", r)) is not None}
        self.victims = {r for r in range(world) if _read(store, "victim", r) is not None}
        gone_key = f"{_PREFIX}/gone"
        self.gone = [int(r) for r in store.get(gone_key).decode().split(",")] if store.check([gone_key]) else []
        self.processes = {r: _read(store, "process", r) for r in range(world)}

    def ended(self) -> list[int]:
        """Ranks of this machine whose process has ended, but for those that reported an error or gave up after
        a peer failed (their exit is a consequence)."""
        return [r for r, entry in self.processes.items()
                if r not in self.victims and r not in self.failed and process_gone(entry)]


def linger_as_store_host(timeout_s: float = LINGER_S) -> None:
    """After a failed fit, on global rank 0 (the rendezvous store's host under Lightning's launcher): keep the
    store up until every other rank has read the cause from it (its diagnosis is done, it reported its own error,
    or its process on this machine has ended), at most ``timeout_s``. A rank that diagnosed after the host had
    exited would find only the processes that ended, rank 0 first, and could not quote a raising rank's error."""
    if (not dist.is_initialized() or dist.get_rank() != 0
            or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"):  # (torchrun's agent hosts it)
        return
    world = dist.get_world_size()

    def accounted(store: dist.Store, rank: int) -> bool:
        return (store.check([f"{_PREFIX}/read/{rank}"]) or store.check([f"{_PREFIX}/failed/{rank}"])
                or process_gone(_read(store, "process", rank)))

    deadline = time.monotonic() + timeout_s
    try:
        store = _within(STORE_TIMEOUT_S + 1, _store)
        while time.monotonic() < deadline:
            waiting = _within(STORE_TIMEOUT_S + 1, lambda: [r for r in range(1, world) if not accounted(store, r)])
            if not waiting:
                return
            _sleep(POLL_S)
        log.info("ddp_plugin: rank 0 exits with %s not done reading the failure from the store",
                 _ranks(waiting))
    except Exception:  # noqa: BLE001 - exiting anyway
        pass


def _sleep(seconds: float) -> None:
    try:
        time.sleep(seconds)
    except Exception:  # noqa: BLE001 - e.g. Lightning's SIGTERM handler failing its own collective
        pass


def diagnose(error: BaseException, what: str = "gradient synchronization") -> str:
    """A sentence naming the ranks that failed, died or are stuck, for the error this rank raises when ``what``
    (a collective) failed. Takes at most ``MISSED_BEATS_S`` (and the store's round trips); less when every rank is
    accounted for, or another rank already knows the cause."""
    global _diagnosed, _store_unreachable
    _diagnosed = True
    me, world = dist.get_rank(), dist.get_world_size()
    # Known without the store, which may be gone with its host.
    ended_here = [r for r, entry in sorted(_peer_processes.items()) if r != me and process_gone(entry)]

    def first_look() -> tuple[dist.Store, list[int], _News]:
        store = _store(probe=True)
        # Said before watching: a rank that sees this one's heartbeat stop (it exits after its own watch) reads
        # this key after that, and does not name a rank that only gave up after a peer failed.
        _tell(store, f"{_PREFIX}/victim/{me}", "1")
        return store, [store.add(f"{_PREFIX}/beat/{r}", 0) for r in range(world)], _News(store, world)

    def beating(store: dist.Store, ranks: list[int], before: list[int]) -> set[int]:
        return {r for r in ranks if store.add(f"{_PREFIX}/beat/{r}", 0) != before[r]}

    try:
        # Store calls are bounded here (_within): a client of a stopped store host would wait forever.
        store, before, news = _within(STORE_TIMEOUT_S + 1, first_look)
        alive: set[int] = set()
        deadline = time.monotonic() + MISSED_BEATS_S
        while not news.failed and not news.gone and not news.ended() and time.monotonic() < deadline:
            unknown = [r for r in range(world) if r not in alive and r not in news.victims]
            if not unknown:
                break  # every rank is alive: a link failed, a collective timed out, or a rank is stuck
            _sleep(POLL_S)
            alive |= _within(STORE_TIMEOUT_S + 1, lambda: beating(store, unknown, before))
            if _within(STORE_TIMEOUT_S + 1, lambda: store.add(f"{_PREFIX}/news", 0)) != news.count:
                news = _within(STORE_TIMEOUT_S + 1, lambda: _News(store, world))
        steps = _within(STORE_TIMEOUT_S + 1, lambda: {
            r: int(s) for r in range(world) if (s := _read(store, "step", r)) is not None})
        # Of the peers of this machine whose processes ended, the first to end: a survivor that a launcher
        # stopped after the cause (torchrun SIGTERMs every rank once one has died) is not a cause.
        ended = news.ended()
        gone = news.gone or (_first_ended(ended) if ended else []) or [
            r for r in range(world) if r not in alive and r not in news.victims and not news.failed]
        if gone and not news.gone:
            _within(STORE_TIMEOUT_S + 1, lambda: _tell(store, f"{_PREFIX}/gone", ",".join(map(str, gone))))
        _within(STORE_TIMEOUT_S + 1, lambda: store.set(f"{_PREFIX}/read/{me}", "1"))  # (the store's host may go)
    except Exception:  # noqa: BLE001
        _store_unreachable = True
        if _found_failed:
            # A rank's own error, read from the store by this rank's heartbeat before the store's host exited.
            reported = "; ".join(f"rank {r} failed with {msg}" for r, msg in sorted(_found_failed.items()))
            return (f"rank {me}: {what} failed because {reported}, as read before the rendezvous store became"
                    f" unreachable. Original error: {error}")
        if _found_gone:
            found = sorted(set(_found_gone))
            return (
                f"rank {me}: {what} failed because rank{'s' if len(found) > 1 else ''} {', '.join(map(str, found))}"
                " stopped responding (killed, crashed or hung), as another rank found before the rendezvous store"
                f" became unreachable. Original error: {error}"
            )
        ended_here = sorted(set(ended_here) | set(_ended_peers(me)))
        if ended_here:
            ended = _first_ended(ended_here)
            return (
                f"rank {me}: {what} failed because rank{'s' if len(ended) > 1 else ''} {', '.join(map(str, ended))}"
                " stopped responding (killed, crashed or hung); its process on this machine has ended, and the"
                f" rendezvous store is unreachable. Original error: {error}"
            )
        return (
            f"rank {me}: {what} failed and the rendezvous store is unreachable, so the process"
            f" hosting it (rank 0 under Lightning's launcher) is gone or hung. Original error: {error}"
        )
    parts = [f"rank {r} failed with {msg}" for r, msg in sorted(news.failed.items())]
    if gone:
        # A hung process (SIGSTOP, a deadlock outside Python, an unreachable host) looks the same as a dead one.
        parts.append(f"rank{'s' if len(gone) > 1 else ''} {', '.join(map(str, gone))} stopped responding (killed,"
                     " crashed or hung)")
    if not parts and steps:
        slowest = min(steps.values())
        behind = [r for r, s in sorted(steps.items()) if s == slowest]
        if slowest < max(steps.values()):
            parts.append(f"every rank is alive, and rank(s) {', '.join(map(str, behind))} are stuck at step {slowest}")
    if not parts:
        parts.append("every rank is alive, so a link between them failed or a collective timed out")
    return f"rank {me}: {what} failed because {'; '.join(parts)}. Original error: {error}"
