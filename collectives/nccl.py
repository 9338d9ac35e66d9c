"""NCCL as a reference: NVIDIA's collectives on CuPy arrays, with the meaning of the `collectives` API.

    from collectives import backend, nccl
    backend.bind_device(MPI.COMM_WORLD)         # each rank picks its GPU first
    comm = nccl.NcclComm(MPI.COMM_WORLD)        # collective: rank 0 makes the unique id, MPI carries it
    total = nccl.all_reduce(x, comm, op="sum")  # x: a cupy.ndarray

What it is for: `mpiparallel verify --against nccl` checks the hand-written collectives against these, and
`mpiparallel bench --compare nccl` times them side by side. Each function mirrors the one of the same name in
`collectives` (arguments, result shape, `out=`, None off the root of `reduce`, the same ValueErrors) without
`algo`: NCCL picks its own ring or tree and protocol. NCCL moves the data itself (NVLink, PCIe, network), so
nothing appears in a byte ledger; its ring all-reduce sends 2(n−1)/n·S per rank, the volume nccl-tests' busbw
assumes.

| here                                      | cupy.cuda.nccl                                             |
|-------------------------------------------|------------------------------------------------------------|
| all_reduce, reduce_scatter, all_gather    | allReduce, reduceScatter, allGather                        |
| reduce                                    | reduce (every rank passes an output buffer; root's counts) |
| broadcast                                 | bcast on the output buffer, which the root fills first     |
| all_to_all, all_to_allv, sendrecv         | send/recv to every peer inside groupStart()/groupEnd()     |

NCCL has no all-to-all: one send and one receive per peer, grouped so they run together, is how NCCL's own
documentation builds it. all_to_allv first exchanges the row counts over MPI (the receivers must know them).

Ops: sum, prod, max, min → NCCL_SUM, NCCL_PROD, NCCL_MAX, NCCL_MIN. avg on floating types → NCCL_AVG
(NCCL ≥ 2.10), which multiplies each input by 1/n before summing: the API's sum/n exactly when the inputs are
multiples of n, else equal within rounding. avg on integers → NCCL_SUM, then floor division here, because
NCCL_AVG truncates toward zero where the API floors. Without NCCL_AVG (an older NCCL or CuPy) floats take the
sum-then-divide path too. An op without an NCCL equivalent raises ValueError.

Types: NCCL reduces int8, uint8, int32, uint32, int64, uint64, float16, float32, float64 and bfloat16 (where the
binding has NCCL_BFLOAT16, NCCL ≥ 2.10); reducing bool, int16, uint16, complex or any other dtype raises
ValueError. Data movement
(all_gather, all_to_all(v), broadcast, sendrecv) moves such dtypes as raw bytes (NCCL_UINT8).

Pointers and streams: every call is queued on CuPy's current stream with raw device pointers (`x.data.ptr`).
A `Memory` says how to get both; `host_memory()` gives NumPy pointers (`x.ctypes.data`) instead, so that a
test double of the library can drive this module on a machine without a GPU. With `blocking=True` (the
default) each call waits for its stream before returning, so results can go straight to MPI or to the host; a
benchmark passes blocking=False and synchronizes once after its timed loop.

Several ranks on one GPU: NCCL refuses two ranks on one device unless NCCL_MULTI_RANK_GPU_ENABLE=1 (NCCL ≥
2.30, experimental). `NcclComm` asks the ranks on each machine which GPU they hold and, when two hold the same
one and the variable is unset, sets it to 1 in this process before NCCL starts (a value the user set is kept).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from .arguments import (
    check_has_axis,
    check_root,
    check_rows_split_evenly,
    check_send_counts,
    flat,
    output_array,
    row_offsets,
    unaliased,
)
from .backend import Array, get_array_module, gpu_array_module, gpu_unavailable_reason, is_floating
from .blocks import check_op, finish_average
from .communicator import Communicator
from .mpi import MPI

MULTI_RANK_GPU = "NCCL_MULTI_RANK_GPU_ENABLE"

NCCL_TYPES = {"int8": "NCCL_INT8", "uint8": "NCCL_UINT8", "int32": "NCCL_INT32", "uint32": "NCCL_UINT32",
              "int64": "NCCL_INT64", "uint64": "NCCL_UINT64", "float16": "NCCL_FLOAT16",
              "float32": "NCCL_FLOAT32", "float64": "NCCL_FLOAT64", "bfloat16": "NCCL_BFLOAT16"}
"""NumPy dtype name → the name of NCCL's datatype constant in `cupy.cuda.nccl`."""

