"""Cluster benchmark: every contender on a simulated 2-node x 2-rank cluster with a capped inter-node link.

    python benchmarks/cluster.py                                   # the default set, 1 Gbit/s, ~6-7 minutes on 2 cores
    python benchmarks/cluster.py --contenders lightning_ddp,ours_hier --steps 8 --rate 500mbit

ZeRO stages, ours beside DeepSpeed (needs ``pip install deepspeed``; ~8 minutes on 2 cores)::

    python benchmarks/cluster.py --contenders lightning_ddp,deepspeed_zero1,deepspeed_zero2,deepspeed_zero3,ours_zero1,ours_zero2,ours_zero3,ours_zero3_node --out benchmarks/results/zero.md

Sync modes (nodes synchronize every 16 steps: DiLoCo, streaming with 16 fragments and max_staleness=1, and the
same with int8) beside synchronous training and the uncapped floor, at a slow link; the timed steps a multiple of
16 so that every fragment crosses equally often in the window::

    python benchmarks/cluster.py --contenders lightning_ddp,ours_hier,ours_hier_int8,ours_diloco16,ours_diloco16_streaming,ours_diloco16_streaming_int8,uncapped_floor --steps 32 --rate 100mbit --out benchmarks/results/sync_100mbit.md

The ZeRO and sync contenders are not in the default set (it writes ``benchmarks/results/cluster.md``); selecting any of
them switches every contender of the run to AdamW (``--optimizer auto``), so that optimizer state exists to shard.

The nodes are network namespaces joined by a veth pair whose egress is capped with tbf
(:class:`ddp_plugin.testing.simcluster.SimulatedCluster`). Each contender is one torchrun
job per node running ``benchmarks/cluster_worker.py`` on the same MLP, data and seed; see that file for what is
measured and how. This driver runs the contenders one after the other, in one run, and writes

- a markdown table (``--out``, default ``benchmarks/results/cluster.md``): median step time, its ratio to
  Lightning ``ddp``, cross-node MB per node per step from the kernel's veth counters and as a multiple of the
  gradient size S, our own traffic accounting next to it, final loss, live tensor MB per rank after backward and
  after an optimizer step (the same ``gc`` walk for every contender), peak RSS; for ours also the strategy's
  ``memory_bytes()``;
- a PNG plot next to it (same name, ``.png``; needs ``pip install matplotlib``).

The headline is the acceptance check for ``hierarchical_zero`` without a codec: cross-node bytes per node per
step <= 1.02 S, and a median step time below both Lightning ``ddp`` and torch FSDP2 hybrid sharding.

Needs root and iproute2; on a machine that cannot build the cluster it prints why and exits 0. A contender that
fails (DeepSpeed not installed, a ZeRO stage of ours not implemented yet) gets a "failed: <error>" row and the
run goes on. This is a benchmark, not a test: it asserts nothing, and its numbers depend on the machine.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import harness
from harness import MB, cell, fmt

HERE = Path(__file__).resolve().parent
WORKER = HERE / "cluster_worker.py"
DEFAULT_OUT = harness.RESULTS / "cluster.md"

LABELS = {
    "lightning_ddp": "Lightning `ddp`",
    "fsdp2_hybrid": "torch FSDP2 hybrid sharding (2 nodes x 2 shards)",
    "fsdp2_full": "torch FSDP2 full sharding (over all 4 ranks)",
    "ours_flat": "ours, flat (`hierarchical=False`)",
    "ours_hier": "ours, hierarchical",
    "ours_hier_fp16": "ours, hierarchical + fp16",
    "ours_hier_int8": "ours, hierarchical + int8",
    "ours_hier_powersgd": "ours, hierarchical + powersgd (rank 4)",
    "torch_ddp_powersgd": "torch DDP + PowerSGD hook (rank 4, 1 bucket)",
    "ours_int8": "ours, int8, `hierarchical=None` (the link probe routes each bucket)",
    "ours_auto": "ours, `compression=\"auto\"`, `bucket_size_mb=\"auto\"` (the link probe decides)",
    "ours_auto_fixed_buckets": "ours, `compression=\"auto\"` (25 MiB buckets)",
    "ours_diloco16": "ours, DiLoCo (`sync_every=16`)",
    "ours_diloco16_streaming": "ours, streaming DiLoCo (`sync_every=16, sync_fragments=16, max_staleness=1`)",
    "ours_diloco16_streaming_int8": "ours, streaming DiLoCo + int8",
    "ours_diloco16_streaming_sparse": "ours, streaming DiLoCo + sparse 1.5 %, 2 bits (SparseLoCo: decay 0.95,"
                                      " `outer_optimizer=\"average\"`)",
    "uncapped_floor": "uncapped floor: Lightning `ddp`, link not capped",
    # ZeRO group: not in the default selection (see the module docstring).
    "deepspeed_zero1": "DeepSpeed ZeRO-1",
    "deepspeed_zero2": "DeepSpeed ZeRO-2",
    "deepspeed_zero3": "DeepSpeed ZeRO-3",
    "ours_zero1": "ours, ZeRO-1 (hierarchical, global shards)",
    "ours_zero2": "ours, ZeRO-2 (hierarchical, global shards)",
    "ours_zero3": "ours, ZeRO-3 (hierarchical, global shards)",
    "ours_zero3_prefetch1": "ours, ZeRO-3 (global shards, `prefetch_units=1`)",
    "ours_zero3_inbw": "ours, ZeRO-3 (hierarchical, global shards, `optimizer_in_backward`)",
    "ours_zero3_inbw_p1": "ours, ZeRO-3 (global shards, `optimizer_in_backward`, `prefetch_units=1`)",
    "ours_zero3_node": "ours, ZeRO-3 (hierarchical, shards inside a node)",
}
RUN_AS = {"uncapped_floor": ("lightning_ddp", None)}
"""The contenders that are not the worker's contender of their name on the capped link: (worker contender, rate)."""
# name -> (label, worker contender, link rate: "capped" uses --rate, None is an uncapped link)
CONTENDERS: dict[str, tuple[str, str, str | None]] = {
    name: (label, *RUN_AS.get(name, (name, "capped"))) for name, label in LABELS.items()}
