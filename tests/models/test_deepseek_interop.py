"""The DeepSeek-V3 family against transformers' DeepseekV3ForCausalLM, in float64.

Our model is saved with `--save`'s writer, loaded by transformers (`experts_implementation="eager"`), and both train
a few steps of AdamW on the same batches: every step's loss and every weight afterwards agree to ≤ 1e-9. Every
tensor starts random (norm weights and the router's selection bias too), so a mis-mapped or mis-transposed tensor
shows. The cases cover a low-rank query and a single query projection, group-limited routing, shared experts,
dense first blocks, interleaved and rotate-half RoPE, and YaRN. transformers computes the router, RMSNorm and the
rotary angles in float32 on purpose (and keeps the router in float32); `widen_upcasts` makes them float64, with
YaRN's frequencies written out here from the paper's formula, so the reference is float64-accurate (DESIGN.md).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import safetensors.numpy
from commands import mpiparallel
from interop import float64_rms_norm, hugging_face, train_side_by_side

from models.transformer import GPTConfig, Transformer
from mpiparallel import optim
from mpiparallel.checkpoints.hugging_face import load_pretrained, save_pretrained

YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "beta_fast": 4.0,
        "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 0.8}
SHAPE = dict(vocab_size=61, n_positions=32, n_embd=24, n_head=3, kv_lora_rank=10, qk_nope_head_dim=6,
             qk_rope_head_dim=4, v_head_dim=5, ffn_hidden=28, moe_aux_coef=0.0)
CASES = {
    "low-rank-query-groups-shared-dense-first": GPTConfig(
        arch="deepseek_v3", n_layer=3, q_lora_rank=12, n_experts=8, moe_top_k=3, moe_ffn_hidden=7,
        n_shared_experts=1, n_group=4, topk_group=2, routed_scaling_factor=2.5, first_k_dense_replace=1, **SHAPE),
    "one-query-projection-rotate-half-raw-gates": GPTConfig(
        arch="deepseek_v3", n_layer=2, q_lora_rank=None, rope_interleave=False, n_experts=4, moe_top_k=2,
        moe_ffn_hidden=6, n_shared_experts=2, moe_renormalize=False, routed_scaling_factor=1.5, rope_theta=500.0,
        **SHAPE),
    "yarn-tied-dense": GPTConfig(arch="deepseek_v3", n_layer=2, q_lora_rank=8, rope_scaling=YARN, rope_theta=100.0,
                                 tie_embeddings=True, **(SHAPE | {"qk_rope_head_dim": 8, "n_positions": 256})),
}


def randomized(model: Transformer, seed: int = 1) -> Transformer:
    """Every tensor random, norm weights around 1, the selection biases of the order of the scores' spread."""
    rng = np.random.default_rng(seed)
    for name, param in model.params.items():
        noise = rng.standard_normal(param.data.shape) * 0.1
        param.data[...] = 1.0 + noise if name.endswith(("norm.weight", "ln_1.weight", "ln_2.weight")) else noise
    for bias in model.expert_biases.values():
        bias[...] = rng.standard_normal(bias.shape) * 0.02
    return model


