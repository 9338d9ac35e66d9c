"""The data of the training matrices: the default corpus as a text file, which `train --data` reads as bytes
(vocabulary 256). Their models are tiny (16-32 channels), so the default data's 2,048-token embedding would be
most of their parameters — and of ZeRO's 4 KB buckets, whose count sets the number of collectives: the matrices
ran 4× longer with it. Bytes keep them about the axes, not the embedding."""

from __future__ import annotations

import os
import socket
from typing import Any

from mpiparallel.data.prepare import cache_folder
from mpiparallel.data.sources import default_corpus_text


def byte_corpus() -> str:
    """The file, written once per cache folder (the tests use a fresh one per session). Every rank may write it:
    each writes its own copy under a unique name and renames it into place, and the copies are the same bytes."""
    path = cache_folder() / "default-corpus-bytes.txt"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        staging = path.with_name(f".{path.name}.{socket.gethostname()}-{os.getpid()}")
        staging.write_text(default_corpus_text()[0], encoding="utf-8")
        os.replace(staging, path)
    return str(path)


def on_bytes(options: dict[str, Any]) -> dict[str, Any]:
    """`options` with the byte corpus as their data unless they name data of their own."""
    return {"data": byte_corpus(), **options}
