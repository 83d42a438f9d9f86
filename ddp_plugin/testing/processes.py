"""The processes of a multi-rank run, seen from outside and from inside.

A test or benchmark that starts a training run (Lightning's launcher, torchrun) and then breaks it needs the
same few things: an environment without another run's rendezvous variables, every rank's process id (each rank
writes ``pid-<rank>`` into a folder), whether a process is still alive or stopped, and, whatever happened, to
leave nothing running afterwards. A rank that breaks itself on purpose uses :func:`inject_fault`.

    proc = subprocess.Popen([...], env=clean_env({"PYTHONUNBUFFERED": "1"}), start_new_session=True)
    try:
        ...                                   # the ranks call write_pid_file(folder, rank) when they start
        gone = [rank for rank, pid in pid_files(folder).items() if not alive(pid)]
    finally:
        end_run(proc, folder)                 # SIGKILL every rank and the launcher's process group

A worker script that several tests launch can run several trainings in one launch (:func:`run_each`): starting the
ranks of a launch costs seconds of imports each, a short fit a fraction of one.

Linux only for :func:`process_state` (it reads ``/proc``). Nothing here imports torch or pytest.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

__all__ = [
    "RENDEZVOUS_ENV",
    "alive",
    "clean_env",
    "end_run",
    "inject_fault",
    "kill_identified",
    "kill_quietly",
    "pid_files",
    "print_line",
    "process_state",
    "run_cases",
    "run_each",
    "runs_argument",
    "signal_group_quietly",
    "stopped",
    "write_identity_file",
    "write_pid_file",
]

RENDEZVOUS_ENV = ("MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK", "NODE_RANK", "WORLD_SIZE", "RANK")
"""Variables a launcher sets for its ranks; a new run started from inside one must not inherit them."""

FAULT_KINDS = ("sigstop", "sigkill", "raise")


def clean_env(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """This process's environment without :data:`RENDEZVOUS_ENV`, then ``extra`` (which may set them again)."""
    env = {k: v for k, v in os.environ.items() if k not in RENDEZVOUS_ENV}
    env.update(extra or {})
    return env


def print_line(text: str) -> None:
    """Write ``text`` and its newline to stdout in one ``write``. The ranks of a launch share one pipe, and an
    unbuffered ``print()`` writes the text and the newline separately, so two ranks' lines can run into one
    (``rank 1 ...: []rank 0 ...: []``) and a test reading one line per rank misses one. A write of at most
    ``PIPE_BUF`` (4096) bytes to a pipe is atomic."""
    sys.stdout.flush()
    os.write(sys.stdout.fileno(), (text + "\n").encode())


def write_pid_file(folder: str | os.PathLike, rank: int | str) -> None:
    """Write this process's id to ``folder/pid-<rank>``, for :func:`pid_files` and :func:`end_run`."""
    with open(os.path.join(folder, f"pid-{rank}"), "w") as f:
        f.write(str(os.getpid()))


def pid_files(folder: str | os.PathLike) -> dict[int, int]:
    """``{rank: pid}`` from the ``pid-<rank>`` files in ``folder`` (a file still being written is skipped)."""
    out = {}
    for f in Path(folder).glob("pid-*"):
        try:
            out[int(f.name[4:])] = int(f.read_text())
        except ValueError:
            pass
    return out


