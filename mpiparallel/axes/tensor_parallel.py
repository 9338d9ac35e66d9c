"""Megatron tensor parallelism (TP) with a vocab-parallel embedding and cross-entropy, and Megatron sequence
parallelism (SP) — the same GPT-2 as `models.transformer.Transformer`, its weights split over the n ranks of a TP group.

What each rank holds and computes (H heads, C = n_embd, V vocabulary, n = tp):

    attn.c_attn   column-parallel: rank r computes q, k and v of heads r·H/n … (r+1)·H/n and runs the serial
                  causal attention on just those heads (heads never interact, so nothing moves)
    attn.c_proj   row-parallel: rank r multiplies its heads' outputs by its C/n rows; partial sums are reduced
    mlp.c_fc      column-parallel: 4C/n hidden units per rank (GELU is elementwise, so it stays local)
    mlp.c_proj    row-parallel
    wte           vocab-parallel: rank r owns a contiguous slice of V/n rows; the embedding of a token is
                  found on one rank (the others add zeros) and the LM head, tied to wte, yields this rank's
                  V/n columns of the logits; the cross-entropy never gathers the full logits
    LayerNorms, wpe, row-parallel biases: replicated

The llama family (`GPTConfig.arch` "llama") splits the same way: q_proj by query heads, o_proj by rows,
gate_proj and up_proj by the same hidden units (so each rank's SwiGLU pairs its own gate and up), down_proj by
rows, an untied lm_head by vocabulary rows like wte, RMSNorms replicated. Grouped-query attention's k_proj and
v_proj are split by KV heads when tp divides n_kv; when tp > n_kv (tp a multiple of n_kv) each KV head is held
whole by the tp/n_kv ranks whose query heads read it (placement `Sharded(1, replicas=tp/n_kv)`), and those
ranks sum its weight gradients in the weight pass — an all-reduce of the h × d gradients over a communicator
of tp/n_kv ranks per block and microbatch (Megatron's rule). Any other tp is one clear error.

DeepSeek-V3 (`GPTConfig.arch` "deepseek_v3") shards its latent attention as Megatron, torchtitan and DeepSeek's
inference code do: q_b_proj (or q_proj) and kv_b_proj by heads (columns), o_proj by rows; the down-projections
q_a_proj and kv_a_proj_with_mqa and their RMSNorms are replicated, every rank computing the whole latent (b·s·(r_q
+ r + d_r) numbers, no communication). The attention enters the group once as a whole (one f for x), so its
backward all-reduces d(x) once, as a llama block's; the replicated weights' gradients are each rank's heads'
share (placement `Partial`), summed over the group once per step by `reduce_partial_gradients` — an all-reduce
of h·(r_q + r + d_r) + r_q + r elements per block. Its MoE experts, routed and shared, are replicated like
Mixtral's. Dense blocks split their SwiGLU as llama's.

A transformer block is the serial `models.layers.Block` with its linears replaced by `ColumnParallelLayer` and
`RowParallelLinear`; the norms, attention, the activations and MLP are the serial classes, run on local shards.

Communication. A layer talks in only two places: where activations enter a column-parallel layer (the whole
input is needed) and where they leave a row-parallel one (partial sums). Megatron names the pairs f and g (TP)
and g, ḡ (SP); each function below does the forward half, its `_backward` twin the backward half:

    function                              forward                    backward                   Megatron
    copy_to_tp                            identity                   all-reduce                 f
    reduce_from_tp                        all-reduce                 identity                   g
    gather_from_sequence_parallel         all-gather along T         reduce-scatter along T     g  (SP)
    reduce_scatter_to_sequence_parallel   reduce-scatter along T     all-gather along T         ḡ  (SP)

TP enters through copy_to_tp and leaves through reduce_from_tp; SP replaces them by the all-gather and the
reduce-scatter (`TensorParallelGroup` picks the pair). Between a row-parallel layer and the next column-parallel
one — the LayerNorms and residual adds — TP holds the full (B, T, C) activation on every rank, SP only a T/n slice
of the sequence: with SP that activation memory falls by n, for the same communication volume.

Cost per transformer block, with S = b·s·h elements of one activation (batch · sequence · hidden), per rank
and ring algorithms: forward 2 all-reduces of S (after attention and after the MLP), 2·2(n−1)/n·S elements
sent; backward 2 all-reduces of S (the d(input) of c_attn and c_fc), the same again (a llama block alike: its
q, k, v enter the group once together, as do its gate and up). With SP forward is
2 × (all-gather + reduce-scatter) of S, (n−1)/n·S each, so 2·2(n−1)/n·S — the volume of the all-reduces it
replaces — and backward the same. Once per step besides: the embedding (forward all-reduce of S; SP:
reduce-scatter forward, all-gather backward), the head's input (backward all-reduce of S; SP: all-gather forward,
reduce-scatter backward), the cross-entropy (all-reduce of the row maxima, b·s elements, and one of the row
sums of exponentials together with the target logits, 2·b·s) and, with SP, one all-reduce of the LayerNorm
gradients ((4·n_layer + 2)·h elements, `models.parameter.reduce_partial_gradients`). Weights per rank: 12h²/n
per block plus V·h/n for the embedding.

Choices, and why:
- Our collectives split along axis 0, activations are (B, T, C) and SP splits T, so the SP wrappers copy to a
  contiguous (T, B, C) array before the collective and back after it: one local copy of the tensor each way
  (free when B = 1), a memory pass much cheaper than the message.
- A column-parallel layer keeps its all-gathered input for its weight gradient (b·s·h per rank, as TP without
  SP keeps it). Megatron keeps only the sequence slice and all-gathers again in backward — one more all-gather
  per column-parallel layer, to save that memory. Here backward moves exactly the forward volume.
- With SP the head all-gathers the final LayerNorm's output and runs the vocab-parallel cross-entropy on the
  whole sequence; its d(input) is reduce-scattered back to the slices.
- With SP a LayerNorm's weight and bias see only this rank's slice of the sequence, so their gradients are
  partial sums (their placement on "tp" is `Partial`): call `reduce_partial_gradients(pieces, {"tp": comm})`
  once per optimizer step, after the last microbatch's backward (Megatron does this when it finishes the gradients; it
  must not run per microbatch, or the gradient accumulated so far would be summed n times). It commutes with the
  data-parallel gradient reduction (both are sums over disjoint rank sets). The row-parallel biases and wpe are
  added to sequence slices too, but their gradients are summed from the all-gathered d(output) the layer needs
  anyway, so they are complete on every rank.
- FP8 (`--fp8 blockwise`, `models.fp8`): every rank quantizes its own shards and activations, tiles starting at
  the shard's edge — the same code as serial, no communication of scales. Where each cut dimension of a shard
  (a column-parallel rank's output columns of each fused block, a row-parallel rank's inner rows) is a multiple
  of 128, the tiles are exactly the serial model's and TP differs from serial FP8 only in float32 summation
  order (the row-parallel partial sums). Where a shard edge cuts a 128-tile, that tile's pieces get their own
  scales: each piece is scaled at least as finely as the serial tile (its amax is ≤ the tile's), so the error
  bound holds and the numbers differ from serial by FP8 rounding, not by a bias. No refusal: narrow models (and
  the tests' tiny ones) would otherwise be unable to use TP at all.
- The vocabulary is padded with zero rows to a multiple of n; the padded logits are −∞, so their probabilities,
  their gradients and their weights stay exactly zero, and `gather_tensor` drops them: loss, gradients and
  checkpoints equal the unpadded serial model's.
"""

