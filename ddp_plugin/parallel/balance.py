"""``pipeline_split="time"``: each block's forward and backward timed once at setup, on this machine's device, so
the stages can be cut where their compute is equal instead of their parameter counts.

The model's own ``forward`` runs on ``example_input_array`` (a microbatch as the pipelined model takes it) with
hooks on every block stamping when its forward and its backward start and end; what runs before the first block
(embeddings) and after the last (final norm, head, and a stand-in loss: the mean of the output's squares, the model
having no target here) is timed with the first and the last stage. Each rank times the same model; the times are
averaged over every rank, so each rank cuts the same stages. The module's buffers and the random generators are
left as they were, and no gradient stays behind.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from lightning.fabric.utilities.apply_func import move_data_to_device
from torch import Tensor, nn
from torch.utils._pytree import tree_leaves

from ddp_plugin.parallel.block_cut import Cut

REPEATS = 3
"""Timed passes (after one untimed): each part's median counts."""


def check_example(module: Any) -> Any:
    """The ``example_input_array`` of the LightningModule ``module``; a clear error where it has none."""
    example = getattr(module, "example_input_array", None)
    if example is None:
        raise TypeError(
            f"`pipeline_split='time'` times every block on an example microbatch: set `self.example_input_array` in"
            f" {type(module).__name__}.__init__ to what the pipelined model takes (`self.model(x)`'s `x`, a tuple of"
            " arguments or a dict of keyword arguments), with the microbatch size you train with. Or balance by"
            " `pipeline_split='parameters'` (the default)."
        )
    return example


def time_blocks(owner: nn.Module, blocks: Sequence[nn.Module], example: Any, device: torch.device,
                group: dist.ProcessGroup | None = None, cuts: Mapping[int, Cut] | None = None) -> list[float]:
    """Seconds of forward plus backward of what runs before the first block, of each block, and of what runs after
    the last (``len(blocks) + 2`` numbers), on ``device`` (``owner`` moved there for the timing and back),
    averaged over the ranks of ``group`` (collective). With ``cuts`` (a cut per block position), then for each
    cut, in the order of the positions, the share of its block's time that its first part takes: the forward
    time of the modules the first part calls over that of all the modules either part calls (the backward taken
    to follow the forward's proportions)."""
    if any(p.is_meta for p in owner.parameters()):
        raise ValueError(
            "`pipeline_split='time'` runs the model to time its blocks, and this model was built on the meta device"
            " (`trainer.init_module(empty_init=True)`): it has no weights to run yet. Name the stages' modules"
            " (`pipeline_split=[[...], [...]]`) or balance by `'parameters'`."
        )
    home = next((p.device for p in owner.parameters()), device)
    buffers = {name: b.detach().clone() for name, b in owner.named_buffers()}
    owner.to(device)
    try:
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            parts = _timed(owner, blocks, move_data_to_device(example, device), _synchronizer(device), cuts or {})
    finally:
        for p in owner.parameters():
            p.grad = None
        with torch.no_grad():
            for name, b in owner.named_buffers():
                b.copy_(buffers[name].to(b.device))
        owner.to(home)
    seconds = torch.tensor(parts, dtype=torch.float64, device=device)
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.all_reduce(seconds, group=group)
        seconds /= dist.get_world_size(group)
    return seconds.tolist()


def _timed(owner: nn.Module, blocks: Sequence[nn.Module], example: Any, sync: Callable[[], None],
           cuts: Mapping[int, Cut]) -> list[float]:
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
    n, runs, shares = len(blocks), [], []
    try:
        for _ in range(REPEATS + 1):
            stamps.clear()
            spent.clear()
            sync()
            start = time.perf_counter()
            output = _call(owner, example)
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
            for p in owner.parameters():
                p.grad = None
    finally:
        for handle in handles:
            handle.remove()
    return ([max(0.0, statistics.median(column)) for column in zip(*runs[1:])]
            + [statistics.median(column) for column in zip(*shares[1:])])


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


def _call(owner: nn.Module, example: Any) -> Any:
    if isinstance(example, Mapping):
        return owner(**example)
    if isinstance(example, (tuple, list)):
        return owner(*example)
    return owner(example)


def _synchronizer(device: torch.device) -> Callable[[], None]:
    if device.type == "cuda":
        return lambda: torch.cuda.synchronize(device)
    return lambda: None
