"""The benchmarks' shared harness: the options they share, the run's header, launches, and result tables.

Every script under ``benchmarks/`` builds on this module, so that each writes its results the same way:

- **options** (:func:`parser`, :func:`add_common`, :func:`add_names`, :func:`add_link`, :func:`add_gpt`):
  ``--out`` (the results file), ``--repeats``, ``--keep``, ``--quiet`` (the machine ran nothing else), the
  comma-separated lists (contenders, layouts, rates, runs) checked against what the script knows;
- **the header** (:class:`Run`, :func:`header_lines`): one block at the top of every results file naming the
  command, the date, the machine (host, CPU, cores, memory), Python, torch and lightning, the commit and whether
  the checkout had uncommitted changes (at the start and at the end), the load average and whether the machine
  was declared quiet;
- **launches**: a script re-executed in a fresh process group (:func:`run_local`), a job of torchrun per node on
  the simulated cluster whose ranks each write ``rank<r>.json`` (:func:`launch_ranks`, :func:`write_rank`), the
  replica groups of ``benchmarks/ft_worker.py`` with torchft's lighthouse (:func:`start_group`,
  :func:`lighthouse`, :func:`open_gate`, ...);
- **results**: markdown tables (:func:`table`), cells (:func:`fmt`, :func:`cell`), the file written and named
  (:func:`write`), a plot saved beside it (:func:`pyplot`, :func:`save_figure`).

Only the standard library is imported here: a driver that launches ranks should not pay torch's seconds of import
on a 2-core machine, and ``setup_memory.py`` measures its ranks' memory from the import on. What needs torch or
Lightning (:func:`fit_gpt_window`, :func:`fully_shard_gpt`) imports it when called, in the rank.
``python benchmarks/harness.py`` prints the header a run would write on this machine now.

(About 750 lines: it is the one module every script imports, in the sections listed above; split, each script
would import several and the sections' helpers call each other.)
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
RESULTS = HERE / "results"
MB = 1e6
RANK_ENV = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
"""What every launched rank gets: one intra-op thread (the ranks share a few cores), no warnings in the logs."""
RENDEZVOUS_ENV = ("MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK", "NODE_RANK", "WORLD_SIZE", "RANK")
"""Variables a launcher sets for its ranks (``ddp_plugin.testing.processes.RENDEZVOUS_ENV``, not imported: it
imports torch); a run started from inside another must not inherit them."""
TRACKED = ("ddp_plugin", "hookspecs", "benchmarks", ":(exclude)benchmarks/results")
"""The paths whose uncommitted changes the header reports: the code that is measured, not the results it writes."""


# ---------------------------------------------------------------------------------------------- options


def parser(doc: str, *, whole: bool = False, prog: str | None = None) -> argparse.ArgumentParser:
    """A script's parser: its docstring's first line as the description (``whole``: all of it, as written)."""
    return argparse.ArgumentParser(prog=prog, description=doc if whole else doc.splitlines()[0],
                                   formatter_class=argparse.RawDescriptionHelpFormatter)


def add_common(p: argparse.ArgumentParser, *, out: Path | None, out_help: str | None = None,
               repeats: int | None = None, repeats_help: str | None = None, keep: bool = False,
               quiet: bool = True) -> None:
    """The options most scripts share: ``--out``, and where asked ``--repeats``, ``--keep`` and ``--quiet``."""
    where = f" (default {out.relative_to(ROOT)})" if out is not None and out.is_relative_to(ROOT) else ""
    p.add_argument("--out", type=Path, default=out, help=out_help or f"the results' markdown file{where}")
    if repeats is not None:
        p.add_argument("--repeats", type=int, default=repeats, help=repeats_help or f"runs of each (default {repeats})")
    if keep:
        p.add_argument("--keep", action="store_true", help="keep each run's folder (logs, records) and print where")
    if quiet:
        p.add_argument("--quiet", action="store_true",
                       help="state in the results that nothing else ran on the machine (then the timings count)")


def add_names(p: argparse.ArgumentParser, flag: str, known: Iterable[str], default: Iterable[str] | str,
              help: str | None = None, **kwargs: Any) -> None:
    """A comma-separated option naming some of ``known`` (checked by :func:`names` after parsing)."""
    known = list(known)
    p.add_argument(flag, default=default if isinstance(default, str) else ",".join(default),
                   help=help or f"comma-separated subset of: {', '.join(known)}", **kwargs)


def split(text: str) -> list[str]:
    """``"a, b,,c"`` -> ``["a", "b", "c"]``."""
    return [x.strip() for x in text.split(",") if x.strip()]


def names(p: argparse.ArgumentParser, text: str, known: Iterable[str], what: str = "contender") -> list[str]:
    """The names of a comma-separated option, or the parser's usage error naming the unknown ones."""
    known = list(known)
    given = split(text)
    unknown = [x for x in given if x not in known]
    if unknown:
        p.error(f"unknown {what}(s) {', '.join(unknown)}; choose from {', '.join(known)}")
    return given