from __future__ import annotations

from typing import Any

from collectives import Communicator, all_gather, all_reduce, reduce_scatter
from collectives.backend import Array, get_array_module
from models.axis import TensorAxis
from models.layers import (
    PLAIN_GEMMS,
    ConcatenatedLinear,
    Gemms,
    Layer,
    Saved,
    add_position_gradient,
    add_rows,
)
from models.parameter import PARTIAL, Parameter, Placement, Sharded, gather_over_model_axes
from models.precision import narrow, widen
from models.transformer import GPTConfig, Transformer

TP_AXIS = "tp"


# -- the communication wrappers: forward above, backward right under it ---------------------------------------

def copy_to_tp(x: Array, comm: Communicator, algo: str = "auto") -> Array:
    """f forward: every rank already holds the whole input of a column-parallel layer; nothing moves."""
    return x


def copy_to_tp_backward(dx: Array, comm: Communicator, algo: str = "auto") -> Array:
    """f backward: each rank's d(input) covers only its output columns; all-reduce them (2(n−1)/n·size sent)."""
    return all_reduce(dx, comm, algo=algo)


def reduce_from_tp(partial: Array, comm: Communicator, algo: str = "auto") -> Array:
    """g forward: sum the partial outputs of a row-parallel layer over the group (all-reduce, 2(n−1)/n·size)."""
    return all_reduce(partial, comm, algo=algo)


