"""`mpiparallel bench COLLECTIVE`: the bandwidth benchmark of the hand-written collectives, nccl-tests style.

For each message size from --minbytes to --maxbytes: --warmup_iters untimed calls, a barrier, then --iters
timed calls; the reported time is the slowest rank's average per call. Every row has nccl-tests' columns:

    size    bytes of the call's largest buffer: the gathered output of all_gather, the whole input of
            reduce_scatter and alltoall, the one buffer of the others (nccl-tests' convention)
    count   elements per rank in nccl-tests' sense: the buffer for all_reduce, broadcast, reduce, sendrecv;
            one rank's block for reduce_scatter (its output), all_gather (its input) and alltoall (per peer)
    algbw   size / time, in GB/s (1e9 bytes)
    busbw   algbw × the bus factor, which makes rank counts comparable with each other and with link speed:
            2(n−1)/n for all_reduce, (n−1)/n for reduce_scatter, all_gather and alltoall, 1 otherwise
    #wrong  elements that differ from the exactly known result, summed over ranks

Out-of-place calls write into a preallocated buffer (`out=`), so no timing includes an allocation. In-place
calls pass out=x (all_reduce, broadcast, reduce); reduce_scatter, all_gather, alltoall and sendrecv cannot
alias input and output in this API, so their in-place columns time the same out-of-place call again.

Exact results (as nccl-tests does): element i of rank r's input is a small integer computed from (r, i), so
sums, products, maxima, minima and averages over ranks are exact even in float16 and bfloat16, and each rank
computes the expected output in float64 from the same formula. Products use factors 1 and 2 only; averages use
inputs that are multiples of the rank count. (Exact for avg up to 32 ranks in float16 and 11 in bfloat16, for
sums up to 341 and 42; bfloat16's exact integers end at 256.)

bfloat16 (-d bfloat16) has no MPI datatype: --compare mpi times algo="mpi" through the API for it (words moved
by MPI, reductions by an all-gather and a float64 sum: `collectives.native`), not straight mpi4py calls.

With --compare mpi every size is also timed for the MPI library's own collective (called straight through
mpi4py, MPI_IN_PLACE for in-place), alternating with ours in the same run; `vs-mpi` = MPI's time / ours, so
above 1 means ours is faster. With --compare nccl the same two columns, `nccl-bw` and `vs-nccl` = NCCL's
time / ours, come from NVIDIA's NCCL (`collectives.nccl`) on the same GPU buffers.

--device gpu puts the buffers on each rank's GPU (CuPy; --compare nccl implies it). Our collectives still
talk through MPI, with device pointers if the library is CUDA-aware, else through pinned host buffers (the
preamble says which), and so does --compare mpi there (through algo="mpi", which stages when it must, rather
than straight mpi4py calls). Every timed loop waits for the GPU stream before it reads the clock.
"""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
from mpi4py import MPI

import collectives
from collectives import Communicator, backend, nccl
from collectives.backend import to_host
from collectives.blocks import finish_average
from collectives.cost_model import calibrate, choose, model_for, precision_choice, save_calibration
from collectives.native import mpi_op
from collectives.topology import EMULATED_INTER_NODE_VARIABLE, describe_nodes

from ..errors import ConfigError, ExitCode
from ..jobs.launch import mpi_library
from .devices import array_module, use_gpu

TYPE_NAMES = {"float32": "float", "float64": "double", "float16": "half", "bfloat16": "bfloat16", "int32": "int32",
              "int64": "int64"}
"""nccl-tests' printed name of each NumPy dtype."""

_REDUCE_UFUNCS = {"sum": np.add, "avg": np.add, "prod": np.multiply, "max": np.maximum, "min": np.minimum}
_CHECK_CHUNK = 1 << 20  # elements per step of the result check, to bound its float64 temporaries


@dataclass(frozen=True)
class BenchSettings:
    """The command line's choices, already validated."""

    collective: str | None
    minbytes: int = 8
    maxbytes: int = 64 << 20
    stepfactor: int = 2
    stepbytes: int | None = None
    iters: int = 20
    warmup_iters: int = 5
    check: bool = True
    datatype: str = "float32"
    op: str = "sum"
    root: int = 0
    algo: str = "auto"
    compare: str | None = None  # "mpi" or "nccl": also time that library's collective
    device: str = "cpu"         # "gpu": CuPy buffers on each rank's GPU
    calibrate: bool = False
    json_path: Path | None = None
    plot_path: Path | None = None


# -- what is known about each collective --------------------------------------------------------------------

