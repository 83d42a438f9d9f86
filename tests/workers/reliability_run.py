"""Worker for the reliability tests.

    torchrun --nproc_per_node 4 tests/workers/reliability_run.py --mode die --die-rank 2       # C5
    torchrun --nproc_per_node 4 tests/workers/reliability_run.py --mode raise --die-rank 2     # an error of its own
    python tests/workers/reliability_run.py --mode stop --die-rank 2 --devices-per-node 2 --timeout 15 --out DIR
        # a hung rank (SIGSTOP) under Lightning's launcher; --strategy ddp runs Lightning's DDPStrategy instead
    python tests/workers/reliability_run.py --mode late --late-rank 3 --late-s 15 --timeout 6 --out DIR  # slow start
    python tests/workers/reliability_run.py --mode nonfinite --out DIR                         # NaN on one rank
    python tests/workers/reliability_run.py --mode weighting --out DIR [--weighting rank]      # uneven batches
    python tests/workers/reliability_run.py --mode weighting --out DIR --devices 0             # reference
"""

from __future__ import annotations

import argparse
import os
import time
from datetime import timedelta

import lightning as L
import torch
from lightning.pytorch.strategies import DDPStrategy
from torch import nn
from torch.utils.data import DataLoader

from ddp_plugin import HierarchicalZeroStrategy
from ddp_plugin.testing.callbacks import ExitReport
from ddp_plugin.testing.data import sine_dataset
from ddp_plugin.testing.models import TinyModule, mlp
from ddp_plugin.testing.processes import inject_fault, print_line, run_each, write_pid_file
from ddp_plugin.testing.ranks import flat_parameters

SIZES = (2, 3, 5, 6)  # uneven per-rank batch sizes; their union is one reference batch of 16
STEPS = 12
NAN_STEP = 5


class Model(TinyModule):
    """8 -> 32 -> 1 (tanh), SGD with momentum, that breaks on purpose inside ``training_step``: a
    :class:`~ddp_plugin.testing.models.TinyModule` with faults, because the tests need the fault on one rank at an
    exact step, between that step's forward on the other ranks and its gradients' collectives (and a NaN in one
    rank's input). Keeps the parameters after every batch in ``history``."""

    def __init__(self, mode: str, die_rank: int = -1, out: str = ".") -> None:
        super().__init__(mlp(8, 32, 1, layers=0, activation=nn.Tanh), optimizer="sgd", lr=0.1, momentum=0.9)
        self.mode, self.die_rank, self.out = mode, die_rank, out
        self.history: list[torch.Tensor] = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        if self.mode == "die" and self.global_rank == self.die_rank and self.global_step == 20:
            print_line(f"rank {self.global_rank} kills itself (SIGKILL) at {time.time():.3f}")
            inject_fault("sigkill")
        if self.mode == "stop" and self.global_rank == self.die_rank and self.global_step == 20:
            # Written before stopping: the test measures from this moment, however long the start took.
            with open(os.path.join(self.out, "stopped"), "w") as f:
                f.write(f"{os.getpid()} {time.time():.3f}")
            print_line(f"rank {self.global_rank} stops itself (SIGSTOP)")
            inject_fault("sigstop")
        if self.mode == "raise" and self.global_rank == self.die_rank and self.global_step == 20:
            inject_fault("raise")
        if self.mode == "nonfinite" and self.global_rank == 1 and self.global_step == NAN_STEP:
            x = x.clone()
            x[0, 0] = float("nan")
        return self.compute_loss((x, y))

    def on_fit_start(self) -> None:
        if self.mode == "stop":  # for the test's cleanup: every rank's process id
            write_pid_file(self.out, self.global_rank)

    def on_train_batch_end(self, outputs, batch, batch_idx):
        self.history.append(flat_parameters(self))


