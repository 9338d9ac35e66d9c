"""The model planned, counted: its parameters per unit and rank, the tokens and (query, key) pairs one rank
computes, and its FLOPs per token.

A model is a list of units: the embedding, n_layer blocks, the head. Per block, on one TP rank of tp, with h
channels, d = h/n_head, F the MLP width, E experts:

    GPT-2        LayerNorms 4h, c_attn (3h² + 3h)/tp, c_proj h²/tp + h, MLP (8h² + 5h) with F = 4h, wpe, tied head
    llama        RMSNorms 2h, q and o 2h²/tp, k and v 2·h·n_kv'·d (n_kv' = n_kv/tp, or 1 head replicated on
                 tp/n_kv ranks when tp > n_kv), SwiGLU 3·h·F/tp, no biases, no wpe, final RMSNorm h, lm_head V·h
                 unless tied
    MoE          E/ep experts of the family's MLP (replicated over tp) and a router h·E
    DeepSeek-V3  MLA and DeepSeekMoE, the first blocks dense; the MTP modules on the head's unit (`deepseek`)

The vocabulary is padded to a multiple of tp; the head unit holds the tied embedding's shard too (counted once
when one rank holds both ends). With `--params N` and no shape every count is scaled so the model adds up to N.

Work of one rank: t = b·s/cp tokens of a microbatch of b sequences (the router's and experts': t/tp under SP);
(query, key) pairs of one sequence on a CP rank: Σ over the causal query blocks of rows · keys seen (this
project's attention), s²/cp (dense), s²/(2cp) (flash). FLOPs per token in MFU's count: 6·N + 12·l·h·s
(`gpus.model_flops_per_token`, N the active weights less the input lookups; DeepSeek-V3's with its MTP module:
`deepseek.activated_flops_per_token`); Megatron's count: eq. 3 of Narayanan et al. (`gpus.megatron_flops_per_step`).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace
from functools import cached_property, lru_cache
from typing import Any

import numpy as np

from models.documents import ONE_DOCUMENT, Documents
from models.layers import QUERY_BLOCK, query_blocks
from models.transformer import GPTConfig

from . import deepseek
from .deepseek import DeepSeekShape
from .gpus import megatron_flops_per_step, model_flops_per_token, peak_flops
from .layout import Layout


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
    document_length: int = 0
    """train --attention document: the mean length of the packed documents (0: causal over the whole sequence)."""

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
    units, tied, experts = _scaled_unit_parameters(model, layout.tp, layout.ep)
    return list(units), tied, list(experts)


@lru_cache(maxsize=1024)
def _scaled_unit_parameters(model: Model, tp: int, ep: int) -> tuple[tuple[float, ...], float, tuple[float, ...]]:
    units, tied = unit_parameters(model, tp, ep), tied_parameters(model, tp)
    experts = expert_unit_parameters(model, ep)
    scale = 1.0
    if model.parameters is not None:
        scale = model.parameters / replace(model, parameters=None).total_parameters()
    return tuple(u * scale for u in units), tied * scale, tuple(e * scale for e in experts)


def held_parameters(units: list[int], per_unit: list[float], tied: float) -> float:
    """Parameters of the units one rank holds; the tied embedding once when it holds both ends."""
    count = sum(per_unit[u] for u in units)
    return count - tied if 0 in units and len(per_unit) - 1 in units else count


# -- tokens and (query, key) pairs one rank computes ----------------------------------------------------------

def causal_pairs(seq: int) -> int:
    """(query, key) products the blocked causal attention computes: Σ over query blocks of rows·keys seen."""
    return sum((stop - start) * stop for start, stop in query_blocks(seq, QUERY_BLOCK))


def packed_documents(model: Model, rows: int) -> Any:
    """The documents of `rows` windows packed with documents of `document_length` tokens each (one per window
    without: causal), for the runtime's formulas (`models.documents`)."""
    if not 0 < model.document_length < model.seq_len:
        return ONE_DOCUMENT
    tokens = np.ones((rows, model.seq_len), dtype=np.int64)
    tokens[:, ::model.document_length] = 0
    return Documents.of_tokens(tokens, 0)


def attention_pairs(model: Model, layout: Layout, attention: str) -> float:
    """(query, key) pairs one sequence's attention computes on one CP rank: this project's causal query blocks
    (the whole sequence's, over cp), the whole s×s square ("dense") or its causal half ("flash"). With packed
    documents of mean length L (`document_length`) the causal kinds see only their document: s/L documents of
    L(L+1)/2 pairs ("flash"; blocked as each document's own for this project's), 1/cp of them per CP rank."""
    seq = model.seq_len // layout.cp
    if attention == "dense":
        return seq * model.seq_len
    if 0 < model.document_length < model.seq_len:
        documents, length = model.seq_len / model.document_length, model.document_length
        each = length * length / 2 if attention == "flash" else causal_pairs(length)
        return documents * each / layout.cp
    if attention == "flash":
        return seq * model.seq_len / 2
    return causal_pairs(seq) * layout.cp  # ≈ 1/cp of the sequence's pairs


def moe_tokens(layout: Layout, tokens: int) -> float:
    """Tokens the router and experts of one rank see: all of them on every TP rank (experts are replicated over
    TP), this rank's sequence slice under SP."""
    return tokens / (layout.tp if layout.sp else 1)


# -- FLOPs per token and MFU ------------------------------------------------------------------------------------

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
