"""Checks that run on every rank of an MPI job (see mpi_harness); each returns a list of failures (empty = pass)."""

from __future__ import annotations

import os
import time

import numpy as np
from mpi4py import MPI

import collectives as C
import collectives.scratch as scratch_pool
from collectives.backend import BFLOAT16, accumulation_dtype, dtype_named
from collectives.cost_model import CostModel

DTYPES = {name: dtype_named(name) for name in ("float16", "bfloat16", "float32", "float64", "int32", "int64")}


def _hand_written(name: str) -> list[str]:
    return [a for a in C.ALGORITHMS[name] if a != "mpi"]


def _on_host(a: np.ndarray) -> np.ndarray:
    return a


_device = _on_host  # where exact_data puts its arrays: NumPy, or CuPy for the GPU checks


def exact_data(rng: np.random.Generator, shape: tuple, dtype: np.dtype, op: str, size: int) -> np.ndarray:
    """Integer-valued data whose reduction over `size` ranks is exact in every dtype (float16 and bfloat16, whose
    integers are exact up to 2048 and 256, included: |partial sums| ≤ 4·8, 3·8², 2^8 on up to 8 ranks)."""
    if op == "prod":
        values = rng.integers(1, 3, shape)  # at most 2**8 = 256 on 8 ranks
    elif op == "avg":
        values = rng.integers(-3, 4, shape) * size  # the sum divides exactly
    else:
        values = rng.integers(-4, 5, shape)
    return _device(values.astype(dtype))


def _host(a):
    """A NumPy copy of a CuPy array (or the array itself)."""
    return a.get() if hasattr(a, "get") and not isinstance(a, np.ndarray) else a


def error_messages(attempts: dict) -> dict[str, str]:
    """Call each attempt; its ValueError's message, or "NO ERROR" when it raised none."""
    messages = {}
    for name, attempt in attempts.items():
        try:
            attempt()
        except ValueError as error:
            messages[name] = str(error)
        else:
            messages[name] = "NO ERROR"
    return messages


def _same_memory(a, b) -> bool:
    """Whether two arrays' address ranges overlap: exact for the contiguous arrays these checks make.

    NumPy's and the CuPy double's arrays are ndarrays; anything else is real CuPy."""
    if isinstance(a, np.ndarray) and isinstance(b, np.ndarray):
        return bool(np.may_share_memory(a, b))
    import cupy

    return bool(cupy.may_share_memory(a, b))


class Failures(list):
    def expect_equal(self, got: np.ndarray | None, want: np.ndarray | None, what: str) -> None:
        got, want = _host(got), _host(want)
        if got is None or want is None:
            if got is not want:
                self.append(f"{what}: got {type(got).__name__}, want {type(want).__name__}")
            return
        if got.shape != want.shape or got.dtype != want.dtype:
            self.append(f"{what}: shape/dtype {got.shape}/{got.dtype} != {want.shape}/{want.dtype}")
        elif not np.array_equal(got, want):
            wrong = int(np.count_nonzero(got != want))
            self.append(f"{what}: {wrong} of {want.size} elements differ")

    def expect_copy(self, got, source, what: str) -> None:
        """`got` equals `source` in values, shape and dtype, and is a new array that shares none of its memory."""
        self.expect_equal(got, source, what)
        if got is source or (got is not None and _same_memory(got, source)):
            self.append(f"{what}: returned its input's memory, not a new array")


def _expect_copies_sending_nothing(comm: C.Communicator, cases: list, tag: str, failures: Failures) -> None:
    """On one rank, for each (collective, algorithms, call(algo), source): every algorithm's call returns a copy
    of `source` and the ledger records no byte sent or received."""
    for name, algorithms, call, source in cases:
        for algo in algorithms:
            what = f"one rank: {name} {algo} {tag}"
            comm.ledger.reset()
            failures.expect_copy(call(algo), source, what)
            sent, received = comm.ledger.total_sent(), comm.ledger.total_received()
            if sent or received:
                failures.append(f"{what}: sent {sent} and received {received} bytes ({comm.ledger.as_dict()})")


