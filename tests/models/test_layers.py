"""Every layer's hand-written backward equals finite differences of its forward (float64), for each family's layers
(GPT-2's LayerNorm, GELU and fused QKV; the llama family's RMSNorm, SwiGLU, RoPE and grouped-query attention), and the
whole model of each family (GPT-2, llama with GQA, tied llama, Mixtral) against finite differences and its KV cache.
Where the math is new it is also checked against its formula: RoPE against complex rotation, GQA against multi-head
attention with repeated KV heads."""

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
    ConcatenatedLinear,
    Embedding,
    HeadCrossEntropy,
    KVCache,
    LayerNorm,
    Linear,
    RMSNorm,
    SwiGLU,
)
from models.parameter import Parameter
from models.rotary import RotaryEmbedding
from models.transformer import GPTConfig, Transformer

RNG = np.random.default_rng(1234)
B, T, C, H, KV = 2, 5, 16, 4, 2
D = C // H


def linear(name: str, n_in: int, n_out: int) -> Linear:
    return Linear(param(f"{name}.weight", n_in, n_out), param(f"{name}.bias", n_out))


def layer_norm(name: str) -> LayerNorm:
    return LayerNorm(Parameter(f"{name}.weight", 1 + 0.3 * RNG.standard_normal(C)), param(f"{name}.bias", C))


def attention() -> CausalSelfAttention:
    return CausalSelfAttention(linear("c_attn", C, 3 * C), linear("c_proj", C, C), H)


def gelu_mlp() -> MLP:
    return MLP(linear("c_fc", C, 4 * C), linear("c_proj", 4 * C, C))


def block() -> Block:
    return Block(layer_norm("ln_1"), attention(), layer_norm("ln_2"), gelu_mlp())


def rms_norm() -> RMSNorm:
    return RMSNorm(Parameter("ln.weight", 1 + 0.3 * RNG.standard_normal(C)), eps=1e-5)


def grouped_attention(n_kv: int = KV, query_block: int = 3, keep: bool = True) -> CausalSelfAttention:
    qkv = ConcatenatedLinear([param("q", C, H * D), param("k", C, n_kv * D), param("v", C, n_kv * D)])
    return CausalSelfAttention(qkv, Linear(param("o", C, C)), H, query_block, keep, n_kv_head=n_kv,
                               rope=RotaryEmbedding(D, theta=100.0))


def swiglu_mlp() -> MLP:
    return MLP(ConcatenatedLinear([param("gate", C, 24), param("up", C, 24)]), Linear(param("down", 24, C)), SwiGLU())


def llama_block() -> Block:
    return Block(rms_norm(), grouped_attention(), rms_norm(), swiglu_mlp())


LAYERS = {  # name: (maker, input width)
    "linear": (lambda: linear("fc", C, 3 * C), C), "layernorm": (lambda: layer_norm("ln"), C), "gelu": (GELU, C),
    "attention": (attention, C), "mlp": (gelu_mlp, C), "block": (block, C),
    "rmsnorm": (rms_norm, C), "swiglu": (SwiGLU, 2 * C),
    "concatenated": (lambda: ConcatenatedLinear([param("a", C, 5), param("b", C, 3)]), C),
    "gqa": (grouped_attention, C), "mqa-selective": (lambda: grouped_attention(n_kv=1, keep=False), C),
    "mha-rope": (lambda: grouped_attention(n_kv=H), C), "swiglu-mlp": (swiglu_mlp, C), "llama-block": (llama_block, C),
}


@pytest.mark.parametrize("name", LAYERS)
def test_backward_matches_finite_differences(name):
    make, width = LAYERS[name]
    check_layer(make(), RNG.standard_normal((B, T, width)))


@pytest.mark.parametrize("name", ["linear", "attention", "block", "mlp", "gqa", "llama-block", "swiglu-mlp"])
def test_input_and_weight_gradients_can_be_computed_separately(name):
    check_split_backward(LAYERS[name][0](), RNG.standard_normal((B, T, C)))


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


def test_rms_norm_is_x_over_its_root_mean_square_times_the_weight():
    layer, x = rms_norm(), RNG.standard_normal((B, T, C))
    expected = x / np.sqrt((x ** 2).mean(axis=-1, keepdims=True) + 1e-5) * layer.weight.data
    np.testing.assert_allclose(layer.forward(x)[0], expected, rtol=1e-14)


def test_swiglu_is_silu_of_the_gate_times_up():
    x = RNG.standard_normal((B, T, 2 * C))
    gate, up = x[..., :C], x[..., C:]
    np.testing.assert_allclose(SwiGLU().forward(x)[0], gate / (1 + np.exp(-gate)) * up, rtol=1e-14)