# Each of ours with the other glibc setting (`release_cpu_memory`): on for the stage-0 paths, off for ZeRO-2/3.
CONTENDERS.update({f"{name}_release": (f"{label}, `release_cpu_memory=True`", f"{worker}_release", rate)
                   for name, (label, worker, rate) in list(CONTENDERS.items())
                   if name.startswith(("ours_hier", "ours_flat", "ours_diloco", "ours_int8"))})
CONTENDERS.update({f"{name}_keep_heap": (f"{label}, `release_cpu_memory=False`", f"{worker}_keep_heap", rate)
                   for name, (label, worker, rate) in list(CONTENDERS.items())
                   if name in ("ours_zero2", "ours_zero3", "ours_zero3_prefetch1")})
GLIBC_CONTENDERS = tuple(c for c in CONTENDERS if c.endswith(("_release", "_keep_heap")))
ZERO_CONTENDERS = tuple(c for c in CONTENDERS if c.startswith(("deepspeed_zero", "ours_zero")))
SYNC_CONTENDERS = {"ours_diloco16": (16, 1, 1), "ours_diloco16_streaming": (16, 1, 16),
                   "ours_diloco16_streaming_int8": (16, 4, 16), "ours_diloco16_streaming_sparse": (16, 100, 16)}
"""Sync-mode contenders: (sync_every H, codec ratio c, fragments F); the acceptance bound on cross-node bytes is
S / (c H), plus, without a codec (the outer state sharded over the nodes), the padding of each part to n equal
shares: at most n - 1 fp32 values per part, each way (:func:`_share_padding_mb`)."""
SYNC_FLOOR_RATIO = 1.10  # the acceptance bound on a sync mode's step time, x the uncapped floor's
DEFAULT_CONTENDERS = tuple(c for c in CONTENDERS if c not in ZERO_CONTENDERS and c not in SYNC_CONTENDERS
                           and c not in GLIBC_CONTENDERS and c not in ("fsdp2_full", "ours_auto_fixed_buckets", "ours_int8"))
OPTIMIZERS = {"sgd": "SGD(lr=0.01, momentum=0.9)", "adamw": "AdamW(lr=1e-3), torch's other defaults"}
ACCEPTANCE_BYTES = 1.02  # x S, per node and step, hierarchical without a codec
ZERO3_RSS_MARGIN_MB = 140  # ours at ZeRO-3 over every rank: peak RSS at least this far below Lightning ddp's
ZERO3_STEP_RATIO = 1.3  # ... and a step within this multiple of ddp's


def build_parser() -> argparse.ArgumentParser:
    """The command line's options (``benchmarks/regression.py`` builds on them)."""
    p = harness.parser(__doc__)
    harness.add_names(p, "--contenders", CONTENDERS, DEFAULT_CONTENDERS,
                      help=f"comma-separated subset of: {', '.join(CONTENDERS)} (default: all but the ZeRO ones, in"
                           " this order)")
    harness.add_link(p, nodes=2, rate="1gbit")
    p.add_argument("--steps", type=int, default=8, help="timed steps per contender (default 8)")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps before them (default 3)")
    harness.add_common(p, out=DEFAULT_OUT, out_help="markdown file; the plot goes next to it as .png", repeats=2,
                       repeats_help="runs per contender (default 2); the order cycles through all contenders, so a"
                                    " slow spell of the machine hits several of them rather than one")
    p.add_argument("--nproc-per-node", type=int, default=2)
    p.add_argument("--hidden", type=int, default=1024, help="MLP hidden width")
    p.add_argument("--layers", type=int, default=11, help="hidden (hidden x hidden) Linear layers")
    p.add_argument("--features", type=int, default=32)
    p.add_argument("--classes", type=int, default=10)
    p.add_argument("--batch-size", type=int, default=8, help="per rank; tiny, so the step is communication-bound")
    p.add_argument("--bucket-size-mb", type=float, default=25.0,
                   help="Lightning ddp's and ours; DeepSpeed's reduce_bucket_size is the same in fp32 elements")
    p.add_argument("--optimizer", choices=("auto", *OPTIMIZERS), default="auto",
                   help="every contender's optimizer; auto (default): adamw when a ZeRO contender is selected, else sgd")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds per contender before it is killed")
    p.add_argument("--seed", type=int, default=0)
    return p


def parse_args(argv: list[str] | None = None, parser: argparse.ArgumentParser | None = None) -> argparse.Namespace:
    p = build_parser() if parser is None else parser
    args = p.parse_args(argv)
    args.contenders = harness.names(p, args.contenders, CONTENDERS)
    if args.optimizer == "auto":
        args.optimizer = "adamw" if any(c in ZERO_CONTENDERS for c in args.contenders) else "sgd"
    return args


# ---------------------------------------------------------------------------------------------- running


