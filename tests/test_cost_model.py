"""The α-β-γ model picks latency-optimal algorithms for small messages and bandwidth-optimal ones for large."""

from __future__ import annotations

import json

import pytest

from collectives import ALGORITHMS
from collectives.cost_model import FORMULAS, CostModel, choose, load_calibration, predict, save_calibration

MODEL = CostModel(alpha=3e-6, beta=1e-10, gamma=1e-10)


def test_every_hand_written_algorithm_has_a_cost_formula():
    for name, table in ALGORITHMS.items():
        if name == "all_to_allv":
            continue  # one algorithm, nothing to choose
        assert set(FORMULAS[name]) == {algo for algo in table if algo != "mpi"}, name


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

