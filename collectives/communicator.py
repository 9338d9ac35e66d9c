"""Communicator: point-to-point messages on arrays, a byte ledger, and the engine that runs collectives.

Every collective algorithm in this package is a generator of `Step`s: "send this array to rank d and/or
receive into that array from rank s". The algorithm never touches MPI itself; between two steps it does its
local work (reductions, copies). Two drivers execute the steps:

- `Communicator.run(steps)` — synchronous: one blocking `MPI_Sendrecv` (or `Send`/`Recv`) per step.
- `CollectiveHandle` — asynchronous: each step is posted as nonblocking `Isend`/`Irecv`; `test()` checks the
  posted requests and, when they are complete, runs the algorithm's local work and posts the next step;
  `wait()` does the same until the end.

How asynchronous progress happens: MPICH and Open MPI move a message only while some MPI call is running on
that rank (unless an asynchronous progress thread is configured, which on two cores costs far more than it
saves). So a handle advances when its owner calls `test()` or `wait()`; calling `test()` between the layers of
a backward pass lets the next step of each in-flight collective start while later layers compute. Small
messages go out eagerly as soon as they are posted; large ones need both sides inside MPI.

Tags. Each collective call takes a fresh tag from a per-communicator sequence (`collective_tag`). Ranks
call collectives in the same order (an MPI rule), so they agree on tags without talking, and several
asynchronous collectives in flight on one communicator never match each other's messages. User
point-to-point messages should use tags below `FIRST_COLLECTIVE_TAG`.

Datatypes. Messages are raw bytes (MPI.BYTE), whatever the dtype. Arrays whose dtype mpi4py cannot export
(bfloat16) travel as unsigned words of their size: the point-to-point calls view them so, and the collectives
hand `run` and `start` steps already in that form (`in_words`); the ledger counts 2 bytes per bfloat16.

Every byte sent or received through this class is recorded in `ledger`, under the name of the operation
that is running (`all_reduce`, `reduce_scatter`, ..., or `p2p` for direct calls); bytes sent to a rank on
another node are counted a second time apart (`ledger.inter_node_sent()`). A communicator knows the node of each
of its ranks (`nodes`, `topology`: see `collectives.topology`), found when it is built: one small all-gather.

Failures. Under an MPI with fault tolerance (ULFM), an MPI call that fails because a peer died, or because another
rank revoked the communicator on seeing that, revokes every communicator of this process and raises
`faults.PeerFailure`, on every survivor; `shrink()` then gives the survivors' communicator (see `faults`).

Settings. A communicator carries the two settings the collectives run with, `check_arguments` and
`segment_bytes` (see `Communicator`); the algorithms read them from the communicator they are given, never
from the environment.
"""

from __future__ import annotations

import os
import time
from collections import defaultdict
from collections.abc import Callable, Generator
from typing import Any

from . import faults
from .backend import Array, HostStaging, as_words
from .faults import raising_peer_failure
from .flight import Call, FlightRecorder, recorded_calls
from .mpi import MPI
from .topology import NodeLayout, emulated_inter_node_link, node_labels

FIRST_COLLECTIVE_TAG = 1 << 14
_COLLECTIVE_TAG_SPAN = 1 << 14  # MPI guarantees tags up to at least 32767

CHECK_ARGUMENTS_VARIABLE = "MPIPARALLEL_CHECK"
SEGMENT_BYTES_VARIABLE = "MPIPARALLEL_SEGMENT_BYTES"

DEFAULT_SEGMENT_BYTES = 1 << 20
"""Largest message the pipelined algorithms send at once, unless a communicator says otherwise.

Large single messages are slow on shared memory (the copy streams through buffers far bigger than the cache);
cutting a block into cache-sized segments and reducing each right after it arrives keeps the data in cache.
Measured here: one 32 MiB Sendrecv ran at 3 GB/s, the same bytes in 1-4 MiB pieces near 10 GB/s.
"""


EMULATED_POLL_SECONDS = 20e-6
"""How long a wait sleeps between tests while MPIPARALLEL_EMULATED_INTER_NODE is set (Linux rounds it up to
some tens of microseconds: the emulated transport's own latency, which calibration measures with the rest)."""


