"""algo="mpi": the MPI library's own collectives, the reference every hand-written algorithm is checked against.

These call MPI_Allreduce, MPI_Reduce_scatter_block, MPI_Allgather, MPI_Alltoall(v), MPI_Bcast and MPI_Reduce
directly; their traffic is invisible to the byte ledger (the library decides what it sends). "avg" is a sum
followed by one division, as in the hand-written algorithms.

bfloat16 has no MPI datatype. Moving it is moving bytes: the calls above on 16-bit words. Reducing it cannot be
left to MPI, so the reference for a bfloat16 reduction is MPI_Allgather (or MPI_Gather, for reduce) of every
rank's whole array as words, then, on each rank that needs the result, the reduction of the n arrays in float64
in rank order and one rounding to bfloat16 (`backend.round_to_bfloat16`). It shares no code with our algorithms.
float64 keeps 53 significant bits and a bfloat16 value has 8, so the float64 sum is exact while the n values
span fewer than about 45 − log2(n) binades (products: while n ≤ 6, or for the ±1, ±2 factors the checks use),
and then the result is the exact sum correctly rounded — in every case the tests and `verify` check. It costs
n·S bytes received per rank instead of about 2·S, which is fine for a reference.
"""

from __future__ import annotations

import numpy as np

from .arguments import unaliased
from .backend import Array, HostStaging, as_words, like, needs_words, round_to_bfloat16, to_host
from .blocks import finish_average
from .faults import raising_peer_failure
from .mpi import MPI

MPI_OP_NAMES = {"sum": "SUM", "avg": "SUM", "prod": "PROD", "max": "MAX", "min": "MIN"}


def mpi_op(op: str) -> MPI.Op:
    """The API's op -> MPI's reduction operator; "avg" is MPI.SUM, and the caller divides once afterwards."""
    return getattr(MPI, MPI_OP_NAMES[op])


_FLOAT64_UFUNCS = {"sum": np.add, "avg": np.add, "prod": np.multiply, "max": np.maximum, "min": np.minimum}


def _typed(x: Array, staging: HostStaging, incoming: bool) -> Array:
    """The buffer to hand MPI; mpi4py derives the MPI datatype from the array's dtype (bfloat16: 16-bit words)."""
    return as_words(staging.incoming(x) if incoming else staging.outgoing(x))


def _run(call, send: Array, recv: Array, *args) -> None:
    """`call` is the communicator's bound method (so a subclass of the communicator sees every call)."""
    staging = HostStaging()
    call(_typed(send, staging, incoming=False), _typed(recv, staging, incoming=True), *args)
    staging.finish()


def _reduced_in_float64(arrays: np.ndarray, op: str, size: int) -> np.ndarray:
    """The reduction of the rows of `arrays` (one per rank, bfloat16) in float64, rank by rank, rounded once."""
    reduce = _FLOAT64_UFUNCS[op]
    total = arrays[0].astype(np.float64)
    for row in arrays[1:]:
        reduce(total, row.astype(np.float64), out=total)
    if op == "avg":
        total /= size
    return round_to_bfloat16(total)


def _gathered(x: Array, comm: MPI.Comm, root: int | None = None) -> np.ndarray | None:
    """Every rank's `x` as the rows of a host array (on `root` only, when given; else on every rank)."""
    host = np.ascontiguousarray(to_host(x)).reshape(-1)
    rows = np.empty((comm.Get_size(), host.size), host.dtype) if root in (None, comm.Get_rank()) else None
    if root is None:
        comm.Allgather(as_words(host), as_words(rows))
    else:
        comm.Gather(as_words(host), None if rows is None else as_words(rows), root)
    return rows


def _into(out: Array, values: np.ndarray) -> None:
    out[...] = like(out, values)


@raising_peer_failure
def mpi_all_reduce(x: Array, out: Array, comm: MPI.Comm, op: str) -> None:
    if needs_words(x.dtype):
        _into(out, _reduced_in_float64(_gathered(x, comm), op, comm.Get_size()))
        return
    _run(comm.Allreduce, unaliased(x, out), out, mpi_op(op))
    if op == "avg":
        finish_average(out, comm.Get_size())


@raising_peer_failure
def mpi_reduce_scatter(x: Array, out: Array, comm: MPI.Comm, op: str) -> None:
    if needs_words(x.dtype):
        rank, block = comm.Get_rank(), out.size
        mine = _gathered(x, comm)[:, rank * block:(rank + 1) * block]
        _into(out, _reduced_in_float64(mine, op, comm.Get_size()))
        return
    _run(comm.Reduce_scatter_block, x, out, mpi_op(op))
    if op == "avg":
        finish_average(out, comm.Get_size())


@raising_peer_failure
def mpi_all_gather(x: Array, out: Array, comm: MPI.Comm) -> None:
    _run(comm.Allgather, x, out)


@raising_peer_failure
def mpi_all_to_all(x: Array, out: Array, comm: MPI.Comm) -> None:
    _run(comm.Alltoall, x, out)


@raising_peer_failure
def mpi_all_to_allv(x: Array, send_counts: list[int], out: Array, recv_counts: list[int],
                    comm: MPI.Comm) -> None:
    staging = HostStaging()
    comm.Alltoallv([as_words(staging.outgoing(x)), send_counts], [as_words(staging.incoming(out)), recv_counts])
    staging.finish()


@raising_peer_failure
def mpi_broadcast(buf: Array, comm: MPI.Comm, root: int) -> None:
    staging = HostStaging()
    comm.Bcast(_typed(buf, staging, incoming=comm.Get_rank() != root), root)
    staging.finish()


@raising_peer_failure
def mpi_reduce(x: Array, out: Array, comm: MPI.Comm, root: int, op: str) -> None:
    if needs_words(x.dtype):
        rows = _gathered(x, comm, root)
        if rows is not None:
            _into(out, _reduced_in_float64(rows, op, comm.Get_size()))
        return
    _run(comm.Reduce, unaliased(x, out), out, mpi_op(op), root)
    if op == "avg" and comm.Get_rank() == root:
        finish_average(out, comm.Get_size())
