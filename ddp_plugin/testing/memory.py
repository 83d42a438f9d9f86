"""This process's resident memory (RSS), for tests and benchmarks that measure what a step or a save costs.

- :func:`rss_bytes`: resident now (``/proc/self/statm``; the same count as ``VmRSS`` in ``/proc/self/status``).
- :func:`peak_rss_bytes`: the most this process has ever had resident (``getrusage``'s ``ru_maxrss``).
- :class:`PeakRSS`: the peak over a stretch of code, sampled every millisecond by a thread (``ru_maxrss`` cannot
  be reset, so it cannot tell the peak of one save after a larger earlier one)::

      before = rss_bytes()
      with PeakRSS() as peak:
          trainer.save_checkpoint(path)
      extra = peak.bytes - before

- :class:`SavedTensorBytes`: the bytes autograd saves for the backward over a stretch of code (what activation
  checkpointing saves).

Linux only (``/proc``; ``ru_maxrss`` is in kilobytes there). Nothing here imports pytest, nor torch but
:class:`SavedTensorBytes` when entered.
"""

from __future__ import annotations

import os
import resource
import threading
import time

__all__ = ["PeakRSS", "SavedTensorBytes", "peak_rss_bytes", "rss_bytes"]


def rss_bytes() -> int:
    """Bytes of this process resident in memory now."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def peak_rss_bytes() -> int:
    """The largest resident set this process has had since it started, in bytes."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


class PeakRSS(threading.Thread):
    """A daemon thread sampling :func:`rss_bytes` every ``interval`` seconds until stopped; ``bytes`` is the
    largest sample, starting from the RSS when it was made. Use it as a context manager (start, then stop and
    join on exit), or call :meth:`start` and :meth:`finish`."""

    def __init__(self, interval: float = 0.001) -> None:
        super().__init__(daemon=True)
        self.interval = interval
        self.bytes = rss_bytes()
        self._stop_sampling = threading.Event()

    def run(self) -> None:
        while not self._stop_sampling.is_set():
            self.bytes = max(self.bytes, rss_bytes())
            time.sleep(self.interval)

    def finish(self) -> int:
        """Stop sampling, wait for the thread, and return the peak in bytes."""
        self._stop_sampling.set()
        self.join()
        return self.bytes

    def __enter__(self) -> PeakRSS:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.finish()


class SavedTensorBytes:
    """Counts the bytes autograd saves for the backward while entered (an outer ``saved_tensors_hooks``; what a
    checkpointed module saves is packed by the checkpoint's own hooks and dropped, so only its inputs count).
    Enter and exit may sit in different callbacks (a Lightning batch's start and end)."""

    def __init__(self) -> None:
        self.bytes = 0
        self._hooks = None

    def _pack(self, t):
        self.bytes += t.numel() * t.element_size()
        # A new tensor object: a reference to a parameter itself, kept by the pipeline schedule's first step, made
        # Lightning's `module.cpu()` at teardown fail ("Couldn't swap Linear.weight").
        return t.detach()

    def __enter__(self) -> SavedTensorBytes:
        import torch

        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._hooks is not None:
            self._hooks.__exit__(None, None, None)
            self._hooks = None
