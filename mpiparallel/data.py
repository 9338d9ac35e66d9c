"""Training data: token ids from a file (or a corpus every Python ships), and llm.c's order of batches.

Files (`--data PATH`): a `.npy` file holds a 1-D array of integer token ids; any other file is read as its bytes,
one token per byte (vocabulary 256; UTF-8 text becomes its UTF-8 bytes). Without `--data`, the default corpus is
Python's own documentation, `pydoc_data.topics` (about half a megabyte of English prose and code), so a first
run needs no download.

Batches (a fixed order that resumed runs and every mesh rely on, as llm.c's dataloader): with B sequences of T
tokens per step there are K = ⌊(N − 1) / (B·T)⌋ full batches in N tokens. Step s reads the window
tok[j·B·T : j·B·T + B·T + 1] with j = s mod K; the inputs are its first B·T tokens as a (B, T) array and the
targets the same window shifted by one token. Every rank computes the same global batch from the step number
alone — no communication, no shuffling state to checkpoint — and then keeps its rows (`rows_for_rank`) and
splits them into microbatches (`microbatches`).
"""

from __future__ import annotations

import importlib
import inspect
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .errors import ConfigError

BYTE_VOCAB_SIZE = 256

FALLBACK_MODULES = ("builtins", "os", "re", "json", "collections", "functools", "itertools", "pathlib", "string",
                    "textwrap", "dataclasses", "fractions", "argparse", "logging", "unittest", "subprocess")
"""Modules whose docstrings form the default corpus when a distribution has stripped pydoc_data."""


@dataclass(frozen=True)
class TokenData:
    """Token ids (1-D int64), the smallest vocabulary that holds them, and where they came from (for logs)."""

    tokens: np.ndarray
    vocab_size_needed: int
    description: str


# -- loading ----------------------------------------------------------------------------------------------------


def load_tokens(path: str | Path | None) -> TokenData:
    """Read `path` (a `.npy` array of token ids or any file as bytes); None gives the default corpus."""
    if path is None:
        return default_corpus()
    path = Path(path)
    if not path.is_file():
        reason = "is a directory, not a file" if path.is_dir() else "does not exist"
        raise ConfigError(f"data file {path} {reason}")
    if path.suffix == ".npy":
        tokens, kind = _read_npy(path), "token ids"
    else:
        tokens, kind = _bytes_as_tokens(_read_bytes(path)), "bytes"
    if tokens.size == 0:
        raise ConfigError(f"data file {path} holds no tokens")
    return TokenData(tokens, int(tokens.max()) + 1, f"{path} ({len(tokens):,} {kind})")