WORKER_OPTIONS = ("steps", "warmup", "hidden", "layers", "features", "classes", "batch_size", "bucket_size_mb", "seed",
                  "optimizer")
"""The options every rank of a contender gets (``cluster_worker.py`` at any commit takes them)."""


def _worker_argv(args: argparse.Namespace, contender: str, out_dir: Path, worker: Path = WORKER) -> list[str]:
    return [str(worker), "--contender", contender, "--out-dir", str(out_dir), *harness.forward(args, *WORKER_OPTIONS)]


def run_one(cluster: Any, args: argparse.Namespace, name: str, out_dir: Path, worker: Path = WORKER,
            env: dict[str, str] | None = None) -> dict[str, Any]:
    """Launch one contender on ``cluster``; return its per-rank results, or the error. ``worker`` and ``env`` (added
    to the ranks' environment) let ``benchmarks/regression.py`` run another commit's worker and package."""
    _, worker_contender, _ = CONTENDERS[name]
    res = harness.launch_ranks(cluster, _worker_argv(args, worker_contender, out_dir, worker),
                               nproc_per_node=args.nproc_per_node, out_dir=out_dir, timeout=args.timeout, env=env)
    return {"name": name, **res}


def cluster_for(clusters: harness.Clusters, args: argparse.Namespace, name: str) -> Any:
    """The cluster a contender runs on: the capped link at ``--rate``, or the uncapped one (the floor)."""
    return clusters(args.rate if CONTENDERS[name][2] == "capped" else None)


def summarize(name: str, runs: list[dict[str, Any]], nodes: int) -> dict[str, Any]:
    """One table row from a contender's runs: medians of per-run values, bytes averaged over runs."""
    ok = [r for r in runs if "ranks" in r]
    row: dict[str, Any] = {"name": name, "label": CONTENDERS[name][0], "runs": len(runs), "failed": len(runs) - len(ok),
                           "wall_s": statistics.mean(r["wall_s"] for r in runs)}
    if not ok:
        row["error"] = runs[-1]["error"]
        return row
    per_run_median = [statistics.median(r["ranks"][0]["step_s"]) for r in ok]
    row["median_s"] = statistics.median(per_run_median)
    row["mean_s"] = statistics.mean(statistics.mean(r["ranks"][0]["step_s"]) for r in ok)  # amortized
    row["per_run_median_s"] = per_run_median
    all_steps = sorted(t for r in ok for t in r["ranks"][0]["step_s"])
    row["p90_s"] = all_steps[min(len(all_steps) - 1, round(0.9 * (len(all_steps) - 1)))]
    first = ok[0]["ranks"][0]
    row["grad_bytes"] = first["grad_bytes"]
    row["params"] = first["params"]
    row["environment"] = first.get("environment")
    row["buckets"] = first.get("buckets")
    row["nodes"], row["ranks_per_node"] = nodes, len(ok[0]["ranks"]) // nodes
    row["final_loss"] = statistics.mean(r["ranks"][0]["losses"][-1] for r in ok)
    row["peak_rss_mb"] = max(rank["maxrss_mb"] for r in ok for rank in r["ranks"])
    row["optimizer"] = first.get("optimizer", "sgd")
    # The link probe's plan, rank 0's at the end of each run (every rank holds rank 0's): whether runs of one job
    # routed and coded each bucket alike.
    # Each run's peak RSS beside its plan: a close call's trial times the runner-up for a few steps, and its memory.
    plans = [(r["ranks"][0]["comm_plan"], max(rank["maxrss_mb"] for rank in r["ranks"])) for r in ok
             if r["ranks"][0].get("comm_plan")]
    if plans:
        row["plans"] = [{"version": p["version"], "decisions": p["decisions"], "reasons": p.get("reasons", []),
                         "links": p.get("links", {}), "peak_rss_mb": rss} for p, rss in plans]
    # Memory per rank: per run the largest rank, then the mean over runs. Worker key -> row key; "_backward" is the
    # probe step's count after backward, the others are after the last timed optimizer step.
    for key, field in (("live_tensor_bytes", "live_tensor"), ("optimizer_state_bytes", "optimizer_state"),
                       ("live_tensor_bytes_backward", "live_tensor_backward")):
        if all(key in rank for r in ok for rank in r["ranks"]):
            row[f"{field}_mb"] = statistics.mean(max(rank[key] for rank in r["ranks"]) for r in ok) / MB
            row[f"{field}_mb_ranks"] = [statistics.mean(r["ranks"][i][key] for r in ok) / MB
                                        for i in range(len(ok[0]["ranks"]))]
    for key, field in (("memory_bytes", "memory_mb"), ("memory_bytes_backward", "memory_backward_mb")):
        if all(key in rank for r in ok for rank in r["ranks"]):
            row[field] = {k: statistics.mean(max(rank[key][k] for rank in r["ranks"]) for r in ok) / MB for k in first[key]}
    mem_errors = {rank[k] for r in ok for rank in r["ranks"] for k in ("memory_bytes_error", "memory_bytes_error_backward")
                  if k in rank}
    if mem_errors:
        row["memory_bytes_error"] = "; ".join(sorted(mem_errors))
    # Cross-node bytes per node and timed step: each node's local rank 0 read its veth's counters.
    tx = {n: [] for n in range(nodes)}
    rx = {n: [] for n in range(nodes)}
    ours = {n: [] for n in range(nodes)}
    wait_ms = []
    for r in ok:
        for rank in r["ranks"]:
            steps = rank["timed_steps"]
            if "tx_bytes" in rank:
                tx[rank["node"]].append(rank["tx_bytes"] / steps / MB)
                rx[rank["node"]].append(rank["rx_bytes"] / steps / MB)
        for n in range(nodes):
            window = [rank["ours_window"] for rank in r["ranks"] if rank["node"] == n and "ours_window" in rank]
            if window:
                ours[n].append(sum(w["comm/cross_node_MB"] for w in window))
                wait_ms.extend(w["comm/wait_ms"] for w in window)
    row["tx_mb_node"] = [statistics.mean(tx[n]) for n in range(nodes)]
    row["rx_mb_node"] = [statistics.mean(rx[n]) for n in range(nodes)]
    row["tx_mb"] = statistics.mean(row["tx_mb_node"])
    row["x_s"] = row["tx_mb"] * MB / row["grad_bytes"]
    if all(ours.values()):
        row["ours_mb_node"] = [statistics.mean(ours[n]) for n in range(nodes)]
        row["ours_mb"] = statistics.mean(row["ours_mb_node"])
        row["agreement_pct"] = [100 * (o - k) / k for o, k in zip(row["ours_mb_node"], row["tx_mb_node"])]
        row["wait_ms"] = statistics.mean(wait_ms)
    return row


