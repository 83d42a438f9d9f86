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
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import cluster  # noqa: E402  (benchmarks/cluster.py: the launcher and the worker's arguments)

DEFAULT_OUT = HERE / "results" / "adaptive.md"
FIXED = ("ours_flat", "ours_hier", "ours_hier_int8")
CONTENDERS = ("lightning_ddp", *FIXED, "ours_auto")
WITHIN_BEST = 1.05


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rates", default="10gbit,1gbit,100mbit", help="link rates, tc notation, comma-separated")
    p.add_argument("--contenders", default=",".join(CONTENDERS))
    p.add_argument("--steps", type=int, default=20, help="timed steps per contender (default 20)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    p.add_argument("--verbose", action="store_true", help="print each plan's link fits and per-bucket times")
    args, rest = p.parse_known_args(argv)
    # Everything else (model size, batch, bucket size, optimizer) is cluster.py's, with its defaults.
    base = cluster.parse_args(["--contenders", args.contenders, "--steps", str(args.steps), "--warmup",
                               str(args.warmup), "--timeout", "900", *rest])
    base.rates = [r.strip() for r in args.rates.split(",") if r.strip()]
    base.repeats, base.out, base.verbose = args.repeats, args.out, args.verbose
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
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    from ddp_plugin.testing.simcluster import SimulatedCluster, available

    ok, reason = available()
    if not ok:
        print(f"benchmarks/adaptive.py: skipped, the simulated cluster cannot run here: {reason}")
        return 0
    revision = cluster._library_revision()
    results: dict[str, dict[str, list[dict[str, Any]]]] = {}
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="adaptive_bench_") as tmp:
        for rate in args.rates:
            results[rate] = {c: [] for c in args.contenders}
            with SimulatedCluster(nodes=args.nodes, rate=rate, prefix="ddpadapt") as net:
                for repeat in range(args.repeats):
                    for name in args.contenders:
                        res = cluster.run_one(net, args, name, Path(tmp) / f"{rate}_{repeat}_{name}")
                        results[rate][name].append(res)
                        report(rate, name, res, args.verbose)
    elapsed = time.perf_counter() - started

    lines = [
        "# Adaptive communication: `auto` against every fixed choice",
        "",
        f"`python benchmarks/adaptive.py {' '.join(argv)}`".rstrip(),
        "",
        f"Library revision {revision}; {time.strftime('%Y-%m-%d')}; the machine was quiet (nothing else ran);"
        f" {elapsed / 60:.1f} minutes. Simulated 2 nodes x 2 ranks, MLP {args.layers} x {args.hidden}"
        f" (S = gradient bytes), batch {args.batch_size} per rank, {args.optimizer}, {args.steps} timed steps after"
        f" {args.warmup}, {args.repeats} run(s) per contender; figure: rank 0's mean interval from one batch start"
        " to the next (every synchronization counted).",
        "",
    ]
    verdicts = []
    for rate, by_name in results.items():
        means = {n: statistics.mean(mean_interval(r) for r in runs if "error" not in r)
                 for n, runs in by_name.items() if any("error" not in r for r in runs)}
        ddp = means.get("lightning_ddp")
        fixed = {n: means[n] for n in FIXED if n in means}
        best = min(fixed, key=fixed.get) if fixed else None
        lines += [f"## {rate}", "", "| contender | mean s/step | vs Lightning `ddp` | vs best fixed | what the plan chose |",
                  "| --- | --- | --- | --- | --- |"]
        for name, runs in by_name.items():
            if name not in means:
                lines.append(f"| {cluster.CONTENDERS[name][0]} | failed: {runs[0].get('error')} | | | |")
                continue
            m = means[name]
            lines.append(f"| {cluster.CONTENDERS[name][0]} | {m:.3f} | {m / ddp:.3f} | {m / fixed[best]:.3f} |"
                         f" {plan_summary(runs[-1]) if 'error' not in runs[-1] else '-'} |"
                         if ddp and best else f"| {name} | {m:.3f} | | | |")
        lines.append("")
        if "ours_auto" in means and ddp and best:
            auto = means["ours_auto"]
            ok_best, ok_ddp = auto <= WITHIN_BEST * fixed[best], auto <= ddp
            verdicts.append(f"- {rate}: `auto` {auto:.3f} s against the best fixed choice ({best}) {fixed[best]:.3f} s:"
                            f" {auto / fixed[best]:.3f}x, **{'within' if ok_best else 'NOT within'} {WITHIN_BEST}x**;"
                            f" against Lightning `ddp` {ddp:.3f} s: {auto / ddp:.3f}x,"
                            f" **{'not slower' if ok_ddp else 'SLOWER'}**")
    lines += ["## Verdict", "", *verdicts, ""]
    text = "\n".join(lines)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
