"""Writing a checkpoint so that a crash in the middle never costs the previous one.

Lightning's ``TorchCheckpointIO`` serializes the whole checkpoint into memory first (one more full copy on
rank 0) and then writes it, and a kill in the middle of that write leaves a truncated file under the final name
when the same name is overwritten (``last.ckpt``). :class:`AtomicCheckpointIO` streams ``torch.save`` into a
temporary file in the target's directory, ``fsync``\\ s it, renames it over the target (atomic on POSIX
filesystems) and ``fsync``\\ s the directory, so the target always holds either the old or the new checkpoint,
complete. Remote paths (``s3://`` and friends) go through Lightning's own writer.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

import torch
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
from lightning.fabric.utilities.types import _PATH
from typing_extensions import override


def _is_local(path: _PATH) -> bool:
    text = str(path)
    return "://" not in text or text.startswith("file://")


def atomic_torch_save(obj: Any, path: _PATH) -> None:
    """``torch.save(obj, path)``, atomically: a temporary file beside ``path``, fsync, rename, fsync the dir."""
    target = Path(str(path).removeprefix("file://"))
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    try:
        os.fchmod(fd, 0o666 & ~_umask())  # mkstemp's 0600 would make the checkpoint private to this user
        with os.fdopen(fd, "wb") as f:
            torch.save(obj, f)
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


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


class AtomicCheckpointIO(TorchCheckpointIO):
    """Lightning's ``TorchCheckpointIO`` with an atomic, streamed write for local paths."""

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], path: _PATH, storage_options: Any | None = None) -> None:
        if storage_options is not None or not _is_local(path):
            return super().save_checkpoint(checkpoint, path, storage_options=storage_options)
        atomic_torch_save(checkpoint, path)
        return None
