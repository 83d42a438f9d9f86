"""A memory cap per process, for tests of models no rank can hold whole: each process moves itself into a memory
cgroup of its own whose limit is the cap, so the kernel ends it (the OOM killer) the moment it is charged more.
A resident-set sampler could miss a short peak; the cgroup's charge cannot.

    reason = cgroup.unavailable()       # None, or why this machine cannot cap (not root, no memory controller)
    cap = cgroup.MemoryCap.join(limit_bytes, name)   # in the process to cap, before it allocates
    ...
    cap.peak_bytes                      # the most this process was charged (cgroup v1: max_usage_in_bytes)

cgroup v1 (``memory.limit_in_bytes``) and v2 (``memory.max``, where the process's cgroup delegates the memory
controller) are both handled. :func:`remove` deletes the cgroups once their processes have exited. What a process
is charged: the pages it touches (its heap, its stacks, the page cache it reads or writes first), not the shared
libraries another process loaded before it.
"""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path("/sys/fs/cgroup")
PREFIX = "ddp_plugin_cap_"


def _own_memory_cgroup() -> tuple[Path, int] | None:
    """The directory of this process's memory cgroup and its version (1 or 2), or ``None``."""
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return None
    found = None
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if "memory" in controllers.split(","):
            directory = ROOT / "memory" / path.lstrip("/")
            if directory.is_dir():
                found = directory, 1
                break
    if found is None:
        for line in lines:
            if line.startswith("0::"):
                directory = ROOT / line[3:].lstrip("/")
                if (directory / "cgroup.subtree_control").exists() and "memory" in (
                        directory / "cgroup.controllers").read_text().split():
                    found = directory, 2
    if found is not None and found[0].name.startswith(PREFIX):
        # A process started by a capped one (Lightning's launcher starts the other ranks from rank 0): its cap
        # goes beside its parent's, not inside it, where the parent would be charged for it too.
        found = found[0].parent, found[1]
    return found


def unavailable() -> str | None:
    """Why a memory cap cannot be set here, or ``None`` when it can: a child process joins a capped cgroup of its
    own and exits (the cgroup is removed after)."""
    if _own_memory_cgroup() is None:
        return "no memory cgroup controller for this process (/proc/self/cgroup)"
    name = f"probe_{os.getpid()}"
    # (this module alone, by its path: the package's import of torch and Lightning cost the probe 4 s, and each
    # pytest worker probes as it collects tests/test_memory_cap.py)
    code = ("import importlib.util, sys;"
            f" spec = importlib.util.spec_from_file_location('ddp_plugin_cgroup_probe', {__file__!r});"
            " module = sys.modules[spec.name] = importlib.util.module_from_spec(spec); spec.loader.exec_module(module);"
            f" cap = module.MemoryCap.join({1 << 30}, {name!r}); print(cap.peak_bytes >= 0)")
    try:
        result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    finally:
        remove([name])
    if result.returncode or result.stdout.strip() != "True":
        lines = (result.stderr.strip() or result.stdout.strip() or "no output").splitlines()
        return f"a process cannot join a memory-capped cgroup here (needs root or a delegated cgroup): {lines[-1]}"
    return None


@dataclass
class MemoryCap:
    """The memory cgroup a process joined: ``path``, ``version``, ``limit`` in bytes."""

    path: Path
    version: int
    limit: int

    @classmethod
    def join(cls, limit: int, name: str) -> MemoryCap:
        """Make the cgroup ``<own cgroup>/ddp_plugin_cap_<name>`` with ``limit`` bytes (swap excluded: the limit on
        memory plus swap is set to the same where the kernel has one) and move this process into it. What the
        process allocated before stays charged where it was."""
        found = _own_memory_cgroup()
        if found is None:
            raise RuntimeError(f"No memory cgroup to cap this process in: {unavailable()}")
        directory, version = found
        path = directory / f"{PREFIX}{name}"
        path.mkdir(exist_ok=True)
        if version == 1:
            (path / "memory.limit_in_bytes").write_text(str(limit))
            swap = path / "memory.memsw.limit_in_bytes"
            if swap.exists():
                swap.write_text(str(limit))
        else:
            (path / "memory.max").write_text(str(limit))
            if (path / "memory.swap.max").exists():
                (path / "memory.swap.max").write_text("0")
        (path / "cgroup.procs").write_text(str(os.getpid()))
        return cls(path, version, limit)

    def set_limit(self, limit: int) -> None:
        """Change the limit (e.g. to what this process holds after its imports plus a budget); below the current
        charge the kernel reclaims first and refuses (``OSError``) if it cannot."""
        if self.version == 1:
            swap = self.path / "memory.memsw.limit_in_bytes"
            if swap.exists() and limit > self.limit:
                swap.write_text(str(limit))  # (memory + swap is never below memory alone)
            (self.path / "memory.limit_in_bytes").write_text(str(limit))
            if swap.exists() and limit <= self.limit:
                swap.write_text(str(limit))
        else:
            (self.path / "memory.max").write_text(str(limit))
        self.limit = limit

    @property
    def peak_bytes(self) -> int:
        """The most this cgroup was charged since it was made (v2 without ``memory.peak``: the current charge)."""
        name = "memory.max_usage_in_bytes" if self.version == 1 else "memory.peak"
        if not (self.path / name).exists():
            name = "memory.current"
        return int((self.path / name).read_text())

    @property
    def current_bytes(self) -> int:
        """What this cgroup is charged now."""
        return int((self.path / ("memory.usage_in_bytes" if self.version == 1 else "memory.current")).read_text())

    def reset_peak(self) -> None:
        """Start :attr:`peak_bytes` again from the current charge (kernels before 6.12 cannot on cgroup v2)."""
        name = "memory.max_usage_in_bytes" if self.version == 1 else "memory.peak"
        try:
            (self.path / name).write_text("0")
        except OSError:
            pass

    @property
    def oom_kills(self) -> int:
        """How many times the kernel ended a process of this cgroup for exceeding the limit."""
        return _oom_kill_count(self.path / ("memory.oom_control" if self.version == 1 else "memory.events"))


