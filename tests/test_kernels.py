"""Fused kernels: each kernel computes the math it stands for, on the CPU and the GPU, and its text is valid C.

Every kernel runs as a host pass on NumPy arrays (cut into many small blocks here, and over two threads), on the
CuPy test double (tests/fake_cupy.py, whose ElementwiseKernel executes the operation text with NumPy) and, where
CuPy finds a GPU, as a real CUDA kernel; each result is compared with the math written out independently in this
file (INDEPENDENT_FORMULAS), never with the kernel's own statements. The generated CUDA source is read the way C
reads it. The layers' device branches (the reductions around the kernels) then run end to end on the device and
must equal the NumPy path. Errors are max-norm relative: max|actual − expected| / max|expected|.
"""

from __future__ import annotations

import math
import os
import re
import subprocess
import sys

import fake_cupy
import numpy as np
import pytest
from mpi_harness import mpiexec_path, run_with_timeout
from workers.errors import relative_error as nan_aware_relative_error
from workers.errors import worst

from collectives import backend
from models import kernels
from models.gpt import GPT, GPTConfig
from models.kernels import FusedKernel, literal
from models.layers import (
    GELU,
    MLP,
    Block,
    CausalSelfAttention,
    LayerNorm,
    Linear,
    TiedHeadCrossEntropy,
    causal_softmax,
    softmax_backward,
)
from models.parameter import Parameter
from mpiparallel.optim import AdamW, adamw_kernel_scalars, adamw_update

RNG = np.random.default_rng(2024)
B, T, C, H, VOCAB = 2, 7, 8, 2, 11
TOLERANCE = 1e-12
KERNELS = [value for value in vars(kernels).values() if isinstance(value, FusedKernel)]
GPU = pytest.mark.skipif(not backend.cupy_available(), reason="needs CuPy and an NVIDIA GPU (pip install -e '.[gpu]')")


def host(x) -> np.ndarray:
    return x.get() if hasattr(x, "get") else np.asarray(x)


def relative_error(actual, expected) -> float:
    actual, expected = host(actual), host(expected)
    assert actual.shape == expected.shape, f"shape {actual.shape} != {expected.shape}"
    return nan_aware_relative_error(actual, expected)


def assert_matches(actual, expected, what: str = "", tolerance: float = TOLERANCE) -> None:
    error = relative_error(actual, expected)
    assert error <= tolerance, f"{what}: relative error {error:.3g} > {tolerance:g}"


def test_kernel_list_is_complete():
    assert {k.name for k in KERNELS} == {"gelu_forward", "gelu_backward", "gelu_forward_keeping_gate",
                                         "gelu_backward_from_gate", "layer_norm_forward", "layer_norm_backward",
                                         "rms_norm_forward", "rms_norm_backward", "swiglu_forward", "swiglu_backward",
                                         "swiglu_forward_keeping_sigmoid", "swiglu_backward_from_sigmoid",
                                         "softmax_exp", "softmax_backward", "adamw"}


# ---------------------------------------------------------------------------------------------------------------
# Each kernel against the math written out independently, on every array module.
# ---------------------------------------------------------------------------------------------------------------


DEVICES = ["fake", pytest.param("cupy", marks=GPU)]
on_devices = pytest.mark.parametrize("xp", DEVICES, indirect=True)
"""For the layers' device branches, compared with their NumPy path."""


@pytest.fixture(params=["numpy", *DEVICES])
def xp(request, monkeypatch):
    """The array module: NumPy (host passes in blocks of 4 elements or one row, on two threads, so blocks are
    many and the last one partial), the CuPy test double on any machine, CuPy on a GPU."""
    if request.param == "numpy":
        monkeypatch.setattr(kernels, "BLOCK_ELEMENTS", 4)
        threads = kernels.host_threads()
        kernels.set_host_threads(2)
        yield np
        kernels.set_host_threads(threads)
        return
    if request.param == "cupy":
        import cupy

        yield cupy
        return
    monkeypatch.setattr(backend, "_cupy", backend._cupy)  # restored, with the rest, when the test ends
    monkeypatch.setattr(backend.HostStaging, "possible", backend.HostStaging.possible)
    monkeypatch.setitem(sys.modules, "cupyx", sys.modules.get("cupyx"))
    monkeypatch.setattr(np, "asarray", np.asarray)  # install() makes them refuse device arrays, as CuPy does
    monkeypatch.setattr(np, "array", np.array)
    yield fake_cupy.install()
    backend.cuda_aware_mpi.cache_clear()


