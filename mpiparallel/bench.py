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
sums, products, maxima, minima and averages over ranks are exact even in float16, and each rank computes the
expected output in float64 from the same formula. Products use factors 1 and 2 only; averages use inputs that
are multiples of the rank count. (Exact in float16 up to 16 ranks for avg, a few hundred for the others.)

With --compare mpi every size is also timed for the MPI library's own collective (called straight through
mpi4py, MPI_IN_PLACE for in-place), alternating with ours in the same run; `vs-mpi` = MPI's time / ours, so
above 1 means ours is faster.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from mpi4py import MPI

import collectives
from collectives import Communicator
from collectives.blocks import finish_average
from collectives.cost_model import calibrate, choose, model_for, save_calibration

from .errors import ConfigError
from .launch import mpi_library

TYPE_NAMES = {"float32": "float", "float64": "double", "float16": "half", "int32": "int32", "int64": "int64"}
"""nccl-tests' printed name of each NumPy dtype."""

_MPI_OPS = {"sum": MPI.SUM, "avg": MPI.SUM, "prod": MPI.PROD, "max": MPI.MAX, "min": MPI.MIN}
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
    compare_mpi: bool = False
    calibrate: bool = False
    json_path: Path | None = None
    plot_path: Path | None = None


# -- what is known about each collective --------------------------------------------------------------------

Call = Callable[[np.ndarray, np.ndarray, Communicator, BenchSettings, bool], None]
"""call(x, out, comm, settings, in_place): one call of a collective on preallocated buffers."""

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


# Our calls go through the public API with out= preallocated buffers. The native calls go straight to mpi4py
# (rather than algo="mpi") so that in-place can use MPI_IN_PLACE, as a program calling MPI itself would.

def _ours_all_reduce(x, out, comm, s, in_place):
    collectives.all_reduce(x, comm, op=s.op, algo=s.algo, out=x if in_place else out)


def _native_all_reduce(x, out, comm, s, in_place):
    if in_place:
        comm.comm.Allreduce(MPI.IN_PLACE, x, _MPI_OPS[s.op])
    else:
        comm.comm.Allreduce(x, out, _MPI_OPS[s.op])
    if s.op == "avg":
        finish_average(x if in_place else out, comm.size)


def _ours_reduce_scatter(x, out, comm, s, in_place):
    collectives.reduce_scatter(x, comm, op=s.op, algo=s.algo, out=out)


def _native_reduce_scatter(x, out, comm, s, in_place):
    comm.comm.Reduce_scatter_block(x, out, _MPI_OPS[s.op])
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
        comm.comm.Reduce(MPI.IN_PLACE, x, _MPI_OPS[s.op], root=s.root)
    else:
        comm.comm.Reduce(x, out if on_root else None, _MPI_OPS[s.op], root=s.root)
    if s.op == "avg" and on_root:
        finish_average(x if in_place else out, comm.size)


def _ours_sendrecv(x, out, comm, s, in_place):
    comm.sendrecv(x, (comm.rank + 1) % comm.size, out, (comm.rank - 1) % comm.size)


def _native_sendrecv(x, out, comm, s, in_place):
    comm.comm.Sendrecv(x, (comm.rank + 1) % comm.size, 0, out, (comm.rank - 1) % comm.size, 0)


def _all_but_one_of(n: int) -> float:
    return (n - 1) / n


