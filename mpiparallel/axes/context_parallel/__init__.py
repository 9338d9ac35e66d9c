"""Context parallelism (CP): a sequence split over the cp ranks of a CP group, every attention over the group.

    attention   the three ways tokens on different ranks meet — ring, all-gather (Llama 3), Ulysses (all-to-all
                by heads) — with the zigzag layout that gives every rank the same causal work; each variant's
                communication and cost per layer are in its docstring
    latent      the same three for DeepSeek-V3's multi-head latent attention, moving the compressed latent

`ContextParallel` is the axis as the model asks for it (`models.axis`).
"""

from __future__ import annotations

from typing import Any

from collectives import Communicator, all_gather
from collectives.backend import Array
from models.axis import ContextAxis
from models.layers import Layer

from .attention import VARIANTS, context_parallel_attention, zigzag_positions, zigzag_shard, zigzag_unsplit
from .latent import GatheredLatentAttention, RingLatentAttention, UlyssesLatentAttention


class ContextParallel(ContextAxis):
    """Context parallelism over a CP group, as the model asks for it (`models.axis`): applied with
    `Transformer(config, …).parallelize(ContextParallel(cp_comm, variant))`, every attention is `variant`'s over
    the group and the model takes this rank's two zigzag chunks of every sequence (`zigzag_shard`), their global
    positions from `positions`. Nothing else in the model changes: every other layer works token by token."""

    def __init__(self, comm: Any, variant: str = "ring") -> None:
        if variant not in VARIANTS:
            raise ValueError(f"unknown context-parallel attention {variant!r}; valid: {', '.join(VARIANTS)}")
        self.comm, self.variant = Communicator.of(comm), variant
        self.rank, self.size = self.comm.rank, self.comm.size

    def attention(self, qkv: Any, projection: Any, heads: int, **settings: Any) -> Layer:
        return context_parallel_attention(self.variant, qkv, projection, heads, self.comm, **settings)

    def latent_attention(self, *layers: Any, **settings: Any) -> Layer:
        variant = {"ring": RingLatentAttention, "all-gather": GatheredLatentAttention,
                   "ulysses": UlyssesLatentAttention}[self.variant]
        return variant(*layers, comm=self.comm, **settings)

    def positions(self, length: int) -> Array:
        return zigzag_positions(length * self.size, self.rank, self.size)

    def whole_sequences(self, local: Array) -> Array:
        gathered = all_gather(local, self.comm)  # (cp·B, s/cp): the ranks' pieces in rank order
        return zigzag_unsplit(gathered.reshape(self.size, *local.shape))

    def local_tokens(self, whole: Array) -> Array:
        return zigzag_shard(whole, self.rank, self.size)

    def sequence_groups(self) -> list[Any]:
        return [self.comm]  # each sequence's 2·cp chunks lie on the group's ranks

    def check_tokens(self, length: int) -> None:
        if length % 2:
            raise ValueError(f"context parallelism holds two equal chunks per rank: {length} local tokens")
