"""torch and transformers for the tests that check our families against transformers' own models."""

from __future__ import annotations

import numpy as np
from optional import optional_module

from mpiparallel import optim

INTEROP = "pip install -e '.[interop]'"


def hugging_face():
    """torch and transformers: a skip that says how to install them, a failure under CI=true
    (tests/support/optional.py)."""
    torch = optional_module("torch", f"needs torch to run transformers' Llama: {INTEROP}")
    transformers = optional_module("transformers", f"needs transformers' Llama: {INTEROP}")
    torch.set_num_threads(1)
    return torch, transformers


def train_side_by_side(torch, model, hf_model, vocab_size: int, steps: int = 3, lr: float = 3e-3,
                       decay: float = 0.1) -> None:
    """Our model and transformers' train `steps` AdamW steps (PyTorch's: betas (0.9, 0.95), eps 1e-8, decay on
    ≥2-D weights only) on the same random batches; every step's loss must agree to 1e-9 (float64)."""
    ours = optim.AdamW(model.parameters(), lr=lr, weight_decay=decay)
    matrices = [p for p in hf_model.parameters() if p.ndim >= 2]
    vectors = [p for p in hf_model.parameters() if p.ndim < 2]
    theirs = torch.optim.AdamW([{"params": matrices, "weight_decay": decay}, {"params": vectors, "weight_decay": 0.0}],
                               lr=lr, betas=(0.9, 0.95), eps=1e-8)
    rng = np.random.default_rng(2)
    for _ in range(steps):
        window = rng.integers(0, vocab_size, size=(2, 17))
        inputs, targets = window[:, :-1], window[:, 1:]
        model.zero_grad()
        loss, saved = model.forward(inputs, targets)
        model.backward(saved)
        ours.step()
        theirs.zero_grad()
        logits = hf_model(torch.from_numpy(inputs)).logits
        hf_loss = torch.nn.functional.cross_entropy(logits.reshape(-1, vocab_size),
                                                    torch.from_numpy(targets).reshape(-1))
        hf_loss.backward()
        theirs.step()
        assert abs(loss - hf_loss.item()) <= 1e-9 * abs(hf_loss.item()), (loss, hf_loss.item())


def float64_rms_norm(torch, module):
    """transformers' RMSNorm forward without its float32 upcast, so a float64 model stays float64-accurate."""
    def forward(hidden):
        variance = hidden.pow(2).mean(-1, keepdim=True)
        return module.weight * (hidden * torch.rsqrt(variance + module.variance_epsilon))
    return forward
