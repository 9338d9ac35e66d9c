"""The kernels compiled for the CPU (models.host_kernels): the math written out, the NumPy chains' numbers (bit for
bit where the operations are the same), and the NumPy chains wherever they cannot run.

Every kernel is built with the machine's C compiler (the suite's machines have one; a machine without one skips
the compiled checks and still runs the fallback ones) and compared with the math written out
(test_kernels.INDEPENDENT_FORMULAS, ROW_FORMULAS here). The elementwise kernels of + − × ÷ and sqrt must also equal
the NumPy evaluation of their own text exactly, and AdamW must give the same bits compiled as with
MPIPARALLEL_HOST_KERNELS=0. The norms' row kernels sum each row in another order than the chains' GEMVs: they
agree with the chains to rounding (float64 1e-13, float32 1e-6), and with the NumPy evaluation of their own text.
"""

from __future__ import annotations

import ctypes
import math
import os
import platform
import subprocess
import sys

import numpy as np
import pytest
from test_kernels import ADAMW_STEP, INDEPENDENT_FORMULAS, KERNELS, assert_matches, consistent_inputs

from models import host_kernels, kernels
from models.kernels import RowKernel
from models.layers import (
    GELU,
    IGNORED,
    CausalSelfAttention,
    HeadCrossEntropy,
    LayerNorm,
    Linear,
    RMSNorm,
    Saved,
    SwiGLU,
    causal_softmax,
    row_dots,
)
from models.parameter import Parameter
from models.precision import DTYPES
from mpiparallel.optim import AdamW, adamw_kernel_scalars, adamw_update, adamw_update_many

RNG = np.random.default_rng(11)
SHAPES = {"mean": (4, 3, 1), "rstd": (4, 3, 1), "row_max": (4, 3, 1), "weighted_sum": (4, 3, 1),
          "mean_dnorm": (4, 3, 1), "mean_dnorm_norm": (4, 3, 1), "weight": (37,), "bias": (37,)}
"""Rows of 37 (not a multiple of any vector width: the loops' remainders run too) over a (4, 3) batch."""
CORRECTLY_ROUNDED = [kernel for kernel in KERNELS if not {"tanh", "exp"} & set(kernel.cuda_source().replace(
    "(", " ").split())]
"""The kernels of + − × ÷ and sqrt only, which the CPU's layers and AdamW run compiled."""

compiled = pytest.mark.skipif(host_kernels.status().startswith("NumPy"), reason=host_kernels.status())
LIBMVEC = (platform.system() == "Linux" and platform.machine() == "x86_64" and platform.libc_ver()[0] == "glibc"
           and tuple(int(part) for part in platform.libc_ver()[1].split(".")[:2]) >= (2, 35))
vector_math = pytest.mark.skipif(not LIBMVEC, reason="glibc's vector exp and tanh (libmvec) are checked on x86-64 "
                                 "glibc 2.35 and later; without them these kernels are not built and the layers run "
                                 "their NumPy chains")
"""The kernels that call tanh or exp link libmvec: where it is there they must build and run (the tests fail, not
skip, on such a machine); elsewhere the layers' chains run, which the tests of the chains cover."""
VECTOR_KERNELS = [pytest.param(kernel, marks=vector_math, id=kernel.name) if kernel not in CORRECTLY_ROUNDED
                  else pytest.param(kernel, id=kernel.name) for kernel in KERNELS]


def kernel_arguments(kernel, dtype) -> dict:
    scalars = adamw_kernel_scalars(**ADAMW_STEP) if kernel is kernels.ADAMW else {}
    arrays = {name: RNG.uniform(0.5, 1.5, SHAPES.get(name, (4, 3, 37))).astype(dtype)
              for name in kernel.input_names if name not in scalars}
    return {**arrays, **scalars}


@compiled
@pytest.mark.parametrize("dtype, tolerance", [(np.float64, 1e-12), (np.float32, 1e-5)])
@pytest.mark.parametrize("kernel", VECTOR_KERNELS)
def test_every_kernel_compiled_for_the_cpu_computes_its_math(kernel, dtype, tolerance):
    arguments = consistent_inputs(kernel, kernel_arguments(kernel, dtype))
    result = host_kernels.run(kernel, **arguments)
    assert result is not None, host_kernels.status()
    expected = INDEPENDENT_FORMULAS[kernel.name](**{name: np.asarray(value, np.float64) if isinstance(
        value, np.ndarray) else value for name, value in arguments.items()})
    assert set(result) == set(expected)
    for name, value in result.items():
        assert value.dtype == dtype and value.shape == (4, 3, 37)
        assert_matches(value, expected[name], name, tolerance)


@compiled
@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("kernel", CORRECTLY_ROUNDED, ids=lambda k: k.name)
def test_compiled_kernels_of_correctly_rounded_operations_equal_numpy_bit_for_bit(kernel, dtype):
    """No fused multiply-add, no wider intermediate, a literal or scalar rounded to T as NumPy rounds it."""
    arguments = kernel_arguments(kernel, dtype)
    result = host_kernels.run(kernel, **arguments)
    for name, expected in kernel.evaluate_numpy(**arguments).items():
        np.testing.assert_array_equal(result[name], expected, err_msg=name)


def test_the_optimizer_uses_a_correctly_rounded_kernel():
    assert {kernel.name for kernel in CORRECTLY_ROUNDED} >= {"layer_norm_forward", "layer_norm_backward",
                                                             "rms_norm_forward", "rms_norm_backward", "adamw"}


# ---------------------------------------------------------------------------------------------------------------
# Row kernels: the norms' statistics and elementwise work in one loop per row.
# ---------------------------------------------------------------------------------------------------------------

ROW_KERNELS = [value for value in vars(kernels).values() if isinstance(value, RowKernel)]
EPS = 1e-5


def _layer_norm_rows_forward(x, weight, bias, eps):
    mean, variance = x.mean(axis=-1, keepdims=True), x.var(axis=-1, keepdims=True)
    rstd = 1 / np.sqrt(variance + eps)
    return {"normalized": (x - mean) * rstd, "out": weight * (x - mean) * rstd + bias, "rstd": rstd}


def _layer_norm_rows_backward(dout, weight, normalized, rstd):
    dn = dout * weight
    return {"dx": rstd * (dn - dn.mean(axis=-1, keepdims=True) - normalized * (dn * normalized).mean(
        axis=-1, keepdims=True)), "dweight": (dout * normalized).reshape(-1, dout.shape[-1]).sum(axis=0),
        "dbias": dout.reshape(-1, dout.shape[-1]).sum(axis=0)}


def _rms_norm_rows_forward(x, weight, eps):
    rstd = 1 / np.sqrt((x**2).mean(axis=-1, keepdims=True) + eps)
    return {"normalized": x * rstd, "out": weight * x * rstd, "rstd": rstd}


def _rms_norm_rows_backward(dout, weight, normalized, rstd):
    dn = dout * weight
    return {"dx": rstd * (dn - normalized * (dn * normalized).mean(axis=-1, keepdims=True)),
            "dweight": (dout * normalized).reshape(-1, dout.shape[-1]).sum(axis=0)}


