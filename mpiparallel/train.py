"""The training loop behind `mpiparallel train`, and the sampling behind `mpiparallel generate`.

One step: take the step's batch (llm.c's order, see `data`), zero the gradients, forward (mean token
cross-entropy over the global batch), backward, clip the global gradient norm, set the step's learning rate,
update. Around it: validation loss every `--eval-every` steps on held-out data, training checkpoints every
`--checkpoint-every` steps (and `--resume` from the newest), a Hugging Face directory at the end (`--save`),
one JSON line per step (`--log-json`), and a progress line on rank 0.

The mesh is 1×1 for now: the parallel axes arrive with their issues, and until then any other mesh is
rejected with a clear message rather than silently trained serially.
"""

from __future__ import annotations

import json
import math
import sys
import time
from dataclasses import dataclass
from typing import Any, TextIO

import numpy as np

from models.gpt import GPT, GPTConfig

from . import checkpoint, data, optim
from .errors import ConfigError

MESH_AXES = ("dp", "tp", "pp", "cp", "ep")


@dataclass(frozen=True)
class TrainSettings:
    """Every `mpiparallel train` option, after parsing (see the command's --help for their meaning)."""

    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 128
    vocab_size: int = 256
    n_positions: int = 1024
    seq_len: int = 128
    batch_size: int = 8
    steps: int = 200
    lr: float = 1e-3
    seed: int = 0
    optimizer: str = "adamw"
    weight_decay: float = 0.0
    dtype: str = "float32"
    grad_clip: float = 0.0
    lr_schedule: str = "constant"
    warmup_steps: int = 0
    data: str | None = None
    init: str | None = None
    save: str | None = None
    checkpoint_dir: str | None = None
    checkpoint_every: int = 0
    resume: bool = False
    eval_every: int = 0
    eval_batches: int = 4
    validation_fraction: float = 0.1
    log_json: str | None = None
    sample_tokens: int = 0
    mesh: tuple[tuple[str, int | None], ...] = ()


def run(settings: TrainSettings) -> int:
    """Train as `settings` says; return the exit status."""
    from mpi4py import MPI

    world = MPI.COMM_WORLD
    _check_mesh(settings, world.Get_size())
    model, config = _build_model(settings)
    tokens = _load_data(settings, config)
    train_tokens, validation_tokens = _split(settings, tokens)
    optimizer = _build_optimizer(settings, model)
    first_step = _resume(settings, model, optimizer)
    reporter = Reporter(settings, config, is_root=world.Get_rank() == 0)
    for step in range(first_step, settings.steps):
        record = train_step(model, optimizer, train_tokens, step, settings)
        if _due(step, settings.eval_every, settings.steps):
            record["val_loss"] = evaluate(model, validation_tokens, settings)
        reporter.step(record)
        if _due(step, settings.checkpoint_every, settings.steps) and settings.checkpoint_dir:
            _save_training_checkpoint(settings, model, optimizer, step + 1)
    reporter.finish()
    if settings.save:
        checkpoint.save_pretrained(settings.save, config, model.state_dict())
        reporter.say(f"saved the model to {settings.save}")
    if settings.sample_tokens and config.vocab_size == 256:
        reporter.say(sample_text(model, prompt="\n", new_tokens=settings.sample_tokens, seed=settings.seed))
    return 0


def train_step(model: GPT, optimizer: Any, tokens: np.ndarray, step: int, settings: TrainSettings) -> dict:
    """One optimizer step on the step's batch; returns the log record (loss before the update)."""
    start = time.perf_counter()
    inputs, targets = data.batch_for_step(tokens, step, settings.batch_size, settings.seq_len)
    model.zero_grad()
    loss = model.forward(inputs, targets)
    model.backward()
    grad_norm = optim.clip_grad_norm(model.parameters(), settings.grad_clip)
    lr = optim.learning_rate(step, settings.lr, settings.lr_schedule, settings.warmup_steps, settings.steps)
    optimizer.step(lr)
    return {"step": step, "loss": loss, "lr": lr, "tokens": int(inputs.size), "time_s": time.perf_counter() - start,
            "grad_norm": grad_norm, "comm_bytes": {}}