NCCL_OPS = {"sum": "NCCL_SUM", "prod": "NCCL_PROD", "max": "NCCL_MAX", "min": "NCCL_MIN", "avg": "NCCL_AVG"}
"""The API's op → the name of NCCL's reduction constant (avg: see the module docstring)."""

_FIRST_VERSION_WITH_AVG = 21000  # NCCL 2.10.0 in NCCL_VERSION_CODE's X·10000 + Y·100 + Z form


# -- reaching the library and the memory -------------------------------------------------------------------

def nccl_unavailable_reason() -> str | None:
    """Why NCCL cannot run here, or None when CuPy sees a GPU and its NCCL binding loads."""
    reason = gpu_unavailable_reason()
    if reason is not None:
        return reason
    try:
        from cupy.cuda import nccl
    except Exception as error:  # a CuPy built without the binding
        return f"CuPy's NCCL binding does not import ({type(error).__name__}: {error})"
    if not getattr(nccl, "available", True):
        return "CuPy finds no NCCL library (pip install nvidia-nccl-cu12, or put libnccl.so on the library path)"
    return None


def several_ranks_unavailable_reason(ranks: int) -> str | None:
    """Why `ranks` ranks on this machine (each on GPU local rank mod GPU count) cannot run NCCL here, or None:
    no NCCL, or ranks that would share a GPU under an NCCL before 2.30 (a test skips for it; `NcclComm` refuses)."""
    reason = nccl_unavailable_reason()
    if reason is not None:
        return reason
    gpus, version = _gpu_count(), cupy_nccl().get_version()
    if ranks > gpus and version < _FIRST_VERSION_WITH_SEVERAL_RANKS_PER_GPU:
        return (f"{ranks} ranks on {gpus} GPU(s) share a GPU, which NCCL {format_version(version)} refuses "
                "(it allows it from 2.30)")
    return None


def _gpu_count() -> int:
    from cupy.cuda import runtime

    return runtime.getDeviceCount()


def cupy_nccl() -> Any:
    """The `cupy.cuda.nccl` module, or a RuntimeError saying why it cannot be used."""
    reason = nccl_unavailable_reason()
    if reason is not None:
        raise RuntimeError(f"NCCL is not available: {reason}")
    from cupy.cuda import nccl

    return nccl


@dataclass(frozen=True)
class Memory:
    """How the adapter reaches arrays: their address, the stream to queue on, waiting for it, the device held.

    `device()` names this rank's GPU so that ranks can tell whether they share one.
    """

    pointer: Callable[[Array], int]
    stream: Callable[[], int]
    synchronize: Callable[[], None]
    device: Callable[[], str]


def cupy_memory() -> Memory:
    """CuPy arrays on CuPy's current stream and device (the real thing)."""
    cupy = gpu_array_module()

    def pointer(x: Array) -> int:
        if not isinstance(x, cupy.ndarray):
            raise TypeError(f"NCCL works on GPU arrays (cupy.ndarray), got {type(x).__module__}.{type(x).__name__}")
        return x.data.ptr

    return Memory(pointer=pointer, stream=lambda: cupy.cuda.get_current_stream().ptr,
                  synchronize=lambda: cupy.cuda.get_current_stream().synchronize(),
                  device=lambda: cupy.cuda.Device().pci_bus_id)


