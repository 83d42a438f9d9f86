"""When device work happened, for the times the library measures (the link probe, the adaptive planner, the
``comm/*`` and ``sync/*`` metrics).

On CPU a collective's work is done when ``wait()`` returns or its future completes, and the host's clock times
it. On CUDA with NCCL neither holds: a collective returns, and its future completes (running its callbacks),
once its kernel is queued; ``wait()`` makes the current stream wait, not the host. A host clock read there
times the enqueue. A :class:`Clock` stamps points of a stream instead: on CUDA an event recorded on the current
stream (it completes when the stream gets there), on CPU the host's ``perf_counter``; a stamp's time is known
once the device reached it (:meth:`Clock.seconds` answers ``None`` before), so the readers take the intervals
the device has finished and keep the rest for their next reading (:class:`Intervals`): nothing waits for the
device to measure it.

    clock = Clock(device)
    start = clock.stamp()             # on the stream the work is queued on
    ...                               # queue the work; for a future: a stamp in its done-callback
    end = clock.stamp()
    intervals.add(start, end)         # intervals.take() -> seconds of the finished ones
"""

from __future__ import annotations

import time
from typing import Union

import torch

Stamp = Union[float, "torch.cuda.Event"]


class Clock:
    """Stamps on ``device``'s current stream (CUDA events), or the host's clock on any other device."""

    def __init__(self, device: torch.device) -> None:
        self.on_device = device.type == "cuda"
        self._origin: torch.cuda.Event | None = None
        if self.on_device:
            self._origin = torch.cuda.Event(enable_timing=True)
            self._origin.record()

    def stamp(self) -> Stamp:
        """Now, on the current stream of the calling thread (CUDA), or on the host."""
        if not self.on_device:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def seconds(self, stamp: Stamp, wait: bool = False) -> float | None:
        """The stamp's time in seconds (from an origin of the clock's own: only differences mean anything);
        ``None`` while the device has not reached it, unless ``wait`` (then the host waits for it)."""
        if isinstance(stamp, float):
            return stamp
        if wait:
            stamp.synchronize()
        elif not stamp.query():
            return None
        return self._origin.elapsed_time(stamp) / 1e3

    def elapsed(self, start: Stamp, end: Stamp, wait: bool = False) -> float | None:
        """Seconds from ``start`` to ``end`` (``None`` while the device has not reached both, unless ``wait``)."""
        a, b = self.seconds(start, wait), self.seconds(end, wait)
        return None if a is None or b is None else b - a


class Intervals:
    """Intervals between stamps, summed once the device finished them: :meth:`take` returns the seconds of the
    finished ones since the last call and keeps the others for the next (on CPU every one is finished)."""

    def __init__(self, clock: Clock) -> None:
        self.clock = clock
        self._pending: list[tuple[Stamp, Stamp]] = []

    def add(self, start: Stamp, end: Stamp) -> None:
        self._pending.append((start, end))

    def take(self) -> float:
        total, left = 0.0, []
        for start, end in self._pending:
            seconds = self.clock.elapsed(start, end)
            if seconds is None:
                left.append((start, end))
            else:
                total += seconds
        self._pending = left
        return total

    def clear(self) -> None:
        self._pending = []