ADAMW_STEP = {"step": 3, "lr": 1e-2, "beta1": 0.9, "beta2": 0.95, "eps": 1e-8, "weight_decay": 0.1}


def _gelu_textbook(x):
    """GELU's tanh approximation, its derivative and its gate Φ̃ (out = x·Φ̃), as the paper writes them (not as the
    kernels factor them)."""
    s, c = math.sqrt(2 / math.pi), 0.044715
    t = np.tanh(s * (x + c * x**3))
    return 0.5 * x * (1 + t), 0.5 * (1 + t) + 0.5 * x * (1 - t**2) * s * (1 + 3 * c * x**2), 0.5 * (1 + t)


def _swiglu_textbook(gate, up):
    """silu(g)·u and its partial derivatives d/dg = u·(σ(g) + g·σ(g)·(1 − σ(g))), d/du = silu(g)."""
    sigmoid = 1 / (1 + np.exp(-gate))
    return gate * sigmoid * up, up * (sigmoid + gate * sigmoid * (1 - sigmoid)), gate * sigmoid


def _adamw_textbook(param, grad, exp_avg, exp_avg_sq, step, lr, beta1, beta2, eps, weight_decay):
    m = beta1 * exp_avg + (1 - beta1) * grad
    v = beta2 * exp_avg_sq + (1 - beta2) * grad**2
    m_hat, v_hat = m / (1 - beta1**step), v / (1 - beta2**step)
    return {"new_param": param * (1 - lr * weight_decay) - lr * m_hat / (np.sqrt(v_hat) + eps),
            "new_exp_avg": m, "new_exp_avg_sq": v}


INDEPENDENT_FORMULAS = {
    # what each kernel computes, written from the math, not from the kernel's statements
    "gelu_forward": lambda x: {"out": _gelu_textbook(x)[0]},
    "gelu_backward": lambda x, dout: {"dx": dout * _gelu_textbook(x)[1]},
    "gelu_forward_keeping_gate": lambda x: {"out": _gelu_textbook(x)[0], "gate": _gelu_textbook(x)[2]},
    "gelu_backward_from_gate": lambda x, gate, dout: {"dx": dout * _gelu_textbook(x)[1]},
    "layer_norm_forward": lambda x, mean, rstd, weight, bias: {"normalized": (x - mean) * rstd,
                                                              "out": weight * ((x - mean) * rstd) + bias},
    "layer_norm_backward": lambda dout, weight, normalized, rstd, mean_dnorm, mean_dnorm_norm: {
        "dx": rstd * (dout * weight - mean_dnorm - normalized * mean_dnorm_norm)},
    "rms_norm_forward": lambda x, rstd, weight: {"normalized": x * rstd, "out": weight * x * rstd},
    "rms_norm_backward": lambda dout, weight, normalized, rstd, mean_dnorm_norm: {
        "dx": rstd * (dout * weight - normalized * mean_dnorm_norm)},
    "swiglu_forward": lambda gate, up: {"out": _swiglu_textbook(gate, up)[0]},
    "swiglu_backward": lambda gate, up, dout: {"dgate": dout * _swiglu_textbook(gate, up)[1],
                                               "dup": dout * _swiglu_textbook(gate, up)[2]},
    "swiglu_forward_keeping_sigmoid": lambda gate, up: {"out": _swiglu_textbook(gate, up)[0],
                                                        "sigmoid": 1 / (1 + np.exp(-gate))},
    "swiglu_backward_from_sigmoid": lambda gate, up, sigmoid, dout: {"dgate": dout * _swiglu_textbook(gate, up)[1],
                                                                     "dup": dout * _swiglu_textbook(gate, up)[2]},
    "softmax_exp": lambda scores, row_max: {"exps": np.exp(scores - row_max)},
    "softmax_backward": lambda probs, dprobs, weighted_sum: {"dscores": probs * (dprobs - weighted_sum)},
    "adamw": lambda param, grad, exp_avg, exp_avg_sq, **scalars: _adamw_textbook(param, grad, exp_avg, exp_avg_sq,
                                                                                  **ADAMW_STEP),
}


