"""One DeepSeek-V3 block on one rank, one microbatch: multi-head latent attention (MLA), then a dense SwiGLU or
DeepSeekMoE (the formulas: `planner.deepseek`'s docstring).

With t tokens, H' = H/tp heads, r the KV latent, r_q the query latent (0: one q_proj), d_qk = d_n + d_r the
query/key channels per head and d_v the value channels, E/ep routed experts of F' units and S shared ones:

    products     q_a [h → r_q] and kv_a [h → r + d_r] (replicated over tp), q_b [r_q → H'·d_qk] and kv_b
                 [r → H'·(d_n + d_v)], o_proj [H'·d_v → h]; the scores over d_qk and their product with V over
                 d_v; the router [h → E], the shared experts' SwiGLU of S·F' and K·t·ep/E rows per routed expert
    elementwise  the norms 4·t·(r + r_q), RoPE 4·t·(H' + 1)·d_r, the head reshapes 2·t·H'·(2d_qk + d_v), SwiGLU
                 ~6 passes over its hidden units, the router ~6 over E
    saved        MLA t·(2r_q + 2r + d_r + 2 + H'·(d_qk + d_n + 2d_v)), the norms and residual inputs, SwiGLU's 5
                 arrays (MoE: per routed token the router's arrays and K experts' rows, and the shared experts')

`Software.recompute_latent` (DeepSeek-V3 §3.2.3) recomputes the norms and the up-projections in backward.
"""

from __future__ import annotations

from .communication import block_collectives
from .kernel_costs import Gemm, UnitCost
from .layout import Layout, Precision
from .shapes import Model, attention_pairs, causal_pairs, moe_tokens
from .software import Software


def latent_block_cost(model: Model, layout: Layout, rows: int, precision: Precision, software: Software,
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
    return UnitCost(saved=_latent_saved_elements(model, layout, rows, item, moe, software),
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
    routed, local, width = moe_tokens(layout, tokens), model.experts / layout.ep, config.moe_ffn_hidden
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
    routed = moe_tokens(layout, tokens)
    hidden = routed * config.moe_ffn_hidden * (model.top_k + config.n_shared_experts)
    return 6 * hidden + 6 * routed * model.experts


def _latent_saved_elements(model: Model, layout: Layout, rows: int, item: float, moe: bool,
                           software: Software) -> float:
    """Elements a DeepSeek-V3 block saves per microbatch on one rank: the llama block's norms and residual inputs,
    MLA's (the compressed query and its norm, the latent and its norm, q, k_nope, the shared RoPE key, v and the
    merged heads: t·(2r_q + 2r + d_r + 2 + H'·(d_qk + d_n + 2d_v)), H' = H/tp), the probabilities unless
    recomputed or fused (a fused kernel keeps one log-sum-exp per query row), the SwiGLU's arrays of its width
    (`software.swiglu_saved` of them; MoE: per routed token the router's arrays and K experts' rows, and the shared
    expert's)."""
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
    if (cp > 1 and layout.cp_attention != "ulysses") or software.attention == "flash":
        probabilities = rows * heads * seq  # the online softmax's log-sum-exp per query row
    elif layout.recompute == "none":  # the probabilities (Ulysses: n_head/cp heads over every position)
        probabilities = rows * heads // cp * causal_pairs(model.seq_len)
    swiglu = software.swiglu_saved
    if not moe:
        mlp = swiglu * tokens * model.ffn_width / tp
    else:
        routed, k = moe_tokens(layout, tokens), model.top_k
        router = model.experts * (1 + 8 / item) + 1 + k * (1 + 8 / item)
        mlp = routed * (router + k * (2 * model.n_embd + swiglu * config.moe_ffn_hidden)
                        + swiglu * config.n_shared_experts * config.moe_ffn_hidden)
    return norms + 2 * activation + attention + mlp + probabilities
