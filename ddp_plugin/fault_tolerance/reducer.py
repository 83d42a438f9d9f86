"""The hierarchical reducer across replica groups: its cross-node stage through torchft."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ddp_plugin.hookspecs import hookimpl
from ddp_plugin.plugins.hierarchical_reducer import HierarchicalReducer

if TYPE_CHECKING:
    from torch import Tensor

    from ddp_plugin.fault_tolerance.replicas import ReplicaGroups
    from ddp_plugin.hookspecs import Bucket


class ReplicaGroupReducer(HierarchicalReducer):
    """Average a bucket over every rank of every live replica group, in the hierarchical reducer's three stages:
    a reduce-scatter inside the group (its world: one node's ranks), the 1/k shard averaged over the live groups'
    ranks of the same group rank through torchft's Manager (the only stage between groups; with a codec, the codec
    on torchft's process group), an all-gather inside the group. One rank per group: the whole bucket crosses."""

    def __init__(self, replicas: ReplicaGroups) -> None:
        super().__init__()
        self._replicas = replicas

    @property
    def splits(self) -> bool:
        return True  # (the group's world is the node; with one rank the shard is the whole bucket)

    def reduce_to_shard(self, bucket: Bucket) -> Tensor:
        topo = self._topology
        padded = self._padded(bucket)
        c = self.shard_numel(bucket)
        padded.div_(topo.ranks_per_node)  # the group's sum of the chunk, then the mean over the live groups
        shard = padded[topo.local_rank * c : (topo.local_rank + 1) * c]
        self._comm.reduce_scatter(shard, padded, group=topo.intra_node_group)
        self._replicas.reduce(self._hook, [(shard, bucket, topo.local_rank * c)])
        return shard

    @hookimpl
    def on_collect_metrics(self) -> dict[str, float]:
        return self._replicas.metrics()
