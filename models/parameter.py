"""A named parameter, and its placement: how each mesh axis holds it.

A parameter's `placement` maps mesh axis names ("tp", "dp", …) to one of three records; an axis it does not name
holds it `Replicated`:

    Replicated()          every rank of the axis holds the whole tensor, and computes the same gradient
    Sharded(dim, blocks, replicas)  dimension `dim` is cut over the axis (replicas > 1: each piece on that many
                          consecutive ranks): `blocks` equal blocks side by side (3 for GPT-2's
                          fused [q | k | v] columns, else 1), each zero-padded to a multiple of the axis size and
                          split evenly; rank r holds its piece of every block, in order
    Partial()             every rank holds the whole tensor, but its gradient is a partial sum: each rank saw
                          other tokens (data parallelism; LayerNorms under sequence parallelism). Summing the
                          gradient over the axis makes it `Replicated`.
    Held()                only this rank of the axis holds the tensor (a pipeline stage's own layers)
    FlatShard(start, stop)  ZeRO's view of one piece: this rank owns elements [start, stop) of the flattened
                          tensor (its reduced gradient and optimizer state; ZeRO-3 also its values)

Everything that must know how a parameter is spread derives from this one record: which axes a gradient is
summed over, which rank counts a gradient in the global norm (`counts_once`), the bytes a rank holds, and
checkpoint save/load (`shard_tensor`, `gather_tensor` cut and rebuild the full tensor).
"""

from __future__ import annotations

import zlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from collectives import Communicator, all_gather, all_reduce
from collectives.backend import Array, get_array_module, to_host


@dataclass(frozen=True)
class Replicated:
    """The whole tensor on every rank of the axis, with the same gradient."""


@dataclass(frozen=True)
class Sharded:
    """Dimension `dim` cut over the axis, as `blocks` equal blocks each split evenly (zero-padded at its end).

    `replicas` > 1: the axis of n ranks holds n/replicas pieces, each on `replicas` consecutive ranks (grouped-query
    KV heads when tp exceeds them: rank r holds piece r // replicas). The copies compute partial gradients that
    the layer sums over them; one copy counts (`counts_once`)."""

    dim: int
    blocks: int = 1
    replicas: int = 1

    def cut(self, rank: int, size: int) -> tuple[int, int]:
        """(the piece rank `rank` holds, the number of pieces) on an axis of `size` ranks."""
        return rank // self.replicas, size // self.replicas


@dataclass(frozen=True)
class Partial:
    """The whole tensor on every rank of the axis; its gradient is a partial sum to be summed over the axis."""


@dataclass(frozen=True)
class Held:
    """Only this rank of the axis holds the tensor: the other ranks hold other tensors (pipeline stages)."""


@dataclass(frozen=True)
class FlatShard:
    """Elements [start, stop) of the flattened tensor, owned by this rank of the axis (a ZeRO shard segment)."""

    start: int
    stop: int


Placement = Replicated | Sharded | Partial | Held | FlatShard
HELD = Held()
REPLICATED = Replicated()
PARTIAL = Partial()


class Parameter:
    """`data` and the gradient `grad` accumulated by backward (same shape and backend; `grad_dtype`, default
    data's dtype). Under mixed precision `data` is the compute-dtype working copy of `master` (the weights at
    --dtype), which the optimizer updates and rounds back into `data` (`models.precision`).

    `name` is the GPT2LMHeadModel tensor name (`transformer.h.0.attn.c_attn.weight`), so checkpoints, gradient
    dumps and tests address parameters the way Hugging Face does. `grad` may be re-pointed at a view into a
    flat buffer (data-parallel buckets do that); layers only ever add into it in place. `placement` says how the
    mesh holds it (see the module docstring); `full_shape` is the shape of the whole tensor.
    """

    __slots__ = ("name", "data", "grad", "placement", "full_shape", "master")

    def __init__(self, name: str, data: Array, placement: Mapping[str, Placement] | None = None,
                 full_shape: tuple[int, ...] | None = None, grad_dtype: Any = None, master: Array | None = None
                 ) -> None:
        self.name = name
        self.data = data
        self.master = master  # mixed precision: the full-precision weights `data` is a rounded copy of
        self.grad = get_array_module(data).zeros(data.shape, grad_dtype or data.dtype)
        self.placement: dict[str, Placement] = dict(placement or {})
        self.full_shape = tuple(data.shape) if full_shape is None else tuple(full_shape)

    def on(self, axis: str) -> Placement:
        """How `axis` holds this parameter."""
        return self.placement.get(axis, REPLICATED)

    def partial_axes(self) -> list[str]:
        """The axes over which this parameter's gradient must be summed."""
        return [axis for axis, how in self.placement.items() if isinstance(how, Partial)]

    def zero_grad(self) -> None:
        self.grad[...] = 0

    def __repr__(self) -> str:
        return f"Parameter({self.name}, shape={tuple(self.data.shape)}, dtype={self.data.dtype})"


