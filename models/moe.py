"""Mixture of experts (MoE): a router sends each token to K of E GPT-2 MLP experts, each expert runs one GEMM over
its tokens, and the gated outputs are summed back per token. No communication here.

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

The aux loss in the objective, two ways (`--moe-aux-scope`). Local (Switch's, Mixtral's): a step averages the
aux losses of its token sets (microbatches × DP·CP ranks), so each set's aux enters the objective with weight
`aux_weight` = 1 / (the number of sets), and its value depends on how the mesh cuts the batch. Global: one aux
loss over the step's whole batch, f and P̄ counted over every token set — the serial model's on any mesh. Its
f_e needs every set's routing, so the step counts them first (`step_counts`, the assignments over all N_step
tokens, `mpiparallel.train.experts`) and each set adds its share, coef·E/(K·N_step²)·Σ_e F_e·S_e with S_e its
own probabilities' column sums; the shares sum to the global loss, whose weight is 1. Either way the router adds
the term's gradient, aux_weight · coef · E · f_e / (K·N²), to d(probs) (f counts choices: it has no gradient;
global: F over N_step). The value is in `RouterStats.aux_loss`; `models.transformer.Transformer.forward` adds
aux_loss · aux_weight to the loss it returns.

Backward from dy (choosing has no gradient; the chosen probs do):

    d expert_out_nk = gate_nk · dy_n                            kept assignments only
    d gate_nk       = ⟨dy_n, expert_out_nk⟩                     0 when dropped
    d chosen probs  = (d gate_n − Σ_j d gate_nj · gate_nj) / Σ_j probs_n[chosen_nj]      (raw gates: d gate)
    d probs         = those at the chosen columns, + the aux term; d logits = the softmax's backward
    d x_n           = d logits_n · W_rᵀ + Σ_k d expert_in_nk

Aux-loss-free balancing (DeepSeek-V3): after each optimizer step, `update_expert_bias` moves every expert's
bias by R·sign(mean(c) − c_e), c_e the assignments to expert e over the step's whole global batch.

Expert parallelism (`mpiparallel.axes.expert_parallel`) puts the experts on different ranks and moves the token
rows to them and back — all-to-allv, or DeepSeek-V3's two-hop dispatch — in place of `InMemory`'s nothing: the
routing, the permutation, the experts and the gates here are the same on one rank and on many.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

import numpy as np

from collectives.backend import Array, get_array_module, like, to_host

from .documents import ONE_DOCUMENT
from .fp8 import quantize_activation
from .layers import MLP, Block, Layer, Saved, column_sums, row_sums, softmax_backward
from .parameter import Parameter

_EXPERT_NAME = re.compile(r"\.mlp\.experts\.(\d+)\.")


# -- names and placement ---------------------------------------------------------------------------------------

def expert_index(name: str) -> int | None:
    """The expert a parameter belongs to (`transformer.h.0.mlp.experts.3.c_fc.weight` -> 3), None for others."""
    match = _EXPERT_NAME.search(name)
    return None if match is None else int(match.group(1))


def expert_capacity(capacity_factor: float, top_k: int, tokens: int, n_experts: int) -> int | None:
    """⌈C·K·tokens/E⌉ rows per expert, None when C = 0 (unlimited). C is taken as the decimal it was written as
    (0.3, not the binary float just above it), so capacities that are whole numbers are not rounded up."""
    if capacity_factor == 0:
        return None
    return math.ceil(Fraction(repr(float(capacity_factor))) * top_k * tokens / n_experts)


MOE_AUX_SCOPES = ("local", "global")
"""Where the Switch aux loss is formed: over each token set (local), or over the step's whole batch (global)."""


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
        # the global aux loss: the step's assignments per expert over all its token sets, and their tokens
        # (None: balance each token set by its own, the local aux loss)
        self.step_counts: np.ndarray | None = None
        self.step_tokens = 0
        self.shares = 1  # ranks whose aux-loss shares make one token set's loss (DeepSeek's split sequences)

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
        """Switch's aux loss: coef · E/(K·N²) · Σ_e f_e · S_e (assignments f_e, the probabilities' column sums
        S_e = N·P̄_e); with step counts, this token set's share of the step's loss (F and N over the step)."""
        counts, tokens = self._balance_counts(assignments, len(routing.scores))
        column_totals = to_host(column_sums(routing.scores))
        return self.aux_coef * self.n_experts * float(counts @ column_totals) / (self.top_k * tokens ** 2)

    def _balance_counts(self, assignments: np.ndarray, tokens: int) -> tuple[np.ndarray, int]:
        """(f, N) of the aux loss: this token set's own, or the step's (the global aux loss)."""
        if self.step_counts is None:
            return assignments, tokens
        return self.step_counts, self.step_tokens

    def _balance_gradient(self, routing: Saved) -> Array:
        """d(aux_weight · aux loss)/d(probs) (N, E): aux_weight·coef·E·f_e/(K·N²), the same in every row."""
        xp = get_array_module(routing.scores)
        counts, tokens = self._balance_counts(routing.stats.assignments, len(routing.scores))
        gradient = self.aux_weight * self.aux_coef * self.n_experts / (self.top_k * tokens ** 2) * counts
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


