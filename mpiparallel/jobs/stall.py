"""The stall watchdog: a job whose ranks all stopped making progress ends with one line naming the rank behind.

A rank that dies is seen at once (`launch.Endings`); a rank that is alive but makes no progress — stopped
(SIGSTOP, a debugger), stuck in a deadlock or a hung collective, starved for good — is not: the others wait in
their next collective forever. PyTorch's answer is the NCCL watchdog (a collective timeout, 10 min by default)
and a flight recorder that says which rank was behind. Here, the self-launching parent watches the ranks'
progress reports (`train.progress`: the step and, coarsely, the phase each rank is in, sent at every phase
boundary over a Unix socket of their own, never over MPI) and, when **no rank** has reported anything new for
`--stall-timeout` seconds (default MPIPARALLEL_STALL_TIMEOUT, else PyTorch's 600 s; 0: off):

- prints one line saying which rank is behind and where every rank is:
  `mpiparallel: stalled: rank 2 (stopped: SIGSTOP or a debugger) has not finished step 41 (forward, microbatch 3)
  for 601 s; ranks 0, 1, 3 wait in step 41 (gradient reduction); no rank made progress for 600 s
  (--stall-timeout 600): ended every rank`;
- SIGKILLs every rank, mpiexec and whatever it started (as a lost host's ending does), exits non-zero, and
  appends `{"event": "stall", …}` to --log-json.

The bound: the job ends at most the timeout + one poll (a quarter of the timeout, at most POLL_S) + the kill after
the last progress. Measured with a 3 s timeout: 3.06-3.16 s from a rank's SIGSTOP to the job's end.

Who is behind. A rank whose process is stopped (state T in /proc: SIGSTOP, a debugger) is behind, whatever its
report says. Else the ranks whose report is the earliest in the run's order (step, then the phases in order:
data, the microbatches' forward and backward by microbatch, gradients, optimizer, validation, end, checkpoint):
the others have gone further and wait for them. Where that earliest place is shared by every rank still running
(a collective that hung on all of them) no rank is singled out, and the line says where they all are. Pipeline
actions are not ordered across ranks (each stage runs its own list), so pipeline ranks in the same step tie.

Long phases that are not stalls. Reports come at every phase boundary, so only one phase that lasts longer than
the timeout on every rank at once would be taken for a stall; the default (600 s) is far beyond the phases of the
runs this trains: a step (the first one's warm-up included), a validation, a checkpoint save. Not watched at
all: setup (reading or preparing the data, training a tokenizer, building the model, loading a checkpoint; it
lasts as long as the data is large) until the first rank starts step 1, and everything after a rank reports
`done` (the final reports, --save, the sample). A run whose single save or validation takes longer than the
timeout needs a larger --stall-timeout.

The watchdog runs only under the self-launching parent (`-n N`); under a bare mpiexec or srun, nothing watches.
A command whose ranks never report (every command but train) is never watched. The ranks that report are those
that reach the socket, a file in the parent's folder: on this machine or a namespace host of `mpiparallel
cluster`, whose /proc is this machine's.
"""

from __future__ import annotations

import json
import selectors
import socket
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from ..train.progress import DONE, SETUP, SOCKET, STEP_PHASES

TIMEOUT_VARIABLE = "MPIPARALLEL_STALL_TIMEOUT"
"""The default of `train --stall-timeout`."""

REPORTS_SOCKET = "progress.sock"
"""The socket in the parent's rank folder (`launch.RANK_PIDS`) that takes the ranks' progress reports."""

POLL_S = 1.0
"""How often, at most, the watchdog looks at the clock when no report comes."""

_PHASE_WORDS = {"data": "reading its rows of the batch", "forward": "forward, microbatch {}",
                "backward": "backward, microbatch {}", "pipeline": "pipeline action {}",
                "gradients": "gradient reduction", "optimizer": "optimizer: overflow vote, clipping, update",
                "validation": "validation", "end": "end of step: the log and the preemption vote",
                "checkpoint": "checkpoint save"}


@dataclass(frozen=True)
class StallWatch:
    """What the self-launching parent's watchdog is told: the timeout (0: no watchdog) and the JSON log that gets
    its event (None: none)."""

    timeout: float = 0.0
    log_json: str | None = None
    flight_dir: str | None = None  # where the ranks write their flight recorders (None: the working directory)

    def log(self, stall: Stall) -> None:
        if self.log_json is not None:
            with open(self.log_json, "a", encoding="utf-8") as log:
                log.write(json.dumps(stall.event()) + "\n")


