"""Multi-head latent attention (MLA): DeepSeek-V2/V3's attention, with hand-written forward and backward.

MLA compresses the keys and values of a token into one latent vector of kv_lora_rank channels, shared by all
heads, plus one RoPE key of qk_rope_head_dim channels, also shared; a KV cache then holds r + d_r numbers per
token (576 in DeepSeek-V3) instead of 2·n_head·head_dim. The math, per token x (h channels), H heads:

    queries      q = up_q(RMSNorm(down_q(x)))  (q_a_proj, q_a_layernorm, q_b_proj)   or  q = W_q·x (q_proj,
                 when q_lora_rank is null); per head [q_nope (d_n) | q_rope (d_r)]
    latent       [c | k_rope] = down_kv(x)      (kv_a_proj_with_mqa: h → r + d_r)
                 [k_nope (d_n) | v (d_v)] per head = up_kv(RMSNorm(c))   (kv_a_layernorm, kv_b_proj: r → H·(d_n + d_v))
    positions    q_rope and k_rope rotated by RoPE (`models.rotary`; interleaved channel pairs when
                 `interleaved`, transformers' `rope_interleave`); k_rope is one key for every head
    scores       s_ij = scale · (q_nope_i · k_nope_j + q_rope_i · k_rope_j),  scale = 1/√(d_n + d_r), times
                 YaRN's correction when the rope is scaled
    output       o_proj(softmax_causal(s) · v): H·d_v → h

Query/key heads (d_n + d_r) are wider than value heads (d_v): the scores are the sum of two products, the no-RoPE
part per head and the RoPE part against the shared key, so the keys are never expanded to H heads of d_n + d_r
(transformers copies k_rope into every head; the numbers are the same). Backward runs the same two products the
other way: d(k_rope) sums the heads' contributions, like a grouped-query KV head shared by H query heads.

Attention runs in blocks of `query_block` query rows, each multiplying only the keys it may see (as
`models.layers.CausalSelfAttention`); `keep_probabilities=False` (selective recomputation) keeps no softmax
probabilities and recomputes each block's in backward. The queries come in spans of consecutive positions
(`query_spans`: one here, a context-parallel rank's two zigzag chunks there), each block seeing the keys from
position 0 to its own; the keys are the [latent | RoPE key] rows `gather_keys` returns (this rank's own
here; `mpiparallel.axes.context_parallel.latent` gathers them from the CP group). `forward_incremental` decodes
with a cache of the normalized latent and the rotated RoPE key — the compressed cache — and expands the keys and
values from it.

Saved per layer and microbatch (elements; b·s tokens): the query path's (x, and with the low-rank query its
down output, norm and up input: b·s·(2·r_q + 2)), the KV path's (x, c's norm, up input: b·s·(2r + 2)), the
scaled rotated queries b·s·H·(d_n + d_r), k_nope and v as views into up_kv's output b·s·H·(d_n + d_v), the
rotated k_rope b·s·d_r (and the [latent | k_rope] rows, up_kv's input, b·s·(r + d_r)), the merged output
b·s·H·d_v, and the probabilities (none with selective recomputation).

Same protocol as `models.layers`: forward / backward_input / backward_weights over a caller-held `Saved`, so a
zero-bubble schedule may run the weight pass late. Communication: none (the tensor-parallel model splits the
up-projections by heads and o_proj by rows; the down-projections and their norms are replicated).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import numpy as np

from collectives.backend import Array, get_array_module

from .documents import ONE_DOCUMENT, add_mask
from .layers import (
    QUERY_BLOCK,
    KVCache,
    Layer,
    Saved,
    add_key_products,
    causal_softmax,
    query_blocks,
    row_dots,
    seen_keys,
    softmax_backward,
)
from .precision import narrow, narrow_saved, widen, widen_saved
from .rotary import RotaryEmbedding, halves_to_pairs, pairs_to_halves


class LowRankProjection(Layer):
    """up(RMSNorm(down(x))): DeepSeek's low-rank query path (q_a_proj → q_a_layernorm → q_b_proj). Three layers
    in a row, each with its own `Saved`; backward runs them in reverse."""

    def __init__(self, down: Any, norm: Any, up: Any) -> None:
        self.down, self.norm, self.up = down, norm, up

    def forward(self, x: Array) -> tuple[Array, Saved]:
        compressed, down = self.down.forward(x)
        normed, norm = self.norm.forward(compressed)
        out, up = self.up.forward(normed)
        return out, Saved(down=down, norm=norm, up=up)

    def backward_input(self, saved: Saved, dout: Array) -> Array:
        dnormed = self.up.backward_input(saved.up, dout)
        return self.down.backward_input(saved.down, self.norm.backward_input(saved.norm, dnormed))

    def backward_weights(self, saved: Saved) -> None:
        self.up.backward_weights(saved.up)
        self.norm.backward_weights(saved.norm)
        self.down.backward_weights(saved.down)
        saved.clear()


class LatentAttention(Layer):
    """Multi-head latent attention (see the module docstring).

    `query` maps x to the (…, H·(d_n + d_r)) queries (a `Linear`, or a `LowRankProjection`); `kv_down` x to
    [c | k_rope] (…, r + d_r); `kv_norm` normalizes c; `kv_up` maps it to (…, H·(d_n + d_v)), per head
    [k_nope | v]; `projection` is o_proj. `n_head` counts this rank's heads (n_head/tp under tensor parallelism).
    `softmax_scale` defaults to 1/√(d_n + d_r).
    """

    input_pass_only = ("q_nope", "q_rope", "k_nope", "k_rope", "v", "merged", "probs")

    def __init__(self, query: Any, kv_down: Any, kv_norm: Any, kv_up: Any, projection: Any, n_head: int,
                 nope_dim: int, rope_dim: int, value_dim: int, rope: RotaryEmbedding, interleaved: bool = True,
                 softmax_scale: float | None = None, query_block: int = QUERY_BLOCK,
                 keep_probabilities: bool = True) -> None:
        if query_block < 1:
            raise ValueError(f"query_block must be at least 1, got {query_block}")
        if rope.head_dim != rope_dim:
            raise ValueError(f"the rotary embedding turns {rope.head_dim} channels, the RoPE heads have {rope_dim}")
        self.query, self.kv_down, self.kv_norm, self.kv_up, self.projection = query, kv_down, kv_norm, kv_up, projection
        self.n_head, self.nope_dim, self.rope_dim, self.value_dim = n_head, nope_dim, rope_dim, value_dim
        self.rope, self.interleaved = rope, interleaved
        self.softmax_scale = softmax_scale or 1.0 / math.sqrt(nope_dim + rope_dim)
        self.query_block, self.keep_probabilities = query_block, keep_probabilities

    @property
    def latent_dim(self) -> int:
        """r = kv_lora_rank: the compressed KV channels (kv_down's output without the RoPE key)."""
        return self.kv_norm.weight.data.shape[0]

    def positions(self, length: int) -> np.ndarray:
        """The global positions of the `length` tokens of a forward (0 … length−1)."""
        return np.arange(length)

    def query_positions(self, length: int) -> np.ndarray:
        """The global positions of the `length` queries attention sees (those of the tokens here; Ulysses sees
        every position of its heads)."""
        return self.positions(length)

    def query_spans(self, length: int) -> list[tuple[int, int, int]]:
        """(first row, end row, global position of the first row) of each run of consecutive positions among the
        `length` local queries: one run here; a context-parallel rank holds two."""
        return [(0, length, 0)]

    def gather_keys(self, latent_keys: Array) -> Array:
        """The [latent | RoPE key] rows (B, t, r + d_r) of every position the queries may see, in position order,
        from this rank's: its own here (context parallelism gathers them from the other ranks)."""
        return latent_keys

    def gather_keys_backward(self, dkeys: Array) -> Array:
        """The backward of `gather_keys`: d(this rank's rows) from d(every gathered row)."""
        return dkeys

    # -- forward -----------------------------------------------------------------------------------------------

    def forward(self, x: Array, documents: Any = ONE_DOCUMENT) -> tuple[Array, Saved]:
        """Attention of the (B, t, C) tokens here, each over the earlier ones of its document (`models.documents`;
        by default the window is one)."""
        q, query = self.query.forward(x)
        compressed, kv_down = self.kv_down.forward(x)
        latent, kv_norm = self.kv_norm.forward(compressed[..., :self.latent_dim])
        dtype = q.dtype  # the compute dtype: narrow ones are widened for the math, rounded for what is kept
        positions = documents.rotary_positions(self.positions(x.shape[1]))
        query_positions = documents.rotary_positions(self.query_positions(q.shape[1]))
        spans = self.query_spans(q.shape[1])
        k_rope = self._rotated(widen(compressed[..., self.latent_dim:])[:, None], positions)[:, 0]
        xp = get_array_module(latent)
        keys = self.gather_keys(xp.concatenate((latent, narrow(k_rope, dtype)), axis=-1))
        kv, kv_up = self.kv_up.forward(keys[..., :self.latent_dim])
        q_nope, q_rope = self._queries(widen(q), query_positions)
        k_nope, v = self._keys_values(widen(kv))
        k_rope = widen(keys[..., self.latent_dim:])[:, None]
        merged, probs = self._attend(q_nope, q_rope, k_nope, k_rope, v, spans, self.keep_probabilities, documents)
        out, projection = self.projection.forward(narrow(merged, dtype))
        saved = Saved(query=query, kv_down=kv_down, kv_norm=kv_norm, kv_up=kv_up, projection=projection,
                      q_nope=q_nope, q_rope=q_rope, k_nope=k_nope, k_rope=k_rope, v=v, merged=merged, probs=probs,
                      positions=positions, query_positions=query_positions, spans=spans, documents=documents)
        narrow_saved(saved, dtype, self.input_pass_only)
        return out, saved

    def _queries(self, q: Array, positions: np.ndarray) -> tuple[Array, Array]:
        """(B, H, t, d_n) and (B, H, t, d_r) queries from the (B, t, H·(d_n + d_r)) projection: scaled by the
        softmax scale (b·t·H·d numbers rather than the b·H·t·t scores), the RoPE part rotated."""
        batch, length = q.shape[:2]
        heads = q.reshape(batch, length, self.n_head, self.nope_dim + self.rope_dim).transpose(0, 2, 1, 3)
        q_nope = heads[..., :self.nope_dim] * self.softmax_scale
        q_rope = self._rotated(heads[..., self.nope_dim:], positions)
        q_rope *= self.softmax_scale
        return q_nope, q_rope

    def _rotated(self, x: Array, positions: np.ndarray) -> Array:
        """A rotated copy of (B, heads, t, d_r) RoPE channels (interleaved pairs first reordered to halves)."""
        turned = pairs_to_halves(x) if self.interleaved else x.copy()
        self.rope.rotate(turned, positions)
        return turned

    def _keys_values(self, kv: Array) -> tuple[Array, Array]:
        """k_nope (B, H, T, d_n) and v (B, H, T, d_v): views into up_kv's (B, T, H·(d_n + d_v)) output."""
        batch, length = kv.shape[:2]
        heads = kv.reshape(batch, length, self.n_head, self.nope_dim + self.value_dim).transpose(0, 2, 1, 3)
        return heads[..., :self.nope_dim], heads[..., self.nope_dim:]

    def _blocks(self, spans: list[tuple[int, int, int]]) -> list[tuple[slice, int]]:
        """(query rows, global position of the first) of every query block of every span: block rows see the
        keys at positions 0 … position + rows − 1, the later ones being in their future (FlashAttention skips
        the same blocks)."""
        return [(slice(first + start, first + stop), position + start)
                for first, end, position in spans for start, stop in query_blocks(end - first, self.query_block)]

    def _blocks_seeing(self, documents: Any, batch: int,
                       spans: list[tuple[int, int, int]]) -> Iterator[tuple[slice, slice, slice, Any]]:
        """(batch rows, query rows, the keys they see, those rows' documents) of every block, in order: `_blocks`
        for all rows at once, or for each row apart with packed documents (`models.layers.attention_blocks`)."""
        for batch_rows in documents.row_groups(batch):
            here = documents.rows(batch_rows)
            for rows, position in self._blocks(spans):
                yield batch_rows, rows, seen_keys(here, position, position + rows.stop - rows.start), here

    def _attend(self, q_nope: Array, q_rope: Array, k_nope: Array, k_rope: Array, v: Array,
                spans: list[tuple[int, int, int]], keep: bool,
                documents: Any = ONE_DOCUMENT) -> tuple[Array, list[Array] | None]:
        """softmax(scores)·v of the queries, each over the keys from its document's first (position 0 for one
        document) to its own, merged to (B, t, H·d_v); also each query block's probabilities if `keep`."""
        xp = get_array_module(q_nope)
        batch, n_head, queries, _ = q_nope.shape
        merged = xp.empty((batch, queries, n_head, self.value_dim), dtype=q_nope.dtype)
        heads = merged.transpose(0, 2, 1, 3)  # written through by the products
        kept = [] if keep else None
        for b, rows, keys, here in self._blocks_seeing(documents, batch, spans):
            probs = self._probabilities(q_nope[b][..., rows, :], q_rope[b][..., rows, :], k_nope[b], k_rope[b], keys,
                                        here)
            xp.matmul(probs, v[b][..., keys, :], out=heads[b][..., rows, :])
            if keep:
                kept.append(probs)
        return merged.reshape(batch, queries, n_head * self.value_dim), kept

    @staticmethod
    def _probabilities(q_nope: Array, q_rope: Array, k_nope: Array, k_rope: Array, keys: slice,
                       documents: Any) -> Array:
        """Softmax of a block of query rows, the last of keys.stop positions, over the `keys` they may see (a
        key after its query or before its document's start masked out): the no-RoPE scores per head plus the
        RoPE scores against the one shared key (broadcast over the heads)."""
        scores = q_nope @ k_nope[..., keys, :].swapaxes(-1, -2)
        scores += q_rope @ k_rope[..., keys, :].swapaxes(-1, -2)
        position = keys.stop - q_nope.shape[-2]  # the first query row's
        add_mask(scores, documents, np.arange(position, keys.stop), np.arange(keys.start, keys.stop))
        return causal_softmax(scores, offset=position - keys.start)

    # -- backward ----------------------------------------------------------------------------------------------

    def backward_input(self, saved: Saved, dout: Array) -> Array:
        dmerged = self.projection.backward_input(saved.projection, dout)
        dq, dkv, dk_rope = self._backward_to_projections(saved, dmerged)
        for name in self.input_pass_only:
            delattr(saved, name)
        dlatent = self.kv_up.backward_input(saved.kv_up, dkv)
        xp = get_array_module(dlatent)
        dkeys = self.gather_keys_backward(xp.concatenate((dlatent, dk_rope.astype(dlatent.dtype)), axis=-1))
        dk_rope = self._rotated_back(widen(dkeys[..., self.latent_dim:])[:, None], saved.positions)[:, 0]
        dlatent = self.kv_norm.backward_input(saved.kv_norm, dkeys[..., :self.latent_dim])
        dcompressed = xp.concatenate((dlatent, dk_rope.astype(dlatent.dtype, copy=False)), axis=-1)
        dx = self.kv_down.backward_input(saved.kv_down, dcompressed)
        dx += self.query.backward_input(saved.query, dq)
        return dx

    def _backward_to_projections(self, saved: Saved, dmerged: Array) -> tuple[Array, Array, Array]:
        """d(queries) (B, t, H·(d_n + d_r)), d(up_kv output) (B, s, H·(d_n + d_v)) and d(rotated RoPE key)
        (B, s, d_r) of the s key positions, in the projections' layouts and dtype, from d(merged heads)."""
        xp, dtype = get_array_module(dmerged), dmerged.dtype
        dmerged = widen(dmerged)
        widen_saved(saved, self.input_pass_only)
        batch, length, _ = dmerged.shape
        keys_length = saved.v.shape[2]
        n_head, d_n, d_r, d_v = self.n_head, self.nope_dim, self.rope_dim, self.value_dim
        dheads = dmerged.reshape(batch, length, n_head, d_v).transpose(0, 2, 1, 3)
        # Σ_j p_ij·dp_ij = dy_i·y_i (FlashAttention's identity): a pass over (B, T, H·d_v), not (B, H, T, T)
        heads = (batch, length, n_head, d_v)
        weighted_sum = row_dots(dmerged.reshape(heads), saved.merged.reshape(heads)).transpose(0, 2, 1, 3)
        dq = xp.empty((batch, length, n_head, d_n + d_r), dmerged.dtype)
        dq_nope = dq.transpose(0, 2, 1, 3)[..., :d_n]
        dq_rope = xp.empty((batch, n_head, length, d_r), dmerged.dtype)
        # zeroed: a key no query block sees keeps 0 (a key one sees is written by the first, added to by the rest)
        dkv = xp.zeros((batch, keys_length, n_head, d_n + d_v), dmerged.dtype)
        # a group axis of one (every head its own key) for add_key_products: (B, H, 1, s, d)
        dk_nope, dv = dkv.transpose(0, 2, 1, 3)[:, :, None, :, :d_n], dkv.transpose(0, 2, 1, 3)[:, :, None, :, d_n:]
        dk_rope = xp.zeros((batch, 1, 1, keys_length, d_r), dmerged.dtype)  # one key for all H heads: a group of H
        q_nope, q_rope, k_nope, k_rope, v = saved.q_nope, saved.q_rope, saved.k_nope, saved.k_rope, saved.v
        group, furthest = None, 0  # the furthest key the group's earlier blocks reached
        for index, (b, rows, keys, here) in enumerate(self._blocks_seeing(saved.documents, batch, saved.spans)):
            if b != group:
                group, furthest = b, 0
            # the keys earlier blocks saw get added to; the rest, this block's own, are written (add_key_products)
            reached = max(min(furthest, keys.stop) - keys.start, 0)
            furthest = max(furthest, keys.stop)
            probs = (saved.probs[index] if saved.probs is not None
                     else self._probabilities(q_nope[b][..., rows, :], q_rope[b][..., rows, :], k_nope[b], k_rope[b],
                                              keys, here))
            dout = dheads[b][..., rows, :]
            add_key_products(dv[b][..., keys, :], probs.swapaxes(-1, -2)[:, :, None], dout[:, :, None], reached)
            dprobs = dout @ v[b][..., keys, :].swapaxes(-1, -2)
            dscores = softmax_backward(probs, dprobs, weighted_sum[b][..., rows, :])
            xp.matmul(dscores, k_nope[b][..., keys, :], out=dq_nope[b][..., rows, :])
            xp.matmul(dscores, k_rope[b][..., keys, :], out=dq_rope[b][..., rows, :])
            key_scores = dscores.swapaxes(-1, -2)  # d(k) takes no scale: q holds it
            add_key_products(dk_nope[b][..., keys, :], key_scores[:, :, None], q_nope[b][:, :, None, rows], reached)
            add_key_products(dk_rope[b][..., keys, :], key_scores[:, None], q_rope[b][:, None, :, rows], reached)
        dq_nope *= self.softmax_scale
        dq_rope *= self.softmax_scale
        dq[..., d_n:] = self._rotated_back(dq_rope, saved.query_positions).transpose(0, 2, 1, 3)
        return (narrow(dq.reshape(batch, length, -1), dtype), narrow(dkv.reshape(batch, keys_length, -1), dtype),
                narrow(dk_rope[:, 0, 0], dtype))

    def _rotated_back(self, dx: Array, positions: np.ndarray) -> Array:
        """The backward of `_rotated`: turned back, then (interleaved) reordered to the projection's channels."""
        self.rope.rotate_back(dx, positions)
        return halves_to_pairs(dx) if self.interleaved else dx

    def backward_weights(self, saved: Saved) -> None:
        self.projection.backward_weights(saved.projection)
        self.kv_up.backward_weights(saved.kv_up)
        self.kv_norm.backward_weights(saved.kv_norm)
        self.kv_down.backward_weights(saved.kv_down)
        self.query.backward_weights(saved.query)
        saved.clear()

    # -- inference ---------------------------------------------------------------------------------------------

    def forward_incremental(self, x: Array, cache: KVCache) -> Array:
        """Inference: attention of the new positions `x` (B, t, C) over the cached ones and their own, appending
        theirs to `cache`. The cache holds the compressed latent — RMSNorm(c) (B, 1, L, r) in its keys slot and
        the rotated RoPE key (B, 1, L, d_r) in its values slot — and the keys and values are expanded from it.
        Nothing is kept for backward."""
        start, length = cache.length, x.shape[1]
        positions = np.arange(start, start + length)
        compressed = self.kv_down.forward(x)[0]
        latent = self.kv_norm.forward(compressed[..., :self.latent_dim])[0]
        k_rope = self._rotated(compressed[..., self.latent_dim:][:, None], positions)
        latents, rope_keys = cache.append(latent[:, None], k_rope)
        k_nope, v = self._keys_values(self.kv_up.forward(latents[:, 0])[0])
        q_nope, q_rope = self._queries(self.query.forward(x)[0], positions)
        merged, _ = self._attend(q_nope, q_rope, k_nope, rope_keys, v, [(0, length, start)], keep=False)
        return self.projection.forward(merged)[0]
