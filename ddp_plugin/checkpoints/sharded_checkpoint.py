"""``checkpoint="sharded"``: every rank writes its own part through ``torch.distributed.checkpoint`` (DCP).

A sharded checkpoint is a directory: DCP's files (one ``__<rank>_0.distcp`` per rank and ``.metadata``), plus
``meta.pt`` from global rank 0 with everything that is not a model or optimizer tensor (loops, callbacks, LR
schedulers, hyperparameters, the plugins' state, optimizer hyperparameters) and the full shape of every tensor.

Tensors are stored under flat keys. A tensor every rank holds whole is ``model/<name>`` (or
``optim/<j>/<index>/<state key>`` for optimizer ``j``'s state of parameter ``index``, numbered across parameter
groups as in an unsharded ``optimizer.state_dict()``); DCP writes such a key once, whichever ranks hold it. A
piece of a sharded tensor is ``<key>#<start>``: the 1-D slice of the flattened tensor that starts at element
``start``. A tensor split by tensor parallelism (a DTensor) is written as DCP writes DTensors, as torch's own
``get_model_state_dict`` and ``dcp.save`` would: each rank's shard under the tensor's key, with the whole shape
and the shard's offsets in DCP's metadata, so ``dcp.load`` reads it into any split or whole. Where ZeRO shards a
rank's shard further (stage 3), the pieces are ``<key>@<dim>:<offset>#<start>``: the 1-D slice, starting at
element ``start``, of the flattened block of the whole tensor that starts at ``offset`` along ``dim`` (torch has
no encoding for a flat piece of a DTensor's shard). Layout 1 (no ``FORMAT_KEY``: written before the layout had a
version) wrote every tensor-parallel shard as such a block ``<key>@<dim>:<offset>``; it still loads. Loading
assembles the unsharded layout from whatever pieces and blocks the writers held, so a sharded checkpoint resumes
on any world size, stage, shard scope or hierarchy, exactly like a consolidated one, and :func:`consolidate` turns
it into a single file plain Lightning loads.

The directory is written as ``<path>.partial`` and renamed to ``<path>`` once every rank has finished (a
previous checkpoint of the same name is moved aside first and deleted after), so a crash in the middle of a
save never leaves a half-written checkpoint under the final name; a save that fails (a full disk, a read-only
directory) removes ``<path>.partial`` and fails on every rank, naming the rank and the cause.

(Just over 400 lines: the writer, the reader and the keys of both layouts sit together, so that a change to what
is written is seen beside what reads it, the lazy reader of a model no rank holds whole included.)
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

from ddp_plugin.checkpoints.checkpoint_io import (
    agree_with_rank_0,
    atomic_torch_save,
    diagnosed,
    explain_write_error,
    not_a_checkpoint,
)

META_FILE = "meta.pt"
FORMAT_KEY = "ddp_plugin_sharded_format"
FORMAT = 2
"""The layout's version: 1 (no ``FORMAT_KEY``: 0.1.0, and development versions until the version was recorded)
wrote tensor-parallel shards under keys of its own (``<key>@<dim>:<offset>``); 2 writes them as DTensors, as DCP
does. Both load."""
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
            meta[FORMAT_KEY] = FORMAT
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


def load(path: Any, lazy: bool = False) -> dict[str, Any]:
    """The checkpoint at ``path`` in the consolidated layout: ``state_dict`` and ``optimizer_states`` as an
    unsharded model and optimizer would have them, everything else as saved. Every rank reads every piece, or,
    with ``lazy``, none yet: each tensor is a :class:`StoredTensor`, read when asked for, whole
    (:meth:`StoredTensor.load`) or only the part a DTensor of this rank holds (:meth:`StoredTensor.read_like`)."""
    p = Path(str(path))
    try:
        meta = torch.load(p / META_FILE, map_location="cpu", weights_only=False)
    except Exception as err:
        bad = not_a_checkpoint(p / META_FILE, err)
        if bad is not None:
            raise bad from err
        raise
    version = meta.pop(FORMAT_KEY, 1)
    if version > FORMAT:
        raise ValueError(
            f"The sharded checkpoint `{path}` is in layout {version}, written by a newer ddp_plugin; this one reads"
            f" layouts up to {FORMAT}. Upgrade ddp_plugin to load it."
        )
    reader = FileSystemReader(str(p))
    metadata = reader.read_metadata()
    shapes: dict[str, tuple[int, ...]] = meta.pop(SHAPES_KEY)
    flat: dict[str, Any] = {}
    for key, md in metadata.state_dict_metadata.items():
        if isinstance(md, TensorStorageMetadata):
            if not lazy:
                flat[key] = torch.empty(md.size, dtype=md.properties.dtype)
        elif isinstance(md, BytesStorageMetadata):
            flat[key] = None
    _read(flat, p)
    whole = _assemble(flat, shapes)
    if lazy:
        whole.update(_stored_tensors(p, metadata, shapes))
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


def _read(flat: dict[str, Any], path: Path) -> None:
    """Read ``flat``'s keys (and only those) from the checkpoint at ``path``, into its tensors."""
    if not flat:
        return
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
        warnings.filterwarnings("ignore", message=".*assuming the intent is to load in a single process")
        dcp.load(flat, checkpoint_id=str(path), no_dist=True)


