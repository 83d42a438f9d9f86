"""The benchmark scripts' command lines: every script under benchmarks/ answers ``--help`` with its usage and
exits 0 (argparse formats help strings with ``%``, so a literal percent sign in one breaks ``--help`` only); and
what of benchmarks/regression.py needs no cluster: its arguments, the last release found in the history, the run
order, the package pinned to a worktree, the comparison table."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = sorted((ROOT / "benchmarks").glob("*.py"))
CONVERGENCE = ROOT / "benchmarks" / "convergence.py"


def run_script(script: Path, *args: str) -> subprocess.CompletedProcess:
    # (forked from the worker's zygote, torch and Lightning imported: a fresh interpreter spent 3-5 s of CPU on
    # imports to print a usage line)
    from tests.support import interpreter

    return subprocess.run([interpreter(), str(script), *args], cwd=ROOT, capture_output=True, text=True, check=False,
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


# ---------------------------------------------------------------------- benchmarks/regression.py (no cluster launched)

RELEASE_0_1_0 = "7dfb8a6e5de9cd22fcea0678b2e3822ce484a0b1"  # the last commit of 2026-11-24, the 0.1.0 heading's date
HISTORY_AT = "27025604307f2a74ef015ef49719e02bd221a78e"  # a commit whose newest release heading is 0.1.0


def benchmark_module(name: str):
    """benchmarks/<name>.py as a module (it may import benchmarks/cluster.py beside it); sys.path as before."""
    import importlib

    saved = list(sys.path)
    try:
        sys.path.insert(0, str(ROOT / "benchmarks"))
        return importlib.import_module(name)
    finally:
        sys.path[:] = saved


@pytest.fixture(scope="module")
def regression():
    return benchmark_module("regression")


def _has_commit(commit: str) -> bool:
    return subprocess.run(["git", "cat-file", "-e", f"{commit}^{{commit}}"], cwd=ROOT, capture_output=True).returncode == 0


def test_regression_refuses_an_unknown_contender(regression, capsys) -> None:
    with pytest.raises(SystemExit) as e:
        regression.parse_args(["--contenders", "ours_hier,bogus", "--base", "HEAD"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "regression.py: error: unknown contender(s) bogus" in err


@pytest.mark.parametrize("side", ["base", "head"])
def test_regression_names_a_bad_revision(regression, capsys, side: str) -> None:
    with pytest.raises(SystemExit) as e:
        regression.parse_args([f"--{side}", "no-such-rev", *(["--base", "HEAD"] if side == "head" else [])])
    assert e.value.code == 2
    assert f"--{side}: 'no-such-rev' is not a commit of the repository" in capsys.readouterr().err


def test_regression_arguments_keep_cluster_pys_rules(regression) -> None:
    args = regression.parse_args(["--base", "HEAD", "--contenders", "ours_hier,ours_zero3"])
    assert args.contenders == ["lightning_ddp", "ours_hier", "ours_zero3"]  # the reference always runs, first
    assert args.optimizer == "adamw"  # a ZeRO contender switches every run to AdamW, as in cluster.py
    assert args.revisions["base"]["commit"] == args.revisions["head"]["commit"]
    default = regression.parse_args(["--base", "HEAD"])
    assert default.contenders == list(regression.DEFAULT_CONTENDERS) and default.optimizer == "sgd"
    assert default.out == ROOT / "benchmarks" / "results" / "regression.md"


@pytest.mark.skipif(not _has_commit(HISTORY_AT), reason="a shallow clone: the release's history is not here")
def test_regression_default_base_is_the_last_release(regression) -> None:
    # CHANGELOG's 0.1.0 heading (dated 2026-11-24) was added on 2026-11-27 (f3ebf7e), 191 commits later: the
    # release is the last commit of its date, not that one.
    release = regression.last_release(HISTORY_AT)
    assert (release["version"], release["date"], release["commit"]) == ("0.1.0", "2026-11-24", RELEASE_0_1_0)
    assert "2026-11-24" in release["how"] and "f3ebf7e" in release["how"]
    args = regression.parse_args([])
    assert args.revisions["base"]["commit"] == regression.last_release()["commit"]
    assert args.revisions["head"]["commit"] == regression.resolve("HEAD")["commit"]
    assert "the default, release" in args.revisions["base"]["chosen"]


def test_last_release_rules_on_a_small_history(regression, tmp_path) -> None:
    def git(*argv: str, day: str | None = None) -> str:
        env = {"GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@t",
               "HOME": str(tmp_path), "PATH": "/usr/bin:/bin:/usr/local/bin"}
        if day:
            env["GIT_AUTHOR_DATE"] = env["GIT_COMMITTER_DATE"] = f"{day}T12:00:00+00:00"
        return subprocess.run(["git", *argv], cwd=tmp_path, env=env, capture_output=True, text=True,
                              check=True).stdout.strip()

    def commit(day: str, changelog: str) -> str:
        (tmp_path / "CHANGELOG.md").write_text(changelog)
        git("add", "CHANGELOG.md")
        git("commit", "-q", "--allow-empty", "-m", day, day=day)
        return git("rev-parse", "HEAD")

    git("init", "-q")
    commit("2026-01-01", "# Changelog\n\n## [Unreleased]\n")
    added_the_same_day = commit("2026-01-02", "# Changelog\n\n## [Unreleased]\n\n## [1.0.0] - 2026-01-02\n")
    assert regression.last_release(repo=tmp_path)["commit"] == added_the_same_day
    released = commit("2026-02-01", "# Changelog\n\n## [Unreleased]\n- more\n\n## [1.0.0] - 2026-01-02\n")
    commit("2026-02-03", "# Changelog\n\n## [Unreleased]\n\n## [1.1.0] - 2026-02-01\n- more\n\n## [1.0.0] - 2026-01-02\n")
    later = regression.last_release(repo=tmp_path)
    assert (later["version"], later["commit"]) == ("1.1.0", released), later
    git("tag", "v1.1.0", added_the_same_day)
    assert regression.last_release(repo=tmp_path) == {"version": "1.1.0", "date": "2026-02-01",
                                                     "commit": added_the_same_day, "how": "the tag v1.1.0"}
    (tmp_path / "CHANGELOG.md").write_text("# Changelog\n\n## [Unreleased]\n")
    git("commit", "-q", "-am", "no release", day="2026-03-01")
    with pytest.raises(LookupError, match="no release heading"):
        regression.last_release(repo=tmp_path)


def test_regression_interleaves_the_commits(regression) -> None:
    assert regression.schedule(["ddp", "hier"], 2) == [
        (0, "ddp", "base"), (0, "ddp", "head"), (0, "hier", "head"), (0, "hier", "base"),
        (1, "ddp", "head"), (1, "ddp", "base"), (1, "hier", "base"), (1, "hier", "head")]


def test_regression_checks_where_the_ranks_imported_from(regression, tmp_path) -> None:
    tree, records = tmp_path / "base", tmp_path / "records"
    records.mkdir()
    for pid, rank, where in ((1, "0", tree), (2, "1", tree), (3, None, tmp_path / "elsewhere")):
        (records / f"{pid}.json").write_text(json.dumps({
            "pid": pid, "rank": rank, "ddp_plugin": str(where / "ddp_plugin" / "__init__.py"),
            "ddp_plugin.hookspecs": str(where / "hookspecs" / "__init__.py")}))
    found = regression.check_imports(records, tree)  # the launcher (no RANK) does not count
    assert found == {"ranks": 2, "outside": [], "files": {"ddp_plugin": ["ddp_plugin/__init__.py"],
                                                          "ddp_plugin.hookspecs": ["hookspecs/__init__.py"]}}
    (records / "4.json").write_text(json.dumps({"pid": 4, "rank": "2", "ddp_plugin": "/work/main/ddp_plugin/__init__.py",
                                                "ddp_plugin.hookspecs": "/work/main/hookspecs/__init__.py"}))
    assert regression.check_imports(records, tree)["outside"] == ["/work/main/ddp_plugin/__init__.py",
                                                                  "/work/main/hookspecs/__init__.py"]


def test_regression_sitecustomize_pins_the_package_to_the_worktree(regression, tmp_path) -> None:
    # A stand-in worktree; the venv's editable install (if any) maps ddp_plugin.hookspecs to this checkout's
    # hookspecs/, which PYTHONPATH alone does not override.
    tree, boot, records = tmp_path / "tree", tmp_path / "boot", tmp_path / "records"
    for folder in (tree / "ddp_plugin", tree / "hookspecs", boot, records):
        folder.mkdir(parents=True)
    (tree / "ddp_plugin" / "__init__.py").write_text("import ddp_plugin.hookspecs\n")
    (tree / "hookspecs" / "__init__.py").write_text("")
    (tree / "hookspecs" / "hooks.py").write_text("")
    (boot / "sitecustomize.py").write_text(regression.SITECUSTOMIZE)
    env = {**os.environ, "PYTHONPATH": f"{boot}{os.pathsep}{tree}", "RANK": "3", regression.TREE_ENV: str(tree),
           regression.IMPORTS_ENV: str(records)}
    # Run from the checkout, whose ddp_plugin/ is first on sys.path for `-c`: the worktree's still wins.
    code = "import ddp_plugin.hookspecs.hooks as h, ddp_plugin; print(ddp_plugin.__file__); print(h.__file__)"
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == [str(tree / "ddp_plugin" / "__init__.py"), str(tree / "hookspecs" / "hooks.py")]
    assert regression.check_imports(records, tree) == {
        "ranks": 1, "outside": [], "files": {"ddp_plugin": ["ddp_plugin/__init__.py"],
                                             "ddp_plugin.hookspecs": ["hookspecs/__init__.py"]}}


def _fake_run(side: str, name: str, step_s: float, rss_mb: float = 900.0, tx_mb: float = 46.5,
              error: str | None = None) -> dict:
    """One launch as cluster.run_one returns it (4 ranks on 2 nodes, 4 timed steps), with the imports check."""
    imports = {"ranks": 4, "outside": [], "files": {"ddp_plugin": ["ddp_plugin/__init__.py"],
                                                    "ddp_plugin.hookspecs": ["hookspecs/__init__.py"]}}
    run = {"side": side, "contender": name, "commit": side[:4], "index": 0, "wall_s": 30.0, "imports": imports}
    if error is not None:
        return {**run, "name": name, "error": error, "log": ""}
    ranks = [{"rank": r, "node": r // 2, "step_s": [step_s] * 4, "timed_steps": 4, "grad_bytes": 46_360_000,
              "params": 11_590_000, "losses": [2.3, 2.29], "maxrss_mb": rss_mb - r,
              **({"tx_bytes": tx_mb * 4e6, "rx_bytes": tx_mb * 4e6} if r % 2 == 0 else {})} for r in range(4)]
    return {**run, "name": name, "ranks": ranks}


def _table(regression, runs: list[dict], contenders: list[str], repeats: int = 1) -> tuple[list[dict], str]:
    import argparse

    revisions = {side: {"rev": side, "commit": f"{side}0" * 8, "short": f"{side}0", "subject": f"the {side}",
                        "chosen": f"`--{side} x`"} for side in ("base", "head")}
    args = argparse.Namespace(contenders=contenders, nodes=2, nproc_per_node=2, rate="1gbit", warmup=3, steps=4,
                              repeats=repeats, optimizer="sgd", revisions=revisions)
    info = {"command": "python benchmarks/regression.py", "date": "2026-12-01 10:00 UTC", "wall_s": 600.0,
            "host": "bench", "cpu": "a CPU", "cores": 2, "memory_gib": 8.0, "platform": "Linux", "python": "3.11",
            "torch": "2.9", "lightning": "2.6", "revision": "commit head0, no uncommitted changes", "load_start": 0.1,
            "load_end": 1.9, "quiet": True, "dirty": []}  # (harness.Run.info(), and the checkout's dirty files)
    entries = regression.compare(args, runs)
    return entries, regression.write_markdown(args, info, runs, entries)


def test_regression_table_flags_a_slower_head(regression) -> None:
    runs = [_fake_run("base", "lightning_ddp", 0.70), _fake_run("head", "lightning_ddp", 0.71),
            _fake_run("base", "ours_hier", 0.60), _fake_run("head", "ours_hier", 0.66),
            _fake_run("base", "ours_hier_int8", 0.44), _fake_run("head", "ours_hier_int8", 0.44, rss_mb=1000.0)]
    entries, text = _table(regression, runs, ["lightning_ddp", "ours_hier", "ours_hier_int8"])
    by = {e["name"]: e for e in entries}
    assert by["ours_hier"]["step_ratio"] == pytest.approx(1.1) and by["ours_hier"]["threshold"] == 0.05
    assert by["ours_hier"]["flags"] == ["step 1.100x base (1.085x against each commit's ddp), beyond 1 + 0.050"]
    assert by["ours_hier_int8"]["flags"] == ["peak RSS 1.111x base (+100 MB)"]
    assert not by["lightning_ddp"]["flags"]
    assert by["ours_hier"]["head"]["ratio_to_ddp"] == pytest.approx(0.66 / 0.71)  # against its own commit's ddp
    row = next(line for line in text.splitlines() if line.startswith("| ours, hierarchical |"))
    assert "| 0.600 / 0.660 | 0.857 / 0.930 | **1.100** | 46.50 / 46.50 | 900 / 900 | 2.29000 / 2.29000 |" in row
    assert "**Flagged**" in text and "ours_hier: step 1.100x base" in text and "ours_hier_int8: peak RSS" in text


def test_regression_table_no_flag_within_the_runs_spread(regression) -> None:
    # head 8 % slower, but base's two runs lay 12 % apart: within the noise.
    runs = [_fake_run(side, "lightning_ddp", 0.70) for side in ("base", "head") for _ in range(2)]
    runs += [_fake_run("base", "ours_hier", 0.56), _fake_run("base", "ours_hier", 0.63),
             _fake_run("head", "ours_hier", 0.64), _fake_run("head", "ours_hier", 0.65)]
    entries, text = _table(regression, runs, ["lightning_ddp", "ours_hier"], repeats=2)
    hier = entries[1]
    assert hier["threshold"] == pytest.approx(0.07 / 0.595) and hier["step_ratio"] == pytest.approx(0.645 / 0.595)
    assert hier["flags"] == [] and "No row flagged" in text and "**Flagged**" not in text
    assert "| ours, hierarchical | 0.560, 0.630 | 0.640, 0.650 | 0.118 / 0.016 | 0.118 |" in text


def test_regression_table_shows_a_failed_cell(regression) -> None:
    unknown = "the worker at base0 has no contender 'ours_auto'"
    runs = [_fake_run("base", "lightning_ddp", 0.70), _fake_run("head", "lightning_ddp", 0.70),
            _fake_run("base", "ours_auto", 0.0, error=unknown), _fake_run("head", "ours_auto", 0.45),
            _fake_run("base", "ours_hier", 0.60), _fake_run("head", "ours_hier", 0.0, error="exit codes [1, 1]")]
    entries, text = _table(regression, runs, ["lightning_ddp", "ours_auto", "ours_hier"])
    by = {e["name"]: e for e in entries}
    assert by["ours_auto"]["flags"] == [] and by["ours_auto"]["notes"] == ["runs at head only"]
    assert by["ours_hier"]["flags"] == ["fails at head, ran at base"]
    auto = next(line for line in text.splitlines() if line.startswith("| ours, `compression=\"auto\"`"))
    assert f"| failed: {unknown} / 0.450 |" in auto
    assert "| 0.600 / failed: exit codes [1, 1] |" in text
    assert "## Failed runs" in text and "ours_hier: fails at head, ran at base" in text


@pytest.fixture(scope="module")
def profile_step():
    return benchmark_module("profile_step")


SITE = "/venv/lib/python3.11/site-packages"
LOOP = (f"Trainer.fit ({SITE}/lightning/pytorch/trainer/trainer.py:584);"
        f"_TrainingEpochLoop.advance ({SITE}/lightning/pytorch/loops/training_epoch_loop.py:300)")
COMM = ("Thread._bootstrap (/usr/lib/python3.11/threading.py:1002);Thread.run (/usr/lib/python3.11/threading.py:982);"
        "SideThread._run (/r/ddp_plugin/runtime/streams.py:103);GradientEngine._reduce (/r/ddp_plugin/gradients/engine.py:306)")


@pytest.mark.parametrize(("thread", "stack", "category"), [
    # The training thread waiting for the comm thread at the end of backward: a wait of that stage.
    ("MainThread", f"{LOOP};backward ({SITE}/torch/autograd/__init__.py:395);_engine_run_backward ({SITE}/torch/autograd/graph.py:979);"
     "GradientEngine.finish (/r/ddp_plugin/gradients/engine.py:366);wait (/r/ddp_plugin/health/watch.py:147);"
     "Event.wait (/usr/lib/python3.11/threading.py:629)", "end of backward: the last buckets: waiting"),
    # A grad hook copying into a bucket inside autograd: the hook's stage, not autograd's.
    ("MainThread", f"{LOOP};_engine_run_backward ({SITE}/torch/autograd/graph.py:979);"
     "GradientEngine._make_grad_hook.<locals>.on_grad_accumulated (/r/ddp_plugin/gradients/engine.py:243)",
     "backward hooks: bucket copies, launches: computing"),
    ("MainThread", f"{LOOP};_TrainingEpochLoop._broadcast_sigterm_tensor ({SITE}/lightning/pytorch/loops/training_epoch_loop.py:265);"
     f"broadcast ({SITE}/torch/distributed/distributed_c10d.py:3151)", "Lightning's per-step SIGTERM broadcast: waiting"),
    ("MainThread", f"{LOOP};Adam.step ({SITE}/torch/optim/adam.py:248);_single_tensor_adam ({SITE}/torch/optim/adam.py:528)",
     "optimizer step: computing"),
    # The codec's arithmetic and its collectives: the cross-node stage, computing and waiting.
    ("ddp_plugin-comm", f"{COMM};HierarchicalReducer.reduce_to_shard (/r/ddp_plugin/plugins/hierarchical_reducer.py:76);"
     "Codec.on_cross_node_reduce (/r/ddp_plugin/codecs/base.py:128);Int8Codec.reduce (/r/ddp_plugin/codecs/int8.py:188);"
     "quantize_into (/r/ddp_plugin/codecs/int8.py:266)", "cross-node reduce (the codec, or the plain all-reduce): computing"),
    ("ddp_plugin-comm", f"{COMM};HierarchicalReducer.reduce_to_shard (/r/ddp_plugin/plugins/hierarchical_reducer.py:76);"
     "Codec.on_cross_node_reduce (/r/ddp_plugin/codecs/base.py:128);Int8Codec.reduce (/r/ddp_plugin/codecs/int8.py:230);"
     "_Works.wait (/r/ddp_plugin/runtime/comm.py:244)", "cross-node reduce (the codec, or the plain all-reduce): waiting"),
    ("ddp_plugin-comm", f"{COMM};HierarchicalReducer.reduce_to_shard (/r/ddp_plugin/plugins/hierarchical_reducer.py:75);"
     "TracedCommunicator.reduce_scatter (/r/ddp_plugin/runtime/comm.py:142);"
     f"all_to_all_single ({SITE}/torch/distributed/distributed_c10d.py:5140)", "in-node reduce-scatter: waiting"),
    # The adds of the reduce-scatter are its computing (comm.py itself is not a wait; only its _Works.wait is).
    ("ddp_plugin-comm", f"{COMM};HierarchicalReducer.reduce_to_shard (/r/ddp_plugin/plugins/hierarchical_reducer.py:75);"
     "TracedCommunicator.reduce_scatter (/r/ddp_plugin/runtime/comm.py:144)", "in-node reduce-scatter: computing"),
    ("ddp_plugin-comm", "Thread.run (/usr/lib/python3.11/threading.py:982);SideThread._run (/r/ddp_plugin/runtime/streams.py:93)",
     "waiting for a bucket (idle)"),
    # Lightning's forward and backward run inside optimizer.step(closure): they are not the optimizer's.
    ("MainThread", f"{LOOP};Adam.step ({SITE}/torch/optim/adam.py:248);Closure.closure ({SITE}/lightning/pytorch/loops/optimization/automatic.py:131);"
     f"_engine_run_backward ({SITE}/torch/autograd/graph.py:979)", "backward (autograd): computing"),
    # The benchmark's own profiler start and barriers are outside the window.
    ("MainThread", f"{LOOP};Window.start (/r/benchmarks/cluster_worker.py:238);start_profiler (/r/benchmarks/cluster_worker.py:204)",
     None),
    ("MainThread", f"{LOOP};LightningModule.log ({SITE}/lightning/pytorch/core/module.py:400)",
     "other: Lightning's loop, callbacks, the rest: computing"),
])
def test_profile_step_puts_each_sample_in_its_stage(profile_step, thread, stack, category) -> None:
    name, frames = profile_step._frames(f"thread (123): {thread};{stack}")
    assert name == thread
    found = profile_step.classify(frames, thread)
    assert (found is None) if category is None else found.startswith(category), found


def test_profile_step_reads_a_wait_in_our_frame_from_its_source_line(profile_step, tmp_path) -> None:
    """A future's ``wait()`` is C++: the sample's innermost Python frame is ours, and its source line says it waits
    (the hierarchical reducer waiting for the cross-node reduce it launched)."""
    source = tmp_path / "hierarchical_reducer.py"
    source.write_text("def reduce_to_shard():\n    shard.add_(1)\n    fut.wait()\n")
    stack = (f"thread (1): ddp_plugin-comm;{COMM};HierarchicalReducer.reduce_to_shard ({source}:%d)")
    for line, category in [(3, "cross-node reduce (the codec, or the plain all-reduce): waiting"),
                           (2, "in-node reduce-scatter: computing")]:
        thread, frames = profile_step._frames(stack % line)
        assert profile_step.classify(frames, thread).startswith(category)


def test_profile_step_sums_a_ranks_file_per_thread_and_step(profile_step, tmp_path) -> None:
    raw = tmp_path / "rank0.txt"
    raw.write_text(f"thread (1): MainThread;{LOOP};Adam.step ({SITE}/torch/optim/adam.py:248) 30\n"
                   f"thread (1): MainThread;{LOOP};Adam.step ({SITE}/torch/optim/adam.py:250) 10\n"
                   f"thread (2): ddp_plugin-comm;Thread.run (/usr/lib/python3.11/threading.py:982);"
                   "SideThread._run (/r/ddp_plugin/runtime/streams.py:93) 60\n")
    split = profile_step.seconds_per_step([profile_step.read_profile(raw)], rate=100, steps=4)
    assert split["MainThread"] == {"optimizer step: computing": pytest.approx(0.1)}
    assert split["ddp_plugin-comm"] == {"waiting for a bucket (idle)": pytest.approx(0.15)}


def test_the_cluster_benchmark_shows_each_runs_plan_and_whether_it_is_the_first_runs():
    cluster = benchmark_module("cluster")
    plan = {"version": 1, "decisions": {"b0": ["hierarchical", "int8"], "b1": ["flat", "int8"]}, "peak_rss_mb": 612.4,
            "links": {"world/int8": {"latency_ms": 5.534, "MB_per_s": 218.2}}}
    other = {"version": 2, "decisions": {"b0": ["flat", "int8"], "b1": ["flat", "int8"]}, "peak_rss_mb": 700.0,
             "reasons": ["flat+int8 9.0 ms against hierarchical+int8 20.0 ms a rank and step (buckets b0): flat+int8"]}
    lines = cluster._plans_section([{"label": "ours, int8", "plans": [plan, plan, other]}, {"label": "ddp"}])
    rows = [line for line in lines if line.startswith("| ours, int8 |")]
    assert len(rows) == 3 and not any(line.startswith("| ddp") for line in lines)
    # (the probe's fits: latency ms / MB/s per stage, "-" for a plan recorded without them)
    assert rows[0] == ("| ours, int8 | 1 | 1 | b0 hierarchical / int8, b1 flat / int8 | yes | none | 612"
                       " | world/int8 5.53 / 218 |")
    assert rows[1].endswith("| yes | none | 612 | world/int8 5.53 / 218 |")
    assert rows[2] == ("| ours, int8 | 3 | 2 | b0 flat / int8, b1 flat / int8 | **no** | flat+int8 9.0 ms against"
                       " hierarchical+int8 20.0 ms a rank and step (buckets b0): flat+int8 | 700 | - |")
