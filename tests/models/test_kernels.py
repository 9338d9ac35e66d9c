"""Fused GPU kernels: their statement text is the layers' and the optimizer's NumPy math, and is valid CUDA C.

On the CPU, each kernel's statements are evaluated with NumPy (`evaluate_numpy`, the same text the GPU compiles)
and compared with the NumPy code path, and the generated CUDA source is read the way C reads it. The layers'
device branches then run end to end on the CuPy test double (tests/support/fake_cupy.py, whose ElementwiseKernel
executes the operation text with NumPy) and, where CuPy finds a GPU, on real CUDA kernels: both must equal the
NumPy path.
Errors are max-norm relative: max|actual − expected| / max|expected|.
"""

from __future__ import annotations

import math
import re
import sys

import fake_cupy
import numpy as np
import pytest
from workers.errors import relative_error as nan_aware_relative_error
from workers.errors import worst

from collectives import backend
from models import kernels
from models.kernels import FusedKernel, literal
from models.layers import (
    GELU,
    MLP,
    Block,
    CausalSelfAttention,
    HeadCrossEntropy,
    LayerNorm,
    Linear,
    RMSNorm,
    SwiGLU,
    causal_softmax,
    row_sums,
    softmax_backward,
)
from models.parameter import Parameter
from models.transformer import GPTConfig, Transformer
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
    assert {k.name for k in KERNELS} == {"gelu_forward", "gelu_backward", "gelu_forward_keeping",
                                         "gelu_backward_from_gate", "layer_norm_forward",
                                         "layer_norm_backward", "rms_norm_forward", "rms_norm_backward",
                                         "swiglu_forward", "swiglu_backward", "swiglu_forward_keeping",
                                         "swiglu_backward_from_sigmoid", "softmax_exp", "softmax_backward",
                                         "adamw"}


# ---------------------------------------------------------------------------------------------------------------
# The kernels' text evaluated with NumPy equals the NumPy code path.
# ---------------------------------------------------------------------------------------------------------------


def layer_norm() -> LayerNorm:
    return LayerNorm(Parameter("ln.weight", 1 + 0.3 * RNG.standard_normal(C)),
                     Parameter("ln.bias", 0.5 * RNG.standard_normal(C)))


def test_gelu_forward_kernel_equals_gelu_layer():
    x = 3 * RNG.standard_normal((B, T, 4 * C))
    assert_matches(kernels.GELU_FORWARD.evaluate_numpy(x=x)["out"], GELU().forward(x)[0], "gelu forward")


def gelu_backward_error(kernel: FusedKernel) -> float:
    x, dout = 3 * RNG.standard_normal((B, T, 4 * C)), RNG.standard_normal((B, T, 4 * C))
    layer = GELU()
    saved = layer.forward(x)[1]
    return relative_error(kernel.evaluate_numpy(x=x, dout=dout)["dx"], layer.backward(saved, dout.copy()))


def test_gelu_backward_kernel_recomputes_gelu_backward_from_x():
    assert gelu_backward_error(kernels.GELU_BACKWARD) <= TOLERANCE


def test_layer_norm_forward_kernel_equals_layer_norm_given_mean_and_rstd():
    ln, x = layer_norm(), 2 * RNG.standard_normal((B, T, C)) + 1
    out, saved = ln.forward(x)
    fused = kernels.LAYER_NORM_FORWARD.evaluate_numpy(x=x, mean=row_sums(x) / C, rstd=saved.rstd,
                                                      weight=ln.weight.data, bias=ln.bias.data)
    assert_matches(fused["normalized"], saved.normalized, "normalized")
    assert_matches(fused["out"], out, "layer norm out")


def test_layer_norm_backward_kernel_equals_layer_norm_given_row_means():
    ln, x, dout = layer_norm(), RNG.standard_normal((B, T, C)), RNG.standard_normal((B, T, C))
    saved = ln.forward(x)[1]
    dnorm = dout * ln.weight.data
    dx = kernels.LAYER_NORM_BACKWARD.evaluate_numpy(
        dout=dout, weight=ln.weight.data, normalized=saved.normalized, rstd=saved.rstd,
        mean_dnorm=row_sums(dnorm) / C, mean_dnorm_norm=row_sums(dnorm * saved.normalized) / C)["dx"]
    assert_matches(dx, ln.backward_input(saved, dout.copy()), "layer norm dx")