def reference_inverse_frequencies(torch, config: GPTConfig):
    """θ^(−2i/d) in float64, d = qk_rope_head_dim, with YaRN (Peng et al., 2023) written out from the paper: the
    pairs that turn fewer than beta_slow times over the original context interpolated (÷ factor), those turning
    more than beta_fast times kept, a linear ramp between (its ends floored and ceiled, as DeepSeek does)."""
    d, theta = config.qk_rope_head_dim, config.rope_theta
    inv_freq = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    if not config.rope_scaling:
        return inv_freq
    s = config.rope_scaling
    original = s["original_max_position_embeddings"]

    def dimension_of(turns):
        return d * math.log(original / (turns * 2 * math.pi)) / (2 * math.log(theta))

    low = max(math.floor(dimension_of(s["beta_fast"])), 0)
    high = min(math.ceil(dimension_of(s["beta_slow"])), d - 1)
    ramp = ((torch.arange(d // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
    return inv_freq / s["factor"] * ramp + inv_freq * (1 - ramp)


def widen_upcasts(torch, hf_model, config: GPTConfig) -> None:
    """transformers' float32 islands made float64: RMSNorm, the rotary angles, the router."""
    inv_freq = reference_inverse_frequencies(torch, config)
    for module in hf_model.modules():
        kind = type(module).__name__
        if kind.endswith("RMSNorm"):
            module.forward = float64_rms_norm(torch, module)
        elif kind.endswith("RotaryEmbedding"):
            module.forward = _rotary_forward(torch, inv_freq, module.attention_scaling)
        elif kind.endswith("TopkRouter"):
            module.forward = _router_forward(torch, module)


def _rotary_forward(torch, inv_freq, attention_scaling):
    def forward(x, position_ids):
        freqs = position_ids[..., None].to(torch.float64) * inv_freq
        angles = torch.cat((freqs, freqs), dim=-1)
        return (angles.cos() * attention_scaling).to(x.dtype), (angles.sin() * attention_scaling).to(x.dtype)
    return forward


def _router_forward(torch, module):
    """transformers' DeepseekV3TopkRouter.forward, in the hidden states' dtype instead of float32."""
    def forward(hidden):
        hidden = hidden.reshape(-1, module.hidden_dim)
        logits = torch.nn.functional.linear(hidden, module.weight)
        scores = logits.sigmoid()
        biased = scores + module.e_score_correction_bias
        per_group = module.num_experts // module.num_group
        group_scores = biased.view(-1, module.num_group, per_group).topk(2, dim=-1)[0].sum(dim=-1)
        groups = torch.topk(group_scores, k=module.topk_group, dim=-1)[1]
        mask = torch.zeros_like(group_scores).scatter_(1, groups, 1)
        mask = mask.unsqueeze(-1).expand(-1, module.num_group, per_group).reshape(-1, module.num_experts)
        chosen = torch.topk(biased.masked_fill(~mask.bool(), float("-inf")), k=module.top_k, dim=-1)[1]
        gates = scores.gather(1, chosen)
        if module.norm_topk_prob:
            gates = gates / (gates.sum(dim=-1, keepdim=True) + 1e-20)
        return logits, gates * module.routed_scaling_factor, chosen
    return forward


def load_into_transformers(torch, transformers, directory, config: GPTConfig):
    hf_model = transformers.DeepseekV3ForCausalLM.from_pretrained(str(directory), dtype=torch.float64,
                                                                   attn_implementation="sdpa",
                                                                   experts_implementation="eager")
    hf_model = hf_model.to(torch.float64).train()
    # transformers keeps the router's weight and bias in float32 on load: put back the file's float64 values
    saved = safetensors.numpy.load_file(str(directory / "model.safetensors"))
    state = hf_model.state_dict()
    with torch.no_grad():
        for name in [name for name in saved if ".mlp.gate." in name and name in state]:  # not MTP layers
            state[name].copy_(torch.from_numpy(saved[name]))
    widen_upcasts(torch, hf_model, config)
    return hf_model


def test_yarn_reference_exercises_interpolation_extrapolation_and_the_ramp():
    torch, _ = hugging_face()
    config = CASES["yarn-tied-dense"]
    plain = reference_inverse_frequencies(torch, GPTConfig(**{**vars(config), "rope_scaling": None}))
    scaled = reference_inverse_frequencies(torch, config)
    kept, slowed = scaled == plain, torch.isclose(scaled, plain / YARN["factor"], rtol=1e-15, atol=0)
    assert kept.any() and slowed.any() and (~kept & ~slowed).any()


@pytest.mark.parametrize("case", list(CASES))
def test_training_equals_transformers_step_by_step(tmp_path, case):
    torch, transformers = hugging_face()
    config = CASES[case]
    model = randomized(Transformer(config, dtype=np.float64))
    save_pretrained(tmp_path, config, model.state_dict())
    hf_model = load_into_transformers(torch, transformers, tmp_path, config)
    if config.tied:
        assert hf_model.lm_head.weight is hf_model.model.embed_tokens.weight
    if config.n_experts:
        np.testing.assert_array_equal(hf_model.model.layers[-1].mlp.gate.e_score_correction_bias.numpy(),
                                      model.expert_biases[f"transformer.h.{config.n_layer - 1}.mlp.router.expert_bias"])

    train_side_by_side(torch, model, hf_model, config.vocab_size)

    resaved = tmp_path / "theirs"
    hf_model.save_pretrained(str(resaved))
    _, loaded, _ = load_pretrained(resaved)
    for name, param in model.params.items():
        np.testing.assert_allclose(loaded[name], param.data, rtol=1e-9, atol=1e-12, err_msg=name)


def test_our_loader_reads_what_transformers_writes_for_a_fresh_model_and_fused_experts(tmp_path):
    torch, transformers = hugging_face()
    hf_config = transformers.DeepseekV3Config(
        vocab_size=50, hidden_size=24, intermediate_size=20, moe_intermediate_size=6, num_hidden_layers=2,
        num_attention_heads=3, num_key_value_heads=3, n_shared_experts=1, n_routed_experts=4, num_experts_per_tok=2,
        n_group=2, topk_group=1, first_k_dense_replace=1, q_lora_rank=None, kv_lora_rank=8, qk_nope_head_dim=4,
        qk_rope_head_dim=4, v_head_dim=6, max_position_embeddings=16, routed_scaling_factor=2.0)
    hf_model = transformers.DeepseekV3ForCausalLM(hf_config).to(torch.float64)
    with torch.no_grad():
        for param in hf_model.parameters():
            param.normal_(0.0, 0.3)
        hf_model.model.layers[1].mlp.gate.e_score_correction_bias.normal_(0.0, 0.05)
    hf_model.save_pretrained(str(tmp_path))
    ours, tensors, _ = load_pretrained(tmp_path)
    assert (ours.arch, ours.q_lora_rank, ours.n_experts, ours.first_k_dense_replace) == ("deepseek_v3", None, 4, 1)
    model = Transformer(ours, dtype=np.float64)
    model.load_state_dict(tensors)
    tokens = np.random.default_rng(0).integers(0, 50, size=(1, 12))
    with torch.no_grad():
        expected = load_into_transformers(torch, transformers, tmp_path, ours)(torch.from_numpy(tokens)).logits.numpy()
    np.testing.assert_allclose(model.logits(tokens), expected, rtol=1e-9, atol=1e-12)

    written = safetensors.numpy.load_file(str(tmp_path / "model.safetensors"))
    experts = "model.layers.1.mlp.experts"
    fused = {key: value for key, value in written.items() if not key.startswith(experts)}
    fused[f"{experts}.gate_up_proj"] = np.stack([np.concatenate((written[f"{experts}.{e}.gate_proj.weight"],
                                                                 written[f"{experts}.{e}.up_proj.weight"]))
                                                 for e in range(4)])
    fused[f"{experts}.down_proj"] = np.stack([written[f"{experts}.{e}.down_proj.weight"] for e in range(4)])
    safetensors.numpy.save_file(fused, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    _, from_fused, _ = load_pretrained(tmp_path)
    for name, value in tensors.items():
        np.testing.assert_array_equal(from_fused[name], value, err_msg=name)


def test_a_model_trained_from_scratch_by_the_command_line_loads_in_transformers_and_continues(tmp_path):
    torch, transformers = hugging_face()
    shape = ["--arch", "deepseek_v3", "--n-layer", "2", "--n-embd", "24", "--n-head", "2", "--seq-len", "16",
             "--batch-size", "2", "--experts", "8", "--top-k", "2", "--n-group", "2", "--topk-group", "1",
             "--first-k-dense", "1", "--q-lora-rank", "8", "--moe-bias-rate", "0.01", "--dtype", "float64"]
    result = mpiparallel("train", *shape, "--steps", "3", "--save", str(tmp_path / "out"))
    assert result.returncode == 0, result.stderr
    config, tensors, _ = load_pretrained(tmp_path / "out")
    assert (config.arch, config.q_lora_rank, config.n_group, config.first_k_dense_replace) == ("deepseek_v3", 8, 2, 1)
    biases = [value for name, value in tensors.items() if name.endswith("expert_bias")]
    assert len(biases) == 1 and np.abs(biases[0]).max() > 0  # the balancing moved the selection bias, and it was saved
    model = Transformer(config, dtype=np.float64)
    model.load_state_dict(tensors)
    tokens = np.random.default_rng(0).integers(0, config.vocab_size, size=(1, 12))
    with torch.no_grad():
        expected = load_into_transformers(torch, transformers, tmp_path / "out", config)(
            torch.from_numpy(tokens)).logits.numpy()
    np.testing.assert_allclose(model.logits(tokens), expected, rtol=1e-9, atol=1e-12)
    result = mpiparallel("train", "--init", str(tmp_path / "out"), "--seq-len", "16", "--batch-size", "2", "--steps",
                         "1", "--dtype", "float64")
    assert result.returncode == 0, result.stderr
    assert "DeepSeek-V3 2 layers" in result.stdout


def test_a_deepseek_option_for_another_family_is_one_clear_error():
    result = mpiparallel("train", "--arch", "llama", "--kv-lora-rank", "8", "--steps", "1")
    assert result.returncode != 0 and "--kv-lora-rank set(s) a deepseek_v3 choice" in result.stderr
    assert "Traceback" not in result.stderr


def test_multi_token_prediction_trains_as_transformers_mtp_layer_on_its_main_model(tmp_path):
    """One MTP module (DeepSeek-V3's depth) against an independent reference: transformers' main model with its
    own `MtpLayer` (the speculative-decoding layer that reads DeepSeek's checkpoint layout) holding our MTP weights,
    the loss cross-entropy + λ · cross-entropy of the token two ahead, written out here; both train with AdamW."""
    torch, transformers = hugging_face()
    from transformers.modeling_layers import MtpLayer
    from transformers.models.deepseek_v3 import modeling_deepseek_v3 as deepseek

    config = GPTConfig(**{**vars(CASES["low-rank-query-groups-shared-dense-first"]), "mtp_depth": 1,
                          "mtp_weight": 0.4})
    model = randomized(Transformer(config, dtype=np.float64))
    save_pretrained(tmp_path, config, model.state_dict())
    hf_model = load_into_transformers(torch, transformers, tmp_path, config)
    mtp = MtpLayer(hf_model.config, deepseek.DeepseekV3DecoderLayer, deepseek.DeepseekV3RMSNorm, config.n_layer,
                   use_post_norm=True).to(torch.float64).train()
    written = safetensors.numpy.load_file(str(tmp_path / "model.safetensors"))
    layer = f"model.layers.{config.n_layer}."
    theirs = {name.removeprefix(layer).replace("shared_head.norm", "post_norm"): value
              for name, value in written.items() if name.startswith(layer)}
    theirs = {("mtp_block." + name if name.split(".")[0] not in ("enorm", "hnorm", "eh_proj", "post_norm") else name):
              value for name, value in theirs.items() if not name.startswith(("embed_tokens", "shared_head.head"))}
    experts = "mtp_block.mlp.experts"  # transformers' modules hold the routed experts fused
    per_expert = [name for name in theirs if name.startswith(experts + ".")]
    theirs[experts + ".gate_up_proj"] = np.stack([np.concatenate((theirs[f"{experts}.{e}.gate_proj.weight"],
                                                                 theirs[f"{experts}.{e}.up_proj.weight"]))
                                                 for e in range(config.n_experts)])
    theirs[experts + ".down_proj"] = np.stack([theirs[f"{experts}.{e}.down_proj.weight"]
                                              for e in range(config.n_experts)])
    for name in per_expert:
        del theirs[name]
    missing, unexpected = mtp.load_state_dict({name: torch.from_numpy(value) for name, value in theirs.items()},
                                              strict=False)
    assert not unexpected and set(missing) == {"mtp_block.mlp.gate.e_score_correction_bias"}  # zero: no bias
    widen_upcasts(torch, mtp, config)
    last_hidden = {}
    hf_model.model.layers[-1].register_forward_hook(lambda module, args, output: last_hidden.update(h=output))

    lr, steps, weight = 3e-3, 3, config.mtp_weight
    ours = optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    theirs_optimizer = torch.optim.AdamW(list(hf_model.parameters()) + list(mtp.parameters()), lr=lr,
                                         betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0)
    rng = np.random.default_rng(5)
    for _ in range(steps):
        window = rng.integers(0, config.vocab_size, size=(2, 17))
        inputs, targets = window[:, :-1], window[:, 1:]
        model.zero_grad()
        loss, saved = model.forward(inputs, targets)
        model.backward(saved)
        ours.step()
        theirs_optimizer.zero_grad()
        logits = hf_model(torch.from_numpy(inputs)).logits
        labels = torch.from_numpy(targets)
        main_loss = torch.nn.functional.cross_entropy(logits.reshape(-1, config.vocab_size), labels.reshape(-1))
        n = inputs.shape[1] - 1
        positions = torch.arange(n)[None]
        hidden = mtp(hf_model.model.embed_tokens(labels[:, :n]), last_hidden["h"][:, :n],
                     hf_model.model.rotary_emb(last_hidden["h"], positions), None, positions, None)
        mtp_logits = hf_model.lm_head(hidden)
        mtp_loss = torch.nn.functional.cross_entropy(mtp_logits.reshape(-1, config.vocab_size),
                                                     labels[:, 1:].reshape(-1))
        (main_loss + weight * mtp_loss).backward()
        theirs_optimizer.step()
        assert loss == pytest.approx((main_loss + weight * mtp_loss).item(), rel=1e-9, abs=0)

    np.testing.assert_allclose(model.params["transformer.mtp.0.eh_proj.weight"].data,
                               mtp.eh_proj.weight.detach().numpy().T, rtol=1e-9, atol=1e-12)
    np.testing.assert_allclose(model.params["transformer.mtp.0.attn.kv_b_proj.weight"].data,
                               mtp.mtp_block.self_attn.kv_b_proj.weight.detach().numpy().T, rtol=1e-9, atol=1e-12)
    np.testing.assert_allclose(model.params["transformer.wte.weight"].data,
                               hf_model.model.embed_tokens.weight.detach().numpy(), rtol=1e-9, atol=1e-12)
