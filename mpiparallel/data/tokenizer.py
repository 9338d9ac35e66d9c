"""Tokenizers behind one small interface: Hugging Face `tokenizers` (a trained byte-level BPE, or any
`tokenizer.json` — GPT-2's, Llama's), or the 256 raw bytes.

(Named `tokenizer`, not `tokenizers` as DESIGN suggests, so that `import tokenizers` inside this package plainly
means Hugging Face's library.)

A tokenizer encodes batches of texts to token ids (no special tokens added: `prepare` puts the end-of-text token
before each document itself), decodes ids back to text, and saves itself into a folder as `tokenizer.json` with a
`tokenizer_config.json` beside it, so that transformers' `AutoTokenizer.from_pretrained(folder)` loads it (as
`PreTrainedTokenizerFast`) next to a model written by `train --save`. BPE training runs offline and in the
library's own (Rust, multi-threaded) code: one pass over the corpus, memory bounded by its distinct words.
The byte tokenizer has 257 ids: the bytes 0–255 and the end-of-text token 256; it writes no file.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import ConfigError

END_OF_TEXT = "<|endoftext|>"
END_OF_TEXT_NAMES = (END_OF_TEXT, "<|end_of_text|>", "</s>", "<eos>", "<|eos|>")
"""Special tokens taken as end-of-text in a tokenizer.json without a tokenizer_config.json naming its eos_token:
GPT-2's, Llama 3's, Llama 2's / Mistral's, Gemma's."""
TOKENIZER_JSON = "tokenizer.json"
TOKENIZER_CONFIG = "tokenizer_config.json"


class ByteTokenizer:
    """UTF-8 bytes as token ids 0–255, and 256 for end-of-text."""

    kind = "byte"
    vocab_size = 257
    eot_id = 256

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
        return [np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int64) for text in texts]

    def decode(self, ids: Iterable[int]) -> str:
        pieces, run = [], bytearray()
        for token in (int(t) for t in ids):
            if token == self.eot_id:
                pieces.append(run.decode("utf-8", errors="replace") + END_OF_TEXT)
                run = bytearray()
            else:
                run.append(token)
        return "".join(pieces) + run.decode("utf-8", errors="replace")

    def save(self, folder: Path) -> None:
        """Nothing to write: data.json says "byte"."""

    def digest(self) -> str:
        return "byte"


class HuggingFaceTokenizer:
    """A `tokenizers.Tokenizer` and its end-of-text token."""

    kind = "huggingface"

    def __init__(self, tokenizer: Any, eot_token: str, source: str = "") -> None:
        self.tokenizer, self.eot_token, self.source = tokenizer, eot_token, source
        eot_id = tokenizer.token_to_id(eot_token)
        if eot_id is None:
            raise ConfigError(f"tokenizer {source} has no token {eot_token!r}")
        self.eot_id = int(eot_id)
        self.vocab_size = int(tokenizer.get_vocab_size(with_added_tokens=True))

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
        encodings = self.tokenizer.encode_batch_fast(list(texts), add_special_tokens=False)
        return [np.asarray(encoding.ids, dtype=np.int64) for encoding in encodings]

    def decode(self, ids: Iterable[int]) -> str:
        return self.tokenizer.decode([int(t) for t in ids], skip_special_tokens=False)

    def save(self, folder: Path) -> None:
        """tokenizer.json, and a tokenizer_config.json that makes transformers load it as a fast tokenizer."""
        self.tokenizer.save(str(folder / TOKENIZER_JSON))
        config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": self.eot_token,
                  "bos_token": self.eot_token, "model_max_length": 1 << 30, "clean_up_tokenization_spaces": False}
        (folder / TOKENIZER_CONFIG).write_text(json.dumps(config, indent=1) + "\n", encoding="utf-8")

    def digest(self) -> str:
        return hashlib.sha256(self.tokenizer.to_str().encode("utf-8")).hexdigest()[:16]


Tokenizer = ByteTokenizer | HuggingFaceTokenizer


def train_bpe(texts: Iterable[str], vocab_size: int) -> HuggingFaceTokenizer:
    """A byte-level BPE (GPT-2's pre-tokenization: its regex, then bytes as 256 visible characters) of
    `vocab_size` tokens, the last merges learned from `texts`; `<|endoftext|>` is token 0."""
    import tokenizers
    from tokenizers import decoders, models, pre_tokenizers, trainers

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    if vocab_size < len(alphabet) + 1:
        raise ConfigError(f"a byte-level BPE needs --vocab-size of at least {len(alphabet) + 1} (256 bytes and the "
                          f"end-of-text token), got {vocab_size}")
    tokenizer = tokenizers.Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[END_OF_TEXT], initial_alphabet=alphabet,
                                  show_progress=False)
    tokenizer.train_from_iterator(texts, trainer)
    return HuggingFaceTokenizer(tokenizer, END_OF_TEXT, "trained byte-level BPE")


def load_tokenizer(path: str | Path, eot_id: int | None = None) -> HuggingFaceTokenizer:
    """A `tokenizer.json`, or a folder holding one (a Hugging Face model folder); its end-of-text token is
    `eot_id`, else tokenizer_config.json's eos_token, else the first of END_OF_TEXT_NAMES it has."""
    import tokenizers

    path = Path(path)
    file = path / TOKENIZER_JSON if path.is_dir() else path
    if not file.is_file():
        where = f"{path} has no {TOKENIZER_JSON}" if path.is_dir() else f"{path} does not exist"
        raise ConfigError(f"cannot load a tokenizer: {where}")
    try:
        tokenizer = tokenizers.Tokenizer.from_file(str(file))
    except Exception as error:  # the library raises plain Exceptions for malformed files
        raise ConfigError(f"cannot read tokenizer {file}: {error}") from None
    if eot_id is not None:
        token = tokenizer.id_to_token(eot_id)
        if token is None:
            raise ConfigError(f"tokenizer {file} has no token id {eot_id} (the end-of-text id data.json names)")
        return HuggingFaceTokenizer(tokenizer, token, str(file))
    return HuggingFaceTokenizer(tokenizer, _end_of_text(tokenizer, file), str(file))


def _end_of_text(tokenizer: Any, file: Path) -> str:
    config = file.parent / TOKENIZER_CONFIG
    if config.is_file():
        try:
            eos = json.loads(config.read_text(encoding="utf-8")).get("eos_token")
        except (OSError, ValueError, AttributeError):
            eos = None
        if isinstance(eos, dict):  # transformers' AddedToken form
            eos = eos.get("content")
        if isinstance(eos, str) and tokenizer.token_to_id(eos) is not None:
            return eos
    for name in END_OF_TEXT_NAMES:
        if tokenizer.token_to_id(name) is not None:
            return name
    raise ConfigError(f"tokenizer {file} has no end-of-text token (none of {', '.join(END_OF_TEXT_NAMES)}, and no "
                      f"eos_token in a {TOKENIZER_CONFIG} beside it)")


def tokenizer_of_folder(folder: str | Path | None, info: dict[str, Any] | None = None) -> Tokenizer | None:
    """The tokenizer a data folder (data.json) or model folder (tokenizer.json) names; None when it names none."""
    if folder is None:
        return None
    folder, info = Path(folder), info or {}
    if (folder / TOKENIZER_JSON).is_file():
        eot_id = info.get("eot_id") if info.get("tokenizer") != "byte" else None
        return load_tokenizer(folder, eot_id if isinstance(eot_id, int) else None)
    if info.get("tokenizer") == "byte":
        return ByteTokenizer()
    return None
