"""Sparse sync at scale (issue 88, item 3): the bytes a node sends and receives per outer sync at 2-16 nodes, a rank
a node, fp32 DiLoCo-style syncs against ``compression="sparse"`` with either aggregation, from the kernel's link
counters; the per-step traffic of the steps where no sync is due; the step against the uncapped floor.

    python benchmarks/sparse_scale.py                                   # 2, 4, 8, 16 nodes, ~15-20 minutes on 2 cores
    python benchmarks/sparse_scale.py --nodes 2,4 --kinds fp32,reduce_scatter --width 512 --out /tmp/s.md
    python benchmarks/sparse_scale.py --nodes 4 --floor                 # also each run with the link uncapped

Each node is a network namespace of :class:`~ddp_plugin.testing.simcluster.SimulatedCluster` whose link is capped
at ``--rate`` (100 Mbit/s) each way, and runs one rank, started directly (no torchrun agent: 16 nodes are 16
processes) with torchrun's variables set, so Lightning sees an externally launched job of ``--nodes`` nodes x 1
device. Every rank trains the same MLP (``--depth`` square layers of ``--width``, AdamW) on random data under
``HierarchicalZeroStrategy(devices_per_node=1, sync_every=H, outer_optimizer=...)`` for ``--steps`` steps; the kinds
(:data:`KINDS`) differ only in the sync flags:

- ``fp32``: DiLoCo, the pseudo-gradients averaged in fp32 (``outer_optimizer="nesterov"``, no codec);
- ``all_gather`` / ``reduce_scatter``: SparseLoCo's recipe (``outer_optimizer="average"``, ``compression="sparse"``,
  ``decay=0.95``) with that ``aggregation``; ``warmup_syncs=0``, so every sync measured is a sparse one (the
  recipe's ``warmup_syncs=2`` sends its first two syncs in int8: docs/compression.md).

After every optimizer step each rank reads its node's veth counters (``/sys/class/net/<link>/statistics``, tx and
rx bytes: frames with their headers, TCP acknowledgements included) with no barrier or other collective of its own.
The strategy syncs at the end of steps H, 2H, ... (``max_staleness=0``: the sync blocks the step that starts it).
What a node moves per step when no sync is due (**the base**) is the median of its per-step deltas over the steps
that are neither a sync step nor the step after one (the tail of a sync's last sends can land there) nor the first
step (lazy setup). What a sync moves is the sync step's delta plus the next step's, minus two bases; the table gives
the mean over the run's syncs (every sync's own numbers are in ``--json``). Step times (rank 0's, per step) are
indicative only: the ranks share 2 cores.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import harness
from harness import MB, fmt

HERE = Path(__file__).resolve().parent
DEFAULT_OUT = harness.RESULTS / "sparse_scale.md"
SPARSELOCO = {"outer_optimizer": "average", "compression": "sparse"}
KINDS: dict[str, dict[str, Any]] = {
    "fp32": {"outer_optimizer": "nesterov"},
    "all_gather": {**SPARSELOCO, "compression_options": {"decay": 0.95, "aggregation": "all_gather"}},
    "reduce_scatter": {**SPARSELOCO, "compression_options": {"decay": 0.95, "aggregation": "reduce_scatter"}},
    "auto": {**SPARSELOCO, "compression_options": {"decay": 0.95, "aggregation": "auto"}},
}
LABELS = {"fp32": "DiLoCo fp32", "all_gather": "sparse, all-gather", "reduce_scatter": "sparse, reduce-scatter",
          "auto": "sparse, `auto`"}
FIRST_PORT = 29700


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = harness.parser(__doc__)
    harness.add_common(p, out=DEFAULT_OUT, keep=True)
    p.add_argument("--nodes", default="2,4,8,16", help="comma-separated node counts (default 2,4,8,16)")
    harness.add_names(p, "--kinds", KINDS, ("fp32", "all_gather", "reduce_scatter"))
    p.add_argument("--rate", default="100mbit", help="each node's link rate per direction, tc notation (default 100mbit)")
    p.add_argument("--floor", action="store_true", help="also run each kind with the link uncapped (the floor)")
    p.add_argument("--width", type=int, default=1024, help="the MLP's width (default 1024)")
    p.add_argument("--depth", type=int, default=4, help="its square layers (default 4: 4.2M parameters at 1024)")
    p.add_argument("--batch", type=int, default=16, help="samples a rank and step (default 16)")
    p.add_argument("--sync-every", type=int, default=8, help="H (default 8)")
    p.add_argument("--steps", type=int, default=28, help="optimizer steps (default 28: syncs after 8, 16, 24)")
    p.add_argument("--timeout", type=float, default=900, help="seconds a launch may take (default 900)")
    p.add_argument("--json", type=Path, default=None, help="also write every number here")
    p.add_argument("--worker", type=json.loads, default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.kind_names = harness.names(p, args.kinds, KINDS, "kind")
    args.node_counts = [int(x) for x in harness.split(args.nodes)]
    return args


# ---------------------------------------------------------------------------------------------- one rank


def worker(spec: dict[str, Any]) -> None:
    """One rank: fit the MLP, read the link counters after every optimizer step, write ``rank<r>.json``."""
    import lightning as L
    import torch
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    from ddp_plugin import HierarchicalZeroStrategy
    from ddp_plugin.testing.simcluster import link_bytes

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    out_dir = Path(spec["out_dir"])
    record: dict[str, Any] = {"rank": rank, "node": rank, "module": __import__("ddp_plugin").__file__}

    class MLP(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            layers: list[nn.Module] = []
            for _ in range(spec["depth"]):
                layers += [nn.Linear(spec["width"], spec["width"]), nn.GELU()]
            self.net = nn.Sequential(*layers[:-1])

        def training_step(self, batch, batch_idx):
            x, y = batch
            return nn.functional.mse_loss(self.net(x), y)

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-4)

    class Counters(L.Callback):
        def __init__(self) -> None:
            self.tx: list[int] = []
            self.rx: list[int] = []
            self.t: list[float] = []

        def _read(self) -> None:
            c = link_bytes()
            self.tx.append(c["tx"])
            self.rx.append(c["rx"])
            self.t.append(time.perf_counter())

        def on_train_start(self, trainer, pl_module) -> None:
            self._read()

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            self._read()

    torch.manual_seed(0)
    model = MLP()
    g = torch.Generator().manual_seed(1 + rank)
    n = spec["steps"] * spec["batch"]
    data = TensorDataset(torch.randn(n, spec["width"], generator=g), torch.randn(n, spec["width"], generator=g))
    counters = Counters()
    strategy = HierarchicalZeroStrategy(devices_per_node=1, sync_every=spec["sync_every"], **KINDS[spec["kind"]])
    trainer = L.Trainer(accelerator="cpu", devices=1, num_nodes=world, strategy=strategy, max_steps=spec["steps"],
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, use_distributed_sampler=False, callbacks=[counters])
    try:
        trainer.fit(model, DataLoader(data, batch_size=spec["batch"]))
    except Exception as err:  # noqa: BLE001 - reported in the table
        record["error"] = f"{type(err).__name__}: {err}"[:500]
    record.update(tx=counters.tx, rx=counters.rx, t=counters.t, params=sum(p.numel() for p in model.parameters()),
                  syncs=round(strategy.metric_means.get("sync/outer_syncs", 0.0) * trainer.global_step),
                  cross_node_MB=strategy.metric_means.get("comm/cross_node_MB"))
    harness.write_rank(out_dir, rank, record)
    if "error" in record:
        sys.exit(1)


# ---------------------------------------------------------------------------------------------- the driver


def launch(cluster: Any, args: argparse.Namespace, kind: str, nodes: int, port: int, out_dir: Path) -> dict[str, Any]:
    """One run: a rank per node, started in its namespace with torchrun's variables; their records, or the error."""
    out_dir.mkdir(parents=True, exist_ok=True)
    spec = {"kind": kind, "out_dir": str(out_dir), "width": args.width, "depth": args.depth, "batch": args.batch,
            "sync_every": args.sync_every, "steps": args.steps}
    procs = []
    t0 = time.perf_counter()
    for node in range(nodes):
        env = cluster.launch_env(node, {
            **harness.RANK_ENV, "PYTHONPATH": str(harness.ROOT), "MASTER_ADDR": cluster.addresses[0],
            "MASTER_PORT": str(port), "WORLD_SIZE": str(nodes), "RANK": str(node), "GROUP_RANK": str(node),
            "NODE_RANK": str(node), "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1", "TORCHELASTIC_RUN_ID": "sparse_scale",
        })
        log = open(out_dir / f"log{node}.txt", "w")
        procs.append(cluster.popen(node, [sys.executable, str(Path(__file__).resolve()), "--worker", json.dumps(spec)],
                                   env=env, stdout=log, stderr=subprocess.STDOUT))
    codes = harness.wait_all(procs, timeout=args.timeout)
    wall = time.perf_counter() - t0
    ranks = sorted((json.loads(f.read_text()) for f in out_dir.glob("rank*.json")), key=lambda r: r["rank"])
    errors = sorted({r["error"] for r in ranks if "error" in r})
    if any(codes) or len(ranks) != nodes or errors:
        tail = "\n".join(f"--- node {i}:\n" + (out_dir / f"log{i}.txt").read_text(errors="replace")[-2000:]
                         for i in range(min(nodes, 3)))
        return {"error": "; ".join(errors) or f"exit codes {codes}", "log": tail, "wall_s": wall}
    return {"ranks": ranks, "wall_s": wall}


