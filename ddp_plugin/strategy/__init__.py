"""The top layer: the Lightning side, the strategy and what it orchestrates for Lightning, and the assembly of a
``fit``'s plugins (it may import every other package; none imports it: ``tests/test_layout.py``'s ``LAYERS``).

- :mod:`~ddp_plugin.strategy.hierarchical_zero`: ``HierarchicalZeroStrategy``, one class on Lightning's
  ``ParallelStrategy`` (also importable from here and from ``ddp_plugin``);
- :mod:`~ddp_plugin.strategy.fit_state`: what it holds between Lightning's calls;
- :mod:`~ddp_plugin.strategy.config`, :mod:`~ddp_plugin.strategy.deepspeed_config`: the flags, validated once
  (a DeepSpeed config mapped to them; the checks of single values are :mod:`ddp_plugin.runtime.checks`, which
  the codecs' options use too);
- :mod:`~ddp_plugin.strategy.environment`, :mod:`~ddp_plugin.strategy.process_groups`: ranks, launcher,
  rendezvous, the layout's process groups and their lifetime;
- :mod:`~ddp_plugin.strategy.assembly`: the setup's steps in torchtitan's order;
  :mod:`~ddp_plugin.strategy.session`: what exists while a ``fit`` runs (plugins, engine, communicator);
  :mod:`~ddp_plugin.strategy.plugin_manager`: a ``fit``'s plugins assembled (built-ins, installed, the user's);
  :mod:`~ddp_plugin.strategy.link_probe`, :mod:`~ddp_plugin.strategy.link_choices`: the links measured and what
  they decide (route, codec, bucket size; the cost model is :mod:`ddp_plugin.gradients.planning`);
- :mod:`~ddp_plugin.strategy.components`: each parallelism as the strategy sees it (its mechanics are
  :mod:`ddp_plugin.parallel`); :mod:`~ddp_plugin.strategy.checkpointing`: the checkpoint routing (what is saved
  and loaded, through which hook, in which layout; the files are :mod:`ddp_plugin.checkpoints`);
- :mod:`~ddp_plugin.strategy.stepping`, :mod:`~ddp_plugin.strategy.inspection`,
  :mod:`~ddp_plugin.strategy.precision`: the epoch's calls, what users ask, clipping that sees every shard.
"""

from __future__ import annotations

from typing import Any

__all__ = ["HierarchicalZeroStrategy"]


def __getattr__(name: str) -> Any:
    # (on first use: a module of the folder imported alone, the flags' config say, does not import the strategy
    # class and every layer it assembles)
    if name == "HierarchicalZeroStrategy":
        from ddp_plugin.strategy.hierarchical_zero import HierarchicalZeroStrategy

        return HierarchicalZeroStrategy
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
