"""Rooted collectives: broadcast and reduce.

- Binomial-tree broadcast: in round k every rank that already has the data sends it 2^k ranks further
  (ranks counted relative to the root), so ⌈log2 n⌉ rounds reach everyone.
      ⌈log2 n⌉·(α + S·β)
- Scatter + all-gather broadcast (van de Geijn): a binomial scatter hands each rank 1/n of the message, then a
  ring all-gather completes it everywhere. Every link carries ≈ 2·S instead of log2(n)·S: for large messages.
      (⌈log2 n⌉ + n−1)·α + 2(n−1)/n·S·β
- Binomial-tree reduce: the broadcast tree run backwards, each parent reducing its children's partial results.
      ⌈log2 n⌉·(α + S·β + S·γ)
- Rabenseifner reduce: recursive-halving reduce-scatter, then every rank sends its reduced piece to the root.
      (log2 p + p−1)·α + 2(p−1)/p·S·β + (p−1)/p·S·γ      (plus the fold when n ≠ p = 2^⌊log2 n⌋)
"""

from __future__ import annotations

from .backend import Array
from .blocks import Reducer, even_bounds
from .communicator import DEFAULT_SEGMENT_BYTES, Step, Steps
from .recursive import PowerOfTwoFold, fold_in, recursive_halving
from .ring import ring_all_gather_phase
from .scratch import scratch


def _parent_mask(relative: int, size: int) -> int:
    """Lowest set bit of `relative` (its distance to its parent in the binomial tree); for the root the first
    power of two ≥ size."""
    return relative & -relative if relative else 1 << (size - 1).bit_length()


def _relabel(steps: Steps, root: int, size: int) -> Steps:
    """Translate an algorithm written for ranks relative to `root` into real ranks."""
    for step in steps:
        yield Step(step.send, (step.dest + root) % size, step.recv, (step.source + root) % size)


def binomial_broadcast(buf: Array, rank: int, size: int, root: int) -> Steps:
    """Broadcast `buf` from `root` (ranks other than root receive into `buf`)."""
    relative = (rank - root) % size
    mask = _parent_mask(relative, size)
    if relative:
        yield Step(recv=buf, source=(rank - mask) % size)
    mask >>= 1
    while mask:
        if relative + mask < size:
            yield Step(send=buf, dest=(rank + mask) % size)
        mask >>= 1


def scatter_allgather_broadcast(buf: Array, rank: int, size: int, root: int,
                                segment_bytes: int = DEFAULT_SEGMENT_BYTES) -> Steps:
    """Broadcast as a binomial scatter of n pieces followed by a ring all-gather of the pieces."""
    relative = (rank - root) % size
    bounds = even_bounds(len(buf), size)  # piece j belongs to relative rank j

    def pieces(first: int, count: int) -> Array:
        return buf[bounds[first]:bounds[min(first + count, size)]]

    mask = _parent_mask(relative, size)
    if relative:  # receive the pieces of my whole subtree from my parent
        yield Step(recv=pieces(relative, mask), source=(rank - mask) % size)
    mask >>= 1
    while mask:
        if relative + mask < size:
            yield Step(send=pieces(relative + mask, mask), dest=(rank + mask) % size)
        mask >>= 1
    yield from _relabel(ring_all_gather_phase(buf, bounds, relative, size, segment_bytes=segment_bytes), root, size)


def binomial_reduce(x: Array, out: Array, rank: int, size: int, root: int, reduce: Reducer) -> Steps:
    """Reduce flat `x` onto `root`; `out` is the accumulator (the result on the root).

    A rank's partial result is its own `x` until the first child's arrives, then `out`: a leaf sends `x` as it
    is, without a copy or a receive buffer.
    """
    relative = (rank - root) % size
    partial, mask = x, 1
    while mask < size:
        if relative & mask:
            yield Step(send=partial, dest=(rank - mask) % size)
            return
        if relative + mask < size:
            with scratch(x, len(x)) as arrived:
                yield Step(recv=arrived, source=(rank + mask) % size)
                reduce(partial, arrived, out)
            partial = out
        mask <<= 1


def rabenseifner_reduce(x: Array, out: Array, rank: int, size: int, root: int, reduce: Reducer,
                        segment_bytes: int = DEFAULT_SEGMENT_BYTES) -> Steps:
    """Reduce flat `x` onto `root` by recursive halving, then a direct gather of the p pieces.

    `out` holds the partial results on every rank (off the root it is the caller's scratch space), so the
    root's own piece is already in place and the others land next to it.
    """
    fold = PowerOfTwoFold.of(rank, size)
    bounds = even_bounds(len(x), fold.p)
    yield from fold_in(x, out, fold, reduce)
    if not fold.is_extra:
        yield from recursive_halving(out if fold.has_extra else x, out, bounds, fold, reduce,
                                     segment_bytes=segment_bytes)
        if rank != root:
            yield Step(send=out[bounds[fold.virtual]:bounds[fold.virtual + 1]], dest=root)
    if rank == root:
        for virtual in range(fold.p):
            if fold.real(virtual) != rank:
                yield Step(recv=out[bounds[virtual]:bounds[virtual + 1]], source=fold.real(virtual))
