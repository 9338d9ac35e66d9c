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
  operation text with NumPy, so code that builds fused kernels runs here too.
- `cuda.alloc_pinned_memory` (plain host memory), `runtime.getDeviceCount()` (one GPU), `Device(i).use()`.

`install()` puts it behind `collectives.backend`, as if CuPy had imported and found a GPU.
"""

from __future__ import annotations

import re
import sys
import types
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from mpi4py import MPI


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


class DeviceArray(np.ndarray):
    """Stands in for cupy.ndarray."""

    def __array_ufunc__(self, ufunc: np.ufunc, method: str, *inputs: Any, out: Any = None, **kwargs: Any) -> Any:
        arguments = inputs + (out or ())
        if any(_is_host_array(x) for x in arguments):
            raise TypeError(f"{ufunc.__name__}: a host (NumPy) array mixed with a device array")
        TRAFFIC.queued += 1
        if out is not None:
            kwargs["out"] = tuple(_plain(x) for x in out)
        result = getattr(ufunc, method)(*(_plain(x) for x in inputs), **kwargs)
        if out is not None:
            return out[0] if len(out) == 1 else out
        return _on_device(result)

    def __array_function__(self, func: Any, types: Any, args: tuple, kwargs: dict) -> Any:
        """NumPy functions on device arrays run as CuPy's do (real CuPy dispatches them to cupy.*), and refuse a host
        array among their arguments."""
        if _holds_host_array(args) or _holds_host_array(tuple(kwargs.values())):
            raise TypeError(f"numpy.{func.__name__}: a host (NumPy) array mixed with a device array")
        TRAFFIC.queued += 1
        result = func(*_plain_deep(args), **{key: _plain_deep(value) for key, value in kwargs.items()})
        out = kwargs.get("out")
        return out if out is not None else _on_device(result)

    def __setitem__(self, key: Any, value: Any) -> None:
        if _is_host_array(value):
            raise TypeError("assigning a host (NumPy) array into a device array: use cupy.asarray first")
        TRAFFIC.queued += 1
        self.view(np.ndarray)[_index(key)] = _plain(value)

    def __getitem__(self, key: Any) -> Any:
        return _on_device(self.view(np.ndarray)[_index(key)])

    def get(self, stream: Any = None, out: np.ndarray | None = None) -> np.ndarray:
        """Blocking device-to-host copy (CuPy's default), so queued work is drained."""
        _drain()
        TRAFFIC.to_host += self.nbytes
        if out is None:
            return self.view(np.ndarray).copy()
        out[...] = self.view(np.ndarray)
        return out

    def set(self, host: np.ndarray) -> None:
        TRAFFIC.to_device += host.nbytes
        TRAFFIC.queued += 1
        self.view(np.ndarray)[...] = host

    def copy(self, order: str = "C") -> DeviceArray:
        TRAFFIC.queued += 1
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


def _drain() -> None:
    TRAFFIC.queued = 0


class _Stream:
    def synchronize(self) -> None:
        TRAFFIC.synchronizations += 1
        _drain()


_STREAM = _Stream()


def asarray(value: Any, dtype: Any = None, order: Any = None) -> DeviceArray:
    if isinstance(value, DeviceArray):
        return value if dtype is None or value.dtype == np.dtype(dtype) else value.astype(dtype)
    host = _NUMPY_ASARRAY(value, dtype=dtype, order=order)
    TRAFFIC.to_device += host.nbytes
    TRAFFIC.queued += 1
    return host.copy().view(DeviceArray)


def array(value: Any, dtype: Any = None, copy: bool = True) -> DeviceArray:
    if isinstance(value, DeviceArray):
        return asarray(_NUMPY_ARRAY(_plain(value), dtype=dtype, copy=copy), dtype)
    return asarray(value, dtype)


def asnumpy(x: Any) -> np.ndarray:
    return x.get() if isinstance(x, DeviceArray) else _NUMPY_ASARRAY(x)


class ElementwiseKernel:
    """Runs an elementwise kernel's operation with NumPy: statements `name = expression;` whose expressions are
    valid Python once C's math functions are NumPy's. Outputs passed in are written in place."""

    _MATH = {name: getattr(np, name) for name in ("tanh", "exp", "log", "sqrt", "fabs", "abs", "maximum", "minimum")}

    def __init__(self, in_params: str, out_params: str, operation: str, name: str = "kernel", **_: Any) -> None:
        self.inputs = [p.split()[-1] for p in in_params.split(",") if p.strip()]
        self.outputs = [p.split()[-1] for p in out_params.split(",") if p.strip()]
        self.statements = [s.strip() for s in operation.split(";") if s.strip()]
        self.name = name

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if len(args) not in (len(self.inputs), len(self.inputs) + len(self.outputs)):
            raise TypeError(f"{self.name}: {len(args)} arguments for {len(self.inputs)} inputs")
        if any(_is_host_array(a) for a in args):
            raise TypeError(f"{self.name}: a host (NumPy) array passed to a device kernel")
        TRAFFIC.queued += 1
        names = {**self._MATH, **{n: _plain(a) for n, a in zip(self.inputs, args, strict=False)}}
        given = list(args[len(self.inputs):])
        names |= {n: _plain(a) for n, a in zip(self.outputs, given, strict=False)}  # outputs are readable too
        for statement in self.statements:
            target, expression = (part.strip() for part in statement.split("=", 1))
            target = re.sub(r"^(T|float|double|const)\s+", "", target)
            names[target] = np.asarray(eval(expression, {"__builtins__": {}}, names))
        results = []
        for i, name in enumerate(self.outputs):
            value = names[name]
            if i < len(given):
                given[i].view(np.ndarray)[...] = value
                results.append(given[i])
            else:
                shape = np.broadcast_shapes(*(np.shape(_plain(a)) for a in args[:len(self.inputs)]))
                dtype = next((a.dtype for a in args if isinstance(a, np.ndarray)), np.float64)
                results.append(np.broadcast_to(value, shape).astype(dtype).view(DeviceArray))
        return results[0] if len(results) == 1 else tuple(results)


def _wrapped(function: Any) -> Any:
    def call(*args: Any, **kwargs: Any) -> Any:
        if _holds_host_array(args) and function.__name__ not in _HOST_ARGUMENTS_ALLOWED:
            raise TypeError(f"cupy.{function.__name__}: a host (NumPy) array passed where CuPy needs device arrays")
        TRAFFIC.queued += 1
        plain_args = _plain_deep(args)
        out = kwargs.get("out")
        if out is not None:
            kwargs["out"] = _plain(out)
        result = function(*plain_args, **kwargs)
        return out if out is not None else _on_device(result)

    call.__name__ = function.__name__
    return call


_HOST_ARGUMENTS_ALLOWED = {"asarray", "array"}


def _module() -> types.ModuleType:
    module = types.ModuleType("fake_cupy")
    module.ndarray = DeviceArray
    module.asarray, module.array, module.asnumpy = asarray, array, asnumpy
    module.ElementwiseKernel = ElementwiseKernel
    module.fuse = lambda *a, **k: (lambda f: f)

    module.__version__ = "0 (test double)"
    runtime = types.SimpleNamespace(getDeviceCount=lambda: 1, getDeviceProperties=lambda i: {"name": b"Fake GPU"})
    module.cuda = types.SimpleNamespace(
        runtime=runtime,
        get_current_stream=lambda: _STREAM,
        alloc_pinned_memory=lambda nbytes: bytearray(max(nbytes, 1)),
        Device=lambda index=0: types.SimpleNamespace(use=lambda: None, id=index),
    )

    def numpy_attribute(name: str) -> Any:
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
    TRAFFIC.queued += 1
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
