"""Where a step's time goes: every contender of the cluster benchmark with its ranks' Python stacks sampled over
the timed window, each thread's wall time split into what it was doing, ours against Lightning ``ddp``.

    python benchmarks/profile_step.py                 # ddp, hierarchical, + int8, + PowerSGD, ZeRO-3 at 1 Gbit/s
    python benchmarks/profile_step.py --contenders lightning_ddp,ours_hier_int8 --rate 100mbit --steps 24

It takes the cluster benchmark's flags (``benchmarks/cluster.py``: model, rate, steps, optimizer; AdamW here
unless ``--optimizer`` says otherwise) and runs each contender once on the same simulated cluster, with
``DDP_BENCH_PROFILE`` set: every rank starts ``py-spy record --idle --threads`` on itself for the timed window
(``pip install py-spy``; it samples the Python stacks of every thread, waits included, at ``--rate-hz``). Each
sample is put in one category by its stack (:data:`CATEGORIES`: the innermost frame that a rule names, stage
by stage), and a category's samples over the rate and the timed steps give its seconds a step, averaged over
the ranks. The training thread's categories sum to the step; the communication thread (``ddp_plugin-comm``)
runs beside it, so its busy categories show what the backward's wait hides or not.

What py-spy cannot see: C++ threads without Python (gloo's own, DDP's reducer, DeepSpeed's): a collective
``ddp`` runs inside the backward is part of the backward there, not a category of its own. Sampling costs each
rank a little CPU (on 2 cores shared by 4 ranks, about 1 % at 100 Hz): the step times here are not the cluster
benchmark's. This is a benchmark, not a test: it asserts nothing, and its numbers depend on the machine.
"""

from __future__ import annotations

import argparse
import collections
import linecache
import re
import statistics
import sys
import tempfile
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import cluster  # the cluster benchmark's flags, contenders and launch
import harness

DEFAULT_CONTENDERS = "lightning_ddp,ours_hier,ours_hier_int8,ours_hier_powersgd,ours_zero3"
DEFAULT_OUT = harness.RESULTS / "profile_1gbit.md"

# Each sample: a stage, from the frames around it (the first of STAGES whose rule some frame matches), and what the
# thread did there, from its innermost frame (WAITS: a collective's message or a wait on another thread or rank;
# else computing, copying included). A rule is (function names, path fragments): a frame matches when its
# function's last dotted part is one of the names (or there are none) and its path holds one of the fragments (or
# there are none).
STAGES: list[tuple[str, tuple[tuple[str, ...], tuple[str, ...], str]]] = [
    ("Lightning's per-step SIGTERM broadcast", (("_broadcast_sigterm_tensor",), (), "")),
    ("cross-node reduce (the codec, or the plain all-reduce)", (("on_cross_node_reduce",), (), "")),
    # (the hierarchical reducer waits for the cross-node reduce's future in its own frame)
    ("cross-node reduce (the codec, or the plain all-reduce)", (("reduce_to_shard",), (), "fut.wait()")),
    ("in-node reduce-scatter", (("reduce_to_shard", "_padded"), ("/hierarchical_reducer.py",), "")),
    ("in-node all-gather", (("gather_shard", "unpad", "_padded_target"), ("/hierarchical_reducer.py",), "")),
    ("flat all-reduce of a bucket", (("on_bucket_ready",), ("/flat_reducer.py", "/mean_allreduce.py"), "")),
    ("ZeRO: gather, release, shard", ((), ("/ddp_plugin/zero/",), "")),
    ("end of backward: the last buckets", (("finish",), ("/ddp_plugin/gradients/engine.py",), "")),
    ("backward hooks: bucket copies, launches", ((), ("/ddp_plugin/gradients/", "/ddp_plugin/runtime/"), "")),
    # (Lightning runs the forward and backward inside ``optimizer.step(closure)``: they go first)
    ("backward (autograd)", (("_engine_run_backward", "backward"), ("/torch/autograd/", "/torch/_tensor.py"), "")),
    ("forward", ((), ("/torch/nn/modules/",), "")),
    ("optimizer step", ((), ("/torch/optim/",), "")),
    ("data loading", ((), ("/torch/utils/data/",), "")),
]
OTHER = "other: Lightning's loop, callbacks, the rest"
WAITS = ("/threading.py", "/distributed_c10d.py", "/c10d_logger.py", "/ddp_plugin/health/watch.py", "/futures/")
WAIT_FUNCTIONS = ("_Works.wait",)
"""Our own waits on several collectives at once."""
WAIT_CALLS = re.compile(r"\.wait\(|\.value\(\)|\.result\(|\.join\(")
"""A wait that is a C++ call in a Python frame of ours (a future's ``wait()``): read from the frame's source line."""
IDLE = "waiting for a bucket (idle)"
OUTSIDE = ("start_profiler", "stop_profiler", "_mark")
"""The benchmark's own frames around the window (its profiler starting and stopping, the barriers): not counted."""


