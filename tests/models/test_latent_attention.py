"""Multi-head latent attention (MLA): every backward against finite differences in float64, the forward against
a direct transcription of DeepSeek's formulas (keys expanded to every head), the split backward, selective
recomputation, and decoding from the compressed cache."""

from __future__ import annotations

import math

import numpy as np
import pytest
from gradient_checks import check_layer, check_split_backward, param, parameters_of

from models.latent_attention import LatentAttention, LowRankProjection
from models.layers import KVCache, Linear, RMSNorm
from models.parameter import Parameter
from models.rotary import RotaryEmbedding, attention_factor, inverse_frequencies, softmax_scale_correction

RNG = np.random.default_rng(35)
B, T, C, H = 2, 7, 12, 3
D_NOPE, D_ROPE, D_V, R_KV, R_Q = 4, 6, 5, 8, 10
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "beta_fast": 32, "beta_slow": 1,
        "mscale": 1.0, "mscale_all_dim": 0.7}


def norm(name: str, width: int) -> RMSNorm:
    return RMSNorm(Parameter(f"{name}.weight", 1 + 0.3 * RNG.standard_normal(width)), eps=1e-6)


def latent_attention(low_rank_query: bool = True, interleaved: bool = True, scaling: dict | None = None,
                     query_block: int = 3, keep: bool = True) -> LatentAttention:
    q_width = H * (D_NOPE + D_ROPE)
    if low_rank_query:
        query = LowRankProjection(Linear(param("q_a", C, R_Q)), norm("q_a_norm", R_Q),
                                  Linear(param("q_b", R_Q, q_width)))
    else:
        query = Linear(param("q", C, q_width))
    scale = softmax_scale_correction(scaling) / math.sqrt(D_NOPE + D_ROPE)
    return LatentAttention(query, Linear(param("kv_a", C, R_KV + D_ROPE)), norm("kv_a_norm", R_KV),
                           Linear(param("kv_b", R_KV, H * (D_NOPE + D_V))), Linear(param("o", H * D_V, C)), H,
                           D_NOPE, D_ROPE, D_V, RotaryEmbedding(D_ROPE, theta=50.0, scaling=scaling),
                           interleaved=interleaved, softmax_scale=scale, query_block=query_block,
                           keep_probabilities=keep)


CASES = {
    "low-rank-query": lambda: latent_attention(),
    "one-query-projection": lambda: latent_attention(low_rank_query=False),
    "rotate-half": lambda: latent_attention(interleaved=False),
    "yarn": lambda: latent_attention(scaling=YARN),
    "selective-recompute": lambda: latent_attention(keep=False, query_block=2),
}


@pytest.mark.parametrize("make", list(CASES.values()), ids=list(CASES))
def test_latent_attention_backward_matches_finite_differences(make):
    check_layer(make(), RNG.standard_normal((B, T, C)))


def test_low_rank_projection_backward_matches_finite_differences():
    check_layer(LowRankProjection(Linear(param("a", C, R_Q)), norm("n", R_Q), Linear(param("b", R_Q, 9))),
                RNG.standard_normal((B, T, C)))


