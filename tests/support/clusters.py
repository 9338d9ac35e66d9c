"""Namespace-host clusters for tests: each gets a name unique to this test process, and the `cluster` fixture
takes every one it made down after the test (even a failed one) and checks that none of its namespaces, bridges or
veths is left. They need root and network namespaces (CI has both; with CI=true a missing one fails)."""

from __future__ import annotations

import itertools
import os
import shutil
import time

import pytest
from optional import missing

from mpiparallel.jobs import namespace_cluster

_names = itertools.count()


def unique_name() -> str:
    """c + this process's PID + a counter, in hex: unique among the processes alive on this machine."""
    return f"c{os.getpid():x}{next(_names):x}"


def needs_namespaces() -> None:
    if os.geteuid() != 0:
        missing("the cluster tests make network namespaces, which needs root")
    for tool in ("ip", "tc", "unshare"):
        if shutil.which(tool) is None:
            missing(f"the cluster tests need the `{tool}` command")


@pytest.fixture
def cluster(tmp_path, monkeypatch):
    """`cluster(nodes, ranks_per_node, link_rate)` makes a cluster of a unique name; every one made is taken down
    after the test, which then checks that none of its namespaces, bridges or veths is left."""
    needs_namespaces()
    monkeypatch.setenv(namespace_cluster.STATE_VARIABLE, str(tmp_path / "clusters"))
    monkeypatch.delenv("MPIPARALLEL_RANKS_PER_NODE", raising=False)
    monkeypatch.delenv("MPIPARALLEL_EMULATED_INTER_NODE", raising=False)
    made: list[str] = []

    def make(nodes: int = 2, ranks_per_node: int = 2, link_rate: str | None = None) -> namespace_cluster.Cluster:
        name = unique_name()
        made.append(name)
        return namespace_cluster.up(name, nodes, ranks_per_node, link_rate)

    yield make
    for name in made:
        namespace_cluster.down(name)
    left = [(name, namespace_cluster.namespaces_of(name), namespace_cluster.links_of(name)) for name in made]
    assert all(not namespaces and not links for _, namespaces, links in left), left


def assert_no_processes_on(made: namespace_cluster.Cluster, within_s: float = 10) -> None:
    """The job left no process on any host (SIGKILLed processes take a moment to go)."""
    deadline = time.monotonic() + within_s
    while any(namespace_cluster.processes_in(host) for host in made.hosts):
        assert time.monotonic() < deadline, {host: namespace_cluster.processes_in(host) for host in made.hosts}
        time.sleep(0.1)