def _row_dots(a, b):
    return {"dot": np.einsum("...i,...i->...", a, b)[..., None]}


ROW_FORMULAS = {"layer_norm_rows_forward": _layer_norm_rows_forward,
                "layer_norm_rows_backward": _layer_norm_rows_backward,
                "rms_norm_rows_forward": _rms_norm_rows_forward, "rms_norm_rows_backward": _rms_norm_rows_backward,
                "row_dots": _row_dots}
"""What each row kernel computes, written from the math (NumPy's mean and var), not from its statements."""


def row_arguments(kernel, dtype, rows=(4, 3), columns=37) -> dict:
    shapes = {"weight": (columns,), "bias": (columns,), "rstd": (*rows, 1)}
    arrays = {name: RNG.uniform(0.5, 1.5, shapes.get(name, (*rows, columns))).astype(dtype)
              for name in kernel.input_names if name != "eps"}
    return {**arrays, "eps": EPS} if "eps" in kernel.input_names else arrays


def test_the_row_kernel_list_is_complete():
    assert set(ROW_FORMULAS) == {kernel.name for kernel in ROW_KERNELS}


@pytest.mark.parametrize("kernel", ROW_KERNELS, ids=lambda k: k.name)
def test_every_row_kernels_text_evaluated_with_numpy_computes_its_math(kernel):
    arguments = row_arguments(kernel, np.float64)
    expected = ROW_FORMULAS[kernel.name](**arguments)
    result = kernel.evaluate_numpy(**arguments)
    assert set(result) == set(expected)
    for name, value in result.items():
        assert value.shape == expected[name].shape, name
        assert_matches(value, expected[name], name, 1e-13)


@compiled
@pytest.mark.parametrize("dtype, tolerance", [(np.float64, 1e-13), (np.float32, 1e-5)])
@pytest.mark.parametrize("columns", [37, 768])
@pytest.mark.parametrize("kernel", ROW_KERNELS, ids=lambda k: k.name)
def test_every_row_kernel_compiled_computes_its_math_and_its_text(kernel, columns, dtype, tolerance):
    """37 columns: the vector loops' remainders run; 768: GPT-2's width. Against the math written out in float64
    and against the NumPy evaluation of the kernel's own text in its dtype."""
    arguments = row_arguments(kernel, dtype, columns=columns)
    result = host_kernels.run(kernel, **arguments)
    assert result is not None, host_kernels.status()
    expected = ROW_FORMULAS[kernel.name](**{name: np.asarray(value, np.float64) if isinstance(
        value, np.ndarray) else value for name, value in arguments.items()})
    evaluated = kernel.evaluate_numpy(**arguments)
    assert set(result) == set(expected)
    for name, value in result.items():
        assert value.dtype == dtype and value.shape == expected[name].shape == kernel.output_shape(
            name, (4, 3, columns)), name
        assert_matches(value, expected[name], name, tolerance)
        assert_matches(value, evaluated[name], name, tolerance)


@compiled
def test_a_row_kernel_writes_the_outputs_it_is_given_and_refuses_the_wrong_shapes():
    arguments = row_arguments(kernels.RMS_NORM_ROWS_BACKWARD, np.float64)
    dx, dweight = np.empty((4, 3, 37)), np.full(37, np.nan)  # column sums start from zero, not from what is there
    result = host_kernels.run(kernels.RMS_NORM_ROWS_BACKWARD, **arguments, dx=dx, dweight=dweight)
    assert result["dx"] is dx and result["dweight"] is dweight
    assert_matches(dweight, _rms_norm_rows_backward(**arguments)["dweight"], "dweight", 1e-13)
    run = host_kernels.run
    assert run(kernels.RMS_NORM_ROWS_BACKWARD, **arguments, dweight=np.empty((4, 3, 37))) is None
    assert run(kernels.RMS_NORM_ROWS_FORWARD, x=arguments["dout"], weight=arguments["weight"],
               eps=np.full((4, 3, 37), EPS)) is None  # a row statement cannot read a full array


@pytest.mark.parametrize("inputs, outputs, phases", [
    ("T x", "T y", [("each", [("y", "x * 2.0")]), ("sum", [("s", "y")])]),       # another phase's element value
    ("T x", "T s", [("row", [("s", "total / columns")])]),                     # unknown name
    ("T x", "T s", [("sum", [("t", "x"), ("s", "t * 2.0")])]),                 # a sum read inside its own loop
    ("T x", "T y", [("sum", [("y", "x")]), ("sum", [("y", "x * x")])]),        # assigned twice
    ("T x", "T y", [("columns", [("c", "x")]), ("each", [("y", "x")])]),       # a column sum that is no output
    ("T x", "T y", [("each", [("x", "x * 2.0"), ("y", "x")])]),                # assigns an input
    ("T x, T columns", "T y", [("each", [("y", "x * columns")])]),             # takes the row length's name
    ("T x", "T y", [("average", [("y", "x")])]),                               # no such phase
    ("T x", "T y, T z", [("each", [("y", "x")])]),                             # an output never written
])
def test_invalid_row_kernels_are_refused(inputs, outputs, phases):
    with pytest.raises(ValueError):
        RowKernel("bad", inputs, outputs, phases)


def test_a_kernel_may_not_take_the_generated_loops_names():
    kernel = kernels.FusedKernel("bad", "T width", "T y", [("y", "width * 2.0")])
    with pytest.raises(ValueError, match="loop's own names"):
        host_kernels.c_source(kernel, np.dtype(np.float64), ("full",))


def test_a_row_kernels_c_source_sums_with_vector_accumulators_and_zeroes_column_sums_first():
    source = host_kernels.c_source(kernels.LAYER_NORM_ROWS_BACKWARD, np.dtype(np.float32),
                                   ("full", "column", "full", "row"))
    before_rows, rows = source.split("for (long row = 0; row < rows; row++) {")
    assert "dweight_array[column] = 0;" in before_rows and "dbias_array[column] = 0;" in before_rows
    assert "#pragma omp simd reduction(+:sum_dnorm, sum_dnorm_norm)" in rows
    assert "dweight_array[column] += dout * normalized;" in rows and "const T columns = (T)width;" in rows


def norm_step(layer, x, dout) -> list[np.ndarray]:
    """Forward, backward: output, d(input) and the weights' gradients."""
    params = [layer.weight, layer.bias] if isinstance(layer, LayerNorm) else [layer.weight]
    for param in params:
        param.grad[...] = 0
    out, saved = layer.forward(x)
    dx = layer.backward(saved, dout)
    return [out, dx, *(param.grad.copy() for param in params)]


