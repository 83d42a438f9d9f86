"""The benchmark scripts' command lines: every script under benchmarks/ answers ``--help`` with its usage and
exits 0 (argparse formats help strings with ``%``, so a literal percent sign in one breaks ``--help`` only)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = sorted((ROOT / "benchmarks").glob("*.py"))
CONVERGENCE = ROOT / "benchmarks" / "convergence.py"


def run_script(script: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(script), *args], cwd=ROOT, capture_output=True, text=True, check=False,
                          timeout=600)


def test_every_benchmark_script_is_listed() -> None:
    assert {p.name for p in SCRIPTS} >= {"cluster.py", "convergence.py", "faults.py", "fault_worker.py"}


@pytest.mark.parametrize("script", SCRIPTS, ids=[p.stem for p in SCRIPTS])
def test_help(script: Path) -> None:
    proc = run_script(script, "--help")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.startswith("usage:"), proc.stdout[:500]
    assert script.name in proc.stdout.splitlines()[0]


@pytest.mark.parametrize("grid", ["1e-3,abc", "1e-3,0", "1e-3,1e-3"])
def test_convergence_lr_grid_refuses_bad_values(grid: str) -> None:
    proc = run_script(CONVERGENCE, "--lr", grid)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "--lr takes" in proc.stderr and repr(grid) in proc.stderr


def test_convergence_run_with_its_own_lr_refuses_a_bad_value() -> None:
    proc = run_script(CONVERGENCE, "--runs", "sync@fast")
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "--runs: 'sync@fast'" in proc.stderr
