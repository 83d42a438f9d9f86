"""Checkpoints:

- :mod:`~ddp_plugin.checkpoints.checkpointing`: ``Checkpoints``, the strategy's routing (what is saved and loaded,
  through which hook, in which layout);
- :mod:`~ddp_plugin.checkpoints.checkpoint_io`: atomic, streamed files; messages for bad files and full disks;
- :mod:`~ddp_plugin.checkpoints.sharded_checkpoint`: ``checkpoint="sharded"`` through
  ``torch.distributed.checkpoint``, and ``consolidate()``;
- :mod:`~ddp_plugin.checkpoints.pretrained`: ``pretrained=`` weights read into each rank's part.
"""
