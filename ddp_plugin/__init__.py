"""ddp_plugin: data-parallel training that is cheap on slow inter-node links.

Importing the package registers the Lightning strategy names (``"hierarchical_zero"`` and friends)::

    import lightning as L
    import ddp_plugin

    trainer = L.Trainer(accelerator="cpu", devices=4, strategy="hierarchical_zero")
"""

from __future__ import annotations

from lightning.pytorch.strategies import StrategyRegistry

from ddp_plugin.hookspecs import Bucket, Topology, hookimpl, hookspec
from ddp_plugin.strategy import HierarchicalZeroStrategy

__version__ = "0.1.0"

__all__ = ["Bucket", "HierarchicalZeroStrategy", "Topology", "hookimpl", "hookspec"]

if "hierarchical_zero" not in StrategyRegistry:
    HierarchicalZeroStrategy.register_strategies(StrategyRegistry)
