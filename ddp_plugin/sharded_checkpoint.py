"""``ddp_plugin.sharded_checkpoint``, the path 0.1.0 documented (``consolidate()``): the module is
:mod:`ddp_plugin.checkpoints.sharded_checkpoint`, re-exported here for code that imports it."""

from ddp_plugin.checkpoints.sharded_checkpoint import consolidate, is_sharded_checkpoint, load, save

__all__ = ["consolidate", "is_sharded_checkpoint", "load", "save"]
