"""A CuPy test double for machines without a GPU: host memory that behaves like device memory where it matters.

What it imitates, so the GPU code paths run (and can fail) on a CPU:
- `DeviceArray`, a NumPy subclass standing in for `cupy.ndarray`. Like CuPy it refuses to mix with host arrays
  (TypeError) in arithmetic, in `cupy.*` and NumPy functions (`np.dot(host, dev)`), at any depth of their
  arguments (`xp.concatenate([dev, host])`), so a forgotten host-to-device transfer shows up as an error, not as
  silent host math; and, once installed, `np.asarray(dev)` / `np.array(dev)` raise as CuPy's implicit conversion
  does, so every device-to-host copy goes through a counted `.get()`.
- Transfers: `.get()`, `.set()` and `asarray(host)` count the bytes moved each way (`TRAFFIC`).
- A CUDA stream: every device operation marks work as queued; `get_current_stream().synchronize()` and the blocking
  `.get()` drain it. `CheckedIntracomm` is an MPI communicator that counts every call (point-to-point and the
  native collectives, blocking or not, on it and on the communicators split from it) which hands MPI a device
  buffer while device work is still queued — the rule the backend promises to keep (synchronize before MPI).
- `ElementwiseKernel`, for kernels whose statements are plain arithmetic valid in both C and Python: it runs the
  operation text with NumPy, so code that builds fused kernels runs here too. Its types are resolved as CuPy
  resolves them: every array given for one placeholder type (`T`) has one dtype, an array given for a fixed type
  casts to it safely, outputs have their parameter's dtype; anything else is CuPy's `TypeError`. Keyword
  arguments CuPy does not take are refused.
- Host/device copies as CuPy makes them: `set` and `get(out=)` take exactly the array's dtype and shape (and a
  contiguous device array), as CuPy checks. `set` from pinned memory is asynchronous: the copy joins the stream
  and reads the host memory only when the stream reaches it (the next device operation, or a synchronization),
  and it does not keep the host buffer alive. `cuda.alloc_pinned_memory` hands out blocks of a pool that, like
  CuPy's, reuses a block as soon as its last host array is gone — so code that lets a pinned buffer go while a
  copy from it is queued reads the next owner's bytes, as on a GPU.
- Only CuPy's names (`cupy_names.txt`, CuPy 14.2's public names): a NumPy function CuPy lacks is an
  AttributeError, as it would be on the GPU. `runtime.getDeviceCount()` (one GPU of 80 GB, its properties' name and
  totalGlobalMem), `Device(i).use()` and
  `.pci_bus_id`, the current stream's `.ptr`, `x.data.ptr`.

`install()` puts it behind `collectives.backend`, as if CuPy had imported and found a GPU.
"""

from __future__ import annotations

import ctypes
import re
import sys
import types
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from mpi4py import MPI

from collectives.backend import BFLOAT16


@dataclass
class Traffic:
    to_host: int = 0
    to_device: int = 0
    queued: int = 0          # device operations since the last synchronization
    synchronizations: int = 0
    unsynchronized_mpi_calls: int = 0
    device_buffers_given_to_mpi: int = 0
    mpi_calls: dict[str, int] = field(default_factory=dict)  # the checked communicator's buffer calls, by name

    def reset(self) -> None:
        for name, value in vars(self).items():
            if isinstance(value, dict):
                value.clear()
            else:
                setattr(self, name, 0)


TRAFFIC = Traffic()


def _plain(x: Any) -> Any:
    return x.view(np.ndarray) if isinstance(x, DeviceArray) else x


def _on_device(x: Any) -> Any:
    if isinstance(x, np.ndarray) and not isinstance(x, DeviceArray):
        return x.view(DeviceArray)
    if isinstance(x, tuple):
        return tuple(_on_device(item) for item in x)
    return x


def _is_host_array(x: Any) -> bool:
    return isinstance(x, np.ndarray) and not isinstance(x, DeviceArray)


