"""GPU presets for the planner (`plan --gpu NAME`), the achievable GEMM rate of each chip, and the two FLOP counts
that throughput is reported in.

Every figure below carries its source. Peak rates are dense (no 2:4 sparsity): NVIDIA's datasheets print the
sparse figure with an asterisk for Hopper, and the dense one is half of it. Bandwidths are per GPU and per
direction (NVIDIA prints NVLink as the sum of both directions: 600 GB/s for A100 is 300 GB/s each way).

The GEMM model (`gemm_seconds`) is set once per chip, never per run: a matrix product runs at the chip's
*maximum achievable matmul FLOP/s* (MAMF: the best rate over a search of shapes, measured with
`mamf-finder.py` and published in S. Bekman's *Machine Learning Engineering*, compute/accelerator/README.md,
"Maximum Achievable Matmul FLOPS comparison table", BF16) unless its operands and result cannot be moved through
memory that fast: time = max(2mnk / MAMF, 2·(mk + kn + mn) bytes / memory bandwidth) — the roofline, with the
measured compute roof — and the compute rounded up to whole output tiles (128×256, 256×128 or 128×128, the
least wasteful) and whole waves of them over
the SMs (tile and wave quantization, NVIDIA's "Matrix Multiplication Background User's Guide"). Small GEMMs (the
attention scores with 96 or 128 channels per head) come out memory-bound; the large projections at the MAMF,
less their last wave's idle SMs.

The two counts (`megatron_flops_per_step`, `model_flops_per_token`):

- Megatron's (Narayanan et al. 2021, eq. 3): 96·B·s·l·h²·(1 + s/6h + V/16lh) per step — the GEMMs of a GPT
  with full activation recomputation (four passes of the blocks: forward, recomputed forward, backward ×2),
  the whole s×s attention square, and the logits. The published Table 1 TFLOP/s are this count over step time.
- The model FLOPs of MFU (PaLM, Chowdhery et al. 2022, appendix B; torchtitan's `get_num_flop_per_token`):
  6·N + 12·l·h·s per token, N the weights a token passes through (embedding lookups excluded) — no
  recomputation counted, attention counted over the whole square. Llama 3 (Dubey et al. 2024, §3.3.2) states
  its MFU in this count (it cites Chowdhery et al.).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

TERA = 1e12
GB = 1e9


MeasuredGemms = Callable[[float, float, float, float, float, float], "float | None"]
"""(m, n, k, count, bytes per operand element, compute roof) -> the product's measured seconds scaled to that roof,
or None where that product was not measured."""


@dataclass(frozen=True)
class GPU:
    """One chip's rates (per GPU) and its node: FLOP/s, bytes/s, seconds, bytes."""

    name: str
    bf16_flops: float
    """Dense bf16/fp16 tensor-core peak."""
    tf32_flops: float
    fp8_flops: float | None
    """Dense fp8 peak; None where the chip has no fp8 tensor cores."""
    memory: float
    memory_bandwidth: float
    nvlink_bandwidth: float
    """Per direction, to the NVSwitch (any peer in the node)."""
    network_bandwidth: float
    """Per direction, this GPU's share of the node's scale-out NICs."""
    nvlink_latency: float
    network_latency: float
    mamf_flops: float
    """Maximum achievable bf16 matmul FLOP/s (measured; see the module docstring)."""
    fp8_mamf_flops: float | None = None
    """Maximum achievable FP8 matmul FLOP/s (None: no FP8 tensor cores)."""
    sms: int = 132
    """Streaming multiprocessors (A100 108, GH100 132: the A100 and H100 whitepapers)."""
    gpus_per_node: int = 8
    measured_gemms: MeasuredGemms | None = None
    """Products timed on this chip (`planner.measured`, `plan --gemm-measured`): consulted before the model."""

    @property
    def mamf_fraction(self) -> float:
        return self.mamf_flops / self.bf16_flops


# Latencies: assumed, not measured — 5 µs per message inside a node and 10 µs across (the Llama 3 paper, §3.3.3,
# puts its multi-hop network's "latency up to tens of microseconds"). Setting both to 0 raises the published
# rows' predictions by 0.4 % to 3.2 % (docs/published-runs.md).
_NVLINK_LATENCY, _NETWORK_LATENCY = 5e-6, 10e-6