def _stat_field(pid: int, field: int) -> str | None:
    """Field ``field`` (numbered from 1, as in proc(5)) of ``/proc/<pid>/stat``, or None if there is no such
    process. Fields are counted after the command's closing bracket (the name may hold spaces and brackets)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[field - 3]
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return None


def process_state(pid: int) -> str | None:
    """The state letter of ``/proc/<pid>/stat`` (``R``, ``S``, ``T`` stopped, ``Z`` zombie, ...), or None if there
    is no such process."""
    return _stat_field(pid, 3)


def alive(pid: int) -> bool:
    """Whether process ``pid`` is still running (or stopped): an exited child not yet reaped (a zombie) is gone."""
    return process_state(pid) not in (None, "Z", "X")


def stopped(pid: int) -> bool:
    """Whether process ``pid`` is stopped (SIGSTOP)."""
    return process_state(pid) == "T"


def kill_quietly(pid: int, sig: int = signal.SIGKILL) -> None:
    """Send ``sig`` to ``pid``; a process that is already gone (or no longer ours) is not an error."""
    try:
        os.kill(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def signal_group_quietly(pgid: int, sig: int = signal.SIGKILL) -> None:
    """Send ``sig`` to the process group ``pgid``; a group that is already gone is not an error."""
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _start_time(pid: int) -> str | None:
    """When process ``pid`` started (clock ticks since boot), or None if there is no such process."""
    return _stat_field(pid, 22)


def write_identity_file(folder: str | os.PathLike) -> None:
    """Write this process's id and start time to ``folder/proc-<pid>`` (made if missing), for
    :func:`kill_identified`. Linux only."""
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, f"proc-{os.getpid()}"), "w") as f:
        f.write(f"{os.getpid()} {_start_time(os.getpid())}")


def kill_identified(folder: str | os.PathLike, sig: int = signal.SIGKILL) -> None:
    """Send ``sig`` to every process that wrote an identity file into ``folder`` and still runs: the same id and
    the same start time, so never a process that took an ended one's id since. A process started outside a
    launcher's session (a rank forked by the test suite's zygote) is reached this way where a process group is
    not."""
    for path in Path(folder).glob("proc-*"):
        try:
            pid, started = path.read_text().split()
        except (OSError, ValueError):
            continue
        if _start_time(int(pid)) == started:
            kill_quietly(int(pid), sig)


def end_run(proc: subprocess.Popen, folder: str | os.PathLike | None = None, also: Iterable[int] = (),
            timeout: float | None = None) -> None:
    """Leave nothing of a run behind: SIGKILL every process named in ``folder``'s ``pid-<rank>`` files, every one
    that wrote an identity file there and still runs (:func:`kill_identified`) and those in ``also`` (a stopped
    process dies of SIGKILL too), then the process group of ``proc`` (started with ``start_new_session=True``: the
    launcher and every rank it started), and reap ``proc``."""
    pids = set(also) | (set(pid_files(folder).values()) if folder is not None else set())
    for pid in pids:
        kill_quietly(pid)
    if folder is not None:
        kill_identified(folder)
    signal_group_quietly(proc.pid)
    proc.wait(timeout=timeout)


def inject_fault(kind: str) -> None:
    """Break this process the way a rank breaks: ``"sigstop"`` (hung: stopped, every connection still open),
    ``"sigkill"`` (dead at once) or ``"raise"`` (an exception in the user's code, a ValueError)."""
    if kind == "sigstop":
        os.kill(os.getpid(), signal.SIGSTOP)
    elif kind == "sigkill":
        os.kill(os.getpid(), signal.SIGKILL)
    elif kind == "raise":
        raise ValueError("the user's training_step broke on purpose")
    else:
        raise ValueError(f"kind={kind!r}: one of {', '.join(FAULT_KINDS)}")


def every_rank(value: Any) -> list[Any]:
    """``value`` of every rank, in rank order, on every rank (``all_gather_object`` over the default group): what
    a worker's case returns for rank 0 to write."""
    import torch.distributed as dist

    every: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every, value)
    return every


def run_cases(cases: Iterable[str], run: Callable[[str], Any], out: str | os.PathLike) -> None:
    """A worker's fits, one per case, one after another in these processes: ``run(case)`` on every rank, and rank 0
    prints ``== case <case>`` before it (a crashed launch's output says which) and appends the JSON line of its
    result to ``out`` after it. (Lightning's launcher starts the other ranks at the first fit, and they run the
    script from its start: whatever is done before it is done in every process, and written by rank 0 only.)"""
    first = os.environ.get("LOCAL_RANK", "0") == "0"
    for case in cases:
        if first:
            print(f"== case {case}", flush=True)
        result = run(case)
        if first:
            with open(out, "a") as f:
                f.write(json.dumps(result) + "\n")


def runs_argument(runs: Sequence[Sequence[str | os.PathLike]]) -> list[str]:
    """The command-line arguments that make a worker's :func:`run_each` run each of ``runs`` (argument lists), one
    after another, in the same processes."""
    return ["--runs", json.dumps([[str(a) for a in run] for run in runs])]


def run_each(main: Callable[[list[str]], None], argv: Sequence[str] | None = None) -> None:
    """A worker's entry point: ``main(args)`` once per run the command line asks for, in order, in these processes.

    ``--runs JSON`` (:func:`runs_argument`) holds a list of argument lists; without it, ``main`` runs once with the
    command line itself. Under Lightning's launcher every rank re-executes the same command line, so every rank
    runs the same fits in the same order, each with its own Trainer; a later run may resume from a checkpoint an
    earlier one wrote."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] != ["--runs"]:
        main(argv)
        return
    if len(argv) != 2:
        raise SystemExit(f"--runs takes one JSON list of argument lists and nothing beside it, not {argv[1:]}")
    for run in json.loads(argv[1]):
        main(run)
