"""``pipeline_split`` as the module names of each stage (torchtitan's ``module_fqns_per_model_part``): the blocks'
positions per stage, and the blocks a list cuts between two stages (named by their parts' modules)."""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn

from ddp_plugin.parallel.stages import cut as block_cut
from ddp_plugin.parallel.stages.cut import Cut


def named_runs(split: Sequence[Sequence[str]], num_stages: int, owner: str, blocks: str, keys: Sequence[str],
                before: Sequence[str], after: Sequence[str]
                ) -> tuple[tuple[tuple[int, ...], ...], dict[int, tuple[tuple[str, ...], tuple[str, ...]]]]:
    """The blocks' positions per stage from the module names of each stage (``pipeline_split`` as a list, as
    torchtitan's ``module_fqns_per_model_part``): names of the model's modules, with or without the
    LightningModule's prefix (``"blocks.3"`` or ``"model.blocks.3"``). The blocks must be named once each, in
    order, at least one per stage; the modules before them may be named in the first stage, those after them in
    the last. A block may instead be cut between two consecutive stages, each naming its own part's children
    (``"blocks.2.attn"`` at the end of one stage, ``"blocks.2.mlp"`` at the start of the next); such blocks are
    returned too, with the attributes each stage named."""
    flag = f"`pipeline_split` (a list of {len(split)} stages)"
    if len(split) != num_stages:
        raise ValueError(f"{flag} names {len(split)} stages; the pipeline runs {num_stages}"
                         " (`pipeline_parallel_size` x `pipeline_virtual_stages`): one list per stage.")
    position = {f"{blocks}.{key}": i for i, key in enumerate(keys)}
    prefix = f"{owner}." if owner else ""
    runs, seen, parts = [], [], []  # parts: per stage, block position -> the attributes it named
    for stage, names in enumerate(split):
        run: list[int] = []
        named: dict[int, list[str]] = {}
        for full in names:
            name = full[len(prefix):] if prefix and full.startswith(prefix) else full
            key, _, rest = name[len(blocks) + 1:].partition(".") if name.startswith(f"{blocks}.") else ("", "", "")
            block, inside = (f"{blocks}.{key}", rest.partition(".")[0]) if rest else (None, "")
            if block not in position:
                block = None
            if name in position:
                run.append(position[name])
            elif block is not None:
                if not run or run[-1] != position[block]:
                    run.append(position[block])
                named.setdefault(position[block], []).append(inside)
            elif name in before or name in after:
                where, wanted = ("first", 0) if name in before else ("last", num_stages - 1)
                if stage != wanted:
                    raise ValueError(f"{flag}: `{full}` is in stage {stage}, but it runs {'before' if wanted == 0 else 'after'}"
                                     f" the blocks: it belongs to the {where} stage ({wanted}).")
            else:
                raise ValueError(
                    f"{flag}: `{full}` is not a block of `{prefix}{blocks}` nor a module before or after it. The"
                    f" blocks: {', '.join(list(position)[:3])}, ...; before them: {', '.join(before) or 'none'};"
                    f" after them: {', '.join(after) or 'none'}."
                )
        if not run:
            raise ValueError(f"{flag}: stage {stage} ({list(names)}) names no block; each stage runs at least one.")
        runs.append(tuple(run))
        parts.append(named)
        seen.extend(run)
    cuts: dict[int, tuple[tuple[str, ...], tuple[str, ...]]] = {}
    for stage, named in enumerate(parts):
        for i, attributes in named.items():
            nxt = parts[stage + 1].get(i) if stage + 1 < num_stages else None
            if i in cuts:
                continue
            if (nxt is None or runs[stage][-1] != i or runs[stage + 1][0] != i
                    or (stage > 0 and i in parts[stage - 1])):
                name = f"{prefix}{blocks}.{keys[i]}"
                raise ValueError(
                    f"{flag} names parts of `{name}` ({', '.join(f'`{name}.{a}`' for a in attributes)}) in stage"
                    f" {stage}: a block is named whole, or cut between two consecutive stages, its first part's"
                    " modules last in one stage and its second part's first in the next."
                )
            cuts[i] = (tuple(attributes), tuple(nxt))
    merged = [i for j, i in enumerate(seen) if not (j and i == seen[j - 1] and i in cuts)]
    if merged != list(range(len(keys))):
        missing = [f"{blocks}.{keys[i]}" for i in range(len(keys)) if i not in seen]
        raise ValueError(
            f"{flag} must name every block of `{prefix}{blocks}` once, in order, stage after stage"
            + (f"; missing: {', '.join(missing)}" if missing else f"; named: {', '.join(f'{blocks}.{keys[i]}' for i in seen)}")
            + "."
        )
    return tuple(runs), cuts


def named_cut(block: nn.Module, path: str, first: Sequence[str], second: Sequence[str]) -> Cut:
    """The cut of the block at ``path`` whose first part holds the attributes ``first`` and whose second part holds
    ``second`` (as the stages named them); ``ValueError`` saying why where none does."""
    fitting = [c for c in block_cut.candidates(block) if set(first) <= set(c.first) and set(second) <= set(c.second)]
    if fitting:
        return fitting[0]
    try:
        block_cut.find(block, second[0])
        why = "no cut puts them on those sides"
    except ValueError as err:
        why = str(err)
    raise ValueError(
        f"`pipeline_split` cuts `{path}` between two stages ({', '.join(f'`{path}.{n}`' for n in first)} before,"
        f" {', '.join(f'`{path}.{n}`' for n in second)} after), and it cannot be cut there: {why}. A block is cut"
        " where one value crosses (docs/pipeline.md, \"Where the stages split\"); or name it whole in one stage."
    )