def host_memory(device: str = "host") -> Memory:
    """NumPy arrays by address, stream 0, nothing to wait for: for test doubles of the NCCL library."""
    return Memory(pointer=lambda x: x.ctypes.data, stream=lambda: 0, synchronize=lambda: None,
                  device=lambda: device)


class NcclComm:
    """An NCCL communicator over the ranks of an MPI communicator; creating one is collective over it.

    Bind each rank to its GPU first (`backend.bind_device`). `library` is `cupy.cuda.nccl` unless a stand-in
    is given, `memory` is `cupy_memory()` unless given. The MPI communicator (`mpi`) stays in use: it carries
    the unique id at creation and all_to_allv's row counts. `close()` (or a `with` block) frees NCCL's side.
    """

    def __init__(self, comm: Any, library: Any = None, memory: Memory | None = None, blocking: bool = True) -> None:
        self.mpi = Communicator.of(comm)
        self.rank, self.size = self.mpi.rank, self.mpi.size
        self.library = library if library is not None else cupy_nccl()
        self.memory = memory if memory is not None else cupy_memory()
        self.blocking = blocking
        self.ranks_share_a_device = _ranks_share_a_device(self.mpi.comm, self.memory.device())
        if self.ranks_share_a_device:
            _check_several_ranks_per_gpu_allowed(self.library.get_version())
            os.environ.setdefault(MULTI_RANK_GPU, "1")  # before NCCL's first call reads its environment
        unique_id = self.library.get_unique_id() if self.rank == 0 else None
        # Pickled, so it arrives as the type the library made and its NcclCommunicator takes: bytes since
        # CuPy 14, a tuple of 128 ints before.
        unique_id = self.mpi.comm.bcast(unique_id, root=0)
        self.nccl = self.library.NcclCommunicator(self.size, unique_id, self.rank)
        self.has_avg = hasattr(self.library, "NCCL_AVG") and self.library.get_version() >= _FIRST_VERSION_WITH_AVG

    def pointer(self, x: Array) -> int:
        return self.memory.pointer(x)

    def stream(self) -> int:
        return self.memory.stream()

    def finish(self, result: Any) -> Any:
        """`result`, after waiting for the stream when the communicator is blocking."""
        if self.blocking:
            self.memory.synchronize()
        return result

    def version(self) -> str:
        """NCCL's runtime version, as "2.23.4"."""
        return format_version(self.library.get_version())

    def close(self) -> None:
        self.nccl.destroy()

    def __enter__(self) -> NcclComm:
        return self

    def __exit__(self, *exception: object) -> None:
        self.close()


_FIRST_VERSION_WITH_SEVERAL_RANKS_PER_GPU = 23000  # NCCL 2.30.0


def _check_several_ranks_per_gpu_allowed(version: int) -> None:
    """NCCL before 2.30 fails several ranks on one GPU deep inside its communicator's creation ("Duplicate GPU
    detected"); say so before, on every rank (every rank sees the same library and the same sharing)."""
    if version < _FIRST_VERSION_WITH_SEVERAL_RANKS_PER_GPU:
        raise RuntimeError(f"ranks share a GPU, which NCCL {format_version(version)} refuses (\"Duplicate GPU "
                           "detected\"); NCCL allows it from 2.30 with NCCL_MULTI_RANK_GPU_ENABLE=1: run one rank "
                           "per GPU, or install NCCL >= 2.30 (e.g. pip install 'nvidia-nccl-cu13>=2.30')")


def format_version(code: int) -> str:
    """NCCL_VERSION_CODE as text: X·10000 + Y·100 + Z since NCCL 2.9, X·1000 + Y·100 + Z before."""
    major, rest = divmod(code, 10000) if code >= 10000 else divmod(code, 1000)
    return f"{major}.{rest // 100}.{rest % 100}"


def _ranks_share_a_device(comm: MPI.Comm, device: str) -> bool:
    """Whether two ranks of `comm` on this machine hold the same GPU (collective over `comm`)."""
    node = comm.Split_type(MPI.COMM_TYPE_SHARED)
    try:
        devices = node.allgather(device)
    finally:
        node.Free()
    return len(set(devices)) < len(devices)