def add_link(p: argparse.ArgumentParser, *, nodes: int | None, rate: str,
             rate_help: str = "inter-node link rate per direction, tc notation") -> None:
    """The simulated cluster's ``--nodes`` (where the script lets it change) and ``--rate``."""
    if nodes is not None:
        p.add_argument("--nodes", type=int, default=nodes)
    p.add_argument("--rate", default=rate, help=f"{rate_help} (default {rate})")


def add_groups(p: argparse.ArgumentParser, *, nodes: int, steps: int, sync_every: int | None = None,
               step_sleep: float | None = None, down: float | None = None, down_help: str | None = None,
               ckpt_every: int | None = None) -> None:
    """The replica-group benchmarks' run (``benchmarks/ft_worker.py`` on the simulated cluster at 100 Mbit/s):
    ``--nodes``, ``--rate``, ``--steps``, and where the script has them ``--sync-every``, ``--step-sleep`` (a
    step's simulated compute), ``--down`` (how long a killed node stays down), ``--ckpt-every`` (fail-fast's
    checkpoints)."""
    add_link(p, nodes=nodes, rate="100mbit")
    p.add_argument("--steps", type=int, default=steps)
    if sync_every is not None:
        p.add_argument("--sync-every", type=int, default=sync_every)
    if step_sleep is not None:
        p.add_argument("--step-sleep", type=float, default=step_sleep, help="a step's simulated compute, seconds")
    if down is not None:
        p.add_argument("--down", type=float, default=down, help=down_help or "seconds a killed node stays down")
    if ckpt_every is not None:
        p.add_argument("--ckpt-every", type=int, default=ckpt_every)


GPT_OPTIONS = ("warmup", "steps", "vocab", "d_model", "heads", "layers", "seq", "global_batch")
"""The GPT benchmarks' options their driver hands to every rank (:func:`forward`)."""


def add_gpt(p: argparse.ArgumentParser) -> None:
    """The GPT benchmarks' model and window (``tensor_parallel.py``, ``pipeline.py``), and the hidden options of
    their ranks (the script re-executed by torchrun with ``--worker``)."""
    p.add_argument("--steps", type=int, default=8, help="timed steps")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps before them")
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--d-model", type=int, default=384)
    p.add_argument("--heads", type=int, default=6)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--global-batch", type=int, default=16)
    p.add_argument("--timeout", type=float, default=600.0)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--contender", help=argparse.SUPPRESS)
    p.add_argument("--out-dir", type=Path, help=argparse.SUPPRESS)


def forward(args: argparse.Namespace, *options: str) -> list[str]:
    """``--option value`` for each of ``options`` (attribute names) of ``args``: a driver's options as its worker
    process gets them."""
    out = []
    for name in options:
        out += [f"--{name.replace('_', '-')}", str(getattr(args, name))]
    return out


