"""Every parameter's name and shape, for every family, in checkpoint order — the model's contract with its
checkpoints (`models.families` maps the names to Hugging Face's). Our names follow GPT2LMHeadModel's
(`transformer.h.{i}.attn.c_attn.weight`, …; lm_head.weight is wte, tied), llama's the same scheme
(`transformer.h.{i}.attn.q_proj.weight`, …, `lm_head.weight` when untied), DeepSeek-V3's its own
(`models.deepseek_v3`'s docstring lists them); every linear is [in, out]. Light on purpose (no NumPy): the
config counts its parameters from here.
"""

from __future__ import annotations

from typing import Any


def parameter_shapes(config: Any) -> dict[str, tuple[int, ...]]:
    """Every parameter's name and shape, in checkpoint order. GPT-2's are GPT2LMHeadModel's names (lm_head.weight
    is wte, tied); llama's follow the same scheme (`transformer.h.{i}.attn.q_proj.weight`, …, `lm_head.weight`
    when untied), [in, out] like every linear here — `models.families` maps them to Hugging Face's."""
    if config.is_deepseek:
        return _deepseek_shapes(config)
    if config.is_llama:
        return _llama_shapes(config)
    c = config.n_embd
    shapes = {"transformer.wte.weight": (config.vocab_size, c), "transformer.wpe.weight": (config.n_positions, c)}
    for i in range(config.n_layer):
        block = f"transformer.h.{i}"
        shapes |= {
            f"{block}.ln_1.weight": (c,), f"{block}.ln_1.bias": (c,),
            f"{block}.attn.c_attn.weight": (c, 3 * c), f"{block}.attn.c_attn.bias": (3 * c,),
            f"{block}.attn.c_proj.weight": (c, c), f"{block}.attn.c_proj.bias": (c,),
            f"{block}.ln_2.weight": (c,), f"{block}.ln_2.bias": (c,),
        }
        shapes |= _feed_forward_shapes(config, block, _mlp_shapes)
    shapes |= {"transformer.ln_f.weight": (c,), "transformer.ln_f.bias": (c,)}
    return shapes


def _llama_shapes(config: Any) -> dict[str, tuple[int, ...]]:
    c, kv = config.n_embd, config.kv_heads * config.head_dim
    shapes = {"transformer.wte.weight": (config.vocab_size, c)}
    for i in range(config.n_layer):
        block = f"transformer.h.{i}"
        shapes |= {
            f"{block}.ln_1.weight": (c,),
            f"{block}.attn.q_proj.weight": (c, c), f"{block}.attn.k_proj.weight": (c, kv),
            f"{block}.attn.v_proj.weight": (c, kv), f"{block}.attn.o_proj.weight": (c, c),
            f"{block}.ln_2.weight": (c,),
        }
        shapes |= _feed_forward_shapes(config, block, _swiglu_shapes)
    shapes["transformer.ln_f.weight"] = (c,)
    if not config.tied:
        shapes["lm_head.weight"] = (config.vocab_size, c)
    return shapes


def _feed_forward_shapes(config: Any, block: str, mlp_shapes: Any) -> dict[str, tuple[int, ...]]:
    """The block's MLP, or its router and experts."""
    c, width = config.n_embd, config.ffn_width
    if not config.n_experts:
        return mlp_shapes(f"{block}.mlp", c, width)
    shapes = {f"{block}.mlp.router.weight": (c, config.n_experts)}
    for e in range(config.n_experts):
        shapes |= mlp_shapes(f"{block}.mlp.experts.{e}", c, width)
    return shapes


def _mlp_shapes(prefix: str, c: int, width: int) -> dict[str, tuple[int, ...]]:
    return {f"{prefix}.c_fc.weight": (c, width), f"{prefix}.c_fc.bias": (width,),
            f"{prefix}.c_proj.weight": (width, c), f"{prefix}.c_proj.bias": (c,)}


def _swiglu_shapes(prefix: str, c: int, width: int) -> dict[str, tuple[int, ...]]:
    return {f"{prefix}.gate_proj.weight": (c, width), f"{prefix}.up_proj.weight": (c, width),
            f"{prefix}.down_proj.weight": (width, c)}


