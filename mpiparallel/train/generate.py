"""Sampling from a trained model: the sample after training (`--sample-tokens`) and `mpiparallel generate`."""

from __future__ import annotations

import numpy as np

from models.precision import is_narrow
from models.transformer import Transformer

from .. import data
from ..checkpoints import hugging_face
from ..errors import ConfigError


def generate(init: str, prompt: str | None, prompt_ids: list[int] | None, new_tokens: int, temperature: float,
             top_k: int | None, seed: int) -> str:
    """Load a checkpoint and continue the prompt; text through the model folder's tokenizer.json (bytes for a
    byte-level model), token ids when the prompt is given as ids."""
    config, tensors, _ = hugging_face.load_pretrained(init)
    dtype = next(iter(tensors.values())).dtype
    model = Transformer(config, dtype=np.float32 if is_narrow(dtype) else dtype)  # bfloat16 computes in float32
    model.load_state_dict(tensors)
    if prompt_ids is None:
        tokenizer = data.tokenizer_of_folder(init)
        if tokenizer is None and config.vocab_size > data.ByteTokenizer.vocab_size:
            raise ConfigError(f"{init} has a vocabulary of {config.vocab_size} tokens, not bytes, and no "
                              f"tokenizer.json: give the prompt as --prompt-ids 15496,11,995")
        if tokenizer is None:
            return sample_text(model, prompt or "\n", new_tokens, seed, temperature, top_k)
        return sample_text(model, prompt, new_tokens, seed, temperature, top_k, tokenizer=tokenizer)
    bad = [t for t in prompt_ids if not 0 <= t < config.vocab_size]
    if bad:
        raise ConfigError(f"--prompt-ids {bad} are outside the vocabulary (0..{config.vocab_size - 1})")
    new = model.generate(np.array(prompt_ids), new_tokens, temperature, top_k, np.random.default_rng(seed))
    return ",".join(str(t) for t in [*prompt_ids, *new.tolist()])


def sample_text(model: Transformer, prompt: str | None, new_tokens: int, seed: int, temperature: float = 0.8,
                top_k: int | None = 40, window: int | None = None, tokenizer: data.Tokenizer | None = None) -> str:
    """Tokens sampled after `prompt`, encoded and decoded by `tokenizer` (default: bytes, as UTF-8 with bad bytes
    replaced); no prompt starts a document (the end-of-text token) and shows only what follows. `window`: the
    most positions the model attends over (its training sequence length)."""
    tokenizer = tokenizer or data.ByteTokenizer()
    prompt_ids = tokenizer.encode_batch([prompt])[0] if prompt else np.array([tokenizer.eot_id])
    new = model.generate(prompt_ids, new_tokens, temperature, top_k, np.random.default_rng(seed), window)
    if not prompt:
        return tokenizer.decode(new.tolist())
    return tokenizer.decode([*prompt_ids.tolist(), *new.tolist()])
