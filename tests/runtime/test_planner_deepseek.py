"""`plan --arch deepseek_v3`: DeepSeek-V3's published config (671 B total, 37 B activated, the 14 B MTP module),
its FLOPs per token, KV cache, and the EP dispatch's bytes across nodes (flat against node-limited two-hop); each
against numbers written out here from the published config.json."""

import json

import pytest
from click.testing import CliRunner

from mpiparallel.commands.plan import plan as plan_command
from mpiparallel.planner import deepseek

H, LAYERS, HEADS, VOCAB = 7168, 61, 128, 129280  # hidden_size, num_hidden_layers, num_attention_heads, vocab_size
Q_RANK, KV_RANK, NOPE, ROPE, V = 1536, 512, 128, 64, 128  # q_lora_rank, kv_lora_rank, qk_nope/rope, v_head_dim
DENSE, EXPERT, EXPERTS, TOP_K, SHARED, FIRST_DENSE = 18432, 2048, 256, 8, 1, 3
ATTENTION = 2 * H + H * Q_RANK + Q_RANK + Q_RANK * HEADS * (NOPE + ROPE) + H * (KV_RANK + ROPE) + KV_RANK \
    + KV_RANK * HEADS * (NOPE + V) + HEADS * V * H
ROUTED = 3 * H * EXPERT  # one routed expert's gate, up and down
MOE = EXPERTS * ROUTED + SHARED * ROUTED + H * EXPERTS  # routed, shared, router
TOTAL = LAYERS * ATTENTION + FIRST_DENSE * 3 * H * DENSE + (LAYERS - FIRST_DENSE) * MOE + 2 * VOCAB * H + H
ACTIVATED = TOTAL - (LAYERS - FIRST_DENSE) * (EXPERTS - TOP_K) * ROUTED
MTP_OWN = 3 * H + 2 * H * H + ATTENTION + MOE  # enorm, hnorm, shared_head.norm, eh_proj, one MoE block


def plan_json(*arguments):
    result = CliRunner().invoke(plan_command, ["--arch", "deepseek_v3", *arguments, "--json"])
    assert result.exit_code == 0, result.output
    return json.loads(result.output)


def published_layout(*extra):
    return ("--gpu", "h800", "--software", "hai-llm", "--precision", "fp8", "--gpus", "2048", "--tp", "1", "--pp",
            "16", "--dp", "128", "--ep", "64", "--zero", "1", "--microbatches", "120", "--schedule", "dualpipev",
            "--recompute", "full", "--batch-size", "15360", "--gpu-memory", "400GB", *extra)


def test_the_published_config_has_671b_parameters_37b_activated_and_a_14b_mtp_module_beside_them():
    document = plan_json("--weights-only")
    assert (document["model"]["seq_len"], document["model"]["experts"], document["model"]["top_k"]) == (4096, 256, 8)
    counts = document["deepseek_v3"]
    assert counts["total_parameters"] == TOTAL and round(TOTAL / 1e9, 1) == 671.0  # the report's 671B
    assert counts["activated_parameters"] == ACTIVATED and int(ACTIVATED / 1e9) == 37  # "37B activated"
    assert counts["mtp_own_parameters"] == MTP_OWN
    assert counts["mtp_parameters"] == MTP_OWN + 2 * VOCAB * H and round(counts["mtp_parameters"] / 1e9) == 13


def test_the_plan_says_which_count_is_which_and_the_kv_cache_per_token():
    result = CliRunner().invoke(plan_command, ["--arch", "deepseek_v3", "--weights-only"])
    assert result.exit_code == 0, result.output
    assert "671.0 B total (every routed expert once" in result.output
    assert "37.6 B activated per token" in result.output and "MTP 13.5 B beside them" in result.output
    assert f"{LAYERS * (KV_RANK + ROPE) * 2:,} bytes over 61 blocks" in result.output


