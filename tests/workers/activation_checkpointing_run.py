"""Worker for tests/test_activation_checkpointing.py: the tiny tied GPT trained twice per layout, without and with
``activation_checkpointing_policy={Block}``, one fit after the other in the same 4 processes.

    python tests/workers/activation_checkpointing_run.py --out result.jsonl [--cases dp,pp2_tp2] [--steps 3]

Each rank records, per fit: the bytes autograd saved for the backward during the first training step, as an
outer ``saved_tensors_hooks`` sees them (what a checkpointed block saves is packed by the checkpoint's own hooks
and dropped: the outer hooks see the block's inputs only), which modules were checkpointed, and its parameters
after the last step. Rank 0 gathers every rank's record and appends one JSON line per case to ``--out``.
"""

from __future__ import annotations

import argparse

import lightning as L
import torch
from torch.utils.data import DataLoader

from ddp_plugin import HierarchicalZeroStrategy
from ddp_plugin.parallel.activation_checkpointing import is_checkpointed
from ddp_plugin.testing.gpt import Block, GPTModule, token_dataset
from ddp_plugin.testing.memory import SavedTensorBytes
from ddp_plugin.testing.processes import every_rank, run_cases
from ddp_plugin.testing.ranks import local_parameters

LAYOUTS: dict[str, dict] = {
    "dp": {},
    "2x2_zero3": {"devices_per_node": 2, "zero_stage": 3, "auto_wrap_policy": [Block]},
    "tp2_dp2": {"devices_per_node": 2, "tensor_parallel_size": 2},
    "pp2_dp2": {"devices_per_node": 2, "pipeline_parallel_size": 2},
    "pp2_dp2_zero3": {"devices_per_node": 2, "pipeline_parallel_size": 2, "zero_stage": 3},
    "pp2_tp2": {"pipeline_parallel_size": 2, "tensor_parallel_size": 2},
}


class SavedBytes(L.Callback):
    """The bytes autograd saves for the backward during the first training step (forward and backward)."""

    def __init__(self) -> None:
        self.saved = SavedTensorBytes()

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if batch_idx == 0:
            self.saved.__enter__()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.saved.__exit__()


def fit(layout: str, steps: int, policy: set | None, meta: bool) -> dict:
    L.seed_everything(1234, verbose=False)
    strategy = HierarchicalZeroStrategy(**LAYOUTS[layout], activation_checkpointing_policy=policy)
    saved = SavedBytes()
    trainer = L.Trainer(accelerator="cpu", devices=4, strategy=strategy, max_steps=steps, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        callbacks=[saved])
    with trainer.init_module(empty_init=meta):
        model = GPTModule(vocab=32, d_model=32, heads=2, layers=4, seq=16, lr=3e-3)
    trainer.fit(model, DataLoader(token_dataset(8 * 4 * steps, seq=16, vocab=32), batch_size=8))
    blocks = [m for m in model.model.modules() if isinstance(m, Block)]
    return {"saved_bytes": saved.saved.bytes, "blocks": len(blocks), "checkpointed": sum(map(is_checkpointed, blocks)),
            "params": local_parameters(strategy, model).tolist(), "steps": trainer.global_step}


def run(case: str, steps: int) -> dict:
    layout, _, meta = case.partition(":")
    plain = fit(layout, steps, None, meta == "meta")
    checkpointed = fit(layout, steps, {Block}, meta == "meta")
    mine = {"plain": plain, "checkpointed": checkpointed}
    every = every_rank(mine)
    return {"case": case, "ranks": every}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--cases", default=",".join(LAYOUTS))
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    run_cases(args.cases.split(","), lambda case: run(case, args.steps), args.out)


if __name__ == "__main__":
    main()
