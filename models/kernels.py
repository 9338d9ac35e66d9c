"""Fused elementwise kernels (GELU, LayerNorm, RMSNorm, SwiGLU, softmax, AdamW): one text, run on a GPU and a CPU.

Why fuse: GELU, the norms' normalize-and-affine, SwiGLU, softmax's shift-and-exponential and the AdamW step are
chains of elementwise operations. Run one array operation at a time, every operation is a trip through memory
(and on a GPU a kernel launch), so each chain becomes one kernel that reads and writes every element once.
Reductions (row maxima, row sums, means, variances) stay outside: CuPy reductions or GEMVs on a GPU, BLAS GEMVs
and NumPy reductions on a CPU; the kernels take their per-row results as broadcast inputs.

Why as data: a kernel is its parameters plus statements `(target, expression)`, and every expression is text that
C and Python read alike — names, literals with a decimal point, + - * /, unary minus, parentheses and the
functions in `FUNCTIONS`. The one text is the formula's only definition, for both devices:

    GPU    `cuda_source()` joins the statements into the loop body of one `cupy.ElementwiseKernel`;
    CPU    `HostProgram` compiles them to NumPy ufunc calls and runs them over cache-sized blocks of the arrays,
           on the rank's threads (`host_threads()`, the budget BLAS gets): one pass through memory per kernel,
           each operation on NumPy's SIMD loops. (numexpr, which evaluates expressions the same way, was slower
           here by 5-90x: its PyPI build computes tanh and exp one element at a time.)

`evaluate_numpy()` evaluates the text plainly, array operation by array operation: the reference the CUDA source
is read against in the tests.

Parameters use CuPy's syntax: `T name` has the arrays' dtype (a Python scalar passed for it is converted to that
dtype), `float64 name` a fixed one. Kernels are pure functions of their inputs; "in place" is a way of calling
them: pass an input array again as the output it is paired with in `in_place`. That is safe because each element
is read before the output element is written (checked: no statement after the output's first assignment reads
the input); CuPy's ElementwiseKernel does not copy aliased arguments, and a host pass cuts both alike.

Precision: in float64 a kernel agrees with plain NumPy arithmetic to rounding (on a CPU bit for bit; the CUDA math
library and the compiler's fused multiply-adds differ in the last bits). In float32 the CUDA locals and outputs
are float, but C evaluates any operation with a literal or a double in double precision before rounding to float
(more accurate, not identical); a host pass follows NumPy, where literals are float32 like the arrays.

Communication: none. Cost: one read of every input element and one write of every output element per call.
"""

from __future__ import annotations

import ast
import math
import os
import re
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
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
"""GPT-2's tanh approximation constants."""


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


