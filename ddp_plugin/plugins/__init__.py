"""Built-in plugins. Each depends only on :mod:`ddp_plugin.hookspecs` (and the collectives helpers)."""

from ddp_plugin.plugins.flat_reducer import FlatReducer
from ddp_plugin.plugins.mean_allreduce import MeanAllReduce

__all__ = ["FlatReducer", "MeanAllReduce"]
