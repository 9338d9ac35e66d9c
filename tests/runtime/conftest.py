"""Fixtures of the runtime tests: `cluster` (tests/support/clusters.py) makes namespace-host clusters; `open_mpi`
(tests/support/open_mpi.py) is an environment whose MPI is Open MPI."""

from clusters import cluster  # noqa: F401 (a fixture, found by pytest here)
from open_mpi import open_mpi  # noqa: F401 (a fixture, found by pytest here)