def reduce_from_tp_backward(dout: Array, comm: Communicator, algo: str = "auto") -> Array:
    """g backward: every partial sum gets the whole d(output), which every rank holds; nothing moves."""
    return dout


def gather_from_sequence_parallel(x: Array, comm: Communicator, algo: str = "auto") -> Array:
    """SP g forward: (B, T/n, C) slices -> the whole (B, T, C) sequence on every rank (all-gather, (n−1)/n·size
    of the result sent)."""
    return _batch_first(all_gather(_sequence_first(x), comm, algo=algo))


def gather_from_sequence_parallel_backward(dx: Array, comm: Communicator, algo: str = "auto") -> Array:
    """SP g backward: sum every rank's d(whole sequence) and keep this rank's slice (reduce-scatter)."""
    return _batch_first(reduce_scatter(_sequence_first(dx), comm, algo=algo))


def reduce_scatter_to_sequence_parallel(partial: Array, comm: Communicator, algo: str = "auto") -> Array:
    """SP ḡ forward: sum the (B, T, C) partial outputs and keep this rank's (B, T/n, C) slice (reduce-scatter,
    (n−1)/n·size sent)."""
    return gather_from_sequence_parallel_backward(partial, comm, algo)


def reduce_scatter_to_sequence_parallel_backward(dout: Array, comm: Communicator, algo: str = "auto") -> Array:
    """SP ḡ backward: every partial sum gets the d(output) of the whole sequence (all-gather of the slices)."""
    return gather_from_sequence_parallel(dout, comm, algo)


def _sequence_first(x: Array) -> Array:
    """(B, T, C) -> contiguous (T, B, C): the collectives split and concatenate along axis 0."""
    return get_array_module(x).ascontiguousarray(x.transpose(1, 0, 2))


def _batch_first(x: Array) -> Array:
    """(T, B, C) -> contiguous (B, T, C), the layout of every activation."""
    return get_array_module(x).ascontiguousarray(x.transpose(1, 0, 2))


class TensorParallelGroup:
    """The TP communicator, the algorithm its collectives use, and whether sequence parallelism is on.

    Its methods are the two places where a parallel layer talks, each with its backward: entering a
    column-parallel layer (TP: f = copy_to_tp; SP: g = gather_from_sequence_parallel) and leaving a row-parallel
    one (TP: g = reduce_from_tp; SP: ḡ = reduce_scatter_to_sequence_parallel).
    """

    def __init__(self, comm: Any, sequence_parallel: bool = False, algo: str = "auto") -> None:
        self.comm = Communicator.of(comm)
        self.sequence_parallel, self.algo = sequence_parallel, algo
        self.rank, self.size = self.comm.rank, self.comm.size

    def into_column_parallel(self, x: Array) -> Array:
        enter = gather_from_sequence_parallel if self.sequence_parallel else copy_to_tp
        return enter(x, self.comm, self.algo)

    def into_column_parallel_backward(self, dx: Array) -> Array:
        enter = gather_from_sequence_parallel_backward if self.sequence_parallel else copy_to_tp_backward
        return enter(dx, self.comm, self.algo)

    def out_of_row_parallel(self, partial: Array) -> Array:
        leave = reduce_scatter_to_sequence_parallel if self.sequence_parallel else reduce_from_tp
        return leave(partial, self.comm, self.algo)

    def out_of_row_parallel_backward(self, dout: Array) -> Array:
        leave = reduce_scatter_to_sequence_parallel_backward if self.sequence_parallel else reduce_from_tp_backward
        return leave(dout, self.comm, self.algo)

    def all_reduce(self, x: Array, op: str = "sum") -> Array:
        return all_reduce(x, self.comm, op=op, algo=self.algo)

    def sequence_positions(self, length: int) -> slice:
        """The positions of a `length`-token sequence whose activations this rank holds between the layers."""
        if not self.sequence_parallel:
            return slice(0, length)
        share = length // self.size
        return slice(self.rank * share, (self.rank + 1) * share)


