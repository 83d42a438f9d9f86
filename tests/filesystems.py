"""Real filesystem faults for tests, without touching the machine: a command run in a mount namespace of its own
(``unshare --mount``; as a user namespace's root where the test does not run as root) in which a tmpfs is
mounted over a directory, small (a full disk: ENOSPC) or read-only (EROFS). The mount is private to the command
and its children and disappears with them."""

from __future__ import annotations

import functools
import os
import shlex
import shutil
import subprocess
import sys
import tempfile


def _unshare() -> list[str]:
    return ["unshare", "--mount", "--propagation", "private"] + ([] if os.geteuid() == 0 else ["--map-root-user"])


@functools.cache
def tmpfs_unavailable() -> str | None:
    """Why a tmpfs cannot be mounted in a mount namespace here (``None`` if it can)."""
    if sys.platform != "linux":
        return "mount namespaces are Linux only"
    if shutil.which("unshare") is None:
        return "`unshare` (util-linux) is not installed"
    with tempfile.TemporaryDirectory() as d:
        probe = subprocess.run([*_unshare(), "sh", "-c", f"mount -t tmpfs -o size=4k tmpfs {shlex.quote(d)}"],
                               capture_output=True, text=True)
    if probe.returncode != 0:
        return f"cannot mount a tmpfs in a mount namespace here: {probe.stderr.strip()[:200]}"
    return None


def in_tmpfs(mountpoint: str | os.PathLike, options: str, argv: list[str | os.PathLike]) -> list[str]:
    """``argv`` run with a tmpfs mounted (``-o options``, e.g. ``size=8k`` or ``ro``) over ``mountpoint``."""
    command = " ".join(shlex.quote(str(a)) for a in argv)
    script = f"mount -t tmpfs -o {shlex.quote(options)} tmpfs {shlex.quote(str(mountpoint))} && exec {command}"
    return [*_unshare(), "sh", "-c", script]