def test_rms_norm_kernels_equal_rms_norm_given_the_row_statistics():
    norm, x, dout = RMSNorm(Parameter("norm.weight", 1 + 0.3 * RNG.standard_normal(C))), \
        2 * RNG.standard_normal((B, T, C)), RNG.standard_normal((B, T, C))
    out, saved = norm.forward(x)
    fused = kernels.RMS_NORM_FORWARD.evaluate_numpy(x=x, rstd=saved.rstd, weight=norm.weight.data)
    assert_matches(fused["normalized"], saved.normalized, "normalized")
    assert_matches(fused["out"], out, "rms norm out")
    dx = kernels.RMS_NORM_BACKWARD.evaluate_numpy(
        dout=dout, weight=norm.weight.data, normalized=saved.normalized, rstd=saved.rstd,
        mean_dnorm_norm=row_sums(dout * norm.weight.data * saved.normalized) / C)["dx"]
    assert_matches(dx, norm.backward_input(saved, dout.copy()), "rms norm dx")


def test_swiglu_kernels_equal_swiglu():
    x, dout = 3 * RNG.standard_normal((B, T, 2 * C)), RNG.standard_normal((B, T, C))
    out, saved = SwiGLU().forward(x)
    gate, up = x[..., :C], x[..., C:]
    assert_matches(kernels.SWIGLU_FORWARD.evaluate_numpy(gate=gate, up=up)["out"], out, "swiglu out")
    fused = kernels.SWIGLU_BACKWARD.evaluate_numpy(gate=gate, up=up, dout=dout)
    dx = SwiGLU().backward(saved, dout.copy())
    assert_matches(fused["dgate"], dx[..., :C], "d(gate)")
    assert_matches(fused["dup"], dx[..., C:], "d(up)")


@pytest.mark.parametrize("offset", [0, 3])
def test_softmax_exp_kernel_gives_causal_softmax(offset):
    queries, keys = 4, 4 + offset
    scores = 4 * RNG.standard_normal((B, H, queries, keys))
    masked = scores + np.triu(np.full((queries, keys), -np.inf), k=offset + 1)
    exps = kernels.SOFTMAX_EXP.evaluate_numpy(scores=masked, row_max=masked.max(axis=-1, keepdims=True))["exps"]
    assert np.all(exps[np.isinf(masked)] == 0)
    assert_matches(exps / row_sums(exps), causal_softmax(scores.copy(), offset), "softmax")


def test_softmax_backward_kernel_equals_softmax_backward():
    probs = causal_softmax(RNG.standard_normal((B, H, T, T)))
    dprobs = RNG.standard_normal((B, H, T, T))
    dscores = kernels.SOFTMAX_BACKWARD.evaluate_numpy(probs=probs, dprobs=dprobs,
                                                      weighted_sum=row_sums(dprobs * probs))["dscores"]
    assert_matches(dscores, softmax_backward(probs, dprobs.copy()), "softmax backward")


def test_softmax_exp_kernel_gives_the_cross_entropy_gradient():
    wte, x = RNG.standard_normal((VOCAB, C)), RNG.standard_normal((B, T, C))
    targets, normalizer = RNG.integers(0, VOCAB, (B, T)), 37.0
    head = HeadCrossEntropy(Parameter("wte", wte))
    saved = head.forward(x, targets, normalizer)[1]
    logits = x.reshape(-1, C) @ wte.T
    exps = kernels.SOFTMAX_EXP.evaluate_numpy(scores=logits, row_max=logits.max(axis=-1, keepdims=True))["exps"]
    expected = exps / (row_sums(exps) * normalizer)
    expected[np.arange(B * T), targets.reshape(-1)] -= 1.0 / normalizer
    assert_matches(saved.dlogits, expected, "d(logits)")


