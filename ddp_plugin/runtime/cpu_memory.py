"""Returning freed CPU buffers to the operating system at ZeRO stages 2 and 3.

Stages 2 and 3 allocate and free bucket- and unit-sized buffers many times per step (gradient buckets
materialized and released, stage 3 units gathered before forward and backward and freed after). PyTorch's CPU
allocator is glibc's ``malloc``, whose *dynamic mmap threshold* rises to the size of the largest chunk freed so
far (up to 32 MiB): after the first step these buffers come from the heap, whose holes are not given back, and
the process's resident memory grows step after step although the live tensors do not (measured on the 2x2
benchmark: 677 MB peak RSS per rank at stage 3 with 53 MB of live tensors, against 615 MB for Lightning
``ddp``). Fixing the threshold at 1 MiB with ``mallopt`` makes every buffer of 1 MiB or more a mapping of its
own that ``free`` unmaps at once (462 MB), for the price of fresh page faults when a buffer is allocated again.

This is process-wide: it applies to every allocation of 1 MiB or more in the process, the user's included.
"""

from __future__ import annotations

import ctypes
import logging
import platform
import sys

log = logging.getLogger(__name__)

M_MMAP_THRESHOLD = -3  # glibc's <malloc.h>
THRESHOLD_BYTES = 1 << 20


def _glibc() -> ctypes.CDLL | None:
    """glibc, or ``None`` off Linux/glibc."""
    if sys.platform != "linux" or platform.libc_ver()[0] != "glibc":
        return None
    try:
        return ctypes.CDLL("libc.so.6")
    except OSError:
        return None


def release_freed_buffers(threshold_bytes: int = THRESHOLD_BYTES) -> bool:
    """Fix glibc's mmap threshold at ``threshold_bytes``; False (and nothing done) off Linux/glibc."""
    libc = _glibc()
    return libc is not None and bool(libc.mallopt(M_MMAP_THRESHOLD, int(threshold_bytes)))


def trim() -> bool:
    """Return the C heap's free pages to the OS (glibc's ``malloc_trim(0)``, every arena); False off Linux/glibc.
    For after a phase that freed much of what it allocated below the threshold (a model's setup): the pages
    would otherwise stay resident, holes the next allocations may never fill."""
    libc = _glibc()
    if libc is None:
        return False
    libc.malloc_trim(0)
    return True


def available_bytes() -> int | None:
    """The memory this process may still take: the smaller of the machine's available memory (``MemAvailable``)
    and what its memory cgroup's limit leaves (cgroup v1 or v2, where a limit is set). ``None`` where neither can
    be read (not Linux)."""
    found: list[int] = []
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    found.append(int(line.split()[1]) * 1024)
                    break
    except OSError:
        return None
    cgroup = _cgroup_headroom()
    if cgroup is not None:
        found.append(cgroup)
    return min(found) if found else None


def _cgroup_headroom() -> int | None:
    """Limit minus usage of this process's memory cgroup, or ``None`` without one or without a limit."""
    try:
        with open("/proc/self/cgroup") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    files = None
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if "memory" in controllers.split(","):  # cgroup v1
            files = (f"/sys/fs/cgroup/memory{path}/memory.limit_in_bytes",
                     f"/sys/fs/cgroup/memory{path}/memory.usage_in_bytes")
            break
        if line.startswith("0::"):  # cgroup v2 (a v1 memory line, if any, wins)
            files = (f"/sys/fs/cgroup{path}/memory.max", f"/sys/fs/cgroup{path}/memory.current")
    if files is None:
        return None
    try:
        with open(files[0]) as f:
            limit = f.read().strip()
        with open(files[1]) as f:
            usage = int(f.read().strip())
    except (OSError, ValueError):
        return None
    if limit == "max" or int(limit) >= 1 << 60:
        return None
    return max(int(limit) - usage, 0)
