"""Nodes: which ranks of a communicator share a machine, and what that means for the bytes they send.

A node is the ranks that share memory (MPI's `COMM_TYPE_SHARED`). Setting `MPIPARALLEL_RANKS_PER_NODE=k` makes
every k consecutive world ranks a node instead, so that one machine can show (and test) a cluster's behaviour.
Every `Communicator` knows the world node of each of its ranks (`Communicator.nodes`; a sub-communicator from
`split` inherits them), so its ledger can count the bytes that leave the node (`Ledger.inter_node_sent()`).

`NodeLayout` is the arithmetic the hierarchical collectives need: node index and local rank of every rank,
the *lanes* (ranks with the same local rank, one per node: the inter-node groups), and, when nodes differ in
size, how the ranks beyond the smallest node's k fold into the first k of their node.

`inter_node_bytes` gives the formula of the bytes one rank sends to other nodes in one collective, per
algorithm (S = the collective's bytes as in `cost_model`, N nodes of k ranks, n = N·k):

    ring (all_reduce / reduce_scatter / all_gather)   2(n−1)/n·S, (n−1)/n·S, (n−1)/n·S  if the rank's right
                                                      neighbour (rank + 1 mod n) is on another node, else 0
    hierarchical                                      2(N−1)/N·S/k, (N−1)/N·S/k, (N−1)/N·S/k on the k lanes
                                                      (k = the smallest node; ranks beyond it send 0)
    recursive doubling / halving, Rabenseifner        the sum over rounds of that round's bytes, counting the
                                                      rounds whose partner lives on another node

Emulated slow links (benchmarks only, never on by default): `MPIPARALLEL_EMULATED_INTER_NODE="α,B"` makes every
message sent to another node wait α seconds plus bytes / B before it leaves (a sleep on the sender, so a
synchronous step of any algorithm lasts as long as its slowest crossing message), on the blocking path, the
asynchronous handles and direct sends alike. With emulated nodes on one machine, that is what makes the node
boundary cost something, as a network would. On the blocking path of a communicator that spans nodes, every
step's wait then sleeps between tests instead of spinning in MPI: with more ranks than cores, spinning
receivers would hold the cores the senders need when their delay is over (measured: 2-3× the emulated delay per
step). `time.sleep` overshoots by some tens of microseconds on Linux; `cost_model.calibrate` measures the links
as they are, delay and polling included.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Sequence

from .mpi import MPI

RANKS_PER_NODE_VARIABLE = "MPIPARALLEL_RANKS_PER_NODE"
EMULATED_INTER_NODE_VARIABLE = "MPIPARALLEL_EMULATED_INTER_NODE"


def emulated_ranks_per_node() -> int | None:
    """k from MPIPARALLEL_RANKS_PER_NODE, or None (nodes are the machines MPI reports)."""
    value = os.environ.get(RANKS_PER_NODE_VARIABLE, "").strip()
    if not value:
        return None
    k = int(value)
    if k < 1:
        raise ValueError(f"{RANKS_PER_NODE_VARIABLE} must be a positive rank count, got {value!r}")
    return k


def emulated_inter_node_link() -> tuple[float, float] | None:
    """(seconds per message, bytes per second) from MPIPARALLEL_EMULATED_INTER_NODE, or None (off)."""
    value = os.environ.get(EMULATED_INTER_NODE_VARIABLE, "").strip()
    if not value:
        return None
    try:
        latency, bandwidth = (float(part) for part in value.split(","))
    except ValueError:
        raise ValueError(f"{EMULATED_INTER_NODE_VARIABLE} takes 'seconds,bytes_per_second' (e.g. 200e-6,1e9), "
                         f"got {value!r}") from None
    return latency, bandwidth


def node_labels(comm: MPI.Comm, node: int | None = None) -> tuple[int, ...]:
    """The node of every rank of `comm` (collective over comm).

    `node` is this process's node when already known (a parent communicator's); otherwise it is world rank // k
    with emulated nodes, or the node's lowest world rank from `COMM_TYPE_SHARED`, renumbered 0, 1, … in order.
    """
    renumber = False
    if node is None:
        k = emulated_ranks_per_node()
        if k is not None:
            node = MPI.COMM_WORLD.Get_rank() // k
        else:
            shared = comm.Split_type(MPI.COMM_TYPE_SHARED)
            try:
                node = shared.allreduce(MPI.COMM_WORLD.Get_rank(), op=MPI.MIN)
            finally:
                shared.Free()
            renumber = True
    labels = tuple(comm.allgather(node))
    if renumber:
        order = {label: index for index, label in enumerate(sorted(set(labels)))}
        labels = tuple(order[label] for label in labels)
    return labels


class NodeLayout:
    """Node index, local rank and lane of every rank of a communicator whose ranks live on `nodes`.

    Nodes are numbered in the order their first rank appears; a node's members are in rank order. With nodes of
    unequal size, k is the smallest node's size: a node's ranks from local rank k on are *extra* and fold into the
    rank with local rank (theirs mod k) — the *core* rank that stands for them in the lanes. The hierarchical
    reduce-scatter and all-gather keep each core rank's blocks together: `block_order` lists the ranks whose
    blocks the work buffer holds, lane by lane, node by node, each core rank followed by its extras.
    """

    def __init__(self, nodes: Sequence[int]) -> None:
        self.nodes = tuple(nodes)
        first_seen: dict[int, int] = {}
        for label in self.nodes:
            first_seen.setdefault(label, len(first_seen))
        self.count = len(first_seen)
        self.node_index = tuple(first_seen[label] for label in self.nodes)
        self.members: tuple[tuple[int, ...], ...] = tuple(
            tuple(r for r, j in enumerate(self.node_index) if j == node) for node in range(self.count))
        self.local_rank = tuple(self.members[j].index(r) for r, j in enumerate(self.node_index))
        self.k = min(len(m) for m in self.members)
        self.even = all(len(m) == self.k for m in self.members)
        self.owned = {members[local]: (members[local], *members[self.k + local::self.k])
                      for members in self.members for local in range(self.k)}
        self.block_order = tuple(r for lane in range(self.k) for j in range(self.count)
                                 for r in self.owned[self.members[j][lane]])
        self.lane_blocks = tuple(sum(len(self.owned[self.members[j][lane]]) for j in range(self.count))
                                 for lane in range(self.k))

    @staticmethod
    @functools.lru_cache(maxsize=256)
    def of(nodes: tuple[int, ...]) -> NodeLayout:
        return NodeLayout(nodes)

    @property
    def spans_nodes(self) -> bool:
        return self.count > 1

    def is_extra(self, rank: int) -> bool:
        return self.local_rank[rank] >= self.k

    def core_of(self, rank: int) -> int:
        """The core rank that stands for `rank` (itself when it is a core rank)."""
        return self.members[self.node_index[rank]][self.local_rank[rank] % self.k]

    def extras_of(self, rank: int) -> tuple[int, ...]:
        return self.owned[rank][1:]

    def core(self, rank: int) -> tuple[int, ...]:
        """The first k ranks of `rank`'s node, in local-rank order (the intra-node group)."""
        return self.members[self.node_index[rank]][:self.k]

    def lane(self, local: int) -> tuple[int, ...]:
        """The ranks with local rank `local`, one per node in node order (an inter-node group)."""
        return tuple(members[local] for members in self.members)

    def crosses(self, a: int, b: int) -> bool:
        return self.nodes[a] != self.nodes[b]


