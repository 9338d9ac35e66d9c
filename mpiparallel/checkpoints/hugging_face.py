"""Checkpoints in Hugging Face's format (`--save`, `--init`).

A GPT-2 checkpoint is a directory `transformers.GPT2LMHeadModel.from_pretrained` loads; a llama-family one a
directory `LlamaForCausalLM` / `MixtralForCausalLM.from_pretrained` loads (names, layouts and config keys:
`models.families`; transformers 4 and 5 configs are read alike). For GPT-2:

    config.json          GPT2Config fields (vocab_size, n_positions, n_embd, n_layer, n_head, …)
    model.safetensors    GPT2LMHeadModel tensor names and layouts: transformer.wte.weight [vocab, n_embd],
                         transformer.h.{i}.attn.c_attn.weight [n_embd, 3·n_embd] (Conv1D: in × out), …

lm_head.weight is not written: GPT-2 ties it to transformer.wte.weight, and transformers re-ties it on load.
Reading accepts what real GPT-2 checkpoints hold: names without the `transformer.` prefix, an lm_head.weight, and
the attention-mask buffers `h.{i}.attn.bias` / `h.{i}.attn.masked_bias` (both ignored).

Writes are atomic: files are written into a temporary directory next to the target and renamed into place, so
a crash leaves either the previous checkpoint or the new one, never half of one. These functions do no
communication; the caller gathers the full tensors first and writes from one rank. Training checkpoints
(`--checkpoint-dir`, `--resume`), which every rank writes its shards of, are `checkpoints.sharded`'s.
"""

from __future__ import annotations

import json
import math
import os
import re
import secrets
import shutil
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import safetensors
import safetensors.numpy

from collectives.backend import to_host
from models import families
from models.config import MOE_KEYS
from models.transformer import GPTConfig, expert_bias_shapes, parameter_shapes

from ..errors import ConfigError

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
PREFIX = "transformer."
GPT2_EOS_TOKEN = 50256
"""<|endoftext|> in GPT-2's 50257-token vocabulary."""

SHAPE_KEYS = ("vocab_size", "n_positions", "n_embd", "n_layer", "n_head")

SUPPORTED_VALUES = {
    "model_type": ("gpt2", *families.LLAMA_TYPES),
    "activation_function": ("gelu_new", "gelu_pytorch_tanh"),
    "tie_word_embeddings": (True,),
    "scale_attn_weights": (True,),
    "scale_attn_by_inverse_layer_idx": (False,),
    "reorder_and_upcast_attn": (False,),
}
"""config.json keys whose other values describe a model our GPT-2 does not compute (an absent key means GPT-2's
default, which is the first value)."""

_IGNORED_TENSOR = re.compile(r"^(lm_head\.weight|h\.\d+\.attn\.(bias|masked_bias))$")


# -- writing a model ---------------------------------------------------------------------------------------------


def save_pretrained(directory: str | Path, config: GPTConfig, tensors: Mapping[str, Any],
                    extra_config: Mapping[str, Any] | None = None) -> Path:
    """Write `config.json` and `model.safetensors` for `tensors` (Hugging Face names, NumPy or CuPy arrays).

    `extra_config` adds keys to config.json (MoE settings, notes); it may not redefine the keys written here.
    An existing directory keeps its other files; the two checkpoint files are replaced one by one.
    """
    target = Path(directory)
    with _temporary_directory_beside(target) as staging:
        _write_model_files(staging, config, tensors, extra_config)
        _publish_files(staging, target)
    return target


def gpt2_config_json(config: GPTConfig, dtype: np.dtype, extra_config: Mapping[str, Any] | None = None) -> dict:
    """config.json for GPT2LMHeadModel: our shape plus GPT-2's fixed choices (GELU tanh, LN eps 1e-5, no dropout),
    and our MoE keys for a mixture of experts."""
    eos = GPT2_EOS_TOKEN if config.vocab_size > GPT2_EOS_TOKEN else config.vocab_size - 1
    fields = {
        "model_type": "gpt2",
        "architectures": ["GPT2LMHeadModel"],
        "vocab_size": config.vocab_size,
        "n_positions": config.n_positions,
        "n_ctx": config.n_positions,
        "n_embd": config.n_embd,
        "n_layer": config.n_layer,
        "n_head": config.n_head,
        "n_inner": None,
        "activation_function": "gelu_new",
        "resid_pdrop": 0.0,
        "embd_pdrop": 0.0,
        "attn_pdrop": 0.0,
        "layer_norm_epsilon": 1e-5,
        "initializer_range": 0.02,
        "scale_attn_weights": True,
        "tie_word_embeddings": True,
        "use_cache": True,
        "bos_token_id": eos,
        "eos_token_id": eos,
        "torch_dtype": np.dtype(dtype).name,
    } | config.moe_settings()
    clashes = sorted(set(fields) & set(extra_config or {}))
    if clashes:
        raise ValueError(f"extra_config may not redefine {clashes}")
    return fields | dict(extra_config or {})


