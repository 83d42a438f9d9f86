"""One replica group of a fault-tolerant run (docs/fault_tolerance.md): start the lighthouse once, then this script
once per group (a node each, with its own rendezvous). Kill a group (every process of it) at any moment and start
it again: the others go on without it, and it rejoins healed from a live peer.

On one machine, 2 ranks per group, 3 groups (the first one starts the lighthouse; each group its own rendezvous
port, 29600 + its id):

    ddp-plugin-group --group 0 --groups 3 --start-lighthouse examples/fault_tolerance.py &
    for i in 1 2; do
        ddp-plugin-group --group $i --groups 3 --lighthouse http://localhost:29510 examples/fault_tolerance.py &
    done

which is, by hand:

    torchft_lighthouse --min_replicas 1 --join_timeout_ms 10000 --bind [::]:29510 &
    for i in 0 1 2; do
        REPLICA_GROUP_ID=$i NUM_REPLICA_GROUPS=3 TORCHFT_LIGHTHOUSE=http://localhost:29510 \\
            MASTER_ADDR=localhost MASTER_PORT=$((29600 + i)) python examples/fault_tolerance.py &
    done

``SYNC_EVERY=50`` runs DiLoCo instead (a quorum per outer sync; nothing crosses nodes between syncs).

On a cluster, the same per node (``--master-addr`` its own address, ``--nproc-per-node K`` to run under torchrun,
or Lightning's launcher), with the lighthouse's host in ``--lighthouse``.
"""

from __future__ import annotations

import os

import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import ddp_plugin  # noqa: F401 (registers the strategies)
from ddp_plugin import HierarchicalZeroStrategy


class Regression(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 1))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x), y)
        self.log("loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def main() -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(65536, 16, generator=g)
    data = DataLoader(TensorDataset(x, torch.sin(x.sum(1, keepdim=True))), batch_size=32)
    trainer = L.Trainer(
        accelerator="cpu", devices=int(os.environ.get("DEVICES", 2)), num_nodes=1,
        max_steps=int(os.environ.get("STEPS", 2000)),
        # Every key from the environment: REPLICA_GROUP_ID, NUM_REPLICA_GROUPS, TORCHFT_LIGHTHOUSE.
        strategy=HierarchicalZeroStrategy(fault_tolerance=True, sync_every=int(os.environ.get("SYNC_EVERY", 1))),
        logger=False, enable_checkpointing=False,
    )
    trainer.fit(Regression(), data)


if __name__ == "__main__":
    main()
