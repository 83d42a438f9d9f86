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

The modules, one job each: :mod:`~ddp_plugin.health.store` (the protocol's keys, timings, reads and writes, which
every side shares), :mod:`~ddp_plugin.health.processes` (is a peer's process on this machine still there),
:mod:`~ddp_plugin.health.heartbeat`, :mod:`~ddp_plugin.health.watch` (NCCL's abort, gloo's released waits),
:mod:`~ddp_plugin.health.diagnosis` (the diagnosis and the per-process state it reads, one object:
:data:`~ddp_plugin.health.diagnosis.DIAGNOSIS`), :mod:`~ddp_plugin.health.signals` (Lightning's SIGTERM handler
shielded) and :mod:`~ddp_plugin.health.linger` (the store's host staying up after a failure). This package's names
are the API the strategy uses.
"""


from ddp_plugin.health.diagnosis import (
    DIAGNOSIS,
    Diagnosis,
    diagnose,
    diagnosed,
    is_collective_failure,
    is_communication_error,
    report_exception,
)
from ddp_plugin.health.heartbeat import Heartbeat
from ddp_plugin.health.linger import linger_as_store_host
from ddp_plugin.health.processes import process_gone, process_id
from ddp_plugin.health.signals import shield_sigterm_handler
from ddp_plugin.health.store import BEAT_INTERVAL_S, MISSED_BEATS_S, POLL_S, STORE_TIMEOUT_S
from ddp_plugin.health.watch import PeersFailed, PeerWatch, abort_nccl, peer_watch, wait

__all__ = [
    "BEAT_INTERVAL_S",
    "DIAGNOSIS",
    "MISSED_BEATS_S",
    "POLL_S",
    "STORE_TIMEOUT_S",
    "Diagnosis",
    "Heartbeat",
    "PeerWatch",
    "PeersFailed",
    "abort_nccl",
    "diagnose",
    "diagnosed",
    "is_collective_failure",
    "is_communication_error",
    "linger_as_store_host",
    "peer_watch",
    "process_gone",
    "process_id",
    "report_exception",
    "shield_sigterm_handler",
    "wait",
]
