"""Model families as data: Hugging Face's Llama, Mixtral and DeepSeek-V3 configs and tensor names, both ways.

A family is not a second model class (see `models.transformer.GPTConfig`): the transformer is built from named choices,
and this module holds what makes a Llama or Mixtral checkpoint ours and ours theirs:

    ours (one scheme for both families)              Hugging Face (LlamaForCausalLM / MixtralForCausalLM)
    transformer.wte.weight         [V, C]            model.embed_tokens.weight         [V, C]
    transformer.h.{i}.ln_1.weight                    model.layers.{i}.input_layernorm.weight
    transformer.h.{i}.attn.q_proj.weight  [C, H·d]   model.layers.{i}.self_attn.q_proj.weight  [H·d, C]  (ᵀ)
    … k_proj, v_proj [C, n_kv·d], o_proj [H·d, C]    … k_proj, v_proj, o_proj                            (ᵀ)
    transformer.h.{i}.ln_2.weight                    model.layers.{i}.post_attention_layernorm.weight
    transformer.h.{i}.mlp.gate_proj/up_proj/down_proj  model.layers.{i}.mlp.gate_proj/up_proj/down_proj (ᵀ)
    transformer.h.{i}.mlp.router.weight   [C, E]     model.layers.{i}.block_sparse_moe.gate.weight [E, C] (ᵀ)
    transformer.h.{i}.mlp.experts.{e}.gate_proj      … block_sparse_moe.experts.{e}.w1                 (ᵀ)
    … up_proj / down_proj                            … w3 / w2                                         (ᵀ)
    transformer.h.{i}.mlp.router.expert_bias  [E]    … block_sparse_moe.expert_bias (ours: aux-loss-free)
    transformer.ln_f.weight                          model.norm.weight
    lm_head.weight                 [V, C]            lm_head.weight (absent when tied)

Our linears keep GPT-2's [in, out] layout (y = x @ W), so every llama matrix is transposed on the way to
nn.Linear's [out, in]. Reading also accepts the fused expert tensors transformers 5 writes
(`mlp.gate.weight`, `mlp.experts.gate_up_proj` [E, 2F, C], `mlp.experts.down_proj` [E, C, F]).

DeepSeek-V3 (`DeepseekV3ForCausalLM`; our names in `models.deepseek_v3`): input_layernorm, self_attn.q_a_proj,
q_a_layernorm, q_b_proj (or q_proj), kv_a_proj_with_mqa, kv_a_layernorm, kv_b_proj, o_proj,
post_attention_layernorm; dense blocks mlp.gate_proj/up_proj/down_proj; MoE blocks mlp.gate.weight [E, C]
(our router [C, E], ᵀ), mlp.gate.e_score_correction_bias [E] (our expert_bias), mlp.shared_experts.*, and the
routed experts as transformers 5 writes them to disk: per expert, mlp.experts.{e}.gate_proj/up_proj/down_proj
(DeepSeek's own checkpoint layout; transformers fuses them only in memory, and its save_pretrained writes them
back apart — measured with 5.24). Reading also accepts the fused tensors of its in-memory layout,
mlp.experts.gate_up_proj [E, 2F, C] (each expert's gate rows, then its up rows) and mlp.experts.down_proj [E, C, F].

Configs: transformers 4 writes `rope_theta` and `rope_scaling`, transformers 5 `rope_parameters`; both are read,
and both are written so either version loads what we save. No communication.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from typing import Any

import numpy as np

from .config import MOE_KEYS
from .rotary import rope_type

LLAMA_TYPES = ("llama", "mixtral", "deepseek_v3")

_LAYER_NAMES = (  # ours after transformer.h.{i}., Hugging Face's after model.layers.{i}., transposed?
    ("ln_1.weight", "input_layernorm.weight", False),
    ("attn.q_proj.weight", "self_attn.q_proj.weight", True),
    ("attn.k_proj.weight", "self_attn.k_proj.weight", True),
    ("attn.v_proj.weight", "self_attn.v_proj.weight", True),
    ("attn.o_proj.weight", "self_attn.o_proj.weight", True),
    ("ln_2.weight", "post_attention_layernorm.weight", False),
)
_MLP_NAMES = (("gate_proj", "gate_proj"), ("up_proj", "up_proj"), ("down_proj", "down_proj"))
_EXPERT_NAMES = (("gate_proj", "w1"), ("up_proj", "w3"), ("down_proj", "w2"))


def name_map(config: Any) -> list[tuple[str, str, bool]]:
    """(our name, Hugging Face's name, transposed) for every tensor of a llama-family model, expert biases
    included, in our checkpoint order (DeepSeek-V3's experts by their per-expert names)."""
    if config.is_deepseek:
        return _deepseek_name_map(config)
    names = [("transformer.wte.weight", "model.embed_tokens.weight", False)]
    for i in range(config.n_layer):
        ours, theirs = f"transformer.h.{i}.", f"model.layers.{i}."
        names += [(ours + a, theirs + b, t) for a, b, t in _LAYER_NAMES]
        if config.n_experts:
            moe = theirs + "block_sparse_moe."
            names.append((ours + "mlp.router.weight", moe + "gate.weight", True))
            names += [(f"{ours}mlp.experts.{e}.{a}.weight", f"{moe}experts.{e}.{b}.weight", True)
                      for e in range(config.n_experts) for a, b in _EXPERT_NAMES]
            names.append((ours + "mlp.router.expert_bias", moe + "expert_bias", False))
        else:
            names += [(f"{ours}mlp.{a}.weight", f"{theirs}mlp.{b}.weight", True) for a, b in _MLP_NAMES]
    names.append(("transformer.ln_f.weight", "model.norm.weight", False))
    if not config.tied:
        names.append(("lm_head.weight", "lm_head.weight", False))
    return names


def to_hugging_face(config: Any, tensors: Mapping[str, Any]) -> dict[str, Any]:
    """Our tensors (by our names) as Hugging Face's names and [out, in] layouts; names absent here are skipped."""
    return {theirs: (tensors[ours].T if transposed else tensors[ours])
            for ours, theirs, transposed in name_map(config) if ours in tensors}


def from_hugging_face(config: Any, tensors: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Hugging Face's tensors as ours (names, [in, out] layouts). Tensors it lacks are left out (the caller
    reports what is missing); an absent expert bias is zero (a checkpoint from elsewhere has none)."""
    tensors = _unfused_deepseek_experts(dict(tensors)) if config.is_deepseek else _unfused_experts(dict(tensors))
    ours = {}
    for name, theirs, transposed in name_map(config):
        if theirs in tensors:
            value = tensors[theirs]
            ours[name] = np.ascontiguousarray(value.T) if transposed else value
        elif name.endswith(".expert_bias"):
            ours[name] = np.zeros(config.n_experts, dtype=tensors["model.embed_tokens.weight"].dtype)
    return ours


_FUSED_EXPERTS = re.compile(r"^model\.layers\.(\d+)\.mlp\.(gate\.weight|experts\.gate_up_proj|experts\.down_proj)$")


def _unfused_experts(tensors: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """transformers 5's fused Mixtral tensors as the per-expert w1/w3/w2 of the hub's format."""
    for name in [name for name in tensors if _FUSED_EXPERTS.match(name)]:
        layer, kind = _FUSED_EXPERTS.match(name).groups()
        value, moe = tensors.pop(name), f"model.layers.{layer}.block_sparse_moe."
        if kind == "gate.weight":
            tensors[moe + "gate.weight"] = value
        elif kind == "experts.gate_up_proj":
            width = value.shape[1] // 2
            for e, fused in enumerate(value):
                tensors[f"{moe}experts.{e}.w1.weight"] = fused[:width]
                tensors[f"{moe}experts.{e}.w3.weight"] = fused[width:]
        else:
            for e, down in enumerate(value):
                tensors[f"{moe}experts.{e}.w2.weight"] = down
    return tensors


# -- config.json ---------------------------------------------------------------------------------------------


def hugging_face_config(config: Any, dtype: np.dtype) -> dict[str, Any]:
    """config.json for LlamaForCausalLM, MixtralForCausalLM when the model has experts, or
    DeepseekV3ForCausalLM."""
    if config.is_deepseek:
        return _deepseek_config(config, dtype)
    mixtral = bool(config.n_experts)
    rope = {"rope_type": "default"} if not config.rope_scaling else dict(config.rope_scaling)
    fields = {
        "model_type": "mixtral" if mixtral else "llama",
        "architectures": ["MixtralForCausalLM" if mixtral else "LlamaForCausalLM"],
        "vocab_size": config.vocab_size,
        "hidden_size": config.n_embd,
        "intermediate_size": config.ffn_width,
        "num_hidden_layers": config.n_layer,
        "num_attention_heads": config.n_head,
        "num_key_value_heads": config.kv_heads,
        "head_dim": config.head_dim,
        **_rotary_family_keys(config, rope),
        "mlp_bias": False,
        "use_cache": True,
        "torch_dtype": np.dtype(dtype).name,
    }
    if mixtral:
        fields |= {"num_local_experts": config.n_experts, "num_experts_per_tok": config.moe_top_k,
                   "router_aux_loss_coef": config.moe_aux_coef, "output_router_logits": False,
                   "router_jitter_noise": 0.0, "sliding_window": None}
        fields |= {key: getattr(config, key) for key in MOE_KEYS}
    return fields


def config_fields(raw: Mapping[str, Any]) -> dict[str, Any]:
    """`GPTConfig` keyword arguments from a Llama or Mixtral config.json (either transformers version).

    Raises ValueError naming a setting our llama does not compute (biases, another activation, a head size
    other than hidden/heads, a rope type other than default or llama3, sliding windows)."""
    model_type = raw.get("model_type")
    if model_type not in LLAMA_TYPES:
        raise ValueError(f"model_type {model_type!r} is not a llama-family model ({', '.join(LLAMA_TYPES)})")
    if model_type == "deepseek_v3":
        return _deepseek_fields(raw)
    shape = {name: _integer(raw, key) for name, key in (
        ("vocab_size", "vocab_size"), ("n_embd", "hidden_size"), ("n_layer", "num_hidden_layers"),
        ("n_head", "num_attention_heads"), ("ffn_hidden", "intermediate_size"))}
    shape["n_kv_head"] = _integer(raw, "num_key_value_heads", shape["n_head"])
    shape["n_positions"] = _integer(raw, "max_position_embeddings", 2048)
    _check_unsupported(raw, shape)
    theta, scaling = _rope(raw)
    fields = shape | {"arch": "llama", "rope_theta": theta, "rope_scaling": scaling,
                      "rms_norm_eps": float(raw.get("rms_norm_eps", 1e-6)),
                      "tie_embeddings": bool(raw.get("tie_word_embeddings", False))}
    if model_type == "mixtral":
        fields |= _mixtral_fields(raw)
    return fields


def _integer(raw: Mapping[str, Any], key: str, default: int | None = None) -> int:
    value = raw.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{key} must be an integer, got {value!r}")
    return value


def _check_unsupported(raw: Mapping[str, Any], shape: Mapping[str, int]) -> None:
    for key in ("attention_bias", "mlp_bias"):
        if raw.get(key, False):
            raise ValueError(f"{key} = true is not supported (llama has no biases here)")
    if raw.get("hidden_act", "silu") != "silu":
        raise ValueError(f"hidden_act = {raw['hidden_act']!r} is not supported (SwiGLU uses silu)")
    head_dim = raw.get("head_dim")
    if head_dim is not None and head_dim * shape["n_head"] != shape["n_embd"]:
        raise ValueError(f"head_dim = {head_dim} is not supported: heads must split hidden_size "
                         f"({shape['n_embd']}) exactly ({shape['n_embd'] // shape['n_head']} per head)")
    if raw.get("sliding_window") not in (None, 0) and raw.get("use_sliding_window", True):
        window = raw["sliding_window"]
        if window < raw.get("max_position_embeddings", math.inf):
            raise ValueError(f"sliding_window = {window} is not supported (attention here is full causal)")


def _rope(raw: Mapping[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """(θ, scaling or None) from rope_parameters (transformers 5) or rope_theta + rope_scaling (4)."""
    parameters = raw.get("rope_parameters")
    if isinstance(parameters, Mapping):
        theta = float(parameters.get("rope_theta", raw.get("rope_theta", 10000.0)))
        scaling = {key: value for key, value in parameters.items() if key != "rope_theta"}
    else:
        theta = float(raw.get("rope_theta", 10000.0))
        scaling = dict(raw.get("rope_scaling") or {})
    kind = rope_type(scaling)
    if kind == "default":
        return theta, None
    scaling.pop("type", None)
    return theta, {"rope_type": kind, **{key: value for key, value in scaling.items() if key != "rope_type"}}


def _mixtral_fields(raw: Mapping[str, Any]) -> dict[str, Any]:
    """Experts and routing. Without our own keys, the aux loss is Hugging Face's objective: its coefficient when
    output_router_logits is on (only then does transformers add it), else none."""
    hf_aux = float(raw.get("router_aux_loss_coef", 0.001)) if raw.get("output_router_logits") else 0.0
    fields = {"n_experts": _integer(raw, "num_local_experts", 8), "moe_top_k": _integer(raw, "num_experts_per_tok", 2),
              "moe_aux_coef": hf_aux}
    return fields | {key: raw[key] for key in MOE_KEYS if key in raw}


# -- DeepSeek-V3 -----------------------------------------------------------------------------------------------

DEEPSEEK_KEYS = ("moe_capacity_factor", "moe_bias_rate", "moe_seq_aux_coef", "mtp_depth", "mtp_weight")
"""Our config.json keys of a DeepSeek-V3 model beyond transformers' (its MoE shape has transformers' names).
`mtp_depth` is ours too: transformers writes num_nextn_predict_layers = 1 for models without MTP weights, so a
checkpoint from elsewhere loads its main model only (its MTP layers, if any, are left unread)."""

_DEEPSEEK_ATTENTION = ("q_proj", "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj")
_DEEPSEEK_NORMS = ("q_a_layernorm", "kv_a_layernorm")


def _deepseek_name_map(config: Any) -> list[tuple[str, str, bool]]:
    """Every block, then the final norm and head, then the MTP modules as DeepSeek's checkpoint stores them:
    layer n_layer + k, with its own copies of the embedding and the head (written on save; on load the shared
    ones are read)."""
    names = [("transformer.wte.weight", "model.embed_tokens.weight", False)]
    for i in range(config.n_layer):
        names += _deepseek_block_names(config, i, f"transformer.h.{i}.", f"model.layers.{i}.")
    names.append(("transformer.ln_f.weight", "model.norm.weight", False))
    head = "transformer.wte.weight" if config.tied else "lm_head.weight"
    if not config.tied:
        names.append(("lm_head.weight", "lm_head.weight", False))
    for k in range(config.mtp_depth):
        ours, theirs = f"transformer.mtp.{k}.", f"model.layers.{config.n_layer + k}."
        names += [(ours + "enorm.weight", theirs + "enorm.weight", False),
                  (ours + "hnorm.weight", theirs + "hnorm.weight", False),
                  (ours + "eh_proj.weight", theirs + "eh_proj.weight", True)]
        names += _deepseek_block_names(config, config.n_layer, ours, theirs, bias=False)
        names += [(ours + "shared_head.norm.weight", theirs + "shared_head.norm.weight", False),
                  ("transformer.wte.weight", theirs + "embed_tokens.weight", False),
                  (head, theirs + "shared_head.head.weight", False)]
    return names


def _deepseek_block_names(config: Any, layer: int, ours: str, theirs: str,
                          bias: bool = True) -> list[tuple[str, str, bool]]:
    """One block's names (a MoE block when `layer` has experts; its selection bias unless `bias` is False)."""
    names = [(ours + "ln_1.weight", theirs + "input_layernorm.weight", False)]
    names += [(f"{ours}attn.{part}.weight", f"{theirs}self_attn.{part}.weight", True) for part in _DEEPSEEK_ATTENTION]
    names += [(f"{ours}attn.{part}.weight", f"{theirs}self_attn.{part}.weight", False) for part in _DEEPSEEK_NORMS]
    names.append((ours + "ln_2.weight", theirs + "post_attention_layernorm.weight", False))
    if config.is_moe_layer(layer):
        names.append((ours + "mlp.router.weight", theirs + "mlp.gate.weight", True))
        if bias:
            names.append((ours + "mlp.router.expert_bias", theirs + "mlp.gate.e_score_correction_bias", False))
        mlps = [f"mlp.experts.{e}" for e in range(config.n_experts)] + ["mlp.shared_experts"]
    else:
        mlps = ["mlp"]
    return names + [(f"{ours}{mlp}.{part}.weight", f"{theirs}{mlp}.{part}.weight", True)
                    for mlp in mlps for part, _ in _MLP_NAMES]


_FUSED_DEEPSEEK = re.compile(r"^(model\.layers\.\d+\.mlp\.experts)\.(gate_up_proj|down_proj)$")


def _unfused_deepseek_experts(tensors: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """transformers 5's fused DeepSeek-V3 experts as per-expert gate_proj, up_proj, down_proj [out, in]."""
    for name in [name for name in tensors if _FUSED_DEEPSEEK.match(name)]:
        experts, kind = _FUSED_DEEPSEEK.match(name).groups()
        value = tensors.pop(name)
        for e, matrix in enumerate(value):
            if kind == "down_proj":
                tensors[f"{experts}.{e}.down_proj.weight"] = matrix
            else:
                width = matrix.shape[0] // 2
                tensors[f"{experts}.{e}.gate_proj.weight"] = matrix[:width]
                tensors[f"{experts}.{e}.up_proj.weight"] = matrix[width:]
    return tensors


def _deepseek_config(config: Any, dtype: np.dtype) -> dict[str, Any]:
    """config.json for DeepseekV3ForCausalLM (a model without experts: every block dense)."""
    rope = {"rope_type": "default"} if not config.rope_scaling else dict(config.rope_scaling)
    return {
        "model_type": "deepseek_v3",
        "architectures": ["DeepseekV3ForCausalLM"],
        "vocab_size": config.vocab_size,
        "hidden_size": config.n_embd,
        "intermediate_size": config.ffn_width,
        "moe_intermediate_size": config.moe_ffn_hidden,
        "num_hidden_layers": config.n_layer,
        "num_attention_heads": config.n_head,
        "num_key_value_heads": config.n_head,
        "n_shared_experts": config.n_shared_experts,
        "n_routed_experts": config.n_experts,
        "num_experts_per_tok": config.moe_top_k,
        "n_group": config.n_group,
        "topk_group": config.topk_group,
        "routed_scaling_factor": config.routed_scaling_factor,
        "norm_topk_prob": config.moe_renormalize,
        "first_k_dense_replace": config.first_k_dense_replace if config.n_experts else config.n_layer,
        "q_lora_rank": config.q_lora_rank,
        "kv_lora_rank": config.kv_lora_rank,
        "qk_nope_head_dim": config.qk_nope_head_dim,
        "qk_rope_head_dim": config.qk_rope_head_dim,
        "v_head_dim": config.v_head_dim,
        "rope_interleave": config.rope_interleave,
        **_rotary_family_keys(config, rope),
        "num_nextn_predict_layers": config.mtp_depth,
        "use_cache": True,
        "torch_dtype": np.dtype(dtype).name,
    } | {key: getattr(config, key) for key in DEEPSEEK_KEYS}


def _deepseek_fields(raw: Mapping[str, Any]) -> dict[str, Any]:
    """`GPTConfig` keyword arguments from a DeepSeek-V3 config.json, refusing what our model does not compute."""
    if raw.get("attention_bias", False):
        raise ValueError("attention_bias = true is not supported (MLA here has no biases)")
    if raw.get("hidden_act", "silu") != "silu":
        raise ValueError(f"hidden_act = {raw['hidden_act']!r} is not supported (SwiGLU uses silu)")
    for key, supported in (("scoring_func", "sigmoid"), ("topk_method", "noaux_tc")):
        if raw.get(key, supported) != supported:
            raise ValueError(f"{key} = {raw[key]!r} is not supported (DeepSeek-V3's router: {supported})")
    shape = {name: _integer(raw, key) for name, key in (
        ("vocab_size", "vocab_size"), ("n_embd", "hidden_size"), ("n_layer", "num_hidden_layers"),
        ("n_head", "num_attention_heads"), ("ffn_hidden", "intermediate_size"), ("kv_lora_rank", "kv_lora_rank"),
        ("qk_nope_head_dim", "qk_nope_head_dim"), ("qk_rope_head_dim", "qk_rope_head_dim"),
        ("v_head_dim", "v_head_dim"))}
    experts = _integer(raw, "n_routed_experts", 0)
    dense = _integer(raw, "first_k_dense_replace", 0)
    q_lora_rank = raw.get("q_lora_rank")
    theta, scaling = _rope(raw)
    fields = shape | {
        "arch": "deepseek_v3", "n_positions": _integer(raw, "max_position_embeddings", 2048),
        "q_lora_rank": None if q_lora_rank is None else _integer(raw, "q_lora_rank"),
        "rope_theta": theta, "rope_scaling": scaling, "rope_interleave": bool(raw.get("rope_interleave", True)),
        "rms_norm_eps": float(raw.get("rms_norm_eps", 1e-6)),
        "tie_embeddings": bool(raw.get("tie_word_embeddings", False)),
        "n_experts": experts if dense < shape["n_layer"] else 0, "moe_aux_coef": 0.0,
    }
    if fields["n_experts"]:
        fields |= {"moe_top_k": _integer(raw, "num_experts_per_tok"), "first_k_dense_replace": dense,
                   "moe_ffn_hidden": _integer(raw, "moe_intermediate_size"),
                   "n_shared_experts": _integer(raw, "n_shared_experts", 0),
                   "n_group": _integer(raw, "n_group", 1) if raw.get("n_group") is not None else 1,
                   "topk_group": _integer(raw, "topk_group", 1) if raw.get("topk_group") is not None else 1,
                   "routed_scaling_factor": float(raw.get("routed_scaling_factor", 1.0)),
                   "moe_renormalize": bool(raw.get("norm_topk_prob", True))}
    return fields | {key: raw[key] for key in DEEPSEEK_KEYS if key in raw}


def _rotary_family_keys(config: Any, rope: dict[str, Any]) -> dict[str, Any]:
    """The config.json keys the llama and deepseek_v3 families write alike: SiLU, positions, RMSNorm's eps, RoPE
    (both the old `rope_scaling` and transformers 5's `rope_parameters`), the head's tying, no biases or dropout."""
    return {"hidden_act": "silu", "max_position_embeddings": config.n_positions, "rms_norm_eps": config.rms_norm_eps,
            "rope_theta": config.rope_theta,
            "rope_scaling": None if not config.rope_scaling else dict(config.rope_scaling),
            "rope_parameters": {"rope_theta": config.rope_theta, **rope}, "tie_word_embeddings": config.tied,
            "attention_bias": False, "attention_dropout": 0.0, "initializer_range": 0.02}
