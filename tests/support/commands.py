"""Running the `mpiparallel` command line from a test, bounded in time."""

from __future__ import annotations

import subprocess
import sys

from mpi_harness import run_with_timeout


def mpiparallel(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    """Run the command line; on timeout kill its whole process group (mpiexec and every rank) and fail."""
    return run_with_timeout([sys.executable, "-m", "mpiparallel", *args], timeout)
