"""Fused elementwise GPU kernels (GELU, LayerNorm, RMSNorm, SwiGLU, softmax, AdamW), written once, checkable on a CPU;
and the CPU's row kernels for the norms, written the same way.

Why fuse: on a GPU every array operation is one kernel launch and one trip through memory. GELU, LayerNorm's
normalize-and-affine, softmax's shift-and-exponential and the AdamW step are chains of such operations, so each
chain becomes one `cupy.ElementwiseKernel` that reads and writes every element once. Reductions (row maxima, row
sums, means, variances) stay CuPy reductions or GEMVs; the kernels take their per-row results as broadcast inputs.

Why as data: a kernel is its parameters plus statements `(target, expression)`, and every expression is text that
C and Python read alike — names, literals with a decimal point, + - * /, unary minus, parentheses and the
functions in `FUNCTIONS`. `cuda_source()` joins the statements into the CUDA C loop body; `evaluate_numpy()` runs
the very same text with NumPy. So a CPU test of `evaluate_numpy` checks the math of the text the GPU compiles.

Parameters use CuPy's syntax: `T name` has the arrays' dtype (a Python scalar passed for it is converted to that
dtype), `float64 name` a fixed one. Kernels are pure functions of their inputs; "in place" is a way of calling
them: pass an input array again as the output it is paired with in `in_place`. That is safe in CUDA because each
element's thread reads the input element before it writes the output element (checked: no statement after the
output's first assignment reads the input), and CuPy's ElementwiseKernel does not copy aliased arguments.

Precision: in float64 a kernel agrees with the NumPy code to rounding (the CUDA math library and the compiler's
fused multiply-adds differ in the last bits). In float32 the locals and outputs are float, but C evaluates any
operation with a literal or a double in double precision before rounding to float: more accurate, not identical.

On the CPU: where NumPy's SIMD loops make each operation of a chain nearly as cheap as a fused loop over the
same data (GELU, SwiGLU, softmax), the layers keep their NumPy chains. Running these kernels' text on NumPy as
one pass — ufunc calls over L2-sized blocks of 32 Ki elements — cost more than the hand-ordered chains in every
layer (measured on an AMD EPYC with AVX-512, per call, caches flushed: GELU backward 1.3 ms against 1.0, SwiGLU
backward 2.2 against 1.5, the AdamW step 7.3 against 5.1; a training step 4-7 % slower); numexpr was slower still
(its PyPI build has no vector math library: tanh of 1 Mi float32 numbers 14 ms against NumPy's 0.16), and Numba's
JIT cost about 0.85 s of import in every process. Where the chains fall far behind PyTorch's one C++ loop —
LayerNorm, RMSNorm and AdamW, seven to eleven passes each — models.host_kernels compiles kernel text with the
system's C compiler (no new dependency): AdamW's text here, with the NumPy chain's numbers bit for bit, and the
norms' RowKernels below (statistics and elementwise work in one loop per row, equal to the chains to rounding);
the chains remain where no compiler is found. Where that leaves the CPU against PyTorch, part by part:
docs/benchmarks.md, "CPU speed against PyTorch".

Communication: none.
"""

from __future__ import annotations

import ast
import math
import re
from collections.abc import Sequence
from typing import Any

import numpy as np

from collectives.backend import Array, get_array_module, is_device_array

FUNCTIONS = {"tanh": np.tanh, "exp": np.exp, "sqrt": np.sqrt}
"""The functions expressions may call: CUDA's math functions (overloaded for float and double) and their NumPy
ufuncs."""

LOCAL_TYPE = "T"
"""C type of the kernel's own intermediate variables: the arrays' dtype (CuPy typedefs the placeholder)."""

FLOAT_TYPES = ("T", "float32", "float64")
_IDENTIFIER = re.compile(r"[A-Za-z][A-Za-z0-9_]*")
_LITERAL = re.compile(r"[0-9]+\.[0-9]*([eE][+-]?[0-9]+)?")
_ALLOWED_CHARACTERS = re.compile(r"[A-Za-z0-9_.+\-*/() ]*")
_OPERATORS = (ast.Add, ast.Sub, ast.Mult, ast.Div)
_RESERVED = {"i", "T", "auto", "bool", "break", "case", "char", "const", "continue", "default", "do", "double",
             "else", "enum", "extern", "float", "for", "goto", "if", "int", "long", "register", "return", "short",
             "signed", "sizeof", "static", "struct", "switch", "typedef", "union", "unsigned", "void", "volatile",
             "while", "half"}
