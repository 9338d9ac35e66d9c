"""When a peer dies: the collectives raise `PeerFailure` on every rank, never hang (under an MPI with ULFM).

MPI's fault tolerance (ULFM: `MPI_Comm_revoke`, `MPI_Comm_shrink`, `MPI_Comm_agree`; Open MPI 5 started with
`mpirun --with-ft ulfm`; mpi4py 4's `Comm.Revoke`, `Shrink`, `Agree`) reports a failed process only to the ranks
that communicate with it: their next call involving it fails with MPI_ERR_PROC_FAILED. Measured with a ring
all-reduce on four ranks whose rank 2 SIGKILLed itself: ranks 1 and 3, its ring neighbours, raised within 0.01 s;
rank 0, waiting on 1 and 3 (both alive), waited until the job was killed a minute later.

So a rank that sees a failure revokes every communicator it holds (`revoke_all`) before it raises. A call pending
on a revoked communicator, or made on it later, fails with MPI_ERR_REVOKED on every member, which then revokes its
own communicators in turn. Every waiting rank waits on some peer; following the waits leads to a rank that saw the
failure or a revoked communicator, so the revocations reach every survivor, whichever communicator (world, a mesh
axis) each was blocked in. Every one of them raises the same error, `PeerFailure`.

    rank 2 dies ─► ranks 1, 3: PROC_FAILED ─► revoke world, dp, tp … ─► rank 0 (blocked on 1): REVOKED
                                                                     ─► revokes its own ─► …

Cost on the healthy path: none — the communication calls sit in `try` blocks, which cost nothing until one raises.
Without ULFM (MPICH; Open MPI started without it) there is no such error class: a dead peer aborts the job or
leaves the others waiting, as before, and the self-launching parent or the heartbeats end it.

After a failure: `Communicator.shrink()` gives the survivors' communicator (MPI_Comm_shrink: a fault-tolerant
agreement on who is left), and `failed_ranks` names the ranks lost.
"""

from __future__ import annotations

import os
import weakref
from collections.abc import Callable
from functools import cache, wraps
from typing import Any, TypeVar

from .mpi import MPI

_held: weakref.WeakSet = weakref.WeakSet()
"""Every `Communicator` this process has built and not yet dropped: what `revoke_all` revokes."""

_in_flight: weakref.WeakSet = weakref.WeakSet()
"""Every collective handle and posted message not yet dropped (objects with `pending_requests()`)."""

_abandoned: list[MPI.Request] = []
"""The requests still pending when their communicator was revoked, kept for the life of the process. Dropped,
mpi4py would free them while active (MPI_Request_free), and Open MPI reports the failure of a freed send on no
communicator, whose error handler ends the process (seen: "Send error after request freed", an abort)."""


class PeerFailure(RuntimeError):
    """A process this rank communicates with, directly or through others, has failed; every communicator this
    process holds is revoked. `error_class` is MPI's (PROC_FAILED, PROC_FAILED_PENDING or REVOKED)."""

    def __init__(self, message: str, error_class: int) -> None:
        super().__init__(message)
        self.error_class = error_class


@cache
def failure_classes() -> frozenset[int]:
    """MPI's error classes that mean a failed peer or a revoked communicator (none where the library has no
    ULFM: mpi4py then gives the names MPI_ERR_UNKNOWN's number)."""
    classes = {MPI.ERR_PROC_FAILED, MPI.ERR_PROC_FAILED_PENDING, MPI.ERR_REVOKED}
    return frozenset(classes - {MPI.ERR_UNKNOWN})



FT_VARIABLE = "OMPI_MCA_mpi_ft_enable"
"""What `mpirun --with-ft ulfm` sets in every rank's environment (Open MPI 5); set it yourself under srun."""


@cache
def fault_tolerant() -> bool:
    """Whether this job runs under an MPI with ULFM turned on: a failed peer is then an error, not a hang."""
    return bool(failure_classes()) and os.environ.get(FT_VARIABLE, "").lower() in ("1", "true", "yes")


def hold(communicator: Any) -> None:
    """Note a communicator `revoke_all` must reach (called by `Communicator.__init__`)."""
    _held.add(communicator)