def adamw_error(kernel: FusedKernel, weight_decay: float) -> float:
    """Largest relative error of p, m and v over four steps of `kernel` against adamw_update."""
    shape, lr, beta1, beta2, eps = (3, 5), 1e-2, 0.9, 0.95, 1e-8
    reference = [RNG.standard_normal(shape), np.zeros(shape), np.zeros(shape)]
    fused, errors = [array.copy() for array in reference], []
    for step in range(1, 5):
        grad = RNG.standard_normal(shape)
        adamw_update(reference[0], grad, reference[1], reference[2], step, lr, beta1, beta2, eps, weight_decay)
        out = kernel.evaluate_numpy(param=fused[0], grad=grad, exp_avg=fused[1], exp_avg_sq=fused[2],
                                    **adamw_kernel_scalars(step, lr, beta1, beta2, eps, weight_decay))
        fused = [out["new_param"], out["new_exp_avg"], out["new_exp_avg_sq"]]
        errors += [relative_error(a, b) for a, b in zip(fused, reference, strict=True)]
    return worst(errors)


@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
def test_adamw_kernel_equals_adamw_update_over_several_steps(weight_decay):
    assert adamw_error(kernels.ADAMW, weight_decay) <= TOLERANCE


def changed(kernel: FusedKernel, old: str, new: str) -> FusedKernel:
    """`kernel` with `old` replaced by `new` in its last statement that contains it."""
    statements = list(kernel.statements)
    k = max(k for k, (_, expression) in enumerate(statements) if old in expression)
    statements[k] = (statements[k][0], statements[k][1].replace(old, new))
    inputs, outputs = kernel.declarations()
    return FusedKernel(f"changed_{kernel.name}", inputs, outputs, statements, kernel.in_place)


def independent_error(kernel: FusedKernel, formula: str) -> float:
    """Largest relative error of `kernel`'s text (evaluated with NumPy) against INDEPENDENT_FORMULAS[formula]."""
    arrays = {name: RNG.uniform(0.5, 1.5, (3, 5)) for name in kernel.input_names}
    expected = INDEPENDENT_FORMULAS[formula](**arrays)
    return worst([relative_error(value, expected[name]) for name, value in kernel.evaluate_numpy(**arrays).items()])


def test_the_comparisons_catch_a_changed_constant_or_operand():
    assert gelu_backward_error(changed(kernels.GELU_BACKWARD, "6.0", "6.001")) > 1e-6
    assert adamw_error(changed(kernels.ADAMW, "grad * one_minus_beta2", "grad * one_minus_beta1"), 0.1) > 1e-6
    assert adamw_error(changed(kernels.ADAMW, "param * decay", "param"), 0.1) > 1e-6
    assert independent_error(kernels.RMS_NORM_BACKWARD, "rms_norm_backward") <= TOLERANCE
    assert independent_error(changed(kernels.RMS_NORM_BACKWARD, "- normalized", "+ normalized"),
                             "rms_norm_backward") > 1e-6
    assert independent_error(kernels.SWIGLU_BACKWARD, "swiglu_backward") <= TOLERANCE
    assert independent_error(changed(kernels.SWIGLU_BACKWARD, "(1.0 - sigmoid)", "(1.0 + sigmoid)"),
                             "swiglu_backward") > 1e-6


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


def test_kernel_constants_are_the_layers_constants():
    from models import layers

    assert (kernels.GELU_SCALE, kernels.GELU_CUBIC) == (layers.GELU_SCALE, layers.GELU_CUBIC)


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
    with pytest.raises(TypeError, match="evaluate_numpy"):
        kernels.GELU_FORWARD(x=np.ones(3))


# ---------------------------------------------------------------------------------------------------------------
# The device branches, on the CuPy test double and (where there is one) on a GPU, against the NumPy path.
# ---------------------------------------------------------------------------------------------------------------


@pytest.fixture(params=["fake", pytest.param("cupy", marks=[GPU, pytest.mark.gpu])])
def xp(request, monkeypatch):
    """The array module of the device branches: the CuPy test double on any machine, CuPy on a GPU."""
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

    def swiglu_mlp() -> MLP:
        gate_up = Linear(param("gate_up.weight", C, 2 * 3 * C))
        return MLP(gate_up, Linear(param("down.weight", 3 * C, C)), SwiGLU())

    makers = {"layernorm": lambda: norm("ln"), "gelu": GELU, "attention": attention, "mlp": mlp,
              "block": lambda: Block(norm("ln_1"), attention(), norm("ln_2"), mlp()),
              "rmsnorm": lambda: RMSNorm(param("norm.weight", C, offset=1.0), eps=1e-5), "swiglu mlp": swiglu_mlp}
    return makers[kind]()


