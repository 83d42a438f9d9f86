"""Where a model's blocks split into pipeline stages: the plan (``pipeline_split``: by parameters, by timed
compute, uniform, by block type, or named), and a module cut down to its stages' blocks.

The contract: the model is a module whose children, in registration order, are modules before a ``ModuleList``
(or a ``ModuleDict`` keyed by layer id) of blocks (they go to the first stage), the blocks (split into contiguous
runs) and modules after it (the last stage); a Hugging Face model is split by its config's ``base_model_pp_plan``
(:mod:`ddp_plugin.parallel.stages.transformers`). See :mod:`ddp_plugin.parallel.pipeline` for the rest.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from torch import nn

from ddp_plugin.parallel.stages import cut as block_cut
from ddp_plugin.parallel.stages import names as stage_names
from ddp_plugin.parallel.stages import transformers as transformers_stages
from ddp_plugin.parallel.stages.cut import Cut

if TYPE_CHECKING:
    from ddp_plugin.parallel.stages.timing import BlockTimes

log = logging.getLogger(__name__)

@dataclass(frozen=True)
class StagePlan:
    """How the model splits: ``owner`` (the module path of the model, ``""`` for the LightningModule itself),
    ``blocks`` (its ``ModuleList`` or ``ModuleDict`` child), ``before``/``after`` (its other children, first and
    last stage), and per stage (``stage_blocks[s]``) the positions of the blocks stage ``s`` runs; ``keys`` are the
    blocks' names in the container, by position (``"0"``, ``"1"``, ... in a list). Stage ``s`` runs on pipeline
    rank ``s % pipeline_parallel_size`` (torch's interleaved assignment; one stage per rank without it)."""

    owner: str
    blocks: str
    before: tuple[str, ...]
    after: tuple[str, ...]
    stage_blocks: tuple[tuple[int, ...], ...]
    keys: tuple[str, ...] = ()
    is_dict: bool = False
    kind: str = "contract"
    """``"contract"`` (the model's ``forward`` skips ``None`` children) or ``"transformers"`` (a Hugging Face model
    split by its config's ``base_model_pp_plan``: :mod:`ddp_plugin.parallel.stages.transformers`); ``blocks``, ``before``
    and ``after`` may then be dotted paths below ``owner``."""
    output: str = ""
    """``"transformers"``: the attribute of the model's output a stage returns (``"logits"``)."""
    cuts: tuple[tuple[int, Cut], ...] = ()
    """The blocks cut between two stages (:mod:`ddp_plugin.parallel.stages.cut`): (position, cut). Such a block is
    in the ``stage_blocks`` of both; the earlier runs its first part, the later its second."""

    def key(self, position: int) -> str:
        return self.keys[position] if self.keys else str(position)

    def cut(self, position: int) -> Cut | None:
        return dict(self.cuts).get(position)

    @property
    def num_stages(self) -> int:
        return len(self.stage_blocks)

    def stage_of(self, name: str) -> set[int]:
        """The stages that hold the parameter or module ``name`` (a name of the LightningModule)."""
        prefix = f"{self.owner}." if self.owner else ""
        rest = name[len(prefix):] if name.startswith(prefix) else name

        def under(path: str) -> bool:
            return rest == path or rest.startswith(f"{path}.")

        if any(map(under, self.before)):
            return {0}
        if any(map(under, self.after)):
            return {self.num_stages - 1}
        if rest.startswith(f"{self.blocks}."):
            key, _, inside = rest[len(self.blocks) + 1:].partition(".")
            index = self.keys.index(key) if self.keys else int(key)
            stages = sorted(s for s, blocks in enumerate(self.stage_blocks) if index in blocks)
            cut = self.cut(index)
            if cut is not None and inside:
                return {stages[-1] if inside.partition(".")[0] in cut.second else stages[0]}
            return set(stages)
        return set(range(self.num_stages))


def check_module(module: nn.Module, pipeline_size: int) -> None:
    """The LightningModule must say how the last stage computes the loss: ``pipeline_loss(output, target)``."""
    if not callable(getattr(module, "pipeline_loss", None)):
        raise TypeError(
            f"`pipeline_parallel_size={pipeline_size}` needs a `pipeline_loss(output, target)` method on"
            f" {type(module).__name__}: the loss of one microbatch, computed on the last stage, and a"
            " `training_step` that computes its loss as `self.pipeline_loss(self.model(x), y)` (docs/pipeline.md)."
        )


SPLIT_METHODS = ("parameters", "time", "uniform", "type:<regex>")


def check_split(value: Any) -> str | tuple[tuple[str, ...], ...]:
    """The ``pipeline_split`` flag: ``"parameters"``, ``"time"``, ``"uniform"``, ``"type:<regex>"`` (a valid regex),
    or the module names of each stage (a list of lists of strings, normalized to tuples)."""
    if isinstance(value, str):
        if value in ("parameters", "time", "uniform"):
            return value
        if value.startswith("type:"):
            try:
                re.compile(value[5:])
            except re.error as err:
                raise ValueError(f"`pipeline_split={value!r}`: {value[5:]!r} is not a regular expression ({err}).")
            return value
    elif isinstance(value, Sequence) and value and all(
            isinstance(names, Sequence) and not isinstance(names, str) and names
            and all(isinstance(n, str) for n in names) for names in value):
        return tuple(tuple(names) for names in value)
    raise ValueError(
        f"`pipeline_split={value!r}` is not a way to split the blocks into stages. Allowed values: 'parameters'"
        " (balanced by parameter count, the default), 'time' (by each block's compute, timed at setup on"
        " the data's first microbatch), 'uniform' (by block count), 'type:<regex>' (by the count of"
        " blocks whose class name matches), or the module names of each stage, one non-empty list per stage (for"
        " example [['tok', 'blocks.0', 'blocks.1'], ['blocks.2', 'blocks.3', 'head']])."
    )


Timer = Callable[[nn.Module, Sequence[nn.Module], Mapping[int, Cut]], "BlockTimes"]
"""``pipeline_split="time"``'s measure: (the model, its blocks, a cut per block that may be cut) -> the seconds
before the blocks, per block, after them, the share of a block's seconds its cut's first part takes, and how far
apart the timed passes were (:func:`ddp_plugin.parallel.stages.timing.time_blocks`)."""

NOISE_BAND = (0.05, 0.3)
"""``pipeline_split="time"`` keeps a simpler split (by parameters, then whole blocks) whose slowest stage is within
the timing's own measured noise of the best split's, taken at least 5 % (a split that differs by less than the
timing can tell would flip between two runs of the same job) and at most 30 % (a difference beyond that is acted
on even on a machine too busy to time well: the timing takes each part's fastest pass, which what else runs only
slows)."""


def plan_stages(module: nn.Module, num_stages: int, split: str | Sequence[Sequence[str]] = "parameters",
                timer: Timer | None = None) -> StagePlan:
    """Find the model's blocks (the ``ModuleList`` or ``ModuleDict`` with the most parameters) and split them into
    ``num_stages`` contiguous runs, in order, as ``split`` says (:func:`check_split`): balanced by parameter count,
    the modules before them counted with the first stage and those after them with the last (DeepSpeed's
    ``partition_method="parameters"``), by compute (``"time"``: ``timer``'s seconds, counted the same way), by
    block count (``"uniform"``), by the count of blocks whose class name matches a regex (``"type:<regex>"``), or
    as named. Raises ``TypeError`` for a module that does not follow the contract and ``ValueError`` for a split
    that cannot hold."""
    described = transformers_stages.find(module)
    if described is not None:
        return _plan_described(module, described, num_stages, split, timer)
    lists = [(name, m) for name, m in module.named_modules()
             if isinstance(m, (nn.ModuleList, nn.ModuleDict)) and len(m)]
    if not lists:
        raise TypeError(
            f"`pipeline_parallel_size` needs a model whose layers are an `nn.ModuleList` (or an `nn.ModuleDict`"
            f" keyed by layer id) of blocks to split into stages; {type(module).__name__} has none. Hold the"
            " repeated blocks in one (as `self.blocks`), modules before it (embeddings) and after it (final norm,"
            " output head) as siblings."
        )
    path, _ = max(lists, key=lambda item: sum(p.numel() for p in item[1].parameters()))
    owner_path, _, blocks_name = path.rpartition(".")
    owner = module.get_submodule(owner_path)
    children = list(owner.named_children())
    position = [name for name, _ in children].index(blocks_name)
    before = tuple(name for name, _ in children[:position])
    after = tuple(name for name, _ in children[position + 1:])
    loose = [name for name, _ in owner.named_parameters(recurse=False)]
    if loose:
        raise TypeError(
            f"{', '.join(repr(f'{owner_path}.{n}' if owner_path else n) for n in loose)} belongs to no child module"
            f" of {type(owner).__name__}, so no stage can own it. Hold it in a module registered before"
            f" `{blocks_name}` (first stage) or after it (last stage)."
        )
    outside = [name for name, _ in module.named_parameters()
               if not (name.startswith(f"{owner_path}.") or not owner_path)]
    if outside:
        raise TypeError(
            f"Parameters outside the pipelined model `{owner_path}`: {', '.join(outside[:5])}. With"
            " `pipeline_parallel_size` > 1 every parameter must belong to the model whose blocks are split."
        )
    return _cut(module, owner_path, blocks_name, before, after, num_stages, split, timer)


def _plan_described(module: nn.Module, layout: Any, num_stages: int, split: str | Sequence[Sequence[str]],
                    timer: Timer | None) -> StagePlan:
    """The stages of a Hugging Face model, from its own stage description (``transformers_stages.find``)."""
    placed = (layout.blocks, *layout.before, *layout.after)
    stray = [name for name, _ in module.named_parameters()
             if not any(name.startswith(f"{layout.owner}.{p}." if layout.owner else f"{p}.") for p in placed)]
    if stray:
        raise TypeError(
            f"Parameters that {type(module.get_submodule(layout.owner)).__name__}'s `base_model_pp_plan` places on"
            f" no stage: {', '.join(stray[:5])}. With `pipeline_parallel_size` > 1 every parameter must belong to a"
            " module the plan names.")
    return _cut(module, layout.owner, layout.blocks, layout.before, layout.after, num_stages, split, timer,
                kind="transformers", output=layout.output)


def _cut(module: nn.Module, owner_path: str, blocks_path: str, before: tuple[str, ...], after: tuple[str, ...],
         num_stages: int, split: str | Sequence[Sequence[str]], timer: Timer | None = None,
         **kind: str) -> StagePlan:
    """The blocks at ``blocks_path`` below the model at ``owner_path`` cut into ``num_stages`` runs as ``split``
    says; ``before`` and ``after`` (paths below the model) go with the first and the last stage."""
    owner = module.get_submodule(owner_path)
    blocks = get_path(owner, blocks_path)
    path = f"{owner_path}.{blocks_path}" if owner_path else blocks_path
    if len(blocks) < num_stages:
        raise ValueError(
            f"`{path}` has {len(blocks)} blocks, fewer than the {num_stages} pipeline stages"
            " (`pipeline_parallel_size` x `pipeline_virtual_stages`); each stage runs at least one block."
        )
    is_dict = isinstance(blocks, nn.ModuleDict)
    keys = tuple(blocks.keys()) if is_dict else ()
    listed = list(blocks.values()) if is_dict else list(blocks)
    cuts: dict[int, Cut] = {}
    if not isinstance(split, str):
        runs, named = stage_names.named_runs(split, num_stages, owner_path, blocks_path,
                                  keys or tuple(map(str, range(len(blocks)))), before, after)
        cuts = {i: stage_names.named_cut(listed[i], f"{path}.{keys[i] if keys else i}", *parts) for i, parts in named.items()}
    elif split == "time":
        if timer is None:
            raise ValueError("`pipeline_split='time'` times the blocks when a fit sets the stages up.")
        options = {i: _middle(b, found) for i, b in enumerate(listed) if (found := block_cut.candidates(b))}
        runs, cuts = _by_time(timer(owner, listed, options), options,
                              _parameter_runs(owner, listed, before, after, num_stages), num_stages)
    elif split == "parameters":
        runs = _parameter_runs(owner, listed, before, after, num_stages)
    else:
        runs = tuple(tuple(r) for r in _balanced_runs(_split_sizes(split, listed, path), num_stages))
    return StagePlan(owner_path, blocks_path, before, after, runs, keys, is_dict, cuts=tuple(sorted(cuts.items())),
                     **kind)


def _parameter_runs(owner: nn.Module, blocks: Sequence[nn.Module], before: tuple[str, ...], after: tuple[str, ...],
                    num_stages: int) -> tuple[tuple[int, ...], ...]:
    """The blocks' runs balanced by parameter count, the modules before and after the blocks weighing on the first
    and the last stage."""
    def count(names: tuple[str, ...]) -> int:
        return sum(p.numel() for n in names if (m := get_path(owner, n)) is not None for p in m.parameters())

    sizes = _split_sizes("parameters", blocks, "")
    sizes[0] += count(before)
    sizes[-1] += count(after)
    return tuple(tuple(r) for r in _balanced_runs(sizes, num_stages))


def _by_time(times: BlockTimes, options: Mapping[int, Cut], by_parameters: tuple[tuple[int, ...], ...],
             num_stages: int) -> tuple[tuple[tuple[int, ...], ...], dict[int, Cut]]:
    """The runs (and cut blocks) of ``pipeline_split="time"``: the best balance of the timed compute, a block that
    may be cut counted as its two parts; but the split by parameters where its slowest stage is within the noise
    (the timing's own, within :data:`NOISE_BAND`) of the best one's, else the best split into whole blocks where that
    is, so that a balance the timing cannot tell apart does not flip between runs."""
    whole = list(times.blocks)
    whole[0] += times.before
    whole[-1] += times.after
    pieces = []  # (block, seconds): a block that may be cut is two pieces, its parts
    for i, t in enumerate(times.blocks):
        share = times.shares.get(i)
        pieces += [(i, t * share), (i, t * (1 - share))] if share is not None else [(i, t)]
    weights = [t for _, t in pieces]
    weights[0] += times.before
    weights[-1] += times.after
    piece_runs = _balanced_runs(weights, num_stages)
    best = max(sum(weights[j] for j in run) for run in piece_runs)
    noise = min(max(NOISE_BAND[0], times.noise), NOISE_BAND[1])
    tolerance = best * (1 + noise)

    def slowest(runs: Sequence[Sequence[int]]) -> float:
        return max(sum(whole[i] for i in run) for run in runs)

    by_blocks = tuple(tuple(r) for r in _balanced_runs(whole, num_stages))
    for runs, why in ((by_parameters, "the split by parameters"), (by_blocks, "whole blocks")):
        if slowest(runs) <= tolerance:
            log.info("ddp_plugin: pipeline_split='time': %s, its slowest stage %.2f ms against %.2f ms for the best"
                     " split, within the timing's noise (%.0f %%)", why, slowest(runs) * 1e3, best * 1e3, 100 * noise)
            return runs, {}
    runs = tuple(tuple(dict.fromkeys(pieces[j][0] for j in run)) for run in piece_runs)
    return runs, {run[-1]: options[run[-1]] for run, later in zip(runs, runs[1:]) if run[-1] == later[0]}


def _middle(block: nn.Module, cuts: Sequence[Cut]) -> Cut:
    """Of a block's cuts, the one nearest its middle by parameter count (the split by time then times it)."""
    def count(names: Sequence[str]) -> int:
        return sum(p.numel() for name, p in block.named_parameters() if name.partition(".")[0] in names)

    return min(cuts, key=lambda c: abs(count(c.first) - count(c.second)))


def _split_sizes(split: str, blocks: Sequence[nn.Module], path: str) -> list[int]:
    """Each block's weight in the balance: 1 (``"uniform"``), whether its class matches (``"type:<regex>"``), or
    its parameter count."""
    if split == "uniform":
        return [1] * len(blocks)
    if split.startswith("type:"):
        pattern = re.compile(split[5:])
        sizes = [int(bool(pattern.search(type(b).__name__))) for b in blocks]
        if not any(sizes):
            raise ValueError(
                f"`pipeline_split={split!r}` matches none of the blocks of `{path}`"
                f" ({', '.join(sorted({type(b).__name__ for b in blocks}))}): nothing to balance."
            )
        return sizes
    return [sum(p.numel() for p in b.parameters()) for b in blocks]


def get_path(owner: nn.Module, path: str) -> Any:
    """The child at a dotted ``path`` below ``owner`` (``None`` where a stage left it out)."""
    for part in path.split("."):
        owner = getattr(owner, part)
    return owner


def set_path(owner: nn.Module, path: str, value: Any) -> None:
    parent, _, name = path.rpartition(".")
    setattr(get_path(owner, parent) if parent else owner, name, value)


def left_out(plan: StagePlan) -> nn.Module | None:
    """What stands for a module another stage holds: ``None`` (the contract's ``forward`` skips it), or for a
    Hugging Face model (whose ``forward`` calls its norm and head unconditionally) an ``nn.Identity``."""
    return nn.Identity() if plan.kind == "transformers" else None


def _balanced_runs(sizes: Sequence[float], parts: int) -> list[list[int]]:
    """Split ``range(len(sizes))`` into ``parts`` non-empty contiguous runs minimizing the largest run's sum
    (dynamic programming; ties go to the earliest split)."""
    n = len(sizes)
    prefix = [0]
    for s in sizes:
        prefix.append(prefix[-1] + s)
    inf = float("inf")
    best = [[inf] * (n + 1) for _ in range(parts + 1)]
    cut = [[0] * (n + 1) for _ in range(parts + 1)]
    best[0][0] = 0
    for k in range(1, parts + 1):
        for i in range(k, n + 1):
            for j in range(k - 1, i):
                cost = max(best[k - 1][j], prefix[i] - prefix[j])
                if cost < best[k][i]:
                    best[k][i], cut[k][i] = cost, j
    runs, i = [], n
    for k in range(parts, 0, -1):
        j = cut[k][i]
        runs.append(list(range(j, i)))
        i = j
    return runs[::-1]


class StageBlocks(nn.ModuleList):
    """The blocks of this rank's stages under their original indices (``blocks.5`` stays ``blocks.5``, so state
    dicts keep the unsplit model's names); iterating yields them in order, indexing counts positions."""

    def __init__(self, blocks: Mapping[int, nn.Module]) -> None:
        super().__init__()
        for index in sorted(blocks):
            self.add_module(str(index), blocks[index])

    def __getitem__(self, idx: Any) -> Any:
        if isinstance(idx, slice):
            return nn.ModuleList(list(self._modules.values())[idx])
        return list(self._modules.values())[idx]


def stage_blocks(plan: StagePlan, blocks: Mapping[int, nn.Module]) -> nn.Module:
    """The container of the blocks at ``blocks``' positions, as the model holds them: a :class:`StageBlocks`, or
    for a ``ModuleDict`` one under the original keys, in order (torchtitan deletes the other stages' keys)."""
    if plan.is_dict:
        return nn.ModuleDict({plan.key(i): blocks[i] for i in sorted(blocks)})
    return StageBlocks(blocks)


def split_module(module: nn.Module, plan: StagePlan, stages: Iterable[int]) -> None:
    """Keep in ``module`` only what ``stages`` run: the other stages' blocks leave the block list (a
    :class:`StageBlocks`, or a ``ModuleDict`` of the stages' keys) and the first and last stage's modules become
    ``None`` elsewhere. In place."""
    stages = set(stages)
    owner = module.get_submodule(plan.owner)
    keep = {i for s in stages for i in plan.stage_blocks[s]}
    blocks = get_path(owner, plan.blocks)
    for i, cut in plan.cuts:  # a cut block: this rank's part of it
        held = [s for s in stages if i in plan.stage_blocks[s]]
        if len(held) == 2:
            raise ValueError(f"Both parts of the cut block `{plan.blocks}.{plan.key(i)}` are on one pipeline rank.")
        if held:
            second = held[0] == max(s for s, run in enumerate(plan.stage_blocks) if i in run)
            block_cut.keep_part(blocks._modules[plan.key(i)], cut, second)
    set_path(owner, plan.blocks, stage_blocks(plan, {i: blocks._modules[plan.key(i)] for i in keep}))
    for name in plan.before if 0 not in stages else ():
        set_path(owner, name, left_out(plan))
    for name in plan.after if plan.num_stages - 1 not in stages else ():
        set_path(owner, name, left_out(plan))
