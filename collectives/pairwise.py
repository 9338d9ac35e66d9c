"""Pairwise exchange: all-to-all, all-to-allv, and the reductions that round once (reduce-scatter, all-reduce).

In round k = 1 … n−1 rank r sends its block for rank r+k and receives the block from rank r−k: n−1 rounds
of one message each way, every byte sent exactly once.
    all-to-all       (n−1)·α + (n−1)/n·S·β          (S = bytes each rank sends in all)
All-to-allv is the same exchange with per-destination row counts; the counts travel first (a small
all-to-all), so each rank can size its receive buffer.

Reductions that round once. In a ring (or tree, or halving) reduction the partial sums travel, so in a 16-bit
float they are rounded at every hop: after n−1 hops an element carries up to n−1 roundings of 2^-8 (bfloat16)
of its partial sums. The pairwise reduce-scatter sends the *inputs* instead: rank r receives the n−1 other
ranks' copies of its own block r (an all-to-all of the blocks), adds all n of them in the accumulation dtype
(`backend.accumulation_dtype`: float32 for bfloat16 and float16) in rank order 0, 1, …, n−1, divides there
for "avg", and rounds once into the result. Every element is reduced on one rank only, so the result is the
same function of the inputs on every rank:

    result[i] = round(((x_0[i] + x_1[i]) + x_2[i]) + … + x_{n−1}[i])      (+ in float32, one final rounding)

The all-reduce follows it with the ring all-gather of the rounded blocks. The bytes are the ring's — the
all-to-all of blocks sends (n−1)/n·S, like the ring's reduce-scatter — and so are the message counts:
    reduce-scatter   (n−1)·α + (n−1)/n·S·β + (n−1)/n·S·γ' + S/n·γ'
    all-reduce       2(n−1)·α + 2(n−1)/n·S·β + (n−1)/n·S·γ' + S/n·γ'
where γ' is the cost per byte of adding a 16-bit block into a float32 accumulator (and S/n·γ' the final
rounding) — on NumPy less than the ring's γ for bfloat16, whose bfloat16 + bfloat16 loop (ml_dtypes) converts
element by element: 4 Mi elements took 1.4 ms into a float32 accumulator against 13 ms bfloat16 + bfloat16
(one 2-core machine under load, best of 5) — and each rank holds the n−1 received blocks at once: (n−1)/n·S
bytes of scratch (the ring holds one segment). For float32 and wider, or integers, the same algorithm is a
rank-order reduction with no extra precision. algo="auto" runs it for sums and averages of 16-bit floats
(`cost_model.precision_choice`).

Error of a bfloat16 sum (u = 2^-8, bfloat16's unit roundoff; u32 = 2^-24; s = Σ x_j exactly; A = Σ |x_j|):
    round once:    |result − s| ≤ u·|s| + (1 + u)·γ32(n−1)·A ≤ (u + 1.01·(n−1)·u32)·A  γ32(k) = k·u32 / (1 − k·u32)
    ring:          |result − s| ≤ γ16(n−1)·A ≈ (n−1)·u·A                              γ16(k) = k·u / (1 − k·u)
(the float32 sum of n terms, then one rounding to bfloat16; against a rounding of each of n−1 partial sums,
Higham's bound for recursive summation; the trees and recursive halving round as often).
Both assume no overflow and no underflow below bfloat16's smallest normal, 2^-126. Measured on gradient-like
data (`mpiexec -n N python tests/support/workers/precision_checks.py`: 2^18 elements per rank in 8 groups of
magnitudes 1e-6 … 1e1, each rank's values a shared normal component plus its own; |error| / A, max and mean;
float32 is the float32 ring on the same draws rounded to float32 instead of bfloat16):

    ranks   bf16 ring            round once           float32 ring         bounds: ring, round once, float32
      2     3.89e-3 / 1.12e-3    3.89e-3 / 1.12e-3    5.96e-8 / 1.72e-8    3.92e-3, 3.91e-3, 5.96e-8
      4     9.42e-3 / 1.51e-3    3.89e-3 / 1.02e-3    1.49e-7 / 2.31e-8    1.19e-2, 3.91e-3, 1.79e-7
      8     1.48e-2 / 1.80e-3    3.89e-3 / 9.54e-4    2.03e-7 / 2.76e-8    2.81e-2, 3.91e-3, 4.17e-7

On two ranks the ring adds each element once as well; from four on its worst case grows with n, the round-once
one stays one rounding (its mean falls as the ranks' noise cancels in s while A grows).
"""

