"""One training step operation by operation, ours beside PyTorch's: what `bench_train.py --profile` prints.

Three reports, each from steps run apart from the timed ones (profilers cost time):

1. **Our layers** (`LayerProfile`): exclusive wall time of every layer's forward and backward and of the optimizer,
   by wrapping their methods; the matrix products inside a layer (`models.layers.PLAIN_GEMMS`, the LM head's
   `logits` and its two backward products) are timed as well and shown as the layer's matmul part.
2. **Side by side** (`side_by_side`): our times and torch.profiler's self CPU times of the same step (of the operators
   doing the work, then with what torch spends calling them: TORCH_CALLS), sorted into the
   categories of `CATEGORIES` — matrix products, attention, activation, norm, RoPE, cross-entropy, the small
   passes (bias, residual adds, copies), embedding, optimizer, zeroing the gradients, and the rest (Python, the
   autograd engine, views: the step's wall time less everything named). Beside each: the least bytes the
   category's work must move (`least_bytes`: every operand read once and every result written once, as one fused
   kernel would) and the rate each side moves them at, so a memory-bound pass shows how far it is from the
   memory's speed, and the matmul share of each step.
3. **What the BLAS alone allows** (`blas_bound`): the step's linear-layer and LM-head GEMMs on random operands,
   NumPy's BLAS against torch's, back to back; with the rest of the step equal to torch's, ours could be at most
   (torch's GEMMs + torch's rest) / (NumPy's GEMMs + torch's rest) of torch's speed.

`machine_lines()` names what decides the figures: the CPU, its widest SIMD NumPy dispatches to, the kernels
OpenBLAS picked (NumPy's BLAS) and the code path oneMKL took (torch's BLAS on x86: MKL runs its AVX-512 kernels
on Intel CPUs and a generic path on others, which is why the same two libraries rank differently on AMD and Intel).

torch.profiler attributes time to ATen operators, so a model built from generic operators (transformers' Llama
computes RMSNorm and RoPE with mul, pow, mean, rsqrt and cat) shows those under the small passes, not under norm
or RoPE: the side-by-side table says so when it happens.
"""

from __future__ import annotations

import ctypes
import functools
import glob
import os
import platform
import subprocess
import sys
import time
from collections import defaultdict
from typing import Any

import numpy as np

CATEGORIES = {"matmul": "matmul (linear layers, LM head)", "attention": "attention (qkᵀ, mask, softmax, pv)",
              "activation": "GELU / SwiGLU", "norm": "LayerNorm / RMSNorm", "rope": "RoPE",
              "cross_entropy": "cross-entropy (vocabulary softmax)", "elementwise": "bias, residual adds, copies",
              "embedding": "embedding", "optimizer": "optimizer (AdamW)", "zeroing": "zeroing gradients",
              "rest": "the rest (Python, autograd, views)"}
"""The rows of the side-by-side table, in order."""

OUR_CATEGORY = {"attention core (qkᵀ, softmax, pv)": "attention", "gelu": "activation", "swiglu": "activation",
                "layernorm": "norm", "rmsnorm": "norm", "rope": "rope", "lm head + cross-entropy": "cross_entropy",
                "embedding": "embedding", "adamw": "optimizer", "zero_grad": "zeroing"}
"""Our layer labels -> category; the linear layers' own passes (bias), residual adds and glue are `elementwise`."""

