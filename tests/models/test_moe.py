"""Mixture of experts: the serial layer equals a per-token loop and finite differences (float64), forced imbalanced
routings, aux-loss-free balancing, the MoE Transformer; expert parallelism on 2 and 4 ranks equals the serial layer and
model and sends exactly the routed rows (workers/moe_checks.py)."""

from __future__ import annotations

import math

import numpy as np
import pytest
from gradient_checks import numeric_gradient
from moe_oracle import (
    copy_experts,
    forcing_inputs,
    forcing_weight,
    loop_reference_of,
    moe_layer,
    random_experts,
)
from mpi_harness import call, run_on_ranks
from workers import moe_checks
from workers.errors import worst

from models.moe import MixtureOfExperts, RouterStats, expert_capacity, update_expert_bias
from models.transformer import GPTConfig, Transformer, expert_bias_shapes, parameter_shapes, units_using
from mpiparallel.axes.expert_parallel import local_experts

pytestmark = pytest.mark.gpu  # scripts/gpu_check.sh runs these on the GPU (tests group)

RNG = np.random.default_rng(2024)
H = 8
TOLERANCE = 1e-9


def parameters_of(layer: MixtureOfExperts) -> list:
    params = [layer.router.weight]
    for expert in layer.experts:
        params += [expert.expand.weight, expert.expand.bias, expert.contract.weight, expert.contract.bias]
    return params


def choice_margins(layer: MixtureOfExperts, x: np.ndarray) -> np.ndarray:
    """Per token, the gap between the K-th best score and the next: a finite-difference step far below it
    cannot change the selection."""
    router = layer.router
    logits = x.reshape(-1, H) @ router.weight.data
    probs = np.exp(logits - logits.max(axis=1, keepdims=True))
    probs /= probs.sum(axis=1, keepdims=True)
    scores = -np.sort(-(probs + (0 if router.expert_bias is None else router.expert_bias)), axis=1)
    if router.top_k == router.n_experts:
        return np.full(len(scores), np.inf)
    return scores[:, router.top_k - 1] - scores[:, router.top_k]


def decisive_inputs(layer: MixtureOfExperts, shape: tuple[int, ...], margin: float = 1e-3) -> np.ndarray:
    """Random tokens, each redrawn until its choice is at least `margin` from a tie."""
    x = RNG.standard_normal(shape).reshape(-1, H)
    while (close := choice_margins(layer, x) < margin).any():
        x[close] = RNG.standard_normal((int(close.sum()), H))
    return x.reshape(shape)


def random_layer(n_experts: int, top_k: int, renormalize: bool = True, capacity_factor: float = 0.0,
                 aux_coef: float = 0.5, aux_weight: float = 0.5) -> MixtureOfExperts:
    return moe_layer(RNG.standard_normal((H, n_experts)), random_experts(RNG, H, n_experts), top_k, renormalize,
                     capacity_factor, aux_coef, aux_weight)


def objective_and_gradients(layer: MixtureOfExperts, x: np.ndarray, weights: np.ndarray):
    """Σ y·weights + aux_weight·aux, its backward (d x, and the parameters' grad), and a function recomputing it."""
    def objective() -> float:
        y, saved = layer.forward(x)
        return float((y * weights).sum()) + layer.router.aux_weight * saved.stats.aux_loss
    for param in parameters_of(layer):
        param.zero_grad()
    dx = layer.backward(layer.forward(x)[1], weights.copy())
    return objective, dx


def assert_matches_finite_differences(objective, analytic: np.ndarray, array: np.ndarray, what: str,
                                      samples: int = 8) -> None:
    """Entry by entry within 1e-6 relative, or 1e-8 absolute: saturated router softmaxes give gradients near
    1e-7, where central differences of an objective of order 10 carry about 1e-9 of rounding."""
    picks, numeric = numeric_gradient(objective, array, samples)
    got = analytic.reshape(-1)[picks]
    assert (np.abs(got - numeric) <= 1e-6 * np.maximum(np.abs(numeric), 1e-2)).all(), f"{what}: {got} vs {numeric}"


def check_layer_gradients(layer: MixtureOfExperts, x: np.ndarray) -> None:
    assert choice_margins(layer, x).min() > 1e-4
    weights = RNG.standard_normal(x.shape)
    objective, dx = objective_and_gradients(layer, x, weights)
    assert_matches_finite_differences(objective, dx, x, "x")
    for param in parameters_of(layer):
        assert_matches_finite_differences(objective, param.grad, param.data, param.name, samples=4)


