"""Refilling a new mesh from the survivors' memory: a training checkpoint's pieces, moved over MPI instead of read
from files (in-place recovery, `train.recovery`).

Every survivor still holds its part of the committed state: parameters (the master copies), AdamW moments, expert
biases — the same `Piece`s a checkpoint writes (`sharded.parameter_pieces`). A piece is a set of boxes of the
serial tensor (`sharded.parts`), so what each survivor holds is a list of global boxes, and what each rank of the
new mesh needs is another. Three moves:

    1. all-gather the box lists          every rank learns who holds which box (replicas: several holders)
    2. all-to-all of requests            each rank asks, per box it needs, one holder for the intersection:
                                         itself where it holds it (a local copy), else holder rank % copies
    3. point-to-point, each box once     holders send the intersections asked of them; receivers copy them in

`complete` says, before anything moves, whether every element of every tensor has a surviving copy: with plain
data parallelism or hybrid sharding's replicas it has; a ZeRO shard or a tensor-parallel slice whose every copy
was on the lost ranks has not, and the caller reads the newest checkpoint instead. Every rank decides alike from
the all-gathered lists: no extra agreement.

Cost: the box lists (about a hundred bytes a box: at most 2·ndim − 1 per piece), then each rank receives exactly
the elements its new pieces need that it did not hold itself — for a dp run shrunk to a smaller dp, nothing at all
(every survivor is a whole replica); for tp 2 → tp 1, the half of each matrix the other slice held.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from collectives import Communicator
from collectives.backend import Array, like, to_host
from collectives.faults import wait_all

from .sharded import Piece, parts

Box = tuple[str, tuple[int, ...], tuple[int, ...]]
"""(tensor name, offsets, sizes): a box of a serial tensor."""

REFILL_TAG = 7001


class SurvivorMemory:
    """What the ranks of `comm` hold (`held`: this rank's pieces and their data; a spare or a rank that held
    nothing passes none), ready to fill any other pieces from (`fill`, collective over `comm`)."""

    def __init__(self, comm: Communicator, held: Sequence[tuple[Piece, Array]]) -> None:
        self.comm = comm
        self.local: dict[Box, np.ndarray] = {}
        mine: list[tuple[Box, tuple[int, ...], str]] = []
        for piece, array in held:
            flat = to_host(array).reshape(-1)
            for part in parts(piece):
                box = (piece.name, part.offsets, part.sizes)
                if box not in self.local:
                    self.local[box] = part.view(flat)
                    mine.append((box, tuple(piece.shape), str(array.dtype)))
        self.holders: dict[Box, list[int]] = {}
        self.dtypes: dict[Box, np.dtype] = {}
        self.boxes_of: dict[str, list[Box]] = {}
        shapes: dict[str, tuple[int, ...]] = {}
        for rank, boxes in enumerate(comm.allgather_objects(mine)):
            for box, shape, dtype in boxes:
                if box not in self.holders:
                    self.holders[box], self.dtypes[box] = [], np.dtype(dtype)
                    self.boxes_of.setdefault(box[0], []).append(box)
                    shapes[box[0]] = shape
                self.holders[box].append(rank)
        self.missing = sorted(name for name, boxes in self.boxes_of.items()
                              if sum(math.prod(box[2]) for box in boxes) < math.prod(shapes[name]))
        self.received_bytes = 0

    @property
    def complete(self) -> bool:
        """Whether every element of every tensor some survivor held part of has a surviving copy (a tensor no
        survivor held any of is found missing by `fill`)."""
        return not self.missing

    def fill(self, needed: Sequence[tuple[Piece, Array]]) -> None:
        """Copy each needed piece's elements into its array (any array library; padding zero), from the rank that
        holds them. Collective over the communicator: every rank calls it, with nothing needed where it needs
        nothing (a spare), so that it serves what it holds."""
        asks: list[list[tuple[Box, tuple[int, ...], tuple[int, ...]]]] = [[] for _ in range(self.comm.size)]
        into: list[list[np.ndarray]] = [[] for _ in range(self.comm.size)]
        flats = []
        for piece, array in needed:
            start, stop = piece.bounds
            flat = np.zeros(stop - start, array.dtype)
            flats.append((flat, array))
            for part in parts(piece):
                self._ask(piece.name, part.offsets, part.sizes, part.view(flat), asks, into)
        asked = self.comm.alltoall_objects(asks)
        requests, staged, outgoing = [], [], []
        for requester, wanted in enumerate(asked):
            for box, offsets, sizes in wanted:
                source = self.local[box][_within(box, offsets, sizes)]
                if requester == self.comm.rank:
                    staged.append(source)
                else:
                    outgoing.append(np.ascontiguousarray(source))  # held until the sends complete
                    requests.append(self.comm.isend(outgoing[-1], requester, REFILL_TAG))
        incoming = []
        for holder, views in enumerate(into):
            for view, (box, _, sizes) in zip(views, asks[holder], strict=True):
                if holder == self.comm.rank:
                    view[...] = staged.pop(0)
                else:
                    buffer = np.empty(sizes, self.dtypes[box])
                    requests.append(self.comm.irecv(buffer, holder, REFILL_TAG))
                    incoming.append((view, buffer))
        wait_all(requests)
        for view, buffer in incoming:
            view[...] = buffer
            self.received_bytes += buffer.nbytes
        for flat, array in flats:
            array[...] = like(array, flat.reshape(array.shape))

    def _ask(self, name: str, offsets: tuple[int, ...], sizes: tuple[int, ...], target: np.ndarray,
             asks: list[list[Any]], into: list[list[np.ndarray]]) -> None:
        """Ask, for every held box of `name` that meets the box at `offsets` of `sizes`, one holder for the
        intersection, to land in `target` (that box's view of the needed piece)."""
        covered = 0
        for box in self.boxes_of.get(name, []):
            lows = [max(a, b) for a, b in zip(offsets, box[1], strict=True)]
            highs = [min(a + n, b + m) for a, n, b, m in zip(offsets, sizes, box[1], box[2], strict=True)]
            if any(lo >= hi for lo, hi in zip(lows, highs, strict=True)):
                continue
            holders = self.holders[box]
            holder = self.comm.rank if self.comm.rank in holders else holders[self.comm.rank % len(holders)]
            asks[holder].append((box, tuple(lows), tuple(hi - lo for lo, hi in zip(lows, highs, strict=True))))
            into[holder].append(target[tuple(slice(lo - o, hi - o) for lo, hi, o in zip(lows, highs, offsets,
                                                                                      strict=True))])
            covered += math.prod(hi - lo for lo, hi in zip(lows, highs, strict=True))
        if covered != math.prod(sizes):
            raise RuntimeError(f"no survivor holds all of {name}'s box at {list(offsets)} of {list(sizes)}: "
                               f"check `complete` before filling")


def _within(box: Box, offsets: Sequence[int], sizes: Sequence[int]) -> tuple[slice, ...]:
    """The slice of `box`'s data that is the global box at `offsets` of `sizes` (inside it)."""
    return tuple(slice(o - b, o - b + n) for o, n, b in zip(offsets, sizes, box[1], strict=True))