class Step:
    """One round of an algorithm: an optional send of `send` to `dest` and receive into `recv` from `source`."""

    __slots__ = ("send", "dest", "recv", "source")

    def __init__(self, send: Array | None = None, dest: int = -1,
                 recv: Array | None = None, source: int = -1) -> None:
        self.send, self.dest, self.recv, self.source = send, dest, recv, source

    def __repr__(self) -> str:
        parts = []
        if self.send is not None:
            parts.append(f"send {self.send.nbytes} B -> {self.dest}")
        if self.recv is not None:
            parts.append(f"recv {self.recv.nbytes} B <- {self.source}")
        return f"Step({', '.join(parts)})"


Steps = Generator[Step, None, None]


class Ledger:
    """Bytes and messages sent and received, per operation name, and the bytes of them sent to another node.
    Reset with `reset()`."""

    def __init__(self) -> None:
        self.sent: dict[str, int] = defaultdict(int)
        self.received: dict[str, int] = defaultdict(int)
        self.messages: dict[str, int] = defaultdict(int)
        self.inter_node: dict[str, int] = defaultdict(int)
        self.operation = "p2p"

    def record(self, name: str, sent: int, received: int, inter_node: int = 0) -> None:
        self.sent[name] += sent
        self.received[name] += received
        if sent:
            self.messages[name] += 1
        if inter_node:
            self.inter_node[name] += inter_node

    def total_sent(self) -> int:
        return sum(self.sent.values())

    def inter_node_sent(self, name: str | None = None) -> int:
        """Bytes sent to ranks on other nodes: all operations, or the one named."""
        return sum(self.inter_node.values()) if name is None else self.inter_node.get(name, 0)

    def intra_node_sent(self, name: str | None = None) -> int:
        """Bytes sent to ranks on this rank's node."""
        sent = self.total_sent() if name is None else self.sent.get(name, 0)
        return sent - self.inter_node_sent(name)

    def total_received(self) -> int:
        return sum(self.received.values())

    def reset(self) -> None:
        self.sent.clear()
        self.received.clear()
        self.messages.clear()
        self.inter_node.clear()

    def as_dict(self) -> dict[str, dict[str, int]]:
        return {name: {"sent": self.sent[name], "received": self.received[name],
                       "messages": self.messages[name], "inter_node_sent": self.inter_node[name]}
                for name in sorted(set(self.sent) | set(self.received))}


def _check_arguments_from_environment() -> bool:
    return os.environ.get(CHECK_ARGUMENTS_VARIABLE, "0") not in ("", "0")


def _segment_bytes_from_environment() -> int:
    return int(os.environ.get(SEGMENT_BYTES_VARIABLE, DEFAULT_SEGMENT_BYTES))


def _byte_buffer(x: Array) -> list:
    """mpi4py buffer spec that sends the array's raw bytes (every dtype, NumPy or CUDA-aware CuPy; bfloat16 as
    16-bit words, which mpi4py can export)."""
    return [as_words(x), MPI.BYTE]


def world_ranks(comm: MPI.Comm) -> tuple[int, ...]:
    """The world rank of each rank of `comm`, in `comm`'s order."""
    return tuple(MPI.Group.Translate_ranks(comm.Get_group(), list(range(comm.Get_size())),
                                           MPI.COMM_WORLD.Get_group()))


def tracked(steps: Steps, call: Call | None) -> Steps:
    """`steps` unchanged, telling the flight recorder's `call` which step runs and with which peers (-1: no send
    or no receive), and closing it when the steps run out — after the last one completed."""
    if call is None:
        yield from steps
        return
    for index, step in enumerate(steps):
        call.step, call.dest = index, -1 if step.send is None else step.dest
        call.source = -1 if step.recv is None else step.source
        yield step
    call.close()


def in_words(steps: Steps) -> Steps:
    """`steps` with every buffer viewed as unsigned words (`backend.as_words`): the form in which arrays of a
    dtype MPI cannot take (bfloat16) travel. The algorithm keeps its typed views for its local work."""
    for step in steps:
        yield Step(None if step.send is None else as_words(step.send), step.dest,
                   None if step.recv is None else as_words(step.recv), step.source)


