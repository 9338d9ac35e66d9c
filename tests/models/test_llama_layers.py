"""The llama family's layers: each backward against finite differences (float64), RoPE against the complex-number
formula, grouped-query attention against multi-head attention with repeated KV heads, and the KV cache."""

from __future__ import annotations

import numpy as np
import pytest
from gradient_checks import check_layer, check_model_gradients, param, parameters_of

from models.layers import (
    MLP,
    Block,
    CausalSelfAttention,
    ConcatenatedLinear,
    KVCache,
    Linear,
    RMSNorm,
    SwiGLU,
)
from models.parameter import Parameter
from models.rotary import RotaryEmbedding
from models.transformer import GPTConfig, Transformer

RNG = np.random.default_rng(77)
B, T, C, H, KV = 2, 7, 16, 4, 2
D = C // H


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


@pytest.mark.parametrize("make", [rms_norm, SwiGLU, lambda: ConcatenatedLinear([param("a", C, 5), param("b", C, 3)]),
                                  grouped_attention, lambda: grouped_attention(n_kv=1, keep=False),
                                  lambda: grouped_attention(n_kv=H), swiglu_mlp, llama_block],
                         ids=["rmsnorm", "swiglu", "concatenated", "gqa", "mqa-selective", "mha-rope", "mlp", "block"])
def test_backward_matches_finite_differences(make):
    width = 2 * C if make is SwiGLU else C
    check_layer(make(), RNG.standard_normal((B, T, width)))


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


LLAMAS = {
    "untied-gqa": GPTConfig(arch="llama", vocab_size=13, n_positions=8, n_embd=16, n_layer=2, n_head=4, n_kv_head=2,
                            ffn_hidden=24),
    "tied": GPTConfig(arch="llama", vocab_size=13, n_positions=8, n_embd=16, n_layer=1, n_head=4, tie_embeddings=True),
    "mixtral": GPTConfig(arch="llama", vocab_size=13, n_positions=8, n_embd=16, n_layer=1, n_head=4, n_kv_head=1,
                         ffn_hidden=8, n_experts=3, moe_top_k=2),
}


@pytest.mark.parametrize("case", list(LLAMAS))
def test_whole_llama_model_gradients_match_finite_differences(case):
    check_model_gradients(Transformer(LLAMAS[case], seed=3, dtype=np.float64))


def test_a_llama_has_no_biases_no_position_table_and_an_untied_head_by_default():
    model = Transformer(LLAMAS["untied-gqa"])
    names = set(model.params)
    assert not any(name.endswith(".bias") for name in names) and "transformer.wpe.weight" not in names
    assert "lm_head.weight" in names and model.params["transformer.h.0.attn.k_proj.weight"].data.shape == (16, 8)
    assert LLAMAS["untied-gqa"].parameter_count() == sum(p.data.size for p in model.parameters())
    assert "lm_head.weight" not in Transformer(LLAMAS["tied"]).params


def test_default_llama_ffn_is_8_thirds_rounded_up_to_64():
    assert GPTConfig(arch="llama", n_embd=576, n_head=9).ffn_width == 1536  # SmolLM-135M's
    assert GPTConfig(arch="llama", n_embd=128, n_head=4).ffn_width == 384


def test_generation_of_a_grouped_query_llama_equals_recomputing_the_sequence():
    model = Transformer(LLAMAS["untied-gqa"], seed=1, dtype=np.float64)
    prompt = [3, 1, 4]
    generated = model.generate(np.array(prompt), new_tokens=4, temperature=0)
    context = list(prompt)
    for token in generated:
        assert token == int(np.argmax(model.logits(np.array([context]))[0, -1]))
        context.append(token)


def test_parameters_of_layers_are_found():
    assert len(parameters_of(llama_block())) == 2 + 4 + 3
