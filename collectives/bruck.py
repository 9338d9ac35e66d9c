"""Bruck's algorithms: all-gather and all-to-all in ⌈log2 n⌉ rounds for any rank count n.

All-gather: rank r keeps a staging buffer whose slot i holds the block of rank (r+i) mod n. In the round with
distance d = 1, 2, 4, … it sends its first min(d, n−d) slots to rank r−d and appends as many from rank r+d;
a final local rotation puts the blocks in rank order.
    ⌈log2 n⌉·α + (n−1)/n·S·β + S·γ_copy          (S = bytes of the gathered result)

All-to-all: after a local rotation slot i holds the block bound for rank r+i. In the round with distance
d = 2^k, every slot whose index has bit k set travels to rank r+d (packed into one message); after all rounds
slot i holds the block from rank r−i, and an inverse rotation orders them by source.
    ⌈log2 n⌉·α + ⌈log2 n⌉·S/2·β + ⌈log2 n⌉·S·γ_copy   (S = bytes each rank sends in all)
Fewer messages than pairwise exchange (n−1 of them), at the price of sending every block about log2(n)/2
times: the better choice for small blocks on many ranks. (Packing and unpacking a round's slots takes about
as much Python as a step, so auto's cost model counts 2α per round: pairwise wins on 4 ranks, Bruck from 8.)
"""

from __future__ import annotations

import functools

from .backend import Array, get_array_module
from .communicator import Step, Steps


def bruck_all_gather(x: Array, out: Array, rank: int, size: int) -> Steps:
    """All-gather of flat `x` into flat `out` in ⌈log2 size⌉ rounds."""
    block = len(x)
    staged = get_array_module(x).empty_like(out)
    staged[:block] = x
    distance = 1
    while distance < size:
        count = min(distance, size - distance)
        yield Step(send=staged[:count * block], dest=(rank - distance) % size,
                   recv=staged[distance * block:(distance + count) * block], source=(rank + distance) % size)
        distance *= 2
    split = (size - rank) * block  # slot i holds rank (rank + i) % size
    out[rank * block:] = staged[:split]
    out[:rank * block] = staged[split:]


def bruck_all_to_all(x: Array, out: Array, rank: int, size: int) -> Steps:
    """All-to-all of flat `x` (size equal blocks, block j for rank j) into flat `out` (ordered by source)."""
    xp = get_array_module(x)
    blocks = x.reshape(size, -1)
    staged = xp.empty_like(blocks)  # slot i is bound for rank (rank + i) % size
    staged[:size - rank], staged[size - rank:] = blocks[rank:], blocks[:rank]
    distance = 1
    while distance < size:
        runs = _slots_with_bit(distance, size)  # the slots whose index has this round's bit set
        outgoing = staged[runs[0][0]:runs[0][1]] if len(runs) == 1 else xp.concatenate([staged[a:b] for a, b in runs])
        arrived = xp.empty_like(outgoing)
        yield Step(send=outgoing.reshape(-1), dest=(rank + distance) % size,
                   recv=arrived.reshape(-1), source=(rank - distance) % size)
        start = 0
        for lo, hi in runs:
            staged[lo:hi] = arrived[start:start + hi - lo]
            start += hi - lo
        distance *= 2
    by_source = out.reshape(size, -1)  # slot i came from rank (rank - i): sources rank, rank-1, …, 0, size-1, …
    by_source[:rank + 1] = staged[rank::-1]
    by_source[rank + 1:] = staged[:rank:-1]


@functools.lru_cache(maxsize=64)
def _slots_with_bit(distance: int, size: int) -> tuple[tuple[int, int], ...]:
    """The runs [lo, hi) of slot indices below `size` that have bit `distance` set: d slots every 2·d."""
    return tuple((lo, min(lo + distance, size)) for lo in range(distance, size, 2 * distance))
