"""The α-β-γ model picks latency-optimal algorithms for small messages and bandwidth-optimal ones for large."""

from __future__ import annotations

import json

import pytest

from collectives import ALGORITHMS
from collectives.cost_model import (
    FORMULAS,
    HIERARCHICAL,
    TREES,
    CostModel,
    busy_fraction,
    choose,
    load_calibration,
    predict,
    save_calibration,
)

MODEL = CostModel(alpha=3e-6, beta=1e-10, gamma=1e-10)


def test_every_hand_written_algorithm_has_a_cost_formula():
    for name, table in ALGORITHMS.items():
        if name == "all_to_allv":
            continue  # one algorithm, nothing to choose
        hierarchical = {"hierarchical"} if name in HIERARCHICAL else set()
        assert set(FORMULAS[name]) | hierarchical == {algo for algo in table if algo != "mpi"}, name


@pytest.mark.parametrize("ranks", [2, 3, 4, 8])
def test_small_all_reduce_uses_recursive_doubling_and_large_a_bandwidth_optimal_algorithm(ranks):
    assert choose(MODEL, "all_reduce", 8, ranks) == "recursive_doubling"
    assert choose(MODEL, "all_reduce", 64 << 20, ranks) in ("ring", "rabenseifner")


def test_ring_all_reduce_formula_is_the_textbook_one():
    s, n = 1e6, 4
    expected = 2 * (n - 1) * MODEL.alpha + 2 * (n - 1) / n * s * MODEL.beta + (n - 1) / n * s * MODEL.gamma
    assert predict(MODEL, "all_reduce", "ring", s, n) == pytest.approx(expected)


def test_rabenseifner_equals_ring_bandwidth_with_logarithmic_latency_on_powers_of_two():
    s, n = 1e6, 8
    ring = predict(MODEL, "all_reduce", "ring", s, n)
    rabenseifner = predict(MODEL, "all_reduce", "rabenseifner", s, n)
    assert ring - rabenseifner == pytest.approx((2 * (n - 1) - 2 * 3) * MODEL.alpha)


def test_large_broadcast_scatters_then_gathers_and_small_uses_the_tree():
    assert choose(MODEL, "broadcast", 8, 8) == "binomial"
    assert choose(MODEL, "broadcast", 64 << 20, 8) == "scatter_allgather"


def test_calibration_round_trips_and_falls_back_to_the_nearest_rank_count(tmp_path):
    path = tmp_path / "calibration.json"
    save_calibration(CostModel(1e-6, 2e-10, 3e-10), 2, path)
    save_calibration(CostModel(5e-6, 4e-10, 3e-10), 8, path)
    assert load_calibration(2, path) == CostModel(1e-6, 2e-10, 3e-10)
    assert load_calibration(7, path) == CostModel(5e-6, 4e-10, 3e-10)
    assert set(json.loads(path.read_text())) == {"2", "8"}


def test_missing_or_corrupt_calibration_gives_the_defaults(tmp_path):
    assert load_calibration(4, tmp_path / "absent.json") == CostModel()
    corrupt = tmp_path / "corrupt.json"
    corrupt.write_text("{not json")
    assert load_calibration(4, corrupt) == CostModel()



SHARED = CostModel(alpha=MODEL.alpha, beta=MODEL.beta, gamma=MODEL.gamma, ranks_per_core=2.0)  # 4 ranks, 2 cores


def test_ranks_sharing_cores_slow_every_all_busy_algorithm_by_the_ranks_per_core():
    for collective, table in FORMULAS.items():
        for algo in table:
            if (collective, algo) not in TREES:
                alone = predict(MODEL, collective, algo, 1 << 20, 4)
                assert predict(SHARED, collective, algo, 1 << 20, 4) == pytest.approx(2 * alone), (collective, algo)


def test_a_binomial_tree_keeps_part_of_the_ranks_busy_and_slows_down_less():
    assert busy_fraction("broadcast", "binomial", 4) == pytest.approx(2 * 3 / (4 * 2))
    assert busy_fraction("broadcast", "binomial", 2) == 1.0
    tree = predict(SHARED, "broadcast", "binomial", 1 << 20, 4)
    assert tree == pytest.approx(1.5 * predict(MODEL, "broadcast", "binomial", 1 << 20, 4))
    eight = predict(MODEL, "broadcast", "binomial", 1 << 20, 8)
    assert predict(SHARED, "broadcast", "binomial", 1 << 20, 8) == pytest.approx(2 * (2 * 7 / (8 * 3)) * eight)
    half_busy = CostModel(ranks_per_core=1.5)  # 1.5 × 7/12 < 1: the tree's ranks find a free core
    assert predict(half_busy, "broadcast", "binomial", 1 << 20, 8) == predict(CostModel(), "broadcast", "binomial",
                                                                              1 << 20, 8)


def test_on_shared_cores_the_tree_broadcast_wins_at_every_size_and_reduce_switches_later():
    """What scripts/bench_collectives.py measured on 4 ranks and 2 cores: binomial broadcast faster than
    scatter + all-gather from 512 KiB to 32 MiB, and binomial reduce faster up to ~512 KiB, Rabenseifner above."""
    default = CostModel()
    shared = CostModel(ranks_per_core=2.0)
    assert choose(default, "broadcast", 32 << 20, 4) == "scatter_allgather"
    assert all(choose(shared, "broadcast", s, 4) == "binomial" for s in (8, 512 << 10, 8 << 20, 64 << 20))
    assert choose(shared, "reduce", 128 << 10, 4) == "binomial"
    assert choose(shared, "reduce", 8 << 20, 4) == "rabenseifner"


def test_the_calibration_file_keeps_the_machine_constants_only(tmp_path):
    path = tmp_path / "calibration.json"
    save_calibration(SHARED, 4, path)
    assert set(json.loads(path.read_text())["4"]) == {"alpha", "beta", "gamma"}
    assert load_calibration(4, path) == MODEL


def test_bruck_all_to_all_pays_for_its_packing_so_pairwise_wins_small_messages_on_4_ranks_and_bruck_from_8():
    assert choose(CostModel(), "all_to_all", 64, 4) == "pairwise"
    assert choose(CostModel(), "all_to_all", 64, 8) == "bruck"
    assert choose(CostModel(), "all_to_all", 64, 16) == "bruck"


def test_recursive_halving_counts_the_copy_of_its_block_so_the_ring_takes_over_for_large_reduce_scatters():
    assert choose(CostModel(), "reduce_scatter", 4096, 4) == "recursive_halving"
    assert choose(CostModel(), "reduce_scatter", 2 << 20, 4) == "ring"
    halving = predict(MODEL, "reduce_scatter", "recursive_halving", 1e6, 4)
    assert halving == pytest.approx(2 * MODEL.alpha + 3 / 4 * 1e6 * (MODEL.beta + MODEL.gamma) + 1e6 / 4 * MODEL.gamma)