def analyse(ranks: list[dict[str, Any]], h: int) -> dict[str, Any]:
    """Per node: the base (median bytes a no-sync step), each sync's bytes beyond two bases; the means over nodes."""
    steps = len(ranks[0]["tx"]) - 1
    sync_steps = [s for s in range(1, steps + 1) if s % h == 0 and s < steps]  # with a step after it
    excluded = {1, *sync_steps, *(s + 1 for s in sync_steps), *(s for s in range(1, steps + 1) if s % h == 0)}
    quiet = [s for s in range(1, steps + 1) if s not in excluded]
    nodes = []
    for r in ranks:
        node: dict[str, Any] = {"node": r["node"]}
        for d in ("tx", "rx"):
            delta = [b - a for a, b in zip(r[d], r[d][1:])]  # delta[s - 1]: step s
            base = statistics.median(delta[s - 1] for s in quiet)
            node[f"delta_{d}"] = delta
            node[f"base_{d}"] = base
            node[f"base_{d}_mean"] = statistics.mean(delta[s - 1] for s in quiet)
            node[f"base_{d}_max"] = max(delta[s - 1] for s in quiet)
            node[f"sync_{d}"] = [delta[s - 1] + delta[s] - 2 * base for s in sync_steps]
        t = r["t"]
        node["step_s"] = [b - a for a, b in zip(t, t[1:])]
        quiet_s = sum(node["step_s"][s - 1] for s in quiet)
        for d in ("tx", "rx"):  # (the heartbeats beat by the clock: bytes a second of the quiet steps too)
            node[f"base_{d}_per_s"] = sum(node[f"delta_{d}"][s - 1] for s in quiet) / quiet_s
        nodes.append(node)
    out: dict[str, Any] = {"per_node": nodes, "sync_steps": sync_steps, "quiet_steps": quiet, "params": ranks[0]["params"],
                           "syncs_applied": ranks[0]["syncs"], "ours_cross_node_MB": ranks[0]["cross_node_MB"],
                           "module": ranks[0]["module"]}
    for d in ("tx", "rx"):
        per_node = [statistics.mean(n[f"sync_{d}"]) for n in nodes]
        out[f"sync_{d}"] = statistics.mean(per_node)
        out[f"sync_{d}_max"] = max(per_node)
        out[f"sync_{d}_min"] = min(per_node)
        out[f"base_{d}"] = statistics.mean(n[f"base_{d}"] for n in nodes)
        out[f"base_{d}_node0"] = nodes[0][f"base_{d}"]
        out[f"base_{d}_others"] = statistics.mean(n[f"base_{d}"] for n in nodes[1:])
        out[f"base_{d}_mean"] = statistics.mean(n[f"base_{d}_mean"] for n in nodes)
        out[f"base_{d}_per_s"] = statistics.mean(n[f"base_{d}_per_s"] for n in nodes)
    step_s = nodes[0]["step_s"][1:]  # rank 0's steps after the first
    out["step_s_mean"] = statistics.mean(step_s)
    out["step_s_quiet"] = statistics.median(nodes[0]["step_s"][s - 1] for s in quiet)
    return out


