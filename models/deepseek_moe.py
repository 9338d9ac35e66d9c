"""DeepSeekMoE: shared experts every token passes through, and fine-grained routed experts chosen by a sigmoid
router restricted to a few groups (DeepSeek-V3's report, section 2.1.2 and eq. 12–20).

For one local token set (one microbatch on one rank: N tokens x_n, b sequences of T tokens), E routed experts in
G = n_group groups of E/G, K choices per token:

    scores     s_n = σ(x_n · W_r)                                   W_r [h, E] (`mlp.router.weight`), no bias
    biased     s_n + b                                              b = the aux-loss-free bias (`expert_bias`,
                                                                    transformers' `e_score_correction_bias`):
                                                                    it chooses, it enters no gate
    groups     each group's score: the sum of its 2 largest biased scores; keep the `topk_group` best groups
    chosen     the K largest biased scores inside the kept groups    ties → the lower index
    gates      g_nk = c · s_n[chosen_nk] / (Σ_j s_n[chosen_nj] + 1e-20)    (norm_topk_prob; else c · s_n[chosen_nk]),
                                                                    c = routed_scaling_factor
    output     y_n = shared(x_n) + Σ_k g_nk · expert_{chosen_nk}(x_n)

The shared experts are one SwiGLU MLP n_shared·moe_intermediate_size wide (transformers stores them so); each
routed expert is a SwiGLU MLP moe_intermediate_size wide. The routed part is `models.moe.MixtureOfExperts` with
this router (capacity, expert parallelism and their all-to-allv included); only the router is new.

Sequence-wise balance loss (eq. 17–20, coefficient α, `--moe-seq-aux-coef`), per sequence of T tokens:

    s'_t   = s_t / Σ_j s_tj                   the scores normalized per token
    f_i    = E / (K·T) · #{t : i chosen for t}    P_i = (1/T) Σ_t s'_ti          L = α Σ_i f_i · P_i

and the token set's aux loss is the mean of L over its b sequences (so sets of whole sequences average to the
serial value on any mesh that keeps sequences whole). f counts choices: it has no gradient. Backward, with
aux_weight w = d(objective)/d(aux) of this set: d s'_ti = w·α·f_i / (T·b), then through the normalization,
d s_t = (d s'_t − Σ_i d s'_ti · s'_ti) / Σ_j s_tj.

Backward of the gates (d g from the experts' side; choosing has no gradient): with norm_topk_prob,
d s[chosen_k] = (c · d g_k − Σ_j d g_j · g_j) / (Σ_j s[chosen_j] + 1e-20); without, c · d g_k; then
d logits = d s · σ'(logits) = d s · s · (1 − s). Communication: none here (the routed part's all-to-allv under EP
is `models.moe`'s).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from collectives import all_reduce
from collectives.backend import Array, get_array_module, like, to_host

from .config import check_groups
from .layers import Layer, Saved, row_sums
from .moe import MixtureOfExperts, Router, sortable

GATE_EPSILON = 1e-20
"""Added to the chosen scores' sum before normalizing (DeepSeek's and transformers' guard against 0/0)."""


def _sigmoid(logits: Array) -> Array:
    """σ(logits), in place."""
    xp = get_array_module(logits)
    xp.negative(logits, out=logits)
    xp.exp(logits, out=logits)
    logits += 1.0
    return xp.reciprocal(logits, out=logits)


