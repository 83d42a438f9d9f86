"""Smoke test of an installed ddp_plugin, run by ``.ci/wheel_smoke`` from a folder outside the checkout.

    python wheel_smoke.py            # sync, int8, zero3, tp, one after another in the same 4 processes
    python wheel_smoke.py int8       # one of them

Short 4-rank CPU fits under Lightning's own launcher (2 simulated nodes of 2 ranks), with ``sync_every=4``, with
``compression="int8"``, with ``zero_stage=3`` and with ``tensor_parallel_size=2`` at ``zero_stage=2`` (the layers
split over the 2 ranks of each node in ``configure_model``), each followed by a check that every rank ends with
the same whole parameters. Written as a user would write it: nothing from the repository, only the installed package.
"""

from __future__ import annotations

import sys

import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import ddp_plugin  # noqa: F401  (registers the strategies)
from ddp_plugin import HierarchicalZeroStrategy

FLAGS = {"sync": {"sync_every": 4}, "int8": {"compression": "int8"}, "zero3": {"zero_stage": 3},
         "tp": {"tensor_parallel_size": 2, "zero_stage": 2}}
STEPS = 12


class Net(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 4))

    def configure_model(self):
        mesh = self.device_mesh  # the strategy's (data_parallel, tensor_parallel) mesh
        if mesh["tensor_parallel"].size() > 1:
            from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

            parallelize_module(self.net, mesh["tensor_parallel"], {"0": ColwiseParallel(), "2": RowwiseParallel()})

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.cross_entropy(self.net(x), y)
        self.log("loss", loss, sync_dist=True)
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


class SameOnEveryRank(L.Callback):
    """At the end of training: every rank's parameters, whole (stage 3 gathers its shards), gathered to every rank
    and compared bit for bit; raises on a difference, so the run fails."""

    def __init__(self, name: str) -> None:
        self.name = name

    def on_train_start(self, trainer, pl_module):
        self.start = torch.cat([p.detach().flatten().clone() for p in self._whole(trainer, pl_module)])

    def on_train_end(self, trainer, pl_module):
        flat = torch.cat([p.detach().flatten() for p in self._whole(trainer, pl_module)])
        every_rank = trainer.strategy.all_gather(flat)
        if not bool((every_rank == every_rank[0]).all()):
            raise AssertionError(f"ranks differ after training: {(every_rank - every_rank[0]).abs().amax(dim=1)}")
        if torch.equal(flat, self.start) or not torch.isfinite(flat).all():
            raise AssertionError("training did not change the parameters, or made them non-finite")
        if trainer.is_global_zero:
            print(f"wheel smoke {self.name}: {trainer.world_size} ranks, {trainer.global_step} steps, loss"
                  f" {trainer.callback_metrics['loss']:.4f}, parameters identical on every rank", flush=True)

    @staticmethod
    def _whole(trainer, pl_module):
        from torch.distributed.tensor import DTensor

        with trainer.strategy.full_parameters():  # (a tensor-parallel parameter made whole from its shards)
            return [p.detach().full_tensor() if isinstance(p, DTensor) else p.detach().clone()
                    for p in pl_module.parameters()]


def fit(name: str) -> None:
    L.seed_everything(0, verbose=False)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(512, 16, generator=g)
    y = x[:, :4].argmax(dim=1)
    trainer = L.Trainer(
        accelerator="cpu", devices=4, max_steps=STEPS, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, callbacks=[SameOnEveryRank(name)],
        strategy=HierarchicalZeroStrategy(devices_per_node=2, **FLAGS[name]),
    )
    trainer.fit(Net(), DataLoader(TensorDataset(x, y), batch_size=16, shuffle=True))


def main() -> None:
    torch.set_num_threads(1)
    for name in sys.argv[1:] or list(FLAGS):
        fit(name)


if __name__ == "__main__":
    main()