def test_mla_caches_576_values_per_token_and_block_against_40960_for_its_expanded_heads():
    kv = plan_json("--weights-only")["deepseek_v3"]["kv_cache"]
    assert kv["latent_values_per_block"] == KV_RANK + ROPE == 576
    assert kv["expanded_values_per_block"] == HEADS * (NOPE + ROPE + V) == 40960  # 2·H·d with d_qk ≠ d_v
    assert kv["latent_bytes"] == LAYERS * 576 * 2 and kv["expanded_bytes"] == LAYERS * 40960 * 2


def test_flops_per_token_count_mla_with_d_qk_192_and_d_v_128_and_the_mtp_module():
    per_token = plan_json("--weights-only")["deepseek_v3"]["flops_per_token"]
    weights = ACTIVATED - VOCAB * H + (MTP_OWN - (EXPERTS - TOP_K) * ROUTED) + VOCAB * H  # MTP: its head again
    attention = 6 * (LAYERS + 1) * 4096 * HEADS * (NOPE + ROPE + V)
    assert per_token == pytest.approx(6 * weights + attention, rel=1e-12)


def test_the_two_hop_dispatch_sends_m_over_k_of_the_flat_dispatchs_bytes_across_nodes():
    flat = plan_json(*published_layout("--ep-dispatch", "flat"))["layouts"][0]
    two_hop = plan_json(*published_layout("--ep-dispatch", "hierarchical"))["layouts"][0]
    # per MoE block and microbatch: dispatch (FP8 + a scale per 128) and combine (BF16), forward, backward and
    # the recomputed forward; each token's copies leaving its node: K·(N − 1)/N flat, M·(N − 1)/N two-hop
    tokens, nodes, m = 4096, 8, 120
    per_token = 3 * (H * (1 + 4 / 128) + H * 2)
    moe_blocks_on_rank_0 = 2  # dualpipev's rank 0: stages 0 (embedding, dense blocks 0–1) and 31 (block 60, head
    # with the MTP module's MoE block), train's even split of the 63 units
    assert flat["ep_inter_node_bytes"] == pytest.approx(
        m * moe_blocks_on_rank_0 * tokens * TOP_K * (nodes - 1) / nodes * per_token, rel=1e-9)
    assert two_hop["ep_inter_node_bytes"] == pytest.approx(flat["ep_inter_node_bytes"] * 4 / TOP_K, rel=1e-9)
    assert two_hop["comm_s"]["ep"] < flat["comm_s"]["ep"]


def test_init_reads_a_config_json_and_deepseek_choices_need_the_family(tmp_path):
    (tmp_path / "config.json").write_text(deepseek.PUBLISHED_CONFIG.read_text())
    result = CliRunner().invoke(plan_command, ["--init", str(tmp_path), "--weights-only", "--json"])
    assert json.loads(result.output)["deepseek_v3"]["total_parameters"] == TOTAL
    result = CliRunner().invoke(plan_command, ["--kv-lora-rank", "64", "--weights-only"])
    assert result.exit_code != 0 and "add --arch deepseek_v3" in str(result.exception)


def test_a_small_deepseek_shape_takes_trains_defaults_and_searches_both_dispatches():
    document = plan_json("--n-layer", "4", "--n-embd", "64", "--n-head", "4", "--experts", "8", "--top-k", "2",
                         "--n-group", "2", "--topk-group", "1", "--first-k-dense", "1", "--gpus", "16",
                         "--gpus-per-node", "4", "--tp", "1", "--pp", "1", "--ep", "8", "--batch-size", "16",
                         "--top", "0")
    dispatches = {layout["ep_dispatch"] for layout in document["layouts"]}
    assert document["model"]["deepseek"]["kv_lora_rank"] == 16 and dispatches == {"flat", "hierarchical"}


def test_each_deepseek_term_moves_the_published_row_the_way_its_physics_says():
    from mpiparallel.planner.published import TERMS, predict, predicted, published_runs

    run = next(run for run in published_runs() if run.source == "deepseek-v3")
    base = predicted(run, predict(run))
    assert predicted(run, predict(run, TERMS["no DualPipe overlap (EP and PP waited for)"][0])) < base
    assert predicted(run, predict(run, TERMS["no SMs held by communication"][0])) > base
    assert predicted(run, predict(run, TERMS["BF16 GEMMs and dispatch"][0])) < base