class StoredTensor:
    """A tensor of a sharded checkpoint not read yet: its ``shape`` and ``dtype``, and the DCP keys it was
    written under (whole, as tensor-parallel blocks ``<name>@<dim>:<offset>``, as ZeRO pieces ``#<start>``).
    :meth:`load` reads it whole; :meth:`read_like` reads only the blocks that overlap what a DTensor of this
    rank holds (the rank's stage, tensor-parallel shard), so a rank never holds a tensor it does not keep."""

    def __init__(self, path: Path, name: str, shape: tuple[int, ...], dtype: torch.dtype,
                 parts: dict[tuple[int, int] | None, list[str]], block_shapes: dict[tuple[int, int], tuple[int, ...]],
                 sizes: dict[str, int]) -> None:
        self.path, self.name, self.shape, self.dtype = path, name, torch.Size(shape), dtype
        self._parts = parts
        """DCP keys per tensor-parallel block ``(dim, offset)``, or under ``None`` those of the whole tensor."""
        self._block_shapes = block_shapes
        self._sizes = sizes
        """Elements per DCP key."""

    def __repr__(self) -> str:
        return f"StoredTensor({self.name!r}, shape={tuple(self.shape)}, dtype={self.dtype})"

    def numel(self) -> int:
        return math.prod(self.shape)

    def _read_keys(self, keys: list[str], shape: tuple[int, ...]) -> Tensor:
        """The tensor of ``shape`` written under ``keys`` (itself, or its ZeRO pieces)."""
        if len(keys) == 1 and _split_key(keys[0])[1] is None:
            flat = {keys[0]: torch.empty(shape, dtype=self.dtype)}
            _read(flat, self.path)
            return flat[keys[0]]
        pieces = {k: torch.empty(self._sizes[k], dtype=self.dtype) for k in keys}
        _read(pieces, self.path)
        base = _split_key(keys[0])[0]
        return _assemble_pieces(pieces, {base: shape})[base]

    def load(self) -> Tensor:
        """The whole tensor."""
        if None in self._parts:
            return self._read_keys(self._parts[None], tuple(self.shape))
        out = torch.empty(tuple(self.shape), dtype=self.dtype)
        for (dim, offset), keys in self._parts.items():
            block = self._read_keys(keys, self._block_shapes[(dim, offset)])
            out.narrow(dim, offset, block.shape[dim]).copy_(block)
        return out

    def read_like(self, like: Any) -> Any:
        """The part of this tensor that the DTensor ``like`` holds on this rank (its mesh and placements), as a
        DTensor like it; only what overlaps that part is read (of the stored shards, blocks or pieces)."""
        from torch.distributed.tensor import DTensor
        # (private: torch has no public function for the part of the whole tensor a rank's shard is; DCP uses it)
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        local_shape, offset = compute_local_shape_and_global_offset(self.shape, like.device_mesh, like.placements)
        local = torch.empty(tuple(local_shape), dtype=self.dtype)
        want = [(o, o + n) for o, n in zip(offset, local_shape)]
        whole_keys = self._parts.get(None, [])
        if len(whole_keys) == 1 and _split_key(whole_keys[0])[1] is None:
            # One DCP entry (a DTensor's shards, or a tensor written whole): DCP reads what overlaps this rank's part.
            # (`from_local` moves `local` to the mesh's device type: the part read is the DTensor's local tensor)
            target = DTensor.from_local(local, like.device_mesh, like.placements, run_check=False,
                                        shape=self.shape, stride=like.stride())
            _read({whole_keys[0]: target}, self.path)
            local = target.to_local()
        elif None in self._parts:
            whole = self._read_keys(self._parts[None], tuple(self.shape))
            local.copy_(whole[tuple(slice(a, b) for a, b in want)])
            del whole
        else:
            for (dim, start), keys in self._parts.items():
                block_shape = self._block_shapes[(dim, start)]
                have = [(0, n) for n in self.shape]
                have[dim] = (start, start + block_shape[dim])
                both = [(max(a, c), min(b, d)) for (a, b), (c, d) in zip(want, have)]
                if any(lo >= hi for lo, hi in both):
                    continue  # another rank's block
                block = self._read_keys(keys, block_shape)
                source = tuple(slice(lo - h[0], hi - h[0]) for (lo, hi), h in zip(both, have))
                target = tuple(slice(lo - w[0], hi - w[0]) for (lo, hi), w in zip(both, want))
                local[target].copy_(block[source])
                del block
        local = local.to(device=like.to_local().device, dtype=like.dtype)
        return DTensor.from_local(local, like.device_mesh, like.placements, run_check=False,
                                  shape=like.shape, stride=like.stride())


