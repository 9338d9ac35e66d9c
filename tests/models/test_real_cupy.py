"""Our fused GPU kernels as real CuPy sees them, on a machine without a GPU (CuPy 14 imports without one).

Two rejections a GPU run could meet before any result: CuPy's type resolution refusing a call (one dtype per
placeholder `T`), and NVRTC failing to compile a kernel for a dtype. The first is checked on every call the
trainer really makes — every precision mode (FP8 too), every family, TP and DP meshes, recorded on the CuPy
double — the second on every kernel at every dtype for the two architectures the GPU machines have (A100 sm_80,
H100 sm_90). How CuPy is reached without a device, and which of its internals that uses: tests/support/real_cupy.py.
With CI=true these tests may not skip: .ci/run installs the `gpu-check` extra (cupy-cuda13x and its NVRTC).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from mpi_harness import run_on_ranks
from optional import optional_module
from real_cupy import compile_kernel, fused_kernels, resolve_types
from workers import device_checks

pytestmark = pytest.mark.gpu  # scripts/gpu_check.sh runs these on the GPU (tests group)

FLOAT_DTYPES = ("float16", "bfloat16", "float32", "float64")
ARCHITECTURES = ("sm_80", "sm_90")


def real_cupy():
    return optional_module("cupy", "needs CuPy (no GPU needed): pip install -e '.[gpu-check]'")


@pytest.fixture(scope="module")
def training_calls() -> list[dict]:
    return run_on_ranks(2, device_checks.kernel_calls_in_training, timeout=600,
                        families=["gpt2", "llama", "deepseek_v3"],
                        meshes=[{"dp": 2, "zero": 1}, {"tp": 2, "sp": True}])[0]


def test_every_kernel_call_the_trainer_makes_passes_real_cupys_type_resolution(training_calls):
    cupy = real_cupy()
    kernels = fused_kernels()
    refused = []
    for call in training_calls:
        try:
            resolve_types(cupy, kernels[call["kernel"]], call["inputs"], call["outputs"])
        except TypeError as error:
            refused.append(f"{call['kernel']}{tuple(call['inputs'])} in {call['modes'][0]}: {error}")
    assert not refused, "\n".join(refused)


FAMILY_KERNELS = {
    "gpt2": {"layer_norm_forward", "layer_norm_backward", "gelu_forward", "gelu_backward", "softmax_exp",
             "softmax_backward", "adamw"},
    "llama": {"rms_norm_forward", "rms_norm_backward", "swiglu_forward", "swiglu_backward", "softmax_exp",
              "softmax_backward", "adamw"},
    "deepseek_v3": {"rms_norm_forward", "rms_norm_backward", "swiglu_forward", "swiglu_backward", "softmax_exp",
                    "softmax_backward", "adamw"},
}


def test_the_recorded_calls_cover_every_kernel_of_each_family_in_every_mode(training_calls):
    """The resolution test sees what it should: every run (family × mesh × precision mode) called all its
    family's kernels, and at the dtype the precision contract says — float64 in a float64 run, float32 in every
    other (a narrow compute dtype is widened to float32 around the norms and elementwise layers, and AdamW
    updates float32 masters)."""
    kernels_by_run: dict[str, set] = {}
    dtypes_by_run: dict[str, set] = {}
    for call in training_calls:
        for run in call["modes"]:
            kernels_by_run.setdefault(run, set()).add(call["kernel"])
            dtypes_by_run.setdefault(run, set()).update(call["inputs"] + call["outputs"])
    assert len(kernels_by_run) == 3 * 2 * 6  # families × meshes × precision modes
    for run, called in kernels_by_run.items():
        assert called == FAMILY_KERNELS[run.split()[0]], run
        assert dtypes_by_run[run] - {None} == {"float64" if "float64" in run else "float32"}, run


def test_real_type_resolution_refuses_the_mixed_call_the_norms_used_to_make():
    """The check can fail: a float32 activation with a bfloat16 weight (what LayerNorm passed before the weight
    was handed over at the activations' dtype) is refused by CuPy itself, with its own message."""
    cupy = real_cupy()
    layer_norm = fused_kernels()["layer_norm_forward"]
    with pytest.raises(TypeError, match="Type is mismatched"):
        resolve_types(cupy, layer_norm, ["float32", "float32", "float32", "bfloat16", "bfloat16"], [])


@pytest.mark.parametrize("architecture", ARCHITECTURES)
def test_every_kernel_compiles_with_nvrtc_at_every_dtype(architecture):
    cupy = real_cupy()
    logs = {}
    for name, kernel in fused_kernels().items():
        for dtype in FLOAT_DTYPES:
            inputs = [dtype if ctype == "T" else ctype for ctype, _ in kernel.inputs]
            logs[f"{name}[{dtype}]"] = compile_kernel(cupy, kernel, inputs, architecture)
    assert len(logs) == 15 * len(FLOAT_DTYPES)  # the GPU's 11 and the CPU's keeping GELU and SwiGLU pairs
    assert all(log == "" for log in logs.values()), {key: log for key, log in logs.items() if log}


def test_the_kernels_compile_as_the_trainer_calls_them(training_calls):
    """The recorded calls, Python scalars as scalars (the AdamW step's hyperparameters), compile cleanly."""
    cupy = real_cupy()
    kernels = fused_kernels()
    signatures = {(call["kernel"], tuple(call["inputs"])) for call in training_calls}
    for name, inputs in sorted(signatures, key=str):
        assert compile_kernel(cupy, kernels[name], list(inputs), "sm_90") == "", (name, inputs)


def test_nvrtc_reports_a_kernel_that_does_not_compile():
    """The compile check can fail: a statement C cannot compile (an undeclared function) is NVRTC's error."""
    cupy = real_cupy()
    from cupy.cuda.compiler import CompileException

    from models.kernels import FusedKernel

    broken = FusedKernel("broken", "T x", "T y", [("y", "x * 2.0")])
    broken.cuda_source = lambda: "y = undeclared_function(x);"
    with pytest.raises(CompileException, match="undeclared_function"):
        compile_kernel(cupy, broken, ["float32"], "sm_90")


def test_the_doubles_list_of_cupy_names_is_the_installed_cupys():
    cupy = real_cupy()
    listed = (Path(__file__).resolve().parents[1] / "support" / "cupy_names.txt").read_text().splitlines()
    names = sorted(line for line in listed if line and not line.startswith("#"))
    assert names == sorted(name for name in dir(cupy) if not name.startswith("_")), \
        f"CuPy {cupy.__version__}'s public names changed: regenerate tests/support/cupy_names.txt"
