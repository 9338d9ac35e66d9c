"""Context parallelism (CP) for multi-head latent attention: the all-gather variant, moving the compressed latent.

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

Ring and Ulysses are not implemented for MLA (the model refuses them with one clear error).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from collectives import Communicator
from collectives.backend import Array

from .context_parallel import (
    gather_keys_values,
    gather_keys_values_backward,
    zigzag_chunks,
    zigzag_positions,
    zigzag_split,
    zigzag_unsplit,
)
from .latent_attention import LatentAttention


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