@compiled
@pytest.mark.parametrize("dtype, tolerance", [(np.float64, 1e-13), (np.float32, 1e-6)])
@pytest.mark.parametrize("kind", ["layernorm", "rmsnorm"])
def test_norms_compiled_equal_the_numpy_chains(monkeypatch, kind, dtype, tolerance):
    """Output, d(input) and the weights' gradients of both paths; the compiled calls both ran and returned."""
    channels = 37
    weight = Parameter("w", (1 + 0.3 * RNG.standard_normal(channels)).astype(dtype))
    layer = (LayerNorm(weight, Parameter("b", (0.5 * RNG.standard_normal(channels)).astype(dtype)))
             if kind == "layernorm" else RMSNorm(weight))
    x, dout = (RNG.standard_normal((4, 3, channels)).astype(dtype) for _ in range(2))
    calls = []
    run = host_kernels.run
    monkeypatch.setattr(host_kernels, "run", lambda kernel, **a: calls.append(run(kernel, **a)) or calls[-1])
    with_kernels = norm_step(layer, x, dout)
    assert len(calls) == 2 and None not in calls
    monkeypatch.setattr(host_kernels, "ENABLED", False)
    for name, compiled_value, numpy_value in zip(("out", "dx", "dweight", "dbias"), with_kernels,
                                                  norm_step(layer, x, dout), strict=False):
        assert compiled_value.dtype == numpy_value.dtype
        assert_matches(compiled_value, numpy_value, name, tolerance)


@compiled
@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
def test_adamw_gives_the_same_bits_compiled_and_as_numpy_passes(monkeypatch, dtype, weight_decay):
    """Three steps over 300,000 elements (more than CPU_BLOCK: the NumPy side goes in blocks)."""
    compiled_state = (RNG.standard_normal(300_000).astype(dtype), np.zeros(300_000, dtype), np.zeros(300_000, dtype))
    numpy_state = tuple(array.copy() for array in compiled_state)  # param, exp_avg, exp_avg_sq
    for step in (1, 2, 3):
        grad = RNG.standard_normal(300_000).astype(dtype)
        monkeypatch.setattr(host_kernels, "ENABLED", True)
        adamw_update(compiled_state[0], grad, *compiled_state[1:], step, 1e-3, 0.9, 0.95, 1e-8, weight_decay)
        monkeypatch.setattr(host_kernels, "ENABLED", False)
        adamw_update(numpy_state[0], grad, *numpy_state[1:], step, 1e-3, 0.9, 0.95, 1e-8, weight_decay)
    for compiled_array, numpy_array in zip(compiled_state, numpy_state, strict=True):
        np.testing.assert_array_equal(compiled_array, numpy_array)


def adamw_model_parameters(dtype, moment_dtype=None) -> tuple[AdamW, list[Parameter]]:
    """Matrices and vectors of a small model's sizes (some above and some under a vector width), with gradients."""
    shapes = [(64, 48), (48,), (5,), (48, 192), (192,), (1,), (300, 7)]
    params = []
    for index, shape in enumerate(shapes):
        param = Parameter(f"p{index}", RNG.standard_normal(shape).astype(dtype))
        param.grad = RNG.standard_normal(shape).astype(dtype)
        params.append(param)
    return AdamW(params, 1e-3, weight_decay=0.1, moment_dtype=moment_dtype), params


@compiled
@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_an_adamw_step_is_one_compiled_call_per_weight_decay_with_the_numbers_of_one_call_each(monkeypatch, dtype):
    """Three steps of AdamW over seven parameters: two run_many calls a step (matrices decay, vectors not), and
    the weights and moments equal, bit for bit, those of adamw_update's NumPy passes one parameter at a time."""
    optimizer, params = adamw_model_parameters(dtype)
    reference, reference_params = adamw_model_parameters(dtype)
    for mine, theirs in zip(params, reference_params, strict=True):
        theirs.data[...], theirs.grad[...] = mine.data, mine.grad
    calls = []
    run_many = host_kernels.run_many
    monkeypatch.setattr(host_kernels, "run_many", lambda kernel, scalars, tensors: calls.append(len(tensors))
                        or run_many(kernel, scalars, tensors))
    for _ in range(3):
        optimizer.step()
    assert sorted(calls) == [3, 3, 3, 4, 4, 4]  # per step: 3 matrices, 4 vectors
    monkeypatch.setattr(host_kernels, "ENABLED", False)
    for step in (1, 2, 3):
        for param in reference_params:
            decay = 0.1 if param.data.ndim >= 2 else 0.0
            adamw_update(param.data, param.grad, reference.exp_avg[param.name], reference.exp_avg_sq[param.name],
                         step, 1e-3, 0.9, 0.95, 1e-8, decay)
    for mine, theirs in zip(params, reference_params, strict=True):
        np.testing.assert_array_equal(mine.data, theirs.data, err_msg=mine.name)
        np.testing.assert_array_equal(optimizer.exp_avg[mine.name], reference.exp_avg[theirs.name])
        np.testing.assert_array_equal(optimizer.exp_avg_sq[mine.name], reference.exp_avg_sq[theirs.name])


@compiled
def test_narrow_moments_and_arrays_the_kernel_cannot_take_are_updated_one_at_a_time(monkeypatch):
    optimizer, params = adamw_model_parameters(np.float32, moment_dtype=DTYPES["bfloat16"])
    many = []
    run_many = host_kernels.run_many
    monkeypatch.setattr(host_kernels, "run_many", lambda *a: many.append(a) or run_many(*a))
    before = [param.data.copy() for param in params]
    optimizer.step()
    assert many == []  # bfloat16 moments: widened and rounded back by `update`, parameter by parameter
    assert all(not np.array_equal(param.data, old) for param, old in zip(params, before, strict=True))
    grids = [RNG.standard_normal((6, 8)).astype(np.float32) for _ in range(4)]
    strided = [grid[:, ::2] for grid in grids]
    copies = [grid.copy() for grid in grids]
    assert not adamw_update_many([tuple(strided)], 1, 1e-3, 0.9, 0.95, 1e-8, 0.0)  # not contiguous
    assert not adamw_update_many([tuple(grids[:3]) + (grids[3].astype(np.float64),)], 1, 1e-3, 0.9, 0.95, 1e-8,
                                 0.0)  # two dtypes
    assert not adamw_update_many([tuple(grids[:3]) + (grids[3][:5],)], 1, 1e-3, 0.9, 0.95, 1e-8, 0.0)  # sizes
    assert not adamw_update_many([], 1, 1e-3, 0.9, 0.95, 1e-8, 0.0)
    for grid, copy in zip(grids, copies, strict=True):
        np.testing.assert_array_equal(grid, copy)  # nothing written
    read_only = grids[0].copy()
    read_only.flags.writeable = False
    assert not host_kernels.run_many(kernels.ADAMW, adamw_kernel_scalars(**ADAMW_STEP), [dict(
        param=read_only, grad=grids[1], exp_avg=grids[2], exp_avg_sq=grids[3], new_param=read_only,
        new_exp_avg=grids[2], new_exp_avg_sq=grids[3])])


