"""Two-hop all-to-all: DeepSeek-V3's node-limited expert dispatch and combine, across nodes once per target node.

Expert parallelism over n ranks on N nodes of k ranks sends each token to the ranks of its chosen experts. The flat
all-to-allv (`mpiparallel.axes.expert_parallel.dispatch_to_experts`) sends one copy per chosen expert, so a token
whose K experts lie on M other nodes crosses the slow links between nodes once per expert on them. DeepSeek-V3
limits every token to at most M nodes and sends it in two hops:

1. across nodes, once per target node, to the rank of that node with the same local rank (its *lane* peer);
2. inside the target node, from that relay rank to the ranks holding the chosen experts, one row per expert.

The combine goes back the same way: each expert rank returns its output rows to the relay (hop 2 reversed), the
relay *sums* the rows of one token (its experts on that node) and sends one row per token back across nodes
(hop 1 reversed), and the source sums a token's rows from its nodes. As linear maps, dispatch D copies token rows
to (token, expert) rows and combine is its transpose Dᵀ (a sum over each token's copies): so the backward of a
dispatch is a combine of the gradients, and the backward of a combine a dispatch, both written here.

A second, thin channel carries one value per (token, expert) assignment along the same route without merging:
`two_hop_dispatch_values` (the gates, so the expert side can weigh its rows before the relay sums them) and its
transpose `two_hop_combine_values` (their gradients, back to the assignments they came from).

The plan (`plan_two_hop`) is built once per dispatch and reused by the combine and by backward: each source tells
each lane peer how many tokens and assignments it sends, and one int64 code per assignment (the token's position
among those sent to that node and the expert's slot on the node); each relay then tells each rank of its node how
many rows it forwards to each of that rank's slots (experts), so every rank can regroup what it receives by slot.

Every exchange is a pairwise all-to-allv among a group of the communicator's ranks (hop 1: the lane, hop 2: the
node), run on the communicator itself so its ledger counts every byte. Costs per dispatch on a rank with U_b
tokens for node b, A_b assignments to node b, R_l rows forwarded to local rank l, slots S per rank, rows of B
bytes and values of v bytes (α, β across nodes: e; inside: i):

    plan       (N−1)·αe + (N−1)·16 B·βe + 8·Σ_{b≠own} A_b·βe                 counts and codes across nodes
               (k−1)·αi + (k−1)·8·S B·βi                                     slot counts inside the node
    dispatch   (N−1)·αe + Σ_{b≠own} U_b·B·βe   then   (k−1)·αi + Σ_{l≠own} R_l·B·βi
    values     the same messages with v bytes per assignment instead of B per token (A_b, R_l)
    combine    the dispatch's messages reversed: the rows this rank received in each hop go back

so a token crosses nodes at most once per target node, U_b ≤ tokens, and with M target nodes per token at most
M·B bytes per token leave the node (M−1 when its own node is among them), against one B-byte row per chosen
expert on another node for the flat all-to-allv. Needs nodes of equal size (`NodeLayout.even`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .arguments import row_offsets
from .backend import Array, get_array_module, like, needs_words, scatter_add
from .communicator import Communicator, in_words
from .hierarchical import among
from .pairwise import pairwise_all_to_all, pairwise_all_to_allv

PLAN = "two_hop_plan"
ROWS = "two_hop_rows"
VALUES = "two_hop_values"


@dataclass(frozen=True)
class TwoHopPlan:
    """Who sends what to whom in one two-hop dispatch, seen from one rank in its three roles.

    As a source: `tokens` (the token rows it sends, node by node; its own node's are copied) with
    `token_counts[b]` for node b, and `assignments` (its assignments' indices, node by node, in the order of their
    codes) with `assignment_counts[b]`. As a relay: `relayed_tokens[b]` and `relayed_assignments[b]` received from
    node b; `forward_rows` (for each row it forwards, sorted by destination rank and slot, the received token it
    copies), `forward_assignments` (the received assignment each forwarded row stands for) and `forward_counts[l]`
    rows to local rank l. As a destination: `arrived_counts[l]` rows from the relay with local rank l, `regroup`
    (arrived rows → grouped by slot) and `slot_counts[j]` rows for its slot j."""

    lane: tuple[int, ...]
    node: tuple[int, ...]
    tokens: np.ndarray
    token_counts: list[int]
    assignments: np.ndarray
    assignment_counts: list[int]
    relayed_tokens: list[int]
    relayed_assignments: list[int]
    forward_rows: np.ndarray
    forward_assignments: np.ndarray
    forward_counts: list[int]
    arrived_counts: list[int]
    regroup: np.ndarray
    slot_counts: list[int]


def _exchange(x: Array, send_counts: list[int], recv_counts: list[int], group: tuple[int, ...], comm: Communicator,
              name: str) -> Array:
    """Pairwise all-to-allv of `x`'s rows among the ranks `group` of `comm` (this rank among them): send_counts[j]
    rows to group[j], recv_counts[j] rows from it; the block for this rank is copied."""
    xp, row = get_array_module(x), int(np.prod(x.shape[1:], dtype=np.int64))
    out = xp.empty((sum(recv_counts), *x.shape[1:]), x.dtype)
    steps = pairwise_all_to_allv(x.reshape(-1), row_offsets(send_counts, row), out.reshape(-1),
                                 row_offsets(recv_counts, row), group.index(comm.rank), len(group))
    comm.run(among(in_words(steps) if needs_words(x.dtype) else steps, group), name)
    return out


def _exchange_counts(counts: np.ndarray, group: tuple[int, ...], comm: Communicator) -> np.ndarray:
    """Pairwise all-to-all of equal int64 blocks (counts[j] to group[j]) among `group`: the blocks received."""
    out = np.empty_like(counts)
    comm.run(among(pairwise_all_to_all(counts.reshape(-1), out.reshape(-1), group.index(comm.rank), len(group)),
                   group), PLAN)
    return out


def plan_two_hop(tokens: np.ndarray, ranks: np.ndarray, slots: np.ndarray, slots_per_rank: int,
                 comm: Communicator) -> TwoHopPlan:
    """The plan for assignments (tokens[a] to slot slots[a] of rank ranks[a] of `comm`, host int arrays): the
    counts and codes of hop 1 across nodes, the slot counts of hop 2 inside the node."""
    layout = comm.topology
    if not layout.even:
        raise ValueError(f"the two-hop all-to-all needs nodes of equal size, got {[len(m) for m in layout.members]}")
    k, me = layout.k, comm.rank
    lane, node = layout.lane(layout.local_rank[me]), layout.members[layout.node_index[me]]
    node_of = np.asarray(layout.node_index)[ranks]
    node_slot = np.asarray(layout.local_rank)[ranks] * slots_per_rank + slots  # the expert's place on its node
    by_node = np.lexsort((node_slot, tokens, node_of))
    sent_tokens, token_counts, codes = [], [], []
    for b in range(layout.count):
        mine = by_node[node_of[by_node] == b]
        unique, position = np.unique(tokens[mine], return_inverse=True)
        sent_tokens.append(unique)
        token_counts.append(len(unique))
        codes.append(position * (k * slots_per_rank) + node_slot[mine])
    counts = np.array([token_counts, [len(c) for c in codes]], np.int64).T.copy()
    received = _exchange_counts(counts, lane, comm)
    relayed_tokens, relayed_assignments = received[:, 0].tolist(), received[:, 1].tolist()
    arrived_codes = _exchange(np.concatenate(codes).astype(np.int64), counts[:, 1].tolist(), relayed_assignments,
                              lane, comm, PLAN)
    token_offset = np.repeat(np.cumsum([0, *relayed_tokens[:-1]]), relayed_assignments)
    relayed_token = token_offset + arrived_codes // (k * slots_per_rank)
    relayed_slot = arrived_codes % (k * slots_per_rank)
    forward = np.argsort(relayed_slot, kind="stable")  # by destination rank, then slot; arrival order inside
    per_slot = np.bincount(relayed_slot, minlength=k * slots_per_rank).reshape(k, slots_per_rank)
    per_source = _exchange_counts(per_slot, node, comm)  # [relay's local rank, my slot]
    slot_of_row = np.repeat(np.tile(np.arange(slots_per_rank), k), per_source.reshape(-1))
    return TwoHopPlan(lane, node, np.concatenate(sent_tokens), token_counts, by_node, counts[:, 1].tolist(),
                      relayed_tokens, relayed_assignments, relayed_token[forward], forward,
                      per_slot.sum(axis=1).tolist(), per_source.sum(axis=1).tolist(),
                      np.argsort(slot_of_row, kind="stable"), per_source.sum(axis=0).tolist())


# -- token rows: dispatch (copies) and combine (sums), each the other's backward ---------------------------------

def two_hop_dispatch(x: Array, plan: TwoHopPlan, comm: Communicator) -> Array:
    """Token rows `x` (tokens, …) to the assignments' ranks: across nodes once per (token, node), then one row per
    assignment inside the node; returns this rank's rows grouped by slot. Backward: `two_hop_combine`."""
    relayed = _exchange(x[like(x, plan.tokens)], plan.token_counts, plan.relayed_tokens, plan.lane, comm, ROWS)
    forwarded = relayed[like(x, plan.forward_rows)]
    arrived = _exchange(forwarded, plan.forward_counts, plan.arrived_counts, plan.node, comm, ROWS)
    return arrived[like(x, plan.regroup)]


def two_hop_combine(rows: Array, plan: TwoHopPlan, comm: Communicator, tokens: int) -> Array:
    """Rows grouped by slot (as `two_hop_dispatch` returned them) back to their tokens, summed: the relay adds a
    token's rows from its node before they cross, the source adds its nodes' sums. Returns (tokens, …), zero for
    tokens sent nowhere. Backward: `two_hop_dispatch`."""
    xp = get_array_module(rows)
    arrived = xp.empty_like(rows)
    arrived[like(rows, plan.regroup)] = rows
    forwarded = _exchange(arrived, plan.arrived_counts, plan.forward_counts, plan.node, comm, ROWS)
    relayed = xp.zeros((sum(plan.relayed_tokens), *rows.shape[1:]), rows.dtype)
    scatter_add(relayed, like(rows, plan.forward_rows), forwarded)
    returned = _exchange(relayed, plan.relayed_tokens, plan.token_counts, plan.lane, comm, ROWS)
    out = xp.zeros((tokens, *rows.shape[1:]), rows.dtype)
    scatter_add(out, like(rows, plan.tokens), returned)
    return out


# -- one value per assignment: the same route, nothing merged --------------------------------------------------------

def two_hop_dispatch_values(values: Array, plan: TwoHopPlan, comm: Communicator) -> Array:
    """One value per assignment (in the order the plan was given them) to where its row arrived: grouped by slot
    like `two_hop_dispatch`'s rows. Backward: `two_hop_combine_values`."""
    relayed = _exchange(values[like(values, plan.assignments)], plan.assignment_counts, plan.relayed_assignments,
                        plan.lane, comm, VALUES)
    forwarded = relayed[like(values, plan.forward_assignments)]
    arrived = _exchange(forwarded, plan.forward_counts, plan.arrived_counts, plan.node, comm, VALUES)
    return arrived[like(values, plan.regroup)]


def two_hop_combine_values(values: Array, plan: TwoHopPlan, comm: Communicator) -> Array:
    """Values grouped by slot back to their assignments, in the order the plan was given them (the transpose of
    `two_hop_dispatch_values`). Backward: `two_hop_dispatch_values`."""
    xp = get_array_module(values)
    arrived = xp.empty_like(values)
    arrived[like(values, plan.regroup)] = values
    forwarded = _exchange(arrived, plan.arrived_counts, plan.forward_counts, plan.node, comm, VALUES)
    relayed = xp.empty_like(forwarded)
    relayed[like(values, plan.forward_assignments)] = forwarded
    returned = _exchange(relayed, plan.relayed_assignments, plan.assignment_counts, plan.lane, comm, VALUES)
    out = xp.empty_like(returned)
    out[like(values, plan.assignments)] = returned
    return out

