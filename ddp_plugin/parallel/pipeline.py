"""Pipeline stages: the module split into stages over ``pipeline_parallel_size`` ranks, run by
``torch.distributed.pipelining``'s schedules, with parameters shared across stages (a tied embedding and output
head) kept bit-identical.

The user contract (docs/pipeline.md):

- The model is a module whose children, in registration order, are modules before a ``ModuleList`` of blocks,
  or a ``ModuleDict`` of them keyed by layer id as torchtitan's models hold theirs (they go to the first stage),
  the blocks (split into contiguous runs balanced by parameter count) and modules after it (the last stage). Its
  ``forward`` tolerates the missing ones: a child another stage holds is ``None``, and the block list (or dict)
  holds this stage's blocks only, under their original indices or keys (torchtitan's manual split).
- ``training_step`` computes its loss as ``self.pipeline_loss(self.model(x), y)``, where ``pipeline_loss(output,
  target)`` is a method of the LightningModule. Under ``ddp`` that is an ordinary call. Here the model's call
  returns a placeholder holding ``x``, and ``pipeline_loss`` runs the schedule over the microbatches of ``x`` and
  ``y`` (forward and backward, ``pipeline_loss`` on the last stage per microbatch) and returns the mean loss,
  known on every stage; ``self.log`` and the returned loss then work as in any Lightning run.
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from ddp_plugin.parallel.stages import forward_replaced, wrap_output
from ddp_plugin.parallel.stage_checkpoint import StageCheckpoint
from ddp_plugin.parallel.stage_module import ACTIVATION_DTYPES, StageModule
from ddp_plugin.parallel.ties import Tie, TiedGradients

if TYPE_CHECKING:
    from torch.amp import GradScaler

    from ddp_plugin.gradients.engine import GradientEngine

    from ddp_plugin.parallel.stages import StagePlan


class PipelineOutput:
    """What the model's call returns inside a pipelined ``training_step``: a placeholder for the output that
    exists only on the last stage, microbatch by microbatch. Pass it to ``self.pipeline_loss``."""

    def __init__(self, args: tuple[Any, ...], kwargs: dict[str, Any], output: str = "") -> None:
        self.args, self.kwargs = args, kwargs
        self.output = output
        """A Hugging Face model's output attribute (``"logits"``): ``self.model(x).logits`` is this placeholder."""

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") or name in ("args", "kwargs", "output"):  # (copy, pickle and friends probe)
            raise AttributeError(name)
        if name == self.__dict__.get("output"):
            return self
        raise AttributeError(
            "With `pipeline_parallel_size` > 1 the model's output exists on the last stage only, one microbatch at a"
            " time: in `training_step` pass it straight to `self.pipeline_loss(output, target)`, which runs the"
            f" pipeline and returns the loss (asked for `.{name}`)."
        )


@contextmanager
def bounded_p2p_waits(group: dist.ProcessGroup, timeout: timedelta | None) -> Generator[None, None, None]:
    """Inside, the schedule's point-to-point sends and receives fail after ``timeout`` on gloo. gloo bounds a
    collective by the group's timeout, but a receive only by the timeout the group was created with (the connect
    timeout, minutes): a survivor of a stopped stage (SIGSTOP, a hung host, whose connections stay open) waited
    there for good. ``torch.distributed.pipelining`` waits for them through its ``_wait_batch_p2p``, which this
    replaces for the schedule's step with one that passes ``timeout`` to ``Work.wait`` (NCCL is left alone: its
    waits are stream waits, bounded by its watchdog)."""
    from torch.distributed.pipelining import schedules

    original = getattr(schedules, "_wait_batch_p2p", None)
    if timeout is None or original is None or dist.get_backend(group) != "gloo":
        yield
        return

    def wait_within_timeout(work: list[dist.Work]) -> None:
        for w in work:
            w.wait(timeout)

    schedules._wait_batch_p2p = wait_within_timeout
    try:
        yield
    finally:
        schedules._wait_batch_p2p = original


