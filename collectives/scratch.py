"""Scratch buffers for the algorithms' temporaries, reused from call to call.

Algorithms need temporaries as large as their input: a work copy for partial results, a buffer for a
partner's whole vector. Allocated afresh on every call, a large one costs more than the data it carries:
glibc hands out allocations of 32 MiB and more as new mappings and returns them on free, so each call pays a
page fault per 4 KiB it touches (measured here: a fresh 32 MiB buffer took 3.9 ms to fill, a reused one
2.1 ms). The MPI library keeps its internal buffers; so do we.

    with scratch(x, n) as work:     # n elements of x's dtype, on x's device
        ...                         # `work` goes back to the pool when the block ends

Host buffers of `POOLED_BYTES` or more come from a pool that keeps what was given back (up to
`POOL_LIMIT_BYTES` in all); smaller ones and device arrays (CuPy has its own memory pool) are allocated as
usual. A buffer is taken for the length of one `with` block, so collectives in flight at the same time (async
handles) never share one; a generator that is dropped half-way gives its buffers back when it is closed.
Landing buffers of one segment need no pool: at most `segment_bytes`, malloc reuses their memory.
"""

from __future__ import annotations

import numpy as np

from .backend import Array, get_array_module

POOLED_BYTES = 1 << 20
"""Smaller temporaries are cheap to allocate (malloc reuses freed memory below glibc's mmap threshold)."""

POOL_LIMIT_BYTES = 1 << 30
"""Most bytes the pool keeps when nothing is using them; buffers given back beyond this are freed."""

_free: list[np.ndarray] = []  # byte buffers not in use, smallest first


def _take(nbytes: int) -> np.ndarray:
    """The smallest free byte buffer of at least `nbytes`, or a new one."""
    for i, buffer in enumerate(_free):
        if buffer.nbytes >= nbytes:
            return _free.pop(i)
    return np.empty(nbytes, np.uint8)


def _give_back(buffer: np.ndarray) -> None:
    _free.append(buffer)
    _free.sort(key=lambda b: b.nbytes)
    while sum(b.nbytes for b in _free) > POOL_LIMIT_BYTES:
        _free.pop()  # the largest goes first


def pooled_bytes() -> int:
    """Bytes held by the pool and not in use (for tests and memory reports)."""
    return sum(b.nbytes for b in _free)


def release_pool() -> None:
    """Free every buffer the pool keeps (the ones in use go back to it as usual)."""
    _free.clear()


class scratch:  # noqa: N801 - used like a function: `with scratch(x, n) as buf`
    """A temporary 1-D array of `count` elements with the dtype and backend of `like`, for one `with` block."""

    __slots__ = ("_array", "_buffer")

    def __init__(self, like: Array, count: int) -> None:
        nbytes = count * like.itemsize
        if nbytes >= POOLED_BYTES and type(like) is np.ndarray:
            self._buffer = _take(nbytes)
            self._array = self._buffer[:nbytes].view(like.dtype)
        else:  # the common small case: kept short, it runs on every call of a small collective
            self._buffer = None
            self._array = get_array_module(like).empty(count, like.dtype)

    def __enter__(self) -> Array:
        return self._array

    def __exit__(self, *exc: object) -> None:
        if self._buffer is not None:
            _give_back(self._buffer)
            self._buffer = None
