"""FP8 GEMMs the way DeepSeek-V3 trains (report §3.3): E4M3 operands with fine-grained scales, float32 accumulation
promoted every N_C = 128 inner elements.

E4M3 (`ml_dtypes.float8_e4m3fn`): 1 sign, 4 exponent, 3 fraction bits — 4 significant bits, unit roundoff
u₈ = 2⁻⁴, largest finite 448, smallest normal 2⁻⁶, smallest subnormal 2⁻⁹, no infinity (beyond 448 is NaN).

Scaling. A tensor is cut into tiles and each tile gets its own scale s = amax(tile) / 448, computed online from
the tile itself (no history, no delayed scaling); its values are stored as round_E4M3(x / s), so the tile's
largest magnitude lands on 448 and the tile uses E4M3's whole range. The tilings, for y = x·W with x [M, K] and
W [K, N] (K the inner dimension):

    GEMM                       left operand                      right operand
    forward     y  = x·W       x:    1×128 tiles along K          W:    128×128 blocks
    act. grad   dx = dy·Wᵀ     dy:   1×128 tiles along N          Wᵀ:   the same 128×128 blocks, transposed
    weight grad dW = xᵀ·dy     xᵀ:   1×128 tiles along M (tokens)  dy:   128×1 tiles along M (tokens)

Activations and output gradients get one scale per token and 128 channels: an outlier channel spoils only its
own 128 neighbours, not the whole tensor (per-tensor scaling) — the reason for fine tiles. Weights are smooth
enough for 128×128 blocks, and a block's scale is the same for W and Wᵀ, so one quantized weight serves forward
and the activation gradient. The weight gradient sums over tokens, so there both operands are tiled along the
token axis (the "transposed" tiling: 128×1 of x and dy).

Special tiles: a tile of zeros gets scale 1 (any scale represents it; 1 avoids 0/0); a tile holding an inf or a
NaN gets scale NaN, so all its values dequantize to NaN — a non-finite input cannot be scaled, and the NaN must
reach the gradients where the overflow checks look. A ragged edge (a dimension not a multiple of the tile) gets
smaller tiles: their amax is taken over the elements that exist.

The GEMM. Every 128 inner elements the products of the raw E4M3 values (exact: 4 × 4 significant bits) are
summed in the tensor core's accumulator, then *promoted*: multiplied by the two tiles' scales and added into a
float32 accumulator. On NVIDIA H800 the FP8 tensor-core accumulator keeps about 14 significant bits (the report
measures nearly 2 % maximum relative error at K = 4096); promotion bounds how many terms ever meet that
accumulator. `accumulator_bits` models it: partial sums of `group` (32) products are added one group at a time
into an accumulator whose result is truncated to that many significant bits (bits the alignment shifts out are
lost, not rounded). `promote_every=None` runs the whole inner dimension through that accumulator.

Error bound (exact float32 accumulation, promotion on; `gemm_error_bound`): rounding moves an element by at
most u₈·|x| in E4M3's normal range and 2⁻¹⁰·s (half the subnormal spacing, s its tile's scale) below it, so
|fp8(a·b) − a·b| ≤ |a|·e_b + e_a·|b| + e_a·e_b + float32's γ_n·|a|·|b| elementwise, e_x = u₈·|x| + 2⁻¹⁰·s —
about 2u₈ = 1/8 of |a|·|b| in the worst case, ≈ 2⁻⁶ relative on random data (scripts/bench_fp8.py measures it).

Arrays. The same code runs on CuPy (the array module of `collectives.backend`): the rounding to E4M3 is written
in float32 arithmetic (frexp, ldexp, rint) rather than a dtype cast, so it needs no FP8 dtype. On NumPy the values
are stored as real 1-byte E4M3; on CuPy as float32 holding E4M3 values — correct, not fast: every GEMM is a loop
of float32 GEMMs over 128-wide slices of dequantized-scale products, and no FP8 tensor core is used.

No communication here. Cost per GEMM: quantizing an M×K operand is a few elementwise passes, and the GEMM is
K/128 float32 GEMMs of M×128×N with one M×N scaled add each (a real FP8 kernel does the same in registers).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import ml_dtypes
import numpy as np

from collectives.backend import Array, get_array_module, is_device_array

from .precision import widen

E4M3 = np.dtype(ml_dtypes.float8_e4m3fn)
E4M3_MAX = 448.0
E4M3_FRACTION_BITS = 3
E4M3_MIN_NORMAL_EXPONENT = -6
E4M3_ROUNDOFF = 2.0**-4
TILE = 128
"""The tile edge (1×128, 128×128) and N_C, the promotion interval: DeepSeek-V3's choice."""
FP8_RECIPES = ("none", "blockwise")