def counts_once(placement: Mapping[str, Placement], coordinates: Mapping[str, int]) -> bool:
    """Whether this rank's copy of a (fully reduced) gradient piece is the one to count in a sum over all ranks:
    a piece sharded over an axis is distinct on every rank of it, a replicated one counts on coordinate 0 only."""
    def counts(how: Placement, coordinate: int) -> bool:
        if isinstance(how, Sharded):
            return coordinate % how.replicas == 0
        return isinstance(how, (Held, FlatShard)) or coordinate == 0

    return all(counts(placement.get(axis, REPLICATED), coordinate) for axis, coordinate in coordinates.items())


def seeded_normal(seed: int, name: str, shape: tuple[int, ...], std: float, dtype: np.dtype) -> np.ndarray:
    """normal(0, std) drawn from a generator seeded by (seed, name): a parameter's initial value depends only on
    the seed and its own name, never on how many other parameters were drawn before it or on which rank."""
    rng = np.random.default_rng([seed, zlib.crc32(name.encode())])
    return (rng.standard_normal(shape) * std).astype(dtype)


# -- cutting a full tensor into a rank's shard, and gathering it back ---------------------------------------

def padded_length(length: int, blocks: int, size: int) -> int:
    """`length` split into `blocks` equal blocks, each padded to a multiple of `size`: the padded total."""
    per_block = length // blocks
    return blocks * (-(-per_block // size) * size)


def shard_along(full: Array, sharded: Sharded, rank: int, size: int) -> Array:
    """Rank `rank`'s piece (a copy) of `full` cut along one axis of `size` ranks: its piece of every block of
    dimension `sharded.dim`, after zero-padding each block to a multiple of `size` (only the vocabulary needs it)."""
    xp = get_array_module(full)
    moved = xp.moveaxis(full, sharded.dim, 0)
    rest, blocks = moved.shape[1:], sharded.blocks
    by_block = moved.reshape(blocks, moved.shape[0] // blocks, *rest)
    padded = padded_length(moved.shape[0], blocks, size) // blocks
    if padded > by_block.shape[1]:
        padding = xp.zeros((blocks, padded - by_block.shape[1], *rest), full.dtype)
        by_block = xp.concatenate([by_block, padding], axis=1)
    piece = padded // size
    shard = by_block[:, rank * piece:(rank + 1) * piece].reshape(blocks * piece, *rest)
    return xp.ascontiguousarray(xp.moveaxis(shard, 0, sharded.dim))


def gather_along(shard: Array, sharded: Sharded, comm: Any, length: int) -> Array:
    """The inverse of `shard_along`: every rank's piece, one all-gather over `comm`, padding dropped so that
    dimension `sharded.dim` has `length` entries again."""
    xp = get_array_module(shard)
    comm = Communicator.of(comm)
    dim, blocks = sharded.dim, sharded.blocks
    moved = xp.ascontiguousarray(xp.moveaxis(shard, dim, 0))
    rest, piece = moved.shape[1:], moved.shape[0] // blocks
    pieces = comm.size // sharded.replicas
    gathered = all_gather(moved, comm).reshape(pieces, sharded.replicas, blocks, piece, *rest)[:, 0]
    by_block = gathered.swapaxes(0, 1).reshape(blocks, pieces * piece, *rest)
    full = by_block[:, :length // blocks].reshape(length, *rest)
    return xp.ascontiguousarray(xp.moveaxis(full, 0, dim))


def shard_tensor(full: Array, placement: Mapping[str, Placement], ranks: Mapping[str, tuple[int, int]]) -> Array:
    """This rank's shard (a copy) of the full tensor: cut along every axis that shards it. `ranks` maps each
    mesh axis to (this rank's coordinate, the axis size)."""
    shard = full
    for axis, how in placement.items():
        if isinstance(how, Sharded):
            shard = shard_along(shard, how, *how.cut(*ranks.get(axis, (0, 1))))
    # cut first, copy what is left: copying the whole tensor first cost a second per GPT-2 124M model
    return shard.copy() if get_array_module(shard).may_share_memory(shard, full) else shard


def gather_tensor(shard: Array, placement: Mapping[str, Placement], comms: Mapping[str, Any],
                  full_shape: tuple[int, ...]) -> Array:
    """The full tensor from every rank's shard, on every rank (one all-gather per sharding axis, in reverse order
    of `shard_tensor`). The inverse of `shard_tensor`; a replicated tensor comes back as a copy."""
    full = shard.copy()
    for axis, how in reversed(list(placement.items())):
        if isinstance(how, Sharded) and axis in comms:
            full = gather_along(full, how, comms[axis], full_shape[how.dim])
    return full


def gather_over_model_axes(tensors: Mapping[str, Array], params: Mapping[str, Parameter],
                           comms: Mapping[str, Any]) -> dict[str, Array]:
    """The serial model's tensors from this rank's pieces (`tensors`: by parameter name, whole along any ZeRO
    axis), on every rank: each tensor gathered over the axes that shard it (`gather_tensor`: tp), then the
    tensors that only some ranks of an axis hold (pipeline stages, EP ranks' experts) collected from all of them,
    one all-gather of host arrays per such axis of `comms` with more than one rank. Names without a parameter
    (the experts' routing biases) are only collected."""
    whole = {name: gather_tensor(tensor, params[name].placement, comms, params[name].full_shape)
             if name in params else tensor for name, tensor in tensors.items()}
    held_axes = {axis for param in params.values() for axis, how in param.placement.items() if isinstance(how, Held)}
    for axis in sorted(held_axes & set(comms)):
        if comms[axis].size > 1:
            merged: dict[str, Array] = {}
            for piece in comms[axis].comm.allgather({name: to_host(value) for name, value in whole.items()}):
                merged |= piece  # a tied wte comes from two stages, equal after every step
            whole = merged
    return whole


def local_shape(full_shape: tuple[int, ...], placement: Mapping[str, Placement],
                sizes: Mapping[str, int]) -> tuple[int, ...]:
    """The shape of one rank's shard of a tensor of `full_shape` (padding included)."""
    shape = list(full_shape)
    for axis, how in placement.items():
        if isinstance(how, Sharded):
            size = sizes.get(axis, 1) // how.replicas
            shape[how.dim] = padded_length(shape[how.dim], how.blocks, size) // size
    return tuple(shape)


def reduce_partial_gradients(pieces: list[Any], comms: Mapping[str, Any], algo: str = "auto") -> None:
    """Sum over each axis in `comms` the gradients that are partial sums over it (placement `Partial`): one
    all-reduce per axis of their concatenation. `pieces` are parameters, or anything with `.grad` and
    `.placement` (ZeRO's shard segments). Call it once per optimizer step, after the last microbatch's backward:
    it sums whatever `grad` holds, so a second call would count every contribution again."""
    for axis, comm in comms.items():
        partial = [piece for piece in pieces if isinstance(piece.placement.get(axis), Partial)]
        if not partial or Communicator.of(comm).size == 1:
            continue
        xp = get_array_module(partial[0].grad)
        total = all_reduce(xp.concatenate([piece.grad.reshape(-1) for piece in partial]), comm, algo=algo)
        offset = 0
        for piece in partial:
            piece.grad[...] = total[offset:offset + piece.grad.size].reshape(piece.grad.shape)
            offset += piece.grad.size
