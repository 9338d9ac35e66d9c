"""The kernels of models.kernels compiled for the CPU by the system's C compiler, called through ctypes.

Why: the CPU's layers are NumPy chains — LayerNorm, RMSNorm and AdamW seven to eleven operations, GELU seven,
SwiGLU six, the attention's softmax six, the cross-entropy eleven, RoPE five — each a pass over its arrays, where
PyTorch runs one C++ loop that reads each input once. The profile (scripts/profile_step.py) showed each at
0.28–0.8× torch's speed; no arrangement of NumPy calls closes that (row broadcasts alone cost two to three times a
plain pass, and a pass over a strided view pays NumPy's per-row cost). Most of these kernels are already written,
as text, for the GPU (models.kernels), the norms' the same way (kernels.RowKernel) — so the CPU compiles that text,
one loop per kernel. What text cannot say is written out here, in C, as short loops: the causal softmax and the
cross-entropy (a mask by row and column, a gather by target), the embedding's gather and its gradients' scatter,
RoPE's turn of every head's rows at their positions.

How: a FusedKernel's `statements` become the body of a C loop over rows × columns. Each argument is, at the call,
one of five layouts: a full array (one element per row and column, C-contiguous), a strided one (a full array
whose rows are evenly spaced further apart: one half of SwiGLU's [gate | up] input, read and written in place), a
row vector (one per row: a LayerNorm's mean, shape (..., 1)), a column vector (one per column: its weight, shape
(C,)) or a scalar (a Python number). Row vectors and scalars are read once per row, every input element before
any output element is written — so an output may be the very array of its input (the kernels' `in_place` pairs).
`#pragma omp simd` tells the compiler that much, and it vectorizes the loop. A RowKernel becomes one loop per
phase inside the loop over rows: a row sum is a reduction loop (`omp simd reduction`: vector accumulators), a
column sum adds into an output zeroed before the first row; the row, a few KiB, stays in the L1 cache from one
phase to the next. `run_many` runs an elementwise kernel over many arrays in one call (`<name>_many`, a loop over
the single-array function), for AdamW's dozens of parameters. A library is built per kernel, dtype and layout,
with `cc -O3 -march=native -ffp-contract=off -fno-math-errno -fopenmp-simd`, once per machine: it is kept in
$MPIPARALLEL_KERNEL_CACHE (default ~/.cache/mpiparallel/kernels) under a hash of its source, the compiler (its
file, size and time), the flags and the CPU, written under a temporary name and renamed, so ranks that build it
at the same time never load half a file.

Calls: in a training step the interpreter runs with cold caches (every GEMM evicts them), where each Python
operation costs several times what it does warm — a compiled call's checks once cost more than its loop. So a
call's plan is kept per argument layout (`_CALLS`), the arrays go to C as the objects themselves (C reads each
one's data pointer, `_objects_source`), and MPIPARALLEL_HOST_KERNELS is read once.

Numbers: T is float or double and C evaluates float ⊕ float in float (x86-64 and arm64: FLT_EVAL_METHOD 0); a
literal is cast to T, as NumPy casts a Python float next to a float32 array; -ffp-contract=off keeps a·b + c two
roundings, as NumPy's two passes round it; + − × ÷ and sqrt are correctly rounded in both. So an elementwise
kernel whose statements follow the NumPy chain operation by operation gives the chain's numbers bit for bit —
AdamW's step, RoPE, the embedding's gradient scatter and GELU's and SwiGLU's backward (from the same kept values)
are the same compiled or not. The norms' row kernels add each row's numbers in another order than the chains'
GEMVs with ones do, so there the two agree to rounding (about 1e-16 relative in float64, 1e-7 in float32), as
any two BLAS builds would; so do the softmax's and cross-entropy's sums. tanh and exp are not correctly rounded:
the loops call glibc's vector versions (libmvec, within 4 ulp by its documentation; `#pragma omp declare simd` on
the function lets the compiler call them), NumPy its own SIMD ones, so GELU's and SwiGLU's forward, the softmax
and the cross-entropy agree with the chains to a few ulp.

When it does not run: no C compiler (`cc`, or $CC), a build that fails (the kernels that call tanh or exp also
without glibc's libmvec: macOS, musl, glibc before 2.35 for tanh), `MPIPARALLEL_HOST_KERNELS=0`, a dtype other than
float32/float64 (bfloat16 work stays NumPy), arrays in none of the layouts. The call then returns None or False
and the caller runs its NumPy chain: the same math, slower. `status()` says which, and why;
`scripts/bench_train.py` prints it.

Communication: none.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import operator
import os
import platform
import re
import shlex
import shutil
import subprocess
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from . import kernels
from .kernels import LOCAL_TYPE, ROW_LENGTH, FusedKernel, RowKernel

Kernel = FusedKernel | RowKernel

C_TYPES = {np.dtype(np.float32): "float", np.dtype(np.float64): "double"}
FLAGS = ("-O3", "-march=native", "-ffp-contract=off", "-fno-math-errno", "-fopenmp-simd", "-fPIC", "-shared")
"""-march=native: the library is built where it runs (the cache key holds the CPU); -ffp-contract=off: no fused
multiply-adds (see the module docstring); -fno-math-errno: sqrt may be the vector instruction; -fopenmp-simd:
honour `#pragma omp simd` without OpenMP's runtime."""
FULL, ROW, COLUMN, SCALAR, STRIDED = "full", "row", "column", "scalar", "strided"
"""The layouts of a call's arguments (module docstring); STRIDED: a full array whose rows are evenly spaced further
apart than their length — one half of SwiGLU's [gate | up] input, a column slice of a contiguous array."""
LOOP_NAMES = {"rows", "row", "column", "width"}
"""The generated loops' own names, which a kernel's variables may not take."""
CACHE_VARIABLE = "MPIPARALLEL_KERNEL_CACHE"
_LITERAL_TOKEN = re.compile(r"(?<![A-Za-z0-9_.])([0-9]+\.[0-9]*(?:[eE][+-]?[0-9]+)?)")


ENABLED = os.environ.get("MPIPARALLEL_HOST_KERNELS", "1") != "0"
"""False when the process starts with MPIPARALLEL_HOST_KERNELS=0: the NumPy chains everywhere, to compare or to
rule the kernels out. Read once, at import: in a training step a look-up in os.environ (six Python frames) costs
about 50 µs, as much as the rest of a compiled call's checks (see `_CALLS`). Tests set it here."""