def reference_forward(layer: LatentAttention, x: np.ndarray, yarn: dict | None = None) -> np.ndarray:
    """DeepSeek's MLA written out: interleaved RoPE as complex multiplication of channel pairs, keys with the shared
    RoPE key copied into every head, one softmax over the full causal score matrix."""
    def rms(v, weight):
        return v / np.sqrt((v * v).mean(-1, keepdims=True) + 1e-6) * weight

    query = layer.query
    if isinstance(query, LowRankProjection):
        q = rms(x @ query.down.weight.data, query.norm.weight.data) @ query.up.weight.data
    else:
        q = x @ query.weight.data
    q = q.reshape(B, T, H, D_NOPE + D_ROPE)
    compressed = x @ layer.kv_down.weight.data
    kv = (rms(compressed[..., :R_KV], layer.kv_norm.weight.data) @ layer.kv_up.weight.data).reshape(B, T, H, -1)
    inv_freq = inverse_frequencies(D_ROPE, 50.0, yarn)
    turn = np.exp(1j * np.outer(np.arange(T), inv_freq)) * attention_factor(yarn)  # (T, d_r/2)

    def rotate(pairs):  # (…, T, d_r) interleaved pairs (x_2i, x_2i+1) as complex numbers, turned
        z = (pairs[..., 0::2] + 1j * pairs[..., 1::2]) * turn
        return np.concatenate((z.real, z.imag), axis=-1)  # transformers' output order: [real parts | imaginary]

    keys = np.concatenate((kv[..., :D_NOPE], np.broadcast_to(rotate(compressed[..., R_KV:])[:, :, None],
                                                              (B, T, H, D_ROPE))), axis=-1)
    queries = np.concatenate((q[..., :D_NOPE], rotate(q[..., D_NOPE:].transpose(0, 2, 1, 3).reshape(B * H, T, -1)
                                                      ).reshape(B, H, T, -1).transpose(0, 2, 1, 3)), axis=-1)
    scores = np.einsum("bihd,bjhd->bhij", queries, keys) * layer.softmax_scale
    scores += np.triu(np.full((T, T), -np.inf), k=1)
    probs = np.exp(scores - scores.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    merged = np.einsum("bhij,bjhd->bihd", probs, kv[..., D_NOPE:]).reshape(B, T, H * D_V)
    return merged @ layer.projection.weight.data


@pytest.mark.parametrize("scaling", [None, YARN], ids=["plain", "yarn"])
@pytest.mark.parametrize("low_rank_query", [True, False], ids=["low-rank-query", "one-query-projection"])
def test_latent_attention_equals_deepseeks_formulas_with_keys_expanded_to_every_head(low_rank_query, scaling):
    layer, x = latent_attention(low_rank_query, scaling=scaling), RNG.standard_normal((B, T, C))
    np.testing.assert_allclose(layer.forward(x)[0], reference_forward(layer, x, scaling), rtol=1e-12, atol=1e-12)


def test_yarn_scales_the_softmax_and_turns_slow_pairs_slower():
    plain, stretched = inverse_frequencies(D_ROPE, 50.0), inverse_frequencies(D_ROPE, 50.0, YARN)
    assert stretched[0] == plain[0] and stretched[-1] == pytest.approx(plain[-1] / YARN["factor"])
    assert plain[1] / YARN["factor"] < stretched[1] < plain[1]  # the pair between is blended
    mscale = 0.1 * YARN["mscale_all_dim"] * math.log(YARN["factor"]) + 1
    assert softmax_scale_correction(YARN) == pytest.approx(mscale ** 2)
    assert attention_factor(YARN) == pytest.approx((0.1 * math.log(YARN["factor"]) + 1) / mscale)


@pytest.mark.parametrize("keep", [True, False], ids=["probabilities-kept", "selective-recompute"])
def test_input_and_weight_passes_apart_equal_the_joint_backward(keep):
    def kept_for_the_weight_pass(saved) -> None:
        assert set(vars(saved)) == {"query", "kv_down", "kv_norm", "kv_up", "projection", "positions",
                                     "query_positions", "spans", "documents"}

    check_split_backward(latent_attention(keep=keep), RNG.standard_normal((B, T, C)), kept_for_the_weight_pass)


def test_selective_recomputation_keeps_no_probabilities_and_computes_the_same():
    x = RNG.standard_normal((B, T, C))
    kept, recomputed = latent_attention(keep=True), latent_attention(keep=False)
    for mine, theirs in zip(parameters_of(recomputed), parameters_of(kept), strict=True):
        mine.data[...] = theirs.data
    out_kept, saved_kept = kept.forward(x)
    out_recomputed, saved_recomputed = recomputed.forward(x)
    assert saved_recomputed.probs is None and saved_recomputed.nbytes() < saved_kept.nbytes()
    np.testing.assert_array_equal(out_recomputed, out_kept)
    dout = RNG.standard_normal(out_kept.shape)
    np.testing.assert_allclose(recomputed.backward(saved_recomputed, dout.copy()),
                               kept.backward(saved_kept, dout.copy()), rtol=1e-12, atol=1e-14)


def test_decoding_from_the_compressed_cache_equals_the_full_forward():
    layer, x = latent_attention(scaling=YARN), RNG.standard_normal((B, T, C))
    full = layer.forward(x)[0]
    cache = KVCache()
    pieces = [layer.forward_incremental(x[:, :3], cache)]
    pieces += [layer.forward_incremental(x[:, t:t + 1], cache) for t in range(3, T)]
    np.testing.assert_allclose(np.concatenate(pieces, axis=1), full, rtol=1e-12, atol=1e-13)
    assert cache.keys.shape == (B, 1, T, R_KV) and cache.values.shape == (B, 1, T, D_ROPE)  # r + d_r per token
