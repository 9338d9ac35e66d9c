"""Preemption: SIGTERM (what Slurm and Kubernetes send before they end a job) or SIGUSR1 (what Slurm's
`--signal` sends ahead of a time limit), to the launcher or to any rank, ends the run cleanly after the step in
progress: a checkpoint is saved if there is a checkpoint folder, and the run exits with 128 + the signal's number
(143 for SIGTERM, 138 for SIGUSR1) after one line saying how to resume.

The ranks must stop after the same step, whichever of them got the signal and whenever: after every step each
rank contributes the signal it has seen (0: none) to an all-reduce with MAX, one integer (8 bytes, a latency-bound
collective: log2(ranks) messages), so every rank learns the same answer at the same step. The self-launching
parent passes a signal it gets on to every rank (`commands.launch.supervise`).
"""

from __future__ import annotations

import signal
import threading
from typing import Any

PREEMPTING_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


class Preemption:
    """Notes a preempting signal when it arrives; `agreed()` is the signal every rank stops for (0: none)."""

    def __init__(self, world: Any) -> None:
        self.world, self.received = world, 0
        if threading.current_thread() is threading.main_thread():  # Python runs signal handlers there only
            for number in PREEMPTING_SIGNALS:
                signal.signal(number, self._note)

    def _note(self, number: int, frame: object) -> None:
        self.received = self.received or number

    def agreed(self) -> int:
        """The signal any rank has received so far (the larger number if two differ), the same on every rank."""
        from mpi4py import MPI

        return self.world.comm.allreduce(self.received, op=MPI.MAX)

    @staticmethod
    def exit_status(number: int) -> int:
        return 128 + number

    @staticmethod
    def name(number: int) -> str:
        return signal.Signals(number).name
