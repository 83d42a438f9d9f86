"""A CUDA stream for each thread of the library's own that queues device work: the engine's communication
thread, the sync modes' outer thread.

Every thread starts on the device's default stream, which the training thread's forward and backward use. A
second thread queueing collectives there, and waiting on them (``Work.wait()`` makes the *current stream* wait),
would hold back every kernel the backward queues after that wait: the overlap the buckets exist for would be
lost on CUDA, where gloo on CPU never shows it. So each such thread gets a stream of its own, as torch's DDP
reducer and FSDP2 keep their communication on streams of their own, with the same hand-overs:

- a tensor the training thread produced is handed over with an event recorded on its stream
  (:meth:`SideStream.hand_over`), which the side stream waits for before using it (:meth:`SideStream.receive`);
- a tensor the training thread allocated is marked as used by the side stream (``record_stream``), so the
  caching allocator does not give its memory to another tensor while the side stream still reads it;
- the training thread's stream waits for the side stream (:meth:`SideStream.join`) before it reads what the
  side thread wrote.

On CPU (and any device without streams) every method does nothing.

The threads themselves are :class:`SideThread`: one daemon thread each, running its work in order. A collective
that failed leaves the thread's later collectives unrun (they would pair with the wrong collective of a peer),
and after a failed fit nothing waits for the thread: it may sit in a collective with a peer that is gone or
stopped until the collective timeout, and only this process ending closes its connections, which is what
releases the peers (see docs/failures.md).
"""

from __future__ import annotations

import concurrent.futures
import queue
import threading
from collections.abc import Callable
from typing import Any

import torch


class SideStream:
    """The stream of one side thread on ``device`` (``None`` off CUDA)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    def bind(self) -> None:
        """In the side thread (an executor's ``initializer``): this device and this stream, from now on."""
        if self.stream is not None:
            torch.cuda.set_device(self.device)
            torch.cuda.set_stream(self.stream)

    def hand_over(self, *tensors: torch.Tensor) -> torch.cuda.Event | None:
        """In the training thread: an event past the work queued so far on its stream, for :meth:`receive`;
        ``tensors`` are marked as used by the side stream."""
        if self.stream is None:
            return None
        for t in tensors:
            t.record_stream(self.stream)
        ready = torch.cuda.Event()
        ready.record()
        return ready

    def receive(self, ready: torch.cuda.Event | None) -> None:
        """In the side thread: its stream waits for the event of :meth:`hand_over`."""
        if ready is not None:
            self.stream.wait_event(ready)

    def join(self) -> None:
        """In the training thread: its stream waits for everything queued on the side stream so far."""
        if self.stream is not None:
            torch.cuda.current_stream(self.device).wait_stream(self.stream)


class SideThread:
    """A daemon thread that runs the work submitted to it one item at a time, in order, on a
    :class:`SideStream` of its own (``self.side``).

    Once an item raised, the items after it are not run: their futures fail with an error that names the first
    one. :meth:`close` ``(wait=False)``, after a failed fit, leaves the thread to the end of the process."""

    def __init__(self, device: torch.device, name: str) -> None:
        self.side = SideStream(device)
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._failed: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, fn: Callable[..., Any], *args: Any) -> concurrent.futures.Future:
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._queue.put((future, fn, args))
        return future

    def _run(self) -> None:
        self.side.bind()
        while (item := self._queue.get()) is not None:
            future, fn, args = item
            if not future.set_running_or_notify_cancel():
                continue
            if self._failed is not None:
                future.set_exception(RuntimeError(
                    f"{self._thread.name}: not run, an earlier item failed: {type(self._failed).__name__}:"
                    f" {self._failed}"))
                continue
            try:
                future.set_result(fn(*args))
            except BaseException as err:  # noqa: BLE001 - handed to whoever waits on the future
                self._failed = err
                future.set_exception(err)
            del item, future, fn, args

    def close(self, wait: bool = True) -> None:
        """No more work. ``wait``: until what was submitted has run (the normal end of a fit)."""
        self._queue.put(None)
        if wait:
            self._thread.join()
