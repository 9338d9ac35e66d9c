"""The public collectives: argument checks, algorithm choice, and dispatch to the hand-written algorithms.

Each function takes an array (NumPy or CuPy) and a `Communicator` (or a raw mpi4py communicator), leaves its
input untouched unless `out=` is given, and returns a new array of the same backend and dtype. `algo` names a
hand-written algorithm, "mpi" for the MPI library's own collective (the reference), or "auto" for the one the
α-β-γ cost model predicts fastest for this message size and rank count (`cost_model`).

Datatypes: every collective moves any dtype; reductions take integers and floats, bfloat16 included (bfloat16
is a dtype the backend knows: `backend`). Each binary reduction of 16-bit floats is computed in float32 and
rounded once, so an algorithm whose partial results travel (ring, trees, halving) rounds at every hop; the
pairwise algorithms send the inputs and round each element once (`pairwise`), and algo="auto" picks them for
sums and averages of bfloat16 and float16 (`cost_model.precision_choice`). algo="mpi" with bfloat16, which MPI
has no datatype for, is the reference of `native`.

The communicator's settings apply to every call: with `check_arguments` (MPIPARALLEL_CHECK=1) each call first
compares its arguments (shape, dtype, op, algo, root) across ranks and raises a clear `CollectiveMismatchError`
on all ranks instead of hanging or corrupting data (and `check_messages` does the same for a phase of
point-to-point messages, such as a pipeline step's); the pipelined algorithms cut messages at its
`segment_bytes` (MPIPARALLEL_SEGMENT_BYTES). See `Communicator`.

The common path is kept lean because a small collective takes a few microseconds: the local checks and the
algorithm choice run once per kind of call (`_Plan`, cached on the communicator), and `Communicator.run`
drives the steps with one MPI call each. What remains per call on two ranks is about 2-3 µs of Python
(the plan lookup, the output check, the step generator, the ledger) around each MPI message.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from . import native
from .arguments import (
    check_has_axis,
    check_root,
    check_rows_split_evenly,
    check_send_counts,
    flat,
    output_array,
    row_offsets,
)
from .backend import Array, get_array_module, is_floating, needs_words
from .blocks import OPS, check_op, finish_average, reducer
from .bruck import bruck_all_gather, bruck_all_to_all
from .communicator import CollectiveHandle, Communicator, Steps, in_words, tracked
from .cost_model import auto_algorithm, precision_choice
from .flight import Call
from .hierarchical import hierarchical_all_gather, hierarchical_all_reduce, hierarchical_reduce_scatter
from .mpi import MPI
from .pairwise import pairwise_all_reduce, pairwise_all_to_all, pairwise_all_to_allv, pairwise_reduce_scatter
from .recursive import (
    rabenseifner_all_reduce,
    recursive_doubling_all_gather,
    recursive_doubling_all_reduce,
    recursive_halving_reduce_scatter,
)
from .ring import ring_all_gather, ring_all_reduce, ring_reduce_scatter
from .tree import binomial_broadcast, binomial_reduce, rabenseifner_reduce, scatter_allgather_broadcast

ALGORITHMS: dict[str, dict[str, Callable[..., Steps] | None]] = {
    "all_reduce": {"ring": ring_all_reduce, "recursive_doubling": recursive_doubling_all_reduce,
                   "rabenseifner": rabenseifner_all_reduce, "hierarchical": hierarchical_all_reduce,
                   "pairwise": pairwise_all_reduce, "mpi": None},
    "reduce_scatter": {"ring": ring_reduce_scatter, "recursive_halving": recursive_halving_reduce_scatter,
                       "hierarchical": hierarchical_reduce_scatter, "pairwise": pairwise_reduce_scatter, "mpi": None},
    "all_gather": {"ring": ring_all_gather, "recursive_doubling": recursive_doubling_all_gather,
                   "bruck": bruck_all_gather, "hierarchical": hierarchical_all_gather, "mpi": None},
    "all_to_all": {"pairwise": pairwise_all_to_all, "bruck": bruck_all_to_all, "mpi": None},
    "all_to_allv": {"pairwise": None, "mpi": None},
    "broadcast": {"binomial": binomial_broadcast, "scatter_allgather": scatter_allgather_broadcast, "mpi": None},
    "reduce": {"binomial": binomial_reduce, "rabenseifner": rabenseifner_reduce, "mpi": None},
}
"""Valid `algo` names per collective ("auto" is valid everywhere)."""

EXTRA_ARGUMENTS: dict[Callable[..., Steps], tuple[str, ...]] = {
    ring_all_reduce: ("segment_bytes",),
    rabenseifner_all_reduce: ("segment_bytes",),
    hierarchical_all_reduce: ("layout", "segment_bytes"),
    pairwise_all_reduce: ("average_over", "segment_bytes"),
    ring_reduce_scatter: ("segment_bytes",),
    recursive_halving_reduce_scatter: ("segment_bytes",),
    hierarchical_reduce_scatter: ("layout", "segment_bytes"),
    pairwise_reduce_scatter: ("average_over", "segment_bytes"),
    ring_all_gather: ("segment_bytes",),
    recursive_doubling_all_gather: ("segment_bytes",),
    hierarchical_all_gather: ("layout", "segment_bytes"),
    scatter_allgather_broadcast: ("segment_bytes",),
    rabenseifner_reduce: ("segment_bytes",),
}
"""What a hand-written algorithm takes after (x, out, rank, size[, root][, reduce]), in this order: `average_over`
(it divides before its one rounding, pairwise, instead of after), `layout` (where the ranks live: the hierarchical
algorithms), `segment_bytes` (the pipelining segment of the algorithms that cut their blocks). Any other function
(the rest, or one put in `ALGORITHMS` in their place) takes none."""


class CollectiveMismatchError(ValueError):
    """Ranks called a collective with arguments that do not agree (raised on every rank, with check_arguments)."""


def algorithms(collective: str) -> list[str]:
    """The `algo` values `collective` accepts."""
    return ["auto", *ALGORITHMS[collective]]


# -- the collectives ----------------------------------------------------------------------------------------

def all_reduce(x: Array, comm: Any, op: str = "sum", algo: str = "auto", out: Array | None = None) -> Array:
    """Elementwise reduction of `x` over all ranks; any shape and size."""
    return _collective("all_reduce", x, comm, op, algo, out, False)


def all_reduce_async(x: Array, comm: Any, op: str = "sum", algo: str = "auto",
                     out: Array | None = None) -> CollectiveHandle:
    """Start `all_reduce`; `handle.test()` progresses it, `handle.wait()` returns the result."""
    return _collective("all_reduce", x, comm, op, algo, out, True)


def reduce_scatter(x: Array, comm: Any, op: str = "sum", algo: str = "auto", out: Array | None = None) -> Array:
    """Reduce `x` over ranks and return block `rank` of its `size` equal blocks along axis 0."""
    return _collective("reduce_scatter", x, comm, op, algo, out, False)


def reduce_scatter_async(x: Array, comm: Any, op: str = "sum", algo: str = "auto",
                         out: Array | None = None) -> CollectiveHandle:
    """Start `reduce_scatter`; `handle.wait()` returns this rank's reduced block."""
    return _collective("reduce_scatter", x, comm, op, algo, out, True)


