"""Checkpoint benchmark: rank 0's extra memory and the time of one save, ours (master mode) against Lightning ``ddp``.

    python benchmarks/checkpoint_memory.py                    # 4 CPU ranks, 11.6M-parameter MLP, AdamW
    python benchmarks/checkpoint_memory.py --contenders ddp,stage3 --out /tmp/ckpt.md

Each contender runs in a fresh process (Lightning's launcher re-executes the command line per rank): 3 training
steps, then ``trainer.save_checkpoint(path)``. While rank 0 saves, a thread samples its resident set size
(``/proc/self/statm``) every millisecond; *extra* is the peak during the save minus the RSS right before it
(after ``gc.collect()``), in MB and in units of S (the fp32 parameter bytes). Rank 0's wall time of the
save includes the final barrier; "file" is the checkpoint's size (all files of a sharded one). This is a benchmark: it asserts nothing.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import tempfile
import time
from pathlib import Path

import harness

CONTENDERS = {
    "ddp": "Lightning `ddp` (TorchCheckpointIO)",
    "stage0": "ours, stage 0",
    "stage2": "ours, ZeRO-2 (global shards)",
    "stage3": "ours, ZeRO-3 (global shards)",
    "stage3_sharded": 'ours, ZeRO-3 (global shards), `checkpoint="sharded"`',
}


def _size(path: str) -> int:
    p = Path(path)
    return sum(f.stat().st_size for f in p.iterdir()) if p.is_dir() else p.stat().st_size


def worker(args: argparse.Namespace) -> None:
    import lightning as L
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    from ddp_plugin import HierarchicalZeroStrategy
    from ddp_plugin.testing.memory import PeakRSS, rss_bytes
    from ddp_plugin.testing.models import TinyModule, mlp

    torch.set_num_threads(1)
    L.seed_everything(0, verbose=False)
    net = mlp(32, args.hidden, 10, layers=args.layers)

    class MeasureSave(L.Callback):
        """After the last step, inside fit (so stage 3 is still sharded): one measured save."""

        def on_train_batch_end(self, trainer, *_) -> None:
            if trainer.global_step != 3:
                return
            gc.collect()
            before = rss_bytes()
            with PeakRSS() as peak:
                start = time.perf_counter()
                trainer.save_checkpoint(args.path)
                seconds = time.perf_counter() - start
            if trainer.is_global_zero:
                s_bytes = sum(p.numel() * 4 for p in net.parameters())
                Path(args.json).write_text(json.dumps({
                    "extra": peak.bytes - before, "before": before, "S": s_bytes, "seconds": seconds,
                    "file": _size(args.path),
                }))

    data = TensorDataset(torch.randn(64, 32), torch.randint(0, 10, (64,)))
    if args.contender == "ddp":
        strategy: object = "ddp"
    else:
        stage, _, mode = args.contender.removeprefix("stage").partition("_")
        strategy = HierarchicalZeroStrategy(zero_stage=int(stage), auto_wrap_policy=["Linear"],
                                            checkpoint=mode or "master")
    trainer = L.Trainer(accelerator="cpu", devices=args.devices, strategy=strategy, max_steps=3, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        callbacks=[MeasureSave()])
    trainer.fit(TinyModule(net, loss="cross_entropy", optimizer="adamw", lr=1e-3), DataLoader(data, batch_size=8))


def driver(args: argparse.Namespace, argv: list[str]) -> None:
    bench = harness.Run(__file__, argv, quiet=args.quiet, ranks=args.devices)
    rows = []
    for name in args.contenders:
        results = []
        for _ in range(args.repeats):
            with tempfile.TemporaryDirectory() as tmp:
                out = Path(tmp) / "result.json"
                harness.run_local([sys.executable, __file__, "--contender", name, "--json", str(out),
                                   "--path", str(Path(tmp) / "model.ckpt"),
                                   *harness.forward(args, "devices", "hidden", "layers")]).check(name)
                results.append(json.loads(out.read_text()))
        extra = sorted(r["extra"] for r in results)[len(results) // 2]
        seconds = sorted(r["seconds"] for r in results)[len(results) // 2]
        r = results[0]
        rows.append((name, extra, seconds, r))
        print(f"{name:8s} extra {extra / 1e6:8.1f} MB = {extra / r['S']:.2f} S, save {seconds:.2f} s, "
              f"file {r['file'] / 1e6:.1f} MB", flush=True)
    s_mb = rows[0][3]["S"] / 1e6
    lines = [
        "# Checkpoint benchmark: rank 0's extra memory during one save",
        "",
        *bench.header(),
        f"- {args.devices} CPU ranks over gloo",
        f"- model: MLP 32 -> {args.layers + 1} x Linear({args.hidden}) -> 10, AdamW, S = {s_mb:.2f} MB of fp32"
        " parameters; a checkpoint holds S of parameters and 2 S of AdamW state",
        "- extra: peak RSS of rank 0 during `trainer.save_checkpoint` (sampled every ms) minus its RSS right before;"
        f" median of {args.repeats} runs; save time on rank 0 includes the final barrier",
        "",
        *harness.table(["contender", "extra MB on rank 0", "x S", "save s", "file MB"],
                       ([CONTENDERS[name], f"{extra / 1e6:.1f}", f"{extra / r['S']:.2f}", f"{seconds:.2f}",
                         f"{r['file'] / 1e6:.1f}"] for name, extra, seconds, r in rows)),
    ]
    harness.write(args.out, "\n".join(lines) + "\n", show=False)


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = harness.parser(__doc__, whole=True)
    harness.add_names(p, "--contenders", CONTENDERS, CONTENDERS)
    p.add_argument("--contender", choices=list(CONTENDERS), help=argparse.SUPPRESS)
    p.add_argument("--json", help=argparse.SUPPRESS)
    p.add_argument("--path", help=argparse.SUPPRESS)
    p.add_argument("--devices", type=int, default=4)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--layers", type=int, default=11)
    harness.add_common(p, out=harness.RESULTS / "checkpoint.md", repeats=3)
    args = p.parse_args(argv)
    args.contenders = harness.names(p, args.contenders, CONTENDERS)
    return args


def main(argv: list[str] | None = None) -> int:
    return harness.dispatch(argv, parse_args, worker, driver, is_worker=lambda args: bool(args.contender))


if __name__ == "__main__":
    sys.exit(main())
