"""The planner: the seeds' exercises answered by `mpiparallel plan --json`, its parameter and activation counts
against the model itself for each family (a parameter: GPT-2, llama with GQA, tied, Mixtral, GPT-2 MoE), memory
per TP rank, its TP and CP bytes against `mpiparallel.traffic`'s formulas, the search keeping only the TP degrees
that split the KV heads, and every layout it keeps fitting in memory, fastest first. (DeepSeek-V3's published
figures: test_planner_deepseek.py.)

Pure Python, no MPI: the command-line tests run `python -m mpiparallel plan` as a subprocess.
"""

from __future__ import annotations

import json
import math
import os
import sys
from fractions import Fraction
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from mpi_harness import run_on_ranks, run_with_timeout
from workers import planner_checks

from collectives.cost_model import CostModel
from models.transformer import GPTConfig, Transformer
from mpiparallel import traffic
from mpiparallel.axes.tensor_parallel import key_value_replicas
from mpiparallel.planner import (
    PRECISIONS,
    Choices,
    Cluster,
    Layout,
    Model,
    candidate_layouts,
    evaluate,
    precision_with,
)
from mpiparallel.planner.core import min_microbatches, unit_costs
from mpiparallel.schedules import SCHEDULES, build_schedule, simulate

ROOT = Path(__file__).resolve().parents[2]


