"""``offload="disk"`` and ``offload="cpu"``: where a ZeRO stage keeps this rank's optimizer state (and, with
``offload_params`` at stage 3, its fp32 parameter shards) between the steps that use it.

With offload, the optimizer's update runs bucket by bucket (:meth:`Offload.step_buckets`, after the closure,
Lightning's ``on_before_optimizer_step`` and clipping; or in backward with ``optimizer_in_backward``): a bucket's
state is brought in, its pieces stepped with the user's optimizer restricted to them
(:func:`~ddp_plugin.zero.backward_step.step_subset`), and the state sent back out while the next bucket is
stepped. The user's ``optimizer.step`` then finds no gradient left and changes nothing. The update of each
element is the one the whole step would make: ZeRO's optimizers are elementwise.

- ``"disk"`` (:class:`DiskOffload`): each bucket's state entry (Adam's ``exp_avg``, ...) is a file in
  ``offload_dir``, mapped into memory (``mmap``, shared) and unlinked at once, so nothing is left behind by a
  run that ends or is killed. The optimizer's ``state`` holds views of the mappings, so everything that reads it
  (checkpoints, members that come and go) works unchanged. Before a bucket is stepped, the next bucket's files
  are asked for (``MADV_WILLNEED``: the kernel reads them while this one steps); after it, a background thread
  writes the bucket's pages (``msync``) and drops them from this process and from the page cache
  (``MADV_DONTNEED``, ``POSIX_FADV_DONTNEED``). A mapped shared file never loses a write: a page touched again
  before it is dropped is written again. With ``offload_params`` a stage-3 unit's parameter shard is such a
  file too, read when its unit is gathered and dropped after the gather and after its step.
- ``"cpu"`` (:class:`HostOffload`): with an accelerator, the state lives in pinned host memory and each bucket's
  is copied to the device for its step (on a side stream, one bucket ahead) and back after it. On a CPU-only run
  the state is in host memory already, and this is the same update bucket by bucket, without copies.
"""

from __future__ import annotations

import logging
import mmap
import os
import tempfile
import threading
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from ddp_plugin.zero.optimizer import step_subset

if TYPE_CHECKING:
    from collections.abc import Sequence

    from torch.optim import Optimizer

    from ddp_plugin.zero.shards import FlatShard

log = logging.getLogger(__name__)

OFFLOADS = (None, "cpu", "disk")


def check_flags(flags: dict[str, Any]) -> None:
    """``offload``, ``offload_dir`` and ``offload_params`` together, and what they cannot go with."""
    offload, directory, params = flags["offload"], flags["offload_dir"], flags["offload_params"]
    if offload is None:
        if directory is not None or params:
            named = "`offload_dir`" if directory is not None else "`offload_params=True`"
            raise ValueError(f"{named} is for `offload='disk'`, and `offload` is None. Allowed: set"
                             " `offload='disk'`, or drop it.")
        return
    why = f"`offload={offload!r}` keeps each rank's shard of the optimizer state out of memory"
    refused = [
        (flags["zero_stage"] == 0, "`zero_stage=0`: it needs `zero_stage` 1, 2 or 3 (the state is offloaded shard"
         " by shard)"),
        (flags["sync_every"] > 1, f"`sync_every={flags['sync_every']}`: the sync modes are not supported with it yet"),
        (flags["fault_tolerance"] is not None, "`fault_tolerance`: not supported with it yet"),
        (flags["tensor_parallel_size"] != 1, f"`tensor_parallel_size={flags['tensor_parallel_size']}`: not"
         " supported with it yet"),
        (flags["pipeline_parallel_size"] > 1, f"`pipeline_parallel_size={flags['pipeline_parallel_size']}`: not"
         " supported with it yet"),
        (bool(flags["skip_nonfinite"]), "`skip_nonfinite=True`: not supported with it yet"),
    ]
    for bad, what in refused:
        if bad:
            raise ValueError(f"{why}, which cannot go with {what}. Allowed: drop one of the two.")
    if offload == "disk":
        if directory is None:
            raise ValueError("`offload='disk'` needs `offload_dir`: a directory on a local disk (an NVMe drive"
                             " for speed) where each rank keeps its files while it runs.")
    elif directory is not None:
        raise ValueError(f"`offload_dir` is for `offload='disk'`; `offload={offload!r}` keeps the state in host"
                         " memory. Allowed: drop `offload_dir`, or `offload='disk'`.")
    if params and (offload != "disk" or flags["zero_stage"] != 3):
        raise ValueError(f"`offload_params=True` puts stage 3's parameter shards on disk: it needs"
                         f" `offload='disk'` and `zero_stage=3` (got `offload={offload!r}`,"
                         f" `zero_stage={flags['zero_stage']}`).")


def check_directory(directory: str | os.PathLike) -> str:
    """``offload_dir`` as a string, refused unless it names (or can be made) a writable directory."""
    if not isinstance(directory, (str, os.PathLike)):
        raise ValueError(f"`offload_dir={directory!r}`: expected a directory path (a string).")
    return os.fspath(directory)


