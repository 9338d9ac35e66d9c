"""Real CuPy's own checks of our fused kernels, run without a GPU: its type resolution and its NVRTC compilation.

CuPy 14 imports on a machine without a GPU; what needs a device is launching. Two steps before the launch do
not, and they are where a kernel call is rejected or a kernel fails to build:

- **Type resolution** (`resolve_types`): `cupy.ElementwiseKernel._decide_params_type(in_types, out_types)` is the
  method `ElementwiseKernel.__call__` runs on the arguments' types (`a.dtype.type` for an array, None for a
  Python scalar) before it allocates or launches anything. It raises CuPy's own `TypeError("Type is mismatched.
  …")` for a call that mixes dtypes under one placeholder — the error a GPU run would hit.
- **Compilation** (`compile_kernel`): the CUDA source CuPy generates for a kernel and its argument types
  (`cupy._core._kernel._get_elementwise_kernel_code`, fed `_ArgInfo` records of the arguments, as `__call__`
  builds them from the arrays), preceded by CuPy's headers (`cupy._core.core._cupy_header_list`), compiled by
  NVRTC with CuPy's compiler options (`cupy._core.core.assemble_cupy_compiler_options`) for an explicit
  architecture (`cupy.cuda.compiler._NVRTCProgram`). CuPy's public compile path asks the device for its
  architecture, so it cannot run here; these internals are the same path minus that question.

These are CuPy internals (underscored names) of CuPy 14.2: if a CuPy release renames them, this module is what
breaks, loudly, and the GPU check (scripts/gpu_check.sh) still runs the kernels for real.
"""

from __future__ import annotations

import io
from typing import Any

import numpy as np

from models.kernels import FusedKernel

ARG_KIND_NDARRAY, ARG_KIND_INDEXER, ARG_KIND_SCALAR = 1, 2, 3
"""cupy._core._kernel's _ArgKind enumeration (ARG_KIND_NDARRAY = 1, then INDEXER, SCALAR)."""


def real_elementwise_kernel(cupy: Any, kernel: FusedKernel) -> Any:
    """The cupy.ElementwiseKernel our kernel builds on a GPU (the same declarations, source and name)."""
    return cupy.ElementwiseKernel(*kernel.declarations(), kernel.cuda_source(), f"mpiparallel_{kernel.name}")


def resolve_types(cupy: Any, kernel: FusedKernel, inputs: list[str | None], outputs: list[str]) -> tuple:
    """CuPy's type resolution of one call: `inputs` are the arguments' dtype names (None for a Python scalar),
    `outputs` the dtype names of the output arrays passed (none: CuPy allocates them). Returns CuPy's (input
    types, output types, type map); raises CuPy's TypeError where a GPU run would."""
    element_wise = real_elementwise_kernel(cupy, kernel)
    return element_wise._decide_params_type(tuple(_scalar_type(name) for name in inputs),
                                            tuple(_scalar_type(name) for name in outputs))


def _scalar_type(name: str | None) -> Any:
    return None if name is None else np.dtype(name).type


def compile_kernel(cupy: Any, kernel: FusedKernel, inputs: list[str | None], architecture: str) -> str:
    """Compile the CUDA source CuPy generates for a call with these input types (dtype names; None for a Python
    scalar, whose C type is its parameter's) for `architecture` ("sm_90"); returns NVRTC's log (empty when
    clean); raises cupy.cuda.compiler.CompileException on an error."""
    from cupy._core import _carray, _kernel, core
    from cupy.cuda import compiler

    element_wise = real_elementwise_kernel(cupy, kernel)
    in_types, out_types, type_map = resolve_types(cupy, kernel, inputs, [])
    arguments = [_argument(name, resolved) for name, resolved in zip(inputs, in_types, strict=True)]
    arguments += [_argument(np.dtype(resolved).name, resolved) for resolved in out_types]
    arguments.append(_kernel._ArgInfo(ARG_KIND_INDEXER, _carray.Indexer, None, 1, True, True))
    source = _kernel._get_elementwise_kernel_code(tuple(arguments), type_map, element_wise.params,
                                                  element_wise.operation, element_wise.name, element_wise.preamble)
    headers = "".join(f"#include <{header}>\n" for header in core._cupy_header_list)
    program = compiler._NVRTCProgram(headers + source, f"{element_wise.name}.cu")
    log = io.StringIO()
    options = core.assemble_cupy_compiler_options(()) + (f"-arch=compute_{architecture.removeprefix('sm_')}",)
    program.compile(options, log_stream=log)
    return log.getvalue()


def _argument(name: str | None, resolved: Any) -> Any:
    """The _ArgInfo record CuPy makes of one argument: a contiguous 1-d array (CuPy reduces contiguous arguments
    to one dimension) or a scalar of its resolved type."""
    from cupy._core import _kernel

    dtype = np.dtype(resolved)
    if name is None:
        return _kernel._ArgInfo(ARG_KIND_SCALAR, dtype.type, dtype, 0, True, True)
    return _kernel._ArgInfo(ARG_KIND_NDARRAY, cupy_ndarray(), dtype, 1, True, True)


def cupy_ndarray() -> type:
    import cupy

    return cupy.ndarray


def fused_kernels() -> dict[str, FusedKernel]:
    """Every fused kernel the models and the optimizer use, by name."""
    from models import kernels

    return {value.name: value for value in vars(kernels).values() if isinstance(value, FusedKernel)}
