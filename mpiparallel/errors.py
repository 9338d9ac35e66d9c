"""The exceptions the command line treats as the user's to fix rather than a crash, the exit status of every way a
command or a job ends (docs/exit-codes.md is the same table for users), and `on_every_rank`, which makes a
ConfigError that one rank found the error of every rank.

| status | meaning |
|---:|---|
| 0 | done |
| 1 | a rank raised an error (a bug, or a failure of this run's own making) and the job was aborted |
| 2 | bad input: options, files, a mesh that does not fit — one message from rank 0 (`ConfigError`) |
| 3 | a checkpoint is damaged: a shard whose bytes or SHA-256 differ from its manifest, a bad manifest |
| 4 | a rank was lost: it died without reporting (killed, out of memory, a segfault) |
| 5 | a host was lost: every process on it ended at once (the host was killed or shut down) |
| 6 | a host became unreachable: no heartbeat from it for the heartbeat bound (a cut link, a frozen host) |
| 7 | the stall watchdog ended a job that made no progress for --stall-timeout seconds |
| 8 | --elastic gave up: restarts used up (--max-restarts), too few ranks left (--min-ranks), or no mesh fits |
| 9 | a check failed: `verify` or `bench` found an element that differs from the reference |
| 130 | interrupted by SIGINT (Ctrl-C), 128 + 2 |
| 138 | preempted by SIGUSR1 (a checkpoint saved first), 128 + 10 |
| 143 | preempted by SIGTERM (a checkpoint saved first), 128 + 15 |

Signals follow the shell's 128 + signal number, as Slurm and torchrun report them; the small numbers are ours.
Statuses 4 to 8 are the self-launching parent's (`train -n N`), which watches the ranks; under a bare `mpiexec` or
`srun` the launcher reports a lost rank or host in its own way (MPICH's hydra: the signal's or 255).
"""

from __future__ import annotations

import signal
from collections.abc import Callable
from enum import IntEnum
from typing import TYPE_CHECKING, TypeVar

if TYPE_CHECKING:
    from collectives import Communicator


class ExitCode(IntEnum):
    OK = 0
    CRASH = 1
    BAD_INPUT = 2
    CORRUPT_CHECKPOINT = 3
    LOST_RANK = 4
    LOST_HOST = 5
    UNREACHABLE_HOST = 6
    STALL = 7
    ELASTIC_GAVE_UP = 8
    CHECK_FAILED = 9
    INTERRUPTED = 128 + signal.SIGINT
    PREEMPTED_SIGUSR1 = 128 + signal.SIGUSR1
    PREEMPTED_SIGTERM = 128 + signal.SIGTERM


def signal_exit_code(number: int) -> int:
    """The status of a process ended by signal `number`, as the shell reports it."""
    return 128 + number


class ConfigError(Exception):
    """An invalid configuration that every rank detects the same way (bad option combination, -n ≠ world size).

    The command line prints it once, from rank 0, and every rank exits with status 2 through the normal MPI
    shutdown. Raise it only for conditions that every rank sees identically: a rank-local problem is an
    ordinary exception, which aborts the whole job (a rank that exits alone would leave the others waiting).
    """

    exit_code = ExitCode.BAD_INPUT


class CorruptCheckpoint(ConfigError):
    """A checkpoint whose files do not match its manifest (or whose manifest is unreadable): reported like a
    ConfigError, with its own status, so that a script can tell "try an older checkpoint" from "fix the options"."""

    exit_code = ExitCode.CORRUPT_CHECKPOINT


class ElasticGaveUp(ConfigError):
    """Survivors recovering in place found no way on (too few ranks, no mesh, no restarts left); the first of them
    has said why in one line, so the command line prints nothing more, and every survivor exits with its status."""

    exit_code = ExitCode.ELASTIC_GAVE_UP


Result = TypeVar("Result")


def on_every_rank(comm: Communicator, action: Callable[[], Result]) -> Result:
    """Run `action` on every rank; a ConfigError on any rank is raised on all of them (so rank 0 reports it once
    and no rank waits for one that gave up; a damaged checkpoint stays one). One all-gather of the messages."""
    try:
        result, error = action(), None
    except ConfigError as raised:
        result, error = None, (type(raised) is CorruptCheckpoint, str(raised))
    errors = [error for error in comm.allgather_objects(error) if error]
    if errors:
        corrupt, message = errors[0]
        raise (CorruptCheckpoint if corrupt else ConfigError)(message)
    return result