def _holds_host_array(x: Any) -> bool:
    """A host array, at any depth of lists and tuples (CuPy checks the arrays inside sequences too)."""
    if isinstance(x, list | tuple):
        return any(_holds_host_array(item) for item in x)
    return _is_host_array(x)


def _holds_device_array(x: Any) -> bool:
    if isinstance(x, list | tuple):
        return any(_holds_device_array(item) for item in x)
    return isinstance(x, DeviceArray)


def _plain_deep(x: Any) -> Any:
    if isinstance(x, list | tuple):
        return type(x)(_plain_deep(item) for item in x)
    return _plain(x)


def _refuse_batched_bfloat16(operands: tuple) -> None:
    """CuPy 14.2's matmul of bfloat16 operands with a batch dimension takes its integer-kernel path, which has no
    bfloat16 (seen on an H200: TypeError "data type 'E' not understood"); 2-D bfloat16 products go to cuBLAS."""
    if any(getattr(x, "dtype", None) == BFLOAT16 for x in operands) and max(np.ndim(x) for x in operands) > 2:
        raise TypeError("data type 'E' not understood")


class DeviceArray(np.ndarray):
    """Stands in for cupy.ndarray."""

    def __array_ufunc__(self, ufunc: np.ufunc, method: str, *inputs: Any, out: Any = None, **kwargs: Any) -> Any:
        arguments = inputs + (out or ())
        if any(_is_host_array(x) for x in arguments):
            raise TypeError(f"{ufunc.__name__}: a host (NumPy) array mixed with a device array")
        _device_work()
        if ufunc is np.matmul:
            _refuse_batched_bfloat16(inputs)
        if out is not None:
            kwargs["out"] = tuple(_plain(x) for x in out)
        result = getattr(ufunc, method)(*(_plain(x) for x in inputs), **kwargs)
        if out is not None:
            return out[0] if len(out) == 1 else out
        if ufunc is np.matmul and all(getattr(x, "dtype", None) == BFLOAT16 for x in inputs):
            result = result.astype(BFLOAT16)  # ml_dtypes' matmul gives float32, cuBLAS's bfloat16 GEMM bfloat16
        return _on_device(result)

    def __array_function__(self, func: Any, types: Any, args: tuple, kwargs: dict) -> Any:
        """NumPy functions on device arrays run as CuPy's do (real CuPy dispatches them to cupy.*), and refuse a host
        array among their arguments."""
        if _holds_host_array(args) or _holds_host_array(tuple(kwargs.values())):
            raise TypeError(f"numpy.{func.__name__}: a host (NumPy) array mixed with a device array")
        _device_work()
        result = func(*_plain_deep(args), **{key: _plain_deep(value) for key, value in kwargs.items()})
        out = kwargs.get("out")
        return out if out is not None else _on_device(result)

    def argsort(self, *args: Any, **kwargs: Any) -> Any:
        _refuse_unsortable("argsort", self)
        return _on_device(self.view(np.ndarray).argsort(*args, **kwargs))

    def sort(self, *args: Any, **kwargs: Any) -> None:
        _refuse_unsortable("sort", self)
        self.view(np.ndarray).sort(*args, **kwargs)

    def __setitem__(self, key: Any, value: Any) -> None:
        if _is_host_array(value):
            raise TypeError("assigning a host (NumPy) array into a device array: use cupy.asarray first")
        _device_work()
        self.view(np.ndarray)[_index(key)] = _plain(value)

    def __getitem__(self, key: Any) -> Any:
        return _on_device(self.view(np.ndarray)[_index(key)])

    @property
    def data(self) -> types.SimpleNamespace:
        """CuPy's MemoryPointer, as far as the project uses it: the device address `.ptr`."""
        return types.SimpleNamespace(ptr=self.view(np.ndarray).ctypes.data)

    def get(self, stream: Any = None, out: np.ndarray | None = None, blocking: bool = True) -> np.ndarray:
        """Blocking device-to-host copy (CuPy's default), so queued work is drained; `out` as CuPy checks it."""
        _drain()
        TRAFFIC.to_host += self.nbytes
        if out is None:
            return self.view(np.ndarray).copy()
        if not isinstance(out, np.ndarray) or isinstance(out, DeviceArray):
            raise TypeError("Only numpy.ndarray can be obtained from cupy.ndarray")
        if out.dtype != self.dtype:
            raise TypeError(f"{out.dtype} array cannot be obtained from {self.dtype} array")
        if out.shape != self.shape:
            raise ValueError(f"Shape mismatch. Expected shape: {self.shape}, actual shape: {out.shape}")
        if not (out.flags.c_contiguous or out.flags.f_contiguous):
            raise RuntimeError("`out` cannot be specified when copying to non-contiguous ndarray")
        out[...] = self.view(np.ndarray)
        return out

    def set(self, arr: np.ndarray, stream: Any = None) -> None:
        """Host-to-device copy on the current stream, checked as CuPy checks it. From pinned memory the copy is
        queued: it reads `arr`'s memory when the stream reaches it, and does not keep `arr` alive."""
        if not isinstance(arr, np.ndarray) or isinstance(arr, DeviceArray):
            raise TypeError("Only numpy.ndarray can be set to cupy.ndarray")
        if arr.dtype != self.dtype:
            raise TypeError(f"{arr.dtype} array cannot be set to {self.dtype} array")
        if arr.shape != self.shape:
            raise ValueError(f"Shape mismatch. Old shape: {self.shape}, new shape: {arr.shape}")
        if not self.flags.c_contiguous:
            raise RuntimeError("Cannot set to non-contiguous array")
        TRAFFIC.to_device += arr.nbytes
        _device_work()
        if arr.flags.c_contiguous and PINNED.holds(arr):
            _PENDING_COPIES.append((self, arr.ctypes.data, arr.nbytes))
        else:  # pageable memory: CUDA copies it to a staging buffer before the call returns
            self.view(np.ndarray)[...] = arr

    def copy(self, order: str = "C") -> DeviceArray:
        _device_work()
        return self.view(np.ndarray).copy(order).view(DeviceArray)

    def item(self, *args: Any) -> Any:
        _drain()
        return self.view(np.ndarray).item(*args)

    def __float__(self) -> float:
        _drain()
        return float(self.view(np.ndarray))


