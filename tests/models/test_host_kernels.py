"""The fused kernels compiled for the CPU (models.host_kernels): the NumPy chains' numbers bit for bit, the math
written out, and the NumPy chains wherever they cannot run.

Every kernel is built with the machine's C compiler (the suite's machines have one; a machine without one skips
the compiled checks and still runs the fallback ones) and compared with the math written out
(test_kernels.INDEPENDENT_FORMULAS). The kernels the CPU's layers use — no tanh or exp — must also equal the
NumPy evaluation of their own text exactly, and the layers and AdamW must give the same bits with the compiled
kernels as with MPIPARALLEL_HOST_KERNELS=0, in float32 and float64.
"""

from __future__ import annotations

import ctypes

import numpy as np
import pytest
from test_kernels import ADAMW_STEP, INDEPENDENT_FORMULAS, KERNELS, assert_matches

from models import host_kernels, kernels
from models.layers import LayerNorm, RMSNorm
from models.parameter import Parameter
from models.precision import DTYPES
from mpiparallel.optim import adamw_kernel_scalars, adamw_update

RNG = np.random.default_rng(11)
SHAPES = {"mean": (4, 3, 1), "rstd": (4, 3, 1), "row_max": (4, 3, 1), "weighted_sum": (4, 3, 1),
          "mean_dnorm": (4, 3, 1), "mean_dnorm_norm": (4, 3, 1), "weight": (37,), "bias": (37,)}
"""Rows of 37 (not a multiple of any vector width: the loops' remainders run too) over a (4, 3) batch."""
CORRECTLY_ROUNDED = [kernel for kernel in KERNELS if not {"tanh", "exp"} & set(kernel.cuda_source().replace(
    "(", " ").split())]
"""The kernels of + − × ÷ and sqrt only, which the CPU's layers and AdamW run compiled."""

compiled = pytest.mark.skipif(host_kernels.status().startswith("NumPy"), reason=host_kernels.status())


def kernel_arguments(kernel, dtype) -> dict:
    scalars = adamw_kernel_scalars(**ADAMW_STEP) if kernel is kernels.ADAMW else {}
    arrays = {name: RNG.uniform(0.5, 1.5, SHAPES.get(name, (4, 3, 37))).astype(dtype)
              for name in kernel.input_names if name not in scalars}
    return {**arrays, **scalars}


@compiled
@pytest.mark.parametrize("dtype, tolerance", [(np.float64, 1e-12), (np.float32, 1e-5)])
@pytest.mark.parametrize("kernel", KERNELS, ids=lambda k: k.name)
def test_every_kernel_compiled_for_the_cpu_computes_its_math(kernel, dtype, tolerance):
    arguments = kernel_arguments(kernel, dtype)
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


def test_the_layers_use_the_compiled_kernels_where_they_can():
    assert {kernel.name for kernel in CORRECTLY_ROUNDED} >= {
        "layer_norm_centered_square", "layer_norm_forward", "layer_norm_backward_products", "layer_norm_backward",
        "rms_norm_forward", "rms_norm_backward_products", "rms_norm_backward", "adamw"}


def norm_step(layer, x, dout) -> list[np.ndarray]:
    """Forward, backward: output, d(input) and the weights' gradients."""
    params = [layer.weight, layer.bias] if isinstance(layer, LayerNorm) else [layer.weight]
    for param in params:
        param.grad[...] = 0
    out, saved = layer.forward(x)
    dx = layer.backward(saved, dout)
    return [out, dx, *(param.grad.copy() for param in params)]


