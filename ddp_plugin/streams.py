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
"""

from __future__ import annotations

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
