"""Optimizers equal independent references; clipping and the schedule follow their stated formulas."""

from __future__ import annotations

import copy
import math

import numpy as np
import pytest
from optional import optional_module

from models import host_kernels
from models.parameter import Parameter
from models.transformer import GPTConfig, Transformer
from mpiparallel.errors import ConfigError
from mpiparallel.optim import (
    SGD,
    AdamW,
    adamw_update,
    clip_grad_norm,
    global_grad_norm,
    learning_rate,
    sgd_update,
)

SHAPES = {"layer.weight": (3, 4), "layer.bias": (4,), "embedding.weight": (5, 2)}


def make_params(dtype=np.float64, seed: int = 0) -> list[Parameter]:
    rng = np.random.default_rng(seed)
    return [Parameter(name, rng.standard_normal(shape).astype(dtype)) for name, shape in SHAPES.items()]


def set_grads(params: list[Parameter], step: int) -> None:
    """Deterministic gradients that differ from step to step."""
    rng = np.random.default_rng(100 + step)
    for param in params:
        param.grad[...] = rng.standard_normal(param.data.shape)


def reference_adamw(values: dict[str, np.ndarray], steps: int, lr: float, betas, eps: float, weight_decay: float,
                    decayed: set[str]) -> dict[str, np.ndarray]:
    """Loshchilov & Hutter's AdamW with PyTorch's placement of eps, written from the paper in float64."""
    beta1, beta2 = betas
    weights = {name: value.astype(np.float64).copy() for name, value in values.items()}
    first = {name: np.zeros_like(w) for name, w in weights.items()}
    second = {name: np.zeros_like(w) for name, w in weights.items()}
    probe = [Parameter(name, np.zeros_like(w)) for name, w in weights.items()]
    for t in range(1, steps + 1):
        set_grads(probe, t)
        for param in probe:
            name, g = param.name, param.grad
            if name in decayed:
                weights[name] = weights[name] - lr * weight_decay * weights[name]
            first[name] = beta1 * first[name] + (1 - beta1) * g
            second[name] = beta2 * second[name] + (1 - beta2) * g * g
            m_hat = first[name] / (1 - beta1**t)
            v_hat = second[name] / (1 - beta2**t)
            weights[name] = weights[name] - lr * m_hat / (np.sqrt(v_hat) + eps)
    return weights


def run_adamw(params: list[Parameter], optimizer: AdamW, first_step: int, last_step: int) -> None:
    for t in range(first_step, last_step + 1):
        set_grads(params, t)
        optimizer.step()