def kernel_arguments(kernel: FusedKernel, dtype) -> tuple[dict[str, np.ndarray], dict[str, float]]:
    """Random inputs for `kernel` broadcast as the layers pass them ((3, 1) per row, (5,) per channel), and its
    scalars."""
    shapes = {"mean": (3, 1), "rstd": (3, 1), "row_max": (3, 1), "weighted_sum": (3, 1), "mean_dnorm": (3, 1),
              "mean_dnorm_norm": (3, 1), "weight": (5,), "bias": (5,)}
    scalars = adamw_kernel_scalars(**ADAMW_STEP) if "step_size" in kernel.input_names else {}
    arrays = {name: RNG.uniform(0.5, 1.5, shapes.get(name, (3, 5))).astype(dtype)
              for name in kernel.input_names if name not in scalars}
    if kernel.name == "gelu_backward_from_gate":  # the gate forward kept for this x
        arrays["gate"] = _gelu_textbook(arrays["x"].astype(np.float64))[2].astype(dtype)
    if kernel.name == "swiglu_backward_from_sigmoid":
        arrays["sigmoid"] = (1 / (1 + np.exp(-arrays["gate"].astype(np.float64)))).astype(dtype)
    return arrays, scalars


def independent_error(kernel: FusedKernel, formula: str | None = None, dtype=np.float64, xp=np) -> float:
    """Largest relative error of `kernel`'s outputs against INDEPENDENT_FORMULAS[formula or its name]."""
    arrays, scalars = kernel_arguments(kernel, dtype)
    expected = INDEPENDENT_FORMULAS[formula or kernel.name](
        **{name: a.astype(np.float64) for name, a in arrays.items()}, **scalars)
    result = kernel(**{name: xp.asarray(a) for name, a in arrays.items()}, **scalars)
    assert set(result) == set(expected)
    for name, value in result.items():
        assert value.dtype == dtype, f"{name} is {value.dtype}"
    return worst([relative_error(result[name], expected[name]) for name in expected])


@pytest.mark.parametrize("dtype, tolerance", [(np.float64, TOLERANCE), (np.float32, 1e-5)])
@pytest.mark.parametrize("kernel", KERNELS, ids=lambda k: k.name)
def test_kernel_equals_an_independent_formula(xp, kernel, dtype, tolerance):
    """Each kernel run (float32 too: T is float there, and no literal or scalar widens it); inputs that
    broadcast, as the layers pass. Compared with the math written out here in float64, never with the kernel's
    own statements: the host pass and the CuPy double evaluate those with NumPy, so that could not fail."""
    error = independent_error(kernel, dtype=dtype, xp=xp)
    assert error <= tolerance, f"{kernel.name}: relative error {error:.3g} > {tolerance:g}"



def changed(kernel: FusedKernel, old: str, new: str) -> FusedKernel:
    """`kernel` with `old` replaced by `new` in its last statement that contains it."""
    statements = list(kernel.statements)
    k = max(k for k, (_, expression) in enumerate(statements) if old in expression)
    statements[k] = (statements[k][0], statements[k][1].replace(old, new))
    inputs, outputs = kernel.declarations()
    return FusedKernel(f"changed_{kernel.name}", inputs, outputs, statements, kernel.in_place)


