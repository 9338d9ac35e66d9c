"""The cluster: GPUs (or ranks), their memory, how many share a node, and the rates each rank runs at.

Per rank: matrix products at `matmul_flops` (or, with a GPU preset of `gpus.GPUS`, each product timed by its shape:
`gpus.gemm_seconds`), elementwise passes at `elementwise_bytes`, and messages by the α-β-γ model of
`collectives.cost_model` — n bytes cost α + n·β, a reduction adds n·γ — with `intra` inside a node (NVLink) and
`inter` across nodes (the network).

Three sources: `plan`'s rate options (the peaks × --efficiency); a preset (`Cluster.from_preset`: its memory,
NVLink and network latency and bandwidth per GPU, γ = 1 / memory bandwidth, the matmul rate its MAMF); or this
machine as `plan --calibrate` measured it (`load_machine`: the rates per rank with every core busy, × cores/ranks,
× the efficiency a real training step reached).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, replace
from pathlib import Path

from collectives.cost_model import CostModel

from .gpus import GPU
from .software import SOFTWARE, Software

GB = 10**9


DEFAULT_PEAK_FLOPS = 989e12
"""An H100's dense bfloat16 matmul FLOP/s: `plan --peak-flops`'s default, and the peak of a GPU in train's MFU."""


@dataclass(frozen=True)
class Cluster:
    """GPUs (or ranks) and what they can do; rates are per rank. With `gpu` (a preset of `gpus.GPUS`) every matrix
    product of a block is timed by its shape (`gpus.gemm_seconds`) instead of at `matmul_flops`."""

    gpus: int = 8
    gpu_memory: float = 80 * GB
    gpus_per_node: int = 8
    intra: CostModel = CostModel(alpha=5e-6, beta=1 / 450e9, gamma=1 / 1.5e12)
    inter: CostModel = CostModel(alpha=10e-6, beta=1 / 50e9, gamma=1 / 1.5e12)
    matmul_flops: float = DEFAULT_PEAK_FLOPS * 0.5
    elementwise_bytes: float = 3.35e12 * 0.5
    gpu: GPU | None = None
    software: Software = SOFTWARE["mpiparallel"]
    peak_flops: float | None = None
    """The dense peak that MFU divides by (a preset's own when `gpu` is set); None: MFU not reported."""
    cpu_cores: int | None = None
    """A calibrated CPU machine (`plan --calibrate`): its cores, which the ranks share; None: GPUs."""

    @classmethod
    def from_preset(cls, gpu: GPU, gpus: int, software: Software = SOFTWARE["mpiparallel"],
                    gpus_per_node: int | None = None) -> Cluster:
        """`gpus` of a preset: its memory, NVLink inside a node and network across (α, β per GPU), matrix
        products by shape, elementwise passes at the memory bandwidth."""
        per_node = min(gpus_per_node or gpu.gpus_per_node, gpus)
        gamma = 1 / gpu.memory_bandwidth
        if software.communication_sms:  # the matrix products run on the SMs communication leaves them
            share = (gpu.sms - software.communication_sms) / gpu.sms
            gpu = replace(gpu, sms=gpu.sms - software.communication_sms, mamf_flops=gpu.mamf_flops * share,
                          fp8_mamf_flops=gpu.fp8_mamf_flops and gpu.fp8_mamf_flops * share)
        return cls(gpus=gpus, gpu_memory=gpu.memory, gpus_per_node=per_node,
                   intra=CostModel(gpu.nvlink_latency, 1 / gpu.nvlink_bandwidth, gamma),
                   inter=CostModel(gpu.network_latency, 1 / gpu.network_bandwidth, gamma),
                   matmul_flops=gpu.mamf_flops, elementwise_bytes=gpu.memory_bandwidth, gpu=gpu, software=software,
                   peak_flops=gpu.bf16_flops)


# -- a machine measured by `plan --calibrate` --------------------------------------------------------------------

def physical_memory() -> int:
    """This machine's memory in bytes (what the ranks of a CPU machine share)."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def load_machine(path: Path, ranks_per_node: int, memory_per_rank: float | None = None) -> Cluster:
    """A cluster of `ranks_per_node` ranks on one machine from `plan --calibrate`'s file. Its rates were measured
    per rank with every core busy (one rank per core); fewer ranks than cores give each rank more BLAS threads
    (matmul rate × cores / ranks), more ranks share the cores (both rates × cores / ranks); both are scaled by the
    compute efficiency measured on a real serial training step. Each rank's memory: `memory_per_rank`, else the
    machine's memory (recorded at calibration; this machine's for older files) shared by the ranks."""
    measured = json.loads(Path(path).read_text())
    if memory_per_rank is None:
        memory_per_rank = (measured.get("memory_bytes") or physical_memory()) / ranks_per_node
    cores = measured["cores"]
    share = cores / ranks_per_node
    efficiency = measured.get("compute_efficiency", 1.0)  # the share of the raw rates a real step reaches
    link = CostModel(measured["alpha"], measured["beta"], measured["gamma"])
    across = CostModel(measured.get("alpha_inter") or link.alpha, measured.get("beta_inter") or link.beta, link.gamma)
    return Cluster(gpus=ranks_per_node, gpu_memory=memory_per_rank, gpus_per_node=ranks_per_node, intra=link,
                   inter=across, matmul_flops=measured["matmul_flops"] * share * efficiency,
                   elementwise_bytes=measured["elementwise_bytes"] * min(1.0, share) * efficiency, cpu_cores=cores)
