"""Exact live and peak heap bytes of a process, every thread included: a ``malloc`` interposer.

PyTorch's CPU tensors are ``malloc``-ed (``posix_memalign``) by whichever thread creates them, the strategy's
communication thread and gloo's threads included; torch's profiler sees only the thread it was started on, and
the resident set size says what glibc kept, not what was live. This module compiles (once, with the system's C
compiler) a small shared library that wraps glibc's allocation functions and counts the usable bytes of every
block allocated and not yet freed, with the highest count reached since the last reset. A process started with
it in ``LD_PRELOAD`` (:func:`preload_env`) reads the counters through :class:`Heap`:

    heap = Heap.attach()               # None when the process was not started with the library
    heap.reset_peak()
    ...                                # one training step
    heap.peak - heap.live_at_reset     # the most the step held on top of what was live before it

Used by the memory-budget tests (``tests/test_memory_budget.py``). Linux with glibc only.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

SOURCE = r"""
#define _GNU_SOURCE
#include <errno.h>
#include <malloc.h>
#include <stddef.h>
#include <stdatomic.h>

extern void *__libc_malloc(size_t);
extern void __libc_free(void *);
extern void *__libc_calloc(size_t, size_t);
extern void *__libc_realloc(void *, size_t);
extern void *__libc_memalign(size_t, size_t);

static _Atomic long long live, peak;

static void count(long long n) {
    long long now = atomic_fetch_add(&live, n) + n;
    long long seen = atomic_load(&peak);
    while (now > seen && !atomic_compare_exchange_weak(&peak, &seen, now)) {}
}
static void *counted(void *p) { if (p) count((long long)malloc_usable_size(p)); return p; }

void *malloc(size_t n) { return counted(__libc_malloc(n)); }
void *calloc(size_t a, size_t b) { return counted(__libc_calloc(a, b)); }
void *memalign(size_t a, size_t n) { return counted(__libc_memalign(a, n)); }
void *aligned_alloc(size_t a, size_t n) { return counted(__libc_memalign(a, n)); }
void *valloc(size_t n) { return counted(__libc_memalign(4096, n)); }
int posix_memalign(void **out, size_t a, size_t n) {
    void *p = __libc_memalign(a, n);
    if (!p && n) return ENOMEM;
    *out = counted(p);
    return 0;
}
void free(void *p) {
    if (!p) return;
    count(-(long long)malloc_usable_size(p));
    __libc_free(p);
}
void *realloc(void *p, size_t n) {
    long long before = p ? (long long)malloc_usable_size(p) : 0;
    void *q = __libc_realloc(p, n);
    if (q) count((long long)malloc_usable_size(q) - before);
    else if (p && n == 0) count(-before);
    return q;
}

long long ddp_heap_live(void) { return atomic_load(&live); }
long long ddp_heap_peak(void) { return atomic_load(&peak); }
void ddp_heap_reset_peak(void) { atomic_store(&peak, atomic_load(&live)); }
"""

ENV_FLAG = "DDP_PLUGIN_HEAP_TRACKER"


def compiler() -> str | None:
    """The C compiler to build the library with, or None."""
    return shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")


def build(directory: str | os.PathLike | None = None) -> Path:
    """Compile the library (once per source text and folder) and return its path; ``RuntimeError`` without a
    compiler or off Linux."""
    cc = compiler()
    if cc is None or not os.path.exists("/proc/self/maps"):
        raise RuntimeError("the heap tracker needs Linux (glibc) and a C compiler (cc or gcc)")
    folder = Path(directory or tempfile.gettempdir())
    digest = hashlib.sha256(SOURCE.encode()).hexdigest()[:12]
    lib = folder / f"ddp_plugin_heap_{digest}.so"
    if lib.exists():
        return lib
    src = folder / f"ddp_plugin_heap_{digest}.{os.getpid()}.c"
    src.write_text(SOURCE)
    tmp = lib.with_suffix(f".{os.getpid()}.so")
    try:
        subprocess.run([cc, "-O2", "-shared", "-fPIC", "-o", str(tmp), str(src)], check=True,
                       capture_output=True, text=True)
        os.replace(tmp, lib)
    finally:
        src.unlink(missing_ok=True)
        tmp.unlink(missing_ok=True)
    return lib


def preload_env(lib: str | os.PathLike, env: dict[str, str] | None = None) -> dict[str, str]:
    """``env`` (default: this process's) with the library first in ``LD_PRELOAD``."""
    env = dict(os.environ if env is None else env)
    env["LD_PRELOAD"] = " ".join(p for p in (str(lib), env.get("LD_PRELOAD", "")) if p)
    env[ENV_FLAG] = str(lib)
    return env


class Heap:
    """The counters of the library this process was started with."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self._lib = lib
        for name in ("ddp_heap_live", "ddp_heap_peak"):
            getattr(lib, name).restype = ctypes.c_longlong
        self.live_at_reset = self.live

    @classmethod
    def attach(cls) -> Heap | None:
        path = os.environ.get(ENV_FLAG)
        if not path or path not in os.environ.get("LD_PRELOAD", ""):
            return None
        return cls(ctypes.CDLL(path))

    @property
    def live(self) -> int:
        """Bytes allocated and not freed, now."""
        return int(self._lib.ddp_heap_live())

    @property
    def peak(self) -> int:
        """The most bytes live at once since the last :meth:`reset_peak`."""
        return int(self._lib.ddp_heap_peak())

    def reset_peak(self) -> None:
        self._lib.ddp_heap_reset_peak()
        self.live_at_reset = self.live
