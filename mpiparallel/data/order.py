"""The batch order: which tokens step s trains on, as a pure function of (step, seed, epoch) — llm.c's order,
extended shard by shard.

The tokens are a list of segments (one in-memory array, or one array per shard). With B sequences of T tokens
per step, segment i holds K_i = ⌊(n_i − 1) / (B·T)⌋ full batches; a batch window never crosses a segment. The
batches of all segments are numbered in order, 0 … K − 1 with K = ΣK_i. Step s is in epoch e = ⌊s / K⌋ and uses
batch b = s mod K — or, with `shuffle`, batch π_e(b) where π_e is a permutation of 0 … K − 1 drawn from a
generator seeded by (seed, e) (`shuffled_index`: a keyed Feistel permutation, so no epoch's permutation is ever
held in memory). Batch number k of segment i starts at token k·B·T of it and spans B·T + 1 tokens:
the inputs are its first B·T tokens as (B, T), the targets the same window shifted by one.

So one `.npy` and one shard holding the same tokens train identically, every mesh and every resume sees the same
tokens, and there is no state to checkpoint beyond the step number. Every rank computes the position from the step
alone (no communication) and reads only its own rows (`TokenBatches.rows`): a rank with rows [a, b) of a batch
reads tokens [start + a·T, start + b·T + 1). Cost: O(log S) to find the segment of S; with `shuffle`, a few
integer rounds per step and O(1) memory whatever K (a drawn permutation of K int64 would be 8·K bytes: 31 MB for
2·10⁹ tokens in batches of 512).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple

import numpy as np

from models.documents import ONE_DOCUMENT, Documents, OneDocument

from ..errors import ConfigError

Reader = Callable[[int, int, int], np.ndarray]
"""reader(segment, start, stop) -> tokens [start, stop) of that segment as int64 (a copy)."""


def full_batch_count(token_count: int, batch_size: int, seq_len: int) -> int:
    """K: how many distinct (B, T) batches the tokens hold before the order wraps around."""
    if batch_size < 1 or seq_len < 1:
        raise ConfigError(f"batch size and sequence length must be at least 1, got {batch_size} and {seq_len}")
    return max(token_count - 1, 0) // (batch_size * seq_len)


class BatchOrder:
    """Where each step's batch lies: (segment, first token), for segments of the given lengths."""

    def __init__(self, lengths: Sequence[int], batch_size: int, seq_len: int, shuffle: bool = False,
                 seed: int = 0, description: str = "data") -> None:
        self.batch_size, self.seq_len, self.shuffle, self.seed = batch_size, seq_len, shuffle, seed
        counts = [full_batch_count(n, batch_size, seq_len) for n in lengths]
        self.first_batch = np.cumsum([0, *counts])  # batch number where each segment's batches begin
        self.batch_count = int(self.first_batch[-1])
        if self.batch_count == 0:
            needed = batch_size * seq_len + 1
            where = "" if len(lengths) == 1 else (f" in {len(lengths)} shards (the longest {max(lengths, default=0)}"
                                                   f"; a batch never crosses a shard)")
            raise ConfigError(f"{description} has {sum(lengths)} tokens{where}, one batch of {batch_size}×{seq_len} "
                              f"needs {needed}")
        self._keys: tuple[int, list[int]] | None = None  # the current epoch's round keys

    def batch_number(self, step: int) -> int:
        """The batch (in the numbering over all segments) that 0-based `step` uses."""
        if step < 0:
            raise ValueError(f"step must be non-negative, got {step}")
        epoch, index = divmod(step, self.batch_count)
        if not self.shuffle:
            return index
        if self._keys is None or self._keys[0] != epoch:
            self._keys = (epoch, feistel_keys(self.seed, epoch))
        return shuffled_index(index, self.batch_count, self._keys[1])

    def locate(self, step: int) -> tuple[int, int]:
        """(segment, index of the batch window's first token in it) for `step`."""
        number = self.batch_number(step)
        segment = int(np.searchsorted(self.first_batch, number, side="right")) - 1
        return segment, (number - int(self.first_batch[segment])) * self.batch_size * self.seq_len


FEISTEL_ROUNDS = 4
_MASK64 = (1 << 64) - 1


def feistel_keys(seed: int, epoch: int) -> list[int]:
    """The round keys of epoch `epoch`'s permutation, from a generator seeded by (seed, epoch)."""
    generator = np.random.default_rng([seed, epoch])
    return [int(key) for key in generator.integers(0, 1 << 62, FEISTEL_ROUNDS)]


def _mix(value: int, key: int) -> int:
    """A 64-bit mixing function (splitmix64's finalizer) of value ^ key: the Feistel round function."""
    z = (value ^ key) * 0x9E3779B97F4A7C15 & _MASK64
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9 & _MASK64
    z = (z ^ (z >> 27)) * 0x94D049BB133111EB & _MASK64
    return z ^ (z >> 31)


