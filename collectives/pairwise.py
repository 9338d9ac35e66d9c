"""Pairwise-exchange all-to-all and all-to-allv.

In round k = 1 … n−1 rank r sends its block for rank r+k and receives the block from rank r−k: n−1 rounds
of one message each way, every byte sent exactly once.
    (n−1)·α + (n−1)/n·S·β          (S = bytes each rank sends in all)
All-to-allv is the same exchange with per-destination row counts; the counts travel first (a small
all-to-all), so each rank can size its receive buffer.
"""

from __future__ import annotations

from .backend import Array
from .communicator import Step, Steps


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
