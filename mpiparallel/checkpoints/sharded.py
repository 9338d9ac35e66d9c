"""Training checkpoints: every rank writes what it holds, one manifest describes it, any mesh reads it back.

A checkpoint is a folder DIR/step-{k:08d}/ (k: completed optimizer steps, so a resumed run starts with step k):

    rank-{r:05d}.safetensors   the boxes of logical tensors that world rank r wrote (one safetensors entry per box)
    manifest.json              written last: step, data position, settings, the mesh it was saved from, the
                               optimizer's scalars, every shard file's bytes and SHA-256, and for every logical
                               tensor its dtype, global shape and shards (file, key, offset and size per dimension)

Logical tensors are the parameters (Hugging Face names), the AdamW moments (`exp_avg/NAME`, `exp_avg_sq/NAME`)
and the MoE expert biases — the serial model's tensors, whatever mesh saved them. No pickle anywhere.

What a rank holds of one logical tensor is a `Piece`: elements [start, stop) of its flattened local shard, the
local shard being the tensor cut by the Sharded axes of its placement (tensor parallelism, padding included). A
whole shard is the range of all its elements; a ZeRO shard segment (`FlatShard`) is a smaller range. A flat range
splits into at most 2·ndim − 1 boxes of the local shard (`flat_range_boxes`), and each of those into boxes of the
global tensor (`Part`: the blocks of fused q|k|v columns and the vocabulary padding are where it splits). Each
global box is one safetensors entry. ZeRO's ranges are described rather than gathered over dp first: every rank
then writes exactly what it holds, no rank needs memory beyond its own state, and the writing is spread over all
ranks instead of falling on one.

Replicas are written once: a rank writes a piece only where it is the copy that counts once (`counts_once`, the
same rule that counts each gradient once in the global norm) — coordinate 0 of every axis that replicates it.
So every element of every logical tensor lies in exactly one shard, which `save` checks before the manifest.

Saving (`save`): rank 0 readies the step folder (an old manifest there is removed first, so the folder counts as
incomplete until the new one lands); every rank writes its file under a temporary name, fsyncs it and renames it;
the shard lists are gathered to rank 0, which fsyncs the folder and then writes manifest.json the same way
(temporary name, fsync, rename, fsync of the folder). A step folder without manifest.json is ignored by
`latest_training_checkpoint`, so a crash while saving leaves the previous checkpoint in charge.
Communication: an all-gather of rank 0's readiness, a gather of the shard descriptions (about a hundred bytes per
box) and a barrier.

Loading (`TrainingCheckpoint.read_piece`): each rank reads, from the shard files, only the boxes its own pieces
cover (safetensors' `get_slice`), so a checkpoint saved on one mesh resumes on any other — resharding happens on
load, without communication. Reading back on the mesh that saved it gives the same bits.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from itertools import product
from pathlib import Path
from typing import Any

import numpy as np
import safetensors
import safetensors.numpy

from collectives import Communicator
from collectives.backend import Array, like, to_host
from models.parameter import HELD, Placement, Sharded, counts_once, local_shape, padded_length
from models.transformer import GPTConfig

from ..errors import ConfigError, CorruptCheckpoint, on_every_rank
from ..mesh import Mesh
from ..text import plural
from .hugging_face import public_file_mode, read_json_object

MANIFEST = "manifest.json"
FORMAT = "mpiparallel training checkpoint"
VERSION = 1
MOMENT_KEYS = ("exp_avg", "exp_avg_sq")
"""The optimizer state that is one array per parameter (AdamW's moments), saved as `KEY/parameter name`."""

_STEP_FOLDER = re.compile(r"^step-(\d{8,})$")
_RANK_FILE = re.compile(r"^rank-\d+\.safetensors$")


def step_folder(directory: str | Path, step: int) -> Path:
    return Path(directory) / f"step-{step:08d}"


# -- what a rank holds, and where it lies in the global tensor ------------------------------------------------


@dataclass(frozen=True)
class Piece:
    """Elements [start, stop) of this rank's flattened local shard of the logical tensor `name` (stop None: to
    the end). The local shard is the global tensor of `shape` cut by the Sharded axes of `placement`, where this
    rank has the (coordinate, size) of `ranks`."""

    name: str
    shape: tuple[int, ...]
    placement: Mapping[str, Placement]
    ranks: Mapping[str, tuple[int, int]]
    start: int = 0
    stop: int | None = None

    @property
    def local_shape(self) -> tuple[int, ...]:
        return local_shape(self.shape, self.placement, {axis: size for axis, (_, size) in self.ranks.items()})

    @property
    def bounds(self) -> tuple[int, int]:
        return self.start, math.prod(self.local_shape) if self.stop is None else self.stop


@dataclass(frozen=True)
class Part:
    """A box of a piece that is also one box of the global tensor: in the piece's flat data, the box of
    `box_shape` starting at element `start`, of which `within` selects this part; in the global tensor, the box
    at `offsets` of `sizes`."""

    start: int
    box_shape: tuple[int, ...]
    within: tuple[slice, ...]
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]

    def view(self, flat: np.ndarray) -> np.ndarray:
        """This part of a piece's flat data (a view)."""
        box = flat[self.start:self.start + math.prod(self.box_shape)].reshape(self.box_shape)
        return box[self.within] if self.within else box[...]