# -- parallel linear layers -----------------------------------------------------------------------------------

class ColumnParallelLayer(Layer):
    """A layer whose weights are cut by output columns (`local`: its math on this rank's shard): its input enters
    through `into_column_parallel` (TP: nothing forward, all-reduce of d(input) backward; SP: all-gather forward,
    reduce-scatter backward) once, however many projections read it (llama's q, k and v)."""

    def __init__(self, local: Layer, group: TensorParallelGroup) -> None:
        self.local, self.group = local, group

    def forward(self, x: Array, *context: Any) -> tuple[Array, Saved]:
        """`context`: what the local layer takes besides its input (an attention layer's documents)."""
        return self.local.forward(self.group.into_column_parallel(x), *context)

    def backward_input(self, saved: Saved, dout: Array) -> Array:
        return self.group.into_column_parallel_backward(self.local.backward_input(saved, dout))

    def backward_weights(self, saved: Saved) -> None:
        self.local.backward_weights(saved)  # the input it saw is the gathered one: no communication


class RowParallelLinear(Layer):
    """y = Σ_r x_r @ W[rows_r, :] + b: rank r multiplies its slice of the input features by its rows of W; the
    partial products leave through `out_of_row_parallel` (TP: all-reduce; SP: reduce-scatter), then the
    replicated bias is added once — which is why `Linear`, whose forward adds the bias, is not reused here.

    Backward: the gradient of every partial product is the whole d(output) (TP: held by every rank; SP:
    all-gathered). The input pass fetches it and keeps it for the weight pass. The bias gradient is summed from
    that whole d(output), so it is complete on every rank even when the bias was added to a sequence slice.
    """

    def __init__(self, weight: Parameter, bias: Parameter | None, group: TensorParallelGroup,
                 gemms: Gemms = PLAIN_GEMMS) -> None:
        self.weight, self.bias, self.group, self.gemms = weight, bias, group, gemms

    def forward(self, x: Array) -> tuple[Array, Saved]:
        # narrow dtypes: float32 accumulation
        partial = self.gemms.forward(widen(x).reshape(-1, x.shape[-1]), self.weight.data)
        partial = narrow(partial.reshape(*x.shape[:-1], partial.shape[-1]), x.dtype)  # sent at the compute dtype
        out = self.group.out_of_row_parallel(partial)
        if self.bias is not None:
            out += self.bias.data
        return out, Saved(x=x)

    def backward_input(self, saved: Saved, dout: Array) -> Array:
        saved.dpartial = self.group.out_of_row_parallel_backward(dout)
        dx = self.gemms.input_gradient(widen(saved.dpartial).reshape(-1, dout.shape[-1]), self.weight.data)
        return narrow(dx.reshape(*saved.x.shape), dout.dtype)

    def backward_weights(self, saved: Saved) -> None:
        x, dpartial = widen(saved.x), widen(saved.dpartial).reshape(-1, saved.dpartial.shape[-1])
        self.weight.grad += self.gemms.weight_gradient(x.reshape(-1, x.shape[-1]), dpartial)
        if self.bias is not None:
            self.bias.grad += dpartial.sum(axis=0)
        saved.clear()


