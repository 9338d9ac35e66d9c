"""Reduction operators and the arithmetic of splitting a flat buffer into blocks and message segments."""

from __future__ import annotations

import functools
from collections.abc import Callable

from .backend import Array, get_array_module, is_floating
from .communicator import Step, Steps

OPS = ("sum", "prod", "max", "min", "avg")
_UFUNC = {"sum": "add", "prod": "multiply", "max": "maximum", "min": "minimum", "avg": "add"}

Reducer = Callable[[Array, Array, Array], None]


def check_op(op: str) -> None:
    if op not in OPS:
        raise ValueError(f"unknown op {op!r}; valid ops: {', '.join(OPS)}")


def reducer(op: str, x: Array) -> Reducer:
    """The ufunc computing out = a (op) b elementwise (`reduce(a, b, out)`), in place when out is a or b.

    "avg" reduces with a sum; the caller divides by the rank count once at the end (`finish_average`).
    """
    return _ufunc(get_array_module(x), op)


@functools.cache
def _ufunc(xp: object, op: str) -> Reducer:
    return getattr(xp, _UFUNC[op])


def finish_average(result: Array, size: int) -> None:
    """Turn a sum into an average in place: true division for floats, floor division for integers."""
    if is_floating(result.dtype):
        result /= size
    else:
        result //= size


@functools.lru_cache(maxsize=1024)
def even_bounds(count: int, parts: int) -> tuple[int, ...]:
    """Offsets splitting `count` elements into `parts` contiguous blocks whose sizes differ by at most one.

    Cached: the same few splits come back on every call of a collective of one size.
    """
    base, extra = divmod(count, parts)
    bounds = [0]
    for i in range(parts):
        bounds.append(bounds[-1] + base + (1 if i < extra else 0))
    return tuple(bounds)


def segment_count(largest_block: int, itemsize: int, segment_bytes: int) -> int:
    """How many segments of at most `segment_bytes` each block is cut into (the communicator's setting).

    The same on every rank: derived from global sizes only, and every rank's communicator has the same
    `segment_bytes` (ranks that built theirs with different values would pair mismatched messages).
    """
    if largest_block * itemsize <= segment_bytes:
        return 1
    limit = max(1, segment_bytes // itemsize)
    return -(-largest_block // limit)


def exchange_in_segments(send: Array, dest: int, recv: Array, source: int, segments: int,
                         on_arrival: Callable[[int, int], None] | None = None) -> Steps:
    """Steps sending `send` to `dest` while receiving `recv` from `source`, cut into `segments` pieces.

    `on_arrival(lo, hi)` runs as soon as recv[lo:hi] has arrived (say, to reduce it while it is in cache).
    Both partners must pass the same `segments`; piece i of one side's send is piece i of the other's recv.
    """
    if segments == 1:  # the common small-message case, without the bookkeeping
        yield Step(send, dest, recv, source)
        if on_arrival is not None:
            on_arrival(0, len(recv))
        return
    send_bounds = even_bounds(len(send), segments)
    recv_bounds = even_bounds(len(recv), segments)
    for i in range(segments):
        lo, hi = recv_bounds[i], recv_bounds[i + 1]
        yield Step(send[send_bounds[i]:send_bounds[i + 1]], dest, recv[lo:hi], source)
        if on_arrival is not None:
            on_arrival(lo, hi)


def exchange_and_reduce(send: Array, dest: int, source: int, mine: Array, target: Array, landing: Array,
                        segments: int, reduce: Reducer) -> Steps:
    """Steps sending `send` to `dest` while a block as long as `mine` arrives from `source`, cut into `segments`
    pieces; each piece lands in the reused buffer `landing` (one segment long, so it is still in cache) and is
    reduced at once with its piece of `mine` into `target` — the inner loop of ring and halving reductions."""
    if segments == 1:  # the common case, without the bookkeeping of pieces
        arrived = landing[:len(mine)]
        yield Step(send, dest, arrived, source)
        reduce(mine, arrived, target)
        return
    send_bounds, recv_bounds = even_bounds(len(send), segments), even_bounds(len(mine), segments)
    for i in range(segments):
        lo, hi = recv_bounds[i], recv_bounds[i + 1]
        arrived = landing[:hi - lo]
        yield Step(send[send_bounds[i]:send_bounds[i + 1]], dest, arrived, source)
        reduce(mine[lo:hi], arrived, target[lo:hi])