def run_one(cluster: Any, args: argparse.Namespace, kind: str, nodes: int, rate: str | None, port: int,
            folder: Path) -> dict[str, Any]:
    res = launch(cluster, args, kind, nodes, port, folder / f"{nodes}-{kind}-{rate}")
    row: dict[str, Any] = {"nodes": nodes, "kind": kind, "rate": rate, "wall_s": res["wall_s"]}
    if "error" in res:
        print(harness.failed(f"{nodes} nodes, {kind}, {rate}:", res), flush=True)
        row["error"] = res["error"]
        return row
    row.update(analyse(res["ranks"], args.sync_every))
    print(f"{nodes} nodes, {kind}, {rate}: sync {row['sync_tx'] / MB:.4f} MB tx, {row['sync_rx'] / MB:.4f} MB rx a"
          f" node; base {row['base_tx']:.0f} B tx, {row['base_rx']:.0f} B rx a step (mean {row['base_tx_mean']:.0f},"
          f" {row['base_tx_per_s']:.0f} B/s tx); {row['step_s_mean']:.3f} s/step"
          f" ({res['wall_s']:.0f} s wall)", flush=True)
    return row


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker is not None:
        worker(args.worker)
        return 0
    if not harness.need_cluster("sparse_scale.py"):
        return 0
    bench = harness.Run(__file__, argv, quiet=args.quiet)
    results: list[dict[str, Any]] = []
    port = FIRST_PORT
    from ddp_plugin.testing.simcluster import SimulatedCluster

    with harness.scratch("sparse_scale_", keep=args.keep) as folder:
        for nodes in args.node_counts:
            with SimulatedCluster(nodes=nodes, rate=args.rate, prefix="sscale") as cluster:
                for rate in ([args.rate, None] if args.floor else [args.rate]):
                    cluster.set_rate(rate)
                    for kind in args.kind_names:
                        port += 1
                        results.append(run_one(cluster, args, kind, nodes, rate, port, folder))
    if args.json:
        args.json.write_text(json.dumps({"argv": bench.argv, "results": results}, indent=1))
    harness.write(args.out, markdown(args, bench, results))
    return 0


