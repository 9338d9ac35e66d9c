"""Collective communication written by hand over MPI point-to-point messages.

    from mpi4py import MPI
    from collectives import Communicator, all_reduce
    comm = Communicator(MPI.COMM_WORLD)
    total = all_reduce(x, comm, op="sum", algo="auto")

Algorithms live one family per module (ring, recursive, bruck, pairwise, tree), each a generator of
communication steps with its α-β-γ cost in the docstring; `api` checks arguments and dispatches; `cost_model`
picks an algorithm for algo="auto"; `native` is the MPI library's own collective (algo="mpi"), the reference.
`nccl` runs NVIDIA's NCCL on CuPy arrays with the same meaning, the GPU reference (`from collectives import nccl`;
it imports CuPy only when a communicator is built).
"""

from .api import (
    ALGORITHMS,
    CollectiveMismatchError,
    algorithms,
    all_gather,
    all_gather_async,
    all_reduce,
    all_reduce_async,
    all_to_all,
    all_to_allv,
    broadcast,
    reduce,
    reduce_scatter,
    reduce_scatter_async,
    world,
)
from .blocks import OPS
from .communicator import CollectiveHandle, Communicator, Ledger

__all__ = [
    "ALGORITHMS", "OPS", "CollectiveHandle", "CollectiveMismatchError", "Communicator", "Ledger", "algorithms",
    "all_gather", "all_gather_async", "all_reduce", "all_reduce_async", "all_to_all", "all_to_allv", "broadcast",
    "reduce", "reduce_scatter", "reduce_scatter_async", "world",
]
