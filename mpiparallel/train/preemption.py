"""Preemption: SIGTERM (what Slurm and Kubernetes send before they end a job) or SIGUSR1 (what Slurm's
`--signal` sends ahead of a time limit), to the launcher or to any rank, ends the run cleanly at a step boundary:
a checkpoint is saved if there is a checkpoint folder, and the run exits with 128 + the signal's number (143 for
SIGTERM, 138 for SIGUSR1) after one line saying how to resume.

The ranks must stop after the same step, whichever of them got the signal and whenever. After every step each
rank contributes the signal it has seen (0: none) to an all-reduce with MAX of one integer, on a communicator of
its own (the project's recursive doubling, asynchronous: `collectives.all_reduce_async`). It is started after a
step and completed after the next, so its first exchange hides behind that step's work (the others, log2(ranks)
− 1 messages of microseconds on free cores, milliseconds when ranks share cores, run in the wait): a signal that
arrives during step k stops every rank after step k + 1 (k + 2 if it lands after step k's all-reduce started),
at most one step more than a blocking all-reduce would run. The self-launching parent passes a signal it gets on
to every rank (`jobs.launch.supervise`).
"""

from __future__ import annotations

import signal
import threading
from typing import Any

import numpy as np

from collectives import Communicator, all_reduce_async
from collectives.communicator import CollectiveHandle

from ..errors import signal_exit_code

PREEMPTING_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


class Preemption:
    """Notes a preempting signal when it arrives; `agreed()` after each step is the signal every rank stops for
    (0: none), the same on every rank."""

    def __init__(self, world: Any) -> None:
        # its own communicator (never interleaved with the step's), revoked with the others when a peer fails
        self.comm = Communicator(world.comm.Dup(), check_arguments=False)
        self.comm.label = "preemption"
        self.received = 0
        self.pending: CollectiveHandle | None = None
        if threading.current_thread() is threading.main_thread():  # Python runs signal handlers there only
            for number in PREEMPTING_SIGNALS:
                signal.signal(number, self._note)

    def _note(self, number: int, frame: object) -> None:
        self.received = self.received or number

    def agreed(self) -> int:
        """The largest signal any rank had seen when the previous all-reduce started (0: none); starts the next.

        The all-reduce is the project's recursive doubling, not MPI's Iallreduce: under ULFM, Open MPI's own
        non-blocking collective, aborted by a peer's loss, now and then ended a survivor ("Send error after request
        freed", 2 runs in 10 of the in-place tests)."""
        answer = int(self.pending.wait()[0]) if self.pending is not None else 0
        self.pending = all_reduce_async(np.array([self.received], np.int64), self.comm, op="max",
                                        algo="recursive_doubling")
        return answer

    def close(self) -> None:
        """Complete the last all-reduce and free the communicator (every rank, at the end of the loop)."""
        if self.pending is not None:
            self.pending.wait()
            self.pending = None
        self.comm.comm.Free()

    @staticmethod
    def exit_status(number: int) -> int:
        return signal_exit_code(number)

    @staticmethod
    def name(number: int) -> str:
        return signal.Signals(number).name