# -- the router ---------------------------------------------------------------------------------------------

def test_router_chooses_the_k_largest_with_ties_to_the_lower_index():
    layer = moe_layer(np.zeros((H, 4)), random_experts(RNG, H, 4), top_k=2)  # every prob 1/4: all tied
    routing = layer.router.forward(RNG.standard_normal((5, H)))
    np.testing.assert_array_equal(routing.chosen, [[0, 1]] * 5)
    np.testing.assert_allclose(routing.gates, 0.5, rtol=1e-15)


def test_the_expert_bias_chooses_but_the_gates_use_the_unbiased_probs():
    bias = np.array([0.0, 0.0, 0.1, 0.05])
    for renormalize, gate in ((True, 0.5), (False, 0.25)):
        layer = moe_layer(np.zeros((H, 4)), random_experts(RNG, H, 4), top_k=2, renormalize=renormalize,
                          expert_bias=bias)
        routing = layer.router.forward(RNG.standard_normal((3, H)))
        np.testing.assert_array_equal(routing.chosen, [[2, 3]] * 3)
        np.testing.assert_allclose(routing.gates, gate, rtol=1e-15)


def test_capacity_is_the_ceiling_of_c_k_tokens_over_e_with_c_as_written():
    assert expert_capacity(0.0, 2, 16, 4) is None
    assert expert_capacity(1.25, 2, 16, 4) == 10
    assert expert_capacity(0.3, 1, 10, 3) == 1  # 0.3 as a binary float would give 1.0000000000000002 -> 2
    assert expert_capacity(1.1, 2, 10, 4) == 6


def test_router_rejects_top_k_outside_one_to_e():
    with pytest.raises(ValueError, match="top_k"):
        moe_layer(np.zeros((H, 4)), random_experts(RNG, H, 4), top_k=5)


# -- the layer against the per-token loop and finite differences -------------------------------------------

@pytest.mark.parametrize("top_k,renormalize,capacity_factor,capacity", [
    (1, True, 0.0, None), (2, True, 0.0, None), (2, False, 0.0, None), (2, True, 0.75, 6), (1, False, 0.5, 2)])
def test_layer_equals_the_per_token_loop(top_k, renormalize, capacity_factor, capacity):
    layer = random_layer(4, top_k, renormalize, capacity_factor)
    x = RNG.standard_normal((2, 8, H))
    y, saved = layer.forward(x)
    want = loop_reference_of(layer, x, capacity)
    np.testing.assert_allclose(y.reshape(-1, H), want.y, rtol=0, atol=1e-12)
    np.testing.assert_array_equal(saved.stats.assignments, want.assignments)
    np.testing.assert_array_equal(saved.stats.processed, want.processed)
    assert saved.stats.dropped_tokens == want.dropped_tokens
    assert saved.stats.aux_loss == pytest.approx(want.aux_loss, rel=1e-12)


@pytest.mark.parametrize("top_k,renormalize,capacity_factor", [
    (1, True, 0.0), (2, True, 0.0), (2, False, 0.0), (2, True, 0.75), (1, True, 0.5), (3, False, 0.6)],
    ids=["top1", "top2", "top2-raw", "top2-capacity", "top1-capacity", "top3-raw-capacity"])
def test_layer_backward_matches_finite_differences(top_k, renormalize, capacity_factor):
    layer = random_layer(4, top_k, renormalize, capacity_factor)
    x = decisive_inputs(layer, (2, 6, H))
    if capacity_factor:
        assert layer.forward(x)[1].stats.dropped_assignments > 0  # capacity really drops something
    check_layer_gradients(layer, x)


def test_input_and_weight_passes_apart_equal_backward():
    layer = random_layer(4, 2, capacity_factor=0.75)
    x = decisive_inputs(layer, (2, 6, H))
    dout = RNG.standard_normal(x.shape)
    dx_together = layer.backward(layer.forward(x)[1], dout.copy())
    together = [p.grad.copy() for p in parameters_of(layer)]
    for p in parameters_of(layer):
        p.zero_grad()
    saved = layer.forward(x)[1]
    dx_apart = layer.backward_input(saved, dout.copy())
    layer.backward_weights(saved)
    np.testing.assert_array_equal(dx_apart, dx_together)
    for p, grad in zip(parameters_of(layer), together, strict=True):
        np.testing.assert_array_equal(p.grad, grad)
    assert not vars(saved)


# -- the imbalance suite: routings forced through the router weights ----------------------------------------

