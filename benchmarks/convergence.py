"""Convergence benchmark: the sync modes (DiLoCo, streaming) against synchronous hierarchical training, on real
text, to the end of training.

    python benchmarks/convergence.py                                  # every run, ~15-20 minutes on 2 cores
    python benchmarks/convergence.py --runs sync,diloco_h16 --steps 512 --out /tmp/convergence.md
    python benchmarks/convergence.py --runs sync,diloco_h16,diloco_h64,diloco_h16_int8,streaming_h16,localsgd_h16,\
diloco_h16_m05 --lr 1e-3,2e-3,3e-3                                    # each run tuned on an lr grid, ~40 minutes
    python benchmarks/convergence.py --runs sync@3e-3,diloco_h16@1e-3 --steps 8192 --eval-every 128  # each at its own lr
    python benchmarks/convergence.py --corpus argparse --schedule constant \
        --out benchmarks/results/convergence_argparse_constant_lr.md  # the first setup (tiny corpus, constant lr)
    python benchmarks/convergence.py --nodes 8 --per-node 1 --reference diloco_h16 --steps 512 \
        --runs diloco_h16,sparseloco_h16_w2,sparseloco_h16_w2_rs --lr 1e-3,3e-3  # 8 nodes of one rank (issue 88)

4 CPU ranks as 2 simulated nodes x 2 (``HierarchicalZeroStrategy(devices_per_node=2, bucket_size_mb=0.1)``; other
layouts with ``--nodes`` and ``--per-node``: 8 nodes of one rank are 8 ranks, ``devices_per_node=1``, the global batch
split 8 ways), the character-level model of :mod:`ddp_plugin.testing.text`. Every run starts from the same initial parameters,
sees the same batches in the same order, follows the same inner learning-rate schedule and takes the same number
of optimizer steps; the runs differ only in the strategy's sync-mode flags (:data:`RUNS`).

The default setup is closer to how DiLoCo is used (Douillard et al. 2023): the inner AdamW's learning rate warms
up linearly over the first 5% of the steps, then decays along a cosine to 10% of its peak (``--schedule cosine``),
and training sees less than one pass over its text: ``--corpus stdlib`` is the concatenated source of 23 large
pure-Python standard-library modules (:data:`~ddp_plugin.testing.text.STDLIB_MODULES`, ~1.9M characters, no
download), and the training windows start at distinct positions drawn without replacement (4096 steps x 64 =
262k of ~1.7M), so no window is trained on twice. ``--corpus argparse --schedule constant`` is the first setup,
unchanged: the source of ``argparse`` alone (~100k characters, so ~2.9 passes at 4096 steps, windows at random
starts with replacement) at a constant learning rate, a regime where the final held-out loss mostly measures
overfitting. Runs:

- ``sync``: synchronous (every step's gradients averaged over all ranks);
- ``diloco_h16``, ``diloco_h64``: nodes train alone and synchronize every 16 / 64 steps, DiLoCo's Nesterov outer
  optimizer on the averaged pseudo-gradient; ``diloco_h16_int8``: the pseudo-gradients cross nodes int8-compressed;
- ``localsgd_h16``: every 16 steps the replicas are simply averaged (``outer_optimizer="average"``): DiLoCo H=16
  without its outer optimizer, which tells the sync period's effect from the outer optimizer's;
- ``streaming_h16``: the same in 4 staggered fragments, each applied one step after it was sent, int8;
- ``diloco_h16_m05``, ``diloco_h64_m05``: DiLoCo with the outer momentum 0.5 instead of the paper's 0.9
  (:func:`nesterov_momentum_05`, passed as a callable ``outer_optimizer``);
- ``diloco_h16_warmup``: DiLoCo H=16 with the paper's outer optimizer, the first 1024 steps (25%)
  synchronous (``sync_warmup_steps=1024``), as the paper starts from a synchronously trained model.
- ``diloco_h16_sparse3``, ``diloco_h16_sparse15``, ``diloco_h64_sparse15``, ``streaming_h16_sparse15``: DiLoCo (and
  streaming) with ``compression="sparse"`` on the pseudo-gradients, 3 % / 1.5 % of each chunk in 2 bits; with
  ``diloco_h64_int8`` for comparison;
- ``sparseloco_h16``, ``sparseloco_h16_d3``, ``sparseloco_h64``, ``streaming_sparseloco_h16``: SparseLoCo's recipe,
  the codec's error-feedback accumulator decayed by 0.95 standing in for the outer momentum, the outer step plain
  descent on the averaged sparse updates (``outer_optimizer="average"``); ``sparseloco_h16_w2`` the recipe docs/sync.md
  recommends (``warmup_syncs=2``: the first two syncs dense in int8), ``sparseloco_h16_w2_rs`` the same with the
  sparse payloads summed by the owner of each range of chunks (``aggregation="reduce_scatter"``), whose bytes a node
  do not grow with the number of nodes (docs/compression.md); ``sparseloco_h16_w2_rs_d3`` the reduce-scatter at 3 %
  density (twice the bytes: the owner's coding of the mean keeps twice the entries).

Like ``tests/workers/compression_run.py``, the script is launched once and Lightning's default launcher
re-executes it once per rank, so every run happens one after another inside the same 4 processes. Per run it
records every step's training loss (the mean of the 4 ranks' batch losses), the held-out loss of the replica
rank 0 holds every ``--eval-every`` steps and after training, the cross-node traffic per step from the strategy's
own accounting, the outer syncs and the wall time. Rank 0 writes

- a markdown table (``--out``, default ``benchmarks/results/convergence.md``): final held-out loss, its ratio to
  ``sync``'s (or ``--reference``'s), cross-node MB per step, outer syncs, wall seconds; and the acceptance check for
  each DiLoCo H=16 run: it ends within 3% of synchronous training's held-out loss; for each run of the sparse recipe
  with ``warmup_syncs=2``, whether it ends within 1% of ``diloco_h16``'s (issue 88);
- a PNG plot next to it (same name, ``.png``; needs ``pip install matplotlib``): held-out and smoothed training
  loss against the step, for every run;
- with ``--json FILE``, every number behind them (the loss curves included).

``--lr`` takes one inner learning rate or a grid of them. With a grid every run is trained once at every value, and
the acceptance compares each run at its best value against synchronous training at its own best, each tuned on
the same grid. DiLoCo's outer step extrapolates the averaged pseudo-gradient (with the paper's Nesterov lr 0.7 and
momentum 0.9, a steady pseudo-gradient moves the parameters 0.7 x (1 + 0.9 / (1 - 0.9)) = 7 times its size a
sync), so its best inner learning rate need not be synchronous training's.

A run that raises gets a "failed" row and the next run starts. This is a benchmark, not a test: it asserts
nothing, and its wall times depend on the machine.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import lightning as L
import torch

import harness
from ddp_plugin import HierarchicalZeroStrategy
from ddp_plugin.testing.ranks import identical_on_all_ranks
from ddp_plugin.testing.text import (
    CONTEXT,
    GLOBAL_BATCH,
    HELD_OUT,
    STDLIB_MODULES,
    CharModel,
    WarmupCosine,
    corpus,
    stdlib_corpus,
    stdlib_sources,
    text_data,
    train_positions,
)
from harness import cell, fmt

DEFAULT_OUT = harness.RESULTS / "convergence.md"
NODES, PER_NODE = 2, 2
WORLD = NODES * PER_NODE  # (set from --nodes and --per-node in main, in every rank: they all parse the same argv)
BUCKET_MB = 0.1
SEED = 1234
LR = 3e-3
WEIGHT_DECAY = 0.01
WARMUP_FRACTION = 0.05  # --schedule cosine: linear warmup over this fraction of the steps,
FINAL_LR_RATIO = 0.1  # then cosine decay to this fraction of the peak lr
CORPORA = ("stdlib", "argparse")
SCHEDULES = ("cosine", "constant")

def nesterov_momentum_05(params) -> torch.optim.Optimizer:
    """DiLoCo's outer optimizer with momentum 0.5 instead of the paper's 0.9 (lr 0.7, Nesterov)."""
    return torch.optim.SGD(params, lr=0.7, momentum=0.5, nesterov=True)


RUNS: dict[str, dict[str, Any]] = {
    "sync": {},
    "diloco_h16": {"sync_every": 16, "outer_optimizer": "nesterov"},
    "diloco_h64": {"sync_every": 64, "outer_optimizer": "nesterov"},
    "localsgd_h16": {"sync_every": 16, "outer_optimizer": "average"},
    "diloco_h16_int8": {"sync_every": 16, "outer_optimizer": "nesterov", "compression": "int8"},
    "streaming_h16": {"sync_every": 16, "outer_optimizer": "nesterov", "sync_fragments": 4, "max_staleness": 1,
                      "compression": "int8"},
    "diloco_h16_m05": {"sync_every": 16, "outer_optimizer": nesterov_momentum_05},
    "diloco_h64_m05": {"sync_every": 64, "outer_optimizer": nesterov_momentum_05},
    "diloco_h16_warmup": {"sync_every": 16, "outer_optimizer": "nesterov", "sync_warmup_steps": 1024},
    # compression="sparse" (top-k of each chunk of 4096, 2-bit values; docs/compression.md) on the pseudo-gradients
    "diloco_h16_sparse3": {"sync_every": 16, "outer_optimizer": "nesterov", "compression": "sparse",
                           "compression_options": {"density": 0.03}},
    "diloco_h16_sparse15": {"sync_every": 16, "outer_optimizer": "nesterov", "compression": "sparse"},
    "diloco_h64_int8": {"sync_every": 64, "outer_optimizer": "nesterov", "compression": "int8"},
    "diloco_h64_sparse15": {"sync_every": 64, "outer_optimizer": "nesterov", "compression": "sparse"},
    "streaming_h16_sparse15": {"sync_every": 16, "outer_optimizer": "nesterov", "sync_fragments": 4,
                               "max_staleness": 1, "compression": "sparse"},
    # SparseLoCo's outer step: the decayed error-feedback accumulator in place of the outer momentum, plain descent
    "sparseloco_h16": {"sync_every": 16, "outer_optimizer": "average", "compression": "sparse",
                       "compression_options": {"decay": 0.95}},
    "sparseloco_h16_d3": {"sync_every": 16, "outer_optimizer": "average", "compression": "sparse",
                          "compression_options": {"decay": 0.95, "density": 0.03}},
    "sparseloco_h64": {"sync_every": 64, "outer_optimizer": "average", "compression": "sparse",
                       "compression_options": {"decay": 0.95}},
    "streaming_sparseloco_h16": {"sync_every": 16, "outer_optimizer": "average", "sync_fragments": 4,
                                 "max_staleness": 1, "compression": "sparse", "compression_options": {"decay": 0.95}},
    # the recipe docs/sync.md recommends, with either aggregation of the sparse payloads (issue 88)
    "sparseloco_h16_w2": {"sync_every": 16, "outer_optimizer": "average", "compression": "sparse",
                          "compression_options": {"decay": 0.95, "warmup_syncs": 2}},
    "sparseloco_h16_w2_rs": {"sync_every": 16, "outer_optimizer": "average", "compression": "sparse",
                             "compression_options": {"decay": 0.95, "warmup_syncs": 2, "aggregation": "reduce_scatter"}},
    "sparseloco_h16_w2_rs_d3": {"sync_every": 16, "outer_optimizer": "average", "compression": "sparse",
                                "compression_options": {"decay": 0.95, "warmup_syncs": 2, "density": 0.03,
                                                        "aggregation": "reduce_scatter"}},
}
ACCEPTANCE = (("diloco_h16", "diloco_h16_m05", "diloco_h16_warmup"), 0.03)  # held-out loss <= 3% above sync's
SPARSE_ACCEPTANCE = (("sparseloco_h16_w2", "sparseloco_h16_w2_rs", "sparseloco_h16_w2_rs_d3"), "diloco_h16", 0.01)
"""Issue 88: the sparse recipe, with either aggregation, ends within 1% of DiLoCo fp32's held-out loss (or below)."""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = harness.parser(__doc__)
    p.add_argument("--runs", default=",".join(RUNS), help=f"comma-separated subset of: {', '.join(RUNS)} (default: all,"
                                                          " in this order); name@lr trains that run at its own inner"
                                                          " lr only, instead of every --lr")
    p.add_argument("--steps", type=int, default=4096,
                   help="optimizer steps per run (default 4096, a multiple of every run's sync period)")
    p.add_argument("--eval-every", type=int, default=64, help="held-out evaluation period in steps (default 64)")
    p.add_argument("--corpus", choices=CORPORA, default="stdlib",
                   help="stdlib (default): the source of 23 large stdlib modules, ~1.9M characters, training windows"
                        " at distinct starts (no window twice; --steps at most ~26k); argparse: the source of argparse"
                        " alone, ~100k characters, windows at random starts with replacement (the first setup)")
    p.add_argument("--schedule", choices=SCHEDULES, default="cosine",
                   help=f"inner learning rate: cosine (default): linear warmup over {WARMUP_FRACTION * 100:g}%% of the steps,"
                        f" then cosine decay to {FINAL_LR_RATIO:g} x the peak --lr; constant: --lr throughout")
    p.add_argument("--lr", type=_lr_grid, default=[LR],
                   help=f"the inner AdamW (peak) learning rate of every run (default {LR:g}), or a comma-separated"
                        " grid (--lr 1e-3,2e-3,3e-3): every run is trained at every value, and the acceptance"
                        " compares each run at its best one (each tuned on the same grid)")
    p.add_argument("--nodes", type=int, default=NODES, help=f"simulated nodes (default {NODES})")
    p.add_argument("--per-node", type=int, default=PER_NODE, help=f"ranks a node (default {PER_NODE})")
    p.add_argument("--reference", default="sync",
                   help="the run the table's ratios divide by (default sync; with a grid, each at its best lr)")
    p.add_argument("--smooth", type=int, default=50, help="training loss moving-average window in the plot (steps)")
    harness.add_common(p, out=DEFAULT_OUT, out_help="markdown file; the plot goes next to it as .png")
    p.add_argument("--json", type=Path, default=None, help="also write every number (loss curves included) here")
    args = p.parse_args(argv)
    own: dict[str, float] = {}  # run -> its own inner lr (``--runs name@lr``), instead of the --lr grid
    names = []
    for item in (r.strip() for r in args.runs.split(",")):
        name, _, lr = item.partition("@")
        if lr:
            try:
                own[name] = _lr_grid(lr)[0]
            except argparse.ArgumentTypeError:
                p.error(f"--runs: {item!r}: the inner lr after @ must be a positive number")
        if name:
            names.append(name)
    args.runs = harness.names(p, ",".join(names), RUNS, "run")
    harness.names(p, args.reference, RUNS, "reference run")
    if args.nodes < 2 or args.per_node < 1 or GLOBAL_BATCH % (args.nodes * args.per_node):
        p.error(f"--nodes {args.nodes} --per-node {args.per_node}: at least 2 nodes, and {GLOBAL_BATCH} windows a step"
                " must split evenly over the ranks")
    # a grid: every run at the first lr, then every run at the next; a run with its own lr once, in the first pass
    args.trainings = [(n, own[n]) if n in own else (n, lr)
                      for i, lr in enumerate(args.lr) for n in names if n not in own or i == 0]
    args.lrs = sorted({lr for _, lr in args.trainings})
    args.grid = len(args.lrs) > 1  # runs trained at different lrs: each is compared at its best
    args.argv = list(sys.argv[1:] if argv is None else argv)
    return args