@compiled
def test_in_place_pairs_write_through():
    arguments = kernel_arguments(kernels.ADAMW, np.float32)
    param, exp_avg, exp_avg_sq = (arguments[name].copy() for name in ("param", "exp_avg", "exp_avg_sq"))
    expected = kernels.ADAMW.evaluate_numpy(**arguments)
    result = host_kernels.run(kernels.ADAMW, **{**arguments, "param": param, "exp_avg": exp_avg,
                                                  "exp_avg_sq": exp_avg_sq},
                              new_param=param, new_exp_avg=exp_avg, new_exp_avg_sq=exp_avg_sq)
    assert result["new_param"] is param
    for name, array in (("new_param", param), ("new_exp_avg", exp_avg), ("new_exp_avg_sq", exp_avg_sq)):
        np.testing.assert_array_equal(array, expected[name])


def test_calls_the_loop_cannot_take_are_left_to_numpy():
    x = RNG.standard_normal((6, 8))
    mean = x.mean(axis=-1, keepdims=True)
    run = host_kernels.run
    assert run(kernels.SOFTMAX_BACKWARD, probs=x[:, ::2], dprobs=x[:, ::2], weighted_sum=mean) is None  # strided
    assert run(kernels.SOFTMAX_BACKWARD, probs=x, dprobs=x, weighted_sum=mean.astype(np.float32)) is None  # dtypes
    narrow = x.astype(DTYPES["bfloat16"])
    assert run(kernels.SOFTMAX_BACKWARD, probs=narrow, dprobs=narrow,
               weighted_sum=mean.astype(DTYPES["bfloat16"])) is None  # no bfloat16 in C
    assert run(kernels.SOFTMAX_BACKWARD, probs=x, dprobs=x, weighted_sum=mean[:3]) is None  # neither row nor column
    assert run(kernels.SOFTMAX_BACKWARD, probs=x, dprobs=x, weighted_sum=mean,
               dscores=np.empty((6, 4))) is None  # a wrong output
    assert run(kernels.SOFTMAX_BACKWARD, probs=x, dprobs=x) is None  # an input missing
    assert run(kernels.SOFTMAX_BACKWARD, probs=x[:0], dprobs=x[:0], weighted_sum=mean[:0]) is None  # empty
    read_only = np.empty_like(x)
    read_only.flags.writeable = False
    assert run(kernels.SOFTMAX_BACKWARD, probs=x, dprobs=x, weighted_sum=mean, dscores=read_only) is None


def test_the_environment_turns_the_kernels_off_for_the_whole_process():
    """MPIPARALLEL_HOST_KERNELS=0 where the process starts: read once, when models.host_kernels is imported."""
    command = [sys.executable, "-c", "from models import host_kernels; print(host_kernels.status())"]
    for value, expected in (("0", "NumPy chains (MPIPARALLEL_HOST_KERNELS=0)"), ("1", host_kernels.status())):
        result = subprocess.run(command, env={**os.environ, "MPIPARALLEL_HOST_KERNELS": value}, capture_output=True,
                                text=True, timeout=120, check=True)
        assert result.stdout.strip() == expected


def test_without_a_compiler_or_when_turned_off_the_layers_run_numpy(monkeypatch, tmp_path):
    monkeypatch.setattr(host_kernels, "ENABLED", False)
    assert host_kernels.status() == "NumPy chains (MPIPARALLEL_HOST_KERNELS=0)"
    assert host_kernels.run(kernels.RMS_NORM_FORWARD, **kernel_arguments(kernels.RMS_NORM_FORWARD,
                                                                         np.float64)) is None
    monkeypatch.setattr(host_kernels, "ENABLED", True)
    monkeypatch.setenv("CC", str(tmp_path / "no-such-compiler"))
    monkeypatch.setattr(host_kernels, "_FAILURES", {})
    host_kernels._compiler.cache_clear()
    host_kernels.forget()
    try:
        assert host_kernels.run(kernels.RMS_NORM_FORWARD, **kernel_arguments(kernels.RMS_NORM_FORWARD,
                                                                             np.float64)) is None
        assert host_kernels.status() == "NumPy chains (no C compiler: cc or $CC)"
        layer = RMSNorm(Parameter("w", np.ones(5)))
        out, _ = layer.forward(np.full((2, 5), 3.0))
        np.testing.assert_allclose(out, np.ones((2, 5)), rtol=1e-6)  # x / rms(x)
    finally:
        monkeypatch.undo()
        host_kernels._compiler.cache_clear()
        host_kernels.forget()


@compiled
def test_arrays_go_to_the_c_side_as_objects_whose_data_pointer_it_reads(monkeypatch):
    """The address sits right after the object header (NumPy's PyArrayObject_fields.data); where the probe does
    not find it there, no kernel runs and status() says why."""
    probe = np.arange(5.0)[1:]  # a view: its data pointer is not where its buffer was allocated
    offset = host_kernels._data_offset()
    assert offset == object.__basicsize__
    assert ctypes.c_void_p.from_address(id(probe) + offset).value == probe.ctypes.data
    arguments = row_arguments(kernels.RMS_NORM_ROWS_FORWARD, np.float64, rows=(5,))
    out = np.zeros((6, 37))
    view = {**arguments, "x": arguments["x"][2:]}  # contiguous rows from the middle of their buffer
    host_kernels.run(kernels.RMS_NORM_ROWS_FORWARD, **view, out=out[3:])
    np.testing.assert_allclose(out[3:], kernels.RMS_NORM_ROWS_FORWARD.evaluate_numpy(**view)["out"], rtol=1e-13)
    assert not out[:3].any()
    monkeypatch.setattr(host_kernels, "_data_offset", lambda: None)
    monkeypatch.setattr(host_kernels, "_FAILURES", {})
    host_kernels.forget()
    try:
        assert host_kernels.run(kernels.RMS_NORM_ROWS_FORWARD, **arguments) is None
        assert host_kernels.status() == ("NumPy chains (rms_norm_rows_forward: NumPy's array object does not keep "
                                         "its data pointer after the object header)")
    finally:
        monkeypatch.undo()
        host_kernels.forget()


def test_status_names_the_kernels_that_could_not_be_built_beside_those_that_were(monkeypatch):
    monkeypatch.setattr(host_kernels, "_FAILURES", {"softmax": "cc failed: cannot find -lmvec"})
    monkeypatch.setattr(host_kernels, "_LOADED", {"layer_norm_rows_forward"})
    monkeypatch.setattr(host_kernels, "_compiler", lambda: (["cc"], "/usr/bin/gcc-12 100 200"))
    assert host_kernels.status() == ("compiled (gcc-12); NumPy chains for softmax (softmax: cc failed: cannot find "
                                     "-lmvec)")
    monkeypatch.setattr(host_kernels, "_LOADED", set())
    assert host_kernels.status() == "NumPy chains (softmax: cc failed: cannot find -lmvec)"


