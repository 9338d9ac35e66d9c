"""The DeepSeek-V3 family in the planner (`plan --arch deepseek_v3`): its published shape, what its parameter
counts count, its KV cache, and the per-block formulas `core` adds for it. Pure arithmetic on a `GPTConfig`.

What is counted (`models.deepseek_v3.parameter_counts`, reused, on the published config.json: 671.0 B / 37.6 B /
13.5 B):

- total: every parameter of the main model: embedding, 61 blocks with each of the 256 routed experts counted once,
  the final norm, the untied head; not the MTP module;
- activated: what one token's forward multiplies by: all but the routed experts, plus 8 routed experts per MoE
  block (the shared expert, the 3 dense blocks, attention, embedding row and head counted whole) — the report's
  "37B activated for each token";
- MTP: the module as DeepSeek's checkpoint stores it (one MoE block, eh_proj [2h, h], three norms, its own copies
  of the embedding and head): 13.5 B, the report's "14B"; in training it shares the embedding and head, so it
  holds 11.6 B of its own (`mtp_own_parameters`).

Per block and token on one TP rank (H heads, d_qk = d_n + d_r query/key and d_v value channels, r = kv_lora_rank,
r_q = q_lora_rank, E routed experts of F_m units, top K, F_s = n_shared·F_m; heads split over tp as train splits
them, the down-projections and every expert replicated):

    q        h·r_q + r_q·(H/tp)·d_qk   (or h·(H/tp)·d_qk without q_lora_rank)
    kv       h·(r + d_r) + r·(H/tp)·(d_n + d_v)
    o        (H/tp)·d_v·h
    scores   pairs·(H/tp)·d_qk, pairs·(H/tp)·d_v with V   (d_qk = 192 ≠ d_v = 128 in DeepSeek-V3)
    MLP      dense first blocks: 3·h·F/tp; MoE: router h·E, shared 3·h·F_s, K routed 3·h·F_m

(multiply-adds; FLOPs are twice these). KV cache per token: MLA keeps the normalized latent and the RoPE key,
l·(r + d_r) values (576 per block in DeepSeek-V3), where multi-head attention with these heads would keep
l·H·(d_qk + d_v) (40,960 per block; 2·H·d for heads of one width d).

Expert-parallel dispatch (`dispatch_copies`): a routed token goes to K experts. The flat all-to-all sends one copy
per expert; across N nodes of G GPUs, K·(N − 1)/N of them leave the node (node-limited routing or not: the own
node holds K/N of a token's experts on average). DeepSeek-V3's two-hop dispatch (§3.2.2) sends each token across
the network once per target node, to the GPU of the same local index, and forwards it there over NVLink: at most
M = topk_group target nodes, M·(N − 1)/N copies across, K·(G − 1)/G forwarded inside. Combine mirrors dispatch.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

PUBLISHED_CONFIG = Path(__file__).with_name("deepseek_v3_config.json")
"""deepseek-ai/DeepSeek-V3's published config.json (the keys the model reads)."""
PUBLISHED_SEQ_LEN = 4096
"""Pre-training's sequence length (the report, §4.2: "we set the maximum sequence length to 4K")."""
DISPATCHES = ("flat", "hierarchical")


@dataclass(frozen=True)
class DeepSeekShape:
    """DeepSeek-V3's choices beyond llama's, GPTConfig's names: multi-head latent attention, DeepSeekMoE (the first
    first_k_dense_replace blocks dense; n_group groups of experts, the nodes, topk_group of them per token) and
    mtp_depth multi-token-prediction modules."""

    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    moe_ffn_hidden: int = 0
    n_shared_experts: int = 0
    first_k_dense_replace: int = 0
    n_group: int = 1
    topk_group: int = 1
    mtp_depth: int = 0

    @classmethod
    def of(cls, config: Any) -> DeepSeekShape:
        return cls(**{f.name: getattr(config, f.name) for f in fields(cls)})


def published_config() -> dict[str, Any]:
    """The published config.json as a dict."""
    return json.loads(PUBLISHED_CONFIG.read_text())


def config_json_fields(raw: dict[str, Any]) -> dict[str, Any]:
    """GPTConfig keyword arguments of a deepseek_v3 config.json (`models.families.config_fields`), its MTP modules
    (num_nextn_predict_layers) included: the report trains with D = 1."""
    from models.families import config_fields

    return config_fields(raw) | {"mtp_depth": int(raw.get("mtp_depth", raw.get("num_nextn_predict_layers", 0)))}


def parameter_counts(config: Any) -> dict[str, int]:
    """total, activated and mtp (`models.deepseek_v3.parameter_counts`, module docstring), for the main model
    whatever config.mtp_depth is; mtp for config.mtp_depth modules."""
    from dataclasses import replace

    from models.deepseek_v3 import parameter_counts as counts

    return counts(replace(config, mtp_depth=0), mtp_depth=config.mtp_depth)


