"""Step-time benchmark: ``hierarchical_zero`` (stage 0) against Lightning's ``ddp`` on the same model.

    python benchmarks/step_time.py                      # defaults: 4 CPU ranks, gloo over loopback
    python benchmarks/step_time.py --steps 60 --repeats 3 --hidden 1024 --layers 11

The top-level invocation is the *driver*: it runs each contender in a fresh subprocess
(``python benchmarks/step_time.py --contender NAME --json FILE ...``), alternating the order
(ddp, ours, ddp, ours, ...), and aggregates the results into a markdown table. A fresh process per run is
needed because Lightning's default launcher re-executes the command line once per rank, and it keeps the two
contenders from sharing any process state.

Inside a contender run, rank 0 times every training step with a Callback (wall time between consecutive
``on_train_batch_end`` calls, i.e. the whole iteration: data, forward, backward + gradient sync, optimizer
step; the ``on_train_batch_start`` -> ``on_train_batch_end`` span is recorded as well). Warmup steps are
discarded. The headline number is ``ours / ddp`` median step time (target <= 1.10).

This is a benchmark, not a test: it asserts nothing, and its numbers depend on the machine.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import harness

CONTENDERS = ("ddp", "hierarchical_zero")
DEFAULT_OUT = harness.RESULTS / "step_time.md"


# ---------------------------------------------------------------------------------------------- arguments


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = harness.parser(__doc__)
    p.add_argument("--devices", type=int, default=4, help="CPU ranks (gloo over loopback)")
    p.add_argument("--steps", type=int, default=30, help="timed steps per run (after warmup)")
    p.add_argument("--warmup", type=int, default=5, help="steps discarded at the start of each run")
    harness.add_common(p, out=DEFAULT_OUT, out_help="markdown file for the results table", repeats=3,
                       repeats_help="runs per contender; order alternates ddp/ours")
    p.add_argument("--hidden", type=int, default=1024, help="MLP hidden width")
    p.add_argument("--layers", type=int, default=11, help="number of hidden (hidden x hidden) Linear layers")
    p.add_argument("--features", type=int, default=32, help="input features (kept tiny: communication-bound)")
    p.add_argument("--classes", type=int, default=10)
    p.add_argument("--batch-size", type=int, default=8, help="per rank")
    p.add_argument("--bucket-size-mb", type=float, default=25.0, help="bucket cap for both contenders")
    p.add_argument("--seed", type=int, default=0)
    # internal: run one contender (the driver passes these to its subprocesses)
    p.add_argument("--contender", choices=CONTENDERS, default=None, help=argparse.SUPPRESS)
    p.add_argument("--json", type=Path, default=None, help=argparse.SUPPRESS)
    return p.parse_args(argv)


# ---------------------------------------------------------------------------------------------- one run


def run_contender(args: argparse.Namespace) -> None:
    """Runs in every rank (Lightning re-executes this command line per rank); rank 0 writes ``--json``."""
    import lightning as L
    import torch
    from lightning.pytorch.strategies import DDPStrategy
    from torch.utils.data import DataLoader, TensorDataset

    import ddp_plugin  # noqa: F401  (registers strategy="hierarchical_zero")
    from ddp_plugin import HierarchicalZeroStrategy
    from ddp_plugin.testing.models import TinyModule, mlp

    torch.set_num_threads(1)

    class StepTimer(L.Callback):
        def __init__(self) -> None:
            self.iter_s: list[float] = []  # consecutive on_train_batch_end intervals
            self.span_s: list[float] = []  # on_train_batch_start -> on_train_batch_end
            self.losses: list[float] = []
            self._start = self._last_end = None

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            self._start = time.perf_counter()

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            now = time.perf_counter()
            self.span_s.append(now - self._start)
            if self._last_end is not None:
                self.iter_s.append(now - self._last_end)
            self._last_end = now
            self.losses.append(float(outputs["loss"]))

    total_steps = args.warmup + args.steps
    n = total_steps * args.batch_size * args.devices
    g = torch.Generator().manual_seed(args.seed)
    x = torch.randn(n, args.features, generator=g)
    y = torch.randint(0, args.classes, (n,), generator=g)
    loader = DataLoader(TensorDataset(x, y), batch_size=args.batch_size, shuffle=True)

    L.seed_everything(args.seed, verbose=False)
    model = TinyModule(mlp(args.features, args.hidden, args.classes, layers=args.layers), loss="cross_entropy",
                       optimizer="sgd", lr=1e-2, momentum=0.9)
    if args.contender == "ddp":
        strategy = DDPStrategy(bucket_cap_mb=args.bucket_size_mb)  # == strategy="ddp" with the bucket cap spelled out
    else:
        strategy = HierarchicalZeroStrategy(bucket_size_mb=args.bucket_size_mb)
    timer = StepTimer()
    trainer = L.Trainer(
        accelerator="cpu",
        devices=args.devices,
        strategy=strategy,
        max_steps=total_steps,
        max_epochs=-1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        callbacks=[timer],
    )
    trainer.fit(model, loader)

    if trainer.global_rank == 0 and args.json is not None:
        # iter_s[k] is the interval ending at step k+1; drop intervals that end inside warmup.
        iters = timer.iter_s[max(args.warmup - 1, 0) :]
        spans = timer.span_s[args.warmup :]
        params = sum(p.numel() for p in model.parameters())
        grad_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        args.json.write_text(
            json.dumps(
                {
                    "contender": args.contender,
                    "steps": trainer.global_step,
                    "iter_s": iters,
                    "span_s": spans,
                    "final_loss": timer.losses[-1],
                    "params": params,
                    "grad_bytes": grad_bytes,
                    "world_size": trainer.world_size,
                    "backend": getattr(trainer.strategy, "process_group_backend", None) or "gloo",
                }
            )
        )


# ---------------------------------------------------------------------------------------------- driver


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    k = (len(xs) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


CHILD_OPTIONS = ("devices", "steps", "warmup", "hidden", "layers", "features", "classes", "batch_size", "bucket_size_mb",
                 "seed")


def drive(args: argparse.Namespace, argv: list[str]) -> None:
    bench = harness.Run(__file__, argv, quiet=args.quiet, ranks=args.devices)
    order = harness.interleaved(CONTENDERS, args.repeats)
    runs: dict[str, list[dict]] = {c: [] for c in CONTENDERS}
    with tempfile.TemporaryDirectory(prefix="step_time_") as tmp:
        for i, contender in enumerate(order):
            json_path = Path(tmp) / f"run{i}_{contender}.json"
            t0 = time.perf_counter()
            launch = harness.run_local([sys.executable, str(Path(__file__).resolve()), "--contender", contender, "--json",
                                        str(json_path), *harness.forward(args, *CHILD_OPTIONS)], env=harness.RANK_ENV)
            launch.check(f"run {i} ({contender})")
            res = json.loads(json_path.read_text())
            runs[contender].append(res)
            print(
                f"[{i + 1}/{len(order)}] {contender:<18} median {statistics.median(res['iter_s']) * 1e3:8.1f} ms/step"
                f"  ({time.perf_counter() - t0:.0f} s wall)",
                flush=True,
            )

    ref = runs[CONTENDERS[0]][0]
    rows = []
    medians: dict[str, float] = {}
    for c in CONTENDERS:
        per_run_med = [statistics.median(r["iter_s"]) for r in runs[c]]
        per_run_p90 = [_pct(r["iter_s"], 0.9) for r in runs[c]]
        per_run_span = [statistics.median(r["span_s"]) for r in runs[c]]
        medians[c] = statistics.median(per_run_med)
        rows.append(
            dict(
                name=c,
                med=medians[c] * 1e3,
                p90=statistics.median(per_run_p90) * 1e3,
                span=statistics.median(per_run_span) * 1e3,
                pooled=statistics.median([t for r in runs[c] for t in r["iter_s"]]) * 1e3,
                runs=", ".join(f"{m * 1e3:.1f}" for m in per_run_med),
                loss=runs[c][-1]["final_loss"],
            )
        )
    ratio = medians["hierarchical_zero"] / medians["ddp"]

    mb = ref["grad_bytes"] / 2**20
    lines = [
        "# Step time: hierarchical_zero (stage 0) vs Lightning ddp",
        "",
        *bench.header(),
        f"- world size {ref['world_size']} CPU ranks, backend {ref['backend']} over loopback, 1 intra-op thread per rank",
        f"- model: MLP {args.features} -> {args.layers + 1} x Linear({args.hidden}) -> {args.classes},"
        f" {ref['params']:,} parameters, {mb:.1f} MiB of fp32 gradients"
        f" (bucket cap {args.bucket_size_mb:g} MiB -> ~{-(-ref['grad_bytes'] // int(args.bucket_size_mb * 2**20))} buckets)",
        f"- batch {args.batch_size} per rank, SGD(momentum); {args.warmup} warmup + {args.steps} timed steps per run,"
        f" {args.repeats} run(s) per contender, order {' / '.join('ours' if c != 'ddp' else c for c in order)}",
        "- step = wall time between consecutive `on_train_batch_end` on rank 0 (whole iteration); median/p90 over"
        " the timed steps of a run, then the median over runs; `fwd+bwd+opt` = median"
        " `on_train_batch_start`->`on_train_batch_end` span; `pooled` = median over the timed steps of all runs",
        "- 4 ranks share 2 cores here, and step times switch between a fast and a slow regime from run to run"
        " (and within a run) for both contenders; compare the per-run medians before trusting a small difference",
        "",
        *harness.table(["contender", "median step (ms)", "p90 step (ms)", "fwd+bwd+opt (ms)", "pooled median (ms)",
                        "per-run medians (ms)", "final loss (rank 0)", "ratio vs ddp"],
                       ([r["name"], f"{r['med']:.1f}", f"{r['p90']:.1f}", f"{r['span']:.1f}", f"{r['pooled']:.1f}",
                         r["runs"], f"{r['loss']:.4f}", f"{r['med'] / rows[0]['med']:.3f}"] for r in rows), "lrrrrlrr"),
        "",
        f"**Headline: hierarchical_zero / ddp median step time = {ratio:.3f}** "
        f"({'meets' if ratio <= 1.10 else 'MISSES'} the <= 1.10 target).",
        "",
    ]
    harness.write(args.out, "\n".join(lines))


def main(argv: list[str] | None = None) -> int:
    return harness.dispatch(argv, parse_args, run_contender, drive, is_worker=lambda args: args.contender is not None)


if __name__ == "__main__":
    sys.exit(main())
