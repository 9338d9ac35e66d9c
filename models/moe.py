"""Mixture of experts (MoE): a router sends each token to K of E GPT-2 MLP experts; expert parallelism (EP) puts
the experts on different ranks and moves the tokens to them and back with all-to-all(v).

The math, for one local token set (one microbatch on one rank: N tokens x_n of h channels), E experts, K choices:

    probs_n    = softmax(x_n · W_r)                             W_r [h, E] (`h.{i}.mlp.router.weight`), no bias
    chosen_n   = the K experts with the largest probs_n + b      ties → the lower index; the per-expert bias b
                                                                (`expert_bias`) only chooses, it enters no gate
    gate_nk    = probs_n[chosen_nk] / Σ_j probs_n[chosen_nj]     (renormalize=False: probs_n[chosen_nk]); over
                                                                all K choices, dropped ones included
    capacity   = ⌈C·K·N/E⌉ rows per expert (C = 0: unlimited)    each expert keeps its first `capacity`
                                                                assignments in token order and drops the rest
    y_n        = Σ_{k kept} gate_nk · expert_{chosen_nk}(x_n)    a token whose choices were all dropped gets
                                                                y_n = 0: the block's residual carries it alone
    aux        = coef · E · Σ_e f_e · P̄_e                       Switch Transformer's load-balancing loss:
                                                                f_e = assignments to e / (K·N), the router's
                                                                choices before capacity; P̄_e = mean_n probs_ne

Every expert is a GPT-2 MLP (c_fc [h, 4h] + bias, GELU tanh, c_proj [4h, h] + bias). Tokens reach the experts
by a permutation, never a loop over tokens: the kept assignments are sorted by expert (stably: token order
inside an expert), their token rows gathered in that order, and each expert runs as one GEMM over its
contiguous slice; the outputs, scaled by their gates, go back to (token, choice) slots summed over the choices.

The aux loss in the objective. A step averages the aux losses of its token sets (microbatches × DP·CP ranks),
so each set's aux enters the objective with weight `aux_weight` = 1 / (the number of sets). The router adds that
term's gradient, aux_weight · coef · E · f_e / N, to d(probs) (f counts choices: it has no gradient). The value
is in `RouterStats.aux_loss`; `models.transformer.Transformer.forward` adds aux_loss · aux_weight to the loss it
returns.

Backward from dy (choosing has no gradient; the chosen probs do):

    d expert_out_nk = gate_nk · dy_n                            kept assignments only
    d gate_nk       = ⟨dy_n, expert_out_nk⟩                     0 when dropped
    d chosen probs  = (d gate_n − Σ_j d gate_nj · gate_nj) / Σ_j probs_n[chosen_nj]      (raw gates: d gate)
    d probs         = those at the chosen columns, + the aux term; d logits = the softmax's backward
    d x_n           = d logits_n · W_rᵀ + Σ_k d expert_in_nk

Aux-loss-free balancing (DeepSeek-V3): after each optimizer step, `update_expert_bias` moves every expert's
bias by R·sign(mean(c) − c_e), c_e the assignments to expert e over the step's whole global batch.

Expert parallelism over an EP group of n ranks: expert e lives on EP rank e // (E/n). Each rank routes its own
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

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from fractions import Fraction
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

from .fp8 import pack_rows, quantize_activation, unpack_rows
from .layers import MLP, Block, Layer, Saved, column_sums, row_sums, softmax_backward
from .parameter import HELD, Parameter, Placement

EP_AXIS = "ep"
EP_DISPATCHES = ("flat", "hierarchical")
_EXPERT_NAME = re.compile(r"\.mlp\.experts\.(\d+)\.")


# -- names and placement ---------------------------------------------------------------------------------------

def expert_index(name: str) -> int | None:
    """The expert a parameter belongs to (`transformer.h.0.mlp.experts.3.c_fc.weight` -> 3), None for others."""
    match = _EXPERT_NAME.search(name)
    return None if match is None else int(match.group(1))


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


def expert_capacity(capacity_factor: float, top_k: int, tokens: int, n_experts: int) -> int | None:
    """⌈C·K·tokens/E⌉ rows per expert, None when C = 0 (unlimited). C is taken as the decimal it was written as
    (0.3, not the binary float just above it), so capacities that are whole numbers are not rounded up."""
    if capacity_factor == 0:
        return None
    return math.ceil(Fraction(repr(float(capacity_factor))) * top_k * tokens / n_experts)


# -- statistics and aux-loss-free balancing ----------------------------------------------------------------------

@dataclass(frozen=True)
class RouterStats:
    """What the router did with one token set (or, summed with `+`, with several): for the log and for
    aux-loss-free balancing. Counts are host NumPy int64 arrays over the E experts."""

    tokens: int
    assignments: np.ndarray  # the router's choices per expert, before capacity: c_e of `update_expert_bias`
    processed: np.ndarray    # rows each expert computed, after capacity
    dropped_tokens: int      # tokens whose every choice was dropped (only the residual carries them)
    aux_loss: float          # coef·E·Σ_e f_e·P̄_e (summed over the sets added together)

    def __add__(self, other: RouterStats) -> RouterStats:
        return RouterStats(self.tokens + other.tokens, self.assignments + other.assignments,
                           self.processed + other.processed, self.dropped_tokens + other.dropped_tokens,
                           self.aux_loss + other.aux_loss)

    @property
    def dropped_assignments(self) -> int:
        return int(self.assignments.sum() - self.processed.sum())

    def as_log(self) -> dict[str, Any]:
        """JSON-able: tokens per expert, dropped tokens and assignments, aux loss, max and mean load (choices)."""
        return {"tokens_per_expert": self.processed.tolist(), "dropped_tokens": self.dropped_tokens,
                "dropped_assignments": self.dropped_assignments, "aux_loss": self.aux_loss,
                "max_load": int(self.assignments.max()), "mean_load": float(self.assignments.mean())}


def update_expert_bias(bias: Array, counts: Array, rate: float) -> None:
    """DeepSeek-V3's aux-loss-free balancing step, in place: bias_e += rate·sign(mean(c) − c_e).

    `counts` must be the assignments to each expert over the whole global batch of the step (every microbatch and
    rank), so every rank applies the same update and the biases stay equal. Under-loaded experts (c_e below the
    mean) gain bias and are chosen more often; over-loaded ones lose it."""
    counts = like(bias, counts).astype(bias.dtype)
    bias += rate * get_array_module(bias).sign(counts.mean() - counts)


# -- the router ----------------------------------------------------------------------------------------------

def sortable(scores: Array) -> Array:
    """`scores` in a dtype every backend sorts: CuPy sorts through Thrust, which has no bfloat16 ("Sorting arrays
    with dtype 'bfloat16' is not supported"); widening to float32 is exact, so the order is the same."""
    return scores.astype(np.float32) if scores.dtype.itemsize < 4 else scores


def _softmax(logits: Array) -> Array:
    """Row softmax, in place."""
    xp = get_array_module(logits)
    logits -= logits.max(axis=-1, keepdims=True)
    xp.exp(logits, out=logits)
    logits /= row_sums(logits)
    return logits


class Router:
    """Chooses K experts per token and their gates, applies capacity, and computes the aux loss (see the module
    docstring); its backward takes d(gates) and returns d(x) from the router's path.

    `forward(x2d)` returns the routing as a `Saved`: `order` (the kept assignments a = n·K + k, sorted by expert,
    token order inside each), `counts` (host list: rows per expert after capacity), `gates` (N, K), `stats`, and
    what backward needs. `aux_weight` is d(objective)/d(aux_loss) of this token set: 1 / (token sets per step).
    `expert_bias` (E,), held by the caller and updated in place by `update_expert_bias`, is added to the probs only
    to choose. A router of another kind (DeepSeek's `SigmoidRouter`) overrides the five methods that say how scores
    are made, gates taken, experts chosen and balance measured; assignment, capacity and backward are shared.
    """

    def __init__(self, weight: Parameter, top_k: int, renormalize: bool = True, capacity_factor: float = 0.0,
                 aux_coef: float = 0.0, aux_weight: float = 1.0, expert_bias: Array | None = None) -> None:
        n_experts = weight.data.shape[1]
        if not 1 <= top_k <= n_experts:
            raise ValueError(f"top_k must be between 1 and the number of experts ({n_experts}), got {top_k}")
        if capacity_factor < 0 or aux_coef < 0:
            raise ValueError(f"capacity_factor and aux_coef must be >= 0, got {capacity_factor} and {aux_coef}")
        self.weight, self.top_k, self.renormalize = weight, top_k, renormalize
        self.capacity_factor, self.aux_coef, self.aux_weight = capacity_factor, aux_coef, aux_weight
        self.expert_bias = expert_bias
        self.scaling = 1.0  # the gates' factor (DeepSeek's routed_scaling_factor; 1 for softmax routing)

    @property
    def n_experts(self) -> int:
        return self.weight.data.shape[1]

    def forward(self, x2d: Array, sequences: int = 1) -> Saved:
        """Route the N tokens of `x2d` (N, h), which are `sequences` sequences of N/sequences tokens (unused here;
        DeepSeek's sequence-wise balance loss needs them)."""
        xp = get_array_module(x2d)
        scores = self._scores(x2d @ self.weight.data)
        chosen = self._choose(scores)
        chosen_total, gates = self._gates(xp.take_along_axis(scores, chosen, axis=1))
        capacity = expert_capacity(self.capacity_factor, self.top_k, len(x2d), self.n_experts)
        order, assignments = self._assign(chosen.reshape(-1), capacity)
        counts = to_host(assignments) if capacity is None else np.minimum(to_host(assignments), capacity)
        routing = Saved(x2d=x2d, scores=scores, chosen=chosen, chosen_total=chosen_total, gates=gates, order=order,
                        counts=counts.tolist(), sequences=sequences)
        tokens = len(x2d)
        routing.stats = RouterStats(tokens, to_host(assignments), counts, self._dropped_tokens(order, tokens),
                                    self._balance_loss(routing, to_host(assignments)))
        return routing

    # How a router scores, gates, chooses and balances; DeepSeek's SigmoidRouter overrides each of these five.

    def _scores(self, logits: Array) -> Array:
        """The routing probabilities: softmax over the experts."""
        return _softmax(logits)

    def _gates(self, chosen_scores: Array) -> tuple[Array | None, Array]:
        """(the chosen scores' row sums, or None without renormalizing; the gates (N, K))."""
        if not self.renormalize:
            return None, chosen_scores
        chosen_total = row_sums(chosen_scores)
        return chosen_total, chosen_scores / chosen_total

    def _choose(self, probs: Array) -> Array:
        """The K largest scores per row, best first; a stable sort of −score puts the lower index first on ties."""
        xp = get_array_module(probs)
        scores = sortable(probs if self.expert_bias is None else probs + self.expert_bias)
        return xp.argsort(-scores, axis=1, kind="stable")[:, :self.top_k]

    def _balance_loss(self, routing: Saved, assignments: np.ndarray) -> float:
        """Switch's aux loss: coef · E/(K·N) · Σ_e f_e · P_e (assignments f_e, mean probability P_e)."""
        tokens = len(routing.scores)
        mean_probs = to_host(column_sums(routing.scores)) / tokens
        return self.aux_coef * self.n_experts * float(assignments @ mean_probs) / (self.top_k * tokens)

    def _balance_gradient(self, routing: Saved) -> Array:
        """d(aux_weight · aux loss)/d(probs) (N, E): aux_weight·coef·E·f_e/(K·N²), the same in every row."""
        xp = get_array_module(routing.scores)
        tokens = len(routing.scores)
        gradient = (self.aux_weight * self.aux_coef * self.n_experts / (self.top_k * tokens ** 2)
                    * routing.stats.assignments)
        dprobs = xp.empty_like(routing.scores)
        dprobs[...] = like(dprobs, gradient)
        return dprobs

    def _scores_backward(self, routing: Saved, dscores: Array) -> Array:
        """d(logits) from d(probs): the softmax's backward."""
        return softmax_backward(routing.scores, dscores)

    # The rest is the same for every router.

    def _assign(self, experts: Array, capacity: int | None) -> tuple[Array, Array]:
        """(the kept assignments sorted by expert, assignments per expert before capacity) from the flat chosen
        experts. Stable sorting keeps token order inside an expert; an assignment's rank there is its index
        minus where its expert starts, and ranks from `capacity` on are dropped."""
        xp = get_array_module(experts)
        by_expert = xp.argsort(experts, kind="stable")
        assignments = xp.bincount(experts, minlength=self.n_experts)
        if capacity is None:
            return by_expert, assignments
        starts = xp.cumsum(assignments) - assignments
        rank_in_expert = xp.arange(len(experts)) - starts[experts[by_expert]]
        return by_expert[rank_in_expert < capacity], assignments

    def _dropped_tokens(self, order: Array, tokens: int) -> int:
        """Tokens none of whose K assignments survived capacity."""
        xp = get_array_module(order)
        kept = xp.zeros(tokens * self.top_k, dtype=bool)
        kept[order] = True
        return tokens - int(kept.reshape(tokens, self.top_k).any(axis=1).sum())

    def backward_input(self, routing: Saved, dgates: Array) -> Array:
        """d(x2d) through the router from d(gates) (N, K; zero for dropped assignments) and the balance loss."""
        xp = get_array_module(dgates)
        scaled = self.scaling * dgates
        if self.renormalize:  # gates = s·c_k / Σc: d(c_k) = (s·dg_k − Σ_j dg_j·g_j) / Σc
            dchosen = (scaled - row_sums(dgates * routing.gates)) / routing.chosen_total
        else:
            dchosen = scaled
        dscores = self._balance_gradient(routing)
        dscores[xp.arange(len(dgates))[:, None], routing.chosen] += dchosen  # a row never chooses an expert twice
        routing.dlogits = self._scores_backward(routing, dscores)
        for name in ("scores", "chosen", "chosen_total", "gates"):  # only the input pass needed them
            delattr(routing, name)
        return routing.dlogits @ self.weight.data.T

    def backward_weights(self, routing: Saved) -> None:
        self.weight.grad += routing.x2d.T @ routing.dlogits
        routing.clear()


# -- expert-parallel communication: forward above, backward right under it ---------------------------------

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


# -- the layer -------------------------------------------------------------------------------------------------

def _spans(counts: Sequence[int]) -> list[slice]:
    """Consecutive slices of counts[i] rows."""
    ends = np.cumsum([0, *counts]).tolist()
    return [slice(start, stop) for start, stop in zip(ends[:-1], ends[1:], strict=True)]


class MixtureOfExperts(Layer):
    """The MoE layer in place of a block's MLP: route, permute by expert, one GEMM per expert, un-permute and
    combine with the gates (see the module docstring). Same protocol as `models.layers`.

    `experts` are the experts this rank holds, as `MLP`s: all E without `ep_comm`; with an EP group of n ranks,
    the E/n experts `local_experts(E, rank, n)`. Forward returns (y, saved); `saved.stats` is the token set's
    `RouterStats` (its `aux_loss` is the value whose gradient, times the router's `aux_weight`, backward adds).
    """

    def __init__(self, router: Router, experts: Sequence[MLP], ep_comm: Any = None, algo: str = "auto",
                 fp8_dispatch: bool = False, ep_dispatch: str = "flat", traffic: ExpertTraffic | None = None) -> None:
        self.router, self.experts, self.algo, self.fp8_dispatch = router, list(experts), algo, fp8_dispatch
        self.ep = None if ep_comm is None or Communicator.of(ep_comm).size == 1 else Communicator.of(ep_comm)
        ep_size = 1 if self.ep is None else self.ep.size
        if len(self.experts) * ep_size != router.n_experts:
            raise ValueError(f"the router has {router.n_experts} experts, but {len(self.experts)} local experts on "
                             f"each of {ep_size} EP ranks make {len(self.experts) * ep_size}")
        if ep_dispatch not in EP_DISPATCHES:
            raise ValueError(f"ep_dispatch must be one of {EP_DISPATCHES}, got {ep_dispatch!r}")
        self.two_hop = ep_dispatch == "hierarchical" and self.ep is not None
        if self.two_hop and not (self.ep.topology.spans_nodes and self.ep.topology.even):
            raise ValueError("the hierarchical (two-hop) dispatch needs an EP group spanning nodes of equal size")
        self.traffic = traffic

    def forward(self, x: Array) -> tuple[Array, Saved]:
        x2d = x.reshape(-1, x.shape[-1])
        routing = self.router.forward(x2d, sequences=x.shape[0] if x.ndim == 3 else 1)
        if self.two_hop:
            y, saved = self._forward_two_hop(x2d, routing)
            return y.reshape(x.shape), saved
        rows = x2d[routing.order // self.router.top_k]
        local_rows, plan = self._dispatch(rows, routing.counts)
        expert_counts = routing.counts if plan is None else plan.expert_counts
        local_out, experts = self._run_experts(local_rows, expert_counts)
        out_rows = self._combine(local_out, plan)
        y = self._weigh_and_sum(out_rows, routing)
        return y.reshape(x.shape), Saved(router=routing, plan=plan, expert_counts=expert_counts, experts=experts,
                                         out_rows=out_rows, stats=routing.stats)

    def _dispatch(self, rows: Array, counts: list[int]) -> tuple[Array, DispatchPlan | None]:
        if self.fp8_dispatch:
            return self._dispatch_in_fp8(rows, counts)
        if self.ep is None:
            return rows, None
        plan = self._plan(counts)
        return dispatch_to_experts(rows, plan, self.ep, self.algo), plan

    def _plan(self, counts: list[int]) -> DispatchPlan:
        plan = plan_dispatch(counts, self.ep)
        if self.traffic is not None:
            self.traffic.add("forward", rows_to=plan.send_counts, rows_from=plan.recv_counts)
        return plan

    def _dispatch_in_fp8(self, rows: Array, counts: list[int]) -> tuple[Array, DispatchPlan | None]:
        """DeepSeek-V3's FP8 dispatch: the rows are quantized (1×128 tiles, a row's own) before they move, sent
        as E4M3 bytes with their float32 scales (`models.fp8.pack_rows`), and dequantized on arrival — with or
        without EP, so serial and EP compute the same numbers. The experts' first FP8 GEMM quantizes them again
        into the same values and scales (a tile's amax is its ±448 element times its scale), so only the bytes
        change: h + 4·⌈h/128⌉ per row instead of 2h; the weight gradient sees the E4M3 rows, as DeepSeek's
        cached FP8 activations are."""
        quantized = quantize_activation(rows)
        if self.ep is None:
            return quantized.dequantize(), None
        plan = self._plan(counts)
        packed = dispatch_to_experts(pack_rows(quantized), plan, self.ep, self.algo)
        return unpack_rows(packed, rows.shape[-1]).dequantize(), plan

    def _combine(self, local_out: Array, plan: DispatchPlan | None) -> Array:
        return local_out if plan is None else combine_from_experts(local_out, plan, self.ep, self.algo)

    def _forward_two_hop(self, x2d: Array, routing: Saved) -> tuple[Array, Saved]:
        """DeepSeek-V3's node-limited dispatch (`collectives.two_hop`): each token crosses to each of its nodes
        once; its gates travel with it, so that the expert side weighs its rows and the relay can sum a token's
        rows of one node before they cross back. y = Dᵀ(gates ⊙ experts(D x)), D the two-hop dispatch."""
        plan = two_hop_plan(routing, self.router.top_k, len(self.experts), self.ep)
        if self.traffic is not None:
            self.traffic.add_two_hop("forward", plan, routing.gates.itemsize)
        if self.fp8_dispatch:  # one quantization per token row: what the flat dispatch's copies of it would get
            packed = two_hop_dispatch(pack_rows(quantize_activation(x2d)), plan, self.ep)
            rows = unpack_rows(packed, x2d.shape[-1]).dequantize()
        else:
            rows = two_hop_dispatch(x2d, plan, self.ep)
        gates = two_hop_dispatch_values(routing.gates.reshape(-1)[routing.order], plan, self.ep)
        local_out, experts = self._run_experts(rows, plan.slot_counts)
        weighed = (local_out * gates[:, None]).astype(local_out.dtype, copy=False)
        y = two_hop_combine(weighed, plan, self.ep, len(x2d))
        return y, Saved(router=routing, plan=plan, expert_counts=plan.slot_counts, experts=experts,
                        local_out=local_out, gates=gates, stats=routing.stats)

    def _backward_two_hop(self, saved: Saved, dy: Array) -> Array:
        """The transpose of each step of `_forward_two_hop`: d(weighed rows) = D dy (a dispatch), d(gates) back to
        their assignments (the values' combine), d(rows) through the experts, then d(x) = Dᵀ d(rows) (a combine)."""
        routing, plan, k = saved.router, saved.plan, self.router.top_k
        if self.traffic is not None:
            self.traffic.add_two_hop("backward", plan, saved.gates.itemsize)
        dweighed = two_hop_dispatch(dy, plan, self.ep)
        dlocal_gates = row_sums(dweighed * saved.local_out)[:, 0].astype(saved.gates.dtype, copy=False)
        dlocal_out = (dweighed * saved.gates[:, None]).astype(dweighed.dtype, copy=False)
        dgates = get_array_module(dy).zeros(routing.gates.size, saved.gates.dtype)
        dgates[routing.order] = two_hop_combine_values(dlocal_gates, plan, self.ep)
        dlocal_rows = self._experts_backward_input(saved.experts, dlocal_out, saved.expert_counts)
        dx = self.router.backward_input(routing, dgates.reshape(-1, k))
        dx += two_hop_combine(dlocal_rows, plan, self.ep, len(dy))
        del saved.local_out, saved.gates, saved.plan, saved.expert_counts
        return dx

    def _run_experts(self, rows: Array, counts: list[int]) -> tuple[Array, list[Saved]]:
        """Expert i on its contiguous slice of `rows`: one GEMM per linear per expert."""
        xp = get_array_module(rows)
        outputs, saved = [], []
        for expert, span in zip(self.experts, _spans(counts), strict=True):
            out, kept = expert.forward(rows[span])
            outputs.append(out)
            saved.append(kept)
        return xp.concatenate(outputs), saved

    def _weigh_and_sum(self, out_rows: Array, routing: Saved) -> Array:
        """y_n = Σ_k gate_nk · out_nk: gated rows into their (token, choice) slots, summed over the choices."""
        xp = get_array_module(out_rows)
        tokens, k = routing.gates.shape
        slots = xp.zeros((tokens * k, out_rows.shape[-1]), out_rows.dtype)
        slots[routing.order] = out_rows * routing.gates.reshape(-1)[routing.order, None]
        return slots.reshape(tokens, k, -1).sum(axis=1)

    def backward_input(self, saved: Saved, dout: Array) -> Array:
        routing, k = saved.router, self.router.top_k
        dy = dout.reshape(-1, dout.shape[-1])
        if self.two_hop:
            return self._backward_two_hop(saved, dy).reshape(dout.shape)
        dy_rows = dy[routing.order // k]
        dgates = get_array_module(dy).zeros(routing.gates.size, dy.dtype)
        dgates[routing.order] = row_sums(dy_rows * saved.out_rows)[:, 0]
        # at the activations' dtype: the gates may be wider (float32 under bfloat16), the rows that travel are not
        dout_rows = (dy_rows * routing.gates.reshape(-1)[routing.order, None]).astype(dy.dtype, copy=False)
        dlocal_out = self._combine_backward(dout_rows, saved.plan)
        dlocal_rows = self._experts_backward_input(saved.experts, dlocal_out, saved.expert_counts)
        drows = self._dispatch_backward(dlocal_rows, saved.plan)
        dx = self.router.backward_input(routing, dgates.reshape(-1, k))
        dx += self._sum_choices(drows, routing.order, len(dy), k)
        del saved.out_rows, saved.plan, saved.expert_counts
        return dx.reshape(dout.shape)

    def _combine_backward(self, dout_rows: Array, plan: DispatchPlan | None) -> Array:
        if plan is None:
            return dout_rows
        if self.traffic is not None:
            self.traffic.add("backward", rows_to=plan.send_counts, rows_from=plan.recv_counts)
        return combine_from_experts_backward(dout_rows, plan, self.ep, self.algo)

    def _dispatch_backward(self, dlocal_rows: Array, plan: DispatchPlan | None) -> Array:
        return dlocal_rows if plan is None else dispatch_to_experts_backward(dlocal_rows, plan, self.ep, self.algo)

    def _experts_backward_input(self, saved: list[Saved], dout: Array, counts: list[int]) -> Array:
        return get_array_module(dout).concatenate([expert.backward_input(kept, dout[span]) for expert, kept, span
                                                   in zip(self.experts, saved, _spans(counts), strict=True)])

    @staticmethod
    def _sum_choices(drows: Array, order: Array, tokens: int, k: int) -> Array:
        """d(x) from the gathered rows: each row's gradient into its (token, choice) slot, summed over choices."""
        slots = get_array_module(drows).zeros((tokens * k, drows.shape[-1]), drows.dtype)
        slots[order] = drows
        return slots.reshape(tokens, k, -1).sum(axis=1)

    def backward_weights(self, saved: Saved) -> None:
        for expert, kept in zip(self.experts, saved.experts, strict=True):
            expert.backward_weights(kept)
        self.router.backward_weights(saved.router)
        saved.clear()


class MoEBlock(Block):
    """A transformer block whose MLP is a `MixtureOfExperts`. Forward also keeps the router's statistics in
    `saved.router_stats` — which full recomputation, keeping only the block's input, would otherwise drop."""

    def forward(self, x: Array) -> tuple[Array, Saved]:
        out, saved = self._forward(x)
        kept = Saved(x=x) if self.recompute_full else saved
        kept.router_stats = saved.mlp.stats
        return out, kept