@pytest.mark.parametrize("kernel, old, new", [
    (kernels.GELU_BACKWARD, "6.0", "6.001"),
    (kernels.GELU_BACKWARD_FROM_GATE, "(x - out)", "(x + out)"),
    (kernels.SWIGLU_BACKWARD_FROM_SIGMOID, "dout * silu", "up * silu"),
    (kernels.LAYER_NORM_BACKWARD, "- mean_dnorm ", "+ mean_dnorm "),
    (kernels.RMS_NORM_BACKWARD, "- normalized", "+ normalized"),
    (kernels.SWIGLU_BACKWARD, "(1.0 - sigmoid)", "(1.0 + sigmoid)"),
    (kernels.SOFTMAX_BACKWARD, "dprobs - weighted_sum", "dprobs + weighted_sum"),
    (kernels.ADAMW, "(1.0 - beta2)", "(1.0 - beta1)"),
    (kernels.ADAMW, "param * decay", "param"),
], ids=lambda value: value.name if isinstance(value, FusedKernel) else None)
def test_the_comparison_catches_a_changed_constant_or_operand(kernel, old, new):
    assert independent_error(changed(kernel, old, new), formula=kernel.name) > 1e-6


# ---------------------------------------------------------------------------------------------------------------
# Host passes: blocks, threads, strided and aliased outputs, dtypes.
# ---------------------------------------------------------------------------------------------------------------


def test_host_pass_gives_the_same_bits_in_any_blocks_and_threads(monkeypatch):
    """Elementwise: cutting into blocks (flat, by rows with per-row and per-channel operands, one block) and
    sharing them among threads cannot change a single bit."""
    x, dout = RNG.standard_normal((5, 7, 9)), RNG.standard_normal((5, 7, 9))
    mean, rstd, weight = RNG.standard_normal((5, 7, 1)), RNG.uniform(0.5, 2, (5, 7, 1)), RNG.standard_normal(9)
    threads = kernels.host_threads()
    results = []
    for block, thread_count in [(10**9, 1), (3, 1), (3, 2), (20, 3), (1, 4)]:
        monkeypatch.setattr(kernels, "BLOCK_ELEMENTS", block)
        kernels.set_host_threads(thread_count)
        results.append([kernels.GELU_BACKWARD(x=x, dout=dout)["dx"],
                        *kernels.LAYER_NORM_FORWARD(x=x, mean=mean, rstd=rstd, weight=weight, bias=weight).values()])
    kernels.set_host_threads(threads)
    for result in results[1:]:
        for actual, expected in zip(result, results[0], strict=True):
            np.testing.assert_array_equal(actual, expected)


def test_host_pass_writes_strided_outputs_and_outputs_it_cannot_cut(monkeypatch):
    monkeypatch.setattr(kernels, "BLOCK_ELEMENTS", 6)
    gate, up, dout = (RNG.standard_normal((4, 3, 5)) for _ in range(3))
    expected = INDEPENDENT_FORMULAS["swiglu_backward"](gate, up, dout)
    dx = np.zeros((4, 3, 10))  # d(gate) and d(up) side by side, as SwiGLU writes them: strided rows
    kernels.SWIGLU_BACKWARD(gate=gate, up=up, dout=dout, dgate=dx[..., :5], dup=dx[..., 5:])
    assert_matches(dx[..., :5], expected["dgate"], "dgate")
    assert_matches(dx[..., 5:], expected["dup"], "dup")
    transposed = np.zeros((5, 3, 4)).transpose(2, 1, 0)  # no (rows, channels) view of it: one block
    dgate = np.zeros((4, 3, 5))
    kernels.SWIGLU_BACKWARD(gate=gate, up=up, dout=dout, dgate=dgate, dup=transposed)
    assert_matches(transposed, expected["dup"], "dup into a transposed array")
    broadcast = kernels.SOFTMAX_EXP(scores=RNG.standard_normal((3, 1, 4)), row_max=np.zeros((1, 2, 4)))["exps"]
    assert broadcast.shape == (3, 2, 4)


def test_host_pass_takes_the_arrays_dtype_and_a_narrow_weight():
    import ml_dtypes

    x, rstd = RNG.standard_normal((6, 4)).astype(np.float32), RNG.uniform(1, 2, (6, 1)).astype(np.float32)
    weight = RNG.standard_normal(4).astype(ml_dtypes.bfloat16)  # a Narrowed norm's working weight
    out = kernels.RMS_NORM_FORWARD(x=x, rstd=rstd, weight=weight)["out"]
    assert out.dtype == np.float32
    assert_matches(out, x.astype(np.float64) * rstd * weight.astype(np.float64), "out", 1e-6)
    with pytest.raises(TypeError, match="output"):
        kernels.GELU_FORWARD(x=x, out=np.empty((6, 4)))  # float64 output for float32 math


