"""Tensor parallelism benchmark: a GPT on the simulated 2-node x 2-rank cluster, TP 2 inside each node and data
parallelism across, against Lightning's ``ModelParallelStrategy`` (its documented recipe: TP 2 + ``fully_shard``
on the data-parallel mesh, no clipping) and Lightning ``ddp`` without tensor parallelism.

    python benchmarks/tensor_parallel.py                        # 1 Gbit/s, ~5 minutes on 2 cores
    python benchmarks/tensor_parallel.py --rate 100mbit --contenders lightning_ddp,ours_tp2

Every contender trains the same GPT (``ddp_plugin.testing.gpt``, tied embedding split by vocabulary where tensor
parallelism is on) from the same seed on the same token windows, global batch 16, AdamW, under Lightning, one
torchrun per node (``benchmarks/tensor_parallel.py --worker``). Measured on the timed window (after the warmup
steps): the interval from one batch's start to the next's on rank 0 (so every synchronization is counted), median
over the steps; cross-node bytes per node and step from the node's veth counters (read by its local rank 0 after a
barrier at the window's start and end); our own accounting (``comm/cross_node_MB``); peak RSS of every rank.

Writes ``benchmarks/results/tensor_parallel.md`` (``--out``) and a PNG beside it. Needs root and iproute2; where the
cluster cannot be built it prints why and exits 0. A benchmark, not a test: it asserts nothing.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

import harness

DEFAULT_OUT = harness.RESULTS / "tensor_parallel.md"

CONTENDERS: dict[str, tuple[str, dict[str, Any] | None]] = {
    "lightning_ddp": ("Lightning `ddp`, the whole model on every rank", None),
    "lightning_model_parallel": ("Lightning `ModelParallelStrategy`, TP 2 + `fully_shard` on dp (its recipe)", None),
    "ours_tp2": ("ours, TP 2 x DP 2", {}),
    "ours_tp2_zero2": ("ours, TP 2 x DP 2, `zero_stage=2`", {"zero_stage": 2}),
    "ours_tp2_int8": ("ours, TP 2 x DP 2, `compression=\"int8\"`", {"compression": "int8"}),
}
"""name -> (label, ``HierarchicalZeroStrategy`` flags beside ``tensor_parallel_size=2``; None: Lightning's own)"""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = harness.parser(__doc__)
    harness.add_names(p, "--contenders", CONTENDERS, CONTENDERS)
    harness.add_link(p, nodes=None, rate="1gbit")
    harness.add_gpt(p)
    harness.add_common(p, out=DEFAULT_OUT, repeats=1, repeats_help="runs per contender, interleaved")
    args = p.parse_args(argv)
    args.contenders = harness.names(p, args.contenders, CONTENDERS)
    return args


# ---------------------------------------------------------------------------------------------- worker (per rank)


def worker(args: argparse.Namespace) -> None:
    import lightning as L
    import torch

    from ddp_plugin import HierarchicalZeroStrategy
    from ddp_plugin.testing.gpt import GPTModule
    from ddp_plugin.testing.windows import StepWindow

    torch.set_num_threads(1)
    name = args.contender
    size = dict(vocab=args.vocab, d_model=args.d_model, heads=args.heads, layers=args.layers, seq=args.seq)
    L.seed_everything(0, verbose=False)
    tp = name != "lightning_ddp"
    if name == "lightning_ddp":
        strategy: Any = "ddp"
    elif name == "lightning_model_parallel":
        from lightning.pytorch.strategies import ModelParallelStrategy

        strategy = ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=2)
    else:
        strategy = HierarchicalZeroStrategy(tensor_parallel_size=2, **CONTENDERS[name][1])
    model = (harness.fully_shard_gpt() if name == "lightning_model_parallel" else GPTModule)(tie="vocab", lr=3e-4,
                                                                                              **size)
    world = int(os.environ["WORLD_SIZE"])
    harness.fit_gpt_window(args, strategy, model, StepWindow(args.warmup, args.steps), world // 2 if tp else world)


# ---------------------------------------------------------------------------------------------- driver


def run(args: argparse.Namespace, argv: list[str]) -> int:
    if not harness.need_cluster("tensor_parallel.py"):
        return 0
    from ddp_plugin.testing.simcluster import SimulatedCluster

    bench = harness.Run(__file__, argv, quiet=args.quiet, ranks=4)
    results: dict[str, list[dict[str, Any]]] = {c: [] for c in args.contenders}
    with SimulatedCluster(nodes=2, rate=args.rate, prefix="ddptp") as cluster, tempfile.TemporaryDirectory() as tmp:
        for i, name in enumerate(harness.interleaved(args.contenders, args.repeats)):
            results[name].append(harness.launch_gpt(cluster, __file__, args, name, Path(tmp) / f"{i}-{name}", 2, name))
    rows = [summarize(name, results[name], args.steps) for name in args.contenders]
    png = args.out.with_suffix(".png")
    plotted = plot(rows, png, args.rate)
    harness.write(args.out, markdown(args, bench, rows), also=[png] if plotted else [])
    return 0


def plot(rows: list[dict[str, Any]], png: Path, rate: str) -> bool:
    ok = [r for r in rows if "median_s" in r]
    plt = harness.pyplot() if ok else None
    if plt is None:
        return False
    fig, axes = plt.subplots(1, 2, figsize=(11, 3.6))
    labels = [r["name"] for r in ok]
    axes[0].barh(labels, [r["median_s"] for r in ok], color="tab:blue")
    axes[0].set_xlabel("median s / step")
    axes[1].barh(labels, [r["tx_mb"] / r["s_mb"] for r in ok], color="tab:orange")
    axes[1].set_xlabel("cross-node bytes / node / step, x S")
    for ax in axes:
        ax.invert_yaxis()
    fig.suptitle(f"GPT, 2 nodes x 2 ranks, link {rate}")
    harness.save_figure(fig, png)
    return True


def summarize(name: str, runs: list[dict[str, Any]], steps: int) -> dict[str, Any]:
    ok = [r["ranks"] for r in runs if "ranks" in r]
    row: dict[str, Any] = {"name": name, "label": CONTENDERS[name][0]}
    if not ok:
        row["error"] = runs[-1]["error"]
        return row
    row.update(harness.gpt_row(ok, steps))
    row["final_loss"] = statistics.mean(ranks[0]["losses"][-1] for ranks in ok)
    return row


def markdown(args: argparse.Namespace, bench: harness.Run, rows: list[dict[str, Any]]) -> str:
    ok = [r for r in rows if "median_s" in r]
    ref = {r["name"]: r for r in ok}
    lines = [
        f"# Tensor parallelism: 2 nodes x 2 ranks, inter-node link {args.rate}",
        "",
        *bench.header(),
        f"- model: GPT (`ddp_plugin.testing.gpt`), vocab {args.vocab}, d {args.d_model}, {args.heads} heads,"
        f" {args.layers} layers, seq {args.seq}, tied embedding"
        + (f", {ok[0]['params']:,} parameters, S = {ok[0]['s_mb']:.2f} MB of fp32 gradients" if ok else "")
        + f"; global batch {args.global_batch}, AdamW, {args.warmup} warmup + {args.steps} timed steps,"
        f" {args.repeats} run(s) per contender",
        "- tensor-parallel contenders: Megatron's split (q/k/v and MLP-in by columns, attention-out and MLP-out by"
        " rows), embedding and head split by vocabulary; TP groups inside a node, data parallelism across the link",
        "- s/step: interval from one batch's start to the next's on rank 0, median; cross-node MB: the node's veth"
        " counter over the window / steps, mean of the 2 nodes; peak RSS: max over ranks",
        "",
    ]
    cells = []
    for r in rows:
        if "median_s" not in r:
            cells.append([r["label"], f"failed: {str(r['error'])[:200]}"])
            continue
        ratio = {other: f"{r['median_s'] / ref[other]['median_s']:.3f}" if other in ref else "-"
                 for other in ("lightning_ddp", "lightning_model_parallel")}
        cells.append([r["label"], f"{r['median_s']:.3f}", ratio["lightning_ddp"], ratio["lightning_model_parallel"],
                      f"{r['tx_mb']:.2f}", f"{r['tx_mb'] / r['s_mb']:.3f}", harness.fmt(r.get("ours_mb"), ".2f"),
                      f"{r['final_loss']:.4f}", f"{r['peak_rss_mb']:.0f}"])
    lines += harness.table(["contender", "median s/step", "vs Lightning `ddp`", "vs `ModelParallelStrategy`",
                            "cross-node MB / node / step", "x S", "our accounting MB", "final loss", "peak RSS MB"], cells)
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    return harness.dispatch(argv, parse_args, worker, run)


if __name__ == "__main__":
    sys.exit(main())
