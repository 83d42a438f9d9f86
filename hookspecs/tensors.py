"""How a plugin reads and writes a parameter that may be a DTensor (tensor parallelism) or a copy held by several
pipeline stages: this rank's local elements, a whole tensor's local part, and where a split parameter's blocks lie.
Functions, beside the value types of :mod:`~ddp_plugin.hookspecs.types`; like them, nothing from the strategy."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from torch import Tensor
    from torch.nn import Parameter


# Tensor parallelism: a module parallelized with ``torch.distributed.tensor.parallel`` has DTensor parameters, each
# rank holding a local shard (or a replica) of the tensor-parallel group's parameter. Data-parallel plugins work on
# those local tensors only: buckets hold local elements, ``offsets`` count them, and a plugin that reads or moves a
# parameter's values goes through the three functions below instead of ``p.numel()``, ``p.data`` and ``p.grad =``.


def _is_dtensor(t: Any) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


def local_tensor(t: Tensor) -> Tensor:
    """This rank's elements of a parameter, gradient or optimizer state: a DTensor's local shard (tensor
    parallelism), any other tensor itself. Writing into it in place writes the parameter."""
    if _is_dtensor(t):
        # The DTensor's own local tensor, not `to_local()`, which returns a new view: `set_local_data` must reach
        # the tensor the DTensor computes with (as FSDP2 does).
        return t._local_tensor
    return t


def set_local_data(p: Parameter, value: Tensor) -> None:
    """Make ``p`` hold ``value`` (shaped like :func:`local_tensor` of ``p``) as its data, sharing its memory: a
    sharder moves parameters into flat buffers this way."""
    if _is_dtensor(p):
        local_tensor(p).data = value  # the DTensor keeps its local tensor object, now over ``value``'s memory
    else:
        p.data = value


def set_local_grad(p: Parameter, grad: Tensor | None) -> None:
    """Set ``p.grad`` from a local gradient ``grad`` (shaped like :func:`local_tensor` of ``p``, whose memory the
    gradient then shares), wrapped as a DTensor of ``p``'s mesh and placements where ``p`` is one."""
    p.grad = grad if grad is None else as_parameter_layout(grad, p)


def as_parameter_layout(value: Tensor, p: Parameter) -> Tensor:
    """``value``, this rank's elements of a tensor shaped like :func:`local_tensor` of ``p`` (a gradient, an
    optimizer state), as a DTensor of ``p``'s mesh and placements where ``p`` is one (so that it can be made whole
    or redistributed), else ``value`` itself."""
    if not _is_dtensor(p):
        return value
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(value, p.device_mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride())


def local_part_of_whole(value: Tensor, p: Parameter) -> Tensor:
    """This rank's part of ``value``, a whole tensor shaped like ``p`` (a checkpoint's optimizer state, say): the
    local shard ``p``'s placements give this rank where ``p`` is a DTensor (no communication), else ``value``. A
    DTensor ``value`` gives its local tensor."""
    if _is_dtensor(value):
        return value._local_tensor
    if not _is_dtensor(p):
        return value
    from torch.distributed.tensor import distribute_tensor

    return distribute_tensor(value.to(local_tensor(p).device), p.device_mesh, p.placements,
                             src_data_rank=None)._local_tensor


def is_tensor_parallel_shard(p: Tensor) -> bool:
    """Whether ``p`` is split over the tensor-parallel group (a DTensor with a ``Shard`` placement): its norm sums
    over the group's ranks, where a replicated parameter's is the same on every rank and counts once."""
    return _is_dtensor(p) and any(placement.is_shard() for placement in p.placements)


PIPELINE_COPIES_ATTRIBUTE = "_ddp_plugin_pipeline_copies"
"""Set by the strategy on a parameter several pipeline stages hold a copy of (a tied embedding and output head):
how many stages hold one."""


def pipeline_copies(p: Tensor) -> int:
    """How many pipeline stages hold a copy of ``p`` (1 for most parameters; 2 for an embedding tied to the output
    head of the last stage). Every copy holds the same gradient, so a global norm over the stages counts each
    copy's part ``1 / pipeline_copies(p)`` times, and the parameter once."""
    return getattr(p, PIPELINE_COPIES_ATTRIBUTE, 1)


def tensor_parallel_blocks(t: Tensor) -> list[tuple[int, int, tuple[int, ...]]] | None:
    """Where the blocks of ``t``, a DTensor split along one dimension over a 1-D mesh, lie in the whole tensor:
    ``(dim, offset, shape)`` of every mesh position's block, in mesh order (as ``torch.chunk`` splits, the last
    ones may be smaller or empty). ``None`` for a plain tensor or a replicated DTensor (every rank holds it
    whole). Needs no communication: a sharded checkpoint's rank 0 records every rank's block shape with it."""
    if not is_tensor_parallel_shard(t):
        return None
    shards = [(i, pl) for i, pl in enumerate(t.placements) if pl.is_shard()]
    if t.device_mesh.ndim != 1 or len(shards) != 1:
        raise ValueError(f"a DTensor split over a {t.device_mesh.ndim}-D mesh with placements {t.placements}: "
                         "tensor parallelism here splits along one dimension over the tensor-parallel mesh")
    dim = shards[0][1].dim % t.dim()
    n, parts = t.shape[dim], t.device_mesh.size()
    chunk = -(-n // parts)
    blocks = []
    for i in range(parts):
        start = min(i * chunk, n)
        shape = list(t.shape)
        shape[dim] = min(chunk, n - start)
        blocks.append((dim, start, tuple(shape)))
    return blocks


def block_key(key: str, t: Tensor) -> str:
    """``key`` for this rank's block of ``t`` in a sharded checkpoint: ``<key>@<dim>:<offset>`` where ``t`` is
    split by tensor parallelism (:func:`tensor_parallel_blocks`), else ``key``. A piece of a block's flattened
    local tensor is ``<key>@<dim>:<offset>#<start>``."""
    blocks = tensor_parallel_blocks(t)
    if blocks is None:
        return key
    dim, offset, _ = blocks[t.device_mesh.get_coordinate()[0]]
    return f"{key}@{dim}:{offset}"
