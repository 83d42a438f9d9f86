"""Worker for the ZeRO memory and bad-optimizer tests.

    python tests/workers/zero_run.py --mode memory --out FILE.json     # 4 ranks, stages 0-3, global scope
    python tests/workers/zero_run.py --mode optimizer --optimizer lbfgs  # must fail before the first step
"""

from __future__ import annotations

import argparse
import json

import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from ddp_plugin import HierarchicalZeroStrategy

WIDTH, LAYERS = 512, 4  # 4 x (512 x 512 + 512) = 1,050,624 parameters, fp32


class Net(L.LightningModule):
    def __init__(self, optimizer: str = "adamw") -> None:
        super().__init__()
        self.net = nn.Sequential(*[nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS)])
        self.optimizer_name = optimizer
        self.memory: dict[str, int] = {}
        self.largest_unit = 0
        self.peak_gathered = 0

    def training_step(self, batch, batch_idx):
        (x,) = batch
        return self.net(x).pow(2).mean()

    def on_train_batch_end(self, outputs, batch, batch_idx):
        # After the optimizer step, before the next zero_grad: parameters, gradients and state all live.
        self.memory = self.trainer.strategy.memory_bytes()
        sharder = self.trainer.strategy.plugin_manager.get_plugin("zero_sharder")
        if sharder is not None and sharder.stage == 3:
            self.largest_unit = sharder.largest_unit_bytes
            self.peak_gathered = sharder.fit_peak_gathered_bytes

    def configure_optimizers(self):
        if self.optimizer_name == "lbfgs":
            return torch.optim.LBFGS(self.parameters())
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def fit(stage: int, optimizer: str, devices: int) -> Net:
    L.seed_everything(0, verbose=False)
    model = Net(optimizer)
    data = TensorDataset(torch.randn(64, WIDTH))
    strategy = HierarchicalZeroStrategy(zero_stage=stage, shard_scope="global", auto_wrap_policy=[nn.Linear])
    trainer = L.Trainer(accelerator="cpu", devices=devices, strategy=strategy, max_steps=2, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(model, DataLoader(data, batch_size=4))
    return model


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mode", choices=["memory", "optimizer"], required=True)
    parser.add_argument("--out", default=None)
    parser.add_argument("--optimizer", default="adamw")
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.mode == "optimizer":
        fit(1, args.optimizer, devices=2)
        return
    rows = {}
    for stage in (0, 1, 2, 3):
        model = fit(stage, "adamw", devices=4)
        rows[stage] = {**model.memory, "largest_unit": model.largest_unit, "peak_gathered": model.peak_gathered,
                       "numel": sum(p.numel() for p in model.parameters())}
    if model.trainer.is_global_zero:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
