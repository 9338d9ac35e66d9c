"""Starting the ranks and ending them: self-launch under mpiexec, and one exit path for every error.

Self-launch. A command run with `-n N` outside MPI starts `mpiexec -n N <python> -m mpiparallel <the same
arguments>` and waits for it, passing its output on; the N copies find themselves under MPI and run the
command. Whether a process is "under MPI" is read from the variables launchers set (MPICH/Intel MPI's
hydra: PMI_RANK/PMI_SIZE; Open MPI: OMPI_COMM_WORLD_*; PMIx launchers: PMIX_RANK; Slurm's srun:
SLURM_PROCID with SLURM_STEP_NUM_TASKS), so the decision is made before MPI starts. Under MPI, `-n` must equal
the number of ranks the job was started with.

A rank that dies without a word (SIGKILL, the out-of-memory killer, a segfault) cannot report itself. MPICH's
mpiexec (hydra) then ends the other ranks at once and prints a banner naming the dead process's PID; the
self-launching parent knows each rank's PID (every rank writes it to a folder the parent names in
MPIPARALLEL_RANK_PIDS) and replaces the banner with one line naming the rank:
`mpiparallel: rank 1 (pid 4242) was lost: killed by signal 9 (SIGKILL); mpiexec ended the other ranks`.

Errors. MPI jobs fail badly by default: one rank that raises and exits leaves the others blocked forever in
their next collective, and a bad option prints the same traceback once per rank. `run_guarded` gives every
failure one of two endings:

- `ConfigError` and click's usage errors are detected identically by every rank (they depend only on the
  arguments and the world size): rank 0 prints the message once, every rank exits with the same status, and
  MPI shuts down normally.
- Any other exception is rank-local: that rank prints one line (its rank, the exception type and message;
  the traceback too with MPIPARALLEL_DEBUG=1) and calls MPI_Abort, which ends every rank at once. An error
  of MPI itself on a surviving rank usually means that another rank died: the line says so.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import traceback
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from types import ModuleType
from typing import BinaryIO, NoReturn

import click

from ..errors import ConfigError

RANK_PIDS = "MPIPARALLEL_RANK_PIDS"
"""Set by the self-launching parent: a folder where each rank writes a file named by its PID holding its rank."""

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
    if launched_by_mpi():
        _register_pid()
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
    sys.stdout.flush()
    sys.stderr.flush()
    with tempfile.TemporaryDirectory(prefix="mpiparallel-ranks-") as pids:
        status = supervise(relaunch_command(mpiexec, ranks, argv), {**os.environ, RELAUNCHED: "1", RANK_PIDS: pids},
                           Path(pids))
    raise SystemExit(status)


def _register_pid() -> None:
    """Under a self-launching parent: tell it which PID this rank has (a file named by the PID)."""
    folder = os.environ.get(RANK_PIDS)
    if folder:
        (Path(folder) / str(os.getpid())).write_text(str(launcher_rank()))


# -- the self-launching parent --------------------------------------------------------------------------------

def supervise(command: Sequence[str], environ: Mapping[str, str], pids: Path) -> int:
    """Run mpiexec, passing its output on, with hydra's banner about a dead process replaced by one line naming
    the rank; return its exit status. Ctrl-C reaches mpiexec (it is in our process group), which ends the ranks;
    a SIGTERM to this process is passed on to it."""
    process = subprocess.Popen(list(command), stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=dict(environ))
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # mpiexec gets it too, and ends the job
    signal.signal(signal.SIGTERM, lambda number, frame: process.send_signal(number))
    relays = [threading.Thread(target=_relay_output, args=(process.stdout, sys.stdout.buffer, pids)),
              threading.Thread(target=_relay, args=(process.stderr, sys.stderr.buffer))]
    for relay in relays:
        relay.start()
    for relay in relays:
        relay.join()
    status = process.wait()
    return status if status >= 0 else 128 - status


def _relay(source: BinaryIO, target: BinaryIO) -> None:
    for line in iter(source.readline, b""):
        target.write(line)
        target.flush()


_BANNER_RULE = re.compile(rb"^={20,}\s*$")
_BANNER_TAIL = (b"YOUR APPLICATION TERMINATED WITH THE EXIT STRING", b"This typically refers to a problem",
                b"Please see the FAQ page")


def _relay_output(source: BinaryIO, target: BinaryIO, pids: Path) -> None:
    """Pass mpiexec's standard output on, with hydra's "BAD TERMINATION" banner (two rules of '=' around its
    lines, then up to three lines about the exit string) turned into `lost_rank_message` on standard error."""
    banner: list[bytes] = []
    for line in iter(source.readline, b""):
        closed = sum(bool(_BANNER_RULE.match(kept)) for kept in banner) >= 2
        if banner and closed and not line.startswith(_BANNER_TAIL):
            _end_banner(banner, target, pids)
            banner = []
        if banner or _BANNER_RULE.match(line):
            banner.append(line)
        else:
            target.write(line)
            target.flush()
    _end_banner(banner, target, pids)


def _end_banner(banner: list[bytes], target: BinaryIO, pids: Path) -> None:
    text = b"".join(banner)
    message = lost_rank_message(text.decode(errors="replace"), pids) if banner else None
    if message is None:
        target.write(text)
        target.flush()
    else:
        print(message, file=sys.stderr, flush=True)


def lost_rank_message(banner: str, pids: Path) -> str | None:
    """One line for hydra's banner about a process that ended badly: which rank it was (from the PIDs the ranks
    registered in `pids`) and how it ended; None if the banner names no PID."""
    pid = re.search(r"PID (\d+)", banner)
    if pid is None:
        return None
    registered = pids / pid.group(1)
    rank = f"rank {registered.read_text().strip()}" if registered.exists() else "a rank"
    exit_string = re.search(r"EXIT STRING: (.+)", banner)
    code = re.search(r"EXIT CODE: (\d+)", banner)
    how = exit_string.group(1).strip() if exit_string else f"exit code {code.group(1) if code else '?'}"
    return f"mpiparallel: {rank} (pid {pid.group(1)}) was lost: {how}; mpiexec ended the other ranks"


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
    click.echo(f"mpiparallel: rank {current_rank()} failed: {_describe(error)}{hint}", err=True)


def _describe(error: Exception) -> str:
    """The exception's type and message; for an error of MPI itself (mpi4py's MPI.Exception, e.g. "See the
    MPI_ERROR field in MPI_Status" when a peer vanished mid-message) also what it most likely means."""
    if type(error).__module__ == "mpi4py.MPI":
        return (f"MPI error: {error} — another rank has most likely died or been killed (the launcher's message "
                f"names it)")
    return f"{type(error).__name__}: {error}"


def _abort(status: int) -> NoReturn:
    """End every rank now: MPI_Abort if MPI is running, else just this process (its launcher ends the rest)."""
    sys.stdout.flush()
    sys.stderr.flush()
    mpi = _running_mpi()
    if mpi is not None:
        mpi.COMM_WORLD.Abort(status)
    os._exit(status)
