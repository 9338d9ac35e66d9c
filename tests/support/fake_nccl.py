"""A stand-in for `cupy.cuda.nccl` built over mpi4py on host memory, so collectives/nccl.py runs without a GPU.

It has the names and call signatures the adapter relies on: `get_unique_id()`, `get_version()`,
`groupStart()`/`groupEnd()`, the NCCL_* datatype and op constants with CuPy's values, and
`NcclCommunicator(ndev, unique_id, rank)` whose allReduce/reduceScatter/allGather/reduce/bcast/send/recv take
raw pointers, element counts, datatype and op constants and a stream, as CuPy's do. Each call turns its
pointers back into NumPy arrays (ctypes) and runs the matching MPI operation on a private duplicate of the
communicator. NCCL's own semantics are kept where they differ from MPI: NCCL_AVG pre-multiplies floats by 1/n
and truncates integer averages toward zero; send/recv inside a group start together at groupEnd.

Every call is recorded in `calls` (a dict per call), so tests can check which constants, counts and stream
the adapter passed. A communicator checks what a real one would reject: a unique id of the wrong type or length,
ranks that received different ids, ndev or rank that do not match the MPI job.
"""

from __future__ import annotations

import ctypes
import os
from typing import Any

import numpy as np
from mpi4py import MPI

from collectives.backend import BFLOAT16, as_words, is_floating

UNIQUE_ID_BYTES = 128
_MPI_OPS = {0: MPI.SUM, 1: MPI.PROD, 2: MPI.MAX, 3: MPI.MIN}


class FakeNccl:
    """The module-level API of `cupy.cuda.nccl`, as an object (one per test, so nothing is global).

    `unique_id` is "bytes" (CuPy ≥ 14) or "tuple" (a tuple of 128 signed chars, older CuPy): the type
    `get_unique_id` returns and the only type `NcclCommunicator` accepts. `version` is NCCL_VERSION_CODE; below
    21000 (NCCL 2.10) NCCL_AVG does not exist, as in NCCL itself.
    """

    NCCL_SUM, NCCL_PROD, NCCL_MAX, NCCL_MIN = 0, 1, 2, 3
    NCCL_INT8, NCCL_UINT8, NCCL_INT32, NCCL_UINT32, NCCL_INT64, NCCL_UINT64 = 0, 1, 2, 3, 4, 5
    NCCL_FLOAT16, NCCL_FLOAT32, NCCL_FLOAT64 = 6, 7, 8
    DTYPES = {0: np.int8, 1: np.uint8, 2: np.int32, 3: np.uint32, 4: np.int64, 5: np.uint64, 6: np.float16,
              7: np.float32, 8: np.float64, 9: BFLOAT16}
    available = True

    def __init__(self, comm: MPI.Comm, unique_id: str = "bytes", version: int = 23004) -> None:
        if unique_id not in ("bytes", "tuple"):
            raise ValueError(f"unique_id must be 'bytes' or 'tuple', got {unique_id!r}")
        self.comm = comm.Dup()  # its messages never meet the adapter's own MPI traffic
        self.unique_id_type = bytes if unique_id == "bytes" else tuple
        self.version = version
        if version >= 21000:  # NCCL 2.10 brought the average and bfloat16
            self.NCCL_AVG = 4
            self.NCCL_BFLOAT16 = 9
        self.calls: list[dict[str, Any]] = []
        self.unique_ids_made = 0
        self._group_depth = 0
        self._pending: list[tuple[str, np.ndarray, int]] = []

    def get_version(self) -> int:
        return self.version

    def get_unique_id(self) -> bytes | tuple:
        self.unique_ids_made += 1
        raw = os.urandom(UNIQUE_ID_BYTES)
        return raw if self.unique_id_type is bytes else tuple(b - 256 if b > 127 else b for b in raw)

    def NcclCommunicator(self, ndev: int, unique_id: Any, rank: int) -> FakeCommunicator:
        return FakeCommunicator(self, ndev, unique_id, rank)

    def groupStart(self) -> None:
        self._group_depth += 1

    def groupEnd(self) -> None:
        if self._group_depth == 0:
            raise RuntimeError("groupEnd without groupStart")
        self._group_depth -= 1
        if self._group_depth == 0:
            self._run_group()

    @property
    def grouped(self) -> bool:
        return self._group_depth > 0

    def _run_group(self) -> None:
        """Start every queued send and receive at once, as NCCL does at the end of a group."""
        pending = [(kind, as_words(buffer), peer) for kind, buffer, peer in self._pending]
        requests = [self.comm.Irecv(buffer, peer) for kind, buffer, peer in pending if kind == "recv"]
        requests += [self.comm.Isend(buffer, peer) for kind, buffer, peer in pending if kind == "send"]
        MPI.Request.Waitall(requests)
        self._pending.clear()


def host_array(pointer: int, count: int, datatype: int) -> np.ndarray:
    """The `count` elements of NCCL type `datatype` at address `pointer`, as a writable NumPy array."""
    dtype = np.dtype(FakeNccl.DTYPES[datatype])
    if count == 0:
        return np.empty(0, dtype)
    raw = (ctypes.c_uint8 * (count * dtype.itemsize)).from_address(pointer)
    return np.ctypeslib.as_array(raw).view(dtype)


def _reduce(mpi_call: Any, send: np.ndarray, recv: np.ndarray | None, mpi_op: MPI.Op, **options: Any) -> None:
    """An MPI reduction of NCCL buffers; MPI has no bfloat16, so those are reduced in float32 and rounded once
    (NCCL adds bfloat16 in float arithmetic too; the tests' values are exact either way)."""
    if send.dtype != BFLOAT16:
        mpi_call(send, recv, mpi_op, **options)
        return
    wide = None if recv is None else np.empty(recv.shape, np.float32)
    mpi_call(send.astype(np.float32), wide, mpi_op, **options)
    if recv is not None:
        recv[...] = wide.astype(BFLOAT16)