@dataclass
class RankProgress:
    """What the parent knows of one rank: its last report (step from 1, phase, detail) and when it came, and
    whether its connection closed (the rank ended)."""

    rank: int
    pid: int
    since: float
    step: int = 0
    phase: str = SETUP
    detail: str = ""
    ended: bool = False

    @property
    def running(self) -> bool:
        return not self.ended and self.phase != DONE

    def order(self) -> tuple[int, int, int]:
        """Its place in the run's order: (step, phase, place inside the phase); setup comes first."""
        if self.phase not in STEP_PHASES:
            return (self.step, -1, 0)
        if self.phase in ("forward", "backward", "pipeline"):  # pipeline actions: no order across ranks
            inside = 0 if self.phase == "pipeline" else 2 * int(self.detail or 0) + (self.phase == "backward")
            return (self.step, STEP_PHASES.index("forward"), inside)
        return (self.step, STEP_PHASES.index(self.phase), 0)

    def where(self) -> str:
        if self.phase == SETUP:
            return "setup (before step 1)"
        words = _PHASE_WORDS.get(self.phase, self.phase).format(self.detail)
        return f"step {self.step} ({words})"


@dataclass(frozen=True)
class Stall:
    """What the watchdog saw when it ended the job: every rank's progress, the ranks it names as behind (none where
    every running rank is at the same place) and those whose process was stopped."""

    timeout: float
    silent_s: float
    ranks: tuple[RankProgress, ...]
    behind: tuple[int, ...]
    stopped: tuple[int, ...]
    at: float  # when it was seen (monotonic)
    by_flight: bool = False  # `behind` found by the flight records where the progress reports named nobody

    def with_flight_records(self, held_up_by: tuple[int, ...]) -> Stall:
        """Where the progress reports single out nobody (pipeline ranks: no order across their actions), the ranks
        the flight records show the others waiting on (`hang.held_up_by`) are the ranks behind."""
        if self.behind or not held_up_by:
            return self
        return replace(self, behind=tuple(sorted(held_up_by)), by_flight=True)

    def message(self) -> str:
        behind = set(self.behind) or {progress.rank for progress in self.ranks if progress.running}
        parts = [self._behind_words([progress for progress in self.ranks if progress.rank in behind])]
        others = [progress for progress in self.ranks if progress.rank not in behind]
        waiting = [progress for progress in others if progress.running]
        parts += [f"{_ranks_words(ranks)} {'waits' if len(ranks) == 1 else 'wait'} in {where}"
                  for where, ranks in _grouped(waiting)]
        finished = [progress.rank for progress in others if progress.phase == DONE and not progress.ended]
        ended = [progress.rank for progress in others if progress.ended]
        if finished:
            parts.append(f"{_ranks_words(finished)} finished training")
        if ended:
            parts.append(f"{_ranks_words(ended)} ended")
        return (f"mpiparallel: stalled: {'; '.join(part for part in parts if part)}; no rank made progress for "
                f"{self.silent_s:.0f} s (--stall-timeout {self.timeout:g}): ended every rank")

    def _behind_words(self, named: list[RankProgress]) -> str:
        """Where the ranks named as behind are (every rank still running, when none is behind the others)."""
        since = {progress.rank: progress.since for progress in named}
        words = []
        for where, ranks in _grouped(named):
            stopped = [rank for rank in ranks if rank in self.stopped]
            how = f" ({'all ' if len(stopped) > 1 else ''}stopped: SIGSTOP or a debugger)" if stopped else ""
            age = max(self.at - since[rank] for rank in ranks)
            verb = "has" if len(ranks) == 1 else "have"
            if self.by_flight:
                how += " (the others wait on it: flight records)" if len(ranks) == 1 else \
                    " (the others wait on them: flight records)"
            words.append(f"{_ranks_words(ranks)}{how} {verb} not finished {where} for {age:.0f} s")
        if not self.behind:
            words.append("none is behind the others (each rank still running waits at the same place)")
        return "; ".join(words)

    def event(self) -> dict[str, Any]:
        """The --log-json record."""
        return {"event": "stall", "timeout": self.timeout, "silent_s": round(self.silent_s, 3),
                "behind": list(self.behind), "behind_by": "flight records" if self.by_flight else "progress",
                "ranks": [{"rank": progress.rank, "pid": progress.pid, "step": progress.step, "phase": progress.phase,
                           "detail": progress.detail, "ended": progress.ended, "stopped": progress.rank in self.stopped,
                           "silent_s": round(self.at - progress.since, 3)} for progress in self.ranks]}


def _grouped(ranks: Iterable[RankProgress]) -> list[tuple[str, list[int]]]:
    """(where, ranks there), in the run's order."""
    groups: dict[str, list[int]] = {}
    for progress in sorted(ranks, key=lambda progress: (progress.order(), progress.rank)):
        groups.setdefault(progress.where(), []).append(progress.rank)
    return list(groups.items())


