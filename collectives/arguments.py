"""Argument checks and buffer layout shared by the hand-written collectives (`api`) and the NCCL adapter (`nccl`).

Both front ends accept the same arguments and must reject bad ones with the same ValueErrors, lay out results
the same way (a flat view of a C-contiguous array, `out=` checked before use) and avoid the same aliasing.
No communication happens here; the only cost is a copy of `x` when it is strided (`flat`) or overlaps the
output (`unaliased`).
"""

from __future__ import annotations

from collections.abc import Sequence

from .backend import Array, get_array_module


def flat(x: Array) -> Array:
    """A 1-D view of `x` (a contiguous copy if `x` is strided): the layout every algorithm works on."""
    return x.ravel()  # a view whenever the elements already lie in C order, else a copy


def output_array(x: Array, out: Array | None, shape: tuple) -> Array:
    """A new array of `shape` and x's dtype and backend, or `out` after checking that it fits.

    `out` must be C-contiguous because results are written through a flat view of it.
    """
    if out is None:
        return get_array_module(x).empty(shape, x.dtype)
    if out.shape != shape or out.dtype != x.dtype:
        raise ValueError(f"out has shape {tuple(out.shape)} and dtype {out.dtype}; "
                         f"expected shape {tuple(shape)} and dtype {x.dtype}")
    if not out.flags.c_contiguous:
        raise ValueError("out must be C-contiguous")
    return out


def unaliased(x: Array, out: Array) -> Array:
    """`x`, or a copy of it when it overlaps `out`.

    MPI forbids aliased send and receive buffers, and NCCL's concurrent sends and receives must not share
    memory either.
    """
    return x.copy() if get_array_module(x).may_share_memory(x, out) else x


def row_offsets(counts: Sequence[int], row: int) -> list[int]:
    """Flat offsets of consecutive blocks of counts[j] rows of `row` elements: len(counts) + 1 entries."""
    offsets = [0]
    for count in counts:
        offsets.append(offsets[-1] + count * row)
    return offsets


def check_send_counts(send_counts: Sequence[int], x: Array, size: int) -> list[int]:
    """all_to_allv's row counts as ints: one non-negative count per rank, adding up to x's rows."""
    counts = [int(c) for c in send_counts]
    if len(counts) != size or any(c < 0 for c in counts):
        raise ValueError(f"send_counts must hold {size} non-negative row counts (one per rank), got {counts}")
    if sum(counts) != x.shape[0]:
        raise ValueError(f"send_counts add up to {sum(counts)} rows but x has {x.shape[0]}")
    return counts


def check_root(root: int, size: int) -> None:
    """The root of broadcast and reduce must be a rank of the communicator."""
    if not 0 <= root < size:
        raise ValueError(f"root must be a rank in 0..{size - 1}, got {root}")


def check_has_axis(x: Array, name: str) -> None:
    """Collectives that split or concatenate along axis 0 cannot take a 0-d array."""
    if x.ndim == 0:
        raise ValueError(f"{name} needs an array with at least one axis, got a 0-d array")


def check_rows_split_evenly(x: Array, size: int, name: str) -> None:
    """reduce_scatter and all_to_all cut axis 0 into one equal block per rank."""
    check_has_axis(x, name)
    if x.shape[0] % size:
        raise ValueError(f"{name} needs x.shape[0] divisible by the {size} ranks; got shape {tuple(x.shape)}")
