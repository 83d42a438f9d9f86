"""The plugins of a ``fit`` with replica groups: the reducer and the sync mode whose steps between groups go
through torchft, and the codec that codes what crosses groups, its state added to what a returning group
receives, and the ZeRO sharder's shards heal in place of the module's parameters."""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

from ddp_plugin.fault_tolerance.healing import heal_codec, heal_sharder
from ddp_plugin.fault_tolerance.reducer import ReplicaGroupReducer
from ddp_plugin.fault_tolerance.sync import ReplicaGroupSync
from ddp_plugin.plugin_manager import cross_node_codec

if TYPE_CHECKING:
    import pluggy

    from ddp_plugin.fault_tolerance.replicas import ReplicaGroups


def replica_group_plugins(replicas: ReplicaGroups) -> dict[str, Any]:
    """``build_plugin_manager``'s ``reducer``, ``outer_sync`` and the ZeRO sharder's ``cross_stage`` (with a sync
    mode, the gradients' stage among the group's own nodes only)."""
    reducer = ReplicaGroupReducer(replicas)
    return {"reducer": reducer, "outer_sync": functools.partial(ReplicaGroupSync, replicas),
            "cross_stage": reducer.across}


def bind_plugins(replicas: ReplicaGroups, pm: pluggy.PluginManager) -> None:
    """Once ``pm`` is built: what crosses groups goes through its codec, whose shared state heals with the rest
    (the sync mode adds its own)."""
    sharder = pm.get_plugin("zero_sharder")
    if sharder is not None:
        heal_sharder(replicas, sharder)
    name = cross_node_codec(pm)
    if name is not None:
        replicas.coded = True
        heal_codec(replicas, pm.get_plugin(name))
