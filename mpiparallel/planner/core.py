"""The planner: memory, time and communication of every layout of a GPT-2, a llama (Mixtral) or a DeepSeek-V3 on
a cluster, ranked. Pure Python, no MPI. DeepSeek-V3's blocks (multi-head latent attention, DeepSeekMoE with dense
first blocks, the MTP module on the head's unit, the flat or node-limited EP dispatch): `planner.deepseek`'s
formulas, in this module's "DeepSeek-V3" section.

A layout is dp·tp·pp·cp (= the GPUs), ep (dividing dp) and its dispatch, ZeRO stage, microbatches, pipeline
schedule, recomputation, sequence parallelism and the CP attention (ring, all-gather, Ulysses). For each the planner
predicts, per pipeline rank and per stage:

- memory: parameters, gradients and optimizer state of the units the rank holds (embedding, blocks, head; TP
  shards, the vocabulary padded to a multiple of tp, the last stage's copy of the tied embedding, E/ep experts),
  divided by dp where ZeRO shards them; plus the activations in flight: the schedule simulator's list of
  actions walked in order, each stage holding its microbatches between F and W (or B), each microbatch costing
  what its units save (`models.layers.block_activation_elements` per block, the family's formula; the head's
  logits). Per block, h channels, d = h/n_head, F the MLP width, E experts:

      GPT-2   LayerNorms 4h, c_attn (3h² + 3h)/tp, c_proj h²/tp + h, MLP (8h² + 5h) with F = 4h, wpe, tied head
      llama   RMSNorms 2h, q and o 2h²/tp, k and v 2·h·n_kv'·d (n_kv' = n_kv/tp, or 1 head replicated on
              tp/n_kv ranks when tp > n_kv; tp must divide n_kv or be a multiple of it), SwiGLU 3·h·F/tp, no
              biases, no wpe, final RMSNorm h, lm_head V·h unless tied
      MoE     E/ep experts of the family's MLP (replicated over tp) and a router h·E; saved: per routed token
              the router's arrays and K·(2h + the expert's hidden units), balanced routing assumed

- compute: the matrix products at the matmul rate — per block and token forward 2·(2h² + 2h·h_kv)/tp for the
  attention projections (h_kv = n_kv'·d; 8h²/tp for multi-head attention), the scores 4·pairs·h/tp, the MLP
  2·2·h·4h/tp (GPT-2) or 2·3·h·F/tp (SwiGLU), MoE K experts per token plus the router's 2·h·E; backward twice
  forward; `--recompute full` adds one more forward of the blocks, `selective` the attention scores — and the
  elementwise passes (norms, GELU or SwiGLU, RoPE, softmax, AdamW) at the elementwise rate;
- communication per axis from the α-β-γ formulas the collectives use (`collectives.cost_model`, the cheapest
  algorithm as algo="auto" picks), the volumes `mpiparallel.traffic` states: tp 2 all-reduces of b·s·h per
  block and microbatch each way (1 with MoE; reduce-scatter + all-gather with SP; the forward's again with
  `--recompute full`), and when tp > n_kv the k and v weight gradients (h·d each) all-reduced over the tp/n_kv
  ranks holding each KV head; cp per block, with t = b·s/cp this rank's tokens: ring 2(c−1)·t·h_kv forward and
  2(2c−1)·t·h_kv backward, all-gather the whole sequence's K and V forward and backward plus their gradients'
  reduce-scatter, Ulysses all-to-alls of t·(h/tp + 2·max(n_kv', c)·d) and t·h/tp each way; ep four
  all-to-alls of K·tokens·h per MoE block (across nodes: the flat dispatch's K·(N − 1)/N copies per token, the
  node-limited two-hop dispatch's M·(N − 1)/N, then NVLink); pp one message of b·s·h per microbatch and stage
  boundary each way, and the tied embedding's gradient between the end stages; dp the gradient all-reduce
  (ZeRO: reduce-scatter + all-gather; ZeRO-3 all-gathers the parameters in forward and backward too);
- the bubble: the schedule simulated with F = I = W = 1; the pipeline then lasts m × the busiest rank's chunks
  (F + B) plus the bubble's chunks at the average chunk's time; exposed communication: tp, cp and ep block the
  compute (ep only beyond the compute beside it with DualPipe's overlap); pp exposes its pipeline fill and
  drain; dp overlaps with backward (all but the last bucket) without a pipeline and is exposed after one.

Step time = pipeline (or microbatches one after another) + exposed dp + the optimizer. Layouts that do not
fit in the GPU memory are dropped; the rest are ranked by step time.
"""

from __future__ import annotations

import itertools
import json
import math
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field, replace
from fractions import Fraction
from functools import cached_property, lru_cache
from pathlib import Path
from typing import Any, NamedTuple

from collectives.cost_model import CostModel, choose, predict
from models.context_parallel import VARIANTS as CP_ATTENTIONS
from models.layers import QUERY_BLOCK, block_activation_elements, query_blocks
from models.precision import dtype_named, model_state_bytes
from models.tensor_parallel import check_tensor_parallel_shape, key_value_replicas
from models.transformer import GPTConfig

from ..schedules import SCHEDULES, bubble_formula, build_schedule, simulate, stage_units
from ..schedules.actions import BACKWARD_WEIGHT, FORWARD, FULL_BACKWARD
from ..schedules.build import V_SHAPED, check_arguments
from ..schedules.simulator import peak_activations
from . import deepseek
from .deepseek import DeepSeekShape
from .gpus import GPU, gemm_seconds, megatron_flops_per_step, model_flops_per_token, peak_flops

AXES = ("dp", "tp", "pp", "cp", "ep")
RECOMPUTE = ("none", "selective", "full")
GB = 10**9
SIMULATED_ACTIONS = 1024
"""Largest pp·microbatches·chunks the layout search simulates when m ≥ 2p (a simulation of 4096 takes a
second); beyond, the bubble is the schedule's formula, exact at unit costs for m ≥ 2p (every schedule here)."""