# -- types and ops -----------------------------------------------------------------------------------------

def _reduction(comm: NcclComm, x: Array, op: str) -> tuple[int, int, bool]:
    """(NCCL datatype, NCCL op, divide by n afterwards) for reducing `x` with `op`."""
    check_op(op)
    name = NCCL_TYPES.get(x.dtype.name)
    if name is None:
        raise ValueError(f"NCCL cannot reduce {x.dtype}: it reduces {', '.join(NCCL_TYPES)}")
    datatype = getattr(comm.library, name, None)
    if datatype is None:
        raise ValueError(f"this NCCL binding has no {name}: it cannot reduce {x.dtype}")
    if op == "avg" and (not is_floating(x.dtype) or not comm.has_avg):
        return datatype, comm.library.NCCL_SUM, True
    op_name = NCCL_OPS.get(op)
    if op_name is None or not hasattr(comm.library, op_name):
        raise ValueError(f"op {op!r} has no NCCL equivalent; NCCL reduces with {', '.join(NCCL_OPS)}")
    return datatype, getattr(comm.library, op_name), False


def _movement(comm: NcclComm, x: Array) -> tuple[int, int]:
    """(NCCL datatype, NCCL elements per element of x) to move x: its own type, or its bytes as NCCL_UINT8."""
    datatype = getattr(comm.library, NCCL_TYPES.get(x.dtype.name, ""), None)
    if datatype is None:
        return comm.library.NCCL_UINT8, x.dtype.itemsize
    return datatype, 1


# -- the collectives ---------------------------------------------------------------------------------------

def all_reduce(x: Array, comm: NcclComm, op: str = "sum", out: Array | None = None) -> Array:
    """Elementwise reduction of `x` over all ranks (ncclAllReduce); out=x reduces in place."""
    datatype, nccl_op, divide = _reduction(comm, x, op)
    out = output_array(x, out, x.shape)
    src, dst = flat(x), out.reshape(-1)
    if src.size:
        comm.nccl.allReduce(comm.pointer(src), comm.pointer(dst), src.size, datatype, nccl_op, comm.stream())
        if divide:
            finish_average(dst, comm.size)
    return comm.finish(out)