def enabled() -> bool:
    """Whether the compiled kernels may run (`ENABLED`)."""
    return ENABLED


def run(kernel: Kernel, **arrays: Any) -> dict[str, np.ndarray] | None:
    """Run `kernel` on NumPy arrays in one compiled pass; outputs passed are written, the others allocated (a
    RowKernel's per-row outputs with shape (..., 1)).

    Returns {output name: array}, or None when the compiled kernel cannot run here (see the module docstring) and
    the caller should run its NumPy chain instead.
    """
    if not ENABLED:
        return None
    key = (kernel, *[(name, value.shape, value.strides, value.dtype) if type(value) is np.ndarray
                     else (name, type(value)) for name, value in arrays.items()],
           *[arrays[name].flags.writeable for name in kernel.output_names if name in arrays])  # (outputs given)
    call = _CALLS.get(key)
    if call is None:
        call = _CALLS[key] = _call(kernel, arrays)
        if len(_CALLS) > MAX_CALLS:  # shapes that keep changing (a sampler's growing context): start over
            _CALLS.clear()
    if call is _CANNOT:
        return None
    function, read_inputs, leading, dtype, new_outputs, outputs, strides = call
    results = {name: arrays[name] if name in arrays else np.empty(new_outputs[name], dtype) for name in outputs}
    # arrays go as the objects themselves (C reads their data pointers); ctypes turns a scalar into a double
    function(*leading, *read_inputs(arrays), *[results[name] for name in outputs], *strides)
    return results


_CALLS: dict[tuple, Any] = {}
"""What a call of these arguments needs (`_call`), by kernel, each argument's name, shape, strides and dtype (or
type, for a scalar) and the writability of the outputs given — all that decides whether and how the compiled loop
takes them. Why: in a training step the interpreter runs with cold caches (each GEMM before a norm evicts them),
where the checks below cost about 140 µs a call against 17 µs warm; a dictionary look-up replaces most of them."""
MAX_CALLS = 4096
_CANNOT = "cannot"


def _call(kernel: Kernel, arrays: Mapping[str, Any]) -> Any:
    """(function, what reads the inputs from the call's arguments in order, rows and width, dtype, the shapes of
    the outputs to allocate, output names, the row strides of the STRIDED arguments) for `run`, or _CANNOT."""
    inputs, outputs = _names(kernel)
    call = _plan(kernel, inputs, outputs, arrays)
    if call is None:
        return _CANNOT
    dtype, shape, layouts, strided_outputs = call
    function = _function(kernel, dtype, layouts, strided_outputs=strided_outputs)
    if function is None:
        return _CANNOT
    new_outputs = {name: _output_shape(kernel, name, shape) for name in outputs if name not in arrays}
    strided = [name for name, layout in zip(inputs, layouts, strict=True) if layout == STRIDED]
    strides = tuple(_row_stride(arrays[name]) for name in [*strided, *strided_outputs])  # fixed by the key
    read_inputs = operator.itemgetter(*inputs) if len(inputs) > 1 else lambda given: (given[inputs[0]],)
    return function, read_inputs, (_rows(shape), shape[-1]), dtype, new_outputs, outputs, strides


def run_many(kernel: FusedKernel, scalars: Mapping[str, float], tensors: Sequence[Mapping[str, np.ndarray]]
             ) -> bool:
    """Run an elementwise `kernel` over several sets of arrays in one compiled call; True when it ran.

    `tensors` holds, per set, every array input and every output (each set one size, all contiguous, all of one
    dtype; outputs writable, in place where an output is its input's array), `scalars` the scalar inputs all sets
    share. Why: an optimizer calls its kernel once per parameter, and Python's cost per call (about 50 µs) is
    more than the kernel's own time for most of a small model's parameters. False, with nothing written, where
    the compiled kernel cannot take them all: the caller then runs each set its own way.
    """
    if not ENABLED or not tensors:
        return False
    inputs, outputs = _names(kernel)
    arrays = [name for name in inputs if name not in scalars] + list(outputs)
    if not inputs or any(name not in inputs for name in scalars):
        return False
    dtype = getattr(tensors[0].get(arrays[0]), "dtype", None)
    if dtype not in C_TYPES:
        return False
    sizes, addresses = [], {name: [] for name in arrays}
    for tensor in tensors:
        size = getattr(tensor.get(arrays[0]), "size", 0)
        if size == 0 or set(tensor) != set(arrays):
            return False
        known: dict[int, int] = {}  # an output that is its input's array: one address
        for name in arrays:
            array = tensor[name]
            if id(array) not in known:
                if not (isinstance(array, np.ndarray) and array.dtype == dtype and array.size == size
                        and array.flags.c_contiguous and (array.flags.writeable or name in inputs)):
                    return False
                known[id(array)] = _address(array)
            elif name in outputs and not array.flags.writeable:
                return False
            addresses[name].append(known[id(array)])
        sizes.append(size)
    layouts = tuple(SCALAR if name in scalars else FULL for name in inputs)
    function = _function(kernel, dtype, layouts, many=True)
    if function is None:
        return False
    count = len(tensors)
    lists = {name: (ctypes.c_void_p * count)(*values) for name, values in addresses.items()}
    function(count, (ctypes.c_long * count)(*sizes),
             *(float(scalars[name]) if name in scalars else lists[name] for name in inputs),
             *(lists[name] for name in outputs))
    return True


def embed(tokens: np.ndarray, table: np.ndarray, positions: np.ndarray | None = None,
          position_table: np.ndarray | None = None) -> np.ndarray | None:
    """table[tokens] (+ position_table[positions]) as a new (…, width) array, in one compiled pass over its rows;
    None where the loop cannot take the call.

    `positions` gives each token its position, as NumPy broadcasts them: a window's positions (T,) serve every row
    of the (B, T) tokens; packed documents give one per token (B, T). Why: NumPy gathers
    the token rows into a new array, then adds the position rows in a second pass over it. None, nothing
    returned, for what the loop cannot take: tables not contiguous or of unlike dtypes, an index outside its
    table (NumPy's IndexError, or its wrap-around of negative indices, is the caller's)."""
    position_table = table if position_table is None else position_table  # (no position rows: never read)
    tokens, positions = np.asarray(tokens), None if positions is None else np.asarray(positions)
    if not (ENABLED and table.ndim == 2 and table.dtype in C_TYPES and table.flags.c_contiguous and tokens.size
            and position_table.dtype == table.dtype and position_table.flags.c_contiguous
            and _integers(tokens, positions) and _positions_fit(tokens, positions)):
        return None
    function = _embedding_function(table.dtype, "embed_rows")
    if function is None:
        return None
    tokens = np.ascontiguousarray(tokens, dtype=np.int64)
    out = np.empty((*tokens.shape, table.shape[1]), table.dtype)
    indices = _NO_POSITIONS if positions is None else np.ascontiguousarray(positions, dtype=np.int64)
    if function(tokens.size, table.shape[1], tokens, table.shape[0], table, indices.size, indices,
                position_table.shape[0], position_table, out) != 0:
        return None
    return out


