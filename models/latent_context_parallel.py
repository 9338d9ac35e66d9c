"""Context parallelism (CP) for multi-head latent attention: all-gather and Ulysses, both moving the compressed latent.

A CP rank holds two zigzag chunks of every sequence (`models.context_parallel`: chunks r and 2·cp−1−r of 2·cp, c
tokens each). Its queries must see the keys and values of every earlier position. MLA's keys and values are
functions of one small vector per token — the normalized latent c (r channels) and the rotated RoPE key (d_r),
576 numbers in DeepSeek-V3 against 128·(192 + 128) = 40,960 for its expanded per-head K and V — so this variant
all-gathers that vector, [c | k_rope], rotated at each token's global position before it leaves, and every rank
expands the whole sequence's k_nope and v itself with kv_b_proj:

    forward    all-gather of (B, s/cp, r + d_r) → (B, s, r + d_r) in sequence order     (cp−1)/cp·b·s·(r + d_r)
    backward   reduce-scatter of d(B, s, r + d_r) back to the ranks that own the tokens   (cp−1)/cp·b·s·(r + d_r)

(elements sent per rank and layer with the ring algorithms; the K/V variants of `models.context_parallel` send
2(cp−1)/cp·b·s·h_kv forward and twice that backward, here h_kv = H·(d_n + d_v) per token once expanded). K and
V never travel, so their different head widths (d_n + d_r against d_v) need no care on the wire. The price is
compute: each rank runs kv_b_proj over all s positions (cp times the serial FLOPs of that one projection), and
kv_b_proj's weight gradient on each rank is its queries' share, summed over the CP group with the other
gradients (as every CP gradient is). The gathered latent and the expanded k_nope and v (b·s·H·(d_n + d_v)) are
kept for backward.

Attention itself is the serial layer's, run over two query spans: the early chunk's queries over keys 0 … their
positions, the late chunk's likewise — the causal mask by global position, the key blocks in each span's future
skipped as in the serial layer. RoPE rotates the queries at their global (zigzag) positions.

Ulysses (`UlyssesLatentAttention`) shares the heads out instead: each rank computes the queries of its tokens
for all its heads and sends them by heads (an all-to-all, as DeepSpeed's Ulysses does), gathers the compressed
latent as above, and expands only its H/cp heads' k_nope and v for all s positions — kv_b_proj's columns of those
heads, so no projection is computed twice — then attends those heads over the whole sequence (the serial layer:
query blocks, selective recomputation) and sends the output back by sequence (the reverse all-to-all):

    forward    all-to-all of q (cp−1)/cp²·b·s·H·(d_n + d_r); all-gather of the latent (cp−1)/cp·b·s·(r + d_r);
               all-to-all of the output (cp−1)/cp²·b·s·H·d_v
    backward   the same three, reversed (the latent's a reduce-scatter)

Queries and values travel at their own widths (d_n + d_r against d_v); keys never travel. Needs H (this rank's
heads) divisible by cp. Ring attention is not implemented for MLA (one clear error).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from collectives import Communicator
from collectives.backend import Array

from .context_parallel import (
    HeadsToSequence,
    gather_keys_values,
    gather_keys_values_backward,
    heads_to_sequence,
    sequence_to_heads,
    zigzag_chunks,
    zigzag_positions,
    zigzag_split,
    zigzag_unsplit,
)
from .latent_attention import LatentAttention
from .layers import Layer, Saved
from .precision import Narrowed


class GatheredLatentAttention(LatentAttention):
    """`LatentAttention` over the CP group `comm`, its [latent | RoPE key] rows all-gathered (see the module
    docstring); `algo` picks the all-gather and reduce-scatter algorithm. Other arguments as `LatentAttention`."""

    def __init__(self, *args: Any, comm: Any, algo: str = "auto", **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.comm, self.algo = Communicator.of(comm), algo

    def positions(self, length: int) -> np.ndarray:
        return zigzag_positions(length * self.comm.size, self.comm.rank, self.comm.size)

    def query_spans(self, length: int) -> list[tuple[int, int, int]]:
        if length % 2:
            raise ValueError(f"context-parallel attention takes this rank's two zigzag chunks: local length {length} "
                             f"must be even (the sequence length divisible by 2·cp)")
        chunk = length // 2
        early, late = zigzag_chunks(self.comm.rank, self.comm.size)
        return [(0, chunk, early * chunk), (chunk, length, late * chunk)]

    def gather_keys(self, latent_keys: Array) -> Array:
        return zigzag_unsplit(gather_keys_values(latent_keys, self.comm, self.algo))

    def gather_keys_backward(self, dkeys: Array) -> Array:
        return gather_keys_values_backward(zigzag_split(dkeys, self.comm.size), self.comm, self.algo)


class QueriesToHeads(Layer):
    """The query projection of this rank's tokens, then `sequence_to_heads`: all s positions of this rank's H/cp
    heads. Backward: `heads_to_sequence`, then the projection's."""

    def __init__(self, query: Any, comm: Communicator, n_head: int, algo: str = "auto") -> None:
        self.query, self.comm, self.head_counts, self.algo = query, comm, (n_head,), algo

    def forward(self, x: Array) -> tuple[Array, Saved]:
        q, saved = self.query.forward(x)
        return sequence_to_heads(q, self.comm, self.head_counts, self.algo), saved

    def backward_input(self, saved: Saved, dout: Array) -> Array:
        return self.query.backward_input(saved, heads_to_sequence(dout, self.comm, self.head_counts, self.algo))

    def backward_weights(self, saved: Saved) -> None:
        self.query.backward_weights(saved)


