"""Mixture-of-experts training with expert parallelism equals the serial MoE model (float64, 3 AdamW steps with
clipping and weight decay): ep ∈ {2, 4} carved from dp ∈ {2, 4}, top-k ∈ {1, 2}, E ∈ {4, 8}, with ZeRO-1, tensor
(+ sequence), context and pipeline parallelism; the aux loss where the token sets match the serial run's; the
aux-loss-free expert biases' trajectory; router statistics in the log; one clear error per bad setting.

With --tp the experts and routers are replicated over the TP group (without SP every TP rank routes the same
tokens; with SP each its slice, and their gradients are summed over tp)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest
from mpi_harness import assert_equals_serial, parallel_training, run_with_timeout, serial_training, train_error

from mpiparallel.checkpoints import hugging_face

BASE = {"n_layer": 2, "n_head": 2, "n_embd": 32, "seq_len": 16, "batch_size": 8, "steps": 3, "dtype": "float64",
        "grad_clip": 0.5, "weight_decay": 0.1, "vocab_size": 257, "lr": 1e-2, "moe_aux_coef": 0.0}
MODELS = {
    "E4-top2": {**BASE, "experts": 4, "top_k": 2},
    "E8-top1": {**BASE, "experts": 8, "top_k": 1},
    # the serial run forms the parallel run's token sets (one microbatch per DP rank): aux loss and capacity on
    "E4-top2-aux": {**BASE, "experts": 4, "top_k": 2, "moe_aux_coef": 0.01, "capacity_factor": 1.0, "microbatches": 2},
    "E4-top1-bias": {**BASE, "experts": 4, "top_k": 1, "moe_bias_rate": 0.01},
}
RUNS = {  # model -> (ranks, configurations)
    "E4-top2": [(2, [{"dp": 2, "ep": 2}, {"tp": 2}, {"tp": 2, "sp": True}]),
                (4, [{"dp": 4, "ep": 2}, {"dp": 4, "ep": 4}, {"dp": 4, "ep": 2, "zero": 1}, {"dp": 2, "ep": 2, "cp": 2},
                     {"dp": 2, "ep": 2, "pp": 2, "microbatches": 2}, {"dp": 2, "ep": 2, "tp": 2},
                     {"dp": 2, "ep": 2, "tp": 2, "sp": True, "zero": 1}])],
    "E8-top1": [(2, [{"dp": 2, "ep": 2}]), (4, [{"dp": 4, "ep": 4}, {"dp": 4, "ep": 2}])],
    "E4-top2-aux": [(2, [{"dp": 2, "ep": 2, "microbatches": 1}])],
    "E4-top1-bias": [(2, [{"dp": 2, "ep": 2}]), (4, [{"dp": 4, "ep": 4}, {"dp": 2, "ep": 2, "tp": 2, "sp": True}])],
}
CASES = [(model, ranks, index) for model, launches in RUNS.items() for ranks, configs in launches
         for index in range(len(configs))]
TOLERANCE = 1e-9


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict:
    """Every model's serial reference, then its parallel runs, a launch per rank count."""
    found = {}
    for model, launches in RUNS.items():
        directory = tmp_path_factory.mktemp(model)
        reference = serial_training(MODELS[model], directory)
        found[model, "reference"] = hugging_face.load_pretrained(directory / "model")[1]
        found[model, "reference log"] = read_log(directory / "log.jsonl")
        for ranks, configs in launches:
            found[model, ranks] = parallel_training(ranks, MODELS[model], configs, reference)
    return found


def label(case: tuple) -> str:
    model, ranks, index = case
    config = dict(RUNS[model])[ranks][index]
    return f"{model}-" + "-".join(f"{key}{value}" for key, value in config.items())


@pytest.mark.parametrize("case", CASES, ids=[label(case) for case in CASES])
def test_expert_parallel_training_equals_the_serial_moe_model(results, case):
    model, ranks, index = case
    assert_equals_serial(results[model, ranks][index], BASE["steps"], TOLERANCE)  # expert biases included


def test_the_serial_runs_biases_moved_so_equal_biases_mean_equal_trajectories(results):
    reference = results["E4-top1-bias", "reference"]
    biases = [value for name, value in reference.items() if name.endswith("router.expert_bias")]
    assert len(biases) == BASE["n_layer"] and all(np.abs(bias).max() > 0 for bias in biases)
    assert not any(np.abs(value).max() > 0 for name, value in results["E4-top2", "reference"].items()
                   if name.endswith("router.expert_bias"))  # no --moe-bias-rate: no bias