"""Names a parameter or variable may not take: CuPy's loop index `i`, the type placeholder, C keywords."""

GELU_SCALE = math.sqrt(2.0 / math.pi)
GELU_CUBIC = 0.044715
"""GPT-2's tanh approximation constants (the same values as models.layers uses)."""


def literal(value: float) -> str:
    """`value` written so that C and Python read the same double: repr round-trips, and the decimal point keeps C
    from reading an integer (integer division would silently truncate)."""
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"kernel literals are finite and non-negative (use unary minus), got {value}")
    mantissa, _, exponent = repr(float(value)).partition("e")
    if "." not in mantissa:
        mantissa += ".0"
    return mantissa + (f"e{exponent}" if exponent else "")


def parse_params(text: str) -> tuple[tuple[str, str], ...]:
    """CuPy's parameter list "T x, float64 lr" as ((type, name), …), checked for what these kernels support."""
    params = []
    for item in filter(None, (part.strip() for part in text.split(","))):
        words = item.split()
        if len(words) != 2 or words[0] not in FLOAT_TYPES:
            raise ValueError(f"parameter {item!r}: expected '<type> <name>' with type one of {FLOAT_TYPES}")
        params.append((words[0], _checked_name(words[1], "parameter")))
    return tuple(params)


def _checked_name(name: str, what: str) -> str:
    if not _IDENTIFIER.fullmatch(name) or name in _RESERVED or name in FUNCTIONS:
        raise ValueError(f"{what} name {name!r} is not a plain identifier free in both C and Python")
    return name


def names_read(expression: str, known: set[str]) -> set[str]:
    """The variables `expression` reads, after checking it is in the C-and-Python subset; raises ValueError."""
    if not _ALLOWED_CHARACTERS.fullmatch(expression) or "--" in expression or "++" in expression:
        raise ValueError(f"{expression!r}: only names, literals, + - * /, parentheses and spaces are allowed "
                         "(and no '--' or '++', which C reads as decrement/increment)")
    try:
        tree = ast.parse(expression, mode="eval")
    except SyntaxError as error:
        raise ValueError(f"{expression!r} does not parse: {error.msg}") from None
    called = {id(node.func) for node in ast.walk(tree) if isinstance(node, ast.Call)}
    read = set()
    for node in ast.walk(tree):
        _check_node(node, expression, called)
        if isinstance(node, ast.Name) and id(node) not in called:
            if node.id not in known:
                raise ValueError(f"{expression!r} reads {node.id!r}, which is neither a parameter nor set before")
            read.add(node.id)
    return read


def _check_node(node: ast.AST, expression: str, called: set[int]) -> None:
    if isinstance(node, (ast.Expression, ast.Load, ast.USub, *_OPERATORS)):
        return
    if isinstance(node, ast.BinOp) and isinstance(node.op, _OPERATORS):
        return
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        return
    if isinstance(node, ast.Name):
        if (node.id in FUNCTIONS) != (id(node) in called):
            role = "function" if id(node) in called else "value"
            raise ValueError(f"{expression!r}: {node.id!r} cannot be used as a {role}")
        return
    if isinstance(node, ast.Call):
        if node.keywords or len(node.args) != 1:
            raise ValueError(f"{expression!r}: functions take exactly one positional argument")
        return
    if isinstance(node, ast.Constant):
        text = ast.get_source_segment(expression, node) or ""
        if not isinstance(node.value, float) or not _LITERAL.fullmatch(text):
            raise ValueError(f"{expression!r}: literal {text!r} must be written with a decimal point, like 2.0")
        return
    raise ValueError(f"{expression!r}: {type(node).__name__} is not allowed in a kernel expression")


