"""Packed documents: which keys each query may see, and each token's position inside its document.

Training windows are documents packed end to end (llm.c's shards put an end-of-text token before each). With
document attention a token attends only to the earlier tokens of its own document, and positions restart at
each document (Llama 3 trained so; Megatron's --reset-attention-mask --reset-position-ids). The end-of-text
token opens a document; the tokens of a window before its first end-of-text are the tail of a document begun
in an earlier window, a document of its own here.

For a window of T tokens, per row b and token i:

    start[b, i]      where token i's document begins in the window (0 for the first)
    position[b, i]   i − start[b, i], the token's position inside its document (RoPE, learned positions)

Query i sees key j iff start[b, i] ≤ j ≤ i. Causal attention over the whole window is the case start = 0:
`ONE_DOCUMENT`, which every layer takes by default, so causal and document attention run the same code.

Documents are contiguous, so start is non-decreasing along the window: a block of queries from i₀ on sees no
key before min_b start[b, i₀] (`first_key`), and attention skips those keys as it skips the future — the work
of a window falls from T(T+1)/2 scores per head to Σ_d L_d(L_d+1)/2 over its documents' lengths L_d, less
whatever a block's rows share. Context parallelism cuts the window into 2·cp chunks of c tokens; the pair
(queries of chunk a, keys of chunk k < a) is skipped whole when a document opens after chunk k's last token
and no later than chunk a's first, min_b start[b, a·c] > (k+1)·c − 1 (`pair_hidden`). `skipped_chunk_pairs`
counts those pairs, each c² scores per head saved forward and again in backward.

The arrays stay on the host (NumPy int64, B × T numbers); the masks they make go to the scores' device.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from collectives.backend import Array, like


@dataclass(frozen=True)
class Documents:
    """The documents of a batch of whole windows (B, T): each token's document start and position in it."""

    starts: np.ndarray     # (B, T) int64: where each token's document begins
    positions: np.ndarray  # (B, T) int64: the token's position inside its document

    @classmethod
    def of_tokens(cls, tokens: np.ndarray, eot_id: int) -> Documents:
        """The documents of (B, T) input token ids, each opened by an `eot_id` token."""
        tokens = np.asarray(tokens)
        length = tokens.shape[-1]
        index = np.broadcast_to(np.arange(length), tokens.shape)
        opens = (tokens == eot_id) | (index == 0)
        starts = np.maximum.accumulate(np.where(opens, index, 0), axis=-1)
        return cls(starts.astype(np.int64), (index - starts).astype(np.int64))

    @property
    def length(self) -> int:
        return self.starts.shape[-1]

    def rows(self, rows: slice) -> Documents:
        """The documents of a slice of the batch's rows (a microbatch)."""
        return Documents(self.starts[rows], self.positions[rows])

    def row_groups(self, batch: int) -> list[slice]:
        """The rows attention takes together: one at a time, so that each skips the keys before its own
        documents (rows packed differently share no skipped block)."""
        return [slice(row, row + 1) for row in range(batch)]

    def first_key(self, query: int) -> int:
        """The first key any row's query at window position `query` (or any later query) may see."""
        return int(self.starts[:, query].min())

    def rotary_positions(self, sequence_positions: Any) -> np.ndarray:
        """The positions (B, t) that RoPE and learned positions use for the tokens at `sequence_positions`."""
        return self.positions[:, np.asarray(sequence_positions)]

    def mask(self, scores: Array, query_positions: Any, key_positions: Any) -> Array | None:
        """−∞ where a key lies before its query's document, 0 elsewhere, shaped to add to `scores`
        (B, …, t_q, t_k): the queries at window positions `query_positions`, the keys at `key_positions`."""
        before = np.asarray(key_positions)[None, None, :] < self.starts[:, np.asarray(query_positions)][:, :, None]
        if not before.any():
            return None
        additive = np.where(before, -np.inf, 0.0).astype(scores.dtype)
        shape = (additive.shape[0],) + (1,) * (scores.ndim - 3) + additive.shape[1:]
        return like(scores, additive.reshape(shape))

    def pair_hidden(self, query_first: int, key_last: int) -> bool:
        """Whether every query from window position `query_first` on has its document begin after `key_last`."""
        return self.first_key(query_first) > key_last


class OneDocument:
    """Causal attention over the whole window: every token in one document, at its window position. The layers'
    default; it makes no mask and hides nothing."""

    def rows(self, rows: slice) -> OneDocument:
        return self

    def row_groups(self, batch: int) -> list[slice]:
        return [slice(None)]  # every row alike: all at once

    def first_key(self, query: int) -> int:
        return 0

    def rotary_positions(self, sequence_positions: Any) -> Any:
        return sequence_positions

    def mask(self, scores: Array, query_positions: Any, key_positions: Any) -> None:
        return None

    def pair_hidden(self, query_first: int, key_last: int) -> bool:
        return False


ONE_DOCUMENT = OneDocument()
ATTENTION_KINDS = ("causal", "document")


def add_mask(scores: Array, documents: Documents | OneDocument, query_positions: Any, key_positions: Any) -> Array:
    """`scores` with the keys before each query's document at −∞ (in place; unchanged for one document)."""
    mask = documents.mask(scores, query_positions, key_positions)
    if mask is not None:
        scores += mask
    return scores


def document_lengths(starts: np.ndarray) -> list[int]:
    """The lengths of the documents (or document pieces) of one window row, from its `starts` (T,)."""
    opened = np.flatnonzero(np.diff(starts, prepend=-1))
    return np.diff(np.append(opened, len(starts))).tolist()


def attention_scores(documents: Documents | OneDocument, length: int) -> int:
    """Scores per head document attention computes at most for a batch of windows of `length` tokens (causal's
    B·T(T+1)/2 falls to Σ over each row's documents of L(L+1)/2), before any block rounding."""
    if isinstance(documents, OneDocument):
        return length * (length + 1) // 2
    return sum(piece * (piece + 1) // 2 for row in documents.starts for piece in document_lengths(row))


def skipped_chunk_pairs(documents: Documents, cp: int) -> int:
    """Of the cp(2cp+1) causal chunk pairs of a context-parallel window cut into 2·cp chunks, how many are
    skipped whole because a document boundary separates the pair (`pair_hidden`) in every row."""
    chunk = documents.length // (2 * cp)
    return sum(documents.pair_hidden(query * chunk, (key + 1) * chunk - 1)
               for query in range(2 * cp) for key in range(query))