def test_a_saved_moe_model_keeps_its_names_and_settings_and_trains_on_from_init(tmp_path):
    saved = tmp_path / "moe"
    run = run_with_timeout([sys.executable, "-m", "mpiparallel", "train", *TINY, "--experts", "4", "--top-k", "2",
                            "--moe-bias-rate", "0.01", "-n", "2", "--ep", "2", "--save", str(saved)], 120)
    assert run.returncode == 0, run.stderr
    config, tensors, raw = hugging_face.load_pretrained(saved)
    assert (config.n_experts, config.moe_top_k, config.moe_bias_rate) == (4, 2, 0.01)
    assert raw["n_experts"] == 4 and raw["moe_top_k"] == 2
    assert {"transformer.h.0.mlp.router.weight", "transformer.h.0.mlp.router.expert_bias",
            "transformer.h.0.mlp.experts.3.c_proj.bias"} <= set(tensors)
    assert tensors["transformer.h.0.mlp.experts.3.c_fc.weight"].shape == (32, 128)
    from_init = ["train", "--init", str(saved), "--seq-len", "16", "--batch-size", "4", "--steps", "2",
                 "--dtype", "float64"]
    logs = {}
    for name, mesh in (("serial", ["--microbatches", "2"]), ("ep2", ["-n", "2", "--ep", "2"])):
        resumed = run_with_timeout([sys.executable, "-m", "mpiparallel", *from_init, *mesh,
                                    "--log-json", str(tmp_path / f"{name}.jsonl")], 120)
        assert resumed.returncode == 0, resumed.stderr
        logs[name] = read_log(tmp_path / f"{name}.jsonl")
        for record in logs[name]:  # the printed statistics are the logged ones
            assert (f"aux {record['aux_loss']:.4f} | load max/mean {record['router']['max_over_mean_load']:.2f}, "
                    f"dropped {record['router']['dropped_tokens']}") in resumed.stdout
    assert_same_router_records(logs["ep2"], logs["serial"])  # the serial run's token sets are the EP ranks'


def read_log(path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines()]


def assert_same_router_records(got: list[dict], want: list[dict]) -> None:
    """Step by step: the same aux loss (float64, 1e-9), expert loads and dropped tokens as `want`; the load ratio
    is max / mean of the loads, computed here."""
    assert len(got) == len(want) > 0
    for a, b in zip(got, want, strict=True):
        assert a["aux_loss"] == pytest.approx(b["aux_loss"], rel=TOLERANCE) and a["aux_loss"] > 0, (a, b)
        assert a["router"]["tokens_per_expert"] == b["router"]["tokens_per_expert"], (a, b)
        assert a["router"]["dropped_tokens"] == b["router"]["dropped_tokens"], (a, b)
        loads = np.array(b["router"]["tokens_per_expert"])
        assert a["router"]["max_over_mean_load"] == pytest.approx(loads.max() / loads.mean(), rel=1e-12), a


def test_the_log_reports_the_aux_loss_and_where_the_tokens_went(results):
    got, want = results["E4-top2-aux", 2][0]["logs"], results["E4-top2-aux", "reference log"]
    assert_same_router_records(got, want)  # the serial run (the oracle) routes the same token sets
    tokens = BASE["batch_size"] * BASE["seq_len"]
    for record in got:
        assert len(record["router"]["tokens_per_expert"]) == 4
        assert sum(record["router"]["tokens_per_expert"]) == 2 * tokens * BASE["n_layer"]  # top-2 of every token
    assert any(record["router"]["dropped_tokens"] > 0 for record in got)  # capacity factor 1 drops some


TINY = ["--n-layer", "1", "--n-embd", "32", "--n-head", "2", "--seq-len", "16", "--batch-size", "4", "--steps", "1"]


@pytest.mark.parametrize("args, fragment", [
    (["-n", "2", "--ep", "2"], "give --experts"),
    (["-n", "2", "--ep", "2", "--experts", "3", "--top-k", "1"], "must divide --experts 3"),
    (["--experts", "2", "--top-k", "3"], "3 is more than --experts 2"),
    (["-n", "2", "--experts", "4", "--ep", "4"], "--ep 4 must divide the data-parallel size 2"),
    (["--experts", "4", "--moe-bias-rate", "-1"], "--moe-bias-rate"),
], ids=["ep-without-experts", "experts-not-divisible", "top-k", "ep-not-dividing-dp", "bias-rate"])
def test_bad_expert_settings_get_one_clear_error(args, fragment):
    assert fragment in train_error(*TINY, *args)
