"""GPT-2 layers with hand-written forward and backward passes.

Every layer is a small class: `forward(x)` computes the output and keeps what backward needs; `backward(dout)`
returns the gradient with respect to the input and adds the parameter gradients into `param.grad`. Backward
is split in two, callable separately, because zero-bubble pipeline schedules and overlapped tensor-parallel
communication need exactly that split:

- `backward_input(dout)`  -> d(input)       (on the critical path: the previous layer waits for it)
- `backward_weights(dout)`                  (accumulates d(weights); can be deferred)

`backward(dout)` does both. Activations are (B, T, C) arrays: batch, sequence, channels. Linear weights use
GPT-2's Conv1D layout [in, out], so y = x @ W + b. The same code runs on NumPy and CuPy arrays.
"""

from __future__ import annotations

import math

from collectives.backend import Array, get_array_module, is_device_array, scatter_add

from . import kernels
from .parameter import Parameter

GELU_SCALE = math.sqrt(2.0 / math.pi)
GELU_CUBIC = 0.044715


def row_sums(a: Array) -> Array:
    """Σ over the last axis, keepdims. Computed as a matrix-vector product with ones: for the short rows here
    (channels, keys) BLAS is 3-4× faster than NumPy's sum(axis=-1)."""
    xp = get_array_module(a)
    sums = a.reshape(-1, a.shape[-1]) @ xp.ones(a.shape[-1], dtype=a.dtype)
    return sums.reshape(*a.shape[:-1], 1)


def column_sums(a: Array) -> Array:
    """Σ over every axis but the last (bias and LayerNorm gradients), as a vector-matrix product with ones: as
    for row_sums, BLAS beats NumPy's sum(axis=0)."""
    xp = get_array_module(a)
    rows = a.reshape(-1, a.shape[-1])
    return xp.ones(rows.shape[0], dtype=a.dtype) @ rows


class Linear:
    """y = x @ weight + bias over the last axis (weight [in, out], Conv1D layout)."""

    def __init__(self, weight: Parameter, bias: Parameter) -> None:
        self.weight, self.bias = weight, bias

    def forward(self, x: Array) -> Array:
        self.x = x
        out = x.reshape(-1, x.shape[-1]) @ self.weight.data
        out += self.bias.data
        return out.reshape(*x.shape[:-1], out.shape[-1])

    def backward_input(self, dout: Array) -> Array:
        dx = dout.reshape(-1, dout.shape[-1]) @ self.weight.data.T
        return dx.reshape(*dout.shape[:-1], dx.shape[-1])

    def backward_weights(self, dout: Array) -> None:
        dout2d = dout.reshape(-1, dout.shape[-1])
        self.weight.grad += self.x.reshape(-1, self.x.shape[-1]).T @ dout2d
        self.bias.grad += column_sums(dout2d)

    def backward(self, dout: Array) -> Array:
        self.backward_weights(dout)
        return self.backward_input(dout)


