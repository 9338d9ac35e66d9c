"""What a process sets for itself before it computes: BLAS threads per rank and the allocator's memory
handling. Used by the commands (`train`, `generate`, `plan`) and by the planner's calibration, which must measure
what training runs with."""

from __future__ import annotations

import os

_BLAS_THREAD_VARIABLES = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")
_LOCAL_RANK_COUNT_VARIABLES = ("MPI_LOCALNRANKS", "OMPI_COMM_WORLD_LOCAL_SIZE")
"""What the launchers say of a node's ranks: MPICH's hydra, Open MPI's mpirun. Slurm's srun says it its own way
(`slurm_tasks_on_this_node`)."""


def slurm_tasks_on_this_node(environ: dict[str, str] = os.environ) -> int | None:
    """The tasks an srun step runs on this node, from SLURM_STEP_TASKS_PER_NODE — `2(x2)`, `3,1` or `4`, the
    count per node of the step, compressed — which srun gives every task of a step (the batch shell has no step,
    so a single process there is not counted as one of many); else SLURM_NTASKS_PER_NODE, what the allocation
    asked for. A step whose nodes run different counts gives the largest (fewer threads rather than a fight).
    None outside Slurm. srun sets neither MPI_LOCALNRANKS nor OMPI_COMM_WORLD_LOCAL_SIZE: without this, every
    rank of `srun -N 2 -n 4` ran one BLAS thread per core (869 ms a step instead of 45, measured)."""
    counts = environ.get("SLURM_STEP_TASKS_PER_NODE", "")
    if counts:
        return max(int(item.split("(")[0]) for item in counts.split(","))
    if environ.get("SLURM_NTASKS_PER_NODE"):
        return int(environ["SLURM_NTASKS_PER_NODE"])
    return None


def local_rank_count(environ: dict[str, str] = os.environ) -> int:
    """How many ranks share this node, from the launcher's variables (1 when none says)."""
    told = next((int(environ[name]) for name in _LOCAL_RANK_COUNT_VARIABLES if environ.get(name)), None)
    return told or slurm_tasks_on_this_node(environ) or 1


def default_blas_threads(cores: int, local_ranks: int, load: float) -> int:
    """BLAS threads per rank: each rank's share of the cores that other work leaves free, at least 1.

    OpenBLAS threads spin while they wait for each other; on cores that other processes also want, a rank's
    threads wait for the slowest of them at every product. Measured on a 2-core machine whose load average was
    17–21 (other jobs running): one rank, the default model, the step time of steps 2–10 with 2 threads 2.6× and
    4.0× that with 1 in two rounds (49.2 s against 18.8 s, 43.0 s against 10.9 s). So the cores the 1-minute load
    average keeps busy (its whole part) are not counted: an idle node gives cores ÷ ranks as before, a busy one
    fewer threads, never a fight."""
    free = max(cores - int(load), 1)
    return max(1, min(cores, free) // max(local_ranks, 1))


def limit_blas_threads(threads: int | None, environ: dict[str, str] = os.environ, load: float | None = None) -> int:
    """Give each rank its BLAS threads (call before NumPy is imported): an explicit `threads`, else
    OMP_NUM_THREADS/OPENBLAS_NUM_THREADS already set by the user, else `default_blas_threads` of this node's
    cores, its ranks (from the launcher's variables) and its load (`load`, default the 1-minute load average).
    Returns the thread count in effect."""
    if threads is None:
        already = next((environ[name] for name in _BLAS_THREAD_VARIABLES if environ.get(name)), None)
        if already is not None:
            return int(already)
        local_ranks = local_rank_count(environ)
        load = os.getloadavg()[0] if load is None else load
        threads = default_blas_threads(len(os.sched_getaffinity(0)), local_ranks, load)
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
