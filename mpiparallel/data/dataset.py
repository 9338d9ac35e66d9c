"""What `train --data` and `--val-data` name, opened: token segments, where they came from, and their fingerprint.

PATH is a folder written by `data prepare` (or holding llm.c's shards: `*train*.bin` for training, `*val*.bin`
for validation, `data.json` and `tokenizer.json` when present), one `.bin` shard, a quoted glob of shards (sorted
by name), a `.npy` array of token ids, or any other file read as bytes (`train` without `--data` opens the
default corpus's cached folder, `prepare.cached_default_corpus`). Shards are memory-mapped
(`shards.MappedShard`); the rest is loaded whole (`sources`). A dataset is a list of segments — (source, start,
stop) — so validation held out from the end of the training tokens is two lists of views, not a copy. The
fingerprint (each file's name, size and a hash of its first 1024 bytes — a shard's header) is what a training
checkpoint records, so that resuming on other data is an error. No communication: every rank opens the same
files and reads only its rows of each batch (`order.TokenBatches`).
"""

from __future__ import annotations

import glob
import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from ..errors import ConfigError
from . import order, sources
from .shards import HEADER_BYTES, MappedShard

DATA_JSON = "data.json"
GLOB_CHARACTERS = set("*?[")


class Source(Protocol):
    def __len__(self) -> int: ...

    def read(self, start: int, stop: int) -> np.ndarray: ...


class ArraySource:
    """Tokens held in memory."""

    def __init__(self, tokens: np.ndarray) -> None:
        self.tokens = tokens

    def __len__(self) -> int:
        return len(self.tokens)

    def read(self, start: int, stop: int) -> np.ndarray:
        return np.array(self.tokens[start:stop], dtype=np.int64)


@dataclass
class Dataset:
    """Token segments (source, start, stop) in order, a description for messages, and what is known about them:
    the files they come from, the vocabulary they need (in memory: checked at load; memory-mapped: unknown until
    read, so checked batch by batch), and the folder's data.json (tokenizer, vocabulary)."""

    segments: list[tuple[Source, int, int]]
    description: str
    files: list[Path] = field(default_factory=list)
    vocab_needed: int | None = None
    info: dict[str, Any] = field(default_factory=dict)
    folder: Path | None = None
    fingerprint_extra: dict[str, Any] = field(default_factory=dict)

    @property
    def mapped(self) -> bool:
        return any(isinstance(source, MappedShard) for source, _, _ in self.segments)

    @property
    def token_count(self) -> int:
        return sum(stop - start for _, start, stop in self.segments)

    def batches(self, batch_size: int, seq_len: int, shuffle: bool = False, seed: int = 0,
                vocab_size: int | None = None) -> order.TokenBatches:
        """The contract's batches of these tokens; with `vocab_size`, a token id outside it is a ConfigError when
        read (memory-mapped tokens are only seen when read)."""
        def read(segment: int, start: int, stop: int) -> np.ndarray:
            source, first, _ = self.segments[segment]
            tokens = source.read(first + start, first + stop)
            if vocab_size is not None and tokens.size and int(tokens.max()) >= vocab_size:
                name = getattr(source, "path", self.description)
                raise ConfigError(f"{name} holds token id {int(tokens.max())} (near token {first + start:,}), but "
                                  f"the model's vocabulary has {vocab_size} tokens; use --vocab-size "
                                  f"{int(tokens.max()) + 1} or more")
            return tokens

        return order.TokenBatches([stop - start for _, start, stop in self.segments], read, batch_size, seq_len,
                                  shuffle, seed, self.description,
                                  checked_when_read=self.mapped and vocab_size is not None)

    def split_tail(self, fraction: float) -> tuple[Dataset, Dataset]:
        """(train, validation): the last ⌊N·fraction⌋ tokens held out, as `sources.split_train_validation` does
        for one array (so a shard and a `.npy` of the same tokens split alike)."""
        if not 0 <= fraction < 1:
            raise ConfigError(f"the validation fraction must lie in [0, 1), got {fraction}")
        boundary = self.token_count - int(self.token_count * fraction)
        head, tail, seen = [], [], 0
        for source, start, stop in self.segments:
            cut = min(max(boundary - seen, 0), stop - start)
            if cut > 0:
                head.append((source, start, start + cut))
            if start + cut < stop:
                tail.append((source, start + cut, stop))
            seen += stop - start
        common = {"files": self.files, "vocab_needed": self.vocab_needed, "info": self.info, "folder": self.folder}
        return (Dataset(head, self.description, **common),
                Dataset(tail, f"the held-out {fraction:.0%} of {self.description}", **common))

    def fingerprint(self) -> dict[str, Any]:
        """Names, sizes and header hashes of the files (plus a content hash where the tokens are not a file)."""
        files = []
        for path in self.files:
            with open(path, "rb") as file:
                head = hashlib.sha256(file.read(HEADER_BYTES)).hexdigest()[:16]
            files.append({"name": path.name, "bytes": path.stat().st_size, "head_sha256": head})
        return {"files": files, **self.fingerprint_extra}

    @property
    def vocab_size(self) -> int | None:
        """The vocabulary the data was prepared for (data.json), if known."""
        value = self.info.get("vocab_size")
        return value if isinstance(value, int) else None