class _Kernel:
    """What FusedKernel and RowKernel share: a checked name, CuPy-style parameter lists, and their names (kept,
    not derived per call: a kernel never changes, and the CPU's calls ask for them every time)."""

    def __init__(self, name: str, inputs: str, outputs: str) -> None:
        self.name = _checked_name(name, "kernel")
        self.inputs, self.outputs = parse_params(inputs), parse_params(outputs)
        self.input_names = tuple(name for _, name in self.inputs)
        self.output_names = tuple(name for _, name in self.outputs)


class FusedKernel(_Kernel):
    """One elementwise kernel: inputs, outputs and statements, runnable by CuPy and by NumPy.

    `kernel(**arrays)` runs it on CuPy arrays (one `cupy.ElementwiseKernel`, built on first use; CuPy compiles it
    per dtype), writing into the outputs that are passed — all of them or none, as CuPy requires — and returns
    {output name: array}. `evaluate_numpy(**arrays)` computes the outputs from NumPy arrays as new arrays.
    `in_place` maps outputs to the inputs they may overwrite (the same array passed for both).
    """

    def __init__(self, name: str, inputs: str, outputs: str, statements: Sequence[tuple[str, str]],
                 in_place: dict[str, str] | None = None) -> None:
        super().__init__(name, inputs, outputs)
        self.statements = tuple(statements)
        self.in_place = dict(in_place or {})
        self._reads = self._check_statements()
        self._check_in_place()
        self._codes = [compile(expression, f"<{name}: {target}>", "eval") for target, expression in self.statements]
        self._compiled: dict[str, Any] = {}

    def _check_statements(self) -> list[set[str]]:
        """Every name is a parameter or set before, inputs are never assigned, outputs always are; returns the
        names each statement reads."""
        params = self.input_names + self.output_names
        if len(set(params)) != len(params):
            raise ValueError(f"{self.name}: parameter names repeat: {params}")
        if LOCAL_TYPE not in {ctype for ctype, _ in self.inputs + self.outputs}:
            raise ValueError(f"{self.name}: some parameter must have the placeholder type {LOCAL_TYPE}")
        known, reads = set(self.input_names), []
        for target, expression in self.statements:
            reads.append(names_read(expression, known))  # reading an output before setting it reads garbage
            if target in self.input_names:
                raise ValueError(f"{self.name}: statement assigns the input {target!r} (inputs are const)")
            known.add(_checked_name(target, "statement target"))
        unwritten = [name for name in self.output_names if name not in known]
        if unwritten:
            raise ValueError(f"{self.name}: outputs {unwritten} are never assigned")
        return reads

    def _check_in_place(self) -> None:
        """An output may share memory with its paired input only if nothing reads the input after the output's
        first assignment (it would read the new value)."""
        for output, source in self.in_place.items():
            if output not in self.output_names or source not in self.input_names:
                raise ValueError(f"{self.name}: in_place pairs an output with an input, got {output!r}: {source!r}")
            first = next(k for k, (target, _) in enumerate(self.statements) if target == output)
            for (target, _), read in zip(self.statements[first + 1:], self._reads[first + 1:], strict=True):
                if source in read:
                    raise ValueError(f"{self.name}: {target} reads {source!r} after {output!r}, which may alias it, "
                                     "was written")

    def cuda_source(self) -> str:
        """The `operation` of the ElementwiseKernel: one C statement per line, locals declared at first use."""
        declared = set(self.input_names + self.output_names)
        lines = []
        for target, expression in self.statements:
            declaration = "" if target in declared else f"{LOCAL_TYPE} "
            declared.add(target)
            lines.append(f"{declaration}{target} = {expression};")
        return "\n".join(lines)

    def evaluate_numpy(self, **arrays: Array) -> dict[str, np.ndarray]:
        """The outputs computed from the statement text with NumPy, as new arrays (broadcast like CuPy does)."""
        self._check_arguments(arrays, required=self.input_names, allowed=self.input_names)
        namespace = dict(arrays)
        for (target, _), code in zip(self.statements, self._codes, strict=True):
            namespace[target] = eval(code, {"__builtins__": {}, **FUNCTIONS}, namespace)  # text checked above
        shape = np.broadcast_shapes(*(np.shape(value) for value in arrays.values()))
        return {name: np.array(np.broadcast_to(namespace[name], shape), dtype=self._dtype(ctype, arrays))
                for ctype, name in self.outputs}

    def __call__(self, **arrays: Array) -> dict[str, Array]:
        """Run on CuPy arrays; outputs passed (all or none) are written, the others allocated."""
        given = tuple(name for name in self.output_names if name in arrays)
        self._check_arguments(arrays, required=self.input_names + (self.output_names if given else ()),
                              allowed=self.input_names + self.output_names)
        self._check_aliasing(arrays)
        device_arrays = [a for a in arrays.values() if is_device_array(a)]
        if not device_arrays:
            raise TypeError(f"{self.name} runs on CuPy arrays; NumPy arrays go through evaluate_numpy")
        kernel = self._elementwise_kernel(get_array_module(device_arrays[0]))
        results = kernel(*(arrays[name] for name in self.input_names + given))
        return dict(zip(self.output_names, results if isinstance(results, tuple) else (results,), strict=True))

    def _check_aliasing(self, arrays: dict[str, Array]) -> None:
        """The same array as an input and an output is allowed only for the declared `in_place` pairs."""
        for output in self.output_names:
            for source in self.input_names:
                if output in arrays and arrays[output] is arrays[source] and self.in_place.get(output) != source:
                    raise ValueError(f"{self.name}: {output} aliases input {source}, which is not an in-place pair")

    def declarations(self) -> tuple[str, str]:
        """The `in_params` and `out_params` strings of the ElementwiseKernel ("T x, T dout", "T dx")."""
        def declare(params: tuple[tuple[str, str], ...]) -> str:
            return ", ".join(f"{ctype} {name}" for ctype, name in params)

        return declare(self.inputs), declare(self.outputs)

    def _elementwise_kernel(self, cupy: Any) -> Any:
        """The cupy.ElementwiseKernel, built once per array module (CuPy compiles it per dtype on first launch)."""
        if cupy.__name__ not in self._compiled:
            self._compiled[cupy.__name__] = cupy.ElementwiseKernel(*self.declarations(), self.cuda_source(),
                                                                   f"mpiparallel_{self.name}")
        return self._compiled[cupy.__name__]

    def _check_arguments(self, arrays: dict[str, Array], required: tuple[str, ...], allowed: tuple[str, ...]) -> None:
        missing = [name for name in required if name not in arrays]
        unknown = [name for name in arrays if name not in allowed]
        if missing or unknown:
            raise TypeError(f"{self.name}: missing arguments {missing}, unknown arguments {unknown}")

    def _dtype(self, ctype: str, arrays: dict[str, Array]) -> np.dtype:
        """What CuPy makes of a parameter type: a fixed dtype, or the dtype of the arrays passed for T."""
        if ctype != LOCAL_TYPE:
            return np.dtype(ctype)
        bound = [arrays[name] for kind, name in self.inputs if kind == LOCAL_TYPE and hasattr(arrays[name], "dtype")]
        return np.result_type(*bound)

    def __repr__(self) -> str:
        return f"FusedKernel({self.name}: {', '.join(self.input_names)} -> {', '.join(self.output_names)})"



