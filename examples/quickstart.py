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
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import ddp_plugin  # noqa: F401  (registers strategy="hierarchical_zero")
from ddp_plugin import HierarchicalZeroStrategy


def make_dataset(n: int = 4096, features: int = 32, classes: int = 4, seed: int = 0) -> TensorDataset:
    """Gaussian blobs: a task a small MLP learns in a few hundred steps."""
    g = torch.Generator().manual_seed(seed)
    centers = torch.randn(classes, features, generator=g) * 2
    y = torch.randint(0, classes, (n,), generator=g)
    x = centers[y] + 3 * torch.randn(n, features, generator=g)
    return TensorDataset(x, y)


class Classifier(L.LightningModule):
    def __init__(self, features: int = 32, hidden: int = 256, classes: int = 4, lr: float = 1e-3) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = nn.Sequential(nn.Linear(features, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(),
                                 nn.Linear(hidden, classes))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.cross_entropy(self.net(x), y)
        self.log("train_loss", loss, prog_bar=True, sync_dist=True)
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)


class Report(L.Callback):
    """At the end of training, on every rank: checksum the parameters, compare across ranks, print on rank 0."""

    def on_train_start(self, trainer, pl_module):
        self.start = time.perf_counter()

    def on_train_end(self, trainer, pl_module):
        elapsed = time.perf_counter() - self.start
        flat = torch.cat([p.detach().flatten() for p in pl_module.parameters()])
        # C1: every rank holds the same parameters.
        checksums = trainer.strategy.all_gather(flat.double().sum().reshape(1)).flatten().tolist()
        topo = trainer.strategy.topology
        if trainer.is_global_zero:
            print(
                f"ddp_plugin quickstart: {topo.world_size} ranks ({topo.num_nodes} node(s) x {topo.ranks_per_node}),"
                f" backend {topo.backend}, launched by {type(trainer.strategy.cluster_environment).__name__}\n"
                f"  {len(trainer.strategy.engine.buckets)} gradient bucket(s) for"
                f" {sum(p.numel() for p in pl_module.parameters())} parameters\n"
                f"  {trainer.global_step} optimizer steps in {elapsed:.1f} s\n"
                f"  train loss {trainer.callback_metrics['train_loss']:.4f} (started near {math.log(4):.2f})\n"
                f"  parameters identical on all ranks: {len(set(checksums)) == 1}"
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
    trainer.fit(Classifier(), loader)


if __name__ == "__main__":
    main()
