"""Rotary position embedding (RoPE), Llama's positions: q and k rotated by an angle that grows with the position.

Head channel pairs (i, i + d/2) — the `rotate_half` convention of Hugging Face's Llama, not interleaved pairs —
turn by the angle p·inv_freq_i at position p, inv_freq_i = θ^(−2i/d), d = head_dim:

    forward     r1 = x1·cos − x2·sin        r2 = x2·cos + x1·sin         (x1, x2: the two halves of a head)
    backward    d1 = g1·cos + g2·sin        d2 = g2·cos − g1·sin         (the rotation's transpose: angle −p·inv_freq)

so q_m·k_n depends on m − n only, and no position is a parameter. The angles are computed at float64 (a float32
table loses precision at large positions: p·inv_freq near 10⁵ keeps only ~3 decimal digits of its fraction),
then cos and sin are cast to the activations' dtype; Hugging Face upcasts to float32 for the same reason.

`rope_scaling` of type "llama3" (Llama 3.1) stretches the low frequencies for long contexts: wavelengths longer
than original_max_position_embeddings / low_freq_factor are divided by `factor`, those shorter than
original / high_freq_factor kept, and those between interpolated smoothly (Meta's formula).

Context parallelism and KV caches need the angles of any positions (the zigzag chunks, the decoded tail): the
layer takes the positions explicitly. Communication: none.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import numpy as np

from collectives.backend import Array, like

ROPE_TYPES = ("default", "llama3")


def inverse_frequencies(head_dim: int, theta: float, scaling: Mapping[str, Any] | None = None) -> np.ndarray:
    """inv_freq_i = θ^(−2i/d) for i < d/2 (float64), with Llama 3's frequency scaling when `scaling` says so."""
    if head_dim % 2:
        raise ValueError(f"rotary embedding rotates channel pairs: head_dim ({head_dim}) must be even")
    inv_freq = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    kind = rope_type(scaling)
    if kind == "llama3":
        inv_freq = _llama3_scaled(inv_freq, scaling)
    return inv_freq


def rope_type(scaling: Mapping[str, Any] | None) -> str:
    """"default" or "llama3" from a config's rope_scaling / rope_parameters (absent: "default")."""
    if not scaling:
        return "default"
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind not in ROPE_TYPES:
        raise ValueError(f"rope type {kind!r} is not supported (supported: {', '.join(ROPE_TYPES)})")
    return kind


def _llama3_scaled(inv_freq: np.ndarray, scaling: Mapping[str, Any]) -> np.ndarray:
    """Llama 3.1's rule: long wavelengths slowed by `factor`, short ones kept, a smooth blend between."""
    factor = float(scaling["factor"])
    low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
    original = float(scaling["original_max_position_embeddings"])
    wavelength = 2 * math.pi / inv_freq
    smooth = (original / wavelength - low) / (high - low)
    blended = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    scaled = np.where(wavelength > original / low, inv_freq / factor, inv_freq)
    between = (wavelength <= original / low) & (wavelength >= original / high)
    return np.where(between, blended, scaled)


class RotaryEmbedding:
    """Rotates (B, heads, t, d) query or key views in place at given positions; `rotate_back` is the backward.

    cos and sin are tabulated once per position count (at float64, cast to the array's dtype) and indexed by
    the positions of each call."""

    def __init__(self, head_dim: int, theta: float = 10000.0, scaling: Mapping[str, Any] | None = None) -> None:
        self.head_dim, self.theta = head_dim, theta
        self.inv_freq = inverse_frequencies(head_dim, theta, scaling)
        self._tables: dict[tuple[Any, type], tuple[Array, Array]] = {}

    def _cos_sin(self, like_array: Array, length: int) -> tuple[Array, Array]:
        """cos and sin of positions 0 … length−1 or more (rows, d/2), in the array's dtype and library; the
        table grows by doubling, so decoding one position at a time recomputes it only log(n) times."""
        key = (like_array.dtype, type(like_array))
        cos, sin = self._tables.get(key, (None, None))
        if cos is None or len(cos) < length:
            rows = max(length, 2 * (0 if cos is None else len(cos)))
            angles = np.outer(np.arange(rows, dtype=np.float64), self.inv_freq)
            cos, sin = (like(like_array, np.cos(angles).astype(like_array.dtype)),
                        like(like_array, np.sin(angles).astype(like_array.dtype)))
            self._tables[key] = cos, sin
        return cos, sin

    def angles(self, x: Array, positions: Any) -> tuple[Array, Array]:
        """cos and sin (t, d/2) of `positions` (t,), broadcasting over the batch and heads of (B, heads, t, d/2)."""
        positions = np.asarray(positions)
        cos, sin = self._cos_sin(x, int(positions.max()) + 1 if positions.size else 1)
        index = like(cos, positions)
        return cos[index], sin[index]

    def rotate(self, x: Array, positions: Any) -> None:
        """x (B, heads, t, d), a view, rotated in place to its positions (t,) (host integers)."""
        self._turn(x, *self.angles(x, positions), sign=1.0)

    def rotate_back(self, dx: Array, positions: Any) -> None:
        """The backward of `rotate`, in place: d(x) from d(rotated), a turn by the opposite angle."""
        self._turn(dx, *self.angles(dx, positions), sign=-1.0)

    @staticmethod
    def _turn(x: Array, cos: Array, sin: Array, sign: float) -> None:
        """(x1, x2) ← (x1·cos − x2·sin, x2·cos + x1·sin) in place; sign −1 turns the other way (sin → −sin)."""
        if sign < 0:
            sin = -sin
        half = x.shape[-1] // 2
        first, second = x[..., :half], x[..., half:]
        first_sin = first * sin
        first *= cos
        first -= second * sin
        second *= cos
        second += first_sin