def track(in_flight: Any) -> None:
    """Note a handle or message whose requests `revoke_all` must keep (`_abandoned`)."""
    _in_flight.add(in_flight)


def revoke_all() -> None:
    """Revoke every communicator this process holds, so that every rank blocked on one of them fails too; keep
    every request still pending (`_abandoned`)."""
    for pending in list(_in_flight):
        _abandoned.extend(pending.pending_requests())
    _in_flight.clear()
    for communicator in list(_held):
        try:
            communicator.comm.Revoke()
        except (MPI.Exception, NotImplementedError):
            pass  # freed meanwhile, or already revoked


def abandon(requests: list[MPI.Request]) -> None:
    """Keep `requests` for the life of the process if any is still pending (see `_abandoned`): what a handle or
    message dropped before it completed (an exception unwound past it) calls."""
    pending = [request for request in requests if request]  # MPI_REQUEST_NULL is false: nothing to keep
    if pending:
        _abandoned.extend(pending)


def raise_if_peer_failed(error: MPI.Exception, during: str = "") -> None:
    """Raise `PeerFailure` (after `revoke_all`) if `error` says a peer failed or a communicator was revoked;
    return otherwise (the caller re-raises `error`)."""
    error_class = error.Get_error_class()
    if error_class not in failure_classes():
        return
    revoke_all()
    what = "a communicator was revoked (a peer failed)" if error_class == MPI.ERR_REVOKED else "a peer process failed"
    raise PeerFailure(f"{what}{f' during {during}' if during else ''}: {error.Get_error_string()}", error_class)


_statuses: list[MPI.Status] = []
"""Status objects reused by every wait (a collective's step has one or two requests): made once, not per call."""


def _statuses_for(requests: list[MPI.Request]) -> list[MPI.Status]:
    while len(_statuses) < len(requests):
        _statuses.append(MPI.Status())
    return _statuses[:len(requests)]


def wait_all(requests: list[MPI.Request]) -> None:
    """MPI_Waitall, its failure told apart: a failed request makes it return MPI_ERR_IN_STATUS, the class that
    says why being in that request's status."""
    statuses = _statuses_for(requests)
    try:
        MPI.Request.Waitall(requests, statuses)
    except MPI.Exception as error:
        _abandoned.extend(requests)  # some may be pending still: never freed while active
        _raise_from_statuses(error, statuses, "a wait")
        raise


def test_all(requests: list[MPI.Request]) -> bool:
    """MPI_Testall, its failure told apart as in `wait_all`."""
    statuses = _statuses_for(requests)
    try:
        return MPI.Request.Testall(requests, statuses)
    except MPI.Exception as error:
        _abandoned.extend(requests)
        _raise_from_statuses(error, statuses, "a test")
        raise


def _raise_from_statuses(error: MPI.Exception, statuses: list[MPI.Status], during: str) -> None:
    raise_if_peer_failed(error, during)
    if error.Get_error_class() != MPI.ERR_IN_STATUS:
        return
    for status in statuses:
        if status.Get_error() in failure_classes():
            raise_if_peer_failed(MPI.Exception(status.Get_error()), during)


Method = TypeVar("Method", bound=Callable[..., Any])


def raising_peer_failure(method: Method) -> Method:
    """A communicator method whose MPI errors of a failed peer become `PeerFailure` (see `raise_if_peer_failed`)."""
    @wraps(method)
    def watched(*args: Any, **kwargs: Any) -> Any:
        try:
            return method(*args, **kwargs)
        except MPI.Exception as error:
            raise_if_peer_failed(error, method.__name__)
            raise
    return watched  # type: ignore[return-value]


def failed_ranks(comm: MPI.Comm) -> list[int]:
    """The ranks of `comm` known to have failed (MPI_Comm_get_failed), in `comm`'s numbering."""
    failed, everyone = comm.Get_failed(), comm.Get_group()
    try:
        return list(MPI.Group.Translate_ranks(failed, list(range(failed.Get_size())), everyone))
    finally:
        failed.Free()
        everyone.Free()