def expert_bias_shapes(config: Any) -> dict[str, tuple[int, ...]]:
    """The MoE expert biases (aux-loss-free balancing): model state saved with the parameters, but no
    parameters — no gradient, no weight decay, changed only by `models.moe.update_expert_bias`."""
    return {expert_bias_name(i): (config.n_experts,) for i in range(config.n_layer) if config.is_moe_layer(i)}


def expert_bias_name(layer: int) -> str:
    """The checkpoint name of layer `layer`'s expert bias (state for aux-loss-free balancing, not a parameter)."""
    return f"transformer.h.{layer}.mlp.router.expert_bias"


def query_head_dim(config: Any) -> int:
    """d_qk = d_n + d_r: the query and key head width."""
    return config.qk_nope_head_dim + config.qk_rope_head_dim


def _deepseek_shapes(config: Any) -> dict[str, tuple[int, ...]]:
    """Every parameter's name and shape in checkpoint order (see the module docstring)."""
    c = config.n_embd
    shapes = {"transformer.wte.weight": (config.vocab_size, c)}
    for i in range(config.n_layer):
        block = f"transformer.h.{i}"
        shapes[f"{block}.ln_1.weight"] = (c,)
        shapes |= _attention_shapes(config, f"{block}.attn")
        shapes[f"{block}.ln_2.weight"] = (c,)
        shapes |= _deepseek_feed_forward(config, i, f"{block}.mlp")
    shapes["transformer.ln_f.weight"] = (c,)
    if not config.tied:
        shapes["lm_head.weight"] = (config.vocab_size, c)
    for k in range(config.mtp_depth):
        module = mtp_prefix(k)
        shapes |= {f"{module}.enorm.weight": (c,), f"{module}.hnorm.weight": (c,),
                   f"{module}.eh_proj.weight": (2 * c, c), f"{module}.ln_1.weight": (c,)}
        shapes |= _attention_shapes(config, f"{module}.attn")
        shapes[f"{module}.ln_2.weight"] = (c,)
        shapes |= _deepseek_feed_forward(config, config.n_layer, f"{module}.mlp")
        shapes[f"{module}.shared_head.norm.weight"] = (c,)
    return shapes


def mtp_prefix(k: int) -> str:
    """Our name prefix of multi-token-prediction module k (0-based: it predicts k + 2 tokens ahead)."""
    return f"transformer.mtp.{k}"


def _attention_shapes(config: Any, prefix: str) -> dict[str, tuple[int, ...]]:
    c, heads, rank = config.n_embd, config.n_head, config.kv_lora_rank
    queries = heads * query_head_dim(config)
    if config.q_lora_rank is None:
        shapes = {f"{prefix}.q_proj.weight": (c, queries)}
    else:
        shapes = {f"{prefix}.q_a_proj.weight": (c, config.q_lora_rank),
                  f"{prefix}.q_a_layernorm.weight": (config.q_lora_rank,),
                  f"{prefix}.q_b_proj.weight": (config.q_lora_rank, queries)}
    return shapes | {
        f"{prefix}.kv_a_proj_with_mqa.weight": (c, rank + config.qk_rope_head_dim),
        f"{prefix}.kv_a_layernorm.weight": (rank,),
        f"{prefix}.kv_b_proj.weight": (rank, heads * (config.qk_nope_head_dim + config.v_head_dim)),
        f"{prefix}.o_proj.weight": (heads * config.v_head_dim, c),
    }


def _deepseek_feed_forward(config: Any, layer: int, prefix: str) -> dict[str, tuple[int, ...]]:
    c = config.n_embd
    if not config.is_moe_layer(layer):
        return _swiglu_shapes(prefix, c, config.ffn_width)
    shapes = {f"{prefix}.router.weight": (c, config.n_experts)}
    for e in range(config.n_experts):
        shapes |= _swiglu_shapes(f"{prefix}.experts.{e}", c, config.moe_ffn_hidden)
    if config.n_shared_experts:
        shapes |= _swiglu_shapes(f"{prefix}.shared_experts", c, config.n_shared_experts * config.moe_ffn_hidden)
    return shapes
