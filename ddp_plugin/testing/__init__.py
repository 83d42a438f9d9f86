"""Helpers for testing and benchmarking data-parallel training: what ddp_plugin's own tests, benchmarks and
examples share, and what a plugin author needs to test a codec or a strategy change on real ranks.

Import the module you need; this package imports none of them (and nothing imports pytest):

- :mod:`ddp_plugin.testing.models`: :func:`~ddp_plugin.testing.models.mlp`, the configurable
  :class:`~ddp_plugin.testing.models.TinyModule`, and :class:`~ddp_plugin.testing.models.LARS`.
- :mod:`ddp_plugin.testing.data`: a seeded regression dataset, and each rank's share of a dataset in order.
- :mod:`ddp_plugin.testing.ranks`: :func:`~ddp_plugin.testing.ranks.free_port`, a pool of real gloo ranks
  (:class:`~ddp_plugin.testing.ranks.RankPool`), and "parameters identical on all ranks" (C1).
- :mod:`ddp_plugin.testing.callbacks`: :class:`~ddp_plugin.testing.callbacks.ParameterHistory`, the parameters
  after every step and the largest difference between ranks.
- :mod:`ddp_plugin.testing.memory`: this process's RSS, now, at its peak, and sampled over a stretch of code.
- :mod:`ddp_plugin.testing.heap`: every thread's live and peak heap bytes, through a ``malloc`` interposer in
  ``LD_PRELOAD`` (compiled with the system's C compiler).
- :mod:`ddp_plugin.testing.processes`: the processes of a run: a clean environment, pid files, alive or stopped,
  leaving nothing behind, and faults a rank injects into itself.
- :mod:`ddp_plugin.testing.simcluster`: a simulated multi-node cluster on one Linux machine (network namespaces
  joined by rate-capped links), and the link counters its nodes read.
- :mod:`ddp_plugin.testing.trees`: the leaves of a nested checkpoint.
- :mod:`ddp_plugin.testing.text`: a character-level model (:class:`~ddp_plugin.testing.text.CharModel`), real
  text without a download (the source of the stdlib's ``argparse``, or of 23 large stdlib modules), seeded
  training and held-out windows, and a warmup-cosine learning-rate schedule.
"""

from __future__ import annotations
