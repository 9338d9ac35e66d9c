"""The suite's error measures (tests/support/workers/errors.py) cannot lose a NaN: every equivalence check aggregates
with them, so a tensor that became NaN or infinite fails its check wherever it is compared."""

import math

import numpy as np
from workers.errors import relative_error, worst


def test_a_non_finite_result_is_an_infinite_error():
    want = np.ones(4)
    for bad in (math.nan, math.inf, -math.inf):
        got = want.copy()
        got[2] = bad
        assert relative_error(got, want) == math.inf
        assert relative_error(want, got) == math.inf
    assert relative_error(math.nan, 2.0) == math.inf


def test_worst_keeps_a_nan_wherever_it_comes():
    assert max(0.0, math.nan) == 0.0  # the trap: the builtin drops a NaN that is not first
    for errors in ([math.nan, 0.0, 1e-12], [0.0, math.nan], [1e-12, 2e-12, math.nan]):
        assert worst(errors) == math.inf
    assert worst([1e-12, 3e-12, 2e-12]) == 3e-12 and worst([]) == 0.0


def test_relative_error_is_relative_to_the_reference():
    assert relative_error(np.array([1.0, 2.5]), np.array([1.0, 2.0])) == 0.25
    assert relative_error(np.zeros(0), np.zeros(0)) == 0.0