def round_to_e4m3(x: Array) -> Array:
    """float32 `x` rounded to the nearest E4M3 number (ties to even), kept as float32; NaN beyond E4M3's range
    (|x| > 448 after rounding; E4M3fn has no infinity), so inf and NaN become NaN."""
    xp = get_array_module(x)
    x = xp.asarray(x, dtype=np.float32)
    exponent = xp.frexp(xp.abs(x))[1] - 1  # |x| in [2^e, 2^(e+1))
    exponent = xp.maximum(exponent, E4M3_MIN_NORMAL_EXPONENT)  # below 2^-6: subnormal, fixed spacing 2^-9
    spacing = xp.ldexp(xp.ones_like(x), exponent - E4M3_FRACTION_BITS)
    with np.errstate(invalid="ignore"):
        rounded = xp.rint(x / spacing) * spacing
        return xp.where(xp.abs(rounded) <= E4M3_MAX, rounded, xp.float32(np.nan))


@dataclass
class Quantized:
    """A 2-D tensor in E4M3 with one float32 scale per `tile` (rows, columns): x ≈ values · scale of its tile.
    `values` has the tensor's shape (E4M3 on NumPy, float32 holding E4M3 numbers on CuPy); `scales` has
    ⌈rows/tile rows⌉ × ⌈columns/tile columns⌉ entries."""

    values: Array
    scales: Array
    tile: tuple[int, int]

    @property
    def shape(self) -> tuple[int, int]:
        return self.values.shape

    def expanded_scales(self) -> Array:
        """Each element's scale: the scales repeated over their tiles, cut at a ragged edge."""
        xp = get_array_module(self.scales)
        rows, columns = self.tile
        full = xp.repeat(xp.repeat(self.scales, rows, axis=0), columns, axis=1)
        return full[:self.shape[0], :self.shape[1]]

    def dequantize(self) -> Array:
        """The float32 tensor the E4M3 values and scales stand for."""
        return self.values.astype(np.float32) * self.expanded_scales()

    @property
    def T(self) -> Quantized:  # noqa: N802 (the transpose, as arrays name it)
        """The transpose: the same values and scales, tiles transposed (a 128×128 block serves W and Wᵀ)."""
        return Quantized(self.values.T, self.scales.T, self.tile[::-1])


def tile_amax(x: Array, tile: tuple[int, int]) -> Array:
    """max |x| over each `tile` of the 2-D float32 `x` (NaN where a tile holds one); ragged edges padded with 0,
    which changes no max."""
    xp = get_array_module(x)
    rows, columns = tile
    tiles = (math.ceil(x.shape[0] / rows), math.ceil(x.shape[1] / columns))
    padded = xp.zeros((tiles[0] * rows, tiles[1] * columns), dtype=np.float32)
    padded[:x.shape[0], :x.shape[1]] = xp.abs(x)
    return padded.reshape(tiles[0], rows, tiles[1], columns).max(axis=(1, 3))


def tile_scales(amax: Array) -> Array:
    """scale = amax / 448 per tile; 1 for a tile of zeros; NaN for a tile with an inf or a NaN."""
    xp = get_array_module(amax)
    scales = (amax / np.float32(E4M3_MAX)).astype(np.float32)
    scales = xp.where(amax == 0, np.float32(1), scales)
    return xp.where(xp.isfinite(amax), scales, np.float32(np.nan))


