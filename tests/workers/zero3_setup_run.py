"""Worker for tests/test_meta_init.py's ZeRO stage 3 setup test: the most heap a rank holds during ``setup`` of a
model built on the meta device at ``zero_stage=3``, against the whole model's size.

    python tests/workers/zero3_setup_run.py --out result.json [--d-model 256 --layers 8] [--flags '{...}']

Started with the heap tracker in ``LD_PRELOAD`` (``ddp_plugin.testing.heap``) on 4 CPU ranks. The GPT is built
under ``trainer.init_module(empty_init=True)``; the tracker's peak is reset just before ``trainer.fit`` and read
at the start of the first batch (setup done: materialized, sharded, optimizer made), then again after two steps.
Rank 0 writes every rank's record: the whole model's bytes, the parameters the rank holds, the setup peak above
the heap at the reset, the units the strategy initialized one by one, and whether every
rank starts finite and its data-parallel replicas equal.
"""

from __future__ import annotations

import argparse
import json

import lightning as L
import torch
from torch.utils.data import DataLoader

from ddp_plugin import HierarchicalZeroStrategy
from ddp_plugin.testing.gpt import GPTModule, token_dataset
from ddp_plugin.testing.heap import Heap
from ddp_plugin.testing.processes import every_rank
from ddp_plugin.testing.ranks import local_parameters, replicas_identical


class SetupPeak(L.Callback):
    def __init__(self, heap: Heap) -> None:
        self.heap = heap
        self.record: dict = {}

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if batch_idx == 0:
            setup_peak = self.heap.peak - self.heap.live_at_reset  # (before the checks below gather anything)
            held = sum(p.numel() * p.element_size() for o in trainer.optimizers for g in o.param_groups
                       for p in g["params"])
            flat = local_parameters(trainer.strategy, pl_module)
            self.record = {
                "setup_peak": setup_peak,
                "held": held,
                "finite": bool(torch.isfinite(flat).all()),
                "replicas_identical": replicas_identical(trainer.strategy, pl_module, flat),
                "units_initialized": getattr(trainer.strategy, "units_initialized", None),
            }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--d-model", type=int, default=256)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--flags", default='{"zero_stage": 3, "auto_wrap_policy": ["Block"]}')
    args = parser.parse_args()
    torch.set_num_threads(1)
    heap = Heap.attach()
    assert heap is not None, "start this worker with the heap tracker in LD_PRELOAD"
    L.seed_everything(1234, verbose=False)
    peak = SetupPeak(heap)
    trainer = L.Trainer(accelerator="cpu", devices=4, strategy=HierarchicalZeroStrategy(**json.loads(args.flags)),
                        max_steps=2, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, callbacks=[peak])
    with trainer.init_module(empty_init=True):
        model = GPTModule(vocab=32, d_model=args.d_model, heads=4, layers=args.layers, seq=8)
    whole = sum(p.numel() * p.element_size() for p in model.parameters())
    heap.reset_peak()
    trainer.fit(model, DataLoader(token_dataset(8 * 4 * 2, seq=8, vocab=32), batch_size=8))
    mine = {**peak.record, "whole": whole, "steps": trainer.global_step}
    every = every_rank(mine)
    if trainer.global_rank == 0:
        with open(args.out, "w") as f:
            json.dump(every, f)


if __name__ == "__main__":
    main()
