"""Starting the ranks and ending them: self-launch under mpiexec, and one exit path for every error.

Self-launch. A command run with `-n N` outside MPI re-executes itself as
`mpiexec -n N <python> -m mpiparallel <the same arguments>`; the N copies find themselves under MPI and run
the command. Whether a process is "under MPI" is read from the variables launchers set (MPICH/Intel MPI's
hydra: PMI_RANK/PMI_SIZE; Open MPI: OMPI_COMM_WORLD_*; PMIx launchers: PMIX_RANK; Slurm's srun:
SLURM_PROCID with SLURM_STEP_NUM_TASKS), so the decision is made before MPI starts. Under MPI, `-n` must equal
the number of ranks the job was started with.

Errors. MPI jobs fail badly by default: one rank that raises and exits leaves the others blocked forever in
their next collective, and a bad option prints the same traceback once per rank. `run_guarded` gives every
failure one of two endings:

- `ConfigError` and click's usage errors are detected identically by every rank (they depend only on the
  arguments and the world size): rank 0 prints the message once, every rank exits with the same status, and
  MPI shuts down normally.
- Any other exception is rank-local: that rank prints one line (its rank, the exception type and message;
  the traceback too with MPIPARALLEL_DEBUG=1) and calls MPI_Abort, which ends every rank at once.
"""

from __future__ import annotations

import os
import shutil
import sys
import traceback
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from types import ModuleType
from typing import NoReturn

import click

from ..errors import ConfigError

RELAUNCHED = "MPIPARALLEL_RELAUNCHED"
"""Set in the environment of relaunched ranks, so an MPI whose launcher sets none of the variables below can
never make the ranks relaunch themselves again."""

_RANK_VARIABLES = ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK")
_LAUNCHER_VARIABLES = (*_RANK_VARIABLES, "PMI_SIZE", "OMPI_COMM_WORLD_SIZE", RELAUNCHED)


def launched_by_mpi(environ: Mapping[str, str] = os.environ) -> bool:
    """True when an MPI launcher (mpiexec, mpirun, srun) started this process as one of several ranks."""
    if any(name in environ for name in _LAUNCHER_VARIABLES):
        return True
    # srun sets SLURM_PROCID in batch scripts too; only a job step of several tasks means "under MPI".
    return "SLURM_PROCID" in environ and int(environ.get("SLURM_STEP_NUM_TASKS", "1")) > 1


def launcher_rank(environ: Mapping[str, str] = os.environ) -> int:
    """This process's rank as told by its launcher, before MPI starts (0 outside a launcher)."""
    for name in (*_RANK_VARIABLES, "SLURM_PROCID"):
        if name in environ:
            return int(environ[name])
    return 0


def find_mpiexec() -> str | None:
    """`mpiexec` on PATH, else the one installed next to this Python (the `mpich` wheel puts it there)."""
    on_path = shutil.which("mpiexec")
    if on_path:
        return on_path
    beside_python = Path(sys.executable).parent / "mpiexec"
    return str(beside_python) if os.access(beside_python, os.X_OK) else None


def relaunch_command(mpiexec: str, ranks: int, argv: Sequence[str]) -> list[str]:
    """The command line that starts `ranks` copies of this program with the same arguments."""
    return [mpiexec, "-n", str(ranks), sys.executable, "-m", "mpiparallel", *argv]


def ensure_world_size(ranks: int | None, argv: Sequence[str]) -> None:
    """Make this command run on `ranks` ranks: relaunch under mpiexec, or check the running job's size.

    `argv` is the command's arguments (without the program name), passed on unchanged to the new ranks.
    Returns only when this process is one of the right number of ranks; `ranks=None` accepts any job.
    """
    if ranks is None:
        return
    if not launched_by_mpi():
        if ranks > 1:
            _relaunch(ranks, argv)
        return
    size = world_size()
    if size != ranks:
        raise ConfigError(f"-n {ranks} asks for {ranks} ranks, but this job was started with {size}; "
                          f"leave out -n under mpiexec/srun, or give the same number")


def _relaunch(ranks: int, argv: Sequence[str]) -> NoReturn:
    mpiexec = find_mpiexec()
    if mpiexec is None:
        raise ConfigError(f"-n {ranks} needs mpiexec to start the ranks, but there is none on PATH or next to "
                          f"{sys.executable}; install one (pip install mpich) or start the ranks yourself")
    command = relaunch_command(mpiexec, ranks, argv)
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(mpiexec, command, {**os.environ, RELAUNCHED: "1"})


_BLAS_THREAD_VARIABLES = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")
_LOCAL_RANK_COUNT_VARIABLES = ("MPI_LOCALNRANKS", "OMPI_COMM_WORLD_LOCAL_SIZE", "SLURM_NTASKS_PER_NODE")