class FusedKernel:
    """One elementwise kernel: inputs, outputs and statements, runnable by CuPy and by NumPy.

    `kernel(**arrays)` runs it on CuPy arrays (one `cupy.ElementwiseKernel`, built on first use; CuPy compiles it
    per dtype) or on NumPy arrays (one `HostProgram` pass, compiled on first use), writing into the outputs that
    are passed — all of them or none, as CuPy requires — and returns {output name: array}.
    `evaluate_numpy(**arrays)` computes the outputs operation by operation as new arrays (the plain reference).
    `in_place` maps outputs to the inputs they may overwrite (the same array passed for both).
    """

    def __init__(self, name: str, inputs: str, outputs: str, statements: Sequence[tuple[str, str]],
                 in_place: dict[str, str] | None = None) -> None:
        self.name = _checked_name(name, "kernel")
        self.inputs, self.outputs = parse_params(inputs), parse_params(outputs)
        self.input_names = tuple(name for _, name in self.inputs)
        self.output_names = tuple(name for _, name in self.outputs)
        self.statements = tuple(statements)
        self.target_names = tuple(target for target, _ in self.statements)
        self.in_place = dict(in_place or {})
        self._reads = self._check_statements()
        self._check_in_place()
        self._codes = [compile(expression, f"<{name}: {target}>", "eval") for target, expression in self.statements]
        self._trees = [ast.parse(expression, mode="eval").body for _, expression in self.statements]
        self._compiled: dict[str, Any] = {}
        self._host_programs: dict[frozenset[str], HostProgram] = {}

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
        """Run on CuPy arrays (one ElementwiseKernel) or NumPy arrays (one blocked pass, `HostProgram`); outputs
        passed (all or none) are written, the others allocated. Scalars passed for `T` take the arrays' dtype."""
        given = tuple(name for name in self.output_names if name in arrays)
        self._check_arguments(arrays, required=self.input_names + (self.output_names if given else ()),
                              allowed=self.input_names + self.output_names)
        self._check_aliasing(arrays)
        device_arrays = [a for a in arrays.values() if is_device_array(a)]
        if not device_arrays:
            return self._host_program(arrays).run(arrays)
        kernel = self._elementwise_kernel(get_array_module(device_arrays[0]))
        results = kernel(*(arrays[name] for name in self.input_names + given))
        return dict(zip(self.output_names, results if isinstance(results, tuple) else (results,), strict=True))

    def _host_program(self, arrays: dict[str, Array]) -> HostProgram:
        """The compiled NumPy program for this set of scalar inputs (their subexpressions run once per call)."""
        scalars = frozenset(name for name in self.input_names if getattr(arrays[name], "ndim", 0) == 0)
        if scalars not in self._host_programs:
            self._host_programs[scalars] = HostProgram(self, scalars)
        return self._host_programs[scalars]

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


BLOCK_ELEMENTS = 1 << 15
"""Elements per block of a host pass: a block's inputs, outputs and registers (32 Ki elements of 4 or 8 bytes
each) stay in a core's L2 cache, while the ufunc calls still run long enough to dwarf their ~1 µs of Python."""

_UFUNCS = {ast.Add: np.add, ast.Sub: np.subtract, ast.Mult: np.multiply, ast.Div: np.divide}
_OPERATIONS = (ast.BinOp, ast.UnaryOp, ast.Call)


def _copy(value: Any, out: np.ndarray) -> np.ndarray:
    np.copyto(out, value)
    return out


