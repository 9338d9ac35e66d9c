"""How far a rank has got, told to the self-launching parent: the step it is in and, coarsely, the phase.

The parent's stall watchdog (`mpiparallel.jobs.stall`) ends a job none of whose ranks has made progress for
`--stall-timeout` seconds and names the rank that is behind. For that every rank reports, at each phase boundary
of the loop, where it now is:

    setup                       reading the data, the tokenizer, building the model, loading a checkpoint
    step k, data                this rank's rows of the step's batch (read and checked)
    step k, forward  m          microbatch m's forward (no pipeline)        } in turn, m = 0, 1, …
    step k, backward m          microbatch m's backward                     }
    step k, pipeline ACTION     the pipeline schedule's next action, e.g. 1F3 (with --pp; it waits for its input
                                first, a receive from the neighbouring stage)
    step k, gradients           the data-parallel reductions and the model-parallel sums (the wait for the others)
    step k, optimizer           the overflow vote, the global-norm clipping (an all-reduce), the update
    step k, validation          the held-out loss (--eval-every)
    step k, end                 the log line, the memory report and the preemption vote (an all-reduce)
    step k, checkpoint          the checkpoint save
    done                        training is over: the last reports, the trace, --save and the sample

Steps count from 1, as the console and the JSON log do. Reports go over a Unix socket of their own beside the
rank's watch connection (`launch.WATCH_SOCKET`), never over MPI: a `SOCK_SEQPACKET` connection to the socket
the parent names in MPIPARALLEL_PROGRESS_SOCKET, one datagram per report (`STEP PHASE DETAIL`; the first one
`RANK PID`). A send never blocks: a report the parent has no room for is dropped (the next one says more), and a
parent that is gone ends the reporting. Cost: one send() per phase boundary — a few per microbatch, a few
microseconds each; no cost per collective. Without the variable (no parent, or `--stall-timeout 0`) the reports
are an object that does nothing.

Test hook: MPIPARALLEL_STALL_AT="STEP@RANK" makes that rank stop for good when it reports the forward of
microbatch 0 (or its first pipeline action) in that step — alive, silent, holding every other rank in its next
collective: the stall the watchdog exists for.
"""

from __future__ import annotations

import os
import socket
import threading
from typing import Any

SOCKET = "MPIPARALLEL_PROGRESS_SOCKET"
"""Set by the self-launching parent when it watches for stalls: the path of the socket that takes the reports."""

STALL_AT = "MPIPARALLEL_STALL_AT"
"""Tests only: `STEP@RANK` — that rank hangs in that step (see the module docstring)."""

SETUP, DONE = "setup", "done"
STEP_PHASES = ("data", "routing", "forward", "backward", "pipeline", "gradients", "optimizer", "gather", "validation",
               "end", "checkpoint")
"""The phases of a step in the order a rank goes through them (forward and backward alternate per microbatch)."""


class ProgressReports:
    """This rank's reports to the parent over its progress socket (see the module docstring)."""

    def __init__(self, connection: socket.socket, rank: int, stall_at: int | None = None) -> None:
        self.connection, self.rank, self.stall_at = connection, rank, stall_at

    @classmethod
    def to_parent(cls, rank: int) -> ProgressReports | NoProgressReports:
        """Connected to the parent's socket if it asked for reports (MPIPARALLEL_PROGRESS_SOCKET), else reports
        that do nothing."""
        path = os.environ.get(SOCKET)
        if not path:
            return NO_PROGRESS_REPORTS
        connection = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            connection.connect(path)
            connection.send(f"{rank} {os.getpid()}".encode())
        except OSError:
            connection.close()
            return NO_PROGRESS_REPORTS
        connection.setblocking(False)
        return cls(connection, rank, _stall_step(os.environ.get(STALL_AT, ""), rank))

    def at(self, step: int, phase: str, detail: Any = "") -> None:
        """This rank is now in `phase` of `step` (from 1); `detail`: the microbatch, or the pipeline action."""
        self._send(f"{step} {phase} {detail}")
        if step == self.stall_at and phase in ("forward", "pipeline"):
            self.stall_at = None
            threading.Event().wait()  # the test hook: alive, silent, for good

    def setup(self) -> None:
        self._send(f"0 {SETUP}")

    def done(self) -> None:
        self._send(f"0 {DONE}")

    def _send(self, text: str) -> None:
        if self.connection is None:
            return
        try:
            self.connection.send(text.encode(), socket.MSG_NOSIGNAL)
        except BlockingIOError:
            pass  # the parent is behind reading: this report is dropped, the next one says more
        except OSError:  # the parent is gone: nobody to tell
            self.connection.close()
            self.connection = None


class NoProgressReports:
    """No parent to tell (run under a bare mpiexec, or --stall-timeout 0): every report does nothing."""

    def at(self, step: int, phase: str, detail: Any = "") -> None:
        pass

    def setup(self) -> None:
        pass

    def done(self) -> None:
        pass


NO_PROGRESS_REPORTS = NoProgressReports()


def _stall_step(setting: str, rank: int) -> int | None:
    """The step of MPIPARALLEL_STALL_AT="STEP@RANK" if it names this rank."""
    step, _, on = setting.partition("@")
    return int(step) if step and on and int(on) == rank else None
