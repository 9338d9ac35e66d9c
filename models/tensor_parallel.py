"""Megatron tensor parallelism (TP) with a vocab-parallel embedding and cross-entropy, and Megatron sequence
parallelism (SP) — the same GPT-2 as `models.gpt.GPT`, its weights split over the n ranks of a TP group.

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

A transformer block is the serial `models.layers.Block` with its four linears replaced by `ColumnParallelLinear`
and `RowParallelLinear`; LayerNorm, attention, GELU and MLP are the serial classes, run on local shards.

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
sent; backward 2 all-reduces of S (the d(input) of c_attn and c_fc), the same again. With SP forward is
2 × (all-gather + reduce-scatter) of S, (n−1)/n·S each, so 2·2(n−1)/n·S — the volume of the all-reduces it
replaces — and backward the same. Once per step besides: the embedding (forward all-reduce of S; SP:
reduce-scatter forward, all-gather backward), the head's input (backward all-reduce of S; SP: all-gather forward,
reduce-scatter backward), the cross-entropy (all-reduce of the row maxima, b·s elements, and one of the row
sums of exponentials together with the target logits, 2·b·s) and, with SP, one all-reduce of the LayerNorm
gradients ((4·n_layer + 2)·h elements, `reduce_replicated_gradients`). Weights per rank: 12h²/n per block plus
V·h/n for the embedding.

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
  partial sums: call `reduce_replicated_gradients(model.sequence_parallel_parameters(), tp_comm)` once per
  optimizer step, after the last microbatch's backward (Megatron does this when it finishes the gradients; it
  must not run per microbatch, or the gradient accumulated so far would be summed n times). It commutes with the
  data-parallel gradient reduction (both are sums over disjoint rank sets). The row-parallel biases and wpe are
  added to sequence slices too, but their gradients are summed from the all-gathered d(output) the layer needs
  anyway, so they are complete on every rank.
- The vocabulary is padded with zero rows to a multiple of n; the padded logits are −∞, so their probabilities,
  their gradients and their weights stay exactly zero, and `gather_tensor` drops them: loss, gradients and
  checkpoints equal the unpadded serial model's.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from collectives import Communicator, all_gather, all_reduce, reduce_scatter
from collectives.backend import Array, get_array_module, scatter_add

from .gpt import GPT, GPTConfig, initial_value, parameter_shapes
from .layers import MLP, Block, CausalSelfAttention, LayerNorm, Linear
from .parameter import Parameter

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

class ColumnParallelLinear:
    """y_r = x @ W[:, columns_r] + b[columns_r]: rank r computes its columns of the output from the whole input.

    The local math is `models.layers.Linear` on the shard; the input enters through `into_column_parallel`
    (TP: nothing forward, all-reduce of d(input) backward; SP: all-gather forward, reduce-scatter backward).
    """

    def __init__(self, weight: Parameter, bias: Parameter, group: TensorParallelGroup) -> None:
        self.local, self.group = Linear(weight, bias), group

    def forward(self, x: Array) -> Array:
        return self.local.forward(self.group.into_column_parallel(x))

    def backward_input(self, dout: Array) -> Array:
        return self.group.into_column_parallel_backward(self.local.backward_input(dout))

    def backward_weights(self, dout: Array) -> None:
        self.local.backward_weights(dout)  # the input it saw is the gathered one: no communication

    def backward(self, dout: Array) -> Array:
        self.backward_weights(dout)
        return self.backward_input(dout)


class RowParallelLinear:
    """y = Σ_r x_r @ W[rows_r, :] + b: rank r multiplies its slice of the input features by its rows of W; the
    partial products leave through `out_of_row_parallel` (TP: all-reduce; SP: reduce-scatter), then the
    replicated bias is added once — which is why `Linear`, whose forward adds the bias, is not reused here.

    Backward: the gradient of every partial product is the whole d(output) (TP: held by every rank; SP:
    all-gathered). `backward_input` fetches it and `backward_weights` reuses it, so call them in that order (as
    every layer in models.layers). The bias gradient is summed from that whole d(output), so it is complete on
    every rank even when the bias was added to a sequence slice.
    """

    def __init__(self, weight: Parameter, bias: Parameter, group: TensorParallelGroup) -> None:
        self.weight, self.bias, self.group = weight, bias, group

    def forward(self, x: Array) -> Array:
        self.x = x
        partial = x.reshape(-1, x.shape[-1]) @ self.weight.data
        out = self.group.out_of_row_parallel(partial.reshape(*x.shape[:-1], partial.shape[-1]))
        out += self.bias.data
        return out

    def backward_input(self, dout: Array) -> Array:
        self._dpartial = self.group.out_of_row_parallel_backward(dout)
        dx = self._dpartial.reshape(-1, dout.shape[-1]) @ self.weight.data.T
        return dx.reshape(*self.x.shape)

    def backward_weights(self, dout: Array) -> None:
        dpartial = self._dpartial.reshape(-1, dout.shape[-1])
        self.weight.grad += self.x.reshape(-1, self.x.shape[-1]).T @ dpartial
        self.bias.grad += dpartial.sum(axis=0)

    def backward(self, dout: Array) -> Array:
        dx = self.backward_input(dout)
        self.backward_weights(dout)
        return dx


# -- vocab-parallel embedding and cross-entropy ---------------------------------------------------------------

class VocabParallelEmbedding:
    """x = wte[tokens] + wpe[positions] with wte split by vocabulary rows.

    Each rank looks up the tokens in its slice [vocab_start, vocab_start + V/n) and writes zeros for the
    others; the partial embeddings leave like a row-parallel layer's output (TP: all-reduce of b·s·h; SP:
    reduce-scatter to this rank's sequence slice), then wpe is added to the positions this rank holds.
    Backward: the whole d(x) (SP: all-gathered) is scattered into this rank's wte rows, and summed into wpe.
    """

    def __init__(self, token: Parameter, position: Parameter, group: TensorParallelGroup, vocab_start: int) -> None:
        self.token, self.position, self.group, self.vocab_start = token, position, group, vocab_start

    def forward(self, tokens: Array) -> Array:
        xp = get_array_module(tokens)
        local = tokens - self.vocab_start
        self.elsewhere = (local < 0) | (local >= self.token.data.shape[0])  # another rank's tokens
        self.rows = xp.where(self.elsewhere, 0, local)
        partial = self.token.data[self.rows]
        partial[self.elsewhere] = 0
        x = self.group.out_of_row_parallel(partial)
        x += self.position.data[self.group.sequence_positions(tokens.shape[-1])]
        return x

    def backward_input(self, dout: Array) -> None:
        return None  # token ids have no gradient

    def backward_weights(self, dout: Array) -> None:
        dpartial = self.group.out_of_row_parallel_backward(dout)  # (B, T, C): the whole sequence
        here = ~self.elsewhere
        scatter_add(self.token.grad, self.rows[here], dpartial[here])
        self.position.grad[:dpartial.shape[-2]] += dpartial.sum(axis=0)

    def backward(self, dout: Array) -> None:
        self.backward_weights(dout)


class VocabParallelCrossEntropy:
    """The LM head tied to the vocab-parallel wte, and softmax cross-entropy that never gathers the logits.

    Rank r computes its V/n columns of the logits, x @ wte_rᵀ, from the whole input (TP: f = copy_to_tp;
    SP: all-gather of the final LayerNorm's sequence slices). The softmax needs three numbers per token from
    the whole vocabulary, each an all-reduce over the group: the largest logit (op max), then — in one message —
    the sum of exponentials and the target's logit, which lives on one rank (the others contribute 0).
    Backward is local: d(logits) = (softmax − onehot(target)) / normalizer on this rank's columns; d(wte_r) is
    local too, and d(input) is a partial sum over the vocabulary that `into_column_parallel_backward` reduces.

    Padded vocabulary rows (the last rank's, when n does not divide V) get logit −∞: probability 0, gradient 0.
    """

    def __init__(self, token: Parameter, group: TensorParallelGroup, vocab_start: int, vocab_size: int) -> None:
        self.token, self.group, self.vocab_start = token, group, vocab_start
        self.padding = slice(max(vocab_size - vocab_start, 0), token.data.shape[0])

    def forward(self, x: Array, targets: Array, normalizer: float) -> float:
        xp = get_array_module(x)
        x = self.group.into_column_parallel(x)
        self.x_shape, self.x2d = x.shape, x.reshape(-1, x.shape[-1])
        self.normalizer = normalizer
        logits = self.x2d @ self.token.data.T  # (B·T, V/n): this rank's columns
        logits[:, self.padding] = -xp.inf
        logits -= self.group.all_reduce(logits.max(axis=-1), op="max")[:, None]
        self._locate_targets(targets.reshape(-1))
        target_logits = xp.zeros(len(logits), logits.dtype)
        target_logits[self.target_rows] = logits[self.target_rows, self.target_columns]
        xp.exp(logits, out=logits)
        sums, target_logits = self.group.all_reduce(xp.stack([logits.sum(axis=-1), target_logits]))
        logits /= sums[:, None]
        self.probs, self.dlogits = logits, None
        return float((xp.log(sums) - target_logits).sum()) / normalizer

    def _locate_targets(self, targets: Array) -> None:
        """The tokens whose target is in this rank's vocabulary slice, and that target's column here."""
        xp = get_array_module(targets)
        local = targets - self.vocab_start
        here = (local >= 0) & (local < self.token.data.shape[0])
        self.target_rows = xp.nonzero(here)[0]
        self.target_columns = local[here]

    def _gradient_of_logits(self) -> Array:
        """(softmax − onehot(target)) / normalizer on this rank's columns, in place of the probabilities."""
        if self.dlogits is None:
            dlogits = self.probs
            dlogits[self.target_rows, self.target_columns] -= 1.0
            dlogits /= self.normalizer
            self.dlogits, self.probs = dlogits, None
        return self.dlogits

    def backward_input(self) -> Array:
        dpartial = (self._gradient_of_logits() @ self.token.data).reshape(self.x_shape)
        return self.group.into_column_parallel_backward(dpartial)

    def backward_weights(self) -> None:
        self.token.grad += self._gradient_of_logits().T @ self.x2d

    def backward(self) -> Array:
        dx = self.backward_input()
        self.backward_weights()
        return dx


# -- how the serial tensors are split ------------------------------------------------------------------------

_SPLITS = {  # name suffix -> (dim, blocks); every other parameter is replicated
    "wte.weight": (0, 1),  # vocabulary rows
    "attn.c_attn.weight": (1, 3),  # the columns of q, k and v: each C wide, head-major, so split each by heads
    "attn.c_attn.bias": (0, 3),
    "attn.c_proj.weight": (0, 1),  # rows = the heads' outputs
    "mlp.c_fc.weight": (1, 1),  # columns = hidden units
    "mlp.c_fc.bias": (0, 1),
    "mlp.c_proj.weight": (0, 1),  # rows = hidden units
}


def tensor_parallel_split(name: str) -> tuple[str, int, int] | None:
    """The shard spec (`Parameter.split`) of the parameter called `name` under tensor parallelism."""
    for suffix, (dim, blocks) in _SPLITS.items():
        if name.endswith(suffix):
            return (TP_AXIS, dim, blocks)
    return None


def padded_length(length: int, blocks: int, size: int) -> int:
    """`length` split into `blocks` equal blocks, each padded to a multiple of `size`: the padded total."""
    per_block = length // blocks
    return blocks * (-(-per_block // size) * size)


def shard_tensor(full: Array, split: tuple[str, int, int] | None, rank: int, size: int) -> Array:
    """Rank `rank`'s shard of the full tensor (a copy): its piece of every block of dimension `dim`, after
    zero-padding each block to a multiple of `size` (only the vocabulary ever needs it)."""
    xp = get_array_module(full)
    if split is None:
        return full.copy()
    _, dim, blocks = split
    moved = xp.moveaxis(full, dim, 0)
    rest = moved.shape[1:]
    by_block = moved.reshape(blocks, moved.shape[0] // blocks, *rest)
    padded = padded_length(moved.shape[0], blocks, size) // blocks
    if padded > by_block.shape[1]:
        padding = xp.zeros((blocks, padded - by_block.shape[1], *rest), full.dtype)
        by_block = xp.concatenate([by_block, padding], axis=1)
    piece = padded // size
    shard = by_block[:, rank * piece:(rank + 1) * piece].reshape(blocks * piece, *rest)
    return xp.ascontiguousarray(xp.moveaxis(shard, 0, dim))


def gather_tensor(shard: Array, split: tuple[str, int, int] | None, comm: Any, shape: tuple[int, ...]) -> Array:
    """The full tensor of serial `shape` from every rank's shard (one all-gather; padding dropped), on every rank.
    The inverse of `shard_tensor`."""
    xp = get_array_module(shard)
    if split is None:
        return shard.copy()
    comm = Communicator.of(comm)
    _, dim, blocks = split
    moved = xp.ascontiguousarray(xp.moveaxis(shard, dim, 0))
    rest, piece = moved.shape[1:], moved.shape[0] // blocks
    gathered = all_gather(moved, comm).reshape(comm.size, blocks, piece, *rest)
    by_block = gathered.swapaxes(0, 1).reshape(blocks, comm.size * piece, *rest)
    full = by_block[:, :shape[dim] // blocks].reshape(shape[dim], *rest)
    return xp.ascontiguousarray(xp.moveaxis(full, 0, dim))


def check_tensor_parallel_shape(config: GPTConfig, tp: int) -> None:
    """Raise ValueError naming every dimension that tensor parallelism over `tp` ranks cannot split evenly."""
    problems = []
    if config.n_head % tp:
        problems.append(f"n_head ({config.n_head}) divisible by tp ({tp}) (attention is split by heads)")
    if 4 * config.n_embd % tp:
        problems.append(f"the MLP width 4·n_embd ({4 * config.n_embd}) divisible by tp ({tp})")
    if problems:
        raise ValueError("tensor parallelism needs " + " and ".join(problems))


def reduce_replicated_gradients(params: list[Parameter], comm: Any, algo: str = "auto") -> None:
    """Sum over the TP group the gradients of replicated parameters that each rank computed from its sequence
    slice only (with SP: the LayerNorms, `TensorParallelGPT.sequence_parallel_parameters()`).

    One all-reduce of their concatenation (2(n−1)/n of (4·n_layer + 2)·h elements). Call it once per optimizer
    step, after every microbatch's backward: it sums whatever `grad` holds, so a second call double-counts.
    """
    if not params:
        return
    xp = get_array_module(params[0].grad)
    total = all_reduce(xp.concatenate([param.grad.reshape(-1) for param in params]), comm, algo=algo)
    offset = 0
    for param in params:
        param.grad[...] = total[offset:offset + param.grad.size].reshape(param.grad.shape)
        offset += param.grad.size


# -- the model -----------------------------------------------------------------------------------------------

class TensorParallelGPT(GPT):
    """GPT-2 over a TP group: `models.gpt.GPT` with parallel layers in place of the serial ones.

    Forward, backward, the hook calls and `units()` are inherited unchanged: only the layers differ.

    `forward` returns the same loss on every rank of the group (every rank holds the whole batch's tokens);
    `parameters()` and `state_dict()` are this rank's shards (`Parameter.split` says how each was cut);
    `full_state_dict` gathers the serial tensors. The initial values are the serial model's (drawn whole from
    `models.gpt.initial_value`, then cut), so every tp starts from, and computes, the same numbers. `algo`
    picks the algorithm of every TP collective ("ring" makes the byte counts exactly the textbook's).
    """

    def __init__(self, config: GPTConfig, tp_comm: Any, seed: int = 0, dtype: Any = np.float32,
                 sequence_parallel: bool = False, algo: str = "auto", xp: Any = np) -> None:
        self.group = TensorParallelGroup(tp_comm, sequence_parallel, algo)
        self.comm, tp = self.group.comm, self.group.size
        check_tensor_parallel_shape(config, tp)
        self.config = config
        self.params = {name: self._shard(name, initial_value(name, shape, config, seed, dtype), xp)
                       for name, shape in parameter_shapes(config).items()}
        p = self.params
        vocab_start = self.group.rank * p["transformer.wte.weight"].data.shape[0]
        self.embedding = VocabParallelEmbedding(p["transformer.wte.weight"], p["transformer.wpe.weight"],
                                                self.group, vocab_start)
        self.blocks = [self._block(i) for i in range(config.n_layer)]
        self.ln_f = LayerNorm(p["transformer.ln_f.weight"], p["transformer.ln_f.bias"])
        self.head = VocabParallelCrossEntropy(p["transformer.wte.weight"], self.group, vocab_start,
                                              config.vocab_size)

    def _shard(self, name: str, full: np.ndarray, xp: Any) -> Parameter:
        split = tensor_parallel_split(name)
        return Parameter(name, xp.asarray(shard_tensor(full, split, self.group.rank, self.group.size)), split)

    def _block(self, i: int) -> Block:
        def weight_and_bias(name: str) -> tuple[Parameter, Parameter]:
            return self.params[f"transformer.h.{i}.{name}.weight"], self.params[f"transformer.h.{i}.{name}.bias"]

        group = self.group
        # the serial attention and MLP classes, with parallel linears in place of theirs (same methods)
        attention = CausalSelfAttention(ColumnParallelLinear(*weight_and_bias("attn.c_attn"), group),
                                        RowParallelLinear(*weight_and_bias("attn.c_proj"), group),
                                        self.config.n_head // group.size)
        mlp = MLP(ColumnParallelLinear(*weight_and_bias("mlp.c_fc"), group),
                  RowParallelLinear(*weight_and_bias("mlp.c_proj"), group))
        return Block(LayerNorm(*weight_and_bias("ln_1")), attention, LayerNorm(*weight_and_bias("ln_2")), mlp)

    def sequence_parallel_parameters(self) -> list[Parameter]:
        """The parameters whose gradient is a partial sum over the TP group (see `reduce_replicated_gradients`):
        the LayerNorms' with SP, none without."""
        if not self.group.sequence_parallel:
            return []
        return [param for name, param in self.params.items() if ".ln_" in name]

    def check_tokens(self, tokens: Array) -> None:
        length = tokens.shape[-1]
        if length > self.config.n_positions:
            raise ValueError(f"sequence length {length} exceeds n_positions {self.config.n_positions}")
        if self.group.sequence_parallel and length % self.group.size:
            raise ValueError(f"sequence parallelism splits the sequence over tp ranks: sequence length {length} "
                             f"must be divisible by tp ({self.group.size})")

    def generate(self, *args: Any, **kwargs: Any) -> Array:
        raise NotImplementedError("sample from the serial model: GPT(config).load_state_dict(full_state_dict(...))")

    def state_dict(self) -> dict[str, Array]:
        """Hugging Face name -> this rank's shard (`full_state_dict` gathers the serial tensors)."""
        return {name: param.data for name, param in self.params.items()}

    def load_state_dict(self, tensors: dict[str, Array]) -> None:
        """Copy in full (serial) tensors by name, keeping this rank's shards; names may omit `transformer.`."""
        by_short_name = {name.removeprefix("transformer."): value for name, value in tensors.items()}
        shapes = parameter_shapes(self.config)
        for name, param in self.params.items():
            value = by_short_name.get(name.removeprefix("transformer."))
            if value is None:
                raise ValueError(f"checkpoint has no tensor {name}")
            if tuple(value.shape) != shapes[name]:
                raise ValueError(f"checkpoint tensor {name} has shape {tuple(value.shape)}, "
                                 f"the model expects {shapes[name]}")
            param.data[...] = shard_tensor(get_array_module(param.data).asarray(value), param.split,
                                           self.group.rank, self.group.size)


def full_state_dict(model: TensorParallelGPT, comm: Any = None) -> dict[str, Array]:
    """The serial model's state dict (names and shapes of `GPT.state_dict()`, vocabulary padding dropped),
    gathered on every rank of the TP group `comm` (default: the model's): one all-gather per sharded tensor."""
    comm = model.comm if comm is None else comm
    shapes = parameter_shapes(model.config)
    return {name: gather_tensor(param.data, param.split, comm, shapes[name]) for name, param in model.params.items()}