@compiled
@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("kind", ["layernorm", "rmsnorm"])
def test_norms_give_the_same_bits_compiled_and_as_numpy_chains(monkeypatch, kind, dtype):
    channels = 37
    weight = Parameter("w", (1 + 0.3 * RNG.standard_normal(channels)).astype(dtype))
    layer = (LayerNorm(weight, Parameter("b", (0.5 * RNG.standard_normal(channels)).astype(dtype)))
             if kind == "layernorm" else RMSNorm(weight))
    x, dout = (RNG.standard_normal((4, 3, channels)).astype(dtype) for _ in range(2))
    calls = []
    run = host_kernels.run
    monkeypatch.setattr(host_kernels, "run", lambda kernel, **a: calls.append(kernel.name) or run(kernel, **a))
    with_kernels = norm_step(layer, x, dout)
    assert len(calls) == (4 if kind == "layernorm" else 3)  # every compiled call ran
    monkeypatch.setenv("MPIPARALLEL_HOST_KERNELS", "0")
    for compiled_value, numpy_value in zip(with_kernels, norm_step(layer, x, dout), strict=True):
        np.testing.assert_array_equal(compiled_value, numpy_value)


@compiled
@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
def test_adamw_gives_the_same_bits_compiled_and_as_numpy_passes(monkeypatch, dtype, weight_decay):
    """Three steps over 300,000 elements (more than CPU_BLOCK: the NumPy side goes in blocks)."""
    compiled_state = (RNG.standard_normal(300_000).astype(dtype), np.zeros(300_000, dtype), np.zeros(300_000, dtype))
    numpy_state = tuple(array.copy() for array in compiled_state)  # param, exp_avg, exp_avg_sq
    for step in (1, 2, 3):
        grad = RNG.standard_normal(300_000).astype(dtype)
        monkeypatch.delenv("MPIPARALLEL_HOST_KERNELS", raising=False)
        adamw_update(compiled_state[0], grad, *compiled_state[1:], step, 1e-3, 0.9, 0.95, 1e-8, weight_decay)
        monkeypatch.setenv("MPIPARALLEL_HOST_KERNELS", "0")
        adamw_update(numpy_state[0], grad, *numpy_state[1:], step, 1e-3, 0.9, 0.95, 1e-8, weight_decay)
    for compiled_array, numpy_array in zip(compiled_state, numpy_state, strict=True):
        np.testing.assert_array_equal(compiled_array, numpy_array)


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
    assert run(kernels.LAYER_NORM_CENTERED_SQUARE, x=x[:, ::2], mean=mean) is None  # not contiguous
    assert run(kernels.LAYER_NORM_CENTERED_SQUARE, x=x, mean=mean.astype(np.float32)) is None  # two dtypes
    assert run(kernels.LAYER_NORM_CENTERED_SQUARE, x=x.astype(DTYPES["bfloat16"]),
               mean=mean.astype(DTYPES["bfloat16"])) is None  # no bfloat16 in C
    assert run(kernels.LAYER_NORM_CENTERED_SQUARE, x=x, mean=mean[:3]) is None  # neither row nor column
    assert run(kernels.LAYER_NORM_CENTERED_SQUARE, x=x, mean=mean, square=np.empty((6, 4))) is None  # bad output
    assert run(kernels.LAYER_NORM_CENTERED_SQUARE, x=x) is None  # an input missing
    assert run(kernels.LAYER_NORM_CENTERED_SQUARE, x=x[:0], mean=mean[:0]) is None  # nothing to point at
    read_only = np.empty_like(x)
    read_only.flags.writeable = False
    assert run(kernels.LAYER_NORM_CENTERED_SQUARE, x=x, mean=mean, square=read_only) is None


def test_without_a_compiler_or_when_turned_off_the_layers_run_numpy(monkeypatch, tmp_path):
    monkeypatch.setenv("MPIPARALLEL_HOST_KERNELS", "0")
    assert host_kernels.status() == "NumPy chains (MPIPARALLEL_HOST_KERNELS=0)"
    assert host_kernels.run(kernels.RMS_NORM_FORWARD, **kernel_arguments(kernels.RMS_NORM_FORWARD,
                                                                         np.float64)) is None
    monkeypatch.delenv("MPIPARALLEL_HOST_KERNELS")
    monkeypatch.setenv("CC", str(tmp_path / "no-such-compiler"))
    monkeypatch.setattr(host_kernels, "_FAILURES", {})
    for cached in (host_kernels._compiler, host_kernels._function):
        cached.cache_clear()
    try:
        assert host_kernels.run(kernels.RMS_NORM_FORWARD, **kernel_arguments(kernels.RMS_NORM_FORWARD,
                                                                             np.float64)) is None
        assert host_kernels.status() == "NumPy chains (no C compiler: cc or $CC)"
        layer = RMSNorm(Parameter("w", np.ones(5)))
        out, _ = layer.forward(np.full((2, 5), 3.0))
        np.testing.assert_allclose(out, np.ones((2, 5)), rtol=1e-6)  # x / rms(x)
    finally:
        monkeypatch.undo()
        for cached in (host_kernels._compiler, host_kernels._function):
            cached.cache_clear()