def _get(results: list[dict[str, Any]], nodes: int, kind: str, rate: str | None) -> dict[str, Any] | None:
    for r in results:
        if r["nodes"] == nodes and r["kind"] == kind and r["rate"] == rate and "error" not in r:
            return r
    return None


def markdown(args: argparse.Namespace, bench: harness.Run, results: list[dict[str, Any]]) -> str:
    ok = [r for r in results if "error" not in r]
    params = ok[0]["params"] if ok else 0
    lines = [f"# Sparse syncs at 2-{max(args.node_counts)} nodes: bytes a node and sync", "", *bench.header(), "",
             f"A rank a node, {args.rate} links (each way), an MLP of {params:,} parameters (S = {params * 4 / MB:.2f}"
             f" MB in fp32), H = {args.sync_every}, {args.steps} steps; bytes from the node's veth counters after"
             " every step (frames with headers, TCP acknowledgements included). A sync's bytes: the sync step's and"
             " the next step's deltas minus twice the node's base (its median delta over the steps with no sync due,"
             " the first step and the steps right after a sync left out); mean over the run's syncs, then over the"
             " nodes. Timings are indicative only: other work ran on the machine, and the ranks share 2 cores.", ""]
    head = ["nodes", "kind", "MB sent a node and sync", "MB received", "min-max over nodes (sent)",
            "x fewer than fp32 (sent)", "x its 2-node bytes (sent)", "base B/step sent (node 0 / others)",
            "base B/step received (node 0 / others)", "s/step, mean", "s/step uncapped"]
    rows = []
    for r in results:
        if r["rate"] != args.rate:
            continue
        if "error" in r:
            rows.append([r["nodes"], LABELS[r["kind"]], f"failed: {harness.cell(r['error'], 200)}"])
            continue
        fp32 = _get(results, r["nodes"], "fp32", args.rate)
        two = _get(results, 2, r["kind"], args.rate)
        floor = _get(results, r["nodes"], r["kind"], None)
        rows.append([r["nodes"], LABELS[r["kind"]], f"{r['sync_tx'] / MB:.4f}", f"{r['sync_rx'] / MB:.4f}",
                     f"{r['sync_tx_min'] / MB:.4f}-{r['sync_tx_max'] / MB:.4f}",
                     fmt(fp32["sync_tx"] / r["sync_tx"] if fp32 else None, ".1f"),
                     fmt(r["sync_tx"] / two["sync_tx"] if two else None, ".2f"),
                     f"{r['base_tx_node0']:.0f} / {r['base_tx_others']:.0f}",
                     f"{r['base_rx_node0']:.0f} / {r['base_rx_others']:.0f}",
                     f"{r['step_s_mean']:.3f}", fmt(floor["step_s_mean"] if floor else None, ".3f")])
    lines += harness.table(head, rows)
    lines += ["", "The base: what a node moves a step when no sync is due, over the quiet steps (median as subtracted above;"
              " mean, which also holds the heartbeats that beat by the clock; and bytes a second of those steps), mean"
              " over the nodes:", ""]
    lines += harness.table(["nodes", "kind", "link", "quiet steps", "sent B/step median", "sent mean", "sent B/s",
                            "received B/step median", "received mean", "received B/s", "s/step (quiet, rank 0)"],
                           [[r["nodes"], LABELS[r["kind"]], r["rate"] or "uncapped", len(r["quiet_steps"]),
                             f"{r['base_tx']:.0f}", f"{r['base_tx_mean']:.0f}", f"{r['base_tx_per_s']:.0f}",
                             f"{r['base_rx']:.0f}", f"{r['base_rx_mean']:.0f}", f"{r['base_rx_per_s']:.0f}",
                             f"{r['step_s_quiet']:.3f}"] for r in ok])
    lines += ["", "Every sync of each run, MB sent a node (mean over nodes):", ""]
    lines += harness.table(["nodes", "kind", "syncs applied", "per sync (MB sent)", "ours: cross_node_MB a step"],
                           [[r["nodes"], LABELS[r["kind"]] + ("" if r["rate"] == args.rate else ", uncapped"),
                             r["syncs_applied"],
                             ", ".join(f"{statistics.mean(n['sync_tx'][i] for n in r['per_node']) / MB:.4f}"
                                       for i in range(len(r["sync_steps"]))),
                             fmt(r["ours_cross_node_MB"], ".4f")] for r in ok])
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
