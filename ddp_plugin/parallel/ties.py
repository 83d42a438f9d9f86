"""Parameters several pipeline stages hold (a tied embedding and output head): found after the split, started
equal, and their gradients summed over the stages every step, so that every copy stays bit-identical
(docs/pipeline.md, "Shared embeddings")."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from ddp_plugin.hookspecs import Bucket, local_tensor

if TYPE_CHECKING:
    from ddp_plugin.parallel.stages import StagePlan


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


class TiedGradients:
    """The sums of the ties' gradients over their copies' ranks (:meth:`sum`; :func:`synchronize` says when)."""

    def __init__(self, ties: list[Tie]) -> None:
        self.ties = ties
        self.comm: Any = None
        """The fit's communicator (``TracedCommunicator``): the sums are counted in the traffic metrics. Set when a
        fit starts (:meth:`~ddp_plugin.parallel.pipeline.PipelineRunner.attach`); the sums run only in a fit."""
        self.hook: Any = None
        """The fit's hook relay where a codec answers ``on_cross_node_reduce`` (``Options.cross_node_codec``): the
        sums go through it, as a bucket of kind ``"tied_gradient"`` each; ``None``: summed in fp32."""
        self._tie_buckets: dict[int, Bucket] = {}
        self._lined_up: set[int] = set()

    def sum(self, data_parallel: tuple[dist.ProcessGroup, int, int] | None = None,
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
            self.comm.all_gather(whole, mine, group=group)
            flat.copy_(whole[:flat.numel()])

    def _check_lined_up(self, number: int, tie: Tie, offset: int, size: int, numel: int) -> None:
        """Once per tie: every copy's rank holds the same part of a bucket of the same size (the stages' shard
        layouts are alike by construction; a mismatch would sum different elements)."""
        if number in self._lined_up:
            return
        mine = torch.tensor([offset, size, numel], dtype=torch.int64)
        spread = torch.cat([mine, -mine])  # (the maximum and minus the minimum in one all-reduce)
        dist.all_reduce(spread, op=dist.ReduceOp.MAX, group=tie.group)
        high, low = spread[:3], -spread[3:]
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
            self.comm.all_reduce(tensor, group=tie.group)
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


def sync_ties(ties: Iterable[Tie]) -> None:
    """Every copy of a shared parameter takes the first stage's value (collective over each tie's ranks)."""
    for tie in ties:
        if tie.param is not None:
            with torch.no_grad():
                dist.broadcast(local_tensor(tie.param).data, src=dist.get_global_rank(tie.group, 0), group=tie.group)
