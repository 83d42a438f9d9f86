"""``checkpoint="sharded"``: every rank writes its own part through ``torch.distributed.checkpoint`` (DCP).

A sharded checkpoint is a directory: DCP's files (one ``__<rank>_0.distcp`` per rank and ``.metadata``), plus
``meta.pt`` from global rank 0 with everything that is not a model or optimizer tensor (loops, callbacks, LR
schedulers, hyperparameters, the plugins' state, optimizer hyperparameters) and the full shape of every tensor.

Tensors are stored under flat keys. A tensor every rank holds whole is ``model/<name>`` (or
``optim/<j>/<index>/<state key>`` for optimizer ``j``'s state of parameter ``index``, numbered across parameter
groups as in an unsharded ``optimizer.state_dict()``); DCP writes such a key once, whichever ranks hold it. A
piece of a sharded tensor is ``<key>#<start>``: the 1-D slice of the flattened tensor that starts at element
``start``. A tensor split by tensor parallelism is written as blocks: ``<key>@<dim>:<offset>`` is the block of
the whole tensor that starts at ``offset`` along ``dim`` (a rank's local shard), and ``<key>@<dim>:<offset>#<start>``
a piece of that block's flattening (ZeRO shards a local shard). Loading assembles the unsharded layout from
whatever pieces and blocks the writers held, so a sharded
checkpoint resumes on any world size, stage, shard scope or hierarchy, exactly like a consolidated one, and
:func:`consolidate` turns it into a single file plain Lightning loads.

The directory is written as ``<path>.partial`` and renamed to ``<path>`` once every rank has finished (a
previous checkpoint of the same name is moved aside first and deleted after), so a crash in the middle of a
save never leaves a half-written checkpoint under the final name; a save that fails (a full disk, a read-only
directory) removes ``<path>.partial`` and fails on every rank, naming the rank and the cause.
"""

from __future__ import annotations

import math
import os
import shutil
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import Tensor
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorStorageMetadata

from ddp_plugin.checkpoint_io import (
    agree_with_rank_0,
    atomic_torch_save,
    diagnosed,
    explain_write_error,
    not_a_checkpoint,
)

META_FILE = "meta.pt"
SHAPES_KEY = "ddp_plugin_shapes"
OPTIM_KEY = "ddp_plugin_optimizers"


def is_sharded_checkpoint(path: Any) -> bool:
    """Whether ``path`` is a directory written by ``checkpoint="sharded"``."""
    p = Path(str(path))
    return p.is_dir() and (p / ".metadata").is_file() and (p / META_FILE).is_file()


def _split_key(key: str) -> tuple[str, int | None]:
    base, sep, start = key.rpartition("#")
    if sep and start.isdigit():
        return base, int(start)
    return key, None


