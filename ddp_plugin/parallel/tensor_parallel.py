"""Tensor parallelism inside a node, the strategy's side of it.

The module parallelizes itself in ``configure_model`` on ``self.device_mesh["tensor_parallel"]`` (Lightning's
``ModelParallelStrategy`` contract: ``torch.distributed.tensor.parallel.parallelize_module``), so its split
parameters are DTensors whose local shards live on each rank of a tensor-parallel group. Data parallelism is the
strategy's own: the gradient engine and every data-parallel plugin work on local shards over the data-parallel
groups of :class:`~ddp_plugin.hookspecs.Topology`. This module holds what is specific to the split:

- :func:`check_flags`: a codec that would let replicated parameters drift apart at stage 3 is refused;
- :func:`check_module`: a module that also applies FSDP (the other half of Lightning's recipe) is refused, and so
  is a DTensor parameter on any other mesh than the tensor-parallel one;
- :func:`sync_module_states`: every rank starts from rank 0's model (each shard from its data-parallel rank 0);
- :func:`global_grad_norm`: the 2-norm of every gradient, a split parameter counted once over its shards and a
  replicated one once, not once per tensor-parallel rank;
- :func:`full_state_dict` / :func:`distribute_state_dict`: checkpoints hold whole, plain tensors, loadable into the
  unsplit model in one process, and load back into any split;
- :func:`local_blocks`: for ``checkpoint="sharded"``, each rank writes its own blocks of the split tensors (no
  gather), under keys that say where a block lies in the whole tensor;
- :class:`Whereabouts`: which split module's forward or backward a rank is in, for the failure diagnosis of the
  tensor-parallel collectives (they run inside DTensor's operations, where nothing else can name them).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from itertools import chain
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.tensor import DTensor, distribute_tensor

from ddp_plugin.runtime.comm import broadcast_coalesced
from ddp_plugin.runtime.storage import unallocated
from ddp_plugin.hookspecs import (
    is_tensor_parallel_shard,
    local_tensor,
    pipeline_copies,
    tensor_parallel_blocks,
)

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.nn import Module



def _fsdp_types() -> tuple[type, ...]:
    from torch.distributed.fsdp import FullyShardedDataParallel

    try:
        from torch.distributed.fsdp import FSDPModule  # torch >= 2.6
    except ImportError:  # pragma: no cover - older torch
        from torch.distributed._composable.fsdp import FSDPModule
    return FSDPModule, FullyShardedDataParallel


LOSSLESS_AT_STAGE_3 = (None, "fp16", "bf16")
"""The codecs a ZeRO stage 3 unit may hold a tensor-parallel replica with (a parameter several ranks must keep
bit-identical, beside split ones in the unit's bucket): they cast each element alone; the others code a bucket as a
whole. (A parameter that pipeline stages share gets a bucket of its own in its unit: every codec works there.)"""


def check_flags(tensor_parallel_size: int, zero_stage: int, compression: str | None) -> None:
    """What the flags cannot do together once the tensor-parallel size is known (``"auto"`` is resolved at setup).
    A codec that codes a bucket as a whole (int8's block scales, top-k's selection, PowerSGD) on a stage 3 unit,
    whose bucket holds a block's split and replicated parameters together, would give a replicated parameter
    other bits on each tensor-parallel rank; fp16 and bf16 cast each element alone."""
    if tensor_parallel_size > 1 and zero_stage == 3 and compression not in LOSSLESS_AT_STAGE_3:
        raise ValueError(
            f"`compression={compression!r}` with `zero_stage=3` and `tensor_parallel_size={tensor_parallel_size}`"
            " is not supported: a stage 3 unit codes a block's split and replicated parameters together, and the"
            " replicated ones would drift apart between tensor-parallel ranks. Use `zero_stage` 0-2 with this codec,"
            " or `compression` None, 'fp16' or 'bf16' at stage 3."
        )


def check_module(module: Module, tensor_parallel_mesh: DeviceMesh | None) -> None:
    """Refuse what ``configure_model`` must not have done with this strategy: FSDP (``fully_shard`` or the
    ``FullyShardedDataParallel`` wrapper) and DTensor parameters on another mesh than the tensor-parallel one."""
    wrapped = [name or "the module" for name, m in module.named_modules() if isinstance(m, _fsdp_types())]
    if wrapped:
        raise TypeError(
            f"`configure_model` applied FSDP (`fully_shard` or `FullyShardedDataParallel`) to {', '.join(wrapped[:5])}"
            f"{' ...' if len(wrapped) > 5 else ''}. With HierarchicalZeroStrategy data parallelism is the strategy's:"
            " drop the `fully_shard` calls on `self.device_mesh['data_parallel']` and keep the tensor-parallel"
            " `parallelize_module` ones; to shard parameters, gradients or optimizer state over the data-parallel"
            " ranks, set `zero_stage` (1, 2 or 3) and `shard_scope`."
        )
    for name, p in module.named_parameters():
        if not isinstance(p, DTensor):
            continue
        if tensor_parallel_mesh is None or p.device_mesh != tensor_parallel_mesh:
            names = p.device_mesh.mesh_dim_names
            raise TypeError(
                f"Parameter {name!r} is a DTensor on the mesh {names or tuple(p.device_mesh.shape)}; with"
                " HierarchicalZeroStrategy a parameter may be split over `self.device_mesh['tensor_parallel']` only"
                " (`parallelize_module(module, self.device_mesh['tensor_parallel'], plan)`), and data parallelism"
                " is the strategy's (`zero_stage`, `shard_scope`)."
            )


def shared_parameters(module: Module) -> list[tuple[str, ...]]:
    """The names of every parameter that is one tensor under several names (a tied weight), each group in
    registration order."""
    names: dict[int, list[str]] = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
    return [tuple(group) for group in names.values() if len(group) > 1]


def restore_ties(module: Module, ties: Iterable[tuple[str, ...]]) -> list[tuple[str, ...]]:
    """Tie again what ``configure_model`` untied: ``parallelize_module`` gives each module it splits parameters of
    its own, so an output head tied to the embedding ends up a second, separate parameter. Each name of a group
    of ``ties`` (from :func:`shared_parameters` before ``configure_model``) is made to hold the group's first
    parameter again, when they are split alike (the same mesh and placements, or both whole). Returns the groups
    it tied again."""
    restored = []
    for group in ties:
        params = [module.get_parameter(name) for name in group]
        first = params[0]
        if all(p is first for p in params):
            continue
        for name, p in zip(group[1:], params[1:]):
            if p is not first and _split(p) != _split(first):
                raise TypeError(
                    f"{group[0]!r} and {name!r} were one parameter (tied) before `configure_model`, which split them"
                    f" differently: {_describe(first)} and {_describe(p)}. Split both alike (an embedding and its tied"
                    " output head both by vocabulary: `RowwiseParallel(input_layouts=Replicate())` on the embedding,"
                    " `ColwiseParallel(...)` on the head, both `Shard(0)`), or leave both whole, and tie them again"
                    f" at the end of `configure_model` (`module.{name} = module.{group[0]}`)."
                )
        for name in group[1:]:
            owner, _, leaf = name.rpartition(".")
            setattr(module.get_submodule(owner), leaf, first)
        restored.append(group)
    return restored


def _split(p: Tensor) -> Any:
    return (p.device_mesh, tuple(p.placements), tuple(p.shape)) if isinstance(p, DTensor) else tuple(p.shape)


def _describe(p: Tensor) -> str:
    if isinstance(p, DTensor):
        return f"a DTensor with placements {tuple(p.placements)}"
    return "a whole (plain) tensor"


def sync_module_states(module: Module, data_parallel_group: dist.ProcessGroup | None,
                       plain_group: dist.ProcessGroup | None = None) -> None:
    """Every rank starts from rank 0's parameters and buffers, as DDP: plain tensors from global rank 0 over the
    world, what a DTensor replicates over a mesh dimension from that dimension's rank 0, and a DTensor's local
    shard from data-parallel rank 0 over ``data_parallel_group`` (the ranks that hold the same shard; the shards
    of a tensor-parallel group already come from one model, as ``parallelize_module`` distributes them from its
    rank 0, or from each rank's own initialization). Collective.

    Tensors without memory yet are left out (:func:`~ddp_plugin.parallel.materialize.unallocated`): a ZeRO stage 3 sharder
    allocates them later and has them made
    equal then (:func:`sync_tensors`)."""
    ignore = set(getattr(module, "_ddp_params_and_buffers_to_ignore", []))
    sync_tensors([t for name, t in chain(module.named_parameters(), module.named_buffers())
                  if name not in ignore and not unallocated(t)], data_parallel_group, plain_group)


def sync_tensors(tensors: Iterable[Tensor], data_parallel_group: dist.ProcessGroup | None,
                 plain_group: dist.ProcessGroup | None = None) -> None:
    """:func:`sync_module_states` for the given parameters and buffers only (in the same order on every rank of
    each group). Collective."""
    plain: list[Tensor] = []
    split: list[Tensor] = []
    replicated: dict[dist.ProcessGroup, list[Tensor]] = {}
    for t in tensors:
        local = local_tensor(t).detach()
        (split if isinstance(t, DTensor) else plain).append(local)
        if isinstance(t, DTensor):
            for dim, placement in enumerate(t.placements):
                if placement.is_replicate() and t.device_mesh.size(dim) > 1:
                    replicated.setdefault(t.device_mesh.get_group(dim), []).append(local)
    if plain:  # (``plain_group``: a pipeline stage's ranks, which hold the same parameters; default the world)
        broadcast_coalesced(plain, plain_group)
    # What a DTensor replicates over its mesh (a row-wise layer's bias over the tensor-parallel ranks) from the
    # mesh dimension's first rank: a model materialized from the meta device drew it on each rank with that
    # rank's seed (eagerly built, it is equal already).
    for group, tensors in replicated.items():
        broadcast_coalesced(tensors, group)
    if split and data_parallel_group is not None and dist.get_world_size(data_parallel_group) > 1:
        broadcast_coalesced(split, data_parallel_group)


def squared_norms(grads: Iterable[tuple[Tensor, bool]], device: torch.device,
                  weights: Iterable[float] | None = None) -> tuple[Tensor, Tensor]:
    """``(split, whole)``: the float64 sums of squares of the local ``grads`` that are tensor-parallel shards
    (``True``) and of the others, each times its weight (``weights``: 1 / the pipeline stages holding a copy)."""
    split = torch.zeros((), dtype=torch.float64, device=device)
    whole = torch.zeros((), dtype=torch.float64, device=device)
    grads = list(grads)
    for (g, is_shard), weight in zip(grads, weights if weights is not None else [1.0] * len(grads)):
        sq = local_tensor(g).detach().double().pow(2).sum()
        if weight != 1.0:
            sq = sq * weight
        if is_shard:
            split += sq
        else:
            whole += sq
    return split, whole


def global_grad_norm(params: Iterable[Tensor], tensor_parallel_group: dist.ProcessGroup | None,
                     device: torch.device, pipeline_group: dist.ProcessGroup | None = None) -> Tensor:
    """The 2-norm of the gradients of ``params`` (whole on every data-parallel rank, as at ZeRO stage 0): a
    split parameter's shards summed over the tensor-parallel group, a replicated one counted once, and with
    pipeline stages every stage's part summed over ``pipeline_group`` (a parameter several stages hold counted
    once). Collective over those groups (one scalar all-reduce each)."""
    with_grads = [p for p in params if p.grad is not None]
    grads = [(p.grad, is_tensor_parallel_shard(p)) for p in with_grads]
    split, whole = squared_norms(grads, device, [1.0 / pipeline_copies(p) for p in with_grads])
    if tensor_parallel_group is not None:
        dist.all_reduce(split, group=tensor_parallel_group)
    total = split + whole
    if pipeline_group is not None:
        dist.all_reduce(total, group=pipeline_group)
    return total.sqrt()


def split_norms(values: Tensor, split: Tensor, tensor_parallel_group: dist.ProcessGroup | None,
                inf: bool, all_reduce: Callable[..., Any] = dist.all_reduce) -> Tensor:
    """Per-parameter norm partials ``values`` (sums of ``|g|^p`` over this rank's part, or maxima for ``inf``)
    with the entries of split parameters (``split``, a bool mask) combined over the tensor-parallel group: one
    all-reduce of the vector (``all_reduce``: a plugin passes its communicator's, which counts it). Replicated
    parameters' entries are left as they are (the same on every rank)."""
    if tensor_parallel_group is None or not bool(split.any()):
        return values
    part = torch.where(split, values, torch.zeros_like(values))
    all_reduce(part, op=dist.ReduceOp.MAX if inf else dist.ReduceOp.SUM, group=tensor_parallel_group)
    return torch.where(split, part, values)


def grad_norms(module: Module, norm_type: float, tensor_parallel_group: dist.ProcessGroup | None
               ) -> dict[str, Tensor]:
    """``{name: norm of its gradient}`` for every parameter of ``module`` with a gradient, as Lightning's
    ``grad_norm`` computes on an unsplit model (it fails on DTensor gradients): a split parameter's norm over all
    its shards. Collective over the tensor-parallel group (one all-reduce)."""
    named = [(name, p) for name, p in module.named_parameters() if p.grad is not None]
    if not named:
        return {}
    inf = norm_type == float("inf")
    g0 = local_tensor(named[0][1].grad)
    values = torch.zeros(len(named), dtype=torch.float64, device=g0.device)
    for i, (_, p) in enumerate(named):
        g = local_tensor(p.grad).detach().double().abs()
        if g.numel():
            values[i] = g.max() if inf else g.pow(norm_type).sum()
    split = torch.tensor([is_tensor_parallel_shard(p) for _, p in named], device=values.device)
    values = split_norms(values, split, tensor_parallel_group, inf)
    norms = values if inf else values.pow(1.0 / norm_type)
    return {name: norms[i].to(local_tensor(p).dtype) for i, (name, p) in enumerate(named)}


def scale_grads(params: Iterable[Tensor], max_norm: float, total_norm: Tensor) -> None:
    """Scale every gradient by ``max_norm / (total_norm + 1e-6)`` where that is below 1, as torch's
    ``clip_grad_norm_`` does (on the local shards: one factor for all)."""
    coef = (max_norm / (total_norm + 1e-6)).clamp(max=1.0)
    for p in params:
        if p.grad is not None:
            g = local_tensor(p.grad)
            g.mul_(coef.to(g.dtype))


# ------------------------------------------------------------------ checkpoints


def full_state_dict(state: Mapping[str, Any]) -> dict[str, Any]:
    """``state`` with every DTensor replaced by its whole value as a plain tensor (an all-gather over its mesh:
    collective, every rank calls it with the same keys in the same order), nested dicts and lists included."""

    def full(value: Any) -> Any:
        if isinstance(value, DTensor):
            return value.full_tensor()
        if isinstance(value, Mapping):
            return {k: full(v) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return type(value)(full(v) for v in value)
        return value

    return {k: full(v) for k, v in state.items()}


def distribute_like(value: Tensor, like: DTensor) -> DTensor:
    """The whole tensor ``value`` split as ``like`` is (its mesh and placements), each rank keeping its own part
    (no communication: every rank holds ``value``)."""
    value = value.to(device=local_tensor(like).device, dtype=like.dtype)
    return distribute_tensor(value, like.device_mesh, like.placements, src_data_rank=None)


def distribute_state_dict(state: Mapping[str, Any], module: Module) -> dict[str, Any]:
    """A whole ``state_dict`` of the unsplit model, with the entries of the module's DTensor parameters and
    buffers split as they are, ready for ``module.load_state_dict``."""
    live = module.state_dict(keep_vars=True)
    out = dict(state)
    for name, current in live.items():
        if isinstance(current, DTensor) and name in out and isinstance(out[name], Tensor) \
                and not isinstance(out[name], DTensor):
            out[name] = distribute_like(out[name], current)
    return out


def distribute_optimizer_state(state: Mapping[str, Any], optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """A whole ``optimizer.state_dict()`` (parameters numbered across groups, as torch numbers them) with each
    state tensor of a DTensor parameter's shape split as that parameter is, ready for ``load_state_dict``."""
    from ddp_plugin.checkpoints.sharded_checkpoint import StoredTensor

    def split(v: Any, p: DTensor) -> Any:
        if isinstance(v, StoredTensor) and tuple(v.shape) == tuple(p.shape):
            return v.read_like(p)  # not read yet: only this rank's part is
        if isinstance(v, Tensor) and not isinstance(v, DTensor) and tuple(v.shape) == tuple(p.shape):
            return distribute_like(v, p)
        return v

    params = [p for group in optimizer.param_groups for p in group["params"]]
    out_state = {}
    for index, entries in state.get("state", {}).items():
        p = params[index] if isinstance(index, int) and index < len(params) else None
        if isinstance(p, DTensor):
            entries = {k: split(v, p) for k, v in entries.items()}
        out_state[index] = entries
    return {**state, "state": out_state}


def block_shapes(state: Mapping[str, Any]) -> dict[str, tuple[int, ...]]:
    """Every rank's block shape (``<key>@<dim>:<offset>``) of each split DTensor in ``state``."""
    return {f"{key}@{dim}:{offset}": shape for key, value in state.items() if isinstance(value, DTensor)
            for dim, offset, shape in tensor_parallel_blocks(value) or ()}


def has_tensor_parallel_parameters(module: Module) -> bool:
    return any(isinstance(p, DTensor) for p in module.parameters())


class Whereabouts:
    """The split module whose forward or backward this rank entered last, so that a collective failing there is
    named ("the tensor-parallel forward of model.blocks.0.attn.o"): a forward pre-hook on every module holding
    DTensor parameters of its own, and a gradient hook on its output, which runs as its backward starts. DTensor
    waits for a collective's result only where it is used, so a failure surfaces in the module that issued it
    or in the next one: the last one entered. Only bookkeeping: no collective, nothing kept beyond a name."""

    def __init__(self, module: Module) -> None:
        self.where: str | None = None
        self._handles = []
        for name, sub in module.named_modules():
            if any(isinstance(p, DTensor) for p in sub.parameters(recurse=False)):
                self._handles += [sub.register_forward_pre_hook(self._entering(f"forward of {name}")),
                                  sub.register_forward_hook(self._leaving(f"backward of {name}"))]

    def _entering(self, where: str) -> Callable[..., None]:
        def hook(module: Module, args: Any) -> None:
            self.where = where
        return hook

    def _leaving(self, backward: str) -> Callable[..., None]:
        def mark(grad: Tensor) -> None:
            self.where = backward

        def hook(module: Module, args: Any, output: Any) -> None:
            if isinstance(output, Tensor) and output.requires_grad:
                output.register_hook(mark)
        return hook

    def phase(self, outside: str) -> str:
        """The phase to name: the split module's forward or backward, else ``outside``."""
        return f"the tensor-parallel {self.where}" if self.where is not None else outside

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
