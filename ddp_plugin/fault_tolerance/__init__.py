"""Replica groups on torchft (``fault_tolerance=``): a lost group does not stop the others, a returning one heals
from a live peer (docs/fault_tolerance.md).

- :mod:`~ddp_plugin.fault_tolerance.options`: the flag, checked at construction;
- :mod:`~ddp_plugin.fault_tolerance.replicas`: this rank's torchft Manager (quorum, commit, healing);
- :mod:`~ddp_plugin.fault_tolerance.reducer`: the hierarchical reducer's cross stage through it;
- :mod:`~ddp_plugin.fault_tolerance.sync`: the sync modes' outer syncs through it;
- :mod:`~ddp_plugin.fault_tolerance.healing`: what a returning group receives;
- :mod:`~ddp_plugin.fault_tolerance.communicator`: the collectives of a codec across groups;
- :mod:`~ddp_plugin.fault_tolerance.plugins`: the plugins of a fit with replica groups, on the hook contract
  (members that come and go).

torchft is an extra (``pip install ddp_plugin[torchft]``), imported only when the flag is on.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

from ddp_plugin.fault_tolerance.options import FaultTolerance

if TYPE_CHECKING:
    from datetime import timedelta

    import lightning.pytorch as pl
    import torch
    from torch.optim import Optimizer

    from ddp_plugin.fault_tolerance.plugins import ReplicaGroupPlugins
    from ddp_plugin.hookspecs import Topology
    from ddp_plugin.parallel.ties import Tie

__all__ = ["FaultTolerance", "fit_plugins"]


def fit_plugins(options: FaultTolerance, module: pl.LightningModule, optimizers: Callable[[], list[Optimizer]],
                topology: Topology, device: torch.device, timeout: timedelta | None,
                per_step: bool, ties: Iterable[Tie] = (), sync_mode: bool = False) -> ReplicaGroupPlugins:
    """This rank's torchft Manager, as the fit's plugins: the member plugin (healing ``module``, ``optimizers()``
    and the fit loop), the reducer's and the sharder's cross stage, and the sync mode's transport.
    ``per_step``: a quorum per optimizer step (the synchronous route, or a sync mode's warm-up steps);
    ``sync_mode``: a sync mode runs (a returning group may then heal in the background)."""
    if importlib.util.find_spec("torchft") is None:
        raise ImportError("`fault_tolerance` runs on torchft: `pip install ddp_plugin[torchft]` (or `pip install"
                          " torchft`).")
    from ddp_plugin.fault_tolerance.plugins import ReplicaGroupMember, replica_group_plugins
    from ddp_plugin.fault_tolerance.replicas import ReplicaGroups

    # (torchft's group rank: the rank in the group's world, every tensor-parallel position and stage its own)
    rank = topology.global_rank(topology.rank)
    size = topology.world_size * topology.tensor_parallel_size * topology.pipeline_parallel_size
    replicas = ReplicaGroups(options, rank, size, device, timeout, per_step=per_step, sync_mode=sync_mode)
    replicas.ties = list(ties)
    return replica_group_plugins(replicas, ReplicaGroupMember(replicas, module, optimizers, topology), sync_mode)
