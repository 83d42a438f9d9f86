"""What the test modules share: where the repository and the worker scripts are, running a worker in a fresh
Python, and the skip mark for tests that need the simulated cluster."""

from __future__ import annotations

import os
import re
import subprocess
from collections.abc import Iterable
from pathlib import Path

import pytest

from ddp_plugin.testing.processes import clean_env
from ddp_plugin.testing.simcluster import available
from tests.zygote import interpreter, start_preloaded  # (the tests start their Python with it)

ROOT = Path(__file__).resolve().parents[1]
WORKERS = ROOT / "tests" / "workers"

FULL_MATRIX_ENV = "DDP_PLUGIN_FULL_MATRIX"
"""Set to 1 (or ``pytest --full-matrix``): the matrices the suite covers pairwise (every pair of two factors' values
in some case, :func:`ddp_plugin.testing.pairwise.covering_pairs`) run every combination instead."""


def matrix(pairwise: list, full: list) -> list:
    """The cases a matrix test runs: ``full`` with ``--full-matrix``, else ``pairwise``."""
    return full if os.environ.get(FULL_MATRIX_ENV, "0") == "1" else pairwise


_cluster_ok, _cluster_reason = available()
needs_cluster = pytest.mark.skipif(not _cluster_ok, reason=_cluster_reason)


def run_python(*args: str | os.PathLike, timeout: float = 300, env: dict[str, str] | None = None,
               check: bool = True, cwd: str | os.PathLike | None = None,
               pythonpath: Iterable[str | os.PathLike] = ()) -> subprocess.CompletedProcess:
    """Run ``python *args`` in a fresh process (Lightning's launcher re-executes the command line per rank,
    which must not be pytest), without the rendezvous variables of any run around it (``env`` may set them),
    with the folders ``pythonpath`` in front of the inherited ``PYTHONPATH``.
    Fails the test with the output when the command fails or hangs."""
    executable = interpreter()
    full_env = clean_env({"PYTHONUNBUFFERED": "1", **(env or {})})
    paths = [*map(str, pythonpath), full_env.get("PYTHONPATH", "")]
    if pythonpath:
        full_env["PYTHONPATH"] = os.pathsep.join(filter(None, paths))
    start_preloaded(full_env)  # (a run with the heap tracker preloaded: forked from a zygote that has it)
    try:
        proc = subprocess.run([executable, *map(str, args)], capture_output=True, text=True, timeout=timeout,
                              env=full_env, cwd=cwd or ROOT)
    except subprocess.TimeoutExpired as err:
        pytest.fail(f"`{' '.join(map(str, args))}` did not finish in {timeout} s:\n{err.stdout}\n{err.stderr}")
    if check and proc.returncode != 0:
        # Where several ranks fail, the first one's cause is often far above the tail: every distinct error line.
        errors = list(dict.fromkeys(line for line in proc.stderr.splitlines()
                                    if re.search(r"\b\w*(Error|Exception)\b:", line)))
        pytest.fail(f"`{' '.join(map(str, args))}` exited with {proc.returncode}:\n{proc.stdout}\n"
                    f"{proc.stderr[-8000:]}\n\nerror lines:\n" + "\n".join(errors[:40]))
    return proc


def relative_difference(a: dict, b: dict) -> float:
    """Max over tensors of the largest difference over the tensor's largest value (same keys in both)."""
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).abs().max() / b[k].abs().max()) for k in a)
