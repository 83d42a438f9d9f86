"""Lightning conformance: Lightning's own tests, unmodified, with ``hierarchical_zero`` wherever a test builds a
CPU ``DDPStrategy``.

    .venv/bin/python -m pip install -r tests/conformance/requirements.txt   # Lightning's test dependencies
    .venv/bin/python tests/conformance/run.py                               # about an hour on 2 busy cores

Lightning 2.6.5's ``tests/`` are expected at ``../shared/lightning-tests/tests`` relative to the repository root
(``--lightning-tests`` to point elsewhere); without them the run is skipped, saying so. They are used in place,
never copied, and nothing is written into them (no bytecode, no pytest cache; the tests run from a scratch
directory under ``--out``).

1. Collect ``tests_pytorch`` with the plugin :mod:`lightning_swap` and keep the tests whose function or
   parameters mention DDP and that can run on CPU here: CPU tests, and tests written for CUDA GPUs, run on CPU
   (``RunIf(min_cuda_gpus=...)`` lifted, ``accelerator="gpu"`` made ``"cpu"``); tests that also need something
   else (scikit-learn, TensorRT) are left out. Standalone tests (Lightning's launcher re-runs the command line
   per rank) run one per process, the others together.
2. Run them at ZeRO stage 0. A test counts where it built a CPU ``DDPStrategy``, i.e. where ours was swapped in;
   each such test passed, is listed in :mod:`expectations` (it asserts DDP internals, or a known difference,
   with the reason), or is an unexpected failure.
3. Run the tests of ``strategies/`` and ``checkpointing/`` (``--zero-tests``) that ran ``fit`` with our strategy
   at stage 0 (and passed or are listed) at stages 1, 2 and 3 (``fit`` saves checkpoints: ``ModelCheckpoint`` is
   on by default).

Writes ``summary.md`` and ``results.json`` under ``--out`` (and ``--summary`` if given) and exits non-zero when
an applicable test failed without being listed.
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import os
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
# ../shared beside the repository (CI's clone); a git worktree one level further down finds the same folder.
DEFAULT_TESTS = next(
    (c for c in (ROOT.parent / "shared", ROOT.parents[1] / "shared") if (c / "lightning-tests" / "tests").is_dir()),
    ROOT.parent / "shared",
) / "lightning-tests" / "tests"

# A script (`python tests/conformance/run.py`): Python puts this folder first on sys.path, so its neighbours import
# by name, as `-p lightning_swap` does in the pytest processes it starts (PYTHONPATH, below).
from expectations import KNOWN_FAILURES, NOT_APPLICABLE  # noqa: E402

REQUIRED = ("cloudpickle", "tensorboard", "pytest_timeout")


def reason_for(nodeid: str, stage: int, table: dict[str, tuple[str, tuple[int, ...]]]) -> str | None:
    for pattern, (reason, stages) in table.items():
        if stage in stages and fnmatch.fnmatchcase(nodeid, pattern):
            return reason
    return None


class Runner:
    def __init__(self, args: argparse.Namespace) -> None:
        self.tests: Path = args.lightning_tests.resolve()
        self.out: Path = args.out.resolve()
        self.timeout = args.timeout
        self.baseline = args.baseline
        self.work = self.out / "work"
        self.work.mkdir(parents=True, exist_ok=True)
        self.marks = self.out / "marks"
        self.marks.mkdir(exist_ok=True)

    def env(self, **extra: str) -> dict[str, str]:
        if self.baseline:
            extra["DDP_PLUGIN_CONFORMANCE_SWAP"] = "0"
        env = {k: v for k, v in os.environ.items()
               if k not in ("LOCAL_RANK", "NODE_RANK", "WORLD_SIZE", "RANK", "MASTER_ADDR", "MASTER_PORT")
               and not k.startswith("DDP_PLUGIN_CONFORMANCE_")}
        env.update(PYTHONDONTWRITEBYTECODE="1", PYTHONUNBUFFERED="1", DDP_PLUGIN_CONFORMANCE_MARKS=str(self.marks),
                   PYTHONPATH=os.pathsep.join([str(HERE), env.get("PYTHONPATH", "")]).rstrip(os.pathsep))
        env.update(extra)
        return env

    def pytest(self, args: list[str], env: dict[str, str], log: Path, timeout: float) -> int:
        cmd = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-p", "lightning_swap",
               "--rootdir", str(self.tests), "-c", os.devnull, "-q", "-rN", *args]
        with open(log, "a") as f:
            f.write(f"$ {' '.join(cmd)}\n")
            f.flush()
            try:
                return subprocess.run(cmd, cwd=self.work, env=env, stdout=f, stderr=subprocess.STDOUT,
                                      timeout=timeout).returncode
            except subprocess.TimeoutExpired:
                f.write(f"\n!! timed out after {timeout} s\n")
                return -1

    def collect(self) -> list[dict]:
        out = self.out / "collected.json"
        self.pytest(["--collect-only", "--continue-on-collection-errors", str(self.tests / "tests_pytorch")],
                    self.env(DDP_PLUGIN_CONFORMANCE_GPU="1", DDP_PLUGIN_CONFORMANCE_COLLECT=str(out)),
                    self.out / "collect.log", timeout=1800)
        return json.loads(out.read_text())

    def run(self, rows: list[dict], stage: int, tag: str) -> list[dict]:
        """Run ``rows`` at ``stage``: the non-standalone ones together (CPU tests, then CUDA tests on CPU), each
        standalone one in a process of its own. Returns one report row per test."""
        report = self.out / f"report-{tag}.jsonl"
        report.unlink(missing_ok=True)
        (self.out / f"rows-{tag}.json").write_text(json.dumps(rows))
        log = self.out / f"{tag}.log"
        log.unlink(missing_ok=True)
        for cuda in (False, True):
            env = self.env(DDP_PLUGIN_CONFORMANCE_STAGE=str(stage), DDP_PLUGIN_CONFORMANCE_REPORT=str(report),
                           DDP_PLUGIN_CONFORMANCE_GPU="1" if cuda else "0")
            together = [r["nodeid"] for r in rows if r["cuda"] == cuda and not r["standalone"]]
            if together:
                select = self.out / f"select-{tag}-{'cuda' if cuda else 'cpu'}.txt"
                select.write_text("\n".join(together) + "\n")
                files = sorted({str(self.tests / n.split("::")[0]) for n in together})
                self.pytest([f"--timeout={self.timeout}", *files], {**env, "DDP_PLUGIN_CONFORMANCE_SELECT": str(select)},
                            log, timeout=self.timeout * len(together) + 600)
            for r in rows:
                if r["cuda"] == cuda and r["standalone"]:
                    self.pytest([f"--timeout={self.timeout}", str(self.tests / r["nodeid"])],
                                {**env, "PL_RUN_STANDALONE_TESTS": "1"}, log, timeout=self.timeout + 300)
        return self.results(rows, tag)

    def results(self, rows: list[dict], tag: str) -> list[dict]:
        report = self.out / f"report-{tag}.jsonl"
        seen = {}
        if report.exists():
            for line in report.read_text().splitlines():
                row = json.loads(line)
                seen[row["nodeid"]] = row
        results = []
        for r in rows:
            row = seen.get(r["nodeid"], {"nodeid": r["nodeid"], "outcome": "failed", "swapped": True,
                                         "message": "no report: the test's process died or timed out (see the log)"})
            row["cuda"], row["standalone"] = r["cuda"], r["standalone"]
            if self.baseline:
                row["swapped"] = True  # nothing is swapped: every selected test counts, under Lightning's DDP
            results.append(row)
        return results

    def fit_marks(self) -> dict[str, set[str]]:
        marks: dict[str, set[str]] = {}
        for path in self.marks.glob("*.txt"):
            for line in path.read_text().splitlines():
                nodeid, kind = line.split("\t")
                marks.setdefault(nodeid, set()).add(kind)
        return marks


def classify(results: list[dict], stage: int) -> tuple[Counter, list[dict]]:
    counts: Counter = Counter()
    rows = []
    for r in results:
        if not r.get("swapped"):
            counts["no CPU DDPStrategy built"] += 1
            continue
        na = reason_for(r["nodeid"], stage, NOT_APPLICABLE)
        known = reason_for(r["nodeid"], stage, KNOWN_FAILURES)
        if r["outcome"] == "skipped":
            verdict = "skipped"
        elif na:
            verdict = "not applicable"  # whatever the outcome: such a test does not test our strategy
        elif r["outcome"] == "passed":
            verdict = "passed"
        elif known:
            verdict = "failed, listed"
        else:
            verdict = "failed, unlisted"
        counts[verdict] += 1
        rows.append({**r, "verdict": verdict, "reason": na or known or ""})
    return counts, rows


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lightning-tests", type=Path, default=Path(os.environ.get("DDP_PLUGIN_LIGHTNING_TESTS", DEFAULT_TESTS)))
    p.add_argument("--out", type=Path, default=Path(tempfile.gettempdir()) / "ddp_plugin_conformance")
    p.add_argument("--summary", type=Path, default=None, help="also write the summary here")
    p.add_argument("--stages", default="0,1,2,3", help="stage 0 runs every test; 1-3 the fit/checkpoint tests")
    p.add_argument("--only", default=None, help="fnmatch patterns on node ids, comma-separated (a subset)")
    p.add_argument("--baseline", action="store_true",
                   help="run Lightning's own DDPStrategy instead of ours (which tests pass on CPU at all)")
    p.add_argument("--reclassify", action="store_true",
                   help="summarize the run already in --out with the current expectations, running nothing")
    p.add_argument("--timeout", type=float, default=300, help="seconds per test")
    p.add_argument("--zero-tests", default="tests_pytorch/strategies/*,tests_pytorch/checkpointing/*",
                   help="fnmatch patterns (comma-separated) of the fit tests also run at stages 1-3: by default"
                   " Lightning's DDP and checkpoint tests (every fit test takes about an hour per stage here)")
    args = p.parse_args()

    if not (args.lightning_tests / "tests_pytorch").is_dir():
        print(f"Lightning conformance skipped: Lightning's tests are not at {args.lightning_tests} (expected "
              "../shared/lightning-tests/tests beside the repository, or pass --lightning-tests).")
        return 0
    missing = [m for m in REQUIRED if subprocess.run([sys.executable, "-c", f"import {m}"], capture_output=True).returncode]
    if missing:
        print(f"Missing Lightning test dependencies {missing}: run `{sys.executable} -m pip install -r"
              f" {HERE / 'requirements.txt'}`.")
        return 2

    start = time.monotonic()
    runner = Runner(args)
    if args.reclassify:
        return reclassify(runner, args)
    collected = runner.collect()
    candidates = [r for r in collected if r["source_mentions_ddp"] and not r["unmet"]]
    if args.only:
        only = args.only.split(",")
        candidates = [r for r in candidates if any(fnmatch.fnmatchcase(r["nodeid"], p) for p in only)]
    stages = [int(s) for s in args.stages.split(",")]
    report: dict = {"collected": len(collected), "candidates": len(candidates), "phases": {}}

    def write() -> str:
        # After every phase, so that a long run can be read while it goes on.
        report["wall_s"] = round(time.monotonic() - start)
        (args.out / "results.json").write_text(json.dumps(report, indent=1))
        summary = render(report, args)
        (args.out / "summary.md").write_text(summary)
        if args.summary:
            args.summary.write_text(summary)
        return summary

    if 0 in stages:
        stage0 = runner.run(candidates, 0, "stage0")
        for cuda, name in ((False, "CPU tests, stage 0"), (True, "CUDA tests on CPU, stage 0")):
            counts, rows = classify([r for r in stage0 if r["cuda"] == cuda], 0)
            report["phases"][name] = {"counts": dict(counts), "rows": rows}
        write()
    # Stages 1-3: the tests that ran `fit` with our strategy at stage 0 and passed there (or are listed).
    fitted = runner.fit_marks()
    good0 = {r["nodeid"] for ph in report["phases"].values() for r in ph["rows"]
             if r["verdict"] in ("passed", "failed, listed")}
    # Without stage 0 in this run, every selected candidate (those that do not apply fail and are listed).
    zero_patterns = args.zero_tests.split(",")
    fit_rows = [r for r in candidates if (0 not in stages or (r["nodeid"] in good0 and r["nodeid"] in fitted))
                and any(fnmatch.fnmatchcase(r["nodeid"], p) for p in zero_patterns)]
    for stage in (s for s in stages if s > 0):
        results = runner.run(fit_rows, stage, f"stage{stage}")
        counts, rows = classify(results, stage)
        report["phases"][f"fit/checkpoint tests, stage {stage}"] = {"counts": dict(counts), "rows": rows}
        write()
    summary = write()
    print(summary)
    unlisted = sum(ph["counts"].get("failed, unlisted", 0) for ph in report["phases"].values())
    return 1 if unlisted else 0


def reclassify(runner: Runner, args: argparse.Namespace) -> int:
    """The summary of an earlier run in ``--out``, with the current expectations (no test runs)."""
    collected = json.loads((args.out / "collected.json").read_text())
    by_id = {r["nodeid"]: r for r in collected}
    old = json.loads((args.out / "results.json").read_text()) if (args.out / "results.json").exists() else {}
    candidates = sum(1 for r in collected if r["source_mentions_ddp"] and not r["unmet"])
    report: dict = {"collected": len(collected), "candidates": old.get("candidates", candidates), "phases": {}}
    if old.get("phases"):
        # The finished run's rows (tests whose process died have a row there and no report line).
        for name, phase in old["phases"].items():
            stage = int(name.rsplit(" ", 1)[1])
            counts, classified = classify([{k: v for k, v in r.items() if k not in ("verdict", "reason")}
                                           for r in phase["rows"]], stage)
            report["phases"][name] = {"counts": dict(counts), "rows": classified}
    for stage in range(4 if not old.get("phases") else 0):
        tag = f"stage{stage}"
        saved = args.out / f"rows-{tag}.json"
        if saved.exists():
            rows = json.loads(saved.read_text())
        else:
            ids: set[str] = set()
            for path in args.out.glob(f"select-{tag}-*.txt"):
                ids |= set(path.read_text().splitlines())
            report_file = args.out / f"report-{tag}.jsonl"
            if report_file.exists():
                ids |= {json.loads(line)["nodeid"] for line in report_file.read_text().splitlines()}
            rows = [by_id[i] for i in sorted(ids) if i in by_id]
        if not rows:
            continue
        results = runner.results(rows, tag)
        if stage == 0:
            for cuda, name in ((False, "CPU tests, stage 0"), (True, "CUDA tests on CPU, stage 0")):
                counts, classified = classify([r for r in results if r["cuda"] == cuda], 0)
                report["phases"][name] = {"counts": dict(counts), "rows": classified}
        else:
            counts, classified = classify(results, stage)
            report["phases"][f"fit/checkpoint tests, stage {stage}"] = {"counts": dict(counts), "rows": classified}
    report["wall_s"] = old.get("wall_s", 0)
    summary = render(report, args)
    (args.out / "summary.md").write_text(summary)
    if args.summary:
        args.summary.write_text(summary)
    print(summary)
    return 1 if any(ph["counts"].get("failed, unlisted", 0) for ph in report["phases"].values()) else 0


def render(report: dict, args: argparse.Namespace) -> str:
    cols = ["passed", "not applicable", "failed, listed", "failed, unlisted", "skipped"]
    lines = [
        "# Lightning conformance",
        "",
        f"Lightning's tests from `{args.lightning_tests}`: {report['collected']} collected, {report['candidates']}"
        " mention DDP and can run on CPU here; counted where a test built a CPU `DDPStrategy` (ours swapped in).",
        f"Wall time {report['wall_s'] / 60:.0f} min.",
        "",
        "| phase | built ours | " + " | ".join(cols) + " |",
        "| --- | ---: | " + " | ".join("---:" for _ in cols) + " |",
    ]
    for name, ph in report["phases"].items():
        c = ph["counts"]
        built = sum(v for k, v in c.items() if k != "no CPU DDPStrategy built")
        lines.append(f"| {name} | {built} | " + " | ".join(str(c.get(k, 0)) for k in cols) + " |")
    for name, ph in report["phases"].items():
        failed = [r for r in ph["rows"] if r["verdict"].startswith("failed")]
        if failed:
            lines += ["", f"## {name}: failures", ""]
            lines += [f"- `{r['nodeid']}`: {r['verdict']}" + (f" ({r['reason']})" if r["reason"] else
                      f": {r.get('message', '')}") for r in failed]
    lines += ["", "Not applicable (tests of DDP internals) and listed failures, with reasons:"
              " `tests/conformance/expectations.py`.", ""]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
