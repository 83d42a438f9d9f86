"""Worker for the sync-mode tests: 4 CPU ranks as 2 simulated nodes x 2, a tiny MLP on the sine task, every
rank's parameters after every optimizer step.

    python -m tests.workers.sync_run --out FILE --flags '{"sync_every": 4, "outer_optimizer": "nesterov"}'
    python -m tests.workers.sync_run --out FILE --flags '{...}' --steps 6 --save-at 3 --ckpt DIR   # saves
    python -m tests.workers.sync_run --out FILE --flags '{...}' --steps 12 --resume CKPT
    torchrun --nproc_per_node 4 -m tests.workers.sync_run ... --kill-rank 3 --kill-after 8 --timeout 20  # a dead rank
    python -m tests.workers.sync_run --runs '[["--out", "FILE1", ...], ["--out", "FILE2", ...]]'  # in one launch

Rank r trains on samples r, r + 4, r + 8, ... of 96 (``rank_loader``; an epoch is 6 steps), so node n's batch
at step j is the union of ranks 2n's and 2n+1's: what the tests' single-process reference feeds replica n. Rank 0 writes ``FILE``:
``history`` (steps x ranks x parameters), ``cross_node_MB`` (steps x ranks: what each rank's accounting
counted as sent across nodes so far), ``metrics`` (the strategy's per-step means), ``memory`` (``memory_bytes()``).
"""

from __future__ import annotations

import argparse
import json
import os
import time

import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader

from ddp_plugin import HierarchicalZeroStrategy
from ddp_plugin.hookspecs import hookimpl
from ddp_plugin.plugins.mean_allreduce import MeanAllReduce
from ddp_plugin.sync import plugin as sync_plugin
from ddp_plugin.testing.callbacks import ExitReport
from ddp_plugin.testing.data import rank_loader, sine_dataset
from ddp_plugin.testing.models import TinyModule, mlp
from ddp_plugin.testing.processes import inject_fault, print_line, run_each
from ddp_plugin.testing.ranks import gather_parameters

FEATURES, HIDDEN, GLOBAL_BATCH, SEED = 8, 16, 16, 0
STEPS_PER_EPOCH = 6
"""Checkpoints are taken at the end of an epoch (``--save-at`` a multiple of it), where a resumed run sees exactly
the batches the uninterrupted one saw (mid-epoch, Lightning's loops would not)."""
INNER = {"sgd": {"lr": 0.05, "momentum": 0.9}, "adamw": {"lr": 1e-2, "weight_decay": 0.1}}


def model(inner: str) -> TinyModule:
    """The model every test builds, the reference included: seeded, so the same initial parameters."""
    torch.manual_seed(SEED)
    return TinyModule(mlp(FEATURES, HIDDEN, 1, layers=1, activation=nn.Tanh), optimizer=inner, **INNER[inner])


def dataset():
    return sine_dataset(GLOBAL_BATCH * STEPS_PER_EPOCH, FEATURES, seed=3)


def rank_batches(rank: int, batch_sizes: str = "") -> list:
    """Rank ``rank``'s batches of an epoch; with ``batch_sizes`` ("4,4,2,1") each cut to the rank's size."""
    batches = list(rank_loader(dataset(), GLOBAL_BATCH, 4, rank))
    if batch_sizes:
        size = int(batch_sizes.split(",")[rank])
        batches = [(x[:size], y[:size]) for x, y in batches]
    return batches


class EveryRank(L.Callback):
    """After every optimizer step: every rank's parameters (an all-gather), kept on rank 0."""

    def __init__(self) -> None:
        self.history: list[torch.Tensor] = []
        self.cross_node_mb: list[torch.Tensor] = []
        self.last = -1

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step in (self.last, 0):  # 0: an accumulating batch before the first step
            return
        self.last = trainer.global_step
        self.history.append(gather_parameters(trainer.strategy, pl_module).cpu())
        # (Lightning's all_gather, not the strategy's counted collectives: this adds nothing to the count.)
        sent = trainer.strategy.metric_totals.get("comm/cross_node_MB", 0.0)
        self.cross_node_mb.append(trainer.strategy.all_gather(torch.tensor([sent], dtype=torch.float64)).reshape(-1))