def parameters_of(layer) -> list[Parameter]:
    found = []
    for value in vars(layer).values():
        if isinstance(value, Parameter):
            found.append(value)
        elif hasattr(value, "__dict__") and not hasattr(value, "shape"):
            found += parameters_of(value)
    return found


@pytest.mark.parametrize("kind", ["layernorm", "gelu", "attention", "mlp", "block", "rmsnorm", "swiglu mlp"])
def test_layer_on_device_equals_numpy_layer(xp, kind):
    cpu, device = build(kind, np.asarray), build(kind, xp.asarray)
    x, dout = RNG.standard_normal((B, T, C)), RNG.standard_normal((B, T, C))
    (device_out, device_saved), (cpu_out, cpu_saved) = device.forward(xp.asarray(x)), cpu.forward(x)
    assert_matches(device_out, cpu_out, f"{kind} forward")
    if kind in ("layernorm", "rmsnorm"):  # kept for backward and read by memory accounting
        assert_matches(device_saved.normalized, cpu_saved.normalized, "normalized")
        assert_matches(device_saved.rstd, cpu_saved.rstd, "rstd")
    assert_matches(device.backward(device_saved, xp.asarray(dout)), cpu.backward(cpu_saved, dout.copy()),
                   f"{kind} dx")
    for p_device, p_cpu in zip(parameters_of(device), parameters_of(cpu), strict=True):
        assert_matches(p_device.grad, p_cpu.grad, f"{kind} d{p_cpu.name}")


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


def test_cross_entropy_head_on_device_equals_numpy(xp):
    wte, x, targets = RNG.standard_normal((VOCAB, C)), RNG.standard_normal((B, T, C)), RNG.integers(0, VOCAB, (B, T))
    cpu, device = HeadCrossEntropy(Parameter("wte", wte)), HeadCrossEntropy(Parameter("wte", xp.asarray(wte)))
    loss, cpu_saved = cpu.forward(x, targets, 20.0)
    device_loss, device_saved = device.forward(xp.asarray(x), xp.asarray(targets), 20.0)
    assert abs(device_loss - loss) <= TOLERANCE * abs(loss)
    assert_matches(device.backward(device_saved, None), cpu.backward(cpu_saved, None), "head dx")
    assert_matches(device.token.grad, cpu.token.grad, "head dwte")


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


def test_gpt_training_step_on_device_equals_numpy(xp):
    """Loss, every gradient and the AdamW-updated weights of the whole model (looser: many layers deep)."""
    config = GPTConfig(vocab_size=VOCAB, n_positions=16, n_embd=C, n_layer=2, n_head=H)
    cpu, device = Transformer(config, seed=5, dtype=np.float64), Transformer(config, seed=5, dtype=np.float64, xp=xp)
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


ADAMW_STEP = {"step": 3, "lr": 1e-2, "beta1": 0.9, "beta2": 0.95, "eps": 1e-8, "weight_decay": 0.1}


def _gelu_textbook(x):
    """GELU's tanh approximation and its derivative, as the paper writes them (not as the kernels factor them)."""
    s, c = math.sqrt(2 / math.pi), 0.044715
    t = np.tanh(s * (x + c * x**3))
    return 0.5 * x * (1 + t), 0.5 * (1 + t) + 0.5 * x * (1 - t**2) * s * (1 + 3 * c * x**2)


def _gelu_kept(x, dout=None, **_):
    """What GELU's forward keeps for its backward (GELU_FORWARD_KEEPING), from the definitions: a = √(2/π)·(1 +
    0.044715·x²), so that the tanh's argument is a·x; the gate (1 + tanh)/2; the output x·gate."""
    s, c = math.sqrt(2 / math.pi), 0.044715
    gate = 0.5 * (1 + np.tanh(s * (x + c * x**3)))
    kept = {"a": s * (1 + c * x**2), "gate": gate, "out": x * gate}
    return kept if dout is None else {"x": x, **kept, "dout": dout}


def _swiglu_kept(up, sigmoid, dout, **_):
    """What SwiGLU's forward keeps, σ(gate) and silu(gate), for a gate taken from the random `sigmoid` array."""
    gate = sigmoid
    return {"up": up, "sigmoid": 1 / (1 + np.exp(-gate)), "silu": gate / (1 + np.exp(-gate)), "dout": dout}