@compiled
def test_a_failed_build_is_reported_and_a_read_only_cache_builds_in_a_temporary_folder(monkeypatch, tmp_path):
    monkeypatch.setattr(host_kernels, "_FAILURES", {})
    host_kernels._function.cache_clear()
    try:
        monkeypatch.setattr(host_kernels, "FLAGS", (*host_kernels.FLAGS, "-no-such-flag"))
        monkeypatch.setenv(host_kernels.CACHE_VARIABLE, str(tmp_path / "cache"))
        arguments = kernel_arguments(kernels.RMS_NORM_FORWARD, np.float64)
        assert host_kernels.run(kernels.RMS_NORM_FORWARD, **arguments) is None
        compiler = host_kernels._compiler()[0][0]
        assert host_kernels.status().startswith(f"NumPy chains (rms_norm_forward: {compiler} failed: ")
        monkeypatch.undo()
        host_kernels._function.cache_clear()
        (tmp_path / "file").write_text("a file where the cache folder's parent should be")
        monkeypatch.setenv(host_kernels.CACHE_VARIABLE, str(tmp_path / "file" / "cache"))
        monkeypatch.setattr(host_kernels, "_FAILURES", {})
        result = host_kernels.run(kernels.RMS_NORM_FORWARD, **arguments)
        assert result is not None and not host_kernels._FAILURES
        np.testing.assert_array_equal(result["out"], kernels.RMS_NORM_FORWARD.evaluate_numpy(**arguments)["out"])
    finally:
        monkeypatch.undo()
        host_kernels._function.cache_clear()


@compiled
def test_a_kernel_is_built_once_and_kept_under_a_hash_of_its_source(monkeypatch, tmp_path):
    monkeypatch.setenv(host_kernels.CACHE_VARIABLE, str(tmp_path / "kernels"))
    host_kernels._function.cache_clear()
    try:
        arguments = kernel_arguments(kernels.LAYER_NORM_CENTERED_SQUARE, np.float32)
        host_kernels.run(kernels.LAYER_NORM_CENTERED_SQUARE, **arguments)
        built = sorted((tmp_path / "kernels").iterdir())
        assert [path.name.split("-")[0] for path in built] == ["layer_norm_centered_square"]
        ctypes.CDLL(str(built[0])).layer_norm_centered_square  # noqa: B018 (the symbol is there)
        host_kernels._function.cache_clear()
        host_kernels.run(kernels.LAYER_NORM_CENTERED_SQUARE, **arguments)
        assert sorted((tmp_path / "kernels").iterdir()) == built  # taken from the cache, not built again
        host_kernels.run(kernels.LAYER_NORM_CENTERED_SQUARE, **kernel_arguments(kernels.LAYER_NORM_CENTERED_SQUARE,
                                                                                 np.float64))
        assert len(list((tmp_path / "kernels").iterdir())) == 2  # another dtype, another library
    finally:
        monkeypatch.undo()
        host_kernels._function.cache_clear()


def test_the_c_source_reads_rows_once_and_rounds_literals_to_t():
    source = host_kernels.c_source(kernels.LAYER_NORM_FORWARD, np.dtype(np.float32),
                                   ("full", "row", "row", "column", "column"))
    assert "typedef float T;" in source
    outer, inner = source.split("#pragma omp simd")
    assert "const T mean = mean_array[row];" in outer and "const T weight = weight_array[column];" in inner
    assert host_kernels._typed_literals("x * 0.5 + beta1 - 1.0e-3") == "x * ((T)0.5) + beta1 - ((T)1.0e-3)"