# ---------------------------------------------------------------------------------------------- reporting


def _plans_section(rows: list[dict[str, Any]]) -> list[str]:
    """Each run's plan at its end, per contender that planned: per bucket the route and the codec, and whether the
    run planned as the contender's first run did."""
    cells = []
    for r in rows:
        plans = r.get("plans") or []
        for i, plan in enumerate(plans, 1):
            buckets = ", ".join(f"{k} {route} / {codec}" for k, (route, codec) in sorted(plan["decisions"].items()))
            same = plan["decisions"] == plans[0]["decisions"]
            links = ", ".join(f"{name} {fit['latency_ms']:.2f} / {fit['MB_per_s']:.0f}"
                              for name, fit in plan.get("links", {}).items())
            cells.append([r["label"], i, plan["version"], buckets, "yes" if same else "**no**",
                          cell("; ".join(plan.get("reasons") or []) or "none", 400), fmt(plan.get("peak_rss_mb"), ".0f"),
                          links or "-"])
    return ["Each run's plan at its end (rank 0's, which every rank holds): per bucket, the route and the codec; the"
            " version counts the plans the run made; the close calls it settled by timing both options (trials), and"
            " the run's peak RSS (max over ranks); the probe's fits of each stage (latency ms / MB/s).", "",
            *harness.table(["contender", "run", "version", "buckets (route / codec)", "as run 1", "close calls tried",
                            "peak RSS MB", "probe"], cells, "lrrlllrl")]


def _ds_version() -> str | None:
    try:
        from importlib.metadata import version

        return version("deepspeed")
    except Exception:  # noqa: BLE001
        return None


