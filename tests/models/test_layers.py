"""Every layer's hand-written backward equals finite differences of its forward (float64)."""

from __future__ import annotations

import math

import numpy as np
import pytest
from gradient_checks import (
    assert_close,
    check_layer,
    check_model_gradients,
    check_split_backward,
    numeric_gradient,
    param,
    parameters_of,
)

from models.layers import (
    GELU,
    IGNORED,
    MLP,
    Block,
    CausalSelfAttention,
    Embedding,
    HeadCrossEntropy,
    KVCache,
    LayerNorm,
    Linear,
)
from models.parameter import Parameter
from models.transformer import GPTConfig, Transformer

RNG = np.random.default_rng(1234)
B, T, C, H = 2, 5, 8, 2


def linear(name: str, n_in: int, n_out: int) -> Linear:
    return Linear(param(f"{name}.weight", n_in, n_out), param(f"{name}.bias", n_out))


def layer_norm(name: str) -> LayerNorm:
    return LayerNorm(Parameter(f"{name}.weight", 1 + 0.3 * RNG.standard_normal(C)), param(f"{name}.bias", C))


def attention() -> CausalSelfAttention:
    return CausalSelfAttention(linear("c_attn", C, 3 * C), linear("c_proj", C, C), H)


def block() -> Block:
    mlp = MLP(linear("c_fc", C, 4 * C), linear("c_proj", 4 * C, C))
    return Block(layer_norm("ln_1"), attention(), layer_norm("ln_2"), mlp)


@pytest.mark.parametrize("make", [lambda: linear("fc", C, 3 * C), lambda: layer_norm("ln"), GELU, attention,
                                  lambda: MLP(linear("c_fc", C, 4 * C), linear("c_proj", 4 * C, C)), block],
                         ids=["linear", "layernorm", "gelu", "attention", "mlp", "block"])
def test_backward_matches_finite_differences(make):
    check_layer(make(), RNG.standard_normal((B, T, C)))


@pytest.mark.parametrize("make", [lambda: linear("fc", C, 3 * C), attention, block,
                                  lambda: MLP(linear("c_fc", C, 4 * C), linear("c_proj", 4 * C, C))],
                         ids=["linear", "attention", "block", "mlp"])
def test_input_and_weight_gradients_can_be_computed_separately(make):
    check_split_backward(make(), RNG.standard_normal((B, T, C)))


def test_attention_is_causal():
    layer, x = attention(), RNG.standard_normal((B, T, C))
    before = layer.forward(x)[0]
    changed = x.copy()
    changed[:, -1] += 1.0  # the last position may not influence earlier ones
    np.testing.assert_allclose(layer.forward(changed)[0][:, :-1], before[:, :-1], rtol=0, atol=1e-14)


def test_embedding_gradient_accumulates_repeated_tokens():
    layer = Embedding(param("wte", 7, C), param("wpe", T, C))
    tokens = np.array([[1, 1, 3, 1, 6], [0, 3, 3, 2, 1]])
    dout = RNG.standard_normal((2, T, C))
    layer.backward(layer.forward(tokens)[1], dout)
    expected = np.zeros((7, C))
    for b in range(2):
        for t in range(T):
            expected[tokens[b, t]] += dout[b, t]
    np.testing.assert_allclose(layer.token.grad, expected, rtol=1e-14)
    np.testing.assert_allclose(layer.position.grad, dout.sum(axis=0), rtol=1e-14)


def test_cross_entropy_matches_finite_differences_and_log_softmax():
    vocab = 11
    head = HeadCrossEntropy(param("wte", vocab, C))
    x, targets = RNG.standard_normal((B, T, C)), RNG.integers(0, vocab, (B, T))
    loss, saved = head.forward(x, targets, normalizer=B * T)
    logits = x.reshape(-1, C) @ head.token.data.T
    log_probs = logits - np.log(np.exp(logits).sum(axis=1, keepdims=True))
    assert loss == pytest.approx(-log_probs[np.arange(B * T), targets.reshape(-1)].mean(), rel=1e-12)
    dx = head.backward(saved, None)
    picks, numeric = numeric_gradient(lambda: head.forward(x, targets, B * T)[0], x)
    assert_close(dx.reshape(-1)[picks], numeric, "cross-entropy input")
    picks, numeric = numeric_gradient(lambda: head.forward(x, targets, B * T)[0], head.token.data)
    assert_close(head.token.grad.reshape(-1)[picks], numeric, "cross-entropy wte")


def test_an_ignored_target_adds_no_loss_and_no_gradient():
    vocab = 11
    head = HeadCrossEntropy(param("wte", vocab, C))
    x, targets = RNG.standard_normal((B, T, C)), RNG.integers(0, vocab, (B, T))
    ignored = targets.copy()
    ignored[:, -2:] = IGNORED  # multi-token prediction's positions past the sequence's end
    loss, saved = head.forward(x, ignored, normalizer=7.0)
    dx, grad = head.backward(saved, None), head.token.grad.copy()
    head.token.zero_grad()
    kept_loss, kept = head.forward(x[:, :-2], targets[:, :-2], normalizer=7.0)
    kept_dx = head.backward(kept, None)
    assert loss == pytest.approx(kept_loss, rel=1e-14)
    np.testing.assert_array_equal(dx[:, -2:], 0.0)
    np.testing.assert_allclose(dx[:, :-2], kept_dx, rtol=1e-14)
    np.testing.assert_allclose(grad, head.token.grad, rtol=1e-13, atol=1e-16)


