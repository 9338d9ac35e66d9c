"""The planner on the llama family: its parameter count is the model's, its memory per rank is what the
model's arrays take (serial and on every TP rank, KV heads split or replicated), its TP and CP bytes are
`mpiparallel.traffic`'s formulas, and its search keeps only the tensor-parallel degrees that can split the KV
heads. The command line plans a llama and infers one from a parameter count.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from mpi_harness import run_on_ranks, run_with_timeout

from collectives.cost_model import CostModel
from models.tensor_parallel import key_value_replicas
from models.transformer import GPTConfig, Transformer
from mpiparallel import traffic
from mpiparallel.planner import PRECISIONS, Choices, Cluster, Layout, Model, candidate_layouts, evaluate
from mpiparallel.planner.core import unit_costs

ROOT = Path(__file__).resolve().parents[2]
SHAPE = {"n_layer": 2, "n_embd": 64, "n_head": 4, "seq_len": 16, "vocab_size": 61}
MODELS = {  # name: the planner's Model fields beyond SHAPE
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
    per_rank = run_on_ranks(4, "workers.planner_checks:held_bytes", configs=configs, rows=2,
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


def run_plan(*arguments: str) -> dict:
    finished = run_with_timeout([sys.executable, "-m", "mpiparallel", "plan", *arguments, "--json"], timeout=120,
                                cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert finished.returncode == 0, finished.stderr
    return json.loads(finished.stdout)


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