@compiled
def test_a_failed_build_is_reported_and_a_read_only_cache_builds_in_a_temporary_folder(monkeypatch, tmp_path):
    monkeypatch.setattr(host_kernels, "_FAILURES", {})
    host_kernels.forget()
    try:
        monkeypatch.setattr(host_kernels, "FLAGS", (*host_kernels.FLAGS, "-no-such-flag"))
        monkeypatch.setenv(host_kernels.CACHE_VARIABLE, str(tmp_path / "cache"))
        arguments = kernel_arguments(kernels.RMS_NORM_FORWARD, np.float64)
        assert host_kernels.run(kernels.RMS_NORM_FORWARD, **arguments) is None
        compiler = host_kernels._compiler()[0][0]
        assert host_kernels.status().startswith(f"NumPy chains (rms_norm_forward: {compiler} failed: ")
        monkeypatch.undo()
        host_kernels.forget()
        (tmp_path / "file").write_text("a file where the cache folder's parent should be")
        monkeypatch.setenv(host_kernels.CACHE_VARIABLE, str(tmp_path / "file" / "cache"))
        monkeypatch.setattr(host_kernels, "_FAILURES", {})
        result = host_kernels.run(kernels.RMS_NORM_FORWARD, **arguments)
        assert result is not None and not host_kernels._FAILURES
        np.testing.assert_array_equal(result["out"], kernels.RMS_NORM_FORWARD.evaluate_numpy(**arguments)["out"])
    finally:
        monkeypatch.undo()
        host_kernels.forget()


@compiled
def test_a_kernel_is_built_once_and_kept_under_a_hash_of_its_source(monkeypatch, tmp_path):
    monkeypatch.setenv(host_kernels.CACHE_VARIABLE, str(tmp_path / "kernels"))
    host_kernels.forget()
    try:
        arguments = row_arguments(kernels.LAYER_NORM_ROWS_FORWARD, np.float32)
        host_kernels.run(kernels.LAYER_NORM_ROWS_FORWARD, **arguments)
        built = sorted((tmp_path / "kernels").iterdir())
        assert [path.name.split("-")[0] for path in built] == ["layer_norm_rows_forward"]
        ctypes.CDLL(str(built[0])).layer_norm_rows_forward  # noqa: B018 (the symbol is there)
        host_kernels.forget()
        host_kernels.run(kernels.LAYER_NORM_ROWS_FORWARD, **arguments)
        assert sorted((tmp_path / "kernels").iterdir()) == built  # taken from the cache, not built again
        host_kernels.run(kernels.LAYER_NORM_ROWS_FORWARD, **row_arguments(kernels.LAYER_NORM_ROWS_FORWARD,
                                                                           np.float64))
        assert len(list((tmp_path / "kernels").iterdir())) == 2  # another dtype, another library
    finally:
        monkeypatch.undo()
        host_kernels.forget()


def test_the_c_source_reads_rows_once_and_rounds_literals_to_t():
    source = host_kernels.c_source(kernels.LAYER_NORM_FORWARD, np.dtype(np.float32),
                                   ("full", "row", "row", "column", "column"))
    assert "typedef float T;" in source
    outer, inner = source.split("#pragma omp simd")
    assert "const T mean = mean_array[row];" in outer and "const T weight = weight_array[column];" in inner
    assert host_kernels._typed_literals("x * 0.5 + beta1 - 1.0e-3") == "x * ((T)0.5) + beta1 - ((T)1.0e-3)"


# ---------------------------------------------------------------------------------------------------------------
# The embedding's gradient: rows added into the rows of their tokens.
# ---------------------------------------------------------------------------------------------------------------


@compiled
@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("vocab, channels", [(11, 37), (300, 768)])
def test_scatter_add_rows_equals_numpy_add_at_bit_for_bit(dtype, vocab, channels):
    """Repeated tokens accumulate in the order they come, into a table that already holds numbers."""
    tokens = RNG.integers(0, vocab, (4, 50))
    tokens[0, :5] = 3  # a token five times in a row
    values = RNG.standard_normal((4, 50, channels)).astype(dtype)
    table = RNG.standard_normal((vocab, channels)).astype(dtype)
    expected = table.copy()
    np.add.at(expected, tokens.reshape(-1), values.reshape(-1, channels))
    assert host_kernels.scatter_add_rows(table, tokens, values.reshape(-1, channels))
    np.testing.assert_array_equal(table, expected)


@compiled
def test_scatter_add_rows_leaves_what_it_cannot_take_to_numpy():
    table, values = np.zeros((5, 8)), np.ones((3, 8))
    for rows, target, given in [(np.array([0, 5, 1]), table, values),     # a token outside the table
                                (np.array([0, -1, 1]), table, values),    # NumPy would wrap around: its call
                                (np.array([0, 1, 2]), np.zeros((5, 16))[:, ::2], values),  # a strided table
                                (np.array([0, 1, 2]), table, values.astype(np.float32)),   # two dtypes
                                (np.array([0.0, 1.0, 2.0]), table, values),                # not integers
                                (np.array([], dtype=np.int64), table, values[:0])]:         # nothing to add
        assert not host_kernels.scatter_add_rows(target, rows, given)
    assert not table.any()


@compiled
def test_scatter_add_rows_adds_position_rows_in_the_same_pass_or_nothing():
    """With positions, each row is also added into the row of its position (one per column of the tokens, shared
    by their rows), in order: the numbers of np.add.at into each table; an index outside either table, or
    positions that do not fit the tokens, write neither."""
    tokens, values = RNG.integers(0, 7, (3, 4)), RNG.standard_normal((12, 5))
    table, position_table = RNG.standard_normal((7, 5)), RNG.standard_normal((4, 5))
    before, before_positions = table.copy(), position_table.copy()
    expected, expected_positions = table.copy(), position_table.copy()
    np.add.at(expected, tokens.reshape(-1), values)
    np.add.at(expected_positions, np.tile([3, 1, 0, 2], 3), values)
    for positions in (np.array([3, 1, 0, 4]), np.array([3, 1, -1, 2]),  # outside the position table
                      np.array([3, 1, 0])):                             # not one per column
        assert not host_kernels.scatter_add_rows(table, tokens, values, positions, position_table)
    np.testing.assert_array_equal(table, before)
    np.testing.assert_array_equal(position_table, before_positions)
    assert host_kernels.scatter_add_rows(table, tokens, values, np.array([3, 1, 0, 2]), position_table)
    np.testing.assert_array_equal(table, expected)
    np.testing.assert_array_equal(position_table, expected_positions)


