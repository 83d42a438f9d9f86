"""Worker for the checkpoint tests (C4).

    python tests/workers/checkpoint_run.py --devices 4 --stage 3 --steps 12 --out DIR --name full
        # 12 steps; ModelCheckpoint writes DIR/full-step=6.ckpt and DIR/full-step=12.ckpt
    python tests/workers/checkpoint_run.py --devices 2 --stage 1 --steps 12 --out DIR --name resumed \
        --resume DIR/full-step=6.ckpt
    python tests/workers/checkpoint_run.py --devices 0 ...     # one process, Lightning's own strategy
    python tests/workers/checkpoint_run.py --devices 4 --steps 12 --out DIR --name kill --stall-second-save
        # trainer.save_checkpoint(DIR/model.ckpt) after steps 3 and 6; rank 0 writes DIR/stalled when 4 kB of
        # the second save are written and then stalls there, for the test to kill it
    python tests/workers/checkpoint_run.py --devices 4 --stage 2 --steps 12 --out DIR --name after \
        --save-after-fit --validate-after-fit
        # after fit (and trainer.validate and trainer.test), trainer.save_checkpoint(DIR/after-after-fit.ckpt)

One epoch is 6 optimizer steps of a global batch of 16 (each rank takes 16 / devices samples, a
DistributedSampler without shuffling), and the checkpoint after 6 steps is written by an uninterrupted run
from ``on_train_batch_end`` of the epoch's last batch: resumed from it, Lightning starts the next epoch and sees
exactly the batches the uninterrupted run saw. (Lightning's own per-epoch checkpoint, written from
``on_train_epoch_end``, makes a resumed run repeat one batch, with any strategy: not what C4 is about.)
Saves DIR/<name>.pt on rank 0: the final parameters and the loss history.

    python tests/workers/checkpoint_run.py --runs '[["--devices", "4", ...], ["--devices", "4", ...]]'
        # several runs one after another in the same 4 processes (every run with the same --devices)
"""

from __future__ import annotations

import argparse
import os
import time

import lightning as L
import torch
from lightning.fabric.plugins import TorchCheckpointIO
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn

import ddp_plugin.checkpoints.checkpoint_io
from ddp_plugin import HierarchicalZeroStrategy
from ddp_plugin.testing.data import rank_loader, sine_dataset
from ddp_plugin.testing.processes import run_each, write_pid_file

GLOBAL_BATCH = 16
STEPS_PER_EPOCH = 6


class Net(L.LightningModule):
    """The checkpointed model: not :class:`~ddp_plugin.testing.models.TinyModule`, because the checkpoint tests
    need more than a training step: its hyperparameters saved (``Net.load_from_checkpoint`` in plain Lightning),
    parameter names the tests read (``body.0.weight``, ``head.weight``), validation and test steps logging with
    ``sync_dist`` (``--validate-after-fit``), an LR scheduler stepping every step (its state is in the checkpoint),
    the loss history, and the engine's bucket count."""

    def __init__(self, width: int = 32) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.body = nn.Sequential(nn.Linear(8, width), nn.Tanh(), nn.Linear(width, width), nn.Tanh())
        self.head = nn.Linear(width, 1)
        self.losses: list[float] = []

    def forward(self, x):
        return self.head(self.body(x))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.mse_loss(self(x), y)
        self.losses.append(loss.item())
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", nn.functional.mse_loss(self(x), y), sync_dist=True)

    def test_step(self, batch, batch_idx):
        x, y = batch
        self.log("test_loss", nn.functional.mse_loss(self(x), y), sync_dist=True)

    def on_train_start(self) -> None:
        engine = getattr(self.trainer.strategy, "engine", None)
        self.num_buckets = len(engine.buckets) if engine is not None else 0

    def train_dataloader(self):
        return self.dataloader(seed=5)

    def dataloader(self, seed: int):
        data = sine_dataset(GLOBAL_BATCH * STEPS_PER_EPOCH, 8, seed)
        return rank_loader(data, GLOBAL_BATCH, self.trainer.world_size, self.trainer.global_rank)

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=1e-2, weight_decay=0.1)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=4, gamma=0.5)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


class SaveEvery(L.Callback):
    """``trainer.save_checkpoint(path)`` after every ``n`` optimizer steps, as a user's own callback would."""

    def __init__(self, n: int, path: str) -> None:
        self.n, self.path = n, path

    def on_train_batch_end(self, trainer, *args) -> None:
        if trainer.global_step % self.n == 0:
            trainer.save_checkpoint(self.path)