def scatter_add_rows(target: np.ndarray, indices: np.ndarray, values: np.ndarray, positions: np.ndarray | None = None,
                     position_target: np.ndarray | None = None) -> bool:
    """target[indices[i], :] += values[i, :] for every i in order (and position_target[position of i] += values[i]
    in the same pass, when given: `positions` as `embed` takes them), in one compiled loop; True when it ran.

    An embedding's gradient: B·T rows of d(x) added into the rows of their tokens, repeated tokens accumulating.
    The same additions in the same order as `np.add.at`, so the same numbers bit for bit — about five times
    faster than its 1-D fast path at GPT-2's widths. False, nothing written, where the loop cannot take the call
    (not contiguous, unlike dtypes, an index outside the table: NumPy's error or wrap-around is the caller's)."""
    position_target = target if position_target is None else position_target  # (no positions: never written)
    indices, positions = np.asarray(indices), None if positions is None else np.asarray(positions)
    if not (ENABLED and target.ndim == 2 and target.dtype in C_TYPES and target.flags.c_contiguous
            and target.flags.writeable and position_target.dtype == target.dtype
            and position_target.flags.c_contiguous and position_target.flags.writeable):
        return False
    width = target.shape[1]
    if values.size != indices.size * width or values.dtype != target.dtype or not values.flags.c_contiguous:
        return False
    if not (_integers(indices, positions) and _positions_fit(indices, positions)):
        return False
    function = _embedding_function(target.dtype, "scatter_add_rows")
    if function is None or indices.size == 0:
        return False
    rows = np.ascontiguousarray(indices, dtype=np.int64)
    positions = _NO_POSITIONS if positions is None else np.ascontiguousarray(positions, dtype=np.int64)
    return function(rows.size, width, rows, target.shape[0], values, target, positions.size, positions,
                    position_target.shape[0], position_target) == 0


_NO_POSITIONS = np.empty(0, np.int64)


def _objects_library(dtype: np.dtype, name: str, lines: list[str]) -> str | None:
    """The source of a hand-written library whose functions take arrays as objects: T, DATA(object) for an array's
    data pointer (`_data_offset`), then `lines`; None, the reason kept under `name`, where the pointer is not
    found."""
    offset = _data_offset()
    if offset is None:
        _FAILURES[name] = "NumPy's array object does not keep its data pointer after the object header"
        return None
    return "\n".join([f"typedef {C_TYPES[np.dtype(dtype)]} T;", _data_macro(offset), "", *lines])


def _load_refusing(name: str, symbol: str, source: str | None, argtypes: list[Any]) -> Any:
    """`_load` for a hand-written function that returns 0 when done and 1 when it refused its arguments, having
    written nothing; None where `source` is (see `_objects_library`)."""
    function = None if source is None else _load(name, symbol, source, argtypes)
    if function is not None:
        function.restype = ctypes.c_long
    return function


def _data_macro(offset: int) -> str:
    return f"#define DATA(object) (*(void *const *)((const char *)(object) + {offset}))"


def _positions_fit(tokens: np.ndarray, positions: np.ndarray | None) -> bool:
    """Whether `positions` gives each token one position as NumPy's broadcasting would: one per token, or one per
    column shared by every row (anything else NumPy refuses, or the caller meant something else)."""
    return positions is None or positions.shape == tokens.shape or positions.shape == tokens.shape[-1:]


def _integers(*indices: np.ndarray | None) -> bool:
    """Whether every index array given is of integers (the loops take them as int64; NumPy refuses floats)."""
    return all(array is None or array.dtype.kind in "iu" for array in indices)


@functools.cache
def _embedding_function(dtype: np.dtype, symbol: str) -> Any:
    """`embed_rows` or `scatter_add_rows` for `dtype`, from one library. Both check every index before they
    write (return 1, nothing done, when one is outside its table) and take the arrays as objects
    (`_objects_source`)."""
    source = _objects_library(dtype, "embedding", [
        "/* 1 when every one of count indices is in [0, size) */",
        "static int within(const long *indices, long count, long size) {",
        "    long outside = 0;",
        "    for (long i = 0; i < count; i++) outside |= indices[i] < 0 || indices[i] >= size;",
        "    return !outside;",
        "}", "",
        "long embed_rows(long rows, long width, const void *tokens_object, long vocab, const void *table_object,",
        "                long period, const void *positions_object, long length, const void *position_table_object,",
        "                const void *out_object) {",
        "    const long *tokens = DATA(tokens_object), *positions = DATA(positions_object);",
        "    const T *table = DATA(table_object), *position_table = DATA(position_table_object);",
        "    T *out = DATA(out_object);",
        "    if (!within(tokens, rows, vocab) || !within(positions, period, length)) return 1;",
        "    for (long row = 0; row < rows; row++) {",
        "        const T *token = table + tokens[row] * width;",
        "        T *x = out + row * width;",
        "        if (period == 0) {",
        "            #pragma omp simd",
        "            for (long column = 0; column < width; column++) x[column] = token[column];",
        "        } else {",
        "            const T *position = position_table + positions[row % period] * width;",
        "            #pragma omp simd",
        "            for (long column = 0; column < width; column++) x[column] = token[column] + position[column];",
        "        }",
        "    }",
        "    return 0;",
        "}", "",
        "long scatter_add_rows(long rows, long width, const void *indices_object, long size,",
        "                      const void *values_object, const void *target_object, long period,",
        "                      const void *positions_object, long length, const void *position_target_object) {",
        "    const long *indices = DATA(indices_object), *positions = DATA(positions_object);",
        "    const T *values = DATA(values_object);",
        "    T *target = DATA(target_object), *position_target = DATA(position_target_object);",
        "    if (!within(indices, rows, size) || !within(positions, period, length)) return 1;",
        "    for (long row = 0; row < rows; row++) {",
        "        T *destination = target + indices[row] * width;",
        "        const T *source = values + row * width;",
        "        #pragma omp simd",
        "        for (long column = 0; column < width; column++) destination[column] += source[column];",
        "        if (period > 0) {",
        "            T *position = position_target + positions[row % period] * width;",
        "            #pragma omp simd",
        "            for (long column = 0; column < width; column++) position[column] += source[column];",
        "        }",
        "    }",
        "    return 0;",
        "}", ""])
    number, array = ctypes.c_long, ctypes.py_object
    argtypes = {"embed_rows": [number, number, array, number, array, number, array, number, array, array],
                "scatter_add_rows": [number, number, array, number, array, array, number, array, number, array]}
    return _load_refusing("embedding", symbol, source, argtypes[symbol])