@pytest.mark.parametrize("q_lora_rank", [None, 12])
@pytest.mark.parametrize("recompute", ["none", "selective", "full"])
def test_one_ranks_memory_is_the_serial_models_parameters_and_about_its_saved_arrays(q_lora_rank, recompute):
    """Parameters exactly (dense first block, MoE blocks, the MTP module); the activations within 1 %: the
    planner's MLA and DeepSeekMoE formulas count the runtime's saved arrays by shape, with balanced routing."""
    import numpy as np

    from models.transformer import Transformer
    from mpiparallel.planner.core import PRECISIONS, Cluster, Layout, Model, evaluate

    shape = deepseek.DeepSeekShape(q_lora_rank=q_lora_rank, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4,
                                   v_head_dim=6, moe_ffn_hidden=24, n_shared_experts=1, first_k_dense_replace=1,
                                   n_group=2, topk_group=1, mtp_depth=1)
    model = Model(3, 32, 4, 16, 61, n_positions=16, experts=4, top_k=2, arch="deepseek_v3", deepseek=shape)
    serial = Transformer(model.config, dtype=np.float32, recompute=recompute)
    tokens = np.random.default_rng(0).integers(0, model.vocab_size, (3, model.seq_len))
    _, saved = serial.forward(tokens, tokens)
    plan = evaluate(model, Cluster(gpus=1, gpus_per_node=1), PRECISIONS["float32"], Layout(recompute=recompute),
                    batch_size=3)
    memory = plan.memory_per_rank[0]
    assert memory["parameters"] == sum(param.data.nbytes for param in serial.parameters())
    assert memory["activations"] == pytest.approx(saved.nbytes(), rel=0.01)


def test_zero_shards_a_routed_expert_over_the_dp_over_ep_ranks_that_hold_it():
    """DP 8 with EP 4: each routed expert lives on 2 ranks (train's expert_dp), so ZeRO-1 shards its AdamW state
    over 2, the attention's and the shared expert's over 8."""
    from mpiparallel.planner.core import PRECISIONS, Cluster, Layout, Model, evaluate

    shape = deepseek.DeepSeekShape(q_lora_rank=None, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4,
                                   v_head_dim=8, moe_ffn_hidden=24, n_shared_experts=1)
    model = Model(2, 32, 4, 16, 64, n_positions=16, experts=8, top_k=2, arch="deepseek_v3", deepseek=shape)
    plan = evaluate(model, Cluster(gpus=8, gpus_per_node=8), PRECISIONS["float32"], Layout(dp=8, ep=4, zero=1),
                    batch_size=8)
    experts = 2 * (8 // 4) * 3 * 32 * 24  # 2 blocks × 2 local experts × gate, up and down
    dense = model.total_parameters() - 2 * 8 * 3 * 32 * 24
    assert plan.memory_per_rank[0]["optimizer_state"] == pytest.approx(8 * (dense / 8 + experts / 2))
    assert plan.memory_per_rank[0]["parameters"] == 4 * (dense + experts)


def test_a_batch_too_small_for_the_gpus_is_named_when_no_layout_fits():
    """2,048 GPUs and the default batch of 8 sequences: dp ≤ 8, so each copy of the 671 B model spans 256 GPUs and
    none fits; the error says the batch caps dp (not "use more GPUs", which would only make it worse). The
    published batch of 15,360 does fit: docs/deepseek_v3.md's "Planning it", run by the docs test."""
    small = CliRunner().invoke(plan_command, ["--arch", "deepseek_v3", "--gpus", "2048", "--gpu", "h800"])
    error = f"{small.output}{small.exception}"  # the command's ConfigError: one "Error:" line from the CLI
    assert small.exit_code != 0
    assert "the batch of 8 sequences allows at most dp 8, so every model copy spans 256 GPUs" in error
    assert "use more GPUs" not in error