def check_against_native(sizes: list[int], dtypes: list[str] | None = None, ops: list[str] | None = None,
                         seed: int = 0, backend: str = "numpy") -> list[str]:
    """Every collective × hand-written algorithm × size × dtype × op agrees exactly with algo="mpi".

    With backend="cupy" the inputs live on the GPU (ranks share device 0 on a one-GPU machine); with
    backend="fake" in the CuPy test double's pretend device memory (tests/support/fake_cupy.py).
    """
    global _device
    if backend == "cupy":
        import cupy

        _device = cupy.asarray
    elif backend == "fake":
        from fake_cupy import install

        _device = install().asarray
    comm = C.world()
    rng = np.random.default_rng(seed * 1000 + comm.rank)
    failures = Failures()
    for dtype in [DTYPES[d] for d in (dtypes or DTYPES)]:
        for count in sizes:
            for op in ops or C.OPS:
                _check_reductions(comm, rng, count, dtype, op, failures)
            _check_data_movement(comm, rng, count, dtype, failures)
    return failures


def _unchanged(x: np.ndarray, original: np.ndarray, what: str, failures: Failures) -> None:
    if not np.array_equal(_host(x), _host(original)):
        failures.append(f"{what}: modified its input")


def _check_reductions(comm: C.Communicator, rng: np.random.Generator, count: int, dtype: np.dtype, op: str,
                      failures: Failures) -> None:
    n = comm.size
    x = exact_data(rng, (count,), dtype, op, n)
    blocks = exact_data(rng, (n, count), dtype, op, n)  # reduce_scatter: block j is row j
    original_x, original_blocks = x.copy(), blocks.copy()
    want_all_reduce = C.all_reduce(x, comm, op, algo="mpi")
    want_reduce_scatter = C.reduce_scatter(blocks, comm, op, algo="mpi")
    roots = sorted({0, n - 1})
    want_reduce = {root: C.reduce(x, comm, root, op, algo="mpi") for root in roots}
    tag = f"count={count} dtype={dtype} op={op}"
    if op == "avg":
        _check_native_average(comm, x, blocks, want_all_reduce, want_reduce_scatter, want_reduce, tag, failures)
    for algo in _hand_written("all_reduce"):
        failures.expect_equal(C.all_reduce(x, comm, op, algo), want_all_reduce, f"all_reduce {algo} {tag}")
        in_place = x.copy()
        C.all_reduce(in_place, comm, op, algo, out=in_place)
        failures.expect_equal(in_place, want_all_reduce, f"all_reduce {algo} out=x {tag}")
    for algo in _hand_written("reduce_scatter"):
        failures.expect_equal(C.reduce_scatter(blocks, comm, op, algo), want_reduce_scatter,
                              f"reduce_scatter {algo} {tag}")
    for algo in _hand_written("reduce"):
        for root in roots:
            failures.expect_equal(C.reduce(x, comm, root, op, algo), want_reduce[root],
                                  f"reduce {algo} root={root} {tag}")
    if n == 1:
        _check_reductions_of_one_contribution(comm, x, blocks, op, tag, failures)
    _unchanged(x, original_x, f"reduction {tag}", failures)
    _unchanged(blocks, original_blocks, f"reduce_scatter {tag}", failures)


def _sum_over_ranks_divided(total, size: int, dtype: np.dtype) -> np.ndarray | None:
    """The average computed here from a sum, not by the library's `finish_average` (which the hand-written and the
    native "avg" both end in, so comparing them with each other cannot see it wrong). exact_data makes every sum
    a multiple of `size`, so float and integer division agree."""
    return None if total is None else (_host(total).astype(np.float64) / size).astype(dtype)


