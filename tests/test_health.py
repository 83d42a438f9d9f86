"""The diagnosis of a failed collective (ddp_plugin.health), on 3 real gloo ranks and their rendezvous store:
which rank it names for a silent heartbeat, a reported error, or none, and that a finding made by one rank is
taken by the next instead of watched for again. (Whole runs with killed, stopped and raising ranks are in
test_reliability.py.)"""

from __future__ import annotations

import concurrent.futures
import subprocess
import sys
import threading
import time
import traceback

import pytest
import torch.distributed as dist

from ddp_plugin import health
from ddp_plugin.health.store import POLL_S
from ddp_plugin.testing.ranks import RankPool

WORLD = 3
ERROR = RuntimeError("[gloo/transport/tcp/pair.cc:553] Connection closed by peer")


@pytest.fixture(scope="module")
def pool():
    with RankPool(WORLD) as ranks:
        yield ranks


@pytest.fixture(autouse=True)
def fresh_store(pool):
    """Every test starts from a store without the health keys of the one before."""
    pool.run(_forget)


def _forget(rank: int, world_size: int) -> None:
    dist.barrier()
    if rank == 0:
        store = dist.distributed_c10d._get_default_store()
        for key in ["gone", "news", *(f"{kind}/{r}" for kind in ("beat", "step", "failed", "victim", "process", "read")
                                      for r in range(world_size))]:
            store.delete_key(f"ddp_plugin/health/{key}")
    health.DIAGNOSIS.reset()
    dist.barrier()


def _diagnose_on(rank: int, diagnosing: set[int], beating: set[int], reports: dict[int, str],
                 ended: set[int] = frozenset()) -> str | None:
    """Heartbeats on the ranks ``beating``, errors reported by the ranks in ``reports``, the ranks ``ended``
    registered as a process of this machine that has ended, then a diagnosis on the ranks ``diagnosing`` (the
    others wait until it is done, as ranks blocked in a collective do)."""
    heartbeat = health.Heartbeat() if rank in beating else None
    try:
        if rank in ended:
            store = dist.distributed_c10d._get_default_store()
            key = f"ddp_plugin/health/process/{rank}"
            while rank in beating and not store.check([key]):  # the heartbeat registers this process first
                time.sleep(0.01)
            store.set(key, _an_ended_process())
        if rank in reports:
            health.report_exception(ValueError(reports[rank]))
        dist.barrier()
        return health.diagnose(ERROR) if rank in diagnosing else None
    finally:
        dist.barrier()  # beating until every diagnosis is done, as a rank blocked in a collective does
        if heartbeat is not None:
            heartbeat.stop()


def _silent_rank_2(rank, world_size):
    return _diagnose_on(rank, diagnosing={0, 1}, beating={0, 1}, reports={})


def _silent_rank_2_then_a_late_diagnosis(rank, world_size):
    first = _diagnose_on(rank, diagnosing={0}, beating={0, 1}, reports={})
    # Rank 1 meets the failure later (its peer, rank 0, gave up): rank 2 is silent by now for too short a time to
    # be seen so again, so it must take rank 0's finding; rank 2 beats again here, yet is still the one named.
    later = _diagnose_on(rank, diagnosing={1}, beating={0, 1, 2}, reports={})
    return first, later


def _an_ended_process() -> str:
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    entry = health.process_id(child.pid)
    child.kill()
    child.wait()
    return entry


def _rank_2_process_ended(rank, world_size):
    # Rank 2's heartbeat goes on (as if its thread outlived the rest): only its process being gone can name it.
    return _diagnose_on(rank, diagnosing={0, 1}, beating={0, 1, 2}, reports={}, ended={2})


def _rank_2_reports_an_error(rank, world_size):
    return _diagnose_on(rank, diagnosing={0, 1}, beating={0, 1, 2}, reports={2: "the user's step broke"})


def _every_rank_beating(rank, world_size):
    return _diagnose_on(rank, diagnosing={0, 1}, beating={0, 1, 2}, reports={})


def _rank_2_named_by_ranks_0_and_1(messages):
    for rank in (0, 1):
        assert messages[rank].startswith(f"rank {rank}: gradient synchronization failed because rank 2 stopped"
                                         " responding (killed, crashed or hung). Original error:"), messages[rank]


def test_a_rank_whose_heartbeat_stopped_is_named_by_every_diagnosing_rank(pool):
    _rank_2_named_by_ranks_0_and_1(pool.run(_silent_rank_2))


@pytest.mark.skipif(health.process_id() is None, reason="needs /proc to look up a process")
def test_a_rank_whose_process_ended_on_this_machine_is_named_without_a_heartbeat_watch(pool):
    _rank_2_named_by_ranks_0_and_1(pool.run(_rank_2_process_ended))


