"""The planner: memory, time and communication of every layout of a GPT-2, a llama (Mixtral) or a DeepSeek-V3 on
a cluster, ranked. Pure Python, no MPI. This module states the arithmetic and gathers the names; each concern is
one module, read in this order (each imports only those above it):

    layout          what a run chooses: Layout, Choices, Precision (bytes per parameter and activation)
    software        how a code base runs it: Software, SOFTWARE (`plan --software`)
    hardware        the GPUs and their rates: Cluster (plain, a preset of `gpus`, or `load_machine`)
    shapes          the model: Model, parameters per unit and rank, tokens and attention pairs, FLOPs per token
    communication   what each unit exchanges per axis, and a collective's time on an axis
    kernel_costs    a unit's matrix products and elementwise passes (Gemm, UnitCost) and their time
    deepseek_block  DeepSeek-V3's block: multi-head latent attention and DeepSeekMoE (`deepseek`'s formulas)
    costs           what each unit (embedding, block, head, MTP modules) costs per microbatch on one rank
    pipeline        the schedule's bubble and activations in flight (simulated), min_microbatches, its time
    setting         one layout's units, stages and ranks, derived once
    memory          memory per pipeline rank and stage
    results         Plan (one layout's prediction, `plan --json`) and its throughput and MFU
    step_time       the step's time: compute, blocking and exposed communication, dp, optimizer
    search          evaluate one layout; enumerate the candidates, rank those that fit

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

from .communication import (
    Collective,
    axis_link,
    axis_nodes,
    axis_size,
    axis_stride,
    block_collectives,
    collective_bytes_sent,
    collective_seconds,
    context_parallel_collectives,
    ep_exchange,
    group_link,
    group_nodes,
    tp_exchanges,
)
from .costs import block_cost, block_gemms, block_saved_elements, block_variants, unit_costs, unit_kinds
from .hardware import DEFAULT_PEAK_FLOPS, GB, Cluster, load_machine
from .kernel_costs import Gemm, UnitCost
from .layout import AXES, PRECISIONS, RECOMPUTE, Choices, Layout, Precision, precision_of, precision_with
from .pipeline import SIMULATED_ACTIONS, PipelineShape, min_microbatches, pipeline_shape
from .results import Plan, peak_of
from .search import candidate_layouts, data_parallel_degree, divisors, evaluate, min_model_parallel, plan
from .shapes import (
    Model,
    attention_pairs,
    attention_parameters,
    expert_parameters,
    expert_unit_parameters,
    flops_per_token,
    held_parameters,
    local_kv_heads,
    megatron_flops,
    mlp_parameters,
    padded_vocab,
    scaled_unit_parameters,
    tied_parameters,
    training_mfu,
    unit_parameters,
)
from .software import ATTENTION_KERNELS, SOFTWARE, Software
from .step_time import BUCKET_BYTES

__all__ = ["ATTENTION_KERNELS", "AXES", "BUCKET_BYTES", "Choices", "Cluster", "Collective", "DEFAULT_PEAK_FLOPS", "GB",
           "Gemm", "Layout", "Model", "PRECISIONS", "PipelineShape", "Plan", "Precision", "RECOMPUTE",
           "SIMULATED_ACTIONS", "SOFTWARE", "Software", "UnitCost", "attention_pairs", "attention_parameters",
           "axis_link", "axis_nodes", "axis_size", "axis_stride", "block_collectives", "block_cost", "block_gemms",
           "block_saved_elements", "block_variants", "candidate_layouts", "collective_bytes_sent",
           "collective_seconds", "context_parallel_collectives", "data_parallel_degree", "divisors", "ep_exchange",
           "evaluate", "expert_parameters", "expert_unit_parameters", "flops_per_token", "group_link", "group_nodes",
           "held_parameters", "load_machine", "local_kv_heads", "megatron_flops", "min_microbatches",
           "min_model_parallel", "mlp_parameters", "padded_vocab", "peak_of", "pipeline_shape", "plan", "precision_of",
           "precision_with", "scaled_unit_parameters", "tied_parameters", "tp_exchanges", "training_mfu", "unit_costs",
           "unit_kinds", "unit_parameters"]
