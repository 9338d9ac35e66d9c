"""`mpiparallel verify`: every hand-written algorithm against a reference library, element for element.

For each collective, each hand-written algorithm (`collectives.ALGORITHMS`, "mpi" excluded), each datatype,
each reduction op and, for broadcast and reduce, the first and last rank as root, the command runs a sweep of
counts — 0, 1, small odd counts, counts not divisible by the rank count, up to --max-count — and compares our
result with the reference library's on the same input. Inputs are random integers (each rank draws its own
from a seeded generator), small enough that every sum and product is exact in every datatype, so the two
results must be equal bit for bit: `#wrong` counts differing output elements, plus input elements the call
modified (the API promises not to), summed over ranks. Averages get multiples of the rank count, so that
the average itself is exact, whether a library divides the sum or (as NCCL does for floats) each input.
The integers shrink with the datatype's exact-integer range (2048 for float16, 256 for bfloat16), so that
every partial sum is exact too: the bound holds up to 32 ranks for sums (16 for bfloat16 averages) — a
result rounded differently by two algorithms would otherwise count as wrong.

bfloat16 (`-d bfloat16`) has no MPI datatype: the MPI reference moves it as 16-bit words and reduces it by
gathering every rank's input and adding in float64, one rounding at the end (`collectives.native`).

"count" means: the elements of x for all_reduce, broadcast and reduce; one rank's block for reduce_scatter
and all_to_all (x has count·n elements) and all_gather (x has count); the largest row count a rank sends to
one destination for all_to_allv (rows of two elements, the per-destination counts drawn at random).

References are pluggable: a `Reference` runs the seven collectives with another library. `MPIReference`
calls the MPI library's own collectives (algo="mpi"); `NCCLReference` calls NVIDIA's NCCL through
`collectives.nccl` (CuPy's binding), on the same GPU arrays.

Devices: --device cpu runs on NumPy arrays, --device gpu on CuPy arrays (each rank bound to GPU local rank
mod GPU count), where our collectives still talk through MPI — with device pointers if the MPI library is
CUDA-aware, else through pinned host buffers (the preamble says which). --against nccl implies --device gpu.
Without a usable GPU on some rank, a GPU run stops before it starts with one message naming the reason.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import ml_dtypes
import numpy as np
from mpi4py import MPI

import collectives
from collectives import Communicator, backend, nccl
from collectives.backend import to_host
from collectives.topology import describe_nodes

from ..errors import ConfigError, ExitCode
from ..jobs.launch import mpi_library
from .devices import array_module, use_gpu

Array = Any  # numpy.ndarray, or cupy.ndarray with --device gpu


class Reference:
    """The collectives of a reference library: same meaning as `collectives`, results to trust."""

    name = "reference"

    def describe(self) -> str | None:
        """A line for the report's preamble, or None."""
        return None

    def close(self) -> None:
        """Free what the library holds (called after the last check)."""

    def cannot_run(self, dtype: str) -> str | None:
        """Why this reference has no collectives for `dtype` (None: it has them)."""
        return None

    def all_reduce(self, x: Array, op: str) -> Array:
        raise NotImplementedError

    def reduce_scatter(self, x: Array, op: str) -> Array:
        raise NotImplementedError

    def all_gather(self, x: Array) -> Array:
        raise NotImplementedError

    def all_to_all(self, x: Array) -> Array:
        raise NotImplementedError

    def all_to_allv(self, x: Array, send_counts: Sequence[int]) -> tuple[Array, list[int]]:
        raise NotImplementedError

    def broadcast(self, x: Array, root: int) -> Array:
        raise NotImplementedError

    def reduce(self, x: Array, root: int, op: str) -> Array | None:
        raise NotImplementedError


class MPIReference(Reference):
    """The MPI library's own collectives (MPI_Allreduce, MPI_Reduce_scatter_block, ...), via algo="mpi"."""

    name = "mpi"

    def __init__(self, comm: Communicator) -> None:
        self.comm = comm

    def all_reduce(self, x: Array, op: str) -> Array:
        return collectives.all_reduce(x, self.comm, op=op, algo="mpi")

    def reduce_scatter(self, x: Array, op: str) -> Array:
        return collectives.reduce_scatter(x, self.comm, op=op, algo="mpi")

    def all_gather(self, x: Array) -> Array:
        return collectives.all_gather(x, self.comm, algo="mpi")

    def all_to_all(self, x: Array) -> Array:
        return collectives.all_to_all(x, self.comm, algo="mpi")

    def all_to_allv(self, x: Array, send_counts: Sequence[int]) -> tuple[Array, list[int]]:
        return collectives.all_to_allv(x, send_counts, self.comm, algo="mpi")

    def broadcast(self, x: Array, root: int) -> Array:
        return collectives.broadcast(x, self.comm, root=root, algo="mpi")

    def reduce(self, x: Array, root: int, op: str) -> Array | None:
        return collectives.reduce(x, self.comm, root=root, op=op, algo="mpi")


