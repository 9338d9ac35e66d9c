"""Communicator settings on several ranks (see mpi_harness): segment sizes and argument checks given explicitly."""

from __future__ import annotations

import numpy as np
from mpi4py import MPI

import collectives as C
from collectives import Communicator


def segments_and_checks() -> dict:
    """Ring all-reduce of 8000 bytes with the default segments and with 400-byte ones (explicit setting, carried
    through split); and a mismatched call under check_arguments=True."""
    x = np.arange(1000, dtype=np.float64) * (MPI.COMM_WORLD.Get_rank() + 1)
    report = {}
    for name, segment_bytes in (("default", None), ("small", 400)):
        comm = Communicator(MPI.COMM_WORLD.Dup(), segment_bytes=segment_bytes).split(0, MPI.COMM_WORLD.Get_rank())
        result = C.all_reduce(x, comm, algo="ring")
        report[name] = {"segment_bytes": comm.segment_bytes, "messages": comm.ledger.messages["all_reduce"],
                        "sent": comm.ledger.sent["all_reduce"],
                        "correct": bool(np.array_equal(result, np.arange(1000) * sum(range(1, comm.size + 1))))}
    checked = Communicator(MPI.COMM_WORLD.Dup(), check_arguments=True).split(0, MPI.COMM_WORLD.Get_rank())
    report["check_arguments"] = checked.check_arguments
    try:
        C.all_reduce(np.ones(3 + checked.rank), checked)  # the ranks disagree on the size
        report["mismatch"] = None
    except C.CollectiveMismatchError as error:
        report["mismatch"] = str(error)
    return report