def shuffled_index(index: int, count: int, keys: list[int]) -> int:
    """π(index) for a pseudo-random permutation π of 0 … count − 1 given by its round keys: a balanced Feistel
    network on 2h-bit numbers (4^h ≥ count), applied again while the result lies outside [0, count) ("cycle
    walking": since 4^h < 4·count, fewer than 4 applications on average). A bijection for any keys."""
    half = max(1, ((count - 1).bit_length() + 1) // 2)
    mask = (1 << half) - 1
    value = index
    while True:
        left, right = value >> half, value & mask
        for key in keys:
            left, right = right, left ^ (_mix(right, key) & mask)
        value = (left << half) | right
        if value < count:
            return value


class TokenBatches:
    """The batches of some token segments in the contract's order, read row range by row range."""

    def __init__(self, lengths: Sequence[int], reader: Reader, batch_size: int, seq_len: int, shuffle: bool = False,
                 seed: int = 0, description: str = "data", checked_when_read: bool = False) -> None:
        self.order = BatchOrder(lengths, batch_size, seq_len, shuffle, seed, description)
        self.reader, self.batch_size, self.seq_len = reader, batch_size, seq_len
        self.checked_when_read = checked_when_read  # the reader may raise ConfigError (a token id outside the vocab)

    @property
    def batch_count(self) -> int:
        return self.order.batch_count

    def rows(self, step: int, first_row: int, stop_row: int) -> tuple[np.ndarray, np.ndarray]:
        """(inputs, targets), each (stop_row − first_row, T), of rows [first_row, stop_row) of the step's batch;
        only those rows' tokens (and one more) are read."""
        if not 0 <= first_row <= stop_row <= self.batch_size:
            raise ValueError(f"rows [{first_row}, {stop_row}) are outside a batch of {self.batch_size}")
        segment, start = self.order.locate(step)
        t = self.seq_len
        window = self.reader(segment, start + first_row * t, start + stop_row * t + 1)
        rows = stop_row - first_row
        return window[:-1].reshape(rows, t), window[1:].reshape(rows, t)

    def rows_for_rank(self, step: int, rank: int, ranks: int) -> tuple[np.ndarray, np.ndarray]:
        """Data-parallel rank `rank` of `ranks`: rows [rank·B/ranks, (rank+1)·B/ranks) of the step's batch."""
        first, stop = row_range(self.batch_size, rank, ranks)
        return self.rows(step, first, stop)

    def batch(self, step: int) -> tuple[np.ndarray, np.ndarray]:
        """The whole global batch of `step`."""
        return self.rows(step, 0, self.batch_size)


def in_memory(tokens: np.ndarray, batch_size: int, seq_len: int, shuffle: bool = False, seed: int = 0,
              description: str = "data") -> TokenBatches:
    """Batches of one token array held in memory."""
    return TokenBatches([len(tokens)], lambda _, start, stop: np.array(tokens[start:stop], dtype=np.int64),
                        batch_size, seq_len, shuffle, seed, description)


def batch_for_step(tokens: np.ndarray, step: int, batch_size: int, seq_len: int) -> tuple[np.ndarray, np.ndarray]:
    """(inputs, targets), each (batch_size, seq_len), for 0-based `step`: copies, so that what a layer keeps for
    backward (the embedding keeps its token ids) holds the batch, not a view of the whole dataset."""
    if step < 0:
        raise ValueError(f"step must be non-negative, got {step}")
    return in_memory(tokens, batch_size, seq_len).batch(step)


def row_range(batch_size: int, rank: int, ranks: int) -> tuple[int, int]:
    """Rows [rank·B/ranks, (rank+1)·B/ranks) of a batch of B."""
    if not 0 <= rank < ranks:
        raise ValueError(f"rank {rank} is outside 0..{ranks - 1}")
    if batch_size % ranks:
        raise ConfigError(f"batch size {batch_size} is not divisible by {ranks} data-parallel ranks")
    rows = batch_size // ranks
    return rank * rows, (rank + 1) * rows


def rows_for_rank(inputs: np.ndarray, targets: np.ndarray, rank: int, ranks: int) -> tuple[np.ndarray, np.ndarray]:
    """Data-parallel rank `rank` of `ranks` keeps rows [rank·B/ranks, (rank+1)·B/ranks) of the global batch."""
    keep = slice(*row_range(inputs.shape[0], rank, ranks))
    return inputs[keep], targets[keep]


class Microbatch(NamedTuple):
    """One microbatch: its input and target token ids (rows, T) and the documents packed in its windows
    (`models.documents`; one per window for causal attention)."""

    inputs: np.ndarray
    targets: np.ndarray
    documents: Documents | OneDocument = ONE_DOCUMENT


def microbatches(inputs: np.ndarray, targets: np.ndarray, count: int,
                 documents: Documents | OneDocument = ONE_DOCUMENT) -> list[Microbatch]:
    """Split the rows (and their documents) into `count` equal microbatches, in order."""
    batch_size = inputs.shape[0]
    if count < 1 or batch_size % count:
        raise ConfigError(f"{batch_size} rows per rank cannot be split into {count} equal microbatches")
    rows = batch_size // count
    return [Microbatch(inputs[i * rows:(i + 1) * rows], targets[i * rows:(i + 1) * rows],
                       documents.rows(slice(i * rows, (i + 1) * rows))) for i in range(count)]
