"""Ring algorithms: reduce-scatter, all-gather, and all-reduce = reduce-scatter followed by all-gather.

The n ranks form a ring; every step each rank sends one block (1/n of the data) to its right neighbour and
receives one from its left. In reduce-scatter the received block is reduced into the local copy and passed on,
so after n−1 steps each rank holds one fully reduced block; all-gather then circulates the finished blocks for
n−1 more steps. Cost (α per message, β per byte sent, γ per byte reduced, S bytes of data, n ranks):

    reduce-scatter   (n−1)·α + (n−1)/n·S·β + (n−1)/n·S·γ
    all-gather       (n−1)·α + (n−1)/n·S·β
    all-reduce       2(n−1)·α + 2(n−1)/n·S·β + (n−1)/n·S·γ

Each rank sends 2(n−1)/n·S bytes in an all-reduce — the lower bound for any all-reduce, which is why the ring
is the algorithm of choice for large messages; its 2(n−1) latency terms make it the worst for small ones.
Blocks larger than `segment_bytes` (the communicator's setting, 1 MiB by default) travel in pieces, each
reduced right after it arrives.
"""

from __future__ import annotations

from collections.abc import Callable

from .backend import Array, get_array_module
from .blocks import Reducer, even_bounds, exchange_and_reduce, exchange_in_segments, segment_count
from .communicator import DEFAULT_SEGMENT_BYTES, Step, Steps
from .scratch import scratch


def ring_reduce_scatter_phase(x: Array, bounds: list[int], rank: int, size: int, reduce: Reducer,
                              partial: Callable[[int, int], Array], *, segment_bytes: int,
                              largest_block: int = 0) -> Steps:
    """The n−1 reduce-scatter steps over the blocks `bounds` of the flat array `x`.

    At step s rank r receives block b = (r−s−2) mod n, reduces it with its own x[b] into `partial(s, b)` and
    sends that partial result on at step s+1; after the last step block `rank` is complete. Each segment lands
    in one small reused buffer, so the reduction reads it from cache (and `partial` may alias `x`).
    `largest_block` (elements) is needed when the first block is not the largest (bounds other than
    `even_bounds`).
    """
    right, left = (rank + 1) % size, (rank - 1) % size
    largest = largest_block or bounds[1] - bounds[0]  # even_bounds: the first block is the largest
    segments = segment_count(largest, x.itemsize, segment_bytes)
    send = x[bounds[left]:bounds[left + 1]]
    landing = get_array_module(x).empty(-(-largest // segments), x.dtype)  # at most a segment
    for step in range(size - 1):
        block = (rank - step - 2) % size
        mine, target = x[bounds[block]:bounds[block + 1]], partial(step, block)
        yield from exchange_and_reduce(send, right, left, mine, target, landing, segments, reduce)
        send = target


def ring_all_gather_phase(out: Array, bounds: list[int], rank: int, size: int, *, segment_bytes: int,
                          largest_block: int = 0) -> Steps:
    """The n−1 all-gather steps: `out` holds block `rank` on entry and every block on exit."""
    right, left = (rank + 1) % size, (rank - 1) % size
    segments = segment_count(largest_block or bounds[1] - bounds[0], out.itemsize, segment_bytes)
    for step in range(size - 1):
        send_block, recv_block = (rank - step) % size, (rank - step - 1) % size
        send, recv = out[bounds[send_block]:bounds[send_block + 1]], out[bounds[recv_block]:bounds[recv_block + 1]]
        if segments == 1:
            yield Step(send, right, recv, left)
        else:
            yield from exchange_in_segments(send, right, recv, left, segments)


def ring_all_reduce(x: Array, out: Array, rank: int, size: int, reduce: Reducer,
                    segment_bytes: int = DEFAULT_SEGMENT_BYTES) -> Steps:
    """All-reduce of flat `x` into flat `out` (which may be `x` itself) without copying `x` first.

    Step 0 sends straight from `x` and every reduction writes into `out`, so no full-size temporary exists.
    """
    bounds = even_bounds(len(x), size)

    def into_out(step: int, block: int) -> Array:
        return out[bounds[block]:bounds[block + 1]]

    yield from ring_reduce_scatter_phase(x, bounds, rank, size, reduce, into_out, segment_bytes=segment_bytes)
    yield from ring_all_gather_phase(out, bounds, rank, size, segment_bytes=segment_bytes)


def ring_reduce_scatter(x: Array, out: Array, rank: int, size: int, reduce: Reducer,
                        segment_bytes: int = DEFAULT_SEGMENT_BYTES) -> Steps:
    """Reduce-scatter of flat `x` (length divisible by size) into `out`, this rank's block.

    Partial results alternate between `out` and one block-sized buffer (one is sent while the other is filled),
    with the parity chosen so that the last step lands in `out`.
    """
    bounds = even_bounds(len(x), size)
    with scratch(x, len(out) if size > 2 else 0) as spare:

        def partial(step: int, block: int) -> Array:
            return out if (size - 2 - step) % 2 == 0 else spare

        yield from ring_reduce_scatter_phase(x, bounds, rank, size, reduce, partial, segment_bytes=segment_bytes)


def ring_all_gather(x: Array, out: Array, rank: int, size: int,
                    segment_bytes: int = DEFAULT_SEGMENT_BYTES) -> Steps:
    """All-gather of flat `x` into flat `out` (size·len(x) elements, rank order)."""
    bounds = even_bounds(len(out), size)
    out[bounds[rank]:bounds[rank + 1]] = x
    yield from ring_all_gather_phase(out, bounds, rank, size, segment_bytes=segment_bytes)
