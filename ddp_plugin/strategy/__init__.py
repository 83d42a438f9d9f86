"""The Lightning side: the strategy and what it orchestrates for Lightning.

- :mod:`~ddp_plugin.strategy.hierarchical_zero`: ``HierarchicalZeroStrategy``, one class on Lightning's
  ``ParallelStrategy`` (also importable from here and from ``ddp_plugin``);
- :mod:`~ddp_plugin.strategy.fit_state`: what it holds between Lightning's calls;
- :mod:`~ddp_plugin.strategy.config`, :mod:`~ddp_plugin.strategy.deepspeed_config`: the flags, validated once
  (a DeepSpeed config mapped to them; the checks of single values are :mod:`ddp_plugin.gradients.checks`, which
  the codecs' options use too);
- :mod:`~ddp_plugin.strategy.environment`, :mod:`~ddp_plugin.strategy.process_groups`: ranks, launcher,
  rendezvous, the layout's process groups and their lifetime;
- :mod:`~ddp_plugin.strategy.assembly`: the setup's steps in torchtitan's order;
  :mod:`~ddp_plugin.strategy.session`: what exists while a ``fit`` runs (plugins, engine, communicator);
- :mod:`~ddp_plugin.strategy.stepping`, :mod:`~ddp_plugin.strategy.inspection`,
  :mod:`~ddp_plugin.strategy.precision`: the epoch's calls, what users ask, clipping that sees every shard.

Checkpoints are :mod:`ddp_plugin.checkpoints`, the gradients' path :mod:`ddp_plugin.gradients` and the plugins.
"""

from __future__ import annotations

from typing import Any

__all__ = ["HierarchicalZeroStrategy"]


def __getattr__(name: str) -> Any:
    # (on first use: the folder's other modules are imported by the layers below the strategy, which must not
    # import the strategy class with them)
    if name == "HierarchicalZeroStrategy":
        from ddp_plugin.strategy.hierarchical_zero import HierarchicalZeroStrategy

        return HierarchicalZeroStrategy
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