def _index(key: Any) -> Any:
    """An index for the underlying NumPy array; host index arrays are refused (they would be a hidden transfer)."""
    keys = key if isinstance(key, tuple) else (key,)
    if any(_is_host_array(k) for k in keys):
        raise TypeError("indexing a device array with a host (NumPy) index array: move the indices first")
    plain = tuple(_plain(k) for k in keys)
    return plain if isinstance(key, tuple) else plain[0]


_PENDING_COPIES: list[tuple[DeviceArray, int, int]] = []
"""Host-to-device copies from pinned memory that the stream has not reached: (device array, host address, bytes)."""


def _run_pending_copies() -> None:
    """The stream reaches the queued copies: each reads the host memory at its address now (whoever owns it)."""
    while _PENDING_COPIES:
        target, address, nbytes = _PENDING_COPIES.pop(0)
        source = (ctypes.c_ubyte * nbytes).from_address(address)
        target.view(np.ndarray).reshape(-1).view(np.uint8)[...] = np.frombuffer(source, np.uint8)


def _device_work() -> None:
    """A device operation joins the stream after whatever is queued (stream order), and is queued itself."""
    _run_pending_copies()
    TRAFFIC.queued += 1


def _drain() -> None:
    _run_pending_copies()
    TRAFFIC.queued = 0


