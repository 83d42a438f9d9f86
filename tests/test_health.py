"""The diagnosis of a failed collective (ddp_plugin.health), on 3 real gloo ranks and their rendezvous store:
which rank it names for a silent heartbeat, a reported error, or none, and that a finding made by one rank is
taken by the next instead of watched for again. (Whole runs with killed, stopped and raising ranks are in
test_reliability.py.)"""

from __future__ import annotations

import subprocess
import sys
import time
import traceback

import pytest
import torch.distributed as dist

from ddp_plugin import health
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
        for key in ["gone", "news", *(f"{kind}/{r}" for kind in ("beat", "step", "failed", "victim", "process")
                                      for r in range(world_size))]:
            store.delete_key(f"ddp_plugin/health/{key}")
    health._diagnosed = health._store_unreachable = False
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
