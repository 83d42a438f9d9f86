"""Writing a checkpoint so that a crash in the middle never costs the previous one, and so that rank 0 does not
need the whole of a sharded state in memory to write it.

Lightning's ``TorchCheckpointIO`` serializes the whole checkpoint into memory first (one more full copy on
rank 0) and then writes it, and a kill in the middle of that write leaves a truncated file under the final name
when the same name is overwritten (``last.ckpt``). :class:`AtomicCheckpointIO` writes into a temporary file in
the target's directory, ``fsync``\\ s it, renames it over the target (atomic on POSIX filesystems) and
``fsync``\\ s the directory, so the target always holds either the old or the new checkpoint, complete.

It writes ``torch.save``'s format itself (a zip of ``data.pkl`` and one record per storage, read by
``torch.load``, ``weights_only`` included), so that a checkpoint may hold :class:`DeferredTensor`\\ s: their
storages are produced one at a time, collectively, after the pickle is written, and each is freed once it is
on disk. Remote paths (``s3://`` and friends) go through Lightning's own writer, with deferred tensors
materialized first (:func:`materialize`).
"""

from __future__ import annotations

import collections
import io
import math
import os
import pickle
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

import torch
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
from lightning.fabric.utilities.types import _PATH
from torch import Tensor
from typing_extensions import override

from ddp_plugin.hookspecs import DeferredStorage, DeferredTensor

_PICKLE_PROTOCOL = 2  # torch.save's


def is_local_path(path: _PATH) -> bool:
    """Whether ``path`` is on a local (or mounted) filesystem: no URL scheme, or ``file://``."""
    text = str(path)
    return "://" not in text or text.startswith("file://")


def local_path(path: _PATH) -> str:
    """A local ``path`` as the operating system names it (without ``file://``)."""
    return str(path).removeprefix("file://")


# ---------------------------------------------------------------------------------------------- deferred tensors


def deferred_storages(obj: Any) -> list[DeferredStorage]:
    """Every :class:`DeferredStorage` in ``obj`` (nested dicts, lists and tuples), in the order they were made."""
    found: dict[int, DeferredStorage] = {}

    def walk(x: Any) -> None:
        if isinstance(x, DeferredTensor):
            found.setdefault(id(x.storage), x.storage)
        elif isinstance(x, DeferredStorage):
            found.setdefault(id(x), x)
        elif isinstance(x, dict):
            for v in x.values():
                walk(v)
        elif isinstance(x, (list, tuple)):
            for v in x:
                walk(v)

    walk(obj)
    return sorted(found.values(), key=lambda s: s.order)


def produce_all(storages: list[DeferredStorage]) -> None:
    """Run every producer, dropping what comes back: what ranks other than 0 do while rank 0 writes."""
    for s in storages:
        s.produce()


def materialize(obj: Any) -> Any:
    """``obj`` with every :class:`DeferredTensor` replaced by a tensor (by ``None`` on the ranks whose producers
    return nothing). Every rank must call it, as it runs the producers; rank 0 then holds all of them at once."""
    made: dict[int, Tensor | None] = {}
    for s in deferred_storages(obj):
        made[id(s)] = s.produce()

    def build(x: Any) -> Any:
        if isinstance(x, DeferredTensor):
            flat = made[id(x.storage)]
            if flat is None:
                return None
            return flat[x.offset : x.offset + math.prod(x.shape)].view(x.shape)
        if isinstance(x, dict):
            return {k: build(v) for k, v in x.items()}
        if isinstance(x, list):
            return [build(v) for v in x]
        if isinstance(x, tuple) and not hasattr(x, "_fields"):
            return tuple(build(v) for v in x)
        return x

    return build(obj)


# ---------------------------------------------------------------------------------------------- the writer


def _storage_type(dtype: torch.dtype) -> type:
    return getattr(torch, torch.storage.TypedStorage(dtype=dtype, device="cpu", _internal=True)._pickle_storage_type())


def _contiguous_stride(shape: tuple[int, ...]) -> tuple[int, ...]:
    stride, acc = [], 1
    for d in reversed(shape):
        stride.append(acc)
        acc *= max(d, 1)
    return tuple(reversed(stride))


