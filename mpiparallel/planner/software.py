"""How a code base runs a layout (`plan --software`): this project, Megatron-LM as Narayanan et al. 2021 ran it, a
FlashAttention + FSDP code base as Llama 3 describes it, and DeepSeek's HAI-LLM as the DeepSeek-V3 report describes
it. One setting per code base, never per run, each taken from its paper's text.

What each setting changes in the prediction (the formulas sit where they are used):

- attention: the (query, key) pairs one sequence computes on a CP rank — "blocked" Σ over query blocks of rows ·
  keys seen, "dense" s², "flash" s²/2 (`shapes.attention_pairs`) — and whether the probabilities, b·H/tp·pairs
  elements, go through memory (not with "flash");
- pipeline_scatter_gather: a stage boundary sends b·s·h/tp per TP rank, then an all-gather of b·s·h over NVLink
  (`pipeline.stage_boundary`);
- attention_dropout: 2 + 1/item more passes over the probabilities each way (`costs.block_cost`);
- blocking_pipeline_sends: the pipeline's exposed sends are max(fill and drain, all its sends) (`step_time`);
- dp_overlap: the exposed gradient reduction is max(last bucket, dp − backward) where it overlaps, dp otherwise;
- chunk_overlap: the EP all-to-alls wait max(0, ep − compute beside them), the pipeline's sends nothing;
- communication_sms: the matrix products run on (SMs − c)/SMs of the chip's MAMF (`cluster.Cluster.from_preset`);
- recompute_latent: MLA's norms and up-projections recomputed in backward (`deepseek_block`);
- sp_keeps_gathered_inputs, swiglu_saved: what a block saves (`costs.block_saved_elements`): with SP the
  all-gathered inputs of the attention and MLP projections (2·b·s·h) or only their sequence shards, and SwiGLU's
  5·F per token (this project) or 3·F (a fused kernel's [gate | up] input and the product).
"""

from __future__ import annotations

from dataclasses import dataclass

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
      back-propagation");
    - sp_keeps_gathered_inputs: with sequence parallelism the block keeps the all-gathered inputs of its column-
      parallel projections, b·s·h each for attention and MLP (this project's layers), or only the sequence shards
      it already keeps and all-gathers them again in backward (Korthikanti et al. 2022 §4.2.2, the sequence
      parallelism Llama 3 §3.3.2 uses);
    - swiglu_saved: elements per token and F/tp that SwiGLU keeps for backward: 5 (this project: [gate | up],
      σ(gate), silu(gate) and the product) or 3 (a fused kernel: its [gate | up] input and the product, the
      down-projection's input; Megatron-Core's fused bias-SwiGLU) or 2 (DeepSeek-V3 §3.3.3: "we cache the inputs
      of the SwiGLU operator and recompute its output in the backward pass")."""

    name: str = "mpiparallel"
    attention: str = "blocked"
    pipeline_scatter_gather: bool = False
    dp_overlap: str = "without-pipeline"
    attention_dropout: bool = False
    blocking_pipeline_sends: bool = False
    chunk_overlap: bool = False
    communication_sms: int = 0
    recompute_latent: bool = False
    sp_keeps_gathered_inputs: bool = True
    swiglu_saved: int = 5


SOFTWARE = {
    "mpiparallel": Software(),
    "megatron-2021": Software("megatron-2021", attention="dense", pipeline_scatter_gather=True, dp_overlap="never",
                              attention_dropout=True, blocking_pipeline_sends=True),
    "flash-fsdp": Software("flash-fsdp", attention="flash", pipeline_scatter_gather=False, dp_overlap="always",
                           sp_keeps_gathered_inputs=False, swiglu_saved=3),
    "hai-llm": Software("hai-llm", attention="flash", dp_overlap="never", chunk_overlap=True, communication_sms=20,
                        recompute_latent=True, swiglu_saved=2),
}
"""The code bases `plan --software` knows: this project, Megatron-LM as Narayanan et al. 2021 ran it, a
FlashAttention + FSDP code base as Llama 3 (Dubey et al. 2024, §3.3.2) describes, and DeepSeek's HAI-LLM as the
DeepSeek-V3 report (§3.2) describes it (its DP reduction unprinted: after the schedule)."""
