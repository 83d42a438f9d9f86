"""The diagnosis: a sentence naming the ranks that failed, died or are stuck, for the error a rank raises when a
collective fails (:meth:`Diagnosis.diagnose`), a rank's own error left on the store for the others
(:meth:`Diagnosis.report`), and :func:`diagnosed`, the phase that turns one into the other. The state it reads,
which this rank's heartbeat and peer watch keep, is one object per process: :data:`DIAGNOSIS`."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch.distributed as dist

from ddp_plugin.health import store as on_store
from ddp_plugin.health.processes import machine, process_gone
from ddp_plugin.health.store import MISSED_BEATS_S, POLL_S, PREFIX, STORE_TIMEOUT_S

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


class Diagnosis:
    """What this process knows of its peers' health, and its diagnosis of a failed collective: the state its
    heartbeat (on its thread), its peer watch and its diagnosis share. One per process (:data:`DIAGNOSIS`): a
    heartbeat starts a fit's watch over it again (:meth:`begin`)."""

    def __init__(self) -> None:
        self.diagnosed = False
        """Whether this rank has diagnosed a failed collective (what it raises after that is a consequence)."""
        self.store_unreachable = False
        """Found by :meth:`diagnose`: a heartbeat may be stuck in a store call, not worth waiting for."""
        self.peer_processes: dict[int, str] = {}
        """rank -> :func:`~ddp_plugin.health.processes.process_id`, read by this rank's heartbeat."""
        self.found_gone: list[int] = []
        """The gone ranks another rank's diagnosis found, as this rank's heartbeat read them."""
        self.found_failed: dict[int, str] = {}
        """The errors other ranks reported, as this rank's heartbeat's watch read them."""
        self.ended_at: dict[int, float] = {}
        """rank -> when this rank's heartbeat first saw its process (on this machine) ended."""
        self.released = threading.Event()
        """Set once the watch found another rank's run over (gloo): :func:`~ddp_plugin.health.watch.wait` raises."""
        self.released_reason = ""

    def begin(self) -> None:
        """A heartbeat starts: what an earlier fit's heartbeat read of its peers is forgotten."""
        self.peer_processes.clear()
        self.found_gone.clear()
        self.found_failed.clear()
        self.ended_at.clear()

    def reset(self) -> None:
        """As a new process starts (tests running several diagnoses in one process)."""
        self.begin()
        self.diagnosed = self.store_unreachable = False
        self.released.clear()

    def release(self, reason: str) -> None:
        """Release this rank's waits on its communication threads (:func:`~ddp_plugin.health.watch.wait`)."""
        self.released_reason = reason
        self.released.set()

    def first_ended(self, ranks: list[int]) -> list[int]:
        """Of ``ranks``, whose processes on this machine have ended, the ones that ended first: the cause, the others
        having given up after it. As this rank's heartbeat saw them end (it looks every ``POLL_S`` until the store is
        lost, so one it did not see ended later). Where it saw none, rank 0 if it is among them (under Lightning's
        launcher it hosts the store, which the others then lost). Where it saw rank 0 end in the same look as others
        and rank 0 hosts the store, rank 0 alone: the others lost the store with it and may give up within a look,
        while a rank 0 that outlives another's failure keeps the store up until the other ranks have read the cause
        (:func:`~ddp_plugin.health.linger.linger_as_store_host`)."""
        seen = [self.ended_at[r] for r in ranks if r in self.ended_at]
        if not seen:
            return [0] if 0 in ranks else ranks
        first = [r for r in ranks if r in self.ended_at and self.ended_at[r] < min(seen) + POLL_S]
        return [0] if 0 in first and on_store.rank_0_hosts_store() else first

    def ended_peers(self, me: int, settle_s: float = 1.0) -> list[int]:
        """The peers of this machine whose processes have ended (as read by this rank's heartbeat). A killed process
        closes its sockets before it becomes a zombie, so a peer's connection may fail while it still looks alive: when
        rank 0 (the store's host under Lightning's launcher) is on this machine, this waits up to ``settle_s`` for it."""
        deadline = time.monotonic() + settle_s
        while True:
            ended = [r for r, entry in sorted(self.peer_processes.items()) if r != me and process_gone(entry)]
            rank_0 = self.peer_processes.get(0)
            if (0 in ended or me == 0 or rank_0 is None or rank_0.split()[0] != machine()
                    or time.monotonic() >= deadline):
                return ended
            time.sleep(0.02)

    def report(self, exc: BaseException) -> None:
        """Leave this rank's error on the store for the other ranks' diagnosis; never raises. A rank that already
        diagnosed a peer's failure reports nothing: what it raises next (say, from Lightning's SIGTERM handler's own
        broadcast) is a consequence, not a cause."""
        if self.diagnosed or is_communication_error(exc):
            return
        try:
            if dist.is_initialized():
                key, value = f"{PREFIX}/failed/{dist.get_rank()}", f"{type(exc).__name__}: {exc}"[:500]
                on_store.within(STORE_TIMEOUT_S + 1, lambda: on_store.tell(on_store.connect(), key, value))
        except Exception:  # noqa: BLE001 - the store may be gone too; the original error is what matters
            pass

    def diagnose(self, error: BaseException, what: str = "gradient synchronization") -> str:
        """A sentence naming the ranks that failed, died or are stuck, for the error this rank raises when ``what``
        (a collective) failed. Takes at most ``MISSED_BEATS_S`` (and the store's round trips); less when every rank is
        accounted for, or another rank already knows the cause."""
        self.diagnosed = True
        me, world = dist.get_rank(), dist.get_world_size()
        # Known without the store, which may be gone with its host.
        ended_here = [r for r, entry in sorted(self.peer_processes.items()) if r != me and process_gone(entry)]

        def first_look() -> tuple[dist.Store, list[int], on_store.News]:
            store = on_store.connect(probe=True)
            # Said before watching: a rank that sees this one's heartbeat stop (it exits after its own watch) reads
            # this key after that, and does not name a rank that only gave up after a peer failed.
            on_store.tell(store, f"{PREFIX}/victim/{me}", "1")
            return store, [store.add(f"{PREFIX}/beat/{r}", 0) for r in range(world)], on_store.News(store, world)

        def beating(store: dist.Store, ranks: list[int], before: list[int]) -> set[int]:
            return {r for r in ranks if store.add(f"{PREFIX}/beat/{r}", 0) != before[r]}

        try:
            # Store calls are bounded here (_within): a client of a stopped store host would wait forever.
            store, before, news = on_store.within(STORE_TIMEOUT_S + 1, first_look)
            alive: set[int] = set()
            deadline = time.monotonic() + MISSED_BEATS_S
            while not news.failed and not news.gone and not news.ended() and time.monotonic() < deadline:
                unknown = [r for r in range(world) if r not in alive and r not in news.victims]
                if not unknown:
                    break  # every rank is alive: a link failed, a collective timed out, or a rank is stuck
                on_store.sleep(POLL_S)
                alive |= on_store.within(STORE_TIMEOUT_S + 1, lambda: beating(store, unknown, before))
                if on_store.within(STORE_TIMEOUT_S + 1, lambda: store.add(f"{PREFIX}/news", 0)) != news.count:
                    news = on_store.within(STORE_TIMEOUT_S + 1, lambda: on_store.News(store, world))
            steps = on_store.within(STORE_TIMEOUT_S + 1, lambda: {
                r: int(s) for r in range(world) if (s := on_store.read(store, "step", r)) is not None})
            # Of the peers of this machine whose processes ended, the first to end: a survivor that a launcher
            # stopped after the cause (torchrun SIGTERMs every rank once one has died) is not a cause.
            ended = news.ended()
            gone = news.gone or (self.first_ended(ended) if ended else []) or [
                r for r in range(world) if r not in alive and r not in news.victims and not news.failed]
            if gone and not news.gone:
                on_store.within(STORE_TIMEOUT_S + 1, lambda: on_store.tell(store, f"{PREFIX}/gone", ",".join(map(str, gone))))
            on_store.within(STORE_TIMEOUT_S + 1, lambda: store.set(f"{PREFIX}/read/{me}", "1"))  # (the store's host may go)
        except Exception:  # noqa: BLE001
            self.store_unreachable = True
            if self.found_failed:
                # A rank's own error, read from the store by this rank's heartbeat before the store's host exited.
                reported = "; ".join(f"rank {r} failed with {msg}" for r, msg in sorted(self.found_failed.items()))
                return (f"rank {me}: {what} failed because {reported}, as read before the rendezvous store became"
                        f" unreachable. Original error: {error}")
            if self.found_gone:
                found = sorted(set(self.found_gone))
                return (
                    f"rank {me}: {what} failed because rank{'s' if len(found) > 1 else ''} {', '.join(map(str, found))}"
                    " stopped responding (killed, crashed or hung), as another rank found before the rendezvous store"
                    f" became unreachable. Original error: {error}"
                )
            ended_here = sorted(set(ended_here) | set(self.ended_peers(me)))
            if ended_here:
                ended = self.first_ended(ended_here)
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


DIAGNOSIS = Diagnosis()
"""This process's: its heartbeat, its watch and every diagnosed phase share it."""


def diagnose(error: BaseException, what: str = "gradient synchronization") -> str:
    """:meth:`Diagnosis.diagnose` of this process."""
    return DIAGNOSIS.diagnose(error, what)


def report_exception(exc: BaseException) -> None:
    """:meth:`Diagnosis.report` of this process."""
    DIAGNOSIS.report(exc)


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
            diagnosis = error(DIAGNOSIS.diagnose(err, what=what))
            setattr(diagnosis, _PHASE, what)
            raise diagnosis from err
        DIAGNOSIS.report(err)
        setattr(err, _PHASE, what)
        if hasattr(err, "add_note"):  # Python 3.11+
            rank = dist.get_rank() if dist.is_initialized() else 0
            err.add_note(f"ddp_plugin: raised on rank {rank} in {what} (by code running on this rank; no collective"
                         " failed)")
        raise