class SigmoidRouter(Router):
    """DeepSeek-V3's router (see the module docstring): sigmoid scores, group-limited top-k on the biased scores,
    gates from the unbiased ones. Same interface as `models.moe.Router`, which it extends: `forward(x2d,
    sequences)` returns the routing (`order`, `counts`, `gates`, `stats`), `backward_input` d(x2d) from d(gates).
    """

    def __init__(self, weight: Any, top_k: int, n_group: int = 1, topk_group: int = 1, norm_topk_prob: bool = True,
                 routed_scaling_factor: float = 1.0, capacity_factor: float = 0.0, seq_aux_coef: float = 0.0,
                 aux_weight: float = 1.0, expert_bias: Array | None = None,
                 sequence_groups: Sequence[Any] = ()) -> None:
        super().__init__(weight, top_k, norm_topk_prob, capacity_factor, 0.0, aux_weight, expert_bias)
        check_groups(self.n_experts, top_k, n_group, topk_group)
        if seq_aux_coef < 0:
            raise ValueError(f"seq_aux_coef must be >= 0, got {seq_aux_coef}")
        self.n_group, self.topk_group = n_group, topk_group
        self.scaling, self.seq_aux_coef = routed_scaling_factor, seq_aux_coef
        # the communicators over which each sequence's tokens are split (cp; tp under sp): f sums over them
        self.sequence_groups = list(sequence_groups)
        self.shares = math.prod(comm.size for comm in self.sequence_groups)

    def _scores(self, logits: Array) -> Array:
        return _sigmoid(logits)

    def _gates(self, chosen_scores: Array) -> tuple[Array | None, Array]:
        """Gates from the unbiased chosen scores, normalized (with a guard against 0/0) and scaled."""
        if not self.renormalize:
            return None, chosen_scores * self.scaling
        chosen_total = row_sums(chosen_scores) + GATE_EPSILON
        return chosen_total, chosen_scores * (self.scaling / chosen_total)

    def _choose(self, scores: Array) -> Array:
        """The K best biased scores per row inside its `topk_group` best groups, best first."""
        xp = get_array_module(scores)
        biased = sortable(scores if self.expert_bias is None else scores + self.expert_bias)
        if self.n_group > 1:
            tokens = len(biased)
            by_group = biased.reshape(tokens, self.n_group, -1)
            top_two = -xp.sort(-by_group, axis=2)[:, :, :2].sum(axis=2)  # (N, G)
            kept = xp.argsort(-top_two, axis=1, kind="stable")[:, :self.topk_group]
            allowed = xp.zeros((tokens, self.n_group), dtype=bool)
            allowed[xp.arange(tokens)[:, None], kept] = True
            biased = xp.where(xp.repeat(allowed, self.n_experts // self.n_group, axis=1), biased, -xp.inf)
        return xp.argsort(-biased, axis=1, kind="stable")[:, :self.top_k]

    def _balance_loss(self, routing: Saved, assignments: np.ndarray) -> float:
        """This rank's share of the sequence-wise loss: f per sequence from the whole sequence (counts summed over
        the ranks that split it, `sequence_groups`), P_i from the tokens here, over the whole length T. The shares
        over those ranks sum to the loss (each enters with `shares` times the token set's weight). Keeps f
        (`routing.fractions`) for backward."""
        if not self.seq_aux_coef:
            return 0.0
        routing.fractions = self._sequence_fractions(routing)
        normalized = self._normalized(routing)
        column_shares = to_host(normalized.sum(axis=1)) / routing.fractions_length  # (b, E): P_i's share here
        return self.seq_aux_coef * float((routing.fractions * column_shares).sum(axis=1).mean())

    def _sequence_fractions(self, routing: Saved) -> np.ndarray:
        """f_i = E/(K·T)·#{t : i chosen for t} per sequence (b, E), T the whole sequence: this rank's counts
        summed over each group that splits the sequences (context parallelism; sequence parallelism)."""
        sequences, experts = routing.sequences, self.n_experts
        chosen = to_host(routing.chosen).reshape(sequences, -1)
        counts = np.stack([np.bincount(row, minlength=experts) for row in chosen]).astype(np.float64)
        for comm in self.sequence_groups:
            counts = all_reduce(counts, comm)
        routing.fractions_length = chosen.shape[1] // self.top_k * self.shares
        return counts * (experts / (self.top_k * routing.fractions_length))

    def _normalized(self, routing: Saved) -> Array:
        """The scores normalized per token, (b, t, E): t this rank's tokens of each sequence."""
        return (routing.scores / row_sums(routing.scores)).reshape(routing.sequences, -1, self.n_experts)

    def _balance_gradient(self, routing: Saved) -> Array:
        """d(aux_weight · L)/d(scores) (N, E) of the sequence-wise balance loss (f held constant): through each
        token's s' with d s'_ti = w·α·f_i/(T·b), T the whole sequence's length."""
        if not self.seq_aux_coef:
            return get_array_module(routing.scores).zeros_like(routing.scores)
        normalized = self._normalized(routing)
        sequences, length = routing.sequences, routing.fractions_length
        fractions = like(routing.scores, routing.fractions.astype(routing.scores.dtype))  # counted in float64
        dnormalized = (self.aux_weight * self.seq_aux_coef / (length * sequences)) * fractions[:, None, :]
        xp, experts = get_array_module(fractions), self.n_experts
        dnormalized = xp.broadcast_to(dnormalized, normalized.shape).reshape(-1, experts)
        normalized = normalized.reshape(-1, experts)
        return (dnormalized - row_sums(dnormalized * normalized)) / row_sums(routing.scores)

    def _scores_backward(self, routing: Saved, dscores: Array) -> Array:
        """d(logits) from d(scores): σ' = σ·(1 − σ), in place."""
        scores = routing.scores
        dscores *= scores
        dscores *= 1.0 - scores
        return dscores


class DeepSeekMoE(Layer):
    """The DeepSeekMoE layer in place of a block's MLP: the routed experts (`MixtureOfExperts` with a
    `SigmoidRouter`) plus the shared experts (an MLP; None when n_shared_experts is 0), summed. Forward keeps the
    router's statistics in `saved.stats`, as `MixtureOfExperts` does, so `MoEBlock` can use it."""

    def __init__(self, routed: MixtureOfExperts, shared: Any = None) -> None:
        self.routed, self.shared = routed, shared

    @property
    def router(self) -> SigmoidRouter:
        return self.routed.router

    def forward(self, x: Array) -> tuple[Array, Saved]:
        y, routed = self.routed.forward(x)
        saved = Saved(routed=routed, stats=routed.stats)
        if self.shared is not None:
            shared_out, saved.shared = self.shared.forward(x)
            y += shared_out
        return y, saved

    def backward_input(self, saved: Saved, dout: Array) -> Array:
        dx = self.routed.backward_input(saved.routed, dout)
        if self.shared is not None:
            dx += self.shared.backward_input(saved.shared, dout)
        return dx

    def backward_weights(self, saved: Saved) -> None:
        if self.shared is not None:
            self.shared.backward_weights(saved.shared)
        self.routed.backward_weights(saved.routed)
        saved.clear()
