"""Replica groups on torchft (``fault_tolerance=``): a lost group does not stop the others, a returning one heals
from a live peer (docs/fault_tolerance.md).

- :mod:`~ddp_plugin.fault_tolerance.options`: the flag, checked at construction;
- :mod:`~ddp_plugin.fault_tolerance.replicas`: this rank's torchft Manager (quorum, commit, healing);
- :mod:`~ddp_plugin.fault_tolerance.reducer`: the hierarchical reducer's cross stage through it;
- :mod:`~ddp_plugin.fault_tolerance.sync`: the sync modes' outer syncs through it;
- :mod:`~ddp_plugin.fault_tolerance.healing`: what a returning group receives;
- :mod:`~ddp_plugin.fault_tolerance.communicator`: the collectives of a codec across groups;
- :mod:`~ddp_plugin.fault_tolerance.plugins`: the plugins of a fit with replica groups.

torchft is an extra (``pip install ddp_plugin[torchft]``), imported only when the flag is on.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

from ddp_plugin.fault_tolerance.options import FaultTolerance

if TYPE_CHECKING:
    import lightning.pytorch as pl
    import torch
    from torch.optim import Optimizer

    from ddp_plugin.config import StrategyConfig
    from ddp_plugin.fault_tolerance.replicas import ReplicaGroups
    from ddp_plugin.hookspecs import Topology
    from ddp_plugin.parallel.ties import Tie

__all__ = ["FaultTolerance", "start_replicas"]


def start_replicas(config: StrategyConfig, module: pl.LightningModule, optimizers: Callable[[], list[Optimizer]],
                   topology: Topology, device: torch.device, ties: Iterable[Tie] = ()) -> ReplicaGroups:
    """This rank's Manager, its healing state the module's, ``optimizers()``' and the fit loop's."""
    if importlib.util.find_spec("torchft") is None:
        raise ImportError("`fault_tolerance` runs on torchft: `pip install ddp_plugin[torchft]` (or `pip install"
                          " torchft`).")
    from ddp_plugin.fault_tolerance.healing import fit_state, load_fit_state, unify_group
    from ddp_plugin.fault_tolerance.replicas import ReplicaGroups

    # (torchft's group rank: the rank in the group's world, every tensor-parallel position and stage its own)
    rank = topology.global_rank(topology.rank)
    size = topology.world_size * topology.tensor_parallel_size * topology.pipeline_parallel_size
    replicas = ReplicaGroups(config.fault_tolerance, rank, size, device,
                             lambda: fit_state(module, optimizers(), replicas.healed_elsewhere()),
                             lambda state: load_fit_state(module, optimizers(), state, replicas.healed_elsewhere()),
                             config.timeout, per_step=config.sync_every == 1 or config.sync_warmup_steps > 0)
    replicas.ties = list(ties)
    replicas.unify.append(lambda: unify_group(module, optimizers(), replicas.healed_elsewhere(),
                                              topology.side_world_group, topology.tensor_parallel_group,
                                              replicas.ties))
    return replicas
