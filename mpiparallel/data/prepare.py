"""`mpiparallel data prepare` and `data info`: text in, llm.c shards out, and what a data folder holds.

Prepare streams: documents are read one at a time (a text file is one document, read in pieces of about
`PIECE_CHARS` characters cut after a newline; a `.jsonl` line's "text" is one document), encoded a batch of
pieces at a time by the tokenizer's own batch encoder, and appended to the shard being written, which is closed
(its header rewritten with the final count) once it holds `shard_tokens`. So memory is one batch of text plus its
ids, whatever the corpus's size. The end-of-text token goes before each document. The first `val_tokens` tokens
form `val_000000.bin`, the rest `train_000000.bin`, `train_000001.bin`, … (llm.c also takes its validation shard
from the start). A BPE is trained first, in one more pass over the documents.

Nothing half-written: everything goes into a hidden sibling folder, renamed to `--out` only when complete; an
error or an interrupt removes it. No MPI.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import shutil
import socket
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, TextIO

import numpy as np

from ..errors import ConfigError
from ..text import plural
from . import sources
from . import tokenizer as tokenizers_
from .dataset import DATA_JSON, read_data_json
from .shards import FORMATS, HEADER_BYTES, header_bytes, read_header, version_for_vocab

DEFAULT_VOCAB_SIZE = 2048
DEFAULT_VAL_TOKENS = 12_800
"""The default corpus's tokenizer and held-out tokens: a 2,048-token byte-level BPE trained on the corpus itself
(3.7 bytes per token on Python's documentation; ~10 % of its 129 K tokens held out). Chosen by measurement: in
the Quick start's two minutes it reaches a lower loss per byte and writes words where bytes write fragments
(docs/data.md: "Why a BPE and not bytes, measured")."""
CACHE_VARIABLE = "MPIPARALLEL_CACHE"

PIECE_CHARS = 1 << 18
BATCH_CHARS = 1 << 20
"""Text handed to the tokenizer's batch encoder at once (its threads share the batch)."""
FORMAT = "mpiparallel data"


@dataclass(frozen=True)
class Piece:
    """Text of one document; `starts` marks its first piece (where the end-of-text token goes)."""

    text: str
    starts: bool


# -- reading the inputs ---------------------------------------------------------------------------------------


def input_files(inputs: Sequence[str | Path], default_corpus: bool = False) -> list[Path]:
    """The files the inputs name: files as given, folders' files (not hidden ones) recursively in name order."""
    files: list[Path] = []
    for given in inputs:
        path = Path(given)
        if path.is_dir():
            files += sorted(p for p in path.rglob("*") if p.is_file() and
                            not any(part.startswith(".") for part in p.relative_to(path).parts))
        elif path.is_file():
            files.append(path)
        else:
            raise ConfigError(f"input {path} does not exist")
    if not files and not default_corpus:
        raise ConfigError(f"the inputs {', '.join(map(str, inputs)) or '(none)'} hold no files")
    return files


def pieces(files: Sequence[Path], default_corpus: bool = False) -> Iterator[Piece]:
    """Every document of every file, in order, as pieces of at most about PIECE_CHARS characters; first the
    default corpus (Python's documentation, a document per topic) when asked for."""
    if default_corpus:
        for document in sources.default_corpus_documents()[0]:
            yield Piece(document, True)
    for path in files:
        if path.suffix == ".jsonl":
            yield from _jsonl_documents(path)
        else:
            yield from _text_pieces(path)


def _text_pieces(path: Path) -> Iterator[Piece]:
    try:
        with open(path, encoding="utf-8", newline="") as file:
            starts, buffer, size = True, [], 0
            for line in file:
                buffer.append(line)
                size += len(line)
                if size >= PIECE_CHARS:
                    yield Piece("".join(buffer), starts)
                    starts, buffer, size = False, [], 0
            if buffer or starts:
                yield Piece("".join(buffer), starts)
    except UnicodeDecodeError as error:
        raise ConfigError(f"{path} is not UTF-8 text ({error.reason} at byte {error.start} of a chunk)") from None
    except OSError as error:
        raise ConfigError(f"cannot read {path}: {error.strerror or error}") from None


def _jsonl_documents(path: Path) -> Iterator[Piece]:
    try:
        with open(path, encoding="utf-8") as file:
            for number, line in enumerate(file, 1):
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except ValueError as error:
                    raise ConfigError(f"{path}:{number} is not a JSON object: {error}") from None
                text = record.get("text") if isinstance(record, dict) else None
                if not isinstance(text, str):
                    raise ConfigError(f"{path}:{number} has no \"text\" string field")
                yield Piece(text, True)
    except UnicodeDecodeError as error:
        raise ConfigError(f"{path} is not UTF-8 text ({error.reason})") from None
    except OSError as error:
        raise ConfigError(f"cannot read {path}: {error.strerror or error}") from None


def batches_of(stream: Iterable[Piece], chars: int = BATCH_CHARS) -> Iterator[list[Piece]]:
    """Consecutive pieces, grouped into lists of about `chars` characters."""
    batch, size = [], 0
    for piece in stream:
        batch.append(piece)
        size += len(piece.text)
        if size >= chars:
            yield batch
            batch, size = [], 0
    if batch:
        yield batch


# -- writing shards ---------------------------------------------------------------------------------------------


class ShardStream:
    """Tokens appended in order become val_000000.bin (the first `val_tokens`), then train shards of
    `shard_tokens` each; each file is written as it fills, its header rewritten when it closes."""

    def __init__(self, folder: Path, version: int, val_tokens: int, shard_tokens: int) -> None:
        self.folder, self.version, self.dtype = folder, version, FORMATS[version][1]
        self.val_tokens, self.shard_tokens = val_tokens, shard_tokens
        self.written = {"val": 0, "train": 0}
        self.shards: list[dict[str, Any]] = []
        self._file: BinaryIO | None = None
        self._name, self._count, self._capacity = "", 0, 0
        self._train_index = 0

    def append(self, tokens: np.ndarray) -> None:
        tokens = tokens.astype(self.dtype)
        while tokens.size:
            if self._file is None:
                self._open_next()
            take = min(tokens.size, self._capacity - self._count)
            self._file.write(tokens[:take].tobytes())
            self._count += take
            tokens = tokens[take:]
            if self._count == self._capacity:
                self._close()

    def _open_next(self) -> None:
        if self.val_tokens and not self.written["val"] and not self.shards:
            self._name, self._capacity = "val_000000.bin", self.val_tokens
        else:
            self._name, self._capacity = f"train_{self._train_index:06d}.bin", self.shard_tokens
            self._train_index += 1
        self._file = open(self.folder / self._name, "wb")
        self._file.write(header_bytes(self.version, 0))
        self._count = 0

    def _close(self) -> None:
        self._file.seek(0)
        self._file.write(header_bytes(self.version, self._count))
        self._file.close()
        self._file = None
        role = "val" if self._name.startswith("val") else "train"
        self.written[role] += self._count
        self.shards.append({"file": self._name, "tokens": self._count})

    @property
    def tokens(self) -> int:
        """Tokens appended so far (closed shards and the open one)."""
        return sum(self.written.values()) + (self._count if self._file is not None else 0)

    def finish(self) -> None:
        if self._file is not None:
            self._close()


class Progress:
    """Tokens written and tokens/s, on one line rewritten in place on a terminal (stderr); a last line always."""

    def __init__(self, stream: TextIO = sys.stderr) -> None:
        self.stream, self.start, self.last = stream, time.perf_counter(), 0.0
        self.interactive = stream.isatty()

    def update(self, tokens: int, documents: int, force: bool = False) -> None:
        now = time.perf_counter()
        if not (force or (self.interactive and now - self.last > 0.25)):
            return
        self.last = now
        rate = tokens / max(now - self.start, 1e-9)
        end = "\n" if force else ""
        prefix = "\r\033[K" if self.interactive else ""
        self.stream.write(f"{prefix}{plural(tokens, 'token')} from {plural(documents, 'document')} | "
                          f"{rate:,.0f} tokens/s{end}")
        self.stream.flush()


# -- the command's work -------------------------------------------------------------------------------------------


def choose_tokenizer(spec: str, vocab_size: int | None, files: Sequence[Path], default_corpus: bool = False
                     ) -> tokenizers_.Tokenizer:
    """byte, bpe (trained now on the files: needs a vocabulary size) or PATH (a tokenizer.json or model folder)."""
    if spec == "byte":
        if vocab_size is not None:
            raise ConfigError("--vocab-size is for --tokenizer bpe; the byte tokenizer has 257 tokens")
        return tokenizers_.ByteTokenizer()
    if spec == "bpe":
        if vocab_size is None:
            raise ConfigError("--tokenizer bpe needs --vocab-size N (the BPE's vocabulary, e.g. 4096)")
        return tokenizers_.train_bpe((piece.text for piece in pieces(files, default_corpus)), vocab_size)
    if vocab_size is not None:
        raise ConfigError("--vocab-size is for --tokenizer bpe; a tokenizer from PATH has its own vocabulary")
    return tokenizers_.load_tokenizer(spec)


def prepare(inputs: Sequence[str | Path], out: str | Path, tokenizer: str = "byte", vocab_size: int | None = None,
            val_tokens: int = 32_768, shard_tokens: int = 100_000_000, progress: Progress | None = None,
            default_corpus: bool = False) -> dict[str, Any]:
    """Tokenize `inputs` (after the default corpus, with `default_corpus`) into shards in `out` (see the module
    docstring); returns data.json's content."""
    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ConfigError(f"--out {out} already exists and is not empty; choose another folder or remove it")
    if shard_tokens < 1 or val_tokens < 0:
        raise ConfigError("--shard-tokens must be at least 1 and --val-tokens at least 0")
    files = input_files(inputs, default_corpus)
    chosen = choose_tokenizer(tokenizer, vocab_size, files, default_corpus)
    out.resolve().parent.mkdir(parents=True, exist_ok=True)  # `--out data/books` in a fresh folder
    staging = out.resolve().parent / f".{out.name}.partial-{socket.gethostname()}-{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir()
    try:
        info = _write(staging, files, chosen, tokenizer, val_tokens, shard_tokens, progress or Progress(),
                      default_corpus)
        if out.exists():
            out.rmdir()  # empty (checked above)
        os.replace(staging, out)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return info


def _write(folder: Path, files: Sequence[Path], tokenizer: tokenizers_.Tokenizer, spec: str, val_tokens: int,
           shard_tokens: int, progress: Progress, default_corpus: bool) -> dict[str, Any]:
    version = version_for_vocab(tokenizer.vocab_size)
    stream = ShardStream(folder, version, val_tokens, shard_tokens)
    eot = np.array([tokenizer.eot_id], dtype=np.int64)
    documents = 0
    for batch in batches_of(pieces(files, default_corpus)):
        for piece, ids in zip(batch, tokenizer.encode_batch([p.text for p in batch]), strict=True):
            if piece.starts:
                stream.append(eot)
                documents += 1
            stream.append(ids)
        progress.update(stream.tokens, documents)
    stream.finish()
    progress.update(stream.tokens, documents, force=True)
    if not stream.written["train"]:
        raise ConfigError(f"the inputs give {stream.written['val']:,} tokens, all taken by --val-tokens "
                          f"{val_tokens:,}: none are left for training")
    tokenizer.save(folder)
    info = {"format": FORMAT, "version": 1,
            "tokenizer": spec if spec in ("byte", "bpe") else str(Path(spec).resolve()),
            "tokenizer_sha256": tokenizer.digest(), "vocab_size": tokenizer.vocab_size, "eot_id": tokenizer.eot_id,
            "shard_version": version, "documents": documents, "train_tokens": stream.written["train"],
            "val_tokens": stream.written["val"], "shards": stream.shards,
            "inputs": ["(default corpus)"] * default_corpus + [str(f) for f in files]}
    (folder / DATA_JSON).write_text(json.dumps(info, indent=1) + "\n", encoding="utf-8")
    return info


def cache_folder(environ: dict[str, str] = os.environ) -> Path:
    """Where prepared data is kept between runs: $MPIPARALLEL_CACHE, else $XDG_CACHE_HOME/mpiparallel, else
    ~/.cache/mpiparallel."""
    if environ.get(CACHE_VARIABLE):
        return Path(environ[CACHE_VARIABLE])
    return Path(environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "mpiparallel"


def cached_default_corpus(cache: Path | None = None, announce: Callable[[str], object] | None = None) -> Path:
    """The default corpus prepared with its own BPE (DEFAULT_VOCAB_SIZE), built on first use into the cache and
    found there afterwards. The folder is named by a hash of the corpus text, which changes with the Python
    version; training the BPE is deterministic, so every process that builds it writes the same files, and two
    that build it at once both end with one complete folder (the loser's rename fails and its copy is dropped).
    `announce` is told, before a build, what is being built and where."""
    documents, source = sources.default_corpus_documents()
    # the documents, each behind an end-of-text token, name the folder (earlier versions hashed one document)
    digest = hashlib.sha256("".join("\x00" + document for document in documents).encode("utf-8")).hexdigest()[:16]
    cache = cache_folder() if cache is None else cache
    folder = cache / f"default-corpus-bpe{DEFAULT_VOCAB_SIZE}-{digest}"
    if (folder / DATA_JSON).is_file():
        return folder
    if announce is not None:
        announce(f"preparing the default corpus once: a {DEFAULT_VOCAB_SIZE:,}-token BPE trained on {source}, "
                 f"cached in {folder} (--data names other data)")
    try:
        cache.mkdir(parents=True, exist_ok=True)
        prepare([], folder, "bpe", DEFAULT_VOCAB_SIZE, val_tokens=DEFAULT_VAL_TOKENS, progress=Progress(io.StringIO()),
                default_corpus=True)
    except (OSError, ConfigError) as error:
        if (folder / DATA_JSON).is_file():  # another process finished first
            return folder
        raise ConfigError(f"cannot prepare the default corpus in {cache} ({error}); set {CACHE_VARIABLE} to a "
                          "writable folder, or pass --data") from None
    return folder


# -- data info ------------------------------------------------------------------------------------------------------


def describe(path: str | Path, first_tokens: int = 32) -> str:
    """A data folder's or one shard's headers, token counts and tokenizer, and its first tokens decoded."""
    path = Path(path)
    if path.is_dir():
        folder, shards = path, sorted(path.glob("*.bin"))
        if not shards:
            raise ConfigError(f"{path} holds no .bin shards")
    elif path.is_file():
        folder, shards = path.parent, [path]
    else:
        raise ConfigError(f"{path} does not exist")
    info = read_data_json(folder)
    written = [entry.get("file") for entry in info.get("shards", []) if isinstance(entry, dict)]
    shards.sort(key=lambda shard: (written.index(shard.name) if shard.name in written else len(written), shard.name))
    headers = [read_header(shard) for shard in shards]
    lines = [f"{path}: {len(shards)} shard{'s' if len(shards) > 1 else ''}, "
             f"{sum(h.token_count for h in headers):,} tokens"]
    for header in headers:
        magic = FORMATS[header.version][0]
        lines.append(f"  {header.path.name:<28} magic {magic} version {header.version} ({header.dtype.name}) "
                     f"{header.token_count:>14,} tokens")
    tokenizer = tokenizers_.tokenizer_of_folder(folder, info)
    if info:
        lines.append(f"tokenizer: {info.get('tokenizer')} (sha256 {info.get('tokenizer_sha256')}), vocabulary "
                     f"{info.get('vocab_size')}, end-of-text id {info.get('eot_id')}; {info.get('documents', '?'):,} "
                     f"documents, {info.get('train_tokens', 0):,} train and {info.get('val_tokens', 0):,} val tokens")
    elif tokenizer is None:
        lines.append("tokenizer: unknown (no data.json or tokenizer.json beside the shards)")
    first = np.fromfile(headers[0].path, dtype=headers[0].dtype, count=min(first_tokens, headers[0].token_count),
                        offset=HEADER_BYTES).astype(np.int64)
    lines.append(f"first {len(first)} tokens of {headers[0].path.name}: {first.tolist()}")
    if tokenizer is not None:
        lines.append(f"decoded: {tokenizer.decode(first)!r}")
    return "\n".join(lines)