# -- vocab-parallel embedding and cross-entropy ---------------------------------------------------------------

class VocabParallelEmbedding(Layer):
    """x = wte[tokens] + wpe[positions] (wpe: GPT-2 only) with wte split by vocabulary rows.

    Each rank looks up the tokens in its slice [vocab_start, vocab_start + V/n) and writes zeros for the
    others; the partial embeddings leave like a row-parallel layer's output (TP: all-reduce of b·s·h; SP:
    reduce-scatter to this rank's sequence slice), then wpe is added to the positions this rank holds.
    Backward: the whole d(x) (SP: all-gathered, in the weight pass) is scattered into this rank's wte rows, and
    summed into wpe.
    """

    def __init__(self, token: Parameter, position: Parameter | None, group: TensorParallelGroup,
                 vocab_start: int) -> None:
        self.token, self.position, self.group, self.vocab_start = token, position, group, vocab_start

    def forward(self, tokens: Array, positions: Array | None = None) -> tuple[Array, Saved]:
        """Embed (B, T) token ids at positions 0 … T−1, or at the distinct `positions` (T,) given (context
        parallelism), or per row (B, T) (packed documents); with SP this rank keeps its slice of the sequence."""
        xp = get_array_module(tokens)
        if positions is None:
            positions = xp.arange(tokens.shape[-1])
        local = tokens - self.vocab_start
        elsewhere = (local < 0) | (local >= self.token.data.shape[0])  # another rank's tokens
        rows = xp.where(elsewhere, 0, local)
        partial = self.token.data[rows]
        partial[elsewhere] = 0
        x = self.group.out_of_row_parallel(partial)
        if self.position is not None:  # GPT-2's learned positions; llama has none (RoPE)
            x += self.position.data[positions[..., self.group.sequence_positions(tokens.shape[-1])]]
        return x, Saved(rows=rows, elsewhere=elsewhere, positions=positions)

    def backward_input(self, saved: Saved, dout: Array) -> None:
        saved.dout = dout
        return None  # token ids have no gradient

    def backward_weights(self, saved: Saved) -> None:
        dpartial = self.group.out_of_row_parallel_backward(saved.dout)  # (B, T, C): the whole sequence
        here = ~saved.elsewhere
        add_rows(self.token.grad, saved.rows[here], dpartial[here])
        if self.position is not None:
            add_position_gradient(self.position.grad, saved.positions, dpartial)
        saved.clear()


