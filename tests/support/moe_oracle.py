"""The exact oracle for the mixture-of-experts tests: the MoE math of DESIGN.md written as a loop over tokens,
one token and one choice at a time, sharing no code with models/moe.py. Also the layer builders and the inputs
that force a routing through the router weights, used by test_moe.py and workers/moe_checks.py."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from models.layers import MLP, Linear
from models.moe import MixtureOfExperts, Router
from models.parameter import Parameter

FORCING_LOGIT = 8.0  # a chosen expert's logit: far above the others' (≈ 0), so no choice is near a tie


@dataclass
class LoopResult:
    y: np.ndarray             # (N, h)
    assignments: np.ndarray   # router choices per expert
    processed: np.ndarray     # rows each expert computed
    dropped_tokens: int
    aux_loss: float


def gelu(v: np.ndarray) -> np.ndarray:
    return 0.5 * v * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (v + 0.044715 * v ** 3)))


def expert_by_hand(expert: MLP, row: np.ndarray) -> np.ndarray:
    hidden = gelu(row @ expert.expand.weight.data + expert.expand.bias.data)
    return hidden @ expert.contract.weight.data + expert.contract.bias.data


def loop_reference(weight: np.ndarray, experts: list[MLP], x: np.ndarray, top_k: int, renormalize: bool,
                   capacity: int | None, aux_coef: float, bias: np.ndarray | None = None) -> LoopResult:
    """The MoE layer token by token: softmax, the K best (ties to the lower index; the bias only chooses),
    gates, first-come capacity, Σ gate · expert(x), and the Switch aux loss."""
    tokens = x.reshape(-1, x.shape[-1])
    n_experts = weight.shape[1]
    bias = np.zeros(n_experts) if bias is None else bias
    y = np.zeros_like(tokens)
    assignments, processed = np.zeros(n_experts, np.int64), np.zeros(n_experts, np.int64)
    prob_sums, dropped_tokens = np.zeros(n_experts), 0
    for n, row in enumerate(tokens):
        logits = row @ weight
        probs = np.exp(logits - logits.max())
        probs /= probs.sum()
        prob_sums += probs
        chosen = sorted(range(n_experts), key=lambda e: (-(probs[e] + bias[e]), e))[:top_k]
        total = sum(probs[e] for e in chosen)
        served = False
        for e in chosen:
            assignments[e] += 1
            if capacity is not None and processed[e] >= capacity:
                continue
            processed[e] += 1
            served = True
            gate = probs[e] / total if renormalize else probs[e]
            y[n] += gate * expert_by_hand(experts[e], row)
        dropped_tokens += not served
    count = len(tokens)
    aux = aux_coef * n_experts * float(np.sum(assignments / (top_k * count) * prob_sums / count))
    return LoopResult(y, assignments, processed, dropped_tokens, aux)


def loop_reference_of(layer: MixtureOfExperts, x: np.ndarray, capacity: int | None) -> LoopResult:
    router = layer.router
    return loop_reference(router.weight.data, layer.experts, x, router.top_k, router.renormalize, capacity,
                          router.aux_coef, router.expert_bias)


# -- building layers ---------------------------------------------------------------------------------------

def random_experts(rng: np.random.Generator, h: int, n_experts: int, scale: float = 0.5) -> list[MLP]:
    def linear(name: str, n_in: int, n_out: int) -> Linear:
        return Linear(Parameter(f"{name}.weight", rng.standard_normal((n_in, n_out)) * scale),
                      Parameter(f"{name}.bias", rng.standard_normal(n_out) * scale))
    return [MLP(linear(f"experts.{e}.c_fc", h, 4 * h), linear(f"experts.{e}.c_proj", 4 * h, h))
            for e in range(n_experts)]


def moe_layer(weight: np.ndarray, experts: list[MLP], top_k: int, renormalize: bool = True,
              capacity_factor: float = 0.0, aux_coef: float = 0.0, aux_weight: float = 1.0,
              expert_bias: np.ndarray | None = None, ep_comm=None) -> MixtureOfExperts:
    router = Router(Parameter("router.weight", weight.copy()), top_k, renormalize, capacity_factor, aux_coef,
                    aux_weight, expert_bias)
    if ep_comm is None:
        return MixtureOfExperts(router, experts)
    from mpiparallel.axes.expert_parallel import exchange_over

    return MixtureOfExperts(router, experts, exchange_over(ep_comm))


def copy_experts(experts: list[MLP]) -> list[MLP]:
    """Fresh parameters (zero gradients) with the same values."""
    def linear(layer: Linear) -> Linear:
        return Linear(Parameter(layer.weight.name, layer.weight.data.copy()),
                      Parameter(layer.bias.name, layer.bias.data.copy()))
    return [MLP(linear(expert.expand), linear(expert.contract)) for expert in experts]


# -- routings forced through the router weights ----------------------------------------------------------------

def forcing_weight(h: int, n_experts: int, rng: np.random.Generator) -> np.ndarray:
    """Router weights where channel c votes for expert c (logit FORCING_LOGIT), plus a little noise."""
    weight = 0.01 * rng.standard_normal((h, n_experts))
    weight[np.arange(n_experts), np.arange(n_experts)] += FORCING_LOGIT
    return weight


def forcing_inputs(choices: list[tuple[int, ...]], h: int, rng: np.random.Generator) -> np.ndarray:
    """Token n's channels choices[n][j] set to 1 − 0.25·j (so its j-th choice is choices[n][j], by margins of
    2 logits), every other channel small noise: with `forcing_weight`, the router picks exactly `choices`."""
    x = 0.01 * rng.standard_normal((len(choices), h))
    for n, chosen in enumerate(choices):
        for j, e in enumerate(chosen):
            x[n, e] = 1.0 - 0.25 * j
    return x
