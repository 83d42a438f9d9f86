"""Sparse recipe benchmark (issue 88, item 4): SparseLoCo's recipe, with and without ``warmup_syncs``, against
DiLoCo + int8 at equal steps on two models, same seeds and batches, only the strategy's sync flags changing.

    python benchmarks/sparse_recipe.py --model gpt --steps 60 --runs diloco_int8,sparseloco,sparseloco_w2
    python benchmarks/sparse_recipe.py --model char --steps 300 --out /tmp/char_300.md --json /tmp/char_300.json
    python benchmarks/sparse_recipe.py --model gpt --steps 60 --embed-std 0.02   # GPT-2's scale: a small init
    python benchmarks/sparse_recipe.py --model gpt --steps 60 --trace --json /tmp/t.json  # the codec's norms

4 CPU ranks as 2 simulated nodes x 2 (``HierarchicalZeroStrategy(devices_per_node=2, sync_every=10, <flags>)``,
the flags in :data:`RUNS`); a run takes ~35 s (GPT, 60 steps) to ~200-300 s (GPT, 300 steps) on 2 quiet cores.

- ``--model gpt``: a tied GPT of 7.4M parameters (:class:`~ddp_plugin.testing.gpt.GPT`, vocab 768, d_model 384,
  6 heads, 4 layers, seq 64) built with Lightning's ``trainer.init_module(empty_init=True)``, whose
  ``init_weights`` draws the tied embedding from N(0, ``--embed-std``^2), 0.56 by default: a large init, first
  loss ~166 (issue 88's stack: 164; ``nn.Embedding``'s own N(0, 1) gives ~350). AdamW lr 1e-2, weight decay 0.1,
  constant; 16 windows of :func:`~ddp_plugin.testing.gpt.token_dataset` a step (4 a rank), in order; held-out
  loss on 256 windows of another seed.
- ``--model char``: the text benchmark's model and data (``benchmarks/convergence.py``: ``CharModel``, 94,752
  parameters, on the stdlib corpus, distinct windows, 64 a step, AdamW 3e-3 with 5 % warmup and a cosine to 0.1
  over ``--steps``; held-out loss on its 4096 held-out windows).

Per run: every step's training loss (the mean over the ranks), its mean over the last 10 steps, the held-out loss
of rank 0's replica after training (every rank holds the same bits then when ``--steps`` is a multiple of 10: the
last step is a sync step), whether every rank holds the same parameters, and the cross-node MB a step from the
strategy's accounting (rank 0's). ``--trace`` records, on each rank, the sparse codec's input, accumulator and sent
norms per coding (the codec's ``reduce`` wrapped; the same results), into ``--json``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import lightning as L
import torch
from torch import nn

import harness
from ddp_plugin import HierarchicalZeroStrategy
from ddp_plugin.testing.data import rank_loader
from ddp_plugin.testing.gpt import GPT, GPTModule, token_dataset
from ddp_plugin.testing.ranks import identical_on_all_ranks
from ddp_plugin.testing.text import CharModel, WarmupCosine, stdlib_corpus, text_data

WORLD, PER_NODE, H, SEED = 4, 2, 10, 1234
GPT_SIZE = {"vocab": 768, "d_model": 384, "heads": 6, "layers": 4, "seq": 64}
GPT_BATCH = 16

SPARSELOCO = {"compression": "sparse", "compression_options": {"decay": 0.95}}
RUNS: dict[str, dict[str, Any]] = {
    "diloco_int8": {"outer_optimizer": "nesterov", "compression": "int8"},
    "diloco": {"outer_optimizer": "nesterov"},
    "localsgd": {"outer_optimizer": "average"},
    "localsgd_int8": {"outer_optimizer": "average", "compression": "int8"},
    "sparseloco": {"outer_optimizer": "average", **SPARSELOCO},
    "sparseloco_dense8": {"outer_optimizer": "average", "compression": "sparse",
                          "compression_options": {"decay": 0.95, "density": 1.0, "bits": 8}},
    "sparseloco_d10": {"outer_optimizer": "average", "compression": "sparse",
                       "compression_options": {"decay": 0.95, "density": 0.1}},
    "sparseloco_b8": {"outer_optimizer": "average", "compression": "sparse",
                      "compression_options": {"decay": 0.95, "bits": 8}},
    "sparse_nesterov": {"outer_optimizer": "nesterov", "compression": "sparse"},
    **{f"sparseloco_w{k}": {"outer_optimizer": "average", "compression": "sparse",
                            "compression_options": {"decay": 0.95, "warmup_syncs": k}} for k in (1, 2, 3, 4, 6)},
}


EMBED_STD = 0.56
"""The tied embedding's initial standard deviation: the first loss is then ~164, as on issue 88's stack (1.0,
``nn.Embedding``'s default: ~350)."""


class BigInitGPT(GPT):
    """The GPT with its tied embedding drawn from N(0, EMBED_STD^2) at initialization (GPT-2's is 0.02)."""

    def init_weights(self) -> None:
        super().init_weights()
        if self.tok is not None:
            nn.init.normal_(self.tok.weight, std=float(os.environ.get("SPARSE_RECIPE_EMBED_STD", EMBED_STD)))


class GPTRun(GPTModule):
    def __init__(self, dataset, held) -> None:
        super().__init__(**GPT_SIZE, lr=1e-2, weight_decay=0.1)
        self.model = BigInitGPT(**GPT_SIZE)
        self.model.init_weights()  # (a no-op on the meta device: the strategy runs it again once materialized)
        self.dataset, self.held, self.losses = dataset, held, []

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = self.pipeline_loss(self.model(x), y)
        self.losses.append(loss.item())
        return loss

    def train_dataloader(self):
        return rank_loader(self.dataset, GPT_BATCH, self.trainer.world_size, self.trainer.global_rank)

    @torch.no_grad()
    def loss(self, x, y) -> float:
        return self.pipeline_loss(self.model(x), y).item()


def build(args: argparse.Namespace, trainer: L.Trainer, data: Any) -> L.LightningModule:
    if args.model == "gpt":
        with trainer.init_module(empty_init=True):
            return GPTRun(data[0], data[1:])
    train, hx, hy = data[0]
    return CharModel(data[1], train, lr=3e-3, weight_decay=0.01, lr_lambda=WarmupCosine(args.steps, 0.05, 0.1))


def load(args: argparse.Namespace) -> Any:
    if args.model == "gpt":
        train = token_dataset(args.steps * GPT_BATCH, seq=GPT_SIZE["seq"], vocab=GPT_SIZE["vocab"], seed=args.seed)
        held = token_dataset(256, seq=GPT_SIZE["seq"], vocab=GPT_SIZE["vocab"], seed=1)
        return train, *held.tensors
    ids, vocab = stdlib_corpus()
    return text_data(ids, args.steps, seed=args.seed, distinct=True), vocab


TRACE: list[dict[str, float]] = []


def trace_sparse() -> None:
    """Record, per call of the sparse codec on this rank, the norms of what came in (g), of the accumulator
    (decay * residual + g), of what this rank sent (the accumulator less the new residual) and of the mean."""
    from ddp_plugin.codecs.sparse import SparseCodec

    plain = SparseCodec.reduce

    def reduce(self, tensor, group, n, bucket, offset, state):
        g = tensor.detach().float().norm().item()
        before = state.residual.clone() if state.residual is not None else None
        acc = tensor.detach().float().reshape(-1).clone()
        if before is not None:
            acc = before[: acc.numel()].mul(self.decay).add_(acc)
        out = plain(self, tensor, group, n, bucket, offset, state)
        sent = acc - state.residual[: acc.numel()] if state.residual is not None else acc  # (int8 warmup: dense)
        TRACE.append({"numel": tensor.numel(), "g": g, "acc": acc.norm().item(), "sent": sent.norm().item(),
                      "mean": tensor.float().norm().item(), "cos": torch.nn.functional.cosine_similarity(
                          sent, acc, dim=0).item()})
        return out

    SparseCodec.reduce = reduce


def run(name: str, args: argparse.Namespace, data: Any) -> dict[str, Any]:
    flags = {"sync_every": H, **RUNS[name]}
    L.seed_everything(SEED + args.seed, verbose=False)
    strategy = HierarchicalZeroStrategy(devices_per_node=PER_NODE, **flags)
    trainer = L.Trainer(accelerator="cpu", devices=WORLD, strategy=strategy, max_steps=args.steps, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        use_distributed_sampler=False)
    model = build(args, trainer, data)
    start = time.perf_counter()
    trainer.fit(model)
    seconds = time.perf_counter() - start
    held = (data[1], data[2]) if args.model == "gpt" else data[0][1:]
    losses = strategy.all_gather(torch.tensor(model.losses, dtype=torch.float64)).mean(0).tolist()
    means = strategy.metric_means
    trace = list(TRACE)
    TRACE.clear()
    return {"name": name, "flags": flags, "train_loss": losses, "trace": trace, "last10": sum(losses[-10:]) / 10,
            "held_out": model.loss(*held), "identical": identical_on_all_ranks(strategy, model),
            "cross_node_MB": means.get("comm/cross_node_MB"), "seconds": seconds,
            "params": sum(p.numel() for p in model.parameters())}


def markdown(args: argparse.Namespace, bench: harness.Run, rows: list[dict[str, Any]]) -> str:
    ref = next((r for r in rows if r["name"] == "diloco_int8"), None)
    lines = [f"# Sparse recipe vs DiLoCo + int8: `--model {args.model}`, {args.steps} steps, H {H}", "",
             *bench.header(), f"- {WORLD} CPU ranks as {WORLD // PER_NODE} simulated nodes x {PER_NODE};"
             f" {rows[0]['params']:,} parameters; see the script's docstring for the model and data", ""]
    cells = []
    for r in rows:
        ratio = r["last10"] / ref["last10"] if ref else None
        hratio = r["held_out"] / ref["held_out"] if ref else None
        cells.append([r["name"], ", ".join(f"`{k}={v!r}`" for k, v in r["flags"].items()),
                      f"{r['train_loss'][0]:.2f}", f"{r['last10']:.4f}", harness.fmt(ratio, ".3f"),
                      f"{r['held_out']:.4f}", harness.fmt(hratio, ".3f"), harness.fmt(r["cross_node_MB"], ".4f"),
                      r["identical"], f"{r['seconds']:.0f}"])
    lines += harness.table(["run", "flags", "first loss", "train loss, last 10 steps", "vs diloco_int8",
                            "held-out loss", "vs diloco_int8", "cross-node MB/step (rank 0)", "ranks identical",
                            "s"], cells, "llrrrrrrlr")
    return "\n".join([*lines, ""])


def main(argv: list[str] | None = None) -> int:
    p = harness.parser(__doc__)
    p.add_argument("--model", choices=("gpt", "char"), default="gpt")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--runs", default="diloco_int8,sparseloco")
    harness.add_common(p, out=None)
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--seed", type=int, default=0,
                   help=f"the data's seed (the GPT's held-out windows keep seed 1), the initial parameters' {SEED} + it")
    p.add_argument("--embed-std", type=float, default=EMBED_STD,
                   help=f"--model gpt: the tied embedding's initial standard deviation (default {EMBED_STD}; GPT-2's: 0.02)")
    p.add_argument("--trace", action="store_true", help="record the sparse codec's norms per call (rank 0's)")
    args = p.parse_args(argv)
    args.runs = harness.names(p, args.runs, RUNS, "run")
    os.environ["SPARSE_RECIPE_EMBED_STD"] = str(args.embed_std)  # (read when the model is initialized)
    if args.trace:
        trace_sparse()
    torch.set_num_threads(1)
    rank0 = int(os.environ.get("LOCAL_RANK", "0")) == 0
    bench = harness.Run(__file__, sys.argv[1:] if argv is None else argv, quiet=args.quiet, ranks=WORLD) if rank0 else None
    data = load(args)
    rows = []
    for name in args.runs:
        rows.append(run(name, args, data))
        if bench is not None:
            r = rows[-1]
            print(f"{name:<20} first {r['train_loss'][0]:.2f} last10 {r['last10']:.4f} held {r['held_out']:.4f}"
                  f" MB/step {harness.fmt(r['cross_node_MB'], '.4f')} identical {r['identical']}"
                  f" {r['seconds']:.0f} s", flush=True)
            if args.json is not None:
                args.json.write_text(json.dumps(rows))
            if args.out is not None:
                harness.write(args.out, markdown(args, bench, rows), show=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
