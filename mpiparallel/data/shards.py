"""llm.c's token shards: the file format, written and read memory-mapped, so a rank's memory does not grow with
the dataset.

A shard is a header of 256 little-endian int32 — magic, version, token count, then zeros — followed by the tokens:
magic 20240520 and version 1 for uint16 tokens (vocabularies up to 65,536, GPT-2's 50,257), magic 20240801 and
version 7 for uint32 tokens (Llama 3's 128,256). llm.c's own shards (`fineweb_train_000001.bin` …) are read as
they are. A reader maps the file (no copy), copies out only the token range it is asked for, and then tells the
kernel it no longer needs those pages (MADV_DONTNEED): the page cache keeps them, but this process's resident set
does not grow with the tokens it has read, whatever the dataset's size. No communication.
"""

from __future__ import annotations

import mmap
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..errors import ConfigError

HEADER_INTS = 256
HEADER_BYTES = HEADER_INTS * 4
FORMATS = {1: (20240520, np.dtype("<u2")), 7: (20240801, np.dtype("<u4"))}
"""version -> (magic, token dtype)."""
UINT16_VOCAB = 1 << 16


def version_for_vocab(vocab_size: int) -> int:
    """1 (uint16 tokens) when every id fits 16 bits, else 7 (uint32)."""
    return 1 if vocab_size <= UINT16_VOCAB else 7


def header_bytes(version: int, token_count: int) -> bytes:
    """The 1024-byte header of a shard of `token_count` tokens."""
    header = np.zeros(HEADER_INTS, dtype="<i4")
    header[:3] = FORMATS[version][0], version, token_count
    return header.tobytes()


def write_shard(path: str | Path, tokens: np.ndarray, version: int) -> None:
    """One shard in llm.c's format (written whole; `ShardWriter` streams)."""
    dtype = FORMATS[version][1]
    if len(tokens) and int(np.max(tokens)) > np.iinfo(dtype).max:
        raise ValueError(f"token id {int(np.max(tokens))} does not fit a version-{version} shard ({dtype})")
    with open(path, "wb") as file:
        file.write(header_bytes(version, len(tokens)))
        file.write(np.asarray(tokens).astype(dtype).tobytes())


@dataclass(frozen=True)
class ShardHeader:
    """What a shard's header says: version, token count, and the token dtype that follows."""

    path: Path
    version: int
    token_count: int

    @property
    def dtype(self) -> np.dtype:
        return FORMATS[self.version][1]

    @property
    def file_bytes(self) -> int:
        return HEADER_BYTES + self.token_count * self.dtype.itemsize


def read_header(path: str | Path) -> ShardHeader:
    """The shard's header, checked against its magic, version and the file's size (one clear error each)."""
    path = Path(path)
    try:
        with open(path, "rb") as file:
            raw = file.read(HEADER_BYTES)
        size = path.stat().st_size
    except OSError as error:
        raise ConfigError(f"cannot read shard {path}: {error.strerror or error}") from None
    if len(raw) < HEADER_BYTES:
        raise ConfigError(f"{path} is {len(raw)} bytes, shorter than an llm.c shard header ({HEADER_BYTES} bytes)")
    magic, version, count = (int(v) for v in np.frombuffer(raw, dtype="<i4", count=3))
    if version not in FORMATS or FORMATS[version][0] != magic:
        known = ", ".join(f"magic {m} version {v}" for v, (m, _) in FORMATS.items())
        raise ConfigError(f"{path} is not an llm.c token shard: magic {magic} version {version} (expected {known})")
    header = ShardHeader(path, version, count)
    if count < 0 or size != header.file_bytes:
        state = "truncated" if size < header.file_bytes else "longer than its header says"
        raise ConfigError(f"shard {path} is {state}: its header promises {count:,} tokens ({header.file_bytes:,} "
                          f"bytes), the file has {size:,} bytes")
    return header


class MappedShard:
    """A shard's tokens memory-mapped; `read` copies a range out and releases its pages again."""

    def __init__(self, path: str | Path) -> None:
        self.header = read_header(path)
        self.path = self.header.path
        with open(self.path, "rb") as file:
            # an empty mapping is not allowed: a shard without tokens maps nothing
            self._map = mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) if self.header.token_count else None
        self.tokens = (np.frombuffer(self._map, dtype=self.header.dtype, count=self.header.token_count,
                                     offset=HEADER_BYTES) if self._map is not None
                       else np.zeros(0, self.header.dtype))

    def __len__(self) -> int:
        return self.header.token_count

    def read(self, start: int, stop: int) -> np.ndarray:
        """Tokens [start, stop) as int64 (a copy); the pages they came from leave this process's resident set."""
        tokens = self.tokens[start:stop].astype(np.int64)
        self._release(start, stop)
        return tokens

    def _release(self, start: int, stop: int) -> None:
        if self._map is None or stop <= start:
            return
        itemsize, page = self.header.dtype.itemsize, mmap.PAGESIZE
        first = (HEADER_BYTES + start * itemsize) // page * page
        last = min(HEADER_BYTES + stop * itemsize, len(self._map))
        self._map.madvise(mmap.MADV_DONTNEED, first, last - first)


def resident_bytes() -> tuple[int, int]:
    """(VmRSS, VmHWM) of this process in bytes, from /proc/self/status (Linux); (0, 0) elsewhere."""
    values = {}
    try:
        with open(f"/proc/{os.getpid()}/status") as status:
            for line in status:
                key, _, rest = line.partition(":")
                if key in ("VmRSS", "VmHWM"):
                    values[key] = int(rest.split()[0]) * 1024
    except OSError:
        return 0, 0
    return values.get("VmRSS", 0), values.get("VmHWM", 0)