class HostProgram:
    """A kernel's statements as NumPy ufunc calls run block by block: the whole kernel is one pass through
    memory, and each operation runs on NumPy's SIMD loops over a block that stays in cache.

    Compiled once per kernel and set of scalar inputs. Every operation of the text becomes one ufunc call writing
    into a register (a block of scratch, reused once its value is dead) or, when it completes an output, into the
    output's block itself; operations on scalars alone (1 − β1) run once per call, before the blocks. Arrays are
    cut into blocks of elements when they all have the full shape, else into blocks of rows of the last axis,
    which per-row statistics ((…, 1): means, maxima) and per-channel weights ((C,)) broadcast against; any other
    broadcast runs as one block. Operations run in the text's order with NumPy's rules, so in float64 the result
    is `evaluate_numpy`'s bit for bit, and in float32 literals are float32 (NumPy's weak scalars), where CUDA
    computes them in double. With `host_threads()` > 1 the blocks are shared out among that many threads
    (NumPy's loops release the GIL).

    Values live in numbered slots: the inputs, the outputs, the literals and scalar results, the registers.
    A step is (ufunc, operand slots, destination slot).
    """

    def __init__(self, kernel: FusedKernel, scalars: frozenset[str]) -> None:
        self.kernel = kernel
        self.slots: dict[str, int] = {name: k for k, name in enumerate(kernel.input_names + kernel.output_names)}
        self.literals: dict[int, float] = {}
        self.uniform_steps: list[tuple[Any, tuple[int, ...], int]] = []  # once per call
        self.block_steps: list[tuple[Any, tuple[int, ...], int]] = []  # once per block
        self.registers: list[int] = []  # slots of the block-sized scratch arrays
        self._compile(set(scalars))

    def _slot(self, name: str) -> int:
        return self.slots.setdefault(name, len(self.slots))

    def _compile(self, uniform: set[str]) -> None:
        kernel, free = self.kernel, []
        last_read = {name: index for index, read in enumerate(kernel._reads) for name in read}
        location = {name: name for name in kernel.input_names}  # the slot name holding each name's value
        for index, (target, tree) in enumerate(zip(kernel.target_names, kernel._trees, strict=True)):
            output = target if target in kernel.output_names else None
            result = self._emit(tree, location, uniform, free, output)
            if output is not None and result != output:  # a bare name, literal or scalar: copied into the output
                self.block_steps.append((_copy, (self._slot(result),), self._slot(output)))
                result = output
            elif output is None and isinstance(tree, ast.Name) and result not in uniform:
                destination = self._register(free)  # a local never shares another name's register
                self.block_steps.append((_copy, (self._slot(result),), self._slot(destination)))
                result = destination
            location[target] = result
            for name in [n for n in location if n not in kernel.output_names and n not in kernel.input_names]:
                if last_read.get(name, -1) <= index:  # no later statement reads it: its register is free
                    value = location.pop(name)
                    if value.startswith("%"):
                        free.append(value)

    def _register(self, free: list[str]) -> str:
        if free:
            return free.pop()
        name = f"%{len(self.registers)}"
        self.registers.append(self._slot(name))
        return name

    def _emit(self, node: ast.AST, location: dict[str, str], uniform: set[str], free: list[str],
              destination: str | None) -> str:
        """Steps computing `node`; returns the slot name of its value: a literal, a name, a scalar, a register."""
        if isinstance(node, ast.Constant):
            name = f"#{node.value!r}"
            self.literals[self._slot(name)] = float(node.value)
            uniform.add(name)
            return name
        if isinstance(node, ast.Name):
            return location[node.id]
        if isinstance(node, ast.BinOp):
            function, children = _UFUNCS[type(node.op)], (node.left, node.right)
        elif isinstance(node, ast.UnaryOp):
            function, children = np.negative, (node.operand,)
        else:
            function, children = FUNCTIONS[node.func.id], tuple(node.args)
        operands = tuple(self._emit(child, location, uniform, free, None) for child in children)
        if all(operand in uniform for operand in operands):
            name = f"${len(self.uniform_steps)}"
            uniform.add(name)
            self.uniform_steps.append((function, tuple(map(self._slot, operands)), self._slot(name)))
            return name
        for child, operand in zip(children, operands, strict=True):  # a temporary's one reader is this step
            if isinstance(child, _OPERATIONS) and operand.startswith("%"):
                free.append(operand)
        destination = destination or self._register(free)
        self.block_steps.append((function, tuple(map(self._slot, operands)), self._slot(destination)))
        return destination

    def run(self, arrays: dict[str, Any]) -> dict[str, np.ndarray]:
        """The outputs for NumPy inputs (scalars or arrays), written into the outputs passed or new arrays."""
        kernel = self.kernel
        dtype = self._dtype(arrays)
        slots: list[Any] = [None] * len(self.slots)
        inputs = {}
        for ctype, name in kernel.inputs:
            wanted, value = dtype if ctype == LOCAL_TYPE else np.dtype(ctype), arrays[name]
            if getattr(value, "ndim", 0) == 0:
                slots[self.slots[name]] = wanted.type(value)
            else:
                inputs[self.slots[name]] = value if value.dtype == wanted else value.astype(wanted)
        shape = _broadcast_shape([a.shape for a in inputs.values()]
                                 + [arrays[n].shape for n in kernel.output_names if n in arrays])
        outputs = {self.slots[name]: self._output(arrays.get(name), dtype if ctype == LOCAL_TYPE else
                                                  np.dtype(ctype), shape)
                   for ctype, name in kernel.outputs}
        for slot, value in self.literals.items():
            slots[slot] = dtype.type(value)
        for function, operands, destination in self.uniform_steps:
            slots[destination] = function(*[slots[k] for k in operands])
        blocks = _Blocks.of(shape, inputs, outputs)
        for slot, value in blocks.whole.items():
            slots[slot] = value
        self._run(slots, blocks, dtype)
        return {name: outputs[self.slots[name]] for name in kernel.output_names}

    def _run(self, slots: list[Any], blocks: _Blocks, dtype: np.dtype) -> None:
        """The block steps over every block, shared out among up to `host_threads()` threads."""
        count = -(-blocks.extent // blocks.step)
        threads = min(host_threads(), count)
        if threads <= 1:
            self._run_blocks(slots, blocks, dtype, 0, blocks.extent)
            return
        per_thread = -(-count // threads) * blocks.step
        futures = [_pool().submit(self._run_blocks, list(slots), blocks, dtype, start,
                                  min(start + per_thread, blocks.extent))
                   for start in range(0, blocks.extent, per_thread)]
        for future in futures:
            future.result()

    def _run_blocks(self, slots: list[Any], blocks: _Blocks, dtype: np.dtype, start: int, stop: int) -> None:
        """The block steps over blocks [start, stop) (rows or elements), with registers of this thread's own."""
        scratch = np.empty((len(self.registers), *blocks.block_shape), dtype)
        for begin in range(start, stop, blocks.step):
            end = min(begin + blocks.step, stop)
            for slot, array in blocks.sliced.items():
                slots[slot] = array[begin:end]
            for register, slot in enumerate(self.registers):
                slots[slot] = scratch[register, :end - begin] if blocks.sliced else scratch[register]
            for function, operands, destination in self.block_steps:
                function(*[slots[k] for k in operands], slots[destination])

    def _dtype(self, arrays: dict[str, Any]) -> np.dtype:
        """T's dtype: the common type of the arrays passed for T (of the scalars when there are none), as CuPy
        resolves it."""
        bound = [arrays[name] for ctype, name in self.kernel.inputs if ctype == LOCAL_TYPE]
        dtypes = {a.dtype for a in bound if getattr(a, "ndim", 0) > 0}
        if len(dtypes) == 1:
            return dtypes.pop()
        return np.result_type(*(dtypes or [np.asarray(a).dtype for a in bound]))

    def _output(self, out: np.ndarray | None, dtype: np.dtype, shape: tuple[int, ...]) -> np.ndarray:
        if out is None:
            return np.empty(shape, dtype)
        if out.shape != shape or out.dtype != dtype:
            raise TypeError(f"{self.kernel.name}: an output is {out.dtype} {out.shape}, the kernel writes {dtype} "
                            f"{shape}")
        return out


class _Blocks:
    """How a host pass cuts its arrays (by slot): `sliced` along their first axis into blocks of `step` rows or
    elements, over `extent` of them; `whole` broadcast to every block; a block of registers is `block_shape`."""

    def __init__(self, sliced: dict[int, np.ndarray], whole: dict[int, np.ndarray], extent: int, step: int,
                 block_shape: tuple[int, ...]) -> None:
        self.sliced, self.whole, self.extent, self.step, self.block_shape = sliced, whole, extent, step, block_shape

    @classmethod
    def of(cls, shape: tuple[int, ...], inputs: dict[int, np.ndarray], outputs: dict[int, np.ndarray]) -> _Blocks:
        arrays = {**inputs, **outputs}
        if all(a.shape == shape for a in arrays.values()):
            flat = {slot: a.reshape(-1) for slot, a in arrays.items()}
            if _views(flat, outputs):
                step = min(BLOCK_ELEMENTS, math.prod(shape))
                return cls(flat, {}, math.prod(shape), max(step, 1), (max(step, 1),))
        elif len(shape) >= 2:
            rows, width = math.prod(shape[:-1]), shape[-1]
            sliced, whole = {}, {}
            for slot, a in arrays.items():
                padded = (1,) * (len(shape) - a.ndim) + a.shape
                if padded[:-1] == shape[:-1]:  # full rows, or one value per row
                    sliced[slot] = a.reshape(rows, padded[-1])
                elif all(size == 1 for size in padded[:-1]):  # one value per channel
                    whole[slot] = a.reshape(padded[-1])
                else:
                    break
            else:
                if _views(sliced, outputs):
                    step = max(1, min(BLOCK_ELEMENTS // max(width, 1), rows))
                    return cls(sliced, whole, rows, step, (step, width))
        return cls({}, arrays, 1, 1, shape)  # one block: the arrays as they are


def _broadcast_shape(shapes: list[tuple[int, ...]]) -> tuple[int, ...]:
    first = shapes[0] if shapes else ()
    return first if all(shape == first for shape in shapes) else np.broadcast_shapes(*shapes)


def _views(reshaped: dict[int, np.ndarray], outputs: dict[int, np.ndarray]) -> bool:
    """Whether every reshaped output is a view of the output (writes reach it); inputs may have been copied."""
    return all(out.size == 0 or np.may_share_memory(reshaped[slot], out) for slot, out in outputs.items())


_HOST_THREADS: list[int] = []
_POOL: list[ThreadPoolExecutor] = []


def host_threads() -> int:
    """Threads of the host passes: `set_host_threads`'s, else OMP_NUM_THREADS (the budget `mpiparallel` gives
    BLAS: cores ÷ ranks on the node), else this process's cores."""
    if not _HOST_THREADS:
        variable = os.environ.get("OMP_NUM_THREADS", "")
        _HOST_THREADS.append(int(variable) if variable.isdigit() and int(variable) > 0
                             else len(os.sched_getaffinity(0)))
    return _HOST_THREADS[0]


def set_host_threads(threads: int) -> None:
    """Use `threads` threads for host passes from now on (the BLAS budget of this rank)."""
    if threads < 1:
        raise ValueError(f"host threads must be at least 1, got {threads}")
    _HOST_THREADS[:] = [threads]
    if _POOL and _POOL[0]._max_workers != threads:
        _POOL.pop().shutdown()


def _pool() -> ThreadPoolExecutor:
    if not _POOL:
        _POOL.append(ThreadPoolExecutor(max_workers=host_threads(), thread_name_prefix="mpiparallel-kernels"))
    return _POOL[0]


# ---------------------------------------------------------------------------------------------------------------
# The kernels: the one definition of each elementwise formula that models.layers and mpiparallel.optim use, on a
# CPU (HostProgram) and a GPU (ElementwiseKernel) alike.
# ---------------------------------------------------------------------------------------------------------------

# GELU and SwiGLU each come as a pair of texts that share their statements: the GPU's backward recomputes the
# gate from the input (a GPU is memory-bound: a tanh costs less than writing the gate and reading it back); the
# CPU's keeps the gate that forward wrote (a CPU is compute-bound: tanh and exp cost more than the memory pass).

_GELU_GATE = (
    # a = √(2/π)·(1 + 0.044715·x²), gate h = (1 + tanh(a·x))/2
    ("a", f"x * x * {literal(GELU_SCALE * GELU_CUBIC)} + {literal(GELU_SCALE)}"),
    ("gate", "tanh(a * x) * 0.5 + 0.5"),
)
_GELU_GRADIENT = (
    ("out", "x * gate"),
    # dx = dout·(h + (x − out)·h·(6a − 4√(2/π))): h + 2·x·h·(1 − h)·du/dx with u = a·x, du/dx = 3a − 2√(2/π)
    ("dx", f"((a * 6.0 - {literal(4.0 * GELU_SCALE)}) * gate * (x - out) + gate) * dout"),
)

GELU_FORWARD = FusedKernel("gelu_forward", "T x", "T out", [*_GELU_GATE, ("out", "x * gate")])
"""out = x·h (GPU): nothing but x is kept; GELU_BACKWARD recomputes the gate."""

GELU_BACKWARD = FusedKernel("gelu_backward", "T x, T dout", "T dx", [*_GELU_GATE, *_GELU_GRADIENT])
"""dx from x and dout (GPU), the gate recomputed."""

GELU_FORWARD_KEEPING_GATE = FusedKernel("gelu_forward_keeping_gate", "T x", "T out, T gate",
                                        [*_GELU_GATE, ("out", "x * gate")])
"""out = x·h and the gate h (CPU), which GELU_BACKWARD_FROM_GATE reads instead of a second tanh."""

GELU_BACKWARD_FROM_GATE = FusedKernel("gelu_backward_from_gate", "T x, T gate, T dout", "T dx",
                                      [_GELU_GATE[0], *_GELU_GRADIENT])
"""dx from x, the kept gate and dout (CPU): a is two multiply-adds of x."""

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

_SIGMOID = ("sigmoid", "1.0 / (exp(-gate) + 1.0)")
_SWIGLU_GRADIENT = (
    ("silu", "gate * sigmoid"),
    ("dup", "dout * silu"),
    # silu'(g) = s + g·s·(1 − s) = s + silu·(1 − s)
    ("dgate", "dout * up * ((1.0 - sigmoid) * silu + sigmoid)"),
)

SWIGLU_FORWARD = FusedKernel("swiglu_forward", "T gate, T up", "T out", [_SIGMOID, ("out", "gate * sigmoid * up")])
"""silu(gate)·up, silu(g) = g·σ(g) (GPU): one pass over the two halves; SWIGLU_BACKWARD recomputes σ."""

SWIGLU_BACKWARD = FusedKernel("swiglu_backward", "T gate, T up, T dout", "T dgate, T dup",
                              [_SIGMOID, *_SWIGLU_GRADIENT])
"""d(gate) and d(up) from the two halves and dy (GPU), written into the halves of one d(input) array."""

SWIGLU_FORWARD_KEEPING_SIGMOID = FusedKernel("swiglu_forward_keeping_sigmoid", "T gate, T up", "T out, T sigmoid",
                                             [_SIGMOID, ("out", "gate * sigmoid * up")])
"""silu(gate)·up and σ(gate) (CPU), which SWIGLU_BACKWARD_FROM_SIGMOID reads instead of a second exp."""

SWIGLU_BACKWARD_FROM_SIGMOID = FusedKernel("swiglu_backward_from_sigmoid", "T gate, T up, T sigmoid, T dout",
                                           "T dgate, T dup", list(_SWIGLU_GRADIENT))
"""d(gate) and d(up) from the two halves, the kept σ(gate) and dy (CPU)."""

SOFTMAX_EXP = FusedKernel("softmax_exp", "T scores, T row_max", "T exps", [("exps", "exp(scores - row_max)")],
                          in_place={"exps": "scores"})
"""exp(scores − row max), masked −inf entries becoming 0; the caller divides by the row sums."""

SOFTMAX_BACKWARD = FusedKernel("softmax_backward", "T probs, T dprobs, T weighted_sum", "T dscores", [
    ("dscores", "(dprobs - weighted_sum) * probs"),
], in_place={"dscores": "dprobs"})
"""d(scores) = p·(dp − Σ dp·p) from the row sums Σ dp·p."""

ADAMW = FusedKernel("adamw", "T param, T grad, T exp_avg, T exp_avg_sq, T decay, T beta1, T beta2, T step_size, "
                    "T sqrt_bias_correction2, T eps", "T new_param, T new_exp_avg, T new_exp_avg_sq", [
                        ("new_exp_avg", "exp_avg * beta1 + grad * (1.0 - beta1)"),
                        ("new_exp_avg_sq", "exp_avg_sq * beta2 + grad * (1.0 - beta2) * grad"),
                        ("new_param", "param * decay - new_exp_avg / (sqrt(new_exp_avg_sq) / sqrt_bias_correction2"
                                      " + eps) * step_size"),
                    ], in_place={"new_param": "param", "new_exp_avg": "exp_avg", "new_exp_avg_sq": "exp_avg_sq"})
"""One AdamW step: reads p, g, m, v once and writes p, m, v once (in place when called so). decay = 1 − lr·wd (1
without decay), step_size = lr / (1 − β1^t), sqrt_bias_correction2 = √(1 − β2^t): see
mpiparallel.optim.adamw_kernel_scalars."""
