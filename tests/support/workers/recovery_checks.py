"""Rank-side checks of the refill from the survivors' memory (`mpiparallel.checkpoints.survivors`): the pieces of one
mesh moved, over MPI, into the pieces of another, equal to slicing the serial tensors — run under MPICH, no
failure needed (the refill is plain point-to-point)."""

from __future__ import annotations

import numpy as np
from mpi4py import MPI

from collectives import Communicator
from models.parameter import REPLICATED, FlatShard, Sharded
from mpiparallel.checkpoints.sharded import Piece, parts
from mpiparallel.checkpoints.survivors import SurvivorMemory

SHAPES = {"w": (6, 10), "fused": (4, 9), "b": (7,)}
"""A weight cut along its rows, a fused q|k|v weight cut per block along its columns (padded: 3 columns of each
block over 2 ranks), a bias held whole."""


def serial(name: str) -> np.ndarray:
    count = int(np.prod(SHAPES[name]))
    return (np.arange(count, dtype=np.float64) + 1000 * list(SHAPES).index(name)).reshape(SHAPES[name])


def pieces_on(tp: tuple[int, int], segment: tuple[int, int] | None) -> list[Piece]:
    """This rank's pieces on a mesh of tensor parallelism `tp` = (rank, size); with `segment` = (dp rank, dp size)
    the rows' weight is further cut in ZeRO-style flat segments over dp."""
    ranks = {"tp": tp, "dp": segment or (0, 1)}
    found = [Piece("fused", SHAPES["fused"], {"tp": Sharded(1, 3)}, ranks), Piece("b", SHAPES["b"],
                                                                                 {"tp": REPLICATED}, ranks)]
    rows = Piece("w", SHAPES["w"], {"tp": Sharded(0)}, ranks)
    if segment is not None:
        count = int(np.prod(rows.local_shape))
        start, stop = count * segment[0] // segment[1], count * (segment[0] + 1) // segment[1]
        rows = Piece("w", SHAPES["w"], {"tp": Sharded(0), "dp": FlatShard(start, stop)}, ranks, start, stop)
    return [rows, *found]


def values_of(piece: Piece) -> np.ndarray:
    """The piece's flat data sliced from the serial tensor (padding zero)."""
    start, stop = piece.bounds
    flat = np.zeros(stop - start)
    for part in parts(piece):
        part.view(flat)[...] = serial(piece.name)[tuple(slice(o, o + n) for o, n in zip(part.offsets, part.sizes,
                                                                                          strict=True))]
    return flat


def refill_from_another_mesh(holding: list[int], zero: bool) -> dict:
    """The ranks in `holding` hold the pieces of a dp 2 × tp 2 mesh (world rank = dp·2 + tp; with `zero` the rows'
    weight in ZeRO segments over dp, else whole on both DP ranks); the others hold nothing. Every rank then fills
    its pieces of a tp 4 mesh. Returns whether the memory was complete and, if so, whether each filled piece
    equals the serial slice, and the bytes received."""
    world = Communicator(MPI.COMM_WORLD)
    dp, tp = divmod(world.rank, 2)
    old = pieces_on((tp, 2), (dp, 2) if zero else None)
    held = [(piece, values_of(piece)) for piece in old] if world.rank in holding else []
    memory = SurvivorMemory(world, held)
    if not memory.complete:
        return {"complete": False, "missing": memory.missing}
    needed = [(piece, np.full(piece.bounds[1] - piece.bounds[0], -1.0)) for piece in pieces_on((world.rank, 4),
                                                                                                None)]
    memory.fill(needed)
    return {"complete": True, "equal": all(np.array_equal(array, values_of(piece)) for piece, array in needed),
            "received": memory.received_bytes}