def flat_range_boxes(shape: Sequence[int], start: int, stop: int) -> list[tuple[int, tuple[int, ...],
                                                                                 tuple[int, ...]]]:
    """Elements [start, stop) of a row-major array of `shape` as boxes (flat start, offsets, sizes), each one a
    contiguous run of elements: the tail of the first row, the whole rows between, the head of the last row
    (recursively), so at most 2·ndim − 1 boxes."""
    if start >= stop:
        return []
    if not shape:
        return [(0, (), ())]
    inner = math.prod(shape[1:])
    first, first_offset = divmod(start, inner)
    last, last_offset = divmod(stop, inner)

    def within_row(row: int, lo: int, hi: int) -> list[tuple[int, tuple[int, ...], tuple[int, ...]]]:
        return [(row * inner + flat, (row, *offsets), (1, *sizes))
                for flat, offsets, sizes in flat_range_boxes(shape[1:], lo, hi)]

    if first == last:
        return within_row(first, first_offset, last_offset)
    boxes = within_row(first, first_offset, inner) if first_offset else []
    first_whole = first + (first_offset > 0)
    if last > first_whole:
        boxes.append((first_whole * inner, (first_whole, *[0] * (len(shape) - 1)), (last - first_whole, *shape[1:])))
    return boxes + within_row(last, 0, last_offset)


def _dimension_runs(piece: Piece) -> list[list[tuple[int, int, int]]]:
    """Per dimension of the local shard, its runs (local start, global start, length) that lie in the global
    tensor; padding lies in none. A Sharded(dim, blocks) axis leaves one run per block on that dimension."""
    runs = [[(0, 0, length)] for length in piece.shape]
    for axis, how in piece.placement.items():
        if isinstance(how, Sharded):
            if runs[how.dim] != [(0, 0, piece.shape[how.dim])]:
                raise ValueError(f"{piece.name}: two axes shard dimension {how.dim}; checkpoints cut one axis per "
                                 f"dimension")
            rank, size = how.cut(*piece.ranks.get(axis, (0, 1)))
            runs[how.dim] = _sharded_runs(piece.shape[how.dim], how.blocks, rank, size)
    return runs


def _sharded_runs(length: int, blocks: int, rank: int, size: int) -> list[tuple[int, int, int]]:
    """`models.parameter.shard_along`'s cut as runs: rank `rank` holds `share` entries of every block (padded to a
    multiple of `size`), of which those before the block's end are real."""
    block = length // blocks
    share = padded_length(length, blocks, size) // (blocks * size)
    real = min(share, block - rank * share)
    return [(b * share, b * block + rank * share, real) for b in range(blocks)] if real > 0 else []