def _as_bytes(unique_id: bytes | tuple) -> bytes:
    return unique_id if isinstance(unique_id, bytes) else bytes(b & 0xFF for b in unique_id)


class FakeCommunicator:
    """`NcclCommunicator`: collectives on raw pointers, run as MPI collectives on the arrays behind them."""

    def __init__(self, library: FakeNccl, ndev: int, unique_id: Any, rank: int) -> None:
        comm = library.comm
        if type(unique_id) is not library.unique_id_type or len(unique_id) != UNIQUE_ID_BYTES:
            raise TypeError(f"NcclCommunicator takes the unique id as {library.unique_id_type.__name__} of "
                            f"{UNIQUE_ID_BYTES}, got {type(unique_id).__name__}")
        if len({_as_bytes(u) for u in comm.allgather(unique_id)}) != 1:
            raise RuntimeError("ranks passed different unique ids to NcclCommunicator")
        if (ndev, rank) != (comm.Get_size(), comm.Get_rank()):
            raise RuntimeError(f"NcclCommunicator({ndev}, id, {rank}) on rank {comm.Get_rank()} of "
                               f"{comm.Get_size()}")
        self.library, self.comm, self.n = library, comm, ndev
        self.multi_rank_gpu = os.environ.get("NCCL_MULTI_RANK_GPU_ENABLE")  # what NCCL would have read now
        self.destroyed = False

    def _record(self, call: str, **fields: Any) -> None:
        self.library.calls.append({"call": call, "grouped": self.library.grouped, **fields})

    def _reduced(self, send: np.ndarray, op: int) -> tuple[np.ndarray, MPI.Op, bool]:
        """(the buffer to hand MPI, the MPI op, truncate an integer average afterwards) for NCCL op `op`."""
        if op != 4:
            return send.copy(), _MPI_OPS[op], False  # a copy, so that sendbuf may equal recvbuf
        if is_floating(send.dtype):
            return send * send.dtype.type(1 / self.n), MPI.SUM, False  # NCCL pre-multiplies floats
        return send.copy(), MPI.SUM, True

    def _truncate_average(self, result: np.ndarray) -> None:
        quotient = np.abs(result) // self.n
        result[...] = np.where(result < 0, -quotient, quotient)

    def allReduce(self, sendbuf: int, recvbuf: int, count: int, datatype: int, op: int,
                  stream: int) -> None:
        self._record("allReduce", count=count, datatype=datatype, op=op, stream=stream)
        send, recv = host_array(sendbuf, count, datatype), host_array(recvbuf, count, datatype)
        send, mpi_op, truncate = self._reduced(send, op)
        _reduce(self.comm.Allreduce, send, recv, mpi_op)
        if truncate:
            self._truncate_average(recv)

    def reduceScatter(self, sendbuf: int, recvbuf: int, recvcount: int, datatype: int, op: int,
                      stream: int) -> None:
        self._record("reduceScatter", count=recvcount, datatype=datatype, op=op, stream=stream)
        send = host_array(sendbuf, recvcount * self.n, datatype)
        recv = host_array(recvbuf, recvcount, datatype)
        send, mpi_op, truncate = self._reduced(send, op)
        _reduce(self.comm.Reduce_scatter_block, send, recv, mpi_op)
        if truncate:
            self._truncate_average(recv)

    def allGather(self, sendbuf: int, recvbuf: int, count: int, datatype: int, stream: int) -> None:
        self._record("allGather", count=count, datatype=datatype, stream=stream)
        send = host_array(sendbuf, count, datatype).copy()
        self.comm.Allgather(as_words(send), as_words(host_array(recvbuf, count * self.n, datatype)))

    def reduce(self, sendbuf: int, recvbuf: int, count: int, datatype: int, op: int, root: int,
               stream: int) -> None:
        self._record("reduce", count=count, datatype=datatype, op=op, root=root, stream=stream)
        send, mpi_op, truncate = self._reduced(host_array(sendbuf, count, datatype), op)
        on_root = self.comm.Get_rank() == root
        recv = host_array(recvbuf, count, datatype) if on_root else None
        _reduce(self.comm.Reduce, send, recv, mpi_op, root=root)
        if truncate and on_root:
            self._truncate_average(recv)

    def bcast(self, buff: int, count: int, datatype: int, root: int, stream: int) -> None:
        self._record("bcast", count=count, datatype=datatype, root=root, stream=stream)
        self.comm.Bcast(as_words(host_array(buff, count, datatype)), root=root)

    def send(self, sendbuf: int, count: int, datatype: int, peer: int, stream: int) -> None:
        self._record("send", count=count, datatype=datatype, peer=peer, stream=stream)
        self._point_to_point("send", host_array(sendbuf, count, datatype), peer)

    def recv(self, recvbuf: int, count: int, datatype: int, peer: int, stream: int) -> None:
        self._record("recv", count=count, datatype=datatype, peer=peer, stream=stream)
        self._point_to_point("recv", host_array(recvbuf, count, datatype), peer)

    def _point_to_point(self, kind: str, buffer: np.ndarray, peer: int) -> None:
        if self.library.grouped:
            self.library._pending.append((kind, buffer, peer))
        elif kind == "send":  # outside a group NCCL blocks until the peer takes part, and so does this
            self.comm.Send(as_words(buffer), peer)
        else:
            self.comm.Recv(as_words(buffer), peer)

    def destroy(self) -> None:
        self.destroyed = True
