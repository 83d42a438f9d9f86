"""The gradient path's machinery, beside its plugins (:mod:`ddp_plugin.plugins`, :mod:`ddp_plugin.codecs`,
:mod:`ddp_plugin.zero`, :mod:`ddp_plugin.sync`):

- :mod:`~ddp_plugin.gradients.engine`: buckets, readiness, launch order, the sync point;
- :mod:`~ddp_plugin.gradients.comm`: the collectives plugins use, with traffic accounting;
- :mod:`~ddp_plugin.gradients.plugin_manager`: a ``fit``'s plugins assembled (built-ins, installed, the user's);
- :mod:`~ddp_plugin.gradients.topology`: the ranks' layout and the device meshes with their groups;
- :mod:`~ddp_plugin.gradients.link_choices`, :mod:`~ddp_plugin.gradients.link_probe`,
  :mod:`~ddp_plugin.gradients.planning`: what the links decide (the probe, the cost model, the plan);
- :mod:`~ddp_plugin.gradients.streams`, :mod:`~ddp_plugin.gradients.clock`: the side threads with their CUDA
  streams, device-time stamps;
- :mod:`~ddp_plugin.gradients.checks`: one validation helper per kind of value (the flags' and the codecs'
  options);
- :mod:`~ddp_plugin.gradients.finite`, :mod:`~ddp_plugin.gradients.cpu_memory`: a NaN/Inf check without a
  temporary, glibc's mmap threshold.
"""
