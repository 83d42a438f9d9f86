"""A character-level language model on real text: training whose loss is worth comparing between runs (codecs,
sync modes), on a corpus every machine has and in seconds of CPU time.

- :func:`corpus`: the source of the standard library's ``argparse`` module (about 100k characters; no download)
  as character ids, and the size of its vocabulary.
- :func:`windows`: the :data:`CONTEXT` characters at each start position, and the character after them.
- :func:`text_data`: a training set of ``steps * GLOBAL_BATCH`` windows from the first 90% of the text and
  :data:`HELD_OUT` held-out windows from the last 10%, both drawn from one generator seeded with ``seed``: the
  same data in every run with the same ``steps``.
- :class:`CharModel`: embeddings, one hidden layer, logits; AdamW; it loads each rank's share of its training
  set in order (:func:`~ddp_plugin.testing.data.rank_loader`) and records this rank's loss of every step::

      ids, vocab = corpus()
      train, held_x, held_y = text_data(ids, steps)
      L.seed_everything(1234, verbose=False)  # the same initial parameters in every run
      model = CharModel(vocab, train)
      trainer = L.Trainer(..., max_steps=steps, use_distributed_sampler=False)
      trainer.fit(model)
      held_out = model.loss(held_x, held_y)

A larger corpus and a schedule, closer to how DiLoCo is trained (``benchmarks/convergence.py``'s default):

- :func:`stdlib_corpus`: the concatenated source of :data:`STDLIB_MODULES` (about 1.9M characters on Python
  3.11; no download), the same ``(ids, vocab)`` as :func:`corpus`; ``text_data(ids, steps, distinct=True)``
  draws its training starts without replacement, so no window is trained on twice.
- :class:`WarmupCosine`: linear warmup then cosine decay of the learning rate, for ``CharModel(...,
  lr_lambda=WarmupCosine(steps))`` (stepped every optimizer step).
"""

from __future__ import annotations

import argparse
import importlib.util
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import lightning as L
import torch
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

from ddp_plugin.testing.data import rank_loader

__all__ = ["CONTEXT", "GLOBAL_BATCH", "HELD_OUT", "STDLIB_MODULES", "CharModel", "WarmupCosine", "corpus",
           "encode", "stdlib_corpus", "stdlib_sources", "text_data", "train_positions", "windows"]

CONTEXT = 16
"""Characters the model sees before the one it predicts."""
GLOBAL_BATCH = 64
"""Windows per optimizer step, over all ranks."""
HELD_OUT = 4096
"""Held-out windows :func:`text_data` draws."""


def corpus() -> tuple[Tensor, int]:
    """The text of ``argparse.py`` as character ids (indices into its sorted set of characters), and the number of
    distinct characters."""
    text = Path(argparse.__file__).read_text(encoding="utf-8")
    vocab = sorted(set(text))
    index = {c: i for i, c in enumerate(vocab)}
    return torch.tensor([index[c] for c in text], dtype=torch.long), len(vocab)


STDLIB_MODULES: tuple[str, ...] = (
    "argparse", "configparser", "dataclasses", "difflib", "doctest", "email._header_value_parser", "enum",
    "functools", "http.client", "inspect", "ipaddress", "logging", "optparse", "pathlib", "pickle", "pydoc",
    "subprocess", "tarfile", "textwrap", "typing", "unittest.mock", "urllib.request", "zipfile",
)
"""Large pure-Python standard-library modules (sorted by name) whose concatenated source :func:`stdlib_corpus`
reads: about 1.9M characters on Python 3.11 (the exact size depends on the Python version)."""


def stdlib_sources(modules: Sequence[str] = STDLIB_MODULES) -> list[tuple[str, str]]:
    """``(module, source)`` for each of ``modules``, in the order given: the text of the file the module is
    loaded from (a package's ``__init__.py``), found without importing it. Every character other than a newline
    and printable ASCII (a handful of box-drawing and accented letters in comments) becomes ``?``, so that the
    vocabulary stays within those 96 characters on any Python version."""
    out = []
    for name in modules:
        spec = importlib.util.find_spec(name)
        if spec is None or spec.origin is None or not spec.origin.endswith(".py"):
            raise ValueError(f"{name!r} is not a pure-Python module of this interpreter")
        text = Path(spec.origin).read_text(encoding="utf-8")
        out.append((name, "".join(c if c == "\n" or " " <= c <= "~" else "?" for c in text)))
    return out


def encode(text: str) -> tuple[Tensor, int]:
    """``text`` as character ids (indices into its sorted set of characters), and the number of distinct
    characters."""
    vocab = sorted(set(text))
    index = {c: i for i, c in enumerate(vocab)}
    return torch.tensor([index[c] for c in text], dtype=torch.long), len(vocab)


def stdlib_corpus(modules: Sequence[str] = STDLIB_MODULES) -> tuple[Tensor, int]:
    """The concatenated source of ``modules`` (:func:`stdlib_sources`, in that order) as character ids, and the
    number of distinct characters: :func:`corpus`'s shape, on about 19 times as much text by default. The last
    10% (:func:`text_data`'s held-out part) is the end of the last modules in the list."""
    return encode("".join(text for _, text in stdlib_sources(modules)))


def windows(ids: Tensor, starts: Tensor) -> tuple[Tensor, Tensor]:
    """``(x, y)``: ``x[i]`` the :data:`CONTEXT` ids from ``starts[i]``, ``y[i]`` the id after them."""
    offsets = starts[:, None] + torch.arange(CONTEXT + 1)
    chunk = ids[offsets]
    return chunk[:, :CONTEXT], chunk[:, CONTEXT]


