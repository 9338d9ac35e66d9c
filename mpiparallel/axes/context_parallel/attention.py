"""Context parallelism (CP): causal self-attention over a sequence split across the cp ranks of a CP group.

Everything but attention works token by token, so a CP rank runs the rest of the block on its own tokens only;
attention is the one place where tokens meet, and this module holds the three ways of letting them meet. Each
is a layer with `CausalSelfAttention`'s protocol and ingredients (the fused qkv `Linear` and the projection, with
`n_head` heads: this rank's heads, n_head/tp under tensor parallelism), so a block can swap it in; each computes
exactly the numbers full causal attention computes on the whole sequence.

Layout (zigzag). A sequence of s tokens is cut into 2·cp chunks of c = s/(2·cp) tokens; CP rank r holds chunks
r and 2·cp−1−r, in that order, as its (B, 2c, C) activation. Under the causal mask chunk i attends to i + 1
chunks, so a rank holding one early and one late chunk has 2·cp + 1 chunks of keys to attend to in all — the
same on every rank, where a contiguous split (rank r holding chunks 2r and 2r+1) gives rank r 4r + 3
(`causal_chunk_pairs` counts them). `zigzag_positions` are a rank's global positions (for the position
embedding); `zigzag_shard` / `zigzag_split` / `zigzag_unsplit` move (B, s, …) arrays between sequence order and
the ranks' pieces.

The variants (s: whole sequence length, b: batch, h: this rank's attention channels = n_head · head_dim; volumes in
elements sent per rank and layer, times the dtype's size for bytes; the ring and pairwise algorithms of the
collectives send exactly these, others may send more):

    variant      moves                               forward               backward              chunk pairs
    ring         K/V around the ring (p2p),          2(cp−1)·bsh/cp        2(2cp−1)·bsh/cp       2cp+1, all heads
                 dK/dV with them in backward
    all-gather   all-gather K/V (Llama 3);           2(cp−1)·bsh/cp        4(cp−1)·bsh/cp        2cp+1, all heads
                 backward: again, + reduce-scatter
    ulysses      all-to-all sequence → heads         4(cp−1)·bsh/cp²       4(cp−1)·bsh/cp²       cp(2cp+1) per head,
                 and back (DeepSpeed)                                                             n_head/cp heads

Grouped-query attention (llama, n_kv KV heads of d channels): ring and all-gather move only the KV heads, so
read h_kv = n_kv·d for h in their rows; Ulysses moves q (h), the KV heads (h_kv' = max(n_kv, cp)·d: with fewer
KV heads than CP ranks each travels in cp/n_kv copies, their gradients summed back) and the output (h), so
2(cp−1)·bs(h + h_kv')/cp² each way. RoPE rotates q and k at each token's global (zigzag) position before the
K/V blocks leave (ring, all-gather) or, for Ulysses, after the all-to-all restored sequence order.

A chunk pair is one (query chunk, key chunk) product of c × c scores per head; two of each rank's 2cp+1 are the
diagonal ones, half masked. Ulysses computes the same number of scores (cp(2cp+1) pairs of n_head/cp heads). Its
volume falls with cp², the others' do not; ring overlaps its transfers with attention, all-gather does not.

Communication, named like Megatron's mappings (forward here, its backward twin under it):

    function / generator          forward                                  backward
    RingAttention._around_ring    K/V blocks passed to the next CP rank    K/V again, dK/dV passed with them
    gather_keys_values            all-gather of the K/V blocks             reduce-scatter of their gradients
    sequence_to_heads             all-to-all (B, s/cp, H) → (B, s, H/cp)    heads_to_sequence (the reverse)
    heads_to_sequence             all-to-all (B, s, H/cp) → (B, s/cp, H)    sequence_to_heads

Ring and all-gather share their attention: the online softmax (FlashAttention's), which attends the local
queries to one block of keys at a time and merges the blocks by the log-sum-exp rule, so the blocks may come in
any order and from anywhere. Forward keeps the log-sum-exp of every query row (b·2c·n_head numbers) instead of
any probabilities, and backward rebuilds each pair's probabilities from it — they never keep probabilities
(`keep_probabilities` is for Ulysses, whose attention is the serial `CausalSelfAttention`). What each keeps for
backward is this rank's q and K/V (3·b·2c·h) and output — a 1/cp share of the serial layer's, nothing of length s.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import numpy as np

from collectives import Communicator, all_gather, all_to_all, reduce_scatter
from collectives.backend import Array, HostStaging, get_array_module
from models.documents import ONE_DOCUMENT, add_mask
from models.layers import (
    QUERY_BLOCK,
    CausalSelfAttention,
    Layer,
    ProjectedAttention,
    Saved,
    group_sum,
    grouped,
    row_dots,
    row_sums,
    softmax_backward,
)
from models.precision import narrow, narrow_saved, widen, widen_saved

VARIANTS = ("ring", "all-gather", "ulysses")
KEY_VALUE_TAG, KEY_VALUE_GRADIENT_TAG = 1, 2  # the ring's point-to-point tags, below the collectives' tags


# -- the zigzag layout ----------------------------------------------------------------------------------------

def zigzag_chunks(rank: int, cp: int) -> tuple[int, int]:
    """The two chunks (of 2·cp) CP rank `rank` holds, in the order it holds them: one early, one late."""
    return rank, 2 * cp - 1 - rank


def chunk_length(length: int, cp: int) -> int:
    """Tokens per chunk when a `length`-token sequence is cut into 2·cp chunks."""
    if length % (2 * cp):
        raise ValueError(f"context parallelism cuts the sequence into 2·cp = {2 * cp} chunks (zigzag): "
                         f"sequence length {length} must be divisible by {2 * cp}")
    return length // (2 * cp)


def _chunk_slice(index: int, length: int) -> slice:
    return slice(index * length, (index + 1) * length)


def zigzag_positions(length: int, rank: int, cp: int) -> np.ndarray:
    """The global positions of the tokens CP rank `rank` holds (position ids for the embedding)."""
    c = chunk_length(length, cp)
    return np.concatenate([np.arange(length)[_chunk_slice(chunk, c)] for chunk in zigzag_chunks(rank, cp)])


def zigzag_shard(x: Array, rank: int, cp: int) -> Array:
    """CP rank `rank`'s piece of `x` (B, s, …) in sequence order: its two chunks along axis 1, (B, s/cp, …)."""
    c = chunk_length(x.shape[1], cp)
    return get_array_module(x).concatenate([x[:, _chunk_slice(chunk, c)] for chunk in zigzag_chunks(rank, cp)],
                                           axis=1)


