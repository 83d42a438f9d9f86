"""The timed window of a benchmark on the simulated cluster, as a Lightning callback every rank runs: after
``warmup`` steps, ``steps`` steps long. Shared by the GPT benchmarks (``benchmarks/tensor_parallel.py``,
``benchmarks/pipeline.py``).

- batch start times on every rank (the interval from one batch's start to the next's counts every sync);
- the node link's kernel tx bytes (``simcluster.link_bytes``, read by the node's local rank 0) and our own
  ``comm/cross_node_MB`` at the window's start and end, each after a barrier;
- the loss of every timed step.

:meth:`StepWindow.result` is a rank's record of the run, which the benchmark writes as JSON for its driver.
"""

from __future__ import annotations

import os
import resource
import time
from typing import Any

import lightning as L
import torch.distributed as dist

from ddp_plugin.testing.simcluster import link_bytes

__all__ = ["StepWindow"]


class StepWindow(L.Callback):
    def __init__(self, warmup: int, steps: int) -> None:
        self.warmup, self.window = warmup, steps
        self.starts: list[float] = []
        self.counters: dict[str, dict[str, int]] = {}
        self.losses: list[float] = []
        self.ours: dict[str, float] = {}

    def _mark(self, trainer: L.Trainer, what: str) -> None:
        dist.barrier()
        if int(os.environ["LOCAL_RANK"]) == 0:
            self.counters[what] = link_bytes()
        totals = getattr(trainer.strategy, "metric_totals", None)  # (ours; Lightning's strategies have none)
        if totals is not None:
            self.ours[what] = totals.get("comm/cross_node_MB", 0.0)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if batch_idx == self.warmup:
            self._mark(trainer, "start")
        if batch_idx >= self.warmup:
            self.starts.append(time.perf_counter())

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if batch_idx >= self.warmup:
            self.losses.append(float(outputs["loss"]))
        if batch_idx == self.warmup + self.window - 1:
            self._mark(trainer, "end")
            self.starts.append(time.perf_counter())

    def result(self, error: str | None) -> dict[str, Any]:
        """This rank's record: rank, node, peak RSS, and (without ``error``) the window's intervals, losses, link
        bytes and our accounting."""
        rank = int(os.environ["RANK"])
        out: dict[str, Any] = {"rank": rank, "node": rank // int(os.environ["LOCAL_WORLD_SIZE"]),
                               "maxrss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}
        if error:
            out["error"] = error[:500]
            return out
        out["interval_s"] = [b - a for a, b in zip(self.starts, self.starts[1:])]
        out["losses"] = self.losses
        if self.counters:
            out["tx_bytes"] = self.counters["end"]["tx"] - self.counters["start"]["tx"]
        if self.ours:
            out["ours_mb"] = self.ours["end"] - self.ours["start"]
        return out