def save(checkpoint: Mapping[str, Any], local_model: Mapping[str, Any], local_optimizers: list[Mapping[str, Any]],
         shapes: Mapping[str, tuple[int, ...]], path: Any) -> None:
    """Write ``checkpoint`` (without its ``state_dict`` and ``optimizer_states``) and this rank's tensors.

    Called on every rank with the same ``path``. ``local_model``: flat keys (``name`` or ``name#start``) to this
    rank's tensors. ``local_optimizers``: per optimizer ``{"state": {flat key: value}, "param_groups": [...]}``,
    flat keys ``<index>/<state key>`` or ``<index>/<state key>#<start>``. ``shapes``: the full shape of every
    key that may be cut into pieces (``model/<name>``), and of every parameter whose optimizer state may be
    (``optim/<j>/<index>``: its state tensors that are cut into pieces have its shape), on every rank, whether
    or not it holds a piece.

    A failure on any rank fails the save on every rank, naming the rank and the cause, and removes
    ``<path>.partial``; a previous checkpoint under ``path`` is kept.
    """
    target = Path(str(path))
    partial = target.with_name(target.name + ".partial")
    rank0 = not dist.is_initialized() or dist.get_rank() == 0
    error: BaseException | None = None
    if rank0:
        try:
            shutil.rmtree(partial, ignore_errors=True)
            partial.mkdir(parents=True)
        except OSError as err:
            error = explain_write_error(err, target) or err
    agree_with_rank_0(error, f"create `{partial}`")
    tensors: dict[str, Any] = {f"model/{k}": v for k, v in local_model.items()}
    for j, opt in enumerate(local_optimizers):
        tensors.update({f"optim/{j}/{k}": v for k, v in opt["state"].items()})
    try:
        with diagnosed(f"writing the sharded checkpoint `{target}`"):
            dcp.save(tensors, checkpoint_id=str(partial))
    except BaseException as err:  # DCP's CheckpointException is a BaseException, raised on every rank
        if rank0:
            shutil.rmtree(partial, ignore_errors=True)
        explained = _explain_dcp_error(err, target)
        if explained is not None:
            raise explained from err
        raise
    if rank0:
        old = target.with_name(target.name + ".old")
        try:
            meta = {k: v for k, v in checkpoint.items() if k not in ("state_dict", "optimizer_states")}
            meta[SHAPES_KEY] = dict(shapes)
            # (with pipeline stages the state is keyed by parameter name, numbered by `param_names` on load)
            meta[OPTIM_KEY] = [{"param_groups": opt["param_groups"],
                                **({"param_names": opt["param_names"]} if opt.get("param_names") else {})}
                               for opt in local_optimizers]
            atomic_torch_save(meta, partial / META_FILE)
            if target.exists():
                shutil.rmtree(old, ignore_errors=True)
                target.rename(old)
            partial.rename(target)
            shutil.rmtree(old, ignore_errors=True)
        except Exception as err:  # noqa: BLE001 - raised below, on every rank
            shutil.rmtree(partial, ignore_errors=True)
            if old.exists() and not target.exists():
                old.rename(target)  # the previous checkpoint back under its name
            error = explain_write_error(err, target) or err
    agree_with_rank_0(error, f"write `{target}`")


def _explain_dcp_error(err: BaseException, target: Path) -> OSError | None:
    """DCP's ``CheckpointException`` holds each failed rank's exception: an ``OSError`` naming the first failed
    rank, the checkpoint and (for a full disk) the free space."""
    failures = getattr(err, "failures", None)
    if not isinstance(failures, dict):
        return explain_write_error(err, target)
    for rank, (exc, _trace) in sorted(failures.items()):
        explained = explain_write_error(exc, target, who=f"rank {rank} ")
        if explained is not None:
            return explained
    return None


def load(path: Any) -> dict[str, Any]:
    """The checkpoint at ``path`` in the consolidated layout: ``state_dict`` and ``optimizer_states`` as an
    unsharded model and optimizer would have them, everything else as saved. Every rank reads every piece."""
    p = Path(str(path))
    try:
        meta = torch.load(p / META_FILE, map_location="cpu", weights_only=False)
    except Exception as err:
        bad = not_a_checkpoint(p / META_FILE, err)
        if bad is not None:
            raise bad from err
        raise
    metadata = FileSystemReader(str(p)).read_metadata()
    flat: dict[str, Any] = {}
    for key, md in metadata.state_dict_metadata.items():
        if isinstance(md, TensorStorageMetadata):
            flat[key] = torch.empty(md.size, dtype=md.properties.dtype)
        elif isinstance(md, BytesStorageMetadata):
            flat[key] = None
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
        warnings.filterwarnings("ignore", message=".*assuming the intent is to load in a single process")
        dcp.load(flat, checkpoint_id=str(p), no_dist=True)
    shapes: dict[str, tuple[int, ...]] = meta.pop(SHAPES_KEY)
    whole = _assemble(flat, shapes)
    checkpoint = dict(meta)
    optimizers = checkpoint.pop(OPTIM_KEY)
    checkpoint["state_dict"] = {k[len("model/"):]: v for k, v in whole.items() if k.startswith("model/")}
    checkpoint["optimizer_states"] = []
    for j, opt in enumerate(optimizers):
        prefix = f"optim/{j}/"
        names = opt.get("param_names")
        index_of = {name: i for i, name in enumerate(names)} if names else None
        state: dict[int, dict[str, Any]] = {}
        for key, value in whole.items():
            if key.startswith(prefix):
                index, name = key[len(prefix):].split("/", 1)
                state.setdefault(int(index) if index_of is None else index_of[index], {})[name] = value
        checkpoint["optimizer_states"].append({"state": dict(sorted(state.items())), "param_groups": opt["param_groups"],
                                               **({"param_names": names} if names else {})})
    return checkpoint


