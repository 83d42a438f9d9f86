"""Checkpoint files, below the parallelisms and the plugins that fill them (they import only
:mod:`ddp_plugin.health`):

- :mod:`~ddp_plugin.checkpoints.checkpoint_io`: atomic, streamed files; messages for bad files and full disks;
- :mod:`~ddp_plugin.checkpoints.sharded_checkpoint`: ``checkpoint="sharded"`` through
  ``torch.distributed.checkpoint``, and ``consolidate()``;
- :mod:`~ddp_plugin.checkpoints.pretrained`: ``pretrained=`` weights read into each rank's part.

What is saved and loaded, through which hook and in which layout is the strategy's routing
(:mod:`ddp_plugin.strategy.checkpointing`), which asks every plugin and parallelism for its part.
"""