def _write_model_files(directory: Path, config: GPTConfig, tensors: Mapping[str, Any],
                       extra_config: Mapping[str, Any] | None) -> None:
    if config.is_llama:
        arrays = {name: _host_array(value) for name, value in families.to_hugging_face(config, tensors).items()}
        content = families.hugging_face_config(config, arrays["model.embed_tokens.weight"].dtype)
        clashes = sorted(set(content) & set(extra_config or {}))
        if clashes:
            raise ValueError(f"extra_config may not redefine {clashes}")
        _write_json(directory / CONFIG_FILE, content | dict(extra_config or {}))
        _write_safetensors(directory / WEIGHTS_FILE, arrays)
        return
    arrays = {_with_prefix(name): _host_array(value) for name, value in tensors.items()
              if name.removeprefix(PREFIX) != "lm_head.weight"}  # tied to wte: transformers re-ties it on load
    if PREFIX + "wte.weight" not in arrays:
        raise ValueError("a GPT-2 checkpoint needs transformer.wte.weight")
    dtype = arrays[PREFIX + "wte.weight"].dtype
    _write_json(directory / CONFIG_FILE, gpt2_config_json(config, dtype, extra_config))
    _write_safetensors(directory / WEIGHTS_FILE, arrays)


def _with_prefix(name: str) -> str:
    return name if name.startswith(PREFIX) else PREFIX + name


def _host_array(value: Any) -> np.ndarray:
    """A C-contiguous NumPy array (safetensors writes raw memory; CuPy arrays are copied to the host)."""
    return np.ascontiguousarray(to_host(value))


def _write_json(path: Path, content: Any) -> None:
    with open(path, "w", encoding="utf-8") as file:
        json.dump(content, file, indent=2)
        file.write("\n")
        _flush_to_disk(file)


def _write_safetensors(path: Path, arrays: dict[str, np.ndarray]) -> None:
    # transformers refuses safetensors files whose metadata does not say which framework wrote them.
    safetensors.numpy.save_file(arrays, str(path), metadata={"format": "pt"})
    os.chmod(path, public_file_mode())  # safetensors creates its file private (0600), config.json is not
    with open(path, "rb+") as file:
        _flush_to_disk(file)


def public_file_mode() -> int:
    """The mode a new file gets from open(): 0666 less the umask (0644 under the usual 022)."""
    mask = os.umask(0)
    os.umask(mask)
    return 0o666 & ~mask


def _flush_to_disk(file: Any) -> None:
    file.flush()
    os.fsync(file.fileno())


# -- atomic publication ------------------------------------------------------------------------------------------


@contextmanager
def _temporary_directory_beside(target: Path) -> Iterator[Path]:
    """A fresh directory next to `target` (same file system, so renames are atomic), removed if writing fails."""
    if target.exists() and not target.is_dir():
        raise ConfigError(f"cannot write a checkpoint to {target}: it is a file")
    target.parent.mkdir(parents=True, exist_ok=True)
    # Not tempfile.mkdtemp: its mode 0700 would stay with the published checkpoint; mkdir honours the umask.
    staging = target.parent / f".{target.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}"
    staging.mkdir()
    try:
        yield staging
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _publish_files(staging: Path, target: Path) -> None:
    """Move the staged files to `target`: one rename for a new directory, else file by file, config.json last."""
    if not target.exists():
        staging.rename(target)
        return
    for name in sorted(os.listdir(staging), key=lambda name: name == CONFIG_FILE):
        os.replace(staging / name, target / name)


# -- reading a model ---------------------------------------------------------------------------------------------


def load_pretrained(directory: str | Path, expected_shapes: Mapping[str, tuple[int, ...]] | None = None
                    ) -> tuple[GPTConfig, dict[str, np.ndarray], dict[str, Any]]:
    """(config, tensors by our name in model order, config.json as read) from a Hugging Face GPT-2, Llama or
    Mixtral directory.

    Every tensor of `expected_shapes` (default: `parameter_shapes(config)`) must be present with that shape;
    further tensors are returned as they are (extensions such as MoE experts check their own). A MoE checkpoint
    without expert biases (any from elsewhere) gets zero biases.
    """
    path = Path(directory)
    if not path.is_dir():
        raise ConfigError(f"checkpoint directory {path} does not exist")
    raw_config = read_json_object(path / CONFIG_FILE, "not a checkpoint directory (model config)")
    config = gpt_config_from_json(raw_config, path / CONFIG_FILE)
    if config.is_llama:
        tensors = families.from_hugging_face(config, _read_weights(path))
    else:
        tensors = _canonical_tensors(_read_weights(path), path / WEIGHTS_FILE)
        dtype = next(iter(tensors.values())).dtype if tensors else np.float32
        tensors |= {name: np.zeros(shape, dtype) for name, shape in expert_bias_shapes(config).items()
                    if name not in tensors}
    expected = expected_shapes or parameter_shapes(config)
    _check_shapes(tensors, expected, path / WEIGHTS_FILE)
    in_model_order = {name: tensors[name] for name in expected} | tensors  # safetensors sorts names alphabetically
    return config, in_model_order, raw_config