ROW_PHASES = ("sum", "row", "each", "columns")
ROW_LENGTH = "columns"
"""The name a RowKernel's expressions read for the length of a row (as T)."""


class RowKernel(_Kernel):
    """A kernel over rows: for each row of the last axis, phases of loops over its columns with per-row values
    between them — a norm's statistics and its elementwise work in one pass over memory.

    Why: LayerNorm and RMSNorm need row statistics (a mean, a variance, Σ dn·n) before their elementwise work. As
    GEMVs over arrays written for them, those cost several extra trips through memory; in one loop per row the row
    stays in the L1 cache from one phase to the next, so each input comes from memory once.

    A phase is (kind, statements):
      "sum":     each target is Σ, over the row's columns, of its expression — one value per row;
      "row":     one value per row, from earlier per-row values, `columns` (the row's length) and inputs given one
                 per row or as scalars;
      "each":    one value per element, as FusedKernel's statements; its locals live in that phase alone;
      "columns": each target, an output, is Σ over all rows of its expression — one value per column (a weight's
                 gradient, summed while the row is in cache instead of in a pass of its own).
    An output set by a "sum" or "row" phase has one value per row (shape (..., 1)), one set by "each" one per
    element, one set by "columns" one per column (shape (columns,)). Expressions are FusedKernel's C-and-Python
    subset; `evaluate_numpy` runs the text with NumPy and models.host_kernels compiles it for the CPU. The GPU's
    norms keep CuPy reductions and FusedKernels: no CUDA version is generated.
    """

    def __init__(self, name: str, inputs: str, outputs: str,
                 phases: Sequence[tuple[str, Sequence[tuple[str, str]]]]) -> None:
        super().__init__(name, inputs, outputs)
        self.phases = tuple((kind, tuple(statements)) for kind, statements in phases)
        self.row_values = self._check_phases()
        self.row_outputs = tuple(name for name in self.output_names if name in self.row_values)
        """The outputs with one value per row."""
        self.column_outputs = tuple(target for kind, statements in self.phases if kind == "columns"
                                    for target, _ in statements)
        """The outputs with one value per column (Σ over the rows)."""
        self._read_per_row = frozenset(name for (kind, _), reads in zip(self.phases, self._reads, strict=True)
                                       if kind == "row" for read in reads for name in read
                                       if name in self.input_names)
        self._codes = [[compile(expression, f"<{name}: {target}>", "eval") for target, expression in statements]
                       for _, statements in self.phases]

    def inputs_read_per_row(self) -> frozenset[str]:
        """The inputs a "row" phase reads: they must be given one per row or as scalars."""
        return self._read_per_row

    def _check_phases(self) -> set[str]:
        """Names are assigned once; a statement reads inputs, per-row values and its own phase's element values
        (a sum's result after its loop only); a column sum is an output nothing reads; every output is assigned.
        Returns the per-row names."""
        params = self.input_names + self.output_names
        if len(set(params)) != len(params) or ROW_LENGTH in params:
            raise ValueError(f"{self.name}: parameter names repeat or take {ROW_LENGTH!r}: {params}")
        per_row, assigned, self._reads = {ROW_LENGTH}, set(), []
        for kind, statements in self.phases:
            if kind not in ROW_PHASES:
                raise ValueError(f"{self.name}: phase {kind!r} is not one of {ROW_PHASES}")
            element_values, sums, reads = set(), set(), []
            for target, expression in statements:
                reads.append(names_read(expression, per_row | set(self.input_names) | element_values))
                if target in self.input_names or target in assigned or target == ROW_LENGTH:
                    raise ValueError(f"{self.name}: {target!r} is an input, or is assigned twice")
                if kind == "columns" and target not in self.output_names:
                    raise ValueError(f"{self.name}: column sum {target!r} is not an output")
                assigned.add(_checked_name(target, "statement target"))
                {"sum": sums, "row": per_row, "each": element_values, "columns": set()}[kind].add(target)
            per_row |= sums
            self._reads.append(reads)
        unwritten = [name for name in self.output_names if name not in assigned]
        if unwritten:
            raise ValueError(f"{self.name}: outputs {unwritten} are never assigned")
        return per_row - {ROW_LENGTH}

    def evaluate_numpy(self, **arrays: Array) -> dict[str, np.ndarray]:
        """The outputs computed from the phases' text with NumPy, as new arrays: row sums with `np.sum` over the
        last axis (row values of shape (..., 1)), column sums over all the others."""
        missing = [name for name in self.input_names if name not in arrays]
        unknown = [name for name in arrays if name not in self.input_names]
        if missing or unknown:
            raise TypeError(f"{self.name}: missing arguments {missing}, unknown arguments {unknown}")
        shape = np.broadcast_shapes(*(np.shape(value) for value in arrays.values()))
        dtype = np.result_type(*(value for value in arrays.values() if hasattr(value, "dtype")))
        namespace: dict[str, Any] = {**arrays, ROW_LENGTH: float(shape[-1])}
        functions = {"__builtins__": {}, **FUNCTIONS}
        for (kind, statements), codes in zip(self.phases, self._codes, strict=True):
            for (target, _), code in zip(statements, codes, strict=True):
                value = eval(code, functions, namespace)  # text checked above
                if kind == "sum":
                    value = np.sum(np.broadcast_to(value, shape), axis=-1, keepdims=True)
                elif kind == "columns":
                    value = np.sum(np.broadcast_to(value, shape).reshape(-1, shape[-1]), axis=0)
                namespace[target] = value
        return {name: np.array(np.broadcast_to(namespace[name], self.output_shape(name, shape)), dtype=dtype)
                for name in self.output_names}

    def output_shape(self, name: str, shape: tuple[int, ...]) -> tuple[int, ...]:
        """The shape of output `name` for inputs of the full shape `shape`."""
        if name in self.row_outputs:
            return (*shape[:-1], 1)
        if name in self.column_outputs:
            return shape[-1:]
        return shape

    def __repr__(self) -> str:
        return f"RowKernel({self.name}: {', '.join(self.input_names)} -> {', '.join(self.output_names)})"