def test_host_threads_follow_the_blas_budget(monkeypatch):
    code = "from models import kernels; print(kernels.host_threads())"
    for variable, expected in [("3", "3"), ("", str(len(os.sched_getaffinity(0))))]:
        environment = {**os.environ, "OMP_NUM_THREADS": variable}
        result = subprocess.run([sys.executable, "-c", code], env=environment, capture_output=True, text=True,
                                timeout=60, check=True)
        assert result.stdout.strip() == expected
    with pytest.raises(ValueError):
        kernels.set_host_threads(0)


def test_ranks_sharing_a_node_split_its_cores_between_blas_and_host_passes():
    """`mpiparallel`'s thread budget (launch.limit_blas_threads): cores ÷ ranks on the node by default, the
    explicit count when given; the host passes get the same count as BLAS on every rank."""
    code = ("import os, sys; from mpiparallel.commands import launch; "
            "threads = launch.limit_blas_threads(None if sys.argv[1] == 'default' else int(sys.argv[1])); "
            "from models import kernels; from mpi4py import MPI; blas = int(os.environ['OPENBLAS_NUM_THREADS']); "
            "counts = MPI.COMM_WORLD.gather([threads, blas, kernels.host_threads()]); "
            "print(counts if MPI.COMM_WORLD.rank == 0 else '', end='')")
    cores = len(os.sched_getaffinity(0))
    environment = {key: value for key, value in os.environ.items()
                   if key not in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")}
    for argument, expected in [("default", max(1, cores // 2)), ("3", 3)]:
        result = run_with_timeout([mpiexec_path(), "-n", "2", sys.executable, "-c", code, argument], timeout=120,
                                  env=environment)
        assert result.returncode == 0, result.stderr
        assert result.stdout.strip() == str([[expected] * 3] * 2), result.stdout


# ---------------------------------------------------------------------------------------------------------------
# The CUDA source, read as C.
# ---------------------------------------------------------------------------------------------------------------

C_STATEMENT = re.compile(r"(?P<type>T )?(?P<target>[A-Za-z_]\w*) = (?P<expression>[^;]+);")
C_TOKEN = re.compile(r"\s*(?:(?P<number>\d[\d.]*(?:[eE][-+]?\d+)?)|(?P<name>[A-Za-z_]\w*)|(?P<op>[-+*/()]))")
C_FUNCTIONS = {"tanh", "exp", "sqrt"}


def c_tokens(expression: str) -> list[tuple[str, str]]:
    """(kind, text) tokens of a C expression; fails on any character outside names, numbers, + - * / ( )."""
    tokens, position = [], 0
    while position < len(expression):
        match = C_TOKEN.match(expression, position)
        assert match and match.end() > position, f"unexpected text in {expression!r} at {expression[position:]!r}"
        tokens.append((match.lastgroup, match.group(match.lastgroup)))
        position = match.end()
    return tokens


@pytest.mark.parametrize("kernel", KERNELS, ids=lambda k: k.name)
def test_cuda_source_assigns_only_declared_names_with_double_literals(kernel):
    inputs, outputs = set(kernel.input_names), set(kernel.output_names)
    known, assigned = inputs | outputs, set()
    for line in kernel.cuda_source().splitlines():
        statement = C_STATEMENT.fullmatch(line)
        assert statement, f"not a C assignment ending with ';': {line!r}"
        target = statement["target"]
        assert target not in inputs, f"assigns the const input {target}"
        assert (statement["type"] is None) == (target in known), f"{target}: declared iff new ({line!r})"
        tokens = c_tokens(statement["expression"])
        for k, (kind, text) in enumerate(tokens):
            if kind == "number":
                assert "." in text and float(text) >= 0, f"{text} is not a double literal"
            elif kind == "name" and text in C_FUNCTIONS:
                assert tokens[k + 1] == ("op", "("), f"{text} is not called"
            elif kind == "name":
                assert text in inputs or text in assigned, f"{text} is read before it is set"
        assert "--" not in statement["expression"] and "++" not in statement["expression"]
        known.add(target)
        assigned.add(target)
    assert outputs <= assigned, f"outputs never written: {outputs - assigned}"


@pytest.mark.parametrize("kernel", KERNELS, ids=lambda k: k.name)
def test_cuda_source_read_as_python_is_what_evaluate_numpy_computes(kernel):
    arrays = {name: RNG.uniform(0.5, 1.5, (3, 4)) for name in kernel.input_names}
    namespace = dict(arrays)
    for line in kernel.cuda_source().splitlines():
        target, expression = line.removeprefix("T ").removesuffix(";").split(" = ", 1)
        namespace[target] = eval(expression, {"__builtins__": {}, "tanh": np.tanh, "exp": np.exp, "sqrt": np.sqrt},
                                 namespace)
    for name, value in kernel.evaluate_numpy(**arrays).items():
        np.testing.assert_array_equal(value, namespace[name])


@pytest.mark.parametrize("kernel", KERNELS, ids=lambda k: k.name)
def test_kernel_parameters_are_declared_as_cupy_reads_them(kernel):
    names = []
    for declaration in kernel.declarations():
        for parameter in declaration.split(", "):
            ctype, name = parameter.split(" ")
            assert ctype == "T" or np.dtype(ctype).name == ctype
            assert re.fullmatch(r"[A-Za-z]\w*", name) and name != "i"
            names.append(name)
    assert len(names) == len(set(names))
    assert all(source in kernel.input_names and output in kernel.output_names
               for output, source in kernel.in_place.items())


def test_literals_are_exact_doubles_with_a_decimal_point():
    assert literal(2.0) == "2.0" and literal(1e-5) == "1.0e-05" and literal(1.5e300) == "1.5e+300"
    for value in (kernels.GELU_SCALE, kernels.GELU_SCALE * kernels.GELU_CUBIC, 0.1):
        assert float(literal(value)) == value
    for value in (float("inf"), -1.0):
        with pytest.raises(ValueError):
            literal(value)


@pytest.mark.parametrize("inputs, outputs, statements, in_place", [
    ("T x", "T y", [("y", "x * 2")], None),                      # integer literal: C would do integer math
    ("T x", "T y", [("y", "x * 1e-5")], None),                   # no decimal point
    ("T x", "T y", [("y", "x ** 2.0")], None),                   # not C
    ("T x", "T y", [("y", "x // 2.0")], None),
    ("T x", "T y", [("y", "x--x")], None),                       # C reads a decrement
    ("T x", "T y", [("y", "z * x")], None),                      # unknown name
    ("T x", "T y", [("y", "y + x")], None),                      # output read before it is set
    ("T x", "T y", [("y", "exp * x")], None),                    # function as a value
    ("T x", "T y", [("y", "x(2.0)")], None),                     # value as a function
    ("T x", "T y", [("y", "pow(x, 2.0)")], None),
    ("T x", "T y", [("y", "x if x else x")], None),
    ("T x", "T y", [("x", "x * 2.0"), ("y", "x")], None),        # assigns a const input
    ("T x", "T y, T z", [("y", "x * 2.0")], None),               # output never written
    ("T x", "T y, T z", [("y", "x * 2.0"), ("z", "x + 1.0")], {"y": "x"}),  # x read after y overwrote it
    ("T i", "T y", [("y", "i * 2.0")], None),                    # CuPy's loop index
    ("int32 n, T x", "T y", [("y", "x * 2.0")], None),
])
def test_invalid_kernels_are_refused(inputs, outputs, statements, in_place):
    with pytest.raises(ValueError):
        FusedKernel("bad", inputs, outputs, statements, in_place)


def test_kernel_arguments_are_checked():
    with pytest.raises(TypeError, match="missing"):
        kernels.GELU_BACKWARD.evaluate_numpy(x=np.ones(3))
    with pytest.raises(TypeError, match="unknown"):
        kernels.GELU_FORWARD.evaluate_numpy(x=np.ones(3), y=np.ones(3))
    with pytest.raises(TypeError, match="missing"):
        kernels.GELU_BACKWARD(x=np.ones(3))
    with pytest.raises(TypeError, match="unknown"):
        kernels.GELU_FORWARD(x=np.ones(3), y=np.ones(3))


# ---------------------------------------------------------------------------------------------------------------
# The layers' device branches, on the CuPy test double and (where there is one) on a GPU, against the NumPy path.
# ---------------------------------------------------------------------------------------------------------------


def build(kind: str, to) -> object:
    """The same layer (same seed, same values) with its parameters converted by `to`."""
    rng = np.random.default_rng(7)

    def param(name: str, *shape: int, offset: float = 0.0) -> Parameter:
        return Parameter(name, to(offset + 0.5 * rng.standard_normal(shape)))

    def linear(name: str, n_in: int, n_out: int) -> Linear:
        return Linear(param(f"{name}.weight", n_in, n_out), param(f"{name}.bias", n_out))

    def norm(name: str) -> LayerNorm:
        return LayerNorm(param(f"{name}.weight", C, offset=1.0), param(f"{name}.bias", C))

    def attention() -> CausalSelfAttention:
        # several query blocks: causal_softmax with offsets, partial key ranges
        return CausalSelfAttention(linear("c_attn", C, 3 * C), linear("c_proj", C, C), H, query_block=3)

    def mlp() -> MLP:
        return MLP(linear("c_fc", C, 4 * C), linear("c_proj", 4 * C, C))

    makers = {"layernorm": lambda: norm("ln"), "gelu": GELU, "attention": attention, "mlp": mlp,
              "block": lambda: Block(norm("ln_1"), attention(), norm("ln_2"), mlp())}
    return makers[kind]()


def parameters_of(layer) -> list[Parameter]:
    found = []
    for value in vars(layer).values():
        if isinstance(value, Parameter):
            found.append(value)
        elif hasattr(value, "__dict__") and not hasattr(value, "shape"):
            found += parameters_of(value)
    return found


@on_devices
@pytest.mark.parametrize("kind", ["layernorm", "gelu", "attention", "mlp", "block"])
def test_layer_on_device_equals_numpy_layer(xp, kind):
    cpu, device = build(kind, np.asarray), build(kind, xp.asarray)
    x, dout = RNG.standard_normal((B, T, C)), RNG.standard_normal((B, T, C))
    (device_out, device_saved), (cpu_out, cpu_saved) = device.forward(xp.asarray(x)), cpu.forward(x)
    assert_matches(device_out, cpu_out, f"{kind} forward")
    if kind == "layernorm":  # kept for backward and read by memory accounting
        assert_matches(device_saved.normalized, cpu_saved.normalized, "normalized")
        assert_matches(device_saved.rstd, cpu_saved.rstd, "rstd")
    assert_matches(device.backward(device_saved, xp.asarray(dout)), cpu.backward(cpu_saved, dout.copy()),
                   f"{kind} dx")
    for p_device, p_cpu in zip(parameters_of(device), parameters_of(cpu), strict=True):
        assert_matches(p_device.grad, p_cpu.grad, f"{kind} d{p_cpu.name}")


@on_devices
@pytest.mark.parametrize("offset", [0, 2])
def test_softmax_and_its_backward_on_device_equal_numpy(xp, offset):
    scores, dprobs = RNG.standard_normal((B, H, 3, 3 + offset)), RNG.standard_normal((B, H, 3, 3 + offset))
    probs = causal_softmax(scores.copy(), offset)
    device_scores = xp.asarray(scores)
    device_probs = causal_softmax(device_scores, offset)
    assert device_probs is device_scores, "causal_softmax works in place"
    assert_matches(device_probs, probs, "softmax")
    device_dprobs = xp.asarray(dprobs)
    dscores = softmax_backward(device_probs, device_dprobs)
    assert dscores is device_dprobs, "softmax_backward works in place"
    assert_matches(dscores, softmax_backward(probs, dprobs.copy()), "softmax backward")


@on_devices
def test_cross_entropy_head_on_device_equals_numpy(xp):
    wte, x, targets = RNG.standard_normal((VOCAB, C)), RNG.standard_normal((B, T, C)), RNG.integers(0, VOCAB, (B, T))
    cpu, device = TiedHeadCrossEntropy(Parameter("wte", wte)), TiedHeadCrossEntropy(Parameter("wte", xp.asarray(wte)))
    loss, cpu_saved = cpu.forward(x, targets, 20.0)
    device_loss, device_saved = device.forward(xp.asarray(x), xp.asarray(targets), 20.0)
    assert abs(device_loss - loss) <= TOLERANCE * abs(loss)
    assert_matches(device.backward(device_saved, None), cpu.backward(cpu_saved, None), "head dx")
    assert_matches(device.token.grad, cpu.token.grad, "head dwte")


@on_devices
@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
def test_adamw_update_on_device_slices_equals_numpy(xp, weight_decay):
    flat = RNG.standard_normal(20)
    state = [flat.copy(), np.zeros(20), np.zeros(20)]
    device_state = [xp.asarray(array) for array in state]
    for step in range(1, 4):
        grad = RNG.standard_normal(12)
        segment = slice(3, 15)  # a ZeRO shard segment: views into flat buffers, updated in place
        adamw_update(*(array[segment] for array in state[:1]), grad, *(array[segment] for array in state[1:]),
                     step, 1e-2, 0.9, 0.95, 1e-8, weight_decay)
        adamw_update(device_state[0][segment], xp.asarray(grad), device_state[1][segment],
                     device_state[2][segment], step, 1e-2, 0.9, 0.95, 1e-8, weight_decay)
        for name, a, b in zip(("param", "exp_avg", "exp_avg_sq"), device_state, state, strict=True):
            assert_matches(a, b, f"step {step} {name}")


@on_devices
def test_gpt_training_step_on_device_equals_numpy(xp):
    """Loss, every gradient and the AdamW-updated weights of the whole model (looser: many layers deep)."""
    config = GPTConfig(vocab_size=VOCAB, n_positions=16, n_embd=C, n_layer=2, n_head=H)
    cpu, device = GPT(config, seed=5, dtype=np.float64), GPT(config, seed=5, dtype=np.float64, xp=xp)
    tokens, targets = RNG.integers(0, VOCAB, (B, T)), RNG.integers(0, VOCAB, (B, T))
    optimizers = [AdamW(model.parameters(), lr=1e-2, weight_decay=0.1) for model in (cpu, device)]
    for step in range(2):
        loss, cpu_saved = cpu.forward(tokens, targets)
        device_loss, device_saved = device.forward(xp.asarray(tokens), xp.asarray(targets))
        assert abs(device_loss - loss) <= 1e-10 * abs(loss), f"step {step} loss"
        cpu.backward(cpu_saved)
        device.backward(device_saved)
        for name, param in cpu.params.items():
            assert_matches(device.params[name].grad, param.grad, f"step {step} d{name}", tolerance=1e-10)
        for optimizer, model in zip(optimizers, (cpu, device), strict=True):
            optimizer.step()
            model.zero_grad()
    for name, param in cpu.params.items():
        assert_matches(device.params[name].data, param.data, name, tolerance=1e-10)


def test_in_place_calls_write_through_and_undeclared_aliasing_is_refused(xp):
    scores = xp.asarray(RNG.standard_normal((2, 4)))
    expected = np.exp(host(scores) - host(scores).max(axis=-1, keepdims=True))
    result = kernels.SOFTMAX_EXP(scores=scores, row_max=scores.max(axis=-1, keepdims=True), exps=scores)["exps"]
    assert result is scores
    assert_matches(scores, expected, "in-place exps")
    with pytest.raises(ValueError, match="in-place"):
        kernels.GELU_BACKWARD(x=scores, dout=scores.copy(), dx=scores)