def describe_nodes(nodes: Sequence[int]) -> str:
    """'2 nodes of 4, 4 ranks (emulated: MPIPARALLEL_RANKS_PER_NODE=4)', or '1 node'."""
    layout = NodeLayout.of(tuple(nodes))
    k = emulated_ranks_per_node()
    how = f" (emulated: {RANKS_PER_NODE_VARIABLE}={k})" if k is not None else " (MPI's shared-memory nodes)"
    sizes = ", ".join(str(len(members)) for members in layout.members)
    return f"{layout.count} node{'s' if layout.count > 1 else ''} of {sizes} ranks{how}"


def inter_node_bytes(collective: str, algo: str, nbytes: float, nodes: Sequence[int], rank: int) -> float | None:
    """Bytes `rank` sends to other nodes in one call of `collective` with `algo` on a communicator whose ranks
    live on `nodes` (the formulas of the module docstring); None where no formula is written (mpi, Bruck,
    pairwise, broadcast, reduce)."""
    layout = NodeLayout.of(tuple(nodes))
    n, s = len(layout.nodes), float(nbytes)
    if n == 1 or not layout.spans_nodes:
        return 0.0
    share = {"all_reduce": 2 * (n - 1) / n, "reduce_scatter": (n - 1) / n, "all_gather": (n - 1) / n}
    if collective not in share:
        return None
    if algo == "ring":
        return share[collective] * s if layout.crosses(rank, (rank + 1) % n) else 0.0
    if algo == "hierarchical":
        return _hierarchical_inter_node_bytes(collective, s, layout, rank)
    return _recursive_inter_node_bytes(collective, algo, s, layout, rank)


def _hierarchical_inter_node_bytes(collective: str, s: float, layout: NodeLayout, rank: int) -> float:
    """Only the lanes cross nodes. All-reduce: a ring all-reduce of the lane's S/k over N nodes. Reduce-scatter
    and all-gather: a ring over the N chunks of the lane (each core rank's own block and its extras'), which
    sends every chunk but one (reduce-scatter: all but its own; all-gather: all but the next rank's); with equal
    nodes that is (N−1)/N·S/k."""
    if layout.is_extra(rank):
        return 0.0
    big_n, local, node = layout.count, layout.local_rank[rank], layout.node_index[rank]
    if collective == "all_reduce":
        return 2 * (big_n - 1) / big_n * s / layout.k
    block = s / len(layout.nodes)
    chunks = [len(layout.owned[r]) * block for r in layout.lane(local)]
    skipped = node if collective == "reduce_scatter" else (node + 1) % big_n
    return sum(chunks) - chunks[skipped]


def _recursive_inter_node_bytes(collective: str, algo: str, s: float, layout: NodeLayout, rank: int) -> float | None:
    """Round by round on p = n ranks (a power of two; other counts fold, and have no formula here): doubling
    all-reduce sends S to rank XOR 1, 2, 4, …; halving sends S/2, S/4, … to rank XOR p/2, p/4, …; the doubling
    all-gather sends S/p, 2S/p, … to rank XOR 1, 2, …; Rabenseifner is halving then doubling."""
    n = len(layout.nodes)
    if n & (n - 1):
        return None
    doubling = [(rank ^ d, d) for d in (1 << i for i in range(n.bit_length() - 1))]
    if (collective, algo) == ("all_reduce", "recursive_doubling"):
        messages = [(partner, s) for partner, _ in doubling]
    elif (collective, algo) == ("all_gather", "recursive_doubling"):
        messages = [(partner, s * d / n) for partner, d in doubling]
    elif (collective, algo) == ("reduce_scatter", "recursive_halving"):
        messages = [(partner, s * d / n) for partner, d in reversed(doubling)]
    elif (collective, algo) == ("all_reduce", "rabenseifner"):
        messages = [(partner, s * d / n) for partner, d in [*reversed(doubling), *doubling]]
    else:
        return None
    return sum(size for partner, size in messages if layout.crosses(rank, partner))
