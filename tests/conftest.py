from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from ddp_plugin.testing.simcluster import SimulatedCluster, available

_cluster_ok, _cluster_reason = available()
needs_cluster = pytest.mark.skipif(not _cluster_ok, reason=_cluster_reason)


@pytest.fixture(scope="module")
def cluster():
    """Two simulated nodes (network namespaces) joined by a 1 Gbit/s link, torn down after the module."""
    with SimulatedCluster(nodes=2, rate="1gbit") as c:
        yield c


ROOT = Path(__file__).resolve().parents[1]
WORKERS = ROOT / "tests" / "workers"


def run_python(*args: str | os.PathLike, timeout: float = 300, env: dict[str, str] | None = None,
               check: bool = True, cwd: str | os.PathLike | None = None) -> subprocess.CompletedProcess:
    """Run ``python *args`` in a fresh process (Lightning's launcher re-executes the command line per rank,
    which must not be pytest). Fails the test with the output when the command fails or hangs."""
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    for var in ("MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK", "NODE_RANK", "WORLD_SIZE", "RANK"):
        if env is None or var not in env:
            full_env.pop(var, None)
    try:
        proc = subprocess.run([sys.executable, *map(str, args)], capture_output=True, text=True, timeout=timeout,
                              env=full_env, cwd=cwd or ROOT)
    except subprocess.TimeoutExpired as err:
        pytest.fail(f"`{' '.join(map(str, args))}` did not finish in {timeout} s:\n{err.stdout}\n{err.stderr}")
    if check and proc.returncode != 0:
        pytest.fail(f"`{' '.join(map(str, args))}` exited with {proc.returncode}:\n{proc.stdout}\n{proc.stderr[-8000:]}")
    return proc