def test_whole_model_gradients_match_finite_differences():
    check_model_gradients(Transformer(GPTConfig(vocab_size=13, n_positions=8, n_embd=8, n_layer=2, n_head=2), seed=3,
                                      dtype=np.float64))


def test_loss_at_initialization_is_about_ln_vocab():
    config = GPTConfig(vocab_size=256, n_positions=32, n_embd=32, n_layer=2, n_head=4)
    model = Transformer(config, seed=0)
    tokens = RNG.integers(0, 256, (4, 32))
    assert model.forward(tokens, np.roll(tokens, -1, axis=1))[0] == pytest.approx(math.log(256), rel=0.02)


def test_initialization_depends_only_on_the_seed():
    config = GPTConfig(vocab_size=17, n_positions=8, n_embd=8, n_layer=2, n_head=2)
    first, second, other = Transformer(config, seed=5), Transformer(config, seed=5), Transformer(config, seed=6)
    for name, value in first.state_dict().items():
        np.testing.assert_array_equal(value, second.state_dict()[name])
    assert not np.array_equal(first.params["transformer.wte.weight"].data, other.params["transformer.wte.weight"].data)
    proj = first.params["transformer.h.1.mlp.c_proj.weight"].data
    assert proj.std() == pytest.approx(0.02 / math.sqrt(4), rel=0.2)


@pytest.mark.parametrize(("window", "expected_rebuilds"), [(None, 1), (8, 4)])
def test_generation_with_kv_cache_equals_recomputing_the_whole_sequence(window, expected_rebuilds):
    config = GPTConfig(vocab_size=13, n_positions=16, n_embd=8, n_layer=2, n_head=2)
    model = Transformer(config, seed=1, dtype=np.float64)
    prompt = [3, 1, 4, 1, 5]
    generated = model.generate(np.array(prompt), new_tokens=20, temperature=0, window=window)  # cache rebuilt
    size = window or config.n_positions
    context, window_start, rebuilds = list(prompt), 0, 0
    for token in generated:
        if len(context) - window_start > size:  # the cache is rebuilt from the latest half
            window_start, rebuilds = len(context) - size // 2, rebuilds + 1
        expected = int(np.argmax(model.logits(np.array([context[window_start:]]))[0, -1]))
        assert token == expected
        context.append(token)
    # n_positions = 16: passed at the 17th token (5 prompt + 12 new); a window of 8 at the 9th, then every 4
    assert rebuilds == expected_rebuilds
    assert len(generated) == 20 and all(0 <= t < 13 for t in generated)


def test_embedding_gradient_accumulates_into_a_strided_gradient_view():
    layer = Embedding(param("wte", 7, C), param("wpe", T, C))
    layer.token.grad = np.zeros((C, 7)).T  # a view that is not C-contiguous, as a flat-buffer layout might give
    tokens = np.array([[1, 1, 3, 1, 6], [0, 3, 3, 2, 1]])
    dout = RNG.standard_normal((2, T, C))
    layer.backward(layer.forward(tokens)[1], dout)
    expected = np.zeros((7, C))
    np.add.at(expected, tokens.reshape(-1), dout.reshape(-1, C))
    np.testing.assert_allclose(layer.token.grad, expected, rtol=1e-14)


def test_attention_in_query_blocks_matches_finite_differences_and_one_block():
    layer, x = attention(), RNG.standard_normal((B, 7, C))
    whole, saved = layer.forward(x)
    dout = RNG.standard_normal(whole.shape)
    dx_whole = layer.backward(saved, dout.copy())
    grads_whole = [p.grad.copy() for p in parameters_of(layer)]
    layer = CausalSelfAttention(layer.qkv, layer.projection, H, query_block=3)  # [0, 3), [3, 6), [6, 7)
    for p in parameters_of(layer):
        p.zero_grad()
    out, saved = layer.forward(x)
    np.testing.assert_allclose(out, whole, rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(layer.backward(saved, dout.copy()), dx_whole, rtol=1e-12, atol=1e-14)
    for p, grad in zip(parameters_of(layer), grads_whole, strict=True):
        np.testing.assert_allclose(p.grad, grad, rtol=1e-12, atol=1e-14)
    check_layer(layer, x)


def test_incremental_attention_in_query_blocks_equals_the_full_forward():
    x = RNG.standard_normal((B, 7, C))
    layer = CausalSelfAttention(linear("c_attn", C, 3 * C), linear("c_proj", C, C), H, query_block=2)
    expected = layer.forward(x)[0]
    cache = KVCache()
    first = layer.forward_incremental(x[:, :4], cache)  # a prompt of 4 positions: two blocks
    rest = layer.forward_incremental(x[:, 4:], cache)  # 3 new positions over 4 cached: offset 4
    np.testing.assert_allclose(np.concatenate((first, rest), axis=1), expected, rtol=1e-12, atol=1e-14)
