"""torch and transformers for the tests that check our families against transformers' own models."""

from __future__ import annotations

from optional import optional_module

INTEROP = "pip install -e '.[interop]'"


def hugging_face():
    """torch and transformers: a skip that says how to install them, a failure under CI=true
    (tests/support/optional.py)."""
    torch = optional_module("torch", f"needs torch to run transformers' Llama: {INTEROP}")
    transformers = optional_module("transformers", f"needs transformers' Llama: {INTEROP}")
    torch.set_num_threads(1)
    return torch, transformers
