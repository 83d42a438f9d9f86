"""The hierarchical reducer across replica groups: its cross-node stage through torchft."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ddp_plugin.plugins.hierarchical_reducer import HierarchicalReducer

if TYPE_CHECKING:
    from pluggy import HookRelay
    from torch import Tensor

    from ddp_plugin.fault_tolerance.replicas import ReplicaGroups
    from ddp_plugin.hookspecs import Bucket


class ReplicaGroupReducer(HierarchicalReducer):
    """Average a bucket over every rank of every live replica group, in the hierarchical reducer's stages: a
    reduce-scatter inside each node of the group (1/k of the bucket a rank), the group's mean of that chunk and
    then the mean over the live groups (:meth:`across`), an all-gather inside the node. One rank per node: the
    whole bucket is the chunk."""

    def __init__(self, replicas: ReplicaGroups) -> None:
        super().__init__()
        self._replicas = replicas

    @property
    def splits(self) -> bool:
        return True  # (with one rank a node the chunk is the whole bucket)

    def shard_numel(self, bucket: Bucket) -> int:
        m = self._topology.num_nodes  # (a chunk splits evenly over the group's nodes)
        return -(-bucket.numel // (self._topology.ranks_per_node * m)) * m

    def reduce_to_shard(self, bucket: Bucket) -> Tensor:
        topo = self._topology
        padded = self._padded(bucket)
        c = self.shard_numel(bucket)
        padded.div_(topo.ranks_per_node)  # the node's sum of the chunk, then the means over nodes and groups
        shard = padded[topo.local_rank * c : (topo.local_rank + 1) * c]
        self._comm.reduce_scatter(shard, padded, group=topo.intra_node_group)
        self.across(self._hook, [(shard, bucket, topo.local_rank * c)])
        return shard

    def across(self, hook: HookRelay, parts: list[tuple[Tensor, Bucket, int]]) -> None:
        """Each ``(chunk, bucket, offset)``, the node's mean of the chunk, averaged in place over the group's nodes
        and then over the live groups: on a group of one node, through torchft at once; on a group of M nodes, the
        chunk is reduce-scattered over them (1/M of it a node, summed), that part averaged over the live groups'
        same ranks, and the parts all-gathered back over the group's nodes. What crosses groups is then the
        group's gradient once, as from a group of one node; a codec codes that, and the stages among the group's
        own nodes stay plain (ZeRO's cross stage too: ``ShardReducer(cross=...)``).

        With a sync mode (no quorum per step) the gradients stay inside the group: averaged over its nodes only
        (a group of several nodes is one replica between the syncs), nothing crossing groups."""
        topo, m = self._topology, self._topology.num_nodes
        between = self._replicas.per_step
        if m == 1:
            if between:
                self._replicas.reduce(hook, parts)
            return
        subs = []
        for chunk, bucket, offset in parts:
            assert chunk.numel() % m == 0, "a chunk splits evenly over the group's nodes (the buckets are padded)"
            s = chunk.numel() // m
            sub = chunk[topo.node_rank * s : (topo.node_rank + 1) * s]
            chunk.div_(m)
            self._comm.reduce_scatter(sub, chunk, group=topo.inter_node_group)
            subs.append((sub, bucket, offset + topo.node_rank * s))
        if between:
            self._replicas.reduce(hook, subs)
        for (chunk, _, _), (sub, _, _) in zip(parts, subs):
            self._comm.all_gather(chunk, sub, group=topo.inter_node_group)
