"""The llama family against transformers' LlamaForCausalLM and MixtralForCausalLM, in float64.

Our model is saved with `--save`'s writer, loaded by transformers, and both train a few steps of AdamW on the same
batches: every step's loss and every weight afterwards agree to ≤ 1e-9. Every tensor starts random (norm weights
too), so a mis-mapped or mis-transposed tensor shows. Hugging Face upcasts RoPE, RMSNorm and the router softmax to
float32 on purpose; `widen_upcasts` makes those float64 so that the reference is float64-accurate (DESIGN.md).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from interop import float64_rms_norm, hugging_face, train_side_by_side

from models.transformer import GPTConfig, Transformer
from mpiparallel.checkpoints.hugging_face import load_pretrained, save_pretrained

LLAMA3_SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": 32}
CASES = {
    "gqa-untied": GPTConfig(arch="llama", vocab_size=61, n_positions=32, n_embd=48, n_layer=2, n_head=6, n_kv_head=2,
                            ffn_hidden=40, rope_theta=500.0),
    "mha-tied": GPTConfig(arch="llama", vocab_size=61, n_positions=32, n_embd=32, n_layer=2, n_head=4,
                          tie_embeddings=True, rms_norm_eps=1e-6),
    "llama3-rope": GPTConfig(arch="llama", vocab_size=61, n_positions=32, n_embd=32, n_layer=1, n_head=4, n_kv_head=1,
                             ffn_hidden=24, rope_theta=50.0, rope_scaling=LLAMA3_SCALING),
    "mixtral": GPTConfig(arch="llama", vocab_size=61, n_positions=32, n_embd=32, n_layer=2, n_head=4, n_kv_head=2,
                         ffn_hidden=24, n_experts=4, moe_top_k=2, moe_aux_coef=0.0),
}


def randomized(model: Transformer, seed: int = 1) -> Transformer:
    """Every tensor random, norm weights around 1, so that no mapping mistake hides behind ones or zeros."""
    rng = np.random.default_rng(seed)
    for name, param in model.params.items():
        noise = rng.standard_normal(param.data.shape) * 0.1
        param.data[...] = 1.0 + noise if name.endswith(("ln_1.weight", "ln_2.weight", "ln_f.weight")) else noise
    return model


def widen_upcasts(torch, transformers, hf_model, config: GPTConfig) -> None:
    """transformers' float32 islands made float64: RMSNorm's statistics, the rotary angles, the router softmax."""
    for module in hf_model.modules():
        kind = type(module).__name__
        if kind.endswith("RMSNorm"):
            module.forward = float64_rms_norm(torch, module)
        elif kind.endswith("RotaryEmbedding"):
            module.forward = _rotary_forward(torch, reference_inverse_frequencies(torch, config))
        elif kind.endswith("TopKRouter"):
            module.forward = _router_forward(torch, module)


def _rotary_forward(torch, inv_freq):
    def forward(x, position_ids):
        freqs = position_ids[..., None].to(torch.float64) * inv_freq
        angles = torch.cat((freqs, freqs), dim=-1)
        return angles.cos().to(x.dtype), angles.sin().to(x.dtype)
    return forward


def _router_forward(torch, module):
    def forward(hidden):
        hidden = hidden.reshape(-1, module.hidden_dim)
        logits = torch.nn.functional.linear(hidden, module.weight)
        probs = torch.softmax(logits, dim=-1)
        top, index = torch.topk(probs, module.top_k, dim=-1)
        return logits, top / top.sum(dim=-1, keepdim=True), index
    return forward


def reference_inverse_frequencies(torch, config: GPTConfig):
    """θ^(−2i/d) in float64, with Llama 3.1's scaling written out from Meta's description (not our code)."""
    d = config.head_dim
    inv_freq = 1.0 / config.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    if not config.rope_scaling:
        return inv_freq
    s = config.rope_scaling
    low_wavelength = s["original_max_position_embeddings"] / s["low_freq_factor"]
    high_wavelength = s["original_max_position_embeddings"] / s["high_freq_factor"]
    scaled = []
    for frequency in inv_freq.tolist():
        wavelength = 2 * math.pi / frequency
        if wavelength < high_wavelength:
            scaled.append(frequency)
        elif wavelength > low_wavelength:
            scaled.append(frequency / s["factor"])
        else:
            smooth = (s["original_max_position_embeddings"] / wavelength - s["low_freq_factor"]) / (
                s["high_freq_factor"] - s["low_freq_factor"])
            scaled.append((1 - smooth) * frequency / s["factor"] + smooth * frequency)
    return torch.tensor(scaled, dtype=torch.float64)


def test_llama3_scaling_changes_the_frequencies_it_should():
    torch, _ = hugging_face()
    config = CASES["llama3-rope"]
    plain = reference_inverse_frequencies(torch, GPTConfig(arch="llama", n_embd=32, n_head=4, rope_theta=50.0))
    scaled = reference_inverse_frequencies(torch, config)
    kept, slowed = scaled == plain, scaled == plain / LLAMA3_SCALING["factor"]
    assert kept.any() and slowed.any() and (~kept & ~slowed).any()  # the case exercises all three parts of the rule


@pytest.mark.parametrize("case", list(CASES))
def test_training_equals_transformers_step_by_step(tmp_path, case):
    torch, transformers = hugging_face()
    config = CASES[case]
    model = randomized(Transformer(config, dtype=np.float64))
    save_pretrained(tmp_path, config, model.state_dict())
    auto = transformers.MixtralForCausalLM if config.n_experts else transformers.LlamaForCausalLM
    hf_model = auto.from_pretrained(str(tmp_path), dtype=torch.float64, attn_implementation="sdpa",
                                     **({"experts_implementation": "eager"} if config.n_experts else {})).train()
    widen_upcasts(torch, transformers, hf_model, config)
    if config.tied:
        assert hf_model.lm_head.weight is hf_model.model.embed_tokens.weight

    train_side_by_side(torch, model, hf_model, config.vocab_size)

    trained = {name: value.detach().numpy() for name, value in hf_model.state_dict().items()}
    resaved = tmp_path / "theirs"
    hf_model.save_pretrained(str(resaved))
    _, loaded, _ = load_pretrained(resaved)
    for name, param in model.params.items():
        np.testing.assert_allclose(loaded[name], param.data, rtol=1e-9, atol=1e-12, err_msg=name)
    assert trained  # the comparison above read transformers' own saved files, in either expert layout


def test_our_loader_reads_what_transformers_writes_for_a_fresh_model(tmp_path):
    torch, transformers = hugging_face()
    config = transformers.LlamaConfig(vocab_size=50, hidden_size=32, intermediate_size=40, num_hidden_layers=1,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16,
                                      rope_theta=1000.0, tie_word_embeddings=False)
    hf_model = transformers.LlamaForCausalLM(config).to(torch.float64)
    hf_model.save_pretrained(str(tmp_path))
    ours, tensors, _ = load_pretrained(tmp_path)
    assert (ours.arch, ours.n_kv_head, ours.ffn_width, ours.rope_theta, ours.tied) == ("llama", 2, 40, 1000.0, False)
    model = Transformer(ours, dtype=np.float64)
    model.load_state_dict(tensors)
    tokens = np.random.default_rng(0).integers(0, 50, size=(1, 12))
    widen_upcasts(torch, transformers, hf_model, ours)
    with torch.no_grad():
        expected = hf_model(torch.from_numpy(tokens)).logits.numpy()
    np.testing.assert_allclose(model.logits(tokens), expected, rtol=1e-9, atol=1e-12)
