"""bfloat16 sums: the pairwise algorithm rounds once and stays within that bound; the ring rounds at every hop.

The bounds (u = 2^-8, bfloat16's unit roundoff; s the exact sum of the n inputs, A = Σ|x_i|; derivation in
collectives/pairwise.py): round once |r − s| ≤ u·|s| + (1 + u)·γ32(n−1)·A, element by element; the ring
|r − s| ≤ γ_bf16(n−1)·A; the float32 ring |r − s| ≤ γ32(n−1)·A.
"""

from __future__ import annotations

import numpy as np
import pytest
from mpi_harness import run_on_ranks
from workers import precision_checks

from collectives.backend import BFLOAT16, round_to_bfloat16


def _neighbours(words: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The bfloat16 values one unit in the last place below and above the positive finite bfloat16 `words`."""
    return ((words - 1).view(BFLOAT16).astype(np.float64), (words + 1).view(BFLOAT16).astype(np.float64))


def test_round_to_bfloat16_rounds_float64_once_to_the_nearest_even():
    rng = np.random.default_rng(0)
    exact = np.abs(rng.standard_normal(200_000)) * 2.0 ** rng.integers(-120, 120, 200_000)
    ties = 1 + (rng.integers(0, 128, 1000) * 2 + 1) * 2.0**-8  # halfway between bfloat16 neighbours 2^-7 apart
    values = np.concatenate([exact, ties, -ties])
    rounded = round_to_bfloat16(values)
    words = rounded.view(np.uint16) & 0x7FFF  # magnitudes: the neighbours of -v are those of v, negated
    nearest = np.abs(rounded.astype(np.float64))
    values = np.abs(values)
    below, above = _neighbours(words)
    distance = np.abs(nearest - values)
    assert (distance <= np.abs(below - values)).all() and (distance <= np.abs(above - values)).all()
    tied = (distance == np.abs(below - values)) | (distance == np.abs(above - values))
    assert tied.sum() >= 2000 and (words[tied] % 2 == 0).all()  # ties go to the even neighbour
    double_rounded = np.float64(1 + 2.0**-8 + 2.0**-30)  # float32 would round it to the tie 1 + 2^-8, then to 1
    assert round_to_bfloat16(np.array([double_rounded]))[0] == BFLOAT16.type(1 + 2.0**-7)


@pytest.mark.parametrize("ranks", [2, 4, 8])
def test_bfloat16_all_reduce_errors_stay_within_the_derived_bounds(ranks):
    measured = run_on_ranks(ranks, precision_checks.sum_errors, timeout=200, count=1 << 16)[0]
    errors, bounds = measured["errors"], measured["bounds"]
    assert measured["round_once_elementwise_violations"] == 0, measured
    for scheme in ("bf16 ring", "round once", "float32 ring"):
        assert 0 < errors[scheme]["max"] <= bounds[scheme], (scheme, measured)
    if ranks >= 4:  # two ranks: the ring adds each element once, too
        assert errors["round once"]["mean"] < errors["bf16 ring"]["mean"], measured
        assert errors["round once"]["max"] < errors["bf16 ring"]["max"], measured
