"""Tensor parallelism inside a node, data parallelism across: a small GPT split over 2 ranks of each of 2
(simulated) nodes, 4 CPU processes, gradient clipping, and a consolidated checkpoint that loads into the unsplit
model in one plain process.

    python examples/tensor_parallel_gpt.py                     # Lightning's launcher, 4 processes
    python examples/tensor_parallel_gpt.py --zero-stage 2      # ZeRO over the data-parallel ranks
    torchrun --nproc_per_node 4 examples/tensor_parallel_gpt.py

The LightningModule is what one writes for Lightning's ModelParallelStrategy, less its `fully_shard` half:
`configure_model` splits the layers on `self.device_mesh["tensor_parallel"]`; the strategy does the rest.
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
from ddp_plugin.testing.gpt import GPT, tensor_parallel_plan, token_dataset


class GPTModule(L.LightningModule):
    def __init__(self, vocab: int = 64, d_model: int = 64, heads: int = 4, layers: int = 2, seq: int = 16) -> None:
        super().__init__()
        self.model = GPT(vocab, d_model, heads, layers, seq)  # its head is tied to the token embedding

    def configure_model(self) -> None:
        from torch.distributed.tensor.parallel import parallelize_module

        # q, k, v and the MLP's first layer by columns, the attention output and the second layer by rows, and
        # the tied embedding by vocabulary (Shard(0) for both its uses). parallelize_module unties the head;
        # the strategy ties it again (or do it here: `self.model.head.weight = self.model.tok.weight`).
        plan = tensor_parallel_plan(self.model, tie="vocab")
        parallelize_module(self.model, self.device_mesh["tensor_parallel"], plan)

    def training_step(self, batch, batch_idx):
        x, y = batch
        logits = self.model(x)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=3e-3, weight_decay=0.1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", type=int, default=4, help="processes on this machine")
    parser.add_argument("--devices-per-node", type=int, default=2, help="simulated ranks per node")
    parser.add_argument("--tp", type=int, default=2, help="tensor_parallel_size")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--zero-stage", type=int, default=0)
    parser.add_argument("--ckpt", default=os.path.join(tempfile.gettempdir(), "tensor_parallel_gpt.ckpt"))
    args = parser.parse_args()
    torch.set_num_threads(1)
    L.seed_everything(0, verbose=False)
    strategy = HierarchicalZeroStrategy(tensor_parallel_size=args.tp, devices_per_node=args.devices_per_node,
                                        zero_stage=args.zero_stage)
    trainer = L.Trainer(accelerator="cpu", devices=args.devices, strategy=strategy, max_steps=args.steps,
                        gradient_clip_val=1.0, logger=False, enable_checkpointing=False, enable_model_summary=False,
                        enable_progress_bar=False)
    trainer.fit(GPTModule(), DataLoader(token_dataset(4096, seq=16, vocab=64), batch_size=8))
    loss = float(trainer.callback_metrics["train_loss"])
    trainer.save_checkpoint(args.ckpt)  # whole tensors, gathered over the tensor-parallel (and ZeRO) shards
    if trainer.is_global_zero:
        mesh = strategy.device_mesh
        print(f"tensor_parallel_gpt: {trainer.world_size} ranks as (data_parallel, tensor_parallel) ="
              f" {tuple(mesh.shape)}, ZeRO stage {args.zero_stage} over the data-parallel ranks\n"
              f"  {args.steps} steps, train loss {loss:.3f} (uniform guess: {torch.log(torch.tensor(64.0)):.3f})")
        whole = GPTModule()  # plain, unsplit, in this process
        whole.load_state_dict(torch.load(args.ckpt, weights_only=False)["state_dict"], strict=True)
        print(f"  checkpoint {args.ckpt}: whole tensors, loaded into the unsplit GPT with strict=True"
              f" ({sum(p.numel() for p in whole.parameters())} parameters)")


if __name__ == "__main__":
    main()