def _lr_grid(text: str) -> list[float]:
    try:
        values = [float(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--lr takes positive numbers separated by commas, got {text!r}") from None
    if not values or any(not v > 0 for v in values) or len(set(values)) != len(values):
        raise argparse.ArgumentTypeError(f"--lr takes distinct positive numbers separated by commas, got {text!r}")
    return values


def load_data(args: argparse.Namespace) -> tuple[tuple, int, int, dict[str, Any]]:
    """``(train, held_x, held_y)``, the vocabulary size, the number of characters, and what the markdown says of
    the data, for ``--corpus``."""
    if args.corpus == "argparse":
        ids, vocab = corpus()
        data = text_data(ids, args.steps)  # random starts, with replacement: the first setup, unchanged
        info = {"distinct": False, "held_out_from": "argparse"}
    else:
        sources = stdlib_sources(STDLIB_MODULES)
        ids, vocab = stdlib_corpus(STDLIB_MODULES)
        if args.steps * GLOBAL_BATCH > train_positions(ids):
            raise SystemExit(f"--corpus stdlib: {args.steps} steps x {GLOBAL_BATCH} windows is more than the"
                             f" {train_positions(ids):,} distinct training windows; use fewer --steps")
        data = text_data(ids, args.steps, distinct=True)  # distinct starts: no window twice
        split, at, held_from = int(len(ids) * 0.9), 0, []
        for name, text in sources:
            if at + len(text) > split:  # the held-out part holds the end of this module
                part = min(1.0, (at + len(text) - split) / len(text))
                held_from.append(f"`{name}`" if part == 1.0 else f"the last {part:.0%} of `{name}`")
            at += len(text)
        info = {"distinct": True, "held_out_from": " and ".join(held_from)}
    x, y = data[0].tensors
    info["positions"] = train_positions(ids)
    info["unique_contents"] = len(torch.unique(torch.cat([x, y[:, None]], 1), dim=0))
    return data, vocab, len(ids), info


def lr_lambda(args: argparse.Namespace) -> WarmupCosine | None:
    """The inner learning-rate multiplier of every run for ``--schedule``, ``None`` for constant."""
    if args.schedule == "constant":
        return None
    return WarmupCosine(args.steps, WARMUP_FRACTION, FINAL_LR_RATIO)


def _lrs_text(args: argparse.Namespace) -> str:
    return "/".join(f"{lr:g}" for lr in args.lrs)


def schedule_text(args: argparse.Namespace) -> str:
    sched = lr_lambda(args)
    peak = f"the peak lr ({_lrs_text(args)}, one per training)" if args.grid else f"{args.lrs[0]:g}"
    if sched is None:
        return f"constant lr {peak}"
    return (f"lr linear warmup over {sched.warmup} steps ({WARMUP_FRACTION:.0%}) to {peak}, then cosine decay to"
            f" {FINAL_LR_RATIO:g} x the peak at step {args.steps}")


def command_argv(args: argparse.Namespace) -> list[str]:
    """The command line, with ``--corpus`` and ``--schedule`` spelled out where the defaults were used."""
    argv = list(args.argv)
    for flag, value in (("--schedule", args.schedule), ("--corpus", args.corpus)):  # prepended: corpus first
        if not any(a == flag or a.startswith(flag + "=") for a in argv):
            argv = [flag, value, *argv]
    return argv


# ---------------------------------------------------------------------------------------------- running


class HeldOut(L.Callback):
    """On rank 0 only (no collective): the held-out loss of the replica rank 0 holds, before the first step and
    after every ``every``-th optimizer step (after that step's outer sync, where one is applied then)."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor, every: int) -> None:
        self.x, self.y, self.every = x, y, every
        self.curve: list[tuple[int, float]] = []
        self._last = -1
        self.eval_s = 0.0
        self.train_s = 0.0  # from the start of training to its end, the evaluations excluded

    def _evaluate(self, step: int, pl_module) -> None:
        start = time.perf_counter()
        self.curve.append((step, pl_module.loss(self.x, self.y)))
        self.eval_s += time.perf_counter() - start

    def on_train_start(self, trainer, pl_module) -> None:
        self._start = time.perf_counter()
        if trainer.is_global_zero:
            self._evaluate(0, pl_module)

    def on_train_end(self, trainer, pl_module) -> None:
        self.train_s = time.perf_counter() - self._start - self.eval_s

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        step = trainer.global_step
        if step == self._last:
            return
        self._last = step
        if trainer.is_global_zero and step % self.every == 0:
            self._evaluate(step, pl_module)


def run(name: str, lr: float, args: argparse.Namespace, data: tuple, vocab: int) -> dict[str, Any]:
    train, held_x, held_y = data
    flags = RUNS[name]
    L.seed_everything(SEED, verbose=False)  # the same initial parameters in every run
    model = CharModel(vocab, train, lr=lr, weight_decay=WEIGHT_DECAY, lr_lambda=lr_lambda(args))
    strategy = HierarchicalZeroStrategy(devices_per_node=PER_NODE, bucket_size_mb=BUCKET_MB, **flags)
    held = HeldOut(held_x, held_y, args.eval_every)
    trainer = L.Trainer(
        accelerator="cpu", devices=WORLD, strategy=strategy, max_steps=args.steps, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        use_distributed_sampler=False, callbacks=[held],
    )
    trainer.fit(model)

    # Collectives: every rank takes part. After fit, every outer sync still in flight has been applied.
    losses = strategy.all_gather(torch.tensor(model.losses, dtype=torch.float64))  # (ranks, steps)
    final_by_rank = strategy.all_gather(torch.tensor([model.loss(held_x, held_y)], dtype=torch.float64)).flatten()
    means = strategy.metric_means
    cross_by_rank = strategy.all_gather(torch.tensor([means.get("comm/cross_node_MB", float("nan"))],
                                                     dtype=torch.float64)).flatten()
    identical = identical_on_all_ranks(strategy, model)
    return {
        "name": name,
        "lr": lr,  # the inner AdamW's peak learning rate
        "flags": flags,
        "steps": trainer.global_step,
        "train_loss": losses.mean(0).tolist(),
        "train_loss_rank0": model.losses,
        "held_out_curve": held.curve,
        "held_out_final": final_by_rank[0].item(),  # the replica rank 0 holds
        "held_out_final_by_rank": final_by_rank.tolist(),
        "cross_node_MB_per_step": means.get("comm/cross_node_MB"),  # rank 0's
        "cross_node_MB_per_step_by_rank": cross_by_rank.tolist(),
        "outer_syncs": round(means.get("sync/outer_syncs", 0.0) * trainer.global_step),  # fragment syncs applied
        "identical_on_all_ranks": identical,
        "lr_after_training": trainer.optimizers[0].param_groups[0]["lr"],  # rank 0's inner lr, after the last step
        "buckets": model.num_buckets,
        "params": sum(p.numel() for p in model.parameters()),
        "seconds": held.train_s,
    }


# ---------------------------------------------------------------------------------------------- reporting


def _flag_value(value: Any) -> Any:
    return value.__name__ if callable(value) else value


def _flags_text(flags: dict[str, Any]) -> str:
    return ", ".join(f"`{k}={_flag_value(v)!r}`" for k, v in flags.items()) if flags else "(none: synchronous)"


def _data_text(args: argparse.Namespace, vocab: int, chars: int, info: dict[str, Any]) -> str:
    windows = args.steps * GLOBAL_BATCH
    batches = (f"{windows:,} windows = {args.steps} steps of {GLOBAL_BATCH}, {GLOBAL_BATCH // WORLD} per rank, in the"
               " same order for every run")
    if info["distinct"]:
        source = (f"the concatenated source of {len(STDLIB_MODULES)} large pure-Python stdlib modules"
                  f" ({', '.join(f'`{m}`' for m in STDLIB_MODULES)}; characters other than newline and printable ASCII"
                  f" replaced by `?`), {chars:,} characters, {vocab} distinct")
        positions, unique = info["positions"], info["unique_contents"]
        sampling = (f"training windows at **distinct** random starts (without replacement) among the {positions:,}"
                    f" of its first 90% ({batches}): **less than one pass** over the training text"
                    f" ({windows / positions:.1%} of its windows, none twice; {unique:,} distinct window contents,"
                    " as source code repeats itself)")
        held = f"the last 10% ({info['held_out_from']}: text no training window comes from)"
        call = f"`text_data(stdlib_corpus(), {args.steps}, distinct=True)`"
    else:
        source = f"the source of the stdlib's `argparse` ({chars:,} characters, {vocab} distinct)"
        sampling = (f"training windows at random starts, with replacement, in its first 90% ({batches}):"
                    f" {windows / info['positions']:.2f} passes' worth of the {info['positions']:,} training windows"
                    f" ({info['unique_contents']:,} distinct window contents)")
        held = "the last 10%"
        call = f"`text_data(corpus(), {args.steps})`"
    return (f"- data (`--corpus {args.corpus}`): {source}; {sampling}; held-out loss on {HELD_OUT:,} windows from"
            f" {held} (`ddp_plugin.testing.text`: {call})")


def write_markdown(args: argparse.Namespace, bench: harness.Run, rows: list[dict[str, Any]], vocab: int, chars: int,
                   info: dict[str, Any], png: Path | None) -> str:
    ok = [r for r in rows if "error" not in r]
    best = best_rows(rows)
    ref = best.get("sync")  # synchronous training at its best inner lr of the grid
    base = args.reference
    base_best = best.get(base)
    grid = args.grid
    params = ok[0]["params"] if ok else 0
    buckets = ok[0]["buckets"] if ok else "?"
    lines = [
        f"# Convergence: sync modes vs synchronous training, {WORLD // PER_NODE} nodes x {PER_NODE} ranks, "
        f"{args.steps} steps, {args.corpus} corpus, {args.schedule} lr",
        "",
        *bench.header(),
        f"- ranks: {WORLD} CPU ranks (1 intra-op thread each) as {WORLD // PER_NODE} simulated nodes x {PER_NODE}, gloo over loopback:"
        f" `HierarchicalZeroStrategy(devices_per_node={PER_NODE}, bucket_size_mb={BUCKET_MB:g}, <flags>)`, ZeRO"
        f" stage 0; {buckets} gradient buckets",
        f"- model: `ddp_plugin.testing.text.CharModel`: next character from the previous {CONTEXT}, Embedding({vocab},"
        f" 24) -> Linear({CONTEXT * 24}, 192) -> GELU -> Linear(192, {vocab}), {params:,} parameters; inner optimizer"
        f" AdamW(lr={_lrs_text(args)}, weight_decay={WEIGHT_DECAY:g}) on every rank; initial parameters from"
        f" `seed_everything({SEED})`, the same in every run",
        f"- inner learning rate (`--schedule {args.schedule}`), the same in every run: {schedule_text(args)}"
        + ("; each run trained once at each of its peak lrs (`--lr`, or its own with `--runs name@lr`)"
           if grid else "")
        + ("" if args.schedule == "constant" else
           " (`CharModel(lr_lambda=WarmupCosine(...))`, a `LambdaLR` stepped after every optimizer step; the outer"
           " optimizer's lr is fixed)"),
        _data_text(args, vocab, chars, info),
        f"- training loss: every step, the mean over the {WORLD} ranks of their batch losses (in a sync mode, each"
        f" rank's loss is its own node's replica's); the plot smooths it with a {args.smooth}-step moving average",
        f"- held-out loss: cross-entropy of the replica **rank 0 holds** (node 0's), before training, after every"
        f" {args.eval_every}th step (after that step's outer sync, where one is applied at that step), and after"
        " training, which is the *final* value. In a sync mode the nodes' replicas differ between outer syncs: after"
        " the last step, the DiLoCo and local SGD runs (staleness 0, the last step a sync step) hold the same parameters on every"
        " rank; the streaming run's fragments were synchronized at different steps (the last one applied when fit"
        " ends), so its nodes still differ there; node 1's replica's final held-out loss is in the notes",
        "- cross-node MB/step: `strategy.metric_means['comm/cross_node_MB']`, the strategy's own accounting of the"
        " bytes rank 0 sent to the other nodes, mean over all steps (outer syncs amortized); a node sends"
        f" {PER_NODE} x that. Outer syncs: `sync/outer_syncs` summed over the steps (fragment syncs for streaming;"
        " its last one, sent after the last step and applied when fit ends, is after the last count)",
        "- wall s: rank 0's time from the start of training to its end (setup, launch and the held-out evaluations not"
        " included), on a shared machine, not a timing benchmark",
        "",
    ]
    cells = []
    for r in rows:
        if "error" in r:
            cells.append([r["name"], _flags_text(RUNS[r["name"]]), f"{r['lr']:g}", f"failed: {cell(r['error'])}",
                          "-", "-", "-", "-"])
            continue
        same = next((s for s in ok if s["name"] == base and s["lr"] == r["lr"]), None)
        mark = "**" if grid and best.get(r["name"]) is r else ""
        cells.append([r["name"], _flags_text(r["flags"]), f"{mark}{r['lr']:g}{mark}", f"{r['held_out_final']:.4f}",
                      fmt(r["held_out_final"] / same["held_out_final"] if same else None, ".4f"),
                      fmt(r["cross_node_MB_per_step"], ".4f"), r["outer_syncs"], f"{r['seconds']:.0f}"])
    lines += harness.table(["run", "flags", "inner lr", "final held-out loss", f"ratio to {base} (same lr)",
                            "cross-node MB/step", "outer syncs", "wall s"], cells, "llrrrrrr")
    if grid:
        lines += ["", f"Each run at its best inner lr (bold above), against {base} at its best:", "",
                  *harness.table(["run", "best inner lr", "final held-out loss", f"ratio to {base} (each tuned)"],
                                 ([name, f"{r['lr']:g}", f"{r['held_out_final']:.4f}",
                                   fmt(r["held_out_final"] / base_best["held_out_final"] if base_best else None,
                                       ".4f")]
                                  for name, r in best.items()))]
    lines.append("")
    names, tol = ACCEPTANCE
    tuned = ", each at its best inner lr" if grid else ""
    for name in names:
        target = best.get(name)
        if ref is not None and target is not None:
            ratio = target["held_out_final"] / ref["held_out_final"]
            verdict = "PASSES" if ratio <= 1 + tol else "MISSES"
            lines.append(f"- **Acceptance, DiLoCo H=16 ({name}{tuned}): final held-out loss / sync's ="
                         f" {target['held_out_final']:.4f} / {ref['held_out_final']:.4f} = {ratio:.4f}** ({verdict}"
                         f" the <= {1 + tol:g} target: within {tol:.0%} of synchronous training)"
                         + (f"; inner lr {target['lr']:g} against sync's {ref['lr']:g}." if grid else "."))
        elif "sync" in args.runs:
            lines.append(f"- Acceptance ({name} within {tol:.0%} of sync): not measured, a run is missing.")
    names, against, tol = SPARSE_ACCEPTANCE
    dense = best.get(against)
    for name in names:
        target = best.get(name)
        if target is None or dense is None:
            continue
        ratio = target["held_out_final"] / dense["held_out_final"]
        verdict = "PASSES" if ratio <= 1 + tol else "MISSES"
        lines.append(f"- **Issue 88, {name}{tuned}: final held-out loss / {against}'s = {target['held_out_final']:.4f}"
                     f" / {dense['held_out_final']:.4f} = {ratio:.4f}** ({verdict} the <= {1 + tol:g} target: within"
                     f" {tol:.0%} of DiLoCo fp32 or below)"
                     + (f"; inner lr {target['lr']:g} against {against}'s {dense['lr']:g}." if grid else "."))
    lines += ["", "Notes:", ""]
    if ref is not None:
        lines.append(f"- sync's held-out loss over the last 20% of the steps (inner lr {ref['lr']:g}):"
                     f" {_tail_text(ref, args.steps)}")
    for r in ok:
        by_rank = r["held_out_final_by_rank"]
        node1 = by_rank[PER_NODE] if len(by_rank) > PER_NODE else None
        cross = r["cross_node_MB_per_step_by_rank"]
        at = f" at lr {r['lr']:g}" if grid else ""
        lines.append(
            f"- {r['name']}{at}: parameters identical on all ranks after training: {r['identical_on_all_ranks']};"
            f" node 1's replica's final held-out loss {fmt(node1, '.4f')}; held-out loss over the last 20% of the"
            f" steps: mean {_tail_mean(r, args.steps):.4f}, best during training"
            f" {min(v for _, v in r['held_out_curve']):.4f}; mean training loss of the last 100 steps"
            f" {sum(r['train_loss'][-100:]) / len(r['train_loss'][-100:]):.4f}; inner lr after the last step"
            f" {r['lr_after_training']:.3g}; cross-node MB/step by rank"
            f" {', '.join(fmt(c, '.4f') for c in cross)}"
        )
    if png is not None:
        lines += ["", f"![held-out and training loss]({png.name})"]
    return "\n".join([*lines, ""])


def best_rows(rows: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Each run's training with the lowest final held-out loss over the ``--lr`` grid (its only one without a
    grid), by run name, in the order the runs were first trained."""
    best: dict[str, dict[str, Any]] = {}
    for r in rows:
        if "error" not in r and (r["name"] not in best or r["held_out_final"] < best[r["name"]]["held_out_final"]):
            best[r["name"]] = r
    return best


def _tail_text(r: dict[str, Any], steps: int) -> str:
    tail = [(s, v) for s, v in r["held_out_curve"] if s >= 0.8 * steps] + [(steps, r["held_out_final"])]
    values = [v for _, v in tail]
    return (f"from step {tail[0][0]} to {steps}: min {min(values):.4f}, max {max(values):.4f}"
            f" (spread {max(values) - min(values):.4f}, {(max(values) - min(values)) / min(values):.2%})")


def _tail_mean(r: dict[str, Any], steps: int) -> float:
    values = [v for s, v in r["held_out_curve"] if 0.8 * steps <= s < steps] + [r["held_out_final"]]
    return sum(values) / len(values)


def _smooth(values: list[float], window: int) -> tuple[list[int], list[float]]:
    """Trailing moving average over ``window`` steps; x is the step (1-based) each average ends at."""
    out, acc = [], 0.0
    for i, v in enumerate(values):
        acc += v
        if i >= window:
            acc -= values[i - window]
        out.append(acc / min(i + 1, window))
    return list(range(1, len(values) + 1)), out


def write_plot(args: argparse.Namespace, rows: list[dict[str, Any]], path: Path) -> bool:
    grid = args.grid
    ok = list(best_rows(rows).values())  # with an --lr grid, each run at its best lr
    plt = harness.pyplot() if ok else None
    if plt is None:
        return False
    fig, (ax_h, ax_t) = plt.subplots(1, 2, figsize=(13, 5))
    ref = next((r for r in ok if r["name"] == "sync"), None)
    for i, r in enumerate(ok):
        color = f"C{i}"
        label = f"{r['name']}, lr {r['lr']:g}" if grid else r["name"]
        curve = [(s, v) for s, v in r["held_out_curve"] if s < r["steps"]] + [(r["steps"], r["held_out_final"])]
        ax_h.plot([s for s, _ in curve], [v for _, v in curve], color=color, lw=1.3,
                  label=f"{label} ({r['held_out_final']:.3f})")
        x, y = _smooth(r["train_loss"], args.smooth)
        ax_t.plot(x, y, color=color, lw=1.0, label=label)
    # Zoom in on the end of training, where the runs differ; the first steps fall off the top.
    late = [v for r in ok for s, v in r["held_out_curve"] if s >= 0.1 * args.steps] + [r["held_out_final"] for r in ok]
    lo, hi = min(late), max(late)
    ax_h.set_ylim(lo - 0.05 * (hi - lo) - 0.01, hi + 0.1 * (hi - lo) + 0.01)
    late_t = [v for r in ok for v in _smooth(r["train_loss"], args.smooth)[1][int(0.1 * args.steps):]]
    lo_t, hi_t = min(late_t), max(late_t)
    ax_t.set_ylim(lo_t - 0.05 * (hi_t - lo_t) - 0.01, hi_t + 0.1 * (hi_t - lo_t) + 0.01)
    if ref is not None:
        ax_h.axhline(ref["held_out_final"] * (1 + ACCEPTANCE[1]), color="k", ls=":", lw=1,
                     label=f"sync final x {1 + ACCEPTANCE[1]:g}")
    dense = next((r for r in ok if r["name"] == SPARSE_ACCEPTANCE[1]), None)
    if dense is not None and any(r["name"] in SPARSE_ACCEPTANCE[0] for r in ok):
        ax_h.axhline(dense["held_out_final"] * (1 + SPARSE_ACCEPTANCE[2]), color="k", ls="--", lw=1,
                     label=f"{SPARSE_ACCEPTANCE[1]} final x {1 + SPARSE_ACCEPTANCE[2]:g}")
    ax_h.set_title(f"held-out loss (rank 0's replica, every {args.eval_every} steps; final in legend)", fontsize=10)
    ax_t.set_title(f"training loss (mean over ranks, {args.smooth}-step moving average)", fontsize=10)
    for ax in (ax_h, ax_t):
        ax.set_xlabel("optimizer step")
        ax.set_ylabel("cross-entropy (nats/char)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    text = "argparse.py" if args.corpus == "argparse" else f"{len(STDLIB_MODULES)} stdlib modules (< 1 pass)"
    peak = f"best lr of {_lrs_text(args)}" if grid else f"lr {args.lrs[0]:g}"
    lr = (f"constant {peak}" if args.schedule == "constant" else
          f"{peak}, {WARMUP_FRACTION:.0%} warmup + cosine to {FINAL_LR_RATIO:g}x")
    fig.suptitle(f"char model on {text}, {WORLD // PER_NODE} nodes x {PER_NODE} CPU ranks, AdamW {lr},"
                 f" {args.steps} steps", fontsize=11)
    harness.save_figure(fig, path)
    return True


def write_results(args: argparse.Namespace, bench: harness.Run, rows: list[dict[str, Any]], vocab: int, chars: int,
                  info: dict[str, Any], show: bool) -> None:
    png = args.out.with_suffix(".png")
    plotted = write_plot(args, rows, png)
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"args": {k: str(v) if isinstance(v, Path) else v
                                                  for k, v in vars(args).items()}, "data": info, "runs": rows},
                                        indent=1, default=_flag_value))
    harness.write(args.out, write_markdown(args, bench, rows, vocab, chars, info, png if plotted else None),
                  show=show, also=[png] if plotted else [])