def test_rope_is_a_complex_rotation_of_channel_pairs_i_and_i_plus_half():
    rope, positions = RotaryEmbedding(D, theta=50.0), np.array([0, 3, 9, 4])
    x = RNG.standard_normal((B, H, len(positions), D))
    rotated = x.copy()
    rope.rotate(rotated, positions)
    pairs = x[..., :D // 2] + 1j * x[..., D // 2:]
    turned = pairs * np.exp(1j * np.outer(positions, 50.0 ** (-np.arange(0, D, 2) / D)))
    np.testing.assert_allclose(rotated, np.concatenate([turned.real, turned.imag], axis=-1), rtol=1e-13, atol=1e-14)
    rope.rotate_back(rotated, positions)
    np.testing.assert_allclose(rotated, x, rtol=1e-13, atol=1e-14)


def test_rope_scores_depend_only_on_the_distance_between_positions():
    rope = RotaryEmbedding(D)
    q, k = RNG.standard_normal((1, 1, 1, D)), RNG.standard_normal((1, 1, 1, D))

    def score(m: int, n: int) -> float:
        a, b = q.copy(), k.copy()
        rope.rotate(a, np.array([m]))
        rope.rotate(b, np.array([n]))
        return float((a * b).sum())

    assert score(7, 3) == pytest.approx(score(104, 100), rel=1e-12)
    assert score(7, 3) != pytest.approx(score(7, 4), rel=1e-6)


def test_grouped_query_attention_equals_multi_head_with_each_kv_head_repeated_for_its_group():
    grouped = grouped_attention(n_kv=KV)
    q, k, v = (weight.data for weight in grouped.qkv.weights)
    group = H // KV
    repeat = [np.repeat(w.reshape(C, KV, D), group, axis=1).reshape(C, H * D) for w in (k, v)]  # head h: KV h // g
    multi_head = CausalSelfAttention(ConcatenatedLinear([Parameter("q", q), Parameter("k", repeat[0]),
                                                         Parameter("v", repeat[1])]),
                                     grouped.projection, H, n_kv_head=H, rope=grouped.rope)
    x = RNG.standard_normal((B, T, C))
    np.testing.assert_allclose(grouped.forward(x)[0], multi_head.forward(x)[0], rtol=1e-13, atol=1e-14)


def test_incremental_grouped_attention_with_rope_equals_the_full_forward():
    layer, x = grouped_attention(query_block=2), RNG.standard_normal((B, 7, C))
    expected = layer.forward(x)[0]
    cache = KVCache()
    first = layer.forward_incremental(x[:, :4], cache)
    rest = [layer.forward_incremental(x[:, t:t + 1], cache) for t in range(4, 7)]  # one position at a time
    assert cache.keys.shape == (B, KV, 7, D)  # only the KV heads are cached
    np.testing.assert_allclose(np.concatenate([first, *rest], axis=1), expected, rtol=1e-12, atol=1e-14)


FAMILIES = {
    "gpt2": GPTConfig(vocab_size=13, n_positions=8, n_embd=8, n_layer=2, n_head=2),
    "llama-gqa-untied": GPTConfig(arch="llama", vocab_size=13, n_positions=8, n_embd=16, n_layer=2, n_head=4,
                                  n_kv_head=2, ffn_hidden=24),
    "llama-tied": GPTConfig(arch="llama", vocab_size=13, n_positions=8, n_embd=16, n_layer=1, n_head=4,
                            tie_embeddings=True),
    "mixtral": GPTConfig(arch="llama", vocab_size=13, n_positions=8, n_embd=16, n_layer=1, n_head=4, n_kv_head=1,
                         ffn_hidden=8, n_experts=3, moe_top_k=2),
}


@pytest.mark.parametrize("family", FAMILIES)
def test_whole_model_gradients_match_finite_differences(family):
    check_model_gradients(Transformer(FAMILIES[family], seed=3, dtype=np.float64))


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_generation_equals_the_argmax_of_recomputing_the_sequence(family):
    model = Transformer(FAMILIES[family], seed=1, dtype=np.float64)
    prompt = [3, 1, 4]
    generated = model.generate(np.array(prompt), new_tokens=4, temperature=0)
    context = list(prompt)
    for token in generated:
        assert token == int(np.argmax(model.logits(np.array([context]))[0, -1]))
        context.append(token)


def test_a_llama_has_no_biases_no_position_table_and_an_untied_head_by_default():
    model = Transformer(FAMILIES["llama-gqa-untied"])
    names = set(model.params)
    assert not any(name.endswith(".bias") for name in names) and "transformer.wpe.weight" not in names
    assert "lm_head.weight" in names and model.params["transformer.h.0.attn.k_proj.weight"].data.shape == (16, 8)
    assert FAMILIES["llama-gqa-untied"].parameter_count() == sum(p.data.size for p in model.parameters())
    assert "lm_head.weight" not in Transformer(FAMILIES["llama-tied"]).params


def test_default_llama_ffn_is_8_thirds_rounded_up_to_64():
    assert GPTConfig(arch="llama", n_embd=576, n_head=9).ffn_width == 1536  # SmolLM-135M's
    assert GPTConfig(arch="llama", n_embd=128, n_head=4).ffn_width == 384


def test_parameters_of_layers_are_found():
    assert len(parameters_of(llama_block())) == 2 + 4 + 3