Call = Callable[[Any, Any, Any, BenchSettings, bool], None]
"""call(x, out, comm, settings, in_place): one call of a collective on preallocated buffers (NumPy or CuPy);
comm is our Communicator, or an NcclComm for the NCCL calls."""

Origin = Callable[[int, int, int, int, np.ndarray], tuple]
"""origin(rank, n, block, root, j) -> (source ranks, or None for "reduced over all ranks"; source indices)."""


@dataclass(frozen=True)
class Collective:
    """Everything the benchmark needs to know about one collective."""

    name: str                 # as on the command line (nccl-tests' spelling)
    api_name: str | None      # its key in collectives.ALGORITHMS (None: sendrecv, a point-to-point exchange)
    bus_factor: Callable[[int], float]
    reduces: bool
    rooted: bool
    input_has_blocks: bool    # the input holds one block per rank (reduce_scatter, alltoall)
    output_has_blocks: bool   # the output holds one block per rank (all_gather, alltoall)
    aliases_in_place: bool    # "in-place" means out=x
    origin: Origin            # where output element j comes from
    ours: Call
    native: Call
    nccl: Call                # the same call through NCCL (collectives.nccl)


# Our calls go through the public API with out= preallocated buffers. The native calls go straight to mpi4py
# (rather than algo="mpi") so that in-place can use MPI_IN_PLACE, as a program calling MPI itself would.

def _ours_all_reduce(x, out, comm, s, in_place):
    collectives.all_reduce(x, comm, op=s.op, algo=s.algo, out=x if in_place else out)


def _native_all_reduce(x, out, comm, s, in_place):
    if in_place:
        comm.comm.Allreduce(MPI.IN_PLACE, x, mpi_op(s.op))
    else:
        comm.comm.Allreduce(x, out, mpi_op(s.op))
    if s.op == "avg":
        finish_average(x if in_place else out, comm.size)


def _ours_reduce_scatter(x, out, comm, s, in_place):
    collectives.reduce_scatter(x, comm, op=s.op, algo=s.algo, out=out)


def _native_reduce_scatter(x, out, comm, s, in_place):
    comm.comm.Reduce_scatter_block(x, out, mpi_op(s.op))
    if s.op == "avg":
        finish_average(out, comm.size)


def _ours_all_gather(x, out, comm, s, in_place):
    collectives.all_gather(x, comm, algo=s.algo, out=out)


def _native_all_gather(x, out, comm, s, in_place):
    comm.comm.Allgather(x, out)


def _ours_alltoall(x, out, comm, s, in_place):
    collectives.all_to_all(x, comm, algo=s.algo, out=out)


def _native_alltoall(x, out, comm, s, in_place):
    comm.comm.Alltoall(x, out)


def _ours_broadcast(x, out, comm, s, in_place):
    collectives.broadcast(x, comm, root=s.root, algo=s.algo, out=x if in_place else out)


def _native_broadcast(x, out, comm, s, in_place):
    if not in_place and comm.rank == s.root:
        out[...] = x  # what an out-of-place broadcast does on the root
    comm.comm.Bcast(x if in_place else out, root=s.root)


def _ours_reduce(x, out, comm, s, in_place):
    collectives.reduce(x, comm, root=s.root, op=s.op, algo=s.algo, out=x if in_place else out)


def _native_reduce(x, out, comm, s, in_place):
    on_root = comm.rank == s.root
    if in_place and on_root:
        comm.comm.Reduce(MPI.IN_PLACE, x, mpi_op(s.op), root=s.root)
    else:
        comm.comm.Reduce(x, out if on_root else None, mpi_op(s.op), root=s.root)
    if s.op == "avg" and on_root:
        finish_average(x if in_place else out, comm.size)


def _ours_sendrecv(x, out, comm, s, in_place):
    comm.sendrecv(x, (comm.rank + 1) % comm.size, out, (comm.rank - 1) % comm.size)


def _native_sendrecv(x, out, comm, s, in_place):
    comm.comm.Sendrecv(x, (comm.rank + 1) % comm.size, 0, out, (comm.rank - 1) % comm.size, 0)


# The NCCL calls: in-place passes out=x where the collective aliases (NCCL reduces and broadcasts in place).

def _nccl_all_reduce(x, out, comm, s, in_place):
    nccl.all_reduce(x, comm, op=s.op, out=x if in_place else out)


def _nccl_reduce_scatter(x, out, comm, s, in_place):
    nccl.reduce_scatter(x, comm, op=s.op, out=out)


def _nccl_all_gather(x, out, comm, s, in_place):
    nccl.all_gather(x, comm, out=out)


