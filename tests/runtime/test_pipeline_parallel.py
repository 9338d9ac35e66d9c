"""Pipeline parallelism trains the serial model's numbers (float64, 3 AdamW steps with clipping and weight decay):
every schedule on 2 and 4 pipeline ranks with m = pp and 2·pp microbatches, and with data parallelism (ZeRO-1),
tensor + sequence parallelism and full recomputation; the bytes between stages are the activations' and their
gradients'; bad pipeline settings get one clear error."""

from __future__ import annotations

import pytest
from mpi_harness import assert_equals_serial, parallel_training, serial_training, train_error

from mpiparallel.axes.pipeline_parallel import stage_units

COMMON = {"n_layer": 8, "n_head": 2, "n_embd": 32, "seq_len": 16, "batch_size": 8, "steps": 3, "dtype": "float64",
          "grad_clip": 0.5, "weight_decay": 0.1, "vocab_size": 257, "lr": 1e-2}
SCHEDULES = ["gpipe", "1f1b", "interleaved", "zb", "zbv", "dualpipev"]
TOLERANCE = 1e-9


def schedule_runs(pp: int) -> list[dict]:
    return [{"pp": pp, "schedule": schedule, "microbatches": m, "virtual_stages": 2 if schedule == "interleaved" else 1}
            for schedule in SCHEDULES for m in (pp, 2 * pp)]


COMBINATIONS = [
    {"pp": 2, "dp": 2, "zero": 1, "schedule": "1f1b"},
    {"pp": 2, "dp": 2, "schedule": "zbv", "microbatches": 2},
    {"pp": 2, "tp": 2, "sp": True, "schedule": "zb"},
    {"pp": 2, "tp": 2, "schedule": "interleaved", "virtual_stages": 2, "microbatches": 4},
]
RECOMPUTING = [{"pp": 2, "schedule": schedule, "recompute": "full", "microbatches": 4} for schedule in ("1f1b", "zbv")]


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> str:
    return serial_training(COMMON, tmp_path_factory.mktemp("serial"))


@pytest.fixture(scope="module")
def two_ranks(reference) -> list[dict]:
    return parallel_training(2, COMMON, schedule_runs(2) + RECOMPUTING, reference)


@pytest.fixture(scope="module")
def four_ranks(reference) -> list[dict]:
    return parallel_training(4, COMMON, schedule_runs(4) + COMBINATIONS, reference)


@pytest.mark.parametrize("index", range(12), ids=[f"{r['schedule']}-m{r['microbatches']}" for r in schedule_runs(2)])
def test_every_schedule_on_two_stages_equals_serial(two_ranks, index):
    assert_equals_serial(two_ranks[index], COMMON["steps"], TOLERANCE)


@pytest.mark.parametrize("index", range(12), ids=[f"{r['schedule']}-m{r['microbatches']}" for r in schedule_runs(4)])
def test_every_schedule_on_four_stages_equals_serial(four_ranks, index):
    assert_equals_serial(four_ranks[index], COMMON["steps"], TOLERANCE)


@pytest.mark.parametrize("index", range(len(COMBINATIONS)),
                         ids=["dp2-zero1", "dp2-zbv", "tp2-sp-zb", "tp2-interleaved"])
def test_pipeline_with_data_and_tensor_parallelism_equals_serial(four_ranks, index):
    assert_equals_serial(four_ranks[12 + index], COMMON["steps"], TOLERANCE)


@pytest.mark.parametrize("index", range(len(RECOMPUTING)), ids=["1f1b", "zbv"])
def test_pipeline_with_full_recomputation_equals_serial(two_ranks, index):
    assert_equals_serial(two_ranks[12 + index], COMMON["steps"], TOLERANCE)


def test_stage_boundaries_carry_one_activation_per_microbatch_each_way_plus_the_tied_gradient(two_ranks):
    """pp = 2, B = 8 rows, s = 16, h = 32, float64. 1F1B: rank 0 holds the first stage — it sends m activations of
    (8/m)·s·h and the tied wte's gradient (V·h) to the last stage's rank. ZB-V: rank 0 holds the first and the last
    stage, so nothing is tied across ranks, and it sends m activations forward and m gradients backward."""
    activation_bytes = COMMON["batch_size"] * COMMON["seq_len"] * COMMON["n_embd"] * 8  # summed over microbatches
    tied_bytes = COMMON["vocab_size"] * COMMON["n_embd"] * 8
    by_schedule = {(r["options"]["schedule"], r["options"]["microbatches"]): r for r in two_ranks[:12]}
    for m in (2, 4):
        assert by_schedule["1f1b", m]["pp_bytes_sent"] == [activation_bytes + tied_bytes] * 3
        assert by_schedule["zbv", m]["pp_bytes_sent"] == [2 * activation_bytes] * 3


def test_stages_split_the_layers_evenly_with_the_embedding_first_and_the_head_last():
    assert stage_units(5, 2) == [range(0, 4), range(4, 7)]  # blocks 1-3 | 4-5; unit 0 embedding, 6 the head
    assert stage_units(4, 4) == [range(0, 2), range(2, 3), range(3, 4), range(4, 6)]


TINY = ["--n-layer", "2", "--n-embd", "32", "--n-head", "2", "--seq-len", "16", "--batch-size", "4", "--steps", "1"]


@pytest.mark.parametrize("args, fragment", [
    (["-n", "2", "--pp", "2", "--schedule", "zb", "--microbatches", "1"], "at least pp microbatches"),
    (["-n", "2", "--pp", "2", "--schedule", "interleaved", "--virtual-stages", "2"], "only 2 layers"),
    (["-n", "2", "--pp", "2", "--microbatches", "3"], "divisible by dp × microbatches"),
    (["-n", "2", "--pp", "2", "--schedule", "pipedream"], "pipedream"),
    (["-n", "2", "--pp", "2", "--virtual-stages", "2"], "virtual stages"),
], ids=["too-few-microbatches", "more-chunks-than-layers", "batch", "unknown-schedule", "virtual-stages"])
def test_bad_pipeline_settings_get_one_clear_error(args, fragment):
    assert fragment in train_error(*TINY, *args)
