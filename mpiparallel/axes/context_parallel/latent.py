"""Context parallelism (CP) for multi-head latent attention: ring, all-gather and Ulysses, moving the compressed latent.

A CP rank holds two zigzag chunks of every sequence (`context_parallel`: chunks r and 2·cp−1−r of 2·cp, c
tokens each). Its queries must see the keys and values of every earlier position. MLA's keys and values are
functions of one small vector per token — the normalized latent c (r channels) and the rotated RoPE key (d_r),
576 numbers in DeepSeek-V3 against 128·(192 + 128) = 40,960 for its expanded per-head K and V — so this variant
all-gathers that vector, [c | k_rope], rotated at each token's global position before it leaves, and every rank
expands the whole sequence's k_nope and v itself with kv_b_proj:

    forward    all-gather of (B, s/cp, r + d_r) → (B, s, r + d_r) in sequence order     (cp−1)/cp·b·s·(r + d_r)
    backward   reduce-scatter of d(B, s, r + d_r) back to the ranks that own the tokens   (cp−1)/cp·b·s·(r + d_r)

(elements sent per rank and layer with the ring algorithms; the K/V variants of `attention` send
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
heads) divisible by cp.

Ring (`RingLatentAttention`) passes the same [latent | RoPE key] blocks around the CP ring instead of gathering
them (`context_parallel.RingAttention`'s schedule, its online softmax and causal chunk pairs): each rank
expands the block in hand to its heads' keys and values, attends, and lets it go, so no rank holds more than one
block's keys at a time; backward passes the blocks around again with their rows' gradients (float32 or wider):

    forward    (cp−1)/cp·b·s·(r + d_r)           backward   (cp−1)/cp·b·s·(r + d_r) + b·s·(r + d_r) gradients
"""

from __future__ import annotations

from typing import Any

import numpy as np

from collectives import Communicator
from collectives.backend import Array, get_array_module
from models.documents import ONE_DOCUMENT
from models.latent_attention import LatentAttention
from models.layers import Layer, Saved, row_sums
from models.precision import Narrowed, narrow, narrow_saved, widen, widen_saved

from .attention import (
    KEY_VALUE_GRADIENT_TAG,
    HeadsToSequence,
    OnlineSoftmax,
    OnlineSoftmaxBackward,
    RingAttention,
    _chunk,
    gather_keys_values,
    gather_keys_values_backward,
    heads_to_sequence,
    sequence_to_heads,
    zigzag_chunks,
    zigzag_positions,
    zigzag_split,
    zigzag_unsplit,
)


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


