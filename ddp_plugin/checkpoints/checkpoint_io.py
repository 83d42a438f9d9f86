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

A save every rank takes part in fails on every rank together: a write that fails on rank 0 still runs the
producers (the other ranks are waiting in those collectives), and :func:`agree_with_rank_0` then tells the other
ranks what failed; a collective that fails because a rank died is diagnosed (:func:`diagnosed`), naming it.

(About 400 lines: the writer, its failure handling and the checks of what is or is not a checkpoint belong
together; each part is short.)
"""

from __future__ import annotations

import collections
import contextlib
import errno
import io
import math
import os
import pickle
import shutil
import sys
import tempfile
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

import torch
import torch.distributed as dist
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
from torch import Tensor
from typing_extensions import override

from ddp_plugin.runtime.lightning_adapter import PATH
from ddp_plugin import health
from ddp_plugin.hookspecs import DeferredStorage, DeferredTensor

_PICKLE_PROTOCOL = 2  # torch.save's
# What torch.save's legacy (pre-zip) format starts with: its magic number, pickled.
_LEGACY_HEADER = pickle.dumps(torch.serialization.MAGIC_NUMBER, protocol=_PICKLE_PROTOCOL)[:-1]
# Errors of a write that ran out of room: the disk or quota is full, or the file hit a size limit.
_NO_ROOM = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG}


def is_local_path(path: PATH) -> bool:
    """Whether ``path`` is on a local (or mounted) filesystem: no URL scheme, or ``file://``."""
    text = str(path)
    return "://" not in text or text.startswith("file://")


def local_path(path: PATH) -> str:
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
        _produce(s)


def _produce(storage: DeferredStorage) -> Tensor | None:
    # Producers gather to rank 0: if one dies in the middle of a save, say which, not gloo's "connection closed".
    with diagnosed("the checkpoint's gather to rank 0"):
        return storage.produce()


def _release(storages: list[DeferredStorage]) -> None:
    """Run the producers rank 0 has not run yet, after its write failed: the other ranks are waiting in them."""
    for s in storages:
        try:
            _produce(s)
        except Exception:  # noqa: BLE001 - a collective failed too; the write's error is what matters
            break


class CheckpointCollectiveError(RuntimeError):
    """A collective of a checkpoint save or load failed; the message names the rank at fault and why."""


def diagnosed(what: str) -> contextlib.AbstractContextManager[None]:
    """:func:`ddp_plugin.health.diagnosed` for a checkpoint's collectives: one that fails because a peer died or
    failed raises :class:`CheckpointCollectiveError` naming that rank instead of the backend's bare socket error."""
    return health.diagnosed(what, error=CheckpointCollectiveError)


