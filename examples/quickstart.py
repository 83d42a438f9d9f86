"""Quickstart: train a small classifier on 4 CPU processes with the `hierarchical_zero` strategy.

    python examples/quickstart.py                 # 4 processes, Lightning's own launcher
    torchrun --nproc_per_node 4 examples/quickstart.py
    mpirun -np 4 python examples/quickstart.py    # with Open MPI and mpi4py installed

Every rank sees a different shard of the data; gradients are averaged over all ranks after each backward,
so every rank ends with the same parameters, which the script checks and reports.
"""

from __future__ import annotations

import argparse
import math
import time

import lightning as L
import torch
from torch.utils.data import DataLoader, TensorDataset

import ddp_plugin  # noqa: F401  (registers strategy="hierarchical_zero")
from ddp_plugin import HierarchicalZeroStrategy
from ddp_plugin.testing.models import TinyModule, mlp
from ddp_plugin.testing.ranks import all_ranks_equal, gather_parameters


def make_dataset(n: int = 4096, features: int = 32, classes: int = 4, seed: int = 0) -> TensorDataset:
    """Gaussian blobs: a task a small MLP learns in a few hundred steps."""
    g = torch.Generator().manual_seed(seed)
    centers = torch.randn(classes, features, generator=g) * 2
    y = torch.randint(0, classes, (n,), generator=g)
    x = centers[y] + 3 * torch.randn(n, features, generator=g)
    return TensorDataset(x, y)


def classifier(features: int = 32, hidden: int = 256, classes: int = 4, lr: float = 1e-3) -> L.LightningModule:
    """An MLP with two hidden layers, cross-entropy, AdamW, logging ``train_loss``: any LightningModule trains
    the same way; this one is ddp_plugin's ready-made :class:`~ddp_plugin.testing.models.TinyModule`."""
    return TinyModule(mlp(features, hidden, classes), loss="cross_entropy", optimizer="adamw", lr=lr,
                      log_loss="train_loss", log_options={"prog_bar": True, "sync_dist": True})


class Report(L.Callback):
    """At the end of training, on every rank: checksum the parameters, compare across ranks, print on rank 0."""

    def on_train_start(self, trainer, pl_module):
        self.start = time.perf_counter()

    def on_train_end(self, trainer, pl_module):
        elapsed = time.perf_counter() - self.start
        # C1: every rank holds the same parameters (one row per rank).
        every_rank = gather_parameters(trainer.strategy, pl_module)
        checksums = every_rank.double().sum(dim=1).tolist()
        topo = trainer.strategy.topology
        if trainer.is_global_zero:
            print(
                f"ddp_plugin quickstart: {topo.world_size} ranks ({topo.num_nodes} node(s) x {topo.ranks_per_node}),"
                f" backend {topo.backend}, launched by {type(trainer.strategy.cluster_environment).__name__}\n"
                f"  {len(trainer.strategy.engine.buckets)} gradient bucket(s) for"
                f" {sum(p.numel() for p in pl_module.parameters())} parameters\n"
                f"  {trainer.global_step} optimizer steps in {elapsed:.1f} s\n"
                f"  train loss {trainer.callback_metrics['train_loss']:.4f} (started near {math.log(4):.2f})\n"
                f"  parameters identical on all ranks: {all_ranks_equal(every_rank)}"
                f" (checksums {', '.join(f'{c:.6f}' for c in checksums)})",
                flush=True,
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", type=int, default=4, help="ranks per node")
    parser.add_argument("--num-nodes", type=int, default=1)
    parser.add_argument("--max-steps", type=int, default=200)
    parser.add_argument("--batch-size", type=int, default=32, help="per rank")
    parser.add_argument("--devices-per-node", type=int, default=None, help="simulate nodes of this many ranks")
    parser.add_argument("--start-method", default="popen", choices=["popen", "spawn"])
    args = parser.parse_args()

    L.seed_everything(0, verbose=False)
    torch.set_num_threads(1)
    if args.devices_per_node is None and args.start_method == "popen":
        strategy = "hierarchical_zero"  # the registered name; every flag at its default
    else:
        strategy = HierarchicalZeroStrategy(devices_per_node=args.devices_per_node, start_method=args.start_method)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=args.devices,
        num_nodes=args.num_nodes,
        strategy=strategy,
        max_steps=args.max_steps,
        callbacks=[Report()],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    loader = DataLoader(make_dataset(), batch_size=args.batch_size, shuffle=True)
    trainer.fit(classifier(), loader)


if __name__ == "__main__":
    main()