def gpt_config_from_json(raw: Mapping[str, Any], source: str | Path = CONFIG_FILE) -> GPTConfig:
    """The model from GPT2Config, LlamaConfig or MixtralConfig fields, refusing settings we do not implement."""
    if raw.get("model_type") in families.LLAMA_TYPES:
        try:
            return GPTConfig(**families.config_fields(raw))
        except (ValueError, TypeError) as error:
            raise ConfigError(f"{source}: {error}") from None
    shape = {}
    for key in SHAPE_KEYS:
        value = raw.get(key, raw.get("n_ctx")) if key == "n_positions" else raw.get(key)
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{source}: {key} must be an integer, got {value!r}")
        shape[key] = value
    for key, supported in SUPPORTED_VALUES.items():
        if raw.get(key, supported[0]) not in supported:
            raise ConfigError(f"{source}: {key} = {raw[key]!r} is not supported (supported: {list(supported)})")
    if raw.get("n_inner") not in (None, 4 * shape["n_embd"]):
        raise ConfigError(f"{source}: n_inner = {raw['n_inner']} is not supported (the MLP is 4·n_embd wide)")
    if not math.isclose(raw.get("layer_norm_epsilon", 1e-5), 1e-5):
        raise ConfigError(f"{source}: layer_norm_epsilon = {raw['layer_norm_epsilon']} is not supported (1e-5)")
    moe = {key: raw[key] for key in MOE_KEYS if key in raw}
    try:
        return GPTConfig(**shape, **moe)
    except (ValueError, TypeError) as error:
        raise ConfigError(f"{source}: {error}") from None


def read_json_object(path: Path, missing: str) -> dict[str, Any]:
    """The JSON object in `path`, or one ConfigError: `missing` says what its absence means."""
    if not path.is_file():
        raise ConfigError(f"{path} is missing: {missing}")
    try:
        content = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ConfigError(f"{path} is not valid JSON: {error}") from None
    if not isinstance(content, dict):
        raise ConfigError(f"{path} must hold a JSON object, not {type(content).__name__}")
    return content


def _read_weights(directory: Path) -> dict[str, np.ndarray]:
    path = directory / WEIGHTS_FILE
    if not path.is_file():
        if (directory / "pytorch_model.bin").is_file():
            raise ConfigError(f"{directory} holds pytorch_model.bin; only model.safetensors is read. Convert it with "
                              f"transformers: GPT2LMHeadModel.from_pretrained(dir).save_pretrained(dir)")
        raise ConfigError(f"{path} is missing: not a checkpoint directory (model weights)")
    return _read_safetensors(path)


def _read_safetensors(path: Path) -> dict[str, np.ndarray]:
    try:
        return safetensors.numpy.load_file(str(path))
    except (safetensors.SafetensorError, OSError, ValueError, TypeError) as error:
        raise ConfigError(f"{path} is not a readable safetensors file: {error}") from None


def _canonical_tensors(tensors: Mapping[str, np.ndarray], source: Path) -> dict[str, np.ndarray]:
    """Names with the `transformer.` prefix, without the tied head and the attention-mask buffers."""
    canonical: dict[str, np.ndarray] = {}
    for name, value in tensors.items():
        short = name.removeprefix(PREFIX)
        if _IGNORED_TENSOR.match(short):
            continue
        if PREFIX + short in canonical:
            raise ConfigError(f"{source} holds {short} both with and without the '{PREFIX}' prefix")
        canonical[PREFIX + short] = value
    return canonical


def _check_shapes(tensors: Mapping[str, np.ndarray], expected: Mapping[str, tuple[int, ...]], source: Path) -> None:
    missing = [name for name in expected if name not in tensors]
    if missing:
        raise ConfigError(f"{source} lacks {len(missing)} tensor(s) the config needs: {', '.join(missing[:5])}"
                          f"{', …' if len(missing) > 5 else ''}")
    wrong = [f"{name} is {tuple(tensors[name].shape)}, the config needs {tuple(shape)}"
             for name, shape in expected.items() if tuple(tensors[name].shape) != tuple(shape)]
    if wrong:
        raise ConfigError(f"{source} does not match its config.json: {'; '.join(wrong[:3])}"
                          f"{'; …' if len(wrong) > 3 else ''}")
