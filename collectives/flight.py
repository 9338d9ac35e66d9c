"""The flight recorder: the last calls of every communicator, kept so that a hung job can say which call each rank
is in, which step of its algorithm, and which peer it waits on.

Every `Communicator` holds a `FlightRecorder`, a ring of the last `MPIPARALLEL_FLIGHT` calls (default 512; 0 turns
recording off). A call is opened when a collective starts (`api`), numbered in that communicator's own sequence
(every rank makes the same calls on a communicator in the same order, so #k is the same call everywhere); the
engine writes the step it is in and the peers of that step as the algorithm runs (`Communicator.run`,
`CollectiveHandle`), and the call is closed when it returns. A record: sequence number, operation, algorithm,
dtype, elements, bytes, root, start and end times, and while open the step and the ranks it sends to and receives
from.

Dumps. `dump_all(path, rank, reason)` writes every live recorder of this process as one JSON file;
`dump_on_signal(rank)` starts a thread that writes `flight-rank-K.json` into `dump_folder` when the process gets
SIGUSR2. Python runs signal handlers only in the main thread, between bytecodes — never while it sits in a
blocking MPI call, which is where a hung rank sits. But Python's C-level handler writes each signal's number to the
wakeup fd (`signal.set_wakeup_fd`) at once, whichever thread the kernel picked; the dump thread reads it there and
writes the dump (mpi4py releases the GIL in blocking calls). A rank that is stopped or dead cannot answer;
`mpiparallel.jobs.hang` names it as missing.

Cost: one small object per call and three attribute writes per algorithm step (docs/training.md has the
measurement).
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
import weakref
from collections import deque
from pathlib import Path
from typing import Any

DEFAULT_CALLS = 512
SIZE_VARIABLE = "MPIPARALLEL_FLIGHT"
FOLDER_VARIABLE = "MPIPARALLEL_FLIGHT_DIR"
DUMP_SIGNAL = signal.SIGUSR2


def recorded_calls(environ: Any = os.environ) -> int:
    """How many calls each recorder keeps: $MPIPARALLEL_FLIGHT, else 512; 0 turns recording off."""
    value = environ.get(SIZE_VARIABLE, "")
    try:
        calls = DEFAULT_CALLS if value == "" else int(value)
    except ValueError:
        raise ValueError(f"{SIZE_VARIABLE}={value!r}: give a number of calls (0 turns the recorder off)") from None
    if calls < 0:
        raise ValueError(f"{SIZE_VARIABLE}={value!r}: give a number of calls >= 0")
    return calls


class Call:
    """One call on a communicator. `step` counts the algorithm's steps from 0; `dest` and `source` are the
    communicator ranks of the current step's send and receive (-1: none); a point-to-point message (`tag` >= 0)
    has no steps and keeps its peer from the start. `background`: a call started without blocking (an `_async`
    collective, a posted message) that nobody waits on yet — it holds its rank up only once a wait begins."""

    __slots__ = ("seq", "op", "algo", "dtype", "count", "nbytes", "root", "started", "ended", "step", "dest",
                 "source", "tag", "background")

    def __init__(self, seq: int, op: str, algo: str, dtype: str, count: int, nbytes: int, root: int) -> None:
        self.seq, self.op, self.algo, self.dtype, self.count, self.nbytes = seq, op, algo, dtype, count, nbytes
        self.root, self.started, self.ended = root, time.time(), None
        self.step, self.dest, self.source, self.tag = -1, -1, -1, -1
        self.background = False

    def close(self) -> None:
        self.ended = time.time()

    def as_dict(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in self.__slots__}


class FlightRecorder:
    """The last calls of one communicator. `label` names it for a reader (a mesh axis: "tp", "dp", …);
    `members` are its ranks' world ranks, in communicator order (set by the communicator). A `point_to_point`
    recorder keeps a communicator's sends and receives apart from its collectives: their numbers are this rank's
    own (two ranks make different ones), so the analysis pairs them by peer and tag instead."""

    def __init__(self, calls: int, label: str = "", members: tuple[int, ...] = (), rank: int = 0,
                 point_to_point: bool = False) -> None:
        self.calls: deque[Call] = deque(maxlen=max(calls, 1))
        self.enabled = calls > 0
        self.label, self.members, self.rank = label, members, rank
        self.point_to_point = point_to_point
        self.next_seq = 0
        _RECORDERS.add(self)

    def open(self, op: str, algo: str, dtype: Any, count: int, nbytes: int, root: int = -1) -> Call | None:
        """Record the start of a call; None when recording is off."""
        if not self.enabled:
            return None
        call = Call(self.next_seq, op, algo, str(dtype), count, nbytes, root)
        self.next_seq += 1
        self.calls.append(call)
        return call

    def as_dict(self) -> dict[str, Any]:
        return {"label": self.label, "members": list(self.members), "rank": self.rank,
                "point_to_point": self.point_to_point, "calls": [call.as_dict() for call in list(self.calls)]}


_RECORDERS: weakref.WeakSet[FlightRecorder] = weakref.WeakSet()


def dump_all(path: str | Path, rank: int, reason: str) -> Path:
    """Write every live recorder of this process to `path` (JSON), the file replaced whole; returns the path.
    `world` is the largest communicator's size (the world's, once any collective ran on it)."""
    path = Path(path)
    recorders = [recorder.as_dict() for recorder in list(_RECORDERS) if recorder.members]
    record = {"rank": rank, "world": max((len(r["members"]) for r in recorders), default=0), "pid": os.getpid(),
              "reason": reason, "time": time.time(), "communicators": recorders}
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")
    partial.write_text(json.dumps(record))
    partial.replace(path)
    return path


def dump_path(folder: str | Path, rank: int) -> Path:
    return Path(folder) / f"flight-rank-{rank}.json"


dump_folder: Path = Path(os.environ.get(FOLDER_VARIABLE) or ".")
"""Where this process's dumps go: $MPIPARALLEL_FLIGHT_DIR, else the working directory (`train --flight-dir`)."""


def dump(rank: int, reason: str) -> Path | None:
    """This process's recorders into `dump_folder`/flight-rank-RANK.json; None when it cannot be written."""
    try:
        return dump_all(dump_path(dump_folder, rank), rank, reason)
    except OSError:
        return None  # a folder that went away or is not writable: the job goes on without the dump


def dump_on_signal(rank: int) -> threading.Thread:
    """From now on SIGUSR2 makes this process write `flight-rank-RANK.json` into `dump_folder` (see the module
    docstring). Call it from the main thread (Python's signal functions must run there)."""
    readable, writable = os.pipe()
    os.set_blocking(writable, False)
    signal.signal(DUMP_SIGNAL, lambda number, frame: None)  # Python's C handler now catches it, in any thread
    signal.set_wakeup_fd(writable)  # … and writes its number here at once, whatever the main thread is doing

    def serve() -> None:
        while True:
            numbers = os.read(readable, 64)
            if DUMP_SIGNAL in numbers:
                dump(rank, "SIGUSR2")

    thread = threading.Thread(target=serve, name="flight-dump", daemon=True)
    thread.start()
    return thread
