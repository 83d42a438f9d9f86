"""Worker for the tensor-parallel refusals: a fit the strategy must refuse at setup, on every rank, naming what to
change. ``--case no_configure_model``: ``tensor_parallel_size=2`` for a module without ``configure_model``;
``--case fully_shard``: a ``configure_model`` that applies Lightning's whole recipe (TP, then ``fully_shard`` on the
data-parallel mesh); ``--case vocab_tie_across_stages``: the embedding split by vocabulary and tied to the head,
with pipeline stages (the two stages would each hold a shard of it)."""

from __future__ import annotations

import argparse

import lightning as L
import torch
from torch.utils.data import DataLoader

from ddp_plugin import HierarchicalZeroStrategy
from ddp_plugin.testing.gpt import GPT, GPTModule, token_dataset


class WithoutConfigureModel(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.model = GPT()

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.cross_entropy(self.model(x).flatten(0, 1), y.flatten())

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters())


class WithFullyShard(GPTModule):
    def configure_model(self) -> None:
        from torch.distributed.fsdp import fully_shard

        super().configure_model()
        for block in self.model.blocks:
            fully_shard(block, mesh=self.device_mesh["data_parallel"])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--case", choices=["no_configure_model", "fully_shard", "vocab_tie_across_stages"],
                        required=True)
    args = parser.parse_args()
    flags = {"tensor_parallel_size": 2, "timeout": 60}
    if args.case == "vocab_tie_across_stages":
        model = GPTModule(tie="vocab")
        flags["pipeline_parallel_size"] = 2
    else:
        model = WithoutConfigureModel() if args.case == "no_configure_model" else WithFullyShard()
    trainer = L.Trainer(accelerator="cpu", devices=4, max_steps=1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False,
                        strategy=HierarchicalZeroStrategy(**flags))
    trainer.fit(model, DataLoader(token_dataset(16), batch_size=2))


if __name__ == "__main__":
    main()