@pytest.mark.skipif(health.process_id() is None, reason="needs /proc to look up a process")
def test_process_gone_tells_an_ended_process_of_this_machine_from_a_running_one():
    assert not health.process_gone(health.process_id())
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    entry = health.process_id(child.pid)
    assert not health.process_gone(entry)
    child.kill()
    child.wait()
    assert health.process_gone(entry)
    # A process of another machine (or pid namespace) is never judged by its id.
    assert not health.process_gone(entry.replace(entry.split()[0], "another-boot/1"))


def test_a_later_diagnosis_takes_the_gone_ranks_another_rank_found(pool):
    (first, _), (_, later), _ = pool.run(_silent_rank_2_then_a_late_diagnosis)
    assert "because rank 2 stopped responding" in first, first
    assert later.startswith("rank 1: gradient synchronization failed because rank 2 stopped responding"), later


def test_a_reported_error_is_quoted_and_its_rank_not_called_gone(pool):
    messages = pool.run(_rank_2_reports_an_error)
    for rank in (0, 1):
        assert messages[rank].startswith(f"rank {rank}: gradient synchronization failed because rank 2 failed with"
                                         " ValueError: the user's step broke. Original error:"), messages[rank]


def test_every_rank_beating_names_nobody(pool):
    messages = pool.run(_every_rank_beating)
    for rank in (0, 1):
        assert "every rank is alive" in messages[rank], messages[rank]
        assert "stopped responding" not in messages[rank], messages[rank]


def _rank_0_raises_in_its_own_code(rank, world_size):
    """Rank 0 raises an ``IndexError`` of its own inside ``diagnosed``; ranks 1 and 2, blocked in a collective
    with it, meet a failed collective there afterwards (as they would when rank 0 exits)."""
    heartbeat = health.Heartbeat()
    try:
        if rank == 0:
            try:
                with health.diagnosed("the link probe"):
                    [][0]  # noqa: B018 - an error in local code
            except Exception as err:  # noqa: BLE001
                frames = [frame.f_code.co_name for frame, _ in traceback.walk_tb(err.__traceback__)]
                result = (type(err).__name__, str(err), getattr(err, "__notes__", []), frames)
            dist.barrier()  # reported before the others diagnose
            return result
        dist.barrier()
        try:
            with health.diagnosed("the link probe"):
                raise ERROR
        except RuntimeError as err:
            return str(err)
    finally:
        dist.barrier()
        heartbeat.stop()


def test_an_error_of_a_ranks_own_code_is_raised_as_itself_and_named_by_the_others(pool):
    (kind, message, notes, frames), *others = pool.run(_rank_0_raises_in_its_own_code)
    # Itself, with its traceback down to where it was raised, and the phase named; not "a link failed".
    assert (kind, message) == ("IndexError", "list index out of range")
    assert frames[-1] == "_rank_0_raises_in_its_own_code"
    assert notes == ["ddp_plugin: raised on rank 0 in the link probe (by code running on this rank; no collective"
                     " failed)"]
    for rank, text in enumerate(others, start=1):
        assert text.startswith(f"rank {rank}: the link probe failed because rank 0 failed with IndexError: list"
                               " index out of range. Original error:"), text


# ---------------------------------------------------------------------- the NCCL watch (health.PeerWatch)
# On NCCL a dead peer raises nothing (a collective returns once queued); the heartbeat's watch finds it and
# aborts the NCCL communicators. The watch's findings are the same on any backend: here on gloo ranks, with an
# abort that records its reason (torch's NCCL abort itself needs several GPUs: benchmarks/gpu_check.py).

def _watching(rank: int, world_size: int, beating: set[int], stepping: bool, report: dict[int, str],
              seconds: float) -> str | None:
    fired: list[tuple[str, float]] = []
    started = time.monotonic()
    watch = (health.PeerWatch(lambda reason: fired.append((reason, time.monotonic() - started)), timeout_s=None,
                              idle_s=1.0, stall_s=1.0) if rank in beating else None)
    heartbeat = health.Heartbeat(watch) if rank in beating else None
    try:
        dist.barrier()
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline and not fired:
            if heartbeat is not None and stepping:
                heartbeat.step += 1
            time.sleep(0.2)
            if rank in report and time.monotonic() - started > 1.5:  # (news to a watch that has begun)
                health.report_exception(ValueError(report.pop(rank)))
        return fired[0] if fired else None
    finally:
        dist.barrier()
        if heartbeat is not None:
            heartbeat.stop()


def _rank_2_silent_while_the_others_wait(rank, world_size):
    fired = _watching(rank, world_size, beating={0, 1}, stepping=False, report={}, seconds=8)
    store = dist.distributed_c10d._get_default_store()
    return fired, store.get("ddp_plugin/health/gone").decode()


