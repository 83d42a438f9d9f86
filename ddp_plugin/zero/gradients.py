"""The gradients of a sharded model as users see them: norms for clipping and logging, computed from the
shards with one small all-reduce, and the whole gradients lent to the module on demand (stages 2-3, where each
rank keeps only its shard)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import Tensor, nn

from ddp_plugin.hookspecs import is_tensor_parallel_shard, local_tensor, pipeline_copies, set_local_grad
from ddp_plugin.parallel.tensor_parallel import split_norms

if TYPE_CHECKING:
    from torch.optim import Optimizer

    from ddp_plugin.zero.shards import Shards


def grad_stats(shards: Shards, norm_type: float | None) -> tuple[Tensor, Tensor]:
    """Per bucket parameter, in bucket order: whether some rank's pieces of it have a gradient, and (with
    ``norm_type``) the sum of ``|g|^norm_type`` over all its pieces, or the max of ``|g|`` for ``inf``. Partial
    values from this rank's pieces, combined over the shard group by one all-reduce."""
    first = [0]
    for bucket in shards.buckets:
        first.append(first[-1] + len(bucket.params))
    n = first[-1]
    inf = norm_type == float("inf")
    local = torch.zeros(2 * n, dtype=torch.float64, device=shards.layout.topology.device)
    for b, entry in enumerate(shards.entries):
        for piece in entry.pieces:
            if piece.param.grad is None:
                continue
            j = first[b] + piece.index
            local[n + j] = 1.0
            if norm_type is not None:
                g = piece.param.grad.detach().double().abs()
                local[j] = torch.maximum(local[j], g.max()) if inf else local[j] + g.pow(norm_type).sum()
    op = dist.ReduceOp.MAX if inf else dist.ReduceOp.SUM
    shards.comm.all_reduce(local, op=op, group=shards.layout.shard_group()[0])
    return local[n:] > 0, local[:n]


def grad_norms(shards: Shards, module: nn.Module, norm_type: float) -> dict[str, Tensor]:
    """``{name: norm}`` of every parameter of ``module`` with a gradient, from the shards (collective)."""
    inf = norm_type == float("inf")
    present, partial = grad_stats(shards, norm_type)
    where: dict[int, int] = {}
    for bucket in shards.buckets:
        for p in bucket.params:
            where[id(p)] = len(where)
    # A tensor-parallel shard's partial covers this rank's block: summed over the tensor-parallel group too.
    split = torch.tensor([is_tensor_parallel_shard(p) for bucket in shards.buckets for p in bucket.params],
                         dtype=torch.bool, device=partial.device)
    partial = split_norms(partial, split, shards.layout.topology.tensor_parallel_group, inf, shards.comm.all_reduce)
    norms: dict[str, Tensor] = {}
    for name, p in module.named_parameters():
        j = where.get(id(p))
        if j is None:
            if p.grad is not None:  # not sharded: whole on every rank
                g = p.grad.detach()
                norms[name] = (g.full_tensor() if hasattr(g, "full_tensor") else g).norm(norm_type)
        elif present[j]:
            value = partial[j] if inf else partial[j] ** (1.0 / norm_type)
            norms[name] = value.to(p.dtype)
    return norms


