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
import json
import os
import platform
import shlex
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
DEFAULT_OUT = HERE / "results" / "tensor_parallel.md"
MB = 1e6

CONTENDERS = {
    "lightning_ddp": "Lightning `ddp`, the whole model on every rank",
    "lightning_model_parallel": "Lightning `ModelParallelStrategy`, TP 2 + `fully_shard` on dp (its recipe)",
    "ours_tp2": "ours, TP 2 x DP 2",
    "ours_tp2_zero2": "ours, TP 2 x DP 2, `zero_stage=2`",
    "ours_tp2_int8": "ours, TP 2 x DP 2, `compression=\"int8\"`",
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--contenders", default=",".join(CONTENDERS), help=f"comma-separated subset of {', '.join(CONTENDERS)}")
    p.add_argument("--rate", default="1gbit", help="inter-node link rate per direction, tc notation")
    p.add_argument("--steps", type=int, default=8, help="timed steps")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps before them")
    p.add_argument("--repeats", type=int, default=1, help="runs per contender, interleaved")
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--d-model", type=int, default=384)
    p.add_argument("--heads", type=int, default=6)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--global-batch", type=int, default=16)
    p.add_argument("--timeout", type=float, default=600.0)
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--contender", help=argparse.SUPPRESS)
    p.add_argument("--out-dir", type=Path, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.contenders = [c for c in args.contenders.split(",") if c]
    unknown = [c for c in args.contenders if c not in CONTENDERS]
    if unknown:
        p.error(f"unknown contender(s) {', '.join(unknown)}; choose from {', '.join(CONTENDERS)}")
    return args


# ---------------------------------------------------------------------------------------------- worker (per rank)


def worker(args: argparse.Namespace) -> None:
    import lightning as L
    import torch
    from torch.utils.data import DataLoader

    from ddp_plugin import HierarchicalZeroStrategy
    from ddp_plugin.testing.gpt import GPTModule, token_dataset
    from ddp_plugin.testing.windows import StepWindow

    torch.set_num_threads(1)
    name = args.contender
    size = dict(vocab=args.vocab, d_model=args.d_model, heads=args.heads, layers=args.layers, seq=args.seq)

    class FullyShardRecipe(GPTModule):
        """Lightning's ModelParallelStrategy recipe: tensor parallelism, then FSDP2 on the data-parallel mesh."""

        def configure_model(self) -> None:
            from torch.distributed.fsdp import fully_shard

            super().configure_model()
            dp = self.device_mesh["data_parallel"]
            for block in self.model.blocks:
                fully_shard(block, mesh=dp)
            fully_shard(self.model, mesh=dp)

    L.seed_everything(0, verbose=False)
    tp = name != "lightning_ddp"
    if name == "lightning_ddp":
        strategy: Any = "ddp"
    elif name == "lightning_model_parallel":
        from lightning.pytorch.strategies import ModelParallelStrategy

        strategy = ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=2)
    else:
        flags = {"ours_tp2": {}, "ours_tp2_zero2": {"zero_stage": 2}, "ours_tp2_int8": {"compression": "int8"}}[name]
        strategy = HierarchicalZeroStrategy(tensor_parallel_size=2, **flags)
    model = (FullyShardRecipe if name == "lightning_model_parallel" else GPTModule)(tie="vocab", lr=3e-4, **size)
    world = int(os.environ["WORLD_SIZE"])
    replicas = world // 2 if tp else world
    window = StepWindow(args.warmup, args.steps)
    trainer = L.Trainer(accelerator="cpu", devices=int(os.environ["LOCAL_WORLD_SIZE"]),
                        num_nodes=world // int(os.environ["LOCAL_WORLD_SIZE"]), strategy=strategy,
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
        out["params"] = sum(p.numel() for p in GPTModule(**size).parameters())
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / f"rank{out['rank']}.json").write_text(json.dumps(out))
    if error:
        sys.exit(1)


# ---------------------------------------------------------------------------------------------- driver


def run(args: argparse.Namespace, argv: list[str]) -> int:
    from ddp_plugin.testing.simcluster import SimulatedCluster, available

    ok, reason = available()
    if not ok:
        print(f"benchmarks/tensor_parallel.py: skipped, the simulated cluster cannot run here: {reason}")
        return 0
    results: dict[str, list[dict[str, Any]]] = {c: [] for c in args.contenders}
    started = time.perf_counter()
    common = ["--warmup", str(args.warmup), "--steps", str(args.steps), "--vocab", str(args.vocab), "--d-model",
              str(args.d_model), "--heads", str(args.heads), "--layers", str(args.layers), "--seq", str(args.seq),
              "--global-batch", str(args.global_batch)]
    env = {"OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    with SimulatedCluster(nodes=2, rate=args.rate, prefix="ddptp") as cluster, tempfile.TemporaryDirectory() as tmp:
        for i, name in enumerate(c for _ in range(args.repeats) for c in args.contenders):
            out_dir = Path(tmp) / f"{i}-{name}"
            t0 = time.perf_counter()
            nodes = cluster.launch([str(Path(__file__).resolve()), "--worker", "--contender", name, "--out-dir",
                                    str(out_dir), *common], nproc_per_node=2, env=env, timeout=args.timeout)
            ranks = sorted((json.loads(f.read_text()) for f in out_dir.glob("rank*.json")), key=lambda r: r["rank"])
            errors = sorted({r["error"] for r in ranks if "error" in r})
            if errors or len(ranks) != 4 or not all(n.ok for n in nodes):
                reason = "; ".join(errors) or f"exit codes {[n.returncode for n in nodes]}"
                print(f"{name}: FAILED ({reason})\n" + "\n".join(n.stderr[-2000:] for n in nodes), flush=True)
                results[name].append({"error": reason})
                continue
            results[name].append({"ranks": ranks})
            print(f"{name}: median {statistics.median(ranks[0]['interval_s']):.3f} s/step"
                  f" ({time.perf_counter() - t0:.0f} s wall)", flush=True)
    rows = [summarize(name, results[name], args.steps) for name in args.contenders]
    text = markdown(args, argv, rows, time.perf_counter() - started)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    plot(rows, args.out.with_suffix(".png"), args.rate)
    print(text)
    return 0


def summarize(name: str, runs: list[dict[str, Any]], steps: int) -> dict[str, Any]:
    ok = [r["ranks"] for r in runs if "ranks" in r]
    row: dict[str, Any] = {"name": name, "label": CONTENDERS[name]}
    if not ok:
        row["error"] = runs[-1]["error"]
        return row
    row["median_s"] = statistics.median(statistics.median(ranks[0]["interval_s"]) for ranks in ok)
    per_node = [statistics.mean(r["tx_bytes"] for ranks in ok for r in ranks if r["node"] == n and "tx_bytes" in r)
                for n in (0, 1)]
    row["tx_mb"] = statistics.mean(per_node) / steps / MB
    row["params"] = ok[0][0]["params"]
    row["s_mb"] = row["params"] * 4 / MB
    if all("ours_mb" in r for r in ok[0]):
        row["ours_mb"] = statistics.mean(sum(r["ours_mb"] for r in ranks if r["node"] == n) / steps
                                         for ranks in ok for n in (0, 1))
    row["final_loss"] = statistics.mean(ranks[0]["losses"][-1] for ranks in ok)
    row["peak_rss_mb"] = max(r["maxrss_mb"] for ranks in ok for r in ranks)
    return row


def markdown(args: argparse.Namespace, argv: list[str], rows: list[dict[str, Any]], wall_s: float) -> str:
    import lightning
    import torch

    ok = [r for r in rows if "median_s" in r]
    ref = {r["name"]: r for r in ok}
    lines = [
        f"# Tensor parallelism: 2 nodes x 2 ranks, inter-node link {args.rate}",
        "",
        f"- command: `python benchmarks/tensor_parallel.py{' ' + shlex.join(argv) if argv else ''}`",
        f"- torch {torch.__version__}, lightning {lightning.__version__}, Python {platform.python_version()},"
        f" {os.cpu_count()} CPU cores shared by the 4 ranks; nothing else ran on the machine; {wall_s:.0f} s in all",
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
        "| contender | median s/step | vs Lightning `ddp` | vs `ModelParallelStrategy` | cross-node MB / node / step"
        " | x S | our accounting MB | final loss | peak RSS MB |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        if "median_s" not in r:
            lines.append(f"| {r['label']} | failed: {str(r['error'])[:200]} | | | | | | | |")
            continue

        def ratio(other: str) -> str:
            return f"{r['median_s'] / ref[other]['median_s']:.3f}" if other in ref else "-"

        ours = f"{r['ours_mb']:.2f}" if "ours_mb" in r else "-"
        lines.append(f"| {r['label']} | {r['median_s']:.3f} | {ratio('lightning_ddp')} |"
                     f" {ratio('lightning_model_parallel')} | {r['tx_mb']:.2f} | {r['tx_mb'] / r['s_mb']:.3f} | {ours}"
                     f" | {r['final_loss']:.4f} | {r['peak_rss_mb']:.0f} |")
    return "\n".join(lines) + "\n"


def plot(rows: list[dict[str, Any]], png: Path, rate: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    ok = [r for r in rows if "median_s" in r]
    fig, axes = plt.subplots(1, 2, figsize=(11, 3.6))
    labels = [r["name"] for r in ok]
    axes[0].barh(labels, [r["median_s"] for r in ok], color="tab:blue")
    axes[0].set_xlabel("median s / step")
    axes[1].barh(labels, [r["tx_mb"] / r["s_mb"] for r in ok], color="tab:orange")
    axes[1].set_xlabel("cross-node bytes / node / step, x S")
    for ax in axes:
        ax.invert_yaxis()
    fig.suptitle(f"GPT, 2 nodes x 2 ranks, link {rate}")
    fig.tight_layout()
    fig.savefig(png, dpi=110)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    return run(args, argv)


if __name__ == "__main__":
    sys.exit(main())
