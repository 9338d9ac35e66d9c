"""Expert parallelism (EP): the experts of every MoE layer spread over the n ranks of an EP group, each token row
moved to its experts' ranks and back. The routing, the experts and the gates are `models.moe`'s; what this module
adds is where the rows go (`InMemory`'s moves, overridden) and what each rank holds (`ExpertParallel`, the axis
as the model asks for it: `Transformer(config, …).parallelize(ExpertParallel(ep_comm))`).

Over an EP group of n ranks expert e lives on EP rank e // (E/n). Each rank routes its own
tokens and applies capacity before anything moves, counts the rows for every expert, exchanges those counts
(`plan_dispatch`: one all-to-all of E integers, so every rank can regroup what it will receive), sends the rows
with all-to-allv, regroups them by local expert (one GEMM per expert again) and sends the outputs back with the
reverse all-to-allv. Each wrapper does the forward half; its `_backward` twin does the backward half:

    function                 forward                                      backward
    dispatch_to_experts      all-to-allv rows to their experts' ranks,    un-regroup, reverse all-to-allv
                             regroup by local expert                      (a combine)
    combine_from_experts     un-regroup, reverse all-to-allv              all-to-allv, regroup (a dispatch)

Cost per MoE layer, rank and microbatch, with b bytes per element: forward, dispatch sends s·h·b and combine
r·h·b, where s = kept rows this rank routes to experts on other ranks and r = rows its experts received from
other ranks; backward moves the same again. So 2·(s + r)·h·b bytes of all-to-allv; with balanced routing and no
drops, s = r = (n−1)/n·K·N, i.e. 4·(n−1)/n·K·N·h·b. Rows for experts on this rank are copied, not sent. Besides
(as `all_to_all`): the count exchange, (n−1)/n·E int64 sent in forward (backward reuses the plan), and inside
each of the four all-to-allv calls its own (n−1) int64 counts. With FP8 (`fp8_dispatch`, `--fp8 blockwise`) the
forward dispatch sends E4M3 rows with their scales, s·(h + 4·⌈h/128⌉) bytes instead of s·h·2, and the combine
and both backward exchanges stay at the compute dtype (DeepSeek-V3's choice). Expert parameters are held only
by their EP rank (placement `Held` on the "ep" axis, `expert_placement`); the router is replicated.

Node-limited dispatch (`ep_dispatch="hierarchical"`, DeepSeek-V3; `collectives.two_hop`): when the EP group spans
N nodes and the router keeps each token's experts on few of them, a token crosses to each of its nodes once (to
the rank there with its own local rank), which forwards it to the ranks of the chosen experts. The gates travel
with the token, the expert side weighs its output rows, and the relay sums a token's rows of one node before
they cross back, so the combine crosses once per (token, node) too. With D the two-hop dispatch (a copy of each
token row per kept assignment) and G the gates:

    forward    y  = Dᵀ(G ⊙ experts(D x))                       D: `two_hop_dispatch`, Dᵀ: `two_hop_combine`
    backward   d(G ⊙ out) = D dy;  d gates = Σ_h out ⊙ D dy, back to their assignments (`two_hop_combine_values`);
               d out = G ⊙ D dy;  d x += Dᵀ experts'(d out)

Per layer, rank and microbatch it sends across nodes, forward, the U_b tokens (at most one per token and other
node) with their A_b gates and plan codes, and the rows it relayed back summed; backward the same rows again
(see `collectives.two_hop` for the formula): per token at most M·h·b bytes each way for M other target nodes,
against one h·b row per chosen expert on another node for the flat all-to-allv. The numbers are the flat
dispatch's up to the order of additions (the relay adds a token's rows of its node first). With `fp8_dispatch`
the token rows travel as E4M3 with their scales over both hops. `ExpertTraffic` counts, per EP peer, the rows
and values each exchange moves: `mpiparallel.traffic`'s ep formula is evaluated on them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from collectives import Communicator, all_to_all, all_to_allv
from collectives.backend import Array, get_array_module, like, to_host
from collectives.two_hop import (
    TwoHopPlan,
    plan_two_hop,
    two_hop_combine,
    two_hop_combine_values,
    two_hop_dispatch,
    two_hop_dispatch_values,
)
from models.axis import ExpertAxis
from models.fp8 import pack_rows, quantize_activation, unpack_rows
from models.layers import Saved, row_sums
from models.moe import InMemory, MixtureOfExperts, Router, expert_index
from models.parameter import HELD, Placement

EP_AXIS = "ep"
EP_DISPATCHES = ("flat", "hierarchical")


def local_experts(n_experts: int, ep_rank: int, ep_size: int) -> range:
    """The experts EP rank `ep_rank` holds: expert e lives on rank e // (E/ep)."""
    if n_experts % ep_size:
        raise ValueError(f"expert parallelism splits the experts evenly: n_experts ({n_experts}) must be divisible "
                         f"by ep ({ep_size})")
    share = n_experts // ep_size
    return range(ep_rank * share, (ep_rank + 1) * share)


