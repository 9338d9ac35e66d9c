"""Recursive doubling and halving: all-reduce, reduce-scatter, all-gather and Rabenseifner's all-reduce.

With p = 2^k ranks, rank v talks to v XOR d for d = 1, 2, 4, … (doubling) or p/2, p/4, … (halving), so every
collective finishes in log2(p) rounds instead of the ring's p−1: the algorithms of choice for small messages.

- recursive-doubling all-reduce: each round exchanges the whole vector and reduces it.
      log2(p)·(α + S·β + S·γ)
- recursive-halving reduce-scatter: each round sends the half of the current window the partner keeps and
  reduces the half it receives; after log2(p) rounds each rank holds its own 1/p, fully reduced (in a work
  buffer, out of which it is copied: + S/p·γ).
      log2(p)·α + (p−1)/p·S·β + (p−1)/p·S·γ
- recursive-doubling all-gather: the mirror image, windows doubling.
      log2(p)·α + (p−1)/p·S·β
- Rabenseifner all-reduce = halving reduce-scatter + doubling all-gather: the ring's bandwidth with only
  2·log2(p) latency terms.
      2·log2(p)·α + 2(p−1)/p·S·β + (p−1)/p·S·γ

Any other rank count n is folded onto p = 2^⌊log2 n⌋ "virtual" ranks (`PowerOfTwoFold`): among the first
2·(n−p) ranks each even rank hands its data to the odd rank after it and sits out; the result is handed back at
the end. That costs one extra exchange of the full vector each way (about 2·(α + S·β) + S·γ).
"""

from __future__ import annotations

import functools

from .backend import Array, get_array_module
from .blocks import Reducer, even_bounds, exchange_and_reduce, exchange_in_segments, segment_count
from .communicator import DEFAULT_SEGMENT_BYTES, Step, Steps
from .scratch import scratch


