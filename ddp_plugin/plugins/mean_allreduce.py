"""The default cross-node stage: a plain averaging all-reduce, what DDP does without a comm hook."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch.distributed as dist

from ddp_plugin.hookspecs import completed_future, hookimpl

if TYPE_CHECKING:
    import torch
    from torch import Tensor

    from ddp_plugin.hookspecs import Communicator


class MeanAllReduce:
    """Average a tensor over a group with one all-reduce. Cost: a ring all-reduce sends 2(n-1)/n of the
    tensor per rank. Registered ``trylast``, so any codec plugin answers ``on_cross_node_reduce`` first."""

    def __init__(self) -> None:
        self._comm: Communicator | None = None

    @hookimpl
    def on_setup(self, comm: Communicator) -> None:
        self._comm = comm

    @hookimpl(trylast=True)
    def on_cross_node_reduce(self, tensor: Tensor, group: dist.ProcessGroup) -> torch.futures.Future:
        size = dist.get_world_size(group)
        if size == 1:
            return completed_future(tensor)
        # Divide before summing, as DDP does: keeps low-precision sums in range.
        tensor.div_(size)
        return self._comm.all_reduce(tensor, group=group, async_op=True).get_future()
