"""Where a ZeRO shard lives: how many shards a bucket is cut into, which one is this rank's, and the groups
that reduce, gather and checkpoint them. Computed once per ``fit`` from the topology and the flags; everything
else in :mod:`ddp_plugin.zero` asks it instead of re-deriving indices."""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch.distributed as dist
    from torch import Tensor

    from ddp_plugin.hookspecs import Topology


class Scope(enum.Enum):
    """How the P shards of a bucket map onto the ranks."""

    NODE = "node"
    """P = ranks per node: each node holds a full replica (``shard_scope="node"``, or a single node)."""
    TWO_LEVEL = "two_level"
    """P = world size, reduced hierarchically: shard ``local_rank * M + node_rank``, so that the intra-node
    reduce-scatter leaves each rank the block its node's peers share, and the cross-node stage splits it."""
    WORLD = "world"
    """P = world size over the flat world group (``hierarchical=False``, or one rank per node)."""


@dataclass(frozen=True)
class ShardLayout:
    """The shard layout of one ``fit``."""

    scope: Scope
    topology: Topology
    hierarchical: bool
    """Whether reductions go through the intra-node, then the inter-node group (several nodes of several ranks,
    and ``hierarchical`` not switched off)."""

    @classmethod
    def of(cls, topology: Topology, shard_scope: str, hierarchical: bool) -> ShardLayout:
        t = topology
        two_stage = bool(hierarchical) and t.num_nodes > 1 and t.ranks_per_node > 1
        if shard_scope == "node" or t.num_nodes == 1:
            scope = Scope.NODE
        else:
            scope = Scope.TWO_LEVEL if two_stage else Scope.WORLD
        return cls(scope=scope, topology=topology, hierarchical=two_stage)

    @property
    def num_shards(self) -> int:
        t = self.topology
        return t.ranks_per_node if self.scope is Scope.NODE else t.world_size

    @property
    def shard_index(self) -> int:
        t = self.topology
        if self.scope is Scope.NODE:
            return t.local_rank
        if self.scope is Scope.TWO_LEVEL:
            return t.local_rank * t.num_nodes + t.node_rank
        return t.rank

    def slice(self, flat: Tensor) -> Tensor:
        """This rank's shard of a bucket-sized tensor (a view)."""
        c = flat.numel() // self.num_shards
        return flat[self.shard_index * c : (self.shard_index + 1) * c]

    def shard_group(self) -> tuple[dist.ProcessGroup, list[int]]:
        """The side group one full copy of the shards is spread over, and the shard index of each of its ranks
        (training-thread collectives: gathers for checkpoints and user hooks, norms)."""
        t = self.topology
        if self.scope is Scope.NODE:
            return t.side_intra_node_group, list(range(t.ranks_per_node))
        if self.scope is Scope.TWO_LEVEL:
            k, m = t.ranks_per_node, t.num_nodes
            return t.side_world_group, [(r % k) * m + r // k for r in range(t.world_size)]
        return t.side_world_group, list(range(t.world_size))
