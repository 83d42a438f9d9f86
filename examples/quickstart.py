"""Quickstart: train a small classifier on 4 CPU processes with the `hierarchical_zero` strategy.

    python examples/quickstart.py                 # 4 processes, Lightning's own launcher
    torchrun --nproc_per_node 4 examples/quickstart.py
    mpirun -np 4 python examples/quickstart.py    # with Open MPI and mpi4py installed

Every rank sees a different shard of the data; gradients are averaged over all ranks after each backward,
so every rank ends with the same parameters, which the script checks and reports.
"""

from __future__ import annotations

import argparse
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", type=int, default=4)
    parser.add_argument("--max-steps", type=int, default=200)
    parser.add_argument("--batch-size", type=int, default=32, help="per rank")
    parser.add_argument("--devices-per-node", type=int, default=None, help="simulate nodes of this many ranks")
    args = parser.parse_args()

    L.seed_everything(0, verbose=False)
    torch.set_num_threads(1)
    strategy = HierarchicalZeroStrategy(devices_per_node=args.devices_per_node)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=args.devices,
        strategy=strategy,
        max_steps=args.max_steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    model = Classifier()
    loader = DataLoader(make_dataset(), batch_size=args.batch_size, shuffle=True)
    start = time.perf_counter()
    trainer.fit(model, loader)
    elapsed = time.perf_counter() - start

    # C1: every rank holds the same parameters. Gather a checksum from each rank and compare.
    flat = torch.cat([p.detach().flatten() for p in model.parameters()])
    checksums = trainer.strategy.all_gather(flat.double().sum().reshape(1)).flatten().tolist()
    topo = strategy.topology
    if trainer.is_global_zero:
        same = len(set(checksums)) == 1
        print(
            f"ddp_plugin quickstart: {topo.world_size} ranks ({topo.num_nodes} node(s) x {topo.ranks_per_node}),"
            f" backend {topo.backend}, launched by {type(strategy.cluster_environment).__name__}\n"
            f"  {trainer.global_step} optimizer steps in {elapsed:.1f} s, batch {args.batch_size} per rank\n"
            f"  final train loss {trainer.callback_metrics['train_loss']:.4f} (started near {torch.log(torch.tensor(4.0)):.2f})\n"
            f"  parameters identical on all ranks: {same} (checksums {', '.join(f'{c:.6f}' for c in checksums)})"
        )


if __name__ == "__main__":
    main()
