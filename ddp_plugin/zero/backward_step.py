"""``optimizer_in_backward``: at ZeRO stages 2-3, each bucket's shard is stepped as soon as its gradient is reduced,
on the communication thread, while backward goes on with the next units; its gradient shard is freed there.
Without it, every gradient shard waits for the optimizer step after backward, so a rank holds them all (S/N) at
the end of backward beside the units it gathers; with it, one bucket's at a time. (torchtune's
``optimizer_in_bwd``; FSDP2 users register the step as a post-accumulate-grad hook.)

The update of each element is the one the step after backward would make: the optimizers a ZeRO stage accepts
are elementwise (:mod:`ddp_plugin.zero.optimizer`), the hyperparameters are read from the user's
``param_groups`` when the bucket is stepped (a scheduler's learning rate of this step), and the state is the
user's optimizer's own. What differs is when: before the global gradient norm is known (so no clipping), before
any check of the whole step's gradients (non-finite steps, a loss scaler's), and before the members of
fault tolerance commit the step.
Those are refused at construction or setup (:func:`check_flags`, :func:`check_trainer`).

A bucket is stepped in backward only where this rank gave every one of its parameters a gradient. A bucket with
a parameter this rank did not use is stepped after backward, with the others', once the ranks agreed on which
parameters some rank used: one no rank used keeps no gradient and is not stepped, as without the flag.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ddp_plugin.zero.optimizer import step_subset

if TYPE_CHECKING:
    from collections.abc import Mapping

    from torch.optim import Optimizer

    from ddp_plugin.zero.offload import Offload
    from ddp_plugin.zero.shards import FlatShard


def check_flags(flags: Mapping[str, Any]) -> None:
    """The flags ``optimizer_in_backward=True`` cannot go with, named with what to change."""
    if not flags.get("optimizer_in_backward"):
        return
    why = "steps each bucket's shard as soon as its gradient is reduced, in backward"
    refused = [
        (flags["zero_stage"] not in (2, 3), f"`zero_stage={flags['zero_stage']}`: it needs `zero_stage=2` or `3`"
         " (at stages 0-1 the gradients are whole until the step)"),
        (flags["gradient_clip_norm"] is not None, f"`gradient_clip_norm={flags['gradient_clip_norm']}`: clipping"
         " needs the global norm of every gradient before any is applied"),
        (bool(flags["skip_nonfinite"]), "`skip_nonfinite=True`: whether to skip is known only once every bucket"
         " is reduced"),
        (flags["sync_every"] > 1, f"`sync_every={flags['sync_every']}`: the sync modes are not supported with it yet"),
        (flags["fault_tolerance"] is not None, "`fault_tolerance`: the step is applied only once the members"
         " commit it, after backward"),
        (flags["tensor_parallel_size"] != 1, f"`tensor_parallel_size={flags['tensor_parallel_size']}`: a replicated"
         " parameter's bucket is reduced on one tensor-parallel rank and broadcast to the others"),
        (flags["pipeline_parallel_size"] > 1, f"`pipeline_parallel_size={flags['pipeline_parallel_size']}`: a"
         " parameter several stages hold gets its gradient from the other stages after backward"),
    ]
    for bad, what in refused:
        if bad:
            raise ValueError(f"`optimizer_in_backward=True` {why}, which cannot go with {what}. Allowed: drop one"
                             " of the two.")


def check_trainer(gradient_clip_val: float | None, automatic_optimization: bool, loss_scaler: bool) -> None:
    """The Trainer's settings ``optimizer_in_backward=True`` cannot go with (at setup)."""
    if gradient_clip_val is not None:
        raise ValueError(f"`optimizer_in_backward=True` cannot go with `Trainer(gradient_clip_val={gradient_clip_val})`:"
                         " clipping needs the global norm of every gradient before any is applied, and each bucket is"
                         " stepped as soon as its gradient is reduced. Drop one of the two.")
    if not automatic_optimization:
        raise ValueError("`optimizer_in_backward=True` needs Lightning's automatic optimization: with"
                         " `automatic_optimization = False` the LightningModule calls the optimizer itself, and every"
                         " `manual_backward` would step it.")
    if loss_scaler:
        raise ValueError("`optimizer_in_backward=True` cannot go with a loss scaler (`precision='16-mixed'`): the"
                         " scaler skips a step after backward if any gradient overflowed, and the buckets are stepped"
                         " in backward. Use `precision='bf16-mixed'` or `'32-true'`.")


class StepInBackward:
    """Steps the buckets whose gradient shards are reduced (on the communication thread), and remembers which
    were, for the sharder's ``on_after_backward``."""

    def __init__(self, offload: Offload | None = None) -> None:
        self.offload = offload
        """Where the buckets' optimizer state is kept between steps (brought in before, sent out after)."""
        self.optimizer: Optimizer | None = None
        self.stepped: set[int] = set()
        """Buckets stepped in this backward (their pieces keep no gradient for the step after it)."""
        self.count = 0
        """Buckets stepped in backward since the last metrics collection: ``zero/buckets_stepped_in_backward``."""
        self.total = 0
        """Buckets stepped in backward in all."""

    def set_optimizer(self, optimizer: Optimizer) -> None:
        self.optimizer = optimizer  # (Lightning's automatic optimization has one; a new fit sets up a new one)

    def step(self, index: int, entry: FlatShard) -> None:
        """Step bucket ``index``'s pieces with their part of ``entry.grad``, then free it."""
        grad, entry.grad = entry.grad, None
        params = []
        for piece in entry.pieces:
            piece.param.grad = grad[piece.at : piece.at + piece.param.numel()]
            params.append(piece.param)
        if self.offload is not None:
            self.offload.fetch(index)
            self.offload.before_step(index)
        try:
            if params:
                step_subset(self.optimizer, params)
        finally:
            for p in params:
                p.grad = None
        if self.offload is not None:
            self.offload.after_step(index)
        self.stepped.add(index)
        self.count += 1
        self.total += 1
