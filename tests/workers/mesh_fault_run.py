"""Worker for the mesh fault tests (tests/test_mesh_faults.py): the tiny tied GPT on a 3-D mesh layout under
Lightning's launcher, one rank killed (SIGKILL), stopped (SIGSTOP) or raising at a fixed step, at the start of its
training step: the other ranks meet it inside the mesh's collectives (tensor-parallel forward and backward,
pipeline sends and receives), not in the gradient sync. Mode ``save``: every rank saves ``DIR/mesh.ckpt`` after
step 2 and again after step 5 (pass ``"checkpoint": "sharded"`` in ``--flags``), and the faulty rank kills itself
as the second save starts writing its part (``torch.distributed.checkpoint.save``), while the others are in it.

    python tests/workers/mesh_fault_run.py --mode die --rank 1 --flags '{"tensor_parallel_size": 2}' --out DIR

Lightning's process observer, which SIGKILLs every rank at its next poll after a child has died (every 5 s), polls
every 60 s here: a poll that came soon after the fault ended every survivor before its diagnosis printed (seen in CI
on a loaded machine); what is tested is that the survivors name the rank and exit by themselves.

Every rank prints ``rank R exits after S s (at T): Error: message`` when ``fit`` fails
(:class:`~ddp_plugin.testing.callbacks.ExitReport`) and leaves its process id in ``DIR`` (for the test's
cleanup); the stopping rank writes ``DIR/stopped`` just before it stops.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import lightning as L
import torch
from torch.utils.data import DataLoader

from lightning.fabric.strategies.launchers.subprocess_script import _ChildProcessObserver

from ddp_plugin import HierarchicalZeroStrategy
from ddp_plugin.testing.callbacks import ExitReport
from ddp_plugin.testing.gpt import GPTModule, token_dataset
from ddp_plugin.testing.processes import inject_fault, print_line, write_pid_file

FAULT_STEP = 5
_ChildProcessObserver.__init__.__defaults__ = (60,)  # sleep_period (see the docstring)


class FaultyGPT(GPTModule):
    def __init__(self, mode: str, rank: int, out: str) -> None:
        super().__init__(vocab=32, d_model=32, heads=2, layers=2, seq=8)
        self.mode, self.fault_rank, self.out = mode, rank, out

    def on_fit_start(self) -> None:
        write_pid_file(self.out, self.global_rank)

    def on_train_batch_end(self, outputs, batch, batch_idx) -> None:
        if self.mode != "save" or self.global_step not in (2, FAULT_STEP):
            return
        if self.global_step == FAULT_STEP and self.global_rank == self.fault_rank:
            import torch.distributed.checkpoint as dcp

            def killed_while_saving(*args, **kwargs):
                print_line(f"rank {self.global_rank} kills itself (SIGKILL) at {time.time():.3f}")
                inject_fault("sigkill")

            dcp.save = killed_while_saving
        self.trainer.save_checkpoint(os.path.join(self.out, "mesh.ckpt"))

    def training_step(self, batch, batch_idx):
        if self.global_rank == self.fault_rank and self.global_step == FAULT_STEP and self.mode != "save":
            if self.mode == "die":
                print_line(f"rank {self.global_rank} kills itself (SIGKILL) at {time.time():.3f}")
                inject_fault("sigkill")
            elif self.mode == "stop":
                with open(os.path.join(self.out, "stopped"), "w") as f:
                    f.write(f"{os.getpid()} {time.time():.3f}")
                print_line(f"rank {self.global_rank} stops itself (SIGSTOP)")
                inject_fault("sigstop")
            else:
                print_line(f"rank {self.global_rank} raises at {time.time():.3f}")
                inject_fault("raise")
        return super().training_step(batch, batch_idx)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mode", required=True, choices=["die", "stop", "raise", "save"])
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--flags", default="{}")
    parser.add_argument("--timeout", type=float, default=8.0)
    parser.add_argument("--out", default=".")
    args = parser.parse_args()
    torch.set_num_threads(1)
    L.seed_everything(0, verbose=False)
    strategy = HierarchicalZeroStrategy(timeout=args.timeout, **json.loads(args.flags))
    trainer = L.Trainer(accelerator="cpu", devices=4, strategy=strategy, callbacks=[ExitReport()], max_steps=50,
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False)
    model = FaultyGPT(args.mode, args.rank, args.out)
    trainer.fit(model, DataLoader(token_dataset(8 * 4 * 50, seq=8, vocab=32), batch_size=8))


if __name__ == "__main__":
    main()
