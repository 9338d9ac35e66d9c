"""DeepSeekMoE: the sigmoid router's group-limited choice against a brute-force search over groups, gates from the
unbiased scores, the sequence-wise balance loss against its formula, and every backward (router, shared and routed
experts, balance loss) against finite differences in float64."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from gradient_checks import numeric_gradient

from models.deepseek_moe import DeepSeekMoE, SigmoidRouter
from models.layers import MLP, ConcatenatedLinear, Linear, SwiGLU
from models.moe import MixtureOfExperts
from models.parameter import Parameter

RNG = np.random.default_rng(17)
H, E, F = 6, 8, 5


def swiglu(name: str, width: int) -> MLP:
    def weight(part: str, *shape: int) -> Parameter:
        return Parameter(f"{name}.{part}", RNG.standard_normal(shape) * 0.5)
    return MLP(ConcatenatedLinear([weight("gate", H, width), weight("up", H, width)]),
               Linear(weight("down", width, H)), SwiGLU())


def deepseek_moe(top_k: int = 3, n_group: int = 4, topk_group: int = 2, norm: bool = True, shared: bool = True,
                 seq_aux_coef: float = 0.3, bias: bool = True) -> DeepSeekMoE:
    expert_bias = RNG.standard_normal(E) * 0.2 if bias else None
    router = SigmoidRouter(Parameter("router", RNG.standard_normal((H, E))), top_k, n_group, topk_group, norm,
                           routed_scaling_factor=2.5, seq_aux_coef=seq_aux_coef, aux_weight=0.5,
                           expert_bias=expert_bias)
    routed = MixtureOfExperts(router, [swiglu(f"experts.{e}", F) for e in range(E)])
    return DeepSeekMoE(routed, swiglu("shared", 2 * F) if shared else None)


def reference_choice(scores: np.ndarray, bias: np.ndarray, top_k: int, n_group: int, topk_group: int) -> list:
    """Per token: of every set of topk_group groups, the one with the largest total of each group's two best
    biased scores; then the top_k best biased scores inside it."""
    choices = []
    for row in scores + bias:
        groups = row.reshape(n_group, -1)
        group_score = [sum(sorted(group)[-2:]) for group in groups]
        best = max(itertools.combinations(range(n_group), topk_group), key=lambda kept: sum(group_score[g]
                                                                                            for g in kept))
        allowed = [e for e in range(E) if e // (E // n_group) in best]
        choices.append(sorted(allowed, key=lambda e: -row[e])[:top_k])
    return choices


def margins(layer: DeepSeekMoE, x2d: np.ndarray) -> np.ndarray:
    """Per token, the smallest gap between a kept group and a dropped one, and between the K-th chosen score and
    the next one its kept groups allow: a finite-difference step far below it cannot change the choice."""
    router, experts_per_group = layer.router, E // layer.router.n_group
    bias = 0.0 if router.expert_bias is None else router.expert_bias
    biased = 1 / (1 + np.exp(-(x2d @ router.weight.data))) + bias
    groups = np.sort(biased.reshape(len(biased), router.n_group, -1), axis=2)[:, :, -2:].sum(axis=2)
    ranked = -np.sort(-groups, axis=1)
    group_gap = (ranked[:, router.topk_group - 1] - ranked[:, router.topk_group] if router.topk_group < router.n_group
                 else np.full(len(biased), np.inf))
    kept = groups >= ranked[:, router.topk_group - 1:router.topk_group]
    allowed = -np.sort(-np.where(np.repeat(kept, experts_per_group, axis=1), biased, -np.inf), axis=1)
    choice_gap = allowed[:, router.top_k - 1] - allowed[:, router.top_k] if router.top_k < E else np.inf
    return np.minimum(group_gap, choice_gap)


def decisive_inputs(layer: DeepSeekMoE, shape: tuple[int, ...], margin: float = 1e-3) -> np.ndarray:
    x = RNG.standard_normal(shape).reshape(-1, H)
    while (close := margins(layer, x) < margin).any():
        x[close] = RNG.standard_normal((int(close.sum()), H))
    return x.reshape(shape)


def parameters_of(layer: DeepSeekMoE) -> list[Parameter]:
    mlps = [*layer.routed.experts, *([layer.shared] if layer.shared else [])]
    return [layer.router.weight] + [w for mlp in mlps for w in (*mlp.expand.weights, mlp.contract.weight)]


@pytest.mark.parametrize("top_k,n_group,topk_group", [(3, 4, 2), (2, 2, 1), (2, 1, 1), (4, 4, 4)])
def test_group_limited_choice_equals_a_brute_force_search_over_groups(top_k, n_group, topk_group):
    layer = deepseek_moe(top_k, n_group, topk_group)
    x2d = RNG.standard_normal((20, H))
    routing = layer.router.forward(x2d)
    scores = 1 / (1 + np.exp(-(x2d @ layer.router.weight.data)))
    want = reference_choice(scores, layer.router.expert_bias, top_k, n_group, topk_group)
    assert routing.chosen.tolist() == want
    assert len({tuple(row) for row in want}) > 1  # the tokens do not all choose alike


@pytest.mark.parametrize("norm", [True, False], ids=["norm_topk_prob", "raw"])
def test_gates_are_the_unbiased_scores_normalized_and_scaled(norm):
    layer = deepseek_moe(norm=norm)
    x2d = RNG.standard_normal((10, H))
    routing = layer.router.forward(x2d)
    scores = 1 / (1 + np.exp(-(x2d @ layer.router.weight.data)))
    chosen = np.take_along_axis(scores, routing.chosen, axis=1)
    want = 2.5 * (chosen / (chosen.sum(axis=1, keepdims=True) + 1e-20) if norm else chosen)
    np.testing.assert_allclose(routing.gates, want, rtol=1e-14)


def test_sequence_balance_loss_is_alpha_sum_of_f_times_p_averaged_over_sequences():
    layer = deepseek_moe(seq_aux_coef=0.3)
    x = RNG.standard_normal((3, 5, H))
    _, saved = layer.forward(x)
    scores = 1 / (1 + np.exp(-(x @ layer.router.weight.data)))
    chosen = np.array(reference_choice(scores.reshape(-1, E), layer.router.expert_bias, 3, 4, 2)).reshape(3, 5, 3)
    losses = []
    for sequence in range(3):
        f = np.array([(chosen[sequence] == e).sum() for e in range(E)]) * E / (3 * 5)
        p = (scores[sequence] / scores[sequence].sum(axis=1, keepdims=True)).mean(axis=0)
        losses.append(0.3 * (f * p).sum())
    assert saved.stats.aux_loss == pytest.approx(np.mean(losses), rel=1e-13)


CASES = {
    "groups-shared-seq-aux": dict(),
    "no-norm-no-shared": dict(norm=False, shared=False),
    "one-group-no-aux": dict(n_group=1, topk_group=1, seq_aux_coef=0.0),
    "no-bias": dict(bias=False, top_k=2),
}


@pytest.mark.parametrize("options", list(CASES.values()), ids=list(CASES))
def test_deepseek_moe_backward_matches_finite_differences(options):
    layer = deepseek_moe(**options)
    x = decisive_inputs(layer, (2, 5, H))
    weights = RNG.standard_normal(x.shape)

    def objective() -> float:
        y, saved = layer.forward(x)
        return float((y * weights).sum()) + layer.router.aux_weight * saved.stats.aux_loss

    params = parameters_of(layer)
    for param in params:
        param.zero_grad()
    dx = layer.backward(layer.forward(x)[1], weights.copy())
    for analytic, array, what in [(dx, x, "x"), *((p.grad, p.data, p.name) for p in params)]:
        picks, numeric = numeric_gradient(objective, array, samples=6)
        got = analytic.reshape(-1)[picks]
        assert (np.abs(got - numeric) <= 1e-6 * np.maximum(np.abs(numeric), 1e-2)).all(), f"{what}: {got} vs {numeric}"


def test_input_and_weight_passes_apart_equal_the_joint_backward():
    layer = deepseek_moe()
    x = RNG.standard_normal((2, 5, H))
    dout = RNG.standard_normal(x.shape)
    params = parameters_of(layer)
    dx_together = layer.backward(layer.forward(x)[1], dout.copy())
    together = [p.grad.copy() for p in params]
    for p in params:
        p.zero_grad()
    saved = layer.forward(x)[1]
    dx_apart = layer.backward_input(saved, dout.copy())
    layer.backward_weights(saved)
    assert not vars(saved)
    np.testing.assert_array_equal(dx_apart, dx_together)
    for p, grad in zip(params, together, strict=True):
        np.testing.assert_array_equal(p.grad, grad)


@pytest.mark.parametrize("experts,top_k,n_group,topk_group,match", [
    (8, 2, 3, 1, "divide"), (8, 2, 4, 5, "topk_group"), (8, 2, 8, 2, "2 best"), (8, 5, 4, 2, "exceeds")])
def test_impossible_groupings_are_refused_with_the_rule_they_break(experts, top_k, n_group, topk_group, match):
    with pytest.raises(ValueError, match=match):
        SigmoidRouter(Parameter("router", np.zeros((H, experts))), top_k, n_group, topk_group)