def all_gather(x: Array, comm: Any, algo: str = "auto", out: Array | None = None) -> Array:
    """Concatenate every rank's `x` (all the same shape) along axis 0, in rank order."""
    return _collective("all_gather", x, comm, None, algo, out, False)


def all_gather_async(x: Array, comm: Any, algo: str = "auto", out: Array | None = None) -> CollectiveHandle:
    """Start `all_gather`; `handle.wait()` returns the concatenation."""
    return _collective("all_gather", x, comm, None, algo, out, True)


def all_to_all(x: Array, comm: Any, algo: str = "auto", out: Array | None = None) -> Array:
    """Block j of `x` along axis 0 goes to rank j; returns the blocks received, ordered by source rank."""
    return _collective("all_to_all", x, comm, None, algo, out, False)


def all_to_allv(x: Array, send_counts: Sequence[int], comm: Any, algo: str = "auto") -> tuple[Array, list[int]]:
    """Rows x[sum(send_counts[:j]) : sum(send_counts[:j+1])] go to rank j.

    Returns (rows received, ordered by source rank; recv_counts, the number of rows from each rank).
    """
    comm = Communicator.of(comm)
    algo = _checked_algorithm(comm, "all_to_allv", x, None, algo)  # not planned: row counts vary call to call
    if comm.check_arguments:
        _check_agreement(comm, "all_to_allv", x, None, algo, 0)
    if algo == "auto":
        algo = "pairwise"
    send_counts = check_send_counts(send_counts, x, comm.size)
    recv_counts = [int(c) for c in all_to_all(np.asarray(send_counts, np.int64), comm,
                                              algo="mpi" if algo == "mpi" else "pairwise")]
    xp, row = get_array_module(x), int(np.prod(x.shape[1:], dtype=np.int64))
    out = xp.empty((sum(recv_counts), *x.shape[1:]), x.dtype)
    src, dst = flat(x), out.reshape(-1)
    call = comm.flight.open("all_to_allv", algo, x.dtype, x.size, x.nbytes)
    if algo == "mpi":
        native.mpi_all_to_allv(src, [c * row for c in send_counts], dst, [c * row for c in recv_counts], comm.comm)
        _close(call)
    else:
        steps = pairwise_all_to_allv(src, row_offsets(send_counts, row), dst, row_offsets(recv_counts, row),
                                     comm.rank, comm.size)
        comm.run(tracked(in_words(steps) if needs_words(x.dtype) else steps, call), "all_to_allv")
    return out, recv_counts