def _setup_lines(args: argparse.Namespace, rows: list[dict[str, Any]], s_mb: float, params: int) -> list[str]:
    """What this run measured and how (the header says where and when)."""
    lines = [
        f"- cluster: `ddp_plugin.testing.simcluster.SimulatedCluster(nodes={args.nodes}, rate={args.rate!r})`,"
        " one network namespace per node, veth link capped with tbf per direction; gloo over the veth"
        " (`GLOO_SOCKET_IFNAME`), intra-node traffic over the namespace's loopback; one torchrun per node",
        f"- model: MLP {args.features} -> {args.layers + 1} x Linear({args.hidden}) -> {args.classes}, {params:,}"
        f" parameters, **S = {s_mb:.2f} MB** ({s_mb * MB / 2**20:.1f} MiB) of fp32 gradients; batch {args.batch_size}"
        f" per rank, {OPTIMIZERS[args.optimizer]}, same data, order and seed for every contender",
        f"- {args.warmup} warmup + {args.steps} timed steps per run, {args.repeats} run(s) per contender;"
        f" bucket cap {args.bucket_size_mb:g} MiB for Lightning `ddp` and ours",
        "- step time: rank 0's wall time per timed step (whole iteration), median over the steps (over runs: median"
        " of per-run medians)",
        "- cross-node MB: bytes each node's veth sent during the timed window (kernel counter"
        " `/sys/class/net/<veth>/statistics/tx_bytes`, read by the node's local rank 0 right after a barrier at the"
        " window's start and end; frame headers included) / timed steps, mean of the nodes; `x S` divides by S",
        "- our accounting: `comm/cross_node_MB` of `HierarchicalZeroStrategy` over the same steps, summed over the"
        " node's ranks (mean of the nodes)",
        "- contenders: Lightning `ddp` = `DDPStrategy(bucket_cap_mb=...)`; FSDP2 = `fully_shard` on each Linear and"
        " the root over a (2 replicate x 2 shard) `DeviceMesh`, plain torch loop (Lightning's FSDP refuses CPU);"
        " ours = `HierarchicalZeroStrategy(hierarchical=..., compression=...)`, powersgd with"
        " `compression_options={'rank': 4, 'start_iter': 2}` (the default start_iter=10 would leave all 11 steps"
        " uncompressed); torch DDP + `powerSGD_hook` with rank 4, `start_powerSGD_iter=2` (the least torch accepts"
        " with error feedback), error feedback and warm start, one bucket (plain torch loop: Lightning ignores comm"
        " hooks on CPU, and the hook aborts on gloo with more than one bucket)",
    ]
    if {r["name"] for r in rows} & set(ZERO_CONTENDERS):
        bucket_el = int(args.bucket_size_mb * 2**20) // 4
        lines.append(
            "- ZeRO contenders: DeepSpeed" + (f" {_ds_version()}" if _ds_version() else "") + " = `deepspeed.initialize("
            "model=net, optimizer=torch.optim.AdamW(...), config=...)` in a plain torch loop (`engine(x)`,"
            " `engine.backward(loss)`, `engine.step()`; Lightning's DeepSpeed strategy refuses CPU) on DeepSpeed's CPU"
            " accelerator (`DS_ACCELERATOR=cpu`) over gloo (`deepspeed.init_distributed(dist_backend='gloo')`); config"
            f" `zero_optimization: {{stage: N, reduce_bucket_size: {bucket_el:,} (= {args.bucket_size_mb:g} MiB of"
            " fp32), overlap_comm: true}`, fp16 and bf16 off (fp32 throughout), `train_micro_batch_size_per_gpu:"
            f" {args.batch_size}`, `gradient_accumulation_steps: 1`, `zero_allow_untested_optimizer: true`, every other"
            " ZeRO setting at DeepSpeed's default (e.g. `allgather_bucket_size`, `contiguous_gradients`, stage 3's"
            " `stage3_param_persistence_threshold`, prefetch and live-parameter limits). A torch optimizer means none of"
            " DeepSpeed's compiled optimizers (FusedAdam, CPUAdam) is built; `DS_BUILD_OPS` unset. Ours ="
            " `HierarchicalZeroStrategy(zero_stage=N, shard_scope=...)` under Lightning, hierarchical reduction (the"
            " default), same bucket cap; shard_scope 'global' shards over all ranks, 'node' over the ranks of a node"
        )
    return lines + [
        "- live tensor MB / rank: every rank walks `gc.get_objects()` for tensors (parameters included) plus every"
        " parameter's `.grad`, dedupes storages by `untyped_storage().data_ptr()` and sums"
        " `untyped_storage().nbytes()`, outside the timed steps, at two points: *after step* = after the last timed"
        " optimizer step (Lightning zeroes gradients only before the next backward, the plain torch loops at the"
        " start of the next step, DeepSpeed's `engine.step()` right away), and *after backward* = in one extra,"
        " untimed probe step after the window, once backward and the gradient synchronization are done, right"
        " before the optimizer step (Lightning's `on_before_optimizer_step`; after `engine.backward` for DeepSpeed);"
        " the table shows the largest rank (mean over runs). The walk sees only storages Python can reach: DDP's"
        " C++ reducer buckets (S per rank for Lightning `ddp` and torch DDP), autograd's saved tensors and"
        " communication buffers are not in it (peak RSS includes them)",
        "- peak RSS: max over ranks of `ru_maxrss`; final loss: rank 0's loss on its last timed batch",
    ]


def _ours_mem(mem: dict[str, float] | None) -> str:
    return "-" if mem is None else (
        f"{mem['params']:.1f} / {mem['grads']:.1f} / {mem['optimizer_state']:.1f} / {mem['total']:.1f}")


