"""Fixtures of the runtime tests: `cluster` (tests/support/clusters.py) makes namespace-host clusters."""

from clusters import cluster  # noqa: F401 (a fixture, found by pytest here)