def _frames(stack: str) -> tuple[str, list[tuple[str, str, str]]]:
    """``thread (TID): NAME;func (path:line);...`` -> (thread name, [(function, path, source line), ...] outermost
    first); the source line read from the file (the same checkout the ranks ran)."""
    head, *rest = stack.split(";")
    thread = head.split(": ", 1)[1] if ": " in head else head
    frames = []
    for frame in rest:
        name, _, where = frame.rpartition(" (")
        path, _, line = where.rstrip(")").rpartition(":")
        source = linecache.getline(path, int(line)).strip() if line.isdigit() else ""
        frames.append((name, path, source))
    return thread, frames


def _matches(frame: tuple[str, str, str], rule: tuple[tuple[str, ...], tuple[str, ...], str]) -> bool:
    name, path, source = frame
    names, paths, line = rule
    return ((not names or name.rsplit(".", 1)[-1] in names) and (not paths or any(p in path for p in paths))
            and (not line or line in source))


def classify(frames: list[tuple[str, str, str]], thread: str) -> str | None:
    """One sample's category, ``stage: waiting`` or ``stage: computing``; None outside the window."""
    if not frames or any(f[0].rsplit(".", 1)[-1] in OUTSIDE for f in frames):
        return None
    name, path, source = frames[-1]
    if thread != "MainThread" and name == "SideThread._run":
        return IDLE  # (its loop waiting on its queue: SimpleQueue.get has no Python frame)
    stage = next((stage for stage, rule in STAGES if any(_matches(f, rule) for f in frames)), OTHER)
    waits = any(w in path for w in WAITS) or name in WAIT_FUNCTIONS or bool(WAIT_CALLS.search(source))
    return f"{stage}: {'waiting (a message, a peer, another thread)' if waits else 'computing'}"


def read_profile(path: Path) -> dict[str, collections.Counter]:
    """One rank's raw py-spy file: samples per category, per thread name."""
    threads: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    for line in path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack:
            continue
        thread, frames = _frames(stack)
        category = classify(frames, thread)
        if category is not None:
            threads[thread][category] += int(count)
    return threads


def seconds_per_step(ranks: list[dict[str, collections.Counter]], rate: float, steps: int) -> dict[str, dict[str, float]]:
    """Mean over ranks of each thread's categories, in seconds a step."""
    out: dict[str, dict[str, float]] = {}
    for thread in sorted({t for r in ranks for t in r}):
        cats = {c for r in ranks for c in r.get(thread, {})}
        out[thread] = {c: statistics.mean(r.get(thread, {}).get(c, 0) for r in ranks) / rate / steps for c in cats}
    return out