def text_data(ids: Tensor, steps: int, seed: int = 0, distinct: bool = False) -> tuple[TensorDataset, Tensor, Tensor]:
    """The training set (``steps * GLOBAL_BATCH`` windows at random starts in the first 90% of ``ids``) and the
    held-out windows ``(x, y)`` (:data:`HELD_OUT` random starts in the last 10%), drawn in that order from one
    generator seeded with ``seed`` (so the held-out windows depend on ``steps`` too).

    The training starts are drawn with replacement, unless ``distinct``: then without (a random permutation of
    the start positions, cut), so no window is in the training set twice: less than one pass over the training
    text. ``distinct`` needs ``steps * GLOBAL_BATCH`` at most the number of start positions
    (:func:`train_positions`)."""
    split = int(len(ids) * 0.9)
    g = torch.Generator().manual_seed(seed)
    n = steps * GLOBAL_BATCH
    if distinct:
        positions = train_positions(ids)
        if n > positions:
            raise ValueError(f"{steps} steps of {GLOBAL_BATCH} windows are {n:,} windows, more than the {positions:,}"
                             " distinct training windows of this text")
        starts = torch.randperm(positions, generator=g)[:n]
    else:
        starts = torch.randint(0, split - CONTEXT - 1, (n,), generator=g)
    train = TensorDataset(*windows(ids, starts))
    held_x, held_y = windows(ids, torch.randint(split, len(ids) - CONTEXT - 1, (HELD_OUT,), generator=g))
    return train, held_x, held_y


def train_positions(ids: Tensor) -> int:
    """The number of distinct training windows (start positions) in the first 90% of ``ids``."""
    return int(len(ids) * 0.9) - CONTEXT - 1


@dataclass(frozen=True)
class WarmupCosine:
    """A learning-rate multiplier of the optimizer step (a ``LambdaLR`` ``lr_lambda``): linear warmup from
    ``1 / warmup`` to 1 over the first ``warmup = round(warmup_fraction * total_steps)`` steps, then a cosine decay
    from 1 to ``final`` at step ``total_steps``."""

    total_steps: int
    warmup_fraction: float = 0.05
    final: float = 0.1

    @property
    def warmup(self) -> int:
        return max(1, round(self.warmup_fraction * self.total_steps))

    def __call__(self, step: int) -> float:
        if step < self.warmup:
            return (step + 1) / self.warmup
        progress = min(1.0, (step - self.warmup) / max(1, self.total_steps - self.warmup))
        return self.final + (1 - self.final) * 0.5 * (1 + math.cos(math.pi * progress))


class CharModel(L.LightningModule):
    """Predict the next character from the previous :data:`CONTEXT`: embeddings (24 wide), one hidden layer
    (192, GELU), logits. Its own class (not :class:`~ddp_plugin.testing.models.TinyModule`): a model of real
    text, its loss history and its bucket count.

    ``losses``: this rank's training loss of every step. ``num_buckets``: the strategy's gradient buckets, at the
    start of training (``None`` for a strategy without an engine). The optimizer is AdamW with ``lr`` and
    ``weight_decay``; every rank loads its share of ``dataset`` in order, ``global_batch`` windows per step over
    all ranks (give the Trainer ``use_distributed_sampler=False``). With ``lr_lambda`` (e.g. :class:`WarmupCosine`),
    the learning rate of step ``s`` (0-based) is ``lr * lr_lambda(s)``: a ``LambdaLR`` stepped after every optimizer
    step (Lightning ``interval="step"``); without, it is ``lr`` throughout."""

    def __init__(self, vocab: int, dataset: TensorDataset, lr: float = 3e-3, weight_decay: float = 0.01,
                 global_batch: int = GLOBAL_BATCH, lr_lambda: Callable[[int], float] | None = None) -> None:
        super().__init__()
        self.dataset = dataset
        self.lr, self.weight_decay, self.global_batch = lr, weight_decay, global_batch
        self.lr_lambda = lr_lambda
        self.embed = nn.Embedding(vocab, 24)
        self.hidden = nn.Linear(CONTEXT * 24, 192)
        self.out = nn.Linear(192, vocab)
        self.losses: list[float] = []
        self.num_buckets: int | None = None

    def forward(self, x: Tensor) -> Tensor:
        return self.out(nn.functional.gelu(self.hidden(self.embed(x).flatten(1))))

    @torch.no_grad()
    def loss(self, x: Tensor, y: Tensor) -> float:
        """The mean cross-entropy of this replica's predictions of ``y`` from ``x`` (e.g. the held-out windows)."""
        return nn.functional.cross_entropy(self(x), y).item()

    def on_train_start(self) -> None:
        engine = getattr(self.trainer.strategy, "engine", None)
        self.num_buckets = len(engine.buckets) if engine is not None else None

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.cross_entropy(self(x), y)
        self.losses.append(loss.item())
        return loss

    def train_dataloader(self) -> DataLoader:
        return rank_loader(self.dataset, self.global_batch, self.trainer.world_size, self.trainer.global_rank)

    def configure_optimizers(self):
        optimizer = torch.optim.AdamW(self.parameters(), lr=self.lr, weight_decay=self.weight_decay)
        if self.lr_lambda is None:
            return optimizer
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, self.lr_lambda)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step", "frequency": 1}}