def quantize(x: Array, tile: tuple[int, int]) -> Quantized:
    """The 2-D `x` in E4M3 with one scale per `tile`: values = round_E4M3(x / scale), scale = amax / 448."""
    x = widen(x).astype(np.float32, copy=False)
    if x.ndim != 2:
        raise ValueError(f"quantize takes a 2-D tensor, got shape {x.shape}")
    tile = (min(tile[0], x.shape[0]) or 1, min(tile[1], x.shape[1]) or 1)  # a tile larger than x: the whole of x
    scales = tile_scales(tile_amax(x, tile))
    quantized = Quantized(x, scales, tile)
    values = round_to_e4m3(x / quantized.expanded_scales())
    quantized.values = values if is_device_array(values) else values.astype(E4M3)  # exact: already E4M3 numbers
    return quantized


def quantize_activation(x: Array, tile: int = TILE) -> Quantized:
    """Activations and output gradients [tokens, K]: one scale per token and `tile` channels (1×128)."""
    return quantize(x, (1, tile))


def quantize_weight(weight: Array, tile: int = TILE) -> Quantized:
    """Weights [K, N]: one scale per `tile`×`tile` block (128×128)."""
    return quantize(weight, (tile, tile))


# -- FP8 on the wire: E4M3 bit patterns, and rows packed with their scales (EP dispatch) -------------------------


def e4m3_bits(values: Array) -> Array:
    """The uint8 bit patterns of E4M3 numbers (float32 holding them, or ml_dtypes' E4M3): sign, 4 exponent bits
    (bias 7; 0 for subnormals), 3 fraction bits; NaN as 0x7F. Arithmetic, so CuPy arrays need no FP8 dtype."""
    xp = get_array_module(values)
    values = values.astype(np.float32)
    magnitude = xp.abs(values)
    magnitude = xp.where(xp.isnan(magnitude), np.float32(0), magnitude)  # NaN: its pattern is set below
    exponent = xp.frexp(magnitude)[1] - 1
    normal = magnitude >= 2.0**E4M3_MIN_NORMAL_EXPONENT
    biased = xp.where(normal, exponent + 7, 0)
    spacing_exponent = xp.where(normal, exponent, E4M3_MIN_NORMAL_EXPONENT) - E4M3_FRACTION_BITS
    fraction = xp.rint(xp.ldexp(magnitude, -spacing_exponent)) - xp.where(normal, 8, 0)
    bits = (xp.signbit(values).astype(np.int32) << 7) | (biased.astype(np.int32) << 3) | fraction.astype(np.int32)
    return xp.where(xp.isnan(values), 0x7F, bits).astype(np.uint8)


def e4m3_from_bits(bits: Array) -> Array:
    """The E4M3 numbers of uint8 bit patterns, as float32 (the inverse of `e4m3_bits`; 0x7F and 0xFF are NaN)."""
    xp = get_array_module(bits)
    bits = bits.astype(np.int32)
    biased, fraction = (bits >> 3) & 0xF, (bits & 0x7).astype(np.float32)
    magnitude = xp.where(biased == 0, xp.ldexp(fraction, -9), xp.ldexp(fraction + 8, biased - 10))
    value = xp.where(bits & 0x80, -magnitude, magnitude).astype(np.float32)
    return xp.where((bits & 0x7F) == 0x7F, np.float32(np.nan), value)


def packed_row_bytes(channels: int, tile: int = TILE) -> int:
    """Bytes of one row sent in FP8: a byte per channel and a float32 scale per 1×`tile` tile."""
    return channels + 4 * math.ceil(channels / tile)


def pack_rows(quantized: Quantized) -> Array:
    """Row-tiled (1×t) E4M3 rows as one uint8 array [rows, channels + 4·tiles]: the values' bit patterns, then
    the row's float32 scales' bytes — what the EP dispatch sends (a row's tiles travel with it)."""
    xp = get_array_module(quantized.scales)
    if quantized.tile[0] != 1:
        raise ValueError(f"pack_rows packs 1×t tiles, got {quantized.tile}")
    scales = xp.ascontiguousarray(quantized.scales.astype(np.float32)).view(np.uint8)
    return xp.concatenate([e4m3_bits(quantized.values), scales], axis=1)