class Communicator:
    """An mpi4py communicator with array point-to-point calls, a byte ledger and a collective tag sequence.

    Build one per process group and pass it explicitly (`Communicator(MPI.COMM_WORLD)`); `Communicator.of`
    returns the one cached on an mpi4py communicator, so functions that accept either reuse the same ledger.

    Settings of every collective run on it; each one left out is read from its environment variable when the
    communicator is built (later changes to the environment do not reach an existing communicator). Every rank
    must use the same values, and `split` passes both on to the sub-communicator:

    - `check_arguments` (MPIPARALLEL_CHECK=1; default off): every collective first compares its arguments
      (shape, dtype, op, algo, root) across ranks, at the cost of one small all-gather per call, and raises
      `CollectiveMismatchError` on all ranks instead of hanging or corrupting data.
    - `segment_bytes` (MPIPARALLEL_SEGMENT_BYTES; default 1 MiB, `DEFAULT_SEGMENT_BYTES`): the largest single
      message of the pipelined algorithms (ring, recursive halving and doubling, and the broadcast and reduce
      built on them); larger blocks travel in segments, each reduced as soon as it arrives.

    Nodes: `nodes[r]` is the node of rank r (world node numbers, so a sub-communicator's agree with the
    world's), `topology` their `NodeLayout`; `node` this rank's. `split` passes this rank's node on. With
    MPIPARALLEL_EMULATED_INTER_NODE set (benchmarks only), messages to other nodes are delayed (`topology`).
    """

    _keyval: int | None = None

    observer: Callable[[str, float, float, int], None] | None = None
    """Tracing hook, off (None) by default: when set, called as observer(name, start, end, bytes_sent) after
    each collective run by `run` or `start` has finished (times from time.perf_counter())."""

    def __init__(self, comm: MPI.Comm, *, check_arguments: bool | None = None,
                 segment_bytes: int | None = None, node: int | None = None) -> None:
        if isinstance(comm, Communicator):
            comm = comm.comm
        if not isinstance(comm, MPI.Comm):
            raise TypeError(f"Communicator needs an mpi4py communicator, got {type(comm).__name__}")
        self.comm = comm
        self.check_arguments = _check_arguments_from_environment() if check_arguments is None else check_arguments
        self.segment_bytes = _segment_bytes_from_environment() if segment_bytes is None else segment_bytes
        self.rank = comm.Get_rank()
        self.size = comm.Get_size()
        self.ledger = Ledger()
        self._next_tag = 0
        self.cost_model: Any = None  # set lazily by collectives.cost_model (same on every rank)
        self.auto_choices: dict[tuple[str, int], str] = {}  # (collective, bytes) -> algorithm, for algo="auto"
        self.call_plans: dict[tuple, Any] = {}  # how each kind of collective call runs (collectives.api)
        self.nodes = node_labels(comm, node)
        self.node = self.nodes[self.rank]
        self.topology = NodeLayout.of(self.nodes)
        # per destination rank: does a message to it leave this node (None: every rank is on this node)
        self.remote = tuple(n != self.node for n in self.nodes) if self.topology.spans_nodes else None
        link = emulated_inter_node_link() if self.remote is not None else None
        self.emulated_link = link
        members = world_ranks(comm)
        self.flight = FlightRecorder(recorded_calls(), members=members, rank=self.rank)
        self.p2p_flight = FlightRecorder(recorded_calls(), members=members, rank=self.rank, point_to_point=True)
        faults.hold(self)  # revoked with the others when a peer fails (`faults`)

    @classmethod
    def of(cls, comm: MPI.Comm | Communicator) -> Communicator:
        """The Communicator for `comm`, created once and cached on the MPI communicator (MPI attribute)."""
        if isinstance(comm, Communicator):
            return comm
        if cls._keyval is None:
            cls._keyval = MPI.Comm.Create_keyval()
        cached = comm.Get_attr(cls._keyval)
        if cached is None:
            cached = cls(comm)
            comm.Set_attr(cls._keyval, cached)
        return cached

    def __repr__(self) -> str:
        return f"Communicator(rank={self.rank}, size={self.size})"

    # -- point to point ---------------------------------------------------------------------------------

    @raising_peer_failure
    def send(self, x: Array, dest: int, tag: int = 0) -> None:
        """Blocking send of a contiguous array's bytes."""
        staging = HostStaging()
        self._delay(x.nbytes, dest)
        self.comm.Send(_byte_buffer(staging.outgoing(x)), dest, tag)
        self.ledger.record(self.ledger.operation, x.nbytes, 0, self._inter_node(x.nbytes, dest))

    @raising_peer_failure
    def recv(self, out: Array, source: int, tag: int = 0) -> Array:
        """Blocking receive into the contiguous array `out` (its size must match the message); returns it."""
        staging = HostStaging()
        self.comm.Recv(_byte_buffer(staging.incoming(out)), source, tag)
        staging.finish()
        self.ledger.record(self.ledger.operation, 0, out.nbytes)
        return out

    def sendrecv(self, x: Array, dest: int, out: Array, source: int, tag: int = 0) -> Array:
        """Send `x` to `dest` while receiving into `out` from `source`; returns `out`."""
        self.run_step(Step(x, dest, out, source), tag)
        return out

    @raising_peer_failure
    def isend(self, x: Array, dest: int, tag: int = 0) -> MPI.Request:
        """Nonblocking send; keep `x` unchanged until the request completes."""
        self._delay(x.nbytes, dest)
        request = self.comm.Isend(_byte_buffer(HostStaging().outgoing(x)), dest, tag)
        self.ledger.record(self.ledger.operation, x.nbytes, 0, self._inter_node(x.nbytes, dest))
        return request

    @raising_peer_failure
    def irecv(self, out: Array, source: int, tag: int = 0) -> MPI.Request:
        """Nonblocking receive into `out` (host arrays, or device arrays with CUDA-aware MPI)."""
        if HostStaging.needed(out):
            raise ValueError("irecv into a GPU array needs CUDA-aware MPI; use recv or a collective instead")
        request = self.comm.Irecv(_byte_buffer(out), source, tag)
        self.ledger.record(self.ledger.operation, 0, out.nbytes)
        return request

    @property
    def label(self) -> str:
        """What the flight recorder's dumps call this communicator (a mesh axis: "tp", "dp", …; "" for none)."""
        return self.flight.label

    @label.setter
    def label(self, label: str) -> None:
        self.flight.label = self.p2p_flight.label = label

    def post_send(self, x: Array, dest: int, tag: int) -> Posted:
        """`isend`, kept in the point-to-point flight recorder until `Posted.wait` sees it complete (in the
        background until a wait on it begins: only then does the message hold this rank up)."""
        call = self.p2p_flight.open("send", "p2p", x.dtype, x.size, x.nbytes)
        if call is not None:
            call.dest, call.tag, call.background = dest, tag, True
        return Posted(self.isend(x, dest, tag), call)

    def post_recv(self, out: Array, source: int, tag: int) -> Posted:
        """`irecv`, kept in the point-to-point flight recorder until `Posted.wait` sees it complete (in the
        background until then, as for `post_send`)."""
        call = self.p2p_flight.open("recv", "p2p", out.dtype, out.size, out.nbytes)
        if call is not None:
            call.source, call.tag, call.background = source, tag, True
        return Posted(self.irecv(out, source, tag), call)

    @raising_peer_failure
    def barrier(self) -> None:
        self.comm.Barrier()

    # -- small agreements: MPI's own collectives on Python objects, kept in the flight recorder -----------------

    @raising_peer_failure
    def allgather_objects(self, value: Any) -> list[Any]:
        """Every rank's `value` (any picklable object), in rank order (for agreements: an error, a choice)."""
        call = self.flight.open("allgather_objects", "mpi", "object", 1, 0)
        gathered = self.comm.allgather(value)
        if call is not None:
            call.close()
        return gathered

    @raising_peer_failure
    def alltoall_objects(self, values: list[Any]) -> list[Any]:
        """`values[r]` to rank r (one picklable object each); returns what each rank sent this one, in rank order."""
        call = self.flight.open("alltoall_objects", "mpi", "object", len(values), 0)
        received = self.comm.alltoall(values)
        if call is not None:
            call.close()
        return received

    @raising_peer_failure
    def broadcast_object(self, value: Any, root: int = 0) -> Any:
        """`root`'s `value` (any picklable object) on every rank."""
        call = self.flight.open("broadcast_object", "mpi", "object", 1, 0, root)
        value = self.comm.bcast(value, root=root)
        if call is not None:
            call.close()
        return value

    @raising_peer_failure
    def split(self, color: int, key: int = 0, label: str = "") -> Communicator:
        """Sub-communicator of the ranks with the same `color`, ordered by `key` (MPI_Comm_split); `label` names
        it in the flight recorder's dumps (a mesh axis)."""
        sub = Communicator(self.comm.Split(color, key), check_arguments=self.check_arguments,
                           segment_bytes=self.segment_bytes, node=self.node)
        sub.label = label
        return sub

    def shrink(self) -> Communicator:
        """After a `faults.PeerFailure`: the survivors' communicator (MPI_Comm_shrink, an agreement on who is left
        that itself tolerates failures), with this one's settings and label; its ranks keep their order."""
        survivors = Communicator(self.comm.Shrink(), check_arguments=self.check_arguments,
                                 segment_bytes=self.segment_bytes, node=self.node)
        survivors.label = self.label
        return survivors

    def _emulated_step(self, send: Array | None, dest: int, recv: Array | None, source: int, tag: int) -> None:
        """One step over the emulated slow link: the receive posted first, the send delayed if it crosses nodes,
        then a wait that sleeps between tests instead of spinning — so that with more ranks than cores a rank
        whose delay is over finds a free core (MPI's spinning waits would hold them all), as on a network."""
        requests = [] if recv is None else [self.comm.Irecv([recv, MPI.BYTE], source, tag)]
        if send is not None:
            self._delay(send.nbytes, dest)
            requests.append(self.comm.Isend([send, MPI.BYTE], dest, tag))
        while not faults.test_all(requests):
            time.sleep(EMULATED_POLL_SECONDS)

    def _inter_node(self, nbytes: int, dest: int) -> int:
        """`nbytes` if a message to `dest` leaves this node, else 0."""
        return nbytes if self.remote is not None and self.remote[dest] else 0

    def _delay(self, nbytes: int, dest: int) -> None:
        """With an emulated slow link, wait as long as a message of `nbytes` to `dest` would take on it."""
        if self.emulated_link is not None and self.remote[dest]:
            latency, bandwidth = self.emulated_link
            time.sleep(latency + nbytes / bandwidth)

    # -- collective engine ------------------------------------------------------------------------------

    def collective_tag(self) -> int:
        tag = FIRST_COLLECTIVE_TAG + self._next_tag
        self._next_tag = (self._next_tag + 1) % _COLLECTIVE_TAG_SPAN
        return tag

    @raising_peer_failure
    def run_step(self, step: Step, tag: int) -> None:
        """Execute one step with blocking MPI calls and record its bytes."""
        send = None if step.send is None else as_words(step.send)
        recv = None if step.recv is None else as_words(step.recv)
        staging = HostStaging() if HostStaging.possible else None
        if staging is not None:
            send = None if send is None else staging.outgoing(send)
            recv = None if recv is None else staging.incoming(recv)
        if self.emulated_link is not None:
            self._emulated_step(send, step.dest, recv, step.source, tag)
        elif send is not None and recv is not None:
            self.comm.Sendrecv([send, MPI.BYTE], step.dest, tag, [recv, MPI.BYTE], step.source, tag)
        elif send is not None:
            self.comm.Send([send, MPI.BYTE], step.dest, tag)
        elif recv is not None:
            self.comm.Recv([recv, MPI.BYTE], step.source, tag)
        if staging is not None:
            staging.finish()
        self.ledger.record(self.ledger.operation, 0 if send is None else send.nbytes,
                           0 if recv is None else recv.nbytes, 0 if send is None else self._inter_node(send.nbytes,
                                                                                                        step.dest))

    def run(self, steps: Steps, name: str) -> None:
        """Run an algorithm's steps to completion with blocking calls, recording traffic under `name`.

        Host arrays (every array, when CuPy is absent) go straight to MPI and the ledger is updated once at the
        end: a small collective takes a few microseconds, and each Python call here is a visible share of them.
        """
        if self.observer is not None:
            steps = self._observed(steps, name)
        tag = FIRST_COLLECTIVE_TAG + self._next_tag  # collective_tag(), inlined
        self._next_tag = (self._next_tag + 1) % _COLLECTIVE_TAG_SPAN
        if HostStaging.possible or self.emulated_link is not None:
            self._run_staged(steps, name, tag)
            return
        comm, byte, remote = self.comm, MPI.BYTE, self.remote
        sent = received = messages = inter_node = 0
        try:
            for step in steps:
                send, recv = step.send, step.recv
                if send is None:
                    if recv is not None:
                        comm.Recv([recv, byte], step.source, tag)
                        received += recv.nbytes
                    continue
                if recv is None:
                    comm.Send([send, byte], step.dest, tag)
                else:
                    comm.Sendrecv([send, byte], step.dest, tag, [recv, byte], step.source, tag)
                    received += recv.nbytes
                if send.nbytes:
                    sent += send.nbytes
                    messages += 1
                    if remote is not None and remote[step.dest]:
                        inter_node += send.nbytes
        except MPI.Exception as error:
            faults.raise_if_peer_failed(error, name)
            raise
        ledger = self.ledger  # Ledger.record, inlined: a call costs a visible share of a small collective
        ledger.sent[name] += sent
        ledger.received[name] += received
        ledger.messages[name] += messages
        if inter_node:
            ledger.inter_node[name] += inter_node

    def _run_staged(self, steps: Steps, name: str, tag: int) -> None:
        """`run` when device arrays may appear (each step staged through host memory where MPI needs it), or when
        inter-node messages are delayed: one `run_step` per step."""
        ledger = self.ledger
        previous, ledger.operation = ledger.operation, name
        try:
            for step in steps:
                self.run_step(step, tag)
        finally:
            ledger.operation = previous

    @raising_peer_failure
    def start(self, steps: Steps, name: str, result: Any, call: Call | None = None) -> CollectiveHandle:
        """Start an algorithm with nonblocking calls; the handle's `wait()` returns `result` at the end. `call`,
        its flight-recorder record, is in the background until that wait."""
        if self.observer is not None:
            steps = self._observed(steps, name)
        if call is not None:
            call.background = True
        return CollectiveHandle(self, steps, name, result, call)

    def _observed(self, steps: Steps, name: str) -> Steps:
        """`steps` unchanged, reporting the collective's span and bytes sent to `observer` once they run out."""
        start, sent = time.perf_counter(), 0
        for step in steps:
            sent += 0 if step.send is None else step.send.nbytes
            yield step
        self.observer(name, start, time.perf_counter(), sent)