class LayerNorm:
    """y = (x − mean) / sqrt(var + eps) · weight + bias over the last axis (eps 1e-5, biased variance)."""

    eps = 1e-5

    def __init__(self, weight: Parameter, bias: Parameter) -> None:
        self.weight, self.bias = weight, bias

    def forward(self, x: Array) -> Array:
        if is_device_array(x):
            return self._forward_device(x)
        xp = get_array_module(x)
        channels = x.shape[-1]
        centered = x - row_sums(x) / channels
        variance = row_sums(centered * centered) / channels
        variance += self.eps
        self.rstd = 1.0 / xp.sqrt(variance, out=variance)
        self.normalized = centered
        self.normalized *= self.rstd
        out = self.normalized * self.weight.data
        out += self.bias.data
        return out

    def _forward_device(self, x: Array) -> Array:
        """Mean and variance as CuPy reductions, then normalize and affine in one fused pass (four on NumPy)."""
        xp = get_array_module(x)
        mean = x.mean(axis=-1, keepdims=True)
        self.rstd = 1.0 / xp.sqrt(x.var(axis=-1, keepdims=True) + self.eps)
        result = kernels.LAYER_NORM_FORWARD(x=x, mean=mean, rstd=self.rstd, weight=self.weight.data,
                                            bias=self.bias.data)
        self.normalized = result["normalized"]
        return result["out"]

    def backward_input(self, dout: Array) -> Array:
        # dx = rstd · (dnorm − mean(dnorm) − norm · mean(dnorm · norm)), with dnorm = dout · weight
        if is_device_array(dout):
            return self._backward_input_device(dout)
        xp = get_array_module(dout)
        channels = dout.shape[-1]
        dnorm = dout * self.weight.data
        work = dnorm * self.normalized
        mean_dnorm_norm = row_sums(work) / channels
        dx = dnorm
        dx -= row_sums(dnorm) / channels
        dx -= xp.multiply(self.normalized, mean_dnorm_norm, out=work)
        dx *= self.rstd
        return dx

    def _backward_input_device(self, dout: Array) -> Array:
        """The two row means as GEMVs with the weight (Σ dout·w, Σ dout·normalized·w), then dx in one fused pass."""
        channels = dout.shape[-1]
        row_shape = (*dout.shape[:-1], 1)
        weight = self.weight.data
        mean_dnorm = (dout.reshape(-1, channels) @ weight).reshape(row_shape) / channels
        mean_dnorm_norm = ((dout * self.normalized).reshape(-1, channels) @ weight).reshape(row_shape) / channels
        return kernels.LAYER_NORM_BACKWARD(dout=dout, weight=weight, normalized=self.normalized, rstd=self.rstd,
                                           mean_dnorm=mean_dnorm, mean_dnorm_norm=mean_dnorm_norm)["dx"]

    def backward_weights(self, dout: Array) -> None:
        self.weight.grad += column_sums(dout * self.normalized)
        self.bias.grad += column_sums(dout)

    def backward(self, dout: Array) -> Array:
        self.backward_weights(dout)
        return self.backward_input(dout)


class GELU:
    """GELU, tanh approximation: 0.5·x·(1 + tanh(√(2/π)·(x + 0.044715·x³))).

    Written as x·h with the gate h = (1 + tanh u)/2 and u = x·a, a = √(2/π)·(1 + 0.044715·x²). Forward keeps
    a, h and the output, so the derivative h + 2·x·h·(1 − h)·du/dx = h + (x − out)·h·(6a − 4√(2/π)) costs
    seven elementwise passes in backward instead of re-deriving tanh terms from x (each pass over the 4C-wide
    hidden activations costs as much as a small GEMM).
    """

    def forward(self, x: Array) -> Array:
        if is_device_array(x):  # one fused pass; backward recomputes the gate from x, so a and h are not kept
            self.x = x
            self.out = kernels.GELU_FORWARD(x=x)["out"]
            return self.out
        xp = get_array_module(x)
        self.x = x
        a = x * x
        a *= GELU_SCALE * GELU_CUBIC
        a += GELU_SCALE
        gate = a * x
        xp.tanh(gate, out=gate)
        gate *= 0.5
        gate += 0.5
        self.a, self.gate = a, gate
        self.out = x * gate
        return self.out

    def backward_input(self, dout: Array) -> Array:
        if is_device_array(dout):
            return kernels.GELU_BACKWARD(x=self.x, dout=dout)["dx"]
        # du/dx = √(2/π)·(1 + 3·0.044715·x²) = 3a − 2√(2/π), and 2·x·(1 − h) = 2·(x − out)
        slope = self.a * 6.0
        slope -= 4.0 * GELU_SCALE
        slope *= self.gate
        slope *= get_array_module(dout).subtract(self.x, self.out)
        slope += self.gate
        slope *= dout
        return slope

    def backward_weights(self, dout: Array) -> None:
        pass

    def backward(self, dout: Array) -> Array:
        return self.backward_input(dout)


