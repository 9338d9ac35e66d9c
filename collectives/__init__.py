"""Collective communication written by hand over MPI point-to-point messages.

    from mpi4py import MPI
    from collectives import Communicator, all_reduce
    comm = Communicator(MPI.COMM_WORLD)
    total = all_reduce(x, comm, op="sum", algo="auto")

Algorithms live one family per module (ring, recursive, bruck, pairwise, tree), each a generator of
communication steps with its α-β-γ cost in the docstring; `api` checks arguments and dispatches; `cost_model`
picks an algorithm for algo="auto"; `native` is the MPI library's own collective (algo="mpi"), the reference.
`nccl` runs NVIDIA's NCCL on CuPy arrays with the same meaning, the GPU reference (`from collectives import nccl`;
it imports CuPy only when a communicator is built). `faults`: under an MPI with ULFM, a failed peer makes every
survivor's collective raise `PeerFailure` instead of waiting.
"""

from typing import Any

_NAMES = {
    "api": ("ALGORITHMS", "CollectiveMismatchError", "Message", "algorithms", "all_gather", "all_gather_async",
            "all_reduce", "all_reduce_async", "all_to_all", "all_to_allv", "broadcast", "check_messages", "reduce",
            "reduce_scatter", "reduce_scatter_async", "world"),
    "blocks": ("OPS",),
    "communicator": ("CollectiveHandle", "Communicator", "Ledger"),
    "faults": ("PeerFailure",),
}
_MODULE_OF = {name: module for module, names in _NAMES.items() for name in names}

__all__ = sorted(_MODULE_OF)


def __getattr__(name: str) -> Any:
    """The public names, imported from their modules on first use: importing the package alone (or a light module
    of it, `collectives.flight`) loads neither NumPy nor MPI, so a process can set its BLAS threads after it."""
    from importlib import import_module

    module = _MODULE_OF.get(name)
    if module is None:  # a submodule, as `import collectives.backend` would have made it an attribute
        try:
            return import_module(f".{name}", __name__)
        except ModuleNotFoundError:
            raise AttributeError(f"module 'collectives' has no attribute {name!r}") from None
    value = getattr(import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value