class SaveAt(L.Callback):
    def __init__(self, step: int, path: str) -> None:
        self.step, self.path = step, path

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step == self.step:
            trainer.save_checkpoint(self.path)


class KillAfter(L.Callback):
    """Rank ``rank`` kills itself (SIGKILL) right after optimizer step ``step``: with a schedule that sends a
    fragment after that step, while its outer sync is in flight on every rank."""

    def __init__(self, rank: int, step: int) -> None:
        self.rank, self.step = rank, step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_rank == self.rank and trainer.global_step == self.step:
            print_line(f"rank {self.rank} kills itself (SIGKILL) at {time.time():.3f}")
            inject_fault("sigkill")


class UserMean(MeanAllReduce):
    """The built-in plain mean as a plugin of the user's, answering ``on_cross_node_reduce`` ahead of the default
    one: the pseudo-gradients then go through it (as through a codec), so the sync mode keeps its outer state per
    node (``"user_mean": true`` in ``--flags``)."""

    @hookimpl
    def on_cross_node_reduce(self, tensor: torch.Tensor, group):
        return super().on_cross_node_reduce(tensor, group)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--flags", default="{}")
    p.add_argument("--inner", default="sgd", choices=list(INNER))
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--save-at", type=int, default=0)
    p.add_argument("--ckpt", default="")
    p.add_argument("--resume", default=None)
    p.add_argument("--kill-rank", type=int, default=-1)
    p.add_argument("--kill-after", type=int, default=0)
    p.add_argument("--timeout", type=float, default=300)
    p.add_argument("--trainer", default="{}", help="more Trainer arguments, JSON (accumulation, clipping, precision)")
    p.add_argument("--scheduler", action="store_true", help="halve the learning rate every 2 optimizer steps")
    p.add_argument("--batch-sizes", default="", help="comma-separated per-rank batch sizes (each a prefix of the"
                   " rank's batch; default: the whole batch)")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    # The route fixed, not measured: runs are compared bit for bit with each other.
    flags = {"devices_per_node": 2, "hierarchical": True, "timeout": args.timeout, **json.loads(args.flags)}
    if flags.pop("user_mean", False):  # (not flags of the strategy's: this worker's own)
        flags["plugins"] = [UserMean()]
    if "sync_window_bytes" in flags:  # a DiLoCo sync's windows, made small enough for this model to have many
        sync_plugin.WINDOW_BYTES = flags.pop("sync_window_bytes")
    strategy = HierarchicalZeroStrategy(**flags)
    net = model(args.inner)
    if args.scheduler:
        plain = net.configure_optimizers

        def with_scheduler():
            optimizer = plain()
            return {"optimizer": optimizer,
                    "lr_scheduler": torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)}

        net.configure_optimizers = with_scheduler
    record = EveryRank()
    exit_report = ExitReport()
    callbacks: list[L.Callback] = [record, exit_report]
    if args.save_at:
        callbacks.append(SaveAt(args.save_at, args.ckpt))
    if args.kill_rank >= 0:
        callbacks.append(KillAfter(args.kill_rank, args.kill_after))
    trainer = L.Trainer(accelerator="cpu", devices=4, strategy=strategy, max_steps=args.steps, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        use_distributed_sampler=False, callbacks=callbacks, **json.loads(args.trainer))
    loader = DataLoader(rank_batches(int(os.environ.get("LOCAL_RANK", "0")), args.batch_sizes), batch_size=None)
    try:
        trainer.fit(net, loader, ckpt_path=args.resume)
    except BaseException as err:
        exit_report.report(trainer.global_rank, err)
        raise
    if trainer.is_global_zero:
        torch.save({"history": torch.stack(record.history), "cross_node_MB": torch.stack(record.cross_node_mb),
                    "metrics": strategy.metric_means,
                    "memory": strategy.memory_bytes()}, args.out)


if __name__ == "__main__":
    run_each(main)
