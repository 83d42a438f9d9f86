"""Regression benchmark: the data-parallel paths of ``benchmarks/cluster.py`` at two commits, side by side.

    python benchmarks/regression.py                                  # HEAD against the last release, ~15 minutes on 2 cores
    python benchmarks/regression.py --base 7dfb8a6 --head HEAD --contenders lightning_ddp,ours_hier --repeats 3

Each revision is checked out with ``git worktree add --detach`` into a temporary folder (removed at the end, also
on an error or Ctrl-C), and its runs use that commit's ``benchmarks/cluster_worker.py`` and that commit's
``ddp_plugin`` and ``hookspecs``: what is measured is the commits, not the working tree, and editing the checkout
during a run changes nothing in it. The driver (this file, ``cluster.py``'s launcher, summary and contenders, the
simulated cluster) is the one you run.

Pinning the package: the launched ranks get ``PYTHONPATH=<boot>:<worktree>``, where ``<boot>`` holds a
``sitecustomize.py`` written by this script. A ``PYTHONPATH`` alone is not enough in a virtual environment with an
editable install of another checkout: its meta-path finder maps ``ddp_plugin.hookspecs`` to that checkout's
``hookspecs/`` (the worktree's ``ddp_plugin/`` has no such folder, so the path search misses it and the editable
finder answers), which mixes two commits' code. The ``sitecustomize`` removes that finder, puts one first that maps
``ddp_plugin`` and ``ddp_plugin.hookspecs`` to the worktree's folders, and at exit writes the files each rank
imported them from; the output lists them, and a run whose ranks imported from anywhere else counts as failed.

One simulated cluster per link rate for the whole run (as in ``cluster.py``). The order interleaves the commits:
per repeat, per contender, one run of each commit back to back, the commit that goes first alternating from one
contender to the next and from one repeat to the next, so a slow spell of the machine hits both. Lightning
``ddp`` (the reference) runs in every repeat, and each commit's ratios are to the ``ddp`` runs of the same
commit. A contender that fails at one commit (one its worker does not know, say) gets a failed cell and the run
goes on. ZeRO contenders switch every run to AdamW, as in ``cluster.py`` (``--optimizer auto``).

Writes ``--out`` (markdown, default ``benchmarks/results/regression.md``) and a JSON beside it with the raw runs:
per contender the median step time at base and head, each commit's ratio to its ``ddp``, head / base, cross-node
MB per node and step, peak RSS, final loss, and a flag where head is slower than base beyond the two commits' own
spread (head / base above 1 + the larger per-run-median spread, at least 5 %), its RSS or cross-node bytes more
than 5 % above, or it fails where base ran. Nothing else should run on the machine meanwhile: that is yours to
ensure; the script warns when the load average at its start is above half the cores. Run it before writing a
release entry in CHANGELOG.md.

Needs root and iproute2; on a machine that cannot build the cluster it prints why and exits 0. A benchmark, not
a test: it asserts nothing, and its numbers depend on the machine. (Over 400 lines: resolving the revisions,
pinning each commit's package, the interleaved runs and the comparison table are one procedure, read top down.)
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any, Iterator

import cluster  # benchmarks/cluster.py: contenders, options, launcher and summary
import harness
from harness import ROOT, cell, fmt

DEFAULT_OUT = harness.RESULTS / "regression.md"
REFERENCE = "lightning_ddp"
DEFAULT_CONTENDERS = (REFERENCE, "ours_flat", "ours_hier", "ours_hier_int8", "ours_int8", "ours_hier_powersgd", "ours_auto")
SIDES = ("base", "head")
SPREAD_FLOOR = 0.05  # head / base step time is flagged above 1 + max(this, either commit's per-run-median spread)
RSS_MARGIN = 0.05  # ... peak RSS above 1 + this x base's
BYTES_MARGIN = 0.05  # ... cross-node bytes above 1 + this x base's
RELEASE_HEADING = re.compile(r"^## \[(\d+\.\d+\.\d+[^\]]*)\](?:\s*-\s*(\d{4}-\d{2}-\d{2}))?", re.M)
TREE_ENV, IMPORTS_ENV = "DDP_REGRESSION_TREE", "DDP_REGRESSION_IMPORTS"

SITECUSTOMIZE = f'''"""Written by benchmarks/regression.py: ddp_plugin and its hookspecs from ${TREE_ENV}, recorded."""
import atexit
import json
import os
import sys
from importlib.util import spec_from_file_location

_TREE = os.environ.get("{TREE_ENV}")
if _TREE:
    _MAP = {{name: os.path.join(_TREE, folder) for name, folder in (("ddp_plugin", "ddp_plugin"),
                                                                  ("ddp_plugin.hookspecs", "hookspecs"))
            if os.path.isfile(os.path.join(_TREE, folder, "__init__.py"))}}

    class _TreeFinder:
        @classmethod
        def find_spec(cls, fullname, path=None, target=None):
            where = _MAP.get(fullname)
            if where is None:
                return None
            return spec_from_file_location(fullname, os.path.join(where, "__init__.py"),
                                           submodule_search_locations=[where])

    # An editable install's finder (setuptools' __editable___ddp_plugin_..._finder) maps the names to its checkout.
    sys.meta_path[:] = [f for f in sys.meta_path if not (getattr(f, "__module__", None) or "").startswith(
        "__editable___ddp_plugin")]
    sys.meta_path.insert(0, _TreeFinder)

    def _record():
        where = os.environ.get("{IMPORTS_ENV}")
        if not where or "ddp_plugin" not in sys.modules:
            return
        files = {{name: getattr(sys.modules.get(name), "__file__", None)
                 for name in ("ddp_plugin", "ddp_plugin.hookspecs")}}
        with open(os.path.join(where, f"{{os.getpid()}}.json"), "w") as f:
            json.dump({{"pid": os.getpid(), "rank": os.environ.get("RANK"), **files}}, f)

    atexit.register(_record)
'''


# ---------------------------------------------------------------------------------------------- revisions


def git(*argv: str, repo: Path = ROOT) -> str:
    """``git argv`` in ``repo``; its stdout, or RuntimeError with git's own message."""
    proc = subprocess.run(["git", *argv], cwd=repo, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(proc.stderr.strip() or f"git {' '.join(argv)} exited {proc.returncode}")
    return proc.stdout.rstrip("\n")


def resolve(rev: str, repo: Path = ROOT) -> dict[str, str]:
    """A revision's full hash, short hash and subject; ValueError where it names no commit of ``repo``."""
    try:
        commit = git("rev-parse", "--verify", "--quiet", f"{rev}^{{commit}}", repo=repo)
    except RuntimeError:
        commit = ""
    if not commit:
        raise ValueError(f"{rev!r} is not a commit of the repository at {repo}")
    short, subject = git("log", "-1", "--format=%h%x09%s", commit, repo=repo).split("\t", 1)
    return {"rev": rev, "commit": commit, "short": short, "subject": subject}


def last_release(rev: str = "HEAD", repo: Path = ROOT) -> dict[str, str]:
    """The last release as of ``rev``: the newest ``## [x.y.z] - date`` heading of its CHANGELOG.md, and the commit.

    The commit: the tag ``vx.y.z`` (or ``x.y.z``) where there is one; else the commit that added the heading (the
    oldest that changed its count in CHANGELOG.md); but where that commit came after the heading's date (the entry
    written down later), the last commit on or before that date (UTC) on the first-parent line to it: the
    heading of 0.1.0 (2026-11-24) was added on 2026-11-27, after 191 more commits. ``how`` says which rule chose it.
    """
    match = RELEASE_HEADING.search(git("show", f"{rev}:CHANGELOG.md", repo=repo))
    if match is None:
        raise LookupError(f"no release heading (## [x.y.z] - date) in CHANGELOG.md at {rev}")
    version, day = match.group(1), match.group(2)
    found = {"version": version, "date": day or ""}
    for tag in (f"v{version}", version):
        try:
            return {**found, "commit": git("rev-parse", "--verify", f"refs/tags/{tag}^{{commit}}", repo=repo),
                    "how": f"the tag {tag}"}
        except RuntimeError:
            pass
    added = git("log", "-S", f"## [{version}]", "--format=%H %cI", rev, "--", "CHANGELOG.md", repo=repo).splitlines()
    if not added:
        raise LookupError(f"no commit before {rev} added the heading ## [{version}] to CHANGELOG.md")
    commit, when = added[-1].split()
    how = f"the commit that added the heading `## [{version}]` to CHANGELOG.md"
    if day:
        end_of_day = f"{day}T23:59:59+00:00"
        released = git("rev-list", "-1", "--first-parent", f"--before={end_of_day}", commit, repo=repo)
        if released and released != commit:
            short = git("rev-parse", "--short", commit, repo=repo)
            return {**found, "commit": released,
                    "how": f"the last commit of the release date {day} (UTC): the heading `## [{version}]` was"
                           f" added after it, in {short} ({when[:10]})"}
    return {**found, "commit": commit, "how": how}


def dirty_files(repo: Path = ROOT) -> list[str]:
    """Tracked files with uncommitted changes in the checkout (they are not what is measured)."""
    return [line[3:] for line in git("status", "--porcelain", "--untracked-files=no", repo=repo).splitlines()]


@contextmanager
def worktree(commit: str, dest: Path) -> Iterator[Path]:
    """``commit`` checked out (detached) at ``dest`` for the duration; removed afterwards, whatever happened."""
    git("worktree", "add", "--detach", "--quiet", str(dest), commit)
    try:
        yield dest
    finally:
        try:
            git("worktree", "remove", "--force", str(dest))
        except RuntimeError:
            shutil.rmtree(dest, ignore_errors=True)
            git("worktree", "prune")


# ---------------------------------------------------------------------------------------------- arguments


def build_parser() -> argparse.ArgumentParser:
    """``cluster.py``'s options (model, steps, link, timeout, ...) with this script's defaults, and the revisions."""
    p = cluster.build_parser()
    p.prog, p.description = "regression.py", __doc__.splitlines()[0]
    p.set_defaults(contenders=",".join(DEFAULT_CONTENDERS), out=DEFAULT_OUT)
    # argparse has no public way to reword an option's help: its actions by option string.
    p._option_string_actions["--contenders"].help = (
        f"comma-separated subset of cluster.py's contenders (default: {','.join(DEFAULT_CONTENDERS)});"
        f" {REFERENCE} is always run, as the reference")
    p._option_string_actions["--out"].help = "markdown file; the raw runs go next to it as .json"
    p._option_string_actions["--repeats"].help = "runs per contender and commit (default 2), interleaved"
    g = p.add_argument_group("revisions")
    g.add_argument("--base", help="the revision to compare against (default: the last release, see last_release())")
    g.add_argument("--head", default="HEAD", help="the revision under test (default HEAD: the committed HEAD,"
                                                  " not the working tree's changes)")
    return p


def parse_args(argv: list[str] | None = None, repo: Path = ROOT) -> argparse.Namespace:
    p = build_parser()
    args = cluster.parse_args(argv, parser=p)  # unknown contenders refused there; ZeRO ones switch to AdamW
    if REFERENCE not in args.contenders:
        args.contenders.insert(0, REFERENCE)
    if args.base is None:
        try:
            args.release = last_release(repo=repo)
        except (LookupError, RuntimeError) as e:
            p.error(f"--base: no default ({e}); name a revision")
        args.base = args.release["commit"]
    args.revisions = {}
    for side in SIDES:
        try:
            args.revisions[side] = resolve(getattr(args, side), repo=repo)
        except ValueError as e:
            p.error(f"--{side}: {e}")
    for side in SIDES:
        args.revisions[side]["chosen"] = f"`--{side} {getattr(args, side)}`"
    if "release" in vars(args):
        args.revisions["base"]["chosen"] = f"the default, release {args.release['version']}: {args.release['how']}"
    return args


# ---------------------------------------------------------------------------------------------- running


def schedule(contenders: list[str], repeats: int) -> list[tuple[int, str, str]]:
    """(repeat, contender, side) in run order: per repeat, per contender, both commits back to back, the one that
    goes first alternating with each contender and each repeat."""
    order = []
    for repeat in range(repeats):
        for i, name in enumerate(contenders):
            sides = SIDES if (repeat + i) % 2 == 0 else SIDES[::-1]
            order += [(repeat, name, side) for side in sides]
    return order


def check_imports(record_dir: Path, tree: Path) -> dict[str, Any]:
    """What the ranks' ``sitecustomize`` recorded: where ``ddp_plugin`` and ``ddp_plugin.hookspecs`` came from,
    as paths relative to ``tree``, and whether every one lay inside it."""
    records = [json.loads(f.read_text()) for f in sorted(record_dir.glob("*.json"))]
    ranks = [r for r in records if r.get("rank") is not None]
    files = {name: sorted({r[name] for r in ranks if r.get(name)}) for name in ("ddp_plugin", "ddp_plugin.hookspecs")}
    outside = sorted({f for fs in files.values() for f in fs if not Path(f).resolve().is_relative_to(tree.resolve())})
    shown = {name: sorted(str(Path(f).resolve().relative_to(tree.resolve())) if f not in outside else f for f in fs)
             for name, fs in files.items()}
    return {"ranks": len(ranks), "files": shown, "outside": outside}


def run_side(net: Any, args: argparse.Namespace, name: str, side: str, tree: Path, boot: Path,
             out_dir: Path) -> dict[str, Any]:
    """One contender at one commit: ``cluster.run_one`` with the worktree's worker and package, its imports checked."""
    worker = tree / "benchmarks" / "cluster_worker.py"
    if not worker.is_file():
        return {"name": name, "error": f"no benchmarks/cluster_worker.py at {args.revisions[side]['short']}",
                "wall_s": 0.0}
    record_dir = out_dir.with_name(out_dir.name + "_imports")
    record_dir.mkdir(parents=True)
    env = {"PYTHONPATH": os.pathsep.join([str(boot), str(tree), *filter(None, [os.environ.get("PYTHONPATH")])]),
           TREE_ENV: str(tree), IMPORTS_ENV: str(record_dir)}
    res = cluster.run_one(net, args, name, out_dir, worker=worker, env=env)
    res["imports"] = check_imports(record_dir, tree)
    worker_contender = cluster.CONTENDERS[name][1]
    if "error" in res and f"argument --contender: invalid choice: '{worker_contender}'" in res.get("log", ""):
        res["error"] = f"the worker at {args.revisions[side]['short']} has no contender {worker_contender!r}"
        res["unknown"] = True
    elif "error" not in res and res["imports"]["outside"]:
        res["error"] = f"ranks imported the package from outside the worktree: {', '.join(res['imports']['outside'])}"
    return res


def run_all(args: argparse.Namespace, trees: dict[str, Path], boot: Path, tmp: Path,
            stack: ExitStack) -> list[dict[str, Any]]:
    """Every (repeat, contender, side) of :func:`schedule`; one record per run, in order."""
    clusters = harness.Clusters(stack, args.nodes, "ddpregr")
    unknown: dict[tuple[str, str], dict[str, Any]] = {}
    runs = []
    order = schedule(args.contenders, args.repeats)
    for i, (repeat, name, side) in enumerate(order):
        short = args.revisions[side]["short"]
        if (name, side) in unknown:  # the worker does not know it: no need to ask again
            res = {**unknown[(name, side)], "wall_s": 0.0}
        else:
            res = run_side(cluster.cluster_for(clusters, args, name), args, name, side, trees[side], boot, tmp / f"run{i}_{side}_{name}")
            if res.get("unknown"):
                unknown[(name, side)] = res
        runs.append({"index": i, "repeat": repeat, "contender": name, "side": side, "commit": short, **res})
        head = f"[{i + 1}/{len(order)}] {name:<20} {side} {short}"
        if "error" in res:
            print(harness.failed(head, {**res, "log": ""}), flush=True)
            continue
        r0 = res["ranks"][0]
        print(f"{head} median {statistics.median(r0['step_s']):.3f} s/step, peak RSS"
              f" {max(r['maxrss_mb'] for r in res['ranks']):.0f} MB ({res['wall_s']:.0f} s wall)", flush=True)
    return runs


# ---------------------------------------------------------------------------------------------- comparing


def spread(row: dict[str, Any]) -> float:
    """(max - min) / median of a row's per-run medians: 0 with one run."""
    runs = row.get("per_run_median_s") or []
    return (max(runs) - min(runs)) / row["median_s"] if len(runs) > 1 else 0.0


def compare(args: argparse.Namespace, runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One entry per contender: each commit's ``cluster.summarize`` row, its ratio to its own ``ddp``, head / base
    and the flags."""
    rows = {side: {name: cluster.summarize(name, [r for r in runs if r["side"] == side and r["contender"] == name],
                                           args.nodes)
                   for name in args.contenders} for side in SIDES}
    out = []
    for name in args.contenders:
        entry: dict[str, Any] = {"name": name, "label": cluster.CONTENDERS[name][0], "flags": [], "notes": []}
        for side in SIDES:
            row, ref = rows[side][name], rows[side][REFERENCE]
            entry[side] = row
            if "median_s" in row and "median_s" in ref:
                row["ratio_to_ddp"] = row["median_s"] / ref["median_s"]
        base, head = entry["base"], entry["head"]
        if "median_s" not in head:
            if "median_s" in base:
                entry["flags"].append("fails at head, ran at base")
            out.append(entry)
            continue
        if "median_s" not in base:
            entry["notes"].append("runs at head only")
            out.append(entry)
            continue
        entry["step_ratio"] = head["median_s"] / base["median_s"]
        entry["threshold"] = max(SPREAD_FLOOR, spread(base), spread(head))
        if "ratio_to_ddp" in base and "ratio_to_ddp" in head:
            entry["ddp_ratio"] = head["ratio_to_ddp"] / base["ratio_to_ddp"]  # head / base, each against its ddp
        if entry["step_ratio"] > 1 + entry["threshold"]:
            against = ""
            if name != REFERENCE and "ddp_ratio" in entry:
                against = f" ({entry['ddp_ratio']:.3f}x against each commit's ddp)"
            entry["flags"].append(f"step {entry['step_ratio']:.3f}x base{against}, beyond 1 + {entry['threshold']:.3f}")
        elif entry["step_ratio"] < 1 - entry["threshold"]:
            entry["notes"].append(f"faster: step {entry['step_ratio']:.3f}x base")
        rss = head["peak_rss_mb"] / base["peak_rss_mb"]
        if rss > 1 + RSS_MARGIN:
            entry["flags"].append(f"peak RSS {rss:.3f}x base ({head['peak_rss_mb'] - base['peak_rss_mb']:+.0f} MB)")
        if base["tx_mb"] > 0 and head["tx_mb"] / base["tx_mb"] > 1 + BYTES_MARGIN:
            entry["flags"].append(f"cross-node bytes {head['tx_mb'] / base['tx_mb']:.3f}x base")
        for side in SIDES:
            if entry[side]["failed"]:
                entry["notes"].append(f"{entry[side]['failed']} of {entry[side]['runs']} {side} runs failed")
        out.append(entry)
    return out


def _pair(entry: dict[str, Any], key: str, spec: str) -> str:
    """``base / head`` of one value; a failed commit's says so, the step time's cell with the error."""
    cells = []
    for side in SIDES:
        row = entry[side]
        if "median_s" not in row:
            cells.append(f"failed: {cell(row.get('error', '?'), 120)}" if key == "median_s" else "failed")
        else:
            cells.append(fmt(row.get(key), spec))
    return " / ".join(cells)


def imports_line(side: str, runs: list[dict[str, Any]], revision: dict[str, str]) -> str:
    """Where one commit's ranks imported the package from, over all its runs."""
    mine = [r for r in runs if r["side"] == side and "imports" in r]
    ranks = sum(r["imports"]["ranks"] for r in mine)
    files = {name: sorted({f for r in mine for f in r["imports"]["files"][name]})
             for name in ("ddp_plugin", "ddp_plugin.hookspecs")}
    outside = sorted({f for r in mine for f in r["imports"]["outside"]})
    where = "; ".join(f"`{name}` from `{', '.join(fs) or 'not imported'}`" for name, fs in files.items())
    verdict = f"**outside the worktree: {', '.join(outside)}**" if outside else "all inside the worktree"
    return (f"  - {side} ({revision['short']}): {ranks} rank records over {len(mine)} launches: {where}"
            f" (relative to the worktree of {revision['short']}): {verdict}")


def write_markdown(args: argparse.Namespace, info: dict[str, Any], runs: list[dict[str, Any]],
                   entries: list[dict[str, Any]]) -> str:
    """The comparison's markdown; ``info``: :meth:`harness.Run.info` with ``dirty``, the checkout's uncommitted
    files (not what is measured)."""
    revs = args.revisions
    lines = [f"# Regression benchmark: {revs['head']['short']} against {revs['base']['short']},"
             f" {args.nodes} nodes x {args.nproc_per_node} ranks, link {args.rate}", "", *harness.header_lines(info)]
    for side in SIDES:
        r = revs[side]
        lines.append(f"- {side}: `{r['commit'][:12]}` {cell(r['subject'], 160)} ({r['chosen']})")
    if info.get("dirty"):
        lines.append(f"- the working tree had uncommitted changes ({len(info['dirty'])} files:"
                     f" {', '.join(info['dirty'][:8])}{', ...' if len(info['dirty']) > 8 else ''}): not measured;"
                     " the commits are")
    lines += [
        f"- each commit ran from its own `git worktree`, its `benchmarks/cluster_worker.py` and its package"
        f" (`PYTHONPATH=<boot>:<worktree>`, the `sitecustomize` in `<boot>` maps `ddp_plugin` and"
        f" `ddp_plugin.hookspecs` to the worktree and records where each rank imported them from):",
        *(imports_line(side, runs, revs[side]) for side in SIDES),
        f"- {args.warmup} warmup + {args.steps} timed steps per run, {args.repeats} run(s) per contender and"
        f" commit, interleaved (per repeat, per contender, both commits back to back, the first alternating);"
        f" {cluster.OPTIMIZERS[args.optimizer]}; model and measurement as in `benchmarks/cluster.py`",
        "- step: rank 0's median over the timed steps (over runs: median of per-run medians); ratio to ddp: to"
        " Lightning `ddp` of the same commit; cross-node MB per node and step from the kernel's veth counters;"
        " peak RSS: max over ranks of `ru_maxrss`; final loss: rank 0's on its last timed batch",
        "",
    ]
    rows = []
    for e in entries:
        ratio = fmt(e.get("step_ratio"), ".3f")
        flag = "; ".join(e["flags"]) or "; ".join(e["notes"]) or ""
        rows.append([e["label"], _pair(e, "median_s", ".3f"), _pair(e, "ratio_to_ddp", ".3f"),
                     f"**{ratio}**" if e["flags"] else ratio, _pair(e, "tx_mb", ".2f"), _pair(e, "peak_rss_mb", ".0f"),
                     _pair(e, "final_loss", ".5f"), f"**{flag}**" if e["flags"] else flag])
    lines += harness.table(["contender", "median s/step base / head", "ratio to ddp base / head", "head / base",
                            "cross-node MB / node / step base / head", "peak RSS MB base / head",
                            "final loss base / head", "flag"], rows, "lllrllll")
    flagged = [e for e in entries if e["flags"]]
    lines.append("")
    if flagged:
        lines.append("**Flagged** (head slower than base beyond the larger of the two commits' per-run-median spread"
                     f" and {SPREAD_FLOOR:.0%}, RSS or cross-node bytes more than {RSS_MARGIN:.0%} above, or failing"
                     " where base ran): " + "; ".join(f"{e['name']}: {', '.join(e['flags'])}" for e in flagged))
    else:
        lines.append(f"No row flagged: head within the larger of the two commits' per-run-median spread and"
                     f" {SPREAD_FLOOR:.0%} of base's step time, RSS and cross-node bytes within {RSS_MARGIN:.0%},"
                     " nothing failing at head that ran at base.")
    if args.repeats == 1:
        lines += ["", f"One run per contender and commit: their spread is not measured, so only the {SPREAD_FLOOR:.0%}"
                      " floor applies (`--repeats 2` or more for a verdict)."]
    ref = next((e for e in entries if e["name"] == REFERENCE and "step_ratio" in e), None)
    if ref is not None:
        lines += ["", f"Lightning `ddp` runs the same Lightning code at both commits: its head / base"
                      f" ({ref['step_ratio']:.3f}) is the noise between the two runs of a pair (and any change of the"
                      " worker script between the commits)."]
    per_run = []
    for e in entries:
        runs_of = [", ".join(f"{m:.3f}" for m in e[side].get("per_run_median_s", [])) or "-" for side in SIDES]
        spreads = " / ".join(f"{spread(e[side]):.3f}" if "median_s" in e[side] else "-" for side in SIDES)
        per_run.append([e["label"], *runs_of, spreads, fmt(e.get("threshold"), ".3f")])
    lines += ["", "## Per run", "", *harness.table(["contender", "base per-run median s/step", "head per-run median"
                                                     " s/step", "spread base / head", "threshold"], per_run, "llllr")]
    failures = [r for r in runs if "error" in r]
    if failures:
        lines += ["", "## Failed runs", ""]
        lines += [f"- run {r['index'] + 1}, {r['contender']} at {r['side']} ({r['commit']}):"
                  f" {cell(r['error'], 300)}" for r in failures]
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    started = harness.start(__file__, argv, parse_args, cluster="skip", ranks=harness.cluster_ranks)
    if started is None:
        return 0
    args, run = started
    dirty = dirty_files() if args.revisions["head"]["commit"] == resolve("HEAD")["commit"] else []
    if dirty:
        print(f"benchmarks/regression.py: the working tree has uncommitted changes ({len(dirty)} files);"
              f" the committed HEAD {args.revisions['head']['short']} is what is measured", flush=True)
    for side in SIDES:
        r = args.revisions[side]
        print(f"{side}: {r['short']} {r['subject'][:100]} ({r['chosen']})", flush=True)
    # SIGTERM ends the run as Ctrl-C does: through the finally blocks that remove the worktrees and the namespaces.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    with ExitStack() as stack:
        tmp = Path(tempfile.mkdtemp(prefix="regression_"))
        stack.callback(shutil.rmtree, tmp, ignore_errors=True)
        trees = {side: stack.enter_context(worktree(args.revisions[side]["commit"], tmp / side)) for side in SIDES}
        boot = tmp / "boot"
        boot.mkdir()
        (boot / "sitecustomize.py").write_text(SITECUSTOMIZE)
        worktrees = {side: str(tree) for side, tree in trees.items()}
        runs = run_all(args, trees, boot, tmp, stack)
    info = {**run.info(), "dirty": dirty, "worktrees": worktrees}
    entries = compare(args, runs)
    raw = args.out.with_suffix(".json")
    raw.parent.mkdir(parents=True, exist_ok=True)
    raw.write_text(json.dumps({"revisions": args.revisions, "meta": info, "runs": runs, "comparison": entries},
                              indent=1, default=str))
    harness.write(args.out, write_markdown(args, info, runs, entries), also=[raw])
    return 0


if __name__ == "__main__":
    sys.exit(main())