# -- the layer -------------------------------------------------------------------------------------------------

def _spans(counts: Sequence[int]) -> list[slice]:
    """Consecutive slices of counts[i] rows."""
    ends = np.cumsum([0, *counts]).tolist()
    return [slice(start, stop) for start, stop in zip(ends[:-1], ends[1:], strict=True)]


class MixtureOfExperts(Layer):
    """The MoE layer in place of a block's MLP: route, permute by expert, one GEMM per expert, un-permute and
    combine with the gates (see the module docstring). Same protocol as `models.layers`.

    `experts` are the experts this rank holds, as `MLP`s: all E here; under expert parallelism the E/n of this EP
    rank, the tokens reaching them through `exchange` (`InMemory` here: the rows stay on this rank;
    `mpiparallel.axes.expert_parallel` has the exchanges over an EP group). Forward returns (y, saved);
    `saved.stats` is the token set's `RouterStats` (its `aux_loss` is the value whose gradient, times the router's
    `aux_weight`, backward adds).
    """

    def __init__(self, router: Router, experts: Sequence[MLP], exchange: InMemory | None = None,
                 fp8_dispatch: bool = False) -> None:
        self.router, self.experts, self.fp8_dispatch = router, list(experts), fp8_dispatch
        self.exchange = exchange or InMemory()
        if len(self.experts) * self.exchange.size != router.n_experts:
            raise ValueError(f"the router has {router.n_experts} experts, but {len(self.experts)} local experts on "
                             f"each of {self.exchange.size} EP ranks make {len(self.experts) * self.exchange.size}")

    def forward(self, x: Array) -> tuple[Array, Saved]:
        x2d = x.reshape(-1, x.shape[-1])
        routing = self.router.forward(x2d, sequences=x.shape[0] if x.ndim == 3 else 1)
        y, saved = self.exchange.forward(self, x2d, routing)
        return y.reshape(x.shape), saved

    def backward_input(self, saved: Saved, dout: Array) -> Array:
        dy = dout.reshape(-1, dout.shape[-1])
        return self.exchange.backward_input(self, saved, dy).reshape(dout.shape)

    def run_experts(self, rows: Array, counts: list[int]) -> tuple[Array, list[Saved]]:
        """Expert i on its contiguous slice of `rows`: one GEMM per linear per expert."""
        xp = get_array_module(rows)
        outputs, saved = [], []
        for expert, span in zip(self.experts, _spans(counts), strict=True):
            out, kept = expert.forward(rows[span])
            outputs.append(out)
            saved.append(kept)
        return xp.concatenate(outputs), saved

    def experts_backward_input(self, saved: list[Saved], dout: Array, counts: list[int]) -> Array:
        return get_array_module(dout).concatenate([expert.backward_input(kept, dout[span]) for expert, kept, span
                                                   in zip(self.experts, saved, _spans(counts), strict=True)])

    def backward_weights(self, saved: Saved) -> None:
        for expert, kept in zip(self.experts, saved.experts, strict=True):
            expert.backward_weights(kept)
        self.router.backward_weights(saved.router)
        saved.clear()


