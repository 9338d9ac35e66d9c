"""algo="mpi": the MPI library's own collectives, the reference every hand-written algorithm is checked against.

These call MPI_Allreduce, MPI_Reduce_scatter_block, MPI_Allgather, MPI_Alltoall(v), MPI_Bcast and MPI_Reduce
directly; their traffic is invisible to the byte ledger (the library decides what it sends). "avg" is a sum
followed by one division, as in the hand-written algorithms.
"""

from __future__ import annotations

from mpi4py import MPI

from .arguments import unaliased
from .backend import Array, HostStaging
from .blocks import finish_average

MPI_OPS = {"sum": MPI.SUM, "avg": MPI.SUM, "prod": MPI.PROD, "max": MPI.MAX, "min": MPI.MIN}
"""The API's op -> MPI's reduction operator; "avg" is MPI.SUM, and the caller divides once afterwards."""


def _typed(x: Array, staging: HostStaging, incoming: bool) -> Array:
    """The buffer to hand MPI; mpi4py derives the MPI datatype from the array's dtype."""
    return staging.incoming(x) if incoming else staging.outgoing(x)


def _run(call, send: Array, recv: Array, *args) -> None:
    """`call` is the communicator's bound method (so a subclass of the communicator sees every call)."""
    staging = HostStaging()
    call(_typed(send, staging, incoming=False), _typed(recv, staging, incoming=True), *args)
    staging.finish()


def mpi_all_reduce(x: Array, out: Array, comm: MPI.Comm, op: str) -> None:
    _run(comm.Allreduce, unaliased(x, out), out, MPI_OPS[op])
    if op == "avg":
        finish_average(out, comm.Get_size())


def mpi_reduce_scatter(x: Array, out: Array, comm: MPI.Comm, op: str) -> None:
    _run(comm.Reduce_scatter_block, x, out, MPI_OPS[op])
    if op == "avg":
        finish_average(out, comm.Get_size())


def mpi_all_gather(x: Array, out: Array, comm: MPI.Comm) -> None:
    _run(comm.Allgather, x, out)


def mpi_all_to_all(x: Array, out: Array, comm: MPI.Comm) -> None:
    _run(comm.Alltoall, x, out)


def mpi_all_to_allv(x: Array, send_counts: list[int], out: Array, recv_counts: list[int],
                    comm: MPI.Comm) -> None:
    staging = HostStaging()
    comm.Alltoallv([staging.outgoing(x), send_counts], [staging.incoming(out), recv_counts])
    staging.finish()


def mpi_broadcast(buf: Array, comm: MPI.Comm, root: int) -> None:
    staging = HostStaging()
    comm.Bcast(_typed(buf, staging, incoming=comm.Get_rank() != root), root)
    staging.finish()


def mpi_reduce(x: Array, out: Array, comm: MPI.Comm, root: int, op: str) -> None:
    _run(comm.Reduce, unaliased(x, out), out, MPI_OPS[op], root)
    if op == "avg" and comm.Get_rank() == root:
        finish_average(out, comm.Get_size())