def causal_softmax(scores: Array, offset: int = 0) -> Array:
    """Softmax over the last axis of (…, Tq, Tk) scores, in place, with key j masked out for query i when
    j > i + offset (the queries are the last Tq of Tk positions when offset = Tk − Tq)."""
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


class CausalSelfAttention:
    """Multi-head causal self-attention: fused qkv projection, per-head softmax(q·kᵀ/√d)·v, output projection.

    The heads stay views into the projections' (B, T, 3, H, d) and (B, T, H, d) layouts: the matrix products
    read and write them with strides, so no transpose is ever copied. Queries go in blocks of `query_block`
    rows, and block [start, stop) multiplies only keys [0, stop): every later key is in its future, so skipping
    them saves about half of q·kᵀ, the softmax passes and p·v, forward and backward (FlashAttention skips the
    same blocks).
    """

    query_block = 64

    def __init__(self, qkv: Linear, projection: Linear, n_head: int) -> None:
        self.qkv, self.projection, self.n_head = qkv, projection, n_head

    def _split_heads(self, qkv: Array) -> tuple[Array, Array, Array]:
        batch, length, three_channels = qkv.shape
        head_dim = three_channels // (3 * self.n_head)
        heads = qkv.reshape(batch, length, 3, self.n_head, head_dim).transpose(2, 0, 3, 1, 4)
        return heads[0], heads[1], heads[2]  # each (B, H, T, head_dim)

    def forward(self, x: Array) -> Array:
        q, k, v = self._split_heads(self.qkv.forward(x))
        self.scale = 1.0 / math.sqrt(q.shape[-1])
        # the scale goes on q (B·H·T·d numbers) rather than on the scores (B·H·T·T); q is kept scaled
        self.q, self.k, self.v = q * self.scale, k, v
        self.merged, self.blocks = self._attend(self.q, k, v, offset=0)
        return self.projection.forward(self.merged)

    def forward_incremental(self, x: Array, cache: KVCache) -> Array:
        """Inference: attention of the new positions `x` (B, t, C) over the cached keys and values and their own,
        appending theirs to `cache`. Nothing is kept for backward."""
        q, k, v = self._split_heads(self.qkv.forward(x))
        keys, values = cache.append(k, v)
        merged, _ = self._attend(q * (1.0 / math.sqrt(q.shape[-1])), keys, values, offset=keys.shape[2] - q.shape[2])
        return self.projection.forward(merged)

    def _attend(self, q: Array, k: Array, v: Array, offset: int) -> tuple[Array, list[tuple[int, int, Array]]]:
        """softmax(q·kᵀ)·v of (B, H, t, d) queries (scale included) at positions offset … offset+t−1 over the keys
        and values from position 0, merged to (B, t, H·d); also each query block's (start, stop, probabilities)."""
        xp = get_array_module(q)
        batch, n_head, queries, head_dim = q.shape
        merged = xp.empty((batch, queries, n_head, head_dim), dtype=q.dtype)
        heads = merged.transpose(0, 2, 1, 3)  # (B, H, t, d), written through by the products
        blocks = []
        for start, stop in query_blocks(queries, self.query_block):
            keys = offset + stop
            scores = q[:, :, start:stop] @ k[:, :, :keys].transpose(0, 1, 3, 2)
            probs = causal_softmax(scores, offset=offset + start)
            xp.matmul(probs, v[:, :, :keys], out=heads[:, :, start:stop])
            blocks.append((start, stop, probs))
        return merged.reshape(batch, queries, n_head * head_dim), blocks

    def backward_input(self, dout: Array) -> Array:
        dheads = self._backward_to_heads(self.projection.backward_input(dout))
        return self.qkv.backward_input(dheads)

    def backward_weights(self, dout: Array) -> None:
        self.projection.backward_weights(dout)
        self.qkv.backward_weights(self._dqkv)

    def backward(self, dout: Array) -> Array:
        dx = self.backward_input(dout)
        self.backward_weights(dout)
        return dx

    def _backward_to_heads(self, dmerged: Array) -> Array:
        """d(qkv) from d(merged heads); kept for backward_weights of the qkv projection."""
        xp = get_array_module(dmerged)
        batch, length, channels = dmerged.shape
        head_dim = channels // self.n_head
        dheads = dmerged.reshape(batch, length, self.n_head, head_dim).transpose(0, 2, 1, 3)
        # in the qkv output's layout; zeroed because every query block adds into the keys and values it saw
        dqkv = xp.zeros((batch, length, 3, self.n_head, head_dim), dmerged.dtype)
        dq, dk, dv = dqkv.transpose(2, 0, 3, 1, 4)
        # Σ_j p_ij·dp_ij = dy_i·y_i (FlashAttention's identity): a pass over (B, T, C) instead of (B, H, T, T)
        weighted_sum = row_sums((dmerged * self.merged).reshape(batch, length, self.n_head, head_dim))
        weighted_sum = weighted_sum.transpose(0, 2, 1, 3)
        for start, stop, probs in self.blocks:
            rows = slice(start, stop)
            dv[:, :, :stop] += probs.transpose(0, 1, 3, 2) @ dheads[:, :, rows]
            dprobs = dheads[:, :, rows] @ self.v[:, :, :stop].transpose(0, 1, 3, 2)
            dscores = softmax_backward(probs, dprobs, weighted_sum[:, :, rows])
            xp.matmul(dscores, self.k[:, :, :stop], out=dq[:, :, rows])
            dk[:, :, :stop] += dscores.transpose(0, 1, 3, 2) @ self.q[:, :, rows]  # q holds the scale already
        dq *= self.scale
        self._dqkv = dqkv.reshape(batch, length, 3 * channels)
        return self._dqkv