def _stored_tensors(path: Path, metadata: Any, shapes: Mapping[str, tuple[int, ...]]) -> dict[str, StoredTensor]:
    """A :class:`StoredTensor` per tensor name of the checkpoint (its blocks and pieces put under one name)."""
    parts: dict[str, dict[tuple[int, int] | None, list[str]]] = {}
    sizes: dict[str, int] = {}
    dtypes: dict[str, torch.dtype] = {}
    for key, md in metadata.state_dict_metadata.items():
        if not isinstance(md, TensorStorageMetadata):
            continue
        base, _ = _split_key(key)
        name, at, where = base.rpartition("@")
        block = tuple(int(x) for x in where.split(":")) if at else None
        name = name if at else base
        parts.setdefault(name, {}).setdefault(block, []).append(key)
        sizes[key] = math.prod(md.size)
        dtypes[name] = md.properties.dtype
    out = {}
    for name, blocks in parts.items():
        if None in blocks and len(blocks[None]) == 1 and _split_key(blocks[None][0])[1] is None:
            shape = tuple(metadata.state_dict_metadata[blocks[None][0]].size)
        else:
            shape = _recorded_shape(name, shapes)
            if shape is None:
                raise ValueError(f"The sharded checkpoint records no shape for `{name}`: it cannot be assembled.")
        block_shapes = {}
        for block in blocks:
            if block is not None:
                recorded = _recorded_shape(f"{name}@{block[0]}:{block[1]}", shapes)
                if recorded is None:
                    raise ValueError(f"The sharded checkpoint records no shape for `{name}@{block[0]}:{block[1]}`.")
                block_shapes[block] = tuple(recorded)
        out[name] = StoredTensor(path, name, tuple(shape), dtypes[name], blocks, block_shapes,
                                 {k: sizes[k] for keys in blocks.values() for k in keys})
    return out


def materialized(value: Any) -> Any:
    """``value`` with every :class:`StoredTensor` in it (in dicts and lists, nested) read whole."""
    if isinstance(value, StoredTensor):
        return value.load()
    if isinstance(value, dict):
        return {k: materialized(v) for k, v in value.items()}
    if isinstance(value, list):
        return [materialized(v) for v in value]
    return value


def _assemble(flat: Mapping[str, Any], shapes: Mapping[str, tuple[int, ...]]) -> dict[str, Any]:
    return _join_blocks(_assemble_pieces(flat, shapes), shapes)


def _assemble_pieces(flat: Mapping[str, Any], shapes: Mapping[str, tuple[int, ...]]) -> dict[str, Any]:
    """``flat`` with the ZeRO pieces ``<key>#<start>`` of each key put together into ``<key>``."""
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
    return whole


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
