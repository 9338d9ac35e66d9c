"""One layout's prediction (`Plan`, the keys of `plan --json`) and its throughput:

    tokens/s                  batch · s / step
    Megatron TFLOP/s per GPU  eq. 3 of Narayanan et al. (which assumes full recomputation) / step / GPUs
    model TFLOP/s per GPU     (6·N + 12·l·h·s) · tokens/s / GPUs (MFU's count, `shapes.flops_per_token`)
    MFU                       model TFLOP/s over the GPU's dense peak (bf16 for 2-byte activations, TF32 for 4)
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from .hardware import Cluster
from .layout import Layout, Precision
from .shapes import Model, flops_per_token, megatron_flops


@dataclass
class Plan:
    """One layout's prediction. Memory in bytes, times in seconds, per rank and step."""

    layout: Layout
    memory_per_rank: list[dict[str, float]]
    """Per pipeline rank: parameters, gradients, optimizer_state, activations and total."""
    memory_per_stage: list[dict[str, Any]]
    compute_s: float
    comm_s: dict[str, float]
    comm_bytes: dict[str, float]
    exposed_comm_s: float
    bubble: float
    step_s: float
    fits: bool = True
    notes: list[str] = field(default_factory=list)
    tokens_per_s: float = 0.0
    """Tokens the whole cluster trains per second."""
    megatron_tflops: float = 0.0
    """Model TFLOP/s per GPU in Megatron's count (Narayanan et al. eq. 3: GEMMs with full recomputation)."""
    model_tflops: float = 0.0
    """Model TFLOP/s per GPU in MFU's count (6·N + 12·l·h·s per token, no recomputation)."""
    mfu: float | None = None
    """model_tflops over the GPU's dense peak (None when the peak is unknown)."""
    ep_inter_node_bytes: float = 0.0
    """Of comm_bytes["ep"], what crosses nodes (the EP dispatch's and combine's copies to other nodes)."""

    @property
    def max_memory(self) -> float:
        return max(rank["total"] for rank in self.memory_per_rank)

    def rank_memory(self, world_rank: int) -> dict[str, float]:
        """World rank `world_rank`'s memory: its pipeline rank's (rank = ((pp_i·dp + dp_i)·cp + cp_i)·tp + tp_i)."""
        layout = self.layout
        return self.memory_per_rank[world_rank // (layout.dp * layout.cp * layout.tp)]

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self.layout), "label": self.layout.label(), "step_s": self.step_s,
                "compute_s": self.compute_s, "bubble": self.bubble, "comm_s": self.comm_s,
                "comm_bytes": self.comm_bytes, "exposed_comm_s": self.exposed_comm_s, "fits": self.fits,
                "max_memory_bytes": self.max_memory, "memory_per_rank": self.memory_per_rank,
                "memory_per_stage": self.memory_per_stage, "notes": self.notes, "tokens_per_s": self.tokens_per_s,
                "megatron_tflops_per_gpu": self.megatron_tflops, "model_tflops_per_gpu": self.model_tflops,
                "mfu": self.mfu, "ep_inter_node_bytes": self.ep_inter_node_bytes}


def peak_of(cluster: Cluster, precision: Precision) -> float | None:
    """The dense tensor-core peak MFU divides by: a preset's bf16 (2-byte activations) or TF32 (4-byte) rate,
    else `cluster.peak_flops`."""
    if cluster.gpu is None:
        return cluster.peak_flops
    return {2: cluster.gpu.bf16_flops, 4: cluster.gpu.tf32_flops}.get(int(precision.activations))


def report_throughput(plan: Plan, model: Model, cluster: Cluster, precision: Precision, batch_size: int) -> None:
    tokens = batch_size * model.seq_len
    plan.tokens_per_s = tokens / plan.step_s
    plan.megatron_tflops = megatron_flops(model, batch_size) / plan.step_s / cluster.gpus / 1e12
    plan.model_tflops = flops_per_token(model) * plan.tokens_per_s / cluster.gpus / 1e12
    peak = peak_of(cluster, precision)
    plan.mfu = plan.model_tflops * 1e12 / peak if peak else None