class VocabParallelCrossEntropy(Layer):
    """The LM head tied to the vocab-parallel wte, and softmax cross-entropy that never gathers the logits.

    Rank r computes its V/n columns of the logits, x @ wte_rᵀ, from the whole input (TP: f = copy_to_tp;
    SP: all-gather of the final LayerNorm's sequence slices). The softmax needs three numbers per token from
    the whole vocabulary, each an all-reduce over the group: the largest logit (op max), then — in one message —
    the sum of exponentials and the target's logit, which lives on one rank (the others contribute 0).
    Backward is local: d(logits) = (softmax − onehot(target)) / normalizer on this rank's columns; d(wte_r) is
    local too, and d(input) is a partial sum over the vocabulary that `into_column_parallel_backward` reduces.

    Padded vocabulary rows (the last rank's, when n does not divide V) get logit −∞: probability 0, gradient 0.
    A target `IGNORED` (negative: on no rank's slice) adds no loss and a zero row of d(logits).
    """

    def __init__(self, token: Parameter, group: TensorParallelGroup, vocab_start: int, vocab_size: int) -> None:
        self.token, self.group, self.vocab_start = token, group, vocab_start
        self.padding = slice(max(vocab_size - vocab_start, 0), token.data.shape[0])

    def forward(self, x: Array, targets: Array, normalizer: float) -> tuple[float, Saved]:
        xp = get_array_module(x)
        x = self.group.into_column_parallel(x)  # at the compute dtype
        x2d = widen(x).reshape(-1, x.shape[-1])  # the logits and their softmax statistics: float32 or wider
        logits = x2d @ self.token.data.T  # (B·T, V/n): this rank's columns
        logits[:, self.padding] = -xp.inf
        logits -= self.group.all_reduce(logits.max(axis=-1), op="max")[:, None]
        target_rows, target_columns = self._locate_targets(targets.reshape(-1))
        target_logits = xp.zeros(len(logits), logits.dtype)
        target_logits[target_rows] = logits[target_rows, target_columns]
        xp.exp(logits, out=logits)
        sums, target_logits = self.group.all_reduce(xp.stack([logits.sum(axis=-1), target_logits]))
        logits /= sums[:, None]
        ignored = targets.reshape(-1) < 0  # IGNORED
        saved = Saved(x_shape=x.shape, x2d=x2d, probs=logits, dlogits=None, normalizer=normalizer, dtype=x.dtype,
                      target_rows=target_rows, target_columns=target_columns, ignored=ignored)
        token_losses = xp.log(sums) - target_logits
        token_losses[ignored] = 0.0
        return float(token_losses.sum()) / normalizer, saved

    def _locate_targets(self, targets: Array) -> tuple[Array, Array]:
        """The tokens whose target is in this rank's vocabulary slice, and that target's column here."""
        xp = get_array_module(targets)
        local = targets - self.vocab_start
        here = (local >= 0) & (local < self.token.data.shape[0])
        return xp.nonzero(here)[0], local[here]

    @staticmethod
    def _gradient_of_logits(saved: Saved) -> Array:
        """(softmax − onehot(target)) / normalizer on this rank's columns, in place of the probabilities."""
        if saved.dlogits is None:
            dlogits = saved.probs
            dlogits[saved.target_rows, saved.target_columns] -= 1.0
            dlogits /= saved.normalizer
            dlogits[saved.ignored] = 0.0
            saved.dlogits, saved.probs = dlogits, None
        return saved.dlogits

    def backward_input(self, saved: Saved, dout: None = None) -> Array:
        dpartial = (self._gradient_of_logits(saved) @ self.token.data).reshape(saved.x_shape)
        return self.group.into_column_parallel_backward(narrow(dpartial, saved.dtype))

    def backward_weights(self, saved: Saved) -> None:
        self.token.grad += self._gradient_of_logits(saved).T @ saved.x2d
        saved.clear()


# -- how the serial tensors are split ------------------------------------------------------------------------

_SPLITS = {  # name suffix -> how the tp axis cuts it; every other parameter is replicated
    "wte.weight": Sharded(0),  # vocabulary rows
    "lm_head.weight": Sharded(0),  # llama's untied head: vocabulary rows, as wte
    "attn.c_attn.weight": Sharded(1, 3),  # the columns of q, k and v: each C wide, head-major, so split each by heads
    "attn.c_attn.bias": Sharded(0, 3),
    "attn.c_proj.weight": Sharded(0),  # rows = the heads' outputs
    "attn.q_proj.weight": Sharded(1),  # query heads
    "attn.o_proj.weight": Sharded(0),
    "mlp.c_fc.weight": Sharded(1),  # columns = hidden units
    "mlp.c_fc.bias": Sharded(0),
    "mlp.c_proj.weight": Sharded(0),  # rows = hidden units
    "mlp.gate_proj.weight": Sharded(1),  # SwiGLU: gate and up cut alike, so each rank pairs its own units
    "mlp.up_proj.weight": Sharded(1),
    "mlp.down_proj.weight": Sharded(0),
    "attn.q_b_proj.weight": Sharded(1),  # DeepSeek-V3's up-projections: columns by heads
    "attn.kv_b_proj.weight": Sharded(1),
}
_KEY_VALUE = ("attn.k_proj.weight", "attn.v_proj.weight")
_LATENT = ("attn.q_a_proj.weight", "attn.q_a_layernorm.weight", "attn.kv_a_proj_with_mqa.weight",
           "attn.kv_a_layernorm.weight")