def _oom_kill_count(path: Path) -> int:
    for line in path.read_text().splitlines():
        key, _, value = line.partition(" ")
        if key == "oom_kill":
            return int(value)
    return 0


def remove(names: list[str]) -> None:
    """Delete the cgroups made by :meth:`MemoryCap.join` under these ``names`` (their processes have exited)."""
    found = _own_memory_cgroup()
    if found is None:
        return
    for name in names:
        path = found[0] / f"{PREFIX}{name}"
        if path.is_dir():
            try:
                path.rmdir()
            except OSError:
                pass  # still holds a process (a zombie being reaped): left for the next run to reuse


CPU_ROOT_V1 = ROOT / "cpu"
CPU_PERIOD_US = 100_000


@dataclass
class CpuQuota:
    """A CPU cgroup whose processes together get at most ``cores`` cores (the CFS quota over a 100 ms period): a
    simulated node's share of the machine, so that one node's bursts (a restarting group importing torch) do not
    slow the others as they would not on separate machines. cgroup v1's ``cpu`` controller
    (``cpu.cfs_quota_us``) or v2's ``cpu.max`` where this process's cgroup delegates it."""

    path: Path
    version: int
    cores: float

    @classmethod
    def make(cls, name: str, cores: float) -> CpuQuota:
        """The cgroup ``ddp_plugin_cpu_<name>`` holding its processes to ``cores`` (> 0) cores."""
        if not cores > 0:
            raise ValueError(f"cores={cores!r}: a CPU quota is a positive number of cores (0.5: half a core).")
        quota = max(1000, int(cores * CPU_PERIOD_US))
        if (CPU_ROOT_V1 / "cpu.cfs_quota_us").exists():
            path = CPU_ROOT_V1 / f"ddp_plugin_cpu_{name}"
            path.mkdir(exist_ok=True)
            (path / "cpu.cfs_period_us").write_text(str(CPU_PERIOD_US))
            (path / "cpu.cfs_quota_us").write_text(str(quota))
            return cls(path, 1, cores)
        own = next((line[3:] for line in Path("/proc/self/cgroup").read_text().splitlines() if line.startswith("0::")),
                   None)
        parent = ROOT / own.lstrip("/") if own is not None else None
        if parent is None or "cpu" not in (parent / "cgroup.controllers").read_text().split():
            raise RuntimeError("no CPU cgroup controller for this process (cgroup v1's cpu, or v2's cpu delegated)")
        path = parent / f"ddp_plugin_cpu_{name}"
        path.mkdir(exist_ok=True)
        (path / "cpu.max").write_text(f"{quota} {CPU_PERIOD_US}")
        return cls(path, 2, cores)

    def add(self, pid: int) -> None:
        """Move process ``pid`` (and the children it starts from now on) into this cgroup."""
        (self.path / "cgroup.procs").write_text(str(pid))

    @property
    def throttled_s(self) -> float:
        """Seconds this cgroup's processes were held back by the quota."""
        for line in (self.path / "cpu.stat").read_text().splitlines():
            key, _, value = line.partition(" ")
            if key == "throttled_time":  # (v1: nanoseconds)
                return int(value) / 1e9
            if key == "throttled_usec":
                return int(value) / 1e6
        return 0.0

    def close(self) -> None:
        """Move what is left in the cgroup to its parent, and delete it."""
        try:
            for pid in (self.path / "cgroup.procs").read_text().split():
                try:
                    (self.path.parent / "cgroup.procs").write_text(pid)
                except OSError:
                    pass  # (exited meanwhile)
            self.path.rmdir()
        except OSError:
            pass  # (already gone, or a process being reaped: left for the next run, which reuses the name)