def run_plan(*arguments: str) -> dict:
    finished = run_with_timeout([sys.executable, "-m", "mpiparallel", "plan", *arguments, "--json"], timeout=120,
                                cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert finished.returncode == 0, finished.stderr
    return json.loads(finished.stdout)


def simulated_bubble(schedule: str, pp: int, microbatches: int) -> Fraction:
    chunks = 2 if schedule in ("interleaved", "zbv", "dualpipev") else 1
    simulation = simulate(build_schedule(schedule, pp, microbatches, 2 if schedule == "interleaved" else 1))
    return 1 - Fraction(3 * microbatches * chunks) / Fraction(simulation.makespan)


@pytest.mark.parametrize("max_bubble", [0.1, 0.05, 0.01])
def test_an_8_stage_pipeline_needs_the_fewest_microbatches_below_each_bubble(max_bubble):
    answers = run_plan("--pp", "8", "--max-bubble", str(max_bubble))["min_microbatches"]
    assert set(answers) == set(SCHEDULES)
    # the seed's 1F1B (and GPipe) bubble (p−1)/(m+p−1) < ε, solved exactly: m > (p−1)(1−ε)/ε
    p, target = 8, Fraction(max_bubble).limit_denominator(1000)
    expected = math.floor((p - 1) * (1 - target) / target) + 1
    assert answers["1f1b"] == answers["gpipe"] == expected
    for schedule, microbatches in answers.items():
        step = p if schedule == "interleaved" else 1
        assert simulated_bubble(schedule, p, microbatches) < target
        if microbatches - step >= (p if schedule in ("zb", "interleaved") else 1):
            assert simulated_bubble(schedule, p, microbatches - step) >= target


def test_the_seed_answers_64_microbatches_for_under_10_percent_with_1f1b():
    assert run_plan("--pp", "8", "--max-bubble", "0.1")["min_microbatches"]["1f1b"] == 64
    assert min_microbatches("1f1b", 8, 0.01) == 694


def test_70b_weights_in_fp16_need_2_of_256_gpus_of_80gb_and_tp2_pp4_leaves_dp_32():
    seed = ["--params", "70e9", "--gpus", "256", "--gpu-memory", "80GB", "--weights-only", "--bytes-per-param", "2"]
    alone = run_plan(*seed)
    assert alone["min_model_parallel"] == 2  # 140 GB of weights over 80 GB GPUs
    assert "layouts" not in alone
    assert run_plan(*seed, "--tp", "2", "--pp", "4")["dp"] == 32


def test_70b_full_training_state_needs_14_gpus_and_every_kept_layout_fits():
    answer = run_plan("--params", "70e9", "--gpus", "256", "--gpu-memory", "80GB", "--tp", "8", "--pp", "8",
                      "--top", "0")
    assert answer["precision"]["weights"] + answer["precision"]["gradients"] + answer["precision"]["optimizer"] == 16
    assert answer["min_model_parallel"] == 14  # 70e9 · 16 bytes = 1120 GB over 80 GB
    layouts = answer["layouts"]
    assert 0 < answer["feasible"] == len(layouts) < answer["considered"]
    assert all(layout["max_memory_bytes"] <= 80e9 for layout in layouts)
    assert [layout["step_s"] for layout in layouts] == sorted(layout["step_s"] for layout in layouts)
    assert all(layout["tp"] == 8 and layout["pp"] == 8 and layout["dp"] * layout["cp"] == 4 for layout in layouts)
    first = layouts[0]
    assert len(first["memory_per_rank"]) == 8 and len(first["memory_per_stage"]) >= 8
    assert all(rank["activations"] > 0 for rank in first["memory_per_rank"])


def test_zero_and_a_pipeline_split_the_memory_as_their_arithmetic_says():
    model, cluster = Model(8, 64, 4, 32, 256), Cluster(gpus=8, gpus_per_node=8)
    precision = precision_with("float32")
    whole = evaluate(model, cluster, precision, Layout(dp=8), 8).memory_per_rank[0]
    zero3 = evaluate(model, cluster, precision, Layout(dp=8, zero=3), 8).memory_per_rank[0]
    for kind in ("parameters", "gradients", "optimizer_state"):
        assert zero3[kind] == pytest.approx(whole[kind] / 8)
    pipeline = evaluate(model, cluster, precision, Layout(dp=2, pp=4, microbatches=4, schedule="gpipe"), 8)
    # GPipe holds all 4 microbatches on every stage; the first stage also the embedding, the last the head
    assert [stage["peak_microbatches"] for stage in pipeline.memory_per_stage] == [4, 4, 4, 4]
    one_f_one_b = evaluate(model, cluster, precision, Layout(dp=2, pp=4, microbatches=4, schedule="1f1b"), 8)
    assert [stage["peak_microbatches"] for stage in one_f_one_b.memory_per_stage] == [4, 3, 2, 1]
    assert one_f_one_b.memory_per_rank[1]["activations"] < pipeline.memory_per_rank[1]["activations"]


def test_max_bubble_without_a_pipeline_is_one_clear_error():
    finished = run_with_timeout([sys.executable, "-m", "mpiparallel", "plan", "--max-bubble", "0.1"], timeout=60,
                                cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert finished.returncode != 0
    assert "--max-bubble needs a pipeline" in finished.stderr + finished.stdout
    assert "Traceback" not in finished.stderr


def test_calibration_measures_the_rates_and_a_real_steps_share_of_them_which_scale_the_machine(tmp_path):
    from mpiparallel.planner.core import load_machine

    machine = tmp_path / "machine.json"
    result = run_with_timeout([sys.executable, "-m", "mpiparallel", "plan", "--calibrate", "-n", "2", "--n-layer", "2",
                               "--n-embd", "32", "--seq-len", "32", "--machine", str(machine)], timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    measured = json.loads(machine.read_text())
    assert measured["ranks"] == 2 and measured["efficiency_shape"]["n_layer"] == 2
    assert measured["matmul_flops"] > 0 and measured["elementwise_bytes"] > 0
    assert 0 < measured["compute_efficiency"] < 10
    one_rank = load_machine(machine, ranks_per_node=1, memory_per_rank=1e9)
    share = measured["cores"] / 1
    assert one_rank.matmul_flops == pytest.approx(measured["matmul_flops"] * share * measured["compute_efficiency"])
    assert one_rank.elementwise_bytes == pytest.approx(measured["elementwise_bytes"] * min(1.0, share)
                                                       * measured["compute_efficiency"])
    assert measured["memory_bytes"] == os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")

    # planned on, the machine is what it is: ranks sharing its cores and memory, rates per rank in GFLOP/s (before:
    # "2 GPUs of 80.00 GB" and "0.0 TFLOP/s per GPU")
    shown = run_with_timeout([sys.executable, "-m", "mpiparallel", "plan", "--machine", str(machine), "--gpus", "2",
                              "--top", "1"], timeout=120, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert shown.returncode == 0, shown.stderr
    per_rank = measured["memory_bytes"] / 2
    memory = f"{per_rank / 1e9:.2f} GB" if per_rank >= 1e9 else f"{per_rank / 1e6:.2f} MB"
    assert (f"machine: 2 ranks on a calibrated CPU machine of {measured['cores']} cores, {memory} of memory per "
            f"rank; per rank ") in shown.stdout, shown.stdout
    assert "GFLOP/s per rank in Megatron's count" in shown.stdout and "fewest ranks that must share" in shown.stdout
    assert "GPU" not in shown.stdout, shown.stdout


SHAPE = {"n_layer": 2, "n_embd": 64, "n_head": 4, "seq_len": 16, "vocab_size": 61}
MODELS = {  # name: the planner's Model fields beyond SHAPE (the family is a parameter)
    "gpt2": {},
    "gqa_untied": {"arch": "llama", "n_kv_head": 2},
    "gqa_tied": {"arch": "llama", "n_kv_head": 2, "tie_embeddings": True},
    "one_kv_head_custom_ffn": {"arch": "llama", "n_kv_head": 1, "ffn_hidden": 96},
    "mixtral_top2": {"arch": "llama", "n_kv_head": 2, "experts": 4, "top_k": 2},
    "mixtral_top1": {"arch": "llama", "n_kv_head": 4, "experts": 3, "top_k": 1},
    "gpt2_moe": {"experts": 4, "top_k": 2},
}


def planner_model(name: str, **overrides) -> Model:
    return Model(**(SHAPE | MODELS[name] | overrides))


def train_config(model: Model) -> GPTConfig:
    """The GPTConfig train builds for the planner's shape, field by field (not through Model.config)."""
    return GPTConfig(vocab_size=model.vocab_size, n_positions=model.n_positions, n_embd=model.n_embd,
                     n_layer=model.n_layer, n_head=model.n_head, n_experts=model.experts, moe_top_k=model.top_k,
                     arch=model.arch, n_kv_head=model.n_kv_head, ffn_hidden=model.ffn_hidden,
                     tie_embeddings=model.tie_embeddings)


@pytest.mark.parametrize("name", MODELS)
def test_parameter_count_equals_the_models(name):
    model = planner_model(name)
    config = train_config(model)
    arrays = sum(param.data.size for param in Transformer(config, dtype=np.float32).parameters())
    assert model.total_parameters() == config.parameter_count() == arrays


def test_llama_3_8b_has_its_published_8_03_billion_parameters():
    llama = Model(32, 4096, 32, 8192, 128256, arch="llama", n_kv_head=8, ffn_hidden=14336)
    assert llama.total_parameters() == train_config(llama).parameter_count() == 8_030_261_248


@pytest.mark.parametrize("recompute", ["none", "selective", "full"])
@pytest.mark.parametrize("name", MODELS)
def test_memory_of_one_rank_equals_the_serial_models_arrays(name, recompute):
    model = planner_model(name)
    serial = Transformer(train_config(model), dtype=np.float32, recompute=recompute)
    tokens = np.random.default_rng(0).integers(0, model.vocab_size, (3, model.seq_len))
    _, saved = serial.forward(tokens, tokens)
    plan = evaluate(model, Cluster(gpus=1, gpus_per_node=1), PRECISIONS["float32"], Layout(recompute=recompute),
                    batch_size=3)
    memory = plan.memory_per_rank[0]
    parameters = sum(param.data.nbytes for param in serial.parameters())
    assert memory["parameters"] == memory["gradients"] == parameters
    assert memory["optimizer_state"] == 2 * parameters
    assert memory["activations"] == saved.nbytes()


@pytest.mark.parametrize("recompute", ["none", "full"])
def test_memory_of_every_tp_rank_equals_its_shards_and_saved_arrays(recompute):
    """tp = 4 over n_kv = 4 (a KV head per rank), 2 and 1 (each replicated on 2 and 4 ranks), tied and not,
    with and without SP; vocabulary 61 padded to 64. Every block's saved arrays exactly; the whole rank's within
    the index arrays of the vocab-parallel embedding and cross-entropy (a few bytes per token, and how many
    targets fall in a rank's vocabulary shard depends on the data)."""
    names = ["gqa_untied", "gqa_tied", "one_kv_head_custom_ffn"]
    models = [planner_model(n) for n in names] + [planner_model("gqa_untied", n_kv_head=4)]
    configs = [{key: value for key, value in vars(train_config(m)).items() if key != "rope_scaling"} for m in models]
    per_rank = run_on_ranks(4, planner_checks.held_bytes, configs=configs, rows=2,
                            length=SHAPE["seq_len"], recompute=recompute)
    cluster = Cluster(gpus=4, gpus_per_node=4)
    for rank_found in per_rank:
        found = iter(rank_found)
        for model in models:
            for sp in (False, True):
                plan = evaluate(model, cluster, PRECISIONS["float32"], Layout(tp=4, sp=sp, recompute=recompute), 2)
                held = next(found)
                block = unit_costs(model, plan.layout, 2, PRECISIONS["float32"])[1].saved * 4
                assert plan.memory_per_rank[0]["parameters"] == held["parameters"], (model, sp)
                assert held["per_unit"][1:-1] == [block] * model.n_layer, (model, sp)
                tokens = 2 * model.seq_len
                assert abs(plan.memory_per_rank[0]["activations"] - held["activations"]) <= 32 * tokens


def fake_communicator(size: int) -> SimpleNamespace:
    """What `mpiparallel.traffic` reads of a communicator: its size, its nodes (one) and the algorithm auto picks
    (the bandwidth-optimal one under a cost model of bytes only, as the planner counts)."""
    return SimpleNamespace(size=size, auto_choices={}, cost_model=CostModel(alpha=0.0, beta=1.0, gamma=0.0),
                           topology=SimpleNamespace(count=1, spans_nodes=False))


@pytest.mark.parametrize("cp_attention", ["ring", "all-gather", "ulysses"])
@pytest.mark.parametrize("recompute", ["none", "full"])
@pytest.mark.parametrize(("n_kv_head", "tp", "cp"), [(2, 4, 2), (4, 2, 2), (1, 2, 4), (4, 1, 4)])
def test_tp_and_cp_bytes_are_the_traffic_modules_formulas(n_kv_head, tp, cp, recompute, cp_attention):
    model = Model(3, 128, 8, 64, 256, arch="llama", n_kv_head=n_kv_head)
    layout = Layout(tp=tp, cp=cp, microbatches=2, recompute=recompute, cp_attention=cp_attention)
    plan = evaluate(model, Cluster(gpus=tp * cp, gpus_per_node=tp * cp), PRECISIONS["float32"], layout, 4)
    shape = traffic.RunShape(rows=2, positions=model.seq_len // cp, channels=model.n_embd, itemsize=4,
                             microbatches=2, blocks=model.n_layer, has_embedding=True, has_head=True, sp=False,
                             recompute=recompute, seq_len=model.seq_len, cp_attention=cp_attention, moe=False,
                             n_head=model.n_head, kv_heads=n_kv_head, tp=tp)
    copies = key_value_replicas(n_kv_head, tp)
    tp_bytes = traffic.tensor_parallel_bytes(shape, fake_communicator(tp), 0.0,
                                             fake_communicator(copies) if copies > 1 else None)
    assert plan.comm_bytes["tp"] == pytest.approx(tp_bytes, rel=1e-12)
    assert plan.comm_bytes["cp"] == pytest.approx(traffic.context_parallel_bytes(shape, cp, tp), rel=1e-12)


def test_the_search_keeps_the_tp_degrees_that_split_the_kv_heads():
    """12 query heads over 8 GPUs: tp 2 and 4 split the heads, but 3 KV heads neither divide nor are divided by
    them, 6 are divided by 2 only, 12 by both."""
    def searched_tp(n_kv_head: int) -> set[int]:
        model = Model(2, 384, 12, 64, 256, arch="llama", n_kv_head=n_kv_head)
        layouts = candidate_layouts(model, Cluster(gpus=8, gpus_per_node=8),
                                    Choices(batch_size=8, pp=1, cp=1, zero=0, recompute="none"))
        return {layout.tp for layout in layouts}

    assert searched_tp(3) == {1}
    assert searched_tp(6) == {1, 2}
    assert searched_tp(12) == {1, 2, 4}


def test_ulysses_is_searched_only_where_cp_splits_the_heads_of_a_tp_rank():
    model = Model(2, 256, 4, 64, 256, arch="llama", n_kv_head=2)
    layouts = list(candidate_layouts(model, Cluster(gpus=8, gpus_per_node=8),
                                     Choices(batch_size=8, pp=1, zero=0, recompute="none", sp=False)))
    ulysses = {(layout.tp, layout.cp) for layout in layouts if layout.cp_attention == "ulysses"}
    ring = {(layout.tp, layout.cp) for layout in layouts if layout.cp_attention == "ring" and layout.cp > 1}
    assert ulysses == {(1, 2), (1, 4), (2, 2)}  # 4 heads: cp·tp must divide them
    assert ring == {(1, 2), (1, 4), (1, 8), (2, 2), (2, 4), (4, 2)}


def test_plan_arch_llama_counts_the_models_parameters_and_ranks_fitting_layouts():
    arguments = ["--arch", "llama", "--n-layer", "4", "--n-embd", "384", "--n-head", "12", "--n-kv-head", "6",
                 "--ffn-hidden", "640", "--seq-len", "64", "--gpus", "4", "--gpu-memory", "1GB", "--top", "0"]
    answer = run_plan(*arguments)
    config = GPTConfig(n_layer=4, n_embd=384, n_head=12, vocab_size=256, arch="llama", n_kv_head=6, ffn_hidden=640)
    assert answer["model"]["total_parameters"] == config.parameter_count()
    assert answer["model"] | {"kv_heads": 6, "ffn_width": 640, "tied": False} == answer["model"]
    layouts = answer["layouts"]
    assert layouts and all(layout["max_memory_bytes"] <= 1e9 for layout in layouts)
    assert {layout["tp"] for layout in layouts} == {1, 2}  # 6 KV heads and tp 4 divide neither way
    tied = run_plan(*arguments, "--tie-embeddings", "--tp", "1", "--pp", "1", "--cp", "1")
    assert tied["model"]["total_parameters"] == config.parameter_count() - 256 * 384  # no lm_head


def test_plan_params_with_arch_llama_infers_gqa_and_swiglu():
    model = run_plan("--arch", "llama", "--params", "7e9", "--weights-only")["model"]
    assert model["total_parameters"] == 7_000_000_000
    assert model["n_embd"] == 128 * model["n_head"] and model["kv_heads"] == model["n_head"] // 4
    assert model["ffn_width"] == -(-8 * model["n_embd"] // (3 * 64)) * 64
    assert not model["tied"]
    inferred = Model(model["n_layer"], model["n_embd"], model["n_head"], 2048, 50257, arch="llama",
                     n_kv_head=model["kv_heads"])
    assert abs(inferred.total_parameters() / 7e9 - 1) < 0.25  # the shape's own count is near the one asked


def test_a_gpt2_with_llama_options_is_one_clear_error():
    finished = run_with_timeout([sys.executable, "-m", "mpiparallel", "plan", "--n-kv-head", "2"], timeout=60,
                                cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert finished.returncode != 0
    assert "n_kv_head is a llama setting" in finished.stderr + finished.stdout
    assert "Traceback" not in finished.stderr


def test_packed_documents_cut_attentions_work_and_saved_probabilities_to_their_documents():
    """`plan --document-length L`: s/L documents of L(L+1)/2 pairs each in place of the sequence's s(s+1)/2 — the
    layer's own count (`models.documents.attention_scores`, checked against what the layer multiplies in
    tests/models/test_documents.py) for documents of exactly L tokens, one query per block."""
    from mpiparallel.planner.costs import block_cost
    from mpiparallel.planner.shapes import attention_pairs, causal_pairs

    causal = Model(4, 256, 4, 2048, 256)
    packed = Model(4, 256, 4, 2048, 256, document_length=256)
    assert attention_pairs(packed, Layout(), "flash") == 8 * 256 * 256 / 2
    assert attention_pairs(packed, Layout(), "mpiparallel") == 8 * causal_pairs(256)
    assert attention_pairs(packed, Layout(cp=4), "mpiparallel") == 2 * causal_pairs(256)
    assert attention_pairs(Model(4, 256, 4, 2048, 256, document_length=2048), Layout(), "mpiparallel") \
        == attention_pairs(causal, Layout(), "mpiparallel")  # one document per window: causal
    precision = PRECISIONS["float32"]
    dense, short = (block_cost(model, Layout(), 1, precision) for model in (causal, packed))
    assert short.flops_forward < dense.flops_forward and short.saved < dense.saved