def expert_placement(name: str, ep_size: int) -> dict[str, Placement]:
    """How the "ep" axis holds a parameter: an expert's only on its EP rank (`Held`); everything else replicated."""
    return {EP_AXIS: HELD} if ep_size > 1 and expert_index(name) is not None else {}


# -- the communication: forward above, backward right under it ---------------------------------------------

@dataclass(frozen=True)
class DispatchPlan:
    """Who sends how many rows to whom in one MoE layer of one microbatch (kept for backward)."""

    send_counts: list[int]    # rows this rank sends to each EP rank (sorted by expert, so grouped by destination)
    recv_counts: list[int]    # rows it receives from each EP rank
    expert_counts: list[int]  # rows each local expert gets
    regroup: np.ndarray       # received rows (by source, then expert) -> grouped by local expert, then source


def plan_dispatch(counts: Sequence[int], comm: Communicator) -> DispatchPlan:
    """Exchange the rows per expert (one all-to-all of E int64): each rank learns how many rows each source
    sends to each of its local experts, and so how to regroup the rows it receives."""
    n = comm.size
    per_destination = np.asarray(counts, np.int64).reshape(n, -1)  # [EP rank, its local expert]
    per_source = all_to_all(per_destination, comm)                 # [source rank, my local expert]
    local_expert_of_row = np.repeat(np.tile(np.arange(per_source.shape[1]), n), per_source.reshape(-1))
    return DispatchPlan(per_destination.sum(axis=1).tolist(), per_source.sum(axis=1).tolist(),
                        per_source.sum(axis=0).tolist(), np.argsort(local_expert_of_row, kind="stable"))


def dispatch_to_experts(rows: Array, plan: DispatchPlan, comm: Communicator, algo: str = "auto") -> Array:
    """Forward: rows sorted by expert go to their experts' EP ranks (all-to-allv, the off-rank rows × h × b
    bytes sent); the received rows are regrouped by local expert, so each expert's rows are contiguous."""
    received, _ = all_to_allv(rows, plan.send_counts, comm, algo=algo)
    return received[like(received, plan.regroup)]


def dispatch_to_experts_backward(dlocal: Array, plan: DispatchPlan, comm: Communicator, algo: str = "auto") -> Array:
    """Backward of a dispatch is a combine: d(rows) go back to the ranks whose tokens they came from."""
    return combine_from_experts(dlocal, plan, comm, algo)


def combine_from_experts(local: Array, plan: DispatchPlan, comm: Communicator, algo: str = "auto") -> Array:
    """Forward: the local experts' outputs, un-regrouped to (source, expert) order, go back to their tokens'
    ranks (the reverse all-to-allv); each rank gets its rows in the order it sent them."""
    xp = get_array_module(local)
    by_source = xp.empty_like(local)
    by_source[like(local, plan.regroup)] = local
    returned, _ = all_to_allv(by_source, plan.recv_counts, comm, algo=algo)
    return returned


def combine_from_experts_backward(drows: Array, plan: DispatchPlan, comm: Communicator, algo: str = "auto") -> Array:
    """Backward of a combine is a dispatch: d(outputs) go to the experts that produced them."""
    return dispatch_to_experts(drows, plan, comm, algo)


def two_hop_plan(routing: Saved, top_k: int, experts_per_rank: int, comm: Communicator) -> TwoHopPlan:
    """The two-hop plan of a routing: each kept assignment (sorted by expert) goes to slot e mod (E/n) of EP rank
    e // (E/n)."""
    experts = np.repeat(np.arange(len(routing.counts)), routing.counts)
    return plan_two_hop(to_host(routing.order) // top_k, experts // experts_per_rank, experts % experts_per_rank,
                        experts_per_rank, comm)


