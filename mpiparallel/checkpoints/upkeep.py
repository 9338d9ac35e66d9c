"""Looking after training checkpoints: checking one is whole (`checkpoint info --verify`; `train --resume` before
it reads one, `verify_before_resume`), keeping only the newest N (`train --keep-checkpoints`), the disk they use,
and exporting one with its run's tokenizer as a Hugging Face folder (`checkpoint export`). No MPI: everything here
reads and writes files.

Verifying reads every byte: each shard file the manifest lists must have the bytes and SHA-256 recorded when it
was saved (manifests written before checksums were recorded have bytes only: that is said), and every shard
entry must be in its file with the dtype and box size the manifest gives.
"""

from __future__ import annotations

import glob
import math
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import safetensors

from models.transformer import GPTConfig, expert_bias_shapes, parameter_shapes

from ..errors import ConfigError
from .sharded import _STEP_FOLDER, MANIFEST, TrainingCheckpoint, damaged, file_checksum


def size_problems(saved: TrainingCheckpoint) -> list[str]:
    """The shard files that are missing or not the size the manifest records (cheap: one stat per file)."""
    problems = []
    for entry in saved.manifest.get("files", []):
        path = saved.folder / entry["file"]
        if not path.is_file():
            problems.append(f"{entry['file']} is missing")
        elif path.stat().st_size != entry.get("bytes"):
            problems.append(f"{entry['file']} has {path.stat().st_size:,} bytes, the manifest records "
                            f"{entry.get('bytes', 0):,} (truncated or overwritten)")
    return problems


def checksum_problems(saved: TrainingCheckpoint, files: list[dict[str, Any]]) -> list[str]:
    """The shard files among `files` (manifest entries) whose SHA-256 differs from the one the manifest records."""
    return [f"{entry['file']}: SHA-256 differs from the manifest's (the file changed after saving)"
            for entry in files if "sha256" in entry and (saved.folder / entry["file"]).is_file()
            and file_checksum(saved.folder / entry["file"]) != entry["sha256"]]


def verify_before_resume(saved: TrainingCheckpoint, rank: int, ranks: int) -> None:
    """What `--resume` checks before it reads: every shard file's size, then the SHA-256 of the files this rank is
    given — file i to rank i mod `ranks`, so the ranks share the reading (GPT-2 124M's float32 state, 1.5 GB,
    hashes in about 1 s on one core). A CorruptCheckpoint names the first file that differs."""
    problems = size_problems(saved) or checksum_problems(saved, saved.manifest.get("files", [])[rank::ranks])
    if problems:
        raise damaged(saved.folder, problems[0])


def verify(saved: TrainingCheckpoint) -> tuple[list[str], list[str]]:
    """(problems, notes): every shard file's size and SHA-256 against the manifest, then every shard entry read
    back with its dtype and box size. No problems: the checkpoint is whole."""
    problems, notes = size_problems(saved), []
    files = saved.manifest.get("files", [])
    unsummed = [entry["file"] for entry in files if "sha256" not in entry]
    if unsummed:
        notes.append(f"{len(unsummed)} of {len(files)} shard files have no checksum in the manifest (saved before "
                     f"checksums were recorded): their sizes and contents' readability are checked, not their bits")
    problems += checksum_problems(saved, files)
    if problems:
        return problems, notes
    for name, tensor in saved.tensors.items():
        for shard in tensor["shards"]:
            problem = _shard_problem(saved.folder / shard["file"], shard, np.dtype(tensor["dtype"]))
            if problem:
                problems.append(f"{name}: {problem}")
    return problems, notes


def _shard_problem(path: Path, shard: Mapping[str, Any], dtype: np.dtype) -> str | None:
    try:
        with safetensors.safe_open(str(path), framework="np") as file:
            values = file.get_tensor(shard["key"])
    except (safetensors.SafetensorError, OSError, ValueError, TypeError, KeyError) as error:
        return f"entry {shard['key']} of {shard['file']} cannot be read: {error}"
    if values.dtype != dtype or values.size != math.prod(shard["sizes"]):
        return (f"entry {shard['key']} of {shard['file']} is {values.dtype} of {values.size} elements, the manifest "
                f"says {dtype} of {math.prod(shard['sizes'])}")
    return None


