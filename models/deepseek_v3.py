"""The DeepSeek-V3 family (`GPTConfig.arch` "deepseek_v3") as choices of the one transformer: its parameters,
its checks, and the block the model builds from them (`block`, with `models.transformer.Transformer`'s layer
factories, so every parallel axis applies to it as to every family).

A block is the llama block (RMSNorm, residual adds) with two parts replaced:

    attention    multi-head latent attention (`models.latent_attention`): q_a_proj, q_a_layernorm, q_b_proj
                 (or q_proj when q_lora_rank is None), kv_a_proj_with_mqa, kv_a_layernorm, kv_b_proj, o_proj
    MLP          blocks 0 … first_k_dense_replace − 1: a dense SwiGLU `ffn_hidden` wide (intermediate_size);
                 the others DeepSeekMoE (`models.deepseek_moe`): a sigmoid router, `n_experts` routed SwiGLU
                 experts `moe_ffn_hidden` wide and one shared SwiGLU n_shared_experts·moe_ffn_hidden wide

Our names (linears [in, out], as every linear here; `models.families` maps them to transformers'):

    transformer.h.{i}.attn.q_a_proj.weight [C, r_q]      … q_a_layernorm.weight [r_q], q_b_proj.weight [r_q, H·d_qk]
    transformer.h.{i}.attn.q_proj.weight [C, H·d_qk]     (q_lora_rank None)
    transformer.h.{i}.attn.kv_a_proj_with_mqa.weight [C, r + d_r], kv_a_layernorm.weight [r],
    transformer.h.{i}.attn.kv_b_proj.weight [r, H·(d_n + d_v)], o_proj.weight [H·d_v, C]
    transformer.h.{i}.mlp.router.weight [C, E], mlp.router.expert_bias [E] (state: e_score_correction_bias)
    transformer.h.{i}.mlp.experts.{e}.gate_proj/up_proj/down_proj.weight, mlp.shared_experts.…
    transformer.mtp.{k}.enorm.weight, hnorm.weight [C], eh_proj.weight [2C, C], shared_head.norm.weight [C], and
    a block's ln_1, attn.*, ln_2, mlp.* (MoE when the model has experts): the multi-token-prediction modules
    (`models.multi_token`; checkpoint layers n_layer + k, as DeepSeek's)

with d_qk = d_n + d_r. No communication here.
"""

from __future__ import annotations

import math
from typing import Any

from .config import DEEPSEEK_V3
from .deepseek_moe import DeepSeekMoE, SigmoidRouter
from .latent_attention import LowRankProjection
from .layers import Block, Linear, LMHead, RMSNorm
from .moe import MoEBlock
from .multi_token import MultiTokenPrediction, PredictionModule
from .rotary import softmax_scale_correction
from .tensors import expert_bias_name, mtp_prefix, parameter_shapes, query_head_dim

ARCH = DEEPSEEK_V3
LATENT_NORM_EPS = 1e-6
"""q_a_layernorm's and kv_a_layernorm's eps: fixed, not rms_norm_eps (DeepSeek's code and transformers alike)."""


def parameter_counts(config: Any, mtp_depth: int = 1) -> dict[str, int]:
    """What a DeepSeek-V3 model holds and computes with, counted from `parameter_shapes`:

    total      every parameter of the main model (embedding and untied head included; no MTP module)
    activated  what one token's forward multiplies by: everything but the routed experts, plus top_k routed
               experts per MoE block (the embedding row and the head counted whole, as DeepSeek counts)
    mtp        `mtp_depth` multi-token-prediction modules as DeepSeek's checkpoint stores them: per module one MoE
               block, eh_proj [2h, h], enorm, hnorm and shared_head.norm, and its own copies of the embedding and
               the head (layer num_hidden_layers of the published checkpoint)

    DeepSeek-V3's published config gives 671.0 B total, 37.6 B activated (the report's "37B"), and 13.5 B of MTP:
    684.5 B in the checkpoint (Hugging Face's "685B")."""
    shapes = parameter_shapes(config)
    total = sum(math.prod(shape) for shape in shapes.values())
    routed = sum(math.prod(shape) for name, shape in shapes.items() if ".mlp.experts." in name)
    moe_blocks = [i for i in range(config.n_layer) if config.is_moe_layer(i)]
    per_expert = routed // (len(moe_blocks) * config.n_experts) if moe_blocks else 0
    activated = total - routed + len(moe_blocks) * config.moe_top_k * per_expert
    last = f"transformer.h.{moe_blocks[-1] if moe_blocks else config.n_layer - 1}."
    block = sum(math.prod(shape) for name, shape in shapes.items() if name.startswith(last))
    h, table = config.n_embd, config.vocab_size * config.n_embd
    mtp = mtp_depth * (block + 2 * h * h + 3 * h + 2 * table)
    return {"total": total, "activated": activated, "mtp": mtp}