def limit_blas_threads(threads: int | None, environ: dict[str, str] = os.environ) -> int:
    """Give each rank its share of this node's cores for BLAS (call before NumPy is imported).

    Ranks on one node that each start a thread per core fight over the cores and all run slower. Default:
    cores ÷ ranks on this node (from the launcher's variables), at least 1. An explicit `threads` wins; so do
    OMP_NUM_THREADS/OPENBLAS_NUM_THREADS already set by the user. Returns the thread count in effect.
    """
    if threads is None:
        already = next((environ[name] for name in _BLAS_THREAD_VARIABLES if environ.get(name)), None)
        if already is not None:
            return int(already)
        local_ranks = next((int(environ[name]) for name in _LOCAL_RANK_COUNT_VARIABLES if environ.get(name)), 1)
        threads = max(1, len(os.sched_getaffinity(0)) // max(local_ranks, 1))
    for name in _BLAS_THREAD_VARIABLES:
        environ[name] = str(threads)
    return threads


def keep_freed_memory() -> bool:
    """Ask glibc's malloc to keep freed memory for reuse instead of handing it back to the operating system.

    Layers keep no activations between steps: what a microbatch saved is freed when its backward has run, so at
    the end of every step tens of megabytes go back to the allocator at once. By default glibc then returns the
    top of its heap to the system and serves large arrays from fresh mappings, and the next forward pays a page
    fault for every 4 KiB it touches again (measured: 2.5× the faults and 10–25 % of a CPU training step).
    Raising the trim threshold and the mmap threshold (to its 32 MiB ceiling) keeps those pages in the process
    — what the GPU path gets from CuPy's memory pool. Returns False where there is no glibc `mallopt`.
    """
    import ctypes

    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    trim_threshold, mmap_threshold = -1, -3  # M_TRIM_THRESHOLD, M_MMAP_THRESHOLD in <malloc.h>
    return bool(mallopt(mmap_threshold, 32 << 20)) and bool(mallopt(trim_threshold, 1 << 30))


def world_size() -> int:
    """The number of ranks in MPI.COMM_WORLD (starts MPI if it is not running yet)."""
    from mpi4py import MPI

    return MPI.COMM_WORLD.Get_size()


def mpi_library() -> str:
    """The MPI library's name and version: the first line of MPI_Get_library_version (starts MPI)."""
    from mpi4py import MPI

    return " ".join(MPI.Get_library_version().splitlines()[0].split())


def _running_mpi() -> ModuleType | None:
    """mpi4py's MPI module if this process has started MPI and not yet shut it down; None otherwise."""
    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is not None and mpi.Is_initialized() and not mpi.Is_finalized():
        return mpi
    return None


def current_rank() -> int:
    """This process's rank in MPI.COMM_WORLD, without starting MPI just to ask."""
    mpi = _running_mpi()
    return mpi.COMM_WORLD.Get_rank() if mpi is not None else launcher_rank()


def debugging() -> bool:
    """MPIPARALLEL_DEBUG=1 asks for full tracebacks."""
    return os.environ.get("MPIPARALLEL_DEBUG", "0") not in ("", "0")


# -- the one exit path ---------------------------------------------------------------------------------------

def run_guarded(entry: Callable[[], int | None]) -> NoReturn:
    """Run `entry` (a command's body) on this rank and exit with its status, ending the job cleanly on error.

    Usage errors (click's, `ConfigError`) are printed by rank 0 only and every rank exits with their status;
    any other exception is reported by the rank that raised it and aborts every rank (MPI_Abort).
    """
    try:
        status = entry()
    except (click.ClickException, ConfigError) as error:
        _report_usage_error(error)
        sys.exit(error.exit_code)
    except (click.exceptions.Abort, KeyboardInterrupt):
        _abort(130)
    except Exception as error:
        _report_crash(error)
        _abort(1)
    sys.exit(status or 0)


def _report_usage_error(error: click.ClickException | ConfigError) -> None:
    if current_rank() != 0:
        return
    if debugging():
        traceback.print_exc()
    if isinstance(error, click.ClickException):
        error.show()
    else:
        click.echo(f"Error: {error}", err=True)


def _report_crash(error: Exception) -> None:
    if debugging():
        traceback.print_exc()
        hint = ""
    else:
        hint = " (MPIPARALLEL_DEBUG=1 prints the traceback)"
    click.echo(f"mpiparallel: rank {current_rank()} failed: {type(error).__name__}: {error}{hint}", err=True)


def _abort(status: int) -> NoReturn:
    """End every rank now: MPI_Abort if MPI is running, else just this process (its launcher ends the rest)."""
    sys.stdout.flush()
    sys.stderr.flush()
    mpi = _running_mpi()
    if mpi is not None:
        mpi.COMM_WORLD.Abort(status)
    os._exit(status)