IMBALANCED = {  # name: (E, K, choices of token n, capacity factor, capacity)
    "every token to one expert": (4, 1, lambda n: (2,), 0.0, None),
    "every token to one expert, top-2": (4, 2, lambda n: (3, n % 3), 0.0, None),
    "experts that receive nothing": (8, 2, lambda n: (n % 2, 1 - n % 2), 0.0, None),
    "everything past capacity": (4, 1, lambda n: (1,), 0.25, 1),
    "past capacity, top-2, some tokens fully dropped": (4, 2, lambda n: (0, 1 + (n >= 8)), 0.5, 4),
}


@pytest.mark.parametrize("case", IMBALANCED)
def test_forced_routing_equals_the_per_token_loop_and_finite_differences(case):
    n_experts, top_k, choose, capacity_factor, capacity = IMBALANCED[case]
    choices = [choose(n) for n in range(16)]
    layer = moe_layer(forcing_weight(H, n_experts, RNG), random_experts(RNG, H, n_experts), top_k,
                      capacity_factor=capacity_factor, aux_coef=0.5, aux_weight=0.5)
    x = forcing_inputs(choices, H, RNG).reshape(2, 8, H)
    y, saved = layer.forward(x)
    want = loop_reference_of(layer, x, capacity)
    np.testing.assert_allclose(y.reshape(-1, H), want.y, rtol=0, atol=1e-12)
    expected = np.bincount(np.ravel(choices), minlength=n_experts)
    np.testing.assert_array_equal(saved.stats.assignments, expected)
    np.testing.assert_array_equal(saved.stats.processed, want.processed)
    assert saved.stats.dropped_tokens == want.dropped_tokens
    served = want.y.any(axis=1)
    assert np.all(y.reshape(-1, H)[~served] == 0)  # dropped tokens: only the residual carries them
    check_layer_gradients(layer, x)


def test_everything_past_capacity_drops_all_but_the_first_tokens():
    n_experts = 4
    layer = moe_layer(forcing_weight(H, n_experts, RNG), random_experts(RNG, H, n_experts), 1, capacity_factor=0.25)
    x = forcing_inputs([(1,)] * 16, H, RNG)
    y, saved = layer.forward(x)
    assert saved.stats.processed.tolist() == [0, 1, 0, 0] and saved.stats.dropped_tokens == 15
    assert np.any(y[0] != 0) and np.all(y[1:] == 0)


# -- aux-loss-free balancing ---------------------------------------------------------------------------------

def test_bias_update_moves_the_bias_toward_under_loaded_experts():
    bias = np.zeros(4)
    update_expert_bias(bias, np.array([6, 1, 3, 2]), rate=0.125)  # mean 3
    np.testing.assert_array_equal(bias, [-0.125, 0.125, 0.0, 0.125])


def test_bias_updates_even_out_a_skewed_router():
    rng, n_experts = np.random.default_rng(0), 4
    weight = 0.3 * rng.standard_normal((H, n_experts))
    weight[0, 0] += 2.0  # channel 0 of every token is 1: expert 0 is everyone's favourite
    x = rng.standard_normal((64, H))
    x[:, 0] = 1.0
    bias = np.zeros(n_experts)
    layer = moe_layer(weight, random_experts(rng, H, n_experts), top_k=1, expert_bias=bias)
    loads = []
    for _ in range(40):
        stats = layer.forward(x)[1].stats
        loads.append(int(stats.assignments.max()))
        update_expert_bias(bias, stats.assignments, rate=0.02)
    assert loads[0] > 55 and max(loads[-10:]) < 24  # from nearly all 64 tokens on one expert to about 16 each
    assert bias[0] < 0 < min(bias[1:])


def test_router_stats_add_up_and_log_as_json():
    a = RouterStats(4, np.array([3, 1]), np.array([2, 1]), 1, 0.25)
    b = RouterStats(4, np.array([1, 3]), np.array([1, 3]), 0, 0.5)
    total = a + b
    assert total.assignments.tolist() == [4, 4] and total.dropped_assignments == 1
    assert total.as_log() == {"tokens_per_expert": [3, 4], "dropped_tokens": 1, "dropped_assignments": 1,
                              "aux_loss": 0.75, "max_load": 4, "mean_load": 4.0}


# -- the MoE Transformer (serial) ------------------------------------------------------------------------------------