def _check_native_average(comm: C.Communicator, x, blocks, all_reduce, reduce_scatter, reduce: dict, tag: str,
                          failures: Failures) -> None:
    """algo="mpi" with op="avg" (the reference every algorithm's average is compared with) equals the native
    sum divided by the rank count here."""
    n, dtype = comm.size, x.dtype
    failures.expect_equal(all_reduce, _sum_over_ranks_divided(C.all_reduce(x, comm, "sum", algo="mpi"), n, dtype),
                          f"all_reduce mpi {tag} against sum / n")
    failures.expect_equal(reduce_scatter,
                          _sum_over_ranks_divided(C.reduce_scatter(blocks, comm, "sum", algo="mpi"), n, dtype),
                          f"reduce_scatter mpi {tag} against sum / n")
    for root, got in reduce.items():
        failures.expect_equal(got, _sum_over_ranks_divided(C.reduce(x, comm, root, "sum", algo="mpi"), n, dtype),
                              f"reduce mpi root={root} {tag} against sum / n")


def _check_reductions_of_one_contribution(comm: C.Communicator, x, blocks, op: str, tag: str,
                                          failures: Failures) -> None:
    """On one rank, with every algorithm ("mpi" and "auto" included), a reduction returns a copy of the only
    contribution, whatever the op (an average over one rank is the value itself), and sends nothing. The
    comparisons with algo="mpi" cannot show this: on one rank both sides take the same local path."""
    _expect_copies_sending_nothing(comm, [
        ("all_reduce", C.algorithms("all_reduce"), lambda algo: C.all_reduce(x, comm, op, algo), x),
        ("reduce_scatter", C.algorithms("reduce_scatter"), lambda algo: C.reduce_scatter(blocks, comm, op, algo),
         blocks),
        ("reduce", C.algorithms("reduce"), lambda algo: C.reduce(x, comm, 0, op, algo), x),
        ("all_reduce_async", _hand_written("all_reduce"), lambda algo: C.all_reduce_async(x, comm, op, algo).wait(),
         x),
        ("reduce_scatter_async", _hand_written("reduce_scatter"),
         lambda algo: C.reduce_scatter_async(blocks, comm, op, algo).wait(), blocks),
    ], tag, failures)


