"""Sync modes for slow links: synchronizing across nodes every ``sync_every`` optimizer steps instead of every
step (local SGD, DiLoCo), in staggered fragments (Streaming DiLoCo), with bounded staleness; inside a node the
ranks stay synchronous. See :mod:`ddp_plugin.sync.plugin` for the algorithm and docs/sync.md for when to use it.

- :mod:`~ddp_plugin.sync.schedule`: which fragment crosses nodes after which step, and which elements make up
  each fragment (pure arithmetic);
- :mod:`~ddp_plugin.sync.plugin`: ``OuterSync``, the plugin on the hook contract.
"""

from ddp_plugin.sync.plugin import OuterSync, build_outer_optimizer
from ddp_plugin.sync.schedule import SyncSchedule, fragment_bounds

__all__ = ["OuterSync", "SyncSchedule", "build_outer_optimizer", "fragment_bounds"]