def query_key_dim(config: Any) -> int:
    return config.qk_nope_head_dim + config.qk_rope_head_dim


def local_heads(config: Any, tp: int) -> int:
    return config.n_head // tp


def latent_attention_parameters(config: Any, tp: int) -> int:
    """One block's two RMSNorms and MLA on one TP rank (module docstring), the latent norms' weights included."""
    h, heads, rank = config.n_embd, local_heads(config, tp), config.kv_lora_rank
    queries = heads * query_key_dim(config)
    query = h * queries if config.q_lora_rank is None else \
        h * config.q_lora_rank + config.q_lora_rank + config.q_lora_rank * queries
    keys_values = h * (rank + config.qk_rope_head_dim) + rank + rank * heads * (config.qk_nope_head_dim
                                                                                 + config.v_head_dim)
    return 2 * h + query + keys_values + heads * config.v_head_dim * h


def feed_forward_parameters(config: Any, tp: int, ep: int, moe: bool) -> int:
    """A dense block's SwiGLU (split over tp), or an MoE block's E/ep routed experts, shared expert and router
    (replicated over tp)."""
    h = config.n_embd
    if not moe:
        return 3 * h * config.ffn_width // tp
    shared = 3 * h * config.n_shared_experts * config.moe_ffn_hidden
    return config.n_experts // ep * 3 * h * config.moe_ffn_hidden + shared + h * config.n_experts


def mtp_own_parameters(config: Any, tp: int = 1, ep: int = 1) -> int:
    """The MTP modules as training holds them: per module enorm, hnorm, eh_proj [2h, h], one MoE block and
    shared_head.norm (the embedding and the head are the main model's)."""
    h = config.n_embd
    block = latent_attention_parameters(config, tp) + feed_forward_parameters(config, tp, ep, bool(config.n_experts))
    return config.mtp_depth * (3 * h + 2 * h * h + block)


def kv_cache_bytes_per_token(config: Any, item: float = 2.0) -> dict[str, float]:
    """Bytes one token adds to the inference KV cache over all blocks: MLA's latent and RoPE key, l·(r + d_r)
    values, beside what caching the expanded keys and values of these heads would take, l·H·(d_qk + d_v)."""
    latent = config.kv_lora_rank + config.qk_rope_head_dim
    expanded = config.n_head * (query_key_dim(config) + config.v_head_dim)
    return {"latent_values_per_block": latent, "expanded_values_per_block": expanded,
            "latent_bytes": config.n_layer * latent * item, "expanded_bytes": config.n_layer * expanded * item}


def dispatch_copies(top_k: int, topk_group: int, nodes: int, per_node: int, dispatch: str) -> tuple[float, float]:
    """(copies across nodes, copies inside a node) one routed token's dispatch sends from its rank, expected over
    balanced routing, flat or hierarchical (module docstring); on one node every copy but the local one's 1/G
    stays on NVLink."""
    if dispatch not in DISPATCHES:
        raise ValueError(f"unknown EP dispatch {dispatch!r}; one of {', '.join(DISPATCHES)}")
    if nodes <= 1:
        return 0.0, top_k * (per_node - 1) / per_node
    remote = (nodes - 1) / nodes
    if dispatch == "flat":
        return top_k * remote, top_k / nodes * (per_node - 1) / per_node
    target_nodes = min(topk_group, top_k, nodes)
    return target_nodes * remote, top_k * (per_node - 1) / per_node


def node_limited(config: Any, ep_nodes: int) -> bool:
    """Whether group-limited routing is node-limited over an EP group spanning `ep_nodes` nodes: one expert group
    per node (n_group = nodes) and fewer groups per token than nodes."""
    return ep_nodes > 1 and config.n_group == ep_nodes and config.topk_group < ep_nodes


def activated_flops_per_token(config: Any, seq_len: int, activated: int | None = None) -> float:
    """MFU's count for DeepSeek-V3 (6·N + attention, `gpus.model_flops_per_token`'s rule): N the activated
    parameters (`activated`, else counted) less the embedding lookup, plus the MTP modules' own activated weights
    and their pass through the shared head; attention over the whole s×s square, (d_qk + d_v) channels per head,
    in the l + D blocks."""
    activated = parameter_counts(config)["activated"] if activated is None else activated
    h = config.n_embd
    lookup = config.vocab_size * h
    mtp_block = latent_attention_parameters(config, 1) + _activated_feed_forward(config)
    mtp = config.mtp_depth * (3 * h + 2 * h * h + mtp_block + config.vocab_size * h)
    blocks = config.n_layer + config.mtp_depth
    attention = 6 * blocks * seq_len * config.n_head * (query_key_dim(config) + config.v_head_dim)
    return 6 * (activated - lookup + mtp) + attention


def _activated_feed_forward(config: Any) -> int:
    h = config.n_embd
    if not config.n_experts:
        return 3 * h * config.ffn_width
    return 3 * h * config.moe_ffn_hidden * (config.moe_top_k + config.n_shared_experts) + h * config.n_experts
