"""The benchmark scripts' command lines: every script under benchmarks/ answers ``--help`` with its usage and
exits 0 (argparse formats help strings with ``%``, so a literal percent sign in one breaks ``--help`` only)."""

from __future__ import annotations

import json
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


def test_gpu_check_runs_on_cpu_ranks(tmp_path) -> None:
    # benchmarks/gpu_check.py is written for 2+ GPUs (NCCL); here a small subset on 2 gloo ranks checks that its
    # launches, comparisons and fault watch work: a parity case per kind of check (exact, a codec, a layout), a
    # short overlap measurement (its threshold out of the way: timings on a busy 2-core machine prove nothing) and
    # the kill of rank 1.
    from tests.support import run_python

    out = tmp_path / "report.json"
    proc = run_python(ROOT / "benchmarks" / "gpu_check.py", "--accelerator", "cpu", "--devices", "2",
                      "--cases", "default,int8,pp2", "--steps", "6", "--overlap-steps", "3", "--overlap-warmup", "1",
                      "--overlap-hidden", "64", "--overlap-layers", "1", "--repeats", "1",
                      "--overlap-max-ratio", "1000", "--timeout", "8", "--out", out, timeout=600)
    report = json.loads(out.read_text())
    assert report["result"] == "PASS", proc.stdout[-4000:]
    status = {f"{c['section']}/{c['name']}": c["status"] for c in report["checks"]}
    assert status == {**{f"parity/{c}": "PASS" for c in ("ddp", "default", "int8", "pp2")},
                      "overlap/measured": "PASS", "overlap/vs ddp": "PASS", "kill/exit code": "PASS",
                      "kill/names the dead rank": "PASS", "kill/time to fail": "PASS"}, proc.stdout[-4000:]
    assert report["sections"]["parity"]["cases"]["default"]["max_abs_diff"] <= 1e-5
    assert report["sections"]["kill"]["dead_rank"] == 1 and set(report["sections"]["kill"]["survivors"]) == {"0"}
    assert "gpu_check: 9 passed, 0 failed, 0 skipped" in proc.stdout
