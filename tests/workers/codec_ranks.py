"""Real ranks for unit tests: a pool of N processes joined in a gloo group, kept for a whole test module.

    with RankPool(4) as ranks:
        results = ranks.run(some_module_level_function, arg)   # one result per rank, in rank order

The function runs on every rank at once, as ``fn(rank, world_size, *args)``, with the default process group
initialized; it must be importable (defined at module level), since the ranks are spawned processes.
Starting the processes costs a few seconds (each imports torch), which is why one pool serves many tests.
"""

from __future__ import annotations

import os
import queue
import socket
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _serve(rank: int, world_size: int, port: int, tasks: Any, results: Any) -> None:
    torch.set_num_threads(1)
    os.environ["LOCAL_RANK"] = str(rank)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    try:
        while True:
            task = tasks.get()
            if task is None:
                break
            fn, args = task
            try:
                results.put((rank, True, fn(rank, world_size, *args)))
            except BaseException:  # noqa: BLE001 - reported to the test, which fails with it
                results.put((rank, False, traceback.format_exc()))
    finally:
        dist.destroy_process_group()


class RankPool:
    """``world_size`` spawned processes over gloo on localhost, running one function at a time on all of them."""

    def __init__(self, world_size: int, timeout: float = 60.0) -> None:
        self.world_size = world_size
        self.timeout = timeout
        ctx = mp.get_context("spawn")
        port = free_port()
        self._results = ctx.Queue()
        self._tasks = [ctx.Queue() for _ in range(world_size)]
        self._procs = [
            ctx.Process(target=_serve, args=(r, world_size, port, self._tasks[r], self._results), daemon=True)
            for r in range(world_size)
        ]
        for p in self._procs:
            p.start()

    def run(self, fn: Callable[..., Any], *args: Any) -> list[Any]:
        """``fn(rank, world_size, *args)`` on every rank; the results in rank order. A failure on any rank
        raises with that rank's traceback; a hang raises after ``timeout`` seconds and stops the pool."""
        for q in self._tasks:
            q.put((fn, args))
        out: list[Any] = [None] * self.world_size
        errors = []
        for _ in range(self.world_size):
            try:
                rank, ok, value = self._results.get(timeout=self.timeout)
            except queue.Empty:
                self.close(force=True)
                raise TimeoutError(f"{fn.__name__} did not finish on every rank within {self.timeout} s") from None
            if ok:
                out[rank] = value
            else:
                errors.append(f"rank {rank}:\n{value}")
        if errors:
            raise RuntimeError(f"{fn.__name__} failed:\n" + "\n".join(errors))
        return out

    def close(self, force: bool = False) -> None:
        if not force:
            for q in self._tasks:
                q.put(None)
        for p in self._procs:
            p.join(timeout=0 if force else 10)
            if p.is_alive():
                p.kill()
                p.join()

    def __enter__(self) -> RankPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