class ExpertTraffic:
    """What this rank's MoE layers exchanged with each EP peer since the last `take()`, forward and backward: the
    counts `mpiparallel.traffic.expert_parallel_bytes` turns into the ep axis's bytes (routing decides them, so
    the layers count them as they plan). Per peer p: `rows_to`/`rows_from` rows of h sent to / received from p
    by the dispatch (the combine returns them), `values_to`/`values_from` the two-hop gates and their gradients,
    `codes_to` the two-hop plan's codes; `calls` the exchanges planned (forward) or reversed (backward)."""

    FIELDS = ("rows_to", "rows_from", "values_to", "values_from", "codes_to")

    def __init__(self, peers: int) -> None:
        self.peers = peers
        self.value_bytes = 0  # the gates' element size (the two-hop dispatch sends them; float32 under bfloat16)
        self.counts = self._empty()

    def _empty(self) -> dict[str, dict[str, Any]]:
        return {direction: {**{name: np.zeros(self.peers, np.int64) for name in self.FIELDS}, "calls": 0}
                for direction in ("forward", "backward")}

    def add(self, direction: str, **counts: Any) -> None:
        totals = self.counts[direction]
        totals["calls"] += 1
        for name, value in counts.items():
            totals[name] += np.asarray(value, np.int64)

    def add_two_hop(self, direction: str, plan: TwoHopPlan, value_bytes: int) -> None:
        """A two-hop exchange: hop 1 with the lane peers (tokens, codes and values per node), hop 2 with the node's
        ranks (one row and value per assignment). The lane and the node share only this rank, which sends
        nothing to itself."""
        lane, node = list(plan.lane), list(plan.node)
        counts = {name: np.zeros(self.peers, np.int64) for name in self.FIELDS}
        counts["rows_to"][lane], counts["rows_from"][lane] = plan.token_counts, plan.relayed_tokens
        counts["values_to"][lane], counts["values_from"][lane] = plan.assignment_counts, plan.relayed_assignments
        counts["codes_to"][lane] = plan.assignment_counts
        for name, inside in (("rows_to", plan.forward_counts), ("rows_from", plan.arrived_counts),
                             ("values_to", plan.forward_counts), ("values_from", plan.arrived_counts)):
            counts[name][node] = inside
        self.value_bytes = value_bytes
        self.add(direction, **counts)

    def take(self) -> dict[str, dict[str, Any]]:
        """The counts so far, and start again from zero."""
        counts, self.counts = self.counts, self._empty()
        return counts | {"value_bytes": self.value_bytes}


# -- the exchanges: how a MoE layer's rows reach this group's experts -------------------------------------------

class AllToAllv(InMemory):
    """The flat dispatch: every kept row goes straight to its expert's EP rank by all-to-allv, and back."""

    def __init__(self, comm: Communicator, algo: str = "auto", traffic: ExpertTraffic | None = None) -> None:
        self.comm, self.algo, self.traffic, self.size = comm, algo, traffic, comm.size

    def dispatch(self, rows: Array, counts: list[int], fp8: bool) -> tuple[Array, DispatchPlan, list[int]]:
        """With `fp8` (DeepSeek-V3's FP8 dispatch) the rows travel as E4M3 bytes with their float32 scales
        (`models.fp8.pack_rows`) and are dequantized on arrival: h + 4·⌈h/128⌉ bytes a row instead of 2h. The
        experts' first FP8 GEMM quantizes them again into the same values and scales, so only the bytes change."""
        plan = plan_dispatch(counts, self.comm)
        self._count("forward", plan)
        if not fp8:
            return dispatch_to_experts(rows, plan, self.comm, self.algo), plan, plan.expert_counts
        packed = dispatch_to_experts(pack_rows(quantize_activation(rows)), plan, self.comm, self.algo)
        return unpack_rows(packed, rows.shape[-1]).dequantize(), plan, plan.expert_counts

    def combine(self, local_out: Array, plan: DispatchPlan) -> Array:
        return combine_from_experts(local_out, plan, self.comm, self.algo)

    def combine_backward(self, dout_rows: Array, plan: DispatchPlan) -> Array:
        self._count("backward", plan)
        return combine_from_experts_backward(dout_rows, plan, self.comm, self.algo)

    def dispatch_backward(self, dlocal_rows: Array, plan: DispatchPlan) -> Array:
        return dispatch_to_experts_backward(dlocal_rows, plan, self.comm, self.algo)

    def _count(self, direction: str, plan: DispatchPlan) -> None:
        if self.traffic is not None:
            self.traffic.add(direction, rows_to=plan.send_counts, rows_from=plan.recv_counts)


