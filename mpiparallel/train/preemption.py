"""Preemption: SIGTERM (what Slurm and Kubernetes send before they end a job) or SIGUSR1 (what Slurm's
`--signal` sends ahead of a time limit), to the launcher or to any rank, ends the run cleanly at a step boundary:
a checkpoint is saved if there is a checkpoint folder, and the run exits with 128 + the signal's number (143 for
SIGTERM, 138 for SIGUSR1) after one line saying how to resume.

The ranks must stop after the same step, whichever of them got the signal and whenever. After every step each
rank contributes the signal it has seen (0: none) to an all-reduce with MAX of one integer, on a communicator of
its own. The all-reduce is non-blocking and completed after the next step, so its latency (log2(ranks) messages:
microseconds on free cores, milliseconds when ranks share cores) hides behind that step's work: a signal that
arrives during step k stops every rank after step k + 1 (k + 2 if it lands after step k's all-reduce started),
at most one step more than a blocking all-reduce would run. The self-launching parent passes a signal it gets on
to every rank (`jobs.launch.supervise`).
"""

from __future__ import annotations

import signal
import threading
from typing import Any

import numpy as np

from collectives import faults
from collectives.communicator import world_ranks
from collectives.flight import FlightRecorder, recorded_calls

from ..errors import signal_exit_code

PREEMPTING_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


class Preemption:
    """Notes a preempting signal when it arrives; `agreed()` after each step is the signal every rank stops for
    (0: none), the same on every rank."""

    def __init__(self, world: Any) -> None:
        self.comm, self.received = world.comm.Dup(), 0  # its own communicator: never interleaved with the step's
        self.flight = FlightRecorder(recorded_calls(), "preemption", world_ranks(self.comm), world.rank)
        self.pending: Any = None
        self.call: Any = None
        faults.hold(self)  # a lost rank revokes its communicator too (in-place recovery: no rank waits here)
        faults.track(self)
        self.sent, self.result = np.zeros(1, np.int64), np.zeros(1, np.int64)
        if threading.current_thread() is threading.main_thread():  # Python runs signal handlers there only
            for number in PREEMPTING_SIGNALS:
                signal.signal(number, self._note)

    def _note(self, number: int, frame: object) -> None:
        self.received = self.received or number

    def agreed(self) -> int:
        """The largest signal any rank had seen when the previous all-reduce started (0: none); starts the next."""
        from mpi4py import MPI

        answer = 0
        if self.pending is not None:
            self._wait()
            answer = int(self.result[0])
        self.sent[0] = self.received
        self.call = self.flight.open("all_reduce", "mpi", "int64", 1, 8)
        if self.call is not None:
            self.call.background = True  # runs beside the next step; it holds a rank up only in `_wait`
        self.pending = self.comm.Iallreduce(self.sent, self.result, op=MPI.MAX)
        return answer

    def _wait(self) -> None:
        if self.call is not None:
            self.call.background = False
        faults.wait_all([self.pending])  # a failed peer: PeerFailure, as in the collectives
        if self.call is not None:
            self.call.close()
            self.call = None

    def pending_requests(self) -> list[Any]:
        """The all-reduce still running (`faults.revoke_all` keeps it when the communicator is revoked)."""
        return [self.pending] if self.pending is not None else []

    def close(self) -> None:
        """Complete the last all-reduce and free the communicator (every rank, at the end of the loop)."""
        if self.pending is not None:
            self._wait()
            self.pending = None
        self.comm.Free()

    @staticmethod
    def exit_status(number: int) -> int:
        return signal_exit_code(number)

    @staticmethod
    def name(number: int) -> str:
        return signal.Signals(number).name
