"""``pipeline_split="time"``: each block's forward and backward timed once at setup, on this machine's device, so
the stages can be cut where their compute is equal instead of their parameter counts.

The blocks are timed on a real microbatch, found without asking the user for one (:func:`first_microbatch`): the
first batch of the data the fit (or validation, test, prediction) runs on, moved to the device as Lightning moves
it, is handed to the step (``training_step``, ...) with the pipelined model's call replaced by one that records
its arguments and stops the step there; the first microbatch of those arguments is the example. Then the model's
own ``forward`` runs on it with hooks on every block stamping when its forward and its backward start and end;
what runs before the first block (embeddings) and after the last (final norm, head, and a stand-in loss: the mean
of the output's squares, the model having no target here) is timed with the first and the last stage. Each rank
times the same model; each part's time is the fastest of every rank's (a rank whose core something else took
while it timed only comes out slower), so each rank cuts the same stages. The module's
buffers and the random generators (torch's, Python's, NumPy's) are left as they were, and no gradient stays
behind.

A model built on the meta device (``trainer.init_module(empty_init=True)``) has no weights to run, and
materializing it whole would defeat the recipe: it is timed a block at a time (:func:`time_meta_blocks`).
"""

from __future__ import annotations

import copy
import gc
import logging
import statistics
import time
import weakref
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.distributed as dist
from lightning.fabric.utilities.apply_func import move_data_to_device
from torch import Tensor, nn
from torch.utils._pytree import tree_leaves, tree_map

from ddp_plugin.runtime import lightning_adapter
from ddp_plugin.parallel.materialize import has_meta_tensors, materialize
from ddp_plugin.parallel.stages.cut import Cut
from ddp_plugin.parallel.stages.forward import forward_replaced
from ddp_plugin.parallel.stages.transformers import stage_forward

log = logging.getLogger(__name__)

REPEATS = 5
"""Timed passes (after one untimed): each part's fastest counts (what else runs on the machine only adds to a
pass, as for ``timeit``)."""


Example = tuple[tuple[Any, ...], dict[str, Any]]
"""What the pipelined model is called with: its positional and keyword arguments."""

STEPS = {"fit": ("fit_loop", "training_step"), "validate": ("validate_loop", "validation_step"),
         "test": ("test_loop", "test_step"), "predict": ("predict_loop", "predict_step")}
"""The Trainer's entry point -> its loop (whose data source gives the batches) and the step it runs."""


class _Reached(Exception):
    """Raised by the pipelined model's call while the step runs to find its input: the call's arguments."""


