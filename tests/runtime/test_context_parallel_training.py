"""Context parallelism trains the serial model's numbers (float64, 3 AdamW steps with clipping and weight decay):
every attention variant on cp = 2 and 4, and with data parallelism (ZeRO-1 and 3), tensor (+ sequence)
parallelism, pipeline stages and full recomputation; bad context-parallel settings get one clear error."""

from __future__ import annotations

import pytest
from mpi_harness import assert_equals_serial, parallel_training, serial_training, train_error

COMMON = {"n_layer": 2, "n_head": 4, "n_embd": 32, "seq_len": 16, "batch_size": 4, "steps": 3, "dtype": "float64",
          "grad_clip": 0.5, "weight_decay": 0.1, "vocab_size": 257, "lr": 1e-2}
VARIANTS = ["ring", "all-gather", "ulysses"]
TOLERANCE = 1e-9

TWO_RANKS = [{"cp": 2, "cp_attention": variant} for variant in VARIANTS] + [
    {"cp": 2, "cp_attention": "ring", "recompute": "full"},
    {"cp": 2, "cp_attention": "ulysses", "recompute": "selective"},
]
FOUR_RANKS = [{"cp": 4, "cp_attention": variant} for variant in VARIANTS] + [
    {"cp": 2, "cp_attention": variant, **mesh} for variant in VARIANTS
    for mesh in ({"dp": 2, "zero": 1}, {"tp": 2}, {"tp": 2, "sp": True})] + [
    {"cp": 2, "dp": 2, "zero": 3, "cp_attention": "all-gather"},
    {"cp": 2, "pp": 2, "cp_attention": "ring", "schedule": "1f1b"},
]


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> str:
    return serial_training(COMMON, tmp_path_factory.mktemp("serial"))


@pytest.fixture(scope="module")
def two_ranks(reference) -> list[dict]:
    return parallel_training(2, COMMON, TWO_RANKS, reference)


@pytest.fixture(scope="module")
def four_ranks(reference) -> list[dict]:
    return parallel_training(4, COMMON, FOUR_RANKS, reference)


def label(config: dict) -> str:
    return "-".join(f"{k}{v}" if not isinstance(v, bool) else k for k, v in config.items())


@pytest.mark.parametrize("index", range(len(TWO_RANKS)), ids=[label(c) for c in TWO_RANKS])
def test_context_parallel_training_on_two_ranks_equals_serial(two_ranks, index):
    assert_equals_serial(two_ranks[index], COMMON["steps"], TOLERANCE)


@pytest.mark.parametrize("index", range(len(FOUR_RANKS)), ids=[label(c) for c in FOUR_RANKS])
def test_context_parallel_training_on_four_ranks_equals_serial(four_ranks, index):
    assert_equals_serial(four_ranks[index], COMMON["steps"], TOLERANCE)


TINY = ["--n-layer", "1", "--n-embd", "32", "--n-head", "4", "--batch-size", "4", "--steps", "1"]


@pytest.mark.parametrize("args, fragment", [
    (["-n", "2", "--cp", "2", "--seq-len", "18"], "must be divisible by 4"),
    (["-n", "4", "--cp", "2", "--tp", "2", "--n-head", "2", "--seq-len", "16", "--cp-attention", "ulysses"],
     "n_head (2) must be divisible by 4"),
    (["-n", "2", "--cp", "2", "--seq-len", "16", "--cp-attention", "striped"], "striped"),
], ids=["seq-len", "ulysses-heads", "unknown-variant"])
def test_bad_context_parallel_settings_get_one_clear_error(args, fragment):
    assert fragment in train_error(*TINY, *args)
