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

import re
from collections.abc import Callable, Generator, Iterable, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from ddp_plugin.parallel import transformers_stages
from ddp_plugin.parallel.stage_plan import StagePlan, _get, _left_out, _set, stage_blocks
from ddp_plugin.hookspecs import Bucket, local_tensor

if TYPE_CHECKING:
    from ddp_plugin.engine import GradientEngine
    from torch.amp import GradScaler


class StageModule(nn.Module):
    """One stage as ``torch.distributed.pipelining`` runs it: the model's own ``forward`` with only this stage's
    modules in place. The modules are the model's (registered here as well, so ``parameters()`` are this
    stage's); the model is not copied."""

    def __init__(self, owner: nn.Module, plan: StagePlan, stage: int) -> None:
        super().__init__()
        self.__dict__["_owner"] = owner  # not a child: its parameters are the LightningModule's
        blocks = _get(owner, plan.blocks)
        self._blocks = {i: blocks._modules[plan.key(i)] for i in plan.stage_blocks[stage]}
        held = {name: _get(owner, name) for name in plan.before + plan.after}
        mine = {name for name in held if (name in plan.before and stage == 0)
                or (name in plan.after and stage == plan.num_stages - 1)}
        self._keep = {name: held[name] if name in mine else _left_out(plan) for name in held}
        self._blocks_name = plan.blocks
        self._kind, self._output = plan.kind, plan.output
        self.__dict__["_stage_blocks"] = stage_blocks(plan, self._blocks)  # (made once; blocks registered in parts)
        self.parts = nn.ModuleList([held[name] for name in held if name in mine] + list(self._blocks.values()))
        self.first, self.last = stage == 0, stage == plan.num_stages - 1
        self.sent_forward: list[int] = []
        self.sent_backward: list[int] = []
        """Bytes each of this stage's training forwards sent on (its outputs) and their backwards sent back (its
        inputs' gradients), since the runner last counted them (one entry per call: the schedule's first step
        also runs one forward to infer the shapes, which sends none of them)."""
        self.send_dtype: torch.dtype | None = None
        """The dtype this stage's floating outputs are cast to before they are sent (their gradients come back in
        it): set where the next stage runs on another node (``pipeline_activations``); ``None``: as computed."""
        self.widen = False
        """Whether this stage's floating inputs, sent narrowed by the stage before, are cast back to the stage's
        compute dtype (its parameters')."""

    def forward(self, *received: Any, **kwargs: Any) -> Any:
        args = received
        if self.widen:
            dtype = next((p.dtype for p in self.parts.parameters() if p.is_floating_point()),
                         torch.get_default_dtype())
            args = tuple(_widened(a, dtype) for a in received)
        out = self._forward(*args, **kwargs)
        if self.send_dtype is not None:
            out = _narrowed(out, self.send_dtype)
        if torch.is_grad_enabled():
            if not self.last:
                self.sent_forward.append(_tensor_bytes(out))
            if not self.first:  # (their gradients go back in the dtype they came in)
                self.sent_backward.append(
                    _tensor_bytes([a for a in received if isinstance(a, Tensor) and a.requires_grad]))
        return out

    def _forward(self, *args: Any, **kwargs: Any) -> Any:
        owner = self._owner
        saved = {name: _get(owner, name) for name in (*self._keep, self._blocks_name)}
        try:
            for name, m in self._keep.items():
                _set(owner, name, m)
            _set(owner, self._blocks_name, self._stage_blocks)
            if self._kind == "transformers":
                return transformers_stages.stage_forward(owner, self.first, self._output, *args, **kwargs)
            return _call_forward(owner, *args, **kwargs)
        finally:
            for name, m in saved.items():
                _set(owner, name, m)


ACTIVATION_DTYPES = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}
"""``pipeline_activations`` -> the dtype sent between stages on different nodes (``None``: as computed)."""


def _narrowed(value: Any, dtype: torch.dtype) -> Any:
    """``value``'s floating tensors wider than ``dtype`` cast to it (a differentiable cast: the gradient that comes
    back is in ``dtype`` too, and is cast back to the tensor's own dtype by autograd)."""
    from torch.utils._pytree import tree_map

    return tree_map(lambda t: t.to(dtype) if isinstance(t, Tensor) and t.is_floating_point()
                    and t.element_size() > dtype.itemsize else t, value)


def _widened(value: Any, dtype: torch.dtype) -> Any:
    """A received tensor in a narrower floating dtype cast to ``dtype`` (the stage's compute dtype)."""
    if isinstance(value, Tensor) and value.is_floating_point() and value.element_size() < dtype.itemsize:
        return value.to(dtype)
    return value