def _assemble(flat: Mapping[str, Any], shapes: Mapping[str, tuple[int, ...]]) -> dict[str, Any]:
    whole: dict[str, Any] = {}
    pieces: dict[str, list[tuple[int, Tensor]]] = {}
    for key, value in flat.items():
        base, start = _split_key(key)
        if start is None:
            whole[base] = value
        else:
            pieces.setdefault(base, []).append((start, value))
    for base, parts in pieces.items():
        shape = _recorded_shape(base, shapes)
        if shape is None:
            raise ValueError(f"The sharded checkpoint records no shape for `{base}`: it cannot be assembled.")
        shape = tuple(shape)
        numel = math.prod(shape)
        out = torch.empty(numel, dtype=parts[0][1].dtype)
        covered = 0
        for start, value in sorted(parts, key=lambda sv: sv[0]):
            out[start : start + value.numel()].copy_(value.reshape(-1))
            covered += value.numel()
        if covered != numel:
            raise ValueError(
                f"The sharded checkpoint is incomplete: the pieces of `{base}` cover {covered} of its {numel}"
                " elements. Was a rank's file lost?"
            )
        whole[base] = out.view(shape)
    return _join_blocks(whole, shapes)


def _recorded_shape(key: str, shapes: Mapping[str, tuple[int, ...]]) -> tuple[int, ...] | None:
    """The shape recorded for ``key``. ``optim/<j>/<index>/<key>`` has the shape of parameter
    ``optim/<j>/<index>`` (older checkpoints recorded the key itself), and its block ``...@<dim>:<offset>`` the
    shape of that parameter's block."""
    if key in shapes:
        return shapes[key]
    name, at, where = key.rpartition("@")
    if at:
        return shapes.get(f"{name.rpartition('/')[0]}@{where}")
    return shapes.get(key.rpartition("/")[0])


def _join_blocks(flat: Mapping[str, Any], shapes: Mapping[str, tuple[int, ...]]) -> dict[str, Any]:
    """``flat`` with the tensor-parallel blocks ``<key>@<dim>:<offset>`` of each key put together into ``<key>``."""
    whole: dict[str, Any] = {}
    blocks: dict[str, list[tuple[int, int, Tensor]]] = {}
    for key, value in flat.items():
        name, at, where = key.rpartition("@")
        if not at:
            whole[key] = value
            continue
        dim, offset = (int(x) for x in where.split(":"))
        blocks.setdefault(name, []).append((dim, offset, value))
    for name, parts in blocks.items():
        shape = _recorded_shape(name, shapes)
        if shape is None:
            raise ValueError(f"The sharded checkpoint records no shape for `{name}`: it cannot be assembled.")
        out = torch.empty(tuple(shape), dtype=parts[0][2].dtype)
        covered = 0
        for dim, offset, value in parts:
            out.narrow(dim, offset, value.shape[dim]).copy_(value)
            covered += value.numel()
        if covered != out.numel():
            raise ValueError(
                f"The sharded checkpoint is incomplete: the tensor-parallel blocks of `{name}` cover {covered} of its"
                f" {out.numel()} elements. Was a rank's file lost?"
            )
        whole[name] = out
    return whole


def consolidate(path: str | os.PathLike, out: str | os.PathLike) -> None:
    """Write the sharded checkpoint ``path`` as one consolidated file ``out`` (loadable by plain Lightning:
    ``MyModule.load_from_checkpoint(out)``, ``Trainer().fit(model, ckpt_path=out)``). Needs no process group."""
    if not is_sharded_checkpoint(path):
        raise FileNotFoundError(f"`{path}` is not a sharded checkpoint directory (no .metadata and {META_FILE}).")
    atomic_torch_save(load(path), out)