def parts(piece: Piece) -> list[Part]:
    """The piece as boxes of the global tensor, in the order of its flat data."""
    runs = _dimension_runs(piece)
    found = []
    for start, offsets, sizes in flat_range_boxes(piece.local_shape, *piece.bounds):
        overlaps = [_overlaps(dimension_runs, lo, size) for dimension_runs, lo, size in zip(runs, offsets, sizes,
                                                                                              strict=True)]
        for choice in product(*overlaps):
            found.append(Part(start - piece.bounds[0], tuple(sizes), tuple(slice(a, b) for a, b, _ in choice),
                              tuple(g for _, _, g in choice), tuple(b - a for a, b, _ in choice)))
    return found


def _overlaps(runs: list[tuple[int, int, int]], lo: int, size: int) -> list[tuple[int, int, int]]:
    """Where the local interval [lo, lo + size) meets each run: (start, stop) inside the interval, and the global
    index of that start."""
    found = []
    for local, global_start, length in runs:
        a, b = max(lo, local), min(lo + size, local + length)
        if a < b:
            found.append((a - lo, b - lo, global_start + a - local))
    return found


def writes_copy(placement: Mapping[str, Placement], mesh: Mesh) -> bool:
    """Whether this rank writes its copy of a piece so placed: the copy that counts once (`counts_once`), on the
    mesh's axes and on those expert parallelism or hybrid sharding split dp into (`Mesh.coordinates_for`)."""
    return counts_once(placement, mesh.coordinates_for(placement))


def parameter_pieces(sources: Iterable[Any], ranks: Mapping[str, tuple[int, int]],
                     values: Mapping[str, Array] | None = None, prefix: str = "") -> list[tuple[Piece, Array]]:
    """(Piece, array) for each optimizer parameter — a whole Parameter or a ZeRO ShardSegment (its `parameter`,
    `start`, `stop`) — named prefix + the parameter's name; the array is `values[source.name]` (an optimizer
    moment), else the source's data."""
    held = []
    for source in sources:
        parameter = getattr(source, "parameter", source)
        piece = Piece(prefix + parameter.name, parameter.full_shape, source.placement, ranks,
                      getattr(source, "start", 0), getattr(source, "stop", None))
        held.append((piece, weights_of(source) if values is None else values[source.name]))
    return held


def weights_of(source: Any) -> Array:
    """The weights a checkpoint holds for a parameter or ZeRO segment: its master copy under mixed precision (the
    working copy is a rounding of it), else its data."""
    master = getattr(source, "master", None)
    return source.data if master is None else master


def expert_bias_pieces(biases: Mapping[str, Array]) -> list[tuple[Piece, Array]]:
    """The expert biases of this rank's layers: whole tensors, held by the pipeline rank of their layer and equal
    on every other axis."""
    return [(Piece(name, tuple(bias.shape), {"pp": HELD}, {}), bias) for name, bias in biases.items()]


# -- saving ---------------------------------------------------------------------------------------------------


def save(directory: str | Path, step: int, held: Sequence[tuple[Piece, Array, bool]], comm: Communicator,
         description: Mapping[str, Any], expected: Sequence[str] = ()) -> Path:
    """Write DIR/step-{step:08d}/ from every rank of `comm` (call it on all): each rank's file with the pieces
    it `held` marked to write, then rank 0's manifest.json (`description` + step + tensors, the `expected` ones
    first and in that order)."""
    folder = step_folder(directory, step)
    on_every_rank(comm, lambda: _ready_folder(folder) if comm.rank == 0 else None)
    shards = write_rank_file(folder, comm.rank, [(piece, array) for piece, array, writes in held if writes])
    checksum = {shards[0]["file"]: file_checksum(folder / shards[0]["file"])} if shards else {}
    every_rank = comm.comm.gather((shards, checksum), root=0)  # also tells rank 0 that every file is in place
    if comm.rank == 0:
        _sync_folder(folder)
        checksums = {name: digest for _, sums in every_rank for name, digest in sums.items()}
        publish_manifest(folder, build_manifest(folder, step, description, [shards for shards, _ in every_rank],
                                                expected, checksums))
    comm.barrier()
    return folder


