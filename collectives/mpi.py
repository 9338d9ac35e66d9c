"""mpi4py's `MPI` module, loaded the first time one of its names is used.

The collectives' modules name `MPI` at their top, but only their functions touch it. Loading it late lets code that
only computes — the α-β cost model, and the planner above it — import the collectives, the models and the planner
on a machine with no MPI library (mpi4py's `MPI` fails to import without one). The first use of a name loads
mpi4py and keeps the name on this object, so later uses are plain attribute reads.
"""

from __future__ import annotations

from typing import Any


class _MPIOnFirstUse:
    def __getattr__(self, name: str) -> Any:
        from mpi4py import MPI as module  # noqa: N811 (the module's own name)

        value = getattr(module, name)
        setattr(self, name, value)  # found in the instance from now on: __getattr__ runs once per name
        return value

    def __repr__(self) -> str:
        return "<mpi4py.MPI, loaded on first use>"


MPI: Any = _MPIOnFirstUse()