"""DeepSeek-V3's down-projections and their norms: replicated, each rank's gradient only its heads' share."""
_MTP_REPLICATED = (".enorm.", ".hnorm.", ".eh_proj.", ".shared_head.norm.")
"""DeepSeek-V3's MTP modules' norms and 2h → h projection: replicated, run on the sequence slice under SP."""


def key_value_replicas(n_kv_head: int, tp: int) -> int:
    """How many TP ranks hold each KV head: 1 when tp divides n_kv (each rank its n_kv/tp heads), tp/n_kv when
    n_kv divides tp (Megatron's rule: each head on tp/n_kv ranks); otherwise one clear ValueError."""
    if n_kv_head % tp == 0:
        return 1
    if tp % n_kv_head == 0:
        return tp // n_kv_head
    raise ValueError(f"tensor parallelism splits the KV heads: n_kv_head ({n_kv_head}) and tp ({tp}) must divide "
                     f"one another (tp ≤ n_kv: each rank holds n_kv/tp heads; tp > n_kv: each head is replicated on "
                     f"tp/n_kv ranks)")


def tensor_parallel_placement(name: str, sequence_parallel: bool = False,
                              key_value_copies: int = 1) -> dict[str, Placement]:
    """How the tp axis holds the parameter called `name`: sharded (see `_SPLITS`; llama's KV projections by KV
    head, each on `key_value_copies` ranks); with SP the norms' gradients are partial sums (each rank normalizes
    only its sequence slice); everything else replicated."""
    if name.endswith(_KEY_VALUE):
        return {TP_AXIS: Sharded(1, replicas=key_value_copies)}
    if name.endswith(_LATENT):
        return {TP_AXIS: PARTIAL}
    for suffix, sharded in _SPLITS.items():
        if name.endswith(suffix):
            return {TP_AXIS: sharded}
    if sequence_parallel and any(part in name for part in (".ln_", ".mlp.router.", ".mlp.experts.",
                                                           ".mlp.shared_experts.", *_MTP_REPLICATED)):
        return {TP_AXIS: PARTIAL}  # replicated, run on this rank's slice: norms, MoE, MTP's eh_proj
    return {}


def check_tensor_parallel_shape(config: GPTConfig, tp: int) -> None:
    """Raise ValueError naming every dimension that tensor parallelism over `tp` ranks cannot split evenly."""
    problems = []
    if config.n_head % tp:
        problems.append(f"n_head ({config.n_head}) divisible by tp ({tp}) (attention is split by heads)")
    if config.ffn_width % tp:
        width = "the SwiGLU width ffn_hidden" if config.is_llama else "the MLP width 4·n_embd"
        problems.append(f"{width} ({config.ffn_width}) divisible by tp ({tp})")
    if problems:
        raise ValueError("tensor parallelism needs " + " and ".join(problems))
    key_value_replicas(config.kv_heads, tp)


# -- the axis: what the model asks of tensor parallelism ------------------------------------------------------