TORCH_CATEGORY = {
    "aten::mm": "matmul", "aten::addmm": "matmul",
    "aten::_scaled_dot_product_flash_attention_for_cpu": "attention",
    "aten::_scaled_dot_product_flash_attention_for_cpu_backward": "attention",
    "aten::bmm": "attention", "aten::baddbmm": "attention", "aten::_softmax": "attention",
    "aten::_softmax_backward_data": "attention", "aten::masked_fill": "attention", "aten::masked_fill_": "attention",
    "aten::triu": "attention",
    "aten::gelu": "activation", "aten::gelu_backward": "activation", "aten::silu": "activation",
    "aten::silu_backward": "activation",
    "aten::native_layer_norm": "norm", "aten::native_layer_norm_backward": "norm", "aten::_fused_rms_norm": "norm",
    "aten::_fused_rms_norm_backward": "norm",
    "aten::_log_softmax": "cross_entropy", "aten::_log_softmax_backward_data": "cross_entropy",
    "aten::nll_loss_forward": "cross_entropy", "aten::nll_loss_backward": "cross_entropy",
    "aten::embedding": "embedding", "aten::index_select": "embedding", "aten::embedding_dense_backward": "embedding",
    "aten::index_add_": "embedding",
    "aten::_fused_adamw_": "optimizer",
    "aten::zero_": "zeroing", "aten::fill_": "zeroing",
    "aten::add": "elementwise", "aten::add_": "elementwise", "aten::sum": "elementwise", "aten::copy_": "elementwise",
    "aten::clone": "elementwise", "aten::cat": "elementwise", "aten::mul": "elementwise", "aten::mul_": "elementwise",
    "aten::pow": "elementwise", "aten::mean": "elementwise", "aten::rsqrt": "elementwise", "aten::neg": "elementwise",
    "aten::div": "elementwise", "aten::sub": "elementwise", "aten::_to_copy": "elementwise",
}
"""torch.profiler operator names -> category (self CPU time); unnamed ones (autograd nodes, views, empty) fall into
the rest. `aten::_foreach_*` (a foreach AdamW) counts as the optimizer."""

TORCH_CALLS = {
    "aten::linear": "matmul", "aten::matmul": "matmul", "AddmmBackward0": "matmul", "MmBackward0": "matmul",
    "aten::scaled_dot_product_attention": "attention", "ScaledDotProductFlashAttentionForCpuBackward0": "attention",
    "GeluBackward0": "activation", "SiluBackward0": "activation",
    "aten::layer_norm": "norm", "NativeLayerNormBackward0": "norm", "aten::rms_norm": "norm",
    "FusedRmsNormBackward0": "norm",
    "aten::cross_entropy_loss": "cross_entropy", "aten::log_softmax": "cross_entropy",
    "aten::nll_loss": "cross_entropy", "aten::nll_loss_nd": "cross_entropy", "LogSoftmaxBackward0": "cross_entropy",
    "NllLossBackward0": "cross_entropy",
    "EmbeddingBackward0": "embedding", "AddBackward0": "elementwise", "MulBackward0": "elementwise",
    "Optimizer.step#AdamW.step": "optimizer", "Optimizer.zero_grad#AdamW.zero_grad": "zeroing",
}
"""The events around a category's operators that are torch's cost of calling them (self CPU time): an operator the
model calls that dispatches to the one doing the work (aten::layer_norm to aten::native_layer_norm), each autograd
node running a backward and the engine's `autograd::engine::evaluate_function: <node>` around it, the optimizer's
Python methods. Ours counts our Python around each layer's work in its category; this puts torch's counterpart
there too (the "+ calls" columns). Views' nodes and AccumulateGrad (per parameter, not per category) stay in the
rest."""
EVALUATE = "autograd::engine::evaluate_function: "

GENERIC_ELEMENTWISE = ("aten::pow", "aten::rsqrt", "aten::neg")
"""Operators that, when they show up, mean the reference builds norms or RoPE out of generic pieces (not cat:
SDPA's backward joins dq, dk, dv with it)."""


# ---------------------------------------------------------------------------------------------------------------
# The machine.
# ---------------------------------------------------------------------------------------------------------------


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


VECTOR_EXTENSIONS = ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "avx512_fp16", "amx_tile")
"""The x86 flags that decide the CPU comparison (issue 47: NumPy's OpenBLAS and torch's oneMKL rank differently on
an Intel Xeon with AVX-512 than on an AMD EPYC) — Linux's /proc/cpuinfo names."""


def cpu_extensions() -> str:
    """Which of VECTOR_EXTENSIONS this CPU has, as /proc/cpuinfo lists them ('unknown' where there is none)."""
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                key, _, value = line.partition(":")
                if key.strip() == "flags":
                    found = [flag for flag in VECTOR_EXTENSIONS if flag in set(value.split())]
                    return " ".join(found) or "none of " + ", ".join(VECTOR_EXTENSIONS)
    except OSError:
        pass
    return "unknown"