def evaluate(model: GPT, tokens: np.ndarray, settings: TrainSettings) -> float:
    """Mean loss over the first `eval_batches` batches of the held-out tokens (no update)."""
    losses = [model.forward(*data.batch_for_step(tokens, i, settings.batch_size, settings.seq_len))
              for i in range(settings.eval_batches)]
    return float(np.mean(losses))


def sample_text(model: GPT, prompt: str, new_tokens: int, seed: int, temperature: float = 0.8,
                top_k: int | None = 40) -> str:
    """Bytes sampled from a byte-level model after `prompt`, decoded as UTF-8 (bad bytes replaced)."""
    prompt_ids = np.frombuffer(prompt.encode(), dtype=np.uint8).astype(np.int64)
    new = model.generate(prompt_ids, new_tokens, temperature, top_k, np.random.default_rng(seed))
    return prompt + bytes(new.astype(np.uint8).tolist()).decode("utf-8", errors="replace")


# -- setting up ---------------------------------------------------------------------------------------------

def _check_mesh(settings: TrainSettings, world_size: int) -> None:
    requested = {axis: size for axis, size in settings.mesh if size not in (None, 1)}
    if requested or world_size != 1:
        shown = ", ".join(f"--{axis} {size}" for axis, size in requested.items()) or f"{world_size} ranks"
        raise ConfigError(f"this version trains on one rank only (mesh 1×1); got {shown}. Data, tensor, "
                          f"pipeline, context and expert parallelism arrive with their own issues")


def _build_model(settings: TrainSettings) -> tuple[GPT, GPTConfig]:
    dtype = np.dtype(settings.dtype)
    if settings.init:
        config, tensors, _ = checkpoint.load_pretrained(settings.init)
        model = GPT(config, seed=settings.seed, dtype=dtype)
        model.load_state_dict(tensors)
    else:
        try:
            config = GPTConfig(vocab_size=settings.vocab_size, n_positions=max(settings.n_positions, settings.seq_len),
                               n_embd=settings.n_embd, n_layer=settings.n_layer, n_head=settings.n_head)
        except ValueError as error:
            raise ConfigError(str(error)) from None
        model = GPT(config, seed=settings.seed, dtype=dtype)
    if settings.seq_len > config.n_positions:
        raise ConfigError(f"--seq-len {settings.seq_len} exceeds the model's n_positions ({config.n_positions})")
    return model, config


def _load_data(settings: TrainSettings, config: GPTConfig) -> np.ndarray:
    tokens = data.load_tokens(settings.data)
    data.check_vocab(tokens, config.vocab_size)
    return tokens.tokens


def _split(settings: TrainSettings, tokens: np.ndarray) -> tuple[np.ndarray, np.ndarray | None]:
    """Hold out the last `validation_fraction` of the tokens when validation is asked for."""
    if not settings.eval_every:
        return tokens, None
    train_tokens, validation_tokens = data.split_train_validation(tokens, settings.validation_fraction)
    needed = settings.batch_size * settings.seq_len + 1
    if len(validation_tokens) < needed:
        raise ConfigError(f"the held-out {settings.validation_fraction:.0%} of the data has {len(validation_tokens)} "
                          f"tokens; one validation batch needs {needed}. Use more data or a larger "
                          f"--validation-fraction, or leave out --eval-every")
    return train_tokens, validation_tokens


def _build_optimizer(settings: TrainSettings, model: GPT) -> Any:
    if settings.optimizer == "sgd":
        return optim.SGD(model.parameters(), lr=settings.lr)
    return optim.AdamW(model.parameters(), lr=settings.lr, weight_decay=settings.weight_decay)


def _resume(settings: TrainSettings, model: GPT, optimizer: Any) -> int:
    """Load the newest training checkpoint when --resume is given; return the first step to run."""
    if not settings.resume:
        return 0
    if not settings.checkpoint_dir:
        raise ConfigError("--resume needs --checkpoint-dir (where the training checkpoints are)")
    latest = checkpoint.latest_training_checkpoint(settings.checkpoint_dir)
    if latest is None:
        return 0  # nothing saved yet: start from the beginning, as a restarted job would want
    config, tensors, optimizer_state, trainer_state = checkpoint.load_training_checkpoint(latest)
    if config != model.config:
        raise ConfigError(f"checkpoint {latest} holds a model of shape {config}, but this run builds {model.config}")
    model.load_state_dict(tensors)
    optimizer.load_state_dict(optimizer_state)
    return int(trainer_state["step"])