def _tensor_bytes(value: Any) -> int:
    if isinstance(value, Tensor):
        return 0 if value.is_meta else value.numel() * value.element_size()
    if isinstance(value, (list, tuple)):
        return sum(_tensor_bytes(v) for v in value)
    return 0


def _call_forward(owner: nn.Module, *args: Any, **kwargs: Any) -> Any:
    # The class's forward, whatever the placeholder patch has put on the instance.
    return type(owner).forward(owner, *args, **kwargs)


# ------------------------------------------------------------------ shared parameters


@dataclass
class Tie:
    """A parameter several stages hold (``names``: its names in the unsplit model, the first canonical;
    ``ranks``: the pipeline ranks holding a copy); ``param`` on those ranks only, ``group`` (its copies' ranks in
    this rank's data-parallel and tensor-parallel position) ``None`` elsewhere."""

    names: tuple[str, ...]
    ranks: tuple[int, ...]
    param: nn.Parameter | None = None
    group: dist.ProcessGroup | None = None


def find_ties(shared: Iterable[tuple[str, ...]], plan: StagePlan, pipeline_size: int) -> list[Tie]:
    """The groups of names of one parameter (``shared``, before the split) that different pipeline ranks hold."""
    ties = []
    for names in shared:
        ranks = sorted({s % pipeline_size for name in names for s in plan.stage_of(name)})
        if len(ranks) > 1:
            ties.append(Tie(tuple(names), tuple(ranks)))
    return ties