def dispatch(argv: list[str] | None, parse: Callable[[list[str]], argparse.Namespace],
             worker: Callable[[argparse.Namespace], Any], driver: Callable[[argparse.Namespace, list[str]], int | None],
             is_worker: Callable[[argparse.Namespace], bool] = lambda args: bool(args.worker)) -> int:
    """``main`` of a script that re-executes itself for its runs: the worker where the hidden option says so,
    else the driver (given the command line, for the header)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse(argv)
    if is_worker(args):
        worker(args)
        return 0
    return driver(args, argv) or 0


# ---------------------------------------------------------------------------------------------- the header


def _git(*argv: str) -> str:
    # (read-only, without taking the index lock: someone may be committing in the same checkout)
    proc = subprocess.run(["git", "--no-optional-locks", *argv], cwd=ROOT, capture_output=True, text=True)
    return proc.stdout.rstrip() if proc.returncode == 0 else ""


def revision(paths: Sequence[str] = TRACKED) -> str:
    """The commit measured, and the files under ``paths`` that differ from it (with a hash of their content, so
    that the header can tell whether they changed during the run)."""
    commit = _git("rev-parse", "--short", "HEAD")
    if not commit:
        return "not a git checkout"
    changed = [line[3:].split(" -> ")[-1] for line in
               _git("status", "--porcelain", "--untracked-files=all", "--", *paths).splitlines()]
    if not changed:
        return f"commit {commit}, no uncommitted changes"
    files = [str(ROOT / c) for c in changed if (ROOT / c).is_file()]
    content = "".join(_git("hash-object", *files).split())[:12] if files else "deleted"
    shown = ", ".join(changed[:8]) + (f" and {len(changed) - 8} more" if len(changed) > 8 else "")
    return f"commit {commit} **with uncommitted changes** in {shown} (content {content})"


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _version(dist: str) -> str:
    # (the installed distribution's version, read without importing it)
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(dist)
    except PackageNotFoundError:
        return "not installed"


def machine() -> dict[str, Any]:
    """The machine and the software: host, CPU, cores, memory, OS, Python, torch, lightning."""
    try:
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    except (ValueError, OSError, AttributeError):
        memory = float("nan")
    return {"host": platform.node(), "cpu": _cpu_model(), "cores": os.cpu_count() or 1, "memory_gib": memory,
            "platform": platform.platform(), "python": platform.python_version(), "torch": _version("torch"),
            "lightning": _version("lightning")}


def load_average() -> float:
    return os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")


def header_lines(info: Mapping[str, Any]) -> list[str]:
    """The header's markdown bullets from :meth:`Run.info` (or a dict of the same keys)."""
    cores, ranks = info["cores"], info.get("ranks")
    changed = info.get("revision_end", info["revision"]) != info["revision"]
    quiet = ("nothing else ran on the machine (`--quiet`): the timings count" if info.get("quiet") else
             "the machine was not declared quiet (no `--quiet`): other work may have run beside this, so the times"
             " may be inflated (bytes and memory do not depend on it)")
    busy = info["load_start"] > 0.5 * cores
    return [
        f"- command: `{info['command']}`",
        f"- date: {info['date']}" + (f"; {info['wall_s']:.0f} s in all" if info.get("wall_s") is not None else ""),
        f"- machine: {info['host']}, {info['cpu']}, {cores} CPU cores"
        + (f" shared by the {ranks} ranks" if ranks else "")
        + f", {info['memory_gib']:.0f} GiB, {info['platform']}",
        f"- software: Python {info['python']}, torch {info['torch']}, lightning {info['lightning']}",
        f"- checkout: {info['revision']}"
        + (f"; **CHANGED during the run**, at its end: {info['revision_end']}" if changed else ""),
        f"- load average (1 min): {info['load_start']:.2f} at the start, {info.get('load_end', float('nan')):.2f} at"
        f" the end" + (f" (**busy at the start**: over half the {cores} cores)" if busy else "") + f"; {quiet}",
    ]


class Run:
    """One run of a benchmark, for its header: made at the start (date, load, commit), read at the end."""

    def __init__(self, script: str | Path, argv: Sequence[str] | None = None, *, quiet: bool = False,
                 ranks: int | None = None) -> None:
        self.argv = list(sys.argv[1:] if argv is None else argv)
        self.command = f"python benchmarks/{Path(script).name}" + (f" {shlex.join(self.argv)}" if self.argv else "")
        self.quiet, self.ranks = quiet, ranks
        self.date = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
        self.started = time.perf_counter()
        self.load_start = load_average()
        self.revision = revision()
        cores = os.cpu_count() or 1
        if self.load_start > 0.5 * cores:  # (said at once: the user may rather wait than measure a busy machine)
            print(f"{self.command}: WARNING: the machine is busy, load average {self.load_start:.2f} over {cores}"
                  " cores; timings may be off", file=sys.stderr, flush=True)

    @property
    def wall_s(self) -> float:
        return time.perf_counter() - self.started

    def info(self) -> dict[str, Any]:
        """Everything the header says, as of now (the end of the run)."""
        return {"command": self.command, "date": self.date, "wall_s": self.wall_s, **machine(), "ranks": self.ranks,
                "revision": self.revision, "revision_end": revision(), "load_start": self.load_start,
                "load_end": load_average(), "quiet": self.quiet}

    def header(self) -> list[str]:
        return header_lines(self.info())