# ---------------------------------------------------------------------------------------------------------------
# The kernels. Each statement follows the NumPy code of models.layers / mpiparallel.optim operation by operation
# (same operands, same order), so evaluate_numpy reproduces that code to the last bit.
# ---------------------------------------------------------------------------------------------------------------

_GELU_GATE = (
    # a = √(2/π)·(1 + 0.044715·x²), gate h = (1 + tanh(a·x))/2, as GELU.forward computes them
    ("a", f"x * x * {literal(GELU_SCALE * GELU_CUBIC)} + {literal(GELU_SCALE)}"),
    ("gate", "tanh(a * x) * 0.5 + 0.5"),
)

GELU_FORWARD = FusedKernel("gelu_forward", "T x", "T out", [*_GELU_GATE, ("out", "x * gate")])
"""out = x·h: one pass instead of seven. Nothing but x is kept: GELU_BACKWARD recomputes the gate."""

_GELU_DX = ("dx", f"((a * 6.0 - {literal(4.0 * GELU_SCALE)}) * gate * (x - out) + gate) * dout")
"""dx = dout·(h + (x − out)·h·(6a − 4√(2/π))), GELU.backward_input's formula."""

GELU_BACKWARD = FusedKernel("gelu_backward", "T x, T dout", "T dx",
                            [*_GELU_GATE, ("out", "x * gate"), _GELU_DX])