def moe_config(**settings) -> GPTConfig:
    values = {"vocab_size": 13, "n_positions": 8, "n_embd": 8, "n_layer": 2, "n_head": 2, "n_experts": 4,
              "moe_top_k": 2, "moe_aux_coef": 0.3, "moe_capacity_factor": 1.5} | settings
    return GPTConfig(**values)


def perturbed_model(config: GPTConfig, **options) -> Transformer:
    model = Transformer(config, seed=3, dtype=np.float64, **options)
    rng = np.random.default_rng(5)
    for p in model.parameters():  # away from the zero biases and unit LayerNorms: every path carries gradient
        p.data += 0.3 * rng.standard_normal(p.data.shape)
    return model


def test_moe_gpt_gradients_match_finite_differences():
    model = perturbed_model(moe_config())
    tokens = np.random.default_rng(6).integers(0, 13, (2, 7))
    loss, saved = model.forward(tokens[:, :-1], tokens[:, 1:])
    assert saved.aux_loss > 0 and sum(s.dropped_assignments for s in saved.router_stats.values()) > 0
    model.backward(saved)
    objective = lambda: model.forward(tokens[:, :-1], tokens[:, 1:])[0]  # noqa: E731
    for name in ("transformer.h.0.mlp.router.weight", "transformer.h.1.mlp.router.weight",
                 "transformer.h.0.mlp.experts.1.c_fc.weight", "transformer.h.1.mlp.experts.3.c_proj.bias",
                 "transformer.h.0.ln_2.weight", "transformer.h.1.attn.c_attn.weight", "transformer.wte.weight"):
        param = model.params[name]
        assert_matches_finite_differences(objective, param.grad, param.data, name, samples=4)


def test_the_loss_adds_the_aux_loss_averaged_over_token_sets():
    model = perturbed_model(moe_config(), moe_token_sets=2)
    tokens = np.random.default_rng(7).integers(0, 13, (2, 7))
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    total, aux_sum = 0.0, 0.0
    for row in range(2):  # two microbatches, one token set each
        loss, saved = model.forward(inputs[row:row + 1], targets[row:row + 1], normalizer=inputs.size)
        aux_sum += sum(stats.aux_loss for stats in saved.router_stats.values())
        assert saved.aux_loss == pytest.approx(sum(s.aux_loss for s in saved.router_stats.values()) / 2, rel=1e-15)
        total += loss
        model.backward(saved)
    dense_part = Transformer(moe_config(moe_aux_coef=0.0), seed=3, dtype=np.float64)
    dense_part.load_state_dict(model.state_dict())
    cross_entropy = sum(dense_part.forward(inputs[r:r + 1], targets[r:r + 1], normalizer=inputs.size)[0]
                        for r in range(2))
    assert total == pytest.approx(cross_entropy + aux_sum / 2, rel=1e-13)

    def objective() -> float:
        return sum(model.forward(inputs[r:r + 1], targets[r:r + 1], normalizer=inputs.size)[0] for r in range(2))
    router = model.params["transformer.h.1.mlp.router.weight"]
    assert_matches_finite_differences(objective, router.grad, router.data, router.name)


def test_full_recompute_equals_none_and_keeps_the_router_statistics():
    tokens = np.random.default_rng(8).integers(0, 13, (2, 7))
    results = []
    for recompute in ("none", "full"):
        model = perturbed_model(moe_config(), recompute=recompute)
        loss, saved = model.forward(tokens[:, :-1], tokens[:, 1:])
        stats = {layer: s.as_log() for layer, s in saved.router_stats.items()}
        model.backward(saved)
        results.append((loss, stats, [p.grad for p in model.parameters()]))
    (loss, stats, grads), (loss_full, stats_full, grads_full) = results
    assert loss_full == loss and stats_full == stats and set(stats) == {0, 1}
    for grad, grad_full in zip(grads, grads_full, strict=True):
        np.testing.assert_array_equal(grad_full, grad)


def test_generation_with_kv_cache_runs_the_experts_token_by_token():
    model = perturbed_model(moe_config(moe_capacity_factor=0.0))
    prompt = np.array([3, 1, 4])
    generated = model.generate(prompt, new_tokens=3, temperature=0)
    context = list(prompt)
    for token in generated:
        assert token == int(np.argmax(model.logits(np.array([context]))[0, -1]))
        context.append(int(token))


