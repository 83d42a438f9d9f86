"""Data for tests: a seeded regression task, and each rank's share of a dataset in a fixed order.

- :func:`sine_dataset`: ``x ~ N(0, 1)`` of shape ``(n, features)`` from its own seeded generator, ``y =
  sin(sum(x))``: smooth, learnable by a tiny MLP, and the same on every rank and in every run.
- :func:`rank_loader`: rank ``r`` of ``N`` gets samples ``r, r + N, r + 2N, ...`` in order, ``global_batch / N``
  per batch, so the union of the ranks' batches at step ``j`` is the single-process run's batch ``j``: what a
  comparison of N-rank training with one process (C2) needs. Give the Trainer ``use_distributed_sampler=False``.
"""

from __future__ import annotations

import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler, TensorDataset

__all__ = ["rank_loader", "sine_dataset"]


def sine_dataset(n: int, features: int, seed: int) -> TensorDataset:
    """``n`` samples ``(x, sin(x.sum()))`` with ``x`` drawn from a generator seeded with ``seed``."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, features, generator=g)
    return TensorDataset(x, torch.sin(x.sum(1, keepdim=True)))


def rank_loader(dataset: Dataset, global_batch: int, world_size: int, rank: int) -> DataLoader:
    """This rank's share of ``dataset`` in order, without shuffling: batches of ``global_batch // world_size``."""
    sampler = DistributedSampler(dataset, num_replicas=world_size, rank=rank, shuffle=False)
    return DataLoader(dataset, batch_size=global_batch // world_size, sampler=sampler)
