"""The built-in plugins of the gradient path: the reducers, the default cross-node mean and the traffic
accounting. Codecs live in :mod:`ddp_plugin.codecs`, the ZeRO sharder in :mod:`ddp_plugin.zero`. Each depends
only on :mod:`ddp_plugin.hookspecs`."""

from ddp_plugin.plugins.flat_reducer import FlatReducer
from ddp_plugin.plugins.hierarchical_reducer import HierarchicalReducer
from ddp_plugin.plugins.mean_allreduce import MeanAllReduce
from ddp_plugin.plugins.traffic import TrafficAccounting

__all__ = ["FlatReducer", "HierarchicalReducer", "MeanAllReduce", "TrafficAccounting"]