def test_the_nccl_watch_names_a_silent_peer_and_aborts_once_this_rank_waits(pool):
    results = pool.run(_rank_2_silent_while_the_others_wait)
    for rank in (0, 1):
        (reason, took), gone = results[rank]
        # (found by its own watch, or taken from the rank that found it first)
        assert reason in ("rank 2 stopped responding (killed, crashed or hung): no heartbeat for 1 s",
                          "rank 2 stopped responding (killed, crashed or hung), as another rank found"), reason
        assert gone == "2"
        assert took < 10, took  # idle 1 s, then 1 s without a beat (and the beat interval's rounding)


def _every_rank_beating_and_stepping(rank, world_size):
    return _watching(rank, world_size, beating={0, 1, 2}, stepping=True, report={}, seconds=4)


def _every_rank_beating_none_stepping(rank, world_size):
    return _watching(rank, world_size, beating={0, 1, 2}, stepping=False, report={}, seconds=4)


def test_the_nccl_watch_leaves_a_healthy_run_alone(pool):
    # Stepping, or waiting while every peer beats (a long step): nothing to abort (timeout_s=None here).
    assert pool.run(_every_rank_beating_and_stepping) == [None, None, None]
    assert pool.run(_every_rank_beating_none_stepping) == [None, None, None]


def _rank_2_reports_while_stepping(rank, world_size):
    return _watching(rank, world_size, beating={0, 1, 2}, stepping=True, report={2: "the user's step broke"},
                     seconds=10)


def test_the_nccl_watch_aborts_at_once_when_a_peer_reports_its_error(pool):
    reasons = pool.run(_rank_2_reports_while_stepping)
    for rank in (0, 1):
        assert reasons[rank][0] == "rank 2 failed with ValueError: the user's step broke", reasons[rank]


def _rank_2_ended_then_rank_1(rank, world_size):
    # As under torchrun: rank 2 dies, then the launcher stops rank 1 (SIGTERM) before it could say it only gave up.
    heartbeat = health.Heartbeat() if rank == 0 else None
    try:
        store = dist.distributed_c10d._get_default_store()
        dist.barrier()
        if rank == 2:
            store.set("ddp_plugin/health/process/2", _an_ended_process())
        time.sleep(1.0)  # (rank 0's heartbeat sees rank 2 end first)
        if rank == 1:
            store.set("ddp_plugin/health/process/1", _an_ended_process())
        time.sleep(1.0)
        dist.barrier()
        return health.diagnose(ERROR) if rank == 0 else None
    finally:
        dist.barrier()
        if heartbeat is not None:
            heartbeat.stop()


def test_of_two_ended_peers_the_one_that_ended_first_is_named(pool):
    message = pool.run(_rank_2_ended_then_rank_1)[0]
    assert message.startswith("rank 0: gradient synchronization failed because rank 2 stopped responding (killed,"
                               " crashed or hung). Original error:"), message


# ---------------------------------------------------------------------- the gloo watch (news only) and health.wait
# On gloo a rank can wait, on its communication thread, for a peer that is alive and waiting in turn (the
# tensor-parallel peer whose broadcast of a bucket never comes, its own reduction having failed): the store's
# news that another rank failed releases that wait at once, instead of the peer's exit seconds later.

def _waiting_on_gloo(rank, world_size, report: dict[int, str], silent: set[int], complete_after: float | None):
    watch = health.peer_watch(timeout_s=None)
    assert watch is not None and watch.news_only
    heartbeat = health.Heartbeat(watch) if rank not in silent else None
    try:
        dist.barrier()
        time.sleep(1.5)  # (news to a watch that has begun)
        if rank in report:
            health.report_exception(ValueError(report[rank]))
            return None
        never = concurrent.futures.Future()
        if complete_after is not None:
            threading.Timer(complete_after, never.set_result, ("done",)).start()
        started = time.monotonic()
        try:
            return "returned", health.wait(never), time.monotonic() - started
        except health.PeersFailed as err:
            return "released", health.is_collective_failure(err) and str(err), time.monotonic() - started
    finally:
        dist.barrier()
        if heartbeat is not None:
            heartbeat.stop()


def _rank_2_reports_while_the_others_wait(rank, world_size):
    return _waiting_on_gloo(rank, world_size, {2: "the user's step broke"}, set(), None)


def test_on_gloo_a_peers_reported_error_releases_a_wait_on_a_collective_that_will_not_complete(pool):
    results = pool.run(_rank_2_reports_while_the_others_wait)
    for rank in (0, 1):
        how, message, took = results[rank]
        assert how == "released", results[rank]
        assert message == ("waited on a collective that will not complete: rank 2 failed with ValueError: the"
                           " user's step broke"), message
        assert took < 10, took  # the next beat (0.5 s) on an idle machine


def _rank_2_silent_while_the_others_wait_on_gloo(rank, world_size):
    return _waiting_on_gloo(rank, world_size, {}, {2}, complete_after=6.0)


