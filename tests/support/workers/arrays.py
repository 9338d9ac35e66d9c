"""Which array library the equivalence workers build the parallel model on: MPIPARALLEL_TEST_ARRAYS.

numpy (default) on the CPU; cupy on the GPU of each rank's local rank (the GPU subset of scripts/gpu_check.sh);
fake on the CuPy test double (tests/support/fake_cupy.py). The serial reference always stays NumPy, so a GPU run is
checked against the CPU's serial model.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from collectives import backend


def parallel_array_module() -> Any:
    kind = os.environ.get("MPIPARALLEL_TEST_ARRAYS", "numpy")
    if kind == "numpy":
        return np
    if kind == "cupy":
        backend.bind_device()
        return backend.gpu_array_module()
    if kind == "fake":
        from fake_cupy import install

        return install()
    raise ValueError(f"MPIPARALLEL_TEST_ARRAYS must be numpy, cupy or fake, got {kind!r}")


def host(x: Any) -> np.ndarray:
    return backend.to_host(x)