def _nccl_alltoall(x, out, comm, s, in_place):
    nccl.all_to_all(x, comm, out=out)


def _nccl_broadcast(x, out, comm, s, in_place):
    nccl.broadcast(x, comm, root=s.root, out=x if in_place else out)


def _nccl_reduce(x, out, comm, s, in_place):
    nccl.reduce(x, comm, root=s.root, op=s.op, out=x if in_place else out)


def _nccl_sendrecv(x, out, comm, s, in_place):
    nccl.sendrecv(x, (comm.rank + 1) % comm.size, out, (comm.rank - 1) % comm.size, comm)


def _all_but_one_of(n: int) -> float:
    return (n - 1) / n


COLLECTIVES: dict[str, Collective] = {c.name: c for c in (
    Collective("all_reduce", "all_reduce", lambda n: 2 * (n - 1) / n, reduces=True, rooted=False,
               input_has_blocks=False, output_has_blocks=False, aliases_in_place=True,
               origin=lambda rank, n, block, root, j: (None, j),
               ours=_ours_all_reduce, native=_native_all_reduce, nccl=_nccl_all_reduce),
    Collective("reduce_scatter", "reduce_scatter", _all_but_one_of, reduces=True, rooted=False,
               input_has_blocks=True, output_has_blocks=False, aliases_in_place=False,
               origin=lambda rank, n, block, root, j: (None, rank * block + j),
               ours=_ours_reduce_scatter, native=_native_reduce_scatter, nccl=_nccl_reduce_scatter),
    Collective("all_gather", "all_gather", _all_but_one_of, reduces=False, rooted=False,
               input_has_blocks=False, output_has_blocks=True, aliases_in_place=False,
               origin=lambda rank, n, block, root, j: (j // block, j % block),
               ours=_ours_all_gather, native=_native_all_gather, nccl=_nccl_all_gather),
    Collective("alltoall", "all_to_all", _all_but_one_of, reduces=False, rooted=False,
               input_has_blocks=True, output_has_blocks=True, aliases_in_place=False,
               origin=lambda rank, n, block, root, j: (j // block, rank * block + j % block),
               ours=_ours_alltoall, native=_native_alltoall, nccl=_nccl_alltoall),
    Collective("broadcast", "broadcast", lambda n: 1.0, reduces=False, rooted=True,
               input_has_blocks=False, output_has_blocks=False, aliases_in_place=True,
               origin=lambda rank, n, block, root, j: (root, j),
               ours=_ours_broadcast, native=_native_broadcast, nccl=_nccl_broadcast),
    Collective("reduce", "reduce", lambda n: 1.0, reduces=True, rooted=True,
               input_has_blocks=False, output_has_blocks=False, aliases_in_place=True,
               origin=lambda rank, n, block, root, j: (None, j),
               ours=_ours_reduce, native=_native_reduce, nccl=_nccl_reduce),
    Collective("sendrecv", None, lambda n: 1.0, reduces=False, rooted=False,
               input_has_blocks=False, output_has_blocks=False, aliases_in_place=False,
               origin=lambda rank, n, block, root, j: ((rank - 1) % n, j),
               ours=_ours_sendrecv, native=_native_sendrecv, nccl=_nccl_sendrecv),
)}


def valid_algorithms(collective: str) -> list[str]:
    """The --algo values `collective` accepts."""
    api_name = COLLECTIVES[collective].api_name
    return ["auto"] if api_name is None else collectives.algorithms(api_name)


# -- inputs with exactly known results ----------------------------------------------------------------------

def input_values(rank: int | np.ndarray, index: np.ndarray, n: int, op: str) -> np.ndarray:
    """Element `index` of rank `rank`'s input, in float64; small integers, so every result is exact.

    `op` is the reduction ("none" for data movement): products get factors 1 and 2 (at most three 2s per
    element), averages get multiples of n (so the final division is exact), sums small values of either
    sign; max, min and data movement get values that differ between neighbouring elements and ranks.
    """
    if op == "prod":
        return np.where((index + rank) % n < index % 4, 2.0, 1.0)
    if op == "avg":
        return ((index * 7 + rank * 3) % 5 - 2.0) * n  # |partial sums| ≤ 2n²
    if op == "sum":
        return (index * 7 + rank * 3) % 13 - 6.0
    return (rank * 1009 + index) % 2039 - 1019.0


def reduced_values(index: np.ndarray, n: int, op: str) -> np.ndarray:
    """The reduction over all n ranks of element `index` of their inputs, in float64."""
    combine = _REDUCE_UFUNCS[op]
    result = input_values(0, index, n, op)
    for rank in range(1, n):
        combine(result, input_values(rank, index, n, op), out=result)
    return result / n if op == "avg" else result


def fill_input(x: Any, rank: int, n: int, op: str) -> None:
    """Write rank `rank`'s input into `x` (NumPy or CuPy), a chunk at a time computed on the host."""
    xp = backend.get_array_module(x)
    for lo in range(0, x.size, _CHECK_CHUNK):
        index = np.arange(lo, min(lo + _CHECK_CHUNK, x.size))
        x[lo:lo + index.size] = xp.asarray(input_values(rank, index, n, op).astype(x.dtype))


def value_pattern(collective: Collective, settings: BenchSettings) -> str:
    """The `op` argument of `input_values` for this run: the reduction, or "none" for data movement."""
    return settings.op if collective.reduces else "none"


def count_mismatches(result: Any, collective: Collective, rank: int, n: int, block: int,
                     settings: BenchSettings) -> int:
    """How many elements of this rank's `result` differ from the exact expected values."""
    op = value_pattern(collective, settings)
    wrong = 0
    for lo in range(0, result.size, _CHECK_CHUNK):
        j = np.arange(lo, min(lo + _CHECK_CHUNK, result.size))
        sources, index = collective.origin(rank, n, block, settings.root, j)
        expected = reduced_values(index, n, op) if sources is None else input_values(sources, index, n, op)
        wrong += int(np.count_nonzero(to_host(result[lo:lo + j.size]) != expected.astype(result.dtype)))
    return wrong


# -- measuring ----------------------------------------------------------------------------------------------

@dataclass
class Buffers:
    """The preallocated buffers of one message size, with nccl-tests' size and count of the call."""

    size: int
    count: int
    x: Any    # numpy.ndarray, or cupy.ndarray with --device gpu
    out: Any


def allocate(collective: Collective, nbytes: int, n: int, dtype: np.dtype, xp: Any = np) -> Buffers:
    elements = nbytes // dtype.itemsize
    has_blocks = collective.input_has_blocks or collective.output_has_blocks
    block = elements // n if has_blocks else elements
    x = xp.empty(block * (n if collective.input_has_blocks else 1), dtype)
    out = xp.empty(block * (n if collective.output_has_blocks else 1), dtype)
    out[...] = 0  # touch every page now rather than inside the first timed call
    return Buffers(max(x.nbytes, out.nbytes), block, x, out)


@dataclass
class Measurement:
    """One timed mode (out-of-place or in-place) of one size."""

    seconds: float
    algbw: float
    busbw: float
    wrong: int | None = None                 # None: not checked (-c 0)
    reference_seconds: float | None = None   # with --compare: the other library's time and busbw
    reference_busbw: float | None = None

    @property
    def vs_reference(self) -> float | None:
        """The other library's time / ours: above 1, ours is faster."""
        return None if self.reference_seconds is None else self.reference_seconds / self.seconds


@dataclass(frozen=True)
class Comparison:
    """The library timed beside ours (--compare): its name in column titles and JSON keys, and its call."""

    name: str     # "mpi" or "nccl": columns mpi-bw/vs-mpi, JSON keys mpi_time_us, mpi_busbw, vs_mpi
    label: str    # "MPI library" or "NCCL", for the footer and the plot
    call: Callable[[Any, Any, bool], None]  # call(x, out, in_place)


def comparison_for(collective: Collective, comm: Communicator, settings: BenchSettings,
                   nccl_comm: nccl.NcclComm | None) -> Comparison | None:
    """What --compare times: the MPI library (straight mpi4py on host buffers, algo="mpi" on GPU ones), or NCCL."""
    if settings.compare == "nccl":
        return Comparison("nccl", "NCCL", lambda x, out, ip: collective.nccl(x, out, nccl_comm, settings, ip))
    if settings.compare != "mpi":
        return None
    if settings.device == "gpu" or backend.needs_words(backend.dtype_named(settings.datatype)):
        through_api = replace(settings, algo="mpi" if collective.api_name else settings.algo)
        return Comparison("mpi", "MPI library", lambda x, out, ip: collective.ours(x, out, comm, through_api, ip))
    return Comparison("mpi", "MPI library", lambda x, out, ip: collective.native(x, out, comm, settings, ip))


@dataclass
class Row:
    size: int
    count: int
    algo: str
    out_of_place: Measurement
    in_place: Measurement


def seconds_per_call(call: Callable[[], None], comm: Communicator, iters: int, warmup_iters: int,
                     synchronize: Callable[[], None] = lambda: None) -> float:
    """Average seconds per call after warm-up, the slowest rank's (every rank starts after a barrier).

    `synchronize` waits for queued GPU work, before the clock starts and before it is read.
    """
    for _ in range(warmup_iters):
        call()
    synchronize()
    comm.barrier()
    start = time.perf_counter()
    for _ in range(iters):
        call()
    synchronize()
    mine = (time.perf_counter() - start) / iters
    return comm.comm.allreduce(mine, op=MPI.MAX)


def _bandwidths(nbytes: int, seconds: float, factor: float) -> tuple[float, float]:
    algbw = nbytes / seconds / 1e9 if seconds > 0 else 0.0
    return algbw, algbw * factor


def measure(collective: Collective, buffers: Buffers, comm: Communicator, settings: BenchSettings,
            in_place: bool, comparison: Comparison | None = None) -> Measurement:
    """Time our call (then the other library's, with --compare) in one mode, then check one fresh call's result."""
    x, out = buffers.x, buffers.out
    factor = collective.bus_factor(comm.size)
    timing = (settings.iters, settings.warmup_iters, lambda: backend.synchronize(x))
    seconds = seconds_per_call(lambda: collective.ours(x, out, comm, settings, in_place), comm, *timing)
    measurement = Measurement(seconds, *_bandwidths(buffers.size, seconds, factor))
    if comparison is not None:
        measurement.reference_seconds = seconds_per_call(lambda: comparison.call(x, out, in_place), comm, *timing)
        measurement.reference_busbw = _bandwidths(buffers.size, measurement.reference_seconds, factor)[1]
    if settings.check:
        measurement.wrong = checked_call(collective, buffers, comm, settings, in_place)
    return measurement


def checked_call(collective: Collective, buffers: Buffers, comm: Communicator, settings: BenchSettings,
                 in_place: bool) -> int:
    """Refill the input, make one call, and return the wrong elements summed over all ranks."""
    fill_input(buffers.x, comm.rank, comm.size, value_pattern(collective, settings))
    collective.ours(buffers.x, buffers.out, comm, settings, in_place)
    backend.synchronize(buffers.out)
    result = buffers.x if in_place and collective.aliases_in_place else buffers.out
    has_result = not (collective.rooted and collective.reduces and comm.rank != settings.root)
    wrong = count_mismatches(result, collective, comm.rank, comm.size, buffers.count, settings) if has_result else 0
    return comm.comm.allreduce(wrong, op=MPI.SUM)


def algorithm_used(collective: Collective, comm: Communicator, settings: BenchSettings, nbytes: int) -> str:
    """The algorithm a call of `nbytes` runs: --algo, or the cost model's choice for algo=auto."""
    if collective.api_name is None:
        return "p2p"
    if comm.size == 1 or nbytes == 0:
        return "local"  # nothing to communicate: every algorithm is a local copy
    if settings.algo != "auto":
        return settings.algo
    rounding_once = precision_choice(collective.api_name, backend.dtype_named(settings.datatype),
                                     settings.op if collective.reduces else None)
    if rounding_once:
        return rounding_once
    return choose(model_for(comm), collective.api_name, nbytes, comm.size, comm.topology.count)


def size_sweep(settings: BenchSettings) -> list[int]:
    """Message sizes from --minbytes to --maxbytes, multiplied by -f or stepped by -i (nccl-tests' loop)."""
    sizes, size = [], settings.minbytes
    while size <= settings.maxbytes:
        sizes.append(size)
        grown = size + settings.stepbytes if settings.stepbytes else size * settings.stepfactor
        size = max(grown, size + 1)  # -b 0 with -f must still advance
    return sizes


def benchmark_size(collective: Collective, nbytes: int, comm: Communicator, settings: BenchSettings,
                   comparison: Comparison | None = None) -> Row:
    buffers = allocate(collective, nbytes, comm.size, backend.dtype_named(settings.datatype),
                       array_module(settings.device))
    fill_input(buffers.x, comm.rank, comm.size, value_pattern(collective, settings))
    out_of_place = measure(collective, buffers, comm, settings, False, comparison)
    in_place = measure(collective, buffers, comm, settings, True, comparison)
    algo = algorithm_used(collective, comm, settings, buffers.size)
    return Row(buffers.size, buffers.count, algo, out_of_place, in_place)


# -- printing -----------------------------------------------------------------------------------------------

_LEFT_COLUMNS = (("size", "(B)", 12), ("count", "(elements)", 12), ("type", "", 8), ("redop", "", 6),
                 ("root", "", 6))
_MODE_COLUMNS = (("time", "(us)", 8), ("algbw", "(GB/s)", 7), ("busbw", "(GB/s)", 7), ("#wrong", "", 6))


def _compare_columns(name: str) -> tuple:
    """mpi-bw and vs-mpi, or nccl-bw and vs-nccl."""
    return (f"{name}-bw", "(GB/s)", max(7, len(name) + 3)), (f"vs-{name}", "", max(6, len(name) + 3))


class Table:
    """nccl-tests' table: left columns, then an out-of-place and an in-place group, then the algorithm."""

    def __init__(self, compare: str | None) -> None:
        self.mode_columns = _MODE_COLUMNS + (_compare_columns(compare) if compare else ())

    @staticmethod
    def _join(cells: list[str], columns: tuple) -> str:
        return "  ".join(cell.rjust(width) for cell, (_, _, width) in zip(cells, columns, strict=True))

    def _width(self, columns: tuple) -> int:
        return sum(width for _, _, width in columns) + 2 * (len(columns) - 1)

    def header(self) -> list[str]:
        mode_width = self._width(self.mode_columns)
        groups = " " * self._width(_LEFT_COLUMNS) + "  " + "out-of-place".center(mode_width) + "  " \
            + "in-place".center(mode_width)
        title = self._cells(lambda name, unit: name) + "  algo"
        units = self._cells(lambda name, unit: unit)
        return ["#" + line[1:].rstrip() for line in (groups, title, units)]

    def _cells(self, pick: Callable[[str, str], str]) -> str:
        left = self._join([pick(name, unit) for name, unit, _ in _LEFT_COLUMNS], _LEFT_COLUMNS)
        mode = self._join([pick(name, unit) for name, unit, _ in self.mode_columns], self.mode_columns)
        return f"{left}  {mode}  {mode}"

    def format_row(self, row: Row, type_name: str, redop: str, root: int) -> str:
        left = self._join([str(row.size), str(row.count), type_name, redop, str(root)], _LEFT_COLUMNS)
        groups = [self._join(_mode_cells(m, len(self.mode_columns)), self.mode_columns)
                  for m in (row.out_of_place, row.in_place)]
        return f"{left}  {groups[0]}  {groups[1]}  {row.algo}"


def _format_time(microseconds: float) -> str:
    if microseconds >= 10000:
        return f"{microseconds:.0f}"
    return f"{microseconds:.1f}" if microseconds >= 100 else f"{microseconds:.2f}"


def _mode_cells(m: Measurement, columns: int) -> list[str]:
    cells = [_format_time(m.seconds * 1e6), f"{m.algbw:.2f}", f"{m.busbw:.2f}",
             "N/A" if m.wrong is None else str(m.wrong)]
    if columns > len(cells):
        cells += [f"{m.reference_busbw:.2f}", f"{m.vs_reference:.2f}"]
    return cells


def _say(comm: Communicator, text: str = "") -> None:
    if comm.rank == 0:
        print(text, flush=True)


def preamble(collective: Collective, comm: Communicator, settings: BenchSettings,
             nccl_comm: nccl.NcclComm | None = None) -> list[str]:
    step = f"{settings.stepbytes}(bytes)" if settings.stepbytes else f"{settings.stepfactor}(factor)"
    lines = [
        f"# mpiparallel bench {collective.name}: minBytes {settings.minbytes} maxBytes {settings.maxbytes} "
        f"step: {step} warmup iters: {settings.warmup_iters} iters: {settings.iters} "
        f"validation: {int(settings.check)}",
        "#",
        f"# ranks: {comm.size}  MPI: {mpi_library()}  datatype: {TYPE_NAMES[settings.datatype]}  "
        f"algo: {settings.algo}",
    ]
    if settings.device == "gpu":
        lines.append(f"# device: gpu (CuPy buffers, each rank on GPU local rank mod GPU count); our collectives "
                     f"reach MPI by {backend.transfer_path()}")
    if settings.algo == "auto" and collective.api_name is not None:
        model = model_for(comm)
        lines.append(f"# algo=auto picks by the cost model (column algo): alpha {model.alpha * 1e6:.2f} us, "
                     f"beta {1 / model.beta / 1e9:.2f} GB/s, gamma {1 / model.gamma / 1e9:.2f} GB/s")
        if comm.topology.spans_nodes:
            across = model.across()
            lines.append(f"# across nodes: alpha {across.alpha * 1e6:.2f} us, beta {1 / across.beta / 1e9:.2f} GB/s")
    lines.append(f"# nodes: {describe_nodes(comm.nodes)}")
    if comm.emulated_link is not None:
        latency, bandwidth = comm.emulated_link
        lines.append(f"# emulated inter-node link ({EMULATED_INTER_NODE_VARIABLE}): each message to another node "
                     f"waits {latency * 1e6:.0f} us + bytes / {bandwidth / 1e9:.2f} GB/s")
    if not collective.aliases_in_place:
        lines.append(f"# in-place: {collective.name} cannot alias input and output in this API; the in-place "
                     "columns repeat the out-of-place call (out= a preallocated buffer)")
    if settings.compare == "mpi":
        how = " through algo=mpi" if settings.device == "gpu" else ""
        lines.append(f"# mpi-bw: busbw of the MPI library's own collective{how}, timed alternately with ours; "
                     "vs-mpi = MPI time / our time (above 1: ours is faster)")
    if settings.compare == "nccl":
        shared = (f"; ranks share a GPU: {nccl.MULTI_RANK_GPU}={os.environ.get(nccl.MULTI_RANK_GPU, '')}"
                  if nccl_comm.ranks_share_a_device else "")
        lines.append(f"# nccl-bw: busbw of NCCL {nccl_comm.version()} on the same buffers, timed alternately with "
                     f"ours; vs-nccl = NCCL time / our time (above 1: ours is faster){shared}")
    return [*lines, "#"]


def footer(rows: list[Row], comparison: Comparison | None) -> list[str]:
    wrong = sum((r.out_of_place.wrong or 0) + (r.in_place.wrong or 0) for r in rows)
    lines = [f"# Out of bounds values : {wrong} {'OK' if wrong == 0 else 'FAILED'}",
             f"# Avg bus bandwidth    : {average_busbw(rows):.4g}"]
    if comparison is not None:
        short = "MPI" if comparison.name == "mpi" else comparison.label
        lines.append(f"# Avg bus bandwidth of {short} : {average_busbw(rows, reference=True):.4g}")
        ratios = [r.out_of_place.vs_reference for r in rows if r.out_of_place.vs_reference]
        if ratios:
            title = f"# vs-{comparison.name}, geometric mean"
            lines.append(f"{title:<27}: {math.exp(np.mean(np.log(ratios))):.3f}")
    return [*lines, "#"]


def average_busbw(rows: list[Row], reference: bool = False) -> float:
    """Mean out-of-place bus bandwidth over all sizes, ours or the compared library's."""
    values = [(r.out_of_place.reference_busbw if reference else r.out_of_place.busbw) for r in rows]
    return float(np.mean(values)) if values else 0.0


# -- outputs ------------------------------------------------------------------------------------------------

def write_json(path: Path, collective: Collective, comm: Communicator, settings: BenchSettings,
               rows: list[Row]) -> None:
    document = {
        "collective": collective.name, "ranks": comm.size, "mpi_library": mpi_library(),
        "algo": settings.algo, "datatype": TYPE_NAMES[settings.datatype],
        "op": settings.op if collective.reduces else None, "root": settings.root if collective.rooted else None,
        "iters": settings.iters, "warmup_iters": settings.warmup_iters, "check": settings.check,
        "compare": settings.compare, "device": settings.device,
        "wrong": sum((r.out_of_place.wrong or 0) + (r.in_place.wrong or 0) for r in rows),
        "avg_busbw": average_busbw(rows),
        "rows": [{"size": r.size, "count": r.count, "algo": r.algo,
                  "out_of_place": _measurement_json(r.out_of_place, settings.compare),
                  "in_place": _measurement_json(r.in_place, settings.compare)}
                 for r in rows],
    }
    path.write_text(json.dumps(document, indent=2) + "\n")


def _measurement_json(m: Measurement, compare: str | None) -> dict:
    """One mode's numbers; with --compare X also X_time_us, X_busbw and vs_X (X = mpi or nccl)."""
    fields = {"time_us": m.seconds * 1e6, "algbw": m.algbw, "busbw": m.busbw, "wrong": m.wrong}
    if m.reference_seconds is not None:
        fields.update({f"{compare}_time_us": m.reference_seconds * 1e6, f"{compare}_busbw": m.reference_busbw,
                       f"vs_{compare}": m.vs_reference})
    return fields


def draw(path: Path, collective: Collective, comm: Communicator, settings: BenchSettings, rows: list[Row],
         comparison: Comparison | None = None) -> None:
    """Bus bandwidth against message size (log scale), ours and, with --compare, the other library's."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shown = [r for r in rows if r.size > 0]
    sizes = [r.size for r in shown]
    figure, axes = plt.subplots(figsize=(7, 4.5))
    axes.plot(sizes, [r.out_of_place.busbw for r in shown], marker="o", label="ours, out-of-place")
    axes.plot(sizes, [r.in_place.busbw for r in shown], marker=".", linestyle="--", label="ours, in-place")
    if comparison is not None:
        axes.plot(sizes, [r.out_of_place.reference_busbw for r in shown], marker="s", label=comparison.label)
    axes.set_xscale("log", base=2)
    axes.set_xlabel("message size (bytes)")
    axes.set_ylabel("bus bandwidth (GB/s)")
    where = ", GPU buffers" if settings.device == "gpu" else ""
    axes.set_title(f"{collective.name}, {comm.size} ranks, {TYPE_NAMES[settings.datatype]}, algo={settings.algo}"
                   f"{where}")
    axes.grid(True, which="both", alpha=0.3)
    axes.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


# -- the command --------------------------------------------------------------------------------------------

def run_calibration(comm: Communicator) -> None:
    """Measure alpha, beta, gamma; rank 0 stores them for this rank count (algo=auto uses them from now on)."""
    model = calibrate(comm)
    path = save_calibration(model, comm.size) if comm.rank == 0 else None
    _say(comm, f"# calibrated for {comm.size} ranks: alpha {model.alpha * 1e6:.2f} us, "
               f"beta {model.beta * 1e9:.4f} ns/B ({1 / model.beta / 1e9:.2f} GB/s), "
               f"gamma {model.gamma * 1e9:.4f} ns/B ({1 / model.gamma / 1e9:.2f} GB/s); saved to {path}")
    if model.alpha_inter is not None or model.beta_inter is not None:
        across = model.across()
        how = "measured" if comm.topology.spans_nodes else "from the planner's machine file"
        _say(comm, f"# across nodes ({how}): alpha {across.alpha * 1e6:.2f} us, "
                   f"beta {across.beta * 1e9:.4f} ns/B ({1 / across.beta / 1e9:.2f} GB/s)")


def prepare_device(comm: Communicator, settings: BenchSettings) -> nccl.NcclComm | None:
    """Check the --device/--compare combination on every rank, bind GPUs, and build NCCL's communicator."""
    if settings.compare == "nccl" and settings.device != "gpu":
        raise ConfigError("--compare nccl times NCCL on GPU buffers: pass --device gpu (or leave --device out)")
    if settings.device != "gpu":
        return None
    what = "bench --compare nccl" if settings.compare == "nccl" else "bench --device gpu"
    use_gpu(comm, what, need_nccl=settings.compare == "nccl")
    # Not blocking: the timed loops wait for the stream once, after their last call, as nccl-tests does.
    return nccl.NcclComm(comm, blocking=False) if settings.compare == "nccl" else None


def run(settings: BenchSettings) -> int:
    """Run the benchmark on every rank; rank 0 prints. Returns the exit status (1 if any result was wrong)."""
    comm = collectives.world()
    if settings.collective is not None:
        collective = COLLECTIVES[settings.collective]
        if collective.rooted and settings.root >= comm.size:
            raise ConfigError(f"--root {settings.root} is not a rank of this {comm.size}-rank job")
    nccl_comm = prepare_device(comm, settings)
    if settings.calibrate:
        run_calibration(comm)
    if settings.collective is None:
        return 0
    rows = run_sweep(collective, comm, settings, nccl_comm)
    if nccl_comm is not None:
        nccl_comm.close()
    wrong = sum((r.out_of_place.wrong or 0) + (r.in_place.wrong or 0) for r in rows)
    return ExitCode.CHECK_FAILED if wrong else 0


def run_sweep(collective: Collective, comm: Communicator, settings: BenchSettings,
              nccl_comm: nccl.NcclComm | None) -> list[Row]:
    """Print the preamble, one row per size and the footer; write --json and --plot. Returns the rows."""
    comparison = comparison_for(collective, comm, settings, nccl_comm)
    table = Table(settings.compare)
    for line in preamble(collective, comm, settings, nccl_comm) + table.header():
        _say(comm, line)
    rows = []
    redop = settings.op if collective.reduces else "none"
    root = settings.root if collective.rooted else -1
    for nbytes in size_sweep(settings):
        rows.append(benchmark_size(collective, nbytes, comm, settings, comparison))
        _say(comm, table.format_row(rows[-1], TYPE_NAMES[settings.datatype], redop, root))
    for line in footer(rows, comparison):
        _say(comm, line)
    if comm.rank == 0 and settings.json_path is not None:
        write_json(settings.json_path, collective, comm, settings, rows)
    if comm.rank == 0 and settings.plot_path is not None:
        draw(settings.plot_path, collective, comm, settings, rows, comparison)
    return rows