@compiled
@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("positions", ["window", "given", "documents", "none"])
def test_the_embedding_compiled_equals_numpys_gather_and_its_gradients_add_at(monkeypatch, positions, dtype):
    """Forward: wte[tokens] + wpe[positions], the chain's numbers bit for bit (the same single addition). Backward:
    wte's and wpe's gradients in one compiled call, the numbers of np.add.at into each; the chain's
    (wpe's: its batch sum, then one addition) to rounding. Positions: a window starting at 2, distinct positions
    given (context parallelism's chunks), per-row positions (packed documents), or none (Llama: RoPE)."""
    from models.layers import Embedding
    batch, length, vocab, width = 3, 9, 13, 6
    tokens = RNG.integers(0, vocab, (batch, length))
    given = {"window": None, "given": RNG.permutation(11)[:length], "none": None,
             "documents": np.tile(np.arange(length), (batch, 1)) % 4}[positions]
    rows = np.tile(np.arange(2, 2 + length) if given is None else given, batch if given is None or given.ndim == 1
                   else 1).reshape(-1)
    dout = RNG.standard_normal((batch, length, width)).astype(dtype)
    wte, wpe = RNG.standard_normal((vocab, width)).astype(dtype), RNG.standard_normal((11, width)).astype(dtype)
    calls = {"embed": [], "scatter_add_rows": []}
    for name, calls_of in calls.items():
        function = getattr(host_kernels, name)
        monkeypatch.setattr(host_kernels, name, lambda *a, f=function, c=calls_of: c.append(f(*a)) or c[-1])
    results = []
    for enabled in (True, False):
        monkeypatch.setattr(host_kernels, "ENABLED", enabled)
        layer = Embedding(Parameter("wte", wte), None if positions == "none" else Parameter("wpe", wpe))
        grads = [layer.token.grad] + ([] if layer.position is None else [layer.position.grad])
        for grad in grads:
            grad[...] = 0.5
        x, saved = layer.forward(tokens, start=2, positions=given)
        layer.backward(saved, dout)
        results.append((x, *grads))
    compiled, chain = results
    assert calls["embed"][0] is not None and calls["scatter_add_rows"][0] is True  # both compiled, one call each
    expected_x = wte[tokens] + (0 if positions == "none" else wpe[rows.reshape(batch, length)])
    np.testing.assert_array_equal(compiled[0], expected_x)
    np.testing.assert_array_equal(chain[0], expected_x)
    expected_wte = np.full_like(wte, 0.5)
    np.add.at(expected_wte, tokens.reshape(-1), dout.reshape(-1, width))
    np.testing.assert_array_equal(compiled[1], expected_wte)
    if positions != "none":
        expected_wpe = np.full_like(wpe, 0.5)
        np.add.at(expected_wpe, rows, dout.reshape(-1, width))
        np.testing.assert_array_equal(compiled[2], expected_wpe)
    for name, compiled_value, chain_value in zip(("x", "d(wte)", "d(wpe)"), compiled, chain, strict=False):
        assert_matches(compiled_value, chain_value, name, 1e-6 if dtype == np.float32 else 1e-14)


@compiled
def test_the_compiled_embedding_leaves_what_it_cannot_take_to_numpy():
    """Tokens outside the table: NumPy's IndexError (or its wrap-around of −1) from the chain, not a wrong row."""
    from models.layers import Embedding
    table, positions = RNG.standard_normal((5, 4)), RNG.standard_normal((3, 4))
    for tokens, position_rows in ((np.array([[0, 5]]), None), (np.array([[0, -1]]), None),
                                  (np.array([[0.0, 1.0]]), None), (np.array([[0, 1]]), np.array([0, 3])),
                                  (np.array([[0, 1]]), np.array([0, 1, 2]))):  # positions that do not fit
        assert host_kernels.embed(tokens, table, position_rows, positions if position_rows is not None else None) \
            is None
    assert host_kernels.embed(np.array([[0, 1]]), np.asfortranarray(table)) is None  # not C-contiguous
    layer = Embedding(Parameter("wte", table))
    with pytest.raises(IndexError):
        layer.forward(np.array([[0, 5]]))
    np.testing.assert_array_equal(layer.forward(np.array([[0, -1]]))[0], table[[[0, 4]]])  # NumPy wraps −1


@compiled
def test_a_calls_plan_is_kept_for_its_exact_arguments_only():
    """run() keeps what a call needs by each argument's shape, strides, dtype and writability: a call that differs
    in any of them is checked afresh — a transposed copy of the same shape, another dtype, a read-only output."""
    kernel = kernels.LAYER_NORM_ROWS_FORWARD
    arguments = row_arguments(kernel, np.float64, rows=(6,), columns=6)
    expected = kernel.evaluate_numpy(**arguments)
    for _ in range(2):  # planned, then from the plan
        np.testing.assert_allclose(host_kernels.run(kernel, **arguments)["out"], expected["out"], rtol=1e-13)
    assert host_kernels.run(kernel, **{**arguments, "x": arguments["x"].T}) is None  # strided: the chain's
    as_float32 = {name: value.astype(np.float32) if isinstance(value, np.ndarray) else value
                  for name, value in arguments.items()}
    assert host_kernels.run(kernel, **as_float32)["out"].dtype == np.float32
    out = np.empty_like(arguments["x"])
    assert host_kernels.run(kernel, **arguments, out=out)["out"] is out
    out.flags.writeable = False
    assert host_kernels.run(kernel, **arguments, out=out) is None


# ---------------------------------------------------------------------------------------------------------------
# The attention's causal softmax: one compiled pass per row.
# ---------------------------------------------------------------------------------------------------------------


def softmax_written_out(scores: np.ndarray, offset: int) -> np.ndarray:
    """softmax over each row's keys 0 … i + offset, the rest 0, in float64 with math.exp (no NumPy chain)."""
    queries, keys = scores.shape[-2:]
    expected = np.zeros(scores.shape)
    for index in np.ndindex(scores.shape[:-1]):
        seen = min(index[-1] + offset + 1, keys)
        row = [float(value) for value in scores[index][:seen]]
        exps = [math.exp(value - max(row)) for value in row]
        expected[index][:seen] = [value / sum(exps) for value in exps]
    return expected


@compiled
@vector_math
@pytest.mark.parametrize("dtype, tolerance", [(np.float64, 1e-14), (np.float32, 1e-6)])
@pytest.mark.parametrize("queries, keys", [(5, 5), (5, 9), (64, 128), (1, 37)])
def test_the_compiled_causal_softmax_computes_its_math_and_equals_the_numpy_chain(monkeypatch, queries, keys,
                                                                                   dtype, tolerance):
    """Each query row over the keys up to its own position (the queries the last of the keys), masked keys 0
    exactly; a key masked by −∞ beforehand (another document's) is 0 too. Rows of 37 and 128 keys: the vector
    loops' remainders run as well as their full vectors."""
    offset = keys - queries
    scores = (4 * RNG.standard_normal((2, 3, queries, keys))).astype(dtype)
    scores[0, 0, -1, :2] = -np.inf  # the last query's first two keys: another document
    compiled_probs = scores.copy()
    assert host_kernels.causal_softmax(compiled_probs, offset)
    expected = softmax_written_out(scores, offset)
    assert_matches(compiled_probs, expected, "softmax", tolerance)
    assert np.all(compiled_probs[expected == 0] == 0)
    monkeypatch.setattr(host_kernels, "ENABLED", False)
    assert_matches(compiled_probs, causal_softmax(scores.copy(), offset), "against the chain", tolerance)


@compiled
@vector_math
def test_the_compiled_causal_softmax_leaves_what_it_cannot_take_to_numpy():
    scores = RNG.standard_normal((2, 4, 6))
    read_only = scores.copy()
    read_only.flags.writeable = False
    for given in (scores.swapaxes(-1, -2), scores[..., ::2], scores.astype(np.float16), read_only, scores[:0]):
        before = given.copy()
        assert not host_kernels.causal_softmax(given, 0)
        np.testing.assert_array_equal(given, before)
    assert host_kernels.causal_softmax(scores, 0)  # the same call, contiguous: compiled


