"""FP8 GEMM error against float64 as the inner dimension K grows — DeepSeek-V3's Figure 7 in small.

    python scripts/bench_fp8.py [--rows 64] [--ks 128,256,...,8192] [--outliers 4] [--seed 0]

y = x·W with x (rows × K) activation-like — normal, each token (row) of its own size e^N(0, 2), and a few outlier
channels 1000× larger, as LLM activations have — and W (K × rows) normal(0, 0.02), its rows of the outlier
channels 1000× smaller, so that y is the sum of all channels and not of the outliers alone. Each column is one way of
computing y from E4M3 operands (`models.fp8`), its error the mean over tokens of ‖y − y₆₄‖ / ‖y₆₄‖ (each row
against the float64 product of the unquantized operands):

    per-tensor          one scale for x, one for W (amax/448), float32 accumulation
    tiles               x per 1×128 tile, W per 128×128 block, float32 accumulation promoted every 128
    tiles 14-bit        the same operands, the tensor core's ~14-bit accumulator, promoted every 128
    tiles 14-bit no-p   the same, the whole of K in the 14-bit accumulator (no promotion)
    per-tensor 14b no-p what an FP8 GEMM without either of DeepSeek's two measures computes

and, to isolate the accumulator, "accumulation only": the error of the two 14-bit columns against the float64
product of the *quantized* operands (the report's ≈2 % at K = 4096 is of this kind, measured on the H800).
The 14-bit accumulator is a model (`models.fp8.accumulate`: groups of 32 products, sum truncated to 14 bits);
the figures are what this model gives, not a measurement of a GPU.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from models.fp8 import fp8_matmul, quantize, quantize_activation, quantize_weight  # noqa: E402

ACCUMULATOR_BITS = 14
OUTLIER = 1000.0


def operands(rows: int, inner: int, outliers: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    x = rng.standard_normal((rows, inner)) * np.exp(rng.normal(0, 2, (rows, 1)))  # tokens of unequal size
    weight = 0.02 * rng.standard_normal((inner, rows))
    channels = rng.choice(inner, size=min(outliers, inner), replace=False)
    x[:, channels] *= OUTLIER
    weight[channels] /= OUTLIER  # an outlier channel contributes to y like any other (its weights are small)
    return x.astype(np.float32), weight.astype(np.float32)


def relative(result: np.ndarray, exact: np.ndarray) -> float:
    """The mean over output rows (tokens) of ‖row error‖ / ‖exact row‖: every token counts alike."""
    return float(np.mean(np.linalg.norm(result - exact, axis=1) / np.linalg.norm(exact, axis=1)))


def errors(x: np.ndarray, weight: np.ndarray) -> dict[str, float]:
    exact = x.astype(np.float64) @ weight.astype(np.float64)
    whole_x, whole_w = quantize(x, x.shape), quantize(weight, weight.shape)
    tiled_x, tiled_w = quantize_activation(x), quantize_weight(weight)
    tiled_exact = tiled_x.dequantize().astype(np.float64) @ tiled_w.dequantize().astype(np.float64)
    whole_exact = whole_x.dequantize().astype(np.float64) @ whole_w.dequantize().astype(np.float64)
    promoted_14 = fp8_matmul(tiled_x, tiled_w, accumulator_bits=ACCUMULATOR_BITS)
    unpromoted_14 = fp8_matmul(tiled_x, tiled_w, None, accumulator_bits=ACCUMULATOR_BITS)
    naive = fp8_matmul(whole_x, whole_w, None, accumulator_bits=ACCUMULATOR_BITS)
    return {"per-tensor": relative(fp8_matmul(whole_x, whole_w), exact),
            "tiles": relative(fp8_matmul(tiled_x, tiled_w), exact),
            "tiles 14-bit": relative(promoted_14, exact),
            "tiles 14-bit no-p": relative(unpromoted_14, exact),
            "per-tensor 14b no-p": relative(naive, exact),
            "acc. only: promoted": relative(promoted_14, tiled_exact),
            "acc. only: no-p": relative(unpromoted_14, tiled_exact),
            "acc. only: per-tensor no-p": relative(naive, whole_exact)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--ks", default="128,256,512,1024,2048,4096,8192")
    parser.add_argument("--outliers", type=int, default=4, help="channels of x scaled by 1000")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    rng = np.random.default_rng(args.seed)
    rows = []
    for inner in (int(k) for k in args.ks.split(",")):
        rows.append((inner, errors(*operands(args.rows, inner, args.outliers, rng))))
    names = list(rows[0][1])
    print(f"mean over tokens of ‖y − y₆₄‖/‖y₆₄‖, y = x·W, x {args.rows}×K (token sizes e^N(0,2), "
          f"{args.outliers} outlier channels ×{OUTLIER:g}), W K×{args.rows}; E4M3 with amax/448 scales")
    print(f"{'K':>6} " + " ".join(f"{name:>{max(len(name), 9)}}" for name in names))
    for inner, measured in rows:
        print(f"{inner:>6} " + " ".join(f"{measured[name]:>{max(len(name), 9)}.2e}" for name in names))


if __name__ == "__main__":
    main()
