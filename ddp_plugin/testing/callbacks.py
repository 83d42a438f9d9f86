"""Lightning callbacks that record what training did, for a test to compare afterwards.

- :class:`ExitReport`: the line ``rank R exits after S s (at T): Error: message`` when ``fit`` fails, printed from
  the Trainer's ``on_exception``, which a fault test reads to learn when each survivor gave up.
- :class:`ParameterHistory`: after every optimizer step, the whole parameter vector (C2: compare it with a
  single-process run's) and the largest difference between ranks (C1: it must stay 0.0)::

      history = ParameterHistory()
      trainer = L.Trainer(..., callbacks=[history])
      trainer.fit(model)
      torch.save({"history": torch.stack(history.history), "max_rank_diff": history.max_rank_diff}, path)
"""

from __future__ import annotations

import contextlib
import time
from typing import Any

import lightning as L
import torch

from ddp_plugin.testing.processes import print_line
from ddp_plugin.testing.ranks import flat_parameters, max_rank_difference

__all__ = ["ExitReport", "ParameterHistory", "SaveAt"]


class ParameterHistory(L.Callback):
    """After every optimizer step (not after the inner batches of gradient accumulation): the full parameter
    vector, on the CPU, in ``history``; the largest elementwise difference from rank 0 so far in
    ``max_rank_diff`` (with more than one rank: an all-gather, so every rank must run it); the device training
    ran on in ``device`` (Lightning moves the model to the CPU after ``fit``). At ZeRO stage 3 the parameters are
    read inside ``strategy.full_parameters()``."""

    def __init__(self) -> None:
        self.history: list[torch.Tensor] = []
        self.max_rank_diff = 0.0
        self.device = ""
        self._last_step = 0

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if trainer.global_step == self._last_step:
            return
        self._last_step = trainer.global_step
        full = getattr(trainer.strategy, "full_parameters", contextlib.nullcontext)
        with full():
            flat = flat_parameters(pl_module)
        self.device = str(flat.device)
        self.history.append(flat.cpu())
        if trainer.world_size > 1:
            self.max_rank_diff = max(self.max_rank_diff, max_rank_difference(trainer.strategy, flat))


class ExitReport(L.Callback):
    """Print ``rank R exits after S s (at T): Error: message`` when ``fit`` fails (``S`` from construction).

    Printed in ``on_exception``, which Lightning calls before its teardown: the teardown puts back the signal
    handlers of before ``fit`` (the default action for SIGTERM), so a launcher's SIGTERM to the survivors of a dead
    rank, arriving right after, would end a rank before a line printed after ``fit`` raised."""

    def __init__(self) -> None:
        self.start = time.time()
        self.reported = False

    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        self.report(trainer.global_rank, exception)

    def report(self, rank: int, err: BaseException) -> None:
        """Print the line once (also for an error raised outside the Trainer's handling)."""
        if self.reported:
            return
        self.reported = True
        now = time.time()
        print_line(f"rank {rank} exits after {now - self.start:.1f} s (at {now:.3f}): {type(err).__name__}: {err}")


class SaveAt(L.Callback):
    """Save a checkpoint to ``path`` after optimizer step ``step``. Give it a step that ends an epoch: a run
    resumed from it starts the next epoch, whose batches are the uninterrupted run's (an interrupted epoch would
    restart from its first batch)."""

    def __init__(self, step: int, path: str) -> None:
        self.step, self.path = step, path

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step == self.step:
            trainer.save_checkpoint(self.path)
