"""ZeRO sharding: optimizer state (stage 1), gradients (stage 2) and parameters (stage 3) split across ranks.

Every gradient bucket is split into P equal shards. With ``shard_scope="global"`` P is the world size; with
``"node"`` P is the ranks per node, and each node holds a full replica (HSDP, DeepSpeed ZeRO++ hpZ): parameter
all-gathers never cross the slow link, at the price of P times more memory for the sharded parts.

Modules, one job each:

- :mod:`~ddp_plugin.zero.layout`: which shard is this rank's, and over which groups (``ShardLayout``, ``Scope``);
- :mod:`~ddp_plugin.zero.shards`: the flat parameters, this rank's shard and its pieces, the all-gathers;
- :mod:`~ddp_plugin.zero.reduce`: a bucket reduced to this rank's shard during backward;
- :mod:`~ddp_plugin.zero.units`: stage 3 units, planned from ``auto_wrap_policy``, gathered and freed;
- :mod:`~ddp_plugin.zero.optimizer`: which optimizers may be sharded, and the optimizer re-pointed at pieces;
- :mod:`~ddp_plugin.zero.gradients`: norms, clipping and whole gradients lent to user hooks;
- :mod:`~ddp_plugin.zero.checkpoint`: consolidated and per-rank checkpoint layouts;
- :mod:`~ddp_plugin.zero.plugin`: ``ZeroSharder``, the plugin that wires the hooks to them.
"""

from ddp_plugin.zero.layout import Scope, ShardLayout
from ddp_plugin.zero.optimizer import ELEMENTWISE_OPTIMIZERS, allow_optimizer, check_optimizer
from ddp_plugin.zero.plugin import ZeroSharder
from ddp_plugin.zero.units import DEFAULT_UNIT_PARAMS, check_auto_wrap_policy, is_called

__all__ = [
    "DEFAULT_UNIT_PARAMS", "ELEMENTWISE_OPTIMIZERS", "Scope", "ShardLayout", "ZeroSharder", "allow_optimizer",
    "check_auto_wrap_policy", "check_optimizer", "is_called",
]
