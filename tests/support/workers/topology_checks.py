"""Collectives on emulated nodes (MPIPARALLEL_RANKS_PER_NODE set by the test): results against native MPI and the
ledger's inter-node bytes against the formulas of `collectives.topology`, on the world and on a split."""

from __future__ import annotations

import numpy as np
from mpi4py import MPI

import collectives as C
from collectives import Communicator
from collectives.topology import inter_node_bytes

CALLS = {
    "all_reduce": lambda x, comm, algo: C.all_reduce(x, comm, algo=algo),
    "reduce_scatter": lambda x, comm, algo: C.reduce_scatter(x, comm, algo=algo),
    "all_gather": lambda x, comm, algo: C.all_gather(x, comm, algo=algo),
}


def _input(collective: str, comm: Communicator, block: int) -> np.ndarray:
    """Exact integers in float64: `block` elements per rank for all_gather, `block` per rank block otherwise."""
    rng = np.random.default_rng(1000 + MPI.COMM_WORLD.Get_rank())
    count = block if collective == "all_gather" else block * comm.size
    return rng.integers(-1000, 1000, count).astype(np.float64)


def _check(comm: Communicator, algorithms: list[str], block: int) -> list[dict]:
    rows = []
    for collective, call in CALLS.items():
        for algo in (a for a in algorithms if a in C.ALGORITHMS[collective]):
            x = _input(collective, comm, block)
            before = x.copy()
            comm.ledger.reset()
            ours = call(x, comm, algo)
            counted = comm.ledger.inter_node_sent(collective)
            sent = comm.ledger.sent[collective]
            reference = call(x, comm, "mpi")
            size = x.nbytes * (comm.size if collective == "all_gather" else 1)
            rows.append({"collective": collective, "algo": algo, "equal": bool(np.array_equal(ours, reference)),
                         "input_kept": bool(np.array_equal(x, before)), "inter_node": counted, "sent": sent,
                         "formula": inter_node_bytes(collective, algo, size, comm.nodes, comm.rank)})
    return rows


def ledger_against_formulas(algorithms: list[str], block: int) -> dict:
    """Every algorithm on the world and on the split of even world ranks / odd world ranks."""
    world = Communicator(MPI.COMM_WORLD.Dup())
    half = world.split(world.rank % 2, world.rank)
    handle = C.all_reduce_async(_input("all_reduce", world, block), world, algo="hierarchical")
    handle.wait()
    async_inter_node = world.ledger.inter_node_sent("all_reduce")
    return {"nodes": list(world.nodes), "half_nodes": list(half.nodes), "world": _check(world, algorithms, block),
            "half": _check(half, algorithms, block), "async_inter_node": async_inter_node}


def placement() -> dict:
    """Where the launcher put this rank: its host name, the node MPI groups it in, and the ranks its launcher's
    variables say share its node (what the BLAS threads are divided by)."""
    import socket

    from mpiparallel import process

    world = Communicator(MPI.COMM_WORLD)
    return {"host": socket.gethostname(), "node": world.nodes[world.rank], "local_ranks": process.local_rank_count()}