def zigzag_split(x: Array, cp: int) -> Array:
    """Every CP rank's piece of `x` (B, s, …), stacked by rank: (cp, B, s/cp, …)."""
    return get_array_module(x).stack([zigzag_shard(x, rank, cp) for rank in range(cp)])


def zigzag_unsplit(pieces: Array) -> Array:
    """The inverse of `zigzag_split`: the (cp, B, s/cp, …) pieces of every rank back in sequence order."""
    cp, batch, local = pieces.shape[:3]
    c = local // 2
    whole = get_array_module(pieces).empty((batch, cp * local, *pieces.shape[3:]), pieces.dtype)
    for rank in range(cp):
        for index, chunk in enumerate(zigzag_chunks(rank, cp)):
            whole[:, _chunk_slice(chunk, c)] = pieces[rank][:, _chunk_slice(index, c)]
    return whole


def causal_chunk_pairs(query_chunks: tuple[int, ...], key_chunks: tuple[int, ...]) -> list[tuple[int, int, bool]]:
    """The (query chunk, key chunk) products causal attention needs between two ranks' chunks (global indices
    given in holding order): (index into query_chunks, index into key_chunks, diagonal), skipping the pairs
    whose keys are all in the queries' future. A diagonal pair (the same chunk) is masked above its diagonal;
    every other pair is entirely in the past and needs no mask."""
    return [(q, k, query == key) for q, query in enumerate(query_chunks)
            for k, key in enumerate(key_chunks) if key <= query]


def visible_chunk_pairs(query_chunks: tuple[int, ...], key_chunks: tuple[int, ...], chunk: int,
                        documents: Any = ONE_DOCUMENT) -> list[tuple[int, int, bool]]:
    """`causal_chunk_pairs` without the pairs packed documents hide whole (`models.documents`: a document opens
    between the key chunk's last token and the query chunk's first, in every row)."""
    return [(q, k, diagonal) for q, k, diagonal in causal_chunk_pairs(query_chunks, key_chunks)
            if not documents.pair_hidden(query_chunks[q] * chunk, (key_chunks[k] + 1) * chunk - 1)]


def _check_local_length(x: Array) -> None:
    if x.shape[1] % 2:
        raise ValueError(f"context-parallel attention takes this rank's two zigzag chunks: local length "
                         f"{x.shape[1]} must be even (the sequence length divisible by 2·cp)")


# -- attention to blocks of keys, merged by log-sum-exp (ring and all-gather) -----------------------------------

def _heads(x: Array) -> Array:
    """(B, t, H, d) -> the (B, H, t, d) view the per-head products read and write."""
    return x.transpose(0, 2, 1, 3)


