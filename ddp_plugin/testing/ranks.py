"""Ranks for tests: a free port for a rendezvous, a pool of real gloo ranks, and C1, "every rank holds the same
parameters", checked the same way everywhere.

- :func:`free_port`: a TCP port nobody listens on, for ``--master_port`` or ``tcp://127.0.0.1:<port>``.
- :class:`RankPool`: N processes (forked from a fork server that imported torch) joined in a gloo group, running one module-level function at a time on
  all of them; one pool serves a whole test module (starting the processes costs seconds)::

      with RankPool(4) as ranks:
          results = ranks.run(some_module_level_function, arg)   # fn(rank, world_size, arg), in rank order

- :func:`flat_parameters`, :func:`gather_parameters`: one flat vector of a module's parameters, and every rank's
  (at ZeRO stage 3 gathered whole through ``strategy.full_parameters()``).
- :func:`identical_on_all_ranks`, :func:`all_ranks_equal`: whether those are the same bits on every rank.
- :func:`local_parameters`, :func:`replicas_identical`: the same for a mesh's data-parallel replicas, which hold
  the same pipeline stage and tensor-parallel shard (a rank's local shards, whole at ZeRO stage 3).
- :func:`max_rank_difference`: the largest elementwise difference of a tensor between any rank and rank 0;
  :func:`max_group_difference`: of several tensors over a process group's ranks, in one all-gather.

The strategy functions take a Lightning strategy (``trainer.strategy``) and are collectives: call them on every
rank. Nothing here imports pytest.
"""

from __future__ import annotations

import contextlib
import os
import queue
import random
import socket
import traceback
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import Tensor, nn

__all__ = [
    "RankPool",
    "all_ranks_equal",
    "flat_parameters",
    "free_port",
    "gather_parameters",
    "identical_on_all_ranks",
    "local_parameters",
    "max_group_difference",
    "max_rank_difference",
    "replicas_identical",
]


