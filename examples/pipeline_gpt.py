"""Pipeline stages across nodes, data parallelism inside each: a small GPT split into 2 stages, one per
(simulated) node of 2 ranks, 4 CPU processes, 1F1B over 4 microbatches, gradient clipping across the stages, and a
consolidated checkpoint that loads into the unsplit model in one plain process.

    python examples/pipeline_gpt.py                                   # Lightning's launcher, 4 processes
    python examples/pipeline_gpt.py --schedule interleaved_1f1b       # 2 stages per rank
    torchrun --nproc_per_node 4 examples/pipeline_gpt.py

The model's `forward` skips what a stage does not hold (another stage's modules are None), and `training_step`
computes its loss as `self.pipeline_loss(self.model(x), y)`: the strategy runs the pipeline schedule there. The
same module trains unchanged under Lightning's `ddp`.
"""

from __future__ import annotations

import argparse
import os
import tempfile

import lightning as L
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

from ddp_plugin import HierarchicalZeroStrategy
from ddp_plugin.testing.gpt import GPT, token_dataset


class GPTModule(L.LightningModule):
    def __init__(self, vocab: int = 64, d_model: int = 64, heads: int = 4, layers: int = 4, seq: int = 16) -> None:
        super().__init__()
        # tok, pos | blocks (a ModuleList, split into stages) | ln_f, head (tied to tok: summed across stages)
        self.model = GPT(vocab, d_model, heads, layers, seq)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = self.pipeline_loss(self.model(x), y)  # the mean over the microbatches, on every stage
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def pipeline_loss(self, logits, y):  # one microbatch's loss, computed on the last stage
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=3e-3, weight_decay=0.1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", type=int, default=4, help="processes on this machine")
    parser.add_argument("--devices-per-node", type=int, default=2, help="simulated ranks per node")
    parser.add_argument("--pp", type=int, default=2, help="pipeline_parallel_size")
    parser.add_argument("--schedule", default="1f1b", choices=["1f1b", "gpipe", "interleaved_1f1b"])
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--ckpt", default=os.path.join(tempfile.gettempdir(), "pipeline_gpt.ckpt"))
    args = parser.parse_args()
    torch.set_num_threads(1)
    L.seed_everything(0, verbose=False)
    strategy = HierarchicalZeroStrategy(pipeline_parallel_size=args.pp, pipeline_schedule=args.schedule,
                                        pipeline_microbatches=args.microbatches,
                                        devices_per_node=args.devices_per_node)
    trainer = L.Trainer(accelerator="cpu", devices=args.devices, strategy=strategy, max_steps=args.steps,
                        gradient_clip_val=1.0, logger=False, enable_checkpointing=False, enable_model_summary=False,
                        enable_progress_bar=False)
    trainer.fit(GPTModule(), DataLoader(token_dataset(4096, seq=16, vocab=64), batch_size=8))
    loss = float(trainer.callback_metrics["train_loss"])
    trainer.save_checkpoint(args.ckpt)  # every stage's tensors, gathered to global rank 0
    if trainer.is_global_zero:
        print(f"pipeline_gpt: {trainer.world_size} ranks, {args.pp} stages ({args.schedule}, {args.microbatches}"
              f" microbatches), data parallel inside each\n"
              f"  {args.steps} steps, train loss {loss:.3f} (uniform guess: {torch.log(torch.tensor(64.0)):.3f})")
        whole = GPTModule()  # plain, unsplit, in this process
        whole.load_state_dict(torch.load(args.ckpt, weights_only=False)["state_dict"], strict=True)
        print(f"  checkpoint {args.ckpt}: the unsplit model's, loaded with strict=True"
              f" ({sum(p.numel() for p in whole.parameters())} parameters)")


if __name__ == "__main__":
    main()