def numpy_simd() -> str:
    """The widest SIMD extension NumPy's dispatched loops use on this CPU (its dispatch targets that it found)."""
    from numpy._core._multiarray_umath import __cpu_dispatch__, __cpu_features__

    found = [feature for feature in __cpu_dispatch__ if __cpu_features__.get(feature)]
    return found[-1] if found else "baseline only"


def openblas_core() -> str:
    """OpenBLAS's own name for the kernels it chose at load time (DYNAMIC_ARCH builds pick by CPU), e.g.
    SkylakeX or Zen; 'unknown' where NumPy's BLAS is not a bundled OpenBLAS."""
    libraries = glob.glob(os.path.join(os.path.dirname(np.__file__), "..", "numpy.libs", "*openblas*"))
    for path in libraries:
        library = ctypes.CDLL(path)
        for symbol in ("scipy_openblas_get_corename64_", "scipy_openblas_get_corename", "openblas_get_corename64_",
                       "openblas_get_corename"):
            function = getattr(library, symbol, None)
            if function is not None:
                function.restype = ctypes.c_char_p
                return function().decode()
    return "unknown"


@functools.cache
def mkl_code_path() -> str:
    """The code path oneMKL reports for torch's GEMMs (MKL_VERBOSE's first line, in a child process: the variable is
    read when MKL loads), e.g. '... for Intel(R) 64 architecture Intel(R) AVX-512 ...'."""
    program = "import torch; a = torch.ones(8, 8); a @ a"
    try:
        result = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, timeout=120,
                                env={**os.environ, "MKL_VERBOSE": "1"})
    except (OSError, subprocess.TimeoutExpired) as failure:
        return f"unknown ({type(failure).__name__})"
    for line in result.stdout.splitlines():
        if line.startswith("MKL_VERBOSE") and " for " in line:
            return line.split(" for ", 1)[1].split(", Lnx")[0]
    return "not MKL (no MKL_VERBOSE line)"


def machine_lines(torch: Any | None) -> list[str]:
    """What the figures depend on: the CPU, NumPy's SIMD and BLAS kernels, torch's."""
    from models import host_kernels, host_memory

    lines = [f"CPU: {cpu_name()} ({os.cpu_count()} logical CPUs; {cpu_extensions()}); NumPy {np.__version__} SIMD "
             f"up to {numpy_simd()}, BLAS OpenBLAS kernels {openblas_core()}; CPU kernels: "
             f"{host_kernels.status(build=True)}",
             f"freed host memory: {host_memory.status()} — for the whole process, both steps alike"]
    if torch is not None:
        blas = "MKL" if torch.backends.mkl.is_available() else "its own"
        lines.append(f"torch {torch.__version__}: CPU capability {torch.backends.cpu.get_cpu_capability()}, BLAS "
                     f"{blas}" + (f" ({mkl_code_path()})" if blas == "MKL" else ""))
    return lines


# ---------------------------------------------------------------------------------------------------------------
# Our step, layer by layer.
# ---------------------------------------------------------------------------------------------------------------