class PowerOfTwoFold:
    """How rank `rank` of `size` maps onto p = 2^⌊log2 size⌋ virtual ranks.

    Ranks below 2·rem (rem = size − p) pair up: the odd one of each pair is virtual rank rank // 2, the even one
    (an *extra* rank) only sends its input in and receives the result back. Ranks from 2·rem on are virtual
    rank rank − rem. Virtual rank v stands for the real ranks `represented(v)`, a contiguous range.
    """

    __slots__ = ("p", "rem", "size", "is_extra", "has_extra", "partner", "virtual")

    def __init__(self, rank: int, size: int) -> None:
        self.p = 1 << (size.bit_length() - 1)
        self.rem = size - self.p
        self.size = size
        self.is_extra = rank < 2 * self.rem and rank % 2 == 0
        self.has_extra = rank < 2 * self.rem and rank % 2 == 1
        self.partner = rank + 1 if self.is_extra else rank - 1  # meaningful for paired ranks only
        self.virtual = None if self.is_extra else (rank // 2 if rank < 2 * self.rem else rank - self.rem)

    @staticmethod
    @functools.lru_cache(maxsize=256)
    def of(rank: int, size: int) -> PowerOfTwoFold:
        """The (immutable) fold for `rank` of `size`, cached: the small-message algorithms ask on every call."""
        return PowerOfTwoFold(rank, size)

    def real(self, virtual: int) -> int:
        return 2 * virtual + 1 if virtual < self.rem else virtual + self.rem

    def first_represented(self, virtual: int) -> int:
        """Lowest real rank that virtual rank `virtual` stands for (p → size, as an end marker)."""
        if virtual >= self.p:
            return self.size
        return 2 * virtual if virtual < self.rem else virtual + self.rem


def _largest_half(bounds: list[int], p: int) -> int:
    """Elements in the larger half of the p segments: the biggest message of a halving/doubling round."""
    return max(bounds[p // 2] - bounds[0], bounds[p] - bounds[p // 2])


def recursive_halving(src: Array, work: Array, bounds: list[int], fold: PowerOfTwoFold, reduce: Reducer, *,
                      segment_bytes: int) -> Steps:
    """Halving reduce-scatter over the p segments `bounds` of `src`; partial results go to `work`.

    Afterwards segment `fold.virtual` of `work` holds the reduction over all virtual ranks. `src` and `work`
    may be the same array; `src` is only read.
    """
    v, half = fold.virtual, _largest_half(bounds, fold.p)
    segments = segment_count(half, src.itemsize, segment_bytes)
    landing = get_array_module(src).empty(-(-half // segments), src.dtype)  # one segment, reused: stays in cache
    lo, hi, distance = 0, fold.p, fold.p // 2
    while distance >= 1:
        mid = lo + distance
        (keep_lo, keep_hi), (give_lo, give_hi) = ((mid, hi), (lo, mid)) if v & distance else ((lo, mid), (mid, hi))
        partner = fold.real(v ^ distance)
        keep = slice(bounds[keep_lo], bounds[keep_hi])
        mine, target, give = src[keep], work[keep], src[bounds[give_lo]:bounds[give_hi]]
        yield from exchange_and_reduce(give, partner, partner, mine, target, landing, segments, reduce)
        src = work
        lo, hi, distance = keep_lo, keep_hi, distance // 2


def recursive_doubling_gather(out: Array, bounds: list[int], fold: PowerOfTwoFold, *, segment_bytes: int) -> Steps:
    """Doubling all-gather over the p segments `bounds` of `out`: segment `fold.virtual` in, all segments out."""
    v, distance = fold.virtual, 1
    segments = segment_count(_largest_half(bounds, fold.p), out.itemsize, segment_bytes)
    while distance < fold.p:
        mine_lo = v & ~(distance - 1)
        theirs_lo = (v ^ distance) & ~(distance - 1)
        partner = fold.real(v ^ distance)
        mine = out[bounds[mine_lo]:bounds[mine_lo + distance]]
        theirs = out[bounds[theirs_lo]:bounds[theirs_lo + distance]]
        if segments == 1:
            yield Step(mine, partner, theirs, partner)
        else:
            yield from exchange_in_segments(mine, partner, theirs, partner, segments)
        distance *= 2


def fold_in(x: Array, work: Array, fold: PowerOfTwoFold, reduce: Reducer) -> Steps:
    """Extra ranks send x to their partner, which reduces it into `work` (= x op partner's x)."""
    if fold.is_extra:
        yield Step(send=x, dest=fold.partner)
    elif fold.has_extra:
        with scratch(x, len(x)) as arrived:
            yield Step(recv=arrived, source=fold.partner)
            reduce(x, arrived, work)


def hand_back(result: Array, fold: PowerOfTwoFold) -> Steps:
    """The virtual rank returns the finished `result` to the extra rank it stood for."""
    if fold.is_extra:
        yield Step(recv=result, source=fold.partner)
    elif fold.has_extra:
        yield Step(send=result, dest=fold.partner)


def recursive_doubling_all_reduce(x: Array, out: Array, rank: int, size: int, reduce: Reducer) -> Steps:
    """All-reduce exchanging the whole vector in each of log2(p) rounds (plus the fold for other n).

    Written flat, without segments or helper generators: it is the small-message algorithm, where every
    microsecond of Python overhead shows. Each round's message lands in one scratch buffer and is reduced into
    `out`, so `out` may be `x` itself.
    """
    fold = PowerOfTwoFold.of(rank, size)
    if fold.is_extra:
        yield Step(send=x, dest=fold.partner)
        yield Step(recv=out, source=fold.partner)
        return
    arrived = get_array_module(x).empty_like(x)
    current = x
    if fold.has_extra:
        yield Step(recv=arrived, source=fold.partner)
        reduce(x, arrived, out)
        current = out
    distance = 1
    while distance < fold.p:
        partner = fold.real(fold.virtual ^ distance)
        yield Step(current, partner, arrived, partner)
        reduce(current, arrived, out)
        current, distance = out, distance * 2
    if fold.has_extra:
        yield Step(send=out, dest=fold.partner)


def rabenseifner_all_reduce(x: Array, out: Array, rank: int, size: int, reduce: Reducer,
                            segment_bytes: int = DEFAULT_SEGMENT_BYTES) -> Steps:
    """All-reduce as recursive-halving reduce-scatter + recursive-doubling all-gather over p segments."""
    fold = PowerOfTwoFold(rank, size)
    if fold.rem:
        yield from fold_in(x, out, fold, reduce)
    if not fold.is_extra:
        bounds = even_bounds(len(x), fold.p)
        yield from recursive_halving(out if fold.has_extra else x, out, bounds, fold, reduce,
                                     segment_bytes=segment_bytes)
        yield from recursive_doubling_gather(out, bounds, fold, segment_bytes=segment_bytes)
    if fold.rem:
        yield from hand_back(out, fold)


def _rank_block_bounds(fold: PowerOfTwoFold, block: int) -> list[int]:
    """Segment bounds when virtual rank v's segment is the blocks of the real ranks it represents."""
    if not fold.rem:
        return range(0, (fold.p + 1) * block, block) if block else [0] * (fold.p + 1)
    return [fold.first_represented(v) * block for v in range(fold.p + 1)]


def recursive_halving_reduce_scatter(x: Array, out: Array, rank: int, size: int, reduce: Reducer,
                                     segment_bytes: int = DEFAULT_SEGMENT_BYTES) -> Steps:
    """Reduce-scatter by recursive halving; `out` receives this rank's block of flat `x`."""
    fold = PowerOfTwoFold.of(rank, size)
    block = len(out)
    if fold.is_extra:
        yield Step(send=x, dest=fold.partner)
        yield Step(recv=out, source=fold.partner)
        return
    with scratch(x, len(x)) as work:
        if fold.has_extra:
            yield from fold_in(x, work, fold, reduce)
        yield from recursive_halving(work if fold.has_extra else x, work, _rank_block_bounds(fold, block), fold,
                                     reduce, segment_bytes=segment_bytes)
        if fold.has_extra:  # this segment holds the extra rank's block first, then this rank's
            yield Step(send=work[(rank - 1) * block:rank * block], dest=fold.partner)
        out[...] = work[rank * block:(rank + 1) * block]


def recursive_doubling_all_gather(x: Array, out: Array, rank: int, size: int,
                                  segment_bytes: int = DEFAULT_SEGMENT_BYTES) -> Steps:
    """All-gather by recursive doubling: log2(p) rounds, windows doubling, plus the fold for other n."""
    fold = PowerOfTwoFold.of(rank, size)
    block = len(x)
    out[rank * block:(rank + 1) * block] = x
    if fold.is_extra:
        yield Step(send=x, dest=fold.partner)
    elif fold.has_extra:
        yield Step(recv=out[fold.partner * block:rank * block], source=fold.partner)
    if not fold.is_extra:
        yield from recursive_doubling_gather(out, _rank_block_bounds(fold, block), fold, segment_bytes=segment_bytes)
    if fold.rem:
        yield from hand_back(out, fold)
