"""How far a parallel result is from its serial reference, for every equivalence check in the suite.

NaN-aware on purpose: Python's `max(0.0, nan)` is 0.0 and `nan >= x` is False, so a tensor that became NaN
vanished from a running maximum unless it happened to be compared first. Here a non-finite value (in the
result or in the reference) is an infinite error, and `worst` keeps it infinite, so every aggregate fails.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import numpy as np

from .arrays import host


def relative_error(got: Any, want: Any) -> float:
    """max |got - want| / max |want| (arrays on any backend, or plain numbers); infinite if either side holds a
    NaN or an infinity; 0 for empty arrays."""
    got, want = np.asarray(host(got)), np.asarray(host(want))
    if want.size == 0:
        return 0.0 if got.size == 0 else math.inf
    if not (np.isfinite(got).all() and np.isfinite(want).all()):
        return math.inf
    scale = max(float(np.abs(want).max()), 1e-300)
    return float(np.abs(got - want).max()) / scale


def worst(errors: Iterable[float]) -> float:
    """The largest of `errors`, a NaN counted as infinite (0 for none)."""
    result = 0.0
    for error in errors:
        error = float(error)
        if math.isnan(error):
            return math.inf
        result = max(result, error)
    return result
