"""The transformer of every family: token embedding (+ learned positions for GPT-2; RoPE inside attention for
Llama), n_layer pre-norm blocks, final norm, LM head (tied to wte for GPT-2, untied by default for Llama);
`GPTConfig.arch` names the family, `models.families` maps its checkpoint names.

The model is a row of units — the embedding (unit 0), each block (units 1 … n_layer) and the head (final
LayerNorm, tied LM head and cross-entropy: unit n_layer + 1) — and runs any contiguous range of them, so a
pipeline stage is a range and the whole model the range that covers all:

    loss, saved = model.forward(tokens, targets)                     # every unit
    model.backward(saved)                                            # fills every param.grad
    x, saved_a = model.forward(tokens, units=range(0, a))            # a first stage: hands x on
    loss, saved_b = model.forward(x, targets, units=range(a, end))   # the last stage
    dx = model.backward(saved_b)                                     # d(x), for the first stage
    model.backward(saved_a, dx)

The model holds no activations: `saved` (one per microbatch and range) does, and `backward_input` /
`backward_weights` split backward as the layers do (`models.layers`). Initialization is normal(0, 0.02),
residual projections normal(0, 0.02/√(2·n_layer)), biases 0, LayerNorm 1/0 — each tensor drawn from a generator
seeded by (seed, its name), so every parallel layout of the model starts from the same numbers.

With `GPTConfig.n_experts` > 0 every block's MLP is a mixture of experts (`models.moe`): parameters
`h.{i}.mlp.router.weight` [n_embd, E] and the experts' `h.{i}.mlp.experts.{e}.c_fc/c_proj.{weight,bias}`
(initialized as the MLP's, c_proj residual-scaled), and state `h.{i}.mlp.router.expert_bias` [E]
(`Transformer.expert_biases`, zeros). The loss then includes the experts' aux losses (`Transformer.forward` says how).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np

from collectives.backend import BFLOAT16, Array, get_array_module, like, to_host

from . import deepseek_v3, host_memory
from .axis import Axis, ContextAxis, ExpertAxis, PipelineAxis, TensorAxis
from .config import GPTConfig
from .documents import ONE_DOCUMENT, Documents, OneDocument
from .fp8 import fp8_gemms
from .layers import (
    GELU,
    MLP,
    PLAIN_GEMMS,
    QUERY_BLOCK,
    RECOMPUTE_MODES,
    Block,
    ConcatenatedLinear,
    KVCache,
    LayerNorm,
    Linear,
    LMHead,
    RMSNorm,
    Saved,
    SwiGLU,
)
from .moe import MOE_AUX_SCOPES, MixtureOfExperts, MoEBlock, Router, expert_index
from .parameter import Parameter, seeded_normal, shard_tensor
from .precision import Narrowed, dtype_named, is_narrow, narrow
from .rotary import RotaryEmbedding
from .tensors import expert_bias_name, expert_bias_shapes, parameter_shapes


def units_using(name: str, n_layer: int, tied: bool = True) -> tuple[int, ...]:
    """The units whose computation reads parameter `name` (unit 0 the embedding, 1 … n_layer the blocks,
    n_layer + 1 the head): a tied token embedding is read twice, by the embedding and by the head."""
    short = name.removeprefix("transformer.")
    if short == "wte.weight":
        return (0, n_layer + 1) if tied else (0,)
    if short == "wpe.weight":
        return (0,)
    if short.startswith(("ln_f.", "mtp.")) or short == "lm_head.weight":
        return (n_layer + 1,)
    return (int(short.split(".")[1]) + 1,)  # h.{i}.…


RESIDUAL_PROJECTIONS = (".c_proj.weight", ".o_proj.weight", ".down_proj.weight")
"""The linears whose output is added to the residual stream: initialized with std 0.02/√(2·n_layer)."""


def initial_value(name: str, shape: tuple[int, ...], config: GPTConfig, seed: int, dtype: Any) -> np.ndarray:
    """The contract's initialization of one parameter, as a NumPy array: norms' weights 1, biases 0, residual
    projections normal(0, 0.02/√(2·n_layer)), every other weight normal(0, 0.02) — for both families."""
    if name.endswith((".ln_1.weight", ".ln_2.weight", "ln_f.weight", "norm.weight")):  # and MLA's, MTP's norms
        return np.ones(shape, dtype)
    if name.endswith(".bias"):
        return np.zeros(shape, dtype)
    std = 0.02 / math.sqrt(2 * config.n_layer) if name.endswith(RESIDUAL_PROJECTIONS) else 0.02
    return seeded_normal(seed, name, shape, std, np.dtype(dtype))


class ParameterHooks:
    """Called around each unit in forward and backward; the base class does nothing.

    `before_backward(u)` comes before unit u's first backward pass, `after_backward(u)` once its weight
    gradients are complete. Data parallelism starts a unit's gradient reduction in `after_backward`; ZeRO-3
    gathers a unit's sharded parameters in `before_forward`/`before_backward` and frees them in the `after_`
    calls.
    """

    def before_forward(self, unit: int) -> None:
        pass

    def after_forward(self, unit: int) -> None:
        pass

    def before_backward(self, unit: int) -> None:
        pass

    def after_backward(self, unit: int) -> None:
        pass


NO_HOOKS = ParameterHooks()


class Transformer:
    """The serial model of every family (GPT-2, Llama, Mixtral, DeepSeek-V3: `GPTConfig.arch`) with hand-written
    backward.

    `recompute` is the activation recomputation mode ("none", "selective", "full"; see `models.layers`) and
    `query_block` the attention's query block length; neither changes the numbers. Mixture of experts
    (config.n_experts > 0): `moe_token_sets` is how many local token sets (microbatches × DP·CP ranks) one
    optimizer step averages the aux losses over — each set's aux loss enters the objective divided by it —
    unless `moe_aux_scope` is "global": one aux loss over the step, from the counts `set_step_routing` gives
    (`models.moe`). The expert biases are state in `expert_biases` (by checkpoint name), not parameters.

    Parallel axes enter through `parallelize` (`models.axis`): a pipeline stage holds only its units (the others
    are None in `units`/`blocks`), tensor parallelism its shards, context parallelism takes this CP rank's two
    zigzag chunks of every sequence, expert parallelism holds and runs only this rank's experts.
    """

    loss_scale: float = 1.0  # float16's loss scaling: forward returns, and backward differentiates, S·objective

    def __init__(self, config: GPTConfig, seed: int = 0, dtype: Any = np.float32, xp: Any = np,
                 recompute: str = "none", query_block: int = QUERY_BLOCK, moe_token_sets: int = 1,
                 compute_dtype: Any = None, grad_dtype: Any = None, fp8: str = "none",
                 moe_aux_scope: str = "local") -> None:
        if moe_token_sets < 1:
            raise ValueError(f"moe_token_sets must be at least 1, got {moe_token_sets}")
        if moe_aux_scope not in MOE_AUX_SCOPES:
            raise ValueError(f"moe_aux_scope must be one of {MOE_AUX_SCOPES}, got {moe_aux_scope!r}")
        self.moe_aux_scope = moe_aux_scope
        if recompute not in RECOMPUTE_MODES:
            raise ValueError(f"recompute must be one of {RECOMPUTE_MODES}, got {recompute!r}")
        self.config, self.moe_token_sets = config, moe_token_sets
        self.recompute, self.query_block = recompute, query_block
        self._set_precision(dtype, compute_dtype, grad_dtype, fp8)
        self.pp, self.tp, self.cp, self.ep = PipelineAxis(), TensorAxis(), ContextAxis(), ExpertAxis()
        if xp is np:  # each step frees what the next allocates again: keep it (models.host_memory)
            host_memory.keep_freed_memory()
        self._build(lambda name, shape: xp.asarray(initial_value(name, shape, config, seed, dtype)))

    def parallelize(self, *axes: Axis) -> Transformer:
        """Split this serial model over `axes` (`models.axis`: at most one each of pp, tp, cp, ep): each takes
        its place (`model.pp`, `.tp`, `.cp`, `.ep`) and the layers are rebuilt, every parameter this rank's piece
        of the serial value held now — so a parallel model starts from the serial model's numbers, and weights
        loaded afterwards are cut the same way. The serial model and this rank's pieces are held together until it
        returns (for GPT-2 124M on tp2: 0.8 s after a 2 s serial build). Returns the model."""
        if self.parallel_axes():
            raise ValueError(f"parallelize a serial model once: this one is already split over "
                             f"{', '.join(axis.name for axis in self.parallel_axes())}")
        names = [axis.name for axis in axes]
        if len(set(names)) != len(names) or not set(names) <= {"pp", "tp", "cp", "ep"}:
            raise ValueError(f"parallelize takes at most one axis each of pp, tp, cp, ep; got {names}")
        if not axes:
            return self
        for axis in axes:
            axis.fit(self.config)
        serial = {name: param.master if param.master is not None else param.data
                  for name, param in self.params.items()}
        for axis in axes:
            setattr(self, axis.name, axis)
        self._build(lambda name, shape: serial[name])
        return self

    def parallel_axes(self) -> list[Axis]:
        """The axes this model is split over, in the order its parameters are cut."""
        return [axis for axis in (self.pp, self.tp, self.cp, self.ep) if axis.parallel]

    # -- construction: the layer factories, each asking the axis that owns its choice ----------------------------

    def _build(self, serial_value: Any) -> None:
        """Hold this rank's units and parameters (`serial_value(name, shape)`: the serial tensor, cut here) and
        build the layers from them."""
        count = self.unit_count
        self.local_units = tuple(sorted(set(self.pp.held_units(count))))
        if not self.local_units or not all(0 <= unit < count for unit in self.local_units):
            raise ValueError(f"units must be a non-empty subset of 0 … {count - 1}, got {self.local_units}")
        self.params = {name: self._held_parameter(name, serial_value(name, shape))
                       for name, shape in self.local_parameter_shapes().items()}
        self.expert_biases = self._initial_expert_biases()
        config, local, last = self.config, set(self.local_units), count - 1
        rope_dim = config.qk_rope_head_dim if config.is_deepseek else config.head_dim
        self.rope = RotaryEmbedding(rope_dim, config.rope_theta, config.rope_scaling) if config.is_llama else None
        self.embedding = self.tp.embedding(self) if 0 in local else None
        self.blocks = [self._block(i) if i + 1 in local else None for i in range(config.n_layer)]
        self.head = self._output_head() if last in local else None
        self.units = [self.embedding, *self.blocks, self.head]

    def _held_parameter(self, name: str, serial: Array) -> Parameter:
        """The parameter `name` as this rank holds it: each axis's placement, the serial tensor cut along the
        axes that shard it (a copy: the serial tensor is not kept)."""
        placement: dict[str, Any] = {}
        for axis in (self.pp, self.tp, self.ep):
            placement |= axis.placement(name)
        return self._parameter(name, shard_tensor(serial, placement, self.axis_ranks()), placement, serial.shape)

    def _set_precision(self, dtype: Any, compute_dtype: Any, grad_dtype: Any, fp8: str = "none") -> None:
        """The master dtype (`dtype`: the weights as initialized and updated), the compute dtype of the working
        copy and the activations (default: `dtype`), and the gradients' (default: `dtype`): `models.precision`.
        `fp8` "blockwise" runs the GEMMs of every linear inside the blocks in E4M3 with 128-wide tiles
        (`models.fp8`); it needs bfloat16 compute (DeepSeek-V3's recipe: what is not FP8 is BF16)."""
        self.master_dtype = np.dtype(dtype)
        self.compute_dtype = dtype_named(compute_dtype or dtype)
        self.grad_dtype = dtype_named(grad_dtype or dtype)
        if fp8 != "none" and self.compute_dtype != BFLOAT16:
            raise ValueError(f"--fp8 {fp8} needs --compute-dtype bfloat16 (DeepSeek-V3's recipe: what is not FP8 is "
                             f"bfloat16), got --compute-dtype {self.compute_dtype.name}")
        self.fp8 = fp8
        self.gemms = fp8_gemms(fp8) or PLAIN_GEMMS

    def _parameter(self, name: str, value: Array, placement: Any, full_shape: Any = None) -> Parameter:
        """A parameter at the compute dtype; when that is narrower than the master dtype, it keeps `value` as its
        master copy and holds the rounded working copy."""
        if is_narrow(self.compute_dtype):
            return Parameter(name, narrow(value, self.compute_dtype), placement, full_shape, self.grad_dtype,
                             master=value)
        return Parameter(name, value.astype(self.compute_dtype, copy=False), placement, full_shape, self.grad_dtype)

    def narrowed(self, layer: Any, statistics: tuple[str, ...] = ()) -> Any:
        """`layer` run in float32 on narrow tensors when the compute dtype is narrow (`models.precision.Narrowed`)."""
        return Narrowed(layer, self.compute_dtype, statistics) if is_narrow(self.compute_dtype) else layer

    def local_parameter_shapes(self) -> dict[str, tuple[int, ...]]:
        """`parameter_shapes` of the parameters the local units read (of the experts, only this EP rank's), in
        checkpoint order."""
        local, experts = set(self.local_units), self.ep.held_experts(self.config.n_experts)
        return {name: shape for name, shape in parameter_shapes(self.config).items()
                if local & set(self.units_of(name)) and expert_index(name) in (None, *experts)}

    def units_of(self, name: str) -> tuple[int, ...]:
        """The units that read parameter (or expert bias) `name` (`units_using`)."""
        return units_using(name, self.config.n_layer, self.config.head_reads_embedding)

    def _initial_expert_biases(self) -> dict[str, Array]:
        """Zero expert biases for the local blocks, with the parameters' array library and dtype."""
        like_params = next(iter(self.params.values())).data
        xp, local = get_array_module(like_params), set(self.local_units)
        return {name: xp.zeros(shape, like_params.dtype) for name, shape in expert_bias_shapes(self.config).items()
                if local & set(self.units_of(name))}

    def head_weight(self) -> Parameter:
        """The LM head's [vocab, n_embd] weight: the token embedding when tied, else lm_head.weight."""
        return self.params["transformer.wte.weight" if self.config.tied else "lm_head.weight"]

    def _block(self, i: int) -> Block:
        if self.config.is_deepseek:
            return deepseek_v3.block(self, i)
        prefix, tp = f"transformer.h.{i}", self.tp
        if self.config.is_llama:
            qkv = tp.concatenated(self, [f"{prefix}.attn.{name}_proj" for name in "qkv"], key_value=True)
            attention = self._attention(qkv, tp.row_parallel(self, f"{prefix}.attn.o_proj"))
        else:
            attention = self._attention(tp.column_parallel(self.linear(f"{prefix}.attn.c_attn")),
                                        tp.row_parallel(self, f"{prefix}.attn.c_proj"))
        if self.config.n_experts:
            block, mlp = MoEBlock, self._mixture_of_experts(i)
        else:
            block, mlp = Block, self.mlp(f"{prefix}.mlp")
        return block(self.norm(f"{prefix}.ln_1"), attention, self.norm(f"{prefix}.ln_2"), mlp,
                     recompute_full=self.recompute == "full")

    def _attention(self, qkv: Any, projection: Any) -> Any:
        """Causal self-attention of this rank's heads (`tp`), over the whole sequence or its CP chunks (`cp`)."""
        return self.cp.attention(qkv, projection, self.tp.heads(self.config.n_head),
                                 n_kv_head=self.tp.kv_heads(self.config.kv_heads), rope=self.rope,
                                 query_block=self.query_block, keep_probabilities=self.recompute != "selective")

    def _output_head(self) -> Any:
        """The head unit: the final norm, the head and its cross-entropy (and DeepSeek-V3's MTP modules)."""
        head = LMHead(self.norm("transformer.ln_f"), self.tp.cross_entropy(self))
        if self.config.is_deepseek and self.config.mtp_depth:
            return deepseek_v3.multi_token_head(self, head)
        return head

    def mlp(self, prefix: str) -> MLP:
        """GPT-2's c_fc, GELU, c_proj, or llama's [gate | up], SwiGLU, down (column- then row-parallel)."""
        tp = self.tp
        if self.config.is_llama:
            return MLP(tp.concatenated(self, [f"{prefix}.gate_proj", f"{prefix}.up_proj"]),
                       tp.row_parallel(self, f"{prefix}.down_proj"), self.narrowed(SwiGLU()))
        return MLP(tp.column_parallel(self.linear(f"{prefix}.c_fc")), tp.row_parallel(self, f"{prefix}.c_proj"),
                   self.narrowed(GELU()))

    def expert(self, prefix: str) -> MLP:
        """One expert: the family's MLP, unsplit (experts are whole on the rank that holds them)."""
        if self.config.is_llama:
            return MLP(self.narrowed(ConcatenatedLinear([self.params[f"{prefix}.gate_proj.weight"],
                                                         self.params[f"{prefix}.up_proj.weight"]],
                                                        gemms=self.gemms)),
                       self.linear(f"{prefix}.down_proj"), self.narrowed(SwiGLU()))
        return MLP(self.linear(f"{prefix}.c_fc"), self.linear(f"{prefix}.c_proj"), self.narrowed(GELU()))

    def held_experts(self, prefix: str) -> list[MLP]:
        """The routed experts of the MoE layer `prefix` that this rank holds (`ep`)."""
        return [self.expert(f"{prefix}.experts.{e}") for e in self.ep.held_experts(self.config.n_experts)]

    def _mixture_of_experts(self, i: int) -> MixtureOfExperts:
        config, prefix = self.config, f"transformer.h.{i}.mlp"
        router = Router(self.params[f"{prefix}.router.weight"], config.moe_top_k, config.moe_renormalize,
                        config.moe_capacity_factor, config.moe_aux_coef, aux_weight=self.aux_weight(),
                        expert_bias=self.expert_biases[expert_bias_name(i)])
        return self.ep.mixture(router, self.held_experts(prefix), fp8_dispatch=self.fp8 != "none")

    def weight_and_bias(self, prefix: str) -> tuple[Parameter, Parameter | None]:
        """A layer's weight and its bias (None where the family has none: llama)."""
        return self.params[f"{prefix}.weight"], self.params.get(f"{prefix}.bias")

    def norm(self, prefix: str) -> Any:
        """The family's norm: LayerNorm (GPT-2) or RMSNorm (llama)."""
        if self.config.is_llama:
            norm = RMSNorm(self.params[f"{prefix}.weight"], self.config.rms_norm_eps)
        else:
            norm = LayerNorm(*self.weight_and_bias(prefix))
        return self.narrowed(norm, statistics=norm.kept_wide)  # 1/std and the weights' gradients stay float32

    def linear(self, prefix: str) -> Any:
        """A linear inside a block: the model's GEMMs (FP8 with --fp8), at the compute dtype."""
        return self.narrowed(Linear(*self.weight_and_bias(prefix), gemms=self.gemms))

    # -- parameters ------------------------------------------------------------------------------------------

    def parameters(self) -> list[Parameter]:
        """Parameters in checkpoint order."""
        return list(self.params.values())

    def zero_grad(self) -> None:
        for param in self.params.values():
            param.zero_grad()

    def unit_parameters(self) -> list[list[Parameter]]:
        """The parameters each unit reads, in forward order: the embedding (wte, wpe), every block, and the head
        (final LayerNorm, then the tied wte); empty for units held elsewhere. Hooks are called per unit (see
        `ParameterHooks`)."""
        by_unit: list[list[Parameter]] = [[] for _ in range(self.unit_count)]
        for param in self.params.values():
            for unit in self.units_of(param.name):
                if unit in self.local_units:
                    by_unit[unit].append(param)
        head = by_unit[-1]
        head.sort(key=lambda param: param.name.endswith("wte.weight"))  # the tied weight closes the head
        return by_unit

    def check_tokens(self, tokens: Array) -> None:
        length = tokens.shape[-1]
        if length > self.config.n_positions:
            raise ValueError(f"sequence length {length} exceeds n_positions {self.config.n_positions}")
        for axis in (self.tp, self.cp):
            axis.check_tokens(length)

    def positions(self, length: int) -> Array | None:
        """The global positions of `length` local tokens: None (0 … length−1) unless context parallelism holds
        other positions (`ContextAxis.positions`)."""
        return self.cp.positions(length)

    def token_positions(self, length: int, documents: Documents | OneDocument = ONE_DOCUMENT) -> Array | None:
        """The positions the embedding gives `length` local tokens: their window positions (`positions`), or
        with packed documents their positions inside their documents (B, length); on the parameters' device."""
        positions = self.positions(length)
        if documents is not ONE_DOCUMENT:
            positions = documents.rotary_positions(np.arange(length) if positions is None else positions)
        return None if positions is None else like(self.params["transformer.wte.weight"].data, positions)

    # -- forward and backward over a range of units ------------------------------------------------------------

    @property
    def unit_count(self) -> int:
        return self.config.n_layer + 2

    def forward(self, inputs: Array, targets: Array | None = None, normalizer: float | None = None,
                hooks: ParameterHooks = NO_HOOKS, units: range | None = None,
                documents: Documents | OneDocument = ONE_DOCUMENT) -> tuple[Any, Saved]:
        """Run `units` (default: all) forward; return their output and the saved state for backward.

        `inputs` are (B, T) token ids when the range starts with the embedding, else the (B, T, C) activation the
        previous unit produced. When the range ends with the head, the output is the cross-entropy of predicting
        `targets`: sum of token losses / `normalizer` (default: the tokens here — pass the global batch's token
        count when this is one microbatch or one data-parallel shard, so the pieces add up to the global mean);
        otherwise it is the activation to hand to the next range.

        `documents` (`models.documents`) are the packed documents of the whole windows these rows come from
        (before context parallelism took this rank's chunks): each token attends only to its own document and
        sits at its position in it. By default each window is one document (causal attention).

        Mixture of experts: `saved.router_stats` maps each MoE layer run here to its `RouterStats`, and
        `saved.aux_loss` is their aux losses divided by `moe_token_sets` — this token set's share of the
        objective's aux term, whose gradient backward adds. A range ending with the head returns the
        cross-entropy plus that share (so the cross-entropy alone is the return value minus `saved.aux_loss`); a
        range without the head returns an activation, and its layers' share is only in `saved.aux_loss`.
        """
        units = range(self.unit_count) if units is None else units
        missing = [unit for unit in units if unit not in self.local_units]
        if missing:
            raise ValueError(f"units {missing} are not held here (this model holds {list(self.local_units)})")
        self._check_documents(documents, inputs.shape[1])
        saved = Saved(units=units, per_unit={}, router_stats={}, aux_loss=0.0)
        x = inputs
        for unit in units:
            hooks.before_forward(unit)
            x, saved.per_unit[unit] = self._forward_unit(unit, x, targets, normalizer, documents)
            self._note_routing(unit, saved)
            hooks.after_forward(unit)
        if saved.router_stats and units[-1] == self.unit_count - 1:
            x += saved.aux_loss
        return x, saved

    @contextmanager
    def scaled_objective(self, scale: float) -> Iterator[None]:
        """Inside, the objective is scaled by `scale`: the cross-entropy (its normalizer divided by it) and each
        router's aux-loss weight, so forward returns and backward differentiates scale·objective; the caller
        divides the gradients by the same scale before using them (loss scaling, float16). On leaving, the plain
        objective again (validation's loss is never scaled)."""
        self._set_loss_scale(scale)
        try:
            yield
        finally:
            self._set_loss_scale(1.0)

    def _set_loss_scale(self, scale: float) -> None:
        self.loss_scale = scale
        for router in self.routers().values():
            router.aux_weight = self.aux_weight(scale) * router.shares

    def aux_weight(self, scale: float = 1.0) -> float:
        """d(objective)/d(a token set's aux loss): 1/(token sets) for the local aux loss (the step averages
        them), 1 for the global one (the sets' shares sum to it); times the loss scale."""
        return scale if self.moe_aux_scope == "global" else scale / self.moe_token_sets

    def sequence_groups(self) -> list[Any]:
        """The communicators over which each sequence's tokens are split: cp's, and tp's under sequence
        parallelism (none in the serial model)."""
        return [*self.cp.sequence_groups(), *self.tp.sequence_groups()]

    def routers(self) -> dict[int, Any]:
        """The router of each MoE block held here, by block index."""
        found = {}
        for index, block in enumerate(self.blocks):
            router = getattr(getattr(block, "mlp", None), "router", None)
            if router is not None:
                found[index] = router
        return found

    def set_step_routing(self, counts: dict[int, np.ndarray] | None, tokens: int = 0) -> None:
        """The global aux loss: each MoE block's assignments per expert over the step's every token set
        (`counts` by block index) and the step's token count; None: each set balanced by its own counts."""
        for index, router in self.routers().items():
            router.step_counts = None if counts is None else counts[index]
            router.step_tokens = tokens

    def _note_routing(self, unit: int, saved: Saved) -> None:
        """Keep an MoE block's router statistics and add its aux loss's share of the objective."""
        stats = getattr(saved.per_unit[unit], "router_stats", None)
        if stats is not None:
            saved.router_stats[unit - 1] = stats
            saved.aux_loss += stats.aux_loss * self.blocks[unit - 1].mlp.router.aux_weight

    def _check_documents(self, documents: Documents | OneDocument, local_length: int) -> None:
        if documents is ONE_DOCUMENT:
            return
        if self.config.is_deepseek and self.config.mtp_depth:
            raise ValueError("document attention with multi-token prediction is not built: a prediction module's "
                             "targets would cross into the next document (use mtp_depth 0)")
        if documents.length != local_length * self.cp.size:
            raise ValueError(f"the documents describe windows of {documents.length} tokens, these hold "
                             f"{local_length * self.cp.size}")

    def _forward_unit(self, unit: int, x: Array, targets: Array | None, normalizer: float | None,
                      documents: Documents | OneDocument) -> Any:
        if unit == 0:
            self.check_tokens(x)
            tokens = like(self.embedding.token.data, x)  # host token ids go to the device
            return self.embedding.forward(tokens, positions=self.token_positions(x.shape[-1], documents))
        if unit < self.unit_count - 1:
            return self.blocks[unit - 1].forward(x, documents)
        if targets is None:
            raise ValueError("the head unit computes the loss: give the targets")
        return self.head.forward(x, like(x, targets), (normalizer or targets.size) / self.loss_scale)

    def backward_input(self, saved: Saved, dout: Array | None = None,
                       hooks: ParameterHooks = NO_HOOKS) -> Array | None:
        """The input passes of `saved`'s units, last to first, from d(output) `dout` (None when the range ends
        with the loss); returns d(range input) (None when it starts with the embedding). Weight gradients wait
        for `backward_weights`."""
        for unit in reversed(saved.units):
            hooks.before_backward(unit)
            dout = self.units[unit].backward_input(saved.per_unit[unit], dout)
        return dout

    def backward_weights(self, saved: Saved, hooks: ParameterHooks = NO_HOOKS) -> None:
        """The weight passes of `saved`'s units (after `backward_input`); frees the saved state."""
        for unit in reversed(saved.units):
            self.units[unit].backward_weights(saved.per_unit.pop(unit))
            hooks.after_backward(unit)

    def backward(self, saved: Saved, dout: Array | None = None, hooks: ParameterHooks = NO_HOOKS) -> Array | None:
        """Both passes, unit by unit, so each unit's gradients are final as early as possible (data-parallel
        reductions start while earlier units still compute). Returns d(range input)."""
        for unit in reversed(saved.units):
            hooks.before_backward(unit)
            dout = self.units[unit].backward(saved.per_unit.pop(unit), dout)
            hooks.after_backward(unit)
        return dout

    def logits(self, tokens: Array) -> Array:
        """Next-token logits (B, T, vocab) for token ids (B, T); no loss, nothing kept."""
        self._require_whole_vocabulary("the logits")
        x, _ = self.forward(tokens, units=range(self.unit_count - 1))
        return self.head.logits(x)

    # -- inference -------------------------------------------------------------------------------------------

    def generate(self, prompt: Array, new_tokens: int, temperature: float = 1.0, top_k: int | None = None,
                 rng: np.random.Generator | None = None, window: int | None = None) -> Array:
        """Sample `new_tokens` tokens after `prompt` (1-D token ids) with a KV cache; returns only the new ones.

        temperature 0 picks the most likely token; top_k keeps only the k most likely before sampling. When
        the context reaches `window` positions (default n_positions; give the training sequence length, as
        positions beyond it never had their embedding trained), the cache is rebuilt from its most recent half.
        """
        self._require_whole_vocabulary("sampling")
        rng = rng or np.random.default_rng()
        window = min(window or self.config.n_positions, self.config.n_positions)
        context = [int(t) for t in prompt]
        if not context:
            raise ValueError("generate needs a prompt of at least one token")
        generated: list[int] = []
        caches, pending = None, context[-window:]
        while len(generated) < new_tokens:
            if caches is None or caches[0].length + len(pending) > window:
                caches = [KVCache() for _ in self.blocks]
                pending = context[-window // 2:] if generated else pending
            logits = self._next_logits(pending, caches)
            token = sample_token(logits, temperature, top_k, rng)
            generated.append(token)
            context.append(token)
            pending = [token]
        return np.array(generated, dtype=np.int64)

    def _require_whole_vocabulary(self, what: str) -> None:
        if self.tp.parallel:
            raise NotImplementedError(f"{what}: the vocab-parallel head never gathers the logits; use the serial "
                                      f"model, Transformer(config).load_state_dict(full_state_dict(...))")

    def _next_logits(self, tokens: list[int], caches: list[KVCache]) -> np.ndarray:
        """Feed `tokens` through the cached model; return the next-token logits as a NumPy vector."""
        xp = get_array_module(self.params["transformer.wte.weight"].data)
        x, _ = self.embedding.forward(xp.asarray([tokens]), start=caches[0].length)
        for block, cache in zip(self.blocks, caches, strict=True):
            x = block.forward_incremental(x, cache)
        return to_host(self.head.logits(x[:, -1])[0])

    # -- state -----------------------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Array]:
        """Hugging Face name -> this rank's array (the whole tensor in the serial model; the tied lm_head.weight
        is not repeated), then the expert biases of an MoE model."""
        return {name: param.data for name, param in self.params.items()} | self.expert_biases

    def axis_ranks(self) -> dict[str, tuple[int, int]]:
        """Mesh axis -> (this rank's coordinate, axis size) for the axes that shard this model's parameters."""
        return {self.tp.name: (self.tp.rank, self.tp.size)}

    def load_state_dict(self, tensors: dict[str, Array]) -> None:
        """Copy in full (serial) tensors by name, each cut to this rank's shard; names may omit `transformer.`.
        Every parameter must be present; an MoE model's expert biases start at zero where absent."""
        by_short_name = {name.removeprefix("transformer."): value for name, value in tensors.items()}
        for name, param in self.params.items():
            value = _tensor_named(by_short_name, name, param.full_shape)
            shard = shard_tensor(like(param.data, value), param.placement, self.axis_ranks())
            param.data[...] = shard
            if param.master is not None:
                param.master[...] = shard
        for name, bias in self.expert_biases.items():  # absent (a checkpoint from elsewhere): zero, as initialized
            if name.removeprefix("transformer.") in by_short_name:
                bias[...] = like(bias, _tensor_named(by_short_name, name, bias.shape))
            else:
                bias[...] = 0


def _tensor_named(by_short_name: dict[str, Array], name: str, shape: tuple[int, ...]) -> Array:
    """The checkpoint's tensor `name` (looked up without `transformer.`), which must have `shape`."""
    value = by_short_name.get(name.removeprefix("transformer."))
    if value is None:
        raise ValueError(f"checkpoint has no tensor {name}")
    if tuple(value.shape) != tuple(shape):
        raise ValueError(f"checkpoint tensor {name} has shape {tuple(value.shape)}, the model expects {tuple(shape)}")
    return value


def sample_token(logits: np.ndarray, temperature: float, top_k: int | None, rng: np.random.Generator) -> int:
    """Draw one token id from logits: greedy at temperature 0, else softmax(logits / temperature) over the top k."""
    if temperature <= 0:
        return int(np.argmax(logits))
    scaled = logits.astype(np.float64) / temperature
    if top_k is not None and top_k < len(scaled):
        cutoff = np.partition(scaled, -top_k)[-top_k]
        scaled[scaled < cutoff] = -np.inf
    probs = np.exp(scaled - scaled.max())
    return int(rng.choice(len(probs), p=probs / probs.sum()))
