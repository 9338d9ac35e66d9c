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
original / high_freq_factor kept, and those between interpolated smoothly (Meta's formula). Type "yarn" (YaRN,
DeepSeek-V2/V3's long-context scaling) blends each frequency between itself (extrapolation, the fast ones that
turn more than beta_fast times over the original context) and itself / factor (interpolation, those turning fewer
than beta_slow times), linearly in the channel index between the two; it also multiplies cos and sin by an
attention factor (`attention_factor`: mscale(factor, mscale) / mscale(factor, mscale_all_dim), with
mscale(s, m) = 0.1·m·ln s + 1) and DeepSeek's softmax scale by mscale(factor, mscale_all_dim)²
(`softmax_scale_correction`).

DeepSeek lays its rotary channels out in interleaved pairs (x0, x1), (x2, x3), … (`rope_interleave`):
`pairs_to_halves` reorders them to [even | odd], after which the rotation above is the interleaved one, with
the output in the [even | odd] order transformers also returns (queries and keys alike, so q·k is unchanged);
`halves_to_pairs` is its backward.

Context parallelism and KV caches need the angles of any positions (the zigzag chunks, the decoded tail): the
layer takes the positions explicitly. Communication: none.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import numpy as np

from collectives.backend import Array, get_array_module, is_device_array, like

from . import host_kernels

ROPE_TYPES = ("default", "llama3", "yarn")


def inverse_frequencies(head_dim: int, theta: float, scaling: Mapping[str, Any] | None = None) -> np.ndarray:
    """inv_freq_i = θ^(−2i/d) for i < d/2 (float64), with Llama 3's frequency scaling when `scaling` says so."""
    if head_dim % 2:
        raise ValueError(f"rotary embedding rotates channel pairs: head_dim ({head_dim}) must be even")
    inv_freq = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    kind = rope_type(scaling)
    if kind == "llama3":
        inv_freq = _llama3_scaled(inv_freq, scaling)
    elif kind == "yarn":
        inv_freq = _yarn_scaled(inv_freq, head_dim, theta, scaling)
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


