"""Token files held in memory: a `.npy` array of token ids, a file read as bytes, or the default corpus.

Files (`--data PATH`): a `.npy` file holds a 1-D array of integer token ids; any other file is read as its bytes,
one token per byte (vocabulary 256; UTF-8 text becomes its UTF-8 bytes). The default corpus is Python's own
documentation, `pydoc_data.topics` (about half a megabyte of English prose and code), so a first run needs no
download; `train` without `--data` trains on it through a BPE (`prepare.cached_default_corpus`). These are
loaded whole (8 bytes per token as int64): datasets larger than memory are llm.c shards (`shards`), which are
memory-mapped instead. No communication: every rank reads the file itself.
"""

from __future__ import annotations

import importlib
import inspect
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..errors import ConfigError

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
    text, source = default_corpus_text()
    tokens = _bytes_as_tokens(text.encode("utf-8"))
    return TokenData(tokens, int(tokens.max()) + 1, f"default corpus: {source} ({len(tokens):,} bytes)")


def default_corpus_text() -> tuple[str, str]:
    """The default corpus as one text (its documents a blank line apart), and where it comes from."""
    documents, source = default_corpus_documents()
    return "\n\n".join(documents), source


def default_corpus_documents() -> tuple[list[str], str]:
    """The default corpus's documents — one per documentation topic (or docstring) — and where they come from."""
    documents, source = _pydoc_topics()
    if documents is None:
        documents, source = _stdlib_docstrings()
    return documents, source


def _pydoc_topics() -> tuple[list[str] | None, str]:
    try:
        from pydoc_data.topics import topics
    except ImportError:
        return None, ""
    return [topics[key] for key in sorted(topics)], "Python's documentation topics (pydoc_data.topics)"


def _stdlib_docstrings() -> tuple[list[str], str]:
    """Docstrings of FALLBACK_MODULES and their public classes and functions, in a fixed order."""
    pieces = []
    for module_name in FALLBACK_MODULES:
        module = importlib.import_module(module_name)
        pieces.append(inspect.getdoc(module) or "")
        for name, member in sorted(vars(module).items()):
            if not name.startswith("_") and (inspect.isclass(member) or inspect.isroutine(member)):
                pieces.append(inspect.getdoc(member) or "")
    documents = [piece for piece in pieces if piece]
    return documents, f"docstrings of {len(FALLBACK_MODULES)} standard-library modules (pydoc_data is not installed)"


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