def check_trainer(loss_scaler: bool) -> None:
    """The Trainer's settings offload cannot go with (at setup)."""
    if loss_scaler:
        raise ValueError("`offload` cannot go with a loss scaler (`precision='16-mixed'`): the update runs bucket by"
                         " bucket before the scaler would decide to skip it. Use `precision='bf16-mixed'` or"
                         " `'32-true'`.")


def _flat_state(value: Any, numel: int) -> bool:
    """Whether a state entry is one value per element of its piece (offloaded), not a count or a scalar."""
    return isinstance(value, Tensor) and value.dim() > 0 and value.numel() == numel


class Offload:
    """The update bucket by bucket, and where a bucket's optimizer state is between updates (here: where the
    optimizer put it; the subclasses move it)."""

    def __init__(self) -> None:
        self.entries: Sequence[FlatShard] = ()
        self.optimizer: Optimizer | None = None
        self.buckets_stepped = 0
        """Buckets stepped by :meth:`step_buckets` and :meth:`after_step` since the last metrics collection."""

    def setup(self, entries: Sequence[FlatShard]) -> None:
        self.entries = entries

    def set_optimizer(self, optimizer: Optimizer) -> None:
        """The optimizer whose state is offloaded (its state so far, if any, is moved out now)."""
        self.optimizer = optimizer
        for b in range(len(self.entries)):
            self.adopt(b)
            self.release(b)

    # The places, overridden by the subclasses.
    def adopt(self, b: int) -> None:
        """Move bucket ``b``'s state entries to where they are kept (the first time, or after a load)."""

    def fetch(self, b: int) -> None:
        """Bucket ``b`` is stepped next: bring its state in (may return before it is in)."""

    def before_step(self, b: int) -> None:
        """Bucket ``b`` is stepped now: what :meth:`fetch` started must be done."""

    def release(self, b: int) -> None:
        """Bucket ``b`` was stepped (or read): send its state back out."""

    def close(self) -> None:
        """Wait for what is on its way out."""

    # The update.
    def step_buckets(self, optimizer: Optimizer) -> None:
        """Step every bucket that has a gradient (not those stepped in backward), one at a time; each piece's
        gradient is dropped after, so the optimizer's own step changes nothing."""
        order = [b for b, entry in enumerate(self.entries) if any(p.param.grad is not None for p in entry.pieces)]
        if order:
            self.fetch(order[0])
        for n, b in enumerate(order):
            if n + 1 < len(order):
                self.fetch(order[n + 1])
            params = [piece.param for piece in self.entries[b].pieces if piece.param.grad is not None]
            self.before_step(b)
            try:
                if params:
                    step_subset(optimizer, params)
            finally:
                for p in params:
                    p.grad = None
            self.after_step(b)

    def after_step(self, b: int) -> None:
        """Bucket ``b`` was just stepped (here or in backward)."""
        self.adopt(b)
        self.release(b)
        self.buckets_stepped += 1


class _MappedFile:
    """One file of ``nbytes`` in ``directory``, mapped shared and unlinked at once (the mapping keeps it)."""

    def __init__(self, directory: str, nbytes: int) -> None:
        fd, path = tempfile.mkstemp(prefix="ddp_plugin_offload_", dir=directory)
        try:
            os.ftruncate(fd, max(nbytes, 1))
            self.map = mmap.mmap(fd, max(nbytes, 1), flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.unlink(path)
        self.fd = fd
        self.nbytes = nbytes
        weakref.finalize(self, os.close, fd)

    def tensor(self, dtype: torch.dtype, numel: int) -> Tensor:
        return torch.frombuffer(self.map, dtype=dtype, count=numel) if numel else torch.empty(0, dtype=dtype)

    def prefetch(self) -> None:
        self.map.madvise(mmap.MADV_WILLNEED)

    def release(self) -> None:
        self.map.flush()
        self.map.madvise(mmap.MADV_DONTNEED)
        os.posix_fadvise(self.fd, 0, 0, os.POSIX_FADV_DONTNEED)


class DiskOffload(Offload):
    """Each bucket's optimizer state entries (and, with ``params``, stage-3 parameter shards) in mapped files in
    ``directory`` (see the module's docstring)."""

    def __init__(self, directory: str, params: bool = False) -> None:
        super().__init__()
        self.directory = directory
        self.params = params
        self.files: dict[tuple[int, str], _MappedFile] = {}
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="ddp_plugin-offload")
        self._pending: dict[int, Future] = {}
        self._lock = threading.Lock()
        self.bytes_on_disk = 0

    def _file(self, b: int, key: str, dtype: torch.dtype, numel: int | None = None) -> Tensor:
        """Bucket ``b``'s flat tensor for state entry ``key`` (a shard's worth, or ``numel``), in its file."""
        numel = self.entries[b].shard.numel() if numel is None else numel
        f = self.files.get((b, key))
        if f is None:
            os.makedirs(self.directory, exist_ok=True)
            f = self.files[(b, key)] = _MappedFile(self.directory, numel * dtype.itemsize)
            self.bytes_on_disk += f.nbytes
        return f.tensor(dtype, numel)

    def shard_to_disk(self, b: int, shard: Tensor) -> Tensor:
        """Stage 3 with ``offload_params``: bucket ``b``'s parameter shard copied to its file; the mapped copy
        (which the caller takes as the shard) is returned. (Called while the shards are made, bucket by bucket.)"""
        mapped = self._file(b, "param", shard.dtype, shard.numel())
        mapped.copy_(shard)
        self.release(b, keys=("param",))
        return mapped

    def whole_bucket(self, b: int) -> Tensor:
        """After ``fit`` with ``params``: a file for bucket ``b``'s whole flat parameters, gathered into it."""
        full = self.entries[b].full
        return self._file(b, "whole", full.dtype, full.numel())

    def adopt(self, b: int) -> None:
        state = self.optimizer.state if self.optimizer is not None else {}
        for piece in self.entries[b].pieces:
            st = state.get(piece.param)
            n = piece.param.numel()
            for key, value in (st or {}).items():
                if not _flat_state(value, n):
                    continue
                flat = self._file(b, key, value.dtype)
                view = flat[piece.at : piece.at + n].view_as(value)
                if view.data_ptr() != value.data_ptr():
                    view.copy_(value)
                    st[key] = view

    def fetch(self, b: int) -> None:
        self._wait(b)  # (a release of it still running would drop what is asked for)
        for (bb, _), f in list(self.files.items()):
            if bb == b:
                f.prefetch()

    def release(self, b: int, keys: Sequence[str] | None = None) -> None:
        files = [f for (bb, k), f in list(self.files.items()) if bb == b and (keys is None or k in keys)]
        if not files:
            return

        def write() -> None:
            for f in files:
                f.release()

        with self._lock:
            self._pending[b] = self._writer.submit(write)

    def after_gather(self, b: int) -> None:
        """Stage 3 with ``offload_params``: bucket ``b``'s shard was read for a gather; drop its pages (and those of
        the whole parameters gathered into a file after ``fit``)."""
        if self.params:
            self.release(b, keys=("param", "whole"))

    def _wait(self, b: int) -> None:
        with self._lock:
            pending = self._pending.pop(b, None)
        if pending is not None:
            pending.result()

    def close(self) -> None:
        for b in list(self._pending):
            self._wait(b)


