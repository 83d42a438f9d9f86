"""Worker for the adaptive communication tests: trains an MLP with the link probe deciding, and writes each rank's
plan (every version's decisions, the last one's per-bucket times) and the logged plan metrics.

    python tests/workers/adaptive_run.py --out DIR [--flags JSON] [--steps N]              # 2 x 2 on loopback
    torchrun ... tests/workers/adaptive_run.py --out DIR --num-nodes 2 --devices 2 \\
        --slow-at 6 --slow-rate 20mbit                                                      # a simulated cluster

``--replan-at STEP``: every rank re-plans (probes again) after that optimizer step. ``--slow-at STEP``: on a
simulated cluster node, local rank 0 caps its node's link at ``--slow-rate`` before that
optimizer step (``tc`` in the node's namespace), as another job starting to share the link would.
"""

from __future__ import annotations

import argparse
import json
import os

import lightning as L
import torch
from lightning.pytorch.loggers import CSVLogger
from torch.utils.data import DataLoader

from ddp_plugin import HierarchicalZeroStrategy
from ddp_plugin.testing.data import sine_dataset
from ddp_plugin.testing.models import TinyModule, mlp
from ddp_plugin.testing.processes import run_each
from ddp_plugin.testing.simcluster import set_link_rate


class SlowDown(L.Callback):
    """Cap this node's link at ``rate`` before optimizer step ``at`` (local rank 0 of each node)."""

    def __init__(self, at: int, rate: str) -> None:
        self.at, self.rate = at, rate

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step == self.at and trainer.local_rank == 0:
            set_link_rate(os.environ["GLOO_SOCKET_IFNAME"], self.rate)


class Replan(L.Callback):
    """Re-plan after optimizer step ``at`` on every rank (collective), as a slowdown the planner saw would."""

    def __init__(self, at: int) -> None:
        self.at = at

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step == self.at:
            trainer.strategy.fit.session.planner.replan(f"step {self.at}: asked for by the test")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--flags", default='{"compression": "auto", "bucket_size_mb": "auto"}')
    parser.add_argument("--devices", type=int, default=4)
    parser.add_argument("--num-nodes", type=int, default=1)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--slow-at", type=int, default=None)
    parser.add_argument("--slow-rate", default="20mbit")
    parser.add_argument("--replan-at", type=int, default=None)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    L.seed_everything(0, verbose=False)
    flags = json.loads(args.flags)
    if args.num_nodes == 1:
        flags.setdefault("devices_per_node", 2)
    strategy = HierarchicalZeroStrategy(**flags)
    trainer = L.Trainer(
        accelerator="cpu", devices=args.devices, num_nodes=args.num_nodes, strategy=strategy, max_steps=args.steps,
        logger=CSVLogger(args.out, name="csv", version=0), log_every_n_steps=1,
        callbacks=([SlowDown(args.slow_at, args.slow_rate)] if args.slow_at is not None else [])
        + ([Replan(args.replan_at)] if args.replan_at is not None else []),
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )
    model = TinyModule(mlp(args.width, args.width, 1, layers=args.layers), optimizer="adam", lr=1e-3)
    trainer.fit(model, DataLoader(sine_dataset(16 * args.steps * args.devices * args.num_nodes, args.width, seed=3),
                                  batch_size=16))
    plan = strategy.comm_plan
    engine_buckets = [str(i) for i in range(len(strategy.fit.session.engine.buckets))]
    result = {
        "rank": trainer.global_rank,
        "plan": None if plan is None else {
            "version": plan.version,
            "reason": plan.reason,
            "probe_s": plan.probe_s,
            "routes": list(plan.routes),
            "codecs": list(plan.codecs),
            "bucket_size_mb": plan.bucket_size_mb,
            "history": [[v, step, {k: list(d) for k, d in decisions.items()}] for v, step, decisions in plan.history],
            "buckets": {k: {"nbytes": b.nbytes, "route": b.route, "codec": b.codec, "predicted_ms": b.predicted_ms,
                            "measured_ms": b.measured_ms} for k, b in plan.buckets.items()},
            "links": plan.model.describe(),
        },
        "engine_buckets": engine_buckets,
        "hierarchical": strategy.uses_hierarchical_reducer,
        "metrics": strategy.metric_means,
        "params_finite": all(torch.isfinite(p).all().item() for p in model.parameters()),
    }
    with open(os.path.join(args.out, f"rank{trainer.global_rank}.json"), "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    run_each(main)