# -- what is planned ------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Model:
    """A model of either family (train's model: `models.transformer.GPTConfig`); `parameters` overrides the count
    (`--params` without a shape). `arch`, `n_kv_head` (0: n_head), `ffn_hidden` (0: the family's default) and
    `tie_embeddings` (None: the family's default) are GPTConfig's, whose rules `config` applies."""

    n_layer: int
    n_embd: int
    n_head: int
    seq_len: int
    vocab_size: int
    n_positions: int = 1024
    experts: int = 0
    top_k: int = 2
    parameters: int | None = None
    arch: str = "gpt2"
    n_kv_head: int = 0
    ffn_hidden: int = 0
    tie_embeddings: bool | None = None
    deepseek: DeepSeekShape | None = None
    """arch deepseek_v3's latent attention, DeepSeekMoE and MTP choices (`planner.deepseek`)."""

    @classmethod
    def from_config(cls, config: GPTConfig, seq_len: int) -> Model:
        """The planner's model of train's configuration (`--init`'s config.json, or train's flags)."""
        return cls(config.n_layer, config.n_embd, config.n_head, seq_len, config.vocab_size, config.n_positions,
                   config.n_experts, config.moe_top_k, arch=config.arch, n_kv_head=config.n_kv_head,
                   ffn_hidden=config.ffn_hidden, tie_embeddings=config.tie_embeddings,
                   deepseek=DeepSeekShape.of(config) if config.is_deepseek else None)

    @classmethod
    def from_parameter_count(cls, parameters: float, seq_len: int = 2048, vocab_size: int = 50257,
                             arch: str = "gpt2") -> Model:
        """A shape with about `parameters` weights in its blocks, h ≈ 128·L as GPT-3 and Llama roughly have,
        rounded to a multiple of 1024, 128 channels per head; the count itself stays `parameters`. GPT-2's
        block holds 12·h² (4h² attention, 8h² MLP); llama's 10.5·h²: n_kv = n_head/4 KV heads (as Llama 2 70B
        and Llama 3 have, 8 of 32 or 64 query heads: 2h² + 2h·h/4 in q, k, v, o) and the SwiGLU default
        F = 8/3·h (3·h·F = 8h²)."""
        per_block = 10.5 if arch == "llama" else 12
        layers = max(1, round((parameters / (per_block * 128**2)) ** (1 / 3)))
        width = max(1024, round(math.sqrt(parameters / (per_block * layers)) / 1024) * 1024)  # heads: 8·k
        heads = width // 128
        return cls(layers, width, heads, seq_len, vocab_size, max(1024, seq_len), parameters=int(parameters),
                   arch=arch, n_kv_head=heads // 4 if arch == "llama" else 0)

    @cached_property
    def config(self) -> GPTConfig:
        """train's configuration of this shape; building it checks the shape (ValueError)."""
        return GPTConfig(vocab_size=self.vocab_size, n_positions=self.n_positions, n_embd=self.n_embd,
                         n_layer=self.n_layer, n_head=self.n_head, n_experts=self.experts, moe_top_k=self.top_k,
                         arch=self.arch, n_kv_head=self.n_kv_head, ffn_hidden=self.ffn_hidden,
                         tie_embeddings=self.tie_embeddings, **self._deepseek_choices())

    def _deepseek_choices(self) -> dict[str, Any]:
        """GPTConfig's deepseek_v3 fields (no Switch loss: DeepSeek-V3 balances with the bias)."""
        return asdict(self.deepseek) | {"moe_aux_coef": 0.0} if self.deepseek else {}

    @property
    def is_llama(self) -> bool:
        """The llama family's choices (RoPE, RMSNorm, SwiGLU, no biases): llama and deepseek_v3."""
        return self.arch in ("llama", "deepseek_v3")

    @property
    def is_deepseek(self) -> bool:
        return self.arch == "deepseek_v3"

    def is_moe_block(self, layer: int) -> bool:
        """Whether block `layer` has experts (all of an MoE model's, but DeepSeek-V3's first dense ones)."""
        return self.config.is_moe_layer(layer)

    @property
    def query_key_dim(self) -> int:
        """Channels per head of queries and keys (DeepSeek-V3: d_n + d_r = 192)."""
        return deepseek.query_key_dim(self.config) if self.is_deepseek else self.head_dim

    @property
    def value_dim(self) -> int:
        """Channels per head of values (DeepSeek-V3: 128)."""
        return self.config.v_head_dim if self.is_deepseek else self.head_dim

    @property
    def kv_heads(self) -> int:
        return self.config.kv_heads

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

    @property
    def ffn_width(self) -> int:
        """The MLP's (and each expert's) hidden units F: 4h for GPT-2, llama's ffn_hidden or 8/3·h rounded."""
        return self.config.ffn_width

    @property
    def tied(self) -> bool:
        return self.config.tied

    def total_parameters(self) -> int:
        """Every parameter of the model (DeepSeek-V3: of the main model, without the MTP modules)."""
        if self.parameters is not None:
            return self.parameters
        if self.is_deepseek:
            return self.deepseek_counts["total"]
        return self.trained_parameters()

    @cached_property
    def deepseek_counts(self) -> dict[str, int]:
        """DeepSeek-V3's total, activated and MTP counts (`deepseek.parameter_counts`; counted once per model)."""
        return deepseek.parameter_counts(self.config)

    def trained_parameters(self) -> int:
        """Every parameter training holds (DeepSeek-V3: with the MTP modules' own)."""
        if self.parameters is not None:
            return self.parameters
        return sum(unit_parameters(self, tp=1, ep=1)) - tied_parameters(self, tp=1)  # the tied copy counts once

    def active_parameters(self) -> int:
        """Weights a token passes through: top_k of the experts (6·N·tokens counts these; DeepSeek-V3: its
        activated count, shared experts and dense blocks whole)."""
        if self.is_deepseek and self.parameters is None:
            return self.deepseek_counts["activated"]
        if not self.experts:
            return self.total_parameters()
        return self.total_parameters() - self.n_layer * (self.experts - self.top_k) * expert_parameters(self)


DEFAULT_PEAK_FLOPS = 989e12
"""An H100's dense bfloat16 matmul FLOP/s: `plan --peak-flops`'s default, and the peak of a GPU in train's MFU."""


ATTENTION_KERNELS = ("blocked", "dense", "flash")


@dataclass(frozen=True)
class Software:
    """How the training code runs what the layout asks (one setting per code base, never per run):

    - attention: "blocked" (this project's layers: causal query blocks, the probabilities in memory), "dense"
      (Megatron-LM 2021: the whole s×s square multiplied, masked and soft-maxed in memory by fused kernels,
      Narayanan et al. §4.2), "flash" (one fused kernel over the causal half; nothing of s×s in memory);
    - pipeline_scatter_gather: a stage boundary sends b·s·h/tp per TP rank and all-gathers over NVLink
      (Narayanan et al. §4.1) instead of b·s·h from every TP rank;
    - attention_dropout: dropout on the attention probabilities (Megatron-LM 2021's GPT: Narayanan et al. §2.3
      and its default --attention-dropout 0.1), memory passes over the s×s probabilities each way;
    - blocking_pipeline_sends: every stage boundary's send and receive waits in the critical path, steady state
      included (Megatron-LM 2021's synchronous p2p), not only in the pipeline's fill and drain;
    - dp_overlap: when the data-parallel reduction overlaps the last microbatch's backward: "without-pipeline"
      (this project: its buckets reduce during backward, but a pipeline reduces after its schedule), "always"
      (Llama 3's FSDP prefetches and reduces asynchronously, §3.3.2) or "never" (Megatron-LM 2021 all-reduces
      after the microbatches);
    - chunk_overlap: the EP all-to-alls and the pipeline's sends run beside the compute of a paired forward and
      backward chunk and wait only for what that compute does not cover (DeepSeek-V3's DualPipe, §3.2.1: "both
      all-to-all and PP communication can be fully hidden");
    - communication_sms: SMs the communication kernels hold, taken from the matrix products (DeepSeek-V3 §3.5.1:
      "we allocate 20 out of the 132 SMs available in the H800 GPU for this purpose");
    - recompute_latent: MLA's RMSNorms and up-projections (q_b_proj, kv_b_proj) recomputed in backward whatever
      the recomputation (DeepSeek-V3 §3.2.3: "we recompute all RMSNorm operations and MLA up-projections during
      back-propagation")."""

    name: str = "mpiparallel"
    attention: str = "blocked"
    pipeline_scatter_gather: bool = False
    dp_overlap: str = "without-pipeline"
    attention_dropout: bool = False
    blocking_pipeline_sends: bool = False
    chunk_overlap: bool = False
    communication_sms: int = 0
    recompute_latent: bool = False


SOFTWARE = {
    "mpiparallel": Software(),
    "megatron-2021": Software("megatron-2021", attention="dense", pipeline_scatter_gather=True, dp_overlap="never",
                              attention_dropout=True, blocking_pipeline_sends=True),
    "flash-fsdp": Software("flash-fsdp", attention="flash", pipeline_scatter_gather=False, dp_overlap="always"),
    "hai-llm": Software("hai-llm", attention="flash", dp_overlap="never", chunk_overlap=True, communication_sms=20,
                        recompute_latent=True),
}
"""The code bases `plan --software` knows: this project, Megatron-LM as Narayanan et al. 2021 ran it, a
FlashAttention + FSDP code base as Llama 3 (Dubey et al. 2024, §3.3.2) describes, and DeepSeek's HAI-LLM as the
DeepSeek-V3 report (§3.2) describes it (its DP reduction unprinted: after the schedule)."""


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
    software: Software = Software()
    peak_flops: float | None = None
    """The dense peak that MFU divides by (a preset's own when `gpu` is set); None: MFU not reported."""

    @classmethod
    def from_preset(cls, gpu: GPU, gpus: int, software: Software = Software(),
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
        return f"{' '.join(parts)} z{self.zero} m{self.microbatches}{schedule} rc-{self.recompute}"


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


# -- parameters per unit ------------------------------------------------------------------------------------

def padded_vocab(vocab_size: int, tp: int) -> int:
    return -(-vocab_size // tp) * tp


def unit_parameters(model: Model, tp: int, ep: int) -> list[int]:
    """Parameters one rank holds of each unit (embedding, blocks…, head), for one TP and EP rank. The head holds
    its vocabulary shard: the tied embedding's (only counted once when one rank holds both) or llama's lm_head."""
    h = model.n_embd
    vocab_rows = padded_vocab(model.vocab_size, tp) // tp * h
    positions = 0 if model.is_llama else model.n_positions * h  # llama's RoPE has no weights
    final_norm = h if model.is_llama else 2 * h
    if model.is_deepseek:  # the MTP modules beside the head, reading their own copy of the embedding
        config = model.config
        attention = deepseek.latent_attention_parameters(config, tp)
        blocks = [attention + deepseek.feed_forward_parameters(config, tp, ep, model.is_moe_block(i))
                  for i in range(model.n_layer)]
        head = final_norm + vocab_rows + tied_parameters(model, tp) + deepseek.mtp_own_parameters(config, tp, ep)
        return [vocab_rows] + blocks + [head]
    block = attention_parameters(model, tp) + mlp_parameters(model, tp, ep)
    return [vocab_rows + positions] + [block] * model.n_layer + [final_norm + vocab_rows]


def attention_parameters(model: Model, tp: int) -> int:
    """One block's norms and attention on one TP rank. GPT-2: LayerNorms 4h, c_attn (3h² + 3h)/tp, c_proj
    h²/tp + h (its bias replicated). Llama: RMSNorms 2h, q and o 2h²/tp, k and v 2·h·h_kv with h_kv = n_kv'·d
    this rank's KV channels (n_kv/tp heads, or one head replicated on tp/n_kv ranks when tp > n_kv)."""
    h = model.n_embd
    if not model.is_llama:
        return 4 * h + (3 * h * h + 3 * h) // tp + (h * h) // tp + h
    return 2 * h + 2 * h * h // tp + 2 * h * local_kv_heads(model, tp) * model.head_dim


def mlp_parameters(model: Model, tp: int, ep: int) -> int:
    """One block's MLP on one TP rank (GPT-2: 8h² + 4h weights and biases, llama's SwiGLU 3·h·F, split over tp;
    GPT-2's c_proj bias replicated), or its E/ep experts (replicated over the TP group) and router [h, E]."""
    h, width = model.n_embd, model.ffn_width
    if model.experts:
        return model.experts // ep * expert_parameters(model) + h * model.experts
    if model.is_llama:
        return 3 * h * width // tp
    return (h * width + width) // tp + (width * h) // tp + h


def expert_parameters(model: Model) -> int:
    """One whole expert: the family's MLP (GPT-2 c_fc and c_proj with biases, llama gate, up and down)."""
    h, width = model.n_embd, model.ffn_width
    return 3 * h * width if model.is_llama else 2 * h * width + width + h


def local_kv_heads(model: Model, tp: int) -> int:
    """KV heads one TP rank holds: n_kv/tp, or 1 when each head is replicated on tp/n_kv ranks."""
    return max(model.kv_heads // tp, 1)


def tied_parameters(model: Model, tp: int) -> int:
    """The token embedding's vocabulary shard when the head unit reads it too (held by both the embedding and the
    head unit): a tied head, or DeepSeek-V3's MTP modules; 0 for llama's untied lm_head."""
    return padded_vocab(model.vocab_size, tp) // tp * model.n_embd if model.config.head_reads_embedding else 0


def expert_unit_parameters(model: Model, ep: int) -> list[int]:
    """Per unit, the routed experts' parameters one rank holds (E/ep per MoE block; DeepSeek-V3's MTP module's
    too): each held by dp/ep ranks only, where ZeRO shards it and its gradient is reduced."""
    if not model.experts:
        return [0] * (model.n_layer + 2)
    if model.is_deepseek:
        per_block = model.experts // ep * 3 * model.n_embd * model.config.moe_ffn_hidden
        head = model.config.mtp_depth * per_block
    else:
        per_block, head = model.experts // ep * expert_parameters(model), 0
    return [0] + [per_block if model.is_moe_block(i) else 0 for i in range(model.n_layer)] + [head]


def scaled_unit_parameters(model: Model, layout: Layout) -> tuple[list[float], float, list[float]]:
    """Per unit, this rank's parameters, the tied shard, and per unit the routed experts' share; with `--params`
    and no shape, scaled so that the whole model adds up to N."""
    units, tied = unit_parameters(model, layout.tp, layout.ep), tied_parameters(model, layout.tp)
    experts = expert_unit_parameters(model, layout.ep)
    scale = 1.0
    if model.parameters is not None:
        scale = model.parameters / replace(model, parameters=None).total_parameters()
    return [u * scale for u in units], tied * scale, [e * scale for e in experts]


def held_parameters(units: list[int], per_unit: list[float], tied: float) -> float:
    """Parameters of the units one rank holds; the tied embedding once when it holds both ends."""
    count = sum(per_unit[u] for u in units)
    return count - tied if 0 in units and len(per_unit) - 1 in units else count


# -- activations and work per unit and microbatch -----------------------------------------------------------

class Collective(NamedTuple):
    """A collective a unit waits for: its name, the bytes of its buffer (all_gather: the gathered size), its
    mesh axis, and the ranks of that axis taking part (0: all of them)."""

    name: str
    nbytes: float
    axis: str
    ranks: int = 0


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


def _causal_pairs(seq: int) -> int:
    """(query, key) products the blocked causal attention computes: Σ over query blocks of rows·keys seen."""
    return sum((stop - start) * stop for start, stop in query_blocks(seq, QUERY_BLOCK))


def tp_exchanges(nbytes: float, layout: Layout, count: int) -> tuple[Collective, ...]:
    """`count` exchanges of one activation over tp: an all-reduce each, or under SP a reduce-scatter and an
    all-gather in its place (the same volume)."""
    if layout.tp == 1:
        return ()
    one = (Collective("reduce_scatter", nbytes, "tp"), Collective("all_gather", nbytes, "tp")) if layout.sp \
        else (Collective("all_reduce", nbytes, "tp"),)
    return one * count


def unit_costs(model: Model, layout: Layout, rows: int, precision: Precision,
               software: Software = Software()) -> list[UnitCost]:
    """Embedding, one block, head: what one microbatch of `rows` sequences costs on one rank, run by `software`."""
    h, tp, item = model.n_embd, layout.tp, precision.activations
    tokens = rows * (model.seq_len // layout.cp)
    s = tokens * h
    vocab = padded_vocab(model.vocab_size, tp) // tp
    seq_shard = tp if layout.sp else 1
    exchange = tp_exchanges(s * item, layout, 1)
    embedding = UnitCost(saved=tokens * 8 / item, flops_forward=0, flops_backward=0,  # the int64 token ids
                         elementwise_forward=2 * s / seq_shard, elementwise_backward=2 * s,
                         collectives_forward=exchange)
    blocks = [block_cost(model, layout, rows, precision, software, moe) for moe in block_variants(model)]
    # the vocab-parallel cross-entropy: the row maxima, then the sums and target logits in one message
    head_collectives = (Collective("all_reduce", tokens * item, "tp"),
                        Collective("all_reduce", 2 * tokens * item, "tp")) if tp > 1 else ()
    # the final norm keeps its output and 1/σ (or 1/rms) (sequence slices under SP), the cross-entropy its whole
    # input (all-gathered under SP) and the probabilities of this rank's vocabulary shard
    head = UnitCost(saved=(s + tokens) / seq_shard + s + tokens * vocab, flops_forward=2 * tokens * h * vocab,
                    flops_backward=4 * tokens * h * vocab, elementwise_forward=6 * s / seq_shard + 6 * tokens * vocab,
                    elementwise_backward=10 * s / seq_shard,
                    collectives_forward=head_collectives, collectives_backward=exchange,
                    gemms_forward=(Gemm(tokens, vocab, h),))
    if model.is_deepseek and model.config.mtp_depth:
        head = _with_prediction_modules(head, blocks[-1], model, rows, vocab, item)
    return [embedding, *blocks, head]


def block_variants(model: Model) -> tuple[bool, ...]:
    """The distinct blocks, as whether they have experts: GPT-2's and llama's blocks are all alike; DeepSeek-V3 has
    dense first blocks, then MoE ones."""
    return tuple(sorted({model.is_moe_block(i) for i in range(model.n_layer)}))


def unit_kinds(model: Model) -> tuple[int, ...]:
    """Per unit (embedding, blocks…, head), its index in `unit_costs`' list."""
    variants = block_variants(model)
    blocks = [1 + variants.index(model.is_moe_block(i)) for i in range(model.n_layer)]
    return (0, *blocks, 1 + len(variants))


def _with_prediction_modules(head: UnitCost, block: UnitCost, model: Model, rows: int, vocab: int,
                             item: float) -> UnitCost:
    """The head unit with DeepSeek-V3's MTP modules (their positions priced whole, not cut over CP or SP): per module
    the two RMSNorms and eh_proj [2h, h], one MoE block and the shared head's logits and cross-entropy again, each
    over all s positions (the last k of module k masked, as models/multi_token.py runs them). Saved per position:
    the embedding's token id, enorm's and hnorm's inputs and 1/rms, eh_proj's input [2h], the final norm's and the
    cross-entropy's (6h + 3 + V)."""
    depth, h, seq = model.config.mtp_depth, model.n_embd, model.seq_len
    tokens = rows * seq
    projection = Gemm(tokens, h, 2 * h, linear=True)
    logits = Gemm(tokens, vocab, h)
    gemms = (projection, logits) + block.gemms_forward
    flops = projection.flops + logits.flops + block.flops_forward
    elements = 8 * tokens * h + 6 * tokens * vocab + block.elementwise_forward
    saved = tokens * (6 * h + 3 + vocab + 8 / item) + block.saved
    return replace(head, saved=head.saved + depth * saved, flops_forward=head.flops_forward + depth * flops,
                   flops_backward=head.flops_backward + depth * (flops + block.flops_backward),
                   elementwise_forward=head.elementwise_forward + depth * elements,
                   elementwise_backward=head.elementwise_backward + depth * (2 * elements),
                   collectives_forward=head.collectives_forward + block.collectives_forward * depth,
                   collectives_backward=head.collectives_backward + block.collectives_backward * depth,
                   gemms_forward=head.gemms_forward + gemms * depth,
                   gemms_recomputed=head.gemms_recomputed + block.gemms_recomputed * depth)


def attention_pairs(model: Model, layout: Layout, attention: str) -> float:
    """(query, key) pairs one sequence's attention computes on one CP rank: this project's causal query blocks
    (the whole sequence's, over cp), the whole s×s square ("dense") or its causal half ("flash")."""
    seq = model.seq_len // layout.cp
    if attention == "dense":
        return seq * model.seq_len
    if attention == "flash":
        return seq * model.seq_len / 2
    return _causal_pairs(seq) * layout.cp  # ≈ 1/cp of the sequence's pairs


def block_gemms(model: Model, layout: Layout, tokens: int, rows: int, attention: str) -> tuple[Gemm, ...]:
    """One block's forward matrix products on one rank: q, k, v (fused), o, the MLP's (or the experts' and the
    router's) and, per sequence and head, the scores Q·Kᵀ and their product with V."""
    h, tp, d = model.n_embd, layout.tp, model.head_dim
    kv_channels = local_kv_heads(model, tp) * d
    width = model.ffn_width
    gemms = [Gemm(tokens, h / tp + 2 * kv_channels if model.is_llama else 3 * h / tp, h), Gemm(tokens, h, h / tp)]
    if model.experts:
        routed = _moe_tokens(layout, tokens)
        local = model.experts / layout.ep
        rows_per_expert = routed * model.top_k / local
        inner = [Gemm(rows_per_expert, 2 * width if model.is_llama else width, h, local),
                 Gemm(rows_per_expert, h, width, local)]
        gemms += inner + [Gemm(routed, model.experts, h)]
    else:
        gemms += [Gemm(tokens, (2 if model.is_llama else 1) * width / tp, h), Gemm(tokens, h, width / tp)]
    seq = model.seq_len // layout.cp
    keys = attention_pairs(model, layout, attention) / seq  # keys per query, on average
    heads = rows * model.n_head / tp
    in_memory = attention != "flash"
    gemms += [Gemm(seq, keys, d, heads, in_memory), Gemm(seq, d, keys, heads, in_memory)]
    return tuple(gemms)


def block_cost(model: Model, layout: Layout, rows: int, precision: Precision,
               software: Software = Software(), moe: bool | None = None) -> UnitCost:
    """One transformer block of any family on one rank, one microbatch (`moe`: DeepSeek-V3's MoE or dense
    blocks; the model's kind otherwise)."""
    if model.is_deepseek:
        return _latent_block_cost(model, layout, rows, precision, software, bool(moe))
    attention = software.attention
    h, tp = model.n_embd, layout.tp
    seq = model.seq_len // layout.cp
    tokens = rows * seq
    s = tokens * h
    seq_shard = tp if layout.sp else 1
    kv_channels = local_kv_heads(model, tp) * model.head_dim
    pairs = attention_pairs(model, layout, attention)
    # the probabilities a materializing kernel writes and reads (a fused one keeps them on chip)
    probabilities = 0.0 if attention == "flash" else rows * (model.n_head // tp) * pairs
    attention_flops = 4 * rows * pairs * h / tp
    projection_flops = 2 * tokens * (2 * h * h / tp + 2 * h * kv_channels)  # q and o; k and v (GQA: h_kv ≤ h/tp)
    # LayerNorms or RMSNorms and residual adds (sharded with SP); GPT-2's biases and head reshapes, llama's head
    # reshapes and RoPE on q and k; the softmax
    attention_elements = 8 * s / tp if not model.is_llama else 8 * tokens * (h / tp + kv_channels)
    mlp_flops, mlp_elements = _mlp_work(model, layout, tokens)
    flops_forward = projection_flops + attention_flops + mlp_flops
    # the softmax's passes over the probabilities; dropout reads them and writes them and a one-byte mask
    probability_passes = 5 + (2 + 1 / precision.activations if software.attention_dropout else 0)
    elementwise_forward = 12 * s / seq_shard + attention_elements + mlp_elements + probability_passes * probabilities
    recompute_flops = {"none": 0.0, "selective": attention_flops / 2, "full": flops_forward}[layout.recompute]
    recompute_elements = {"none": 0.0, "selective": probability_passes * probabilities,
                          "full": elementwise_forward}[layout.recompute]
    forward, backward = block_collectives(model, layout, tokens, precision.activations)
    gemms = block_gemms(model, layout, tokens, rows, attention)
    recomputed = {"none": (), "selective": gemms[-2:-1], "full": gemms}[layout.recompute]
    return UnitCost(saved=block_saved_elements(model, layout, rows, precision.activations),
                    flops_forward=flops_forward, flops_backward=2 * flops_forward + recompute_flops,
                    elementwise_forward=elementwise_forward,
                    elementwise_backward=2 * elementwise_forward + recompute_elements,
                    collectives_forward=forward, collectives_backward=backward,
                    gemms_forward=gemms, gemms_recomputed=recomputed)


# -- DeepSeek-V3: multi-head latent attention and DeepSeekMoE (formulas: `planner.deepseek`'s docstring) ----------

def _latent_block_cost(model: Model, layout: Layout, rows: int, precision: Precision, software: Software,
                       moe: bool) -> UnitCost:
    """One DeepSeek-V3 block (MLA, then a dense SwiGLU or DeepSeekMoE) on one rank, one microbatch."""
    config, tp, item = model.config, layout.tp, precision.activations
    seq = model.seq_len // layout.cp
    tokens = rows * seq
    s = tokens * model.n_embd
    seq_shard = tp if layout.sp else 1
    heads = model.n_head // tp
    pairs = attention_pairs(model, layout, software.attention)
    scores = _latent_score_gemms(model, layout, rows, pairs, software.attention)
    gemms = _latent_projection_gemms(model, layout, tokens) + scores + _deepseek_ffn_gemms(model, layout, tokens, moe)
    flops_forward = sum(g.flops for g in gemms)
    probabilities = 0.0 if software.attention == "flash" else rows * heads * pairs
    # the norms (two of h, the latents' r and r_q), RoPE on the queries' and the shared key's d_r channels, the
    # head reshapes of q, k and v; the SwiGLU passes (or the router's and the experts')
    latent = config.kv_lora_rank + (config.q_lora_rank or 0)
    attention_elements = 4 * tokens * latent + 4 * tokens * (heads + 1) * config.qk_rope_head_dim \
        + 2 * tokens * heads * (2 * model.query_key_dim + model.value_dim)
    probability_passes = 5 + (2 + 1 / item if software.attention_dropout else 0)
    elementwise_forward = 12 * s / seq_shard + attention_elements + _deepseek_ffn_elements(model, layout, tokens, moe) \
        + probability_passes * probabilities
    recomputed = {"none": (), "selective": scores, "full": gemms}[layout.recompute]
    recompute_elements = {"none": 0.0, "selective": probability_passes * probabilities,
                          "full": elementwise_forward}[layout.recompute]
    if software.recompute_latent and layout.recompute != "full":  # the norms' passes and the up-projections again
        recomputed += _latent_up_projections(model, layout, tokens)
        recompute_elements += 12 * s / seq_shard + 4 * tokens * latent
    forward, backward = block_collectives(model, layout, tokens, item, moe, precision.dispatch)
    return UnitCost(saved=_latent_saved_elements(model, layout, rows, item, moe),
                    flops_forward=flops_forward, flops_backward=2 * flops_forward + sum(g.flops for g in recomputed),
                    elementwise_forward=elementwise_forward,
                    elementwise_backward=2 * elementwise_forward + recompute_elements,
                    collectives_forward=forward, collectives_backward=backward, gemms_forward=gemms,
                    gemms_recomputed=recomputed)


def _latent_projection_gemms(model: Model, layout: Layout, tokens: int) -> tuple[Gemm, ...]:
    """MLA's projections on one TP rank: q_a and kv_a (replicated), q_b and kv_b (this rank's heads), o_proj (or
    q_proj for q_a and q_b without q_lora_rank)."""
    config, heads, h = model.config, model.n_head // layout.tp, model.n_embd
    down = [Gemm(tokens, config.kv_lora_rank + config.qk_rope_head_dim, h, linear=True)]
    if config.q_lora_rank is None:
        down.append(Gemm(tokens, heads * model.query_key_dim, h, linear=True))
    else:
        down.append(Gemm(tokens, config.q_lora_rank, h, linear=True))
    return (*down, *_latent_up_projections(model, layout, tokens), Gemm(tokens, h, heads * model.value_dim,
                                                                        linear=True))


def _latent_up_projections(model: Model, layout: Layout, tokens: int) -> tuple[Gemm, ...]:
    """kv_b_proj and q_b_proj (with q_lora_rank): the latents up to this rank's heads."""
    config, heads = model.config, model.n_head // layout.tp
    kv = Gemm(tokens, heads * (config.qk_nope_head_dim + model.value_dim), config.kv_lora_rank, linear=True)
    if config.q_lora_rank is None:
        return (kv,)
    return kv, Gemm(tokens, heads * model.query_key_dim, config.q_lora_rank, linear=True)


def _latent_score_gemms(model: Model, layout: Layout, rows: int, pairs: float, attention: str) -> tuple[Gemm, ...]:
    """Per sequence and head: the scores Q·Kᵀ over d_qk channels and their product with V of d_v channels."""
    seq = model.seq_len // layout.cp
    keys, heads, in_memory = pairs / seq, rows * model.n_head / layout.tp, attention != "flash"
    return (Gemm(seq, keys, model.query_key_dim, heads, in_memory), Gemm(seq, model.value_dim, keys, heads, in_memory))


def _deepseek_ffn_gemms(model: Model, layout: Layout, tokens: int, moe: bool) -> tuple[Gemm, ...]:
    """A dense block's SwiGLU (split over tp), or DeepSeekMoE's router, shared expert and this rank's routed
    experts (E/ep of them, K·tokens·ep/E rows each under balanced routing)."""
    config, h = model.config, model.n_embd
    if not moe:
        width = model.ffn_width / layout.tp
        return Gemm(tokens, 2 * width, h, linear=True), Gemm(tokens, h, width, linear=True)
    routed, local, width = _moe_tokens(layout, tokens), model.experts / layout.ep, config.moe_ffn_hidden
    rows_per_expert = routed * model.top_k / local
    shared = config.n_shared_experts * width
    gemms = (Gemm(routed, model.experts, h), Gemm(rows_per_expert, 2 * width, h, local, linear=True),
             Gemm(rows_per_expert, h, width, local, linear=True))
    return gemms + ((Gemm(routed, 2 * shared, h, linear=True), Gemm(routed, h, shared, linear=True)) if shared else ())


def _deepseek_ffn_elements(model: Model, layout: Layout, tokens: int, moe: bool) -> float:
    """SwiGLU's ~6 passes over its hidden units; the router's sigmoid, bias, group and top-k passes over E."""
    config = model.config
    if not moe:
        return 6 * tokens * model.ffn_width / layout.tp
    routed = _moe_tokens(layout, tokens)
    hidden = routed * config.moe_ffn_hidden * (model.top_k + config.n_shared_experts)
    return 6 * hidden + 6 * routed * model.experts


def _latent_saved_elements(model: Model, layout: Layout, rows: int, item: float, moe: bool) -> float:
    """Elements a DeepSeek-V3 block saves per microbatch on one rank: the llama block's norms and residual inputs,
    MLA's (the compressed query and its norm, the latent and its norm, q, k_nope, the shared RoPE key, v and the
    merged heads: t·(2r_q + 2r + d_r + 2 + H'·(d_qk + d_n + 2d_v)), H' = H/tp), the probabilities unless
    recomputed or fused, the SwiGLU's 5 arrays of its width (MoE: per routed token the router's arrays and K
    experts' rows, and the shared expert's)."""
    config, tp, cp = model.config, layout.tp, layout.cp
    seq = model.seq_len // cp
    tokens, heads = rows * seq, model.n_head // tp
    activation = tokens * model.n_embd
    if layout.recompute == "full":
        return activation / tp if layout.sp else activation
    norms = 2 * (activation + tokens) / (tp if layout.sp else 1)
    attention = tokens * (2 * (config.q_lora_rank or 0) + 2 * config.kv_lora_rank + config.qk_rope_head_dim + 2
                          + heads * (model.query_key_dim + config.qk_nope_head_dim + 2 * model.value_dim))
    probabilities = 0.0
    if cp > 1 and layout.cp_attention != "ulysses":
        probabilities = rows * heads * seq  # the online softmax's log-sum-exp per query row
    elif layout.recompute == "none":  # Ulysses: n_head/cp heads over every position
        probabilities = rows * heads // cp * _causal_pairs(model.seq_len)
    if not moe:
        mlp = 5 * tokens * model.ffn_width / tp
    else:
        routed, k = _moe_tokens(layout, tokens), model.top_k
        router = model.experts * (1 + 8 / item) + 1 + k * (1 + 8 / item)
        mlp = routed * (router + k * (2 * model.n_embd + 5 * config.moe_ffn_hidden)
                        + 5 * config.n_shared_experts * config.moe_ffn_hidden)
    return norms + 2 * activation + attention + mlp + probabilities


def ep_exchange(setting: _Setting, nbytes: float) -> tuple[float, float, float]:
    """Seconds, bytes sent and bytes sent across nodes of one dispatch (or combine) of `nbytes` of routed tokens
    (one copy each) over ep: K copies per token. Inside a node the all-to-all's α-β price; across nodes the copies
    of `deepseek.dispatch_copies` (flat, or node-limited two-hop), the network's and NVLink's shares running at
    once (each α per peer)."""
    layout, cluster, model = setting.layout, setting.cluster, setting.model
    link, nodes = axis_link(layout, "ep", cluster), axis_nodes(layout, "ep", cluster)
    per_node = layout.ep // nodes
    topk_group = model.config.topk_group if model.is_deepseek else model.top_k
    inter, intra = deepseek.dispatch_copies(model.top_k, topk_group, nodes, per_node, layout.ep_dispatch)
    if nodes == 1:
        volume = model.top_k * nbytes
        return (collective_seconds("all_to_all", volume, layout.ep, link),
                collective_bytes_sent("all_to_all", volume, layout.ep), 0.0)
    across = link.across()
    inter_peers = nodes - 1 if layout.ep_dispatch == "hierarchical" else layout.ep - per_node
    seconds = max(inter_peers * across.alpha + inter * nbytes * across.beta,
                  (per_node - 1) * link.alpha + intra * nbytes * link.beta)
    return seconds, (inter + intra) * nbytes, inter * nbytes


def _moe_tokens(layout: Layout, tokens: int) -> float:
    """Tokens the router and experts of one rank see: all of them on every TP rank (experts are replicated over
    TP), this rank's sequence slice under SP."""
    return tokens / (layout.tp if layout.sp else 1)


def _mlp_work(model: Model, layout: Layout, tokens: int) -> tuple[float, float]:
    """Forward matmul FLOPs and elementwise elements of the MLP: GPT-2's c_fc and c_proj (2·2·h·4h per token)
    and GELU (~7 passes over 4h), llama's gate, up and down (2·3·h·F) and SwiGLU (~6 passes over F); split over
    tp, or K experts per token plus the router's 2·h·E."""
    h, width = model.n_embd, model.ffn_width
    matrices, passes = (3, 6) if model.is_llama else (2, 7)
    if model.experts:
        routed = _moe_tokens(layout, tokens)
        hidden = routed * width * model.top_k
        return 2 * matrices * h * hidden + 2 * routed * h * model.experts, passes * hidden
    hidden = tokens * width / layout.tp
    return 2 * matrices * h * hidden, passes * hidden


def block_saved_elements(model: Model, layout: Layout, rows: int, item: float) -> float:
    """Elements one block saves per microbatch on one rank: the runtime's `block_activation_elements` (either
    family), with the MoE block's and context-parallel attention's differences; `item` bytes per element (the
    int64 index arrays count 8/item)."""
    h, tp, cp = model.n_embd, layout.tp, layout.cp
    seq = model.seq_len // cp
    tokens = rows * seq
    recompute = "selective" if cp > 1 and layout.recompute == "none" else layout.recompute  # CP's: below
    family = {"kv_heads": model.kv_heads, "ffn_hidden": model.ffn_width} if model.is_llama else {}
    saved = float(block_activation_elements(rows, seq, h, model.n_head, tp, layout.sp, recompute, **family))
    if layout.recompute == "full":
        return saved
    if model.experts:
        saved += _moe_saved_change(model, layout, tokens, item)
    heads = model.n_head // tp
    if cp > 1 and layout.cp_attention != "ulysses":  # the online softmax keeps one log-sum-exp per query row
        saved += rows * heads * seq
    elif cp > 1 and layout.recompute == "none":  # Ulysses: the serial attention of n_head/cp heads, all s positions
        saved += rows * heads // cp * _causal_pairs(model.seq_len)
    return saved


def _moe_saved_change(model: Model, layout: Layout, tokens: int, item: float) -> float:
    """What an MoE block saves instead of the dense MLP's hidden units (GPT-2 16h per token: c_fc's output and
    GELU's three arrays of 4h; llama 5F): per routed token the router's probabilities (E), its top-K choice
    (an argsort of E int64), 1/Σ of the chosen probabilities, the K gates and K int64 assignments; then the K
    rows gathered for the experts, their K outputs, and the experts' hidden units (balanced: K·tokens rows)."""
    h, experts, k = model.n_embd, model.experts, model.top_k
    hidden = 5 * model.ffn_width if model.is_llama else 16 * h
    router = experts + experts * 8 / item + 1 + k + k * 8 / item
    return _moe_tokens(layout, tokens) * (router + k * (2 * h + hidden)) - tokens * hidden / layout.tp


def block_collectives(model: Model, layout: Layout, tokens: int, item: float, moe: bool | None = None,
                      dispatch: float | None = None) -> tuple[tuple[Collective, ...], tuple[Collective, ...]]:
    """(forward, backward) collectives of one block and microbatch, as `mpiparallel.traffic` counts them:
    tp two exchanges each way (one with MoE: the experts are replicated over TP), cp the K/V of the chosen
    attention, ep the dispatch and combine; backward also the KV weight gradients' all-reduces over the tp/n_kv
    ranks that hold each KV head (llama, tp > n_kv), and with --recompute full the forward's again."""
    moe = bool(model.experts) if moe is None else moe
    s = tokens * model.n_embd * item
    exchanges = tp_exchanges(s, layout, 1 if moe else 2)
    cp_forward, cp_backward = context_parallel_collectives(model, layout, tokens, item)
    forward, backward = exchanges + cp_forward, exchanges + cp_backward
    if moe and layout.ep > 1:  # dispatch and combine of every routed token (`ep_exchange`: its K copies)
        routed = _moe_tokens(layout, tokens) * model.n_embd
        moved = (Collective("dispatch", routed * (dispatch or item), "ep"), Collective("combine", routed * item, "ep"))
        forward, backward = forward + moved, backward + moved
    copies = key_value_replicas(model.kv_heads, layout.tp) if model.is_llama else 1
    if copies > 1:
        backward += (Collective("all_reduce", model.n_embd * model.head_dim * item, "tp", copies),) * 2
    if layout.recompute == "full":
        backward = forward + backward
    return forward, backward


def context_parallel_collectives(model: Model, layout: Layout, tokens: int,
                                 item: float) -> tuple[tuple[Collective, ...], tuple[Collective, ...]]:
    """(forward, backward) of the CP attention over c ranks, with h_kv = n_kv'·d this TP rank's KV channels and
    t = b·s/c this rank's tokens: ring passes 2(c−1)·t·h_kv forward and 2(2c−1)·t·h_kv backward (K/V again,
    with dK/dV); all-gather gathers K and V of the sequence (2·c·t·h_kv) forward, again backward and
    reduce-scatters their gradients; Ulysses all-to-alls q, k, v (t·(h/tp + 2·max(n_kv', c)·d)) and the
    output (t·h/tp) each way."""
    c = layout.cp
    if c == 1:
        return (), ()
    if model.is_deepseek:
        return _latent_context_collectives(model, layout, tokens, item)
    heads, kv_heads, d = model.n_head // layout.tp, local_kv_heads(model, layout.tp), model.head_dim
    kv = tokens * kv_heads * d * item
    if layout.cp_attention == "ring":
        return ((Collective("ring_pass", 2 * (c - 1) * kv, "cp"),),
                (Collective("ring_pass", 2 * (2 * c - 1) * kv, "cp"),))
    if layout.cp_attention == "all-gather":
        gathered = 2 * c * kv
        return ((Collective("all_gather", gathered, "cp"),),
                (Collective("all_gather", gathered, "cp"), Collective("reduce_scatter", gathered, "cp")))
    into_heads = Collective("all_to_all", tokens * (heads + 2 * max(kv_heads, c)) * d * item, "cp")
    into_sequence = Collective("all_to_all", tokens * heads * d * item, "cp")
    return (into_heads, into_sequence), (into_sequence, into_heads)


def _latent_context_collectives(model: Model, layout: Layout, tokens: int,
                                item: float) -> tuple[tuple[Collective, ...], tuple[Collective, ...]]:
    """MLA's CP moves the compressed [latent | RoPE key] rows, r + d_r per token (`mpiparallel.traffic`): ring
    passes them forward and them and their gradients backward; all-gather gathers them and reduce-scatters their
    gradients; Ulysses does that too and all-to-alls the queries (d_qk per head) and outputs (d_v per head)."""
    c, config = layout.cp, model.config
    latent = tokens * (config.kv_lora_rank + config.qk_rope_head_dim) * item
    if layout.cp_attention == "ring":
        return ((Collective("ring_pass", (c - 1) * latent, "cp"),),
                (Collective("ring_pass", (2 * c - 1) * latent, "cp"),))
    gathered = (Collective("all_gather", c * latent, "cp"),)
    scattered = (Collective("reduce_scatter", c * latent, "cp"),)
    if layout.cp_attention == "all-gather":
        return gathered, gathered + scattered
    heads = model.n_head // layout.tp
    queries = Collective("all_to_all", tokens * heads * model.query_key_dim * item, "cp")
    outputs = Collective("all_to_all", tokens * heads * model.value_dim * item, "cp")
    return gathered + (queries, outputs), gathered + scattered + (outputs, queries)


# -- time of a collective on an axis ------------------------------------------------------------------------

def axis_stride(layout: Layout, axis: str) -> int:
    """Rank distance between neighbours of `axis` (innermost first: tp, cp, dp, pp; ep inside dp)."""
    return {"tp": 1, "cp": layout.tp, "dp": layout.tp * layout.cp, "ep": layout.tp * layout.cp,
            "pp": layout.tp * layout.cp * layout.dp}[axis]


def axis_size(layout: Layout, axis: str) -> int:
    return getattr(layout, axis)


def axis_link(layout: Layout, axis: str, cluster: Cluster) -> CostModel:
    """NVLink-like inside a node; once the group spans nodes, the two-tier model (inside and across) that the
    collectives' cost model prices flat and hierarchical algorithms with."""
    return group_link(axis_stride(layout, axis), axis_size(layout, axis), cluster)


def group_link(stride: int, ranks: int, cluster: Cluster) -> CostModel:
    if stride * ranks <= cluster.gpus_per_node:
        return cluster.intra
    return replace(cluster.intra, alpha_inter=cluster.inter.alpha, beta_inter=cluster.inter.beta)


def group_nodes(stride: int, ranks: int, cluster: Cluster) -> int:
    """Nodes a group of `ranks` ranks `stride` apart spans (nodes of gpus_per_node consecutive ranks)."""
    per_node = max(1, min(ranks, cluster.gpus_per_node // stride))
    return math.ceil(ranks / per_node)


def axis_nodes(layout: Layout, axis: str, cluster: Cluster) -> int:
    return group_nodes(axis_stride(layout, axis), axis_size(layout, axis), cluster)


def collective_seconds(name: str, nbytes: float, ranks: int, link: CostModel, nodes: int = 1) -> float:
    """The cheapest algorithm's predicted time, as algo="auto" would choose it (`collectives.cost_model`, with
    hierarchical algorithms where the group spans `nodes` > 1); a ring pass of K/V is ranks − 1 point-to-point
    messages of nbytes/(ranks − 1)."""
    if ranks <= 1 or nbytes <= 0:
        return 0.0
    if name in ("ring_pass", "send"):
        steps = ranks - 1 if name == "ring_pass" else 1
        crossing = link.across() if nodes > 1 else link
        return steps * (crossing.alpha + nbytes / steps * crossing.beta)
    algo = choose(link, name, int(nbytes), ranks, nodes)
    return predict(link, name, algo, int(nbytes), ranks, nodes)


def collective_bytes_sent(name: str, nbytes: float, ranks: int) -> float:
    """Bytes one rank sends (bandwidth-optimal algorithms)."""
    if ranks <= 1:
        return 0.0
    fraction = (ranks - 1) / ranks
    return {"all_reduce": 2 * fraction, "reduce_scatter": fraction, "all_gather": fraction,
            "all_to_all": fraction, "ring_pass": 1.0, "send": 1.0}[name] * nbytes


# -- the pipeline: bubble and peak activations from the simulator -----------------------------------------

@dataclass(frozen=True)
class PipelineShape:
    bubble: float
    makespan_units: float
    peak_per_stage: tuple[int, ...]
    rank_stage_counts: tuple[tuple[tuple[int, ...], ...], ...]
    """Per rank: every distinct state (microbatches held on each of its stages), to weigh by bytes per stage."""
    stage_ranks: tuple[int, ...]
    simulated: bool


@lru_cache(maxsize=4096)
def pipeline_shape(schedule: str, pp: int, microbatches: int, virtual_stages: int = 2) -> PipelineShape:
    """Bubble and activations held of `schedule` with F = I = W = 1 (cached; `virtual_stages`: interleaved's v).
    The activations come from the action lists alone (list order is time order on a rank); the bubble from the
    simulator, or for schedules of more than SIMULATED_ACTIONS compute actions from the schedule's formula."""
    chunks = 2 if schedule in V_SHAPED else virtual_stages if schedule == "interleaved" else 1
    built = build_schedule(schedule, pp, microbatches, chunks if schedule == "interleaved" else 1)
    simulated = pp * microbatches * chunks <= SIMULATED_ACTIONS or microbatches < 2 * pp
    if simulated:
        makespan = simulate(built).makespan
        bubble = 1 - 3 * microbatches * chunks / makespan
    else:
        bubble = bubble_formula(schedule, pp, microbatches, chunks if schedule == "interleaved" else 1)
        makespan = 3 * microbatches * chunks / (1 - bubble)
    states = tuple(_held_states(built, rank) for rank in range(pp))
    return PipelineShape(bubble, makespan, peak_activations(built)[0], states, built.stage_ranks, simulated)


def _held_states(built: Any, rank: int) -> tuple[tuple[int, ...], ...]:
    """Every distinct count of microbatches held on each of `rank`'s stages (in `stages_of` order), after each
    of its actions: list order is time order on a rank."""
    stages = built.stages_of(rank)
    held = dict.fromkeys(stages, 0)
    states = {tuple(held.values())}
    for action in built.actions[rank]:
        change = {FORWARD: 1, BACKWARD_WEIGHT: -1, FULL_BACKWARD: -1}.get(action.kind, 0)
        if change:
            held[action.stage] += change
            states.add(tuple(held.values()))
    return tuple(sorted(states))


def min_microbatches(schedule: str, pp: int, max_bubble: float) -> int:
    """The fewest microbatches whose simulated bubble (F = I = W = 1) is below `max_bubble`, exactly: the
    makespan is an integer, so the comparison is made in fractions. The schedule's formula (cheap) gives the
    starting count, the simulator the answer. Interleaved (v = 2) needs multiples of pp."""
    target = Fraction(max_bubble).limit_denominator(10**9)
    step = pp if schedule == "interleaved" else 1
    first = pp if schedule == "zb" else step
    virtual = 2 if schedule == "interleaved" else 1

    def below(m: int) -> bool:
        return _exact_bubble(schedule, pp, m) < target

    high = first
    while bubble_formula(schedule, pp, high, virtual) >= max_bubble:
        high *= 2
    low = max(first, high // 2)
    while high - low > step:  # bisect the formula: its bubble falls as m grows
        middle = max(low + step, (low + high) // 2 // step * step)
        low, high = (low, middle) if bubble_formula(schedule, pp, middle, virtual) < max_bubble else (middle, high)
    count = high if bubble_formula(schedule, pp, low, virtual) >= max_bubble else low
    while not below(count):  # the formula is only a lower bound for a few microbatches (ZB-V below 2p − 1)
        count += step
    while count - step >= first and below(count - step):
        count -= step
    return count


@lru_cache(maxsize=1024)
def _exact_bubble(schedule: str, pp: int, microbatches: int) -> Fraction:
    chunks = 2 if schedule in V_SHAPED or schedule == "interleaved" else 1
    simulation = simulate(build_schedule(schedule, pp, microbatches, chunks if schedule == "interleaved" else 1))
    return 1 - Fraction(3 * microbatches * chunks) / Fraction(simulation.makespan)


# -- one layout -----------------------------------------------------------------------------------------------

BUCKET_BYTES = 25 * 2**20
"""train's default --bucket-mb: the data-parallel engine reduces gradients in buckets of this size."""


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


@dataclass(frozen=True)
class _Setting:
    """Everything `evaluate` derives once per layout."""

    model: Model
    cluster: Cluster
    precision: Precision
    layout: Layout
    costs: list[UnitCost]
    stages: list[range]
    stage_ranks: tuple[int, ...]
    shape: PipelineShape | None
    rows: int
    """Sequences per microbatch on one rank."""
    kinds: tuple[int, ...]
    """Per unit, its cost's index in `costs` (`unit_kinds`)."""
    experts: tuple[float, ...] = ()
    """Per unit, the routed experts' parameters this rank holds (`expert_unit_parameters`)."""

    def held_experts(self, rank: int) -> float:
        return sum(self.experts[u] for u in self.units_of(rank)) if self.experts else 0.0

    def zero_shards(self, expert: bool) -> int:
        """Ranks one parameter's ZeRO state is sharded over: dp, or the dp/ep holding a routed expert."""
        return self.layout.dp // self.layout.ep if expert else self.layout.dp

    def cost_of(self, unit: int) -> UnitCost:
        return self.costs[self.kinds[unit]]

    def kind_counts(self, units: list[int] | range) -> list[int]:
        """How many units of each cost (embedding, each kind of block, head) are among `units`."""
        counts = [0] * len(self.costs)
        for unit in units:
            counts[self.kinds[unit]] += 1
        return counts

    def stages_of(self, rank: int) -> list[int]:
        return [s for s, owner in enumerate(self.stage_ranks) if owner == rank]

    def units_of(self, rank: int) -> list[int]:
        return sorted(u for s in self.stages_of(rank) for u in self.stages[s])


def evaluate(model: Model, cluster: Cluster, precision: Precision, layout: Layout, batch_size: int,
             weights_only: bool = False) -> Plan:
    """Memory, time and communication of one layout (a valid one: see `candidate_layouts`)."""
    rows = batch_size // (layout.dp * layout.microbatches)
    shape = pipeline_shape(layout.schedule, layout.pp, layout.microbatches, layout.virtual_stages) \
        if layout.pp > 1 else None
    costs = unit_costs(model, layout, rows, precision, cluster.software)
    per_unit, tied, experts = scaled_unit_parameters(model, layout)
    setting = _Setting(model, cluster, precision, layout, costs,
                       stage_units(model.n_layer, layout.pp * layout.chunks), shape.stage_ranks if shape else (0,),
                       shape, rows, unit_kinds(model), tuple(experts))
    stage_saved = [0.0 if weights_only else sum(setting.cost_of(u).saved for u in units) * precision.activations
                   for units in setting.stages]
    peaks = shape.peak_per_stage if shape else (1,)
    memory_per_stage = [{"stage": s, "pp_rank": setting.stage_ranks[s], "units": [units.start, units.stop],
                         "parameters": sum(per_unit[u] for u in units),
                         "activations_per_microbatch": stage_saved[s], "peak_microbatches": peaks[s],
                         "activations": peaks[s] * stage_saved[s]} for s, units in enumerate(setting.stages)]
    memory_per_rank = [_rank_memory(setting, rank, per_unit, tied, stage_saved) for rank in range(layout.pp)]
    plan = _timed_plan(setting, per_unit, tied, memory_per_rank, memory_per_stage)
    plan.fits = plan.max_memory <= cluster.gpu_memory
    _report_throughput(plan, model, cluster, precision, batch_size)
    if layout.cp > 1 or model.experts and (layout.tp > 1 or layout.ep > 1):
        plan.notes.append("activations and ep traffic approximate (balanced routing; CP attention's buffers "
                          "not measured)")
    if shape and not shape.simulated:
        plan.notes.append(f"bubble from the schedule's formula (more than {SIMULATED_ACTIONS} actions to simulate)")
    return plan


def flops_per_token(model: Model) -> float:
    """MFU's count for this model (`gpus.model_flops_per_token`): N the active weights less the input lookups
    (GPT-2's position table; the token table unless it is tied to the head, whose product it then is);
    DeepSeek-V3's: `deepseek.activated_flops_per_token` (its MTP modules and d_qk ≠ d_v counted)."""
    if model.is_deepseek and model.parameters is None:
        return deepseek.activated_flops_per_token(model.config, model.seq_len, model.active_parameters())
    h = model.n_embd
    lookups = (0 if model.is_llama else model.n_positions * h) + (0 if model.tied else model.vocab_size * h)
    return model_flops_per_token(model.active_parameters() - lookups, model.n_layer, h, model.seq_len)


def training_mfu(config: GPTConfig, seq_len: int, tokens_per_s_per_rank: float, device_name: str,
                 dtype: str = "bfloat16") -> float | None:
    """The MFU `train` logs (the same count as `plan`'s): 6·N + 12·l·h·s FLOPs per token × the tokens one rank
    trains per second, over the dense peak of its device (`gpus.peak_flops`; CUDA names such as 'NVIDIA H100
    80GB HBM3'). None where the device has no preset or no tensor cores for `dtype` (a CPU, a float64 run)."""
    try:
        peak = peak_flops(device_name, dtype)
    except ValueError:
        return None
    return flops_per_token(Model.from_config(config, seq_len)) * tokens_per_s_per_rank / peak


def megatron_flops(model: Model, batch_size: int) -> float:
    """Megatron's count of one step of `batch_size` sequences (`gpus.megatron_flops_per_step`)."""
    return megatron_flops_per_step(batch_size, model.seq_len, model.n_layer, model.n_embd, model.vocab_size)


def peak_of(cluster: Cluster, precision: Precision) -> float | None:
    """The dense tensor-core peak MFU divides by: a preset's bf16 (2-byte activations) or TF32 (4-byte) rate,
    else `cluster.peak_flops`."""
    if cluster.gpu is None:
        return cluster.peak_flops
    return {2: cluster.gpu.bf16_flops, 4: cluster.gpu.tf32_flops}.get(int(precision.activations))


def _report_throughput(plan: Plan, model: Model, cluster: Cluster, precision: Precision, batch_size: int) -> None:
    tokens = batch_size * model.seq_len
    plan.tokens_per_s = tokens / plan.step_s
    plan.megatron_tflops = megatron_flops(model, batch_size) / plan.step_s / cluster.gpus / 1e12
    plan.model_tflops = flops_per_token(model) * plan.tokens_per_s / cluster.gpus / 1e12
    peak = peak_of(cluster, precision)
    plan.mfu = plan.model_tflops * 1e12 / peak if peak else None


def _rank_memory(setting: _Setting, rank: int, per_unit: list[float], tied: float,
                 stage_saved: list[float]) -> dict[str, float]:
    layout, precision = setting.layout, setting.precision
    experts = setting.held_experts(rank)
    dense = held_parameters(setting.units_of(rank), per_unit, tied) - experts

    def sharded(per_parameter: float, stage: int) -> float:  # ZeRO stage `stage` and up shard these bytes
        if layout.zero < stage:
            return (dense + experts) * per_parameter
        return per_parameter * (dense / setting.zero_shards(False) + experts / setting.zero_shards(True))

    weights, gradients = sharded(precision.weights, 3), sharded(precision.gradients, 2)
    optimizer = sharded(precision.optimizer, 1)
    if setting.shape is None:
        activations = stage_saved[0]  # microbatches one after another: one in flight
    else:
        stages = setting.stages_of(rank)
        activations = max(sum(n * stage_saved[s] for s, n in zip(stages, state, strict=True))
                          for state in setting.shape.rank_stage_counts[rank])
    return {"pp_rank": rank, "parameters": weights, "gradients": gradients, "optimizer_state": optimizer,
            "activations": activations, "total": weights + gradients + optimizer + activations}


def _compute_seconds(setting: _Setting, cost: UnitCost, backward: bool) -> float:
    """The matrix products (at `matmul_flops`, or by shape on a GPU preset) and the elementwise passes."""
    cluster, item, fp8 = setting.cluster, setting.precision.activations, setting.precision.fp8_gemms
    elements = cost.elementwise_backward if backward else cost.elementwise_forward
    memory = elements * item / cluster.elementwise_bytes
    if cluster.gpu is None:
        return (cost.flops_backward if backward else cost.flops_forward) / cluster.matmul_flops + memory
    if not backward:
        return sum(g.seconds(cluster.gpu, item, fp8) for g in cost.gemms_forward) + memory
    return sum(g.backward_seconds(cluster.gpu, item, fp8) for g in cost.gemms_forward) + \
        sum(g.seconds(cluster.gpu, item, fp8) for g in cost.gemms_recomputed) + memory


def _blocking(setting: _Setting, cost: UnitCost) -> tuple[dict[str, float], dict[str, float], float]:
    """Per axis, seconds and bytes sent of the collectives one microbatch of a unit waits for, and the EP bytes
    that cross nodes."""
    layout = setting.layout
    seconds, bytes_sent, ep_across = dict.fromkeys(AXES, 0.0), dict.fromkeys(AXES, 0.0), 0.0
    for name, nbytes, axis, group in cost.collectives_forward + cost.collectives_backward:
        if name in ("dispatch", "combine"):
            time, sent, across = ep_exchange(setting, nbytes)
            seconds[axis], bytes_sent[axis], ep_across = seconds[axis] + time, bytes_sent[axis] + sent, \
                ep_across + across
            continue
        ranks = group or axis_size(layout, axis)
        seconds[axis] += collective_seconds(name, nbytes, ranks, axis_link(layout, axis, setting.cluster),
                                            axis_nodes(layout, axis, setting.cluster))
        bytes_sent[axis] += collective_bytes_sent(name, nbytes, ranks)
    return seconds, bytes_sent, ep_across


def _timed_plan(setting: _Setting, per_unit: list[float], tied: float, memory_per_rank: list[dict[str, float]],
                memory_per_stage: list[dict[str, Any]]) -> Plan:
    layout, m = setting.layout, setting.layout.microbatches
    compute_of = [_compute_seconds(setting, c, False) + _compute_seconds(setting, c, True) for c in setting.costs]
    blocking_of = [_blocking(setting, c) for c in setting.costs]

    def weighted(units: list[int] | range, values: list[float]) -> float:
        return sum(n * v for n, v in zip(setting.kind_counts(units), values, strict=True))

    overlapped = setting.cluster.software.chunk_overlap
    waits_of = [_waited(seconds, compute, overlapped) for (seconds, _, _), compute in zip(blocking_of, compute_of,
                                                                                            strict=True)]
    chunk_seconds = [weighted(units, compute_of) + weighted(units, waits_of) for units in setting.stages]
    per_rank = []  # (compute, comm seconds per axis, bytes per axis, waited) of each pipeline rank's step
    for rank in range(layout.pp):
        units = setting.units_of(rank)
        seconds = {axis: m * weighted(units, [b[0][axis] for b in blocking_of]) for axis in AXES}
        sent = {axis: m * weighted(units, [b[1][axis] for b in blocking_of]) for axis in AXES}
        per_rank.append((m * weighted(units, compute_of), seconds, sent, m * weighted(units, waits_of)))
    busiest = max(range(layout.pp), key=lambda rank: per_rank[rank][0] + per_rank[rank][3])
    compute, comm_s, comm_bytes, exposed = per_rank[busiest]
    ep_across = m * weighted(setting.units_of(busiest), [b[2] for b in blocking_of])
    if setting.shape is None:
        pipeline, bubble = m * chunk_seconds[0], 0.0
    else:
        message, boundary = _stage_boundary(setting)
        sends = 2 * m * layout.chunks
        comm_s["pp"], comm_bytes["pp"] = sends * boundary, sends * message
        tied_bytes = _tied_gradient_bytes(setting, busiest, tied)
        comm_s["pp"] += collective_seconds("send", tied_bytes, 2, axis_link(layout, "pp", setting.cluster))
        comm_bytes["pp"] += tied_bytes
        fill_and_drain = 2 * (layout.pp * layout.chunks - 1) * boundary  # each boundary once each way, waited for
        if setting.cluster.software.blocking_pipeline_sends:  # the steady state's sends wait too
            fill_and_drain = max(fill_and_drain, comm_s["pp"])
        if overlapped:  # sent beside the paired chunks' compute
            fill_and_drain = 0.0
        pipeline = _pipeline_seconds(setting, chunk_seconds) + fill_and_drain
        bubble = setting.shape.bubble
        exposed += fill_and_drain
    count = held_parameters(setting.units_of(busiest), per_unit, tied)
    experts = setting.held_experts(busiest)
    dp_seconds, dp_bytes, last_bucket = _data_parallel(setting, count - experts, experts)
    comm_s["dp"], comm_bytes["dp"] = dp_seconds, dp_bytes
    overlap = setting.cluster.software.dp_overlap
    if overlap == "always" or overlap == "without-pipeline" and setting.shape is None:
        backward = weighted(setting.units_of(busiest), [_compute_seconds(setting, c, True) for c in setting.costs])
        dp_exposed = max(last_bucket, dp_seconds - backward)  # overlapped with the last microbatch's backward
    else:  # reduced after the backward (or after the pipeline's schedule)
        dp_exposed = dp_seconds
    exposed += dp_exposed
    step = pipeline + dp_exposed + _optimizer_seconds(setting, count - experts, experts)
    return Plan(layout, memory_per_rank, memory_per_stage, compute, comm_s, comm_bytes, exposed, bubble, step,
                ep_inter_node_bytes=ep_across)


def _pipeline_seconds(setting: _Setting, chunk_seconds: list[float]) -> float:
    """The schedule's time: its steady state as long as the busiest rank's chunks (m times their F + B: every
    microbatch passes each of that rank's stages), its fill and drain — the simulated bubble, in chunk times —
    as long as the average chunk (they pass every stage once). Equal chunks give makespan/3 × one chunk."""
    layout, shape = setting.layout, setting.shape
    busiest = max(sum(chunk_seconds[s] for s in setting.stages_of(rank)) for rank in range(layout.pp))
    idle_chunks = shape.makespan_units / 3 - layout.microbatches * layout.chunks
    return layout.microbatches * busiest + idle_chunks * sum(chunk_seconds) / len(chunk_seconds)


def _waited(seconds: dict[str, float], compute: float, overlapped: bool) -> float:
    """What a unit's microbatch waits for its collectives: all of them, or with `Software.chunk_overlap` the EP
    all-to-alls only beyond the compute they run beside."""
    if not overlapped:
        return sum(seconds.values())
    return sum(value for axis, value in seconds.items() if axis != "ep") + max(0.0, seconds["ep"] - compute)


def _stage_boundary(setting: _Setting) -> tuple[float, float]:
    """Bytes one rank sends across a stage boundary per microbatch and direction, and the seconds it waits: the
    activation; with Megatron's scatter/gather (tp > 1, no SP) each TP rank sends 1/tp of it and the receivers
    all-gather it over the node's links."""
    layout, cluster = setting.layout, setting.cluster
    message = _stage_message_bytes(setting)
    scatter_gather = cluster.software.pipeline_scatter_gather and layout.tp > 1 and not layout.sp
    sent = message / layout.tp if scatter_gather else message
    seconds = collective_seconds("send", sent, 2, axis_link(layout, "pp", cluster), axis_nodes(layout, "pp", cluster))
    if scatter_gather:
        seconds += collective_seconds("all_gather", message, layout.tp, axis_link(layout, "tp", cluster))
    return sent, seconds


def _stage_message_bytes(setting: _Setting) -> float:
    """One microbatch's activation handed from stage to stage (train's activation_shape)."""
    layout, model = setting.layout, setting.model
    positions = model.seq_len // layout.cp // (layout.tp if layout.sp else 1)
    return setting.rows * positions * model.n_embd * setting.precision.activations


def _tied_gradient_bytes(setting: _Setting, rank: int, tied: float) -> float:
    """The tied embedding's gradient, sent once per step between the first and the last stage's ranks when
    they differ (GPT-2 and tied llama; `mpiparallel.traffic.pipeline_bytes`)."""
    ends = (setting.stage_ranks[0], setting.stage_ranks[-1])
    if not tied or ends[0] == ends[1] or rank not in ends:
        return 0.0
    return tied * setting.precision.gradients


def _data_parallel(setting: _Setting, dense: float, experts: float = 0.0) -> tuple[float, float, float]:
    """Seconds, bytes sent and the last bucket's seconds of the gradient reductions: the dense parameters' over
    dp×cp, the routed experts' over the dp/ep×cp ranks holding the same experts (ep apart, train's expert_dp)."""
    layout = setting.layout
    seconds, sent, last_bucket = _reduction(setting, dense, layout.dp * layout.cp, layout.tp)
    if experts:
        more = _reduction(setting, experts, layout.dp // layout.ep * layout.cp, layout.tp * layout.cp * layout.ep)
        seconds, sent, last_bucket = seconds + more[0], sent + more[1], max(last_bucket, more[2])
    return seconds, sent, last_bucket


def _reduction(setting: _Setting, count: float, ranks: int, stride: int) -> tuple[float, float, float]:
    """One group's gradient reduction over `ranks` ranks `stride` apart (the ranks that hold the same
    parameters): all-reduce per bucket; ZeRO-1/2 reduce-scatter + all-gather of the updated parameters; ZeRO-3
    also all-gathers every parameter for forward and again for backward."""
    layout, precision = setting.layout, setting.precision
    if ranks == 1 or precision.gradients == 0 or count <= 0:
        return 0.0, 0.0, 0.0
    link, nodes = group_link(stride, ranks, setting.cluster), group_nodes(stride, ranks, setting.cluster)
    grad_bytes = count * precision.gradients
    buckets = max(1, math.ceil(grad_bytes / BUCKET_BYTES))
    bucket = grad_bytes / buckets
    gathers = 3 if layout.zero == 3 else 1
    calls = [("all_reduce", 1)] if layout.zero == 0 else [("reduce_scatter", 1), ("all_gather", gathers)]
    seconds = sent = last_bucket = 0.0
    for name, per_bucket in calls:  # every bucket the same size: one prediction each
        one = collective_seconds(name, bucket, ranks, link, nodes)
        seconds += buckets * per_bucket * one
        sent += buckets * per_bucket * collective_bytes_sent(name, bucket, ranks)
        last_bucket = one if last_bucket == 0 else last_bucket
    return seconds, sent, last_bucket


def _optimizer_seconds(setting: _Setting, dense: float, experts: float = 0.0) -> float:
    """AdamW's elementwise passes over this rank's parameters, its ZeRO shard of them (about 12: moments,
    square root, division, decay); SGD's 2; plus zeroing the gradients."""
    layout, precision = setting.layout, setting.precision
    passes = 12 if precision.optimizer else 2
    local = dense + experts
    if layout.zero >= 1:
        local = dense / setting.zero_shards(False) + experts / setting.zero_shards(True)
    return (passes + 1) * local * precision.weights / setting.cluster.elementwise_bytes


# -- the search -------------------------------------------------------------------------------------------------

def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def candidate_layouts(model: Model, cluster: Cluster, choices: Choices) -> Iterator[Layout]:
    """Every layout train would accept for this model on `cluster.gpus` ranks, with the fixed choices kept:
    tp inside a node dividing the heads and the MLP width, and dividing the KV heads or a multiple of them
    (`models.tensor_parallel.check_tensor_parallel_shape`), pp·chunks ≤ layers, 2·cp dividing the sequence
    (Ulysses: cp dividing the heads of a TP rank, and dividing their KV heads or a multiple of them), ep
    dividing dp and the experts, microbatches ≥ pp dividing the batch rows of a DP rank, ZeRO ≤ 1 with a
    pipeline."""
    def pick(name: str, values: list) -> list:
        fixed = getattr(choices, name)
        return [fixed] if fixed is not None else values

    for tp, pp, cp in itertools.product(pick("tp", divisors(cluster.gpus)), pick("pp", divisors(cluster.gpus)),
                                        pick("cp", divisors(cluster.gpus))):
        if cluster.gpus % (tp * pp * cp) or not _splits(model, tp) or model.seq_len % (2 * cp if cp > 1 else 1):
            continue
        if choices.tp is None and tp > cluster.gpus_per_node or pp > model.n_layer:
            continue
        dp = cluster.gpus // (tp * pp * cp)
        if choices.dp is not None and choices.dp != dp or choices.batch_size % dp:
            continue
        yield from _inner_choices(model, choices, dp, tp, pp, cp, pick, cluster.gpus_per_node)


def _splits(model: Model, tp: int) -> bool:
    """Whether tensor parallelism over tp ranks can split this model (heads, MLP width, KV heads)."""
    try:
        check_tensor_parallel_shape(model.config, tp)
    except ValueError:
        return False
    return True


def _cp_attentions(model: Model, tp: int, cp: int, fixed: str | None) -> list[str]:
    """The CP attentions this cp can run: ring and all-gather always, Ulysses when cp divides this TP rank's
    heads and its KV heads divide cp or cp them."""
    if cp == 1:
        return [fixed or "ring"]
    heads, kv_heads = model.n_head // tp, local_kv_heads(model, tp)
    ulysses = heads % cp == 0 and (kv_heads % cp == 0 or cp % kv_heads == 0)
    return [a for a in ([fixed] if fixed else CP_ATTENTIONS) if a != "ulysses" or ulysses]


def _dispatches(model: Model, tp: int, cp: int, ep: int, per_node: int, fixed: str | None) -> list[str]:
    """The EP dispatches this ep can run: flat always, hierarchical when the routing is node-limited over the
    nodes the EP group spans (`deepseek.node_limited`)."""
    nodes = math.ceil(ep / max(1, min(ep, per_node // (tp * cp))))
    hierarchical = model.is_deepseek and deepseek.node_limited(model.config, nodes)
    return [d for d in ([fixed] if fixed else deepseek.DISPATCHES) if d == "flat" or hierarchical]


def _inner_choices(model: Model, choices: Choices, dp: int, tp: int, pp: int, cp: int, pick: Any,
                   per_node: int = 8) -> Iterator[Layout]:
    eps = pick("ep", [e for e in divisors(dp) if model.experts and model.experts % e == 0] or [1])
    zeros = pick("zero", [0, 1] if pp > 1 else [0, 1, 2, 3])
    schedules = pick("schedule", list(SCHEDULES)) if pp > 1 else ["1f1b"]
    sps = pick("sp", [False, True]) if tp > 1 else [False]
    microbatch_counts = pick("microbatches", _microbatch_candidates(choices.batch_size // dp, pp))
    attentions = _cp_attentions(model, tp, cp, choices.cp_attention)
    for ep, zero, schedule, m, recompute, sp, attention in itertools.product(
            eps, zeros, schedules, microbatch_counts, pick("recompute", list(RECOMPUTE)), sps, attentions):
        if (choices.batch_size // dp) % m or ep > 1 and dp % ep:
            continue
        for virtual, dispatch in itertools.product(pick("virtual_stages", [2]) if schedule == "interleaved" else [2],
                                                   _dispatches(model, tp, cp, ep, per_node, choices.ep_dispatch)):
            layout = Layout(dp, tp, pp, cp, ep, zero, m, schedule, recompute, sp, attention, virtual, dispatch)
            if pp == 1 or _valid_schedule(layout, model.n_layer):
                yield layout


def _microbatch_candidates(rows: int, pp: int) -> list[int]:
    """Divisors of the rows from pp up: the first three (more microbatches shrink the bubble and the activations
    but cost a message and a kernel launch each) and the largest."""
    counts = [d for d in divisors(rows) if d >= pp]
    return sorted(set(counts[:3] + counts[-1:]))


def _valid_schedule(layout: Layout, n_layer: int) -> bool:
    try:
        check_arguments(layout.schedule, layout.pp, layout.microbatches,
                        layout.virtual_stages if layout.schedule == "interleaved" else 1)
    except ValueError:
        return False
    return layout.pp * layout.chunks <= n_layer


def plan(model: Model, cluster: Cluster, precision: Precision, choices: Choices,
         weights_only: bool = False) -> tuple[list[Plan], int]:
    """The layouts that fit, fastest first, and how many were considered."""
    considered, fitting = 0, []
    for layout in candidate_layouts(model, cluster, choices):
        considered += 1
        result = evaluate(model, cluster, precision, layout, choices.batch_size, weights_only)
        if result.fits:
            fitting.append(result)
    fitting.sort(key=lambda p: (p.step_s, p.max_memory))
    return fitting, considered


def min_model_parallel(model: Model, precision: Precision, gpu_memory: float) -> int:
    """The fewest GPUs that must share the model states (all of them, or the weights only): ⌈N·bytes / memory⌉,
    in integers so that an exact fit is not rounded up."""
    need = Fraction(model.total_parameters()) * Fraction(precision.per_parameter).limit_denominator(10**6)
    return max(1, math.ceil(need / Fraction(gpu_memory).limit_denominator(10**6)))


def data_parallel_degree(gpus: int, choices: Choices) -> int | None:
    """The DP degree the fixed model-parallel degrees leave (the others at 1): gpus / (tp·pp·cp)."""
    model_parallel = (choices.tp or 1) * (choices.pp or 1) * (choices.cp or 1)
    if choices.dp is not None:
        return choices.dp
    return gpus // model_parallel if gpus % model_parallel == 0 else None


# -- a machine measured by `plan --calibrate` --------------------------------------------------------------------

def load_machine(path: Path, ranks_per_node: int, gpu_memory: float) -> Cluster:
    """A cluster of `ranks_per_node` ranks on one machine from `plan --calibrate`'s file. Its rates were measured
    per rank with every core busy (one rank per core); fewer ranks than cores give each rank more BLAS threads
    (matmul rate × cores / ranks), more ranks share the cores (both rates × cores / ranks); both are scaled by the
    compute efficiency measured on a real serial training step."""
    measured = json.loads(Path(path).read_text())
    cores = measured["cores"]
    share = cores / ranks_per_node
    efficiency = measured.get("compute_efficiency", 1.0)  # the share of the raw rates a real step reaches
    link = CostModel(measured["alpha"], measured["beta"], measured["gamma"])
    across = CostModel(measured.get("alpha_inter") or link.alpha, measured.get("beta_inter") or link.beta, link.gamma)
    return Cluster(gpus=ranks_per_node, gpu_memory=gpu_memory, gpus_per_node=ranks_per_node, intra=link,
                   inter=across, matmul_flops=measured["matmul_flops"] * share * efficiency,
                   elementwise_bytes=measured["elementwise_bytes"] * min(1.0, share) * efficiency)