class KVCache:
    """Keys and values (B, H, positions, head_dim) of the positions seen so far, for incremental decoding."""

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


class MLP:
    """c_fc (C -> 4C), GELU, c_proj (4C -> C)."""

    def __init__(self, expand: Linear, contract: Linear) -> None:
        self.expand, self.gelu, self.contract = expand, GELU(), contract

    def forward(self, x: Array) -> Array:
        return self.contract.forward(self.gelu.forward(self.expand.forward(x)))

    def backward_input(self, dout: Array) -> Array:
        self._dhidden = self.gelu.backward_input(self.contract.backward_input(dout))
        return self.expand.backward_input(self._dhidden)

    def backward_weights(self, dout: Array) -> None:
        self.contract.backward_weights(dout)
        self.expand.backward_weights(self._dhidden)

    def backward(self, dout: Array) -> Array:
        dx = self.backward_input(dout)
        self.backward_weights(dout)
        return dx


class Block:
    """Pre-LayerNorm transformer block: x + attn(ln_1(x)), then + mlp(ln_2(·))."""

    def __init__(self, ln_1: LayerNorm, attn: CausalSelfAttention, ln_2: LayerNorm, mlp: MLP) -> None:
        self.ln_1, self.attn, self.ln_2, self.mlp = ln_1, attn, ln_2, mlp

    def forward(self, x: Array) -> Array:
        x = x + self.attn.forward(self.ln_1.forward(x))
        return x + self.mlp.forward(self.ln_2.forward(x))

    def forward_incremental(self, x: Array, cache: KVCache) -> Array:
        x = x + self.attn.forward_incremental(self.ln_1.forward(x), cache)
        return x + self.mlp.forward(self.ln_2.forward(x))

    def backward_input(self, dout: Array) -> Array:
        self._dmlp_in = self.mlp.backward_input(dout)
        dmid = dout + self.ln_2.backward_input(self._dmlp_in)
        self._dmid = dmid
        self._dattn_in = self.attn.backward_input(dmid)
        return dmid + self.ln_1.backward_input(self._dattn_in)

    def backward_weights(self, dout: Array) -> None:
        self.mlp.backward_weights(dout)
        self.ln_2.backward_weights(self._dmlp_in)
        self.attn.backward_weights(self._dmid)
        self.ln_1.backward_weights(self._dattn_in)

    def backward(self, dout: Array) -> Array:
        dx = self.backward_input(dout)
        self.backward_weights(dout)
        return dx