"""dx from x and dout in one pass: recomputing tanh is cheaper on a GPU than keeping and re-reading a and h."""

GELU_FORWARD_KEEPING = FusedKernel("gelu_forward_keeping", "T x", "T a, T gate, T out",
                                   [*_GELU_GATE, ("out", "x * gate")])
"""The CPU's GELU forward (models.host_kernels): GELU.forward's seven NumPy passes in one, keeping what they keep
(a and the gate) — so the compiled and NumPy paths save the same activations (layers.block_activation_elements),
and backward, GELU_BACKWARD_FROM_GATE, needs no second tanh (as fast, measured, as recomputing it)."""

GELU_BACKWARD_FROM_GATE = FusedKernel("gelu_backward_from_gate", "T x, T a, T gate, T out, T dout", "T dx",
                                      [_GELU_DX])
"""The CPU's GELU backward: dx from x, the kept a, gate and output, and dout, in one pass."""

LAYER_NORM_FORWARD = FusedKernel("layer_norm_forward", "T x, T mean, T rstd, T weight, T bias",
                                 "T normalized, T out", [
                                     ("normalized", "(x - mean) * rstd"),
                                     ("out", "normalized * weight + bias"),
                                 ])
"""Normalize and affine from the per-row mean and 1/std; writes `normalized`, which backward keeps."""

LAYER_NORM_BACKWARD = FusedKernel("layer_norm_backward",
                                  "T dout, T weight, T normalized, T rstd, T mean_dnorm, T mean_dnorm_norm", "T dx", [
                                      ("dx", "(dout * weight - mean_dnorm - normalized * mean_dnorm_norm) * rstd"),
                                  ])
"""dx = rstd·(dnorm − mean(dnorm) − normalized·mean(dnorm·normalized)), dnorm = dout·weight, from the row means."""