class PipelineRunner:
    """The stages of this rank and their schedule; runs a training or evaluation step."""

    def __init__(self, module: nn.Module, plan: StagePlan, schedule: str, microbatches: int,
                 pipeline_size: int, pipeline_rank: int, group: dist.ProcessGroup, device: torch.device,
                 ties: list[Tie], order: Sequence[str], loss_group: dist.ProcessGroup | None = None,
                 timeout: timedelta | None = None, activations: str = "fp32",
                 nodes: Sequence[int] | None = None) -> None:
        from torch.distributed.pipelining import PipelineStage
        from torch.distributed.pipelining.schedules import get_schedule_class

        self.module = module
        self.owner = module.get_submodule(plan.owner)
        self.plan = plan
        self.microbatches = microbatches
        self.size, self.rank, self.group = pipeline_size, pipeline_rank, group
        self.timeout = timeout
        self.ties = ties
        self.tied = TiedGradients(ties)
        """The sums of the ties' gradients (:func:`ddp_plugin.parallel.ties.synchronize` runs them)."""
        self.checkpoint = StageCheckpoint(module, group, pipeline_size, pipeline_rank, ties, order)
        """This rank's stages' state against the unsplit model's (the checkpoint routing asks it)."""
        self.loss_group = loss_group if loss_group is not None else group
        self.is_first = pipeline_rank == 0
        self.is_last = pipeline_rank == pipeline_size - 1
        self.stage_indices = list(range(pipeline_rank, plan.num_stages, pipeline_size))
        self.stages = [PipelineStage(StageModule(self.owner, plan, s), s, plan.num_stages, device, group=group)
                       for s in self.stage_indices]
        narrow = ACTIVATION_DTYPES[activations]
        if narrow is not None and nodes is not None:  # (`nodes`: the node of each pipeline rank)
            for stage in self.stages:
                module, s, here = stage.submod, stage.stage_index, nodes[stage.stage_index % pipeline_size]
                if not module.last and nodes[(s + 1) % pipeline_size] != here:
                    module.send_dtype = narrow
                if not module.first and nodes[(s - 1) % pipeline_size] != here:
                    module.widen, module.receive_dtype = True, narrow
        self._losses: list[Tensor] = []
        self._scale = 1.0
        self._loss_scaler: GradScaler | None = None
        self.comm: Any = None
        """The fit's communicator (``TracedCommunicator``, :meth:`attach`): the schedule's sends and the loss are
        counted in the traffic metrics. ``None`` outside a fit (not counted)."""
        self.device = device
        # torch's own names ("1F1B", "GPipe", "Interleaved1F1B"), case-insensitive
        self._schedule_class = get_schedule_class(schedule.replace("_", ""))
        self._schedule_stages = self.stages if schedule == "interleaved_1f1b" else self.stages[0]
        # The loss is scaled here (1/M, times sample weighting and 1/accumulate_grad_batches), not by the schedule.
        self.schedule = self._schedule_class(self._schedule_stages, microbatches, loss_fn=self._loss,
                                             scale_grads=False)
        self._predict: tuple[int, Any] | None = None
        """The forward-only schedule of ``trainer.predict`` and the rows of the batches it was set up for."""

    def attach(self, comm: Any, hook: Any) -> None:
        """A fit's communicator (its traffic counted) and, where a codec answers ``on_cross_node_reduce``, its hook
        relay (the tied gradients' sums go through the codec; ``None``: summed in fp32)."""
        self.comm = self.tied.comm = comm
        self.tied.hook = hook

    def _loss(self, output: Any, target: Any) -> Tensor:
        loss = type(self.module).pipeline_loss(self.module, output, target)
        self._losses.append(loss.detach())
        loss = loss * self._scale
        # Under a loss scaler (fp16), scaled as Lightning scales the loss before its backward, which the schedule
        # replaces: the scaler's unscale_ then finds the gradients it expects (as a tensor op: no host sync).
        return self._loss_scaler.scale(loss) if self._loss_scaler is not None else loss

    @contextmanager
    def model_call(self, forward: Callable[..., Any]) -> Generator[None, None, None]:
        """While the user's step runs, the model's call is ``forward`` (then the call outside steps again)."""
        with forward_replaced(self.owner, forward):
            yield

    def call_outside_steps(self) -> None:
        """From now until :meth:`release`, the model called outside a step runs the whole pipeline, forward only
        (:meth:`predict`, without gradients): collective, every stage returns the last stage's output, as a
        tensor-parallel model's call is collective. Lightning's model summary calls the module with
        ``example_input_array`` at the fit's start on every rank; the stage's own ``forward`` would run its blocks
        on the model's input."""

        def forward(*args: Any, **kwargs: Any) -> Any:
            with torch.no_grad():
                return self.predict(args, kwargs)

        self.owner.forward = forward

    def release(self) -> None:
        """The model's own ``forward`` back (at the strategy's teardown)."""
        self.owner.__dict__.pop("forward", None)

    @contextmanager
    def placeholders(self, run: Callable[[PipelineOutput, Any], Tensor]) -> Generator[list[bool], None, None]:
        """While the user's step runs: the model's call returns a :class:`PipelineOutput`, and
        ``pipeline_loss(output, target)`` calls ``run``. Yields a one-item list that is ``[True]`` once ``run``
        ran."""
        module = self.module
        ran = [False]

        def capture(*args: Any, **kwargs: Any) -> PipelineOutput:
            return PipelineOutput(args, kwargs, self.plan.output)

        def pipeline_loss(output: Any, target: Any) -> Tensor:
            if not isinstance(output, PipelineOutput):
                raise TypeError(
                    "With `pipeline_parallel_size` > 1, `pipeline_loss` takes the model's output as `training_step`"
                    " got it from `self.model(x)` (a placeholder: the output exists on the last stage only)."
                )
            ran[0] = True
            return run(output, target)

        module.pipeline_loss = pipeline_loss
        try:
            with self.model_call(capture):
                yield ran
        finally:
            del module.__dict__["pipeline_loss"]

    def run(self, output: PipelineOutput, target: Any, train: bool, scale: float,
            loss_scaler: GradScaler | None = None) -> Tensor:
        """One schedule step over the microbatches of ``output.args`` (the first stage's input) and ``target``
        (the last stage's); returns the mean loss over the microbatches, on every stage. Each microbatch's loss
        is multiplied by ``scale`` / microbatches, then scaled by ``loss_scaler`` (fp16's) if given."""
        batch = _batch_size(output.args, target)
        if batch % self.microbatches:
            raise ValueError(
                f"A batch of {batch} samples per data-parallel rank does not split into `pipeline_microbatches="
                f"{self.microbatches}` equal microbatches; use a batch size (per data-parallel rank) that is a"
                " multiple of it."
            )
        self._losses = []
        self._scale = scale / self.microbatches
        self._loss_scaler = loss_scaler
        args = output.args if self.is_first else ()
        kwargs = output.kwargs if self.is_first else {}
        extra = {"target": target, "losses": []} if self.is_last else {}
        with bounded_p2p_waits(self.group, self.timeout):
            if train:
                self.schedule.step(*args, **kwargs, **extra)
                self._count_sends()
            else:
                self.schedule.eval(*args, **kwargs, **extra)
        # (The first step's shape inference computes one loss on placeholder values before the microbatches'.)
        losses = self._losses[-self.microbatches:]
        mean = (torch.stack(losses).float().mean() if losses
                else torch.zeros((), dtype=torch.float32, device=self.device))
        if train and self.comm is not None:
            self.comm.broadcast(mean, src=self.size - 1, group=self.loss_group)
        else:
            dist.broadcast(mean, src=dist.get_global_rank(self.loss_group, self.size - 1), group=self.loss_group)
        return mean

    def predict(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """The model's output for a whole batch, on every stage: a forward-only schedule over the microbatches of
        ``args``/``kwargs`` (the first stage's input; tensors split along dim 0), then the last stage's output
        broadcast to the other stages. A batch that does not split into the microbatches (a dataset's last) is
        padded with copies of its last sample, whose outputs are dropped; the schedule is set up again when the
        padded batch's size changes (its receive buffers have fixed shapes)."""
        rows = _batch_size((*args, *kwargs.values()), None)  # (every stage reads the same batch)
        padded = -(-rows // self.microbatches) * self.microbatches
        if self._predict is None or self._predict[0] != padded:
            self._predict = (padded, self._schedule_class(self._schedule_stages, self.microbatches))  # no loss
        schedule = self._predict[1]
        if self.is_first and padded != rows:
            args, kwargs = _pad_rows((args, kwargs), rows, padded)
        with bounded_p2p_waits(self.group, self.timeout):
            output = schedule.step(*args, **kwargs) if self.is_first else schedule.step()
        output = self._broadcast_from_last(output)
        output = _slice_rows(output, padded, rows) if padded != rows else output
        if self.plan.kind == "transformers":
            return wrap_output(self.plan.output, output)
        return output

    def _broadcast_from_last(self, output: Any) -> Any:
        """The last stage's ``output`` (a tensor, or lists, tuples and dicts of tensors and plain values) on every
        stage of this rank's pipeline: its structure with each tensor's shape and dtype first, then the tensors."""
        from torch.utils._pytree import tree_leaves, tree_map

        src = dist.get_global_rank(self.group, self.size - 1)
        if self.is_last:
            output = tree_map(lambda v: v.contiguous() if isinstance(v, Tensor) else v, output)
        header = [tree_map(lambda v: _Described(v.shape, v.dtype) if isinstance(v, Tensor) else v, output)
                  if self.is_last else None]
        dist.broadcast_object_list(header, src=src, group=self.group, device=self.device)
        if not self.is_last:
            output = tree_map(lambda v: torch.empty(v.shape, dtype=v.dtype, device=self.device)
                              if isinstance(v, _Described) else v, header[0])
        for leaf in tree_leaves(output):
            if isinstance(leaf, Tensor):
                dist.broadcast(leaf, src=src, group=self.group)
        return output

    def synchronize(self, engine: GradientEngine,
                    data_parallel: tuple[dist.ProcessGroup, int, int] | None = None) -> None:
        """The data-parallel sync of a stage after its last microbatch, and the tied gradients summed over their
        stages. With ``data_parallel`` (this stage's data-parallel group for the training thread, its size D and this
        rank's place in it) the sum comes after the tied gradients' buckets are reduced, while the stage's other
        buckets are: each data-parallel rank sums 1/D of the mean with its peers of the other stages, so the tied
        gradient crosses between the stages once per step instead of once per data-parallel rank. That 1/D is the
        ZeRO sharder's shard at stages 2-3 (``on_gradient_shard``); without one (stages 0-1, the bucket holds the
        whole mean) each rank cuts its 1/D and the stage all-gathers the sums. Otherwise (one data-parallel rank, a
        sync mode, a tied parameter sharing a stage 3 unit's bucket with others) the whole gradients are summed
        before the sync."""
        ties = [t for t in self.ties if t.param is not None]
        alone = {id(b.params[0]): b for b in engine.buckets if len(b.params) == 1}
        if data_parallel is None or data_parallel[1] == 1 or any(id(t.param) not in alone for t in ties):
            self.tied.sum()
            engine.synchronize()
        else:
            def between() -> None:  # the tied gradients' buckets are reduced; their sum crosses the link now
                held = {}
                for number, tie in enumerate(self.ties):
                    if tie.param is not None:
                        bucket = alone[id(tie.param)]
                        if (part := engine.gradient_shard(bucket)) is not None:
                            held[number] = (*part, bucket.numel)
                self.tied.sum(data_parallel, held)

            engine.synchronize(first=[t.param for t in ties], between=between)
        if engine.check_finite:  # every stage skips the step when any stage saw a NaN/Inf gradient
            flag = torch.tensor([int(engine.nonfinite)], device=self.device)
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.loss_group)
            engine.nonfinite = bool(flag.item())

    def _count_sends(self) -> None:
        """The step's activations sent to the next stage and gradients sent to the previous one, counted as the
        schedule's point-to-point sends (stage s runs on pipeline rank s mod P)."""
        for stage in self.stages:
            module, index = stage.submod, stage.stage_index
            sends = []
            # (the step's M microbatches: the last M calls, after the first step's shape inference)
            if forward := sum(module.sent_forward[-self.microbatches:]):
                sends.append(((index + 1) % self.size, forward))
            if backward := sum(module.sent_backward[-self.microbatches:]):
                sends.append(((index - 1) % self.size, backward))
            module.sent_forward, module.sent_backward = [], []
            if sends and self.comm is not None:
                self.comm.count_sends(self.group, sends)

def _batch_size(args: tuple[Any, ...], target: Any) -> int:
    for value in (*args, target):
        if isinstance(value, Tensor) and value.dim():
            return value.shape[0]
    raise TypeError("The pipelined model's input or the target must be a batched tensor (samples along dim 0).")


@dataclass(frozen=True)
class _Described:
    """A tensor's shape and dtype, sent ahead of it."""

    shape: torch.Size
    dtype: torch.dtype


def _pad_rows(value: Any, rows: int, padded: int) -> Any:
    """``value``'s tensors of ``rows`` samples (along dim 0) filled up to ``padded`` with copies of the last."""
    from torch.utils._pytree import tree_map

    def pad(t: Any) -> Any:
        if isinstance(t, Tensor) and t.dim() and t.shape[0] == rows:
            return torch.cat([t, t[-1:].expand(padded - rows, *t.shape[1:])])
        return t

    return tree_map(pad, value)


def _slice_rows(value: Any, padded: int, rows: int) -> Any:
    """``value``'s tensors of ``padded`` samples cut back to the first ``rows``."""
    from torch.utils._pytree import tree_map

    return tree_map(lambda t: t[:rows] if isinstance(t, Tensor) and t.dim() and t.shape[0] == padded else t, value)