def test_the_gloo_watch_reads_news_only_and_a_wait_that_completes_returns_its_result(pool):
    # No heartbeat from rank 2 for 6 s: gloo's own collectives say when a peer is gone, so the news-only watch
    # does not act on silence (a busy machine's late beats would end healthy runs).
    results = pool.run(_rank_2_silent_while_the_others_wait_on_gloo)
    for rank in (0, 1):
        how, value, took = results[rank]
        assert (how, value) == ("returned", "done"), results[rank]
        assert took >= 5.5, took


def _rank_2_reports_then_the_store_is_gone(rank, world_size):
    watch = health.peer_watch(timeout_s=None)
    heartbeat = health.Heartbeat(watch)
    try:
        dist.barrier()
        time.sleep(1.5)  # (news to a watch that has begun)
        if rank == 2:
            health.report_exception(ValueError("the user's step broke"))
            return None
        deadline = time.monotonic() + 30
        while watch.fired is None and time.monotonic() < deadline:
            time.sleep(0.1)
        real = health.store.connect

        def gone(probe: bool = False):
            raise ConnectionError("Connection refused")  # (the store's host, rank 0 under Lightning, has exited)

        health.store.connect = gone
        try:
            return health.diagnose(ERROR)
        finally:
            health.store.connect = real
            health.DIAGNOSIS.store_unreachable = False
    finally:
        dist.barrier()
        heartbeat.stop()


def test_a_reported_error_read_before_the_store_went_away_is_still_named(pool):
    # Under Lightning's launcher rank 0 hosts the store and may exit first; a survivor diagnosing after that named
    # the raising rank "stopped responding" instead of quoting its error (seen in tests/test_mesh_faults.py).
    for message in pool.run(_rank_2_reports_then_the_store_is_gone)[:2]:
        assert message.startswith("rank ") and ("failed because rank 2 failed with ValueError: the user's step broke,"
                                                " as read before the rendezvous store became unreachable") in message, \
            message


def _rank_2_reports_and_rank_1_diagnoses_late(rank, world_size, late_s: float = 1.5):
    dist.barrier()
    start = time.monotonic()
    if rank == 2:
        health.report_exception(ValueError("the user's step broke"))
        result = None
    elif rank == 1:
        time.sleep(late_s)  # (its collective fails later: say, its watch read the news late on a busy machine)
        result = health.diagnose(ERROR)
    else:
        health.linger_as_store_host(timeout_s=30)  # (as at exit after a failed fit)
        result = time.monotonic() - start
    dist.barrier()
    health.DIAGNOSIS.diagnosed = False
    return result


def test_the_store_host_waits_at_exit_until_the_others_have_read_the_cause(pool):
    # Under Lightning's launcher rank 0 hosts the store: exiting at once after a failed fit, it left a survivor
    # that diagnosed later without the raising rank's error, naming "rank 0 stopped responding" instead (seen in
    # tests/test_mesh_faults.py). Rank 0 now waits for every rank's diagnosis (or its own report) first.
    waited, named, _ = pool.run(_rank_2_reports_and_rank_1_diagnoses_late)
    assert 1.4 < waited < 20, waited
    assert named.startswith("rank 1: gradient synchronization failed because rank 2 failed with ValueError: the"
                            " user's step broke"), named


def test_of_ranks_seen_ending_in_one_look_rank_0_the_stores_host_is_named(monkeypatch):
    # Found by CI (tests/test_mesh_faults.py, pp2_dp2, rank 0 killed): its pipeline peer, rank 1, lost the store with
    # it and exited within the same look (POLL_S) of rank 3's heartbeat, which named "ranks 0, 1". A rank 0 that
    # outlives another's failure keeps the store up until the others have read the cause (linger_as_store_host).
    monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE", raising=False)
    diagnosis = health.Diagnosis()
    diagnosis.ended_at = {0: 10.0, 1: 10.0 + POLL_S / 2}
    assert diagnosis.first_ended([0, 1]) == [0]
    diagnosis.ended_at = {1: 10.0, 0: 10.0 + 2 * POLL_S}  # rank 1 seen first, looks apart
    assert diagnosis.first_ended([0, 1]) == [1]
    diagnosis.ended_at = {1: 10.0, 2: 10.0}  # without rank 0, both: the look cannot tell them apart
    assert diagnosis.first_ended([1, 2]) == [1, 2]
    diagnosis.ended_at = {}  # none seen (the heartbeat had stopped): rank 0, the store's host
    assert diagnosis.first_ended([0, 2]) == [0]
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")  # torchrun's agent hosts the store: no tiebreak
    diagnosis.ended_at = {0: 10.0, 1: 10.0}
    assert diagnosis.first_ended([0, 1]) == [0, 1]