class LayerProfile:
    """Exclusive wall time per (layer label, phase), by wrapping the forward/backward methods of every layer, and
    the time of the matrix products inside each (`gemm=True` wrappers: their time stays in the layer that called
    them and is also counted as its matmul part). `detach()` puts every wrapped method back."""

    PHASES = {"forward": "forward", "backward": "backward", "backward_input": "backward",
              "backward_weights": "backward"}

    def __init__(self) -> None:
        self.totals: dict[tuple[str, str], float] = defaultdict(float)
        self.matmul: dict[tuple[str, str], float] = defaultdict(float)
        self.stack: list[list[float]] = []  # per open call: [start, time in timed children, time in GEMMs]
        self.wrapped: list[tuple[Any, str, bool, Any]] = []

    def wrap(self, obj: Any, label: str, phases: dict[str, str] | None = None, gemm: bool = False) -> None:
        """Time `obj`'s methods (name -> the phase they count in; default: the layer protocol's) under `label`."""
        for name, phase in (phases or self.PHASES).items():
            method = getattr(obj, name, None)
            if method is not None:
                self.wrapped.append((obj, name, name in vars(obj), vars(obj).get(name)))
                setattr(obj, name, self._timed(method, label, phase, gemm))

    def detach(self) -> None:
        for obj, name, had_own, original in reversed(self.wrapped):
            if had_own:
                setattr(obj, name, original)
            else:
                delattr(obj, name)
        self.wrapped.clear()

    def _timed(self, method, label: str, phase: str, gemm: bool):
        def timed(*args, **kwargs):
            frame = [time.perf_counter(), 0.0, 0.0]
            self.stack.append(frame)
            try:
                return method(*args, **kwargs)
            finally:
                elapsed = time.perf_counter() - frame[0]
                self.stack.pop()
                parent = self.stack[-1] if self.stack else None
                if gemm and parent is not None:
                    parent[2] += elapsed  # a product inside a layer: the layer's own time, its matmul part
                elif gemm:
                    self.totals[label, phase] += elapsed
                    self.matmul[label, phase] += elapsed
                else:
                    self.totals[label, phase] += elapsed - frame[1]
                    self.matmul[label, phase] += frame[2]
                    if parent is not None:
                        parent[1] += elapsed
        return timed

    def attach(self, model: Any, optimizer: Any) -> None:
        """Wrap every layer of `model` (GPT-2's or llama's names), its rotary embedding, its matrix products, the
        optimizer step and zeroing the gradients."""
        from models.layers import PLAIN_GEMMS

        llama = model.config.is_llama
        norm = "rmsnorm" if llama else "layernorm"
        names = ({"qkv": "linear q|k|v", "projection": "linear o_proj", "expand": "linear gate|up",
                  "activation": "swiglu", "contract": "linear down"} if llama else
                 {"qkv": "linear qkv", "projection": "linear attn proj", "expand": "linear mlp fc",
                  "activation": "gelu", "contract": "linear mlp proj"})
        self.wrap(PLAIN_GEMMS, "matmul", {"forward": "forward", "input_gradient": "backward",
                                          "weight_gradient": "backward"}, gemm=True)
        self.wrap(model.embedding, "embedding")
        self.wrap(model.head.ln_f, norm)
        head = "lm head + cross-entropy"
        self.wrap(model.head.loss, head, {"forward": "forward"})
        self.wrap(model.head.loss, head, {"logits": "forward", "backward_input": "backward",
                                          "backward_weights": "backward"}, gemm=True)
        if model.rope is not None:  # one object serves every block: q and k turned in forward, d(q), d(k) back
            self.wrap(model.rope, "rope", {"rotate": "forward", "rotate_back": "backward"})
        for block in model.blocks:
            self.wrap(block, "residual adds")
            for ln in (block.ln_1, block.ln_2):
                self.wrap(ln, norm)
            self.wrap(block.attn, "attention core (qkᵀ, softmax, pv)")
            self.wrap(block.attn.qkv, names["qkv"])
            self.wrap(block.attn.projection, names["projection"])
            self.wrap(block.mlp, "mlp glue")
            self.wrap(block.mlp.expand, names["expand"])
            self.wrap(block.mlp.activation, names["activation"])
            self.wrap(block.mlp.contract, names["contract"])
        self.wrap(optimizer, "adamw", {"step": "update"})
        self.wrap(model, "zero_grad", {"zero_grad": "update"})

    def report(self, steps: int, step_seconds: float) -> None:
        phases = ("forward", "backward", "update")
        labels = sorted({label for label, _ in self.totals}, key=lambda k: -sum(self.totals[k, p] for p in phases))
        print(f"\nprofile of our step (exclusive ms per step, {steps} steps; step {step_seconds * 1e3:.1f} ms; "
              f"matmul: the layer's matrix products)")
        print(f"{'layer':38s} {'forward':>9s} {'backward':>9s} {'update':>9s} {'matmul':>9s} {'share':>7s}")
        for label in labels:
            times = [self.totals[label, p] / steps for p in phases]
            cells = " ".join(f"{t * 1e3:9.2f}" if t else f"{'':9s}" for t in times)
            products = sum(self.matmul[label, p] for p in phases) / steps
            matmul = f"{products * 1e3:9.2f}" if products else f"{'':9s}"
            print(f"{label:38s} {cells} {matmul} {sum(times) / step_seconds:7.1%}")
        covered = sum(self.totals.values()) / steps
        print(f"{'rest':38s} {'':9s} {'':9s} {'':9s} {'':9s} {1 - covered / step_seconds:7.1%}")

    def categories(self, steps: int, step_seconds: float) -> dict[str, float]:
        """Seconds per step in each of CATEGORIES: every layer's matrix products under matmul, the rest of the
        layer under its own category (linear layers, residual adds, glue: elementwise)."""
        seconds: dict[str, float] = defaultdict(float)
        for (label, phase), total in self.totals.items():
            products = self.matmul[label, phase]
            seconds["matmul"] += products / steps
            seconds[OUR_CATEGORY.get(label, "elementwise")] += (total - products) / steps
        seconds["rest"] = step_seconds - sum(seconds.values())
        return dict(seconds)