def stall_second_save(marker: str) -> None:
    """From the second checkpoint on, stop writing after 4 kB (after creating ``marker``) and wait to be killed."""
    real_save, calls = ddp_plugin.checkpoints.checkpoint_io.stream_save, []

    class Stalling:
        def __init__(self, f, stall_at: int) -> None:
            self.f, self.stall_at, self.written = f, stall_at, 0

        def write(self, data) -> int:
            n = self.f.write(data)
            self.written += n
            if self.written >= self.stall_at:
                open(marker, "w").close()
                time.sleep(600)
            return n

        def __getattr__(self, name):
            return getattr(self.f, name)

    def save(obj, f):
        calls.append(1)
        if len(calls) < 2:
            return real_save(obj, f)
        return real_save(obj, Stalling(f, 4096))  # the checkpoint has ~20 kB

    ddp_plugin.checkpoints.checkpoint_io.stream_save = save  # the checkpoint writer's serializer


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--devices", type=int, default=4)
    p.add_argument("--devices-per-node", type=int, default=None)
    p.add_argument("--stage", type=int, default=0)
    p.add_argument("--scope", default="global")
    p.add_argument("--compression", default=None)
    p.add_argument("--checkpoint", default="master")
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--name", required=True)
    p.add_argument("--resume", default=None)
    p.add_argument("--width", type=int, default=32)
    # Generous: it bounds the rendezvous too, which a slow start on a busy machine can take long to reach.
    p.add_argument("--timeout", type=float, default=300)
    p.add_argument("--stall-second-save", action="store_true")
    p.add_argument("--lightning-io", action="store_true", help="Lightning's TorchCheckpointIO instead of ours")
    p.add_argument("--accelerator", default="cpu", help="cpu, or gpu for the CUDA/NCCL tests")
    p.add_argument("--no-save", action="store_true", help="no checkpoints: the uninterrupted reference")
    p.add_argument("--ckpt-dir", default=None, help="where checkpoints go (default: --out)")
    p.add_argument("--bucket-mb", type=float, default=25, help="bucket_size_mb")
    p.add_argument("--wrap", default="Linear", help="auto_wrap_policy: comma-separated class names")
    p.add_argument("--save-after-fit", action="store_true", help="trainer.save_checkpoint after fit")
    p.add_argument("--validate-after-fit", action="store_true", help="trainer.validate and .test before that")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    L.seed_everything(11, verbose=False)
    model = Net(width=args.width)
    if args.devices:
        strategy = HierarchicalZeroStrategy(
            zero_stage=args.stage, shard_scope=args.scope, compression=args.compression,
            devices_per_node=args.devices_per_node, auto_wrap_policy=args.wrap.split(","),
            hierarchical=True,  # (not measured: a resumed run must take the route the saving one took)
            checkpoint=args.checkpoint, timeout=args.timeout, bucket_size_mb=args.bucket_mb,
            checkpoint_io=TorchCheckpointIO() if args.lightning_io else None,
        )
    else:
        strategy = "auto"
    # A checkpoint after steps 6 and 12 (<name>-step=6.ckpt, ...), saved while training goes on.
    ckpt_dir = args.ckpt_dir or args.out
    saver = ModelCheckpoint(
        dirpath=ckpt_dir, filename=args.name + "-{step}", save_top_k=-1, every_n_train_steps=STEPS_PER_EPOCH
    )
    callbacks: list[L.Callback] = [] if args.no_save else [saver]
    if args.stall_second_save:
        callbacks = [SaveEvery(3, os.path.join(ckpt_dir, "model.ckpt"))]
    trainer = L.Trainer(
        accelerator=args.accelerator, devices=max(args.devices, 1), strategy=strategy, max_steps=args.steps,
        callbacks=callbacks, enable_checkpointing=saver in callbacks, logger=False, enable_progress_bar=False,
        enable_model_summary=False, use_distributed_sampler=False,
    )
    if args.stall_second_save and int(os.environ.get("LOCAL_RANK", 0)) == 0:
        stall_second_save(os.path.join(args.out, "stalled"))
    write_pid_file(args.out, os.environ.get("LOCAL_RANK", 0))
    trainer.fit(model, ckpt_path=args.resume)
    if args.validate_after_fit:
        trainer.validate(model, dataloaders=model.dataloader(seed=6), verbose=False)
        trainer.test(model, dataloaders=model.dataloader(seed=7), verbose=False)
    user_state_dict = None
    if args.save_after_fit:
        trainer.save_checkpoint(os.path.join(ckpt_dir, f"{args.name}-after-fit.ckpt"))
        try:  # what the optimizer the user holds says when asked directly
            trainer.optimizers[0].state_dict()
            user_state_dict = "returned"
        except RuntimeError as err:
            user_state_dict = str(err)
    if trainer.is_global_zero:
        params = {n: p.detach().cpu().clone() for n, p in model.named_parameters()}
        torch.save({"params": params, "losses": model.losses, "global_step": trainer.global_step,
                    "num_buckets": getattr(model, "num_buckets", 0), "user_state_dict": user_state_dict},
                   os.path.join(args.out, f"{args.name}.pt"))


if __name__ == "__main__":
    run_each(main)