def test_adamw_equals_reference_with_weight_decay_on_matrices_only():
    params = make_params()
    initial = {p.name: p.data.copy() for p in params}
    optimizer = AdamW(params, lr=0.01, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    run_adamw(params, optimizer, 1, 6)
    expected = reference_adamw(initial, 6, 0.01, (0.9, 0.95), 1e-8, 0.1, {"layer.weight", "embedding.weight"})
    for param in params:
        np.testing.assert_allclose(param.data, expected[param.name], rtol=1e-13, atol=0)


def test_adamw_does_not_decay_one_dimensional_parameters():
    with_decay, without_decay = make_params(), make_params()
    run_adamw(with_decay, AdamW(with_decay, lr=0.01, weight_decay=0.5), 1, 3)
    run_adamw(without_decay, AdamW(without_decay, lr=0.01, weight_decay=0.0), 1, 3)
    for decayed, plain in zip(with_decay, without_decay, strict=True):
        if decayed.data.ndim == 1:
            np.testing.assert_array_equal(decayed.data, plain.data)
        else:
            assert not np.allclose(decayed.data, plain.data)


def test_adamw_in_float32_stays_close_to_the_float64_reference():
    params = make_params(np.float32)
    initial = {p.name: p.data.copy() for p in params}
    run_adamw(params, AdamW(params, lr=0.01, weight_decay=0.1), 1, 4)
    expected = reference_adamw(initial, 4, 0.01, (0.9, 0.95), 1e-8, 0.1, {"layer.weight", "embedding.weight"})
    for param in params:
        assert param.data.dtype == np.float32
        np.testing.assert_allclose(param.data, expected[param.name], rtol=1e-5, atol=1e-6)


def test_sgd_equals_w_minus_lr_times_g_with_per_step_lr():
    params = make_params()
    expected = {p.name: p.data.copy() for p in params}
    optimizer = SGD(params, lr=0.1)
    for t, lr in enumerate([None, 0.05, 0.2], start=1):
        set_grads(params, t)
        for param in params:
            expected[param.name] -= (0.1 if lr is None else lr) * param.grad
        optimizer.step(lr)
    for param in params:
        np.testing.assert_allclose(param.data, expected[param.name], rtol=1e-15)
    assert optimizer.step_count == 3


def test_lr_override_changes_only_that_step():
    overridden, plain = make_params(), make_params()
    optimizer_a, optimizer_b = AdamW(overridden, lr=0.01), AdamW(plain, lr=0.02)
    for t in (1, 2):
        set_grads(overridden, t)
        set_grads(plain, t)
        optimizer_a.step(lr=0.02)
        optimizer_b.step()
    for a, b in zip(overridden, plain, strict=True):
        np.testing.assert_array_equal(a.data, b.data)


def test_pure_update_functions_leave_the_gradient_alone_and_reuse_scratch():
    param, grad = np.ones(4), np.full(4, 2.0)
    scratch = np.empty(4)
    sgd_update(param, grad, 0.5, scratch)
    np.testing.assert_array_equal(param, np.zeros(4))
    m, v = np.zeros(4), np.zeros(4)
    adamw_update(param, grad, m, v, 1, 0.1, 0.9, 0.95, 1e-8, 0.0, scratch)
    np.testing.assert_array_equal(grad, np.full(4, 2.0))
    np.testing.assert_allclose(param, np.full(4, -0.1), rtol=1e-7)  # first Adam step moves by lr·sign(g)
    with pytest.raises(ValueError, match="starts at 1"):
        adamw_update(param, grad, m, v, 0, 0.1, 0.9, 0.95, 1e-8, 0.0)
    with pytest.raises(ValueError, match="scratch"):
        sgd_update(param, grad, 0.1, np.empty(3))


@pytest.mark.parametrize("layout", ["contiguous", "strided"])
def test_adamw_on_a_parameter_larger_than_a_block_equals_the_update_in_one_piece(monkeypatch, layout):
    """Blocks of CPU_BLOCK elements (here 1,000, so 5,000 + 37 elements make six, the last short) give the very
    numbers of one pass over the whole array; a strided array (no flat view) is updated in one piece. (The NumPy
    passes: the compiled kernel, where it runs, takes a contiguous array whole.)"""
    import mpiparallel.optim as optim

    monkeypatch.setattr(host_kernels, "ENABLED", False)
    rng = np.random.default_rng(7)
    arrays = [rng.standard_normal((5037, 2) if layout == "strided" else 5037) for _ in range(4)]
    arrays[3] = np.abs(arrays[3])  # v ≥ 0
    if layout == "strided":
        arrays = [array[:, 0] for array in arrays]
    whole = [array.copy() for array in arrays]
    adamw_update(*whole, 3, 0.01, 0.9, 0.95, 1e-8, 0.1)
    monkeypatch.setattr(optim, "CPU_BLOCK", 1000)
    seen = []
    passes = optim._adamw_passes
    monkeypatch.setattr(optim, "_adamw_passes", lambda *a: (seen.append(a[0].size), passes(*a))[1])
    adamw_update(*arrays, 3, 0.01, 0.9, 0.95, 1e-8, 0.1)
    assert seen == ([1000] * 5 + [37] if layout == "contiguous" else [5037])
    for blocked, reference in zip(arrays, whole, strict=True):
        np.testing.assert_array_equal(blocked, reference)


def test_adamw_equals_torch_adamw():
    torch = optional_module("torch", "torch is optional (pip install -e '.[interop]'); the reference test above "
                                     "covers the formula")
    torch.set_num_threads(1)  # tiny tensors are no faster on more threads; they would take cores from other work
    params = make_params()
    torch_params = [torch.nn.Parameter(torch.tensor(p.data.copy())) for p in params]
    decayed = [tp for p, tp in zip(params, torch_params, strict=True) if p.data.ndim >= 2]
    plain = [tp for p, tp in zip(params, torch_params, strict=True) if p.data.ndim < 2]
    groups = [{"params": decayed, "weight_decay": 0.1}, {"params": plain, "weight_decay": 0.0}]
    torch_optimizer = torch.optim.AdamW(groups, lr=0.01, betas=(0.9, 0.95), eps=1e-8, foreach=False)
    optimizer = AdamW(params, lr=0.01, weight_decay=0.1)
    for t in range(1, 6):
        set_grads(params, t)
        for param, torch_param in zip(params, torch_params, strict=True):
            torch_param.grad = torch.tensor(param.grad.copy())
        optimizer.step()
        torch_optimizer.step()
    for param, torch_param in zip(params, torch_params, strict=True):
        np.testing.assert_allclose(param.data, torch_param.detach().numpy(), rtol=1e-12, atol=0)


def test_state_dict_round_trip_continues_exactly_like_an_uninterrupted_run():
    uninterrupted = make_params()
    run_adamw(uninterrupted, AdamW(uninterrupted, lr=0.01, weight_decay=0.1), 1, 6)

    first_half = make_params()
    optimizer = AdamW(first_half, lr=0.01, weight_decay=0.1)
    run_adamw(first_half, optimizer, 1, 3)
    saved_state = copy.deepcopy(optimizer.state_dict())
    saved_weights = {p.name: p.data.copy() for p in first_half}
    run_adamw(first_half, optimizer, 4, 4)  # the saved state must not alias the live buffers

    resumed = [Parameter(name, value) for name, value in saved_weights.items()]
    resumed_optimizer = AdamW(resumed, lr=0.01, weight_decay=0.1)
    resumed_optimizer.load_state_dict(saved_state)
    assert resumed_optimizer.step_count == 3
    run_adamw(resumed, resumed_optimizer, 4, 6)
    for a, b in zip(uninterrupted, resumed, strict=True):
        np.testing.assert_array_equal(a.data, b.data)


def test_state_dict_holds_named_moments_and_the_step():
    params = make_params()
    optimizer = AdamW(params, lr=0.01)
    run_adamw(params, optimizer, 1, 2)
    state = optimizer.state_dict()
    assert state["optimizer"] == "adamw" and state["step"] == 2
    assert set(state["exp_avg"]) == set(state["exp_avg_sq"]) == set(SHAPES)
    assert SGD(params, lr=0.1).state_dict() == {"optimizer": "sgd", "step": 0}


def test_load_state_dict_rejects_another_optimizer_or_other_parameters():
    params = make_params()
    with pytest.raises(ConfigError, match="'sgd' optimizer state"):
        AdamW(params, lr=0.01).load_state_dict(SGD(params, lr=0.1).state_dict())
    state = AdamW(params, lr=0.01).state_dict()
    del state["exp_avg"]["layer.bias"]
    with pytest.raises(ConfigError, match="missing.*layer.bias"):
        AdamW(params, lr=0.01).load_state_dict(state)
    state = AdamW(params, lr=0.01).state_dict()
    state["exp_avg_sq"]["layer.bias"] = np.zeros(5)
    with pytest.raises(ConfigError, match="shape"):
        AdamW(params, lr=0.01).load_state_dict(state)


def test_bad_hyperparameters_are_config_errors():
    with pytest.raises(ConfigError, match="non-negative"):
        SGD(make_params(), lr=-1.0)
    with pytest.raises(ConfigError, match="betas"):
        AdamW(make_params(), lr=0.1, betas=(1.0, 0.9))


def test_adamw_lowers_the_loss_of_the_gpt_model():
    config = GPTConfig(vocab_size=16, n_positions=8, n_embd=8, n_layer=1, n_head=2)
    model = Transformer(config, seed=0, dtype=np.float64)
    tokens = np.arange(16).reshape(2, 8) % 16
    optimizer = AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    losses = []
    for _ in range(10):
        model.zero_grad()
        loss, saved = model.forward(tokens[:, :-1], tokens[:, 1:])
        losses.append(loss)
        model.backward(saved)
        optimizer.step()
    assert losses[-1] < losses[0] - 0.1


# --- gradient norm and clipping --------------------------------------------------------------------------------


def grads_of(*arrays: np.ndarray) -> list[Parameter]:
    params = []
    for i, array in enumerate(arrays):
        param = Parameter(f"p{i}", np.zeros_like(array))
        param.grad[...] = array
        params.append(param)
    return params


def test_global_grad_norm_is_the_l2_norm_of_all_grads_accumulated_in_float64():
    params = grads_of(np.array([3.0, 0.0], np.float32), np.array([[4.0]], np.float32))
    assert global_grad_norm(params) == 5.0
    big = grads_of(np.full(1000, 1e20, np.float32))  # squares overflow float32, not float64
    assert math.isclose(global_grad_norm(big), 1e20 * math.sqrt(1000), rel_tol=1e-6)


def test_grad_norm_callback_receives_the_local_sum_of_squares_and_returns_the_global_one():
    params = grads_of(np.array([3.0, 4.0]))
    seen = []

    def two_ranks_with_equal_shards(local: float) -> float:
        seen.append(local)
        return 2 * local

    assert global_grad_norm(params, two_ranks_with_equal_shards) == math.sqrt(50.0)
    assert seen == [25.0]


def test_clip_grad_norm_scales_by_max_norm_over_norm_plus_epsilon():
    params = grads_of(np.array([3.0, 0.0]), np.array([4.0]))
    norm = clip_grad_norm(params, max_norm=1.0)
    assert norm == 5.0
    coefficient = 1.0 / (5.0 + 1e-6)
    np.testing.assert_allclose(params[0].grad, [3.0 * coefficient, 0.0], rtol=1e-15)
    np.testing.assert_allclose(params[1].grad, [4.0 * coefficient], rtol=1e-15)


def test_clip_grad_norm_leaves_small_grads_and_is_off_for_non_positive_max_norm():
    params = grads_of(np.array([0.3, 0.4]))
    assert clip_grad_norm(params, max_norm=1.0) == pytest.approx(0.5)
    np.testing.assert_array_equal(params[0].grad, [0.3, 0.4])
    big = grads_of(np.array([30.0, 40.0]))
    assert clip_grad_norm(big, max_norm=0.0) == 50.0
    np.testing.assert_array_equal(big[0].grad, [30.0, 40.0])


def test_clip_grad_norm_uses_the_global_norm_from_the_callback():
    params = grads_of(np.array([3.0, 4.0]))
    norm = clip_grad_norm(params, max_norm=5.0, reduce_sum_of_squares=lambda local: 4 * local)
    assert norm == 10.0
    np.testing.assert_allclose(params[0].grad, np.array([3.0, 4.0]) * 5.0 / (10.0 + 1e-6), rtol=1e-15)


# --- learning-rate schedule -------------------------------------------------------------------------------------


def test_warmup_ramps_linearly_to_base_lr_on_its_last_step():
    assert learning_rate(0, 1.0, warmup_steps=4) == 0.25
    assert learning_rate(3, 1.0, warmup_steps=4) == 1.0
    assert learning_rate(100, 1.0, warmup_steps=4) == 1.0
    assert learning_rate(7, 0.5) == 0.5


def test_cosine_decays_from_base_lr_to_min_lr_at_the_last_step():
    def cosine(step):
        return learning_rate(step, 1.0, "cosine", warmup_steps=10, total_steps=111, min_lr_fraction=0.1)

    assert cosine(9) == 1.0
    assert cosine(10) == 1.0
    assert cosine(60) == pytest.approx(0.55, rel=1e-15)
    assert cosine(110) == pytest.approx(0.1, rel=1e-15)
    assert cosine(500) == pytest.approx(0.1, rel=1e-15)
    assert all(cosine(s) >= cosine(s + 1) for s in range(10, 115))


def test_cosine_without_warmup_starts_at_base_lr():
    assert learning_rate(0, 2.0, "cosine", total_steps=3, min_lr_fraction=0.0) == 2.0
    assert learning_rate(1, 2.0, "cosine", total_steps=3, min_lr_fraction=0.0) == pytest.approx(1.0)
    assert learning_rate(2, 2.0, "cosine", total_steps=3, min_lr_fraction=0.0) == 0.0
    assert learning_rate(0, 2.0, "cosine", total_steps=1) == pytest.approx(0.2)


@pytest.mark.parametrize("kwargs, message", [
    ({"schedule": "linear"}, "unknown learning-rate schedule"),
    ({"warmup_steps": -1}, "warmup"),
    ({"schedule": "cosine"}, "total_steps"),
    ({"schedule": "cosine", "total_steps": 0}, "total_steps"),
    ({"min_lr_fraction": 1.5}, "min_lr_fraction"),
    ({"base_lr": -0.1}, "non-negative"),
    ({"step": -1}, "step"),
])
def test_schedule_rejects_bad_settings(kwargs, message):
    arguments = {"step": 0, "base_lr": 1.0} | kwargs
    with pytest.raises(ConfigError, match=message):
        learning_rate(**arguments)