class InMemory:
    """How a `MixtureOfExperts` moves token rows to its experts and back — here, on one rank, it does not: the
    rows sorted by expert are the experts' rows. `mpiparallel.axes.expert_parallel` overrides the four moves
    (`dispatch`, `combine` and their backward twins) with all-to-allv over an EP group, or the whole pass with
    DeepSeek-V3's two-hop dispatch; the permutation, the experts and the gates are this class's in every case."""

    size = 1  # the EP ranks the experts are spread over

    def forward(self, layer: MixtureOfExperts, x2d: Array, routing: Saved) -> tuple[Array, Saved]:
        rows = x2d[routing.order // layer.router.top_k]
        local_rows, plan, expert_counts = self.dispatch(rows, routing.counts, layer.fp8_dispatch)
        local_out, experts = layer.run_experts(local_rows, expert_counts)
        out_rows = self.combine(local_out, plan)
        y = _weigh_and_sum(out_rows, routing)
        return y, Saved(router=routing, plan=plan, expert_counts=expert_counts, experts=experts, out_rows=out_rows,
                        stats=routing.stats)

    def backward_input(self, layer: MixtureOfExperts, saved: Saved, dy: Array) -> Array:
        routing, k = saved.router, layer.router.top_k
        dy_rows = dy[routing.order // k]
        dgates = get_array_module(dy).zeros(routing.gates.size, dy.dtype)
        dgates[routing.order] = row_sums(dy_rows * saved.out_rows)[:, 0]
        # at the activations' dtype: the gates may be wider (float32 under bfloat16), the rows that travel are not
        dout_rows = (dy_rows * routing.gates.reshape(-1)[routing.order, None]).astype(dy.dtype, copy=False)
        dlocal_out = self.combine_backward(dout_rows, saved.plan)
        dlocal_rows = layer.experts_backward_input(saved.experts, dlocal_out, saved.expert_counts)
        drows = self.dispatch_backward(dlocal_rows, saved.plan)
        dx = layer.router.backward_input(routing, dgates.reshape(-1, k))
        dx += _sum_choices(drows, routing.order, len(dy), k)
        del saved.out_rows, saved.plan, saved.expert_counts
        return dx

    def dispatch(self, rows: Array, counts: list[int], fp8: bool) -> tuple[Array, Any, list[int]]:
        """The rows of this rank's experts, a plan for the way back (None: nothing moved), and each local
        expert's row count. With `fp8` (DeepSeek-V3's FP8 dispatch) the rows are quantized (1×128 tiles, a row's
        own) as they would be to travel, and dequantized — so one rank and EP compute the same numbers."""
        return (quantize_activation(rows).dequantize() if fp8 else rows), None, list(counts)

    def combine(self, local_out: Array, plan: Any) -> Array:
        return local_out

    def combine_backward(self, dout_rows: Array, plan: Any) -> Array:
        return dout_rows

    def dispatch_backward(self, dlocal_rows: Array, plan: Any) -> Array:
        return dlocal_rows


def _weigh_and_sum(out_rows: Array, routing: Saved) -> Array:
    """y_n = Σ_k gate_nk · out_nk: gated rows into their (token, choice) slots, summed over the choices."""
    xp = get_array_module(out_rows)
    tokens, k = routing.gates.shape
    slots = xp.zeros((tokens * k, out_rows.shape[-1]), out_rows.dtype)
    slots[routing.order] = out_rows * routing.gates.reshape(-1)[routing.order, None]
    return slots.reshape(tokens, k, -1).sum(axis=1)


def _sum_choices(drows: Array, order: Array, tokens: int, k: int) -> Array:
    """d(x) from the gathered rows: each row's gradient into its (token, choice) slot, summed over choices."""
    slots = get_array_module(drows).zeros((tokens * k, drows.shape[-1]), drows.dtype)
    slots[order] = drows
    return slots.reshape(tokens, k, -1).sum(axis=1)


class MoEBlock(Block):
    """A transformer block whose MLP is a `MixtureOfExperts`. Forward also keeps the router's statistics in
    `saved.router_stats` — which full recomputation, keeping only the block's input, would otherwise drop."""

    def forward(self, x: Array, documents: Any = ONE_DOCUMENT) -> tuple[Array, Saved]:
        out, saved = self._forward(x, documents)
        kept = Saved(x=x, documents=documents) if self.recompute_full else saved
        kept.router_stats = saved.mlp.stats
        return out, kept