class _Pickler(pickle.Pickler):
    """``torch.save``'s pickler, which also takes :class:`DeferredTensor`\\ s (their storage keys are
    ``d<order>``; ordinary storages are numbered as ``torch.save`` numbers them)."""

    def __init__(self, file: IO[bytes]) -> None:
        super().__init__(file, protocol=_PICKLE_PROTOCOL)
        self.keys: dict[int, str] = {}
        self.storages: dict[str, torch.UntypedStorage] = {}
        self.deferred: dict[int, str] = {}

    def persistent_id(self, obj: Any) -> tuple | None:
        if isinstance(obj, DeferredStorage):
            key = self.deferred.setdefault(id(obj), f"d{obj.order}")
            return ("storage", _storage_type(obj.dtype), key, obj.device, obj.numel)
        if isinstance(obj, torch.storage.TypedStorage):
            storage, stype, numel = obj._untyped_storage, getattr(torch, obj._pickle_storage_type()), obj._size()
        elif torch.is_storage(obj):
            storage, stype, numel = obj, torch.UntypedStorage, obj.nbytes()
        else:
            return None
        key = self.keys.setdefault(storage._cdata, str(len(self.keys)))
        self.storages[key] = storage
        location = str(obj._fake_device) if getattr(obj, "_fake_device", None) is not None else None
        return ("storage", stype, key, location or torch.serialization.location_tag(storage), numel)

    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, DeferredTensor):
            args = (obj.storage, obj.offset, tuple(obj.shape), _contiguous_stride(tuple(obj.shape)), False,
                    collections.OrderedDict())
            return torch._utils._rebuild_tensor_v2, args
        return NotImplemented


def _write_record(writer: Any, name: str, storage: torch.UntypedStorage) -> None:
    if storage.device.type != "cpu":
        storage = storage.cpu()
    writer.write_record(name, storage, storage.nbytes())


def stream_save(obj: Any, f: IO[bytes]) -> None:
    """``torch.save(obj, f)`` for a checkpoint that may hold :class:`DeferredTensor`\\ s: the pickle first, then
    the ordinary storages, then each deferred storage as its producer makes it, in the order they were made
    (the order in which the other ranks call :func:`produce_all` on the same checkpoint). A failure still calls
    the remaining producers before it is raised, so that the other ranks are not left waiting in a
    collective."""
    pending = deferred_storages(obj)
    try:
        buf = io.BytesIO()
        pickler = _Pickler(buf)
        pickler.dump(obj)
        with torch.serialization._open_zipfile_writer(f) as writer:  # what torch.save writes with
            data = buf.getvalue()
            del buf
            writer.write_record("data.pkl", data, len(data))
            writer.write_record(".format_version", "1", len("1"))
            alignment = str(torch.serialization._get_storage_alignment())
            writer.write_record(".storage_alignment", alignment, len(alignment))
            writer.write_record("byteorder", sys.byteorder, len(sys.byteorder))
            for key, storage in pickler.storages.items():
                _write_record(writer, f"data/{key}", storage)
            while pending:
                s = pending.pop(0)
                flat = s.produce()
                key = pickler.deferred.get(id(s))
                if key is None:
                    continue
                if flat is None or flat.numel() != s.numel or flat.dtype != s.dtype:
                    raise RuntimeError(
                        f"A deferred checkpoint tensor came back as {None if flat is None else (flat.dtype, flat.numel())}"
                        f" on rank 0, not {s.numel} elements of {s.dtype}."
                    )
                _write_record(writer, f"data/{key}", flat.contiguous().untyped_storage())
                del flat
    except BaseException:
        for s in pending:  # release the other ranks, then fail
            try:
                s.produce()
            except Exception:  # noqa: BLE001
                break
        raise


def atomic_write(path: _PATH, write: Callable[[IO[bytes]], None]) -> None:
    """``write(file)`` into a temporary file beside ``path``, fsync, rename over ``path``, fsync the directory."""
    target = Path(local_path(path))
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    try:
        os.fchmod(fd, 0o666 & ~_umask())  # mkstemp's 0600 would make the checkpoint private to this user
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    dir_fd = os.open(target.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def atomic_torch_save(obj: Any, path: _PATH) -> None:
    """``torch.save(obj, path)``, atomically; ``obj`` may hold :class:`DeferredTensor`\\ s."""
    atomic_write(path, lambda f: stream_save(obj, f))


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


class AtomicCheckpointIO(TorchCheckpointIO):
    """Lightning's ``TorchCheckpointIO`` with an atomic, streamed write for local paths. Checkpoints may hold
    :class:`DeferredTensor`\\ s; the rank that calls ``save_checkpoint`` (global rank 0) produces them while
    writing, and every other rank must call :func:`produce_all` on the same checkpoint meanwhile."""

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], path: _PATH, storage_options: Any | None = None) -> None:
        if storage_options is not None or not is_local_path(path):
            return super().save_checkpoint(materialize(checkpoint), path, storage_options=storage_options)
        atomic_torch_save(checkpoint, path)
        return None