RMS_NORM_FORWARD = FusedKernel("rms_norm_forward", "T x, T rstd, T weight", "T normalized, T out", [
    ("normalized", "x * rstd"),
    ("out", "normalized * weight"),
])
"""RMSNorm's scale and weight from the per-row 1/rms; writes `normalized`, which backward keeps."""

RMS_NORM_BACKWARD = FusedKernel("rms_norm_backward", "T dout, T weight, T normalized, T rstd, T mean_dnorm_norm",
                                "T dx", [
                                    ("dx", "(dout * weight - normalized * mean_dnorm_norm) * rstd"),
                                ])
"""dx = rstd·(dnorm − normalized·mean(dnorm·normalized)), dnorm = dout·weight, from the row mean."""

# The CPU's norms: statistics and elementwise work in one pass over each row (models.host_kernels compiles them).
# The statements follow the NumPy chains of models.layers; the sums run in another order than those chains' GEMVs,
# so the numbers agree to rounding, not bit for bit.

LAYER_NORM_ROWS_FORWARD = RowKernel("layer_norm_rows_forward", "T x, T weight, T bias, T eps",
                                    "T normalized, T out, T rstd", [
                                        ("sum", [("sum_x", "x")]),
                                        ("row", [("mean", "sum_x / columns")]),
                                        ("sum", [("sum_squares", "(x - mean) * (x - mean)")]),
                                        ("row", [("rstd", "1.0 / sqrt(sum_squares / columns + eps)")]),
                                        ("each", [("normalized", "(x - mean) * rstd"),
                                                  ("out", "normalized * weight + bias")]),
                                    ])
"""LayerNorm forward: the mean, the (biased) variance of x − mean, then normalize and affine; keeps `normalized`
and `rstd` for backward."""

LAYER_NORM_ROWS_BACKWARD = RowKernel("layer_norm_rows_backward", "T dout, T weight, T normalized, T rstd",
                                     "T dx, T dweight, T dbias", [
                                         ("sum", [("sum_dnorm", "dout * weight"),
                                                  ("sum_dnorm_norm", "dout * weight * normalized")]),
                                         ("row", [("mean_dnorm", "sum_dnorm / columns"),
                                                  ("mean_dnorm_norm", "sum_dnorm_norm / columns")]),
                                         ("each", [("dx", "(dout * weight - mean_dnorm - normalized * mean_dnorm_norm)"
                                                          " * rstd")]),
                                         ("columns", [("dweight", "dout * normalized"), ("dbias", "dout")]),
                                     ])
"""LayerNorm's backward: dx = rstd·(dn − mean(dn) − n·mean(dn·n)), dn = dout·weight, and the weight and bias
gradients Σ dout·n and Σ dout."""

RMS_NORM_ROWS_FORWARD = RowKernel("rms_norm_rows_forward", "T x, T weight, T eps", "T normalized, T out, T rstd", [
    ("sum", [("sum_squares", "x * x")]),
    ("row", [("rstd", "1.0 / sqrt(sum_squares / columns + eps)")]),
    ("each", [("normalized", "x * rstd"), ("out", "normalized * weight")]),
])
"""RMSNorm forward: 1/rms, then scale and weight; keeps `normalized` and `rstd` for backward."""

RMS_NORM_ROWS_BACKWARD = RowKernel("rms_norm_rows_backward", "T dout, T weight, T normalized, T rstd",
                                   "T dx, T dweight", [
                                       ("sum", [("sum_dnorm_norm", "dout * weight * normalized")]),
                                       ("row", [("mean_dnorm_norm", "sum_dnorm_norm / columns")]),
                                       ("each", [("dx", "(dout * weight - normalized * mean_dnorm_norm) * rstd")]),
                                       ("columns", [("dweight", "dout * normalized")]),
                                   ])
"""RMSNorm's backward: dx = rstd·(dn − n·mean(dn·n)), dn = dout·weight, and the weight gradient Σ dout·n."""