def _save_training_checkpoint(settings: TrainSettings, model: GPT, optimizer: Any, steps_done: int) -> None:
    checkpoint.save_training_checkpoint(settings.checkpoint_dir, steps_done, model.config, model.state_dict(),
                                        optimizer.state_dict(), {"settings": _jsonable(settings)})


def _due(step: int, every: int, steps: int) -> bool:
    """Whether a periodic action runs after 0-based `step`: every `every` steps, and after the last one."""
    return every > 0 and ((step + 1) % every == 0 or step + 1 == steps)


def _jsonable(settings: TrainSettings) -> dict:
    return {key: value for key, value in vars(settings).items() if key != "mesh"}


# -- reporting ----------------------------------------------------------------------------------------------

class Reporter:
    """Rank 0's view of training: a progress line (rewritten in place on a terminal) and the JSON log."""

    def __init__(self, settings: TrainSettings, config: GPTConfig, is_root: bool,
                 stream: TextIO = sys.stdout) -> None:
        self.settings, self.is_root, self.stream = settings, is_root, stream
        self.interactive = is_root and stream.isatty()
        self.log = open(settings.log_json, "a" if settings.resume else "w") if is_root and settings.log_json else None
        self.every = max(1, settings.steps // 20)
        if is_root:
            self.say(f"GPT-2 {config.n_layer} layers, {config.n_embd} channels, {config.n_head} heads, vocab "
                     f"{config.vocab_size}: {config.parameter_count() / 1e6:.2f} M parameters; "
                     f"{settings.batch_size}×{settings.seq_len} tokens per step, {settings.dtype}")

    def step(self, record: dict) -> None:
        if not self.is_root:
            return
        if self.log is not None:
            self.log.write(json.dumps(record) + "\n")
            self.log.flush()
        step = record["step"]
        line = (f"step {step + 1:>5}/{self.settings.steps} | loss {record['loss']:.4f} | lr {record['lr']:.2e} | "
                f"{record['tokens'] / record['time_s']:,.0f} tok/s")
        if "val_loss" in record:
            line += f" | val {record['val_loss']:.4f}"
        if self.interactive:
            end = "\n" if "val_loss" in record else ""
            self.stream.write(f"\r{line}\033[K{end}")
            self.stream.flush()
        elif (step + 1) % self.every == 0 or step == 0 or "val_loss" in record or step + 1 == self.settings.steps:
            self.say(line)
        if not math.isfinite(record["loss"]):
            raise FloatingPointError(f"the loss became {record['loss']} at step {step}; try a smaller --lr")

    def say(self, text: str) -> None:
        if self.is_root:
            if self.interactive:
                self.stream.write("\r\033[K")
            print(text, file=self.stream, flush=True)

    def finish(self) -> None:
        if self.interactive:
            self.stream.write("\n")
        if self.log is not None:
            self.log.close()


def generate(init: str, prompt: str | None, prompt_ids: list[int] | None, new_tokens: int, temperature: float,
             top_k: int | None, seed: int) -> str:
    """Load a checkpoint and continue the prompt; text for byte-level models, token ids otherwise."""
    config, tensors, _ = checkpoint.load_pretrained(init)
    model = GPT(config, dtype=next(iter(tensors.values())).dtype)
    model.load_state_dict(tensors)
    if prompt_ids is None:
        if config.vocab_size != 256:
            raise ConfigError(f"{init} has a vocabulary of {config.vocab_size} tokens, not bytes, and mpiparallel "
                              f"has no tokenizer for it: give the prompt as --prompt-ids 15496,11,995")
        return sample_text(model, prompt or "\n", new_tokens, seed, temperature, top_k)
    bad = [t for t in prompt_ids if not 0 <= t < config.vocab_size]
    if bad:
        raise ConfigError(f"--prompt-ids {bad} are outside the vocabulary (0..{config.vocab_size - 1})")
    new = model.generate(np.array(prompt_ids), new_tokens, temperature, top_k, np.random.default_rng(seed))
    return ",".join(str(t) for t in [*prompt_ids, *new.tolist()])

