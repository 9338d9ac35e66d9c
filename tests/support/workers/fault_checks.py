"""A peer killed mid-collective under ULFM (see tests/collectives/test_peer_failure.py): every survivor raises
PeerFailure, and the survivors' communicator works."""

from __future__ import annotations

import faulthandler
import os
import signal
import time
from collections.abc import Callable

import numpy as np
from mpi4py import MPI

import collectives as C
from collectives import Communicator, faults
from collectives.faults import PeerFailure

COLLECTIVES: dict[str, Callable[[np.ndarray, Communicator], object]] = {
    "all_reduce ring": lambda x, comm: C.all_reduce(x, comm, algo="ring"),
    "all_reduce recursive_doubling": lambda x, comm: C.all_reduce(x, comm, algo="recursive_doubling"),
    "all_reduce mpi": lambda x, comm: C.all_reduce(x, comm, algo="mpi"),
    "all_gather bruck": lambda x, comm: C.all_gather(x, comm, algo="bruck"),
    "all_to_all pairwise": lambda x, comm: C.all_to_all(x, comm, algo="pairwise"),
    "broadcast binomial": lambda x, comm: C.broadcast(x, comm, algo="binomial"),
    "reduce_scatter ring, asynchronous": lambda x, comm: C.reduce_scatter_async(x, comm, algo="ring").wait(),
}


def survive_a_peer(collective: str, dies: int = 2, at: int = 20) -> dict:
    """Run `collective` over the world and over half of it (even and odd ranks) in turn until rank `dies` kills
    itself at iteration `at`; then shrink the world and check a ring all-reduce on the survivors against MPI's."""
    faulthandler.dump_traceback_later(60, exit=True)  # a rank that hangs says where, and ends
    MPI.COMM_SELF.Set_errhandler(MPI.ERRORS_RETURN)
    world = Communicator(MPI.COMM_WORLD.Dup())
    half = world.split(world.rank % 2, label="half")
    run = COLLECTIVES[collective]
    x = np.arange(12_000, dtype=np.float64) + world.rank
    started, raised = 0.0, None
    for iteration in range(100_000):
        if iteration == at:
            started = time.monotonic()
            if world.rank == dies:
                os.kill(os.getpid(), signal.SIGKILL)
        try:
            run(x, world)
            run(x, half)
        except PeerFailure as failure:
            raised = failure
            break
    if raised is None:
        return {"raised": None}
    after_s = time.monotonic() - started
    survivors = world.shrink()
    y = np.arange(1000, dtype=np.float64) * (world.rank + 1)
    expected = np.empty_like(y)
    survivors.comm.Allreduce(y, expected)
    return {"raised": type(raised).__name__, "message": str(raised), "after_s": after_s, "size": survivors.size,
            "label": survivors.label, "failed": faults.failed_ranks(world.comm),
            "equal": bool(np.array_equal(C.all_reduce(y, survivors, algo="ring"), expected))}


def agree_on_a_half_done_step() -> dict:
    """The step's agreement (`train.recovery.InPlace.commit`) when a step is done on some survivors and not on
    others: rank 3 dies; rank 1, summing with it over {1, 3}, sees the failure; ranks 0 and 2 finish their sum over
    {0, 2} (rank 1 holds no part of that communicator, so nothing revokes it) and reach the commit point. The
    agreement must tell all three that the step is not applied."""
    from mpiparallel.train.recovery import InPlace
    from mpiparallel.train.settings import TrainSettings

    faulthandler.dump_traceback_later(60, exit=True)
    world = Communicator(MPI.COMM_WORLD.Dup())
    recovery = InPlace(world, TrainSettings(), lambda survivors, settings: "unused")
    pair = world.split(world.rank % 2, label="pair")
    x = np.ones(1000)
    C.all_reduce(x, world, algo="ring")
    if world.rank == 3:
        os.kill(os.getpid(), signal.SIGKILL)
    where = "commit"
    try:
        C.all_reduce(x, pair, algo="ring")
        recovery.commit(9)
    except PeerFailure:
        where = "failure" if not recovery.agreed else "commit raised"
        recovery._agree_on_the_failure()  # what `recover` does first (nothing where the commit took part)
    return {"where": where, "applied": recovery.applied, "size": world.shrink().size}