def _chunk(x: Array, index: int) -> Array:
    """Local chunk `index` (0: the early one, 1: the late one) of a per-head array whose token axis is the second
    to last ((B, H, 2c, d), or grouped (B, n_kv, g, 2c, d)), a view."""
    return x[..., _chunk_slice(index, x.shape[-2] // 2), :]


def _scores(q: Array, keys: Array, diagonal: bool, documents: Any = ONE_DOCUMENT,
            chunks: tuple[int, int] = (0, 0)) -> Array:
    """q·kᵀ of one chunk pair (q scaled already), −∞ above the diagonal of a diagonal pair (the future) and,
    with packed documents, −∞ where a key lies before its query's document (`chunks`: the pair's global query
    and key chunk indices)."""
    xp = get_array_module(q)
    scores = q @ keys.swapaxes(-1, -2)
    if diagonal:
        scores += xp.triu(xp.full(scores.shape[-2:], -xp.inf, dtype=scores.dtype), k=1)
    chunk = keys.shape[-2]
    query_chunk, key_chunk = chunks
    return add_mask(scores, documents, np.arange(query_chunk * chunk, (query_chunk + 1) * chunk),
                    np.arange(key_chunk * chunk, (key_chunk + 1) * chunk))


class OnlineSoftmax:
    """softmax(q·kᵀ)·v of the local queries over keys that arrive one chunk at a time (FlashAttention's online
    softmax), built per call.

    Per query row it keeps the largest score m seen so far, the sum l of exp(score − m) and the output
    unnormalized, o = Σ exp(score − m)·v. A chunk whose row maximum exceeds m rescales l and o by
    exp(m_old − m_new) before adding its own terms, so chunks may come in any order. `finish` divides o by l and
    returns the log-sum-exp m + log l: exp(score − lse) is then any pair's probability, which is all backward
    needs to rebuild it.
    """

    def __init__(self, q: Array, out: Array, documents: Any = ONE_DOCUMENT, chunks: tuple[int, int] = (0, 1)) -> None:
        """q: (B, n_kv, g, 2c, d) local queries grouped by KV head, scaled by 1/√d; out: the same shape, where
        the output is written; `documents` the packed documents of the whole windows and `chunks` the global
        indices of the two local chunks (for its mask)."""
        xp = get_array_module(q)
        self.q, self.out, self.documents, self.chunks = q, out, documents, chunks
        out[...] = 0
        self.row_max = xp.full((*q.shape[:-1], 1), -xp.inf, dtype=q.dtype)
        self.row_sum = xp.zeros((*q.shape[:-1], 1), dtype=q.dtype)

    def add(self, chunk: int, keys: Array, values: Array, diagonal: bool, key_chunk: int = 0) -> None:
        """Attend the queries of local chunk `chunk` to one chunk of keys and values (B, n_kv, 1, c, d), global
        chunk `key_chunk`."""
        xp = get_array_module(keys)
        row_max, row_sum, out = _chunk(self.row_max, chunk), _chunk(self.row_sum, chunk), _chunk(self.out, chunk)
        exps = _scores(_chunk(self.q, chunk), keys, diagonal, self.documents, (self.chunks[chunk], key_chunk))
        new_max = xp.maximum(row_max, exps.max(axis=-1, keepdims=True))
        # a row whose keys so far all lie before its document (packed documents) sees nothing yet: its maximum
        # stays −∞, and its exponentials shift by 0 (−∞ − (−∞) would be NaN)
        shift = xp.where(xp.isneginf(new_max), 0.0, new_max)
        rescale = xp.exp(row_max - shift)  # 0 on a row's first chunk (m_old = −∞)
        exps -= shift
        xp.exp(exps, out=exps)
        row_sum *= rescale
        row_sum += row_sums(exps)
        out *= rescale
        out += exps @ values
        row_max[...] = new_max

    def finish(self) -> Array:
        """Normalize the output; return the log-sum-exp of every query row (B, H, 2c, 1)."""
        self.out /= self.row_sum
        return self.row_max + get_array_module(self.row_sum).log(self.row_sum)


class OnlineSoftmaxBackward:
    """The gradients of `OnlineSoftmax`, one chunk pair at a time: each pair's probabilities rebuilt from the
    log-sum-exp, d(scores) by `softmax_backward` with FlashAttention's Σ p·dp = dy·y, d(q) accumulated here and
    d(keys), d(values) into the arrays that travel with the keys."""

    def __init__(self, q: Array, log_sum_exp: Array, dout: Array, weighted_sum: Array, dq: Array,
                 documents: Any = ONE_DOCUMENT, chunks: tuple[int, int] = (0, 1)) -> None:
        """q: scaled local queries; dout: d(output); weighted_sum: Σ dout·output per row; dq: zeroed, to add into;
        `documents` and `chunks` as `OnlineSoftmax`'s."""
        self.q, self.log_sum_exp, self.dout, self.weighted_sum, self.dq = q, log_sum_exp, dout, weighted_sum, dq
        self.documents, self.chunks = documents, chunks

    def add(self, chunk: int, keys: Array, values: Array, dkeys: Array, dvalues: Array, diagonal: bool,
            key_chunk: int = 0) -> None:
        xp = get_array_module(keys)
        q, dout, dq = _chunk(self.q, chunk), _chunk(self.dout, chunk), _chunk(self.dq, chunk)
        probs = _scores(q, keys, diagonal, self.documents, (self.chunks[chunk], key_chunk))
        probs -= _chunk(self.log_sum_exp, chunk)
        xp.exp(probs, out=probs)
        dvalues += group_sum(probs.swapaxes(-1, -2) @ dout)
        dscores = softmax_backward(probs, dout @ values.swapaxes(-1, -2), _chunk(self.weighted_sum, chunk))
        dq += dscores @ keys
        dkeys += group_sum(dscores.swapaxes(-1, -2) @ q)  # q holds the scale already


def _queries_and_keys_values(qkv: Array, n_head: int, n_kv_head: int) -> tuple[Array, Array]:
    """From the fused projection's [q | k | v] (B, t, (H + 2·n_kv)·d): q (B, t, H, d) scaled by 1/√d, and the
    K/V block (B, t, 2, n_kv, d) — contiguous copies, because the K/V block is what travels and q is what stays."""
    batch, length, width = qkv.shape
    head_dim = width // (n_head + 2 * n_kv_head)
    q = qkv[..., :n_head * head_dim].reshape(batch, length, n_head, head_dim) * (1.0 / math.sqrt(head_dim))
    kv = qkv[..., n_head * head_dim:].reshape(batch, length, 2, n_kv_head, head_dim)
    return q, get_array_module(qkv).ascontiguousarray(kv)


class KeyValueBlockAttention(ProjectedAttention):
    """Attention of this rank's queries to every CP rank's K/V block, one block at a time; ring and all-gather
    differ only in how the blocks reach this rank and how their gradients return (`_key_value_blocks` and
    `_key_value_blocks_backward`, generators the attention loop pulls from). Backward is `ProjectedAttention`'s
    around `_backward_to_qkv`.

    Grouped-query attention: the blocks carry only the n_kv KV heads (2·b·t·n_kv·d elements, not 2·b·t·h), and
    each is attended by the g = H/n_kv query heads of its group. Rotary positions (`rope`): q and k are rotated
    at this rank's global zigzag positions before the K/V block leaves, so every block arrives rotated."""

    input_pass_only = ("q", "kv", "merged", "log_sum_exp")

    def __init__(self, qkv: Any, projection: Any, n_head: int, comm: Any, n_kv_head: int | None = None,
                 rope: Any = None) -> None:
        self.qkv, self.projection, self.n_head, self.n_kv_head = qkv, projection, n_head, n_kv_head or n_head
        self.rope = rope
        self.comm = Communicator.of(comm)
        self.chunks = zigzag_chunks(self.comm.rank, self.comm.size)

    def _pairs(self, source: int, chunk: int, documents: Any) -> list[tuple[int, int, bool, int]]:
        """(local query chunk, index of the key chunk in `source`'s block, diagonal, the key chunk's global
        index) of every chunk pair this rank computes with `source`'s block."""
        key_chunks = zigzag_chunks(source, self.comm.size)
        return [(query, key, diagonal, key_chunks[key])
                for query, key, diagonal in visible_chunk_pairs(self.chunks, key_chunks, chunk, documents)]

    def _positions(self, local_length: int) -> np.ndarray:
        return zigzag_positions(local_length * self.comm.size, self.comm.rank, self.comm.size)

    def _keys_values(self, block: Array) -> tuple[Array, Array]:
        """Keys and values of a (B, t, 2, n_kv, d) block as (B, n_kv, 1, t, d) views, broadcast over a group."""
        return _heads(block[:, :, 0])[:, :, None], _heads(block[:, :, 1])[:, :, None]

    def forward(self, x: Array, documents: Any = ONE_DOCUMENT) -> tuple[Array, Saved]:
        qkv, qkv_saved = self.qkv.forward(x)  # with SP: the whole of this CP rank's tokens, gathered over tp
        _check_local_length(qkv)
        dtype = qkv.dtype  # narrow compute dtypes: the K/V blocks travel narrow, the math runs in float32
        q, kv = _queries_and_keys_values(widen(qkv), self.n_head, self.n_kv_head)
        if self.rope is not None:
            positions = documents.rotary_positions(self._positions(q.shape[1]))
            self.rope.rotate(_heads(q), positions)
            self.rope.rotate(_heads(kv[:, :, 0]), positions)
        kv = narrow(kv, dtype)
        merged = get_array_module(q).empty_like(q)
        attention = OnlineSoftmax(grouped(_heads(q), self.n_kv_head), grouped(_heads(merged), self.n_kv_head),
                                  documents, self.chunks)
        chunk = q.shape[1] // 2
        for source, block in self._key_value_blocks(kv):
            keys, values = self._keys_values(widen(block))
            for query, key, diagonal, key_chunk in self._pairs(source, chunk, documents):
                attention.add(query, _chunk(keys, key), _chunk(values, key), diagonal, key_chunk)
        log_sum_exp = attention.finish()
        merged = merged.reshape(*q.shape[:2], -1)
        out, projection_saved = self.projection.forward(narrow(merged, dtype))
        saved = Saved(qkv=qkv_saved, projection=projection_saved, q=q, kv=kv, merged=merged, log_sum_exp=log_sum_exp,
                      documents=documents)
        narrow_saved(saved, dtype, ("q", "merged"))  # the log-sum-exp is a statistic: float32
        return out, saved

    def _backward_to_qkv(self, saved: Saved, dmerged: Array) -> Array:
        """d(qkv) (B, t, (H + 2·n_kv)·d) from d(merged heads): d(q) here, d(K/V) of this rank's block from
        wherever its keys were attended to."""
        xp, dtype = get_array_module(dmerged), dmerged.dtype
        dmerged = widen(dmerged)
        widen_saved(saved, ("q", "merged"))
        q, n_kv = saved.q, self.n_kv_head
        batch, length, n_head, head_dim = q.shape
        dmerged = dmerged.reshape(q.shape)
        weighted_sum = grouped(_heads(row_dots(dmerged, saved.merged.reshape(q.shape))), n_kv)
        dqkv = xp.zeros((batch, length, (n_head + 2 * n_kv) * head_dim), q.dtype)
        dq = dqkv[..., :n_head * head_dim].reshape(q.shape)
        dkv = dqkv[..., n_head * head_dim:].reshape(batch, length, 2, n_kv, head_dim)
        documents = saved.documents
        gradients = OnlineSoftmaxBackward(grouped(_heads(q), n_kv), saved.log_sum_exp, grouped(_heads(dmerged), n_kv),
                                          weighted_sum, grouped(_heads(dq), n_kv), documents, self.chunks)
        for source, block, dblock in self._key_value_blocks_backward(saved.kv, dkv):
            keys, values = self._keys_values(widen(block))
            dkeys, dvalues = self._keys_values(dblock)
            for query, key, diagonal, key_chunk in self._pairs(source, length // 2, documents):
                gradients.add(query, _chunk(keys, key), _chunk(values, key), _chunk(dkeys, key),
                              _chunk(dvalues, key), diagonal, key_chunk)
        dq *= 1.0 / math.sqrt(head_dim)
        if self.rope is not None:
            positions = documents.rotary_positions(self._positions(length))
            self.rope.rotate_back(_heads(dq), positions)
            self.rope.rotate_back(_heads(dkv[:, :, 0]), positions)
        return narrow(dqkv, dtype)

    def _key_value_blocks(self, kv: Array) -> Iterator[tuple[int, Array]]:
        """(source rank, its K/V block (B, t, 2, H, d)) for every CP rank, this rank's own `kv` among them."""
        raise NotImplementedError

    def _key_value_blocks_backward(self, kv: Array, dkv: Array) -> Iterator[tuple[int, Array, Array]]:
        """(source rank, its K/V block, the zeroed-or-partial gradient of that block to add into) for every CP
        rank; at the end this rank's own complete d(K/V) is written into `dkv`."""
        raise NotImplementedError


class RingAttention(KeyValueBlockAttention):
    """Ring attention over the CP group, zigzag layout: the K/V blocks travel around the ring while each rank
    attends to the block in hand.

    Step k of cp: rank r holds the block of rank r − k; it posts the nonblocking send of that block to rank r + 1
    and the receive of the next from rank r − 1, attends its queries to the block in hand (the online softmax,
    fully masked chunk pairs skipped), then waits. Backward passes the K/V blocks around again, and with each the
    gradient of its keys and values: rank r adds its pairs' share and hands it on (a blocking exchange after the
    compute), so after cp exchanges every d(K/V) is back with its owner, complete.

    Per rank and layer (h: this rank's attention channels, elements): forward cp − 1 sends of the 2·b·(s/cp)·h
    K/V block, 2(cp−1)·bsh/cp; backward cp − 1 K/V sends and cp d(K/V) sends, 2(2cp−1)·bsh/cp. Every rank computes
    2cp + 1 chunk pairs (c × c scores per head, c = s/2cp), two of them diagonal.
    """

    def _around_ring(self, kv: Array) -> Iterator[tuple[int, Array]]:
        """Every rank's K/V block, this rank's first: while the caller attends to one, it is on its way to the
        next rank and the following one is on its way here."""
        xp, comm = get_array_module(kv), self.comm
        rank, cp = comm.rank, comm.size
        spare = [xp.empty_like(kv) for _ in range(min(cp - 1, 2))]  # receive into one while the other is sent
        block = kv
        for step in range(cp - 1):
            arriving, staging = spare[step % 2], HostStaging()  # a host mirror for a device array, if MPI needs one
            requests = [comm.irecv(staging.incoming(arriving), (rank - 1) % cp, KEY_VALUE_TAG),
                        comm.isend(block, (rank + 1) % cp, KEY_VALUE_TAG)]
            yield (rank - step) % cp, block
            for request in requests:
                request.Wait()
            staging.finish()
            block = arriving
        yield (rank + 1) % cp, block

    def _key_value_blocks(self, kv: Array) -> Iterator[tuple[int, Array]]:
        yield from self._around_ring(kv)

    def _key_value_blocks_backward(self, kv: Array, dkv: Array) -> Iterator[tuple[int, Array, Array]]:
        xp, comm = get_array_module(kv), self.comm
        dblock = xp.zeros_like(kv)
        for source, block in self._around_ring(kv):
            yield source, block, dblock
            if comm.size > 1:  # hand on the gradient of the block just used; the last hop takes it home
                dblock = comm.sendrecv(dblock, (comm.rank + 1) % comm.size, xp.empty_like(dblock),
                                       (comm.rank - 1) % comm.size, KEY_VALUE_GRADIENT_TAG)
        dkv[...] = dblock


def gather_keys_values(kv: Array, comm: Communicator, algo: str = "auto") -> Array:
    """Forward: every CP rank's (B, t, 2, H, d) K/V block, stacked by rank (cp, B, t, 2, H, d) (all-gather;
    (cp−1)·2·b·t·h elements sent with the ring)."""
    return all_gather(kv[None], comm, algo=algo)


def gather_keys_values_backward(dgathered: Array, comm: Communicator, algo: str = "auto") -> Array:
    """Backward: sum every rank's gradient of the gathered blocks and keep this rank's (reduce-scatter)."""
    return reduce_scatter(dgathered, comm, algo=algo)[0]


class AllGatherAttention(KeyValueBlockAttention):
    """Llama 3's context-parallel attention: all-gather every rank's K/V block once per layer, attend the local
    queries to them at their global positions (the same chunk pairs and online softmax as the ring), and
    reduce-scatter the gradients of the gathered blocks in backward.

    The gathered blocks are not kept for backward (that would keep 2·b·s·h per layer, of length s): backward
    gathers them again. `algo` picks the all-gather and reduce-scatter algorithm.

    Per rank and layer (elements): forward an all-gather of the 2·b·(s/cp)·h K/V block, 2(cp−1)·bsh/cp; backward
    the all-gather again and a reduce-scatter of the gathered d(K/V), 4(cp−1)·bsh/cp. Every rank computes
    2cp + 1 chunk pairs, two of them diagonal. Nothing overlaps the collectives, which are fewer and larger
    messages than the ring's.
    """

    def __init__(self, qkv: Any, projection: Any, n_head: int, comm: Any, algo: str = "auto",
                 n_kv_head: int | None = None, rope: Any = None) -> None:
        super().__init__(qkv, projection, n_head, comm, n_kv_head, rope)
        self.algo = algo

    def _key_value_blocks(self, kv: Array) -> Iterator[tuple[int, Array]]:
        yield from enumerate(gather_keys_values(kv, self.comm, self.algo))

    def _key_value_blocks_backward(self, kv: Array, dkv: Array) -> Iterator[tuple[int, Array, Array]]:
        gathered = gather_keys_values(kv, self.comm, self.algo)
        dgathered = get_array_module(kv).zeros_like(gathered)
        for source in range(self.comm.size):
            yield source, gathered[source], dgathered[source]
        dkv[...] = gather_keys_values_backward(dgathered, self.comm, self.algo)


# -- Ulysses: re-shard from sequence to heads and back --------------------------------------------------------

def sequence_to_heads(x: Array, comm: Communicator, head_counts: tuple[int, ...], algo: str = "auto") -> Array:
    """All-to-all: (B, s/cp, Σ n_i·d), this rank's tokens of every head of each part i (q, k, v: n_i = H, n_kv,
    n_kv; the attention output: (H,)), to (B, s, Σ (n_i/cp)·d), every token (in sequence order) of this rank's
    n_i/cp heads of each part, parts side by side. Sends (cp−1)/cp of x. Its backward is `heads_to_sequence`."""
    xp, cp = get_array_module(x), comm.size
    batch, local, width = x.shape
    head_dim = width // sum(head_counts)
    by_rank = xp.concatenate([part.reshape(batch, local, cp, -1).transpose(2, 0, 1, 3)
                              for part in _parts(x, head_counts, head_dim)], axis=-1)  # (cp, B, s/cp, ·)
    return zigzag_unsplit(all_to_all(by_rank, comm, algo=algo))


def heads_to_sequence(x: Array, comm: Communicator, head_counts: tuple[int, ...], algo: str = "auto") -> Array:
    """All-to-all, the reverse of `sequence_to_heads` (and its backward): (B, s, Σ (n_i/cp)·d) to
    (B, s/cp, Σ n_i·d). Sends (cp−1)/cp of x."""
    xp, cp = get_array_module(x), comm.size
    batch, length, width = x.shape
    head_dim = width * cp // sum(head_counts)
    by_head_group = all_to_all(zigzag_split(x, cp), comm, algo=algo)  # (cp, B, s/cp, ·): head group first
    local_counts = tuple(count // cp for count in head_counts)
    return xp.concatenate([part.transpose(1, 2, 0, 3).reshape(batch, length // cp, -1)
                           for part in _parts(by_head_group, local_counts, head_dim)], axis=-1)


def _parts(x: Array, head_counts: tuple[int, ...], head_dim: int) -> list[Array]:
    """The consecutive column blocks of n_i·d channels of x's last axis (views)."""
    ends = np.cumsum([0, *head_counts]) * head_dim
    return [x[..., a:b] for a, b in zip(ends[:-1].tolist(), ends[1:].tolist(), strict=True)]


def replicate_key_value_heads(qkv: Array, n_head: int, n_kv_head: int, copies: int) -> Array:
    """[q | k | v] with every KV head repeated `copies` times in place (KV head j → heads j·copies … ), so a
    group of n_kv·copies KV heads can be shared out over that many ranks (Ulysses with n_kv < cp)."""
    if copies == 1:
        return qkv
    xp = get_array_module(qkv)
    batch, length, width = qkv.shape
    head_dim = width // (n_head + 2 * n_kv_head)
    q, k, v = _parts(qkv, (n_head, n_kv_head, n_kv_head), head_dim)
    repeat = [xp.repeat(part.reshape(batch, length, n_kv_head, head_dim), copies, axis=2).reshape(batch, length, -1)
              for part in (k, v)]
    return xp.concatenate([q, *repeat], axis=-1)


def replicate_key_value_heads_backward(dqkv: Array, n_head: int, n_kv_head: int, copies: int) -> Array:
    """Backward of `replicate_key_value_heads`: each KV head's gradient is the sum over its copies."""
    if copies == 1:
        return dqkv
    xp = get_array_module(dqkv)
    batch, length, width = dqkv.shape
    head_dim = width // (n_head + 2 * n_kv_head * copies)
    dq, dk, dv = _parts(dqkv, (n_head, n_kv_head * copies, n_kv_head * copies), head_dim)
    summed = [part.reshape(batch, length, n_kv_head, copies, head_dim).sum(axis=3).reshape(batch, length, -1)
              for part in (dk, dv)]
    return xp.concatenate([dq, *summed], axis=-1)


class SequenceToHeads(Layer):
    """The fused qkv projection of this rank's tokens, then `sequence_to_heads`: Ulysses's attention reads q, k
    and v of all s positions of its heads from it. With fewer KV heads than CP ranks (n_kv < cp) each KV head is
    first repeated cp/n_kv times, so every rank receives the one its query heads read. Backward:
    `heads_to_sequence`, the sum over the repeats, then the projection's."""

    def __init__(self, qkv: Any, comm: Communicator, n_head: int, n_kv_head: int, algo: str = "auto") -> None:
        self.qkv, self.comm, self.n_head, self.n_kv_head, self.algo = qkv, comm, n_head, n_kv_head, algo
        self.copies = max(comm.size // n_kv_head, 1)
        self.head_counts = (n_head, n_kv_head * self.copies, n_kv_head * self.copies)

    def forward(self, x: Array) -> tuple[Array, Saved]:
        qkv, saved = self.qkv.forward(x)  # with SP: the whole of this CP rank's tokens, gathered over tp
        _check_local_length(qkv)
        qkv = replicate_key_value_heads(qkv, self.n_head, self.n_kv_head, self.copies)
        return sequence_to_heads(qkv, self.comm, self.head_counts, self.algo), saved

    def backward_input(self, saved: Saved, dout: Array) -> Array:
        dqkv = heads_to_sequence(dout, self.comm, self.head_counts, self.algo)
        dqkv = replicate_key_value_heads_backward(dqkv, self.n_head, self.n_kv_head, self.copies)
        return self.qkv.backward_input(saved, dqkv)

    def backward_weights(self, saved: Saved) -> None:
        self.qkv.backward_weights(saved)


class HeadsToSequence(Layer):
    """`heads_to_sequence` of the attention output, then the output projection of this rank's tokens.
    Backward: the projection's, then `sequence_to_heads`."""

    def __init__(self, projection: Any, comm: Communicator, n_head: int, algo: str = "auto") -> None:
        self.projection, self.comm, self.head_counts, self.algo = projection, comm, (n_head,), algo

    def forward(self, merged: Array) -> tuple[Array, Saved]:
        return self.projection.forward(heads_to_sequence(merged, self.comm, self.head_counts, self.algo))

    def backward_input(self, saved: Saved, dout: Array) -> Array:
        dmerged = self.projection.backward_input(saved, dout)
        return sequence_to_heads(dmerged, self.comm, self.head_counts, self.algo)

    def backward_weights(self, saved: Saved) -> None:
        self.projection.backward_weights(saved)


class UlyssesAttention(Layer):
    """DeepSpeed Ulysses: all-to-all from sequence shards to head shards, so each CP rank holds all s positions
    of n_head/cp heads and runs the serial `CausalSelfAttention` on them (query blocks, `keep_probabilities`,
    RoPE at positions 0 … s−1 — the all-to-all restores sequence order), then all-to-all back. Needs n_head
    (this rank's heads) divisible by cp, and n_kv divisible by cp or cp by n_kv (then each KV head travels in
    cp/n_kv copies). `algo` picks the all-to-all algorithm.

    Per rank and layer (elements, h = this rank's attention channels, h_kv = n_kv'·d with n_kv' = max(n_kv, cp)
    the KV heads sent): forward an all-to-all of q, k, v (b·(s/cp)·(h + 2·h_kv), of which (cp−1)/cp leaves) and
    one of the attention output (b·(s/cp)·h), 2(cp−1)·bs(h + h_kv)/cp²; backward the reverse all-to-alls of their
    gradients, the same. (Multi-head: 4(cp−1)·bsh/cp².) Every rank computes the whole causal attention of
    n_head/cp heads, cp(2cp+1) chunk pairs per head; it saves them as the serial layer does for its heads
    (probabilities of length s² unless keep_probabilities=False).
    """

    def __init__(self, qkv: Any, projection: Any, n_head: int, comm: Any, algo: str = "auto",
                 query_block: int = QUERY_BLOCK, keep_probabilities: bool = True, n_kv_head: int | None = None,
                 rope: Any = None) -> None:
        comm = Communicator.of(comm)
        n_kv_head = n_kv_head or n_head
        if n_head % comm.size:
            raise ValueError(f"ulysses attention splits this rank's heads over the cp ranks: n_head ({n_head}; "
                             f"n_head/tp with tensor parallelism) must be divisible by cp ({comm.size})")
        if n_kv_head % comm.size and comm.size % n_kv_head:
            raise ValueError(f"ulysses attention shares the KV heads out over the cp ranks: n_kv_head ({n_kv_head}; "
                             f"per tensor-parallel rank) and cp ({comm.size}) must divide one another")
        into_heads = SequenceToHeads(qkv, comm, n_head, n_kv_head, algo)
        self.local = CausalSelfAttention(into_heads, HeadsToSequence(projection, comm, n_head, algo),
                                         n_head // comm.size, query_block, keep_probabilities,
                                         n_kv_head=into_heads.head_counts[1] // comm.size, rope=rope)

    def forward(self, x: Array, documents: Any = ONE_DOCUMENT) -> tuple[Array, Saved]:
        return self.local.forward(x, documents)  # the whole windows' documents: sequence order is restored

    def backward_input(self, saved: Saved, dout: Array) -> Array:
        return self.local.backward_input(saved, dout)

    def backward_weights(self, saved: Saved) -> None:
        self.local.backward_weights(saved)


# -- choosing a variant ---------------------------------------------------------------------------------------

def context_parallel_attention(variant: str, qkv: Any, projection: Any, n_head: int, comm: Any,
                               algo: str = "auto", query_block: int = QUERY_BLOCK,
                               keep_probabilities: bool = True, n_kv_head: int | None = None,
                               rope: Any = None) -> Layer:
    """The attention layer of `variant` ("ring", "all-gather" or "ulysses") over the CP communicator `comm`, with
    `n_head` query heads and `n_kv_head` KV heads (default: n_head) on this rank, and rotary positions `rope`.

    `algo` is the collective algorithm of all-gather (its all-gather and reduce-scatter) and ulysses (its
    all-to-all); `query_block` and `keep_probabilities` apply to ulysses, whose attention is the serial one —
    ring and all-gather use chunk pairs and always rebuild probabilities in backward.
    """
    heads = {"n_kv_head": n_kv_head, "rope": rope}
    if variant == "ring":
        return RingAttention(qkv, projection, n_head, comm, **heads)
    if variant == "all-gather":
        return AllGatherAttention(qkv, projection, n_head, comm, algo, **heads)
    if variant == "ulysses":
        return UlyssesAttention(qkv, projection, n_head, comm, algo, query_block, keep_probabilities, **heads)
    raise ValueError(f"unknown context-parallel attention {variant!r}; valid: {', '.join(VARIANTS)}")