def _ready_folder(folder: Path) -> None:
    """An empty step folder, with nothing that could pass for a complete checkpoint until the manifest lands."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
        _sync_folder(folder.parent)
        if (folder / MANIFEST).exists():
            (folder / MANIFEST).unlink()
            _sync_folder(folder)
        for entry in folder.iterdir():
            if _RANK_FILE.match(entry.name) or entry.name.startswith("."):
                entry.unlink()
    except OSError as error:
        raise ConfigError(f"cannot write a training checkpoint to {folder}: {error}") from None


def write_rank_file(folder: Path, rank: int, held: Sequence[tuple[Piece, Array]]) -> list[dict]:
    """Write rank `rank`'s shard file (temporary name, fsync, rename); return its shard descriptions."""
    name = f"rank-{rank:05d}.safetensors"
    arrays: dict[str, np.ndarray] = {}
    shards = []
    for piece, array in held:
        flat = to_host(array).reshape(-1)
        for part in parts(piece):
            key = f"{piece.name}#{len(arrays)}"
            arrays[key] = np.ascontiguousarray(part.view(flat))
            shards.append({"tensor": piece.name, "dtype": flat.dtype.name, "shape": list(piece.shape),
                           "file": name, "key": key, "offsets": list(part.offsets), "sizes": list(part.sizes)})
    if arrays:
        staging = folder / f".{name}.tmp-{os.getpid()}"
        safetensors.numpy.save_file(arrays, str(staging), metadata={"format": "np", "rank": str(rank)})
        os.chmod(staging, public_file_mode())  # safetensors creates the file private (0600)
        with open(staging, "rb+") as file:
            os.fsync(file.fileno())
        os.replace(staging, folder / name)
    return shards