class Embedding:
    """x = wte[tokens] + wpe[positions]."""

    def __init__(self, token: Parameter, position: Parameter) -> None:
        self.token, self.position = token, position

    def forward(self, tokens: Array, start: int = 0) -> Array:
        """Embed (B, T) token ids sitting at positions start … start+T−1."""
        self.tokens = tokens
        return self.token.data[tokens] + self.position.data[start:start + tokens.shape[-1]]

    def backward_input(self, dout: Array) -> None:
        return None  # token ids have no gradient

    def backward_weights(self, dout: Array) -> None:
        channels = dout.shape[-1]
        grad = self.token.grad
        if grad.flags.c_contiguous:
            # one scatter of B·T·C single numbers into the flat table: NumPy's add.at has a fast path for 1-D
            # targets, 5× faster than adding B·T rows into the 2-D table
            entries = self.tokens.reshape(-1, 1) * channels + get_array_module(self.tokens).arange(channels)
            scatter_add(grad.reshape(-1), entries.reshape(-1), dout.reshape(-1))
        else:  # a strided gradient view: reshape(-1) would scatter into a copy
            scatter_add(grad, self.tokens.reshape(-1), dout.reshape(-1, channels))
        self.position.grad[:dout.shape[-2]] += dout.sum(axis=0)

    def backward(self, dout: Array) -> None:
        self.backward_weights(dout)


class TiedHeadCrossEntropy:
    """logits = x @ wteᵀ (the LM head shares the token embedding), then softmax cross-entropy.

    `forward` returns the *sum* of the token losses divided by `normalizer` (the token count of the whole
    global batch), so the losses of microbatches and data-parallel ranks add up to the global mean with one
    normalization. The logits never leave this layer: forward turns them, in place, straight into
    d(logits) = (softmax − onehot(target)) / normalizer, which is all backward needs (one pass over the
    B·T × vocab logits fewer than normalizing the probabilities and scaling them again later).
    """

    def __init__(self, token: Parameter) -> None:
        self.token = token

    def forward(self, x: Array, targets: Array, normalizer: float) -> float:
        xp = get_array_module(x)
        self.x_shape = x.shape
        self.x2d = x.reshape(-1, x.shape[-1])
        targets = targets.reshape(-1)
        rows = xp.arange(len(targets))
        logits = self.x2d @ self.token.data.T
        if is_device_array(logits):
            target_logits = _shifted_exp_device(logits, rows, targets)
        else:
            logits -= logits.max(axis=-1, keepdims=True)
            target_logits = logits[rows, targets]
            xp.exp(logits, out=logits)
        sums = row_sums(logits)
        logits /= sums * normalizer  # softmax / normalizer
        logits[rows, targets] -= 1.0 / normalizer
        self.dlogits = logits
        return float((xp.log(sums[:, 0]) - target_logits).sum()) / normalizer

    def logits(self, x: Array) -> Array:
        """Plain logits for sampling (no loss)."""
        return x @ self.token.data.T

    def backward_input(self) -> Array:
        return (self.dlogits @ self.token.data).reshape(self.x_shape)

    def backward_weights(self) -> None:
        self.token.grad += self.dlogits.T @ self.x2d

    def backward(self) -> Array:
        dx = self.backward_input()
        self.backward_weights()
        return dx


def _shifted_exp_device(logits: Array, rows: Array, targets: Array) -> Array:
    """logits ← exp(logits − row max) in one fused pass; returns the shifted target logits, read before it."""
    row_max = logits.max(axis=-1, keepdims=True)
    target_logits = logits[rows, targets] - row_max[:, 0]
    kernels.SOFTMAX_EXP(scores=logits, row_max=row_max, exps=logits)
    return target_logits