class TwoHop(InMemory):
    """DeepSeek-V3's node-limited dispatch (`collectives.two_hop`): each token crosses to each of its nodes once;
    its gates travel with it, so that the expert side weighs its rows and the relay can sum a token's rows of one
    node before they cross back. y = Dᵀ(gates ⊙ experts(D x)), D the two-hop dispatch."""

    def __init__(self, comm: Communicator, traffic: ExpertTraffic | None = None) -> None:
        if not (comm.topology.spans_nodes and comm.topology.even):
            raise ValueError("the hierarchical (two-hop) dispatch needs an EP group spanning nodes of equal size")
        self.comm, self.traffic, self.size = comm, traffic, comm.size

    def forward(self, layer: MixtureOfExperts, x2d: Array, routing: Saved) -> tuple[Array, Saved]:
        plan = two_hop_plan(routing, layer.router.top_k, len(layer.experts), self.comm)
        if self.traffic is not None:
            self.traffic.add_two_hop("forward", plan, routing.gates.itemsize)
        if layer.fp8_dispatch:  # one quantization per token row: what the flat dispatch's copies of it would get
            packed = two_hop_dispatch(pack_rows(quantize_activation(x2d)), plan, self.comm)
            rows = unpack_rows(packed, x2d.shape[-1]).dequantize()
        else:
            rows = two_hop_dispatch(x2d, plan, self.comm)
        gates = two_hop_dispatch_values(routing.gates.reshape(-1)[routing.order], plan, self.comm)
        local_out, experts = layer.run_experts(rows, plan.slot_counts)
        weighed = (local_out * gates[:, None]).astype(local_out.dtype, copy=False)
        y = two_hop_combine(weighed, plan, self.comm, len(x2d))
        return y, Saved(router=routing, plan=plan, expert_counts=plan.slot_counts, experts=experts,
                        local_out=local_out, gates=gates, stats=routing.stats)

    def backward_input(self, layer: MixtureOfExperts, saved: Saved, dy: Array) -> Array:
        """The transpose of each step of `forward`: d(weighed rows) = D dy (a dispatch), d(gates) back to their
        assignments (the values' combine), d(rows) through the experts, then d(x) = Dᵀ d(rows) (a combine)."""
        routing, plan, k = saved.router, saved.plan, layer.router.top_k
        if self.traffic is not None:
            self.traffic.add_two_hop("backward", plan, saved.gates.itemsize)
        dweighed = two_hop_dispatch(dy, plan, self.comm)
        dlocal_gates = row_sums(dweighed * saved.local_out)[:, 0].astype(saved.gates.dtype, copy=False)
        dlocal_out = (dweighed * saved.gates[:, None]).astype(dweighed.dtype, copy=False)
        dgates = get_array_module(dy).zeros(routing.gates.size, saved.gates.dtype)
        dgates[routing.order] = two_hop_combine_values(dlocal_gates, plan, self.comm)
        dlocal_rows = layer.experts_backward_input(saved.experts, dlocal_out, saved.expert_counts)
        dx = layer.router.backward_input(routing, dgates.reshape(-1, k))
        dx += two_hop_combine(dlocal_rows, plan, self.comm, len(dy))
        del saved.local_out, saved.gates, saved.plan, saved.expert_counts
        return dx


def exchange_over(comm: Any, dispatch: str = "flat", algo: str = "auto",
                  traffic: ExpertTraffic | None = None) -> InMemory:
    """How a MoE layer reaches the experts of the EP group `comm`: "flat" all-to-allv or "hierarchical" two-hop
    (`InMemory` for a group of one)."""
    if dispatch not in EP_DISPATCHES:
        raise ValueError(f"ep_dispatch must be one of {EP_DISPATCHES}, got {dispatch!r}")
    comm = Communicator.of(comm)
    if comm.size == 1:
        return InMemory()
    return TwoHop(comm, traffic) if dispatch == "hierarchical" else AllToAllv(comm, algo, traffic)


# -- the axis: what the model asks of expert parallelism -------------------------------------------------------

class ExpertParallel(ExpertAxis):
    """This rank's E/n experts, and tokens that reach experts on other ranks by `dispatch` ("flat" all-to-allv, or
    "hierarchical": node-limited, `collectives.two_hop`). Each rank builds only its experts (their parameters
    placed `Held` on "ep": no other rank has a copy, so their gradients are summed over expert_dp, not dp); what
    the exchanges sent is counted in `traffic` (read by the trainer's ep byte ledger)."""

    def __init__(self, comm: Any, dispatch: str = "flat") -> None:
        if dispatch not in EP_DISPATCHES:
            raise ValueError(f"ep_dispatch must be one of {EP_DISPATCHES}, got {dispatch!r}")
        self.comm, self.dispatch = Communicator.of(comm), dispatch
        self.rank, self.size = self.comm.rank, self.comm.size
        self.traffic = ExpertTraffic(self.size)

    def fit(self, config: Any) -> None:
        local_experts(config.n_experts, self.rank, self.size)  # raises unless n divides the experts

    def held_experts(self, n_experts: int) -> range:
        return local_experts(n_experts, self.rank, self.size)

    def placement(self, name: str) -> dict[str, Placement]:
        return expert_placement(name, self.size)

    def mixture(self, router: Router, experts: list[Any], fp8_dispatch: bool) -> MixtureOfExperts:
        exchange = exchange_over(self.comm, self.dispatch, traffic=self.traffic)
        return MixtureOfExperts(router, experts, exchange, fp8_dispatch=fp8_dispatch)