def file_checksum(path: Path) -> str:
    """The SHA-256 of a file, read in 1 MiB blocks."""
    digest = hashlib.sha256()
    with open(path, "rb") as file:
        for block in iter(lambda: file.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def build_manifest(folder: Path, step: int, description: Mapping[str, Any], every_rank: Iterable[list[dict]],
                   expected: Sequence[str] = (), checksums: Mapping[str, str] | None = None) -> dict[str, Any]:
    """The manifest of the shards every rank wrote. Each `expected` tensor must be there, and each tensor's
    shards must add up to its element count: a replica written twice, or a piece nobody wrote, is a bug in who
    writes what, caught here before it becomes a checkpoint. Each file is listed with its bytes and (given
    `checksums`) its SHA-256, which `checkpoint info --verify` checks."""
    tensors: dict[str, dict[str, Any]] = {}
    for shard in (shard for shards in every_rank for shard in shards):
        entry = tensors.setdefault(shard["tensor"], {"dtype": shard["dtype"], "shape": shard["shape"], "shards": []})
        if (entry["dtype"], entry["shape"]) != (shard["dtype"], shard["shape"]):
            raise RuntimeError(f"ranks disagree on {shard['tensor']}: {entry['dtype']} {entry['shape']} and "
                               f"{shard['dtype']} {shard['shape']}")
        entry["shards"].append({key: shard[key] for key in ("file", "key", "offsets", "sizes")})
    for name, entry in tensors.items():
        entry["shards"].sort(key=lambda shard: shard["offsets"])
        written = sum(math.prod(shard["sizes"]) for shard in entry["shards"])
        if written != math.prod(entry["shape"]):
            raise RuntimeError(f"{name}: the ranks wrote {written} elements of {math.prod(entry['shape'])}")
    missing = [name for name in expected if name not in tensors]
    if missing:
        raise RuntimeError(f"no rank wrote {', '.join(missing[:3])}{' …' if len(missing) > 3 else ''}")
    rank = {name: i for i, name in enumerate(expected)}
    files = sorted({shard["file"] for entry in tensors.values() for shard in entry["shards"]})
    return {"format": FORMAT, "version": VERSION, "step": step, **description,
            "files": [{"file": name, "bytes": (folder / name).stat().st_size,
                       **({"sha256": checksums[name]} if checksums and name in checksums else {})} for name in files],
            "tensors": dict(sorted(tensors.items(), key=lambda item: (rank.get(item[0], len(rank)), item[0])))}


def publish_manifest(folder: Path, manifest: Mapping[str, Any]) -> None:
    """manifest.json under a temporary name, fsync, rename, fsync of the folder: the checkpoint now counts."""
    staging = folder / f".{MANIFEST}.tmp-{os.getpid()}"
    with open(staging, "w", encoding="utf-8") as file:
        json.dump(manifest, file, indent=1)
        file.write("\n")
        file.flush()
        os.fsync(file.fileno())
    os.replace(staging, folder / MANIFEST)
    _sync_folder(folder)


def _sync_folder(folder: Path) -> None:
    """fsync a directory, so the renames in it survive a crash of the machine."""
    descriptor = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


# -- finding and reading ----------------------------------------------------------------------------------------


def latest_training_checkpoint(directory: str | Path) -> Path | None:
    """The step folder with a manifest and the highest step in `directory`; None when there is none yet."""
    path = Path(directory)
    if not path.exists():
        return None
    if not path.is_dir():
        raise ConfigError(f"checkpoint directory {path} is a file")
    complete = [(int(match.group(1)), entry) for entry in path.iterdir()
                if (match := _STEP_FOLDER.match(entry.name)) and (entry / MANIFEST).is_file()]
    return max(complete)[1] if complete else None


def incomplete_steps(directory: str | Path, after: int = 0) -> list[int]:
    """The steps after `after` whose folder in `directory` has no manifest: saves that never finished (a rank
    lost while writing), which resume ignores."""
    path = Path(directory)
    if not path.is_dir():
        return []
    return sorted(int(match.group(1)) for entry in path.iterdir()
                  if (match := _STEP_FOLDER.match(entry.name)) and int(match.group(1)) > after
                  and not (entry / MANIFEST).is_file())


def find_checkpoint(path: str | Path) -> Path:
    """A step folder, or the newest complete one in a checkpoint directory; one clear error otherwise."""
    path = Path(path)
    if (path / MANIFEST).is_file():
        return path
    if not path.exists():
        raise ConfigError(f"{path} does not exist")
    if not path.is_dir():
        raise ConfigError(f"{path} is a file, not a checkpoint directory")
    if _STEP_FOLDER.match(path.name):
        raise ConfigError(f"{path} has no {MANIFEST}: a save that did not finish, not a checkpoint")
    latest = latest_training_checkpoint(path)
    if latest is None:
        raise ConfigError(f"{path} holds no training checkpoint (no step-*/{MANIFEST})")
    return latest


class TrainingCheckpoint:
    """One complete step folder: its manifest, and any box of its tensors read from the shard files."""

    def __init__(self, folder: str | Path) -> None:
        self.folder = Path(folder)
        self.manifest = read_manifest(self.folder)
        self.tensors: dict[str, dict[str, Any]] = self.manifest["tensors"]
        self._files: dict[str, Any] = {}

    @property
    def step(self) -> int:
        return self.manifest["step"]

    def check_model(self, config: GPTConfig) -> None:
        """The model this run builds must be the one saved."""
        saved = self.manifest.get("model")
        if saved != config.to_dict():
            differences = [f"{key} {saved.get(key)} (this run: {value})" for key, value in config.to_dict().items()
                           if not isinstance(saved, dict) or saved.get(key) != value]
            raise ConfigError(f"checkpoint {self.folder} holds another model: {', '.join(differences)}")

    def check_data(self, identity: Mapping[str, Any]) -> None:
        """This run's training data must be the data saved: the same files (names, sizes, headers) in the same
        order (shuffled or not), or the step number would point at other tokens. Checkpoints that recorded no
        fingerprint are accepted."""
        saved = self.manifest.get("data_position", {})
        if "fingerprint" not in saved:
            return
        differences = []
        if saved["fingerprint"] != identity.get("fingerprint"):
            differences.append(f"it was saved training on {_describe_fingerprint(saved['fingerprint'])}, this run "
                               f"reads {_describe_fingerprint(identity.get('fingerprint'))}")
        if saved.get("shuffle") != identity.get("shuffle"):
            differences.append(f"--shuffle was {'on' if saved.get('shuffle') else 'off'}")
        if differences:
            raise ConfigError(f"cannot resume from {self.folder} on other data: {'; '.join(differences)}. Resume "
                              f"with the same --data (and --shuffle), or start a new --checkpoint-dir")

    def optimizer_scalars(self, name: str) -> dict[str, Any]:
        """The optimizer's saved scalars (kind, step count), which must be of optimizer `name`."""
        scalars = self.manifest.get("optimizer", {})
        if scalars.get("optimizer") != name:
            raise ConfigError(f"checkpoint {self.folder} holds {scalars.get('optimizer')!r} optimizer state, this "
                              f"run uses {name!r}")
        return dict(scalars)

    def read_piece(self, piece: Piece, dtype: Any) -> np.ndarray:
        """The piece's elements as a flat array of `dtype` (local padding zero), read box by box."""
        start, stop = piece.bounds
        flat = np.zeros(stop - start, dtype)
        self._check_shape(piece)
        for part in parts(piece):
            part.view(flat)[...] = self.read_box(piece.name, part.offsets, part.sizes)
        return flat

    def _check_shape(self, piece: Piece) -> None:
        entry = self.tensors.get(piece.name)
        if entry is None:
            raise ConfigError(f"checkpoint {self.folder} has no tensor {piece.name}")
        if tuple(entry["shape"]) != tuple(piece.shape):
            raise ConfigError(f"checkpoint {self.folder}: {piece.name} is {tuple(entry['shape'])}, this run needs "
                              f"{tuple(piece.shape)}")

    def read_box(self, name: str, offsets: Sequence[int], sizes: Sequence[int]) -> np.ndarray:
        """The box of tensor `name` at `offsets` of `sizes`, from the slices of the shards it overlaps."""
        entry = self.tensors[name]
        box = np.empty(tuple(sizes), np.dtype(entry["dtype"]))
        covered = 0
        for shard in entry["shards"]:
            lows = [max(a, b) for a, b in zip(offsets, shard["offsets"], strict=True)]
            highs = [min(a + n, b + m) for a, n, b, m in zip(offsets, sizes, shard["offsets"], shard["sizes"],
                                                                strict=True)]
            if any(lo >= hi for lo, hi in zip(lows, highs, strict=True)):
                continue
            source = tuple(slice(lo - o, hi - o) for lo, hi, o in zip(lows, highs, shard["offsets"], strict=True))
            target = tuple(slice(lo - o, hi - o) for lo, hi, o in zip(lows, highs, offsets, strict=True))
            box[target] = self._slice(shard, source)
            covered += math.prod(hi - lo for lo, hi in zip(lows, highs, strict=True))
        if covered != math.prod(sizes):
            raise damaged(self.folder, f"the shards of {name} do not cover its box at {list(offsets)} of "
                                       f"{list(sizes)}")
        return box

    def _slice(self, shard: Mapping[str, Any], source: tuple[slice, ...]) -> np.ndarray:
        path = self.folder / shard["file"]
        try:
            if shard["file"] not in self._files:
                self._files[shard["file"]] = safetensors.safe_open(str(path), framework="np")
            file = self._files[shard["file"]]
            return file.get_slice(shard["key"])[source] if source else file.get_tensor(shard["key"])
        except (safetensors.SafetensorError, OSError, ValueError, TypeError, KeyError) as error:
            raise damaged(self.folder, f"shard {shard['file']} (entry {shard['key']}) cannot be read: {error}"
                          ) from None


def _describe_fingerprint(fingerprint: Any) -> str:
    """A data fingerprint in a few words: its files (the first three) and their bytes."""
    if not isinstance(fingerprint, dict):
        return "unknown data"
    files = fingerprint.get("files") or []
    if not files:
        return f"the default corpus ({fingerprint.get('tokens', '?')} tokens)"
    shown = ", ".join(f"{f.get('name')} ({f.get('bytes', 0):,} bytes)" for f in files[:3])
    return f"{len(files)} file{'s' if len(files) > 1 else ''}: {shown}{' …' if len(files) > 3 else ''}"


def read_manifest(folder: Path) -> dict[str, Any]:
    """manifest.json, checked enough that every later lookup in it is safe."""
    path = folder / MANIFEST
    if not path.is_file():
        raise ConfigError(f"{path} is missing: {folder} is not a complete training checkpoint")
    try:
        manifest = read_json_object(path, f"{folder} is not a complete training checkpoint")
    except ConfigError as error:
        raise damaged(folder, str(error)) from None
    problem = _manifest_problem(manifest)
    if problem:
        raise damaged(folder, f"{path}: {problem}")
    return manifest


def _manifest_problem(manifest: Mapping[str, Any]) -> str | None:
    if manifest.get("format") != FORMAT:
        return "not an mpiparallel training checkpoint manifest"
    if manifest.get("version") != VERSION or not isinstance(manifest.get("step"), int):
        return f"version {manifest.get('version')!r} is not {VERSION}, or the step is missing"
    tensors = manifest.get("tensors")
    if not isinstance(tensors, dict):
        return "lists no tensors"
    for name, entry in tensors.items():
        problem = _manifest_entry_problem(entry)
        if problem:
            return f"tensor {name}: {problem}"
    files = manifest.get("files", [])
    if not (isinstance(files, list) and all(isinstance(entry, dict) and isinstance(entry.get("file"), str)
                                            and isinstance(entry.get("bytes"), int) for entry in files)):
        return "its list of shard files is malformed"
    return None


def damaged(folder: Path, problem: str) -> CorruptCheckpoint:
    """The one error for a damaged checkpoint: which folder and step, what is wrong, and what to run next (an
    older complete checkpoint of the same directory, if there is one)."""
    step = _STEP_FOLDER.match(folder.name)
    older = [int(match.group(1)) for entry in (folder.parent.iterdir() if folder.parent.is_dir() else [])
             if (match := _STEP_FOLDER.match(entry.name)) and (entry / MANIFEST).is_file()
             and (step is None or int(match.group(1)) < int(step.group(1)))]
    where = f"checkpoint {folder}" + (f" (step {int(step.group(1))})" if step else "")
    if older:
        advice = (f"resume from an older one with --resume-from {max(older)} (complete: "
                  f"{', '.join(f'step {k}' for k in sorted(older))})")
    else:
        advice = "there is no older complete checkpoint beside it: leave out --resume to start anew"
    return CorruptCheckpoint(f"{where} is damaged: {problem}; {advice}. `mpiparallel checkpoint info {folder} "
                             f"--verify` checks every file")


def _manifest_entry_problem(entry: Any) -> str | None:
    if not isinstance(entry, dict) or not isinstance(entry.get("shards"), list):
        return "no list of shards"
    shape = entry.get("shape")
    if not (isinstance(shape, list) and all(isinstance(n, int) and n >= 0 for n in shape)):
        return f"bad shape {shape!r}"
    try:
        np.dtype(entry.get("dtype"))
    except TypeError:
        return f"unknown dtype {entry.get('dtype')!r}"
    for shard in entry["shards"]:
        if not isinstance(shard, dict) or not isinstance(shard.get("key"), str):
            return f"bad shard {shard!r}"
        file, offsets, sizes = shard.get("file"), shard.get("offsets"), shard.get("sizes")
        if not isinstance(file, str) or Path(file).name != file or not file:
            return f"shard file {file!r} is not a file name in the step folder"
        if not (isinstance(offsets, list) and isinstance(sizes, list) and len(offsets) == len(sizes) == len(shape)
                and all(isinstance(v, int) for v in offsets + sizes)
                and all(0 <= o and 0 < n and o + n <= d for o, n, d in zip(offsets, sizes, shape, strict=True))):
            return f"shard {shard['key']} has offsets {offsets!r} and sizes {sizes!r} outside {shape}"
    return None


def load_pieces(checkpoint: TrainingCheckpoint, held: Iterable[tuple[Piece, Array]]) -> None:
    """Copy each piece from the checkpoint into its array (same shape as the piece's data; any array library)."""
    for piece, array in held:
        values = checkpoint.read_piece(piece, array.dtype)
        array[...] = like(array, values.reshape(array.shape))


# -- describing ---------------------------------------------------------------------------------------------------


def describe(checkpoint: TrainingCheckpoint, most_shards: int = 4) -> str:
    """What a checkpoint holds: step, the mesh it was saved from, the model, and every tensor with its dtype,
    global shape and shards (their boxes, or a count and the first few), then the bytes."""
    manifest = checkpoint.manifest
    mesh, model, optimizer = manifest.get("mesh", {}), manifest.get("model", {}), manifest.get("optimizer", {})
    position = manifest.get("data_position", {})
    data_bytes = sum(math.prod(entry["shape"]) * np.dtype(entry["dtype"]).itemsize
                     for entry in checkpoint.tensors.values())
    file_bytes = sum(entry.get("bytes", 0) for entry in manifest.get("files", []))
    lines = [f"checkpoint {checkpoint.folder}: step {checkpoint.step}",
             f"  saved from {plural(mesh.get('world_size', '?'), 'rank')}: " + " × ".join(
                 f"{axis} {mesh.get(axis, '?')}" for axis in ("dp", "tp", "pp", "cp")) +
             f", ep {mesh.get('ep', '?')}, zero {mesh.get('zero', '?')}" + (", sp" if mesh.get("sp") else "") +
             (f", {mesh.get('schedule')} schedule" if mesh.get("pp", 1) > 1 else ""),
             f"  model: {plural(model.get('n_layer', '?'), 'layer')}, n_embd {model.get('n_embd', '?')}, "
             f"{plural(model.get('n_head', '?'), 'head')}, vocab {model.get('vocab_size', '?')}"
             + (f", {model['n_experts']} experts (top {model.get('moe_top_k')})" if model.get("n_experts") else ""),
             f"  optimizer {optimizer.get('optimizer', '?')} at step {optimizer.get('step', '?')}; data: next step "
             f"{position.get('next_step', '?')} = batch {position.get('batch', '?')} of "
             f"{position.get('batches_per_pass', '?')}",
             f"  {plural(len(checkpoint.tensors), 'tensor')}, {data_bytes:,} bytes of data in "
             f"{plural(len(manifest.get('files', [])), 'shard file')} of {file_bytes:,} bytes", ""]
    width = max((len(name) for name in checkpoint.tensors), default=4)
    lines.append(f"  {'tensor':<{width}}  {'dtype':<8} {'shape':<12} shards")
    for name, entry in checkpoint.tensors.items():
        shape = "×".join(str(n) for n in entry["shape"]) or "scalar"
        lines.append(f"  {name:<{width}}  {entry['dtype']:<8} {shape:<12} {_shard_summary(entry, most_shards)}")
    return "\n".join(lines)


def _shard_summary(entry: Mapping[str, Any], most: int) -> str:
    """`1 (whole)`, or the count and the boxes as [start:stop, …] in each dimension (the first `most`)."""
    shards = entry["shards"]
    if len(shards) == 1 and shards[0]["sizes"] == entry["shape"]:
        return f"1 (whole, {shards[0]['file']})"
    boxes = ["[" + ", ".join(f"{o}:{o + n}" for o, n in zip(s["offsets"], s["sizes"], strict=True)) + "]"
             for s in shards[:most]]
    more = f" … {len(shards) - most} more" if len(shards) > most else ""
    files = len({s["file"] for s in shards})
    return f"{len(shards)} in {files} file{'s' if files > 1 else ''}: {' '.join(boxes)}{more}"