# ---------------------------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    global NODES, PER_NODE, WORLD
    args = parse_args(argv)
    NODES, PER_NODE, WORLD = args.nodes, args.per_node, args.nodes * args.per_node
    torch.set_num_threads(1)
    rank0 = int(os.environ.get("LOCAL_RANK", "0")) == 0
    # (rank 0 writes the results; the others, started by Lightning's launcher at the first fit, only train)
    bench = harness.Run(__file__, command_argv(args), quiet=args.quiet, ranks=WORLD) if rank0 else None
    data, vocab, chars, info = load_data(args)
    rows: list[dict[str, Any]] = []
    trainings = args.trainings  # a grid: every run at one lr, then the next
    for i, (name, lr) in enumerate(trainings):
        try:
            rows.append(run(name, lr, args, data, vocab))
        except Exception as err:  # noqa: BLE001 - a failed run gets its row; the next one starts
            traceback.print_exc()
            rows.append({"name": name, "lr": lr, "error": f"{type(err).__name__}: {err}"})
        if bench is not None:
            r = rows[-1]
            status = (f"failed ({r['error']})" if "error" in r else
                      f"held-out {r['held_out_final']:.4f}, {r['cross_node_MB_per_step']:.4f} cross-node MB/step,"
                      f" {r['outer_syncs']} outer syncs, {r['seconds']:.0f} s")
            print(f"[{i + 1}/{len(trainings)}] {name:<16} lr {lr:<8g} {status}", flush=True)
            write_results(args, bench, rows, vocab, chars, info, show=i == len(trainings) - 1)  # after every run
    return 0


if __name__ == "__main__":
    sys.exit(main())