@compiled
@pytest.mark.parametrize("dtype, tolerance", [(np.float64, 1e-14), (np.float32, 1e-6)])
def test_row_dots_compiled_equal_the_chain_and_serve_the_attention_backward(monkeypatch, dtype, tolerance):
    """Σ a·b per row of each head, (B, T, H, d) -> (B, T, H, 1), compiled and as row_sums(a·b); the attention's
    backward asks for it once (Σ_j p·dp as dy·y), and falls back to the chain where the kernel cannot run."""
    a, b = (RNG.standard_normal((2, 5, 3, 64)).astype(dtype) for _ in range(2))
    kernels_run = []
    run = host_kernels.run
    monkeypatch.setattr(host_kernels, "run", lambda kernel, **arrays: kernels_run.append(kernel.name) or run(
        kernel, **arrays))
    compiled_dots = row_dots(a, b)
    assert kernels_run == ["row_dots"] and compiled_dots.shape == (2, 5, 3, 1) and compiled_dots.dtype == dtype
    assert_matches(compiled_dots, np.einsum("bthd,bthd->bth", a, b)[..., None], "the math", tolerance)
    monkeypatch.setattr(host_kernels, "ENABLED", False)
    assert_matches(compiled_dots, row_dots(a, b), "against the chain", tolerance)
    monkeypatch.setattr(host_kernels, "ENABLED", True)
    kernels_run.clear()
    qkv, projection = (Linear(Parameter(name, RNG.standard_normal(shape).astype(dtype))) for name, shape in
                       (("qkv", (12, 36)), ("proj", (12, 12))))
    attention = CausalSelfAttention(qkv, projection, 3, query_block=2)
    out, saved = attention.forward(RNG.standard_normal((2, 5, 12)).astype(dtype))
    attention.backward_input(saved, np.ones_like(out))
    assert kernels_run.count("row_dots") == 1