# ------------------------------------------------------------------ running a step


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
        self.order = list(order)
        """The unsplit model's parameter names in ``named_parameters()`` order (a tied parameter once)."""
        self._optimizer_params: dict[int, list[list[nn.Parameter]]] = {}
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
                    module.widen = True
        self._losses: list[Tensor] = []
        self._scale = 1.0
        self._loss_scaler: GradScaler | None = None
        self.comm: Any = None
        """The fit's communicator (``TracedCommunicator``): the schedule's sends, the tied gradients' sums and
        the loss are counted in the traffic metrics. ``None`` outside a fit (not counted)."""
        self.hook: Any = None
        """The fit's hook relay where a codec answers ``on_cross_node_reduce`` (``Options.cross_node_codec``): the
        tied gradients' sums go through it, as a bucket of kind ``"tied_gradient"`` each; ``None``: summed in
        fp32."""
        self._tie_buckets: dict[int, Bucket] = {}
        self._lined_up: set[int] = set()
        self.device = device
        # torch's own names ("1F1B", "GPipe", "Interleaved1F1B"), case-insensitive
        self._schedule_class = get_schedule_class(schedule.replace("_", ""))
        self._schedule_stages = self.stages if schedule == "interleaved_1f1b" else self.stages[0]
        # The loss is scaled here (1/M, times sample weighting and 1/accumulate_grad_batches), not by the schedule.
        self.schedule = self._schedule_class(self._schedule_stages, microbatches, loss_fn=self._loss,
                                             scale_grads=False)
        self._predict: tuple[int, Any] | None = None
        """The forward-only schedule of ``trainer.predict`` and the rows of the batches it was set up for."""

    def _loss(self, output: Any, target: Any) -> Tensor:
        loss = type(self.module).pipeline_loss(self.module, output, target)
        self._losses.append(loss.detach())
        loss = loss * self._scale
        # Under a loss scaler (fp16), scaled as Lightning scales the loss before its backward, which the schedule
        # replaces: the scaler's unscale_ then finds the gradients it expects (as a tensor op: no host sync).
        return self._loss_scaler.scale(loss) if self._loss_scaler is not None else loss

    @contextmanager
    def model_call(self, forward: Callable[..., Any]) -> Generator[None, None, None]:
        """While the user's step runs, the model's call is ``forward``."""
        self.owner.forward = forward
        try:
            yield
        finally:
            del self.owner.__dict__["forward"]

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
            return transformers_stages.wrap_output(self.plan.output, output)
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

    def _gather_to_first(self, value: Any) -> list[Any] | None:
        """``value`` of every stage, in stage order, on global rank 0 (``None`` elsewhere). Only the stages in
        global rank 0's data-parallel and tensor-parallel position take part; the others return at once."""
        if dist.get_global_rank(self.group, 0) != 0:
            return None
        every: list[Any] | None = [None] * self.size if self.rank == 0 else None
        dist.gather_object(value, every, dst=dist.get_global_rank(self.group, 0), group=self.group)
        return every

    def gather_module_state(self, state: dict[str, Any]) -> dict[str, Any]:
        """The unsplit model's state dict on global rank 0 from every stage's ``state`` (whole tensors, on CPU to
        travel); this rank's own ``state`` elsewhere. Collective over the pipeline group of global rank 0."""
        every = self._gather_to_first({k: (v.cpu() if isinstance(v, Tensor) else v) for k, v in state.items()})
        if every is None or dist.get_rank() != 0:
            return state
        merged: dict[str, Any] = {}
        for part in every:
            merged.update(part)
        for tie in self.ties:  # one tensor under every name, as the unsplit model's state dict has it
            first = next((merged[n] for n in tie.names if n in merged), None)
            for name in tie.names:
                if name in merged:
                    merged[name] = first
        return merged

    def note_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """Keep the module parameters ``optimizer`` was made with, group by group: its state dict numbers them so
        (a ZeRO sharder's consolidated one too, whose optimizer then holds pieces)."""
        self._optimizer_params[id(optimizer)] = [list(group["params"]) for group in optimizer.param_groups]

    def _optimizer_groups(self, optimizer: torch.optim.Optimizer) -> list[list[nn.Parameter]]:
        return self._optimizer_params.get(id(optimizer)) or [list(g["params"]) for g in optimizer.param_groups]

    def _canonical_names(self) -> dict[int, str]:
        """id(parameter) -> its name in the unsplit model (a tied parameter's first name), for this rank's."""
        names = {id(p): name for name, p in self.module.named_parameters()}
        names.update({id(t.param): t.names[0] for t in self.ties if t.param is not None})
        return names

    def gather_optimizer_state(self, state: Mapping[str, Any], optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """The unsplit model's optimizer state on global rank 0 from every stage's (``state``: this stage's
        ``optimizer.state_dict()`` with whole tensors): parameters numbered across groups in the unsplit model's
        order, as its optimizer would number them, and their names under ``"param_names"`` (for a resume on
        another layout); each stage's group ``g`` is the unsplit optimizer's group ``g``. This rank's own state
        elsewhere. Collective over the pipeline group of global rank 0."""
        names = self._canonical_names()
        params = [p for group in self._optimizer_groups(optimizer) for p in group]
        groups = []
        start = 0
        for group in state["param_groups"]:
            count = len(group["params"])
            groups.append(({k: v for k, v in group.items() if k != "params"},
                           [names[id(p)] for p in params[start:start + count]]))
            start += count
        entries = {names[id(params[i])]: {k: (v.cpu() if isinstance(v, Tensor) else v) for k, v in entry.items()}
                   for i, entry in state["state"].items()}
        every = self._gather_to_first((groups, entries))
        if every is None or dist.get_rank() != 0:
            return dict(state)
        rank_of = {name: i for i, name in enumerate(self.order)}
        merged_groups: list[tuple[dict[str, Any], list[str]]] = []
        merged_entries: dict[str, Any] = {}
        for stage_groups, stage_entries in every:
            for g, (hyper, group_names) in enumerate(stage_groups):
                if g == len(merged_groups):
                    merged_groups.append((hyper, []))
                merged_groups[g][1].extend(n for n in group_names if n not in merged_groups[g][1])
            for name, entry in stage_entries.items():
                merged_entries.setdefault(name, entry)
        param_names: list[str] = []
        out_groups = []
        for hyper, group_names in merged_groups:
            group_names.sort(key=lambda n: rank_of.get(n, len(rank_of)))
            out_groups.append({**hyper, "params": list(range(len(param_names), len(param_names) + len(group_names)))})
            param_names.extend(group_names)
        out_state = {i: merged_entries[name] for i, name in enumerate(param_names) if name in merged_entries}
        return {"state": out_state, "param_groups": out_groups, "param_names": param_names}

    def named_sharded_optimizer_state(self, local: Mapping[str, Any], optimizer: torch.optim.Optimizer
                                      ) -> dict[str, Any]:
        """This rank's part of ``optimizer``'s state for ``checkpoint="sharded"`` (flat keys ``<index>/<key>...``
        and shapes ``<index>...``, numbered as this stage's unsharded optimizer) under the unsplit model's
        parameter names instead of this stage's numbers, so the stages' keys never collide; on global rank 0 also
        every stage's groups, numbered as :meth:`gather_optimizer_state` numbers them (``param_names``).
        Collective over the pipeline group of global rank 0."""
        names = self._canonical_names()
        params = [p for group in self._optimizer_groups(optimizer) for p in group]

        def named(key: str) -> str:
            index, rest = re.match(r"(\d+)(.*)", key).groups()
            return names[id(params[int(index)])] + rest

        merged = self.gather_optimizer_state({"state": {}, "param_groups": local["param_groups"]}, optimizer)
        return {**local, "state": {named(k): v for k, v in local["state"].items()},
                "shapes": {named(k): v for k, v in local.get("shapes", {}).items()},
                "param_groups": merged["param_groups"], "param_names": merged.get("param_names")}

    def gather_nested(self, value: Mapping[str, Any]) -> dict[str, Any]:
        """Every stage's ``value`` (nested dicts whose leaves are keyed by the unsplit model's names, or the same on
        every stage) merged on global rank 0, tensors on CPU; this rank's own ``value`` elsewhere. Collective over
        the pipeline group of global rank 0."""
        every = self._gather_to_first(_to_cpu(value))
        if every is None or dist.get_rank() != 0:
            return dict(value)
        merged: dict[str, Any] = {}
        for part in every:
            _merge_into(merged, part)
        return merged

    def gather_shapes(self, shapes: dict[str, tuple[int, ...]]) -> dict[str, tuple[int, ...]]:
        """Every stage's ``shapes`` on global rank 0 (for the sharded checkpoint's metadata, which it writes)."""
        every = self._gather_to_first(shapes)
        merged: dict[str, tuple[int, ...]] = {}
        for part in every or [shapes]:
            merged.update(part)
        return merged

    def local_optimizer_state(self, state: Mapping[str, Any], optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """This stage's part of a consolidated optimizer state (:meth:`gather_optimizer_state`'s, or an unsplit
        run's with one group per group here), numbered as this stage's ``optimizer`` numbers its parameters."""
        saved_names = state.get("param_names")
        if saved_names is None:  # an unsplit run's: its parameters in the unsplit model's order, group after group
            saved_names = self.order
        index_of = {name: i for i, name in enumerate(saved_names)}
        names = self._canonical_names()
        saved_groups = state["param_groups"]
        if len(saved_groups) != len(optimizer.param_groups):
            raise ValueError(
                f"The checkpoint's optimizer has {len(saved_groups)} parameter groups and this stage's"
                f" {len(optimizer.param_groups)}: with pipeline stages, `configure_optimizers` must make the same"
                " groups on every stage (the unsplit model's, each holding the stage's share)."
            )
        out_state: dict[int, Any] = {}
        out_groups = []
        local = 0
        for saved, group in zip(saved_groups, self._optimizer_groups(optimizer)):
            indices = []
            for p in group:
                entry = state["state"].get(index_of.get(names[id(p)], -1))
                if entry is not None:
                    out_state[local] = entry
                indices.append(local)
                local += 1
            out_groups.append({**{k: v for k, v in saved.items() if k != "params"}, "params": indices})
        return {"state": out_state, "param_groups": out_groups}

    def sum_tied_gradients(self, data_parallel: tuple[dist.ProcessGroup, int, int] | None = None,
                           held: Mapping[int, tuple[int, Tensor, int]] | None = None) -> None:
        """Each shared parameter's gradient summed over the stages holding a copy (each copy got the gradient of
        its own uses), so every copy holds the unsplit model's gradient. ``data_parallel`` (group, size D, this
        rank's index): the gradients are the stage's data-parallel mean, the same on its D ranks, and each rank
        sums its 1/D part, then the stage all-gathers the parts (see :func:`synchronize`). ``held``: tie number ->
        the part of its bucket's mean a ZeRO sharder keeps on this rank, ``(offset, tensor, bucket size)``; that
        part alone is summed, in place (the shards of the copies' buckets line up: checked once)."""
        for number, tie in enumerate(self.ties):
            if tie.param is None:
                continue
            if held is not None and number in held:
                offset, part, numel = held[number]
                self._check_lined_up(number, tie, offset, part.numel(), numel)
                self._sum(number, tie, part, numel, offset)
                continue
            p = tie.param
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            grad = local_tensor(p.grad)
            flat = grad.view(-1)
            if data_parallel is None:
                self._sum(number, tie, flat, flat.numel(), 0)
                continue
            group, size, index = data_parallel
            part = -(-flat.numel() // size)
            whole = torch.zeros(part * size, dtype=flat.dtype, device=flat.device)
            whole[:flat.numel()] = flat
            mine = whole[index * part:(index + 1) * part].clone()
            self._sum(number, tie, mine, whole.numel(), index * part)
            if self.comm is not None:
                self.comm.all_gather(whole, mine, group=group)
            else:
                dist.all_gather(list(whole.split(part)), mine, group=group)
            flat.copy_(whole[:flat.numel()])

    def _check_lined_up(self, number: int, tie: Tie, offset: int, size: int, numel: int) -> None:
        """Once per tie: every copy's rank holds the same part of a bucket of the same size (the stages' shard
        layouts are alike by construction; a mismatch would sum different elements)."""
        if number in self._lined_up:
            return
        mine = torch.tensor([offset, size, numel], dtype=torch.int64)
        low, high = mine.clone(), mine.clone()
        dist.all_reduce(low, op=dist.ReduceOp.MIN, group=tie.group)
        dist.all_reduce(high, op=dist.ReduceOp.MAX, group=tie.group)
        if not torch.equal(low, high):
            raise RuntimeError(
                f"ddp_plugin: the ZeRO shards of `{tie.names[0]}`'s copies do not line up across the pipeline"
                f" stages (this rank holds elements {offset}..{offset + size} of {numel}; the copies' ranks"
                f" {list(tie.ranks)} span {low.tolist()}..{high.tolist()}); please report this layout.")
        self._lined_up.add(number)

    def _sum(self, number: int, tie: Tie, tensor: Tensor, numel: int, offset: int) -> None:
        """``tensor`` (elements ``offset``... of the flat gradient of ``tie``'s copy, ``numel`` elements with
        padding) summed over the copies, in place: through the codec where there is one (its mean over the
        copies' group, times their number; every copy decodes the same bits), else an fp32 all-reduce."""
        if self.hook is None:
            (self.comm.all_reduce if self.comm is not None else dist.all_reduce)(tensor, group=tie.group)
            return
        bucket = self._tie_buckets.get(number)
        if bucket is None or bucket.numel != numel:
            buffer = torch.empty(numel, dtype=tensor.dtype, device=tensor.device)
            buffer.untyped_storage().resize_(0)  # (its shape and device only: codecs code `tensor`)
            bucket = self._tie_buckets[number] = Bucket(
                index=number, buffer=buffer, params=(tie.param,), names=(tie.names[0],), offsets=(0,),
                kind="tied_gradient")
        future = self.hook.on_cross_node_reduce(tensor=tensor, group=tie.group, bucket=bucket, offset=offset)
        if future is not None:
            future.wait()
        tensor.mul_(len(tie.ranks))


def _to_cpu(value: Any) -> Any:
    if isinstance(value, Tensor):
        return value.detach().cpu()
    if isinstance(value, Mapping):
        return {k: _to_cpu(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_to_cpu(v) for v in value)
    return value


def _merge_into(merged: dict[str, Any], part: Mapping[str, Any]) -> None:
    """``part``'s entries into ``merged``: nested dicts merged key by key, any other value kept from the first."""
    for key, value in part.items():
        if isinstance(value, Mapping) and isinstance(merged.get(key), dict):
            _merge_into(merged[key], value)
        elif key not in merged:
            merged[key] = dict(value) if isinstance(value, Mapping) else value


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


def sync_ties(ties: Iterable[Tie]) -> None:
    """Every copy of a shared parameter takes the first stage's value (collective over each tie's ranks)."""
    for tie in ties:
        if tie.param is not None:
            with torch.no_grad():
                dist.broadcast(local_tensor(tie.param).data, src=dist.get_global_rank(tie.group, 0), group=tie.group)


def synchronize(engine: GradientEngine, runner: PipelineRunner,
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
    ties = [t for t in runner.ties if t.param is not None]
    alone = {id(b.params[0]): b for b in engine.buckets if len(b.params) == 1}
    if data_parallel is None or data_parallel[1] == 1 or any(id(t.param) not in alone for t in ties):
        runner.sum_tied_gradients()
        engine.synchronize()
    else:
        def between() -> None:  # the tied gradients' buckets are reduced; their sum crosses the link now
            held = {}
            for number, tie in enumerate(runner.ties):
                if tie.param is not None:
                    bucket = alone[id(tie.param)]
                    if (part := engine.gradient_shard(bucket)) is not None:
                        held[number] = (*part, bucket.numel)
            runner.sum_tied_gradients(data_parallel, held)

        engine.synchronize(first=[t.param for t in ties], between=between)
    if engine.check_finite:  # every stage skips the step when any stage saw a NaN/Inf gradient
        flag = torch.tensor([int(engine.nonfinite)], device=runner.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=runner.loss_group)
        engine.nonfinite = bool(flag.item())
