"""The 2-D layout of ranks: nodes x ranks per node, with its device mesh and process groups."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from ddp_plugin.hookspecs import Topology


@dataclass(frozen=True)
class Layout:
    """World size and ranks per node, validated up front; everything after trusts these numbers."""

    world_size: int
    ranks_per_node: int

    def __post_init__(self) -> None:
        if self.ranks_per_node < 1 or self.world_size % self.ranks_per_node != 0:
            raise ValueError(
                f"`devices_per_node={self.ranks_per_node}` does not divide the world size {self.world_size}: every"
                " node must run the same number of ranks. Set `devices_per_node` to a divisor of the world size"
                f" ({', '.join(str(d) for d in _divisors(self.world_size))}), or leave it None to use the"
                " launcher's ranks per node."
            )

    @property
    def num_nodes(self) -> int:
        return self.world_size // self.ranks_per_node


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def build_topology(layout: Layout, device: torch.device) -> Topology:
    """Build the ``(node, local)`` device mesh over the initialized default process group.

    Ranks are laid out row-major (global rank = node * ranks_per_node + local rank), as Lightning, torchrun and
    SLURM number them. Every rank must call this (creating subgroups is collective).
    """
    rank = dist.get_rank()
    mesh = init_device_mesh(
        device.type, (layout.num_nodes, layout.ranks_per_node), mesh_dim_names=("node", "local")
    )
    k, m = layout.ranks_per_node, layout.num_nodes
    side_intra, _ = dist.new_subgroups_by_enumeration([[n * k + l for l in range(k)] for n in range(m)])
    side_inter, _ = dist.new_subgroups_by_enumeration([[n * k + l for n in range(m)] for l in range(k)])
    return Topology(
        world_size=layout.world_size,
        rank=rank,
        num_nodes=layout.num_nodes,
        ranks_per_node=layout.ranks_per_node,
        backend=dist.get_backend(),
        device=device,
        world_group=dist.group.WORLD,
        intra_node_group=mesh.get_group("local"),
        inter_node_group=mesh.get_group("node"),
        mesh=mesh,
        side_world_group=dist.new_group(),
        side_intra_node_group=side_intra,
        side_inter_node_group=side_inter,
    )