def _check_data_movement(comm: C.Communicator, rng: np.random.Generator, count: int, dtype: np.dtype,
                         failures: Failures) -> None:
    n = comm.size
    x = exact_data(rng, (count,), dtype, "sum", n)
    blocks = exact_data(rng, (n, count), dtype, "sum", n)
    tag = f"count={count} dtype={dtype}"
    want = C.all_gather(x, comm, algo="mpi")
    for algo in _hand_written("all_gather"):
        failures.expect_equal(C.all_gather(x, comm, algo), want, f"all_gather {algo} {tag}")
    want = C.all_to_all(blocks, comm, algo="mpi")
    for algo in _hand_written("all_to_all"):
        failures.expect_equal(C.all_to_all(blocks, comm, algo), want, f"all_to_all {algo} {tag}")
    for root in sorted({0, n - 1}):
        want = C.broadcast(x, comm, root, algo="mpi")
        for algo in _hand_written("broadcast"):
            failures.expect_equal(C.broadcast(x, comm, root, algo), want, f"broadcast {algo} root={root} {tag}")
    send_counts = rng.integers(0, max(2 * count // n, 1) + 1, n)
    rows = exact_data(rng, (int(send_counts.sum()), 3), dtype, "sum", n)
    want_rows, want_counts = C.all_to_allv(rows, send_counts, comm, algo="mpi")
    got_rows, got_counts = C.all_to_allv(rows, send_counts, comm, algo="pairwise")
    failures.expect_equal(got_rows, want_rows, f"all_to_allv {tag}")
    if got_counts != want_counts:
        failures.append(f"all_to_allv {tag}: recv_counts {got_counts} != {want_counts}")
    if n == 1:
        _check_data_movement_on_one_rank(comm, x, blocks, rows, tag, failures)


def _check_data_movement_on_one_rank(comm: C.Communicator, x, blocks, rows, tag: str, failures: Failures) -> None:
    """On one rank, with every algorithm ("mpi" and "auto" included), moving data returns a copy of the input
    (the rank's own blocks, gathered from and sent to itself) and sends nothing."""
    received_counts = {}

    def all_to_allv(algo):
        got_rows, received_counts[algo] = C.all_to_allv(rows, [rows.shape[0]], comm, algo)
        return got_rows

    _expect_copies_sending_nothing(comm, [
        ("all_gather", C.algorithms("all_gather"), lambda algo: C.all_gather(x, comm, algo), x),
        ("all_gather_async", _hand_written("all_gather"), lambda algo: C.all_gather_async(x, comm, algo).wait(), x),
        ("all_to_all", C.algorithms("all_to_all"), lambda algo: C.all_to_all(blocks, comm, algo), blocks),
        ("broadcast", C.algorithms("broadcast"), lambda algo: C.broadcast(x, comm, 0, algo), x),
        ("all_to_allv", C.algorithms("all_to_allv"), all_to_allv, rows),
    ], tag, failures)
    for algo, counts in received_counts.items():
        if counts != [rows.shape[0]]:
            failures.append(f"one rank: all_to_allv {algo} {tag}: recv_counts {counts} != [{rows.shape[0]}]")


def check_multidimensional(seed: int = 0) -> list[str]:
    """Shapes with trailing axes, auto choice, and out= buffers, against the reference."""
    comm = C.world()
    n = comm.size
    rng = np.random.default_rng(seed + comm.rank)
    failures = Failures()
    x = exact_data(rng, (2 * n, 3, 5), np.dtype("float64"), "sum", n)
    failures.expect_equal(C.all_reduce(x, comm), C.all_reduce(x, comm, algo="mpi"), "all_reduce 3-d")
    failures.expect_equal(C.reduce_scatter(x, comm), C.reduce_scatter(x, comm, algo="mpi"), "reduce_scatter 3-d")
    failures.expect_equal(C.all_gather(x, comm), C.all_gather(x, comm, algo="mpi"), "all_gather 3-d")
    failures.expect_equal(C.all_to_all(x, comm), C.all_to_all(x, comm, algo="mpi"), "all_to_all 3-d")
    scalar = np.float64(comm.rank + 1).reshape(())
    failures.expect_equal(C.all_reduce(scalar, comm), np.float64(n * (n + 1) / 2).reshape(()), "0-d all_reduce")
    strided = x[:, 1, ::2]  # not contiguous
    failures.expect_equal(C.all_reduce(strided, comm), C.all_reduce(strided.copy(), comm, algo="mpi"),
                          "non-contiguous all_reduce")
    out = np.empty_like(x)
    got = C.all_reduce(x, comm, out=out)
    if got is not out:
        failures.append("all_reduce(out=...) did not return out")
    return failures


def ledger_volumes(count: int, dtype: str = "float64") -> dict:
    """Bytes each rank's ledger records for one call of each ring algorithm (and the pairwise ones) on `count`
    elements of `dtype`."""
    comm = C.world()
    x = np.ones(count, dtype_named(dtype))
    volumes = {}
    for name, call in [("all_reduce", lambda: C.all_reduce(x, comm, algo="ring")),
                       ("reduce_scatter", lambda: C.reduce_scatter(x, comm, algo="ring")),
                       ("all_gather", lambda: C.all_gather(x, comm, algo="ring")),
                       ("rabenseifner", lambda: C.all_reduce(x, comm, algo="rabenseifner")),
                       ("all_to_all", lambda: C.all_to_all(x, comm, algo="pairwise")),
                       ("pairwise_all_reduce", lambda: C.all_reduce(x, comm, algo="pairwise")),
                       ("pairwise_reduce_scatter", lambda: C.reduce_scatter(x, comm, algo="pairwise"))]:
        comm.ledger.reset()
        call()
        volumes[name] = {"sent": comm.ledger.total_sent(), "received": comm.ledger.total_received(),
                         "by_operation": dict(comm.ledger.sent)}
    return volumes


def pool_every_temporary() -> None:
    """Make every algorithm temporary come from the scratch pool, however small (it pools >= 1 MiB otherwise)."""
    scratch_pool.POOLED_BYTES = 0


def check_async_equals_sync(count: int, pool_everything: bool = False) -> list[str]:
    """Several asynchronous collectives in flight at once, progressed by interleaved test(), equal the sync forms.

    With `pool_everything`, every temporary comes from the scratch pool: handles in flight together must each
    hold their own buffers, and all of them are back in the pool at the end."""
    if pool_everything:
        pool_every_temporary()
    comm = C.world()
    n = comm.size
    rng = np.random.default_rng(comm.rank)
    failures = Failures()
    x = exact_data(rng, (n * count,), np.dtype("float32"), "sum", n)
    calls = []
    for algo in _hand_written("all_reduce"):
        calls.append((f"all_reduce {algo}", C.all_reduce_async(x, comm, "sum", algo),
                      C.all_reduce(x, comm, "sum", algo)))
    for algo in _hand_written("reduce_scatter"):
        calls.append((f"reduce_scatter {algo}", C.reduce_scatter_async(x, comm, "max", algo),
                      C.reduce_scatter(x, comm, "max", algo)))
    for algo in _hand_written("all_gather"):
        calls.append((f"all_gather {algo}", C.all_gather_async(x, comm, algo), C.all_gather(x, comm, algo)))
    calls.append(("all_reduce avg", C.all_reduce_async(x, comm, "avg"), C.all_reduce(x, comm, "avg")))
    pending = [handle for _, handle, _ in calls]
    while pending:  # progress every handle a little at a time, as a backward pass would between layers
        pending = [handle for handle in pending if not handle.test()]
    for what, handle, want in calls:
        failures.expect_equal(handle.wait(), want, f"async {what}")
    if pool_everything and comm.size > 1:
        in_pool = len(scratch_pool._free)
        C.reduce_scatter(x, comm, algo="ring")  # takes a buffer it gives back, so the count cannot change
        if not scratch_pool.pooled_bytes() or len(scratch_pool._free) != in_pool:
            failures.append(f"pool: {in_pool} buffers before a reduce_scatter, {len(scratch_pool._free)} after")
    return failures


def check_errors_are_clear() -> dict[str, str]:
    """Bad arguments raise ValueError; return each message so the test can check what it names."""
    comm = C.world()
    x = np.ones(comm.size * 2 + 1)
    attempts = {
        "bad_op": lambda: C.all_reduce(x, comm, op="median"),
        "bad_algo": lambda: C.all_reduce(x, comm, algo="hypercube"),
        "bad_algo_for_collective": lambda: C.all_gather(x, comm, algo="rabenseifner"),
        "not_divisible": lambda: C.reduce_scatter(x, comm),
        "alltoall_not_divisible": lambda: C.all_to_all(x, comm),
        "bad_out_dtype": lambda: C.all_reduce(x, comm, out=np.empty(x.shape, np.float32)),
        "bad_root": lambda: C.broadcast(x, comm, root=comm.size),
        "bad_counts": lambda: C.all_to_allv(x, [1] * comm.size, comm),
        "string_dtype": lambda: C.all_reduce(np.array(["a"]), comm),
        "async_mpi": lambda: C.all_reduce_async(x, comm, algo="mpi"),
    }
    return error_messages(attempts)


def mismatched_shapes() -> str:
    """With MPIPARALLEL_CHECK=1, ranks passing different shapes get one clear error instead of a hang."""
    comm = C.world()
    try:
        C.all_reduce(np.ones(4 + comm.rank), comm)
    except C.CollectiveMismatchError as error:
        return str(error)
    return "NO ERROR"


def mismatched_dtypes() -> str:
    """With MPIPARALLEL_CHECK=1, rank 0 passing bfloat16 where the others pass float16 gets one clear error."""
    comm = C.world()
    try:
        C.all_reduce(np.ones(4, BFLOAT16 if comm.rank == 0 else np.float16), comm)
    except C.CollectiveMismatchError as error:
        return str(error)
    return "NO ERROR"


def raise_on_rank(rank: int) -> str:
    """Rank `rank` raises while the others enter a collective: the job must end, not hang."""
    comm = C.world()
    if comm.rank == rank:
        raise RuntimeError(f"deliberate failure on rank {rank}")
    C.all_reduce(np.ones(10), comm)
    time.sleep(60)
    return "finished"


def auto_choices() -> dict[str, str]:
    """What algo="auto" picks for a tiny and a large all_reduce, with fixed constants, on this communicator."""
    comm = C.world()
    comm.cost_model = CostModel(alpha=3e-6, beta=1e-10, gamma=1e-10)
    from collectives.cost_model import choose
    return {"small": choose(comm.cost_model, "all_reduce", 8, comm.size),
            "large": choose(comm.cost_model, "all_reduce", 64 << 20, comm.size),
            "segment_bytes": os.environ.get("MPIPARALLEL_SEGMENT_BYTES", ""),
            "library": MPI.Get_library_version().splitlines()[0]}


def check_point_to_point_and_split() -> list[str]:
    """send/recv/sendrecv/isend/irecv move exact bytes, the ledger counts them, split makes working subgroups."""
    comm = C.world()
    rank, n = comm.rank, comm.size
    failures = Failures()
    right, left = (rank + 1) % n, (rank - 1) % n
    comm.ledger.reset()
    mine = np.arange(5, dtype=np.float16) + rank
    arrived = comm.sendrecv(mine, right, np.empty_like(mine), left)
    failures.expect_equal(arrived, np.arange(5, dtype=np.float16) + left, "sendrecv")
    if rank % 2 == 0 and right != rank:
        comm.send(mine, right, tag=3)
    if rank % 2 == 1:
        failures.expect_equal(comm.recv(np.empty_like(mine), left, tag=3), mine - 1, "send/recv")
    inbox = np.empty(3, np.int64)
    MPI.Request.Waitall([comm.irecv(inbox, left, tag=4), comm.isend(np.full(3, rank, np.int64), right, tag=4)])
    failures.expect_equal(inbox, np.full(3, left, np.int64), "isend/irecv")
    if comm.ledger.sent["p2p"] < 5 * 2 + 3 * 8:
        failures.append(f"p2p ledger recorded {comm.ledger.sent['p2p']} bytes sent")
    sendrecv_and_isend = 5 * 2 + 3 * 8  # float16 and int64 elements; send/recv adds 5 * 2 on even/odd ranks
    want_sent = sendrecv_and_isend + (5 * 2 if rank % 2 == 0 and right != rank else 0)
    want_received = sendrecv_and_isend + (5 * 2 if rank % 2 == 1 else 0)
    if (comm.ledger.total_sent(), comm.ledger.total_received()) != (want_sent, want_received):
        failures.append(f"ledger recorded {comm.ledger.total_sent()} bytes sent, {comm.ledger.total_received()} "
                        f"received; want {want_sent}, {want_received}: {comm.ledger.as_dict()}")
    halves = comm.split(color=rank % 2, key=rank)
    total = C.all_reduce(np.array([rank], np.int64), halves)
    failures.expect_equal(total, np.array([sum(range(rank % 2, n, 2))], np.int64), "all_reduce on split")
    if halves.ledger is comm.ledger:
        failures.append("a split communicator shares its parent's ledger")
    return failures


def check_out_aliasing_input(pool_everything: bool = False) -> list[str]:
    """out=x (in place) works for every algorithm, the native reference included."""
    if pool_everything:
        pool_every_temporary()
    comm = C.world()
    failures = Failures()
    x = exact_data(np.random.default_rng(comm.rank), (1001,), np.dtype("float64"), "sum", comm.size)
    want = C.all_reduce(x, comm, algo="mpi")
    for algo in C.ALGORITHMS["all_reduce"]:
        y = x.copy()
        failures.expect_equal(C.all_reduce(y, comm, algo=algo, out=y), want, f"all_reduce {algo} out=x")
    want = C.reduce(x, comm, root=1, algo="mpi")
    for algo in C.ALGORITHMS["reduce"]:
        y = x.copy()
        failures.expect_equal(C.reduce(y, comm, root=1, algo=algo, out=y), want, f"reduce {algo} out=x")
    return failures


def gradient_like(rng: np.random.Generator, count: int, groups: int = 8) -> np.ndarray:
    """float64 values like one rank's gradients: `groups` tensors of magnitudes 1e-6 … 1e1, each element a
    component shared by all ranks (the true gradient; seeded by the caller's shared generator) plus this rank's
    own noise of the same size."""
    scales = np.repeat(10.0 ** np.linspace(-6, 1, groups), -(-count // groups))[:count]
    return scales * rng.standard_normal(count)


def _rank_order_reduction(rows: np.ndarray, op: str, dtype: np.dtype) -> np.ndarray:
    """The pairwise algorithms' promised result, computed here from every rank's input: the rows added (or
    multiplied, maxed, minned) in the accumulation dtype in rank order, divided there for avg, rounded once."""
    ufunc = {"sum": np.add, "avg": np.add, "prod": np.multiply, "max": np.maximum, "min": np.minimum}[op]
    total = rows[0].astype(accumulation_dtype(dtype))
    for row in rows[1:]:
        total = ufunc(total, row.astype(total.dtype))
    if op == "avg":
        total = total / total.dtype.type(len(rows))
    return total.astype(dtype)


def check_pairwise_rounds_once(count: int, seed: int = 0) -> list[str]:
    """On random (inexact) data, algo="pairwise" all_reduce and reduce_scatter equal, bit for bit, the rank-order
    float32 reduction of every rank's input rounded once (computed here from an all-gather); algo="auto" runs
    it for bfloat16 and float16 sums and averages."""
    comm = C.world()
    n = comm.size
    shared, own = np.random.default_rng(seed), np.random.default_rng([seed, comm.rank + 1])
    failures = Failures()
    for dtype in (BFLOAT16, np.dtype(np.float16), np.dtype(np.float32)):
        x = (gradient_like(shared, n * count) + gradient_like(own, n * count)).astype(dtype)
        rows = C.all_gather(x, comm, algo="mpi").reshape(n, -1)
        for op in ("sum", "avg", "max") + (("prod",) if dtype != np.float16 else ()):  # float16 products overflow
            want = _rank_order_reduction(rows, op, dtype)
            block = slice(comm.rank * count, (comm.rank + 1) * count)
            tag = f"{dtype} {op} count={count}"
            failures.expect_equal(C.all_reduce(x, comm, op, "pairwise"), want, f"pairwise all_reduce {tag}")
            failures.expect_equal(C.reduce_scatter(x, comm, op, "pairwise"), want[block],
                                  f"pairwise reduce_scatter {tag}")
            failures.expect_equal(C.all_reduce_async(x, comm, op, "pairwise").wait(), want,
                                  f"pairwise all_reduce_async {tag}")
            in_place = x.copy()
            C.all_reduce(in_place, comm, op, "pairwise", out=in_place)
            failures.expect_equal(in_place, want, f"pairwise all_reduce out=x {tag}")
            if dtype != np.float32 and op in ("sum", "avg"):
                failures.expect_equal(C.all_reduce(x, comm, op), want, f"auto all_reduce {tag}")
                failures.expect_equal(C.reduce_scatter(x, comm, op), want[block], f"auto reduce_scatter {tag}")
    return failures
