"""Worker for the memory-budget tests (tests/test_memory_budget.py): heap bytes of a training step, per setting.

    python tests/workers/memory_run.py --out FILE.json --runs ddp,hier,hier_int8 [--devices 4 --devices-per-node 2]

Started with the heap tracker in ``LD_PRELOAD`` (``ddp_plugin.testing.heap``); every run trains the same MLP on
the same data with AdamW, one after the other in one launch, after an unmeasured fit of the first (the process's
one-time setup: its process group, lazy imports). Per rank and run, after ``--warmup`` steps:

- ``kept``: heap bytes live at the start of a step (``on_train_batch_start``) above those live before the
  Trainer was made (the model's parameters already counted there), the largest over the timed steps: what the
  strategy and the optimizer keep between steps;
- ``step``: the most the heap held during a step (start of ``on_train_batch_start`` to the end of
  ``on_train_batch_end``: forward, backward, every reduction, the optimizer step) above what was live at its
  start, the largest over the timed steps;
- ``peak``: the most the heap held during a step above what was live before the Trainer was made, the
  largest over the timed steps: what the budget holds;
- ``params``, ``grads``, ``optimizer_state`` bytes (``S``: the gradient bytes), the largest bucket's,
  parameter's and (stage 3) unit's bytes, the most stage 3 held gathered at once (``gathered_peak``), and a digest
  of the trained parameters.
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import json

import lightning as L
import torch
import torch.distributed as dist
from lightning.pytorch.strategies import DDPStrategy
from torch.utils.data import DataLoader, TensorDataset

from ddp_plugin import HierarchicalZeroStrategy
from ddp_plugin.testing.heap import Heap
from ddp_plugin.testing.models import TinyModule, mlp

SETTINGS: dict[str, dict] = {
    # name -> HierarchicalZeroStrategy flags ("ddp": Lightning's own DDPStrategy)
    "ddp": {},
    "flat": dict(hierarchical=False),
    "hier": dict(hierarchical=True),
    "hier_fp16": dict(hierarchical=True, compression="fp16"),
    "hier_int8": dict(hierarchical=True, compression="int8"),
    "hier_powersgd": dict(hierarchical=True, compression="powersgd",
                          compression_options={"rank": 4, "start_iter": 2}),
    "flat_int8": dict(hierarchical=False, compression="int8"),
    "diloco": dict(hierarchical=True, sync_every=4),
    "streaming": dict(hierarchical=True, sync_every=4, sync_fragments=4, max_staleness=1),
    "streaming_int8": dict(hierarchical=True, sync_every=4, sync_fragments=4, max_staleness=1, compression="int8"),
    "zero1": dict(hierarchical=True, zero_stage=1),
    "zero2": dict(hierarchical=True, zero_stage=2),
    "zero3": dict(hierarchical=True, zero_stage=3, auto_wrap_policy=[torch.nn.Linear]),
    "zero3_prefetch1": dict(hierarchical=True, zero_stage=3, auto_wrap_policy=[torch.nn.Linear], prefetch_units=1),
    "zero3_in_backward": dict(hierarchical=True, zero_stage=3, auto_wrap_policy=[torch.nn.Linear],
                              optimizer_in_backward=True),
}


class HeapPerStep(L.Callback):
    def __init__(self, heap: Heap, base: int, warmup: int) -> None:
        self.heap, self.base, self.warmup = heap, base, warmup
        self.kept = self.step = self.peak = self.bucket = self.unit = 0
        self.sharder = None
        self.gathered = 0

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if batch_idx == 0:
            engine = getattr(trainer.strategy, "engine", None)
            if engine is not None:
                self.bucket = max(b.buffer.numel() * b.buffer.element_size() for b in engine.buckets)
                sharder = trainer.strategy.plugin_manager.get_plugin("zero_sharder")
                self.unit = sharder.largest_unit_bytes if sharder is not None else 0
                self.sharder = sharder
        self.heap.reset_peak()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if self.sharder is not None:  # (the sharder gathers every unit at teardown: read it while training)
            self.gathered = self.sharder.fit_peak_gathered_bytes
        if batch_idx >= self.warmup:
            self.kept = max(self.kept, self.heap.live_at_reset - self.base)
            self.step = max(self.step, self.heap.peak - self.heap.live_at_reset)
            self.peak = max(self.peak, self.heap.peak - self.base)


def fit(name: str, args: argparse.Namespace, heap: Heap) -> dict:
    L.seed_everything(0, verbose=False)
    model = TinyModule(mlp(args.width, args.width, args.width, layers=args.layers), loss="mean_square",
                       optimizer="adamw", lr=1e-3)
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    data = TensorDataset(torch.randn(args.batch * (args.warmup + args.steps) * args.devices, args.width))
    if name == "ddp":
        strategy = DDPStrategy(bucket_cap_mb=args.bucket_mb)
    else:
        strategy = HierarchicalZeroStrategy(devices_per_node=args.devices_per_node, bucket_size_mb=args.bucket_mb,
                                            **SETTINGS[name])
    gc.collect()
    heap.reset_peak()
    probe = HeapPerStep(heap, heap.live, args.warmup)
    trainer = L.Trainer(accelerator="cpu", devices=args.devices, strategy=strategy, callbacks=[probe],
                        max_steps=args.warmup + args.steps, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(model, DataLoader(data, batch_size=args.batch))
    state = sum(t.numel() * t.element_size() for s in trainer.optimizers[0].state.values()
                for t in s.values() if isinstance(t, torch.Tensor) and t.dim() > 0)
    return {"kept": probe.kept, "step": probe.step, "peak": probe.peak,
            "params": params, "grads": params, "optimizer_state": state, "largest_bucket": probe.bucket,
            "largest_unit": probe.unit,
            "gathered_peak": probe.gathered,
            "digest": hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in model.parameters())).hexdigest(),
            "largest_param": max(p.numel() * p.element_size() for p in model.parameters())}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--runs", required=True)
    p.add_argument("--devices", type=int, default=4)
    p.add_argument("--devices-per-node", type=int, default=2)
    p.add_argument("--width", type=int, default=512)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--bucket-mb", type=float, default=2.0)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=4)
    args = p.parse_args()
    heap = Heap.attach()
    if heap is None:
        raise SystemExit("start this worker with the heap tracker in LD_PRELOAD (ddp_plugin.testing.heap)")
    # One fit first, not measured: the first fit of a process also creates the process group and gloo's
    # buffers and imports what Lightning and torch import lazily, which it keeps. Counted in the first measured
    # run, they made Lightning ddp's kept bytes 4.34 S instead of its 4.01 S (a fresh environment on 2026-11-29).
    fit(args.runs.split(",")[0], args, heap)
    dist.barrier()
    results = {}
    for name in args.runs.split(","):
        mine = fit(name, args, heap)
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, mine)
        results[name] = everyone
        dist.barrier()
    if dist.get_rank() == 0:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
