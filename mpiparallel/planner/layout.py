"""What a run chooses: the layout of its ranks (`Layout`), the choices `plan` fixes or searches (`Choices`), and
the bytes of its number formats (`Precision`).

A layout is dp·tp·pp·cp ranks (= the GPUs; world rank ((pp_i·dp + dp_i)·cp + cp_i)·tp + tp_i, tp innermost), ep
dividing dp with its dispatch ("flat", or the node-limited two-hop "hierarchical"), the ZeRO stage, m
microbatches, the pipeline schedule and its chunks per rank (interleaved: v; the V-shaped zbv and dualpipev: 2),
the recomputation (none, selective, full), sequence parallelism and the CP attention (ring, all-gather, Ulysses).

Bytes per parameter are `models.precision.model_state_bytes`'s, the formula `train --memory-report` uses: weights
+ gradients + optimizer state (AdamW's two moments, and an fp32 master copy when the compute dtype is narrower):

    mixed     bf16 weights and gradients, fp32 master and moments   2 + 2 + 12 = 16
    bfloat16  bf16 weights, fp32 gradients                          2 + 4 + 12 = 18
    fp8       fp32 gradients and master, bf16 moments               2 + 4 + (4 + 2·2) = 14, FP8 GEMMs and dispatch
    float32   4 + 4 + 8 = 16;  float64  8 + 8 + 16 = 32

SGD keeps no optimizer state; `--weights-only` keeps the weights alone; `--bytes-per-param` rescales all three.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from models.precision import dtype_named, model_state_bytes

from ..schedules.build import V_SHAPED

AXES = ("dp", "tp", "pp", "cp", "ep")
RECOMPUTE = ("none", "selective", "full")


@dataclass(frozen=True)
class Precision:
    """Bytes per parameter of weights, gradients and optimizer state, and per activation element."""

    weights: float
    gradients: float
    optimizer: float
    activations: float
    fp8_gemms: bool = False
    """The layers' matrix products in FP8 (`--fp8 blockwise`)."""
    dispatch: float | None = None
    """Bytes per element of the EP dispatch (None: `activations`); DeepSeek-V3 dispatches FP8 (§3.3.3)."""

    @property
    def per_parameter(self) -> float:
        return self.weights + self.gradients + self.optimizer


def precision_of(compute: str, master: str, gradients: str, moments: str | None = None) -> Precision:
    """Bytes per parameter of `train --compute-dtype C --dtype M --grad-dtype G [--exp-avg-dtype X]` with AdamW:
    the one formula `--memory-report` uses too (`models.precision.model_state_bytes`)."""
    per_parameter = model_state_bytes(compute, master, gradients, moments=moments)
    return Precision(per_parameter["parameters"], per_parameter["gradients"], per_parameter["optimizer_state"],
                     dtype_named(compute).itemsize)


PRECISIONS = {
    # bf16 weights and gradients; AdamW keeps an fp32 master copy and two fp32 moments: 2 + 2 + 12 = 16 bytes
    "mixed": precision_of("bfloat16", "float32", "bfloat16"),
    "bfloat16": precision_of("bfloat16", "float32", "float32"),  # --compute-dtype bfloat16: 2 + 4 + 12 = 18 bytes
    # DeepSeek-V3: --fp8 blockwise --compute-dtype bfloat16 --exp-avg-dtype bfloat16: 2 + 4 + (4 + 2·2) = 14 bytes
    # (the E4M3 copies of the weights exist only inside the GEMMs, which run in FP8); the EP dispatch sends E4M3
    # activations and one fp32 scale per 128 of them (§3.3.3: "quantize the activation before MoE up-projections
    # into FP8 and then apply dispatch components"; the combine stays BF16)
    "fp8": replace(precision_of("bfloat16", "float32", "float32", moments="bfloat16"), fp8_gemms=True,
                   dispatch=1 + 4 / 128),
    "float32": precision_of("float32", "float32", "float32"),  # weights, grads, 2 moments: 4 + 4 + 8
    "float64": precision_of("float64", "float64", "float64"),
}


def precision_with(name: str, optimizer: str = "adamw", bytes_per_param: float | None = None,
                   weights_only: bool = False) -> Precision:
    """A preset; SGD keeps no state; `weights_only` keeps only the weights; `bytes_per_param` rescales the
    model states to that many bytes per parameter (the weights alone with `weights_only`)."""
    base = PRECISIONS[name]
    if optimizer == "sgd":
        base = replace(base, optimizer=0)
    if weights_only:
        base = replace(base, gradients=0, optimizer=0)
    if bytes_per_param is not None:
        scale = bytes_per_param / base.per_parameter
        base = replace(base, weights=base.weights * scale, gradients=base.gradients * scale,
                       optimizer=base.optimizer * scale)
    return base


@dataclass(frozen=True)
class Layout:
    dp: int = 1
    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1
    zero: int = 0
    microbatches: int = 1
    schedule: str = "1f1b"
    recompute: str = "none"
    sp: bool = False
    cp_attention: str = "ring"
    virtual_stages: int = 2
    """Stages per rank of the interleaved schedule (Megatron's v)."""
    ep_dispatch: str = "flat"
    """The EP all-to-all: "flat" (one copy per expert) or "hierarchical" (node-limited two-hop)."""
    dp_shard: int = 0
    """Hybrid sharding (`train --dp-shard`): ZeRO shards over groups of this many DP ranks, replicated across the
    dp/dp_shard groups; 0 (or dp): over all of dp."""

    @property
    def shard_ranks(self) -> int:
        """The DP ranks one dense parameter's ZeRO states are sharded over."""
        return self.dp_shard or self.dp

    @property
    def replicas(self) -> int:
        """The shard groups holding copies of the sharded states (1 without hybrid sharding)."""
        return self.dp // self.shard_ranks

    @property
    def chunks(self) -> int:
        """Stages per pipeline rank: v for interleaved, 2 for the V-shaped schedules, else 1."""
        if self.pp > 1 and self.schedule == "interleaved":
            return self.virtual_stages
        return 2 if self.pp > 1 and self.schedule in V_SHAPED else 1

    @property
    def world(self) -> int:
        return self.dp * self.tp * self.pp * self.cp

    def label(self) -> str:
        cp = f"cp{self.cp}" + (f"-{self.cp_attention}" if self.cp > 1 else "")
        parts = [f"dp{self.dp}", f"tp{self.tp}{'+sp' if self.sp else ''}", f"pp{self.pp}", cp]
        if self.ep > 1:
            parts.append(f"ep{self.ep}" + ("-hierarchical" if self.ep_dispatch == "hierarchical" else ""))
        schedule = f" {self.schedule}" if self.pp > 1 else ""
        if self.pp > 1 and self.schedule == "interleaved" and self.virtual_stages != 2:
            schedule += f" v{self.virtual_stages}"
        zero = f"z{self.zero}" + (f"/{self.dp_shard}" if self.replicas > 1 else "")
        return f"{' '.join(parts)} {zero} m{self.microbatches}{schedule} rc-{self.recompute}"


@dataclass(frozen=True)
class Choices:
    """Fixed choices (None: searched) and the run's global batch."""

    batch_size: int = 8
    dp: int | None = None
    tp: int | None = None
    pp: int | None = None
    cp: int | None = None
    ep: int | None = None
    zero: int | None = None
    microbatches: int | None = None
    schedule: str | None = None
    recompute: str | None = None
    sp: bool | None = None
    cp_attention: str | None = None
    virtual_stages: int | None = None
    ep_dispatch: str | None = None
    dp_shard: int | None = None