# ---------------------------------------------------------------------------------------------- results


def fmt(value: float | None, spec: str) -> str:
    """``value`` formatted, ``-`` where there is none."""
    return "-" if value is None else format(value, spec)


def cell(text: Any, limit: int = 300) -> str:
    """``text`` made safe for one markdown table cell (one line, no ``|``), at most ``limit`` characters."""
    text = " ".join(str(text).split()).replace("|", "\\|")
    return text if len(text) <= limit else text[: limit - 3] + "..."


def row(cells: Sequence[Any]) -> str:
    """One markdown table row; an empty cell stays ``| |``."""
    return "|" + "|".join(f" {c} " if str(c) else " " for c in cells) + "|"


def table(head: Sequence[str], rows: Iterable[Sequence[Any]], align: str | None = None) -> list[str]:
    """A markdown table: the header, the alignment row (``align``: ``l`` or ``r`` per column; default the first
    column left, the others right) and the rows, each padded with empty cells to the header's width (a failed
    row names its error in one cell)."""
    align = align or "l" + "r" * (len(head) - 1)
    lines = [row(head), "|" + "|".join("---:" if a == "r" else "---" for a in align) + "|"]
    for cells in rows:
        cells = list(cells)
        lines.append(row(cells + [""] * (len(head) - len(cells))))
    return lines


def write(path: Path | str, text: str, *, show: bool = True, also: Sequence[Path] = ()) -> None:
    """Write a results file (its folder made), print it (``show``) and say where it went (and ``also``)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    if show:
        print(text, flush=True)
    print(f"written to {path}" + "".join(f" and {p}" for p in also), flush=True)


def pyplot() -> Any:
    """``matplotlib.pyplot`` on the Agg backend, or None (said on stderr) where matplotlib is not installed."""
    try:
        import matplotlib
    except ImportError:
        print("matplotlib is not installed, so no plot was written (pip install matplotlib)", file=sys.stderr)
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig: Any, path: Path) -> None:
    """A plot beside its table: laid out, written at 110 dpi, closed."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


@contextmanager
def scratch(prefix: str, keep: bool = False) -> Iterator[Path]:
    """A run's folder (logs, records): removed after the run unless ``keep``, or kept (and said) when it failed,
    so that an error's "see the logs in ..." still holds."""
    folder = Path(tempfile.mkdtemp(prefix=prefix))
    try:
        yield folder
    except BaseException:
        print(f"kept {folder}", flush=True)
        raise
    if keep:
        print(f"kept {folder}", flush=True)
    else:
        shutil.rmtree(folder, ignore_errors=True)


# ---------------------------------------------------------------------------------------------- local launches