class NCCLReference(Reference):
    """NVIDIA's NCCL on CuPy arrays (`collectives.nccl`): ncclAllReduce, ncclReduceScatter, ..., and grouped
    ncclSend/ncclRecv for the all-to-alls, which NCCL does not have. Pass `nccl_comm` to use one built
    elsewhere (another library object, a test double); by default one is built over `comm` with CuPy's NCCL."""

    name = "nccl"

    def __init__(self, comm: Communicator, nccl_comm: nccl.NcclComm | None = None) -> None:
        self.comm = nccl_comm if nccl_comm is not None else nccl.NcclComm(comm)

    def cannot_run(self, dtype: str) -> str | None:
        name = nccl.NCCL_TYPES.get(dtype)
        if name is not None and getattr(self.comm.library, name, None) is None:
            return f"this NCCL binding has no {name} (NCCL ≥ 2.10 with a CuPy that exposes it)"
        return None

    def describe(self) -> str:
        shared = (f"; ranks share a GPU: {nccl.MULTI_RANK_GPU}={os.environ.get(nccl.MULTI_RANK_GPU, '')}"
                  if self.comm.ranks_share_a_device else "")
        return f"# reference: NCCL {self.comm.version()} through cupy.cuda.nccl{shared}"

    def close(self) -> None:
        self.comm.close()

    def all_reduce(self, x: Array, op: str) -> Array:
        return nccl.all_reduce(x, self.comm, op=op)

    def reduce_scatter(self, x: Array, op: str) -> Array:
        return nccl.reduce_scatter(x, self.comm, op=op)

    def all_gather(self, x: Array) -> Array:
        return nccl.all_gather(x, self.comm)

    def all_to_all(self, x: Array) -> Array:
        return nccl.all_to_all(x, self.comm)

    def all_to_allv(self, x: Array, send_counts: Sequence[int]) -> tuple[Array, list[int]]:
        return nccl.all_to_allv(x, send_counts, self.comm)

    def broadcast(self, x: Array, root: int) -> Array:
        return nccl.broadcast(x, self.comm, root=root)

    def reduce(self, x: Array, root: int, op: str) -> Array | None:
        return nccl.reduce(x, self.comm, root=root, op=op)


REFERENCES: dict[str, Callable[[Communicator], Reference]] = {"mpi": MPIReference, "nccl": NCCLReference}


def reference_for(name: str, comm: Communicator) -> Reference:
    if name not in REFERENCES:
        raise ConfigError(f"verify --against {name}: unknown reference; valid: {', '.join(REFERENCES)}")
    return REFERENCES[name](comm)


# -- devices ------------------------------------------------------------------------------------------------

def resolve_device(against: str, device: str | None) -> str:
    """--device, defaulting to where the reference runs: the GPU for NCCL, the CPU for MPI."""
    if against == "nccl" and device == "cpu":
        raise ConfigError("verify --against nccl runs on GPU buffers only; leave out --device or pass --device gpu")
    return device or ("gpu" if against == "nccl" else "cpu")


# -- the cases ----------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class VerifySettings:
    against: str = "mpi"
    device: str | None = None  # None: where the reference runs (gpu for nccl, cpu for mpi)
    max_count: int = (1 << 20) + 3
    collectives: Sequence[str] = ("all_reduce", "reduce_scatter", "all_gather", "all_to_all", "all_to_allv",
                                  "broadcast", "reduce")
    datatypes: Sequence[str] = ("float16", "bfloat16", "float32", "float64", "int32", "int64")
    seed: int = 0


@dataclass(frozen=True)
class Case:
    """One call to check: a collective with one algorithm, datatype, op, root and count."""

    collective: str
    algo: str
    dtype: str
    op: str | None
    root: int | None
    count: int
    number: int  # position in the sweep, the same on every rank: seeds this case's inputs


REDUCING = ("all_reduce", "reduce_scatter", "reduce")
ROOTED = ("broadcast", "reduce")


def count_sweep(max_count: int, n: int) -> list[int]:
    """0, 1, a few small and odd counts, counts around multiples of n, a large odd one, and max_count."""
    candidates = {0, 1, 2, 3, 7, 16, 33, n - 1, n + 1, 2 * n + 1, 1000, 4099, 65537, max_count}
    return sorted(c for c in candidates if 0 <= c <= max_count)


def hand_written(collective: str) -> list[str]:
    return [algo for algo in collectives.ALGORITHMS[collective] if algo != "mpi"]


