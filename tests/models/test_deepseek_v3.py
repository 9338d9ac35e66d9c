"""The DeepSeek-V3 family as a model: its parameters, the whole model's gradients against finite differences
(float64), recomputation, generation from the compressed cache, and the config checks."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
from commands import mpiparallel
from gradient_checks import check_model_gradients
from mpi_harness import train_error

from models.transformer import GPTConfig, Transformer, expert_bias_shapes, parameter_shapes

SHAPE = dict(arch="deepseek_v3", vocab_size=13, n_positions=16, n_embd=12, n_head=2, kv_lora_rank=6,
             qk_nope_head_dim=4, qk_rope_head_dim=4, v_head_dim=3, ffn_hidden=10, moe_aux_coef=0.0)
MOE = dict(n_experts=4, moe_top_k=2, moe_ffn_hidden=5, n_shared_experts=1, n_group=2, topk_group=1,
           routed_scaling_factor=2.0, first_k_dense_replace=1)


def config(**changes) -> GPTConfig:
    return GPTConfig(**(SHAPE | dict(n_layer=2, q_lora_rank=8) | MOE | changes))


def test_parameters_follow_transformers_modules_with_dense_first_blocks_and_no_switch_loss():
    shapes = parameter_shapes(config(n_layer=3))
    assert shapes["transformer.h.0.attn.q_b_proj.weight"] == (8, 2 * (4 + 4))
    assert shapes["transformer.h.0.attn.kv_a_proj_with_mqa.weight"] == (12, 6 + 4)
    assert shapes["transformer.h.0.attn.kv_b_proj.weight"] == (6, 2 * (4 + 3))
    assert shapes["transformer.h.0.attn.o_proj.weight"] == (2 * 3, 12)
    assert shapes["transformer.h.0.mlp.down_proj.weight"] == (10, 12)  # dense: intermediate_size
    assert shapes["transformer.h.1.mlp.shared_experts.down_proj.weight"] == (5, 12)
    assert shapes["transformer.h.2.mlp.experts.3.gate_proj.weight"] == (12, 5)
    assert "transformer.h.0.attn.q_proj.weight" not in shapes and "lm_head.weight" in shapes
    assert list(expert_bias_shapes(config(n_layer=3))) == [f"transformer.h.{i}.mlp.router.expert_bias" for i in (1, 2)]
    assert "transformer.h.0.attn.q_proj.weight" in parameter_shapes(config(q_lora_rank=None))


@pytest.mark.parametrize("changes", [dict(), dict(q_lora_rank=None, rope_interleave=False, moe_renormalize=False),
                                     dict(moe_seq_aux_coef=0.2), dict(mtp_depth=2, mtp_weight=0.5)],
                         ids=["low-rank-query", "one-query-projection", "sequence-balance-loss", "mtp"])
def test_whole_model_gradients_match_finite_differences(changes):
    check_model_gradients(Transformer(config(**changes), seed=3, dtype=np.float64))


@pytest.mark.parametrize("recompute", ["selective", "full"])
def test_recomputation_computes_the_same_loss_and_gradients(recompute):
    tokens, targets = np.random.default_rng(0).integers(0, 13, (2, 2, 8))
    results = []
    for mode in ("none", recompute):
        model = Transformer(config(moe_seq_aux_coef=0.1), seed=5, dtype=np.float64, recompute=mode, query_block=3)
        loss, saved = model.forward(tokens, targets)
        model.backward(saved)
        results.append((loss, [p.grad.copy() for p in model.parameters()]))
    assert results[1][0] == pytest.approx(results[0][0], rel=1e-13)
    for mine, theirs in zip(results[1][1], results[0][1], strict=True):
        np.testing.assert_allclose(mine, theirs, rtol=1e-11, atol=1e-14)


def test_generation_from_the_compressed_cache_equals_recomputing_the_sequence():
    model = Transformer(config(), seed=4, dtype=np.float64)
    for p in model.parameters():
        p.data += 0.2 * np.random.default_rng(1).standard_normal(p.data.shape)
    prompt = np.array([3, 1, 4])
    generated = model.generate(prompt, 5, temperature=0)
    sequence = list(prompt)
    for _ in range(5):
        sequence.append(int(np.argmax(model.logits(np.array([sequence]))[0, -1])))
    assert generated.tolist() == sequence[3:]


@pytest.mark.parametrize("changes,match", [
    (dict(kv_lora_rank=0), "kv_lora_rank"), (dict(qk_rope_head_dim=3), "even"), (dict(moe_aux_coef=0.01), "Switch"),
    (dict(first_k_dense_replace=5), "first_k_dense_replace"), (dict(n_group=3), "n_group"),
    (dict(q_lora_rank=0), "q_lora_rank")])
def test_impossible_deepseek_settings_are_one_clear_error(changes, match):
    with pytest.raises(ValueError, match=match):
        config(**changes)


DEEPSEEK_V3_CONFIG = {  # the published config.json of deepseek-ai/DeepSeek-V3 (the keys this model reads)
    "model_type": "deepseek_v3", "vocab_size": 129280, "hidden_size": 7168, "intermediate_size": 18432,
    "moe_intermediate_size": 2048, "num_hidden_layers": 61, "num_attention_heads": 128, "num_key_value_heads": 128,
    "n_shared_experts": 1, "n_routed_experts": 256, "routed_scaling_factor": 2.5, "kv_lora_rank": 512,
    "q_lora_rank": 1536, "qk_rope_head_dim": 64, "v_head_dim": 128, "qk_nope_head_dim": 128, "n_group": 8,
    "topk_group": 4, "num_experts_per_tok": 8, "first_k_dense_replace": 3, "norm_topk_prob": True,
    "max_position_embeddings": 163840, "rms_norm_eps": 1e-6, "rope_theta": 10000, "tie_word_embeddings": False,
    "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
                     "original_max_position_embeddings": 4096, "type": "yarn"},
    "scoring_func": "sigmoid", "topk_method": "noaux_tc", "num_nextn_predict_layers": 1}


def test_deepseek_v3s_published_config_has_671b_parameters_37b_activated_and_a_14b_mtp_module():
    from models.deepseek_v3 import parameter_counts
    from models.families import config_fields

    counts = parameter_counts(GPTConfig(**config_fields(DEEPSEEK_V3_CONFIG)))
    assert round(counts["total"] / 1e9) == 671  # the report: 671B total parameters
    assert int(counts["activated"] / 1e9) == 37  # 37B activated for each token (37.6 B counted)
    assert round(counts["mtp"] / 1e9, 1) == 13.5  # the 14B MTP module; 684.5 B on Hugging Face ("685B")
    assert round((counts["total"] + counts["mtp"]) / 1e9, 1) == 684.5  # the checkpoint's 684.5 B, called 685B


def test_multi_token_prediction_equals_its_modules_run_on_the_first_t_minus_k_positions():
    """The modules run over all T positions with the last k masked (what lets SP and CP cut them as the main
    model): the loss equals the modules run on T − k positions, written out here (the gradients follow: they
    match finite differences of that loss, above)."""
    model = Transformer(config(mtp_depth=2, mtp_weight=0.5), seed=3, dtype=np.float64)
    tokens, targets = np.random.default_rng(4).integers(0, 13, (2, 3, 8))
    loss = model.forward(tokens, targets)[0]
    hidden = model.forward(tokens, units=range(model.unit_count - 1))[0]
    mtp, (rows, length) = model.head, targets.shape
    expected = mtp.head.forward(hidden, targets, targets.size)[0]
    for k, module in enumerate(mtp.modules, start=1):
        n = length - k
        embedded = module.enorm.forward(mtp.embedding.forward(targets[:, k - 1:k - 1 + n])[0])[0]
        z = module.projection.forward(np.concatenate((embedded, module.hnorm.forward(hidden[:, :n])[0]), axis=-1))[0]
        hidden = module.block.forward(z)[0]
        module_loss = module.cross_entropy.forward(module.norm.forward(hidden)[0], targets[:, k:], rows * n)[0]
        expected += 0.5 / 2 * module_loss
    assert loss == pytest.approx(expected, rel=1e-12)


def test_a_multi_token_prediction_deeper_than_the_sequence_is_one_clear_error():
    message = train_error("--arch", "deepseek_v3", "--mtp-depth", "4", "--n-layer", "1", "--n-embd", "16",
                          "--seq-len", "4", "--batch-size", "2", "--steps", "1")
    assert "--mtp-depth 4: module k predicts the token k + 1 ahead, so --seq-len (4) must exceed" in message


def test_resuming_on_another_mesh_continues_exactly(tmp_path):
    """Saved under tensor parallelism (experts, MTP and the moving selection bias included), resumed with expert
    parallelism and ZeRO-3: the resumed steps' losses equal the uninterrupted run's."""
    shape = ["--arch", "deepseek_v3", "--n-layer", "2", "--n-embd", "32", "--n-head", "2", "--seq-len", "16",
             "--batch-size", "4", "--experts", "4", "--top-k", "2", "--first-k-dense", "1", "--mtp-depth", "1",
             "--moe-bias-rate", "0.01", "--dtype", "float64", "--steps", "4", "--checkpoint-dir",
             str(tmp_path / "ck"), "--checkpoint-every", "2"]
    whole = mpiparallel("train", "-n", "2", *shape, "--tp", "2", "--log-json", str(tmp_path / "a.jsonl"))
    assert whole.returncode == 0, whole.stderr
    shutil.rmtree(tmp_path / "ck" / "step-00000004")  # resume from step 2
    resumed = mpiparallel("train", "-n", "2", *shape, "--dp", "2", "--ep", "2", "--zero", "3", "--resume",
                          "--log-json", str(tmp_path / "b.jsonl"))
    assert resumed.returncode == 0, resumed.stderr

    def losses(name):
        return {r["step"]: r["loss"] for r in map(json.loads, (tmp_path / name).read_text().splitlines())}

    after = losses("b.jsonl")
    assert sorted(after) == [3, 4]
    for step, loss in after.items():
        assert loss == pytest.approx(losses("a.jsonl")[step], rel=1e-9, abs=0)