def clean_env(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """This process's environment without the rendezvous variables, then ``extra``."""
    env = {k: v for k, v in os.environ.items() if k not in RENDEZVOUS_ENV}
    env.update(extra or {})
    return env


def spawn(cmd: Sequence[str], log: Path, env: Mapping[str, str] | None = None, cwd: Path = ROOT) -> subprocess.Popen:
    """``cmd`` in a session of its own (so that every process it starts can be ended with it), its output to
    ``log``, in a clean environment (``PYTHONUNBUFFERED``: a killed run's log still has its last lines)."""
    with open(log, "a") as f:
        return subprocess.Popen(list(cmd), cwd=cwd, stdout=f, stderr=subprocess.STDOUT, start_new_session=True,
                                env=clean_env({"PYTHONUNBUFFERED": "1", **(env or {})}))


@dataclass
class Launch:
    """How a local launch ended: its exit code (None: killed at its timeout), wall time and log."""

    returncode: int | None
    wall_s: float
    log: str

    def check(self, what: str) -> None:
        """Fail the benchmark (with the log's tail) where the launch did not exit 0."""
        if self.returncode != 0:
            sys.stderr.write(self.log[-8000:])
            raise SystemExit(f"{what} failed with exit code {self.returncode}")


def _group_alive(pid: int) -> bool:
    try:
        os.killpg(pid, 0)
        return True
    except ProcessLookupError:
        return False


def run_local(cmd: Sequence[str], *, log: Path | None = None, timeout: float | None = None,
              env: Mapping[str, str] | None = None) -> Launch:
    """Run ``cmd`` (usually this script again, which Lightning's launcher re-executes once per rank) in its own
    process group, up to ``timeout`` seconds, and wait until every process of the group is gone: Lightning's
    launcher does not wait for the ranks it started, and the next launch must not share the cores with them.
    ``env`` is added to a clean environment (pass :data:`RANK_ENV` to pin the threads: without ``OMP_NUM_THREADS``
    Lightning's launcher picks the threads of each rank from the cores, which is what some benchmarks measure)."""
    own = log is None
    log = Path(tempfile.mkstemp(prefix="bench_", suffix=".log")[1]) if own else log
    t0 = time.perf_counter()
    proc = spawn(cmd, log, env)
    try:
        rc: int | None = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the launch's own process group: rank 0 and the ranks it started
        proc.wait()
        rc = None
    deadline = time.monotonic() + 60
    while _group_alive(proc.pid) and time.monotonic() < deadline:
        time.sleep(0.2)
    if _group_alive(proc.pid):
        os.killpg(proc.pid, signal.SIGKILL)
    text = log.read_text(errors="replace")
    if own:
        log.unlink()
    return Launch(rc, time.perf_counter() - t0, text)


def interleaved(contenders: Sequence[str], repeats: int) -> list[str]:
    """The run order: every contender once, then again, so that a slow spell of the machine hits several."""
    return [c for _ in range(repeats) for c in contenders]


# ---------------------------------------------------------------------------------------------- the simulated cluster


def need_cluster(script: str, fatal: bool = False) -> bool:
    """Whether the simulated cluster can run here; where not, say why (``fatal``: and exit non-zero)."""
    from ddp_plugin.testing.simcluster import available

    ok, reason = available()
    if not ok:
        if fatal:
            sys.exit(f"needs the simulated cluster: {reason}")
        print(f"benchmarks/{script}: skipped, the simulated cluster cannot run here: {reason}")
    return ok


def start(script: str, argv: list[str] | None, parse: Callable[[list[str]], argparse.Namespace], *,
          cluster: str | None = None, ranks: Callable[[argparse.Namespace], int] | None = None
          ) -> tuple[argparse.Namespace, Run] | None:
    """A driver's start: its command line parsed; where it needs the simulated cluster (``cluster``: ``"skip"`` or
    ``"fatal"``, see :func:`need_cluster`) that checked, None where it cannot run; then its :class:`Run` begun."""
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse(argv)
    if cluster is not None and not need_cluster(Path(script).name, fatal=cluster == "fatal"):
        return None
    return args, Run(script, argv, quiet=getattr(args, "quiet", False), ranks=ranks(args) if ranks else None)


def cluster_ranks(args: argparse.Namespace) -> int:
    """The ranks of the cluster benchmark's options: nodes x ranks a node."""
    return args.nodes * args.nproc_per_node


class Clusters:
    """Simulated clusters by link rate (None: uncapped), each built on first use and torn down with ``stack``."""

    def __init__(self, stack: ExitStack, nodes: int, prefix: str) -> None:
        self.stack, self.nodes, self.prefix = stack, nodes, prefix
        self.built: dict[str | None, Any] = {}

    def __call__(self, rate: str | None) -> Any:
        if rate not in self.built:
            from ddp_plugin.testing.simcluster import SimulatedCluster

            self.built[rate] = self.stack.enter_context(SimulatedCluster(nodes=self.nodes, rate=rate,
                                                                         prefix=self.prefix))
        return self.built[rate]


def write_rank(out_dir: Path, rank: int, record: Mapping[str, Any]) -> None:
    """A rank's record of a launch, ``out_dir/rank<r>.json``, where :func:`launch_ranks` reads it."""
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"rank{rank}.json").write_text(json.dumps(record))


