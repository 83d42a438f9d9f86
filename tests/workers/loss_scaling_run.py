"""Worker for tests/test_loss_scaling.py: fp16 training with a loss scaler (Lightning's ``16-mixed``), on CPU ranks.

    python tests/workers/loss_scaling_run.py --out result.jsonl [--cases ddp,ours:2:flag,...] [--steps 10]

torch's ``GradScaler`` runs on CPU too (``torch.amp.GradScaler("cpu")``), so the paths a GPU run takes with a
scaler run here, on 2 ranks over gloo: Lightning's ``MixedPrecision("16-mixed", "cpu", scaler=...)`` with CPU
autocast in float16. Cases (one fit each, in the same 2 processes):

- ``ddp`` / ``ddp:inf``: Lightning's own ``ddp`` with ``Trainer(gradient_clip_val=0.05)``, the reference;
- ``ours:<stage>:flag``: the strategy's ``gradient_clip_norm=0.05`` (must clip the unscaled gradients);
- ``ours:<stage>:trainer``: the Trainer's clipping through the strategy;
- ``...:inf``: rank 0 gets an infinite value in one element of one gradient at step 3 (the scaler must skip that
  step on every rank and halve its scale everywhere, also where ZeRO shards the gradients so that only one
  rank's shard holds the infinity); ``...:inf:skip`` with ``skip_nonfinite=True`` as well;
- ``pp:<scale>``: a GPT in 2 pipeline stages under a scaler starting at ``<scale>`` (1024 or 1): the schedule
  runs the backward, so it must scale the loss as the scaler's ``scale`` would.

Rank 0 appends one JSON line per case to ``--out``: every rank's final parameters, scale history and steps.
"""

from __future__ import annotations

import argparse

import lightning as L
import torch
from lightning.pytorch.plugins.precision import MixedPrecision
from lightning.pytorch.strategies import DDPStrategy
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from ddp_plugin import HierarchicalZeroStrategy
from ddp_plugin.testing.gpt import GPTModule, token_dataset
from ddp_plugin.testing.processes import every_rank, run_cases

CLIP = 0.05
INF_STEP = 3
CASES = ["ddp", "ours:0:flag", "ours:2:flag", "ours:2:trainer", "ddp:inf", "ours:0:inf", "ours:2:inf",
         "ours:2:inf:skip", "ours:0:inf:skip", "pp:1024", "pp:1"]


class MLP(L.LightningModule):
    def __init__(self, inject_inf: bool) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 1))
        self.inject_inf = inject_inf

    def training_step(self, batch, batch_idx):
        x, y = batch
        if self.inject_inf and self.global_step == INF_STEP and self.global_rank == 0:
            def poison(grad: torch.Tensor) -> torch.Tensor:
                handle.remove()  # (this step's backward only)
                grad = grad.clone()
                grad.view(-1)[0] = float("inf")  # one element of one gradient, on one rank
                return grad

            handle = self.net[0].weight.register_hook(poison)
        return nn.functional.mse_loss(self.net(x).float(), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


class SGDGPT(GPTModule):
    """SGD: an update proportional to the gradient (Adam's would hide a gradient off by the scale's factor)."""

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.5)


class Scales(L.Callback):
    def __init__(self) -> None:
        self.scales: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.scales.append(float(trainer.precision_plugin.scaler.get_scale()))


def run(case: str, steps: int) -> dict:
    L.seed_everything(1234, verbose=False)
    parts = case.split(":")
    scales = Scales()
    init_scale = float(parts[1]) if parts[0] == "pp" else 1024.0
    # (growth_interval beyond the run: the scale changes only when a step finds a non-finite gradient)
    scaler = torch.amp.GradScaler("cpu", init_scale=init_scale, growth_interval=10_000)
    clip_by_trainer = parts[0] == "ddp" or "trainer" in parts or "inf" in parts
    if parts[0] == "ddp":
        strategy = DDPStrategy(process_group_backend="gloo")
    elif parts[0] == "pp":
        strategy = HierarchicalZeroStrategy(pipeline_parallel_size=2, pipeline_microbatches=2)
    else:
        strategy = HierarchicalZeroStrategy(zero_stage=int(parts[1]), skip_nonfinite="skip" in parts,
                                            gradient_clip_norm=None if clip_by_trainer else CLIP)
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_steps=steps, logger=False,
                        plugins=[MixedPrecision("16-mixed", "cpu", scaler=scaler)],
                        gradient_clip_val=CLIP if clip_by_trainer and parts[0] != "pp" else None,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        callbacks=[scales])
    if parts[0] == "pp":
        model = SGDGPT(vocab=32, d_model=16, heads=2, layers=2, seq=8)
        data = token_dataset(8 * steps, seq=8, vocab=32)
        loader = DataLoader(data, batch_size=4)
    else:
        model = MLP(inject_inf="inf" in parts)
        g = torch.Generator().manual_seed(0)
        data = TensorDataset(torch.randn(8 * steps, 8, generator=g), torch.randn(8 * steps, 1, generator=g))
        loader = DataLoader(data, batch_size=4)
    trainer.fit(model, loader)
    params = torch.cat([p.detach().float().reshape(-1) for p in model.parameters()])
    mine = {"params": params.tolist(), "scales": scales.scales, "steps": trainer.global_step,
            "skipped": getattr(trainer.strategy, "skipped_steps", None)}
    every = every_rank(mine)
    return {"case": case, "ranks": every}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--cases", default=",".join(CASES))
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args()
    torch.set_num_threads(1)
    run_cases(args.cases.split(","), lambda case: run(case, args.steps), args.out)


if __name__ == "__main__":
    main()