class DDPPatientStart(DDPStrategy):
    """Lightning's DDPStrategy connecting with its default 30-minute timeout, then giving its collectives
    ``collective_timeout``: what ``DDPStrategy(timeout=...)`` does once started. (With a short timeout, DDP's
    rendezvous fails on a loaded machine before the other ranks have imported Lightning.)"""

    def __init__(self, collective_timeout: timedelta) -> None:
        super().__init__()
        self._collective_timeout = collective_timeout

    def setup_distributed(self) -> None:
        super().setup_distributed()
        set_timeout = getattr(torch.distributed, "set_timeout", None)  # torch 2.15: the private name is deprecated
        (set_timeout or torch.distributed.distributed_c10d._set_pg_timeout)(self._collective_timeout)


def uneven_batches(rank: int, world: int) -> list[list[int]]:
    """Step j: the union over ranks is samples [16j, 16j+16); rank r takes SIZES[r] of them (world 4), or all."""
    if world == 1:
        return [list(range(16 * j, 16 * j + 16)) for j in range(STEPS)]
    start = sum(SIZES[:rank])
    return [list(range(16 * j + start, 16 * j + start + SIZES[rank])) for j in range(STEPS)]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mode", required=True, choices=["die", "raise", "stop", "late", "nonfinite", "weighting"])
    parser.add_argument("--out", default=".")
    parser.add_argument("--devices", type=int, default=4)
    parser.add_argument("--die-rank", type=int, default=2)
    parser.add_argument("--timeout", type=float, default=None, help="seconds; default: the strategy's")
    parser.add_argument("--weighting", default="rank")
    parser.add_argument("--late-rank", type=int, default=-1, help="this local rank starts --late-s seconds late")
    parser.add_argument("--late-s", type=float, default=0.0)
    parser.add_argument("--devices-per-node", type=int, default=None, help="simulated nodes of this many ranks")
    parser.add_argument("--strategy", default="hierarchical_zero",
                        choices=["hierarchical_zero", "ddp", "ddp_patient_start"],
                        help="ddp: Lightning's DDPStrategy with the same timeout, to compare (ddp_patient_start:"
                             " the timeout on its collectives only)")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    if int(os.environ.get("LOCAL_RANK", 0)) == args.late_rank:
        time.sleep(args.late_s)  # as a slow import on a loaded machine: the others are waiting at the rendezvous
    L.seed_everything(0, verbose=False)
    model = Model(args.mode, args.die_rank, args.out)
    if args.devices and args.strategy == "ddp":
        timeout = {"timeout": timedelta(seconds=args.timeout)} if args.timeout else {}
        strategy = DDPStrategy(**timeout)
    elif args.devices and args.strategy == "ddp_patient_start":
        strategy = DDPPatientStart(timedelta(seconds=args.timeout))
    elif args.devices:
        timeout = {"timeout": args.timeout} if args.timeout else {}
        strategy = HierarchicalZeroStrategy(
            **timeout, skip_nonfinite=args.mode == "nonfinite", weighting=args.weighting,
            devices_per_node=args.devices_per_node,
        )
    else:
        strategy = "auto"
    exit_report = ExitReport()
    trainer = L.Trainer(
        accelerator="cpu", devices=max(args.devices, 1), strategy=strategy, callbacks=[exit_report],
        max_steps=500 if args.mode in ("die", "raise", "stop") else STEPS, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, use_distributed_sampler=args.mode != "weighting",
    )
    if args.mode == "weighting":
        # The batches depend on the rank, known once the Trainer has set up its environment.
        rank, world = int(os.environ.get("LOCAL_RANK", 0)), max(args.devices, 1)
        loader = DataLoader(sine_dataset(16 * STEPS, 8, seed=3), batch_sampler=uneven_batches(rank, world))
    else:
        loader = DataLoader(sine_dataset(4096, 8, seed=3), batch_size=8)
    try:
        trainer.fit(model, loader)
    except BaseException as err:
        exit_report.report(trainer.global_rank, err)
        raise
    history = torch.stack(model.history)
    every_rank = trainer.strategy.all_gather(history) if trainer.world_size > 1 else history[None]
    if trainer.is_global_zero:
        torch.save({"history": history, "every_rank": every_rank,
                    "skipped": getattr(trainer.strategy, "skipped_steps", 0)},
                   os.path.join(args.out, f"{args.mode}-{args.devices}-{args.weighting}.pt"))


if __name__ == "__main__":
    run_each(main)