def block(model: Any, i: int, prefix: str | None = None) -> Block:
    """Block i, built by `model`'s layer factories (`models.transformer.Transformer`, which asks its axes: tensor
    parallelism enters the whole latent attention once, its up-projections hold this rank's heads, its o_proj is
    row-parallel). `prefix` names the block's parameters: transformer.h.{i} by default, an MTP module's otherwise;
    the MTP modules' MoE chooses with no selection bias and adds no balance loss."""
    config, main = model.config, prefix is None
    prefix = prefix or f"transformer.h.{i}"
    attention = model.tp.enter_attention(_latent_attention(model, f"{prefix}.attn"))
    if config.is_moe_layer(i):
        kind, mlp = MoEBlock, _deepseek_moe(model, i, f"{prefix}.mlp", balanced=main)
    else:
        kind, mlp = Block, model.mlp(f"{prefix}.mlp")
    return kind(model.norm(f"{prefix}.ln_1"), attention, model.norm(f"{prefix}.ln_2"), mlp,
                recompute_full=model.recompute == "full")


def multi_token_head(model: Any, head: LMHead) -> MultiTokenPrediction:
    """The head unit with the `mtp_depth` multi-token-prediction modules after the main head."""
    config = model.config
    modules = [PredictionModule(model.norm(f"{mtp_prefix(k)}.enorm"), model.norm(f"{mtp_prefix(k)}.hnorm"),
                                _plain_linear(model, f"{mtp_prefix(k)}.eh_proj"),
                                block(model, config.n_layer, mtp_prefix(k)),
                                model.norm(f"{mtp_prefix(k)}.shared_head.norm"), model.tp.cross_entropy(model))
               for k in range(config.mtp_depth)]
    return MultiTokenPrediction(head, modules, model.tp.embedding(model), config.mtp_weight, model.cp)


def _latent_attention(model: Any, prefix: str) -> Any:
    config = model.config
    if config.q_lora_rank is None:
        query = _plain_linear(model, f"{prefix}.q_proj")
    else:
        query = LowRankProjection(_plain_linear(model, f"{prefix}.q_a_proj"),
                                  _latent_norm(model, f"{prefix}.q_a_layernorm"),
                                  _plain_linear(model, f"{prefix}.q_b_proj"))
    scale = softmax_scale_correction(config.rope_scaling) / query_head_dim(config) ** 0.5
    return model.cp.latent_attention(
        query, _plain_linear(model, f"{prefix}.kv_a_proj_with_mqa"), _latent_norm(model, f"{prefix}.kv_a_layernorm"),
        _plain_linear(model, f"{prefix}.kv_b_proj"), model.tp.row_parallel(model, f"{prefix}.o_proj"),
        model.tp.heads(config.n_head), config.qk_nope_head_dim, config.qk_rope_head_dim, config.v_head_dim,
        model.rope, config.rope_interleave, softmax_scale=scale, query_block=model.query_block,
        keep_probabilities=model.recompute != "selective")


def _latent_norm(model: Any, prefix: str) -> Any:
    """The RMSNorm of a compressed query or KV latent (eps `LATENT_NORM_EPS`; statistics kept wide)."""
    norm = RMSNorm(model.params[f"{prefix}.weight"], LATENT_NORM_EPS)
    return model.narrowed(norm, statistics=norm.kept_wide)


def _plain_linear(model: Any, prefix: str) -> Any:
    """A bias-free linear of this rank's weight as it is held (whole, or its heads' columns under TP)."""
    return model.narrowed(Linear(model.params[f"{prefix}.weight"]))


def _deepseek_moe(model: Any, i: int, prefix: str, balanced: bool = True) -> DeepSeekMoE:
    config = model.config
    router = SigmoidRouter(model.params[f"{prefix}.router.weight"], config.moe_top_k, config.n_group,
                           config.topk_group, config.moe_renormalize, config.routed_scaling_factor,
                           config.moe_capacity_factor, config.moe_seq_aux_coef if balanced else 0.0,
                           expert_bias=model.expert_biases[expert_bias_name(i)] if balanced else None,
                           sequence_groups=model.sequence_groups() if balanced else ())
    router.aux_weight = model.aux_weight() * router.shares  # the ranks' shares add up to a token set's loss
    routed = model.ep.mixture(router, model.held_experts(prefix), fp8_dispatch=model.fp8 != "none")
    shared = model.expert(f"{prefix}.shared_experts") if config.n_shared_experts else None
    return DeepSeekMoE(routed, shared)