ROW_DOTS = RowKernel("row_dots", "T a, T b", "T dot", [("sum", [("dot", "a * b")])])
"""Σ a·b over each row: attention's backward needs Σ_j p_ij·dp_ij, which is dy_i·y_i per query and head
(models.layers.row_dots); as one loop per row no a·b array is written and read back for the sums."""

_SIGMOID = ("sigmoid", "1.0 / (exp(-gate) + 1.0)")

SWIGLU_FORWARD = FusedKernel("swiglu_forward", "T gate, T up", "T out", [_SIGMOID, ("out", "gate * sigmoid * up")])
"""silu(gate)·up, silu(g) = g·σ(g): one pass over the two halves. Nothing but the input is kept: SWIGLU_BACKWARD
recomputes σ."""

SWIGLU_BACKWARD = FusedKernel("swiglu_backward", "T gate, T up, T dout", "T dgate, T dup", [
    _SIGMOID,
    ("silu", "gate * sigmoid"),
    ("dup", "dout * silu"),
    # silu'(g) = s + g·s·(1 − s) = s + silu·(1 − s), SwiGLU.backward_input's formula
    ("dgate", "dout * up * ((1.0 - sigmoid) * silu + sigmoid)"),
])
"""d(gate) and d(up) from the two halves and dy in one pass, written into the halves of one d(input) array."""

SWIGLU_FORWARD_KEEPING = FusedKernel("swiglu_forward_keeping", "T gate, T up", "T sigmoid, T silu, T out",
                                     [_SIGMOID, ("silu", "gate * sigmoid"), ("out", "silu * up")])
"""The CPU's SwiGLU forward (models.host_kernels): SwiGLU.forward's NumPy passes in one, reading the halves where
they lie (strided) and keeping what the chain keeps, σ(gate) and silu(gate) — so both paths save the same."""

SWIGLU_BACKWARD_FROM_SIGMOID = FusedKernel("swiglu_backward_from_sigmoid", "T up, T sigmoid, T silu, T dout",
                                           "T dgate, T dup", [
                                               ("dup", "dout * silu"),
                                               ("dgate", "((1.0 - sigmoid) * silu + sigmoid) * up * dout"),
                                           ])
"""The CPU's SwiGLU backward: d(gate) and d(up) from the kept σ and silu, written into the halves of d(input)."""

SOFTMAX_EXP = FusedKernel("softmax_exp", "T scores, T row_max", "T exps", [("exps", "exp(scores - row_max)")],
                          in_place={"exps": "scores"})
"""exp(scores − row max), masked −inf entries becoming 0; the caller divides by the row sums."""

SOFTMAX_BACKWARD = FusedKernel("softmax_backward", "T probs, T dprobs, T weighted_sum", "T dscores", [
    ("dscores", "(dprobs - weighted_sum) * probs"),
], in_place={"dscores": "dprobs"})
"""d(scores) = p·(dp − Σ dp·p) from the row sums Σ dp·p."""

ADAMW = FusedKernel("adamw", "T param, T grad, T exp_avg, T exp_avg_sq, T decay, T beta1, T one_minus_beta1, "
                    "T beta2, T one_minus_beta2, T step_size, T sqrt_bias_correction2, T eps",
                    "T new_param, T new_exp_avg, T new_exp_avg_sq", [
                        ("new_exp_avg", "exp_avg * beta1 + grad * one_minus_beta1"),
                        ("new_exp_avg_sq", "exp_avg_sq * beta2 + grad * one_minus_beta2 * grad"),
                        ("new_param", "param * decay - new_exp_avg / (sqrt(new_exp_avg_sq) / sqrt_bias_correction2"
                                      " + eps) * step_size"),
                    ], in_place={"new_param": "param", "new_exp_avg": "exp_avg", "new_exp_avg_sq": "exp_avg_sq"})
"""One AdamW step: reads p, g, m, v once and writes p, m, v once (in place when called so). decay = 1 − lr·wd (1
without decay), 1 − β1 and 1 − β2 computed in double as NumPy's `grad * (1 - beta1)` computes them (so the compiled
CPU kernel gives the NumPy step's numbers), step_size = lr / (1 − β1^t), sqrt_bias_correction2 = √(1 − β2^t): see
mpiparallel.optim.adamw_kernel_scalars."""