def complete_steps(directory: str | Path) -> list[Path]:
    """The complete step folders of a checkpoint directory, oldest first."""
    path = Path(directory)
    if not path.is_dir():
        return []
    found = [(int(match.group(1)), entry) for entry in path.iterdir()
             if (match := _STEP_FOLDER.match(entry.name)) and (entry / MANIFEST).is_file()]
    return [entry for _, entry in sorted(found)]


def prune(directory: str | Path, keep: int) -> list[Path]:
    """Remove all but the newest `keep` complete checkpoints (keep 0: keep all); the removed folders. The
    manifest goes first, so a folder half removed is an unfinished save, never a checkpoint."""
    folders = complete_steps(directory)
    removed = folders[:-keep] if 0 < keep < len(folders) else []
    for folder in removed:
        (folder / MANIFEST).unlink()
        shutil.rmtree(folder, ignore_errors=True)
    return removed


def folder_bytes(folder: str | Path) -> int:
    """The bytes of the files under a folder."""
    return sum(path.stat().st_size for path in Path(folder).rglob("*") if path.is_file())


def mesh_words(mesh: Mapping[str, Any]) -> str:
    """A saved mesh in a few words: "4 ranks: dp 2 × tp 2" (axes of size 1 left out, ZeRO when on, and its shard
    groups with hybrid sharding: "zero 3 sharded over 2")."""
    axes = [f"{axis} {mesh[axis]}" for axis in ("dp", "tp", "pp", "cp", "ep") if mesh.get(axis, 1) > 1]
    zero = f", zero {mesh['zero']}" if mesh.get("zero") else ""
    if mesh.get("zero") and mesh.get("dp_shard") and mesh["dp_shard"] < mesh.get("dp", 1):
        zero += f" sharded over {mesh['dp_shard']}"
    return f"{mesh.get('world_size', '?')} rank{'s' if mesh.get('world_size') != 1 else ''}: " \
           f"{' × '.join(axes) or 'serial'}{zero}"


def run_tokenizer(saved: TrainingCheckpoint) -> tuple[Any, str]:
    """(the tokenizer the saved run trained with, where it came from), as `train --save` finds it: the data
    folder's (`data prepare`'s data.json and tokenizer.json; the default corpus's in the cache, prepared again if
    the cache was emptied), else the --init folder's, else bytes for a byte vocabulary; (None, why) when the run's
    data names none (llm.c's shards, a .npy of ids)."""
    from .. import data
    from ..data.dataset import read_data_json

    settings = saved.manifest.get("settings", {})
    path, init = settings.get("data", {}).get("data"), settings.get("model", {}).get("init")
    folder, words = None, f"the data's, {path}"
    if path is None:
        folder, words = data.cached_default_corpus(), "the default corpus's, in the cache"
    elif Path(path).is_dir():
        folder = Path(path)
    elif path.endswith(".bin") and (shards := sorted(glob.glob(path))):  # a shard or a glob of them, as train
        folder = Path(shards[0]).parent
    found = data.tokenizer_of_folder(folder, read_data_json(folder)) if folder is not None else None
    if found is None and init is not None:
        found, words = data.tokenizer_of_folder(init), f"the --init folder's, {init}"
    vocab = saved.manifest.get("model", {}).get("vocab_size", 0)
    if found is None and vocab <= data.ByteTokenizer.vocab_size:
        return data.ByteTokenizer(), "bytes (no tokenizer file: generate reads and writes UTF-8 bytes)"
    if found is None:
        return None, (f"the run's data ({path}) names no tokenizer: copy the one that made its ids beside the "
                      f"model as tokenizer.json")
    return found, words


def whole_model(saved: TrainingCheckpoint) -> tuple[GPTConfig, dict[str, np.ndarray]]:
    """The serial model's config and tensors (parameters and expert biases) from a checkpoint of any mesh."""
    try:
        config = GPTConfig(**saved.manifest["model"])
    except (KeyError, TypeError) as error:
        raise ConfigError(f"checkpoint {saved.folder} does not describe its model: {error}") from None
    names = [*parameter_shapes(config), *expert_bias_shapes(config)]
    missing = [name for name in names if name not in saved.tensors]
    if missing:
        raise ConfigError(f"checkpoint {saved.folder} lacks {', '.join(missing[:3])}")
    return config, {name: saved.read_box(name, [0] * len(saved.tensors[name]["shape"]), saved.tensors[name]["shape"])
                    for name in names}