def _read_bytes(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except OSError as error:
        raise ConfigError(f"cannot read data file {path}: {error.strerror or error}") from None


def _bytes_as_tokens(content: bytes) -> np.ndarray:
    return np.frombuffer(content, dtype=np.uint8).astype(np.int64)


def _read_npy(path: Path) -> np.ndarray:
    """A 1-D array of non-negative integers from a .npy file, as int64."""
    try:
        array = np.load(path, allow_pickle=False)
    except (OSError, ValueError, EOFError) as error:
        raise ConfigError(f"data file {path} is not a readable .npy array: {error}") from None
    if not isinstance(array, np.ndarray):
        raise ConfigError(f"data file {path} is an .npz archive; save one 1-D token array with numpy.save")
    if array.ndim != 1 or array.dtype.kind not in "iu":
        raise ConfigError(f"data file {path} holds a {array.ndim}-D {array.dtype} array; token data must be "
                          f"a 1-D integer array")
    if array.size and array.min() < 0:
        raise ConfigError(f"data file {path} holds a negative token id ({array.min()})")
    if array.size and array.dtype == np.uint64 and array.max() > np.iinfo(np.int64).max:
        raise ConfigError(f"data file {path} holds a token id too large for int64 ({array.max()})")
    return array.astype(np.int64)


def default_corpus() -> TokenData:
    """Python's documentation topics as UTF-8 bytes (or stdlib docstrings where pydoc_data is missing)."""
    text, source = _pydoc_topics()
    if text is None:
        text, source = _stdlib_docstrings()
    tokens = _bytes_as_tokens(text.encode("utf-8"))
    return TokenData(tokens, int(tokens.max()) + 1, f"default corpus: {source} ({len(tokens):,} bytes)")


def _pydoc_topics() -> tuple[str | None, str]:
    try:
        from pydoc_data.topics import topics
    except ImportError:
        return None, ""
    return "\n\n".join(topics[key] for key in sorted(topics)), "Python's documentation topics (pydoc_data.topics)"


def _stdlib_docstrings() -> tuple[str, str]:
    """Docstrings of FALLBACK_MODULES and their public classes and functions, in a fixed order."""
    pieces = []
    for module_name in FALLBACK_MODULES:
        module = importlib.import_module(module_name)
        pieces.append(inspect.getdoc(module) or "")
        for name, member in sorted(vars(module).items()):
            if not name.startswith("_") and (inspect.isclass(member) or inspect.isroutine(member)):
                pieces.append(inspect.getdoc(member) or "")
    text = "\n\n".join(piece for piece in pieces if piece)
    return text, f"docstrings of {len(FALLBACK_MODULES)} standard-library modules (pydoc_data is not installed)"


def check_vocab(token_data: TokenData, vocab_size: int) -> None:
    """ConfigError when a token id does not fit the model's vocabulary."""
    if token_data.vocab_size_needed > vocab_size:
        raise ConfigError(f"{token_data.description} contains token id {token_data.vocab_size_needed - 1}, but the "
                          f"model's vocabulary has {vocab_size} tokens; use --vocab-size "
                          f"{token_data.vocab_size_needed} or more")


def split_train_validation(tokens: np.ndarray, validation_fraction: float = 0.1) -> tuple[np.ndarray, np.ndarray]:
    """(train, validation): the last ⌊N·fraction⌋ tokens are held out as one contiguous piece (views, no copy).

    Sizes are not checked here: `batch_for_step` reports a piece too short for one batch.
    """
    if not 0 <= validation_fraction < 1:
        raise ConfigError(f"the validation fraction must lie in [0, 1), got {validation_fraction}")
    held_out = int(len(tokens) * validation_fraction)
    boundary = len(tokens) - held_out
    return tokens[:boundary], tokens[boundary:]


# -- batches ----------------------------------------------------------------------------------------------------


def full_batch_count(token_count: int, batch_size: int, seq_len: int) -> int:
    """K: how many distinct (B, T) batches the tokens hold before the order wraps around."""
    if batch_size < 1 or seq_len < 1:
        raise ConfigError(f"batch size and sequence length must be at least 1, got {batch_size} and {seq_len}")
    return max(token_count - 1, 0) // (batch_size * seq_len)


def batch_for_step(tokens: np.ndarray, step: int, batch_size: int, seq_len: int) -> tuple[np.ndarray, np.ndarray]:
    """(inputs, targets), each (batch_size, seq_len), for 0-based `step`: copies, so that what a layer keeps for
    backward (the embedding keeps its token ids) holds the batch, not a view of the whole dataset."""
    if step < 0:
        raise ValueError(f"step must be non-negative, got {step}")
    batch_count = full_batch_count(len(tokens), batch_size, seq_len)
    tokens_per_batch = batch_size * seq_len
    if batch_count == 0:
        raise ConfigError(f"data has {len(tokens)} tokens, one batch of {batch_size}×{seq_len} needs "
                          f"{tokens_per_batch + 1}")
    start = (step % batch_count) * tokens_per_batch
    window = tokens[start:start + tokens_per_batch + 1]
    return window[:-1].reshape(batch_size, seq_len).copy(), window[1:].reshape(batch_size, seq_len).copy()


def rows_for_rank(inputs: np.ndarray, targets: np.ndarray, rank: int, ranks: int) -> tuple[np.ndarray, np.ndarray]:
    """Data-parallel rank `rank` of `ranks` keeps rows [rank·B/ranks, (rank+1)·B/ranks) of the global batch."""
    if not 0 <= rank < ranks:
        raise ValueError(f"rank {rank} is outside 0..{ranks - 1}")
    batch_size = inputs.shape[0]
    if batch_size % ranks:
        raise ConfigError(f"batch size {batch_size} is not divisible by {ranks} data-parallel ranks")
    rows = batch_size // ranks
    keep = slice(rank * rows, (rank + 1) * rows)
    return inputs[keep], targets[keep]


def microbatches(inputs: np.ndarray, targets: np.ndarray, count: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """Split the rows into `count` equal microbatches, in order."""
    batch_size = inputs.shape[0]
    if count < 1 or batch_size % count:
        raise ConfigError(f"{batch_size} rows per rank cannot be split into {count} equal microbatches")
    rows = batch_size // count
    return [(inputs[i * rows:(i + 1) * rows], targets[i * rows:(i + 1) * rows]) for i in range(count)]
