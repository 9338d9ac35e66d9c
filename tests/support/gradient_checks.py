"""Gradient checks the layer and model tests share: a layer's or a whole model's hand-written backward against
central finite differences of its forward, in float64."""

from __future__ import annotations

import numpy as np

from models.parameter import Parameter
from models.transformer import Transformer

RNG = np.random.default_rng(1234)


def param(name: str, *shape: int, scale: float = 0.5) -> Parameter:
    return Parameter(name, RNG.standard_normal(shape) * scale)


def parameters_of(layer) -> list[Parameter]:
    found = []
    for value in vars(layer).values():
        for item in value if isinstance(value, list) else [value]:
            if isinstance(item, Parameter):
                found.append(item)
            elif hasattr(item, "__dict__") and not isinstance(item, np.ndarray):
                found += parameters_of(item)
    return found


def numeric_gradient(loss, array: np.ndarray, samples: int = 12, eps: float = 1e-6) -> tuple[list, np.ndarray]:
    """Central differences of loss() with respect to a few random entries of `array` (changed in place)."""
    flat = array.reshape(-1)
    picks = RNG.choice(flat.size, size=min(samples, flat.size), replace=False)
    estimates = []
    for i in picks:
        original = flat[i]
        flat[i] = original + eps
        plus = loss()
        flat[i] = original - eps
        minus = loss()
        flat[i] = original
        estimates.append((plus - minus) / (2 * eps))
    return picks, np.array(estimates)


def assert_close(analytic: np.ndarray, numeric: np.ndarray, what: str) -> None:
    scale = max(np.abs(numeric).max(), 1e-3)
    assert np.abs(analytic - numeric).max() / scale < 1e-6, f"{what}: {analytic} vs {numeric}"


def check_layer(layer, x: np.ndarray) -> None:
    """d(sum(forward(x) · R)) by backward versus finite differences, for x and every parameter."""
    out, saved = layer.forward(x)
    weights = RNG.standard_normal(out.shape)

    def loss() -> float:
        return float((layer.forward(x)[0] * weights).sum())

    params = parameters_of(layer)
    for p in params:
        p.zero_grad()
    dx = layer.backward(saved, weights.copy())
    picks, numeric = numeric_gradient(loss, x)
    assert_close(dx.reshape(-1)[picks], numeric, f"{type(layer).__name__} input")
    for p in params:
        picks, numeric = numeric_gradient(loss, p.data)
        assert_close(p.grad.reshape(-1)[picks], numeric, f"{type(layer).__name__} {p.name}")


def check_model_gradients(model: Transformer) -> None:
    """Every parameter's gradient of the whole model's loss against finite differences (a vocabulary of 13)."""
    for p in model.parameters():  # move away from the all-ones/zeros init so every path carries gradient
        p.data += 0.1 * RNG.standard_normal(p.data.shape)
    tokens, targets = RNG.integers(0, 13, (2, 6)), RNG.integers(0, 13, (2, 6))
    model.backward(model.forward(tokens, targets)[1])
    for p in model.parameters():
        picks, numeric = numeric_gradient(lambda: model.forward(tokens, targets)[0], p.data, samples=6)
        assert_close(p.grad.reshape(-1)[picks], numeric, p.name)


def check_split_backward(layer, x: np.ndarray, inspect_saved=None) -> None:
    """backward_input then backward_weights give exactly the joint backward's d(input) and weight gradients (what
    zero-bubble schedules rely on); `inspect_saved(saved)` sees what the input pass left for the weight pass."""
    out, saved = layer.forward(x)
    dout = RNG.standard_normal(out.shape)
    params = parameters_of(layer)
    dx_together = layer.backward(saved, dout.copy())
    together = [p.grad.copy() for p in params]
    for p in params:
        p.zero_grad()
    saved = layer.forward(x)[1]
    dx_apart = layer.backward_input(saved, dout.copy())
    if inspect_saved is not None:
        inspect_saved(saved)
    layer.backward_weights(saved)
    np.testing.assert_array_equal(dx_apart, dx_together)
    for p, grad in zip(params, together, strict=True):
        np.testing.assert_array_equal(p.grad, grad)
