"""Settings every test shares, and where the tests are.

The tests are grouped by the floor they check: `collectives/` (the communicator, the algorithms, the backend and
its CuPy double, NCCL), `models/` (layers and their backward, the families against transformers, kernels, FP8,
the tensor- and context-parallel layers), `runtime/` (mesh, data, DP/PP engines, schedules, training,
checkpoints, planner, traces, clusters) and `cli/` (the command line, its help examples, the docs' commands,
the scripts). What they share is the `support/` folder, on the path of every test and every rank it starts:
`mpi_harness` (run code on N ranks with a timeout), `mpi_worker`, `workers/` (the rank-side checks),
`fake_cupy` / `fake_nccl` (the GPU doubles), `real_cupy`, `gradient_checks`, `commands`, `interop`, `optional`.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent / "support"))

from processes import kill_leftover_jobs, segments_made_since  # noqa: E402

from collectives.flight import FOLDER_VARIABLE as FLIGHT_FOLDER_VARIABLE  # noqa: E402
from mpiparallel.data.prepare import CACHE_VARIABLE  # noqa: E402


@pytest.fixture(scope="session", autouse=True)
def fresh_cache_folder(tmp_path_factory: pytest.TempPathFactory) -> None:
    """The runs a test starts (and their ranks) keep prepared data, such as the default corpus's BPE, in one folder
    that starts empty in every test session: the suite does not depend on what a user's cache holds, and the first
    run without --data builds it as a first run on a new machine does."""
    os.environ[CACHE_VARIABLE] = str(tmp_path_factory.mktemp("cache"))


@pytest.fixture(scope="session", autouse=True)
def flight_records_outside_the_checkout(tmp_path_factory: pytest.TempPathFactory) -> None:
    """Ranks write their flight recorders into the working directory by default (on an error, a stall, SIGUSR2);
    the tests that end jobs that way must not leave them in the checkout: the runs they start write here."""
    os.environ[FLIGHT_FOLDER_VARIABLE] = str(tmp_path_factory.mktemp("flight"))


@pytest.fixture(autouse=True)
def no_job_outlives_its_test():
    """A job a test started with `processes.start_job` and left running (a failed assertion) is killed here."""
    yield
    kill_leftover_jobs()


@pytest.fixture(scope="session", autouse=True)
def no_shared_memory_left_behind():
    """The shared-memory files that ranks killed by the tests left in /dev/shm (`processes.LEFT_SEGMENTS`) are
    removed when the session ends: only those made during it that no process holds."""
    started = time.time()
    yield
    for path in segments_made_since(started):
        path.unlink(missing_ok=True)