def unpack_rows(packed: Array, channels: int, tile: int = TILE) -> Quantized:
    """The inverse of `pack_rows` for rows of `channels` values in 1×`tile` tiles."""
    xp = get_array_module(packed)
    values = e4m3_from_bits(packed[:, :channels])
    scales = xp.ascontiguousarray(packed[:, channels:]).view(np.float32)
    tile = min(tile, channels) or 1
    return Quantized(values if is_device_array(values) else values.astype(E4M3), scales, (1, tile))


# -- the GEMM ---------------------------------------------------------------------------------------------------


def truncate_to_bits(x: Array, bits: int) -> Array:
    """x with all but its `bits` leading significant bits dropped (toward zero): what an accumulator that aligns
    its addends and keeps `bits` bits does to a sum."""
    xp = get_array_module(x)
    fraction, exponent = xp.frexp(x)  # fraction in [0.5, 1)
    return xp.ldexp(xp.trunc(xp.ldexp(fraction, bits)), exponent - bits)


def accumulate(a: Array, b: Array, accumulator_bits: int | None = None, group: int = 32) -> Array:
    """a·b (float32 operands): in float32 (BLAS) when `accumulator_bits` is None; else as the limited tensor-core
    accumulator does it — `group` products at a time summed exactly, each group's sum added to the running sum
    and the result truncated to `accumulator_bits` significant bits."""
    if accumulator_bits is None:
        return a @ b
    xp = get_array_module(a)
    a, b = a.astype(np.float64), b.astype(np.float64)
    total = xp.zeros((a.shape[0], b.shape[1]), dtype=np.float64)
    for start in range(0, a.shape[1], group):
        total = truncate_to_bits(total + a[:, start:start + group] @ b[start:start + group], accumulator_bits)
    return total.astype(np.float32)


def _scale_constant_over(extent: int, promote_every: int, inner: int) -> bool:
    """Whether a tile `extent` long along the inner dimension holds each promotion interval whole."""
    return extent >= inner or extent % promote_every == 0


