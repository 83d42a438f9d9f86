"""Adaptive communication benchmark: ``compression="auto"`` (the link probe decides route, codec and bucket size)
against every fixed choice and Lightning ``ddp``, at several link rates, in one run.

    python benchmarks/adaptive.py                                      # 10gbit, 1gbit, 100mbit; ~25 minutes on 2 cores
    python benchmarks/adaptive.py --rates 1gbit --steps 10 --out /tmp/adaptive.md

The same simulated cluster, MLP (11.55M parameters, S = 46.2 MB) and worker as ``benchmarks/cluster.py``
(``cluster_worker.py``), one contender after another, rate after rate. The figure per contender is the **mean
interval from one batch start to the next** over the timed steps, so every synchronization is counted (rank
0's; the workers time every step from ``on_train_batch_start`` to the next). Contenders: Lightning ``ddp``, ours
flat (``hierarchical=False``), hierarchical, hierarchical + int8, and ``auto`` (``hierarchical=None,
compression="auto", bucket_size_mb="auto"``); for ``auto`` the table also says what the plan chose (routes and
codecs per bucket, bucket size, probe time).

Done when (issue 28), at every rate: ``auto`` within 1.05x of the best fixed choice, and never slower than
Lightning ``ddp``. Needs root and iproute2 (prints why and exits 0 otherwise). A benchmark, not a test.
"""

from __future__ import annotations

import argparse
import collections
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

import cluster  # benchmarks/cluster.py: the launcher and the worker's arguments
import harness

DEFAULT_OUT = harness.RESULTS / "adaptive.md"
FIXED = ("ours_flat", "ours_hier", "ours_hier_int8")
CONTENDERS = ("lightning_ddp", *FIXED, "ours_auto")
WITHIN_BEST = 1.05


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = harness.parser(__doc__)
    p.add_argument("--rates", default="10gbit,1gbit,100mbit", help="link rates, tc notation, comma-separated")
    harness.add_names(p, "--contenders", cluster.CONTENDERS, CONTENDERS,
                      help=f"comma-separated contenders of cluster.py (default: {','.join(CONTENDERS)})")
    p.add_argument("--steps", type=int, default=20, help="timed steps per contender (default 20)")
    p.add_argument("--warmup", type=int, default=3)
    harness.add_common(p, out=DEFAULT_OUT, repeats=1)
    p.add_argument("--verbose", action="store_true", help="print each plan's link fits and per-bucket times")
    args, rest = p.parse_known_args(argv)
    # Everything else (model size, batch, bucket size, optimizer) is cluster.py's, with its defaults.
    base = cluster.parse_args(["--contenders", args.contenders, "--steps", str(args.steps), "--warmup",
                               str(args.warmup), "--timeout", "900", *rest])
    base.rates = harness.split(args.rates)
    base.repeats, base.out, base.verbose, base.quiet = args.repeats, args.out, args.verbose, args.quiet
    return base


def mean_interval(res: dict[str, Any]) -> float:
    return statistics.mean(res["ranks"][0]["step_s"])


def plan_summary(res: dict[str, Any]) -> str:
    plan = res["ranks"][0].get("comm_plan")
    if plan is None:
        return "-"
    counts = collections.Counter(f"{b['route']}+{b['codec']}" for b in plan["buckets"].values())
    chosen = ", ".join(f"{n}x {k}" for k, n in counts.most_common())
    return (f"{chosen}; buckets of {plan['bucket_size_mb']:.1f} MiB; probe {plan['probe_s']:.2f} s;"
            f" plan v{plan['version']}")