_A100 = dict(  # NVIDIA A100 Tensor Core GPU datasheet (2021): 312 TFLOP/s bf16/fp16 dense, TF32 156, no fp8;
    bf16_flops=312 * TERA, tf32_flops=156 * TERA, fp8_flops=None,
    nvlink_bandwidth=300 * GB,  # third-generation NVLink 600 GB/s (both directions)
    network_bandwidth=25 * GB,  # DGX A100: eight 200 Gb/s HDR InfiniBand HCAs for eight GPUs (Narayanan et al. §5)
    nvlink_latency=_NVLINK_LATENCY, network_latency=_NETWORK_LATENCY,
    mamf_flops=271.2 * TERA,  # MAMF table: A100 SXM 271.2 TFLOP/s (86.9 % of 312), torch 2.6.0+cu126
    sms=108,
)
_HOPPER = dict(  # NVIDIA H100 Tensor Core GPU datasheet, SXM5: bf16 1,979 and fp8 3,958 TFLOP/s with sparsity,
    bf16_flops=989.4 * TERA, tf32_flops=494.7 * TERA, fp8_flops=1978.9 * TERA,  # i.e. 989.4 and 1,978.9 dense
    nvlink_bandwidth=450 * GB,  # fourth-generation NVLink 900 GB/s (both directions)
    network_bandwidth=50 * GB,  # one 400 Gb/s ConnectX-7 NIC per GPU (DGX H100; Llama 3 §3.3.1: "400 Gbps")
    nvlink_latency=_NVLINK_LATENCY, network_latency=_NETWORK_LATENCY,
    mamf_flops=794.5 * TERA,  # MAMF table: H100 SXM 794.5 TFLOP/s (80.3 % of 989), torch 2.7.0+cu126
    # DeepGEMM (deepseek-ai, README, 2025-04-18): "up to 1550 TFLOPS on H800" for its block-scaled FP8 GEMM
    # (78 % of 1,979) — the H100 die; the MAMF table has no FP8 column
    fp8_mamf_flops=1550 * TERA,
)

MIB = 2**20
H100_MEMORY = 81_559 * MIB  # nvidia-smi's memory.total of an H100 SXM 80GB (the H800 has the same HBM3)

GPUS: dict[str, GPU] = {
    # A100 80GB SXM4: 2,039 GB/s HBM2e (datasheet)
    "a100-80gb": GPU("a100-80gb", memory=80 * GB, memory_bandwidth=2039 * GB, **_A100),
    # A100 40GB SXM4: 1,555 GB/s HBM2 (datasheet)
    "a100-40gb": GPU("a100-40gb", memory=40 * GB, memory_bandwidth=1555 * GB, **_A100),
    # H100 SXM5 80GB: 3.35 TB/s HBM3 (datasheet); the memory as the device reports it, 81,559 MiB (nvidia-smi on
    # the H100 lent to this project, 2026-11-13): the "80 GB" are GiB, 85.5e9 bytes
    "h100-sxm": GPU("h100-sxm", memory=H100_MEMORY, memory_bandwidth=3350 * GB, **_HOPPER),
    # H800 SXM5: the H100 die with NVLink cut to 400 GB/s (both directions); DeepSeek-V3 (2024) §3.2.2 measures
    # "NVLink ... 160 GB/s" and "IB (50 GB/s)" per GPU on its H800 nodes
    "h800": GPU("h800", memory=H100_MEMORY, memory_bandwidth=3350 * GB,
                **(_HOPPER | {"nvlink_bandwidth": 200 * GB})),
    # H200 SXM: the H100 die with 141 GB HBM3e at 4.8 TB/s (H200 datasheet; the device reports 143,771 MiB, measured
    # on the H200 lent to this project, 2026-11-28); the MAMF table's GH200 (the same die with HBM3e) measured
    # 828.6 TFLOP/s
    "h200": GPU("h200", memory=143_771 * MIB, memory_bandwidth=4800 * GB,
                **(_HOPPER | {"mamf_flops": 828.6 * TERA})),
}


def gpu_named(name: str) -> GPU:
    """The preset `name` (ValueError naming the presets otherwise)."""
    try:
        return GPUS[name]
    except KeyError:
        raise ValueError(f"unknown GPU {name!r}; presets: {', '.join(GPUS)}") from None