def clip_grad_norm(shards: Shards, optimizer: Optimizer, max_norm: float, whole_buckets: bool) -> Tensor:
    """Scale the gradients ``optimizer`` applies so that their global 2-norm is at most ``max_norm``; return the
    norm before clipping. Sharded gradients are summed over the shard group (one all-reduce), gradients of
    parameters that are not sharded are the same on every rank and counted once. With tensor parallelism, the
    parts of parameters split over the tensor-parallel group are summed over it too (one more scalar
    all-reduce), and replicated ones counted once. ``whole_buckets`` (stage 1, where the pieces' gradients are
    slices of the buckets and the module's ``.grad`` views all of them): scale the whole buckets, so that
    ``.grad`` shows what the optimizer applies, the same on every rank."""
    grads = [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
    # id(piece gradient) -> whether its parameter is split over the tensor-parallel group
    sharded = {id(piece.param.grad): is_tensor_parallel_shard(bucket.params[piece.index])
               for bucket, entry in zip(shards.buckets, shards.entries) for piece in entry.pieces
               if piece.param.grad is not None}
    topology = shards.layout.topology
    pieces = torch.zeros(2, dtype=torch.float64, device=topology.device)  # [split, replicated] over the shards
    whole = torch.zeros(2, dtype=torch.float64, device=topology.device)  # [split, replicated], not ZeRO-sharded
    # A parameter several pipeline stages hold counts 1 / copies on each (the stages' norms are summed below).
    weights = {id(g): 1.0 / pipeline_copies(p) for group in optimizer.param_groups for p in group["params"]
               for g in (p.grad,) if g is not None}
    for bucket, entry in zip(shards.buckets, shards.entries):
        for piece in entry.pieces:
            if piece.param.grad is not None:
                weights[id(piece.param.grad)] = 1.0 / pipeline_copies(bucket.params[piece.index])
    for g in grads:
        sq = local_tensor(g).detach().double().pow(2).sum()
        if weights.get(id(g), 1.0) != 1.0:
            sq = sq * weights[id(g)]
        if id(g) in sharded:
            pieces[0 if sharded[id(g)] else 1] += sq
        else:
            whole[0 if is_tensor_parallel_shard(g) else 1] += sq
    shards.comm.all_reduce(pieces, group=shards.layout.shard_group()[0])
    split = pieces[0] + whole[0]
    if topology.tensor_parallel_group is not None:
        shards.comm.all_reduce(split, group=topology.tensor_parallel_group)
    total = split + pieces[1] + whole[1]
    if topology.pipeline_parallel_group is not None:
        shards.comm.all_reduce(total, group=topology.pipeline_parallel_group)
    total = total.sqrt().to(torch.float32)
    clamped = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    tensors = [local_tensor(g) for g in grads]
    if whole_buckets:
        tensors = [t for g, t in zip(grads, tensors) if id(g) not in sharded] + [b.buffer for b in shards.buckets]
    for t in tensors:
        t.mul_(clamped.to(t.dtype))
    return total


class LentGradients:
    """``on_gather_full_gradients``: all-gather the shards' gradients into buffers of their own and point each
    module parameter's ``.grad`` at its slice; on return, restore each ``.grad``. Nested calls lend once."""

    def __init__(self, shards: Shards) -> None:
        self.shards = shards
        self._lent: list[tuple[nn.Parameter, Tensor | None]] = []
        self._depth = 0

    def lend(self) -> None:
        self._depth += 1
        if self._depth > 1:
            return  # nested: lent already (every rank nests alike)
        self._lent = []
        present, _ = grad_stats(self.shards, None)
        j = 0
        for bucket, entry in zip(self.shards.buckets, self.shards.entries):
            flags = present[j : j + len(bucket.params)].tolist()
            j += len(bucket.params)
            if not any(flags):
                continue
            local = entry.shard.new_zeros(entry.shard.numel())
            for piece in entry.pieces:
                if piece.param.grad is not None:
                    local[piece.at : piece.at + piece.param.numel()].copy_(piece.param.grad.detach().reshape(-1))
            # A buffer of its own, not the bucket's: during accumulation the bucket holds this rank's running sum.
            full = local.new_empty(bucket.numel)
            self.shards.gather(full, local)
            for i, p in enumerate(bucket.params):
                if flags[i]:
                    self._lent.append((p, p.grad))
                    local = local_tensor(p)
                    set_local_grad(p, full[bucket.offsets[i] : bucket.offsets[i] + local.numel()].view_as(local))

    def take_back(self) -> None:
        self._depth = max(self._depth - 1, 0)
        if self._depth == 0:
            for p, previous in self._lent:
                p.grad = previous
            self._lent = []