def open_data(path: str, role: str = "train") -> Dataset:
    """The dataset `--data PATH` (role "train") or `--val-data PATH` (role "val") names."""
    if set(path) & GLOB_CHARACTERS and not Path(path).exists():
        matches = sorted(glob.glob(path))
        if not matches:
            raise ConfigError(f"the glob {path!r} matches no file")
        return _shards([Path(m) for m in matches], f"{len(matches)} shards matching {path}", Path(matches[0]).parent)
    resolved = Path(path)
    if resolved.is_dir():
        return _folder(resolved, role)
    if resolved.suffix == ".bin":
        if not resolved.is_file():
            raise ConfigError(f"data file {resolved} does not exist")
        return _shards([resolved], f"shard {resolved}", resolved.parent)
    return _in_memory(sources.load_tokens(resolved), [resolved], {})


def validation_in_folder(path: str | None) -> Dataset | None:
    """The validation shards beside `--data` when it names a folder that has some."""
    if path is None or not Path(path).is_dir() or not sorted(Path(path).glob("*val*.bin")):
        return None
    return _folder(Path(path), "val")


def _in_memory(token_data: sources.TokenData, files: list[Path], extra: dict[str, Any]) -> Dataset:
    tokens = token_data.tokens
    return Dataset([(ArraySource(tokens), 0, len(tokens))], token_data.description, files, token_data.vocab_size_needed,
                   fingerprint_extra=extra)


def _folder(folder: Path, role: str) -> Dataset:
    pattern = "*train*.bin" if role == "train" else "*val*.bin"
    paths = sorted(folder.glob(pattern))
    if not paths:
        raise ConfigError(f"data folder {folder} has no {pattern} shards (write some with `mpiparallel data "
                          f"prepare`)")
    return _shards(paths, f"{len(paths)} {role} shard{'s' if len(paths) > 1 else ''} in {folder}", folder)


def _shards(paths: list[Path], description: str, folder: Path) -> Dataset:
    for path in paths:
        if path.suffix != ".bin" or not path.is_file():
            raise ConfigError(f"{path} is not a .bin token shard")
    shards = [MappedShard(path) for path in paths]
    segments: list[tuple[Source, int, int]] = [(shard, 0, len(shard)) for shard in shards]
    return Dataset(segments, description, paths, info=read_data_json(folder), folder=folder)


def read_data_json(folder: Path) -> dict[str, Any]:
    """A folder's data.json (empty when there is none, as beside llm.c's own shards)."""
    path = folder / DATA_JSON
    if not path.is_file():
        return {}
    try:
        info = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as error:
        raise ConfigError(f"cannot read {path}: {error}") from None
    if not isinstance(info, dict):
        raise ConfigError(f"{path} does not hold a JSON object")
    return info
