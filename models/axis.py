"""How a parallel axis enters the model: the model asks one object per axis whenever it builds a piece that axis
owns. The classes here are the serial answers (one rank, nothing moves); each axis's own module subclasses its
class and overrides what that axis changes:

    axis  asked for                                  serial answer here   parallel answer (mpiparallel.axes.…)
    pp    the units this rank holds                  `PipelineAxis`       pipeline_parallel.PipelineStages
    tp    parameters' shards, the embedding, the     `TensorAxis`         tensor_parallel.TensorParallel
          head's cross-entropy, linears, heads
    cp    the attention, the tokens' positions       `ContextAxis`        context_parallel.ContextParallel
    ep    the experts held, how tokens reach them    `ExpertAxis`         expert_parallel.ExpertParallel

A model starts serial (`Transformer(config)`: `model.pp`, `.tp`, `.cp`, `.ep` are these) and
`model.parallelize(*axes)` puts each axis in its place and rebuilds the layers, every parameter cut from the
serial value the model already holds. So the model's constructor takes no communicator, every axis enters
through the one door, and the serial model reads as if no axis existed.

Why the model asks (factories) rather than each axis rewriting a built model (wrappers, torchtitan's module
swaps): tensor parallelism changes a layer *and* the parameter it is made of, per family (GPT-2's fused c_attn,
llama's q/k/v with grouped KV heads, DeepSeek's latent attention that enters the group once); the model already
knows which piece is which while it builds, and an axis written as a rewrite would have to re-learn every
family's structure from outside. Data parallelism is the one axis that changes no layer: the same model runs on
every replica and only its gradients are summed, so it takes the built model's parameters over and runs as hooks
around each unit (`mpiparallel.axes.data_parallel`).

No communication here.
"""

from __future__ import annotations

from typing import Any

from collectives.backend import Array

from .latent_attention import LatentAttention
from .layers import CausalSelfAttention, ConcatenatedLinear, Embedding, HeadCrossEntropy, Layer
from .moe import MixtureOfExperts, Router
from .parameter import Placement


class Axis:
    """One parallel axis as the model sees it: its name on the mesh, this rank's coordinate along it, and what it
    asks of every model it splits. The serial axis has one rank."""

    name = ""
    rank, size = 0, 1
    comm: Any = None

    def fit(self, config: Any) -> None:
        """Check that this axis can split `config`'s model (ValueError naming the dimension that does not divide),
        and prepare what depends on the model's shape. Called once, before the model is rebuilt."""

    def placement(self, name: str) -> dict[str, Placement]:
        """How this axis holds parameter `name` (`models.parameter`): replicated unless the axis says otherwise."""
        return {}

    def check_tokens(self, length: int) -> None:
        """Raise ValueError when `length` local tokens per sequence cannot be split as this axis needs."""

    def sequence_groups(self) -> list[Any]:
        """The communicators over which this axis splits each sequence's tokens (per-sequence sums need them):
        none here."""
        return []

    @property
    def parallel(self) -> bool:
        return self.size > 1 or self.comm is not None


class PipelineAxis(Axis):
    """Pipeline parallelism's questions. Serial: every unit (the embedding, each block, the head) is held here."""

    name = "pp"

    def held_units(self, unit_count: int) -> tuple[int, ...]:
        return tuple(range(unit_count))


class TensorAxis(Axis):
    """Tensor (and sequence) parallelism's questions, asked with the model that builds (`model`): its
    parameters, its GEMMs and its narrowing of layers to the compute dtype. Serial: whole weights, serial layers."""

    name = "tp"
    sequence_shards = 1  # how many pieces the sequence is cut into between the layers (SP: tp)
    key_value_group: Any = None  # the ranks that hold the same KV heads (tensor parallelism past n_kv)

    def embedding(self, model: Any) -> Layer:
        return Embedding(model.params["transformer.wte.weight"], model.params.get("transformer.wpe.weight"))

    def cross_entropy(self, model: Any) -> Layer:
        return model.narrowed(HeadCrossEntropy(model.head_weight()))

    def column_parallel(self, layer: Layer) -> Layer:
        """A layer whose output units are split over the group (its input must be whole)."""
        return layer

    def row_parallel(self, model: Any, prefix: str) -> Layer:
        """The linear `prefix` whose input units are split over the group (its partial outputs are summed)."""
        return model.linear(prefix)

    def concatenated(self, model: Any, prefixes: list[str], key_value: bool = False) -> Layer:
        """Bias-free projections of one input side by side (llama's q, k, v; gate and up). `key_value`: the last
        two are KV projections (which tensor parallelism may hold on several ranks)."""
        weights = [model.params[f"{prefix}.weight"] for prefix in prefixes]
        return model.narrowed(ConcatenatedLinear(weights, gemms=model.gemms))

    def enter_attention(self, attention: Layer) -> Layer:
        """DeepSeek-V3's latent attention, which enters the group once as a whole."""
        return attention

    def heads(self, n_head: int) -> int:
        """Query heads computed on this rank."""
        return n_head

    def kv_heads(self, n_kv_head: int) -> int:
        """KV heads computed on this rank."""
        return n_kv_head


class ContextAxis(Axis):
    """Context parallelism's questions. Serial: attention over the whole sequence, positions 0 … T−1."""

    name = "cp"

    def attention(self, qkv: Layer, projection: Layer, heads: int, **settings: Any) -> Layer:
        """Causal self-attention of `heads` query heads; `settings`: n_kv_head, rope, query_block,
        keep_probabilities."""
        return CausalSelfAttention(qkv, projection, heads, **settings)

    def latent_attention(self, *layers: Any, **settings: Any) -> Layer:
        """DeepSeek-V3's multi-head latent attention of `layers` (`models.latent_attention.LatentAttention`)."""
        return LatentAttention(*layers, **settings)

    def positions(self, length: int) -> Any:
        """The global positions of `length` local tokens; None: 0 … length−1."""
        return None

    def whole_sequences(self, local: Array) -> Array:
        """The whole sequences of which `local` (B, local tokens) holds this rank's tokens."""
        return local

    def local_tokens(self, whole: Array) -> Array:
        """This rank's tokens of the whole sequences `whole` (B, T): the inverse of `whole_sequences`."""
        return whole


class ExpertAxis(Axis):
    """Expert parallelism's questions. Serial: every expert here, tokens routed in memory."""

    name = "ep"
    traffic: Any = None  # what the exchanges sent, where they exchange (`axes.expert_parallel.ExpertTraffic`)
    dispatch = "flat"

    def held_experts(self, n_experts: int) -> range:
        return range(n_experts)

    def mixture(self, router: Router, experts: list[Any], fp8_dispatch: bool) -> MixtureOfExperts:
        """The layer that routes each token to its experts and combines their outputs."""
        return MixtureOfExperts(router, experts, fp8_dispatch=fp8_dispatch)