def launch_ranks(cluster: Any, argv: list[str], *, nproc_per_node: int, out_dir: Path, timeout: float,
                 env: Mapping[str, str] | None = None) -> dict[str, Any]:
    """One torchrun job per node of ``cluster`` running ``argv``; the ranks' records (:func:`write_rank`) by rank,
    or the error: the ranks' own where they left one, else how the processes ended, with each node's log tail."""
    t0 = time.perf_counter()
    nodes = cluster.launch(argv, nproc_per_node=nproc_per_node, env={**RANK_ENV, **(env or {})}, timeout=timeout)
    wall = time.perf_counter() - t0
    ranks = sorted((json.loads(f.read_text()) for f in out_dir.glob("rank*.json")), key=lambda r: r["rank"])
    errors = sorted({r["error"] for r in ranks if "error" in r})
    if not all(n.ok for n in nodes) or len(ranks) != len(nodes) * nproc_per_node or errors:
        tail = "\n".join(f"--- node {n.node} (exit {n.returncode}{', timed out' if n.timed_out else ''}):\n"
                         f"{n.stdout[-1500:]}\n{n.stderr[-3000:]}" for n in nodes)
        error = "; ".join(errors) if errors else f"exit codes {[n.returncode for n in nodes]}" + (
            ", timed out" if any(n.timed_out for n in nodes) else "")
        return {"error": error, "log": tail, "wall_s": wall}
    return {"ranks": ranks, "wall_s": wall}


def failed(head: str, res: Mapping[str, Any]) -> str:
    """The progress line of a launch that failed, with its log."""
    return f"{head} FAILED ({res['error']}, {res.get('wall_s', 0.0):.0f} s)\n{res.get('log', '')}".rstrip()


def ft_net(width: int) -> Any:
    """``ft_worker``'s model: an MLP from 8 inputs through two tanh layers of ``width`` to one output (``churn.py``
    evaluates the groups' final parameters in it)."""
    from torch import nn

    from ddp_plugin.testing.models import mlp

    return mlp(8, width, 1, layers=2, activation=nn.Tanh)


def fully_shard_gpt() -> type:
    """``ddp_plugin.testing.gpt.GPTModule`` with Lightning's ``ModelParallelStrategy`` recipe: the tensor-parallel
    plan (``GPTModule.configure_model``), then FSDP2 on the data-parallel mesh, each block and the root."""
    from ddp_plugin.testing.gpt import GPTModule

    class FullyShardRecipe(GPTModule):
        def configure_model(self) -> None:
            from torch.distributed.fsdp import fully_shard

            super().configure_model()
            dp = self.device_mesh["data_parallel"]
            for block in self.model.blocks:
                fully_shard(block, mesh=dp)
            fully_shard(self.model, mesh=dp)

    return FullyShardRecipe


