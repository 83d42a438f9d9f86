"""The gradients' cross stage across replica groups: a :class:`~ddp_plugin.plugins.cross_stage.CrossStage` for the
hierarchical reducer and the ZeRO sharder, among a group's nodes and then across the live groups through
torchft."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ddp_plugin.hookspecs import hookimpl

if TYPE_CHECKING:
    from pluggy import HookRelay
    from torch import Tensor

    from ddp_plugin.fault_tolerance.replicas import ReplicaGroups
    from ddp_plugin.hookspecs import Bucket, Communicator, Topology


class ReplicaGroupCrossStage:
    """Each node's chunk of a bucket (the reducer's, after its reduce-scatter inside the node; the sharder's node
    shard) averaged over every rank of every live replica group: the group's mean of the chunk, then the mean over
    the live groups. The reducer then all-gathers the chunks inside the node; with one rank a node the chunk is the
    whole bucket.

    A plugin (its ``on_setup`` takes the group's topology and communicator)."""

    def __init__(self, replicas: ReplicaGroups) -> None:
        self.replicas = replicas
        self._topology: Topology | None = None
        self._comm: Communicator | None = None

    @hookimpl
    def on_setup(self, topology: Topology, comm: Communicator) -> None:
        self._topology, self._comm = topology, comm

    @property
    def splits_into(self) -> int:
        return self._topology.num_nodes  # (a chunk splits evenly over the group's nodes)

    def reduce(self, hook: HookRelay, parts: list[tuple[Tensor, Bucket, int]]) -> None:
        """Each ``(chunk, bucket, offset)``, the node's mean of the chunk, averaged in place over the group's nodes
        and then over the live groups: on a group of one node, through torchft at once; on a group of M nodes, the
        chunk is reduce-scattered over them (1/M of it a node, summed), that part averaged over the live groups'
        same ranks, and the parts all-gathered back over the group's nodes. What crosses groups is then the
        group's gradient once, as from a group of one node; a codec codes that, and the stages among the group's
        own nodes stay plain.

        With a sync mode (no quorum per step) the gradients stay inside the group: averaged over its nodes only
        (a group of several nodes is one replica between the syncs), nothing crossing groups."""
        topo, comm = self._topology, self._comm
        m = topo.num_nodes
        between = self.replicas.per_step
        if m == 1:
            if between:
                self.replicas.reduce(hook, parts)
            return
        subs = []
        for chunk, bucket, offset in parts:
            assert chunk.numel() % m == 0, "a chunk splits evenly over the group's nodes (the buckets are padded)"
            s = chunk.numel() // m
            sub = chunk[topo.node_rank * s : (topo.node_rank + 1) * s]
            chunk.div_(m)
            comm.reduce_scatter(sub, chunk, group=topo.inter_node_group)
            subs.append((sub, bucket, offset + topo.node_rank * s))
        if between:
            self.replicas.reduce(hook, subs)
        for (chunk, _, _), (sub, _, _) in zip(parts, subs):
            comm.all_gather(chunk, sub, group=topo.inter_node_group)
