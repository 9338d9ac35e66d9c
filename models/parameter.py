"""A named parameter: its value, its gradient, and where it lives in a Hugging Face checkpoint."""

from __future__ import annotations

import zlib

import numpy as np

from collectives.backend import Array, get_array_module


class Parameter:
    """`data` and the gradient `grad` accumulated by backward (same shape, dtype and backend).

    `name` is the GPT2LMHeadModel tensor name (`transformer.h.0.attn.c_attn.weight`), so checkpoints, gradient
    dumps and tests address parameters the way Hugging Face does. `grad` may be re-pointed at a view into a
    flat buffer (data-parallel buckets do that); layers only ever add into it in place.

    `split` says how `data` is a shard of the full tensor: None when every rank holds all of it, else
    (mesh axis, dim, blocks) — dimension `dim` of the full tensor is `blocks` equal blocks laid side by side
    (1 for a plain split, 3 for GPT-2's fused [q | k | v] columns), each split evenly over the ranks of the axis
    (zero-padded at its end when it does not divide); the shard holds its rank's piece of every block, in order.
    `models.tensor_parallel.shard_tensor` and `gather_tensor` convert between the two.
    """

    __slots__ = ("name", "data", "grad", "split")

    def __init__(self, name: str, data: Array, split: tuple[str, int, int] | None = None) -> None:
        self.name = name
        self.data = data
        self.grad = get_array_module(data).zeros_like(data)
        self.split = split

    def zero_grad(self) -> None:
        self.grad[...] = 0

    def __repr__(self) -> str:
        return f"Parameter({self.name}, shape={tuple(self.data.shape)}, dtype={self.data.dtype})"


def seeded_normal(seed: int, name: str, shape: tuple[int, ...], std: float, dtype: np.dtype) -> np.ndarray:
    """normal(0, std) drawn from a generator seeded by (seed, name): a parameter's initial value depends only on
    the seed and its own name, never on how many other parameters were drawn before it or on which rank."""
    rng = np.random.default_rng([seed, zlib.crc32(name.encode())])
    return (rng.standard_normal(shape) * std).astype(dtype)