def fit_gpt_window(args: argparse.Namespace, strategy: Any, model: Any, window: Any, replicas: int,
                   extra: Callable[[dict[str, Any]], None] | None = None) -> None:
    """One rank of a GPT benchmark's launch (``--worker``): fit ``model`` under ``strategy`` for the warmup and the
    timed window (``window``, a ``StepWindow``) on the same token windows as every contender, each of the
    ``replicas`` data-parallel ranks reading its share of the global batch; write the window's record (with the
    model's size, and what ``extra`` adds) where the driver reads it; exit 1 after an error, reported in the table."""
    import lightning as L
    from torch.utils.data import DataLoader

    from ddp_plugin.testing.gpt import GPTModule, token_dataset

    per_node, world = int(os.environ["LOCAL_WORLD_SIZE"]), int(os.environ["WORLD_SIZE"])
    trainer = L.Trainer(accelerator="cpu", devices=per_node, num_nodes=world // per_node, strategy=strategy,
                        max_steps=args.warmup + args.steps, callbacks=[window], logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    data = token_dataset(args.global_batch * (args.warmup + args.steps), seq=args.seq, vocab=args.vocab)
    error = None
    try:
        trainer.fit(model, DataLoader(data, batch_size=args.global_batch // replicas))
    except Exception as err:  # noqa: BLE001 - reported in the table
        error = f"{type(err).__name__}: {err}"
    out = window.result(error)
    if not error:
        size = dict(vocab=args.vocab, d_model=args.d_model, heads=args.heads, layers=args.layers, seq=args.seq)
        out["params"] = sum(p.numel() for p in GPTModule(**size).parameters())
        if extra is not None:
            extra(out)
    write_rank(args.out_dir, out["rank"], out)
    if error:
        sys.exit(1)


def launch_gpt(cluster: Any, script: str | Path, args: argparse.Namespace, name: str, out_dir: Path,
               nproc_per_node: int, head: str, options: Sequence[str] = ()) -> dict[str, Any]:
    """One launch of a GPT benchmark's contender (the script again with ``--worker``, its model and window options
    and ``options``), its progress line printed under ``head``."""
    argv = [str(Path(script).resolve()), "--worker", "--contender", name, "--out-dir", str(out_dir),
            *forward(args, *GPT_OPTIONS, *options)]
    res = launch_ranks(cluster, argv, nproc_per_node=nproc_per_node, out_dir=out_dir, timeout=args.timeout)
    if "error" in res:
        print(failed(f"{head}:", res), flush=True)
    else:
        import statistics

        ranks = res["ranks"]
        tx = statistics.mean(r["tx_bytes"] for r in ranks if "tx_bytes" in r) / args.steps / MB
        print(f"{head}: median {statistics.median(ranks[0]['interval_s']):.3f} s/step, {tx:.2f} MB/node/step"
              f" ({res['wall_s']:.0f} s wall)", flush=True)
    return res


def gpt_row(ok: list[list[dict[str, Any]]], steps: int) -> dict[str, Any]:
    """What a GPT benchmark's table says of a contender's successful launches (``ok``: each launch's records):
    rank 0's median interval (median over launches), each node's kernel tx bytes a step (mean over launches),
    their mean, the parameters and S (fp32 gradient bytes), our accounting where every rank has one, peak RSS."""
    import statistics

    row: dict[str, Any] = {"median_s": statistics.median(statistics.median(ranks[0]["interval_s"]) for ranks in ok)}
    row["node_mb"] = [statistics.mean(r["tx_bytes"] for ranks in ok for r in ranks if r["node"] == n and "tx_bytes"
                                      in r) / steps / MB for n in (0, 1)]
    row["tx_mb"] = statistics.mean(row["node_mb"])
    row["params"] = ok[0][0]["params"]
    row["s_mb"] = row["params"] * 4 / MB
    if all("ours_mb" in r for r in ok[0]):
        row["ours_mb"] = statistics.mean(sum(r["ours_mb"] for r in ranks if r["node"] == n) / steps
                                         for ranks in ok for n in (0, 1))
    row["peak_rss_mb"] = max(r["maxrss_mb"] for ranks in ok for r in ranks)
    return row


# ---------------------------------------------------------------------------------------------- replica groups

FT_WORKER = HERE / "ft_worker.py"
LIGHTHOUSE_PORT = 29510


def records(out: Path, node: int, tag: str = "") -> list[dict]:
    """What node ``node``'s ``ft_worker.py`` recorded so far: a dict per optimizer step."""
    path = out / f"rec-{node}{tag}.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def wait_for_step(out: Path, node: int, step: int, procs: list[subprocess.Popen], tag: str = "",
                  timeout: float = 600) -> None:
    deadline = time.time() + timeout
    while not any(r["global_step"] >= step for r in records(out, node, tag)):
        if time.time() > deadline or any(p.poll() not in (None, 0) for p in procs):
            raise RuntimeError(f"node {node} did not reach step {step}; see the logs in {out}")
        time.sleep(0.02)


def kill_node(cluster: Any, node: int, proc: subprocess.Popen) -> float:
    """SIGKILL every process in the node's namespace (torchrun's workers are sessions of their own); the time."""
    pids = subprocess.run(["ip", "netns", "pids", cluster.node_namespace(node)], capture_output=True, text=True,
                          check=True).stdout.split()
    killed = time.time()
    for pid in pids:
        try:
            os.kill(int(pid), signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.wait()
    return killed


def wait_all(procs: list[subprocess.Popen], timeout: float = 900) -> list[int]:
    deadline = time.time() + timeout
    for p in procs:
        try:
            p.wait(timeout=max(1.0, deadline - time.time()))
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
    return [p.returncode for p in procs]


def group_env(cluster: Any, node: int, port: int, master: str | None = None) -> dict[str, str]:
    """A replica group's environment on ``node``: its own rendezvous (``master``, default the node itself)."""
    return cluster.launch_env(node, {"MASTER_ADDR": master or cluster.addresses[node], "MASTER_PORT": str(port),
                                     "PYTHONPATH": str(ROOT)})


@contextmanager
def lighthouse(cluster: Any, out: Path, join_timeout_ms: int = 5000, heartbeat_timeout_ms: int = 1000
               ) -> Iterator[str]:
    """torchft's lighthouse in node 0's namespace (its log in ``out``) for the duration; its address as the nodes
    reach it."""
    from ddp_plugin.fault_tolerance.launch import lighthouse_command

    proc = cluster.popen(0, [*lighthouse_command(), "--min_replicas", "1", "--join_timeout_ms", str(join_timeout_ms),
                             "--heartbeat_timeout_ms", str(heartbeat_timeout_ms), "--bind", f"[::]:{LIGHTHOUSE_PORT}"],
                         stdout=open(out / "lighthouse.txt", "w"), stderr=subprocess.STDOUT)
    time.sleep(1.0)
    try:
        yield f"http://{cluster.addresses[0]}:{LIGHTHOUSE_PORT}"
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def start_group(cluster: Any, node: int, spec: Mapping[str, Any], out: Path, port: int, tag: str = "",
                prefix: Sequence[str] = (), master: str | None = None) -> subprocess.Popen:
    """Node ``node``'s process of a torchft run: ``ft_worker.py`` with ``spec`` (after ``prefix``: a module that
    starts it, say), its log ``out/log<node><tag>.txt``."""
    return cluster.popen(node, [sys.executable, *prefix, str(FT_WORKER), json.dumps(dict(spec))],
                         env=group_env(cluster, node, port, master),
                         stdout=open(out / f"log{node}{tag}.txt", "w"), stderr=subprocess.STDOUT)


def open_gate(out: Path, ready: Sequence[Path], procs: list[subprocess.Popen], timeout: float = 300) -> float:
    """Wait until every rank has written its ``gate.<node>.<rank>`` file (set up), then let them all step at once
    (``gate``); the time it opened."""
    deadline = time.time() + timeout
    while not all(p.exists() for p in ready):
        if time.time() > deadline or any(p.poll() is not None for p in procs):
            raise RuntimeError(f"a node did not start; see the logs in {out}")
        time.sleep(0.05)
    (out / "gate").touch()
    return time.time()


def launch_job(cluster: Any, out: Path, nodes: int, devices: int, port: int, spec: Mapping[str, Any]
               ) -> list[subprocess.Popen]:
    """One torchrun job of ``ft_worker.py`` over nodes 0..``nodes``-1 (``spec`` with each node's ``node`` and the
    job's ``nodes``), its logs ``out/log<node><tag>.txt``: today's fail-fast run."""
    procs = []
    for node in range(nodes):
        command = [sys.executable, "-m", "torch.distributed.run", f"--nnodes={nodes}", f"--node_rank={node}",
                   f"--nproc_per_node={devices}", f"--master_addr={cluster.addresses[0]}", f"--master_port={port}",
                   "--max_restarts=0", str(FT_WORKER), json.dumps({**spec, "node": node, "nodes": nodes})]
        env = cluster.launch_env(node, {"PYTHONPATH": str(ROOT)})
        procs.append(cluster.popen(node, command, env=env, stdout=open(out / f"log{node}{spec['tag']}.txt", "w"),
                                   stderr=subprocess.STDOUT))
    return procs


# ---------------------------------------------------------------------------------------------- workers


def spec_parser(doc: str, positional: bool = False) -> dict[str, Any]:
    """A worker's one argument, the run as JSON (``--spec``, or ``positional``), parsed."""
    p = parser(doc, whole=positional)
    if positional:
        p.add_argument("spec", type=json.loads, help="the run, as JSON (written by its driver)")
    else:
        p.add_argument("--spec", required=True, type=json.loads, help="the run, as JSON (keys above)")
    return p.parse_args().spec


def write_pid(out: str | Path) -> None:
    """This rank's ``pid-<local rank>`` in ``out``, first thing (before its seconds of imports): the driver can
    end the rank from its first moment (``ddp_plugin.testing.processes.pid_files``)."""
    with open(os.path.join(out, f"pid-{os.environ.get('LOCAL_RANK', '0')}"), "w") as f:
        f.write(str(os.getpid()))


def main(argv: list[str] | None = None) -> int:
    """``python benchmarks/harness.py``: the header a run would write on this machine now."""
    p = parser(__doc__)
    p.add_argument("--quiet", action="store_true", help="as a benchmark's --quiet: nothing else runs on the machine")
    args = p.parse_args(argv)
    print("\n".join(Run(__file__, argv, quiet=args.quiet).header()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
