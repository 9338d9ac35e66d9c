"""What each unit (embedding, block, head) costs per microbatch of b sequences on one rank: the elements it saves
for backward, its matrix products and elementwise passes, forward and backward, and the collectives it waits for.

Per block and token forward, h channels, h_kv = n_kv'·d this TP rank's KV channels, F the MLP width:

    attention   projections 2·(2h² + 2h·h_kv)/tp (8h²/tp for multi-head attention), scores 4·pairs·h/tp per
                sequence (`shapes.attention_pairs`)
    MLP         2·2·h·4h/tp (GPT-2) or 2·3·h·F/tp (SwiGLU); MoE K experts per token plus the router's 2·h·E
    elementwise norms and residuals 12·h (÷ tp under SP), GELU ~7 or SwiGLU ~6 passes over the hidden units, the
                softmax 5 passes over the probabilities (+ 2 + 1/item with attention dropout)

Backward is twice forward; `--recompute full` adds one more forward of the blocks, `selective` the attention
scores. Saved per block: the runtime's `models.layers.block_activation_elements` (either family); MoE's per routed
token the router's arrays and K·(2h + the expert's hidden units) (balanced routing assumed); CP's one log-sum-exp
per query row (ring, all-gather), or Ulysses' serial attention of n_head/cp heads. The head: the final norm, the
logits t·V/tp (2·t·h·V/tp FLOPs forward) and the vocab-parallel cross-entropy; the embedding: the int64 token ids.
DeepSeek-V3's blocks are `deepseek_block`'s; its MTP modules ride on the head's unit.
"""

from __future__ import annotations

from dataclasses import replace
from functools import lru_cache

from models.layers import block_activation_elements

from .communication import Collective, block_collectives, tp_exchanges
from .deepseek_block import latent_block_cost
from .kernel_costs import Gemm, UnitCost
from .layout import Layout, Precision
from .shapes import Model, attention_pairs, causal_pairs, local_kv_heads, moe_tokens, packed_documents, padded_vocab
from .software import SOFTWARE, Software


def unit_costs(model: Model, layout: Layout, rows: int, precision: Precision,
               software: Software = SOFTWARE["mpiparallel"]) -> list[UnitCost]:
    """Embedding, one block of each kind (`block_variants`), head: what one microbatch of `rows` sequences costs on
    one rank, run by `software`. Cached: of the layout, only tp, cp, ep, sp, the recomputation and the CP
    attention change them."""
    costed = Layout(tp=layout.tp, cp=layout.cp, ep=layout.ep, recompute=layout.recompute, sp=layout.sp,
                    cp_attention=layout.cp_attention)
    return list(_unit_costs(model, costed, rows, precision, software))


@lru_cache(maxsize=4096)
def _unit_costs(model: Model, layout: Layout, rows: int, precision: Precision,
                software: Software) -> tuple[UnitCost, ...]:
    blocks = [block_cost(model, layout, rows, precision, software, moe) for moe in block_variants(model)]
    head = _head_cost(model, layout, rows, precision.activations)
    if model.is_deepseek and model.config.mtp_depth:
        vocab = padded_vocab(model.vocab_size, layout.tp) // layout.tp
        head = _with_prediction_modules(head, blocks[-1], model, rows, vocab, precision.activations)
    return (_embedding_cost(model, layout, rows, precision.activations), *blocks, head)