from __future__ import annotations

from .backend import Array, accumulation_dtype, get_array_module
from .blocks import Reducer, even_bounds, exchange_in_segments, finish_average, segment_count
from .communicator import DEFAULT_SEGMENT_BYTES, Step, Steps
from .ring import ring_all_gather_phase
from .scratch import scratch


def pairwise_all_to_all(x: Array, out: Array, rank: int, size: int) -> Steps:
    """All-to-all of flat `x` (size equal blocks, block j for rank j) into flat `out` (ordered by source)."""
    block = len(x) // size
    out[rank * block:(rank + 1) * block] = x[rank * block:(rank + 1) * block]
    for k in range(1, size):
        dest, source = (rank + k) % size, (rank - k) % size
        yield Step(send=x[dest * block:(dest + 1) * block], dest=dest,
                   recv=out[source * block:(source + 1) * block], source=source)


def pairwise_all_to_allv(x: Array, send_offsets: list[int], out: Array, recv_offsets: list[int],
                         rank: int, size: int) -> Steps:
    """All-to-allv of flat `x`: x[send_offsets[j]:send_offsets[j+1]] goes to rank j; rank i's data lands at
    out[recv_offsets[i]:recv_offsets[i+1]]."""
    out[recv_offsets[rank]:recv_offsets[rank + 1]] = x[send_offsets[rank]:send_offsets[rank + 1]]
    for k in range(1, size):
        dest, source = (rank + k) % size, (rank - k) % size
        yield Step(send=x[send_offsets[dest]:send_offsets[dest + 1]], dest=dest,
                   recv=out[recv_offsets[source]:recv_offsets[source + 1]], source=source)


def pairwise_reduce_scatter_phase(x: Array, result: Array, bounds: list[int], rank: int, size: int,
                                  reduce: Reducer, average_over: int, segment_bytes: int) -> Steps:
    """Block `rank` of flat `x` (blocks `bounds`) reduced over all ranks into `result`, rounded once.

    Every rank's copy of the block arrives whole before any addition, so they are added in rank order; the
    accumulator has the accumulation dtype, and `result` (which may alias x's block) is written once at the end.
    """
    mine = x[bounds[rank]:bounds[rank + 1]]
    length = len(mine)
    segments = segment_count(bounds[1] - bounds[0], x.itemsize, segment_bytes)  # the first block is the largest
    with scratch(x, (size - 1) * length) as arrived:

        def copy_of(source: int) -> Array:  # slot of rank `source`'s copy of block `rank` (own copy: x itself)
            if source == rank:
                return mine
            slot = source if source < rank else source - 1
            return arrived[slot * length:(slot + 1) * length]

        for k in range(1, size):
            dest, source = (rank + k) % size, (rank - k) % size
            yield from exchange_in_segments(x[bounds[dest]:bounds[dest + 1]], dest, copy_of(source), source,
                                            segments)
        total = get_array_module(x).empty(length, accumulation_dtype(x.dtype))
        total[...] = copy_of(0)
        for source in range(1, size):
            reduce(total, copy_of(source), total)
        if average_over:
            finish_average(total, average_over)
        result[...] = total  # the one rounding


def pairwise_reduce_scatter(x: Array, out: Array, rank: int, size: int, reduce: Reducer, average_over: int = 0,
                            segment_bytes: int = DEFAULT_SEGMENT_BYTES) -> Steps:
    """Reduce-scatter of flat `x` (length divisible by size) into `out`, this rank's block, rounded once.

    `average_over` (the rank count, for op="avg") divides the accumulated sum before its rounding.
    """
    bounds = even_bounds(len(x), size)
    yield from pairwise_reduce_scatter_phase(x, out, bounds, rank, size, reduce, average_over, segment_bytes)


def pairwise_all_reduce(x: Array, out: Array, rank: int, size: int, reduce: Reducer, average_over: int = 0,
                        segment_bytes: int = DEFAULT_SEGMENT_BYTES) -> Steps:
    """All-reduce of flat `x` into flat `out` (which may be `x`): the pairwise reduce-scatter of x's n blocks,
    each rounded once, then the ring all-gather of the rounded blocks."""
    bounds = even_bounds(len(x), size)
    yield from pairwise_reduce_scatter_phase(x, out[bounds[rank]:bounds[rank + 1]], bounds, rank, size, reduce,
                                             average_over, segment_bytes)
    yield from ring_all_gather_phase(out, bounds, rank, size, segment_bytes=segment_bytes)