class Posted:
    """A point-to-point message in flight: its MPI request and its flight-recorder call (None: recording off)."""

    __slots__ = ("request", "call", "__weakref__")

    def __init__(self, request: MPI.Request, call: Call | None) -> None:
        self.request, self.call = request, call
        faults.track(self)

    def pending_requests(self) -> list[MPI.Request]:
        return [self.request]

    def __del__(self) -> None:
        faults.abandon([self.request])  # dropped while in flight: never freed while pending (`faults._abandoned`)

    def wait(self) -> None:
        if self.call is not None:
            self.call.background = False  # waited on: from now on this message holds the rank up
        faults.wait_all([self.request])
        if self.call is not None:
            self.call.close()

    @staticmethod
    def wait_all(posted: list[Posted]) -> None:
        """Wait for every message (one MPI call), then close their calls."""
        for message in posted:
            if message.call is not None:
                message.call.background = False
        faults.wait_all([message.request for message in posted])
        for message in posted:
            if message.call is not None:
                message.call.close()


class CollectiveHandle:
    """A collective in flight. `test()` advances it without blocking; `wait()` finishes it and returns the result.

    Each posted step holds an `Isend` and/or `Irecv`. When they complete, the algorithm's local work for that
    step runs (inside `test`/`wait`) and the next step is posted.
    """

    def __init__(self, comm: Communicator, steps: Steps, name: str, result: Any, call: Call | None = None) -> None:
        self._comm, self._call = comm, call
        self._steps = steps
        self._name = name
        self._result = result
        self._tag = comm.collective_tag()
        self._requests: list[MPI.Request] = []
        self._staging = HostStaging()
        self._done = False
        faults.track(self)
        self._post_next()

    def pending_requests(self) -> list[MPI.Request]:
        return self._requests

    def __del__(self) -> None:
        faults.abandon(self._requests)  # dropped mid-flight: never freed while pending (`faults._abandoned`)

    def _post_next(self) -> None:
        step = next(self._steps, None)
        if step is None:
            self._done = True
            self._requests = []
            return
        mpi, tag = self._comm.comm, self._tag
        self._requests = requests = []  # held as they are posted: a failure between the two keeps the first
        try:
            if step.recv is not None:
                requests.append(mpi.Irecv(_byte_buffer(self._staging.incoming(step.recv)), step.source, tag))
            sent = 0 if step.send is None else step.send.nbytes
            if step.send is not None:
                self._comm._delay(sent, step.dest)
                requests.append(mpi.Isend(_byte_buffer(self._staging.outgoing(step.send)), step.dest, tag))
        except MPI.Exception as error:  # a revoked communicator: PeerFailure, as from a wait
            faults.raise_if_peer_failed(error, self._name)
            raise
        self._comm.ledger.record(self._name, sent, 0 if step.recv is None else step.recv.nbytes,
                                 0 if step.send is None else self._comm._inter_node(sent, step.dest))

    def _advance(self) -> None:
        self._staging.finish()
        self._post_next()

    def test(self) -> bool:
        """Make progress; True once the collective has completed."""
        while not self._done:
            if not faults.test_all(self._requests):
                return False
            self._advance()
        return True

    def wait(self) -> Any:
        """Block until the collective completes and return its result."""
        if self._call is not None:
            self._call.background = False  # from now on it holds this rank up
        while not self._done:
            faults.wait_all(self._requests)
            self._advance()
        return self._result

    @property
    def done(self) -> bool:
        return self._done