_PICK = random.Random()  # (seeded from the OS: every process its own sequence)


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free on ``host`` a moment ago, picked at random below the ephemeral range: the operating
    system's own pick (``bind(..., 0)``) lies inside it, where any process's next outgoing connection (a gloo pair,
    torchft's clients) may take it before the rendezvous store listens on it (seen in CI: ``EADDRINUSE``)."""
    low = _ephemeral_low()
    for _ in range(100):
        port = _PICK.randrange(max(1024, low - 12000), low)
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            return port
    with socket.socket() as s:  # (nothing free down there: the operating system's pick)
        s.bind((host, 0))
        return s.getsockname()[1]


def _ephemeral_low() -> int:
    """The first port of Linux's ephemeral range (32768 where it cannot be read)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


# ---------------------------------------------------------------------------------------------- C1


def init_one_rank(device_name: str) -> torch.device:
    """A one-rank process group on a free local port: NCCL on ``cuda:0`` for ``"cuda"``, else gloo on the CPU.
    The device, made current."""
    import os
    from datetime import timedelta

    import torch.distributed as dist

    device = torch.device("cuda", 0) if device_name == "cuda" else torch.device("cpu")
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(free_port())
    if device.type == "cuda":
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", rank=0, world_size=1, timeout=timedelta(seconds=60), device_id=device)
    else:
        dist.init_process_group("gloo", rank=0, world_size=1, timeout=timedelta(seconds=60))
    return device


def flat_parameters(module: nn.Module | Iterable[Tensor]) -> Tensor:
    """Every parameter of ``module`` (or the given tensors), detached and flattened into one new vector."""
    params = module.parameters() if isinstance(module, nn.Module) else module
    return torch.cat([p.detach().flatten() for p in params])


def gather_parameters(strategy: Any, module: nn.Module) -> Tensor:
    """``(world_size, numel)``: row ``r`` is rank ``r``'s :func:`flat_parameters` of ``module``, whole (inside
    ``strategy.full_parameters()`` where the strategy has it, which at ZeRO stage 3 gathers the shards)."""
    full = getattr(strategy, "full_parameters", contextlib.nullcontext)
    with full():
        flat = flat_parameters(module)
    every_rank = strategy.all_gather(flat)
    return every_rank if every_rank.dim() == 2 else every_rank[None]  # not distributed: no rank dimension


def all_ranks_equal(every_rank: Tensor) -> bool:
    """Whether every row of ``every_rank`` (one per rank, as ``all_gather`` stacks them) equals row 0, bit for
    bit (a NaN equals nothing)."""
    return bool((every_rank == every_rank[0]).all())


def identical_on_all_ranks(strategy: Any, module: nn.Module) -> bool:
    """C1: whether every rank holds exactly the same parameters of ``module`` as rank 0."""
    return all_ranks_equal(gather_parameters(strategy, module))


def local_parameters(strategy: Any, module: nn.Module) -> Tensor:
    """This rank's part of every parameter of ``module`` (a DTensor's local shard), flattened into one new vector,
    inside ``strategy.full_parameters()`` (whole at ZeRO stage 3)."""
    from ddp_plugin.hookspecs import local_tensor

    with strategy.full_parameters():
        return torch.cat([local_tensor(p).detach().flatten() for p in module.parameters()])


def replicas_identical(strategy: Any, module: nn.Module, mine: Tensor | None = None) -> bool:
    """Whether every data-parallel replica of this rank (``strategy.device_mesh["data_parallel"]``, or every rank
    without a mesh) holds the same :func:`local_parameters` (or the given ``mine``) as the first one."""
    mine = local_parameters(strategy, module) if mine is None else mine
    group = strategy.device_mesh.get_group("data_parallel") if strategy.device_mesh is not None else None
    every = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(every, mine, group=group)
    return all_ranks_equal(torch.stack(every))


def max_group_difference(tensors: Iterable[Tensor], group: dist.ProcessGroup | None = None) -> float:
    """The largest ``|t on rank r - t on the group's first rank|`` over ``tensors`` (flattened together: one
    all-gather, whatever their number) and the ranks of ``group`` (``None``: the world); 0.0 without tensors. Every
    rank of the group calls it with tensors of the same sizes."""
    mine = torch.cat([t.detach().reshape(-1) for t in tensors] or [torch.zeros(0)])
    every = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(every, mine, group=group)
    return max((float((t - every[0]).abs().max()) for t in every), default=0.0) if mine.numel() else 0.0


def max_rank_difference(strategy: Any, tensor: Tensor) -> float:
    """The largest ``|tensor on rank r - tensor on rank 0|`` over all ranks and elements (0.0: identical)."""
    every_rank = strategy.all_gather(tensor)
    return (every_rank - every_rank[0]).abs().max().item()


# ---------------------------------------------------------------------------------------------- a pool of ranks


_READY = "ready"
_CPU = "cpu"
_ranks_cpu = [0.0]


def pool_cpu_seconds() -> float:
    """CPU seconds (user and system) the ranks of every :class:`RankPool` this process closed used, each rank's
    own, as it reported them on leaving: the ranks are the fork server's children, not this process's, so its
    ``RUSAGE_CHILDREN`` never counts them."""
    return _ranks_cpu[0]


def _serve(rank: int, world_size: int, port: int, tasks: Any, results: Any) -> None:
    torch.set_num_threads(1)
    os.environ["LOCAL_RANK"] = str(rank)
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    except BaseException:  # noqa: BLE001 - reported: the pool starts again on another port
        results.put((rank, False, traceback.format_exc()))
        return
    results.put((rank, True, _READY))
    try:
        while True:
            task = tasks.get()
            if task is None:
                import resource

                used = resource.getrusage(resource.RUSAGE_SELF)
                results.put((rank, True, (_CPU, used.ru_utime + used.ru_stime)))
                break
            fn, args = task
            try:
                results.put((rank, True, fn(rank, world_size, *args)))
            except BaseException:  # noqa: BLE001 - reported to the caller, which fails with it
                results.put((rank, False, traceback.format_exc()))
    finally:
        dist.destroy_process_group()


def _start_context() -> Any:
    """How the ranks start: forked from multiprocessing's fork server, which imports torch (and this module) once
    per process that makes pools, not once per rank; plain spawn where there is no fork server (not POSIX).
    Never a fork of the caller itself, whose threads (pytest's, a gloo group's) a child would inherit half-held.
    Each rank imported torch anew before: a pool of 4 ranks cost 10-16 CPU seconds before its first function."""
    if "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torch.distributed", __name__])
    return ctx


class RankPool:
    """``world_size`` processes over gloo on localhost, running one function at a time on all of them.

    The function runs on every rank at once, as ``fn(rank, world_size, *args)``, with the default process group
    initialized; it must be importable (defined at module level), since the ranks are not forks of the caller,
    and so must its arguments and results be picklable.
    """

    def __init__(self, world_size: int, timeout: float = 60.0, attempts: int = 3) -> None:
        self.world_size = world_size
        self.timeout = timeout
        """For each function: the ranks' start is not counted (on a busy machine spawning and importing can take
        minutes), only the function's own run."""
        for _ in range(attempts):
            failures = self._start(free_port())
            if not failures:
                return
            self.close(force=True)  # (another process took the free port first, say)
        raise RuntimeError(f"the ranks did not start in {attempts} attempts:\n" + "\n".join(failures))

    def _start(self, port: int) -> list[str]:
        """Spawn the ranks on ``port`` and wait until each has joined the group, or failed (its error), or ended."""
        ctx = _start_context()
        self._results = ctx.Queue()
        self._tasks = [ctx.Queue() for _ in range(self.world_size)]
        self._procs = [
            ctx.Process(target=_serve, args=(r, self.world_size, port, self._tasks[r], self._results), daemon=True)
            for r in range(self.world_size)
        ]
        for p in self._procs:
            p.start()
        ready: set[int] = set()
        failures: list[str] = []
        while len(ready) + len(failures) < self.world_size:
            try:
                rank, ok, value = self._results.get(timeout=5.0)
            except queue.Empty:
                gone = [r for r, p in enumerate(self._procs) if not p.is_alive() and r not in ready]
                if gone:
                    return failures + [f"rank {r} ended while starting" for r in gone]
                continue
            if ok:
                ready.add(rank)
            else:
                failures.append(f"rank {rank}:\n{value}")
        return failures

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
        """Stop the ranks: let them leave the group (``force``: kill them at once)."""
        if not force:
            for q in self._tasks:
                q.put(None)
            for _ in self._procs:
                try:
                    _, ok, value = self._results.get(timeout=10)
                except queue.Empty:
                    break
                if ok and isinstance(value, tuple) and value[:1] == (_CPU,):
                    _ranks_cpu[0] += value[1]
        for p in self._procs:
            p.join(timeout=0 if force else 10)
            if p.is_alive():
                p.kill()
                p.join()

    def __enter__(self) -> RankPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
