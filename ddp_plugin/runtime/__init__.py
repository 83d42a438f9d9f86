"""The bottom layer: what every other package may import, and which imports none of them (only the hook
contract, :mod:`ddp_plugin.hookspecs`, and :mod:`ddp_plugin.health`). A helper that several layers need goes
here; one that needs a plugin, the engine or the strategy does not (``tests/test_layout.py``'s ``LAYERS``).

- :mod:`~ddp_plugin.runtime.comm`: ``TracedCommunicator``, the collectives plugins use, with traffic accounting;
- :mod:`~ddp_plugin.runtime.topology`: the ranks' layout (``Layout``) and the device meshes with their groups;
- :mod:`~ddp_plugin.runtime.streams`, :mod:`~ddp_plugin.runtime.clock`: the side threads with their CUDA
  streams, device-time stamps;
- :mod:`~ddp_plugin.runtime.checks`: one validation helper per kind of value (the flags' and the codecs'
  options);
- :mod:`~ddp_plugin.runtime.finite`, :mod:`~ddp_plugin.runtime.cpu_memory`, :mod:`~ddp_plugin.runtime.storage`:
  a NaN/Inf check without a temporary, glibc's mmap threshold, whether a tensor has memory behind its shape;
- :mod:`~ddp_plugin.runtime.answers`: the dicts several plugins answered one hook with, merged.
"""