def broadcast(x: Array, comm: Any, root: int = 0, algo: str = "auto", out: Array | None = None) -> Array:
    """Every rank returns root's `x`; the others' `x` only gives the shape and dtype (as in MPI_Bcast)."""
    comm = comm if isinstance(comm, Communicator) else Communicator.of(comm)
    plan = _plan(comm, "broadcast", x, None, algo, root, False)
    out = output_array(x, out, plan.out_shape)
    buf = out.ravel()  # flat(out), inlined here and below: a call costs a visible share of a small collective
    if comm.rank == root and out is not x:
        buf[...] = x.ravel()
    call = comm.flight.open("broadcast", plan.algo, x.dtype, x.size, x.nbytes, root)
    if plan.native:
        plan.algorithm(buf, *plan.arguments)
    elif plan.algorithm is not None:
        comm.run(tracked(plan.steps(buf), call), "broadcast")
        return out
    _close(call)
    return out


def reduce(x: Array, comm: Any, root: int = 0, op: str = "sum", algo: str = "auto",
           out: Array | None = None) -> Array | None:
    """Reduction of `x` over ranks, returned on `root`; other ranks return None (their `out`, if given, is
    used as scratch space)."""
    comm = comm if isinstance(comm, Communicator) else Communicator.of(comm)
    plan = _plan(comm, "reduce", x, op, algo, root, False)
    result = output_array(x, out, plan.out_shape)  # off the root it is the accumulator the tree algorithms need
    src, dst = x.ravel(), result.ravel()
    call = comm.flight.open("reduce", plan.algo, x.dtype, x.size, x.nbytes, root)
    if plan.native:
        plan.algorithm(src, dst, *plan.arguments)
    elif plan.algorithm is not None:
        comm.run(tracked(plan.steps(src, dst), call), "reduce")
        call = None  # closed by its steps
    else:
        dst[...] = src
    _close(call)
    return result if comm.rank == root else None


# -- shared machinery ---------------------------------------------------------------------------------------

_NATIVE: dict[str, Callable[..., None]] = {
    "all_reduce": native.mpi_all_reduce, "reduce_scatter": native.mpi_reduce_scatter,
    "all_gather": native.mpi_all_gather, "all_to_all": native.mpi_all_to_all,
    "broadcast": native.mpi_broadcast, "reduce": native.mpi_reduce}


