"""The hook contract of ddp_plugin.

Everything a plugin author needs lives in this package: the markers (:data:`hookimpl`, :data:`hookspec`),
the hook specifications (:mod:`ddp_plugin.hookspecs.hooks`) and the small value types that hooks exchange
(:class:`Bucket`, :class:`Topology`, :class:`Options`, :class:`DeferredTensor`), the interface of the
collectives a plugin may use (:class:`Communicator`, handed to ``on_setup``), and the functions that read a
parameter that may be a DTensor or a pipeline stage's copy (:mod:`ddp_plugin.hookspecs.tensors`). Plugins import from here and
never from the strategy's internals.

It is installed as ``ddp_plugin.hookspecs`` (the repository keeps it in the top-level ``hookspecs/`` folder).
"""

from __future__ import annotations

import pluggy

PROJECT_NAME = "ddp_plugin"
"""The pluggy project name; also the entry-point group third-party plugins declare."""

hookspec = pluggy.HookspecMarker(PROJECT_NAME)
hookimpl = pluggy.HookimplMarker(PROJECT_NAME)

from ddp_plugin.hookspecs.tensors import (  # noqa: E402
    as_parameter_layout,
    block_key,
    is_tensor_parallel_shard,
    local_part_of_whole,
    local_tensor,
    pipeline_copies,
    set_local_data,
    set_local_grad,
    tensor_parallel_blocks,
)
from ddp_plugin.hookspecs.types import (  # noqa: E402
    Bucket,
    Communicator,
    DeferredStorage,
    DeferredTensor,
    Options,
    ParameterShards,
    Topology,
    Traffic,
    completed_future,
)

__all__ = [
    "PROJECT_NAME", "Bucket", "Communicator", "DeferredStorage", "DeferredTensor", "Options", "ParameterShards",
    "Topology", "Traffic", "as_parameter_layout", "block_key", "completed_future", "hookimpl", "hookspec",
    "is_tensor_parallel_shard", "local_part_of_whole", "local_tensor", "pipeline_copies", "set_local_data",
    "set_local_grad", "tensor_parallel_blocks",
]
