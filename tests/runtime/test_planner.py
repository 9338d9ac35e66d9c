"""The planner: the seeds' exercises answered by `mpiparallel plan --json`, its parameter and activation counts
against the model itself, and every layout it keeps fitting in memory, fastest first.

Pure Python, no MPI: the command-line tests run `python -m mpiparallel plan` as a subprocess.
"""

from __future__ import annotations

import json
import math
import os
import sys
from fractions import Fraction
from pathlib import Path

import numpy as np
import pytest
from mpi_harness import run_with_timeout

from models.transformer import GPTConfig, Transformer
from mpiparallel.planner import PRECISIONS, Cluster, Layout, Model, evaluate, precision_with
from mpiparallel.planner.core import min_microbatches
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


def test_parameter_count_equals_the_models():
    config = GPTConfig(vocab_size=256, n_positions=1024, n_embd=64, n_layer=3, n_head=4)
    model = Transformer(config, dtype=np.float32)
    counted = sum(param.data.size for param in model.parameters())
    assert Model(3, 64, 4, 32, 256).total_parameters() == counted


def test_memory_of_one_rank_equals_the_serial_models_arrays():
    config = GPTConfig(vocab_size=256, n_positions=1024, n_embd=32, n_layer=2, n_head=4)
    model = Transformer(config, dtype=np.float32)
    tokens = np.random.default_rng(0).integers(0, 256, (4, 16))
    _, saved = model.forward(tokens, tokens)
    plan = evaluate(Model(2, 32, 4, 16, 256), Cluster(gpus=1, gpus_per_node=1), PRECISIONS["float32"],
                    Layout(), batch_size=4)
    memory = plan.memory_per_rank[0]
    parameters = sum(param.data.nbytes for param in model.parameters())
    assert memory["parameters"] == memory["gradients"] == parameters
    assert memory["optimizer_state"] == 2 * parameters
    assert memory["activations"] == saved.nbytes()


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
    one_rank = load_machine(machine, ranks_per_node=1, gpu_memory=1e9)
    share = measured["cores"] / 1
    assert one_rank.matmul_flops == pytest.approx(measured["matmul_flops"] * share * measured["compute_efficiency"])
    assert one_rank.elementwise_bytes == pytest.approx(measured["elementwise_bytes"] * min(1.0, share)
                                                       * measured["compute_efficiency"])