def _collective(name: str, x: Array, comm: Any, op: str | None, algo: str, out: Array | None,
                asynchronous: bool) -> Any:
    """Run one of the unrooted collectives: all_reduce, reduce_scatter, all_gather, all_to_all.

    Returns the result array, or a CollectiveHandle whose wait() returns it when `asynchronous`.
    """
    comm = comm if isinstance(comm, Communicator) else Communicator.of(comm)
    plan = _plan(comm, name, x, op, algo, 0, asynchronous)
    out = output_array(x, out, plan.out_shape)
    src, dst = x.ravel(), out.ravel()
    call = comm.flight.open(name, plan.algo, x.dtype, x.size, x.nbytes)
    if plan.native:
        plan.algorithm(src, dst, *plan.arguments)
    elif plan.algorithm is None:  # one rank, or nothing to send
        dst[...] = src
        if asynchronous:
            return comm.start(tracked(iter(()), call), name, out, call)
    elif asynchronous:
        return comm.start(tracked(plan.steps(src, dst), call), name, out, call)
    else:
        comm.run(tracked(plan.steps(src, dst), call), name)
        return out
    _close(call)
    return out


def _close(call: Call | None) -> None:
    """Close a flight-recorder call that ran without steps (MPI's own collective, or nothing to send)."""
    if call is not None:
        call.close()


class _Plan:
    """How calls of one kind run on one communicator, worked out (arguments checked, algorithm chosen) once.

    A kind is (collective, op, algo, dtype, shape, root, array type, async or not): every call of a kind
    passes the same checks and runs the same algorithm, so later calls only look their plan up. On a message
    of a few bytes the checks and the choice would otherwise cost as much time as the message itself.
    `algorithm` is None when there is nothing to communicate (one rank, or no elements).
    """

    __slots__ = ("algo", "out_shape", "native", "algorithm", "arguments", "average_over", "in_words")

    def __init__(self, comm: Communicator, name: str, x: Array, op: str | None, algo: str, root: int) -> None:
        self.algo = algo
        self.native = algo == "mpi" and comm.size > 1 and x.size > 0
        self.out_shape = _result_shape(name, tuple(x.shape), comm.size)
        self.average_over = comm.size if op == "avg" and (name != "reduce" or comm.rank == root) else 0
        self.in_words = needs_words(x.dtype)  # bfloat16: MPI sees 16-bit words
        rooted = (root,) if name in _ROOTED else ()
        if comm.size == 1 or x.size == 0:
            self.algorithm, self.arguments = None, ()
        elif algo == "mpi":
            self.algorithm = _NATIVE[name]
            self.arguments = (comm.comm, *rooted, *(() if op is None else (op,)))
        else:
            self.algorithm = ALGORITHMS[name][algo]
            self.arguments = (comm.rank, comm.size, *rooted, *(() if op is None else (reducer(op, x),)))
            extra = EXTRA_ARGUMENTS.get(self.algorithm, ())
            if "average_over" in extra:  # it divides before its one rounding (pairwise), not after
                self.arguments += (self.average_over,)
                self.average_over = 0
            if "layout" in extra:
                self.arguments += (comm.topology,)
            if "segment_bytes" in extra:
                self.arguments += (comm.segment_bytes,)

    def steps(self, *buffers: Array) -> Steps:
        """The hand-written algorithm's steps on these buffers (then the division, for op="avg")."""
        steps = self.algorithm(*buffers, *self.arguments)
        if self.in_words:
            steps = in_words(steps)
        return _then_divide(steps, buffers[-1], self.average_over) if self.average_over else steps


_MAX_PLANS = 4096  # shapes that change from call to call must not grow the cache without bound
_ROOTED = ("broadcast", "reduce")


def _plan(comm: Communicator, name: str, x: Array, op: str | None, algo: str, root: int,
          asynchronous: bool) -> _Plan:
    """The plan of this call's kind, made on the kind's first call; then, with check_arguments, the
    cross-rank comparison that no cache can replace."""
    key = (name, op, algo, x.dtype, x.shape, root, type(x), asynchronous)
    plan = comm.call_plans.get(key)
    if plan is None:
        resolved = _checked_algorithm(comm, name, x, op, algo, root=root, asynchronous=asynchronous)
        if len(comm.call_plans) >= _MAX_PLANS:
            comm.call_plans.clear()
        plan = comm.call_plans[key] = _Plan(comm, name, x, op, resolved, root)
    if comm.check_arguments:
        _check_agreement(comm, name, x, op, algo, root)
    return plan


