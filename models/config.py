"""The model's choices: `GPTConfig`, the family and shape of one transformer (GPT-2, Llama, Mixtral, DeepSeek-V3),
with the checks that reject a shape no model can have. Light on purpose (no NumPy): the command line reads its
defaults from here (`mpiparallel.train.settings`), so every default is written once, in this dataclass.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

from .tensors import parameter_shapes

DEEPSEEK_V3 = "deepseek_v3"
ARCHITECTURES = ("gpt2", "llama", DEEPSEEK_V3)
MOE_KEYS = ("n_experts", "moe_top_k", "moe_renormalize", "moe_aux_coef", "moe_capacity_factor", "moe_bias_rate")
"""The MoE fields of GPTConfig that config.json gains for a model with experts (`models.families`)."""


@dataclass(frozen=True)
class GPTConfig:
    """The model: its family and shape. Field names follow transformers.GPT2Config; the Llama family's choices
    are named after LlamaConfig's (`models.families` maps both ways).

    `arch` "gpt2": learned positions, LayerNorm, multi-head attention with biases, a 4·n_embd GELU MLP, the head
    tied to wte. `arch` "llama": RoPE (`rope_theta`, `rope_scaling` e.g. {"rope_type": "llama3", …}), RMSNorm
    (`rms_norm_eps`), grouped-query attention with `n_kv_head` KV heads (0: n_head), a SwiGLU MLP `ffn_hidden`
    wide (0: 8/3·n_embd rounded up to a multiple of 64), no biases, the head untied unless `tie_embeddings`.

    n_experts > 0 replaces every block's MLP by a mixture of that many experts of the family's MLP
    (`models.moe`; Mixtral for llama): each token goes to the moe_top_k best; moe_renormalize makes its gates sum
    to 1; moe_aux_coef weighs the Switch load-balancing loss; moe_capacity_factor C caps each expert at
    ⌈C·K·tokens/E⌉ rows per token set (0: unlimited); moe_bias_rate R > 0 turns on aux-loss-free balancing (the
    trainer updates the expert biases).

    `arch` "deepseek_v3" (`models.deepseek_v3`): the llama choices with multi-head latent attention (q_lora_rank
    None: one query projection; kv_lora_rank, qk_nope_head_dim, qk_rope_head_dim, v_head_dim; RoPE pairs
    interleaved when rope_interleave) and, from block first_k_dense_replace on, DeepSeekMoE: n_experts routed
    experts moe_ffn_hidden wide with a sigmoid router (groups: n_group, topk_group; gates × routed_scaling_factor,
    normalized when moe_renormalize), n_shared_experts shared ones, moe_seq_aux_coef the sequence-wise balance
    loss's α; moe_bias_rate drives the selection bias (e_score_correction_bias). mtp_depth D > 0 adds D
    multi-token-prediction modules to the head unit (`models.multi_token`), their losses weighted mtp_weight / D.
    """

    vocab_size: int = 256
    n_positions: int = 1024
    n_embd: int = 128
    n_layer: int = 4
    n_head: int = 4
    n_experts: int = 0
    moe_top_k: int = 2
    moe_renormalize: bool = True
    moe_aux_coef: float = 0.01
    moe_capacity_factor: float = 0.0
    moe_bias_rate: float = 0.0
    arch: str = "gpt2"
    n_kv_head: int = 0
    ffn_hidden: int = 0
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    rms_norm_eps: float = 1e-5
    tie_embeddings: bool | None = None
    q_lora_rank: int | None = None
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    rope_interleave: bool = True
    moe_ffn_hidden: int = 0
    n_shared_experts: int = 0
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    first_k_dense_replace: int = 0
    moe_seq_aux_coef: float = 0.0
    mtp_depth: int = 0
    mtp_weight: float = 0.3

    def __post_init__(self) -> None:
        for name in ("vocab_size", "n_positions", "n_embd", "n_layer", "n_head"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.arch not in ARCHITECTURES:
            raise ValueError(f"arch must be one of {ARCHITECTURES}, got {self.arch!r}")
        if self.n_embd % self.n_head and not self.is_deepseek:
            raise ValueError(f"n_embd ({self.n_embd}) must be divisible by n_head ({self.n_head})")
        if self.n_kv_head < 0 or self.ffn_hidden < 0:
            raise ValueError(f"n_kv_head and ffn_hidden must be >= 0 (0: the default), got {self.n_kv_head} and "
                             f"{self.ffn_hidden}")
        if self.n_head % self.kv_heads:
            raise ValueError(f"n_head ({self.n_head}) must be divisible by n_kv_head ({self.kv_heads}): each KV head "
                             f"serves an equal group of query heads")
        if self.arch == "gpt2":
            self._check_gpt2_choices()
        elif self.is_deepseek:
            _check_deepseek_choices(self)
        elif self.head_dim % 2:
            raise ValueError(f"RoPE rotates channel pairs: the head size n_embd/n_head ({self.head_dim}) must be even")
        if self.n_experts < 0:
            raise ValueError(f"n_experts must be >= 0 (0: a dense MLP), got {self.n_experts}")
        if self.n_experts and not 1 <= self.moe_top_k <= self.n_experts:
            raise ValueError(f"moe_top_k must be between 1 and n_experts ({self.n_experts}), got {self.moe_top_k}")
        for name in ("moe_aux_coef", "moe_capacity_factor", "moe_bias_rate"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")

    def _check_gpt2_choices(self) -> None:
        if self.kv_heads != self.n_head:
            raise ValueError("GPT-2 has multi-head attention: n_kv_head is a llama setting (use arch llama)")
        if self.ffn_hidden not in (0, 4 * self.n_embd):
            raise ValueError(f"GPT-2's MLP is 4·n_embd = {4 * self.n_embd} wide: ffn_hidden is a llama setting")
        if self.tie_embeddings is False:
            raise ValueError("GPT-2 ties its LM head to the token embedding: --no-tie-embeddings needs arch llama")

    @property
    def is_llama(self) -> bool:
        """The llama family's choices (RoPE, RMSNorm, SwiGLU, no biases): llama and deepseek_v3."""
        return self.arch in ("llama", DEEPSEEK_V3)

    @property
    def is_deepseek(self) -> bool:
        return self.arch == DEEPSEEK_V3

    def is_moe_layer(self, layer: int) -> bool:
        """Whether block `layer` has experts (all of a MoE model's but DeepSeek's first_k_dense_replace)."""
        return bool(self.n_experts) and layer >= self.first_k_dense_replace

    @property
    def kv_heads(self) -> int:
        """KV heads: n_kv_head, or n_head (multi-head attention) when 0."""
        return self.n_kv_head or self.n_head

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

    @property
    def ffn_width(self) -> int:
        """The MLP's hidden units: 4·n_embd for GPT-2; llama's ffn_hidden, by default 8/3·n_embd rounded up to a
        multiple of 64 (Llama's rule without its multiplier)."""
        if not self.is_llama:
            return 4 * self.n_embd
        return self.ffn_hidden or 64 * -(-(8 * self.n_embd) // (3 * 64))

    @property
    def tied(self) -> bool:
        """Whether the LM head is the token embedding (always for GPT-2; llama only with tie_embeddings)."""
        return not self.is_llama or bool(self.tie_embeddings)

    @property
    def head_reads_embedding(self) -> bool:
        """Whether the head unit reads wte too: a tied head, or multi-token prediction's next-token lookups."""
        return self.tied or bool(self.mtp_depth)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def moe_settings(self) -> dict[str, Any]:
        """The MoE keys config.json gains (`MOE_KEYS`); none for a dense model."""
        return {key: getattr(self, key) for key in MOE_KEYS} if self.n_experts else {}

    def parameter_count(self) -> int:
        return sum(math.prod(shape) for shape in parameter_shapes(self).values())


LATENT_DIMENSIONS = ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")


def _check_deepseek_choices(config: Any) -> None:
    """Raise ValueError naming the first DeepSeek-V3 setting that cannot build a model."""
    for name in LATENT_DIMENSIONS:
        if getattr(config, name) < 1:
            raise ValueError(f"deepseek_v3 needs {name} >= 1, got {getattr(config, name)}")
    if config.n_kv_head not in (0, config.n_head):
        raise ValueError("multi-head latent attention has no KV heads to group: n_kv_head is a llama setting")
    if config.q_lora_rank is not None and config.q_lora_rank < 1:
        raise ValueError(f"q_lora_rank must be >= 1, or None for one query projection; got {config.q_lora_rank}")
    if config.qk_rope_head_dim % 2:
        raise ValueError(f"RoPE rotates channel pairs: qk_rope_head_dim ({config.qk_rope_head_dim}) must be even")
    if config.mtp_depth < 0 or (config.mtp_depth and config.mtp_weight <= 0):
        raise ValueError(f"mtp_depth must be >= 0 and mtp_weight > 0 with it, got {config.mtp_depth} and "
                         f"{config.mtp_weight}")
    if not 0 <= config.first_k_dense_replace <= config.n_layer:
        raise ValueError(f"first_k_dense_replace must be between 0 and n_layer ({config.n_layer}), "
                         f"got {config.first_k_dense_replace}")
    if config.n_experts:
        if config.moe_ffn_hidden < 1 or config.n_shared_experts < 0:
            raise ValueError(f"DeepSeekMoE needs moe_ffn_hidden >= 1 and n_shared_experts >= 0, got "
                             f"{config.moe_ffn_hidden} and {config.n_shared_experts}")
        if config.moe_aux_coef:
            raise ValueError("deepseek_v3 balances its experts with the expert bias (--moe-bias-rate) and the "
                             "sequence-wise loss (--moe-seq-aux-coef), not the Switch loss: moe_aux_coef must be 0")
        check_groups(config.n_experts, config.moe_top_k, config.n_group, config.topk_group)


def check_groups(n_experts: int, top_k: int, n_group: int, topk_group: int) -> None:
    """Group-limited routing's shape rules, one ValueError naming the broken one."""
    if n_group < 1 or n_experts % n_group:
        raise ValueError(f"n_group ({n_group}) must be at least 1 and divide the routed experts ({n_experts})")
    if not 1 <= topk_group <= n_group:
        raise ValueError(f"topk_group must be between 1 and n_group ({n_group}), got {topk_group}")
    if n_group > 1 and n_experts // n_group < 2:
        raise ValueError(f"a group's score is the sum of its 2 best experts: n_group ({n_group}) leaves "
                         f"{n_experts // n_group} expert(s) per group")
    if top_k > topk_group * (n_experts // n_group):
        raise ValueError(f"top_k ({top_k}) exceeds the experts of the topk_group ({topk_group}) kept groups "
                         f"({topk_group * (n_experts // n_group)})")
