"""Fixtures of the collectives' tests: `open_mpi` (tests/support/open_mpi.py), an environment whose MPI is Open MPI
(the peer-failure tests need its fault tolerance, ULFM)."""

from open_mpi import open_mpi  # noqa: F401 (a fixture, found by pytest here)
