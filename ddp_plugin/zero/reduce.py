"""Reducing a gradient bucket to this rank's shard of its mean, during backward (communication thread)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ddp_plugin.zero.layout import Scope

if TYPE_CHECKING:
    from pluggy import HookRelay
    from torch import Tensor

    from ddp_plugin.hookspecs import Bucket, Communicator
    from ddp_plugin.plugins.cross_stage import CrossStage
    from ddp_plugin.zero.layout import ShardLayout


class ShardReducer:
    """Reduces each bucket to this rank's shard: an intra-node reduce-scatter, then ``on_cross_node_reduce`` on
    the node's share (so codecs compress it), then, with global shards, the slice of it this rank owns. Without
    a hierarchy (one node per rank, ``hierarchical=False``) the cross-node hook runs on the whole bucket over the
    world and the shard is sliced out.

    ``whole`` (stage 1) also leaves the whole bucket holding the mean, so every module parameter's ``.grad`` is
    the averaged gradient, as under DDP; the shard is then a slice of it. That costs, per step, one more
    intra-node all-gather ((k-1)/k of the bucket per rank) and, with global shards over several nodes, (M-1)/M
    of the bucket more per node across nodes (with a codec, or node shards, nothing more across nodes).

    ``plain`` (no codec answers the cross-node stage): global shards reduce-scatter across nodes too, half the
    bytes of an all-reduce of the node's share.

    ``cross`` (:class:`~ddp_plugin.plugins.cross_stage.CrossStage`, fault tolerance's) takes the cross-node stage
    of node shards instead of the hook: ``cross.reduce(hook, [(block, bucket, offset)])`` averages the node's block
    in place over every node."""

    def __init__(self, layout: ShardLayout, comm: Communicator, hook: HookRelay, whole: bool, plain: bool,
                 cross: CrossStage | None = None) -> None:
        self.layout, self.comm, self.hook = layout, comm, hook
        self.whole, self.plain = whole, plain
        self.cross = cross
        self._block: Tensor | None = None

    def _block_buffer(self, numel: int, like: Tensor) -> Tensor:
        """Scratch for the node's share, reused from bucket to bucket (one bucket is reduced at a time)."""
        buf = self._block
        if buf is None or buf.numel() < numel or buf.dtype != like.dtype or buf.device != like.device:
            buf = self._block = like.new_empty(numel)
        return buf[:numel]

    def __call__(self, bucket: Bucket) -> Tensor:
        """This rank's shard of the bucket's mean (at stage 1 a view of the bucket, which holds the whole mean)."""
        layout, comm = self.layout, self.comm
        t = layout.topology
        k, m = t.ranks_per_node, t.num_nodes
        buf = bucket.buffer
        if layout.scope is Scope.TWO_LEVEL or (layout.scope is Scope.NODE and (m == 1 or layout.hierarchical
                                                                               or self.cross is not None)):
            buf.div_(k)
            c = buf.numel() // k
            out = self._block_buffer(c, buf) if layout.scope is Scope.TWO_LEVEL else buf.new_empty(c)
            block = comm.reduce_scatter(out, buf, group=t.intra_node_group)
            if layout.scope is Scope.TWO_LEVEL and not self.whole and self.plain:
                return comm.reduce_scatter(block.new_empty(c // m), block, group=t.inter_node_group).div_(m)
            if self.cross is not None:
                self.cross.reduce(self.hook, [(block, bucket, t.local_rank * c)])
            else:
                self.hook.on_cross_node_reduce(tensor=block, group=t.inter_node_group, bucket=bucket,
                                               offset=t.local_rank * c).wait()
            if self.whole:
                if k > 1:
                    comm.all_gather(buf, block, group=t.intra_node_group)
                else:
                    buf.copy_(block)
                return layout.slice(buf)
            if layout.scope is Scope.NODE:
                return block
            return block[t.node_rank * (c // m) : (t.node_rank + 1) * (c // m)].clone()  # not a view of scratch
        assert self.cross is None, "a cross stage of its own is for node shards"
        if layout.scope is Scope.WORLD and not self.whole and self.plain:
            n = t.world_size
            return comm.reduce_scatter(buf.new_empty(buf.numel() // n), buf, group=t.world_group).div_(n)
        self.hook.on_cross_node_reduce(tensor=buf, group=t.world_group, bucket=bucket, offset=0).wait()
        return layout.slice(buf)
