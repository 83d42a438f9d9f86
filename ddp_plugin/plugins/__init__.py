"""Built-in plugins. Each depends only on :mod:`ddp_plugin.hookspecs` (and the collectives helpers)."""

from ddp_plugin.plugins.codecs import Bf16Codec, Fp16Codec, Int8Codec, PowerSGDCodec, TopKCodec
from ddp_plugin.plugins.flat_reducer import FlatReducer
from ddp_plugin.plugins.hierarchical_reducer import HierarchicalReducer
from ddp_plugin.plugins.mean_allreduce import MeanAllReduce
from ddp_plugin.plugins.traffic import TrafficAccounting
from ddp_plugin.plugins.zero_sharder import ZeroSharder

__all__ = [
    "Bf16Codec",
    "FlatReducer",
    "Fp16Codec",
    "HierarchicalReducer",
    "Int8Codec",
    "MeanAllReduce",
    "PowerSGDCodec",
    "TopKCodec",
    "TrafficAccounting",
    "ZeroSharder",
]