class _Stream:
    ptr = 0x57AE  # a handle NCCL calls are queued on (collectives.nccl reads it)

    def synchronize(self) -> None:
        TRAFFIC.synchronizations += 1
        _drain()


class PinnedPool:
    """Page-locked host memory as CuPy's pinned memory pool hands it out: blocks rounded up to 512 bytes, a block
    back in the pool as soon as nothing references its memory object, and the most recently freed block of a size
    handed out first. Blocks are never returned to the system, so a queued copy can still read one."""

    def __init__(self) -> None:
        self._free: dict[int, list[bytearray]] = {}
        self._ranges: list[tuple[int, int]] = []
        self.blocks_reused = 0

    def allocate(self, nbytes: int) -> Any:
        size = max(512, -(-nbytes // 512) * 512)
        free = self._free.setdefault(size, [])
        if free:
            block = free.pop()
            self.blocks_reused += 1
        else:
            block = bytearray(size)
            start = np.frombuffer(block, np.uint8).ctypes.data
            self._ranges.append((start, start + size))
        return PinnedMemory.wrap(block, self)

    def release(self, block: bytearray) -> None:
        self._free.setdefault(len(block), []).append(block)

    def holds(self, array: np.ndarray) -> bool:
        """True when `array`'s memory lies in one of the pool's blocks."""
        start = array.ctypes.data
        return any(low <= start and start + array.nbytes <= high for low, high in self._ranges)


class PinnedMemory:
    """Stands in for cupy.cuda.PinnedMemoryPointer: a buffer that `np.frombuffer` reads (and keeps referenced);
    when the last array over it is gone, its block goes back to the pool."""

    @staticmethod
    def wrap(block: bytearray, pool: PinnedPool) -> Any:
        class Memory(ctypes.c_ubyte * len(block)):  # a buffer NumPy keeps as the base of the arrays over it
            def __del__(self) -> None:
                pool.release(block)

        return Memory.from_buffer(block)


PINNED = PinnedPool()


_STREAM = _Stream()


def asarray(value: Any, dtype: Any = None, order: Any = None) -> DeviceArray:
    if isinstance(value, DeviceArray):
        return value if dtype is None or value.dtype == np.dtype(dtype) else value.astype(dtype)
    host = _NUMPY_ASARRAY(value, dtype=dtype, order=order)
    TRAFFIC.to_device += host.nbytes
    _device_work()
    return host.copy().view(DeviceArray)


def array(value: Any, dtype: Any = None, copy: bool = True) -> DeviceArray:
    if isinstance(value, DeviceArray):
        return asarray(_NUMPY_ARRAY(_plain(value), dtype=dtype, copy=copy), dtype)
    return asarray(value, dtype)


def asnumpy(x: Any) -> np.ndarray:
    return x.get() if isinstance(x, DeviceArray) else _NUMPY_ASARRAY(x)


class ElementwiseKernel:
    """Runs an elementwise kernel's operation with NumPy: statements `name = expression;` whose expressions are
    valid Python once C's math functions are NumPy's. Outputs passed in are written in place. Types are resolved
    as CuPy resolves them (`_resolve_types`)."""

    _MATH = {name: getattr(np, name) for name in ("tanh", "exp", "log", "sqrt", "fabs", "abs", "maximum", "minimum")}
    _OPTIONS = {"reduce_dims", "options", "preamble", "no_return", "return_tuple", "loop_prep", "after_loop"}
    """The keyword arguments cupy.ElementwiseKernel takes besides the four positional ones."""

    def __init__(self, in_params: str, out_params: str, operation: str, name: str = "kernel", **options: Any) -> None:
        unknown = sorted(set(options) - self._OPTIONS)
        if unknown:
            raise TypeError(f"ElementwiseKernel() got unexpected keyword arguments {unknown}")
        self.inputs, self.outputs = _parse_params(in_params), _parse_params(out_params)
        self.statements = [s.strip() for s in operation.split(";") if s.strip()]
        self.name = name

    def __call__(self, *args: Any, size: Any = None, block_size: Any = None, stream: Any = None) -> Any:
        if len(args) not in (len(self.inputs), len(self.inputs) + len(self.outputs)):
            raise TypeError(f"Wrong number of arguments for {self.name}")
        if any(_is_host_array(a) for a in args):
            raise TypeError(f"{self.name}: a host (NumPy) array passed to a device kernel")
        types_of = self._resolve_types(args)
        _device_work()
        names = {**self._MATH, **{n: _typed(a, types_of[n]) for (_, n), a in zip(self.inputs, args, strict=False)}}
        given = list(args[len(self.inputs):])
        names |= {n: _plain(a) for (_, n), a in zip(self.outputs, given, strict=False)}  # outputs are readable too
        for statement in self.statements:
            target, expression = (part.strip() for part in statement.split("=", 1))
            target = re.sub(r"^(T|float|double|const)\s+", "", target)
            names[target] = np.asarray(eval(expression, {"__builtins__": {}}, names))
        shape = np.broadcast_shapes(*(np.shape(_plain(a)) for a in args))
        results = []
        for i, (_, name) in enumerate(self.outputs):
            value = np.broadcast_to(names[name], shape).astype(types_of[name])
            if i < len(given):
                given[i].view(np.ndarray)[...] = value
                results.append(given[i])
            else:
                results.append(value.view(DeviceArray))
        return results[0] if len(results) == 1 else tuple(results)

    def _resolve_types(self, args: tuple) -> dict[str, np.dtype]:
        """Each parameter's dtype, or CuPy's TypeError: the arrays given for one placeholder type share one dtype
        (Python scalars take it), an array given for a fixed type casts to it safely, and output arrays have
        their parameter's dtype."""
        bound: dict[str, np.dtype] = {}
        params = self.inputs + self.outputs
        for (ctype, name), value in zip(params, args, strict=False):
            if not isinstance(value, DeviceArray):
                continue
            fixed = _fixed_dtype(ctype)
            if fixed is not None:
                if not np.can_cast(value.dtype, fixed):
                    raise TypeError(f"Type is mismatched. {name} {value.dtype} {fixed}")
            elif bound.setdefault(ctype, value.dtype) != value.dtype:
                raise TypeError(f"Type is mismatched. {name} {value.dtype} {bound[ctype]} {ctype}")
        resolved = {}
        for ctype, name in params:
            fixed = _fixed_dtype(ctype)
            if fixed is None and ctype not in bound:
                raise TypeError(f"Cannot determine the type of {name} ({ctype}): no array is given for {ctype}")
            resolved[name] = fixed if fixed is not None else bound[ctype]
        return resolved


def _parse_params(text: str) -> list[tuple[str, str]]:
    return [tuple(p.split()[-2:]) for p in text.split(",") if p.strip()]


_FIXED_TYPES = ("bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64", "float16",
                "float32", "float64", "complex64", "complex128")
"""Parameter types that name a dtype; any other name is a placeholder bound by the arrays given for it."""


def _fixed_dtype(ctype: str) -> np.dtype | None:
    """The dtype of a parameter type that names one ("float32"), None for a placeholder ("T")."""
    return np.dtype(ctype) if ctype in _FIXED_TYPES else None


def _typed(value: Any, dtype: np.dtype) -> Any:
    """A kernel argument as the kernel sees it: arrays as they are, Python scalars converted to their parameter's
    dtype (CuPy passes them by value in that C type)."""
    return _plain(value) if isinstance(value, np.ndarray) else dtype.type(value)


def _refuse_unsortable(name: str, x: Any) -> None:
    """CuPy sorts through Thrust, which has no bfloat16 (seen on an H200 with CuPy 14.2: NotImplementedError)."""
    if name in ("sort", "argsort") and getattr(x, "dtype", None) == np.dtype(BFLOAT16):
        raise NotImplementedError("Sorting arrays with dtype 'bfloat16' is not supported")


def _wrapped(function: Any) -> Any:
    def call(*args: Any, **kwargs: Any) -> Any:
        if _holds_host_array(args) and function.__name__ not in _HOST_ARGUMENTS_ALLOWED:
            raise TypeError(f"cupy.{function.__name__}: a host (NumPy) array passed where CuPy needs device arrays")
        if args:
            _refuse_unsortable(function.__name__, args[0])
        if function is np.matmul:
            _refuse_batched_bfloat16(args[:2])
        _device_work()
        plain_args = _plain_deep(args)
        out = kwargs.get("out")
        if out is not None:
            kwargs["out"] = _plain(out)
        result = function(*plain_args, **kwargs)
        if out is None and function is np.matmul and all(getattr(x, "dtype", None) == BFLOAT16 for x in args[:2]):
            result = result.astype(BFLOAT16)  # as the `@` operator's: cuBLAS's bfloat16 GEMM gives bfloat16
        return out if out is not None else _on_device(result)

    call.__name__ = function.__name__
    return call


_HOST_ARGUMENTS_ALLOWED = {"asarray", "array"}


CUPY_NAMES = frozenset(line for line in (Path(__file__).with_name("cupy_names.txt")).read_text().splitlines()
                       if line and not line.startswith("#"))
"""CuPy 14.2's public top-level names: the double offers NumPy's function of a name only if CuPy has the name."""


class _Device:
    """cupy.cuda.Device: the one pretend GPU."""

    def __init__(self, device: int | None = None) -> None:
        self.id = 0 if device is None else device
        if self.id != 0:
            raise RuntimeError(f"cudaErrorInvalidDevice: device {self.id} (the double has one GPU)")

    def use(self) -> None:
        pass

    @property
    def pci_bus_id(self) -> str:
        return "0000:00:00.0"


def _standard_normal(size: Any = None, dtype: Any = np.float64) -> DeviceArray:
    """cupy.random.standard_normal: float32 or float64 only, as CuPy's generator draws."""
    if np.dtype(dtype) not in (np.dtype(np.float32), np.dtype(np.float64)):
        raise TypeError(f"cupy.random.standard_normal: dtype must be float32 or float64, not {np.dtype(dtype)}")
    _device_work()
    return _on_device(np.random.default_rng().standard_normal(size, dtype=dtype))


def _module() -> types.ModuleType:
    module = types.ModuleType("fake_cupy")
    module.ndarray = DeviceArray
    module.asarray, module.array, module.asnumpy = asarray, array, asnumpy
    module.ElementwiseKernel = ElementwiseKernel
    module.fuse = lambda *a, **k: (lambda f: f)
    module.random = types.SimpleNamespace(standard_normal=_standard_normal)  # cupy.random's draws, on the device

    module.__version__ = "0 (test double)"
    runtime = types.SimpleNamespace(getDeviceCount=lambda: 1,
                                    getDeviceProperties=lambda i: {"name": b"Fake GPU", "totalGlobalMem": 80 * 10**9})
    module.cuda = types.SimpleNamespace(
        runtime=runtime,
        get_current_stream=lambda: _STREAM,
        alloc_pinned_memory=PINNED.allocate,
        Device=_Device,
    )

    def numpy_attribute(name: str) -> Any:
        if name not in CUPY_NAMES:
            raise AttributeError(f"module 'cupy' has no attribute {name!r} (NumPy has it; CuPy 14.2 does not)")
        value = getattr(np, name)
        return _wrapped(value) if callable(value) and not isinstance(value, type) else value

    module.__getattr__ = numpy_attribute
    return module


FAKE = _module()


_NUMPY_ASARRAY, _NUMPY_ARRAY = np.asarray, np.array


def _implicit_conversion_refused(convert: Any) -> Any:
    def strict(value: Any, *args: Any, **kwargs: Any) -> np.ndarray:
        if _holds_device_array(value):
            raise TypeError(f"numpy.{convert.__name__} of a device array: implicit conversion to a NumPy array is "
                            f"not allowed (CuPy); use .get() or cupy.asnumpy, which count the transfer")
        return convert(value, *args, **kwargs)

    strict.__name__ = convert.__name__
    return strict


def install() -> types.ModuleType:
    """Make `collectives.backend` see this double as CuPy with one GPU, and NumPy refuse to convert its arrays
    implicitly (np.asarray, np.array: callers that must undo it, as a test fixture, save them first); returns
    the fake module."""
    from collectives import backend

    np.asarray, np.array = _implicit_conversion_refused(_NUMPY_ASARRAY), _implicit_conversion_refused(_NUMPY_ARRAY)

    backend._cupy = FAKE
    backend._CUPY_IMPORT_ERROR = ""
    backend.HostStaging.possible = True
    backend.cuda_aware_mpi.cache_clear()
    sys.modules["cupyx"] = types.SimpleNamespace(scatter_add=_scatter_add)
    return FAKE


def _scatter_add(target: DeviceArray, indices: Any, values: Any) -> None:
    _device_work()
    np.add.at(_plain(target), _plain(indices), _plain(values))


class CheckedIntracomm(MPI.Intracomm):
    """COMM_WORLD's twin that counts MPI calls given a device buffer while device work is still queued: every
    point-to-point and collective call (blocking and nonblocking), on it and on the communicators made from it."""

    def _inspect(self, *buffers: Any) -> None:
        """Count the device buffers among one call's arguments, and the call if any is given with work queued."""
        arrays = [spec[0] if isinstance(spec, list | tuple) and spec else spec for spec in buffers]
        on_device = sum(isinstance(array, DeviceArray) for array in arrays)
        TRAFFIC.device_buffers_given_to_mpi += on_device
        if on_device and TRAFFIC.queued:
            TRAFFIC.unsynchronized_mpi_calls += 1


_BUFFER_CALLS = ("Send", "Ssend", "Bsend", "Rsend", "Recv", "Sendrecv", "Sendrecv_replace", "Bcast", "Gather",
                 "Gatherv", "Scatter", "Scatterv", "Allgather", "Allgatherv", "Alltoall", "Alltoallv", "Alltoallw",
                 "Reduce", "Allreduce", "Reduce_scatter_block", "Reduce_scatter", "Scan", "Exscan")
_MADE_FROM = ("Split", "Split_type", "Dup", "Create", "Create_group")


def _checked_call(name: str) -> Any:
    def call(self: CheckedIntracomm, *args: Any, **kwargs: Any) -> Any:
        self._inspect(*args, *kwargs.values())
        TRAFFIC.mpi_calls[name] = TRAFFIC.mpi_calls.get(name, 0) + 1
        return getattr(super(CheckedIntracomm, self), name)(*args, **kwargs)

    call.__name__ = name
    return call


def _checked_maker(name: str) -> Any:
    def make(self: CheckedIntracomm, *args: Any, **kwargs: Any) -> Any:
        made = getattr(super(CheckedIntracomm, self), name)(*args, **kwargs)
        return CheckedIntracomm(made) if isinstance(made, MPI.Intracomm) and made != MPI.COMM_NULL else made

    make.__name__ = name
    return make


for _name in _BUFFER_CALLS:  # the blocking call and its nonblocking twin (Isend, Iallreduce, …)
    for _variant in (_name, "I" + _name[0].lower() + _name[1:]):
        if hasattr(MPI.Intracomm, _variant):
            setattr(CheckedIntracomm, _variant, _checked_call(_variant))
for _name in _MADE_FROM:
    if hasattr(MPI.Intracomm, _name):
        setattr(CheckedIntracomm, _name, _checked_maker(_name))
