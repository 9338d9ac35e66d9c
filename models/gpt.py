"""GPT-2: token + position embeddings, n_layer pre-LayerNorm blocks, final LayerNorm, LM head tied to wte.

The model owns its parameters (by Hugging Face name) and its layers. `forward(tokens, targets)` returns the
loss and keeps the activations; `backward()` fills every `param.grad`. Initialization is normal(0, 0.02),
residual projections normal(0, 0.02/√(2·n_layer)), biases 0, LayerNorm 1/0 — each tensor drawn from a generator
seeded by (seed, its name), so every parallel layout of the model starts from the same numbers.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from collectives.backend import Array, get_array_module, like, to_host

from .layers import MLP, Block, CausalSelfAttention, Embedding, KVCache, LayerNorm, Linear, TiedHeadCrossEntropy
from .parameter import Parameter, seeded_normal


@dataclass(frozen=True)
class GPTConfig:
    """The model's shape; field names follow transformers.GPT2Config."""

    vocab_size: int = 256
    n_positions: int = 1024
    n_embd: int = 128
    n_layer: int = 4
    n_head: int = 4

    def __post_init__(self) -> None:
        for name in ("vocab_size", "n_positions", "n_embd", "n_layer", "n_head"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.n_embd % self.n_head:
            raise ValueError(f"n_embd ({self.n_embd}) must be divisible by n_head ({self.n_head})")

    def to_dict(self) -> dict[str, int]:
        return asdict(self)

    def parameter_count(self) -> int:
        c, layers = self.n_embd, self.n_layer
        per_block = 2 * 2 * c + (c * 3 * c + 3 * c) + (c * c + c) + (c * 4 * c + 4 * c) + (4 * c * c + c)
        return self.vocab_size * c + self.n_positions * c + layers * per_block + 2 * c


def parameter_shapes(config: GPTConfig) -> dict[str, tuple[int, ...]]:
    """Every parameter's Hugging Face name and shape, in checkpoint order (lm_head.weight is wte, tied)."""
    c = config.n_embd
    shapes = {"transformer.wte.weight": (config.vocab_size, c), "transformer.wpe.weight": (config.n_positions, c)}
    for i in range(config.n_layer):
        block = f"transformer.h.{i}"
        shapes |= {
            f"{block}.ln_1.weight": (c,), f"{block}.ln_1.bias": (c,),
            f"{block}.attn.c_attn.weight": (c, 3 * c), f"{block}.attn.c_attn.bias": (3 * c,),
            f"{block}.attn.c_proj.weight": (c, c), f"{block}.attn.c_proj.bias": (c,),
            f"{block}.ln_2.weight": (c,), f"{block}.ln_2.bias": (c,),
            f"{block}.mlp.c_fc.weight": (c, 4 * c), f"{block}.mlp.c_fc.bias": (4 * c,),
            f"{block}.mlp.c_proj.weight": (4 * c, c), f"{block}.mlp.c_proj.bias": (c,),
        }
    shapes |= {"transformer.ln_f.weight": (c,), "transformer.ln_f.bias": (c,)}
    return shapes


def initial_value(name: str, shape: tuple[int, ...], config: GPTConfig, seed: int, dtype: Any) -> np.ndarray:
    """The contract's initialization of one parameter, as a NumPy array."""
    if name.endswith((".ln_1.weight", ".ln_2.weight", "ln_f.weight")):
        return np.ones(shape, dtype)
    if name.endswith(".bias"):
        return np.zeros(shape, dtype)
    residual_projection = name.endswith((".attn.c_proj.weight", ".mlp.c_proj.weight"))
    std = 0.02 / math.sqrt(2 * config.n_layer) if residual_projection else 0.02
    return seeded_normal(seed, name, shape, std, np.dtype(dtype))


class ParameterHooks:
    """Called around each unit of `GPT.units()` in forward and backward; the base class does nothing.

    Data parallelism starts a unit's gradient reduction in `after_backward`; ZeRO-3 gathers a unit's sharded
    parameters in `before_forward`/`before_backward` and frees them in the `after_` calls.
    """

    def before_forward(self, unit: int) -> None:
        pass

    def after_forward(self, unit: int) -> None:
        pass

    def before_backward(self, unit: int) -> None:
        pass

    def after_backward(self, unit: int) -> None:
        pass


class GPT:
    """The serial GPT-2 model with hand-written backward."""

    def __init__(self, config: GPTConfig, seed: int = 0, dtype: Any = np.float32, xp: Any = np) -> None:
        self.config = config
        self.params = {name: Parameter(name, xp.asarray(initial_value(name, shape, config, seed, dtype)))
                       for name, shape in parameter_shapes(config).items()}
        p = self.params
        self.embedding = Embedding(p["transformer.wte.weight"], p["transformer.wpe.weight"])
        self.blocks = [self._block(i) for i in range(config.n_layer)]
        self.ln_f = LayerNorm(p["transformer.ln_f.weight"], p["transformer.ln_f.bias"])
        self.head = TiedHeadCrossEntropy(p["transformer.wte.weight"])

    def _block(self, i: int) -> Block:
        def weight_and_bias(name: str) -> tuple[Parameter, Parameter]:
            return self.params[f"transformer.h.{i}.{name}.weight"], self.params[f"transformer.h.{i}.{name}.bias"]

        def linear(name: str) -> Linear:
            return Linear(*weight_and_bias(name))

        def layer_norm(name: str) -> LayerNorm:
            return LayerNorm(*weight_and_bias(name))

        attention = CausalSelfAttention(linear("attn.c_attn"), linear("attn.c_proj"), self.config.n_head)
        return Block(layer_norm("ln_1"), attention, layer_norm("ln_2"), MLP(linear("mlp.c_fc"), linear("mlp.c_proj")))

    def parameters(self) -> list[Parameter]:
        """Parameters in checkpoint order."""
        return list(self.params.values())

    def zero_grad(self) -> None:
        for param in self.params.values():
            param.zero_grad()

    def check_tokens(self, tokens: Array) -> None:
        length = tokens.shape[-1]
        if length > self.config.n_positions:
            raise ValueError(f"sequence length {length} exceeds n_positions {self.config.n_positions}")

    def units(self) -> list[list[Parameter]]:
        """The parameters each stage of the computation uses, in forward order: the embedding, every block, and
        the head (final LayerNorm plus the tied wte). Hooks are called per unit (see `ParameterHooks`)."""
        embedding = [self.embedding.token, self.embedding.position]
        blocks = [[p for p in self.params.values() if p.name.startswith(f"transformer.h.{i}.")]
                  for i in range(self.config.n_layer)]
        head = [self.ln_f.weight, self.ln_f.bias, self.head.token]
        return [embedding, *blocks, head]

    def hidden(self, tokens: Array, hooks: ParameterHooks | None = None) -> Array:
        """The final-LayerNorm output (B, T, C) for token ids (B, T). It opens the head unit (ln_f belongs to
        it) and leaves closing it (`after_forward`) to the caller, who runs the rest of the head."""
        self.check_tokens(tokens)
        tokens = like(self.embedding.token.data, tokens)  # host token ids go to the weights' device
        hooks = hooks or ParameterHooks()
        hooks.before_forward(0)
        x = self.embedding.forward(tokens)
        hooks.after_forward(0)
        for i, block in enumerate(self.blocks, start=1):
            hooks.before_forward(i)
            x = block.forward(x)
            hooks.after_forward(i)
        hooks.before_forward(len(self.blocks) + 1)
        return self.ln_f.forward(x)

    def forward(self, tokens: Array, targets: Array, normalizer: float | None = None,
                hooks: ParameterHooks | None = None) -> float:
        """Cross-entropy of predicting `targets` from `tokens` (both (B, T)): sum of token losses / normalizer.

        `normalizer` defaults to the number of tokens here (a plain mean); pass the global batch's token count
        when this call is one microbatch or one data-parallel shard, so the pieces add up to the global mean.
        """
        hooks = hooks or ParameterHooks()
        hidden = self.hidden(tokens, hooks)
        loss = self.head.forward(hidden, like(hidden, targets), normalizer or targets.size)
        hooks.after_forward(len(self.blocks) + 1)
        return loss

    def backward(self, hooks: ParameterHooks | None = None) -> None:
        """Accumulate d(loss)/d(param) into every param.grad (after `forward`)."""
        hooks = hooks or ParameterHooks()
        last = len(self.blocks) + 1
        hooks.before_backward(last)
        dx = self.ln_f.backward(self.head.backward())
        hooks.after_backward(last)
        for i in range(len(self.blocks), 0, -1):
            hooks.before_backward(i)
            dx = self.blocks[i - 1].backward(dx)
            hooks.after_backward(i)
        hooks.before_backward(0)
        self.embedding.backward(dx)
        hooks.after_backward(0)

    def generate(self, prompt: Array, new_tokens: int, temperature: float = 1.0, top_k: int | None = None,
                 rng: np.random.Generator | None = None) -> Array:
        """Sample `new_tokens` tokens after `prompt` (1-D token ids) with a KV cache; returns only the new ones.

        temperature 0 picks the most likely token; top_k keeps only the k most likely before sampling. When
        the context reaches n_positions, the cache is rebuilt from the most recent half of it.
        """
        rng = rng or np.random.default_rng()
        context = [int(t) for t in prompt]
        if not context:
            raise ValueError("generate needs a prompt of at least one token")
        generated: list[int] = []
        caches, pending = None, context[-self.config.n_positions:]
        while len(generated) < new_tokens:
            if caches is None or caches[0].length + len(pending) > self.config.n_positions:
                caches = [KVCache() for _ in self.blocks]
                pending = context[-self.config.n_positions // 2:] if generated else pending
            logits = self._next_logits(pending, caches)
            token = sample_token(logits, temperature, top_k, rng)
            generated.append(token)
            context.append(token)
            pending = [token]
        return np.array(generated, dtype=np.int64)

    def _next_logits(self, tokens: list[int], caches: list[KVCache]) -> np.ndarray:
        """Feed `tokens` through the cached model; return the next-token logits as a NumPy vector."""
        xp = get_array_module(self.params["transformer.wte.weight"].data)
        x = self.embedding.forward(xp.asarray([tokens]), start=caches[0].length)
        for block, cache in zip(self.blocks, caches, strict=True):
            x = block.forward_incremental(x, cache)
        logits = self.head.logits(self.ln_f.forward(x[:, -1]))[0]
        return to_host(logits)

    def state_dict(self) -> dict[str, Array]:
        """Hugging Face name -> array (the tied lm_head.weight is not repeated)."""
        return {name: param.data for name, param in self.params.items()}

    def load_state_dict(self, tensors: dict[str, Array]) -> None:
        """Copy values in by name; names may omit the `transformer.` prefix. Every parameter must be present."""
        by_short_name = {name.removeprefix("transformer."): value for name, value in tensors.items()}
        for name, param in self.params.items():
            value = by_short_name.get(name.removeprefix("transformer."))
            if value is None:
                raise ValueError(f"checkpoint has no tensor {name}")
            if tuple(value.shape) != tuple(param.data.shape):
                raise ValueError(f"checkpoint tensor {name} has shape {tuple(value.shape)}, "
                                 f"the model expects {tuple(param.data.shape)}")
            param.data[...] = like(param.data, value)


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
