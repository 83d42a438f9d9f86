"""Traffic accounting: what each step sent inside nodes and across them, and how long backward waited."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from ddp_plugin.hookspecs import hookimpl

if TYPE_CHECKING:
    from ddp_plugin.hookspecs import Bucket, Communicator

MB = 1e6


class TrafficAccounting:
    """Per optimizer step and per rank, from what each collective moves (the communicator handed to ``on_setup``
    records it):

    - ``comm/intra_node_MB``, ``comm/cross_node_MB``: megabytes sent to ranks on this node and on other nodes.
      Cross-node bytes are what the slow link carries; summed over a node's ranks they match the node's
      network counters (tested against the kernel's within 5%; measured 0.3% below for large messages, 5.4%
      below for PowerSGD's small ones, where frame headers and ACKs weigh more).
    - ``comm/compression_ratio``: bytes a plain averaging all-reduce would have sent in the cross-node stage
      over the bytes the codec sent (1.0 without a codec).
    - ``comm/time_ms``: from the first bucket's launch to the last bucket's completion;
      ``comm/wait_ms``: how long backward waited for it at its end;
      ``comm/hidden_share``: the share of communication time hidden behind backward, 1 - wait / time.
    """

    def __init__(self) -> None:
        self._comm: Communicator | None = None
        self._reset()

    def _reset(self) -> None:
        self.intra_node_bytes = 0
        self.cross_node_bytes = 0
        self.wait_s = 0.0
        self.comm_s = 0.0
        self.plain_bytes = 0.0
        self.codec_bytes = 0
        self._first_launch: float | None = None
        self._last_done = 0.0

    @hookimpl(wrapper=True)
    def on_bucket_ready(self, bucket: Bucket):
        now = time.perf_counter()
        if self._first_launch is None:
            self._first_launch = now
        future = yield

        def done(_: torch.futures.Future) -> None:
            self._last_done = max(self._last_done, time.perf_counter())

        if future is not None:
            future.add_done_callback(done)
        return future

    @hookimpl(wrapper=True)
    def on_cross_node_reduce(self, tensor: torch.Tensor, group: dist.ProcessGroup):
        before = self._comm.bytes_sent_by_this_thread()
        future = yield
        n = dist.get_world_size(group)
        self.plain_bytes += 2 * (n - 1) / n * tensor.numel() * tensor.element_size()
        self.codec_bytes += self._comm.bytes_sent_by_this_thread() - before
        return future

    @hookimpl
    def on_setup(self, comm: Communicator) -> None:
        self._comm = comm
        comm.take_traffic()  # start from zero: setup's own traffic is not a step's

    @hookimpl
    def on_after_backward(self, buckets: Sequence[Bucket], sync_wait_s: float) -> None:
        traffic = self._comm.take_traffic()
        self.intra_node_bytes += traffic.intra_node_bytes
        self.cross_node_bytes += traffic.cross_node_bytes
        self.wait_s += sync_wait_s
        if self._first_launch is not None:
            self.comm_s += max(self._last_done - self._first_launch, sync_wait_s)
        self._first_launch = None

    @hookimpl
    def on_collect_metrics(self) -> dict[str, float]:
        metrics = {
            "comm/intra_node_MB": self.intra_node_bytes / MB,
            "comm/cross_node_MB": self.cross_node_bytes / MB,
            "comm/compression_ratio": self.plain_bytes / self.codec_bytes if self.codec_bytes else 1.0,
            "comm/time_ms": self.comm_s * 1e3,
            "comm/wait_ms": self.wait_s * 1e3,
            "comm/hidden_share": 1.0 - self.wait_s / self.comm_s if self.comm_s > 0 else 0.0,
        }
        self._reset()
        return metrics