def build_parser() -> argparse.ArgumentParser:
    parser = cluster.build_parser()
    parser.description = __doc__.split("\n\n")[0]
    parser.set_defaults(contenders=DEFAULT_CONTENDERS, out=DEFAULT_OUT, steps=24, repeats=1, optimizer="adamw")
    parser.add_argument("--rate-hz", type=int, default=100, help="py-spy samples a second (default 100)")
    parser.add_argument("--raw", type=Path, default=None, help="a folder to keep every rank's py-spy file in")
    return parser


def _table(name: str, result: dict[str, Any], ref_step: float | None) -> list[str]:
    split, step = result["split"], result["step_s"]
    ratio = f", {step / ref_step:.3f}x `ddp`" if ref_step else ""
    rows = []
    for thread in sorted(split, key=lambda t: (t != "MainThread", t)):
        if thread not in ("MainThread", "ddp_plugin-comm", "ddp_plugin-outer"):
            continue  # (the health, heal-server and probe threads: idle)
        cats = {c: s for c, s in split[thread].items() if c != IDLE}  # (a side thread's idle: the step less its busy)
        rows += [[thread, cat, f"{s:.3f}", f"{s / step:.1%}"]
                 for cat, s in sorted(cats.items(), key=lambda kv: -kv[1]) if s >= 0.0005]
        rows.append([thread, "**all of the above**", f"{sum(cats.values()):.3f}", f"{sum(cats.values()) / step:.1%}"])
    return [f"### {cluster.CONTENDERS[name][0]}: {step:.3f} s a step (median, rank 0){ratio}", "",
            *harness.table(["thread", "category", "s / step", "share of the step"], rows, "llrr"), ""]


def main(argv: list[str] | None = None) -> int:
    started = harness.start(__file__, argv, lambda a: cluster.parse_args(a, build_parser()), cluster="skip",
                            ranks=harness.cluster_ranks)
    if started is None:
        return 0
    args, run = started
    results: dict[str, dict[str, Any]] = {}
    with ExitStack() as stack, tempfile.TemporaryDirectory(prefix="profile_step_") as tmp:
        clusters = harness.Clusters(stack, args.nodes, "ddpprof")
        for name in args.contenders:
            folder = Path(tmp) / name
            folder.mkdir()
            res = cluster.run_one(cluster.cluster_for(clusters, args, name), args, name, folder / "out",
                                  env={"DDP_BENCH_PROFILE": str(folder), "DDP_BENCH_PROFILE_RATE": str(args.rate_hz)})
            if "error" in res:
                print(harness.failed(f"{name}:", res), flush=True)
                continue
            ranks = [read_profile(p) for p in sorted(folder.glob("rank*.txt"))]
            if args.raw:
                (args.raw / name).mkdir(parents=True, exist_ok=True)
                for p in folder.glob("rank*.txt"):
                    (args.raw / name / p.name).write_bytes(p.read_bytes())
            step = statistics.median(res["ranks"][0]["step_s"])
            results[name] = {"step_s": step, "split": seconds_per_step(ranks, args.rate_hz, args.steps),
                             "ranks": len(ranks)}
            print(f"{name}: {step:.3f} s/step, {len(ranks)} profiles", flush=True)
    ref = results.get("lightning_ddp", {}).get("step_s")
    text = [f"# Where the step goes: {args.nodes} nodes x {args.nproc_per_node} ranks, inter-node link {args.rate}", "",
            *run.header(),
            f"- the cluster benchmark's model and data ({args.hidden} x {args.layers} MLP, {args.optimizer}),"
            f" {args.steps} timed steps after {args.warmup}",
            f"- every rank sampled by py-spy at {args.rate_hz} Hz over the timed window; seconds a step per category, mean "
            "over the ranks; the training thread (`MainThread`) sums to the step, the communication thread runs "
            "beside it", ""]
    for name, result in results.items():
        text += _table(name, result, ref if name != "lightning_ddp" else None)
    harness.write(args.out, "\n".join(text))
    return 0


if __name__ == "__main__":
    sys.exit(main())