class HeadColumns(Layer):
    """x @ W[:, columns]: a linear of the columns of a block of heads (kv_b_proj's for this CP rank's heads), its
    weight gradient added into those columns only (the CP ranks' gradient sum completes the others)."""

    def __init__(self, weight: Any, columns: slice) -> None:
        self.weight, self.columns = weight, columns

    def forward(self, x: Array) -> tuple[Array, Saved]:
        out = x.reshape(-1, x.shape[-1]) @ self.weight.data[:, self.columns]
        return out.reshape(*x.shape[:-1], out.shape[-1]), Saved(x=x)

    def backward_input(self, saved: Saved, dout: Array) -> Array:
        saved.dout = dout
        dx = dout.reshape(-1, dout.shape[-1]) @ self.weight.data[:, self.columns].T
        return dx.reshape(*dout.shape[:-1], dx.shape[-1])

    def backward_weights(self, saved: Saved) -> None:
        x2d = saved.x.reshape(-1, saved.x.shape[-1])
        self.weight.grad[:, self.columns] += x2d.T @ saved.dout.reshape(-1, saved.dout.shape[-1])
        saved.clear()


class UlyssesLatentAttention(GatheredLatentAttention):
    """MLA with Ulysses over the CP group `comm` (see the module docstring). Takes `LatentAttention`'s layers
    for all of this rank's H heads (`n_head`); attends H/cp of them. `kv_up` must be a bias-free `Linear` (its
    weight's columns of this rank's heads are used)."""

    def __init__(self, query: Any, kv_down: Any, kv_norm: Any, kv_up: Any, projection: Any, n_head: int,
                 *args: Any, comm: Any, algo: str = "auto", **kwargs: Any) -> None:
        comm = Communicator.of(comm)
        if n_head % comm.size:
            raise ValueError(f"ulysses attention splits this rank's heads over the cp ranks: n_head ({n_head}; "
                             f"n_head/tp with tensor parallelism) must be divisible by cp ({comm.size})")
        heads = n_head // comm.size
        nope_dim, value_dim = args[0], args[2]
        width = heads * (nope_dim + value_dim)
        local_up = HeadColumns(kv_up.weight, slice(comm.rank * width, (comm.rank + 1) * width))
        if isinstance(kv_up, Narrowed):  # mixed precision: computed in float32 as kv_up would be
            local_up = Narrowed(local_up, kv_up.dtype)
        super().__init__(QueriesToHeads(query, comm, n_head, algo), kv_down, kv_norm, local_up,
                         HeadsToSequence(projection, comm, n_head, algo), heads, *args, comm=comm, algo=algo,
                         **kwargs)

    def query_positions(self, length: int) -> np.ndarray:
        return np.arange(length)

    def query_spans(self, length: int) -> list[tuple[int, int, int]]:
        return [(0, length, 0)]
