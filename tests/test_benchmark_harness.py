"""benchmarks/harness.py, what every benchmark writes with: the header names the machine, the software and the
commit (and says when the checkout changed or the machine was busy), the table writer's markdown, the shared
options' checks, and a launch's record (no cluster, no ranks: a stand-in cluster and a tiny process)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def harness():
    import importlib

    saved = list(sys.path)
    try:
        sys.path.insert(0, str(ROOT / "benchmarks"))
        return importlib.import_module("harness")
    finally:
        sys.path[:] = saved


def test_the_header_names_the_machine_and_the_commit(harness) -> None:
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                            check=True).stdout.strip()
    run = harness.Run("cluster.py", ["--rate", "100mbit", "--out", "/tmp/a b.md"], quiet=True, ranks=4)
    text = "\n".join(run.header())
    machine = harness.machine()
    assert "- command: `python benchmarks/cluster.py --rate 100mbit --out '/tmp/a b.md'`" in text
    assert f"- machine: {machine['host']}, {machine['cpu']}, {machine['cores']} CPU cores shared by the 4 ranks" in text
    assert f"torch {machine['torch']}, lightning {machine['lightning']}" in text
    assert f"- checkout: commit {commit}" in text
    assert "nothing else ran on the machine (`--quiet`)" in text and "UTC" in text


def test_the_header_says_what_changed_and_how_busy(harness) -> None:
    info = {"command": "python benchmarks/x.py", "date": "2026-12-01 10:00 UTC", "wall_s": 61.0, "host": "bench",
            "cpu": "a CPU", "cores": 2, "memory_gib": 8.0, "platform": "Linux", "python": "3.11", "torch": "2.9",
            "lightning": "2.6", "revision": "commit abc, no uncommitted changes", "load_start": 1.5, "load_end": 0.2,
            "quiet": False}
    lines = harness.header_lines(info)
    assert lines[1] == "- date: 2026-12-01 10:00 UTC; 61 s in all"
    assert "CHANGED" not in "\n".join(lines) and "**busy at the start**" in lines[-1]
    assert "not declared quiet" in lines[-1]
    changed = harness.header_lines({**info, "revision_end": "commit abd, no uncommitted changes", "load_start": 0.1})
    assert changed[4].endswith("**CHANGED during the run**, at its end: commit abd, no uncommitted changes")
    assert "busy" not in changed[-1]


def test_the_table_writer(harness) -> None:
    lines = harness.table(["contender", "s/step", "note"], [["ddp", 0.5, "fine"], ["ours", "failed: boom"]], "lrl")
    assert lines == ["| contender | s/step | note |", "|---|---:|---|", "| ddp | 0.5 | fine |",
                     "| ours | failed: boom | |"]
    assert harness.cell("a | b\n c") == "a \\| b c" and harness.cell("x" * 10, 6) == "xxx..."
    assert harness.fmt(None, ".2f") == "-" and harness.fmt(1.234, ".2f") == "1.23"


def test_shared_options(harness, capsys) -> None:
    p = harness.parser("The doc's first line.\n\nMore.")
    harness.add_names(p, "--contenders", ["a", "b"], ["a"])
    harness.add_common(p, out=harness.RESULTS / "x.md", repeats=2, keep=True)
    args = p.parse_args(["--contenders", "b, a", "--quiet"])
    assert harness.names(p, args.contenders, ["a", "b"]) == ["b", "a"]
    assert (args.out, args.repeats, args.keep, args.quiet) == (harness.RESULTS / "x.md", 2, False, True)
    assert harness.forward(SimpleNamespace(d_model=384, steps=8), "d_model", "steps") == ["--d-model", "384",
                                                                                          "--steps", "8"]
    with pytest.raises(SystemExit):
        harness.names(p, "a,c", ["a", "b"])
    assert "unknown contender(s) c; choose from a, b" in capsys.readouterr().err


def test_launch_ranks_reads_the_ranks_or_names_the_error(harness, tmp_path) -> None:
    class Cluster:  # the simulated cluster's launch(), standing in: its ranks write their records
        nodes = 2

        def __init__(self, records: list[dict], code: int = 0) -> None:
            self.records, self.code = records, code

        def launch(self, argv, nproc_per_node, env, timeout):
            assert env["OMP_NUM_THREADS"] == "1" and env["X"] == "1"
            for record in self.records:
                harness.write_rank(tmp_path, record["rank"], record)
            return [SimpleNamespace(node=n, ok=self.code == 0, returncode=self.code, timed_out=False, stdout="",
                                    stderr=f"node {n} said so") for n in range(self.nodes)]

    ok = harness.launch_ranks(Cluster([{"rank": r, "v": r} for r in (2, 0, 3, 1)]), ["w.py"], nproc_per_node=2,
                              out_dir=tmp_path, timeout=10, env={"X": "1"})
    assert [r["rank"] for r in ok["ranks"]] == [0, 1, 2, 3] and "error" not in ok
    for f in tmp_path.glob("rank*.json"):
        f.unlink()
    bad = harness.launch_ranks(Cluster([{"rank": 0, "error": "ValueError: no"}], code=1), ["w.py"], nproc_per_node=2,
                               out_dir=tmp_path, timeout=10, env={"X": "1"})
    assert bad["error"] == "ValueError: no" and "node 1 said so" in bad["log"]
    assert json.loads((tmp_path / "rank0.json").read_text())["error"] == "ValueError: no"


def test_run_local_records_the_exit_and_the_log(harness, tmp_path) -> None:
    done = harness.run_local([sys.executable, "-c", "import os; print(os.environ['OMP_NUM_THREADS']); raise SystemExit(3)"],
                             env=harness.RANK_ENV)
    assert (done.returncode, done.log.strip()) == (3, "1")
    with pytest.raises(SystemExit, match="the thing failed with exit code 3"):
        done.check("the thing")
    slow = harness.run_local([sys.executable, "-c", "import time; time.sleep(60)"], log=tmp_path / "log", timeout=0.5)
    assert slow.returncode is None and slow.wall_s < 30