def _result_shape(name: str, shape: tuple, size: int) -> tuple:
    if name == "reduce_scatter" and shape:
        return (shape[0] // size, *shape[1:])
    if name == "all_gather" and shape:
        return (shape[0] * size, *shape[1:])
    return shape


def _then_divide(steps: Steps, result: Array, size: int) -> Steps:
    """The algorithm's steps, then the one division that turns a sum into an average (op="avg")."""
    yield from steps
    finish_average(result, size)


_MAX_DIMS = 8


_SPLIT_ALONG_AXIS0 = ("reduce_scatter", "all_to_all")  # x.shape[0] must divide by the rank count
_ANY_SHAPE = ("all_reduce", "broadcast", "reduce")  # 0-d arrays too: nothing is split or concatenated


def _checked_algorithm(comm: Communicator, name: str, x: Array, op: str | None, algo: str, *, root: int = 0,
                       asynchronous: bool = False) -> str:
    """Check the arguments of one call (on this rank) and return the algorithm to run (resolving "auto")."""
    valid = ALGORITHMS[name]
    if name in _ROOTED:
        check_root(root, comm.size)
    if algo != "auto" and algo not in valid:
        raise ValueError(f"{name} has no algorithm {algo!r}; valid: {', '.join(algorithms(name))}")
    if asynchronous and algo == "mpi":
        raise ValueError(f"{name}_async runs the hand-written algorithms only; "
                         f"valid: {', '.join(a for a in algorithms(name) if a != 'mpi')}")
    if op is not None:
        check_op(op)
        if x.dtype.kind not in "iu" and not is_floating(x.dtype):
            raise ValueError(f"{name} reduces float (bfloat16 included) and integer arrays; got dtype {x.dtype}")
    if name in _SPLIT_ALONG_AXIS0:
        check_rows_split_evenly(x, comm.size, name)
    elif name not in _ANY_SHAPE:
        check_has_axis(x, name)
    if algo != "auto" or name == "all_to_allv":
        return algo
    if comm.size == 1:
        return next(iter(valid))
    return precision_choice(name, x.dtype, op) or auto_algorithm(comm, name,
                                                                 x.nbytes * (comm.size if name == "all_gather" else 1))


_DTYPE_OF_CHAR = {np.dtype(name).char: name for name in (
    "bool", "int8", "uint8", "int16", "uint16", "int32", "uint32", "int64", "uint64", "float16", "float32", "float64",
    "bfloat16", "complex64", "complex128")}
"""A dtype's one-letter code (what check_arguments gathers) -> its name; bfloat16's is "E", not a NumPy code."""


def _describe(row: np.ndarray) -> str:
    name = list(ALGORITHMS)[row[0]]
    ndim = int(row[4])
    shape = tuple(int(d) if d >= 0 else "*" for d in row[6:6 + ndim])
    op = OPS[row[1]] if row[1] >= 0 else None
    algo = algorithms(name)[row[2]]
    parts = [f"shape={shape}", f"dtype={_DTYPE_OF_CHAR.get(chr(int(row[3])), chr(int(row[3])))}"]
    if op:
        parts.append(f"op={op}")
    parts += [f"algo={algo}", f"root={int(row[5])}"]
    return f"{name}({', '.join(parts)})"


def _check_agreement(comm: Communicator, name: str, x: Array, op: str | None, algo: str, root: int) -> None:
    """Gather every rank's description of this call and raise on all ranks if they differ."""
    if x.ndim > _MAX_DIMS:
        raise ValueError(f"check_arguments (MPIPARALLEL_CHECK) supports arrays of up to {_MAX_DIMS} dimensions")
    row = np.full(6 + _MAX_DIMS, -1, np.int64)
    row[:6] = (list(ALGORITHMS).index(name), OPS.index(op) if op else -1, algorithms(name).index(algo),
               ord(x.dtype.char), x.ndim, root)
    row[6:6 + x.ndim] = x.shape
    if name == "all_to_allv" and x.ndim:  # row counts legitimately differ
        row[6] = -1
    rows = np.empty((comm.size, row.size), np.int64)
    comm.comm.Allgather(row, rows)
    if (rows == rows[0]).all():
        return
    lines = [f"  rank {r}: {_describe(rows[r])}" for r in range(comm.size)]
    raise CollectiveMismatchError(f"ranks disagree on a {name} call (check_arguments, MPIPARALLEL_CHECK=1):\n"
                                  + "\n".join(lines))


@dataclass(frozen=True)
class Message:
    """One point-to-point message a rank means to send or receive: "send" or "recv", the peer (a rank of the
    communicator), the tag, and the shape and dtype name of the array."""

    direction: str
    peer: int
    tag: int
    shape: tuple[int, ...]
    dtype: str

    def describe(self) -> str:
        return f"{'×'.join(map(str, self.shape)) or 'scalar'} {self.dtype}"


_SHOWN_PROBLEMS = 6


def check_messages(comm: Communicator, messages: Sequence[Message], what: str = "point-to-point messages") -> None:
    """Check that the sends and receives every rank of `comm` means to make (`messages`, this rank's) pair up: each
    send from rank s to rank d with tag t meets a receive on d from s with tag t, of the same shape and dtype, and
    the other way round. One all-gather of the plans (a few bytes per message); on a mismatch every rank raises
    the same `CollectiveMismatchError`, naming each unpaired or mismatched message — before any of them moves,
    where unchecked they would hang (a send nobody receives, a receive nobody sends) or corrupt (a size that
    differs)."""
    plans = comm.allgather_objects([(m.direction, m.peer, m.tag, tuple(m.shape), m.dtype) for m in messages])
    sent: dict[tuple[int, int, int], list[Message]] = {}
    received: dict[tuple[int, int, int], list[Message]] = {}
    for rank, plan in enumerate(plans):
        for message in (Message(*row) for row in plan):
            if message.direction == "send":
                sent.setdefault((rank, message.peer, message.tag), []).append(message)
            else:
                received.setdefault((message.peer, rank, message.tag), []).append(message)
    problems = [problem for key in sorted(set(sent) | set(received))
                for problem in _unpaired(key, sent.get(key, []), received.get(key, []))]
    if problems:
        shown = problems[:_SHOWN_PROBLEMS] + ([f"… and {len(problems) - _SHOWN_PROBLEMS} more"]
                                             if len(problems) > _SHOWN_PROBLEMS else [])
        where = f" on {comm.label}" if comm.label else ""
        raise CollectiveMismatchError(f"{what}{where} do not pair up (check_arguments, MPIPARALLEL_CHECK=1):\n"
                                      + "\n".join(f"  {line}" for line in shown))


def _unpaired(key: tuple[int, int, int], sends: list[Message], receives: list[Message]) -> list[str]:
    """What is wrong with the messages of one (source, destination, tag), in the order each side lists them."""
    source, dest, tag = key
    problems = []
    for send, receive in zip(sends, receives, strict=False):  # the extras of either side: below
        if (send.shape, send.dtype) != (receive.shape, receive.dtype):
            problems.append(f"rank {source} sends rank {dest} tag {tag} as {send.describe()}; rank {dest} receives "
                            f"it into {receive.describe()}")
    for send in sends[len(receives):]:
        problems.append(f"rank {source} sends rank {dest} tag {tag} ({send.describe()}) that rank {dest} never "
                        f"receives")
    for receive in receives[len(sends):]:
        problems.append(f"rank {dest} receives tag {tag} from rank {source} ({receive.describe()}) that rank "
                        f"{source} never sends")
    return problems


def world() -> Communicator:
    """The Communicator of MPI.COMM_WORLD."""
    return Communicator.of(MPI.COMM_WORLD)