def write_markdown(args: argparse.Namespace, run: harness.Run, rows: list[dict[str, Any]], png: Path | None) -> str:
    ok = [r for r in rows if "median_s" in r]
    ref = next((r for r in ok if r["name"] == "lightning_ddp"), None)
    s_mb = ok[0]["grad_bytes"] / MB if ok else float("nan")
    params = ok[0]["params"] if ok else 0
    lines = [f"# Cluster benchmark: {args.nodes} nodes x {args.nproc_per_node} ranks, inter-node link {args.rate}", "",
             *run.header(), *_setup_lines(args, rows, s_mb, params), ""]
    main_rows = []
    for r in rows:
        if "median_s" not in r:
            main_rows.append([r["label"], f"failed: {cell(r['error'])}"])
            continue
        main_rows.append([r["label"], f"{r['median_s']:.3f}", fmt(r["median_s"] / ref["median_s"] if ref else None, ".3f"),
                          f"{r['tx_mb']:.2f}", f"{r['x_s']:.3f}", fmt(r.get("ours_mb"), ".2f"), f"{r['final_loss']:.5f}",
                          f"{fmt(r.get('live_tensor_backward_mb'), '.1f')} / {fmt(r.get('live_tensor_mb'), '.1f')}",
                          f"{r['peak_rss_mb']:.0f}"])
    lines += harness.table(["contender", "median s/step", "ratio vs Lightning `ddp`", "cross-node MB / node / step"
                            " (kernel)", "x S", "our accounting MB", "final loss", "live tensor MB / rank, after"
                            " backward / after step", "peak RSS MB"], main_rows)
    if args.optimizer == "sgd":
        lines += [
            "",
            "Final loss only shows that no contender went astray: from this deep MLP's default initialisation the"
            " activations reaching the last layers are tiny, so in 11 steps of lr 0.01 the loss moves almost only"
            " through the output bias, which every codec sends exactly or nearly so (PowerSGD sends 1-D tensors"
            " uncompressed; int8 differs in the 6th digit). Codec accuracy is checked by the test suite's training"
            " runs.",
        ]
    else:
        lines += [
            "",
            "Final loss only shows that no contender went astray (same data, seed and optimizer everywhere, so"
            " exact ZeRO implementations agree to float rounding); training equivalence is checked by the test suite.",
        ]
    memory_rows, detail_rows = [], []
    for r in ok:
        mem = _ours_mem(r.get("memory_mb"))
        if "memory_bytes_error" in r:
            mem = f"failed: {cell(r['memory_bytes_error'], 120)}"
        memory_rows.append([r["label"], ", ".join(f"{v:.1f}" for v in r.get("live_tensor_backward_mb_ranks", [])) or "-",
                            ", ".join(f"{v:.1f}" for v in r.get("live_tensor_mb_ranks", [])) or "-",
                            fmt(r.get("optimizer_state_mb"), ".1f"), _ours_mem(r.get("memory_backward_mb")), mem,
                            f"{r['peak_rss_mb']:.0f}"])
        detail_rows.append([r["label"], ", ".join(f"{m:.3f}" for m in r["per_run_median_s"]), f"{r['p90_s']:.3f}",
                            ", ".join(f"{v:.2f}" for v in r["tx_mb_node"]), ", ".join(f"{v:.2f}" for v in r["rx_mb_node"]),
                            ", ".join(f"{v:.2f}" for v in r["ours_mb_node"]) if "ours_mb_node" in r else "-",
                            ", ".join(f"{v:+.2f} %" for v in r["agreement_pct"]) if "agreement_pct" in r else "-",
                            fmt(r.get("wait_ms"), ".0f"), fmt(r.get("buckets"), "d"), f"{r['wall_s']:.0f}"])
    lines += ["", "## Memory per rank", "",
              "S = fp32 parameters = fp32 gradients; AdamW keeps 2 S of state (SGD with momentum S). Unsharded,"
              " a rank holds params + grads + state = 4 S with AdamW; ZeRO-1 over N ranks shards the state"
              " (2 + 2/N) S, ZeRO-2 also the gradients (1 + 3/N) S, ZeRO-3 everything 4/N S, plus whatever"
              " buffers and gathered units an implementation keeps.", "",
              *harness.table(["contender", "live tensor MB after backward, rank 0..3", "live tensor MB after step,"
                              " rank 0..3", "optimizer state MB (torch optimizer's `state`, largest rank)", "ours"
                              " `memory_bytes()` MB after backward, largest rank: params / grads / optimizer state /"
                              " total", "same, after step", "peak RSS MB"], memory_rows, "lllrllr"),
              "", "## Details", "",
              *harness.table(["contender", "per-run median s/step", "p90 s/step", "kernel tx MB/step node 0, node 1",
                              "kernel rx MB/step node 0, node 1", "ours MB/step node 0, node 1", "ours vs kernel",
                              "backward wait ms", "buckets", "wall s"], detail_rows, "llrllllrrr")]

    zero_lines = _zero_section(ok)
    if zero_lines:
        lines += ["", "## ZeRO: ours beside DeepSpeed, per stage", "", *zero_lines]
    names = {r["name"] for r in rows}
    if "ours_hier" in names:
        lines += ["", "## Acceptance (hierarchical, no codec)", "", *_acceptance_section(ok, ref)]
    if names & set(SYNC_CONTENDERS):
        lines += ["", "## Sync modes against the uncapped floor", "", *_sync_section(ok)]
    if ref is not None and len(ok) > 1:
        lines += ["", "## Memory against Lightning `ddp`", "", *_memory_section(ok, ref)]
    if png is not None:
        lines += ["", f"![step time and cross-node bytes]({png.name})"]
    if any(r.get("plans") for r in ok):
        lines += ["", "## The link probe's plans", "", *_plans_section(ok)]
    return "\n".join([*lines, ""])


def _acceptance_section(ok: list[dict[str, Any]], ref: dict[str, Any] | None) -> list[str]:
    hier = next((r for r in ok if r["name"] == "ours_hier"), None)
    fsdp = next((r for r in ok if r["name"] == "fsdp2_hybrid"), None)
    if hier is None:
        return ["- not checked: `ours_hier` failed"]
    verdict = "holds" if hier["x_s"] <= ACCEPTANCE_BYTES else "FAILS"
    lines = [f"- cross-node bytes per node per step: {hier['tx_mb']:.2f} MB = {hier['x_s']:.3f} S"
             f" (limit {ACCEPTANCE_BYTES} S): **{verdict}**"]
    for other, label in ((ref, "Lightning `ddp`"), (fsdp, "torch FSDP2 hybrid")):
        if other is None:
            lines.append(f"- step time vs {label}: not checked ({label} not run or failed)")
        else:
            faster = hier["median_s"] < other["median_s"]
            lines.append(f"- step time vs {label}: {hier['median_s']:.3f} s against {other['median_s']:.3f} s"
                         f" (ratio {hier['median_s'] / other['median_s']:.3f}): **{'faster' if faster else 'NOT faster'}**")
    return lines