def _yarn_scaled(inv_freq: np.ndarray, head_dim: int, theta: float, scaling: Mapping[str, Any]) -> np.ndarray:
    """YaRN: channel pair i keeps inv_freq_i below the correction range, takes inv_freq_i / factor above it, and
    a linear blend inside it; the range is where a pair turns beta_fast … beta_slow times over the original
    context (floored and ceiled unless `truncate` is false)."""
    factor, original = float(scaling["factor"]), float(scaling["original_max_position_embeddings"])
    fast, slow = float(scaling.get("beta_fast") or 32), float(scaling.get("beta_slow") or 1)

    def channel_turning(turns: float) -> float:  # the channel index whose pair turns `turns` times over `original`
        return head_dim * math.log(original / (turns * 2 * math.pi)) / (2 * math.log(theta))

    low, high = channel_turning(fast), channel_turning(slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # transformers' guard against a zero-width ramp
    interpolated = np.clip((np.arange(head_dim // 2, dtype=np.float64) - low) / (high - low), 0.0, 1.0)
    return inv_freq / factor * interpolated + inv_freq * (1.0 - interpolated)


def _mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def attention_factor(scaling: Mapping[str, Any] | None) -> float:
    """YaRN's multiplier of cos and sin (1 for the other rope types): `attention_factor` if the config gives it,
    else mscale(factor, mscale) / mscale(factor, mscale_all_dim) when both are set, else mscale(factor)."""
    if rope_type(scaling) != "yarn":
        return 1.0
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    factor, mscale, mscale_all_dim = float(scaling["factor"]), scaling.get("mscale"), scaling.get("mscale_all_dim")
    if mscale and mscale_all_dim:
        return _mscale(factor, mscale) / _mscale(factor, mscale_all_dim)
    return _mscale(factor)


def softmax_scale_correction(scaling: Mapping[str, Any] | None) -> float:
    """DeepSeek's factor on the softmax scale 1/√d under a scaled rope: mscale(factor, mscale_all_dim)² when
    mscale_all_dim is set, else 1."""
    if rope_type(scaling) == "default" or not scaling.get("mscale_all_dim"):
        return 1.0
    return _mscale(float(scaling["factor"]), float(scaling["mscale_all_dim"])) ** 2


def pairs_to_halves(x: Array) -> Array:
    """Interleaved rotary channels (x0, x1), (x2, x3), … as [x0, x2, … | x1, x3, …] (a copy): the layout in which
    `RotaryEmbedding` turns pair i = (x_2i, x_2i+1)."""
    xp = get_array_module(x)
    return xp.concatenate((x[..., 0::2], x[..., 1::2]), axis=-1)


def halves_to_pairs(dx: Array) -> Array:
    """The backward of `pairs_to_halves`: gradients in the [even | odd] layout back to interleaved channels."""
    xp = get_array_module(dx)
    half = dx.shape[-1] // 2
    out = xp.empty_like(dx)
    out[..., 0::2], out[..., 1::2] = dx[..., :half], dx[..., half:]
    return out


class RotaryEmbedding:
    """Rotates (B, heads, t, d) query or key views in place at given positions; `rotate_back` is the backward.

    cos and sin are tabulated once per position count (at float64, cast to the array's dtype) and indexed by
    the positions of each call; YaRN's attention factor multiplies both (the turn then also scales, and its
    transpose, the backward, scales alike)."""

    def __init__(self, head_dim: int, theta: float = 10000.0, scaling: Mapping[str, Any] | None = None) -> None:
        self.head_dim, self.theta = head_dim, theta
        self.inv_freq = inverse_frequencies(head_dim, theta, scaling)
        self.attention_factor = attention_factor(scaling)
        self._tables: dict[tuple[Any, type], tuple[Array, Array]] = {}

    def _cos_sin(self, like_array: Array, length: int) -> tuple[Array, Array]:
        """cos and sin of positions 0 … length−1 or more (rows, d/2), in the array's dtype and library; the
        table grows by doubling, so decoding one position at a time recomputes it only log(n) times."""
        key = (like_array.dtype, type(like_array))
        cos, sin = self._tables.get(key, (None, None))
        if cos is None or len(cos) < length:
            rows = max(length, 2 * (0 if cos is None else len(cos)))
            angles = np.outer(np.arange(rows, dtype=np.float64), self.inv_freq)
            factor = self.attention_factor
            cos, sin = (like(like_array, (factor * np.cos(angles)).astype(like_array.dtype)),
                        like(like_array, (factor * np.sin(angles)).astype(like_array.dtype)))
            self._tables[key] = cos, sin
        return cos, sin

    def angles(self, x: Array, positions: Any) -> tuple[Array, Array]:
        """cos and sin (t, d/2) of `positions` (t,), broadcasting over the batch and heads of (B, heads, t, d/2);
        per-row positions (B, t) (packed documents) give (B, 1, t, d/2)."""
        positions = np.asarray(positions)
        cos, sin = self._cos_sin(x, int(positions.max()) + 1 if positions.size else 1)
        index = like(cos, positions)
        if positions.ndim == 2:
            return cos[index][:, None], sin[index][:, None]
        return cos[index], sin[index]

    def rotate(self, x: Array, positions: Any) -> None:
        """x (B, heads, t, d), a view, rotated in place to its positions (t,) or (B, t) (host integers)."""
        if not self._turn_compiled(x, positions, sign=1.0):
            self._turn(x, *self.angles(x, positions), sign=1.0)

    def rotate_back(self, dx: Array, positions: Any) -> None:
        """The backward of `rotate`, in place: d(x) from d(rotated), a turn by the opposite angle."""
        if not self._turn_compiled(dx, positions, sign=-1.0):
            self._turn(dx, *self.angles(dx, positions), sign=-1.0)

    def _turn_compiled(self, x: Array, positions: Any, sign: float) -> bool:
        """`_turn` at each row's position in one compiled loop over the tables (models.host_kernels) on the CPU;
        False where it cannot run (then `_turn`, the same numbers)."""
        if is_device_array(x):
            return False
        positions = np.asarray(positions)
        cos, sin = self._cos_sin(x, int(positions.max()) + 1 if positions.size else 1)
        return host_kernels.rotate_pairs(x, cos, sin, positions, sign)

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
