"""The two-hop all-to-all (`collectives.two_hop`) on emulated nodes: what arrives where, the combine as the
dispatch's transpose, and the bytes that cross nodes against counts taken from the routing itself."""

from __future__ import annotations

import numpy as np
from mpi4py import MPI

from collectives import Communicator, all_to_allv
from collectives.two_hop import (
    ROWS,
    plan_two_hop,
    two_hop_combine,
    two_hop_combine_values,
    two_hop_dispatch,
    two_hop_dispatch_values,
)


def _routing(rng: np.random.Generator, tokens: int, top_k: int, slots: int, comm: Communicator,
             nodes_per_token: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Each token's top_k distinct experts (rank·slots + slot) on at most `nodes_per_token` random nodes."""
    layout = comm.topology
    per_node = layout.k * slots
    chosen_tokens, chosen_experts = [], []
    for t in range(tokens):
        nodes = rng.choice(layout.count, nodes_per_token, replace=False)
        pool = np.concatenate([[r * slots + s for r in layout.members[b] for s in range(slots)] for b in nodes])
        experts = rng.choice(pool, min(top_k, len(pool), per_node * nodes_per_token), replace=False)
        chosen_tokens += [t] * len(experts)
        chosen_experts += list(experts)
    experts = np.array(chosen_experts, np.int64)
    order = np.argsort(experts, kind="stable")  # as the MoE layer sorts its assignments: by expert
    return np.array(chosen_tokens, np.int64)[order], experts[order] // slots, experts[order] % slots


def exchanges(tokens: int, top_k: int, slots: int, width: int, nodes_per_token: int, seed: int) -> dict:
    comm = Communicator(MPI.COMM_WORLD.Dup())
    rng = np.random.default_rng(seed + comm.rank)
    token_of, rank_of, slot_of = _routing(rng, tokens, top_k, slots, comm, nodes_per_token)
    x = rng.integers(-50, 50, (tokens, width)).astype(np.float64)
    x[:, 0] = comm.rank * tokens + np.arange(tokens)  # each row names its token
    values = rng.integers(1, 9, len(token_of)).astype(np.float64)
    comm.ledger.reset()
    plan = plan_two_hop(token_of, rank_of, slot_of, slots, comm)
    arrived = two_hop_dispatch(x, plan, comm)
    arrived_values = two_hop_dispatch_values(values, plan, comm)
    combined = two_hop_combine(arrived * arrived_values[:, None], plan, comm, tokens)
    values_back = two_hop_combine_values(arrived_values, plan, comm)
    two_hop_bytes = comm.ledger.inter_node_sent()
    everyone = comm.comm.allgather((token_of, rank_of, slot_of, x, values))
    failures = []
    start = 0
    for slot, count in enumerate(plan.slot_counts):  # every assignment to my slot, whatever order it came in
        expected = sorted((source * tokens + t, float(v)) for source, (ts, rs, ss, _, vs) in enumerate(everyone)
                          for t, r, s, v in zip(ts, rs, ss, vs, strict=True) if r == comm.rank and s == slot)
        got = arrived[start:start + count]
        order = np.argsort(got[:, 0], kind="stable")
        if [e[0] for e in expected] != got[order, 0].tolist():
            failures.append(f"slot {slot}: tokens {got[order, 0].tolist()} instead of {[e[0] for e in expected]}")
        for row, (token, _) in zip(got[order], expected, strict=False):
            source, t = divmod(int(token), tokens)
            if not np.array_equal(row, everyone[source][3][t]):
                failures.append(f"slot {slot}: token {token}'s row differs")
        if sorted(arrived_values[start:start + count].tolist()) != sorted(e[1] for e in expected):
            failures.append(f"slot {slot}: the values differ")
        start += count
    totals = np.zeros(tokens)
    np.add.at(totals, token_of, values)
    if not np.array_equal(combined, x * totals[:, None]):
        failures.append("the combine is not the sum of each token's weighted copies")
    if not np.array_equal(values_back, values):
        failures.append("combine_values(dispatch_values(v)) is not v")
    rows_across = comm.ledger.inter_node_sent(ROWS)
    # the flat all-to-allv of one row per assignment and back, for comparison
    comm.ledger.reset()
    received, counts = all_to_allv(x[token_of], np.bincount(rank_of, minlength=comm.size).tolist(), comm)
    all_to_allv(received, counts, comm)
    remote = [comm.topology.crosses(comm.rank, r) for r in range(comm.size)]
    flat_formula = (sum(remote[r] for r in rank_of) + sum(c for c, far in zip(counts, remote, strict=True) if far)) \
        * x.itemsize * width + 2 * 8 * sum(remote)  # rows there and back, each call's counts
    return {"failures": failures, "two_hop_inter_node": two_hop_bytes, "two_hop_rows": rows_across,
            "flat_inter_node": comm.ledger.inter_node_sent(), "flat_formula": flat_formula,
            "formula": _inter_node_formula(everyone, comm, tokens, slots, x.itemsize * width)}


def _inter_node_formula(everyone: list, comm: Communicator, tokens: int, slots: int, row_bytes: int) -> float:
    """The module docstring's bytes across nodes for one plan, dispatch, values dispatch, combine and values combine,
    counted from every rank's routing: as a source, U_b rows, A_b codes and values for each other node b; as a
    relay, the rows (one per token) and values that came from each other node go back; plus the count blocks."""
    layout, me = comm.topology, comm.rank
    node = np.asarray(layout.node_index)
    total = 16.0 * (layout.count - 1)  # the counts: two int64 to each lane peer
    for b in range(layout.count):
        if b == node[me]:
            continue
        token_of, rank_of, _, _, _ = everyone[me]
        to_b = node[rank_of] == b
        total += len(np.unique(token_of[to_b])) * row_bytes + to_b.sum() * (8 + 8)  # rows, codes, values
        peer = layout.members[b][layout.local_rank[me]]  # my lane peer on node b relays to my node
        token_of, rank_of, _, _, _ = everyone[peer]
        from_b = node[rank_of] == node[me]
        total += len(np.unique(token_of[from_b])) * row_bytes + from_b.sum() * 8  # summed rows, values back
    return total


def layer_against_sets(n_experts: int, top_k: int, capacity_factor: float, fp8: bool = False) -> dict:
    """The MoE layer with the two-hop dispatch (EP over the world, on emulated nodes), with capacity dropping
    rows, against the serial layer run on each rank's token set: y, d(x), the router's and the held experts'
    gradients; and against the flat EP layer's bytes across nodes."""
    from moe_oracle import copy_experts, random_experts

    from collectives import all_reduce
    from models.moe import MixtureOfExperts, Router
    from models.parameter import Parameter
    from mpiparallel.axes.expert_parallel import exchange_over, local_experts

    from .errors import relative_error

    comm, h, tokens = Communicator(MPI.COMM_WORLD.Dup()), 8, 8
    rng = np.random.default_rng([5, n_experts, top_k])
    weight, experts = rng.standard_normal((h, n_experts)), random_experts(rng, h, n_experts)
    x, dout = rng.standard_normal((2, comm.size, tokens, h))

    def layer(held: list, ep_comm: Communicator | None = None, dispatch: str = "flat") -> MixtureOfExperts:
        router = Router(Parameter("router.weight", weight.copy()), top_k, capacity_factor=capacity_factor)
        exchange = None if ep_comm is None else exchange_over(ep_comm, dispatch)
        return MixtureOfExperts(router, copy_experts(held), exchange)

    serial = layer(experts)
    y, saved = serial.forward(x[comm.rank][None])
    dropped = saved.stats.dropped_tokens
    dx = serial.backward(saved, dout[comm.rank][None].copy())
    held = local_experts(n_experts, comm.rank, comm.size)
    # each rank ran the serial layer on its own token set: their gradients summed are the whole batch's
    serial_router = all_reduce(serial.router.weight.grad, comm)
    serial_experts = {(e, part): all_reduce(getattr(serial.experts[e], part).weight.grad, comm)
                      for e in range(n_experts) for part in ("expand", "contract")}
    errors, across = {}, {}
    for dispatch in ("flat", "hierarchical"):
        parallel = layer([experts[e] for e in held], comm, dispatch)
        comm.ledger.reset()
        y_ep, saved_ep = parallel.forward(x[comm.rank][None])
        dx_ep = parallel.backward(saved_ep, dout[comm.rank][None].copy())
        across[dispatch] = comm.ledger.inter_node_sent()
        errors[f"{dispatch} y"] = relative_error(y_ep, y)
        errors[f"{dispatch} dx"] = relative_error(dx_ep, dx)
        errors[f"{dispatch} router"] = relative_error(all_reduce(parallel.router.weight.grad, comm), serial_router)
        for mine, expert in zip(parallel.experts, held, strict=True):
            for part in ("expand", "contract"):
                errors[f"{dispatch} expert {expert} {part}"] = relative_error(getattr(mine, part).weight.grad,
                                                                              serial_experts[expert, part])
    return {"errors": errors, "dropped_tokens": int(dropped), "across": across}