def _memory_section(ok: list[dict[str, Any]], ref: dict[str, Any]) -> list[str]:
    """Each contender's peak RSS per rank against Lightning ``ddp``'s (limit for ours without ZeRO sharding: at
    most ``ddp``'s; for ours at ZeRO-3 over every rank: at least ``ZERO3_RSS_MARGIN_MB`` below it, and a step
    within ``ZERO3_STEP_RATIO`` x ``ddp``'s)."""
    lines = [f"Peak RSS per rank (max over ranks) and median step time against Lightning `ddp`'s"
             f" {ref['peak_rss_mb']:.0f} MB and {ref['median_s']:.3f} s in this run.", ""]
    for r in ok:
        if r is ref or r["name"] == "uncapped_floor":
            continue
        delta = r["peak_rss_mb"] - ref["peak_rss_mb"]
        ratio = r["median_s"] / ref["median_s"]
        line = f"- {r['label']}: {r['peak_rss_mb']:.0f} MB ({delta:+.0f} MB), step {ratio:.3f}x"
        if r["name"].startswith("ours_zero3") and r["name"] != "ours_zero3_node":
            ok_rss, ok_step = -delta >= ZERO3_RSS_MARGIN_MB, ratio <= ZERO3_STEP_RATIO
            line += (f": at least {ZERO3_RSS_MARGIN_MB} MB below **{'holds' if ok_rss else 'FAILS'}**, within"
                     f" {ZERO3_STEP_RATIO}x **{'holds' if ok_step else 'FAILS'}**")
        elif r["name"].startswith("ours_") and not r["name"].startswith("ours_zero"):
            line += f": at most `ddp`'s **{'holds' if delta <= 0 else 'FAILS'}**"
        lines.append(line)
    return lines


def _share_padding_mb(r: dict[str, Any], every: int, fragments: int) -> float:
    """The most a node sends per step for padding in a sync mode with the outer state sharded over the nodes: each
    rank's part of a fragment in a bucket (at most F + buckets - 1 such parts a cycle) is reduce-scattered and
    all-gathered in n equal shares, padded by up to n - 1 fp32 values."""
    n, k = r["nodes"], r["ranks_per_node"]
    return k * (fragments + (r["buckets"] or 1) - 1) * (n - 1) * 4 * 2 / every / MB


def _sync_section(ok: list[dict[str, Any]]) -> list[str]:
    """Each sync-mode contender's step time as a multiple of the uncapped floor's (limit 1.10) and its cross-node
    bytes per node and step against S / (c H) (c: the codec's ratio)."""
    by_name = {r["name"]: r for r in ok}
    floor = by_name.get("uncapped_floor")
    lines = ["Step times here are means over the timed steps (amortized), not medians. Sync modes cross nodes every H = 16 steps (with timed steps a multiple of 16, every fragment crossed"
             " equally often in the window). Limits: step time <= "
             f"{SYNC_FLOOR_RATIO:.2f}x the uncapped floor; cross-node bytes per node and step <= S/H, S/(4H) with"
             " int8 (the kernel's count includes frame headers; our accounting counts payload).", ""]
    for name, (every, ratio, fragments) in SYNC_CONTENDERS.items():
        r = by_name.get(name)
        if r is None:
            continue
        bound = r["grad_bytes"] / MB / (ratio * every)
        padding = _share_padding_mb(r, every, fragments) if ratio == 1 else 0.0
        # The mean, not the median: a sync that blocks one step in 16 hardly moves the median.
        parts = [f"- {r['label']}: mean {r['mean_s']:.3f} s/step (median {r['median_s']:.3f})"]
        if floor is not None:
            x = r["mean_s"] / floor["mean_s"]
            parts.append(f" = {x:.3f}x the uncapped floor's mean {floor['mean_s']:.3f} s"
                         f" (**{'holds' if x <= SYNC_FLOOR_RATIO else 'FAILS'}**)")
        ours = r.get("ours_mb")
        measured = ours if ours is not None else r["tx_mb"]
        parts.append(f"; cross-node {r['tx_mb']:.3f} MB per node and step (kernel)"
                     + (f", {ours:.4f} MB (our accounting)" if ours is not None else "")
                     + f" against S/{ratio * every} = {bound:.4f} MB"
                     + (f" + {padding * MB:.0f} B of the shares' padding" if padding else "")
                     + f" (**{'holds' if measured <= bound + padding else 'FAILS'}**)")
        sync_twin = by_name.get("ours_hier_int8" if ratio == 4 else "ours_hier")
        if sync_twin is not None and sync_twin.get("ours_mb") and ours is not None:
            parts.append(f"; {sync_twin['ours_mb'] / ours:.1f}x less than synchronous {sync_twin['label']}"
                         f" ({sync_twin['ours_mb']:.2f} MB)")
        lines.append("".join(parts))
    lines += ["", "int8 sends one fp32 scale per block of 1024 values beside the bytes (`int8` in the synchronous"
              " rows: 0.251 S, not 0.250 S), so its pseudo-gradients are that much above S/(4H)."]
    return lines


def _zero_section(ok: list[dict[str, Any]]) -> list[str]:
    """One line per ZeRO stage run by both DeepSpeed and us: step time, cross-node bytes and memory side by side."""
    by_name = {r["name"]: r for r in ok}
    out = []
    for stage, ours_names in ((1, ("ours_zero1",)), (2, ("ours_zero2",)), (3, ("ours_zero3", "ours_zero3_node"))):
        ds = by_name.get(f"deepspeed_zero{stage}")
        for name in ours_names:
            ours = by_name.get(name)
            if ds is None or ours is None:
                continue
            mem = ""
            for key, when in (("live_tensor_backward_mb", "after backward"), ("live_tensor_mb", "after step")):
                if ds.get(key) and ours.get(key):
                    mem += (f"; live tensors {when} {ours[key]:.1f} MB against {ds[key]:.1f} MB per rank"
                            f" ({ours[key] / ds[key]:.2f}x)")
            out.append(
                f"- stage {stage}, {ours['label']}: {ours['median_s']:.3f} s/step against DeepSpeed's {ds['median_s']:.3f}"
                f" (ratio {ours['median_s'] / ds['median_s']:.3f}); cross-node {ours['tx_mb']:.1f} MB = {ours['x_s']:.2f} S"
                f" against {ds['tx_mb']:.1f} MB = {ds['x_s']:.2f} S per node and step{mem}"
            )
    return out