def rows_to_check(settings: VerifySettings, n: int) -> Iterator[tuple[str, str, str, str | None, list[int | None]]]:
    """(collective, algo, dtype, op, roots) for every row of the report."""
    roots = sorted({0, n - 1})
    for collective in settings.collectives:
        for algo in hand_written(collective):
            for dtype in settings.datatypes:
                for op in collectives.OPS if collective in REDUCING else (None,):
                    yield collective, algo, dtype, op, roots if collective in ROOTED else [None]


# -- one case -----------------------------------------------------------------------------------------------

def make_input(case: Case, rank: int, n: int, seed: int) -> tuple[Array, list[int] | None]:
    """This rank's random input for `case` (and the all_to_allv send counts)."""
    rng = np.random.default_rng([seed, case.number, rank])
    send_counts = None
    if case.collective == "all_to_allv":
        send_counts = [int(c) for c in rng.integers(0, case.count + 1, size=n)]
        shape: tuple[int, ...] = (sum(send_counts), 2)
    elif case.collective in ("reduce_scatter", "all_to_all"):
        shape = (case.count * n,)
    else:
        shape = (case.count,)
    dtype = backend.dtype_named(case.dtype)
    if case.op == "prod":
        values = rng.choice([-2, -1, 1, 2], size=shape)  # |product| ≤ 2^n: exact, or ±inf on both sides
    elif case.op == "avg":
        bound = max(1, min(8, exact_integers(dtype) // n**2))  # |partial sums| ≤ bound·n²
        values = rng.integers(-bound, bound + 1, size=shape) * n
    elif case.op is not None:
        bound = max(1, min(8, exact_integers(dtype) // n))  # |partial sums| ≤ bound·n
        values = rng.integers(-bound, bound + 1, size=shape)
    else:
        values = rng.integers(-1000, 1001, size=shape)  # data movement: distinct values catch misplaced blocks
    return values.astype(dtype), send_counts


def exact_integers(dtype: np.dtype) -> int:
    """The largest N such that every integer of magnitude up to N is exact in `dtype` (2^(significant bits))."""
    if backend.is_floating(dtype):
        return 2 ** (ml_dtypes.finfo(dtype).nmant + 1)
    return int(np.iinfo(dtype).max)


OURS: dict[str, Callable] = {
    "all_reduce": lambda x, c, comm, counts: collectives.all_reduce(x, comm, op=c.op, algo=c.algo),
    "reduce_scatter": lambda x, c, comm, counts: collectives.reduce_scatter(x, comm, op=c.op, algo=c.algo),
    "all_gather": lambda x, c, comm, counts: collectives.all_gather(x, comm, algo=c.algo),
    "all_to_all": lambda x, c, comm, counts: collectives.all_to_all(x, comm, algo=c.algo),
    "all_to_allv": lambda x, c, comm, counts: collectives.all_to_allv(x, counts, comm, algo=c.algo),
    "broadcast": lambda x, c, comm, counts: collectives.broadcast(x, comm, root=c.root, algo=c.algo),
    "reduce": lambda x, c, comm, counts: collectives.reduce(x, comm, root=c.root, op=c.op, algo=c.algo),
}

THEIRS: dict[str, Callable] = {
    "all_reduce": lambda ref, x, c, counts: ref.all_reduce(x, c.op),
    "reduce_scatter": lambda ref, x, c, counts: ref.reduce_scatter(x, c.op),
    "all_gather": lambda ref, x, c, counts: ref.all_gather(x),
    "all_to_all": lambda ref, x, c, counts: ref.all_to_all(x),
    "all_to_allv": lambda ref, x, c, counts: ref.all_to_allv(x, counts),
    "broadcast": lambda ref, x, c, counts: ref.broadcast(x, c.root),
    "reduce": lambda ref, x, c, counts: ref.reduce(x, c.root, c.op),
}


def mismatches(ours: object, theirs: object) -> int:
    """Elements where two results differ; a result of the wrong shape or dtype counts every element."""
    if isinstance(ours, tuple) and isinstance(theirs, tuple):  # all_to_allv: (rows, recv_counts)
        return mismatches(ours[0], theirs[0]) + (0 if list(ours[1]) == list(theirs[1]) else 1)
    if ours is None or theirs is None:
        return 0 if ours is None and theirs is None else 1
    ours, theirs = to_host(ours), to_host(theirs)
    if ours.shape != theirs.shape or ours.dtype != theirs.dtype:
        return max(ours.size, theirs.size, 1)
    return int(np.count_nonzero(ours != theirs))


def wrong_elements(case: Case, comm: Communicator, reference: Reference, seed: int, xp: Any = np) -> int:
    """This rank's wrong elements for one case: result differences plus input elements that changed.

    `xp` (NumPy or CuPy) is where the inputs live; each library gets its own copy of the same input.
    """
    host_input, send_counts = make_input(case, comm.rank, comm.size, seed)
    x = xp.array(host_input)
    ours = OURS[case.collective](x, case, comm, send_counts)
    modified_input = int(np.count_nonzero(to_host(x) != host_input))
    theirs = THEIRS[case.collective](reference, xp.array(host_input), case, send_counts)
    return mismatches(ours, theirs) + modified_input


# -- the report ---------------------------------------------------------------------------------------------

_COLUMNS = (("collective", "<15"), ("algo", "<19"), ("dtype", "<8"), ("op", "<5"), ("roots", "<6"),
            ("cases", ">6"), ("#wrong", ">7"))


def _format(cells: Sequence[str]) -> str:
    return "  " + "  ".join(f"{cell:{spec}}" for cell, (_, spec) in zip(cells, _COLUMNS, strict=True))


def _say(comm: Communicator, text: str) -> None:
    if comm.rank == 0:
        print(text, flush=True)


def check_row(comm: Communicator, reference: Reference, settings: VerifySettings, counts: list[int],
              row: tuple, first_number: int, xp: Any = np) -> tuple[int, list[str]]:
    """Run every count (and root) of one row; returns (#wrong summed over ranks, the failing cases)."""
    collective, algo, dtype, op, roots = row
    cases = [Case(collective, algo, dtype, op, root, count, first_number + i)
             for i, (root, count) in enumerate((root, count) for root in roots for count in counts)]
    wrong = np.array([wrong_elements(case, comm, reference, settings.seed, xp) for case in cases], np.int64)
    comm.comm.Allreduce(MPI.IN_PLACE, wrong, op=MPI.SUM)
    failing = [f"count {c.count}" + ("" if c.root is None else f" root {c.root}")
               for c, w in zip(cases, wrong, strict=True) if w]
    return int(wrong.sum()), failing


def _failures(failing: list[str], shown: int = 4) -> str:
    if not failing:
        return ""
    more = f" and {len(failing) - shown} more" if len(failing) > shown else ""
    return f"   FAILED at {', '.join(failing[:shown])}{more}"


def run(settings: VerifySettings) -> int:
    """Check every row on every rank; rank 0 prints the table. Returns 0 iff nothing was wrong."""
    comm = collectives.world()
    device = resolve_device(settings.against, settings.device)
    if device == "gpu":
        what = "verify --against nccl" if settings.against == "nccl" else "verify --device gpu"
        use_gpu(comm, what, need_nccl=settings.against == "nccl")
    reference = reference_for(settings.against, comm)
    status = check_all(comm, reference, settings, device)
    reference.close()  # not on error: freeing NCCL while peers are stuck in a call could hang instead of abort
    return status


def device_line(device: str) -> str:
    if device == "cpu":
        return "# device: cpu (NumPy arrays)"
    return f"# device: gpu (CuPy arrays); our collectives reach MPI by {backend.transfer_path()}"


def check_all(comm: Communicator, reference: Reference, settings: VerifySettings, device: str) -> int:
    """Print the preamble and every row of the table; returns 0 iff no row is wrong."""
    xp = array_module(device)
    counts = count_sweep(settings.max_count, comm.size)
    _say(comm, f"# mpiparallel verify --against {reference.name}: {comm.size} ranks, {mpi_library()}, "
               f"seed {settings.seed}")
    _say(comm, device_line(device))
    _say(comm, f"# nodes: {describe_nodes(comm.nodes)}")
    if reference.describe():
        _say(comm, reference.describe())
    _say(comm, f"# counts: {' '.join(map(str, counts))}")
    _say(comm, "#" + _format([name for name, _ in _COLUMNS])[1:])
    rows = wrong_rows = cases = 0
    skipped = {dtype: reason for dtype in settings.datatypes if (reason := reference.cannot_run(dtype))}
    for dtype, reason in skipped.items():
        _say(comm, f"# {dtype}: not checked: {reason}")
    for row in rows_to_check(settings, comm.size):
        if row[2] in skipped:
            continue
        wrong, failing = check_row(comm, reference, settings, counts, row, first_number=cases, xp=xp)
        collective, algo, dtype, op, roots = row
        row_cases = len(counts) * len(roots)
        shown_roots = "-" if roots == [None] else ",".join(map(str, roots))
        line = _format([collective, algo, dtype, op or "-", shown_roots, str(row_cases), str(wrong)])
        _say(comm, line + _failures(failing))
        rows, cases, wrong_rows = rows + 1, cases + row_cases, wrong_rows + (wrong > 0)
    verdict = "all OK" if wrong_rows == 0 else f"FAILED: {wrong_rows} rows wrong"
    _say(comm, f"# {rows} rows, {cases} cases: {verdict}")
    return ExitCode.CHECK_FAILED if wrong_rows else 0