class TensorParallel(TensorAxis):
    """Tensor parallelism over a TP group, as the model asks for it (`models.axis`): applied with
    `Transformer(config, …).parallelize(TensorParallel(tp_comm))`, the model holds this rank's shards and its
    linears, embedding and cross-entropy are the parallel layers above; forward, backward (over any range of
    units) and state loading are the serial model's.

    `forward` returns the same loss on every rank of the group (every rank holds the whole batch's tokens);
    `parameters()` and `state_dict()` are this rank's shards (`Parameter.placement` says how each was cut);
    `full_state_dict` gathers the serial tensors. The initial values are the serial model's, cut, so every tp
    starts from, and computes, the same numbers. `algo` picks the algorithm of every TP collective ("ring" makes
    the byte counts exactly the textbook's).

    With SP the LayerNorms' gradients are partial sums over the group (placement `Partial` on "tp"): sum them
    once per optimizer step, after the last microbatch's backward (`reduce_partial_gradients`).
    """

    def __init__(self, tp_comm: Any, sequence_parallel: bool = False, algo: str = "auto") -> None:
        self.group = TensorParallelGroup(tp_comm, sequence_parallel, algo)
        self.comm, self.rank, self.size = self.group.comm, self.group.rank, self.group.size
        self.sequence_shards = self.size if sequence_parallel else 1
        self.key_value_copies = 1

    def sequence_groups(self) -> list[Any]:
        return [self.comm] if self.group.sequence_parallel else []  # SP: each rank routes its slice of a sequence

    def fit(self, config: GPTConfig) -> None:
        check_tensor_parallel_shape(config, self.size)
        self.n_head, self.n_kv_head = config.n_head, config.kv_heads
        self.vocab_size = config.vocab_size
        self.key_value_copies = key_value_replicas(config.kv_heads, self.size)
        # the ranks that hold the same KV heads sum those heads' weight gradients (None: no copies)
        self.key_value_group = (self.comm.split(self.rank // self.key_value_copies, self.rank)
                                if self.key_value_copies > 1 else None)

    def placement(self, name: str) -> dict[str, Placement]:
        return tensor_parallel_placement(name, self.group.sequence_parallel, self.key_value_copies)

    def check_tokens(self, length: int) -> None:
        if length % self.sequence_shards:
            raise ValueError(f"sequence parallelism splits the sequence over tp ranks: sequence length {length} "
                             f"must be divisible by tp ({self.sequence_shards})")

    def embedding(self, model: Any) -> VocabParallelEmbedding:
        token = model.params["transformer.wte.weight"]
        return VocabParallelEmbedding(token, model.params.get("transformer.wpe.weight"), self.group,
                                      self._vocab_start(token))

    def cross_entropy(self, model: Any) -> VocabParallelCrossEntropy:
        head = model.head_weight()
        return VocabParallelCrossEntropy(head, self.group, self._vocab_start(head), self.vocab_size)

    def _vocab_start(self, table: Parameter) -> int:
        """The first vocabulary row of this rank's shard of a [vocab, n_embd] table (wte or lm_head)."""
        return self.rank * table.data.shape[0]

    def column_parallel(self, layer: Layer) -> ColumnParallelLayer:
        return ColumnParallelLayer(layer, self.group)

    def row_parallel(self, model: Any, prefix: str) -> RowParallelLinear:
        return RowParallelLinear(*model.weight_and_bias(prefix), self.group, gemms=model.gemms)

    def concatenated(self, model: Any, prefixes: list[str], key_value: bool = False) -> ColumnParallelLayer:
        """Column-parallel projections of one input (entering the group once); KV heads held on several ranks sum
        their weight gradients over those ranks."""
        weights = [model.params[f"{prefix}.weight"] for prefix in prefixes]
        groups = [None] * len(weights)
        if key_value:
            groups[-2:] = [self.key_value_group] * 2
        return ColumnParallelLayer(model.narrowed(ConcatenatedLinear(weights, groups, gemms=model.gemms)),
                                   self.group)

    def enter_attention(self, attention: Layer) -> ColumnParallelLayer:
        """DeepSeek-V3's latent attention enters the group once, as a whole: its replicated down-projections and
        this rank's heads of its up-projections all read the one input; its o_proj is row-parallel."""
        return ColumnParallelLayer(attention, self.group)

    def heads(self, n_head: int) -> int:
        return n_head // self.size

    def kv_heads(self, n_kv_head: int) -> int:
        return max(n_kv_head // self.size, 1)


def full_state_dict(model: Transformer, comm: Any = None) -> dict[str, Array]:
    """The serial model's state dict (names and shapes of `Transformer.state_dict()`, vocabulary padding dropped),
    gathered on every rank of the TP group `comm` (default: the model's): one all-gather per sharded tensor."""
    tensors = {name: param.data for name, param in model.params.items()}
    return gather_over_model_axes(tensors, model.params, {TP_AXIS: model.tp.comm if comm is None else comm})