def test_dense_config_keeps_exactly_the_gpt2_tensors():
    config = GPTConfig(vocab_size=13, n_positions=8, n_embd=8, n_layer=1, n_head=2)
    names = list(parameter_shapes(config))
    assert [n for n in names if ".mlp." in n] == [f"transformer.h.0.mlp.{n}" for n in
                                                  ("c_fc.weight", "c_fc.bias", "c_proj.weight", "c_proj.bias")]
    assert expert_bias_shapes(config) == {} and config.moe_settings() == {}
    assert config.parameter_count() == sum(math.prod(s) for s in parameter_shapes(config).values())


def test_moe_tensors_names_shapes_initialization_and_units():
    config = moe_config(n_layer=2, n_embd=32, n_head=2, n_experts=4)
    shapes = parameter_shapes(config)
    assert shapes["transformer.h.1.mlp.router.weight"] == (32, 4)
    assert shapes["transformer.h.1.mlp.experts.3.c_fc.weight"] == (32, 128)
    assert shapes["transformer.h.1.mlp.experts.3.c_proj.bias"] == (32,)
    assert not any(name.startswith("transformer.h.0.mlp.c_") for name in shapes)
    assert config.parameter_count() == sum(math.prod(s) for s in shapes.values())
    model = Transformer(config, seed=0, dtype=np.float64)
    assert model.params["transformer.h.0.mlp.router.weight"].data.std() == pytest.approx(0.02, rel=0.2)
    projection = model.params["transformer.h.0.mlp.experts.2.c_proj.weight"].data
    assert projection.std() == pytest.approx(0.02 / math.sqrt(2 * 2), rel=0.2)
    assert not model.params["transformer.h.0.mlp.experts.2.c_fc.bias"].data.any()
    bias = model.state_dict()["transformer.h.1.mlp.router.expert_bias"]
    assert bias.shape == (4,) and not bias.any() and "transformer.h.1.mlp.router.expert_bias" not in model.params
    assert units_using("transformer.h.1.mlp.experts.3.c_fc.weight", 2) == (2,)
    assert units_using("transformer.h.0.mlp.router.expert_bias", 2) == (1,)
    assert config.moe_settings() == {"n_experts": 4, "moe_top_k": 2, "moe_renormalize": True, "moe_aux_coef": 0.3,
                                     "moe_capacity_factor": 1.5, "moe_bias_rate": 0.0}


def test_state_dict_round_trip_carries_the_expert_biases():
    source = perturbed_model(moe_config())
    source.expert_biases["transformer.h.0.mlp.router.expert_bias"][:] = [0.1, -0.2, 0.0, 0.3]
    target = Transformer(moe_config(), seed=9, dtype=np.float64)
    target.load_state_dict({name.removeprefix("transformer."): v for name, v in source.state_dict().items()})
    for name, value in source.state_dict().items():
        np.testing.assert_array_equal(target.state_dict()[name], value)
    tokens = np.array([[1, 2, 3, 4]])
    assert target.forward(tokens, tokens)[0] == source.forward(tokens, tokens)[0]
    incomplete = dict(source.state_dict())
    del incomplete["transformer.h.1.mlp.router.expert_bias"]
    target.load_state_dict(incomplete)  # a checkpoint from elsewhere has no expert biases: they start at zero
    np.testing.assert_array_equal(target.expert_biases["transformer.h.1.mlp.router.expert_bias"], 0.0)
    np.testing.assert_array_equal(target.expert_biases["transformer.h.0.mlp.router.expert_bias"],
                                  source.expert_biases["transformer.h.0.mlp.router.expert_bias"])


@pytest.mark.parametrize("settings,message", [
    ({"moe_top_k": 5}, "moe_top_k"), ({"moe_top_k": 0}, "moe_top_k"), ({"moe_bias_rate": -0.1}, "moe_bias_rate"),
    ({"moe_capacity_factor": -1.0}, "moe_capacity_factor"), ({"moe_aux_coef": -1.0}, "moe_aux_coef"),
    ({"n_experts": -1}, "n_experts")])
def test_config_rejects_invalid_moe_settings(settings, message):
    with pytest.raises(ValueError, match=message):
        moe_config(**settings)


def test_the_model_needs_at_least_one_token_set():
    with pytest.raises(ValueError, match="moe_token_sets"):
        Transformer(moe_config(), moe_token_sets=0)


def test_experts_must_split_evenly_over_ep():
    assert local_experts(8, 1, 4) == range(2, 4)
    with pytest.raises(ValueError, match="divisible by ep"):
        local_experts(6, 0, 4)


def test_a_layer_needs_all_experts_over_its_ep_ranks():
    with pytest.raises(ValueError, match="4 experts"):
        moe_layer(np.zeros((H, 4)), copy_experts(random_experts(RNG, H, 3)), top_k=1)