COLLECTIVES: dict[str, Collective] = {c.name: c for c in (
    Collective("all_reduce", "all_reduce", lambda n: 2 * (n - 1) / n, reduces=True, rooted=False,
               input_has_blocks=False, output_has_blocks=False, aliases_in_place=True,
               origin=lambda rank, n, block, root, j: (None, j),
               ours=_ours_all_reduce, native=_native_all_reduce),
    Collective("reduce_scatter", "reduce_scatter", _all_but_one_of, reduces=True, rooted=False,
               input_has_blocks=True, output_has_blocks=False, aliases_in_place=False,
               origin=lambda rank, n, block, root, j: (None, rank * block + j),
               ours=_ours_reduce_scatter, native=_native_reduce_scatter),
    Collective("all_gather", "all_gather", _all_but_one_of, reduces=False, rooted=False,
               input_has_blocks=False, output_has_blocks=True, aliases_in_place=False,
               origin=lambda rank, n, block, root, j: (j // block, j % block),
               ours=_ours_all_gather, native=_native_all_gather),
    Collective("alltoall", "all_to_all", _all_but_one_of, reduces=False, rooted=False,
               input_has_blocks=True, output_has_blocks=True, aliases_in_place=False,
               origin=lambda rank, n, block, root, j: (j // block, rank * block + j % block),
               ours=_ours_alltoall, native=_native_alltoall),
    Collective("broadcast", "broadcast", lambda n: 1.0, reduces=False, rooted=True,
               input_has_blocks=False, output_has_blocks=False, aliases_in_place=True,
               origin=lambda rank, n, block, root, j: (root, j),
               ours=_ours_broadcast, native=_native_broadcast),
    Collective("reduce", "reduce", lambda n: 1.0, reduces=True, rooted=True,
               input_has_blocks=False, output_has_blocks=False, aliases_in_place=True,
               origin=lambda rank, n, block, root, j: (None, j),
               ours=_ours_reduce, native=_native_reduce),
    Collective("sendrecv", None, lambda n: 1.0, reduces=False, rooted=False,
               input_has_blocks=False, output_has_blocks=False, aliases_in_place=False,
               origin=lambda rank, n, block, root, j: ((rank - 1) % n, j),
               ours=_ours_sendrecv, native=_native_sendrecv),
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
    if op in ("sum", "avg"):
        small = (index * 7 + rank * 3) % 13 - 6.0
        return small * n if op == "avg" else small
    return (rank * 1009 + index) % 2039 - 1019.0


def reduced_values(index: np.ndarray, n: int, op: str) -> np.ndarray:
    """The reduction over all n ranks of element `index` of their inputs, in float64."""
    combine = _REDUCE_UFUNCS[op]
    result = input_values(0, index, n, op)
    for rank in range(1, n):
        combine(result, input_values(rank, index, n, op), out=result)
    return result / n if op == "avg" else result


def fill_input(x: np.ndarray, rank: int, n: int, op: str) -> None:
    for lo in range(0, x.size, _CHECK_CHUNK):
        index = np.arange(lo, min(lo + _CHECK_CHUNK, x.size))
        x[lo:lo + index.size] = input_values(rank, index, n, op)


def value_pattern(collective: Collective, settings: BenchSettings) -> str:
    """The `op` argument of `input_values` for this run: the reduction, or "none" for data movement."""
    return settings.op if collective.reduces else "none"


def count_mismatches(result: np.ndarray, collective: Collective, rank: int, n: int, block: int,
                     settings: BenchSettings) -> int:
    """How many elements of this rank's `result` differ from the exact expected values."""
    op = value_pattern(collective, settings)
    wrong = 0
    for lo in range(0, result.size, _CHECK_CHUNK):
        j = np.arange(lo, min(lo + _CHECK_CHUNK, result.size))
        sources, index = collective.origin(rank, n, block, settings.root, j)
        expected = reduced_values(index, n, op) if sources is None else input_values(sources, index, n, op)
        wrong += int(np.count_nonzero(result[lo:lo + j.size] != expected.astype(result.dtype)))
    return wrong


# -- measuring ----------------------------------------------------------------------------------------------

@dataclass
class Buffers:
    """The preallocated buffers of one message size, with nccl-tests' size and count of the call."""

    size: int
    count: int
    x: np.ndarray
    out: np.ndarray


def allocate(collective: Collective, nbytes: int, n: int, dtype: np.dtype) -> Buffers:
    elements = nbytes // dtype.itemsize
    has_blocks = collective.input_has_blocks or collective.output_has_blocks
    block = elements // n if has_blocks else elements
    x = np.empty(block * (n if collective.input_has_blocks else 1), dtype)
    out = np.empty(block * (n if collective.output_has_blocks else 1), dtype)
    out[...] = 0  # touch every page now rather than inside the first timed call
    return Buffers(max(x.nbytes, out.nbytes), block, x, out)


@dataclass
class Measurement:
    """One timed mode (out-of-place or in-place) of one size."""

    seconds: float
    algbw: float
    busbw: float
    wrong: int | None = None           # None: not checked (-c 0)
    mpi_seconds: float | None = None   # with --compare mpi
    mpi_busbw: float | None = None

    @property
    def vs_mpi(self) -> float | None:
        """MPI's time / ours: above 1, ours is faster."""
        return None if self.mpi_seconds is None else self.mpi_seconds / self.seconds


@dataclass
class Row:
    size: int
    count: int
    algo: str
    out_of_place: Measurement
    in_place: Measurement


def seconds_per_call(call: Callable[[], None], comm: Communicator, iters: int, warmup_iters: int) -> float:
    """Average seconds per call after warm-up, the slowest rank's (every rank starts after a barrier)."""
    for _ in range(warmup_iters):
        call()
    comm.barrier()
    start = time.perf_counter()
    for _ in range(iters):
        call()
    mine = (time.perf_counter() - start) / iters
    return comm.comm.allreduce(mine, op=MPI.MAX)


def _bandwidths(nbytes: int, seconds: float, factor: float) -> tuple[float, float]:
    algbw = nbytes / seconds / 1e9 if seconds > 0 else 0.0
    return algbw, algbw * factor


def measure(collective: Collective, buffers: Buffers, comm: Communicator, settings: BenchSettings,
            in_place: bool) -> Measurement:
    """Time our call (then MPI's, with --compare) in one mode, then check one fresh call's result."""
    x, out = buffers.x, buffers.out
    factor = collective.bus_factor(comm.size)
    seconds = seconds_per_call(lambda: collective.ours(x, out, comm, settings, in_place), comm,
                               settings.iters, settings.warmup_iters)
    measurement = Measurement(seconds, *_bandwidths(buffers.size, seconds, factor))
    if settings.compare_mpi:
        measurement.mpi_seconds = seconds_per_call(lambda: collective.native(x, out, comm, settings, in_place),
                                                   comm, settings.iters, settings.warmup_iters)
        measurement.mpi_busbw = _bandwidths(buffers.size, measurement.mpi_seconds, factor)[1]
    if settings.check:
        measurement.wrong = checked_call(collective, buffers, comm, settings, in_place)
    return measurement


def checked_call(collective: Collective, buffers: Buffers, comm: Communicator, settings: BenchSettings,
                 in_place: bool) -> int:
    """Refill the input, make one call, and return the wrong elements summed over all ranks."""
    fill_input(buffers.x, comm.rank, comm.size, value_pattern(collective, settings))
    collective.ours(buffers.x, buffers.out, comm, settings, in_place)
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
    return choose(model_for(comm), collective.api_name, nbytes, comm.size)


def size_sweep(settings: BenchSettings) -> list[int]:
    """Message sizes from --minbytes to --maxbytes, multiplied by -f or stepped by -i (nccl-tests' loop)."""
    sizes, size = [], settings.minbytes
    while size <= settings.maxbytes:
        sizes.append(size)
        grown = size + settings.stepbytes if settings.stepbytes else size * settings.stepfactor
        size = max(grown, size + 1)  # -b 0 with -f must still advance
    return sizes


def benchmark_size(collective: Collective, nbytes: int, comm: Communicator, settings: BenchSettings) -> Row:
    buffers = allocate(collective, nbytes, comm.size, np.dtype(settings.datatype))
    fill_input(buffers.x, comm.rank, comm.size, value_pattern(collective, settings))
    out_of_place = measure(collective, buffers, comm, settings, in_place=False)
    in_place = measure(collective, buffers, comm, settings, in_place=True)
    algo = algorithm_used(collective, comm, settings, buffers.size)
    return Row(buffers.size, buffers.count, algo, out_of_place, in_place)


# -- printing -----------------------------------------------------------------------------------------------

_LEFT_COLUMNS = (("size", "(B)", 12), ("count", "(elements)", 12), ("type", "", 8), ("redop", "", 6),
                 ("root", "", 6))
_MODE_COLUMNS = (("time", "(us)", 8), ("algbw", "(GB/s)", 7), ("busbw", "(GB/s)", 7), ("#wrong", "", 6))
_COMPARE_COLUMNS = (("mpi-bw", "(GB/s)", 7), ("vs-mpi", "", 6))


class Table:
    """nccl-tests' table: left columns, then an out-of-place and an in-place group, then the algorithm."""

    def __init__(self, compare_mpi: bool) -> None:
        self.mode_columns = _MODE_COLUMNS + (_COMPARE_COLUMNS if compare_mpi else ())

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
        cells += [f"{m.mpi_busbw:.2f}", f"{m.vs_mpi:.2f}"]
    return cells


def _say(comm: Communicator, text: str = "") -> None:
    if comm.rank == 0:
        print(text, flush=True)


def preamble(collective: Collective, comm: Communicator, settings: BenchSettings) -> list[str]:
    step = f"{settings.stepbytes}(bytes)" if settings.stepbytes else f"{settings.stepfactor}(factor)"
    lines = [
        f"# mpiparallel bench {collective.name}: minBytes {settings.minbytes} maxBytes {settings.maxbytes} "
        f"step: {step} warmup iters: {settings.warmup_iters} iters: {settings.iters} "
        f"validation: {int(settings.check)}",
        "#",
        f"# ranks: {comm.size}  MPI: {mpi_library()}  datatype: {TYPE_NAMES[settings.datatype]}  "
        f"algo: {settings.algo}",
    ]
    if settings.algo == "auto" and collective.api_name is not None:
        model = model_for(comm)
        lines.append(f"# algo=auto picks by the cost model (column algo): alpha {model.alpha * 1e6:.2f} us, "
                     f"beta {1 / model.beta / 1e9:.2f} GB/s, gamma {1 / model.gamma / 1e9:.2f} GB/s")
    if not collective.aliases_in_place:
        lines.append(f"# in-place: {collective.name} cannot alias input and output in this API; the in-place "
                     "columns repeat the out-of-place call (out= a preallocated buffer)")
    if settings.compare_mpi:
        lines.append("# mpi-bw: busbw of the MPI library's own collective, timed alternately with ours; "
                     "vs-mpi = MPI time / our time (above 1: ours is faster)")
    return [*lines, "#"]


def footer(rows: list[Row], compare_mpi: bool) -> list[str]:
    wrong = sum((r.out_of_place.wrong or 0) + (r.in_place.wrong or 0) for r in rows)
    lines = [f"# Out of bounds values : {wrong} {'OK' if wrong == 0 else 'FAILED'}",
             f"# Avg bus bandwidth    : {average_busbw(rows):.4g}"]
    if compare_mpi:
        lines.append(f"# Avg bus bandwidth of MPI : {average_busbw(rows, mpi=True):.4g}")
        ratios = [r.out_of_place.vs_mpi for r in rows if r.out_of_place.vs_mpi]
        if ratios:
            lines.append(f"# vs-mpi, geometric mean   : {math.exp(np.mean(np.log(ratios))):.3f}")
    return [*lines, "#"]


def average_busbw(rows: list[Row], mpi: bool = False) -> float:
    """Mean out-of-place bus bandwidth over all sizes, ours or MPI's."""
    values = [(r.out_of_place.mpi_busbw if mpi else r.out_of_place.busbw) for r in rows]
    return float(np.mean(values)) if values else 0.0


# -- outputs ------------------------------------------------------------------------------------------------

def write_json(path: Path, collective: Collective, comm: Communicator, settings: BenchSettings,
               rows: list[Row]) -> None:
    document = {
        "collective": collective.name, "ranks": comm.size, "mpi_library": mpi_library(),
        "algo": settings.algo, "datatype": TYPE_NAMES[settings.datatype],
        "op": settings.op if collective.reduces else None, "root": settings.root if collective.rooted else None,
        "iters": settings.iters, "warmup_iters": settings.warmup_iters, "check": settings.check,
        "compare": "mpi" if settings.compare_mpi else None,
        "wrong": sum((r.out_of_place.wrong or 0) + (r.in_place.wrong or 0) for r in rows),
        "avg_busbw": average_busbw(rows),
        "rows": [{"size": r.size, "count": r.count, "algo": r.algo,
                  "out_of_place": _measurement_json(r.out_of_place), "in_place": _measurement_json(r.in_place)}
                 for r in rows],
    }
    path.write_text(json.dumps(document, indent=2) + "\n")


def _measurement_json(m: Measurement) -> dict:
    fields = {"time_us": m.seconds * 1e6, "algbw": m.algbw, "busbw": m.busbw, "wrong": m.wrong}
    if m.mpi_seconds is not None:
        fields.update(mpi_time_us=m.mpi_seconds * 1e6, mpi_busbw=m.mpi_busbw, vs_mpi=m.vs_mpi)
    return fields


def draw(path: Path, collective: Collective, comm: Communicator, settings: BenchSettings, rows: list[Row]) -> None:
    """Bus bandwidth against message size (log scale), ours and, with --compare, MPI's."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shown = [r for r in rows if r.size > 0]
    sizes = [r.size for r in shown]
    figure, axes = plt.subplots(figsize=(7, 4.5))
    axes.plot(sizes, [r.out_of_place.busbw for r in shown], marker="o", label="ours, out-of-place")
    axes.plot(sizes, [r.in_place.busbw for r in shown], marker=".", linestyle="--", label="ours, in-place")
    if settings.compare_mpi:
        axes.plot(sizes, [r.out_of_place.mpi_busbw for r in shown], marker="s", label="MPI library")
    axes.set_xscale("log", base=2)
    axes.set_xlabel("message size (bytes)")
    axes.set_ylabel("bus bandwidth (GB/s)")
    axes.set_title(f"{collective.name}, {comm.size} ranks, {TYPE_NAMES[settings.datatype]}, algo={settings.algo}")
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


def run(settings: BenchSettings) -> int:
    """Run the benchmark on every rank; rank 0 prints. Returns the exit status (1 if any result was wrong)."""
    comm = collectives.world()
    if settings.calibrate:
        run_calibration(comm)
    if settings.collective is None:
        return 0
    collective = COLLECTIVES[settings.collective]
    if collective.rooted and settings.root >= comm.size:
        raise ConfigError(f"--root {settings.root} is not a rank of this {comm.size}-rank job")
    table = Table(settings.compare_mpi)
    for line in preamble(collective, comm, settings) + table.header():
        _say(comm, line)
    rows = []
    redop = settings.op if collective.reduces else "none"
    root = settings.root if collective.rooted else -1
    for nbytes in size_sweep(settings):
        rows.append(benchmark_size(collective, nbytes, comm, settings))
        _say(comm, table.format_row(rows[-1], TYPE_NAMES[settings.datatype], redop, root))
    for line in footer(rows, settings.compare_mpi):
        _say(comm, line)
    if comm.rank == 0 and settings.json_path is not None:
        write_json(settings.json_path, collective, comm, settings, rows)
    if comm.rank == 0 and settings.plot_path is not None:
        draw(settings.plot_path, collective, comm, settings, rows)
    wrong = sum((r.out_of_place.wrong or 0) + (r.in_place.wrong or 0) for r in rows)
    return 1 if wrong else 0
