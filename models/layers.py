"""Transformer layers with hand-written forward and backward passes, and no hidden state: GPT-2's (LayerNorm,
GELU MLP, learned positions, tied head) and the Llama family's (RMSNorm, SwiGLU, grouped-query attention with
RoPE, untied head), one block built from either set (`Block`).

Every layer follows one protocol (llm.c's, with the saved activations handed back to the caller):

    out, saved = layer.forward(x)            # `saved`: what backward will need, held by the caller
    dx = layer.backward_input(saved, dout)   # d(input); on the critical path (the previous layer waits for it)
    layer.backward_weights(saved)            # adds d(weights) into param.grad; may run later; frees `saved`
    dx = layer.backward(saved, dout)         # both, in that order

A layer object holds only its parameters and settings, so any number of microbatches may be in flight through
it, each with its own `saved`, and a microbatch's weight pass may run after later microbatches' input passes
(zero-bubble pipeline schedules). `backward_input` records in `saved` the output gradients the weight pass needs
and drops what only it needed; `backward_weights` empties `saved`. Layers never modify `dout` in place.

Activations are (B, T, C) arrays: batch, sequence, channels. Linear weights use the [in, out] layout (GPT-2's
Conv1D; llama checkpoints' [out, in] are transposed on load), so y = x @ W + b. The same code runs on NumPy
and CuPy arrays (the device branches call fused kernels).

Saved activations, per transformer block and microbatch (elements; b·s tokens, h channels, a heads, NumPy path;
`block_activation_elements` is the formula, and the tests measure it):

    LayerNorm ×2             normalized input h, 1/std 1 per token                  2·(bsh + bs)
    LayerNorm outputs ×2     the inputs of c_attn and c_fc                         2·bsh
    c_attn output            q (scaled in place), k, v                             3·bsh
    attention output         the input of c_proj                                   bsh
    softmax probabilities    per query block of q rows, over its ≤ stop keys       a·b·Σ_blocks q·stop ≈ a·b·s²/2
    GELU                     input, a, gate, output (the input of c_proj)           16·bsh

and a llama block (F SwiGLU units, n_kv KV heads of d channels): the same norms (RMSNorm: normalized input,
1/rms), q, k, v of bs·(h + 2·n_kv·d), the attention output bsh, the probabilities, and SwiGLU's [gate | up]
input, σ(gate), silu(gate) and output, 5·bs·F.

`--recompute selective` keeps no probabilities and recomputes them per query block in backward; `--recompute
full` keeps only the block's input (bsh) and reruns the block's forward at the start of its backward.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import numpy as np

from collectives import all_reduce
from collectives.backend import Array, get_array_module, is_device_array, scatter_add

from . import host_kernels, kernels
from .documents import ONE_DOCUMENT, add_mask
from .kernels import GELU_CUBIC, GELU_SCALE
from .parameter import Parameter
from .precision import narrow, narrow_saved, widen, widen_saved

RECOMPUTE_MODES = ("none", "selective", "full")
QUERY_BLOCK = 64
"""Attention's default query block: rows of q per causal block (larger: fewer, bigger matrix products)."""
GPU_QUERY_BLOCK = 1024
"""The default on a GPU, where every block is several kernel launches forward and backward and the host, not the
GPU, sets the pace: at T 1024 on an H200, one block instead of 16 took SmolLM-135M's TF32 step from 956 to 247 ms
and GPT-2 124M's from 245 to 138 ms (docs/gpus.md), for twice the probabilities kept for backward."""
IGNORED = -1
"""A target that predicts nothing (multi-token prediction's positions whose token lies past the sequence's end):
the cross-entropies add no loss and no gradient for it."""


class Saved(SimpleNamespace):
    """What one forward call of a layer keeps for its backward: arrays, and the `Saved` of its sublayers."""

    def clear(self) -> None:
        """Drop everything (the last backward pass has run)."""
        vars(self).clear()

    def nbytes(self) -> int:
        """Bytes of the distinct arrays held (views of one buffer count once)."""
        return distinct_bytes(self)


def distinct_bytes(*states: Any) -> int:
    """Bytes of the distinct array buffers reachable from `states` (Saved objects, lists, tuples, dicts)."""
    seen: set[int] = set()
    total = 0
    pending = list(states)
    while pending:
        value = pending.pop()
        if isinstance(value, Saved):
            pending.extend(vars(value).values())
        elif isinstance(value, (list, tuple)):
            pending.extend(value)
        elif isinstance(value, dict):
            pending.extend(value.values())
        elif hasattr(value, "nbytes") and getattr(value, "ndim", 0) > 0:
            base = value.base if value.base is not None else value
            if id(base) not in seen:
                seen.add(id(base))
                total += base.nbytes
    return total


