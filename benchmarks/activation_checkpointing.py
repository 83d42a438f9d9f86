"""Activation checkpointing benchmark: the memory a training step takes for its activations, and its time, with
``activation_checkpointing_policy={Block}`` against without, per layout.

    python benchmarks/activation_checkpointing.py                  # writes benchmarks/results/activation_checkpointing.md
    python benchmarks/activation_checkpointing.py --layouts dp,pp2_tp2 --out /tmp/ac.md

Each (layout, on/off) is one fresh run of 4 CPU ranks under Lightning's launcher (the command line re-executed
per rank), a GPT of ``ddp_plugin.testing.gpt`` (``--d-model``, ``--layers``, ``--seq``; batch ``--batch`` per
data-parallel rank), AdamW, ``--steps`` steps. Per rank:

- *activations*: the bytes autograd saved for the backward during step 2 (an outer ``saved_tensors_hooks``;
  what a checkpointed block saves is dropped by the checkpoint and recomputed, only its inputs are kept);
- *peak above start*: the peak RSS during training (sampled every millisecond) minus the RSS when training
  starts, after ``gc.collect()``: the activations, the step's temporaries, the gradients and the optimizer state
  (allocated at the first step); the parameters are there before;
- *step*: the median wall time of steps 2 to the last.

The table shows the rank with the largest peak. This is a benchmark: it asserts nothing; run it on an idle
machine and say so.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import harness

LAYOUTS: dict[str, dict] = {
    "dp": {},
    "2x2_zero3": {"devices_per_node": 2, "zero_stage": 3, "auto_wrap_policy": ["Block"]},
    "tp2_dp2": {"devices_per_node": 2, "tensor_parallel_size": 2},
    "pp2_tp2": {"pipeline_parallel_size": 2, "tensor_parallel_size": 2},
}


def worker(args: argparse.Namespace) -> None:
    import lightning as L
    import torch
    import torch.distributed as dist
    from torch.utils.data import DataLoader

    from ddp_plugin import HierarchicalZeroStrategy
    from ddp_plugin.testing.gpt import GPTModule, token_dataset
    from ddp_plugin.testing.memory import PeakRSS, SavedTensorBytes, rss_bytes

    torch.set_num_threads(1)

    class Measure(L.Callback):
        def __init__(self) -> None:
            self.saved = SavedTensorBytes()
            self.times: list[float] = []
            self.peak: PeakRSS | None = None
            self.start_rss = 0
            self._t0 = 0.0

        def on_train_start(self, trainer, pl_module) -> None:
            gc.collect()
            self.start_rss = rss_bytes()
            self.peak = PeakRSS()
            self.peak.__enter__()

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
            if batch_idx == 1:
                self.saved.__enter__()
            self._t0 = time.perf_counter()

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            if batch_idx >= 1:
                self.times.append(time.perf_counter() - self._t0)
            self.saved.__exit__()

        def on_train_end(self, trainer, pl_module) -> None:
            peak = self.peak.finish() if self.peak is not None else 0
            mine = {"saved": self.saved.bytes, "peak": peak - self.start_rss, "step": statistics.median(self.times)}
            every = [None] * dist.get_world_size()
            dist.all_gather_object(every, mine)
            if trainer.is_global_zero:
                Path(args.json).write_text(json.dumps(every))

    L.seed_everything(0, verbose=False)
    policy = {"Block"} if args.on else None
    strategy = HierarchicalZeroStrategy(**LAYOUTS[args.layout], activation_checkpointing_policy=policy)
    trainer = L.Trainer(accelerator="cpu", devices=4, strategy=strategy, max_steps=args.steps, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        callbacks=[Measure()])
    with trainer.init_module(empty_init=True):
        model = GPTModule(vocab=256, d_model=args.d_model, heads=4, layers=args.layers, seq=args.seq)
    data = token_dataset(args.batch * 4 * args.steps, seq=args.seq, vocab=256)
    trainer.fit(model, DataLoader(data, batch_size=args.batch))


def driver(args: argparse.Namespace, argv: list[str]) -> None:
    bench = harness.Run(__file__, argv, quiet=args.quiet, ranks=4)
    rows = []
    for layout in args.layouts:
        for on in (False, True):
            with tempfile.TemporaryDirectory() as tmp:
                out = Path(tmp) / "result.json"
                harness.run_local([sys.executable, __file__, "--layout", layout, "--json", str(out),
                                   *harness.forward(args, "steps", "d_model", "layers", "seq", "batch"),
                                   *(["--on"] if on else [])]).check(f"{layout} {'on' if on else 'off'}")
                ranks = json.loads(out.read_text())
            worst = max(ranks, key=lambda r: r["peak"])
            rows.append((layout, on, worst, max(r["saved"] for r in ranks)))
            print(f"{layout:10s} {'on ' if on else 'off'} activations {rows[-1][3] / 1e6:7.1f} MB, peak above start"
                  f" {worst['peak'] / 1e6:7.1f} MB, step {worst['step']:.3f} s", flush=True)
    lines = [
        "# Activation checkpointing: memory and time of a training step, with and without",
        "",
        *bench.header(),
        f"- setup: 4 CPU ranks over gloo, GPT d_model={args.d_model}, {args.layers} blocks, seq {args.seq}, batch"
        f" {args.batch} per data-parallel rank, AdamW, {args.steps} steps, built with `init_module(empty_init=True)`;"
        " `activation_checkpointing_policy={\"Block\"}` against none",
        "- per layout the rank with the largest peak: *activations* = bytes saved for the backward in one step (the"
        " largest rank's); *peak above start* = peak RSS during training minus RSS at its start (gradients and AdamW"
        " state included, the same with and without); *step* = median wall time",
        "",
        *harness.table(["layout", "checkpointing", "activations MB", "peak above start MB", "step s"],
                       ([layout, "on" if on else "off", f"{saved / 1e6:.1f}", f"{worst['peak'] / 1e6:.1f}",
                         f"{worst['step']:.3f}"] for layout, on, worst, saved in rows), "llrrr"),
    ]
    harness.write(args.out, "\n".join(lines) + "\n", show=False)


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = harness.parser(__doc__)
    harness.add_names(p, "--layouts", LAYOUTS, LAYOUTS)
    p.add_argument("--layout", choices=list(LAYOUTS), help=argparse.SUPPRESS)
    p.add_argument("--on", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--json", help=argparse.SUPPRESS)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--batch", type=int, default=8)
    harness.add_common(p, out=harness.RESULTS / "activation_checkpointing.md")
    args = p.parse_args(argv)
    args.layouts = harness.names(p, args.layouts, LAYOUTS, "layout")
    return args


def main(argv: list[str] | None = None) -> int:
    return harness.dispatch(argv, parse_args, worker, driver, is_worker=lambda args: bool(args.layout))


if __name__ == "__main__":
    sys.exit(main())