# ---------------------------------------------------------------------------------------------------------------
# PyTorch's step, operator by operator.
# ---------------------------------------------------------------------------------------------------------------


def torch_categories(torch: Any, run_step, steps: int, activations: tuple[int, int, int] | None = None
                     ) -> tuple[dict[str, float], dict[str, float], float, bool]:
    """Seconds per step in each category from torch.profiler's self CPU times over `steps` calls of `run_step()`:
    of the operators doing the work, and with the events that call them added (TORCH_CALLS); the profiled wall
    time per step, and whether generic operators (pow, rsqrt, neg) built norms or RoPE.

    `activations` (B, T, C), for a model with learned positions: the position rows' add (B, T, C) + (T, C) and
    their gradient's sum over the batch are counted as the embedding's, as ours counts them (`position_work`);
    torch.profiler then records shapes, which tells those two from the residual adds and the bias gradients."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], record_shapes=activations is not None) as profiler:
        start = time.perf_counter()
        for _ in range(steps):
            run_step()
        wall = (time.perf_counter() - start) / steps
    seconds: dict[str, float] = defaultdict(float)
    calls: dict[str, float] = defaultdict(float)
    generic = False
    for event in profiler.key_averages(group_by_input_shape=activations is not None):
        category = TORCH_CATEGORY.get(event.key)
        if category is None and event.key.startswith("aten::_foreach_"):
            category = "optimizer"
        if activations is not None and position_work(event.key, event.input_shapes, activations):
            category = "embedding"
        generic |= event.key in GENERIC_ELEMENTWISE
        if category is not None:
            seconds[category] += event.self_cpu_time_total / 1e6 / steps
        caller = TORCH_CALLS.get(event.key.removeprefix(EVALUATE))
        if caller is not None:
            calls[caller] += event.self_cpu_time_total / 1e6 / steps
    with_calls = {category: seconds.get(category, 0.0) + calls.get(category, 0.0) for category in CATEGORIES}
    seconds["rest"] = wall - sum(seconds.values())
    with_calls["rest"] = wall - sum(value for category, value in with_calls.items() if category != "rest")
    return dict(seconds), with_calls, wall, generic


def position_work(name: str, input_shapes: Any, activations: tuple[int, int, int]) -> bool:
    """Whether torch's operator `name` on `input_shapes` is the learned positions' share of the embedding: the add
    of the position rows to the token rows, (B, T, C) + (T, C), or the sum over the batch that is their gradient
    (aten::sum of a (B, T, C) array over a list of dimensions). Our embedding layer does both (models.layers.
    Embedding: one compiled gather-and-add, one scatter into both tables), so without this torch's embedding row
    would hold less of the work than ours; the residual adds are (B, T, C) + (B, T, C), the bias gradients sum
    (B·T, C) arrays."""
    batch, length, channels = activations
    rows, positions = [batch, length, channels], [length, channels]
    shapes = [list(shape) for shape in input_shapes or []]
    if name == "aten::add":
        return shapes[:2] == [rows, positions]
    return name == "aten::sum" and len(shapes) == 4 and shapes[0] == rows


# ---------------------------------------------------------------------------------------------------------------
# The least bytes each category moves.
# ---------------------------------------------------------------------------------------------------------------


def least_bytes(config: Any, batch: int, length: int, itemsize: int,
                linears: list[tuple[int, int]]) -> dict[str, float]:
    """Bytes per step that each category's work must move at least: each operand read once, each result written
    once. Activations: N = B·T tokens of C channels (K: the key/value width, F: the MLP width, V: the vocabulary).

        matmul      Σ over the linear and LM-head GEMMs of (A + B + C)
        attention   per layer forward q, k, v, out; backward q, k, v, out, d(out), dq, dk, dv: 6NC + 6NK
        activation  GELU per layer 5NF (forward h -> a, backward h, da -> dh); SwiGLU 8NF (two inputs)
        norm        5NC per norm (forward x -> y, backward x, dy -> dx), 2L + 1 norms
        rope        4(NC + NK) per layer (q and k turned forward and back)
        cross-ent.  2NV (read the logits, write their gradient)
        elementwise 12NC per layer: two residual adds forward, two gradient sums backward, 3NC each
        embedding   5NC (+ 2NC with learned positions): gather rows, scatter their gradient
        optimizer   7P (read p, g, m, v; write p, m, v), P parameters
        zeroing     P

    `linears`: (in, out) of each weight matrix of a block (`bench_train.block_linears`).
    """
    n, c, layers = batch * length, config.n_embd, config.n_layer
    k = config.kv_heads * config.head_dim
    f, v = config.ffn_width, config.vocab_size
    parameters = config.parameter_count()
    gemm_elements = sum(n * i + i * o + n * o for i, o in linears) * 3 * layers
    gemm_elements += 3 * (n * c + v * c + n * v)
    elements = {"matmul": gemm_elements,
                "attention": (6 * n * c + 6 * n * k) * layers,
                "activation": (8 if config.is_llama else 5) * n * f * layers,
                "norm": 5 * n * c * (2 * layers + 1),
                "rope": 4 * (n * c + n * k) * layers if config.is_llama else 0,
                "cross_entropy": 2 * n * v,
                "elementwise": 12 * n * c * layers,
                "embedding": 5 * n * c + (0 if config.is_llama else 2 * n * c),
                "optimizer": 7 * parameters,
                "zeroing": parameters}
    return {category: count * itemsize for category, count in elements.items()}


# ---------------------------------------------------------------------------------------------------------------
# The GEMMs alone.
# ---------------------------------------------------------------------------------------------------------------


def blas_seconds(torch: Any, gemms: list[tuple[tuple[int, ...], tuple[int, ...], bool, bool]], dtype: Any,
                 repeats: int = 3) -> tuple[float, float, float]:
    """(NumPy seconds, torch seconds, FLOPs) for the step's linear and LM-head GEMMs — `gemms` as
    `bench_train.step_gemms` lists them; attention's batched products are left out (SDPA does not expose them) —
    same operands, alternated; the fastest of `repeats` rounds each."""
    rng = np.random.default_rng(0)
    products, flops = [], 0.0
    for a_shape, b_shape, transpose_a, transpose_b in gemms:
        if len(a_shape) != 2:
            continue
        a = rng.standard_normal(a_shape, dtype=np.float32).astype(dtype)
        b = rng.standard_normal(b_shape, dtype=np.float32).astype(dtype)
        a, b = (a.T if transpose_a else a), (b.T if transpose_b else b)
        out = np.empty((a.shape[0], b.shape[1]), dtype)
        torch_operands = [torch.from_numpy(x.T).T if x.flags.f_contiguous and not x.flags.c_contiguous
                          else torch.from_numpy(x) for x in (a, b, out)]
        products.append(((a, b, out), torch_operands))
        flops += 2.0 * a.shape[0] * a.shape[1] * b.shape[1]
    best_numpy = best_torch = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for (a, b, out), _ in products:
            np.matmul(a, b, out=out)
        best_numpy = min(best_numpy, time.perf_counter() - start)
        start = time.perf_counter()
        for _, (a, b, out) in products:
            torch.mm(a, b, out=out)
        best_torch = min(best_torch, time.perf_counter() - start)
    return best_numpy, best_torch, flops


# ---------------------------------------------------------------------------------------------------------------
# The report.
# ---------------------------------------------------------------------------------------------------------------


def side_by_side(ours: dict[str, float], ours_step: float, theirs: dict[str, float] | None, theirs_step: float | None,
                 bytes_moved: dict[str, float], reference: str, generic: bool,
                 theirs_with_calls: dict[str, float] | None = None) -> None:
    """The side-by-side table: ms per step, theirs/ours (above 1: ours faster) — of torch's operators alone, then
    with torch's calls of them (`theirs_with_calls`, torch_categories) — least MB, GB/s each."""
    print(f"\none step by category, ours beside {reference} (torch.profiler self CPU times: of the operators "
          "doing the work, then + calls: with the operators, autograd nodes and Python methods that call them), ms "
          "per step; ahead = theirs / ours; least MB: what the work must move; GB/s: least MB over each side's "
          "time")
    print(f"{'category':38s} {'ours':>8s} {reference:>12s} {'ahead':>7s} {'+ calls':>9s} {'ahead':>7s} "
          f"{'least MB':>9s} {'ours GB/s':>10s} {'theirs GB/s':>11s}")
    for category, label in CATEGORIES.items():
        mine = ours.get(category, 0.0)
        cells = [f"{mine * 1e3:8.2f}"]
        for table, width in ((theirs, 12), (theirs_with_calls, 9)):
            other = table.get(category, 0.0) if table is not None else None
            cells += [f"{other * 1e3:{width}.2f}" if other is not None else f"{'':{width}s}",
                      f"{other / mine:7.2f}" if other is not None and mine > 0 and other > 0 else f"{'':7s}"]
        other = theirs.get(category, 0.0) if theirs is not None else None
        moved = bytes_moved.get(category)
        cells += [f"{moved / 1e6:9.1f}" if moved else f"{'':9s}",
                  f"{moved / mine / 1e9:10.1f}" if moved and mine > 0 else f"{'':10s}",
                  f"{moved / other / 1e9:11.1f}" if moved and other else f"{'':11s}"]
        print(f"{label:38s} " + " ".join(cells))
    line = f"{'step':38s} {ours_step * 1e3:8.2f}"
    if theirs_step is not None:
        line += f" {theirs_step * 1e3:12.2f} {theirs_step / ours_step:7.2f}"
    print(line)
    share = f"matmul share of the step: ours {ours.get('matmul', 0.0) / ours_step:.0%}"
    if theirs is not None and theirs_step:
        share += f", {reference} {theirs.get('matmul', 0.0) / theirs_step:.0%}"
    print(share)
    if generic:
        print(f"({reference} builds RMSNorm and RoPE from generic operators — mul, pow, mean, rsqrt, neg, cat — which "
              "torch.profiler cannot tell apart: they are counted under bias, residual adds, copies, and so is "
              "SwiGLU's product silu(gate)·up, whose row holds only silu)")


def blas_bound(numpy_seconds: float, torch_seconds: float, flops: float, theirs: dict[str, float] | None,
               theirs_step: float | None) -> None:
    print(f"\nthe step's linear and LM-head GEMMs alone ({flops / 1e9:.2f} GFLOP): NumPy {numpy_seconds * 1e3:.1f} ms "
          f"({flops / numpy_seconds / 1e9:.1f} GFLOP/s), torch {torch_seconds * 1e3:.1f} ms "
          f"({flops / torch_seconds / 1e9:.1f} GFLOP/s): NumPy's BLAS at {torch_seconds / numpy_seconds:.2f}× torch's")
    if theirs is not None and theirs_step is not None:
        rest = theirs_step - theirs.get("matmul", 0.0)
        ceiling = (torch_seconds + rest) / (numpy_seconds + rest)
        print(f"with everything but these GEMMs as fast as torch's ({rest * 1e3:.1f} ms), ours would run at "
              f"{ceiling:.2f}× torch's step")