def first_microbatch(module: Any, owner: nn.Module, microbatches: int, device: torch.device) -> Example:
    """The first microbatch the pipelined model ``owner`` (a module of the LightningModule ``module``) is called
    with: the first batch of the running entry point's data (``trainer.fit``: the training data), moved to
    ``device`` through the module's batch hooks, handed to the step (``training_step``, ...) with ``owner``'s call
    replaced by one that records its arguments and ends the step; of those, each tensor's first ``1 /
    microbatches`` of the samples (along dim 0). The random generators are left as they were (a shuffled loader
    draws from them). A clear error where there is no data or the step does not call ``owner``."""
    trainer = module.trainer
    fn = trainer.state.fn.value if trainer.state.fn is not None else "fit"
    loop_name, step_name = STEPS[fn]
    what = (f"`pipeline_split='time'` times the blocks on the first microbatch of the data `trainer.{fn}` runs on:"
            f" it runs `{step_name}` on the first batch, up to its call of the pipelined model")
    states = lightning_adapter.collect_rng_states(include_cuda=device.type == "cuda")
    try:
        batch, batch_idx, dataloader_idx, several = _first_batch(trainer, getattr(trainer, loop_name), fn, what)
        batch = lightning_adapter.transfer_batch(module, batch, device, dataloader_idx)
        args, kwargs = _model_input(module, owner, step_name, batch, batch_idx, dataloader_idx if several else None,
                                    what)
    finally:
        lightning_adapter.set_rng_states(states)
    rows = next((v.shape[0] for v in tree_leaves((args, kwargs)) if isinstance(v, Tensor) and v.dim()), None)
    if rows is None:
        raise TypeError(f"{what}, and that call got no batched tensor (samples along dim 0) to time the blocks on.")
    size = max(1, -(-rows // microbatches))
    return tree_map(lambda v: v[:size] if isinstance(v, Tensor) and v.dim() and v.shape[0] == rows else v,
                    (tuple(args), dict(kwargs)))


def _first_batch(trainer: Any, loop: Any, fn: str, what: str) -> tuple[Any, int, int, bool]:
    """The first batch of ``loop``'s data (as the loop combines several loaders), its index, its loader's index, and
    whether there are several loaders."""
    from lightning.pytorch.utilities.combined_loader import CombinedLoader

    loaders = lightning_adapter.first_loader(loop)
    if loaders is None:
        raise TypeError(f"{what}; this `trainer.{fn}` was given no data. Pass the data, or balance by"
                        " `pipeline_split='parameters'` (the default).")
    combined = loaders if isinstance(loaders, CombinedLoader) else CombinedLoader(
        loaders, "max_size_cycle" if fn == "fit" else "sequential")
    try:
        batch, batch_idx, dataloader_idx = next(iter(combined))
    except StopIteration:
        raise TypeError(f"{what}; its data is empty.") from None
    finally:
        combined.reset()  # (a loader's workers shut down)
    return batch, batch_idx, dataloader_idx, len(combined.flattened) > 1


def _model_input(module: Any, owner: nn.Module, step_name: str, batch: Any, batch_idx: int,
                 dataloader_idx: int | None, what: str) -> Example:
    """Run ``module``'s step ``step_name`` on ``batch`` until it calls ``owner``; that call's arguments."""
    from lightning.pytorch.utilities.signature_utils import is_param_in_hook_signature

    step = getattr(module, step_name)
    args: list[Any] = [batch]
    if is_param_in_hook_signature(step, "batch_idx", min_args=2):
        args.append(batch_idx)
    if dataloader_idx is not None:
        args.append(dataloader_idx)

    def reached(*model_args: Any, **model_kwargs: Any) -> Any:
        raise _Reached(model_args, model_kwargs)

    try:
        with forward_replaced(owner, reached), torch.no_grad():
            step(*args)
    except _Reached as call:
        return call.args[0], call.args[1]
    except Exception as err:
        raise RuntimeError(f"{what}, and `{step_name}` failed before that call: {type(err).__name__}: {err}."
                           " Or balance by `pipeline_split='parameters'` (the default).") from err
    raise TypeError(f"{what}, and `{step_name}` returned without calling it (`self.{_name(module, owner)}(...)`).")


def _name(module: nn.Module, owner: nn.Module) -> str:
    """``owner``'s attribute path in ``module`` (``model``), or ``forward`` for the module itself."""
    return next((name for name, m in module.named_modules() if m is owner and name), "forward")


def fit_timer(module: Any, device: torch.device, microbatches: int) -> Callable[..., BlockTimes]:
    """``pipeline_split="time"``'s measure for a fit's setup (:data:`~ddp_plugin.parallel.stages.plan.Timer`): the
    blocks of the LightningModule ``module``'s pipelined model timed on ``device`` on the first microbatch of the
    data (:func:`first_microbatch`), the fastest rank's, and logged. A model built on the meta device is timed a
    block at a time (:func:`time_meta_blocks`)."""

    def timer(owner: nn.Module, blocks: Sequence[nn.Module], cuts: Mapping[int, Cut]) -> BlockTimes:
        example = first_microbatch(module, owner, microbatches, device)
        if has_meta_tensors(owner):
            # (imported here: the plan imports this module)
            from ddp_plugin.parallel.stages.plan import plan_stages

            layout = plan_stages(module, len(blocks), "uniform")  # (a stage per block: where the blocks are)
            times = time_meta_blocks(owner, layout, example, device, cuts=cuts)
        else:
            times = time_blocks(owner, blocks, example, device, cuts=cuts)
        log.info("ddp_plugin: pipeline_split='time': %s ms before the blocks, %s per block, %s after them%s; the"
                 " passes %.0f %% apart", f"{times.before * 1e3:.2f}", ", ".join(f"{t * 1e3:.2f}" for t in times.blocks),
                 f"{times.after * 1e3:.2f}", "".join(f"; block {i} before `{cuts[i].at}`: {share:.2f} of it"
                                                     for i, share in sorted(times.shares.items())), 100 * times.noise)
        return times

    return timer


@dataclass(frozen=True)
class BlockTimes:
    """What :func:`time_blocks` measured, in seconds of forward plus backward, the fastest rank's."""

    before: float
    """What runs before the first block (embeddings)."""
    blocks: tuple[float, ...]
    """Each block."""
    after: float
    """What runs after the last block (final norm, head, the stand-in loss)."""
    shares: dict[int, float]
    """For each block that may be cut (by position), the share of its time its first part takes."""
    noise: float
    """How far apart the timed passes were: each part's second fastest pass less its fastest, summed over the
    parts, over the sum of their fastest. Splits whose slowest stages differ by less than this share are not told
    apart."""


def time_blocks(owner: nn.Module, blocks: Sequence[nn.Module], example: Example, device: torch.device,
                group: dist.ProcessGroup | None = None, cuts: Mapping[int, Cut] | None = None) -> BlockTimes:
    """Seconds of forward plus backward of what runs before the first block, of each block, and of what runs after
    the last, ``owner`` called with ``example`` (its arguments) on ``device`` (``owner`` moved there for the
    timing and back), the fastest of the ranks of ``group`` (collective; the cuts' shares and the noise are
    averaged). With ``cuts`` (a cut per block position), for each cut the share of its block's time that its
    first part takes: the forward time of the modules the first part calls over that of all the modules either
    part calls (the backward taken to follow the forward's proportions). ``owner`` must hold real weights (built on
    the meta device, it is timed by :func:`time_meta_blocks`)."""
    if has_meta_tensors(owner):
        raise ValueError("`time_blocks` runs the whole model, and this one is on the meta device: time it a block at"
                         " a time (`time_meta_blocks`).")
    home = next((p.device for p in owner.parameters()), device)
    buffers = {name: b.detach().clone() for name, b in owner.named_buffers()}
    owner.to(device)
    example = move_data_to_device(example, device)
    try:
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            runs, shares, _ = _passes(lambda: owner(*example[0], **example[1]), owner, blocks,
                                      _synchronizer(device), cuts or {})
    finally:
        for p in owner.parameters():
            p.grad = None
        with torch.no_grad():
            for name, b in owner.named_buffers():
                b.copy_(buffers[name].to(b.device))
        owner.to(home)
    return _fastest_rank(_summary(list(zip(*runs[1:])), list(zip(*shares[1:]))), len(blocks), cuts or {}, device,
                         group)


def time_meta_blocks(owner: nn.Module, layout: Any, example: Example, device: torch.device,
                     group: dist.ProcessGroup | None = None, cuts: Mapping[int, Cut] | None = None) -> BlockTimes:
    """What :func:`time_blocks` measures, for a model built on the meta device, never holding more of it than one
    block: the blocks run in order, each a stage of its own (``layout``: a :class:`~ddp_plugin.parallel.stages.plan.
    StagePlan` of one block per stage, its ``owner`` the path of ``owner``; the first stage with the modules before
    the blocks, the last with those after them). Each stage is a copy of ``owner`` cut down to it (``owner`` stays
    on meta), materialized on ``device`` and initialized as the strategy initializes a stage (:func:`~ddp_plugin.
    parallel.materialize.materialize`), run once untimed and :data:`REPEATS` times timed on the previous stage's
    output (the first on ``example``), and dropped before the next is made. The random generators are put back,
    so the model's own initialization afterwards draws what it would have without the timing. Collective over
    ``group``, as :func:`time_blocks`."""
    # (imported here: the plan imports this module)
    from ddp_plugin.parallel.stages.plan import split_module

    n = len(layout.stage_blocks)
    cuts = cuts or {}
    sync = _synchronizer(device)
    args, kwargs = move_data_to_device(example, device)
    columns: list[list[float]] = [[] for _ in range(n + 2)]  # (before, each block, after: a value per timed pass)
    share_columns: list[list[float]] = []
    local = replace(layout, owner="")
    states = lightning_adapter.collect_rng_states(include_cuda=device.type == "cuda")
    try:
        for i in range(n):
            stage = _stage_copy(owner, local, i)
            split_module(stage, local, [i])
            try:
                materialize(stage, device)
            except TypeError as err:
                raise TypeError(
                    f"`pipeline_split='time'` times a model built on the meta device a block at a time, each"
                    f" materialized and initialized alone, and block {i}'s stage cannot be: {err} Or balance by"
                    " `pipeline_split='parameters'` (the default), or name the stages' modules"
                    " (`pipeline_split=[[...], [...]]`).") from err
            block = stage.get_submodule(local.blocks)._modules[local.key(i)]
            call = _stage_call(stage, local, i)
            try:
                runs, shares, output = _passes(lambda c=call, a=args, k=kwargs: c(*a, **k), stage, [block], sync,
                                               {0: cuts[i]} if i in cuts else {})
            except RuntimeError as err:
                raise RuntimeError(
                    f"`pipeline_split='time'` times a model built on the meta device a block at a time, each stage"
                    f" materialized alone, and block {i}'s stage failed: {err}. (A tensor its `forward` uses that is"
                    " neither a parameter nor a buffer stays on the meta device: register it as a buffer.) Or balance"
                    " by `pipeline_split='parameters'` (the default).") from err
            before, columns[i + 1], after = map(list, zip(*runs[1:]))  # (the timed passes)
            columns[0] = before if i == 0 else columns[0]  # (what runs before the blocks, with the first)
            columns[n + 1] = after if i == n - 1 else columns[n + 1]  # (and after them, with the last)
            if i in cuts:
                share_columns.append([s[0] for s in shares[1:]])
            held = [weakref.ref(t) for t in (*stage.parameters(), *stage.buffers())]
            del stage, block, call, runs
            if any(r() is not None for r in held):  # (a reference cycle in the user's modules holds them)
                gc.collect()
            args, kwargs = _received(output), {}  # (what the next stage is called with, as the schedule does)
    finally:
        lightning_adapter.set_rng_states(states)
    return _fastest_rank(_summary(columns, share_columns), n, cuts, device, group)


def _stage_copy(owner: nn.Module, layout: Any, stage: int) -> nn.Module:
    """A copy of the meta ``owner`` (its tensors on the meta device: it costs no memory) in which the modules
    ``stage`` does not run are ``owner``'s own, not copied (:func:`~ddp_plugin.parallel.stages.plan.split_module`
    then drops them from the copy). Device meshes stay the same objects (their process groups)."""
    blocks = owner.get_submodule(layout.blocks)
    shared = [m for i, m in enumerate(blocks._modules.values()) if i != stage]
    shared += [owner.get_submodule(name) for name in layout.before if stage != 0]
    shared += [owner.get_submodule(name) for name in layout.after if stage != layout.num_stages - 1]
    shared += [t.device_mesh for t in (*owner.parameters(), *owner.buffers()) if hasattr(t, "device_mesh")]
    return copy.deepcopy(owner, {id(m): m for m in shared if m is not None})


def _stage_call(stage: nn.Module, layout: Any, position: int) -> Callable[..., Any]:
    """The stage's call as the schedule makes it (:class:`~ddp_plugin.parallel.stage_module.StageModule`): the
    model's class's own ``forward`` (a Hugging Face model's from ``inputs_embeds`` after the first stage)."""
    if layout.kind == "transformers":
        first = position == 0
        return lambda *args, **kwargs: stage_forward(stage, first, layout.output, *args, **kwargs)
    return lambda *args, **kwargs: type(stage).forward(stage, *args, **kwargs)


def _received(output: Any) -> tuple[Any, ...]:
    """A stage's output as the next stage receives it: the positional arguments, floating tensors requiring their
    gradient (its backward computes them, as a stage's does)."""
    values = output if isinstance(output, tuple) else (output,)
    return tuple(v.detach().requires_grad_(v.is_floating_point()) if isinstance(v, Tensor) else v for v in values)


def _passes(call: Callable[[], Any], module: nn.Module, blocks: Sequence[nn.Module], sync: Callable[[], None],
            cuts: Mapping[int, Cut]) -> tuple[list[list[float]], list[list[float]], Any]:
    """``call`` (forward, then the stand-in loss's backward) run once untimed and :data:`REPEATS` times timed, with
    hooks stamping ``blocks``: each pass's seconds before the blocks, of each block and after them; each pass's
    share of each cut's block (by position, in order) its first part takes; and the last pass's output, detached.
    ``module``'s gradients are dropped after each pass."""
    stamps: dict[tuple[str, int], float] = {}
    spent: dict[tuple[int, str], float] = {}  # (block, attribute): forward seconds of the cut blocks' modules

    def stamp(key: str, i: int) -> Callable[..., None]:
        def hook(*_: Any) -> None:
            sync()
            stamps[key, i] = time.perf_counter()
        return hook

    handles = []
    for i, block in enumerate(blocks):
        handles += [block.register_forward_pre_hook(stamp("f0", i)), block.register_forward_hook(stamp("f1", i)),
                    block.register_full_backward_pre_hook(stamp("b0", i)),
                    block.register_full_backward_hook(stamp("b1", i))]
    for i, cut in cuts.items():
        for name in (*cut.first, *cut.second):
            if isinstance(child := blocks[i]._modules.get(name), nn.Module):
                handles += [child.register_forward_pre_hook(_clock(spent, (i, name), sync, -1.0)),
                            child.register_forward_hook(_clock(spent, (i, name), sync, 1.0))]
    n, runs, shares, output = len(blocks), [], [], None
    try:
        for _ in range(REPEATS + 1):
            stamps.clear()
            spent.clear()
            sync()
            start = time.perf_counter()
            output = call()
            loss = sum(t.float().square().mean() for t in tree_leaves(output)
                       if isinstance(t, Tensor) and t.is_floating_point() and t.requires_grad)
            sync()
            forward_end = time.perf_counter()
            loss.backward()
            sync()
            end = time.perf_counter()
            run = [stamps["f0", 0] - start + end - stamps["b1", 0]]
            run += [stamps["f1", i] - stamps["f0", i] + stamps["b1", i] - stamps["b0", i] for i in range(n)]
            run.append(forward_end - stamps["f1", n - 1] + stamps["b0", n - 1] - forward_end)
            runs.append(run)
            shares.append([_share(spent, i, cut) for i, cut in sorted(cuts.items())])
            for p in module.parameters():
                p.grad = None
    finally:
        for handle in handles:
            handle.remove()
    return runs, shares, tree_map(lambda t: t.detach() if isinstance(t, Tensor) else t, output)


def _summary(columns: Sequence[Sequence[float]], share_columns: Sequence[Sequence[float]]) -> list[float]:
    """Each part's fastest pass (``columns``: a part's timed passes), each cut's median share, and the spread: each
    part's second fastest pass less its fastest, summed, over the sum of their fastest."""
    fastest = [sorted(c) for c in columns]
    total = sum(c[0] for c in fastest)
    spread = sum(c[1] - c[0] for c in fastest) / total if total > 0 else 0.0
    return [max(0.0, c[0]) for c in fastest] + [statistics.median(c) for c in share_columns] + [spread]


def _fastest_rank(parts: list[float], n: int, cuts: Mapping[int, Cut], device: torch.device,
                  group: dist.ProcessGroup | None) -> BlockTimes:
    """This rank's :func:`_summary` of ``n`` blocks as the fastest rank's of ``group``: each part's time the least
    of the ranks', the shares and the spread their mean (collective)."""
    seconds = torch.tensor(parts[:n + 2], dtype=torch.float64, device=device)
    rest = torch.tensor(parts[n + 2:], dtype=torch.float64, device=device)  # the cuts' shares, the noise
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.all_reduce(seconds, op=dist.ReduceOp.MIN, group=group)
        dist.all_reduce(rest, group=group)
        rest /= dist.get_world_size(group)
    values = seconds.tolist() + rest.tolist()
    return BlockTimes(values[0], tuple(values[1:n + 1]), values[n + 1],
                      dict(zip(sorted(cuts), values[n + 2:-1])), values[-1])


def _clock(spent: dict[Any, float], key: Any, sync: Callable[[], None], sign: float) -> Callable[..., None]:
    """A hook adding ``sign`` x now to ``spent[key]``: -1 as a module's forward starts, +1 as it ends (a module
    called several times adds up each call)."""
    def hook(*_: Any) -> None:
        sync()
        spent[key] = spent.get(key, 0.0) + sign * time.perf_counter()
    return hook


def _share(spent: Mapping[tuple[int, str], float], block: int, cut: Cut) -> float:
    first = sum(spent.get((block, name), 0.0) for name in cut.first)
    total = first + sum(spent.get((block, name), 0.0) for name in cut.second)
    return first / total if total > 0 else 0.5


def _synchronizer(device: torch.device) -> Callable[[], None]:
    if device.type == "cuda":
        return lambda: torch.cuda.synchronize(device)
    return lambda: None