class RingLatentAttention(LatentAttention):
    """MLA with ring attention over the CP group `comm`: the compressed [latent | RoPE key] blocks travel around
    the ring (`context_parallel.RingAttention`'s schedule), and each rank expands every block it holds to
    keys and values with kv_b_proj, attends its two chunks to it (the online softmax, the causal chunk pairs) and
    lets it go; backward passes the blocks around again with the gradients of their rows. Per rank and layer
    (elements): forward (cp−1)·b·(s/cp)·(r + d_r), backward (2cp−1)·b·(s/cp)·(r + d_r). Each rank runs kv_b_proj
    over all s positions (as the all-gather variant does), but holds only one block of them at a time; its
    weight gradient is accumulated during the input pass (a small r × H·(d_n + d_v) buffer, added in the weight
    pass). `kv_up` must be a bias-free `Linear` (optionally `Narrowed`)."""

    input_pass_only = ("q", "keys", "merged", "log_sum_exp")

    def __init__(self, *args: Any, comm: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.comm = Communicator.of(comm)
        self.chunks = zigzag_chunks(self.comm.rank, self.comm.size)
        self.ring = RingAttention(None, None, self.n_head, self.comm)  # its schedule of blocks around the ring

    def positions(self, length: int) -> np.ndarray:
        return zigzag_positions(length * self.comm.size, self.comm.rank, self.comm.size)

    def _expanded(self, block: Array) -> tuple[Array, Array]:
        """Keys (B, H, 1, t, d_n + d_r) — k_nope per head beside the shared k_rope — and values (B, H, 1, t, d_v)
        of a [latent | RoPE key] block, shaped as `OnlineSoftmax` reads them (one query head per key head)."""
        xp = get_array_module(block)
        kv = block[..., :self.latent_dim] @ widen(self.kv_up.weight.data)
        k_nope, v = self._keys_values(kv)
        k_rope = xp.broadcast_to(block[:, None, :, self.latent_dim:], (*k_nope.shape[:3], self.rope_dim))
        return xp.concatenate((k_nope, k_rope), axis=-1)[:, :, None], v[:, :, None]

    def _pairs(self, source: int, chunk: int, documents: Any) -> list[tuple[int, int, bool, int]]:
        return self.ring._pairs(source, chunk, documents)

    def forward(self, x: Array, documents: Any = ONE_DOCUMENT) -> tuple[Array, Saved]:
        q, query = self.query.forward(x)
        if q.shape[1] % 2:
            raise ValueError(f"context-parallel attention takes this rank's two zigzag chunks: local length "
                             f"{q.shape[1]} must be even (the sequence length divisible by 2·cp)")
        compressed, kv_down = self.kv_down.forward(x)
        latent, kv_norm = self.kv_norm.forward(compressed[..., :self.latent_dim])
        dtype, xp = q.dtype, get_array_module(q)
        positions = documents.rotary_positions(self.positions(x.shape[1]))
        k_rope = self._rotated(widen(compressed[..., self.latent_dim:])[:, None], positions)[:, 0]
        keys = narrow(xp.concatenate((widen(latent), k_rope), axis=-1), dtype)  # the block that travels
        q = xp.concatenate(self._queries(widen(q), positions), axis=-1)[:, :, None]  # (B, H, 1, 2c, d_n + d_r)
        merged = xp.empty((*q.shape[:-1], self.value_dim), dtype=q.dtype)
        attention = OnlineSoftmax(q, merged, documents, self.chunks)
        for source, block in self.ring._around_ring(keys):
            block_keys, block_values = self._expanded(widen(block))
            for query_chunk, key, diagonal, key_chunk in self._pairs(source, x.shape[1] // 2, documents):
                attention.add(query_chunk, _chunk(block_keys, key), _chunk(block_values, key), diagonal, key_chunk)
        log_sum_exp = attention.finish()
        merged = merged[:, :, 0].transpose(0, 2, 1, 3).reshape(x.shape[0], x.shape[1], -1)
        out, projection = self.projection.forward(narrow(merged, dtype))
        saved = Saved(query=query, kv_down=kv_down, kv_norm=kv_norm, projection=projection, q=q, keys=keys,
                      merged=merged, log_sum_exp=log_sum_exp, positions=positions, documents=documents)
        narrow_saved(saved, dtype, ("q", "merged"))  # the log-sum-exp is a statistic: float32
        return out, saved

    def backward_input(self, saved: Saved, dout: Array) -> Array:
        dmerged = self.projection.backward_input(saved.projection, dout)
        xp, dtype = get_array_module(dmerged), dmerged.dtype
        widen_saved(saved, ("q", "merged"))
        q, d_n, d_v = saved.q, self.nope_dim, self.value_dim
        batch, heads, _, length, _ = q.shape
        dheads = widen(dmerged).reshape(batch, length, heads, d_v).transpose(0, 2, 1, 3)[:, :, None]
        merged = saved.merged.reshape(batch, length, heads, d_v).transpose(0, 2, 1, 3)[:, :, None]
        dq = xp.zeros_like(q)
        gradients = OnlineSoftmaxBackward(q, saved.log_sum_exp, dheads, row_sums(dheads * merged), dq,
                                          saved.documents, self.chunks)
        weight = widen(self.kv_up.weight.data)
        saved.dweight = xp.zeros_like(weight)
        dkeys_own = xp.zeros(saved.keys.shape, weight.dtype)
        for source, block, dblock in self._blocks_backward(saved.keys, dkeys_own):
            block = widen(block)
            block_keys, block_values = self._expanded(block)
            dblock_keys, dblock_values = xp.zeros_like(block_keys), xp.zeros_like(block_values)
            for query_chunk, key, diagonal, key_chunk in self._pairs(source, length // 2, saved.documents):
                gradients.add(query_chunk, _chunk(block_keys, key), _chunk(block_values, key),
                              _chunk(dblock_keys, key), _chunk(dblock_values, key), diagonal, key_chunk)
            dkv = xp.concatenate((dblock_keys[:, :, 0, :, :d_n], dblock_values[:, :, 0]), axis=-1)
            dkv = dkv.transpose(0, 2, 1, 3).reshape(batch, length, -1)  # up_kv's output layout
            latent_rows = block[..., :self.latent_dim].reshape(-1, self.latent_dim)
            saved.dweight += latent_rows.T @ dkv.reshape(-1, dkv.shape[-1])
            dblock[..., :self.latent_dim] += dkv @ weight.T
            dblock[..., self.latent_dim:] += dblock_keys[:, :, 0, :, d_n:].sum(axis=1)
        dq = dq[:, :, 0] * self.softmax_scale
        dq_rope = self._rotated_back(xp.ascontiguousarray(dq[..., d_n:]), saved.positions)
        dq = xp.concatenate((dq[..., :d_n], dq_rope), axis=-1).transpose(0, 2, 1, 3).reshape(batch, length, -1)
        dk_rope = self._rotated_back(dkeys_own[:, None, :, self.latent_dim:], saved.positions)[:, 0]
        for name in self.input_pass_only:
            delattr(saved, name)
        dlatent = self.kv_norm.backward_input(saved.kv_norm, narrow(dkeys_own[..., :self.latent_dim], dtype))
        dcompressed = xp.concatenate((dlatent, narrow(dk_rope, dtype).astype(dlatent.dtype, copy=False)), axis=-1)
        dx = self.kv_down.backward_input(saved.kv_down, dcompressed)
        dx += self.query.backward_input(saved.query, narrow(dq, dtype))
        return dx

    def _blocks_backward(self, keys: Array, dkeys: Array) -> Any:
        """The ring's backward schedule: every block with the gradient of its rows that travels with it."""
        xp = get_array_module(dkeys)
        comm = self.comm
        dblock = xp.zeros_like(dkeys)
        for source, block in self.ring._around_ring(keys):
            yield source, block, dblock
            if comm.size > 1:
                dblock = comm.sendrecv(dblock, (comm.rank + 1) % comm.size, xp.empty_like(dblock),
                                       (comm.rank - 1) % comm.size, KEY_VALUE_GRADIENT_TAG)
        dkeys[...] = dblock

    def backward_weights(self, saved: Saved) -> None:
        self.projection.backward_weights(saved.projection)
        weight = self.kv_up.weight
        weight.grad += saved.dweight.astype(weight.grad.dtype, copy=False)
        self.kv_norm.backward_weights(saved.kv_norm)
        self.kv_down.backward_weights(saved.kv_down)
        self.query.backward_weights(saved.query)
        saved.clear()