def fp8_matmul(a: Quantized, b: Quantized, promote_every: int | None = TILE,
               accumulator_bits: int | None = None, group: int = 32) -> Array:
    """a·b in float32 from E4M3 operands: per `promote_every` (N_C) inner elements, the raw E4M3 products summed
    (`accumulate`), then scaled by the two tiles' scales and added into the float32 result. `promote_every=None`:
    no promotion — the scaled products of the whole inner dimension go through the accumulator at once.

    Each promotion interval must lie inside one scale of each operand (a.tile[1] and b.tile[0] multiples of it,
    or the whole inner dimension): a scale changing inside a tensor-core sum cannot be applied after it."""
    inner = a.shape[1]
    if b.shape[0] != inner:
        raise ValueError(f"fp8_matmul: inner dimensions differ, {a.shape} · {b.shape}")
    if promote_every is None:
        return accumulate(a.dequantize(), b.dequantize(), accumulator_bits, group)
    if not (_scale_constant_over(a.tile[1], promote_every, inner)
            and _scale_constant_over(b.tile[0], promote_every, inner)):
        raise ValueError(f"fp8_matmul: promotion every {promote_every} needs scale tiles that hold whole intervals, "
                         f"got {a.tile} and {b.tile}")
    xp = get_array_module(a.scales)
    row_scales = xp.repeat(a.scales, a.tile[0], axis=0)[:a.shape[0]]  # (M, K tiles of a)
    column_scales = xp.repeat(b.scales, b.tile[1], axis=1)[:, :b.shape[1]]  # (K tiles of b, N)
    left, right = a.values.astype(np.float32), b.values.astype(np.float32)
    out = xp.zeros((a.shape[0], b.shape[1]), dtype=np.float32)
    for start in range(0, inner, promote_every):
        stop = min(start + promote_every, inner)
        partial = accumulate(left[:, start:stop], right[start:stop], accumulator_bits, group)
        partial *= row_scales[:, start // a.tile[1], None]
        partial *= column_scales[start // b.tile[0]]
        out += partial
    return out


# -- a linear layer's three GEMMs -------------------------------------------------------------------------------


class BlockwiseFp8Gemms:
    """The three GEMMs of y = x·W (W [K, N]) in E4M3 with DeepSeek-V3's tiles (the table above), float32 results;
    the drop-in for `models.layers.Gemms`. Each call quantizes its operands afresh (online scales): a weight's
    blocks are recomputed in the input pass, identical to forward's since the weight has not changed.

    `tile` is the tile edge and the promotion interval (128, DeepSeek-V3's N_C); `accumulator_bits` models a
    limited tensor-core accumulator (None: exact float32, what training uses)."""

    name = "blockwise"

    def __init__(self, tile: int = TILE, accumulator_bits: int | None = None) -> None:
        self.tile, self.accumulator_bits = tile, accumulator_bits

    def _matmul(self, a: Quantized, b: Quantized) -> Array:
        return fp8_matmul(a, b, self.tile, self.accumulator_bits)

    def forward(self, x2d: Array, weight: Array) -> Array:
        """y = x·W: x in 1×128 tiles along K, W in 128×128 blocks."""
        return self._matmul(quantize_activation(x2d, self.tile), quantize_weight(weight, self.tile))

    def input_gradient(self, dout2d: Array, weight: Array) -> Array:
        """dx = dy·Wᵀ: dy in 1×128 tiles along N, Wᵀ the forward blocks transposed."""
        return self._matmul(quantize_activation(dout2d, self.tile), quantize_weight(weight, self.tile).T)

    def weight_gradient(self, x2d: Array, dout2d: Array) -> Array:
        """dW = xᵀ·dy: both tiled 128 tokens long (xᵀ 1×128, dy 128×1), since the sum runs over tokens."""
        return self._matmul(quantize(x2d.T, (1, self.tile)), quantize(dout2d, (self.tile, 1)))


def fp8_gemms(recipe: str, tile: int = TILE) -> BlockwiseFp8Gemms | None:
    """The GEMMs of `--fp8 recipe`: None for "none" (the layers' own compute-dtype GEMMs)."""
    if recipe not in FP8_RECIPES:
        raise ValueError(f"fp8 recipe must be one of {FP8_RECIPES}, got {recipe!r}")
    return BlockwiseFp8Gemms(tile) if recipe == "blockwise" else None


def gemm_error_bound(a: Array, b: Array, qa: Quantized, qb: Quantized, promote_every: int = TILE) -> Array:
    """The elementwise bound on |fp8_matmul(qa, qb) − a·b| (exact float32 accumulation, promotion on).

    Rounding to E4M3 moves an element by at most half a spacing: u₈·|x| in the normal range, 2⁻¹⁰·s below the
    tile's 2⁻⁶·s (subnormals), so e_x = u₈·|x| + 2⁻¹⁰·s bounds it. The products then err by
    |a|·e_b + e_a·|b| + e_a·e_b, and float32 adds γ_n·Σ|products| with n = N_C (one BLAS sum per interval)
    + K/N_C (the promotions) + 3 (the two scale multiplies, the dequantized operands)."""
    xp = get_array_module(a)
    a, b = xp.abs(widen(a).astype(np.float64)), xp.abs(widen(b).astype(np.float64))
    error_a = E4M3_ROUNDOFF * a + 2.0**-10 * qa.expanded_scales()
    error_b = E4M3_ROUNDOFF * b + 2.0**-10 * qb.expanded_scales()
    rounding = a @ error_b + error_a @ b + error_a @ error_b
    terms = promote_every + math.ceil(a.shape[1] / promote_every) + 3
    return rounding + terms * 2.0**-24 * ((a + error_a) @ (b + error_b))
