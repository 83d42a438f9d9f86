"""The stage of a hierarchical reduction between nodes, as a protocol the reducers own: the hierarchical reducer
(:class:`~ddp_plugin.plugins.hierarchical_reducer.HierarchicalReducer`) and the ZeRO sharder's node shards hand it
each rank's chunk once the node has reduced it. Without one, that stage is the ``on_cross_node_reduce`` hook over
the inter-node group (where a codec answers); a way to keep members that come and go gives its own (fault
tolerance's: among a member's nodes, then across the live members)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from pluggy import HookRelay
    from torch import Tensor

    from ddp_plugin.hookspecs import Bucket


class CrossStage(Protocol):
    """Each node's reduced chunk averaged over every node (or member), in place."""

    @property
    def splits_into(self) -> int:
        """What a chunk's length must be a multiple of (the reducer pads its buckets to it; read after setup)."""

    def reduce(self, hook: HookRelay, parts: list[tuple[Tensor, Bucket, int]]) -> None:
        """Each ``(chunk, bucket, offset)``: the node's mean of elements ``offset..`` of ``bucket``, averaged in
        place over every node. ``hook``: the fit's hooks (a codec answers ``on_cross_node_reduce`` on them)."""