def reduce_scatter(x: Array, comm: NcclComm, op: str = "sum", out: Array | None = None) -> Array:
    """Reduce `x` over ranks and return block `rank` of its `size` equal blocks along axis 0 (ncclReduceScatter)."""
    check_rows_split_evenly(x, comm.size, "reduce_scatter")
    datatype, nccl_op, divide = _reduction(comm, x, op)
    out = output_array(x, out, (x.shape[0] // comm.size, *x.shape[1:]))
    src, dst = flat(x), out.reshape(-1)
    if dst.size:
        comm.nccl.reduceScatter(comm.pointer(src), comm.pointer(dst), dst.size, datatype, nccl_op, comm.stream())
        if divide:
            finish_average(dst, comm.size)
    return comm.finish(out)


def all_gather(x: Array, comm: NcclComm, out: Array | None = None) -> Array:
    """Concatenate every rank's `x` along axis 0, in rank order (ncclAllGather)."""
    check_has_axis(x, "all_gather")
    datatype, per_element = _movement(comm, x)
    out = output_array(x, out, (x.shape[0] * comm.size, *x.shape[1:]))
    src, dst = flat(x), out.reshape(-1)
    if src.size:
        comm.nccl.allGather(comm.pointer(src), comm.pointer(dst), src.size * per_element, datatype, comm.stream())
    return comm.finish(out)


def all_to_all(x: Array, comm: NcclComm, out: Array | None = None) -> Array:
    """Block j of `x` along axis 0 goes to rank j; returns the blocks received, ordered by source rank."""
    check_rows_split_evenly(x, comm.size, "all_to_all")
    out = output_array(x, out, x.shape)
    src, dst = flat(unaliased(x, out)), out.reshape(-1)
    block = src.size // comm.size
    blocks = [(peer, slice(peer * block, (peer + 1) * block)) for peer in range(comm.size)]
    _exchange(comm, [(peer, src[part]) for peer, part in blocks], [(peer, dst[part]) for peer, part in blocks])
    return comm.finish(out)


def all_to_allv(x: Array, send_counts: Sequence[int], comm: NcclComm) -> tuple[Array, list[int]]:
    """Rows x[sum(send_counts[:j]) : sum(send_counts[:j+1])] go to rank j.

    Returns (rows received, ordered by source rank; recv_counts, the rows from each rank). The counts travel
    over MPI first, because a receiver must know how much each peer sends before it posts the receives.
    """
    check_has_axis(x, "all_to_allv")
    send_counts = check_send_counts(send_counts, x, comm.size)
    recv_counts = [int(c) for c in comm.mpi.comm.alltoall(send_counts)]
    row = int(np.prod(x.shape[1:], dtype=np.int64))
    out = get_array_module(x).empty((sum(recv_counts), *x.shape[1:]), x.dtype)
    src, dst = flat(x), out.reshape(-1)
    send_at, recv_at = row_offsets(send_counts, row), row_offsets(recv_counts, row)
    peers = range(comm.size)
    _exchange(comm, [(j, src[send_at[j]:send_at[j + 1]]) for j in peers],
              [(j, dst[recv_at[j]:recv_at[j + 1]]) for j in peers])
    return comm.finish(out), recv_counts


def broadcast(x: Array, comm: NcclComm, root: int = 0, out: Array | None = None) -> Array:
    """Every rank returns root's `x`; the others' `x` only gives the shape and dtype (ncclBcast)."""
    check_root(root, comm.size)
    out = output_array(x, out, x.shape)
    buf = out.reshape(-1)
    if comm.rank == root:
        buf[...] = flat(x)
    if buf.size:
        datatype, per_element = _movement(comm, buf)
        comm.nccl.bcast(comm.pointer(buf), buf.size * per_element, datatype, root, comm.stream())
    return comm.finish(out)


def reduce(x: Array, comm: NcclComm, root: int = 0, op: str = "sum", out: Array | None = None) -> Array | None:
    """Reduction of `x` over ranks, returned on `root`; other ranks return None (ncclReduce)."""
    check_root(root, comm.size)
    datatype, nccl_op, divide = _reduction(comm, x, op)
    result = output_array(x, out, x.shape)  # NCCL ignores it off the root; allocating it everywhere keeps one path
    src, dst = flat(x), result.reshape(-1)
    if src.size:
        comm.nccl.reduce(comm.pointer(src), comm.pointer(dst), src.size, datatype, nccl_op, root, comm.stream())
        if divide and comm.rank == root:
            finish_average(dst, comm.size)
    comm.finish(result)
    return result if comm.rank == root else None


def sendrecv(x: Array, dest: int, out: Array, source: int, comm: NcclComm) -> Array:
    """Send `x` to `dest` while receiving into `out` from `source` (one NCCL group); returns `out`."""
    _exchange(comm, [(dest, flat(unaliased(x, out)))], [(source, out.reshape(-1))])
    return comm.finish(out)


def _exchange(comm: NcclComm, sends: Sequence[tuple[int, Array]], receives: Sequence[tuple[int, Array]]) -> None:
    """Post every send and receive inside one NCCL group, so that they progress together instead of deadlocking.

    Empty buffers are skipped on both sides: the counts of a pair agree, so sender and receiver skip together.
    """
    stream = comm.stream()
    comm.library.groupStart()
    for peer, buffer in sends:
        if buffer.size:
            datatype, per_element = _movement(comm, buffer)
            comm.nccl.send(comm.pointer(buffer), buffer.size * per_element, datatype, peer, stream)
    for peer, buffer in receives:
        if buffer.size:
            datatype, per_element = _movement(comm, buffer)
            comm.nccl.recv(comm.pointer(buffer), buffer.size * per_element, datatype, peer, stream)
    comm.library.groupEnd()
