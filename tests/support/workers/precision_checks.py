"""How far a bfloat16 all-reduce is from the exact sum: the ring (rounding each partial sum as it travels), the
pairwise algorithm (a float32 sum, rounded once) and the float32 ring, on gradient-like data.

Run on its own to print the table of `collectives/pairwise.py` and docs/collectives.md:

    mpiexec -n 4 python tests/support/workers/precision_checks.py [elements per rank]
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/, for workers.*

import collectives as C
from collectives.backend import round_to_bfloat16
from workers.collective_checks import gradient_like

BFLOAT16_ROUNDOFF = 2.0**-8   # u: bfloat16 keeps 8 significant bits
FLOAT32_ROUNDOFF = 2.0**-24


def gamma(k: int, u: float) -> float:
    """Higham's γ_k = k·u / (1 − k·u): the relative error bound of k roundings in a row."""
    return k * u / (1 - k * u)


def bounds(n: int) -> dict[str, float]:
    """Each scheme's worst-case |result − exact sum| / Σ|x| on n ranks (see collectives/pairwise.py)."""
    return {"bf16 ring": gamma(n - 1, BFLOAT16_ROUNDOFF),
            "round once": BFLOAT16_ROUNDOFF + (1 + BFLOAT16_ROUNDOFF) * gamma(n - 1, FLOAT32_ROUNDOFF),
            "float32 ring": gamma(n - 1, FLOAT32_ROUNDOFF)}


def _exact_sum_and_magnitude(x: np.ndarray, comm: C.Communicator) -> tuple[np.ndarray, np.ndarray]:
    """Σ_ranks x and Σ_ranks |x| in float64 (exact here: n ≤ 8 values of one tensor's magnitude per element)."""
    rows = C.all_gather(x, comm, algo="mpi").reshape(comm.size, -1).astype(np.float64)
    return rows.sum(axis=0), np.abs(rows).sum(axis=0)


def sum_errors(count: int, seed: int = 0) -> dict:
    """|result − exact| / Σ|x| of each scheme (max and mean over `count` elements; and the median of
    |result − exact| / |exact|), the bound of each, and how many elements break the round-once scheme's
    elementwise bound u·|s| + (1 + u)·γ(n−1)·Σ|x|."""
    comm = C.world()
    n = comm.size
    shared, own = np.random.default_rng(seed), np.random.default_rng([seed, comm.rank + 1])
    values = gradient_like(shared, count) + gradient_like(own, count)
    bf16, fp32 = round_to_bfloat16(values), values.astype(np.float32)
    exact_bf16, magnitude_bf16 = _exact_sum_and_magnitude(bf16, comm)
    exact_fp32, magnitude_fp32 = _exact_sum_and_magnitude(fp32, comm)
    results = {"bf16 ring": (C.all_reduce(bf16, comm, algo="ring"), exact_bf16, magnitude_bf16),
               "round once": (C.all_reduce(bf16, comm, algo="pairwise"), exact_bf16, magnitude_bf16),
               "float32 ring": (C.all_reduce(fp32, comm, algo="ring"), exact_fp32, magnitude_fp32)}
    errors = {}
    for scheme, (result, exact, magnitude) in results.items():
        error = np.abs(result.astype(np.float64) - exact)
        relative = error[exact != 0] / np.abs(exact[exact != 0])
        errors[scheme] = {"max": float((error / magnitude).max()), "mean": float((error / magnitude).mean()),
                          "median_of_sum": float(np.median(relative))}
    once, exact, magnitude = results["round once"]
    elementwise = (BFLOAT16_ROUNDOFF * np.abs(exact)
                   + (1 + BFLOAT16_ROUNDOFF) * gamma(n - 1, FLOAT32_ROUNDOFF) * magnitude)
    broken = int(np.count_nonzero(np.abs(once.astype(np.float64) - exact) > elementwise))
    return {"ranks": n, "errors": errors, "bounds": bounds(n), "round_once_elementwise_violations": broken}


def table_row(measured: dict) -> str:
    cells = [f"{e['max']:.2e} / {e['mean']:.2e} / {e['median_of_sum']:.2e}"
             for e in (measured["errors"][s] for s in ("bf16 ring", "round once", "float32 ring"))]
    return f"    {measured['ranks']:>5}   " + "   ".join(f"{cell:<30}" for cell in cells)


if __name__ == "__main__":
    result = sum_errors(int(sys.argv[1]) if len(sys.argv) > 1 else 1 << 18)
    if C.world().rank == 0:
        print(table_row(result), "  bounds:", {k: f"{v:.2e}" for k, v in result["bounds"].items()},
              "violations:", result["round_once_elementwise_violations"])
