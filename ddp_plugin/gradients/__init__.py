"""The gradient path's machinery, beside its plugins (:mod:`ddp_plugin.plugins`, :mod:`ddp_plugin.codecs`,
:mod:`ddp_plugin.zero`, :mod:`ddp_plugin.sync`):

- :mod:`~ddp_plugin.gradients.engine`: buckets, readiness, launch order, the sync point;
- :mod:`~ddp_plugin.gradients.planning`: the links' cost model and the plan it chooses (route, codec, bucket
  size); the probe that measures the links and the choices made from it are the strategy's
  (:mod:`ddp_plugin.strategy.link_probe`, :mod:`ddp_plugin.strategy.link_choices`), which assemble the plugins.

Below it, :mod:`ddp_plugin.runtime` (the communicator, the topology, streams, clocks, checks); above it, the
plugins, then fault tolerance, then the strategy (``tests/test_layout.py``'s ``LAYERS``).
"""
