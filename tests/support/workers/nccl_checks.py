"""Checks of collectives/nccl.py run on every rank (see mpi_harness).

backend="fake" drives the adapter with the NCCL test double (tests/support/fake_nccl.py) on NumPy arrays and also
checks every call it made (name, count, datatype and op constants, stream, grouping); backend="cupy" drives it
with the real `cupy.cuda.nccl` on CuPy arrays. Either way every result is compared with our own collectives.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
from fake_nccl import FakeNccl

import collectives as C
from collectives import backend as backend_module
from collectives import nccl
from collectives.backend import is_floating
from workers.collective_checks import Failures
from workers.collective_checks import error_messages as messages_of

STREAM = 0x5EED  # the test double's "current stream": every call must pass it on
REDUCIBLE = ("int8", "uint8", "int32", "uint32", "int64", "uint64", "float16", "float32", "float64", "bfloat16")
MOVED_AS_BYTES = ("bool", "int16", "complex64")
CUPY_TYPES = {"int8": 0, "uint8": 1, "int32": 2, "uint32": 3, "int64": 4, "uint64": 5, "float16": 6,
              "float32": 7, "float64": 8, "bfloat16": 9}
"""cupy.cuda.nccl's datatype constants, written out here so that the adapter's own table is under test."""
CUPY_OPS = {"sum": 0, "prod": 1, "max": 2, "min": 3, "avg": 4}


class Session:
    """One adapter communicator, its library (the double, or None for CuPy's), and where arrays live."""

    def __init__(self, backend: str, unique_id: str = "bytes", version: int = 23004, blocking: bool = True,
                 device: str = "host") -> None:
        self.comm = C.world()
        self.fake = backend == "fake"
        self.syncs = 0
        if self.fake:
            self.library: Any = FakeNccl(self.comm.comm, unique_id, version)
            memory = nccl.Memory(pointer=lambda x: x.ctypes.data, stream=lambda: STREAM,
                                 synchronize=self._count_sync, device=lambda: device)
            self.put: Callable = np.asarray
        else:
            import cupy

            backend_module.bind_device(self.comm.comm)
            self.library, memory, self.put = None, None, cupy.asarray
        self.nccl = nccl.NcclComm(self.comm, library=self.library, memory=memory, blocking=blocking)

    def _count_sync(self) -> None:
        self.syncs += 1

    def call(self, failures: Failures, what: str, function: Callable, *expected_calls: dict) -> Any:
        """Run one adapter call; with the double, check the NCCL calls it made and that it synchronized."""
        if not self.fake:
            return function()
        first, syncs = len(self.library.calls), self.syncs
        result = function()
        made = self.library.calls[first:]
        keys = set().union(*expected_calls)
        if _unordered([{k: v for k, v in call.items() if k in keys} for call in made]) != _unordered(expected_calls):
            failures.append(f"{what}: NCCL calls {made}, expected {list(expected_calls)}")
        if self.nccl.blocking and self.syncs == syncs:
            failures.append(f"{what}: returned without waiting for the stream")
        return result


def _unordered(calls: Sequence[dict]) -> list[str]:
    """Calls as comparable text, in no particular order: inside an NCCL group the order of calls is free."""
    return sorted(repr(sorted(call.items())) for call in calls)


def _values(rng: np.random.Generator, shape: tuple, dtype: str, op: str, n: int) -> np.ndarray:
    """Small integers: every sum and product is exact in every dtype (int8 and float16 included) on 4 ranks.

    Float averages get multiples of n, where NCCL's pre-multiplication by 1/n is exact; integer averages get
    any value, so that floor (the API) and truncation (NCCL_AVG) would differ if the adapter mixed them up.
    """
    if op == "prod":
        values = rng.integers(1, 3, shape)
    elif np.dtype(dtype).kind in "ub":
        values = rng.integers(0, 5, shape) % (2 if dtype == "bool" else 5)
    else:
        values = rng.integers(-4, 5, shape)
    if op == "avg" and is_floating(np.dtype(dtype)):
        values = values * n
    if np.dtype(dtype).kind == "c":
        return (values + 1j * values[::-1]).astype(dtype)
    return values.astype(dtype)


def _reduce_call(name: str, count: int, dtype: str, op: str, has_avg: bool, **fields: int) -> dict:
    uses_avg = op == "avg" and is_floating(np.dtype(dtype)) and has_avg
    nccl_op = CUPY_OPS["avg"] if uses_avg else CUPY_OPS["sum" if op == "avg" else op]
    return {"call": name, "count": count, "datatype": CUPY_TYPES[dtype], "op": nccl_op, "stream": STREAM,
            **fields}


def _moved(dtype: str, count: int) -> tuple[int, int]:
    """(datatype constant, count) the adapter must pass to move `count` elements of `dtype`."""
    if dtype in CUPY_TYPES:
        return CUPY_TYPES[dtype], count
    return CUPY_TYPES["uint8"], count * np.dtype(dtype).itemsize


def _when(count: int, *calls: dict) -> tuple[dict, ...]:
    """No NCCL call at all for zero elements."""
    return calls if count else ()


# -- reductions --------------------------------------------------------------------------------------------

def _check_reductions(s: Session, dtype: str, count: int, op: str, failures: Failures) -> None:
    comm, n = s.comm, s.comm.size
    rng = np.random.default_rng([count, n, comm.rank, C.OPS.index(op), REDUCIBLE.index(dtype)])
    x = s.put(_values(rng, (count,), dtype, op, n))
    blocks = s.put(_values(rng, (n * count,), dtype, op, n))
    original_x, original_blocks = x.copy(), blocks.copy()
    has_avg, tag = s.nccl.has_avg, f"count={count} dtype={dtype} op={op}"

    call = _when(count, _reduce_call("allReduce", count, dtype, op, has_avg))
    want = C.all_reduce(x, comm, op)
    failures.expect_equal(s.call(failures, f"all_reduce {tag}", lambda: nccl.all_reduce(x, s.nccl, op), *call),
                          want, f"all_reduce {tag}")
    in_place = x.copy()
    got = s.call(failures, f"all_reduce out=x {tag}", lambda: nccl.all_reduce(in_place, s.nccl, op, out=in_place),
                 *call)
    failures.expect_equal(in_place, want, f"all_reduce out=x {tag}")
    if got is not in_place:
        failures.append(f"all_reduce out=x {tag}: did not return out")

    call = _when(count, _reduce_call("reduceScatter", count, dtype, op, has_avg))
    failures.expect_equal(s.call(failures, f"reduce_scatter {tag}", lambda: nccl.reduce_scatter(blocks, s.nccl, op),
                                 *call),
                          C.reduce_scatter(blocks, comm, op), f"reduce_scatter {tag}")
    for root in sorted({0, n - 1}):
        call = _when(count, _reduce_call("reduce", count, dtype, op, has_avg, root=root))
        failures.expect_equal(s.call(failures, f"reduce {tag}", lambda r=root: nccl.reduce(x, s.nccl, r, op), *call),
                              C.reduce(x, comm, root, op), f"reduce root={root} {tag}")
    failures.expect_equal(x, original_x, f"input of the reductions {tag}")
    failures.expect_equal(blocks, original_blocks, f"input of reduce_scatter {tag}")


# -- data movement -----------------------------------------------------------------------------------------

def _check_data_movement(s: Session, dtype: str, count: int, failures: Failures) -> None:
    comm, n, rank = s.comm, s.comm.size, s.comm.rank
    rng = np.random.default_rng([count, n, rank, 99, (REDUCIBLE + MOVED_AS_BYTES).index(dtype)])
    x = s.put(_values(rng, (count,), dtype, "none", n))
    blocks = s.put(_values(rng, (n * count,), dtype, "none", n))
    original_x, original_blocks = x.copy(), blocks.copy()
    datatype, moved = _moved(dtype, count)
    tag = f"count={count} dtype={dtype}"

    call = _when(count, {"call": "allGather", "count": moved, "datatype": datatype, "stream": STREAM})
    failures.expect_equal(s.call(failures, f"all_gather {tag}", lambda: nccl.all_gather(x, s.nccl), *call),
                          C.all_gather(x, comm), f"all_gather {tag}")

    exchange = [{"call": kind, "count": moved, "datatype": datatype, "peer": peer, "grouped": True}
                for kind in ("send", "recv") for peer in range(n)]
    failures.expect_equal(s.call(failures, f"all_to_all {tag}", lambda: nccl.all_to_all(blocks, s.nccl),
                                 *_when(count, *exchange)),
                          C.all_to_all(blocks, comm), f"all_to_all {tag}")

    for root in sorted({0, n - 1}):
        call = _when(count, {"call": "bcast", "count": moved, "datatype": datatype, "root": root})
        failures.expect_equal(s.call(failures, f"broadcast {tag}", lambda r=root: nccl.broadcast(x, s.nccl, r), *call),
                              C.broadcast(x, comm, root), f"broadcast root={root} {tag}")

    right, left = (rank + 1) % n, (rank - 1) % n
    pair = [{"call": "send", "peer": right, "grouped": True}, {"call": "recv", "peer": left, "grouped": True}]
    got = s.call(failures, f"sendrecv {tag}", lambda: nccl.sendrecv(x, right, s.put(np.zeros(count, dtype)), left,
                                                                    s.nccl), *_when(count, *pair))
    failures.expect_equal(got, comm.sendrecv(x, right, s.put(np.zeros(count, dtype)), left), f"sendrecv {tag}")

    _check_all_to_allv(s, rng, dtype, count, failures)
    failures.expect_equal(x, original_x, f"input of the data movement {tag}")
    failures.expect_equal(blocks, original_blocks, f"input of all_to_all {tag}")


def _check_all_to_allv(s: Session, rng: np.random.Generator, dtype: str, count: int, failures: Failures) -> None:
    """Rows of three elements; each rank sends 0..count rows to each peer (so some pairs send nothing)."""
    comm, n = s.comm, s.comm.size
    send_counts = [int(c) for c in rng.integers(0, count + 1, n)]
    rows = s.put(_values(rng, (sum(send_counts), 3), dtype, "none", n))
    recv_counts = [int(c) for c in comm.comm.alltoall(send_counts)]
    datatype = _moved(dtype, 1)[0]
    calls = [{"call": "send", "peer": j, "count": _moved(dtype, 3 * c)[1], "datatype": datatype}
             for j, c in enumerate(send_counts) if c]
    calls += [{"call": "recv", "peer": j, "count": _moved(dtype, 3 * c)[1], "datatype": datatype}
              for j, c in enumerate(recv_counts) if c]
    got_rows, got_counts = s.call(failures, f"all_to_allv {dtype}", lambda: nccl.all_to_allv(rows, send_counts, s.nccl),
                                  *calls)
    want_rows, want_counts = C.all_to_allv(rows, send_counts, comm)
    failures.expect_equal(got_rows, want_rows, f"all_to_allv count={count} dtype={dtype}")
    if got_counts != want_counts:
        failures.append(f"all_to_allv count={count} dtype={dtype}: recv_counts {got_counts} != {want_counts}")


# -- shapes, errors, options -------------------------------------------------------------------------------

def _check_shapes(s: Session, failures: Failures) -> None:
    """Trailing axes, a non-contiguous input and a 0-d all_reduce give our API's shapes and values."""
    comm, n = s.comm, s.comm.size
    x = s.put(_values(np.random.default_rng(comm.rank), (2 * n, 3, 2), "float64", "sum", n))
    failures.expect_equal(nccl.all_reduce(x, s.nccl), C.all_reduce(x, comm), "all_reduce 3-d")
    failures.expect_equal(nccl.reduce_scatter(x, s.nccl), C.reduce_scatter(x, comm), "reduce_scatter 3-d")
    failures.expect_equal(nccl.all_gather(x, s.nccl), C.all_gather(x, comm), "all_gather 3-d")
    failures.expect_equal(nccl.all_to_all(x, s.nccl), C.all_to_all(x, comm), "all_to_all 3-d")
    strided = x[:, 1, ::2]
    failures.expect_equal(nccl.all_reduce(strided, s.nccl, "max"), C.all_reduce(strided, comm, "max"),
                          "non-contiguous all_reduce")
    scalar = s.put(np.float64(comm.rank + 1).reshape(()))
    failures.expect_equal(nccl.all_reduce(scalar, s.nccl), C.all_reduce(scalar, comm), "0-d all_reduce")


def error_messages(s: Session) -> dict[str, str]:
    """What each bad call raises (ValueError expected), for the test to check the message names the cause."""
    n = s.comm.size
    x = s.put(np.ones(2 * n + 1))
    attempts = {
        "int16": lambda: nccl.all_reduce(s.put(np.ones(3, np.int16)), s.nccl),
        "bool": lambda: nccl.reduce(s.put(np.ones(3, bool)), s.nccl, op="max"),
        "complex": lambda: nccl.reduce_scatter(s.put(np.ones(n, np.complex64)), s.nccl),
        "op": lambda: nccl.all_reduce(x, s.nccl, op="median"),
        "not_divisible": lambda: nccl.reduce_scatter(x, s.nccl),
        "zero_dimensional": lambda: nccl.all_gather(s.put(np.float64(1).reshape(())), s.nccl),
        "out_dtype": lambda: nccl.all_reduce(x, s.nccl, out=s.put(np.empty(x.shape, np.float32))),
        "root": lambda: nccl.broadcast(x, s.nccl, root=n),
        "send_counts": lambda: nccl.all_to_allv(x, [1] * n, s.nccl),
    }
    return messages_of(attempts)


def _check_other_communicators(failures: Failures) -> dict:
    """A tuple unique id (CuPy < 14), an NCCL without NCCL_AVG, and blocking=False."""
    n = C.world().size
    results = {}
    for name, session in (("tuple_id", Session("fake", unique_id="tuple")),
                          ("nccl_2_8", Session("fake", version=20804, device=f"gpu{C.world().rank}")),
                          ("nonblocking", Session("fake", blocking=False))):
        x = _values(np.random.default_rng(C.world().rank), (11,), "float32", "avg", n)
        call = _reduce_call("allReduce", 11, "float32", "avg", session.nccl.has_avg)
        got = session.call(failures, name, lambda s=session, x=x: nccl.all_reduce(x, s.nccl, "avg"), call)
        failures.expect_equal(got, C.all_reduce(x, session.comm, "avg"), f"{name} all_reduce avg")
        results[name] = {"has_avg": session.nccl.has_avg, "syncs": session.syncs,
                         "version": session.nccl.version()}
    return results


# -- entry points ------------------------------------------------------------------------------------------

def check_against_ours(counts: list[int], backend: str = "fake") -> dict:
    """Every wrapped collective × count × dtype (× op) equals our own collectives; the double's log checks out."""
    s = Session(backend)
    failures = Failures()
    for dtype in REDUCIBLE:
        for count in counts:
            for op in C.OPS:
                _check_reductions(s, dtype, count, op, failures)
    for dtype in REDUCIBLE + MOVED_AS_BYTES:
        for count in counts:
            _check_data_movement(s, dtype, count, failures)
    _check_shapes(s, failures)
    report: dict[str, Any] = {"errors": error_messages(s)}
    if s.fake:
        report.update(others=_check_other_communicators(failures), unique_ids_made=s.library.unique_ids_made,
                      multi_rank_gpu=s.nccl.nccl.multi_rank_gpu, shares=s.nccl.ranks_share_a_device,
                      streams=sorted({call["stream"] for call in s.library.calls if "stream" in call}))
    s.nccl.close()
    report["failures"] = list(failures)
    return report


def an_old_nccl_on_a_shared_gpu() -> str:
    """The adapter's error when ranks share a GPU and NCCL predates 2.30 (2.23.4 here)."""
    try:
        Session("fake", version=22304, device="gpu0")
    except RuntimeError as error:
        return str(error)
    return "no error"


def multi_rank_setting(devices: str) -> dict:
    """NCCL_MULTI_RANK_GPU_ENABLE as NCCL sees it, when ranks hold "shared" or "distinct" devices."""
    rank = C.world().rank
    s = Session("fake", device="gpu0" if devices == "shared" else f"gpu{rank}")
    return {"multi_rank_gpu": s.nccl.nccl.multi_rank_gpu, "shares": s.nccl.ranks_share_a_device}


# -- verify and bench through the double ------------------------------------------------------------------

def _rank_0_output(run: Callable[[], int]) -> dict:
    """Run a command body on every rank; return its status and what rank 0 printed."""
    import contextlib
    import io

    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        status = run()
    return {"status": status, "output": printed.getvalue()}


def verify_against_the_double(max_count: int, version: int = 23004) -> dict:
    """`verify --against nccl`'s table, with NCCL (of NCCL_VERSION_CODE `version`) replaced by the double on NumPy
    arrays."""
    from mpiparallel.commands import verify

    comm = C.world()
    library = FakeNccl(comm.comm, version=version)
    device = "gpu0" if version >= 23000 else f"gpu{comm.rank}"  # before NCCL 2.30, one rank per GPU
    reference = verify.NCCLReference(comm, nccl.NcclComm(comm, library, nccl.host_memory(device)))
    settings = verify.VerifySettings(against="nccl", max_count=max_count)
    return _rank_0_output(lambda: verify.check_all(comm, reference, settings, "cpu"))


def bench_against_the_double(collectives: list[str], json_dir: str, options: dict) -> dict:
    """`bench COLLECTIVE --compare nccl` for each collective, with NCCL replaced by the double on NumPy arrays."""
    from pathlib import Path

    from mpiparallel.commands import bench

    comm = C.world()
    nccl_comm = nccl.NcclComm(comm, FakeNccl(comm.comm), nccl.host_memory(), blocking=False)
    runs = {}
    for name in collectives:
        settings = bench.BenchSettings(name, compare="nccl", json_path=Path(json_dir) / f"{name}.json", **options)
        runs[name] = _rank_0_output(lambda s=settings: len(bench.run_sweep(bench.COLLECTIVES[s.collective], comm, s,
                                                                           nccl_comm)))
    return runs


def cupy_memory_on_the_cupy_double() -> dict:
    """The adapter's real memory access (`nccl.cupy_memory()`: x.data.ptr, the current stream's .ptr, the
    device's pci_bus_id) on the CuPy double's device arrays, with the NCCL double behind it: an all_reduce in
    float32 and bfloat16, and what the library saw."""
    from fake_cupy import install

    fake = install()
    comm = C.world()
    library = FakeNccl(comm.comm)
    with nccl.NcclComm(comm, library, nccl.cupy_memory()) as nccl_comm:
        results = {}
        for dtype in ("float32", "bfloat16"):
            x = fake.asarray(np.arange(5, dtype=np.float32).astype(dtype) + comm.rank)
            total = nccl.all_reduce(x, nccl_comm, "sum")
            results[dtype] = {"on_device": type(total).__name__ == "DeviceArray",
                              "values": total.get().astype(np.float64).tolist()}
        streams = sorted({call["stream"] for call in library.calls if "stream" in call})
        return {"results": results, "streams": streams, "stream_ptr": fake.cuda.get_current_stream().ptr,
                "shares": nccl_comm.ranks_share_a_device}