@compiled
@vector_math
@pytest.mark.parametrize("dtype, tolerance", [(np.float64, 1e-14), (np.float32, 1e-6)])
@pytest.mark.parametrize("vocab", [11, 1000])
def test_the_compiled_cross_entropy_computes_its_math_and_equals_the_numpy_chain(monkeypatch, vocab, dtype,
                                                                                 tolerance):
    """The loss and d(logits) = (softmax − onehot) / normalizer, written out in float64 with math.exp and
    math.log; an ignored target (IGNORED) adds no loss and leaves a zero row; both equal the layer's NumPy chain."""
    rows, channels, normalizer = 14, 6, 37.0
    wte = Parameter("wte", RNG.standard_normal((vocab, channels)).astype(dtype))
    x = RNG.standard_normal((2, rows // 2, channels)).astype(dtype)
    targets = RNG.integers(0, vocab, (2, rows // 2))
    targets[1, 3] = IGNORED
    logits = x.reshape(rows, channels).astype(np.float64) @ wte.data.T.astype(np.float64)
    expected_loss, expected_dlogits = 0.0, np.zeros((rows, vocab))
    for row, target in enumerate(targets.reshape(-1)):
        if target == IGNORED:
            continue
        exps = [math.exp(value - max(logits[row])) for value in logits[row]]
        expected_loss += (math.log(sum(exps)) - (logits[row, target] - max(logits[row]))) / normalizer
        expected_dlogits[row] = np.array(exps) / sum(exps) / normalizer
        expected_dlogits[row, target] -= 1 / normalizer
    ran = []
    compiled_call = host_kernels.cross_entropy
    monkeypatch.setattr(host_kernels, "cross_entropy", lambda *a: ran.append(compiled_call(*a)) or ran[-1])
    loss, saved = HeadCrossEntropy(wte).forward(x, targets, normalizer)
    assert ran[0] is not None
    assert abs(loss - expected_loss) <= 10 * tolerance * expected_loss
    assert_matches(saved.dlogits, expected_dlogits, "d(logits)", tolerance)
    assert not saved.dlogits[rows // 2 + 3].any()
    monkeypatch.setattr(host_kernels, "ENABLED", False)
    chain_loss, chain_saved = HeadCrossEntropy(wte).forward(x, targets, normalizer)
    assert ran[1] is None and abs(loss - chain_loss) <= 10 * tolerance * chain_loss
    assert_matches(saved.dlogits, chain_saved.dlogits, "against the chain", tolerance)


@compiled
@vector_math
def test_the_compiled_cross_entropy_leaves_what_it_cannot_take_to_numpy():
    logits = RNG.standard_normal((4, 5))
    for given, targets in ((logits, np.array([0, 1, 5, 2])),             # a target beyond the vocabulary
                           (logits, np.array([0.0, 1.0, 2.0, 3.0])),     # not integers
                           (logits, np.array([0, 1, 2])),                # one target short
                           (logits.T.copy().T, np.arange(4)),            # strided logits
                           (logits.astype(np.float16), np.arange(4))):   # a dtype the loop does not take
        before = given.copy()
        assert host_kernels.cross_entropy(given, targets, 3.0) is None
        np.testing.assert_array_equal(given, before)
    with pytest.raises(IndexError):  # NumPy's own error, from the chain
        HeadCrossEntropy(Parameter("wte", RNG.standard_normal((5, 3)))).forward(
            RNG.standard_normal((1, 2, 3)), np.array([[0, 5]]), 2.0)


# ---------------------------------------------------------------------------------------------------------------
# GELU: the chain's passes in one, keeping what the chain keeps.
# ---------------------------------------------------------------------------------------------------------------


def compiled_and_chain(monkeypatch, layer_class, x, dout) -> tuple[list, tuple, tuple]:
    """The `run` results, then (output, what forward kept, d(x)) of a fresh `layer_class()` compiled and as the
    NumPy chain; both compiled calls must have run, and neither when turned off."""
    ran = []
    run = host_kernels.run
    monkeypatch.setattr(host_kernels, "run", lambda kernel, **a: ran.append(run(kernel, **a)) or ran[-1])
    paths = {}
    for enabled in (True, False):
        monkeypatch.setattr(host_kernels, "ENABLED", enabled)
        out, saved = layer_class().forward(x)
        kept = {name: value.copy() for name, value in vars(saved).items()}
        paths[enabled] = (out, kept, layer_class().backward_input(saved, dout))
    assert ran[0] is not None and ran[1] is not None and ran[2:] == [None, None]
    return ran, paths[True], paths[False]


@compiled
@vector_math
@pytest.mark.parametrize("dtype, tolerance", [(np.float64, 1e-14), (np.float32, 1e-6)])
def test_gelu_compiled_keeps_what_the_chain_keeps_and_equals_it(monkeypatch, dtype, tolerance):
    """Forward keeps x, a, the gate and the output on both paths (so block_activation_elements holds for both);
    a is the chain's bit for bit, the gate and output to tanh's last bits (glibc's vector tanh against NumPy's);
    backward from the very values the chain kept gives the chain's d(x) bit for bit."""
    x, dout = (3 * RNG.standard_normal((4, 3, 40))).astype(dtype), RNG.standard_normal((4, 3, 40)).astype(dtype)
    ran, (out, kept, dx), (chain_out, chain_kept, chain_dx) = compiled_and_chain(monkeypatch, GELU, x, dout)
    assert {name: (value.shape, value.dtype) for name, value in kept.items()} == {
        name: (value.shape, value.dtype) for name, value in chain_kept.items()}
    np.testing.assert_array_equal(kept["a"], chain_kept["a"])
    assert_matches(out, chain_out, "out", tolerance)
    assert_matches(dx, chain_dx, "d(x)", 10 * tolerance)
    monkeypatch.setattr(host_kernels, "ENABLED", True)
    from_chain = GELU().backward_input(Saved(**chain_kept), dout)
    assert ran[-1] is not None
    np.testing.assert_array_equal(from_chain, chain_dx)


@compiled
@vector_math
@pytest.mark.parametrize("dtype, tolerance", [(np.float64, 1e-14), (np.float32, 1e-6)])
def test_swiglu_compiled_reads_the_halves_where_they_lie_and_equals_the_chain(monkeypatch, dtype, tolerance):
    """The [gate | up] halves are STRIDED views: forward reads them and backward writes d(gate), d(up) into the
    halves of d(input) without copies; both keep what the chain keeps; backward from the chain's kept values gives
    the chain's d(input) bit for bit."""
    x, dout = RNG.standard_normal((4, 3, 2 * 21)).astype(dtype), RNG.standard_normal((4, 3, 21)).astype(dtype)
    ran, (out, kept, dx), (chain_out, chain_kept, chain_dx) = compiled_and_chain(monkeypatch, SwiGLU, x, dout)
    assert {name: value.shape for name, value in kept.items()} == {name: v.shape for name, v in chain_kept.items()}
    assert_matches(out, chain_out, "out", tolerance)
    assert_matches(dx, chain_dx, "d(input)", 10 * tolerance)
    monkeypatch.setattr(host_kernels, "ENABLED", True)
    chain_kept["up"] = x[..., 21:]  # as the chain keeps it: a view of the input's half
    np.testing.assert_array_equal(SwiGLU().backward_input(Saved(**chain_kept), dout), chain_dx)
    assert ran[-1] is not None


@compiled
def test_the_strided_layout_takes_evenly_spaced_rows_only():
    """A column slice of a contiguous array, in and out, runs compiled with its row stride; columns that are not
    contiguous, or rows not evenly spaced (a slice of the middle axis), go to NumPy."""
    kernel = kernels.SOFTMAX_BACKWARD
    wide = RNG.standard_normal((4, 3, 50))
    probs, dprobs, weighted_sum = wide[..., 5:25], RNG.standard_normal((4, 3, 20)), RNG.standard_normal((4, 3, 1))
    out = np.zeros((4, 3, 45))
    result = host_kernels.run(kernel, probs=probs, dprobs=dprobs, weighted_sum=weighted_sum,
                              dscores=out[..., 20:40])
    np.testing.assert_array_equal(result["dscores"], kernel.evaluate_numpy(probs=probs, dprobs=dprobs,
                                                                           weighted_sum=weighted_sum)["dscores"])
    assert not out[..., :20].any() and not out[..., 40:].any()
    assert host_kernels._row_stride(probs) == 50
    for uneven in (wide[..., ::2][..., :20],                     # columns not contiguous
                   np.broadcast_to(wide[:1, :, :20], (4, 3, 20))):  # every batch entry the same memory
        assert uneven.shape == dprobs.shape and host_kernels._row_stride(uneven) is None
        assert host_kernels.run(kernel, probs=uneven, dprobs=dprobs, weighted_sum=weighted_sum) is None
    middle = wide[:, :2, :20]  # rows 0 and 1 of each batch entry, then a gap of a row: not evenly spaced
    assert host_kernels._row_stride(middle) is None
    assert host_kernels.run(kernel, probs=middle, dprobs=dprobs[:, :2], weighted_sum=weighted_sum[:, :2]) is None


# ---------------------------------------------------------------------------------------------------------------
# RoPE: the turn of every head's row at its position, in one compiled loop.
# ---------------------------------------------------------------------------------------------------------------


@compiled
@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("per_row", [False, True])
def test_rope_compiled_equals_its_numpy_passes_bit_for_bit(monkeypatch, per_row, dtype):
    """Query heads as views into a qkv projection's output (the layout the attention passes), rotated forward and
    back at shared positions or per-row ones (packed documents); the key and value channels are left alone."""
    from models.rotary import RotaryEmbedding
    batch, length, heads, head_dim = 2, 7, 3, 8
    qkv = RNG.standard_normal((batch, length, 3 * heads * head_dim)).astype(dtype)
    positions = np.tile(np.arange(length), (batch, 1)) % 4 if per_row else np.arange(2, 2 + length)
    dout = RNG.standard_normal((batch, heads, length, head_dim)).astype(dtype)
    ran, results = [], []
    rotate = host_kernels.rotate_pairs
    monkeypatch.setattr(host_kernels, "rotate_pairs", lambda *a: ran.append(rotate(*a)) or ran[-1])
    for enabled in (True, False):
        monkeypatch.setattr(host_kernels, "ENABLED", enabled)
        rope, copy, grad = RotaryEmbedding(head_dim), qkv.copy(), dout.copy()
        queries = copy.reshape(batch, length, 3 * heads, head_dim)[:, :, :heads].transpose(0, 2, 1, 3)
        rope.rotate(queries, positions)
        rope.rotate_back(grad, positions)
        results.append((copy, grad))
    assert ran == [True, True, False, False]
    for compiled_value, numpy_value in zip(*results, strict=True):
        np.testing.assert_array_equal(compiled_value, numpy_value)
    np.testing.assert_array_equal(results[0][0][..., heads * head_dim:], qkv[..., heads * head_dim:])
    assert not np.array_equal(results[0][0][..., :heads * head_dim], qkv[..., :heads * head_dim])


@compiled
def test_rope_compiled_leaves_what_it_cannot_take_to_numpy():
    x, cos, sin = RNG.standard_normal((2, 3, 5, 8)), RNG.standard_normal((6, 4)), RNG.standard_normal((6, 4))
    before = x.copy()
    for given, positions in ((x, np.array([0, 1, 2, 3, 6])),      # a position beyond the tables
                             (x, np.array([0, 1, 2, 3])),         # one position short
                             (x[..., ::-1], np.arange(5)),        # a last axis read backwards
                             (x[0], np.arange(5))):               # not (B, heads, t, d)
        assert not host_kernels.rotate_pairs(given, cos, sin, positions, 1.0)
    np.testing.assert_array_equal(x, before)
    assert host_kernels.rotate_pairs(x, cos, sin, np.arange(5), 1.0)