def rotate_pairs(x: np.ndarray, cos: np.ndarray, sin: np.ndarray, positions: np.ndarray, sign: float) -> bool:
    """RoPE's turn in place: (x1, x2) ← (x1·cos − x2·s, x2·cos + x1·s), s = sign·sin, for the halves x1, x2 of
    every (B, heads, t, d) row at its position — models.rotary's NumPy passes, the same numbers bit for bit, in one
    compiled loop; True when it ran.

    `cos`, `sin`: (rows, d/2) tables by position; `positions`: (t,) shared by the batch, or (B, t) per row (packed
    documents). Why: the heads are views into the qkv projection's output, so each of NumPy's five passes walks
    rows of d/2 numbers at a time. False, nothing written, where the loop cannot take the call (not 4-D, a last
    axis not contiguous, tables not contiguous or of another dtype, a position outside the tables)."""
    if not (ENABLED and x.ndim == 4 and x.dtype in C_TYPES and x.strides[-1] == x.itemsize and x.size
            and x.flags.writeable and x.shape[-1] == 2 * cos.shape[-1] and cos.dtype == sin.dtype == x.dtype
            and cos.flags.c_contiguous and sin.flags.c_contiguous and cos.shape == sin.shape):
        return False
    batch, heads, length, width = x.shape
    positions = np.ascontiguousarray(positions, dtype=np.int64)
    if positions.shape not in ((length,), (batch, length)) or any(stride % x.itemsize for stride in x.strides):
        return False
    function = _rotary_function(x.dtype)
    if function is None:
        return False
    batch_stride, head_stride, row_stride = (stride // x.itemsize for stride in x.strides[:3])
    return function(batch, heads, length, width // 2, x, batch_stride, head_stride, row_stride, cos, sin,
                    positions, positions.ndim == 2, len(cos), float(sign)) == 0


@functools.cache
def _rotary_function(dtype: np.dtype) -> Any:
    source = _objects_library(dtype, "rotary", [
        "long rotate_pairs(long batch, long heads, long length, long half, const void *x_object, long batch_stride,",
        "                  long head_stride, long row_stride, const void *cos_object, const void *sin_object,",
        "                  const void *positions_object, long per_row, long table_rows, double sign_value) {",
        "    T *x = DATA(x_object);",
        "    const T *cos = DATA(cos_object), *sin = DATA(sin_object), sign = (T)sign_value;",
        "    const long *positions = DATA(positions_object), count = per_row ? batch * length : length;",
        "    for (long i = 0; i < count; i++) if (positions[i] < 0 || positions[i] >= table_rows) return 1;",
        "    for (long b = 0; b < batch; b++)",
        "        for (long h = 0; h < heads; h++)",
        "            for (long t = 0; t < length; t++) {",
        "                T *first = x + b * batch_stride + h * head_stride + t * row_stride, *second = first + half;",
        "                const long position = positions[per_row ? b * length + t : t];",
        "                const T *c = cos + position * half, *s = sin + position * half;",
        "                #pragma omp simd",
        "                for (long k = 0; k < half; k++) {",
        "                    const T x1 = first[k], x2 = second[k], turn = s[k] * sign;",
        "                    first[k] = x1 * c[k] - x2 * turn;",
        "                    second[k] = x2 * c[k] + x1 * turn;",
        "                }",
        "            }",
        "    return 0;",
        "}", ""])
    number, array = ctypes.c_long, ctypes.py_object
    return _load_refusing("rotary", "rotate_pairs", source, [number, number, number, number, array, number, number,
                                                             number, array, array, array, number, number,
                                                             ctypes.c_double])


def causal_softmax(scores: np.ndarray, offset: int) -> bool:
    """Softmax over the last axis of (…, queries, keys) scores, in place, key j masked out for query i when
    j > i + offset — models.layers.causal_softmax's math in one compiled pass per row; True when it ran.

    Per row: the largest score the query may see, each visible score's exponential and their sum, then each
    divided by the sum, the row in the L1 cache throughout; the masked keys are set to 0 without an exponential.
    NumPy's chain makes six passes over the scores (add the mask, max, subtract, exp, sum, divide). The
    exponentials are glibc's vector ones (libmvec: `#pragma omp declare simd` on exp lets the loop call them,
    within 4 ulp by glibc's documentation, as NumPy's own SIMD exp is within a few); a score set to −∞ before
    the call (another document's key) gives 0 like a masked one. False, nothing written, where the loop cannot
    take the call: not contiguous, another dtype, or no libmvec (not glibc, or glibc without it)."""
    if not ENABLED or scores.dtype not in C_TYPES or scores.ndim < 2 or scores.size == 0:
        return False
    if not (scores.flags.c_contiguous and scores.flags.writeable):
        return False
    function = _softmax_function(scores.dtype, "causal_softmax")
    if function is None:
        return False
    queries, keys = scores.shape[-2:]
    function(scores.size // keys, queries, keys, offset, _pointer(scores))
    return True


def cross_entropy(logits: np.ndarray, targets: np.ndarray, normalizer: float) -> np.ndarray | None:
    """Softmax cross-entropy of each row of (rows, vocab) logits, in one compiled pass per row: the logits become,
    in place, d(logits) = (softmax − onehot(target)) / normalizer, and the rows' losses log Σ exp(l − max) −
    (l_target − max) are returned; a target below 0 (layers.IGNORED) gives a zero row and a loss of 0. The
    HeadCrossEntropy chain's math, whose eleven NumPy passes over the logits this replaces, with `causal_softmax`'s
    vector exponentials. None, nothing written, where the loop cannot take the call (as `causal_softmax`, and a
    target beyond the vocabulary: NumPy's IndexError is the caller's)."""
    if not ENABLED or logits.ndim != 2 or logits.dtype not in C_TYPES or logits.size == 0:
        return None
    rows, vocab = logits.shape
    if not (logits.flags.c_contiguous and logits.flags.writeable) or targets.shape != (rows,):
        return None
    if targets.dtype.kind not in "iu" or targets.max() >= vocab:
        return None
    function = _softmax_function(logits.dtype, "cross_entropy")
    if function is None:
        return None
    losses = np.empty(rows, logits.dtype)
    targets = np.ascontiguousarray(targets, dtype=np.int64)
    function(rows, vocab, targets.ctypes.data, float(normalizer), _pointer(logits), _pointer(losses))
    return losses


@functools.cache
def _softmax_function(dtype: np.dtype, symbol: str) -> Any:
    """`causal_softmax` or `cross_entropy` from their library for `dtype` (one source: both share `exponentials`)."""
    exp, log = {"float": ("expf", "logf"), "double": ("exp", "log")}[C_TYPES[np.dtype(dtype)]]
    source = "\n".join([
        "#include <math.h>", f"typedef {C_TYPES[np.dtype(dtype)]} T;", "", *_vector_declarations(["exp"]),
        "/* row[0 … n) ← exp(row − its largest value), which goes to *largest; returns their sum */",
        "static T exponentials(T *row, long n, T *largest) {",
        "    T most = -INFINITY, total = 0;",
        "    #pragma omp simd reduction(max:most)",
        "    for (long k = 0; k < n; k++) most = row[k] > most ? row[k] : most;",
        "    #pragma omp simd reduction(+:total)",
        "    for (long k = 0; k < n; k++) {",
        f"        row[k] = {exp}(row[k] - most);",
        "        total += row[k];",
        "    }",
        "    *largest = most;",
        "    return total;",
        "}", "",
        "void causal_softmax(long rows, long queries, long keys, long offset, T *scores) {",
        "    for (long row = 0; row < rows; row++) {",
        "        T *score = scores + row * keys, largest;",
        "        long seen = row % queries + offset + 1;  /* keys 0 … i + offset: the query's past and itself */",
        "        if (seen > keys) seen = keys;",
        "        const T total = exponentials(score, seen, &largest);",
        "        #pragma omp simd",
        "        for (long key = 0; key < seen; key++) score[key] /= total;",
        "        for (long key = seen; key < keys; key++) score[key] = 0;",
        "    }", "}", "",
        "void cross_entropy(long rows, long vocab, const long *targets, double normalizer, T *logits, T *losses) {",
        "    for (long row = 0; row < rows; row++) {",
        "        T *logit = logits + row * vocab, largest;",
        "        const long target = targets[row];",
        "        if (target < 0) {  /* ignored: no loss, no gradient */",
        "            for (long word = 0; word < vocab; word++) logit[word] = 0;",
        "            losses[row] = 0;",
        "            continue;",
        "        }",
        "        const T target_logit = logit[target];",
        "        const T total = exponentials(logit, vocab, &largest);",
        "        const T scale = total * (T)normalizer;  /* softmax / normalizer */",
        "        #pragma omp simd",
        "        for (long word = 0; word < vocab; word++) logit[word] /= scale;",
        "        logit[target] -= (T)(1.0 / normalizer);",
        f"        losses[row] = {log}(total) - (target_logit - largest);",
        "    }", "}", ""])
    pointer, number = ctypes.c_void_p, ctypes.c_long
    argtypes = {"causal_softmax": [number, number, number, number, pointer],
                "cross_entropy": [number, number, pointer, ctypes.c_double, pointer, pointer]}[symbol]
    return _load("softmax", symbol, source, argtypes, ("mvec", "m"))


@functools.cache
def _names(kernel: Kernel) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """The kernel's input and output names, or ((), ()) when a parameter has a fixed type (the loop types all as T)."""
    if any(ctype != LOCAL_TYPE for ctype, _ in kernel.inputs + kernel.outputs):
        return (), ()
    return kernel.input_names, kernel.output_names


def _output_shape(kernel: Kernel, name: str, shape: tuple[int, ...]) -> tuple[int, ...]:
    """A full array's shape, or a RowKernel's per-row (..., 1) or per-column (columns,) output's."""
    return kernel.output_shape(name, shape) if isinstance(kernel, RowKernel) else shape


def _rows(shape: tuple[int, ...]) -> int:
    rows = 1
    for size in shape[:-1]:
        rows *= size
    return rows


def _address(array: np.ndarray) -> int:
    """The array's address as an integer (a writable buffer's through ctypes: 0.7 µs against ctypes.data's 2)."""
    if array.flags.writeable:
        return ctypes.addressof(ctypes.c_char.from_buffer(array))
    return array.ctypes.data


def _pointer(array: np.ndarray) -> Any:
    """The array's address for a `void *` parameter (a writable buffer's by reference: 1 µs against ctypes.data's 3)."""
    if array.flags.writeable:
        return ctypes.byref(ctypes.c_char.from_buffer(array))
    return array.ctypes.data


def _plan(kernel: Kernel, inputs: tuple[str, ...], outputs: tuple[str, ...], arrays: Mapping[str, Any]
          ) -> tuple[np.dtype, tuple[int, ...], tuple[str, ...], tuple[str, ...]] | None:
    """The call's dtype, full shape, each input's layout and the outputs given STRIDED, or None when the compiled
    loop cannot take it.

    The full shape is the largest input's; every other argument must be that shape or one of the smaller layouts,
    every output passed that shape (a RowKernel's per-row output one per row; a full one may be STRIDED), and an
    input a RowKernel reads per row one per row or a scalar."""
    if not inputs or len(arrays) < len(inputs) or any(name not in arrays for name in inputs):
        return None
    largest = max((arrays[name] for name in inputs), key=lambda value: getattr(value, "size", 0))
    if not isinstance(largest, np.ndarray) or 0 in (largest.ndim, largest.size) or largest.dtype not in C_TYPES:
        return None  # (an empty array has no buffer to point at: the chain does nothing as fast)
    dtype, shape = largest.dtype, largest.shape
    layouts = []
    for name in inputs:
        layout = _layout(arrays[name], shape, dtype)
        if layout is None:
            return None
        layouts.append(layout)
    if isinstance(kernel, RowKernel) and any(layout not in (ROW, SCALAR) for name, layout in zip(
            inputs, layouts, strict=True) if name in kernel.inputs_read_per_row()):
        return None
    strided_outputs = []
    for name in outputs:
        if name not in arrays:
            continue
        wanted, given = _shape_layout(_output_shape(kernel, name, shape), shape), _layout(arrays[name], shape, dtype)
        if not (given == wanted or (given, wanted) == (STRIDED, FULL)) or not arrays[name].flags.writeable:
            return None
        if given == STRIDED:
            strided_outputs.append(name)
    if any(name not in inputs and name not in outputs for name in arrays):
        return None
    return dtype, shape, tuple(layouts), tuple(strided_outputs)


def _layout(value: Any, shape: tuple[int, ...], dtype: np.dtype) -> str | None:
    """FULL, ROW, COLUMN or SCALAR for an argument of a call over `shape`, None for anything else."""
    if not isinstance(value, np.ndarray):
        return SCALAR if isinstance(value, (int, float)) else None
    if value.ndim == 0:
        return SCALAR
    if value.dtype != dtype:
        return None
    if value.flags.c_contiguous:
        return _shape_layout(value.shape, shape)
    return STRIDED if value.shape == shape and _row_stride(value) is not None else None


def _row_stride(array: np.ndarray) -> int | None:
    """The elements from one row's start to the next's, for an array whose last axis is contiguous and whose rows
    are evenly spaced (every leading axis steps over whole rows of the one after it); None for any other."""
    itemsize, strides, shape = array.itemsize, array.strides, array.shape
    if array.ndim < 2 or strides[-1] != itemsize or strides[-2] % itemsize or strides[-2] < shape[-1] * itemsize:
        return None
    if any(strides[axis] != strides[axis + 1] * shape[axis + 1] for axis in range(array.ndim - 2)):
        return None
    return strides[-2] // itemsize


def _shape_layout(value_shape: tuple[int, ...], shape: tuple[int, ...]) -> str | None:
    """FULL, ROW or COLUMN for an array of `value_shape` in a call over `shape`, None for any other shape."""
    if value_shape == shape:
        return FULL
    padded = (1,) * (len(shape) - len(value_shape)) + value_shape
    if len(padded) != len(shape):
        return None
    if padded[-1] == 1 and padded[:-1] == shape[:-1]:
        return ROW
    if padded[-1] == shape[-1] and all(size == 1 for size in padded[:-1]):
        return COLUMN
    return None


def c_source(kernel: Kernel, dtype: np.dtype, layouts: tuple[str, ...], strided_outputs: tuple[str, ...] = ()) -> str:
    """The C function `<kernel name>` for one dtype and input layout: rows × width elements, a loop over the
    columns of each row (a RowKernel: one loop per phase, column sums zeroed before the first row). A STRIDED input
    and each of `strided_outputs` takes its row stride after its address."""
    names = {*kernel.input_names, *kernel.output_names, *_targets(kernel)}
    if names & LOOP_NAMES:
        raise ValueError(f"{kernel.name}: {sorted(names & LOOP_NAMES)} are the generated loop's own names")
    parameters, per_row, loads = _parameters(kernel, layouts, strided_outputs)
    zeroed = kernel.column_outputs if isinstance(kernel, RowKernel) else ()
    if isinstance(kernel, RowKernel):
        body = _row_kernel_body(kernel, per_row, loads, strided_outputs)
    else:
        body = [*per_row, *_column_loop(loads, _statements(kernel.statements, set(kernel.input_names)),
                                        _stores(kernel.output_names, strided_outputs))]
    return "\n".join(["#include <tgmath.h>", f"typedef {C_TYPES[np.dtype(dtype)]} T;", "",
                      *_vector_declarations(_vector_functions(kernel)),
                      f"void {kernel.name}({', '.join(parameters)}) {{",
                      *(f"    for (long column = 0; column < width; column++) {name}_array[column] = 0;"
                        for name in zeroed),
                      "    for (long row = 0; row < rows; row++) {",
                      *(f"        {line}" for line in body),
                      "    }", "}", ""])


VECTOR_FUNCTIONS = {"tanh": ("tanhf", "tanh"), "exp": ("expf", "exp")}
"""The functions a kernel's text may call that the loops take from glibc's vector math library (libmvec): their
float and double names."""


def _vector_functions(kernel: Kernel) -> tuple[str, ...]:
    """The VECTOR_FUNCTIONS the kernel's statements call."""
    text = " ".join(expression for _, expression in _statements_of(kernel))
    return tuple(name for name in VECTOR_FUNCTIONS if re.search(rf"\b{name}\s*\(", text))


def _vector_declarations(functions: Sequence[str]) -> list[str]:
    """`#pragma omp declare simd` on each function's float and double versions: a loop that calls them is then
    vectorized with glibc's vector versions (libmvec, which the library is linked with). The names are
    parenthesized so that <tgmath.h>'s macros leave them alone."""
    lines = []
    for name in functions:
        for c_type, c_name in zip(("float", "double"), VECTOR_FUNCTIONS[name], strict=True):
            lines += ["#pragma omp declare simd notinbranch", f"{c_type} ({c_name})({c_type});"]
    return [*lines, ""] if lines else []


def _statements_of(kernel: Kernel) -> list[tuple[str, str]]:
    return list(kernel.statements) if isinstance(kernel, FusedKernel) else [
        statement for _, phase in kernel.phases for statement in phase]


def _targets(kernel: Kernel) -> list[str]:
    return [target for target, _ in _statements_of(kernel)]


def _parameters(kernel: Kernel, layouts: tuple[str, ...], strided_outputs: tuple[str, ...] = ()
                ) -> tuple[list[str], list[str], list[str]]:
    """The C parameters, the declarations read once per row (row vectors, scalars) and those read per element."""
    parameters, per_row, loads = ["long rows", "long width"], [], []
    for name, layout in zip(kernel.input_names, layouts, strict=True):
        if layout == SCALAR:
            parameters.append(f"double {name}_value")
            per_row.append(f"const T {name} = (T){name}_value;")
        else:
            parameters.append(f"const T *{name}_array" + (f", long {name}_stride" if layout == STRIDED else ""))
            if layout == ROW:
                per_row.append(f"const T {name} = {name}_array[row];")
            else:
                index = {FULL: "row * width + column", STRIDED: f"row * {name}_stride + column"}.get(layout, "column")
                loads.append(f"const T {name} = {name}_array[{index}];")
    parameters.extend(f"T *{name}_array" + (f", long {name}_stride" if name in strided_outputs else "")
                      for name in kernel.output_names)
    return parameters, per_row, loads


def _statements(statements: Any, declared: set[str]) -> list[str]:
    """`T target = expression;` (or without the type when already declared), literals cast to T."""
    lines = []
    for target, expression in statements:
        lines.append(f"{'' if target in declared else 'T '}{target} = {_typed_literals(expression)};")
        declared.add(target)
    return lines


def _stores(names: Any, strided: tuple[str, ...] = ()) -> list[str]:
    return [f"{name}_array[row * {f'{name}_stride' if name in strided else 'width'} + column] = {name};"
            for name in names]


def _column_loop(loads: list[str], body: list[str], after: list[str], pragma: str = "#pragma omp simd") -> list[str]:
    """One vectorized loop over the row's columns: every input element is read before any output is written."""
    return [pragma, "for (long column = 0; column < width; column++) {",
            *(f"    {line}" for line in [*loads, *body, *after]), "}"]


def _row_kernel_body(kernel: RowKernel, per_row: list[str], loads: list[str], strided_outputs: tuple[str, ...] = ()
                     ) -> list[str]:
    """A RowKernel's phases inside the loop over rows: a sum is a reduction loop (the compiler keeps vector
    accumulators), a row phase plain statements, an each phase a loop like a FusedKernel's, a columns phase a loop
    adding to the per-column outputs."""
    lines = [*per_row, f"const T {ROW_LENGTH} = (T)width;"]
    for kind, statements in kernel.phases:
        if kind == "sum":
            targets = [target for target, _ in statements]
            lines.extend(f"T {target} = 0;" for target in targets)
            lines.extend(_column_loop(loads, [f"{target} += {_typed_literals(expression)};"
                                              for target, expression in statements], [],
                                      f"#pragma omp simd reduction(+:{', '.join(targets)})"))
        elif kind == "row":
            lines.extend(_statements(statements, set()))
        elif kind == "columns":
            lines.extend(_column_loop(loads, [f"{target}_array[column] += {_typed_literals(expression)};"
                                              for target, expression in statements], []))
        else:
            outputs = [target for target, _ in statements if target in kernel.output_names]
            lines.extend(_column_loop(loads, _statements(statements, set()), _stores(outputs, strided_outputs)))
    lines.extend(f"{name}_array[row] = {name};" for name in kernel.row_outputs)
    return lines


def _typed_literals(expression: str) -> str:
    """Every literal cast to T: NumPy's rounding of a Python float next to an array of T."""
    return _LITERAL_TOKEN.sub(r"((T)\1)", expression)


@functools.cache
def _compiler() -> tuple[list[str], str] | None:
    """The C compiler's command ($CC, else cc) and what identifies its build (the resolved file, its size and
    time: no process started where the kernels are already built), or None when there is none."""
    command = shlex.split(os.environ.get("CC", "cc"))
    found = shutil.which(command[0]) if command else None
    if found is None:
        return None
    program = Path(found).resolve()
    stat = program.stat()
    return command, f"{program} {stat.st_size} {stat.st_mtime_ns}"


def forget() -> None:
    """Drop the loaded functions and the calls' plans: the next call looks for the compiler and its cache again."""
    _function.cache_clear()
    _softmax_function.cache_clear()
    _embedding_function.cache_clear()
    _rotary_function.cache_clear()
    _CALLS.clear()
    _LOADED.clear()


_FAILURES: dict[str, str] = {}
"""Why a kernel could not be built, by kernel name (for status())."""
_LOADED: set[str] = set()
"""The kernels built or taken from the cache, by name: with failures beside them, status() names both."""


@functools.cache
def _function(kernel: Kernel, dtype: np.dtype, layouts: tuple[str, ...], many: bool = False,
              strided_outputs: tuple[str, ...] = ()) -> Any:
    """The loaded C function for this kernel, dtype and layout (built or taken from the cache), or None:
    `<name>_objects`, which takes the arrays themselves (see `_objects_source`), or with `many` its `<name>_many`
    variant over lists of addresses (see run_many)."""
    if many:
        source = c_source(kernel, dtype, layouts) + _many_source(kernel, layouts)
        lists = [ctypes.c_double if layout == SCALAR else ctypes.c_void_p for layout in layouts]
        return _load(kernel.name, f"{kernel.name}_many", source,
                     [ctypes.c_long, ctypes.c_void_p, *lists, *([ctypes.c_void_p] * len(kernel.output_names))])
    offset = _data_offset()
    if offset is None:
        _FAILURES[kernel.name] = "NumPy's array object does not keep its data pointer after the object header"
        return None
    source = (c_source(kernel, dtype, layouts, strided_outputs)
              + _objects_source(kernel, layouts, offset, strided_outputs))
    objects = [ctypes.c_double if layout == SCALAR else ctypes.py_object for layout in layouts]
    strides = [ctypes.c_long] * (layouts.count(STRIDED) + len(strided_outputs))
    return _load(kernel.name, f"{kernel.name}_objects", source,
                 [ctypes.c_long, ctypes.c_long, *objects, *([ctypes.py_object] * len(kernel.output_names)), *strides],
                 ("mvec", "m") if _vector_functions(kernel) else ("m",))


@functools.cache
def _data_offset() -> int | None:
    """Where a NumPy array object keeps the address of its data: right after the Python object header (the
    `data` field of NumPy's PyArrayObject_fields, which its C API's PyArray_DATA reads), confirmed on a probe
    array; None where it is not found there."""
    probe = np.empty(3)
    offset = object.__basicsize__  # sizeof(PyObject)
    return offset if ctypes.c_void_p.from_address(id(probe) + offset).value == probe.ctypes.data else None


def _objects_source(kernel: Kernel, layouts: tuple[str, ...], offset: int, strided_outputs: tuple[str, ...] = ()
                    ) -> str:
    """`<name>_objects(rows, width, …)`: the kernel with each array argument given as the NumPy array object
    itself. Why: turning an array into an address in Python (ctypes, or its `ctypes.data`) costs 10–15 µs an
    argument in a training step, where the interpreter runs with cold caches; ctypes hands an object over as its
    pointer, and reading the address there is one load."""
    parameters, arguments, strides = ["long rows", "long width"], ["rows", "width"], []
    for name, layout in zip(kernel.input_names, layouts, strict=True):
        parameters.append(f"double {name}_value" if layout == SCALAR else f"const void *{name}_object")
        arguments.append(f"{name}_value" if layout == SCALAR else f"DATA({name}_object)")
        if layout == STRIDED:
            arguments.append(f"{name}_stride")
            strides.append(f"long {name}_stride")
    for name in kernel.output_names:
        parameters.append(f"const void *{name}_object")
        arguments.append(f"DATA({name}_object)")
        if name in strided_outputs:
            arguments.append(f"{name}_stride")
            strides.append(f"long {name}_stride")
    parameters.extend(strides)  # after every array, in their order: what `run` passes last
    return "\n".join([_data_macro(offset), f"void {kernel.name}_objects({', '.join(parameters)}) {{",
                      f"    {kernel.name}({', '.join(arguments)});", "}", ""])


def _load(name: str, symbol: str, source: str, argtypes: list[Any], libraries: tuple[str, ...] = ("m",)) -> Any:
    """The C function `symbol` of `source` linked with `libraries`, built or taken from the cache, or None (the
    reason kept under `name`)."""
    compiler = _compiler()
    if compiler is None:
        _FAILURES[name] = "no C compiler (cc or $CC)"
        return None
    command, version = compiler
    links = [f"-l{library}" for library in libraries]
    key = hashlib.sha256("\n".join([source, version, " ".join(command), *FLAGS, *links, _cpu()]).encode()
                         ).hexdigest()
    try:
        library = _cached_library([*command, *FLAGS], source, links, f"{name}-{key[:20]}.so")
    except BuildFailed as failure:
        _FAILURES[name] = str(failure)
        return None
    function = getattr(library, symbol)
    function.argtypes, function.restype = argtypes, None
    _LOADED.add(name)
    return function


def _many_source(kernel: FusedKernel, layouts: tuple[str, ...]) -> str:
    """`<name>_many(count, sizes, …)`: the kernel over `count` arrays, each a row of sizes[k] elements; an array
    argument is a list of `count` addresses, a scalar one value for all."""
    parameters, arguments = ["long count", "const long *sizes"], ["1", "sizes[k]"]
    for name, layout in zip(kernel.input_names, layouts, strict=True):
        parameters.append(f"double {name}_value" if layout == SCALAR else f"void *const *{name}_list")
        arguments.append(f"{name}_value" if layout == SCALAR else f"{name}_list[k]")
    parameters.extend(f"void *const *{name}_list" for name in kernel.output_names)
    arguments.extend(f"{name}_list[k]" for name in kernel.output_names)
    return "\n".join([f"void {kernel.name}_many({', '.join(parameters)}) {{",
                      f"    for (long k = 0; k < count; k++) {kernel.name}({', '.join(arguments)});", "}", ""])


class BuildFailed(Exception):
    """The compiler could not build a kernel (its message says why)."""


def _cached_library(command: list[str], source: str, links: list[str], name: str) -> ctypes.CDLL:
    """The library `name` from the cache folder, built there first if missing; where the folder cannot be written
    (a read-only home), built in a temporary folder for this process alone."""
    library = cache_folder() / name
    if library.exists():
        return ctypes.CDLL(str(library))
    try:
        library.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=library.parent) as folder:
            os.replace(_build(command, source, links, Path(folder), name), library)  # whole, or not at all
        return ctypes.CDLL(str(library))
    except OSError:
        with tempfile.TemporaryDirectory() as folder:
            return ctypes.CDLL(str(_build(command, source, links, Path(folder), name)))  # stays mapped once loaded


def _build(command: list[str], source: str, links: list[str], folder: Path, name: str) -> Path:
    """Compile `source` with `command` (the compiler and its flags) into `folder`/`name`, linked with `links`;
    BuildFailed with the compiler's message if it cannot."""
    source_path, built = folder / "kernel.c", folder / name
    source_path.write_text(source)
    try:
        result = subprocess.run([*command, "-o", str(built), str(source_path), *links],
                                capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired) as error:
        raise BuildFailed(f"{command[0]} failed: {error}") from error
    if result.returncode != 0:
        raise BuildFailed(f"{command[0]} failed: {result.stderr.strip()[-300:]}")
    return built


def cache_folder() -> Path:
    """Where built kernels are kept: $MPIPARALLEL_KERNEL_CACHE, else $XDG_CACHE_HOME/mpiparallel/kernels, else
    ~/.cache/mpiparallel/kernels (apart from MPIPARALLEL_CACHE's prepared data: a kernel suits every dataset)."""
    if os.environ.get(CACHE_VARIABLE):
        return Path(os.environ[CACHE_VARIABLE])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "mpiparallel" / "kernels"


@functools.cache
def _cpu() -> str:
    """What -march=native depends on: the CPU's model and feature flags (a cache shared by unlike hosts differs)."""
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.machine() + platform.processor()
    wanted = [line for line in info.splitlines() if line.startswith(("model name", "flags", "Features"))]
    return platform.machine() + "\n".join(sorted(set(wanted)))


def status(build: bool = False) -> str:
    """One line: whether the CPU's kernels run compiled, and why not (`build`: build one kernel first, so
    that a compiler that cannot build is found now rather than at the first layer)."""
    if build:  # one kernel of each kind: a row kernel, one calling libmvec's tanh, the softmax library
        run(kernels.RMS_NORM_ROWS_FORWARD, x=np.ones((1, 8), np.float32), weight=np.ones(8, np.float32), eps=1e-6)
        run(kernels.GELU_FORWARD_KEEPING, x=np.ones((1, 8), np.float32))
        causal_softmax(np.ones((1, 8, 8), np.float32), 0)
    if not enabled():
        return "NumPy chains (MPIPARALLEL_HOST_KERNELS=0)"
    compiler = _compiler()
    if compiler is None:
        return "NumPy chains (no C compiler: cc or $CC)"
    program = Path(compiler[1].rsplit(" ", 2)[0])
    if _FAILURES:
        name, reason = next(iter(_FAILURES.items()))
        if not _LOADED:
            return f"NumPy chains ({name}: {reason})"
        return f"compiled ({program.name}); NumPy chains for {', '.join(sorted(_FAILURES))} ({name}: {reason})"
    return f"compiled ({program.name})"
