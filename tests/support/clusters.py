"""Namespace-host clusters for tests: each gets a name unique to this test process, and the `cluster` fixture
takes every one it made down after the test (even a failed one) and checks that none of its namespaces, bridges,
veths, Slurm daemons or files is left. They need root and network namespaces (CI has both; with CI=true a missing
one fails)."""

from __future__ import annotations

import itertools
import os
import shutil
import tempfile
import time
from pathlib import Path

import pytest
from optional import missing

from mpiparallel.errors import ConfigError
from mpiparallel.jobs import namespace_cluster, slurm_cluster

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
def cluster(monkeypatch):
    """`cluster(nodes, ranks_per_node, link_rate)` makes a cluster of a unique name; every one made is taken down
    after the test, which then checks that none of its namespaces, bridges or veths is left."""
    needs_namespaces()
    # a short folder: Slurm's step sockets lie under it, and a Unix socket's path has at most 107 characters
    state = Path(tempfile.mkdtemp(prefix="mpc-", dir="/tmp"))
    monkeypatch.setenv(namespace_cluster.STATE_VARIABLE, str(state))
    monkeypatch.delenv("MPIPARALLEL_RANKS_PER_NODE", raising=False)
    monkeypatch.delenv("MPIPARALLEL_EMULATED_INTER_NODE", raising=False)
    made: list[str] = []

    def make(nodes: int = 2, ranks_per_node: int = 2, link_rate: str | None = None,
             scheduler: str = "none") -> namespace_cluster.Cluster:
        name = unique_name()
        made.append(name)
        if scheduler == "slurm":
            needs_slurm()
        return namespace_cluster.up(name, nodes, ranks_per_node, link_rate, scheduler)

    yield make
    for name in made:
        namespace_cluster.down(name)
    left = [(name, namespace_cluster.namespaces_of(name), namespace_cluster.links_of(name),
             slurm_cluster.own_processes(namespace_cluster.state_root() / name),
             (namespace_cluster.state_root() / name).exists()) for name in made]
    shutil.rmtree(state, ignore_errors=True)
    assert all(not any(leftovers) for _, *leftovers in left), left


def needs_slurm() -> None:
    try:
        slurm_cluster.check_packages()
    except ConfigError as lacking:
        missing(str(lacking))


def assert_no_processes_on(made: namespace_cluster.Cluster, within_s: float = 10) -> None:
    """The job left no process on any host but the cluster's slurmds (SIGKILLed processes take a moment to go)."""
    def left() -> dict[str, set[int]]:
        daemons = set(slurm_cluster.own_processes(made.folder))
        return {host: set(namespace_cluster.processes_in(host)) - daemons for host in made.hosts}

    deadline = time.monotonic() + within_s
    while any(left().values()):
        assert time.monotonic() < deadline, left()
        time.sleep(0.1)