def _swiglu_from_kept(up, sigmoid, silu, dout):
    gate = silu / sigmoid  # the gate the kept values came from
    return {"dgate": dout * _swiglu_textbook(gate, up)[1], "dup": dout * _swiglu_textbook(gate, up)[2]}


CONSISTENT_INPUTS = {"gelu_backward_from_gate": _gelu_kept, "swiglu_backward_from_sigmoid": _swiglu_kept}
"""Kernels whose inputs are not independent (a backward given its forward's kept values): the inputs, from the
random ones of the same names, that a forward would have passed it."""


def consistent_inputs(kernel, arrays: dict) -> dict:
    """NumPy `arrays` with the kept values a forward would have given `kernel` (CONSISTENT_INPUTS), each at its
    dtype."""
    if kernel.name not in CONSISTENT_INPUTS:
        return arrays
    made = CONSISTENT_INPUTS[kernel.name](**{name: value.astype(np.float64) for name, value in arrays.items()})
    return {name: made[name].astype(arrays[name].dtype) for name in arrays}


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
    "gelu_forward_keeping": lambda x: {**_gelu_kept(x), "out": _gelu_textbook(x)[0]},
    "gelu_backward_from_gate": lambda x, a, gate, out, dout: {"dx": dout * _gelu_textbook(x)[1]},
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
    "swiglu_forward_keeping": lambda gate, up: {"sigmoid": 1 / (1 + np.exp(-gate)), "silu": _swiglu_textbook(
        gate, up)[2], "out": _swiglu_textbook(gate, up)[0]},
    "swiglu_backward_from_sigmoid": _swiglu_from_kept,
    "softmax_exp": lambda scores, row_max: {"exps": np.exp(scores - row_max)},
    "softmax_backward": lambda probs, dprobs, weighted_sum: {"dscores": probs * (dprobs - weighted_sum)},
    "adamw": lambda param, grad, exp_avg, exp_avg_sq, **scalars: _adamw_textbook(param, grad, exp_avg, exp_avg_sq,
                                                                                  **ADAMW_STEP),
}


@pytest.mark.parametrize("dtype, tolerance", [(np.float64, TOLERANCE), (np.float32, 1e-5)])
@pytest.mark.parametrize("kernel", KERNELS, ids=lambda k: k.name)
def test_kernel_on_device_equals_an_independent_formula(xp, kernel, dtype, tolerance):
    """Each kernel compiled and run (float32 too: T is float there); inputs that broadcast, as the layers pass.
    Compared with the math written out here (INDEPENDENT_FORMULAS) in float64, never with the kernel's own
    statements: the CuPy double evaluates those statements with NumPy, so that comparison could not fail."""
    shapes = {"mean": (3, 1), "rstd": (3, 1), "row_max": (3, 1), "weighted_sum": (3, 1), "mean_dnorm": (3, 1),
              "mean_dnorm_norm": (3, 1), "weight": (5,), "bias": (5,)}
    scalars = adamw_kernel_scalars(**ADAMW_STEP) if kernel is kernels.ADAMW else {}
    arrays = consistent_inputs(kernel, {name: RNG.uniform(0.5, 1.5, shapes.get(name, (3, 5))).astype(dtype)
                                        for name in kernel.input_names if name not in scalars})
    expected = INDEPENDENT_FORMULAS[kernel.name](**{name: a.astype(np.float64) for name, a in arrays.items()},
                                                 **scalars)
    result = kernel(**{name: xp.asarray(a) for name, a in arrays.items()}, **scalars)
    assert set(result) == set(expected)
    for name, value in result.items():
        assert value.dtype == dtype, f"{name} is {value.dtype}"
        assert_matches(value, expected[name], name, tolerance)


def test_in_place_calls_write_through_and_undeclared_aliasing_is_refused(xp):
    scores = xp.asarray(RNG.standard_normal((2, 4)))
    expected = np.exp(host(scores) - host(scores).max(axis=-1, keepdims=True))
    result = kernels.SOFTMAX_EXP(scores=scores, row_max=scores.max(axis=-1, keepdims=True), exps=scores)["exps"]
    assert result is scores
    assert_matches(scores, expected, "in-place exps")
    with pytest.raises(ValueError, match="in-place"):
        kernels.GELU_BACKWARD(x=scores, dout=scores.copy(), dx=scores)
