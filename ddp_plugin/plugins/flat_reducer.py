"""The flat reducer: one stage over every rank, like DDP."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ddp_plugin.hookspecs import hookimpl

if TYPE_CHECKING:
    import torch
    from pluggy import HookRelay

    from ddp_plugin.hookspecs import Bucket, Communicator, Topology


class FlatReducer:
    """Average each bucket over the whole world through ``on_cross_node_reduce``.

    With one node that is all there is; with several nodes the whole bucket crosses the slow link, which is
    what the hierarchical reducer avoids. A codec therefore compresses the whole bucket here.
    """

    def __init__(self) -> None:
        self._hook: HookRelay | None = None
        self._topology: Topology | None = None
        self._comm: Communicator | None = None

    @hookimpl
    def on_setup(self, topology: Topology, hook: HookRelay, comm: Communicator) -> None:
        self._topology = topology
        self._hook = hook
        self._comm = comm

    @hookimpl(trylast=True)
    def on_bucket_ready(self, bucket: Bucket) -> torch.futures.Future:
        assert self._hook is not None and self._topology is not None, "on_setup must run before backward"
        return self._hook.on_cross_node_reduce(
            tensor=bucket.buffer, group=self._topology.world_group, bucket=bucket, offset=0
        )
