"""A Communicator carries the collectives' settings: given explicitly, or read from the environment when it is
built (never at import), and passed on by split."""

from __future__ import annotations

import pytest
from mpi4py import MPI
from mpi_harness import run_on_ranks
from workers import communicator_checks

from collectives import Communicator
from collectives.communicator import DEFAULT_SEGMENT_BYTES


def test_settings_come_from_the_environment_when_the_communicator_is_built(monkeypatch):
    monkeypatch.delenv("MPIPARALLEL_SEGMENT_BYTES", raising=False)
    monkeypatch.delenv("MPIPARALLEL_CHECK", raising=False)
    plain = Communicator(MPI.COMM_SELF.Dup())
    assert (plain.segment_bytes, plain.check_arguments) == (DEFAULT_SEGMENT_BYTES, False)
    monkeypatch.setenv("MPIPARALLEL_SEGMENT_BYTES", "64")
    monkeypatch.setenv("MPIPARALLEL_CHECK", "1")
    assert (plain.segment_bytes, plain.check_arguments) == (DEFAULT_SEGMENT_BYTES, False)  # built before
    later = Communicator(MPI.COMM_SELF.Dup())
    assert (later.segment_bytes, later.check_arguments) == (64, True)
    explicit = Communicator(MPI.COMM_SELF.Dup(), segment_bytes=128, check_arguments=False)
    assert (explicit.segment_bytes, explicit.check_arguments) == (128, False)
    child = explicit.split(0, 0)
    assert (child.segment_bytes, child.check_arguments) == (128, False)


@pytest.fixture(scope="module")
def two_ranks() -> list[dict]:
    return run_on_ranks(2, communicator_checks.segments_and_checks)


def test_smaller_segments_send_the_same_bytes_in_more_messages(two_ranks):
    for rank in two_ranks:
        default, small = rank["default"], rank["small"]
        assert default["correct"] and small["correct"]
        assert (default["segment_bytes"], small["segment_bytes"]) == (DEFAULT_SEGMENT_BYTES, 400)
        assert small["sent"] == default["sent"] == 8000  # ring all-reduce, 2 ranks: 2(n−1)/n · 8000 bytes
        assert default["messages"] == 2 and small["messages"] == 2 * 4000 // 400


def test_an_explicit_argument_check_catches_ranks_that_disagree(two_ranks):
    for rank in two_ranks:
        assert rank["check_arguments"] is True
        assert rank["mismatch"] is not None and "shape" in rank["mismatch"]
