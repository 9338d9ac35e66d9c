"""Ranks that hang on purpose, for the flight recorder's tests (tests/runtime/test_flight_recorder.py).

    mpiexec -n N python hang_program.py SCENARIO FOLDER

Every rank writes its flight recorder into FOLDER on SIGUSR2, as a rank of `mpiparallel` does, and touches
FOLDER/ready-K once it has made its first calls. Scenarios:

- skip: rank 2 skips the world's all_reduce #3 and goes into an all_reduce on a communicator of ranks 1 and 2,
  where rank 1 never comes: every rank waits for good.
- mismatch: rank 1's all_reduce #2 has twice the elements of rank 0's (the same algorithm): rank 0 fails on the
  message that is too long for it (it dumps, then waits before aborting), rank 1 waits in the next step.
- unreceived: rank 0 sends rank 1 a message (as a pipeline stage does) that rank 1 never receives: it waits in
  the world's next all_reduce for rank 0, which waits for the receive.
- loop: all_reduces in a loop for a minute (the test stops one rank with SIGSTOP).
"""

import os
import sys
import time
from pathlib import Path

import numpy as np
from mpi4py import MPI

from collectives import Communicator, all_reduce, flight


def main() -> None:
    scenario, folder = sys.argv[1], Path(sys.argv[2])
    world = Communicator(MPI.COMM_WORLD)
    world.label = "world"
    flight.dump_folder = folder
    flight.dump_on_signal(world.rank)
    pair = world.split(1 if world.rank in (1, 2) else 0, world.rank, label="pair")
    ones = np.ones(1000)
    try:
        SCENARIOS[scenario](world, pair, ones, folder)
    except Exception as error:  # as `run_guarded` does: dump, give the others time, then abort
        flight.dump(world.rank, f"error: {type(error).__name__}: {error}")
        time.sleep(30)
        MPI.COMM_WORLD.Abort(1)


def _ready(world: Communicator, folder: Path) -> None:
    (folder / f"ready-{world.rank}").touch()


def _skip(world: Communicator, pair: Communicator, ones: np.ndarray, folder: Path) -> None:
    for _ in range(3):
        all_reduce(ones, world, algo="ring")
    _ready(world, folder)
    if world.rank == 2:
        all_reduce(ones, pair, algo="ring")  # rank 1 is in the world's #3, waiting for this rank
    all_reduce(ones, world, algo="ring")


def _mismatch(world: Communicator, pair: Communicator, ones: np.ndarray, folder: Path) -> None:
    for _ in range(2):
        all_reduce(ones, world, algo="ring")
    _ready(world, folder)
    all_reduce(np.ones(2000) if world.rank == 1 else ones, world, algo="ring")
    time.sleep(60)


def _unreceived(world: Communicator, pair: Communicator, ones: np.ndarray, folder: Path) -> None:
    for _ in range(2):
        all_reduce(ones, world, algo="ring")
    _ready(world, folder)
    if world.rank == 0:  # as a pipeline stage sends its activations: 2 MB, more than any eager limit
        world.post_send(np.ones(1 << 18), 1, tag=7).wait()
    all_reduce(ones, world, algo="ring")  # rank 1 waits here for rank 0, which waits for its receive


def _loop(world: Communicator, pair: Communicator, ones: np.ndarray, folder: Path) -> None:
    started = time.time()
    while time.time() - started < 60:
        all_reduce(ones, world, algo="ring")
        if not os.path.exists(folder / f"ready-{world.rank}"):
            _ready(world, folder)


SCENARIOS = {"skip": _skip, "mismatch": _mismatch, "unreceived": _unreceived, "loop": _loop}

if __name__ == "__main__":
    main()