def report(rate: str, name: str, res: dict[str, Any], verbose: bool) -> None:
    """One contender's run as it ends; with ``verbose`` the plan's fits, per-bucket times and close calls."""
    if "error" in res:
        print(f"{rate} {name}: FAILED {res['error']}\n{res['log']}", flush=True)
        return
    print(f"{rate} {name:<16} mean {mean_interval(res):.3f} s/step  {plan_summary(res)}", flush=True)
    plan = res["ranks"][0].get("comm_plan")
    if plan is None or not verbose:
        return
    for stage, fit in plan["links"].items():
        print(f"    {stage:<22} {fit['latency_ms']:8.2f} ms {fit['MB_per_s']:9.1f} MB/s")
    for key, b in plan["buckets"].items():
        print(f"    bucket {key:<4} {b['MB']:6.2f} MB {b['route']:<12} {b['codec']:<5}"
              f" predicted {b['predicted_ms']:7.1f} ms measured {b['measured_ms'] or 0:7.1f} ms")
    if plan.get("bucket_reason"):
        print(f"    bucket size: {plan['bucket_reason']}")
    for reason in plan.get("reasons", ()):
        print(f"    close call: {reason}")


def main(argv: list[str] | None = None) -> int:
    started = harness.start(__file__, argv, parse_args, cluster="skip", ranks=harness.cluster_ranks)
    if started is None:
        return 0
    args, run = started
    from ddp_plugin.testing.simcluster import SimulatedCluster

    results: dict[str, dict[str, list[dict[str, Any]]]] = {}
    with tempfile.TemporaryDirectory(prefix="adaptive_bench_") as tmp:
        for rate in args.rates:
            results[rate] = {c: [] for c in args.contenders}
            with SimulatedCluster(nodes=args.nodes, rate=rate, prefix="ddpadapt") as net:
                for repeat in range(args.repeats):
                    for name in args.contenders:
                        res = cluster.run_one(net, args, name, Path(tmp) / f"{rate}_{repeat}_{name}")
                        results[rate][name].append(res)
                        report(rate, name, res, args.verbose)

    lines = [
        "# Adaptive communication: `auto` against every fixed choice",
        "",
        *run.header(),
        f"- setup: simulated 2 nodes x 2 ranks, MLP {args.layers} x {args.hidden} (S = gradient bytes), batch"
        f" {args.batch_size} per rank, {args.optimizer}, {args.steps} timed steps after {args.warmup}, {args.repeats}"
        " run(s) per contender; figure: rank 0's mean interval from one batch start to the next (every"
        " synchronization counted)",
        "",
    ]
    verdicts = []
    for rate, by_name in results.items():
        means = {n: statistics.mean(mean_interval(r) for r in runs if "error" not in r)
                 for n, runs in by_name.items() if any("error" not in r for r in runs)}
        ddp = means.get("lightning_ddp")
        fixed = {n: means[n] for n in FIXED if n in means}
        best = min(fixed, key=fixed.get) if fixed else None
        rows = []
        for name, runs in by_name.items():
            label = cluster.CONTENDERS[name][0]
            if name not in means:
                rows.append([label, f"failed: {runs[0].get('error')}"])
            elif ddp and best:
                m = means[name]
                rows.append([label, f"{m:.3f}", f"{m / ddp:.3f}", f"{m / fixed[best]:.3f}",
                             plan_summary(runs[-1]) if "error" not in runs[-1] else "-"])
            else:
                rows.append([name, f"{means[name]:.3f}"])
        lines += [f"## {rate}", "", *harness.table(["contender", "mean s/step", "vs Lightning `ddp`", "vs best fixed",
                                                    "what the plan chose"], rows, "lrrrl"), ""]
        if "ours_auto" in means and ddp and best:
            auto = means["ours_auto"]
            ok_best, ok_ddp = auto <= WITHIN_BEST * fixed[best], auto <= ddp
            verdicts.append(f"- {rate}: `auto` {auto:.3f} s against the best fixed choice ({best}) {fixed[best]:.3f} s:"
                            f" {auto / fixed[best]:.3f}x, **{'within' if ok_best else 'NOT within'} {WITHIN_BEST}x**;"
                            f" against Lightning `ddp` {ddp:.3f} s: {auto / ddp:.3f}x,"
                            f" **{'not slower' if ok_ddp else 'SLOWER'}**")
    lines += ["## Verdict", "", *verdicts, ""]
    harness.write(args.out, "\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
