"""The kernels of one unit and their time on one rank.

A unit's microbatch (`UnitCost`) is its matrix products (`Gemm`: count × [m, k]·[k, n], 2·m·n·k·count FLOPs), its
elementwise passes (elements read and written), the collectives it blocks on and the elements it saves for
backward. Its compute time, forward:

    Σ products' time + elements · bytes per element / elementwise_bytes

with the products at `matmul_flops` (FLOPs / rate), or on a GPU preset each by its shape (`gpus.gemm_seconds`:
tile and wave quantization at the chip's MAMF; a layer's weight product under FP8 at the FP8 ceiling with 1-byte
operands; a fused attention kernel's scores at the ceiling alone). Backward runs each product twice — the input's
gradient [m, n]·[n, k] and the weight's [k, m]·[m, n] — plus the recomputed ones.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import NamedTuple

from .communication import Collective
from .gpus import GPU, gemm_seconds
from .hardware import Cluster
from .layout import Precision


class Gemm(NamedTuple):
    """`count` matrix products [m, k] × [k, n]; `in_memory` False for a fused attention kernel whose scores stay
    on chip (only its compute is timed); `linear` for a layer's weight product (FP8 training runs those in FP8:
    DeepSeek-V3 §3.3, attention, router and head stay in BF16)."""

    m: float
    n: float
    k: float
    count: float = 1
    in_memory: bool = True
    linear: bool = False

    @property
    def flops(self) -> float:
        return 2 * self.m * self.n * self.k * self.count

    def seconds(self, gpu: GPU, item: float, fp8: bool = False) -> float:
        """At the chip's FP8 ceiling (operands of one byte) for a linear under FP8 where the chip has one."""
        in_fp8 = fp8 and self.linear and gpu.fp8_mamf_flops is not None
        roof = gpu.fp8_mamf_flops if in_fp8 else gpu.mamf_flops
        if not self.in_memory:
            return self.flops / roof
        return gemm_seconds(self.m, self.n, self.k, gpu, 1.0 if in_fp8 else item, self.count, roof)

    def backward_seconds(self, gpu: GPU, item: float, fp8: bool = False) -> float:
        """The input's gradient [m, n] × [n, k] and the weight's [k, m] × [m, n]."""
        if not self.in_memory:
            return 2 * self.seconds(gpu, item)
        dgrad, wgrad = self._replace(n=self.k, k=self.n), self._replace(m=self.k, k=self.m)
        return dgrad.seconds(gpu, item, fp8) + wgrad.seconds(gpu, item, fp8)


@dataclass(frozen=True)
class UnitCost:
    """One unit, one microbatch, one rank: elements saved, matmul FLOPs and elementwise elements, forward and
    backward; the collectives it blocks on per direction; and its matrix products by shape (forward; backward
    runs each twice, for the input's and the weight's gradient, plus the recomputed ones)."""

    saved: float
    flops_forward: float
    flops_backward: float
    elementwise_forward: float
    elementwise_backward: float
    collectives_forward: tuple[Collective, ...] = ()
    collectives_backward: tuple[Collective, ...] = ()
    gemms_forward: tuple[Gemm, ...] = ()
    gemms_recomputed: tuple[Gemm, ...] = ()


@lru_cache(maxsize=16384)
def compute_seconds(cost: UnitCost, cluster: Cluster, precision: Precision, backward: bool) -> float:
    """The matrix products (at `matmul_flops`, or by shape on a GPU preset) and the elementwise passes (cached:
    the search prices the same units for many layouts)."""
    item, fp8 = precision.activations, precision.fp8_gemms
    elements = cost.elementwise_backward if backward else cost.elementwise_forward
    memory = elements * item / cluster.elementwise_bytes
    if cluster.gpu is None:
        return (cost.flops_backward if backward else cost.flops_forward) / cluster.matmul_flops + memory
    if not backward:
        return sum(g.seconds(cluster.gpu, item, fp8) for g in cost.gemms_forward) + memory
    return sum(g.backward_seconds(cluster.gpu, item, fp8) for g in cost.gemms_forward) + \
        sum(g.seconds(cluster.gpu, item, fp8) for g in cost.gemms_recomputed) + memory