class HostOffload(Offload):
    """``offload="cpu"``: the optimizer state in pinned host memory, each bucket's copied to ``device`` for its
    step, on a side stream and one bucket ahead, and back after it. With ``device`` the CPU, nothing is copied
    (the state is in host memory already); the update still runs bucket by bucket."""

    def __init__(self, device: torch.device) -> None:
        super().__init__()
        self.device = device
        self.stream_copies = device.type != "cpu"
        self.host: dict[tuple[int, int, str], Tensor] = {}
        """(bucket, piece, key) -> the entry in pinned host memory."""
        self._ready: dict[int, Any] = {}
        self._stream = torch.Stream(device=device) if self.stream_copies else None

    def _states(self, b: int) -> list[tuple[int, dict[str, Any], int]]:
        state = self.optimizer.state if self.optimizer is not None else {}
        return [(i, state.get(piece.param) or {}, piece.param.numel())
                for i, piece in enumerate(self.entries[b].pieces)]

    def adopt(self, b: int) -> None:
        if not self.stream_copies:
            return
        for i, st, n in self._states(b):
            for key, value in st.items():
                if _flat_state(value, n) and value.device.type != "cpu":
                    host = self.host.get((b, i, key))
                    if host is None:
                        host = self.host[(b, i, key)] = torch.empty(value.shape, dtype=value.dtype, pin_memory=True)
                    host.copy_(value, non_blocking=True)  # (on the current stream, after the step)

    def release(self, b: int) -> None:
        if not self.stream_copies:
            return
        torch.accelerator.current_stream(self.device).synchronize()  # (the copies of adopt are done)
        for i, st, _ in self._states(b):
            for key in list(st):
                if (host := self.host.get((b, i, key))) is not None:
                    st[key] = host

    def fetch(self, b: int) -> None:
        if not self.stream_copies or b in self._ready:
            return
        stream = self._stream
        stream.wait_stream(torch.accelerator.current_stream(self.device))
        with stream:
            for i, st, _ in self._states(b):
                for key in list(st):
                    if (host := self.host.get((b, i, key))) is not None:
                        st[key] = host.to(self.device, non_blocking=True)
        self._ready[b] = stream.record_event()

    def before_step(self, b: int) -> None:
        if (ready := self._ready.pop(b, None)) is not None:
            torch.accelerator.current_stream(self.device).wait_event(ready)


def make_offload(kind: str | None, directory: str | None, params: bool, device: torch.device) -> Offload | None:
    if kind is None:
        return None
    if kind == "disk":
        if device.type != "cpu":
            raise ValueError(f"`offload='disk'` runs the update on the host, where its files are mapped: with the"
                             f" parameters on {device.type} it is not available yet. Allowed: `offload='cpu'` (the"
                             " state in pinned host memory, copied to the device for each bucket's step), or CPU ranks.")
        return DiskOffload(directory, params)
    return HostOffload(device)