def write_plot(args: argparse.Namespace, rows: list[dict[str, Any]], path: Path) -> bool:
    ok = [r for r in rows if "median_s" in r]
    plt = harness.pyplot() if ok else None
    if plt is None:
        return False
    labels = [r["label"].replace("`", "") for r in ok]
    s_mb = ok[0]["grad_bytes"] / MB
    colors = ["tab:blue" if r["name"].startswith("ours") else "tab:gray" for r in ok]
    has_mem = all("live_tensor_mb" in r for r in ok)
    fig, axes = plt.subplots(1, 3 if has_mem else 2, figsize=(18 if has_mem else 13, 0.45 * len(ok) + 2.2), sharey=True)
    ax_t, ax_b = axes[:2]
    y = range(len(ok))
    ax_t.barh(y, [r["median_s"] for r in ok], color=colors)
    ax_t.set_yticks(list(y), labels)
    ax_t.invert_yaxis()
    ax_t.set_xlabel("median step time (s)")
    ref = next((r for r in ok if r["name"] == "lightning_ddp"), None)
    if ref is not None:
        ax_t.axvline(ref["median_s"], color="k", ls=":", lw=1, label="Lightning ddp")
        ax_t.legend(loc="upper center", bbox_to_anchor=(0.5, -0.09), fontsize=8, frameon=False)
    ax_t.set_xlim(0, 1.15 * max(r["median_s"] for r in ok))
    for i, r in enumerate(ok):
        ax_t.text(r["median_s"], i, f" {r['median_s']:.2f}", va="center", fontsize=8)
    ax_b.barh(y, [r["tx_mb"] for r in ok], color=colors)
    ax_b.set_xlabel("cross-node MB per node per step (kernel veth counter)")
    for mult, style in ((1.0, "--"), (1.5, ":")):
        ax_b.axvline(mult * s_mb, color="k", ls=style, lw=1, label=f"{mult:g} S = {mult * s_mb:.1f} MB")
    ax_b.legend(loc="upper center", bbox_to_anchor=(0.5, -0.09), ncol=2, fontsize=8, frameon=False)
    ax_b.set_xlim(0, 1.15 * max(max(r["tx_mb"] for r in ok), 1.5 * s_mb))
    for i, r in enumerate(ok):
        ax_b.text(r["tx_mb"], i, f" {r['tx_mb']:.1f}", va="center", fontsize=8)
    if has_mem:
        ax_m = axes[2]
        bw = [r.get("live_tensor_backward_mb", r["live_tensor_mb"]) for r in ok]
        ax_m.barh(y, bw, color=colors, label="after backward")
        ax_m.scatter([r["live_tensor_mb"] for r in ok], list(y), color="k", marker="|", s=120, zorder=3,
                     label="after step")
        ax_m.set_xlabel("live tensor MB per rank (largest rank)")
        unsharded = 4 if args.optimizer == "adamw" else 3
        ax_m.axvline(unsharded * s_mb, color="k", ls="--", lw=1, label=f"{unsharded} S (unsharded)")
        ax_m.legend(loc="upper center", bbox_to_anchor=(0.5, -0.09), ncol=3, fontsize=8, frameon=False)
        ax_m.set_xlim(0, 1.25 * max(max(bw), max(r["live_tensor_mb"] for r in ok), 4 * s_mb))
        for i, v in enumerate(bw):
            ax_m.text(v, i, f" {v:.0f}", va="center", fontsize=8)
    fig.suptitle(f"{args.nodes} nodes x {args.nproc_per_node} ranks, link {args.rate}, "
                 f"{ok[0]['params'] / 1e6:.1f}M-parameter MLP (S = {s_mb:.1f} MB), {args.optimizer}, {args.steps} timed steps",
                 fontsize=10)
    harness.save_figure(fig, path)
    return True


# ---------------------------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    started = harness.start(__file__, argv, parse_args, cluster="skip", ranks=harness.cluster_ranks)
    if started is None:
        return 0
    args, run = started
    order = harness.interleaved(args.contenders, args.repeats)
    runs: dict[str, list[dict[str, Any]]] = {c: [] for c in args.contenders}
    with ExitStack() as stack, tempfile.TemporaryDirectory(prefix="cluster_bench_") as tmp:
        clusters = harness.Clusters(stack, args.nodes, "ddpbench")
        for i, name in enumerate(order):
            res = run_one(cluster_for(clusters, args, name), args, name, Path(tmp) / f"run{i}_{name}")
            runs[name].append(res)
            head = f"[{i + 1}/{len(order)}] {name:<20}"
            if "error" in res:
                print(harness.failed(head, res), flush=True)
                continue
            r0 = res["ranks"][0]
            tx = statistics.mean(r["tx_bytes"] for r in res["ranks"] if "tx_bytes" in r) / r0["timed_steps"] / MB
            print(f"{head} median {statistics.median(r0['step_s']):.3f} s/step,"
                  f" cross-node {tx:.2f} MB/node/step ({res['wall_s']:.0f} s wall)", flush=True)

    rows = [summarize(name, runs[name], args.nodes) for name in args.contenders]
    png = args.out.with_suffix(".png")
    plotted = write_plot(args, rows, png)
    harness.write(args.out, write_markdown(args, run, rows, png if plotted else None), also=[png] if plotted else [])
    return 0


if __name__ == "__main__":
    sys.exit(main())