def _ranks_words(ranks: list[int]) -> str:
    return f"rank{'s' if len(ranks) != 1 else ''} {', '.join(map(str, sorted(ranks)))}"


def behind(ranks: Iterable[RankProgress], stopped: Iterable[int]) -> tuple[int, ...]:
    """The ranks holding the others up: those whose process is stopped, else the running ranks at the earliest
    place — none if that is every running rank (nobody is behind anybody)."""
    if stopped:
        return tuple(sorted(stopped))
    running = [progress for progress in ranks if progress.running]
    if not running:
        return ()
    earliest = min(progress.order() for progress in running)
    last = [progress.rank for progress in running if progress.order() == earliest]
    return tuple(sorted(last)) if len(last) < len(running) else ()


def stopped_processes(pids: Iterable[int]) -> set[int]:
    """Those of `pids` whose process is stopped (state T or t in /proc: a stop signal, a debugger); a process not
    on this machine is not known to be."""
    stopped = set()
    for pid in pids:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue
        if state in ("T", "t"):
            stopped.add(pid)
    return stopped


class StallWatchdog(threading.Thread):
    """In the parent: takes the ranks' progress reports on REPORTS_SOCKET in `folder` and calls `stalled(stall)`
    once, when some rank has reached step 1, some rank of the `ranks` has not finished, and no report came for
    `timeout` seconds (see the module docstring). `environment()` is what the ranks need to report."""

    def __init__(self, folder: Path, ranks: int, timeout: float, stalled: Callable[[Stall], None]) -> None:
        super().__init__(name="mpiparallel-stall-watchdog", daemon=True)
        self.path, self.ranks, self.timeout, self.stalled = folder / REPORTS_SOCKET, ranks, timeout, stalled
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.listener.bind(str(self.path))
        self.listener.listen(max(ranks, 1))
        self.listener.setblocking(False)
        self.progress: dict[socket.socket, RankProgress | None] = {}  # a connection -> its rank, once it said which
        self.ended: list[RankProgress] = []  # the ranks whose connection closed
        self.last_progress = time.monotonic()
        self.stopped = threading.Event()

    def environment(self) -> dict[str, str]:
        return {SOCKET: str(self.path)}

    def run(self) -> None:
        selector = selectors.DefaultSelector()
        selector.register(self.listener, selectors.EVENT_READ)
        try:
            while not self.stopped.is_set():
                for key, _ in selector.select(min(POLL_S, self.timeout / 4)):
                    if key.fileobj is self.listener:
                        self._accept(selector)
                    else:
                        self._read(key.fileobj, selector)
                stall = self._stall(time.monotonic())
                if stall is not None and not self.stopped.is_set():
                    self.stopped.set()
                    self.stalled(stall)
        finally:
            for connection in list(self.progress):
                connection.close()
            selector.close()
            self.listener.close()

    def stop(self) -> None:
        self.stopped.set()

    def _accept(self, selector: selectors.BaseSelector) -> None:
        try:
            connection, _ = self.listener.accept()
        except BlockingIOError:
            return
        connection.setblocking(False)
        self.progress[connection] = None
        selector.register(connection, selectors.EVENT_READ)

    def _read(self, connection: Any, selector: selectors.BaseSelector) -> None:
        """Every report waiting on `connection` (one datagram each); its end when it closed."""
        now = time.monotonic()
        while True:
            try:
                words = connection.recv(256).decode(errors="replace").split()
            except BlockingIOError:
                return
            except OSError:
                words = []
            progress = self.progress[connection]
            if not words:  # closed: the rank ended
                selector.unregister(connection)
                connection.close()
                del self.progress[connection]
                if progress is not None:
                    progress.ended, progress.since = True, now
                    self.ended.append(progress)
                self.last_progress = now
                return
            if progress is None:  # the first datagram: RANK PID
                self.progress[connection] = RankProgress(int(words[0]), int(words[1]), now)
            else:
                progress.step, progress.phase, progress.detail = int(words[0]), words[1], " ".join(words[2:])
                progress.since = now
            self.last_progress = now

    def _known(self) -> list[RankProgress]:
        return sorted([progress for progress in self.progress.values() if progress is not None] + self.ended,
                      key=lambda progress: progress.rank)

    def _stall(self, now: float) -> Stall | None:
        ranks = self._known()
        started = any(progress.phase in STEP_PHASES for progress in ranks)
        if not started or not any(progress.running for progress in ranks) or now - self.last_progress <= self.timeout:
            return None
        pids = {progress.pid: progress.rank for progress in ranks if progress.running}
        stopped = sorted(pids[pid] for pid in stopped_processes(pids))
        return Stall(self.timeout, now - self.last_progress, tuple(ranks), behind(ranks, stopped), tuple(stopped), now)