def block_activation_elements(batch: int, seq: int, hidden: int, heads: int, tp: int = 1,
                              sequence_parallel: bool = False, recompute: str = "none",
                              query_block: int = QUERY_BLOCK, kv_heads: int | None = None,
                              ffn_hidden: int | None = None, documents: Any = ONE_DOCUMENT) -> int:
    """Elements one transformer block saves per microbatch after its forward (NumPy path), on one rank.

    GPT-2 (`ffn_hidden` None). With tensor parallelism over n = tp ranks, the column-parallel layers see the
    whole input: without SP that is the LayerNorm outputs themselves (b·s·h, replicated); with SP each rank keeps
    its sequence slice of the LayerNorms (÷ n) plus the all-gathered inputs of c_attn and c_fc (b·s·h each). The
    heads and the MLP's 4h hidden units are split (÷ n). So, with S = b·s·h, t = b·s:

        none, tp only:   4S + 2t + 20S/n + probabilities/n
        none, tp + sp:   2S + (22S + 2t)/n + probabilities/n
        selective:       the same without the probabilities
        full:            the block's input: S (tp only) or S/n (sp)

    and probabilities = b·a·Σ over query blocks [start, stop) of (stop − start)·stop (≈ b·a·s²/2); with packed
    `documents`, a·Σ over rows and blocks of (stop − start)·(stop − the block's first key) (`attention_blocks`).

    Llama (`ffn_hidden` F given, `kv_heads` n_kv): the RMSNorms keep the same as LayerNorms (normalized input
    and 1/rms), the q, k, v output is t·(h/n + 2·h_kv) with h_kv = max(n_kv/n, 1)·d this rank's KV channels, and
    SwiGLU keeps its [gate | up] input, σ(gate), silu(gate) and its output: 5·t·F/n. So

        none, tp only:   4S + 2t + t·(h/n + 2·h_kv) + S/n + 5tF/n + probabilities/n
        none, tp + sp:   2S + 2(S + t)/n + t·(h/n + 2·h_kv) + S/n + 5tF/n + probabilities/n
    """
    if recompute not in RECOMPUTE_MODES:
        raise ValueError(f"recompute must be one of {RECOMPUTE_MODES}, got {recompute!r}")
    activation, tokens, n = batch * seq * hidden, batch * seq, tp
    if recompute == "full":
        return activation // n if sequence_parallel else activation
    probabilities = 0
    if recompute == "none":
        kept = sum(len(range(batch)[rows]) * (block.stop - block.start) * (keys.stop - keys.start)
                   for rows, block, keys, _ in attention_blocks(documents, batch, seq, query_block))
        probabilities = (heads // n) * kept
    norms = 2 * (activation + tokens) // n if sequence_parallel else 2 * (activation + tokens)
    if ffn_hidden is not None:
        kv_channels = max((kv_heads or heads) // n, 1) * (hidden // heads)
        attention = tokens * (hidden // n + 2 * kv_channels) + activation // n
        return norms + 2 * activation + attention + 5 * tokens * ffn_hidden // n + probabilities
    if sequence_parallel:
        return 2 * activation + (22 * activation + 2 * tokens) // n + probabilities
    return 4 * activation + 2 * tokens + 20 * activation // n + probabilities


def row_sums(a: Array) -> Array:
    """Σ over the last axis, keepdims. Computed as a matrix-vector product with ones: for the short rows here
    (channels, keys) BLAS is 3-4× faster than NumPy's sum(axis=-1)."""
    xp = get_array_module(a)
    sums = a.reshape(-1, a.shape[-1]) @ xp.ones(a.shape[-1], dtype=a.dtype)
    return sums.reshape(*a.shape[:-1], 1)


def row_dots(a: Array, b: Array) -> Array:
    """Σ a·b over the last axis, keepdims. On the CPU one compiled loop per row (kernels.ROW_DOTS) where
    models.host_kernels can build it; else `row_sums(a * b)`, which writes a·b and reads it back."""
    if not is_device_array(a):
        result = host_kernels.run(kernels.ROW_DOTS, a=a, b=b)
        if result is not None:
            return result["dot"]
    return row_sums(a * b)


def column_sums(a: Array) -> Array:
    """Σ over every axis but the last (bias and LayerNorm gradients), as a vector-matrix product with ones: as
    for row_sums, BLAS beats NumPy's sum(axis=0)."""
    xp = get_array_module(a)
    rows = a.reshape(-1, a.shape[-1])
    return xp.ones(rows.shape[0], dtype=a.dtype) @ rows


class Layer:
    """The protocol's joint backward: the input pass, then the weight pass."""

    def backward(self, saved: Saved, dout: Array | None) -> Array | None:
        dx = self.backward_input(saved, dout)
        self.backward_weights(saved)
        return dx

    def backward_input(self, saved: Saved, dout: Array | None) -> Array | None:
        raise NotImplementedError

    def backward_weights(self, saved: Saved) -> None:
        raise NotImplementedError


class Gemms:
    """The three matrix products of a linear layer y = x·W on 2-D operands, at the operands' own dtype: forward
    x·W, the input gradient dy·Wᵀ, the weight gradient xᵀ·dy. The linear layers (`Linear`, `ConcatenatedLinear`,
    `mpiparallel.axes.tensor_parallel.RowParallelLinear`) call them and nothing else, so
    `models.fp8.BlockwiseFp8Gemms`, their E4M3 twin, turns every linear inside the blocks to FP8 on every parallel
    axis at once."""

    name = "none"

    def forward(self, x2d: Array, weight: Array) -> Array:
        return x2d @ weight

    def input_gradient(self, dout2d: Array, weight: Array) -> Array:
        return dout2d @ weight.T

    def weight_gradient(self, x2d: Array, dout2d: Array) -> Array:
        return x2d.T @ dout2d


PLAIN_GEMMS = Gemms()


class Linear(Layer):
    """y = x @ weight + bias over the last axis (weight [in, out], Conv1D layout; bias None: none, as in Llama);
    its matrix products are `gemms`' (default: plain; FP8 with `models.fp8.BlockwiseFp8Gemms`)."""

    def __init__(self, weight: Parameter, bias: Parameter | None = None, gemms: Gemms = PLAIN_GEMMS) -> None:
        self.weight, self.bias, self.gemms = weight, bias, gemms

    def forward(self, x: Array) -> tuple[Array, Saved]:
        out = self.gemms.forward(x.reshape(-1, x.shape[-1]), self.weight.data)
        if self.bias is not None:
            out += self.bias.data
        return out.reshape(*x.shape[:-1], out.shape[-1]), Saved(x=x)

    def backward_input(self, saved: Saved, dout: Array) -> Array:
        saved.dout = dout
        dx = self.gemms.input_gradient(dout.reshape(-1, dout.shape[-1]), self.weight.data)
        return dx.reshape(*dout.shape[:-1], dx.shape[-1])

    def backward_weights(self, saved: Saved) -> None:
        x, dout = saved.x, saved.dout.reshape(-1, saved.dout.shape[-1])
        self.weight.grad += self.gemms.weight_gradient(x.reshape(-1, x.shape[-1]), dout)
        if self.bias is not None:
            self.bias.grad += column_sums(dout)
        saved.clear()


class ConcatenatedLinear(Layer):
    """[x @ W_1 | x @ W_2 | …]: several bias-free projections of one input, their outputs side by side in one
    (…, Σ out_i) array — Llama's q, k and v (and SwiGLU's gate and up) as if they were GPT-2's one fused c_attn.

    The separate weights are what Hugging Face stores and what tensor parallelism cuts head by head; the one
    output is what attention reads. `gradient_groups[i]`, when given, is a communicator whose ranks hold
    copies of W_i that saw different inputs (grouped-query KV heads replicated over tensor-parallel ranks): the
    weight pass sums W_i's gradient over it (an all-reduce of in·out_i elements)."""

    def __init__(self, weights: list[Parameter], gradient_groups: list[Any] | None = None,
                 gemms: Gemms = PLAIN_GEMMS) -> None:
        self.weights, self.gemms = list(weights), gemms
        self.gradient_groups = list(gradient_groups or [None] * len(self.weights))
        ends = [0]
        for weight in self.weights:
            ends.append(ends[-1] + weight.data.shape[1])
        self.columns = [slice(a, b) for a, b in zip(ends[:-1], ends[1:], strict=True)]

    def forward(self, x: Array) -> tuple[Array, Saved]:
        xp = get_array_module(x)
        x2d = x.reshape(-1, x.shape[-1])
        out = xp.empty((len(x2d), self.columns[-1].stop), dtype=x.dtype)
        for weight, columns in zip(self.weights, self.columns, strict=True):
            out[:, columns] = self.gemms.forward(x2d, weight.data)
        return out.reshape(*x.shape[:-1], out.shape[-1]), Saved(x=x)

    def backward_input(self, saved: Saved, dout: Array) -> Array:
        saved.dout = dout.reshape(-1, dout.shape[-1])
        dx = self.gemms.input_gradient(saved.dout[:, self.columns[0]], self.weights[0].data)
        for weight, columns in zip(self.weights[1:], self.columns[1:], strict=True):
            dx += self.gemms.input_gradient(saved.dout[:, columns], weight.data)
        return dx.reshape(*dout.shape[:-1], dx.shape[-1])

    def backward_weights(self, saved: Saved) -> None:
        x2d = saved.x.reshape(-1, saved.x.shape[-1])
        for weight, columns, group in zip(self.weights, self.columns, self.gradient_groups, strict=True):
            grad = self.gemms.weight_gradient(x2d, saved.dout[:, columns])
            weight.grad += grad if group is None else all_reduce(grad, group)
        saved.clear()


def at_dtype_of(x: Array, parameter: Parameter) -> Array:
    """The parameter's working copy at the dtype of the activations `x`: in a mixed-precision run a norm computes
    in float32 (`precision.Narrowed`) while its weight's working copy is bfloat16 or float16. NumPy promotes the
    mix by itself; a fused GPU kernel takes one dtype for all its `T` arguments, and CuPy refuses the mix. Exact:
    every narrow value is a float32 value."""
    return parameter.data.astype(x.dtype, copy=False)


class _Norm(Layer):
    """What LayerNorm and RMSNorm share: the input pass runs on the device's fused kernels, on the CPU as one
    compiled loop per row where models.host_kernels can build it, else as NumPy passes (the same math, its sums in
    another order). Each computes its weights' gradients there too (`saved.dweight`, LayerNorm's `saved.dbias`:
    vectors, summed while the rows are at hand) for the weight pass to add, and drops the normalized input — so
    between the two passes a norm holds two vectors, not the output gradient and dy·n."""

    kept_wide = ("rstd", "dweight", "dbias")
    """What a narrow compute dtype must not round (precision.Narrowed's `statistics`): 1/std, and the weights'
    gradients between the passes — sums over every row, which bfloat16 would round once per rank, so a data-parallel
    run's partial sums would round apart from a serial run's whole sum (2⁻⁸, where the summation order alone differs
    by 1e-7)."""

    def backward_input(self, saved: Saved, dout: Array) -> Array:
        if is_device_array(dout):
            dx = self._backward_input_device(saved, dout)
        else:
            dx = self._backward_input_compiled(saved, dout)
            if dx is None:
                dx = self._backward_input_numpy(saved, dout)
        del saved.normalized
        return dx

    def _backward_input_device(self, saved: Saved, dout: Array) -> Array:
        raise NotImplementedError

    def _backward_input_compiled(self, saved: Saved, dout: Array) -> Array | None:
        raise NotImplementedError

    def _backward_input_numpy(self, saved: Saved, dout: Array) -> Array:
        raise NotImplementedError


class LayerNorm(_Norm):
    """y = (x − mean) / sqrt(var + eps) · weight + bias over the last axis (eps 1e-5, biased variance).

    Backward, with n the normalized input and dn = dy·weight: dx = rstd·(dn − mean(dn) − n·mean(dn·n)),
    d(weight) = Σ dy·n, d(bias) = Σ dy. On the CPU each pass is one compiled loop per row (kernels.LAYER_NORM_ROWS_*:
    the row's statistics, then its elementwise work, while the row is in cache) where models.host_kernels can
    build it, else NumPy passes with row and column sums as GEMVs with ones (`row_sums`); on a GPU, CuPy
    reductions and fused kernels.
    """

    eps = 1e-5

    def __init__(self, weight: Parameter, bias: Parameter) -> None:
        self.weight, self.bias = weight, bias

    def forward(self, x: Array) -> tuple[Array, Saved]:
        if is_device_array(x):
            return self._forward_device(x)
        return self._forward_compiled(x) or self._forward_numpy(x)

    def _rstd(self, variance: Array) -> Array:
        variance += self.eps
        return 1.0 / get_array_module(variance).sqrt(variance, out=variance)

    def _forward_numpy(self, x: Array) -> tuple[Array, Saved]:
        normalized = x - row_sums(x) / x.shape[-1]
        rstd = self._rstd(row_sums(normalized * normalized) / x.shape[-1])
        normalized *= rstd
        out = normalized * self.weight.data
        out += self.bias.data
        return out, Saved(normalized=normalized, rstd=rstd)

    def _forward_compiled(self, x: Array) -> tuple[Array, Saved] | None:
        """Mean, variance, normalize and affine in one compiled pass over each row (None: not compiled here)."""
        result = host_kernels.run(kernels.LAYER_NORM_ROWS_FORWARD, x=x, weight=self.weight.data,
                                  bias=self.bias.data, eps=self.eps)
        if result is None:
            return None
        return result["out"], Saved(normalized=result["normalized"], rstd=result["rstd"])

    def _forward_device(self, x: Array) -> tuple[Array, Saved]:
        """Mean and variance as CuPy reductions, then normalize and affine in one fused pass."""
        xp = get_array_module(x)
        mean = x.mean(axis=-1, keepdims=True)
        rstd = 1.0 / xp.sqrt(x.var(axis=-1, keepdims=True) + self.eps)
        result = kernels.LAYER_NORM_FORWARD(x=x, mean=mean, rstd=rstd, weight=at_dtype_of(x, self.weight),
                                            bias=at_dtype_of(x, self.bias))
        return result["out"], Saved(normalized=result["normalized"], rstd=rstd)

    def _backward_input_numpy(self, saved: Saved, dout: Array) -> Array:
        channels = dout.shape[-1]
        dnorm = dout * self.weight.data
        work = dnorm * saved.normalized
        mean_dnorm_norm = row_sums(work) / channels
        dx = dnorm
        dx -= row_sums(dnorm) / channels
        xp = get_array_module(dout)
        dx -= xp.multiply(saved.normalized, mean_dnorm_norm, out=work)
        dx *= saved.rstd
        saved.dweight = column_sums(xp.multiply(dout, saved.normalized, out=work))  # work is free again
        saved.dbias = column_sums(dout)
        return dx

    def _backward_input_compiled(self, saved: Saved, dout: Array) -> Array | None:
        """The row means of dn and dn·n, then dx, then the weight and bias gradients, in one compiled pass."""
        result = host_kernels.run(kernels.LAYER_NORM_ROWS_BACKWARD, dout=dout, weight=self.weight.data,
                                  normalized=saved.normalized, rstd=saved.rstd)
        if result is None:
            return None
        saved.dweight, saved.dbias = result["dweight"], result["dbias"]
        return result["dx"]

    def _backward_input_device(self, saved: Saved, dout: Array) -> Array:
        """The two row means as GEMVs with the weight (Σ dout·w, Σ dout·normalized·w), then dx in one fused pass."""
        channels = dout.shape[-1]
        row_shape = (*dout.shape[:-1], 1)
        weight = at_dtype_of(dout, self.weight)
        dout_norm = dout * saved.normalized
        saved.dweight, saved.dbias = column_sums(dout_norm), column_sums(dout)
        mean_dnorm = (dout.reshape(-1, channels) @ weight).reshape(row_shape) / channels
        mean_dnorm_norm = (dout_norm.reshape(-1, channels) @ weight).reshape(row_shape) / channels
        return kernels.LAYER_NORM_BACKWARD(dout=dout, weight=weight, normalized=saved.normalized, rstd=saved.rstd,
                                           mean_dnorm=mean_dnorm, mean_dnorm_norm=mean_dnorm_norm)["dx"]

    def backward_weights(self, saved: Saved) -> None:
        self.weight.grad += saved.dweight
        self.bias.grad += saved.dbias
        saved.clear()


class RMSNorm(_Norm):
    """y = x · rsqrt(mean(x²) + eps) · weight over the last axis (Llama's norm: no mean subtracted, no bias).

    The statistics are computed in the activations' dtype, float32 or float64 (never narrower). Backward, with
    n = x·rstd the normalized input and dn = dy·weight: dx = rstd · (dn − n · mean(dn · n)), d(weight) = Σ dy·n.
    Run as LayerNorm's: one compiled loop per row on the CPU where it can be built, else NumPy passes; on a GPU,
    GEMVs and fused kernels.
    """

    def __init__(self, weight: Parameter, eps: float = 1e-6) -> None:
        self.weight, self.eps = weight, eps

    def forward(self, x: Array) -> tuple[Array, Saved]:
        if not is_device_array(x):  # the statistics, scale and weight in one compiled pass over each row
            result = host_kernels.run(kernels.RMS_NORM_ROWS_FORWARD, x=x, weight=self.weight.data, eps=self.eps)
            if result is not None:
                return result["out"], Saved(normalized=result["normalized"], rstd=result["rstd"])
        xp = get_array_module(x)
        mean_square = row_sums(x * x) / x.shape[-1]
        mean_square += self.eps
        rstd = 1.0 / xp.sqrt(mean_square, out=mean_square)
        if is_device_array(x):  # scale and weight in one fused pass
            result = kernels.RMS_NORM_FORWARD(x=x, rstd=rstd, weight=at_dtype_of(x, self.weight))
            return result["out"], Saved(normalized=result["normalized"], rstd=rstd)
        normalized = x * rstd
        return normalized * self.weight.data, Saved(normalized=normalized, rstd=rstd)

    def _backward_input_numpy(self, saved: Saved, dout: Array) -> Array:
        dnorm = dout * self.weight.data
        mean_dnorm_norm = row_sums(dnorm * saved.normalized) / dout.shape[-1]
        dnorm -= saved.normalized * mean_dnorm_norm
        dnorm *= saved.rstd
        saved.dweight = column_sums(dout * saved.normalized)
        return dnorm

    def _backward_input_compiled(self, saved: Saved, dout: Array) -> Array | None:
        """The row mean of dn·n, then dx, then the weight gradient, in one compiled pass over each row."""
        result = host_kernels.run(kernels.RMS_NORM_ROWS_BACKWARD, dout=dout, weight=self.weight.data,
                                  normalized=saved.normalized, rstd=saved.rstd)
        if result is None:
            return None
        saved.dweight = result["dweight"]
        return result["dx"]

    def _backward_input_device(self, saved: Saved, dout: Array) -> Array:
        """mean(dn · n) as a GEMV with the weight (Σ dout·n·w), then dx in one fused pass."""
        channels = dout.shape[-1]
        weight = at_dtype_of(dout, self.weight)
        dout_norm = dout * saved.normalized
        saved.dweight = column_sums(dout_norm)
        mean_dnorm_norm = (dout_norm.reshape(-1, channels) @ weight).reshape(*dout.shape[:-1], 1) / channels
        return kernels.RMS_NORM_BACKWARD(dout=dout, weight=weight, normalized=saved.normalized,
                                         rstd=saved.rstd, mean_dnorm_norm=mean_dnorm_norm)["dx"]

    def backward_weights(self, saved: Saved) -> None:
        self.weight.grad += saved.dweight
        saved.clear()


class GELU(Layer):
    """GELU, tanh approximation: 0.5·x·(1 + tanh(√(2/π)·(x + 0.044715·x³))).

    Written as x·h with the gate h = (1 + tanh u)/2 and u = x·a, a = √(2/π)·(1 + 0.044715·x²). Forward keeps
    a, h and the output, so the derivative h + 2·x·h·(1 − h)·du/dx = h + (x − out)·h·(6a − 4√(2/π)) costs
    seven elementwise passes in backward instead of re-deriving tanh terms from x (each pass over the 4C-wide
    hidden activations costs as much as a small GEMM). No weights: the input pass frees what it kept.
    """

    def forward(self, x: Array) -> tuple[Array, Saved]:
        if is_device_array(x):  # one fused pass; backward recomputes the gate from x, so a and h are not kept
            out = kernels.GELU_FORWARD(x=x)["out"]
            return out, Saved(x=x, out=out)
        kept = host_kernels.run(kernels.GELU_FORWARD_KEEPING, x=x)  # the passes below in one, where compiled
        if kept is not None:
            return kept["out"], Saved(x=x, a=kept["a"], gate=kept["gate"], out=kept["out"])
        xp = get_array_module(x)
        a = x * x
        a *= GELU_SCALE * GELU_CUBIC
        a += GELU_SCALE
        gate = a * x
        xp.tanh(gate, out=gate)
        gate *= 0.5
        gate += 0.5
        out = x * gate
        return out, Saved(x=x, a=a, gate=gate, out=out)

    def backward_input(self, saved: Saved, dout: Array) -> Array:
        if is_device_array(dout):
            dx = kernels.GELU_BACKWARD(x=saved.x, dout=dout)["dx"]
            saved.clear()
            return dx
        compiled = host_kernels.run(kernels.GELU_BACKWARD_FROM_GATE, x=saved.x, a=saved.a, gate=saved.gate,
                                    out=saved.out, dout=dout)
        if compiled is not None:
            saved.clear()
            return compiled["dx"]
        # du/dx = √(2/π)·(1 + 3·0.044715·x²) = 3a − 2√(2/π), and 2·x·(1 − h) = 2·(x − out)
        slope = saved.a * 6.0
        slope -= 4.0 * GELU_SCALE
        slope *= saved.gate
        slope *= get_array_module(dout).subtract(saved.x, saved.out)
        slope += saved.gate
        slope *= dout
        saved.clear()
        return slope

    def backward_weights(self, saved: Saved) -> None:
        saved.clear()


class SwiGLU(Layer):
    """Llama's gated activation of the [gate | up] halves of its input: silu(gate) · up, silu(g) = g·σ(g).

    The input is the (…, 2F) output of the concatenated gate and up projections (F of each, side by side — under
    tensor parallelism each rank's F/n of each), the output (…, F). Backward, with s = σ(gate):
    d(up) = dy · gate · s and d(gate) = dy · up · s · (1 + gate · (1 − s)). No weights."""

    def forward(self, x: Array) -> tuple[Array, Saved]:
        xp = get_array_module(x)
        width = x.shape[-1] // 2
        gate, up = x[..., :width], x[..., width:]
        if is_device_array(x):  # one fused pass; backward recomputes σ, so only the input's halves are kept
            return kernels.SWIGLU_FORWARD(gate=gate, up=up)["out"], Saved(gate=gate, up=up)
        kept = host_kernels.run(kernels.SWIGLU_FORWARD_KEEPING, gate=gate, up=up)  # the passes below in one
        if kept is not None:
            return kept["out"], Saved(up=up, sigmoid=kept["sigmoid"], silu=kept["silu"])
        # the halves are strided views of x: each pass over one pays NumPy's per-row cost, so gate is read once,
        # into a contiguous copy that becomes silu (measured at 1024 × 704: forward 2.6 -> 2.1 ms)
        silu = xp.ascontiguousarray(gate)
        sigmoid = xp.negative(silu)
        xp.exp(sigmoid, out=sigmoid)
        sigmoid += 1.0
        xp.reciprocal(sigmoid, out=sigmoid)
        silu *= sigmoid
        return silu * up, Saved(up=up, sigmoid=sigmoid, silu=silu)

    def backward_input(self, saved: Saved, dout: Array) -> Array:
        xp = get_array_module(dout)
        dx = xp.empty((*dout.shape[:-1], 2 * dout.shape[-1]), dtype=dout.dtype)
        width = dout.shape[-1]
        if is_device_array(dout):
            kernels.SWIGLU_BACKWARD(gate=saved.gate, up=saved.up, dout=dout, dgate=dx[..., :width],
                                    dup=dx[..., width:])
            saved.clear()
            return dx
        compiled = host_kernels.run(kernels.SWIGLU_BACKWARD_FROM_SIGMOID, up=saved.up, sigmoid=saved.sigmoid,
                                    silu=saved.silu, dout=dout, dgate=dx[..., :width], dup=dx[..., width:])
        if compiled is not None:
            saved.clear()
            return dx
        xp.multiply(dout, saved.silu, out=dx[..., width:])
        # silu'(g) = s + g·s·(1 − s) = s + silu·(1 − s), built in a contiguous array and written into the strided
        # half of dx once (five passes over the half itself took 4.0 ms at 1024 × 704, these 2.8)
        dgate = xp.subtract(1.0, saved.sigmoid)
        dgate *= saved.silu
        dgate += saved.sigmoid
        dgate *= saved.up
        dgate *= dout
        dx[..., :width] = dgate
        saved.clear()
        return dx

    def backward_weights(self, saved: Saved) -> None:
        saved.clear()


def causal_softmax(scores: Array, offset: int = 0) -> Array:
    """Softmax over the last axis of (…, Tq, Tk) scores, in place, with key j masked out for query i when
    j > i + offset (the queries are the last Tq of Tk positions when offset = Tk − Tq). On the CPU one compiled
    pass per row where models.host_kernels can build it; else the NumPy passes below."""
    if not is_device_array(scores) and host_kernels.causal_softmax(scores, offset):
        return scores
    xp = get_array_module(scores)
    queries, keys = scores.shape[-2:]
    scores += xp.triu(xp.full((queries, keys), -xp.inf, dtype=scores.dtype), k=offset + 1)  # the future: −inf
    if is_device_array(scores):
        return _normalized_exp_device(scores)
    scores -= scores.max(axis=-1, keepdims=True)  # stable: the largest exponent is e^0
    xp.exp(scores, out=scores)
    scores /= row_sums(scores)
    return scores


def _normalized_exp_device(scores: Array) -> Array:
    """exp(s − row max) / row sum in place, the shift and the exponential fused into one pass."""
    kernels.SOFTMAX_EXP(scores=scores, row_max=scores.max(axis=-1, keepdims=True), exps=scores)
    scores /= row_sums(scores)
    return scores


def softmax_backward(probs: Array, dprobs: Array, weighted_sum: Array | None = None) -> Array:
    """d(scores) from d(probs) for p = softmax(scores): p · (dp − Σ dp·p); masked entries have p = 0. In place.

    `weighted_sum` is Σ dp·p over the last axis (keepdims), for callers that have a cheaper way to it."""
    if weighted_sum is None:
        weighted_sum = row_sums(dprobs * probs)
    if is_device_array(dprobs):
        fused = kernels.SOFTMAX_BACKWARD(probs=probs, dprobs=dprobs, weighted_sum=weighted_sum, dscores=dprobs)
        return fused["dscores"]
    dprobs -= weighted_sum
    dprobs *= probs
    return dprobs


def query_blocks(queries: int, block: int) -> list[tuple[int, int]]:
    """[start, stop) ranges of `block` queries covering 0 … queries−1."""
    return [(start, min(start + block, queries)) for start in range(0, queries, block)]


def seen_keys(documents: Any, first_query: int, query_stop: int) -> slice:
    """The keys a block of queries at positions [first_query, query_stop) may see: none in their future, none
    before the first document any of them is in (`models.documents`) — FlashAttention skips the same blocks."""
    return slice(documents.first_key(first_query), query_stop)


def attention_blocks(documents: Any, batch: int, queries: int, block: int,
                     offset: int = 0) -> Iterator[tuple[slice, slice, slice, Any]]:
    """(batch rows, query rows, the keys they see, those rows' documents) of every block attention computes, in
    order: all rows at once for one document per window, each row apart for packed documents (`row_groups`);
    the queries in blocks of `block` at positions offset …, each seeing `seen_keys`."""
    for rows in documents.row_groups(batch):
        here = documents.rows(rows)
        for start, stop in query_blocks(queries, block):
            yield rows, slice(start, stop), seen_keys(here, offset + start, offset + stop), here


class ProjectedAttention(Layer):
    """The backward every attention layer between the fused qkv projection (`qkv`) and the output projection
    (`projection`) shares, however its heads attend: the input pass runs the output projection's, the layer's
    own `_backward_to_qkv` (d(qkv) from d(merged heads)) and the qkv projection's, then drops what only it
    needed (`input_pass_only`, names in `saved`); the weight pass is the two projections'. The context-parallel
    variants (`mpiparallel.axes.context_parallel`) are the other subclasses."""

    input_pass_only: tuple[str, ...] = ()

    def backward_input(self, saved: Saved, dout: Array) -> Array:
        dqkv = self._backward_to_qkv(saved, self.projection.backward_input(saved.projection, dout))
        for name in self.input_pass_only:
            delattr(saved, name)
        return self.qkv.backward_input(saved.qkv, dqkv)

    def backward_weights(self, saved: Saved) -> None:
        self.projection.backward_weights(saved.projection)
        self.qkv.backward_weights(saved.qkv)
        saved.clear()

    def _backward_to_qkv(self, saved: Saved, dmerged: Array) -> Array:
        raise NotImplementedError


class CausalSelfAttention(ProjectedAttention):
    """Causal self-attention: fused qkv projection, per-head softmax(q·kᵀ/√d)·v, output projection; multi-head
    (GPT-2) or grouped-query (Llama: n_kv_head < n_head), with or without rotary positions.

    The projection's output is [q | k | v]: n_head·d, then n_kv·d and n_kv·d channels (GPT-2's c_attn is the case
    n_kv = n_head). The heads stay views into it: the matrix products read and write them with strides, so no
    transpose is ever copied, and q is scaled by 1/√d in place there (B·H·T·d numbers rather than the B·H·T·T
    scores). Grouped-query attention: query head h reads KV head h // g, g = n_head/n_kv. The query heads are
    viewed as (B, n_kv, g, T, d) and the keys as (B, n_kv, 1, T, d), so one broadcast product serves the g heads
    of a group and the keys are never repeated; d(K) and d(V) are the sums of the group's contributions.
    `rope` (a `models.rotary.RotaryEmbedding`) rotates q and k in place at positions 0 … T−1 (after a KV cache's
    length when decoding); backward rotates d(q) and d(k) back.

    Queries go in blocks of `query_block` rows, and block [start, stop) multiplies only keys [0, stop): every
    later key is in its future, so skipping them saves about half of q·kᵀ, the softmax passes and p·v, forward
    and backward (FlashAttention skips the same blocks).

    `keep_probabilities=False` is selective recomputation: forward keeps no softmax probabilities (no term in
    s²) and backward recomputes each query block's from the kept q and k, one block at a time.
    """

    input_pass_only = ("q", "k", "v", "merged", "probs")

    def __init__(self, qkv: Any, projection: Any, n_head: int, query_block: int = QUERY_BLOCK,
                 keep_probabilities: bool = True, n_kv_head: int | None = None, rope: Any = None) -> None:
        if query_block < 1:
            raise ValueError(f"query_block must be at least 1, got {query_block}")
        n_kv_head = n_kv_head or n_head
        if n_head % n_kv_head:
            raise ValueError(f"grouped-query attention: n_head ({n_head}) must be divisible by n_kv_head "
                             f"({n_kv_head})")
        self.qkv, self.projection, self.n_head, self.n_kv_head = qkv, projection, n_head, n_kv_head
        self.query_block, self.keep_probabilities, self.rope = query_block, keep_probabilities, rope

    def _split_heads(self, qkv: Array) -> tuple[Array, Array, Array]:
        """q (B, H, T, d) and k, v (B, n_kv, T, d): views into the [q | k | v] projection output."""
        return split_heads(qkv, self.n_head, self.n_kv_head)

    def forward(self, x: Array, documents: Any = ONE_DOCUMENT) -> tuple[Array, Saved]:
        """Attention of the (B, T, C) window `x`, each token over the earlier ones of its document
        (`models.documents`; by default the window is one)."""
        qkv, qkv_saved = self.qkv.forward(x)
        dtype = qkv.dtype  # the compute dtype: narrow ones are widened for the math, rounded for what is kept
        q, k, v = self._split_heads(widen(qkv))
        self._rotate(q, k, documents.rotary_positions(np.arange(q.shape[2])))
        q *= 1.0 / math.sqrt(q.shape[-1])
        merged, probs = self._attend(q, k, v, offset=0, keep=self.keep_probabilities, documents=documents)
        out, projection_saved = self.projection.forward(narrow(merged, dtype))
        saved = Saved(qkv=qkv_saved, projection=projection_saved, q=q, k=k, v=v, merged=merged, probs=probs,
                      documents=documents)
        narrow_saved(saved, dtype, self.input_pass_only)
        return out, saved

    def _rotate(self, q: Array, k: Array, positions: Any) -> None:
        if self.rope is not None:
            self.rope.rotate(q, positions)
            self.rope.rotate(k, positions)

    def forward_incremental(self, x: Array, cache: KVCache) -> Array:
        """Inference: attention of the new positions `x` (B, t, C) over the cached keys and values and their own,
        appending theirs to `cache`. Nothing is kept for backward."""
        q, k, v = self._split_heads(self.qkv.forward(x)[0])
        self._rotate(q, k, np.arange(cache.length, cache.length + q.shape[2]))
        keys, values = cache.append(k, v)
        q = q * (1.0 / math.sqrt(q.shape[-1]))
        merged, _ = self._attend(q, keys, values, offset=keys.shape[2] - q.shape[2], keep=False)
        return self.projection.forward(merged)[0]

    def _attend(self, q: Array, k: Array, v: Array, offset: int, keep: bool,
                documents: Any = ONE_DOCUMENT) -> tuple[Array, list[Array] | None]:
        """softmax(q·kᵀ)·v of (B, H, t, d) queries (scale included) at positions offset … offset+t−1 over the
        (B, n_kv, ·, d) keys and values from position 0 (each query's document's first key on), merged to
        (B, t, H·d); also each query block's probabilities if `keep`."""
        xp = get_array_module(q)
        batch, n_head, queries, head_dim = q.shape
        merged = xp.empty((batch, queries, n_head, head_dim), dtype=q.dtype)
        heads = grouped(merged.transpose(0, 2, 1, 3), k.shape[1])  # written through by the products
        q, k, v = grouped(q, k.shape[1]), k[:, :, None], v[:, :, None]
        kept = [] if keep else None
        for rows, block, keys, here in attention_blocks(documents, batch, queries, self.query_block, offset):
            probs = self._probabilities(q[rows], k[rows], block.start, block.stop, keys, here)
            xp.matmul(probs, v[rows][..., keys, :], out=heads[rows][..., block, :])
            if keep:
                kept.append(probs)
        return merged.reshape(batch, queries, n_head * head_dim), kept

    @staticmethod
    def _probabilities(q: Array, k: Array, start: int, stop: int, keys: slice, documents: Any) -> Array:
        """Softmax of query rows [start, stop) over the `keys` they may see (grouped 5-D views): the keys at
        positions after a query's and before its document's start masked out (the query rows being the last
        of keys.stop positions)."""
        scores = q[..., start:stop, :] @ k[..., keys, :].swapaxes(-1, -2)
        offset = keys.stop - (stop - start)  # the first query row's position
        add_mask(scores, documents, np.arange(offset, keys.stop), np.arange(keys.start, keys.stop))
        return causal_softmax(scores, offset=offset - keys.start)

    def _backward_to_qkv(self, saved: Saved, dmerged: Array) -> Array:
        """d(qkv), in the projection output's layout, from d(merged heads)."""
        xp, dtype = get_array_module(dmerged), dmerged.dtype
        dmerged = widen(dmerged)
        widen_saved(saved, self.input_pass_only)
        batch, length, channels = dmerged.shape
        head_dim, n_kv = channels // self.n_head, self.n_kv_head
        dheads = grouped(dmerged.reshape(batch, length, self.n_head, head_dim).transpose(0, 2, 1, 3), n_kv)
        # zeroed, though every key's first sum is written (add_key_products): what a block leaves is 0, not garbage
        dqkv = xp.zeros((batch, length, (self.n_head + 2 * n_kv) * head_dim), dmerged.dtype)
        dq, dk, dv = split_heads(dqkv, self.n_head, n_kv)
        dq5, dk5, dv5 = grouped(dq, n_kv), dk[:, :, None], dv[:, :, None]
        # Σ_j p_ij·dp_ij = dy_i·y_i (FlashAttention's identity): a pass over (B, T, C) instead of (B, H, T, T)
        heads = (batch, length, self.n_head, head_dim)
        weighted_sum = row_dots(dmerged.reshape(heads), saved.merged.reshape(heads))
        weighted_sum = grouped(weighted_sum.transpose(0, 2, 1, 3), n_kv)
        q, k, v, documents = grouped(saved.q, n_kv), saved.k[:, :, None], saved.v[:, :, None], saved.documents
        blocks = attention_blocks(documents, batch, length, self.query_block)
        for index, (rows, block, keys, here) in enumerate(blocks):
            probs = (saved.probs[index] if saved.probs is not None
                     else self._probabilities(q[rows], k[rows], block.start, block.stop, keys, here))
            dout = dheads[rows][..., block, :]
            reached = max(block.start - keys.start, 0)  # the keys before this block's own: earlier blocks saw them
            add_key_products(dv5[rows][..., keys, :], probs.swapaxes(-1, -2), dout, reached)
            dprobs = dout @ v[rows][..., keys, :].swapaxes(-1, -2)
            dscores = softmax_backward(probs, dprobs, weighted_sum[rows][..., block, :])
            xp.matmul(dscores, k[rows][..., keys, :], out=dq5[rows][..., block, :])
            queries = q[rows][..., block, :]  # scaled by 1/√d: d(k) needs no scale of its own
            add_key_products(dk5[rows][..., keys, :], dscores.swapaxes(-1, -2), queries, reached)
        dq *= 1.0 / math.sqrt(head_dim)
        if self.rope is not None:
            positions = documents.rotary_positions(np.arange(length))
            self.rope.rotate_back(dq, positions)
            self.rope.rotate_back(dk, positions)
        return narrow(dqkv, dtype)


def split_heads(qkv: Array, n_head: int, n_kv_head: int) -> tuple[Array, Array, Array]:
    """q (B, H, T, d) and k, v (B, n_kv, T, d) as views into a [q | k | v] array (B, T, (H + 2·n_kv)·d)."""
    batch, length, width = qkv.shape
    head_dim = width // (n_head + 2 * n_kv_head)
    q_end, k_end = n_head * head_dim, (n_head + n_kv_head) * head_dim
    q = qkv[..., :q_end].reshape(batch, length, n_head, head_dim)
    k = qkv[..., q_end:k_end].reshape(batch, length, n_kv_head, head_dim)
    v = qkv[..., k_end:].reshape(batch, length, n_kv_head, head_dim)
    return q.transpose(0, 2, 1, 3), k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)


def grouped(heads: Array, n_kv_head: int) -> Array:
    """(B, H, t, …) query heads as a (B, n_kv, g, t, …) view: the g = H/n_kv heads that share a KV head."""
    batch, n_head = heads.shape[:2]
    return heads.reshape(batch, n_kv_head, n_head // n_kv_head, *heads.shape[2:])


def group_sum(products: Array) -> Array:
    """Σ over the group axis (2) of per-query-head products, for the one KV head they share (keepdims)."""
    return products if products.shape[2] == 1 else products.sum(axis=2, keepdims=True)


def add_key_products(target: Array, a: Array, b: Array, reached: int) -> None:
    """target += group_sum(a @ b), where the rows of `a` and `target` are keys: the first `reached` keys, which
    earlier query blocks reached too, are added to; the rest — this block's own keys, which no earlier block sees —
    are written by the product itself. Why: written into the strided d(k) or d(v) view by the matrix product, a
    key's first sum costs no temporary and no strided pass; and each key's sums still come in the blocks' order,
    so the query block changes no number."""
    if reached:
        target[..., :reached, :] += group_sum(a[..., :reached, :] @ b)
    own_keys, own_rows = target[..., reached:, :], a[..., reached:, :]
    if own_rows.shape[2] == 1:  # one query head per KV head: nothing to sum
        get_array_module(target).matmul(own_rows, b, out=own_keys)
    else:
        (own_rows @ b).sum(axis=2, keepdims=True, out=own_keys)


class KVCache:
    """Keys (rotated, with RoPE) and values (B, n_kv, positions, head_dim) of the positions seen so far, for
    incremental decoding; grouped-query attention caches only its n_kv heads."""

    def __init__(self) -> None:
        self.keys: Array | None = None
        self.values: Array | None = None

    def append(self, keys: Array, values: Array) -> tuple[Array, Array]:
        xp = get_array_module(keys)
        if self.keys is None:
            self.keys, self.values = keys.copy(), values.copy()
        else:
            self.keys = xp.concatenate((self.keys, keys), axis=2)
            self.values = xp.concatenate((self.values, values), axis=2)
        return self.keys, self.values

    @property
    def length(self) -> int:
        return 0 if self.keys is None else self.keys.shape[2]


class MLP(Layer):
    """expand, activation, contract: GPT-2's c_fc (C → 4C), GELU, c_proj (4C → C), or Llama's concatenated
    gate and up projections (C → 2F), SwiGLU, down (F → C)."""

    def __init__(self, expand: Any, contract: Any, activation: Layer | None = None) -> None:
        self.expand, self.activation, self.contract = expand, activation or GELU(), contract

    def forward(self, x: Array) -> tuple[Array, Saved]:
        hidden, expand = self.expand.forward(x)
        activated, activation = self.activation.forward(hidden)
        out, contract = self.contract.forward(activated)
        return out, Saved(expand=expand, activation=activation, contract=contract)

    def backward_input(self, saved: Saved, dout: Array) -> Array:
        dactivated = self.contract.backward_input(saved.contract, dout)
        dhidden = self.activation.backward_input(saved.activation, dactivated)
        return self.expand.backward_input(saved.expand, dhidden)

    def backward_weights(self, saved: Saved) -> None:
        self.contract.backward_weights(saved.contract)
        self.expand.backward_weights(saved.expand)
        saved.clear()


class Block(Layer):
    """Pre-LayerNorm transformer block: x + attn(ln_1(x)), then + mlp(ln_2(·)).

    `recompute_full=True` is full activation recomputation: forward keeps only the block's input, and the input
    pass first reruns the forward from it (including any communication the layers do) to rebuild the rest."""

    def __init__(self, ln_1: LayerNorm, attn: CausalSelfAttention, ln_2: LayerNorm, mlp: MLP,
                 recompute_full: bool = False) -> None:
        self.ln_1, self.attn, self.ln_2, self.mlp = ln_1, attn, ln_2, mlp
        self.recompute_full = recompute_full

    def forward(self, x: Array, documents: Any = ONE_DOCUMENT) -> tuple[Array, Saved]:
        """The block on the (B, T, C) window `x`; attention keeps to each token's document (`models.documents`)."""
        out, saved = self._forward(x, documents)
        return (out, Saved(x=x, documents=documents)) if self.recompute_full else (out, saved)

    def _forward(self, x: Array, documents: Any) -> tuple[Array, Saved]:
        normed, ln_1 = self.ln_1.forward(x)
        attended, attn = self.attn.forward(normed, documents)
        middle = x + attended
        normed, ln_2 = self.ln_2.forward(middle)
        transformed, mlp = self.mlp.forward(normed)
        return middle + transformed, Saved(ln_1=ln_1, attn=attn, ln_2=ln_2, mlp=mlp)

    def forward_incremental(self, x: Array, cache: KVCache) -> Array:
        x = x + self.attn.forward_incremental(self.ln_1.forward(x)[0], cache)
        return x + self.mlp.forward(self.ln_2.forward(x)[0])[0]

    def backward_input(self, saved: Saved, dout: Array) -> Array:
        if self.recompute_full:
            rebuilt = self._forward(saved.x, saved.documents)[1]
            saved.clear()
            vars(saved).update(vars(rebuilt))
        dmiddle = dout + self.ln_2.backward_input(saved.ln_2, self.mlp.backward_input(saved.mlp, dout))
        return dmiddle + self.ln_1.backward_input(saved.ln_1, self.attn.backward_input(saved.attn, dmiddle))

    def backward_weights(self, saved: Saved) -> None:
        self.mlp.backward_weights(saved.mlp)
        self.ln_2.backward_weights(saved.ln_2)
        self.attn.backward_weights(saved.attn)
        self.ln_1.backward_weights(saved.ln_1)
        saved.clear()


class Embedding(Layer):
    """x = wte[tokens] + wpe[positions] (GPT-2), or x = wte[tokens] without `position` (Llama: RoPE instead)."""

    def __init__(self, token: Parameter, position: Parameter | None = None) -> None:
        self.token, self.position = token, position

    def forward(self, tokens: Array, start: int = 0, positions: Array | None = None) -> tuple[Array, Saved]:
        """Embed (B, T) token ids sitting at positions start … start+T−1, or at the distinct `positions` (T,)
        given (context parallelism holds two chunks of the sequence), or at per-row positions (B, T)
        (packed documents: each restarts at 0)."""
        rows = slice(start, start + tokens.shape[-1]) if positions is None else positions
        x = None if is_device_array(self.token.data) else self._embed_compiled(tokens, rows)
        if x is None:
            x = self.token.data[tokens]
            if self.position is not None:
                x += self.position.data[rows]
        return x, Saved(tokens=tokens, rows=rows)

    def _embed_compiled(self, tokens: np.ndarray, rows: Any) -> np.ndarray | None:
        """The token and position rows gathered and added in one compiled pass (None: not compiled here)."""
        if self.position is None:
            return host_kernels.embed(tokens, self.token.data)
        return host_kernels.embed(tokens, self.token.data, position_indices(rows), self.position.data)

    def backward_input(self, saved: Saved, dout: Array) -> None:
        saved.dout = dout
        return None  # token ids have no gradient

    def backward_weights(self, saved: Saved) -> None:
        if is_device_array(saved.dout) or not self._add_gradients_compiled(saved):
            add_rows(self.token.grad, saved.tokens, saved.dout)
            if self.position is not None:
                add_position_gradient(self.position.grad, saved.rows, saved.dout)
        saved.clear()

    def _add_gradients_compiled(self, saved: Saved) -> bool:
        """Each row of d(x) added into its token's and its position's gradient rows in one compiled pass."""
        dout = saved.dout.reshape(-1, saved.dout.shape[-1])
        if self.position is None:
            return host_kernels.scatter_add_rows(self.token.grad, saved.tokens, dout)
        return host_kernels.scatter_add_rows(self.token.grad, saved.tokens, dout, position_indices(saved.rows),
                                             self.position.grad)


def position_indices(rows: Any) -> np.ndarray:
    """The position rows an embedding reads as indices: a window's slice as the range it covers (shared by every
    row of the batch), or the positions given ((T,) or per token (B, T))."""
    return np.arange(rows.start, rows.stop) if isinstance(rows, slice) else rows


def add_rows(table: Array, rows: Array, values: Array) -> None:
    """table[rows[i]] += values[i] for every row index i (values: (..., C), rows: its leading shape), repeated
    rows accumulating — an embedding's gradient. On the CPU one compiled loop (models.host_kernels) where it can
    run, else NumPy's add.at, with the same numbers."""
    channels = table.shape[-1]
    values = values.reshape(-1, channels)
    if not is_device_array(table) and host_kernels.scatter_add_rows(table, rows, values):
        return
    if table.flags.c_contiguous:
        # one scatter of B·T·C single numbers into the flat table: NumPy's add.at has a fast path for 1-D
        # targets, 5× faster than adding B·T rows into the 2-D table
        entries = rows.reshape(-1, 1) * channels + get_array_module(rows).arange(channels)
        scatter_add(table.reshape(-1), entries.reshape(-1), values.reshape(-1))
    else:  # a strided gradient view: reshape(-1) would scatter into a copy
        scatter_add(table, rows.reshape(-1), values)


def add_position_gradient(grad: Array, rows: Any, dout: Array) -> None:
    """wpe's gradient from d(x) (B, T, C) of tokens at `rows`: a slice or distinct positions (T,) shared by the
    batch's rows, or per-row positions (B, T), which repeat (every document has a position 0)."""
    if getattr(rows, "ndim", 1) == 2:
        add_rows(grad, get_array_module(grad).asarray(rows), dout)
    else:
        grad[rows] += dout.sum(axis=0)  # distinct positions: no index repeats


class HeadCrossEntropy(Layer):
    """logits = x @ wteᵀ (the LM head shares the token embedding), then softmax cross-entropy.

    `forward` returns the *sum* of the token losses divided by `normalizer` (the token count of the whole
    global batch), so the losses of microbatches and data-parallel ranks add up to the global mean with one
    normalization. The logits never leave this layer: forward turns them, in place, straight into
    d(logits) = (softmax − onehot(target)) / normalizer, which is all backward needs (one pass over the
    B·T × vocab logits fewer than normalizing the probabilities and scaling them again later). The loss is the
    root of backward: `backward_input` takes no output gradient (pass None). A target `IGNORED` adds no loss and
    a zero row of d(logits).
    """

    def __init__(self, token: Parameter) -> None:
        self.token = token

    def forward(self, x: Array, targets: Array, normalizer: float) -> tuple[float, Saved]:
        xp = get_array_module(x)
        x2d = x.reshape(-1, x.shape[-1])
        logits = self.logits(x2d)
        token_losses = None if is_device_array(logits) else host_kernels.cross_entropy(logits, targets.reshape(-1),
                                                                                        normalizer)
        if token_losses is not None:  # compiled: the passes below in one per row
            return float(token_losses.sum()) / normalizer, Saved(x2d=x2d, x_shape=x.shape, dlogits=logits)
        ignored = targets.reshape(-1) < 0  # IGNORED
        targets = xp.where(ignored, 0, targets.reshape(-1))
        rows = xp.arange(len(targets))
        if is_device_array(logits):
            target_logits = _shifted_exp_device(logits, rows, targets)
        else:
            logits -= logits.max(axis=-1, keepdims=True)
            target_logits = logits[rows, targets]
            xp.exp(logits, out=logits)
        sums = row_sums(logits)
        logits /= sums * normalizer  # softmax / normalizer
        logits[rows, targets] -= 1.0 / normalizer
        token_losses = xp.log(sums[:, 0]) - target_logits
        logits[ignored], token_losses[ignored] = 0.0, 0.0
        loss = float(token_losses.sum()) / normalizer
        return loss, Saved(x2d=x2d, x_shape=x.shape, dlogits=logits)

    def logits(self, x: Array) -> Array:
        """x @ wteᵀ: the logits forward turns into the loss, and what sampling reads."""
        return x @ self.token.data.T

    def backward_input(self, saved: Saved, dout: None = None) -> Array:
        return (saved.dlogits @ self.token.data).reshape(saved.x_shape)

    def backward_weights(self, saved: Saved) -> None:
        self.token.grad += saved.dlogits.T @ saved.x2d
        saved.clear()


class LMHead(Layer):
    """The model's last unit: the final LayerNorm, then the tied LM head and its cross-entropy (`loss`)."""

    def __init__(self, ln_f: LayerNorm, loss: Any) -> None:
        self.ln_f, self.loss = ln_f, loss

    def forward(self, x: Array, targets: Array, normalizer: float) -> tuple[float, Saved]:
        normed, ln_f = self.ln_f.forward(x)
        loss, cross_entropy = self.loss.forward(normed, targets, normalizer)
        return loss, Saved(ln_f=ln_f, cross_entropy=cross_entropy)

    def logits(self, x: Array) -> Array:
        """Next-token logits for sampling."""
        return self.loss.logits(self.ln_f.forward(x)[0])

    def backward_input(self, saved: Saved, dout: None = None) -> Array:
        return self.ln_f.backward_input(saved.ln_f, self.loss.backward_input(saved.cross_entropy))

    def backward_weights(self, saved: Saved) -> None:
        self.loss.backward_weights(saved.cross_entropy)
        self.ln_f.backward_weights(saved.ln_f)
        saved.clear()


def _shifted_exp_device(logits: Array, rows: Array, targets: Array) -> Array:
    """logits ← exp(logits − row max) in one fused pass; returns the shifted target logits, read before it."""
    row_max = logits.max(axis=-1, keepdims=True)
    target_logits = logits[rows, targets] - row_max[:, 0]
    kernels.SOFTMAX_EXP(scores=logits, row_max=row_max, exps=logits)
    return target_logits