def agree_with_rank_0(error: BaseException | None, what: str) -> None:
    """After rank 0's part of a save that every rank takes part in: every rank learns whether ``what`` (a verb
    phrase, "write `model.ckpt`") failed on rank 0, so that all fail together naming rank 0 and the cause
    instead of going on (and later failing in a collective that rank 0 left). Rank 0 raises ``error`` itself;
    the others' ``error`` is ignored. Every rank must call it."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        if error is not None:
            raise error
        return
    me = dist.get_rank()
    box = [f"{type(error).__name__}: {error}" if me == 0 and error is not None else None]
    with diagnosed(f"waiting for rank 0 to {what}"):
        dist.broadcast_object_list(box, src=0)
    if me == 0:
        if error is not None:
            raise error
    elif box[0] is not None:
        raise RuntimeError(f"rank {me}: rank 0 could not {what}: {box[0]}")


def materialize(obj: Any) -> Any:
    """``obj`` with every :class:`DeferredTensor` replaced by a tensor (by ``None`` on the ranks whose producers
    return nothing). Every rank must call it, as it runs the producers; rank 0 then holds all of them at once."""
    made: dict[int, Tensor | None] = {}
    storages = deferred_storages(obj)
    for i, s in enumerate(storages):
        try:
            made[id(s)] = _produce(s)
        except BaseException:
            _release(storages[i + 1 :])  # the other ranks are waiting in those
            raise

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
                flat = _produce(s)
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
        _release(pending)  # release the other ranks, then fail
        raise


def atomic_write(path: PATH, write: Callable[[IO[bytes]], None]) -> None:
    """``write(file)`` into a temporary file beside ``path``, fsync, rename over ``path``, fsync the directory.
    An ``OSError`` (also one torch's zip writer buries under "unexpected pos") is raised naming ``path``, and for a
    full disk the free space."""
    target = Path(local_path(path))
    tmp: str | None = None
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
        os.fchmod(fd, 0o666 & ~_umask())  # mkstemp's 0600 would make the checkpoint private to this user
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
        dir_fd = os.open(target.parent, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
    except BaseException as err:
        if tmp is not None:
            Path(tmp).unlink(missing_ok=True)  # (gone already if the rename happened)
        explained = explain_write_error(err, target)
        if explained is not None:
            raise explained from err
        raise


def explain_write_error(err: BaseException, target: Path, who: str = "") -> OSError | None:
    """An ``OSError`` naming the checkpoint ``target`` (and, when the disk is full, its filesystem's free space)
    for the first ``OSError`` in ``err``'s chain; ``None`` if there is none. ``who``: "rank 2 " or ""."""
    cause: BaseException | None = err
    seen: set[int] = set()
    while cause is not None and not isinstance(cause, OSError) and id(cause) not in seen:
        if isinstance(cause, CheckpointCollectiveError):
            return None  # a rank died or failed: that is the cause, already named
        seen.add(id(cause))
        cause = cause.__cause__ or cause.__context__
    if not isinstance(cause, OSError) or cause.errno is None:
        return None
    reason = os.strerror(cause.errno)
    message = f"{reason}: {who}could not write the checkpoint `{target}`"
    if cause.errno in _NO_ROOM:
        message += (
            f" ({_free_space(target.parent)} free on its filesystem; a previous checkpoint of that name is kept)"
            if cause.errno != errno.EFBIG else
            f" (a file size limit: the process's `ulimit -f` or the filesystem's; {_free_space(target.parent)} free"
            " on it; a previous checkpoint of that name is kept)"
        )
    elif cause.filename is not None and str(cause.filename) != str(target):
        message += f" (at `{cause.filename}`)"
    return OSError(cause.errno, message)  # OSError picks the subclass for the errno (PermissionError, ...)


def _free_space(directory: Path) -> str:
    try:
        free = shutil.disk_usage(directory).free
    except OSError:
        return "unknown space"
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if free >= size:
            return f"{free / size:.1f} {unit}"
    return f"{free} B"


def atomic_torch_save(obj: Any, path: PATH) -> None:
    """``torch.save(obj, path)``, atomically; ``obj`` may hold :class:`DeferredTensor`\\ s, whose producers all run
    even when the write fails (:func:`stream_save` runs those it did not reach; here those of a file that could
    not even be created)."""
    started = False

    def write(f: IO[bytes]) -> None:
        nonlocal started
        started = True
        stream_save(obj, f)  # looked up at each call: tests replace it

    try:
        atomic_write(path, write)
    except BaseException:
        if not started:
            _release(deferred_storages(obj))
        raise


def not_a_checkpoint(path: PATH, err: BaseException) -> ValueError | None:
    """For a local ``path`` ``torch.load`` failed on (``err``): a clear error if it is no checkpoint at all (empty,
    random bytes, cut short by an interrupted copy, another kind of file or directory), else ``None`` (then
    ``err`` stands: e.g. a real checkpoint that ``weights_only`` refuses)."""
    p = Path(local_path(path))
    try:
        if p.is_dir():
            what = "a directory that is not a sharded checkpoint (no `.metadata` and `meta.pt`; an interrupted save?)"
        elif not p.is_file():
            return None
        else:
            size = p.stat().st_size
            with open(p, "rb") as f:
                if f.read(len(_LEGACY_HEADER)) == _LEGACY_HEADER:
                    return None  # torch.save's legacy format
            if zipfile.is_zipfile(p):
                with zipfile.ZipFile(p) as z:
                    if any(n == "data.pkl" or n.endswith("/data.pkl") for n in z.namelist()):
                        return None  # torch.save's format: torch's error is about its content
                what = f"a zip archive of {size} bytes without torch.save's `data.pkl`"
            elif size == 0:
                what = "an empty file"
            else:
                what = f"{size} bytes that are not torch.save's format (a zip archive holding `data.pkl`)"
    except (OSError, zipfile.BadZipFile):
        return None
    return ValueError(
        f"`{path}` is not a checkpoint, or truncated: {what}. Was its save or copy interrupted, or is it another"
        f" file? (torch.load raised {type(err).__name__})"
    )


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


class AtomicCheckpointIO(TorchCheckpointIO):
    """Lightning's ``TorchCheckpointIO`` with an atomic, streamed write for local paths. Checkpoints may hold
    :class:`DeferredTensor`\\ s; the rank that calls ``save_checkpoint`` (global rank 0) produces them while
    writing, and every other rank must call :func:`produce_all` on the same checkpoint meanwhile."""

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], path: PATH, storage_options: Any | None = None) -> None:
        if storage_options is not None or not is_local_path(path):
            return super().save_checkpoint(materialize(checkpoint), path, storage_options=storage_options)
        atomic_torch_save(checkpoint, path)
        return None
