"""Worker for the traffic accounting tests: 4 ranks as 2 nodes x 2, a model of known gradient size, a CSV
logger; saves every rank's per-step traffic means and the gradient size.

    python tests/workers/traffic_run.py --out DIR [--flat] [--num-nodes N --devices K] [--width W]
    python tests/workers/traffic_run.py --out DIR --num-nodes 2 --devices 2 --tp 2     # a tied GPT, TP 2 x DP 2
    python tests/workers/traffic_run.py --out DIR --num-nodes 2 --devices 2 --pp 2     # the GPT, a stage per node
"""

from __future__ import annotations

import argparse
import json
import os

import lightning as L
import torch
from lightning.pytorch.loggers import CSVLogger
from torch.utils.data import DataLoader, TensorDataset

from ddp_plugin import HierarchicalZeroStrategy
from ddp_plugin.testing.gpt import GPTModule, token_dataset
from ddp_plugin.testing.models import TinyModule, mlp
from ddp_plugin.testing.simcluster import link_bytes
from ddp_plugin.testing.processes import run_each


class KernelCounters(L.Callback):
    """On a simulated cluster node (GLOO_SOCKET_IFNAME names its link): the link's kernel tx_bytes and our own
    cross-node accounting, both over the same window of steps (after warmup, between barriers)."""

    def __init__(self, warmup: int) -> None:
        self.warmup = warmup
        self.kernel_tx = 0.0
        self.ours = 0.0

    def _mark(self, trainer) -> tuple[int, float]:
        trainer.strategy.barrier()
        return link_bytes()["tx"], trainer.strategy.metric_totals.get("comm/cross_node_MB", 0.0) * 1e6

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if batch_idx == self.warmup:
            self._start = self._mark(trainer)

    def on_train_end(self, trainer, pl_module):
        tx, ours = self._mark(trainer)
        self.kernel_tx = float(tx - self._start[0])
        self.ours = ours - self._start[1]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--flat", action="store_true")
    parser.add_argument("--devices", type=int, default=4)
    parser.add_argument("--num-nodes", type=int, default=1)
    parser.add_argument("--devices-per-node", type=int, default=None)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--compression", default=None)
    parser.add_argument("--tp", type=int, default=1,
                        help="tensor_parallel_size; above 1 the model is a GPT whose embedding and head share one"
                             " replicated weight (a large replicated parameter beside the split ones)")
    parser.add_argument("--pp", type=int, default=1, help="pipeline_parallel_size (the GPT, stages of whole nodes)")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    L.seed_everything(0, verbose=False)
    strategy = HierarchicalZeroStrategy(devices_per_node=args.devices_per_node, hierarchical=not args.flat,
                                        compression=args.compression, progress_bar_metrics=True,
                                        tensor_parallel_size=args.tp, pipeline_parallel_size=args.pp)
    on_cluster = "GLOO_SOCKET_IFNAME" in os.environ
    counters = KernelCounters(args.warmup)
    trainer = L.Trainer(
        accelerator="cpu", devices=args.devices, num_nodes=args.num_nodes, strategy=strategy, max_steps=args.steps,
        logger=CSVLogger(args.out, name="csv", version=0), log_every_n_steps=1,
        callbacks=[counters] if on_cluster else [],
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )
    gpt = dict(vocab=args.width * 4, d_model=args.width, heads=4, layers=2, seq=16)
    if args.pp > 1:
        model = GPTModule(**gpt)
        data = DataLoader(token_dataset(64 * args.steps, seq=16, vocab=args.width * 4), batch_size=4)
    elif args.tp > 1:
        model = GPTModule(vocab=args.width * 4, d_model=args.width, heads=4, layers=2, seq=16, tie="replicated")
        data = DataLoader(token_dataset(64 * args.steps, seq=16, vocab=args.width * 4), batch_size=4)
    else:
        model = TinyModule(mlp(args.width, args.width, 1), optimizer="sgd", lr=1e-3)
        x = torch.randn(64 * args.steps, args.width)
        data = DataLoader(TensorDataset(x, x[:, :1]), batch_size=8)
    trainer.fit(model, data)
    means = strategy.metric_means
    names = sorted(means)
    every_rank = trainer.strategy.all_gather(torch.tensor([means[n] for n in names], dtype=torch.float64))
    node_traffic = trainer.strategy.all_gather(torch.tensor([counters.kernel_tx, counters.ours], dtype=torch.float64))
    if trainer.is_global_zero:
        with open(os.path.join(args.out, "traffic.json"), "w") as f:
            json.dump({
                "names": names,
                "per_rank": every_rank.tolist(),
                # the whole model's (a DTensor's numel is its whole tensor's; a tied weight is one parameter)
                "gradient_bytes": sum(p.numel() * p.element_size() for p in model.parameters()),
                "replicated_bytes": sum(p.numel() * p.element_size() for p in model.parameters()
                                        if type(p).__name__ != "DTensor"),
                "num_params": len(list(model.parameters())),
                "hierarchical": strategy.uses_hierarchical_reducer,
                "steps": trainer.global_step,
                "progress_bar": sorted(trainer.progress_bar_metrics),
                "window_steps": args.steps - args.warmup,
                # per rank: [kernel tx bytes of its node's link (local rank 0 only, else 0), our cross-node bytes]
                "window_traffic": node_traffic.tolist(),
                # with --pp 2 (a stage per node, D ranks in each, batch 4 each): per node and step, the boundary
                # activations (or their gradients) of the stage's 4 D windows, the tied embedding's gradient sum
                # (each data-parallel rank sums 1/D of it across), and the loss (4 bytes per rank, from node 1)
                "pipeline_bytes": (4 * args.devices * gpt["seq"] * gpt["d_model"] * 4
                                   + gpt["vocab"] * gpt["d_model"] * 4 + 4 * args.devices / 2),
            }, f)


if __name__ == "__main__":
    run_each(main)
