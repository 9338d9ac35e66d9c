"""Keeping the host memory a step frees for the next step: glibc malloc's two thresholds.

Why: a training step allocates its activations and temporaries in forward, frees them during backward, and the
next step allocates the same sizes again. glibc's malloc gives every allocation above its *mmap threshold* a
mapping of its own, unmapped again on free, and returns the heap's free top to the kernel once it exceeds its
*trim threshold*. The thresholds start at 128 KiB and 2 × that; glibc raises them as mapped blocks are freed,
but not past 32 MiB, and not for good — the step's pattern still hands pages back every step. A page handed
back is a new page next time: the kernel faults it in and zeroes it on first touch. Measured on a 2-core AMD
EPYC VM, GPT-2 4L/256d (T 128, B 8, float32, one thread), a plain loop of steps: 20 thousand page faults a step
and 535–555 ms a step; with the thresholds set, none and 398–479 ms (docs/benchmarks.md). A 205 MiB array (GPT-2
124M's logits) took 123 ms to allocate and fill on fresh pages against 29 ms reused.

What: `keep_freed_memory()` sets M_MMAP_THRESHOLD to 1 GiB (blocks below it come from the heap, which keeps
them) and M_TRIM_THRESHOLD to 2 GiB − 1 (the heap's free top is kept up to that), through `mallopt` — the knob
glibc gives for this, the same as the MALLOC_MMAP_THRESHOLD_ and MALLOC_TRIM_THRESHOLD_ environment variables
but settable after the process starts. The cost is the one a caching allocator has: the process keeps the
memory of its largest step resident instead of handing it back between steps (the peak itself is unchanged).
`Transformer` calls it when its arrays are NumPy's; GPU arrays come from CuPy's memory pool, which already
keeps freed blocks.

When it does not: `MPIPARALLEL_KEEP_FREED_MEMORY=0`, or a C library without glibc's `mallopt` (macOS, musl):
malloc keeps its defaults and the step is as before, slower by its page faults. `status()` says which.

Communication: none.
"""

from __future__ import annotations

import ctypes
import functools
import os

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc's <malloc.h>
MMAP_THRESHOLD = 1 << 30
TRIM_THRESHOLD = (1 << 31) - 1  # mallopt takes an int
VARIABLE = "MPIPARALLEL_KEEP_FREED_MEMORY"

_state = {"status": "not asked (malloc's defaults)"}


def keep_freed_memory() -> bool:
    """Set glibc malloc's thresholds so that freed blocks stay in the heap for the next step (module docstring).
    Returns whether they are set; idempotent and cheap, so every CPU model may call it."""
    if os.environ.get(VARIABLE, "1") == "0":
        _state["status"] = f"off ({VARIABLE}=0: malloc's defaults)"
        return False
    mallopt = _glibc_mallopt()
    if mallopt is None:
        _state["status"] = "not glibc (malloc's defaults)"
        return False
    if not (mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD) and mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD)):
        _state["status"] = "glibc refused mallopt (malloc's defaults)"
        return False
    _state["status"] = f"kept (mmap threshold {MMAP_THRESHOLD >> 20} MiB, trim threshold {TRIM_THRESHOLD >> 20} MiB)"
    return True


def status() -> str:
    """What this process's malloc does with freed memory, for benchmark headers."""
    return _state["status"]


@functools.cache
def _glibc_mallopt() -> ctypes._CFuncPtr | None:
    """glibc's mallopt, or None where the C library is not glibc (musl has a mallopt that does nothing); looked up
    once, as every CPU model asks."""
    try:
        libc = ctypes.CDLL(None)
        libc.gnu_get_libc_version  # noqa: B018 — glibc's own symbol: present only there
        mallopt = libc.mallopt
    except (AttributeError, OSError):
        return None
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return mallopt
