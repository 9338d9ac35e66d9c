"""Mesh checks run on every rank (see mpi_harness)."""

from __future__ import annotations

import numpy as np

import collectives as C
from mpiparallel.mesh import Mesh, MeshShape


def groups(dp=None, tp=1, pp=1, cp=1, ep=1) -> dict:
    """Every axis group of this rank, as the sorted world ranks in it (found by all-gathering world ranks)."""
    mesh = Mesh(C.world(), MeshShape(dp=dp, tp=tp, pp=pp, cp=cp, ep=ep))
    me = np.array([mesh.world.rank], np.int64)
    found = {name: C.all_gather(me, comm).tolist()
             for name, comm in {**mesh.communicators(), "dp_cp": mesh.dp_cp, "expert_dp": mesh.expert_dp}.items()}
    found["coordinates"] = vars(mesh.coordinates)
    found["axis_ranks"] = {name: comm.rank for name, comm in mesh.communicators().items()}
    return found