_DTYPE_PEAKS = {"bfloat16": "bf16_flops", "float16": "bf16_flops", "tf32": "tf32_flops", "float32": "tf32_flops",
                "float8": "fp8_flops"}

_DEVICE_NAMES = (("A100", "80GB", "a100-80gb"), ("A100", "", "a100-40gb"), ("H800", "", "h800"),
                 ("H200", "", "h200"), ("GH200", "", "h200"), ("H100", "", "h100-sxm"))


def preset_for_device(device_name: str) -> GPU | None:
    """The preset of a CUDA device name as torch or CuPy report it ('NVIDIA H100 80GB HBM3', 'NVIDIA
    A100-SXM4-80GB'); None for a device without one (then MFU is not defined)."""
    upper = device_name.upper()
    for chip, memory, preset in _DEVICE_NAMES:
        if chip in upper and memory in upper:
            return GPUS[preset]
    return None


def peak_flops(gpu: GPU | str, dtype: str = "bfloat16") -> float:
    """The dense tensor-core peak of `gpu` (a preset or a device name) for a compute dtype: bfloat16 or float16,
    float32 (as TF32), float8. ValueError where the chip has none or the device is unknown."""
    chip = gpu if isinstance(gpu, GPU) else GPUS.get(gpu) or preset_for_device(gpu)
    if chip is None:
        raise ValueError(f"no peak FLOP/s known for device {gpu!r}; presets: {', '.join(GPUS)}")
    if dtype not in _DTYPE_PEAKS:
        raise ValueError(f"no tensor-core peak for dtype {dtype!r}; known: {', '.join(_DTYPE_PEAKS)}")
    peak = getattr(chip, _DTYPE_PEAKS[dtype])
    if peak is None:
        raise ValueError(f"{chip.name} has no {dtype} tensor cores")
    return peak


TILES = ((128, 256), (256, 128), (128, 128))
"""Output tiles one SM computes at a time in a large bf16 GEMM (NVIDIA, "Matrix Multiplication Background User's
Guide", tile and wave quantization: its A100 examples use 256×128 and 128×128); the library picks the one that
wastes least, each assumed to run at the MAMF."""


def gemm_seconds(m: float, n: float, k: float, gpu: GPU, item: float = 2.0, count: float = 1,
                 roof: float | None = None) -> float:
    """`count` [m, k] × [k, n] products (a batch): the roofline with the measured compute roof (module
    docstring; `roof`: another ceiling, the FP8 one), the compute rounded up to whole tiles (the least wasteful of
    `TILES`) and whole waves of tiles over the SMs (a wave runs `gpu.sms` tiles at the MAMF; a last, partial wave
    takes as long as a full one). A product `gpu.measured_gemms` knows takes its measured time instead."""
    roof = roof or gpu.mamf_flops
    if gpu.measured_gemms is not None:
        measured = gpu.measured_gemms(m, n, k, count, item, roof)
        if measured is not None:
            return measured
    compute = min(_quantized_flops(m, n, k, count, tile, gpu.sms) for tile in TILES) / roof
    traffic = count * item * (m * k + k * n + m * n) / gpu.memory_bandwidth
    return max(compute, traffic)


def _quantized_flops(m: float, n: float, k: float, count: float, tile: tuple[int, int], sms: int) -> float:
    """The FLOPs the SMs spend on `count` products in whole tiles and whole waves of `sms` tiles."""
    tiles = math.ceil(m / tile[0]) * math.ceil(n / tile[1]) * count
    return math.ceil(tiles / sms) * sms * 2 * tile[0] * tile[1] * k


# -- the two FLOP counts -------------------------------------------------------------------------------------------

def megatron_flops_per_step(batch: int, seq: int, layers: int, hidden: int, vocab: int) -> float:
    """Narayanan et al. 2021, eq. (3): 96·B·s·l·h²·(1 + s/6h + V/16lh), GEMMs only, with full recomputation."""
    return 96 * batch * seq * layers * hidden**2 * (1 + seq / (6 * hidden) + vocab / (16 * layers * hidden))


def model_flops_per_token(active_parameters: float, layers: int, hidden: int, seq: int) -> float:
    """MFU's count (PaLM appendix B): 6·N + 12·l·h·s per token — N the weights a token passes through, without
    the input embedding's lookup; the attention over the whole s×s square, as PaLM and torchtitan count it."""
    return 6 * active_parameters + 12 * layers * hidden * seq
