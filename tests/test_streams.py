"""The library's side threads (ddp_plugin.runtime.streams.SideThread): work runs in order; once an item failed the
items after it are not run (their collectives would pair with the wrong collectives of a peer); and after a
failed fit nothing waits for a thread stuck in a collective with a rank that is gone."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from ddp_plugin.runtime.streams import SideThread


def test_work_runs_in_order_on_one_thread_and_close_waits_for_it():
    thread = SideThread(torch.device("cpu"), "test-side")
    seen: list[tuple[int, str]] = []
    futures = [thread.submit(lambda i: seen.append((i, threading.current_thread().name)) or i * i, i)
               for i in range(5)]
    thread.close()
    assert [f.result() for f in futures] == [0, 1, 4, 9, 16]
    assert seen == [(i, "test-side") for i in range(5)]


def test_after_a_failed_item_the_later_ones_are_not_run_and_say_why():
    thread = SideThread(torch.device("cpu"), "test-side")
    ran: list[int] = []

    def fail() -> None:
        raise RuntimeError("Connection closed by peer")

    first = thread.submit(fail)
    later = thread.submit(ran.append, 1)
    thread.close()
    with pytest.raises(RuntimeError, match="Connection closed by peer"):
        first.result()
    with pytest.raises(RuntimeError, match="test-side: not run, an earlier item failed: RuntimeError: Connection"
                                           " closed by peer"):
        later.result()
    assert ran == []


def test_close_without_waiting_leaves_a_stuck_thread_to_the_end_of_the_process():
    release = threading.Event()
    thread = SideThread(torch.device("cpu"), "test-side")
    stuck = thread.submit(release.wait)  # (a collective with a rank that is gone)
    time.sleep(0.1)
    started = time.monotonic()
    thread.close(wait=False)
    assert time.monotonic() - started < 1.0
    assert thread._thread.daemon  # the interpreter's exit does not join it either
    release.set()
    assert stuck.result(timeout=10) is True
