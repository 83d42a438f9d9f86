"""Processes of this machine, named so that a peer on the same machine (the same boot and process namespace) can
tell whether one has ended: ``"<machine> <pid> <start time>"``, read back from ``/proc``."""

from __future__ import annotations

import os
from functools import cache


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
def machine() -> str | None:
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
    return None if machine() is None or start is None else f"{machine()} {pid} {start}"


def process_gone(entry: str | None) -> bool:
    """Whether the process :func:`process_id` described as ``entry`` has ended: only known for a process of this
    machine (the same boot and process namespace; its id is not reused while the start time differs), else
    False."""
    if entry is None or machine() is None:
        return False
    where, pid, start = entry.split()
    return where == machine() and _start_time(int(pid)) != start