def _embedding_cost(model: Model, layout: Layout, rows: int, item: float) -> UnitCost:
    """The lookup: its int64 token ids saved, two passes over its output, the TP exchange of the activation."""
    tokens = rows * (model.seq_len // layout.cp)
    s = tokens * model.n_embd
    return UnitCost(saved=tokens * 8 / item, flops_forward=0, flops_backward=0,
                    elementwise_forward=2 * s / (layout.tp if layout.sp else 1), elementwise_backward=2 * s,
                    collectives_forward=tp_exchanges(s * item, layout, 1))


def _head_cost(model: Model, layout: Layout, rows: int, item: float) -> UnitCost:
    """The final norm, the logits of this rank's vocabulary shard and the vocab-parallel cross-entropy."""
    h, tp = model.n_embd, layout.tp
    tokens = rows * (model.seq_len // layout.cp)
    s = tokens * h
    vocab = padded_vocab(model.vocab_size, tp) // tp
    seq_shard = tp if layout.sp else 1
    # the vocab-parallel cross-entropy: the row maxima, then the sums and target logits in one message
    collectives = (Collective("all_reduce", tokens * item, "tp"),
                   Collective("all_reduce", 2 * tokens * item, "tp")) if tp > 1 else ()
    # the final norm keeps its output and 1/σ (or 1/rms) (sequence slices under SP), the cross-entropy its whole
    # input (all-gathered under SP) and the probabilities of this rank's vocabulary shard
    return UnitCost(saved=(s + tokens) / seq_shard + s + tokens * vocab, flops_forward=2 * tokens * h * vocab,
                    flops_backward=4 * tokens * h * vocab, elementwise_forward=6 * s / seq_shard + 6 * tokens * vocab,
                    elementwise_backward=10 * s / seq_shard, collectives_forward=collectives,
                    collectives_backward=tp_exchanges(s * item, layout, 1), gemms_forward=(Gemm(tokens, vocab, h),))


@lru_cache(maxsize=64)
def block_variants(model: Model) -> tuple[bool, ...]:
    """The distinct blocks, as whether they have experts: GPT-2's and llama's blocks are all alike; DeepSeek-V3 has
    dense first blocks, then MoE ones."""
    return tuple(sorted({model.is_moe_block(i) for i in range(model.n_layer)}))


@lru_cache(maxsize=64)
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


def block_gemms(model: Model, layout: Layout, tokens: int, rows: int, attention: str) -> tuple[Gemm, ...]:
    """One block's forward matrix products on one rank: q, k, v (fused), o, the MLP's (or the experts' and the
    router's) and, per sequence and head, the scores Q·Kᵀ and their product with V."""
    h, tp, d = model.n_embd, layout.tp, model.head_dim
    kv_channels = local_kv_heads(model, tp) * d
    width = model.ffn_width
    gemms = [Gemm(tokens, h / tp + 2 * kv_channels if model.is_llama else 3 * h / tp, h), Gemm(tokens, h, h / tp)]
    if model.experts:
        routed = moe_tokens(layout, tokens)
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
               software: Software = SOFTWARE["mpiparallel"], moe: bool | None = None) -> UnitCost:
    """One transformer block of any family on one rank, one microbatch (`moe`: DeepSeek-V3's MoE or dense
    blocks; the model's kind otherwise)."""
    if model.is_deepseek:
        return latent_block_cost(model, layout, rows, precision, software, bool(moe))
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
    return UnitCost(saved=block_saved_elements(model, layout, rows, precision.activations, software),
                    flops_forward=flops_forward, flops_backward=2 * flops_forward + recompute_flops,
                    elementwise_forward=elementwise_forward,
                    elementwise_backward=2 * elementwise_forward + recompute_elements,
                    collectives_forward=forward, collectives_backward=backward,
                    gemms_forward=gemms, gemms_recomputed=recomputed)


def _mlp_work(model: Model, layout: Layout, tokens: int) -> tuple[float, float]:
    """Forward matmul FLOPs and elementwise elements of the MLP: GPT-2's c_fc and c_proj (2·2·h·4h per token)
    and GELU (~7 passes over 4h), llama's gate, up and down (2·3·h·F) and SwiGLU (~6 passes over F); split over
    tp, or K experts per token plus the router's 2·h·E."""
    h, width = model.n_embd, model.ffn_width
    matrices, passes = (3, 6) if model.is_llama else (2, 7)
    if model.experts:
        routed = moe_tokens(layout, tokens)
        hidden = routed * width * model.top_k
        return 2 * matrices * h * hidden + 2 * routed * h * model.experts, passes * hidden
    hidden = tokens * width / layout.tp
    return 2 * matrices * h * hidden, passes * hidden


def block_saved_elements(model: Model, layout: Layout, rows: int, item: float,
                         software: Software = SOFTWARE["mpiparallel"]) -> float:
    """Elements one block saves per microbatch on one rank: the runtime's `block_activation_elements` (either
    family), with the MoE block's and context-parallel attention's differences and `software`'s own (a fused
    attention keeps one log-sum-exp per query row instead of the probabilities; Megatron's SP keeps no gathered
    inputs; a fused SwiGLU keeps 3F, not 5F, per token of a dense MLP); `item` bytes per element (the int64 index
    arrays count 8/item)."""
    h, tp, cp = model.n_embd, layout.tp, layout.cp
    seq = model.seq_len // cp
    tokens = rows * seq
    flash = software.attention == "flash"
    recompute = "selective" if (cp > 1 or flash) and layout.recompute == "none" else layout.recompute
    family = {"kv_heads": model.kv_heads, "ffn_hidden": model.ffn_width} if model.is_llama else {}
    saved = float(block_activation_elements(rows, seq, h, model.n_head, tp, layout.sp, recompute, **family,
                                            documents=packed_documents(model, rows)))
    if layout.recompute == "full":
        return saved
    if layout.sp and tp > 1 and not software.sp_keeps_gathered_inputs:
        saved -= 2 * tokens * h  # the inputs of qkv and of the MLP: their shards are the norms' outputs, kept
    if model.is_llama and not model.experts:
        saved -= (5 - software.swiglu_saved) * tokens * model.ffn_width / tp
    if model.experts:
        saved += _moe_saved_change(model, layout, tokens, item)
    heads = model.n_head // tp
    if (cp > 1 and layout.cp_attention != "ulysses") or flash:  # one log-sum-exp per query row (Ulysses: as many)
        saved += rows * heads * seq
    elif cp > 1 and layout.recompute == "none":  # Ulysses: the serial attention of n_head/cp heads, all s positions
        saved += rows * heads // cp * causal_pairs(model.seq_len)
    return saved


def _moe_saved_change(model: Model, layout: Layout, tokens: int, item: float) -> float:
    """What an MoE block saves instead of the dense MLP's hidden units (GPT-2 16h per token: c_fc's output and
    GELU's three arrays of 4h; llama 5F): per routed token the router's probabilities (E), its top-K choice
    (an argsort of E int64), 1/Σ of the chosen probabilities, the K gates and K int64 assignments; then the K
    rows gathered for the experts, their K outputs, and the experts' hidden units (balanced: K·tokens rows)."""
    h, experts, k = model.n_embd, model.experts, model.top_k
    hidden = 5 * model.ffn_width if model.is_llama else 16 * h
    router = experts + experts * 8 / item + 1 + k + k * 8 / item
    return moe_tokens(layout, tokens) * (router + k * (2 * h + hidden)) - tokens * hidden / layout.tp