# -- expert parallelism on 2 and 4 ranks ----------------------------------------------------------------------

def layer_checks(ep: int) -> dict:
    checks = {}
    for n_experts in (4, 8):
        for top_k in (1, 2):
            checks[f"union E{n_experts} k{top_k}"] = call(moe_checks.layer_against_union, n_experts=n_experts,
                                                      top_k=top_k)
            checks[f"sets E{n_experts} k{top_k}"] = call(moe_checks.layer_against_sets, n_experts=n_experts,
                                                     top_k=top_k, capacity_factor=0.75, aux_coef=0.5)
    return checks


def imbalance_checks() -> dict:
    return {f"imbalance {case}": call(moe_checks.forced_routing, case=case) for case in
            ("all to one expert", "one hot rank", "a hot spot per rank", "experts that receive nothing",
             "everything past capacity")}


def model_checks() -> dict:
    return {f"model {recompute}": call(moe_checks.model_against_serial, recompute=recompute)
            for recompute in ("none", "full")}


@pytest.fixture(scope="module")
def two_ranks() -> dict:
    checks = {**layer_checks(2), **imbalance_checks(), **model_checks()}
    return run_on_ranks(2, checks)


@pytest.fixture(scope="module")
def four_ranks() -> dict:
    checks = {**layer_checks(4), **imbalance_checks(), **model_checks()}
    return run_on_ranks(4, checks)


@pytest.fixture(params=[2, 4], ids=["ep2", "ep4"])
def ranks(request, two_ranks, four_ranks) -> list[dict]:
    return two_ranks if request.param == 2 else four_ranks


def results_named(ranks: list[dict], prefix: str) -> list[tuple[str, dict]]:
    return [(name, result) for rank in ranks for name, result in rank.items() if name.startswith(prefix)]


def test_expert_parallel_layer_equals_the_serial_layer_on_the_union_of_tokens(ranks):
    found = results_named(ranks, "union")
    assert len(found) == 4 * len(ranks)
    for name, result in found:
        assert worst(result["errors"].values()) <= TOLERANCE, (name, result["errors"])


def test_expert_parallel_layer_with_capacity_and_aux_equals_the_serial_layer_per_token_set(ranks):
    found = results_named(ranks, "sets")
    assert any(result["dropped"] for _, result in found)  # capacity dropped rows somewhere
    for name, result in found:
        assert worst(result["errors"].values()) <= TOLERANCE, (name, result["errors"])


def test_all_to_allv_sends_the_routed_rows_once_each_way(ranks):
    for name, result in results_named(ranks, "union") + results_named(ranks, "sets"):
        ledger = result["ledger"]
        assert ledger["forward"] == ledger["routed_bytes"] == ledger["backward"], name
    total = sum(result["ledger"]["forward"] for _, result in results_named(ranks, "union E8 k2"))
    off_rank_rows = sum(result["ledger"]["off_rank_rows_sent"] for _, result in results_named(ranks, "union E8 k2"))
    assert total == 2 * off_rank_rows * H * 8 > 0  # dispatch + combine, each off-rank row once


def test_forced_imbalanced_routings_equal_serial_and_the_oracle_counts(ranks):
    found = results_named(ranks, "imbalance")
    assert len(found) == 5 * len(ranks)
    for name, result in found:
        assert worst(result["errors"].values()) <= TOLERANCE, (name, result["errors"])
        assert result["counts_match_oracle"], (name, result)
        assert result["ledger"]["forward"] == result["ledger"]["routed_bytes"], name
    hot = [result for name, result in found if name.endswith("one hot rank")]
    assert all(result["received_rows"] == 0 for result in hot[1:])  # only EP rank 0 receives rows


def test_expert_parallel_model_equals_the_serial_model(ranks):
    for name, result in results_named(ranks, "model"):
        assert result["held_experts"] == result["expected_experts"], name
        assert worst(result["errors"].values()) <= TOLERANCE, (name, result["errors"])


def test_expert_parallel_model_runs_on_device_arrays():
    """The EP model's worker on the CuPy double (scripts/gpu_check.sh runs it with real CuPy)."""
    results = run_on_ranks(2, {"model": call(moe_checks.model_against_serial, recompute="none")},
                           env={"MPIPARALLEL_TEST_ARRAYS": "fake"})
    for result in results:
        assert worst(result["model"]["errors"].values()) <= TOLERANCE, result["model"]["errors"]
