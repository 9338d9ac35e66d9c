"""Rank 0's account of training: the header, a progress line per step, the JSON log (`--log-json`), and lines
gathered from every rank in rank order.

The progress line rewrites itself in place where the output is a terminal — also under `-n N`, where the
self-launching parent, not rank 0, holds the terminal and says so (`TERMINAL`); every `every`-th line stays.
Its figures: the step counted from 1 out of --steps (as the JSON log's "step", checkpoints' folders and the
resume and save lines count it), the loss and its mean since the last kept line, the
learning rate, tokens/s and ms/step as moving means over the last `MOVING_STEPS` steps (one step's own time
swings with the machine's load), MFU — model FLOPs per second (`model_flops_per_token`) over the peak of the
ranks (`metering.peak_flops`, what the planner assumes) — and the steps done, the time elapsed and the ETA.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from collections import deque
from collections.abc import Mapping
from pathlib import Path
from typing import Any, TextIO

from models.moe import expert_index
from models.transformer import GPTConfig, parameter_shapes

from ..text import plural
from .settings import TrainSettings

TERMINAL = "MPIPARALLEL_TERMINAL"
"""Set by the self-launching parent (`mpiparallel.jobs.launch.TERMINAL`): 1 when its own output is a terminal
(rank 0's output then reaches one through mpiexec's pipes, and the progress line may rewrite itself), else 0.
Under a launcher of one's own, set it by hand: `mpiexec -n 4 env MPIPARALLEL_TERMINAL=1 mpiparallel train`."""

PROGRESS = "MPIPARALLEL_PROGRESS"
"""Set by the `--elastic` parent (`mpiparallel.jobs.elastic`): a file where rank 0 writes the steps done."""

CONTINUE_LOG = "MPIPARALLEL_CONTINUE_LOG"
"""Set to 1 by the `--elastic` parent on a relaunch: rank 0 appends to --log-json even when the relaunched job
starts from step 0 (lost before the first checkpoint), so the lost job's steps and the restart event stay."""

MOVING_STEPS = 10
"""Steps in the moving means of tokens/s and ms/step."""


class TensorBoardLog:
    """--tensorboard DIR: each step's loss, learning rate, tokens/s, gradient norm, validation loss, MoE aux loss
    and bytes sent per mesh axis as TensorBoard scalars (event files written by tensorboardX), by step from 1."""

    def __init__(self, folder: str) -> None:
        from tensorboardX import SummaryWriter

        self.writer = SummaryWriter(folder)

    def add(self, record: dict) -> None:
        step = record["step"]
        scalars = {"loss/train": record["loss"], "learning_rate": record["lr"],
                   "throughput/tokens_per_second": record["tokens"] / record["time_s"]}
        optional = {"loss/validation": "val_loss", "loss/aux": "aux_loss", "grad_norm": "grad_norm"}
        scalars |= {tag: record[key] for tag, key in optional.items() if record.get(key) is not None}
        scalars |= {f"bytes_sent/{axis}": sent for axis, sent in record.get("comm_bytes", {}).items()}
        for tag, value in scalars.items():
            self.writer.add_scalar(tag, value, step)

    def close(self) -> None:
        self.writer.close()


class NoTensorBoard:
    """No --tensorboard (or not rank 0): nothing written."""

    def add(self, record: dict) -> None:
        """Nothing to write."""

    def close(self) -> None:
        """Nothing to close."""


def describe_model(config: GPTConfig) -> str:
    """GPT-2, Llama, Mixtral (a llama with experts) or DeepSeek-V3."""
    if not config.is_llama:
        return "GPT-2"
    if config.is_deepseek:
        return "DeepSeek-V3"
    return "Mixtral" if config.n_experts else "Llama"


def _kv_heads(config: GPTConfig) -> str:
    return f" ({config.kv_heads} KV)" if config.kv_heads != config.n_head else ""


def model_flops_per_token(config: GPTConfig, seq_len: int) -> float:
    """Training FLOPs per token (forward and backward, no recomputation), as MFU counts them: 6 per weight a token
    multiplies (the embedding tables only as the head; of the experts only top-k of E), and 6·T·h per layer for
    causal attention's two products (QKᵀ and AV over T/2 keys on average: 2·2·(T/2)·h forward, twice that
    backward)."""
    weights = 0.0
    for name, shape in parameter_shapes(config).items():
        if name.endswith(("wte.weight", "wpe.weight")) and not (name.endswith("wte.weight") and config.tied):
            continue  # a lookup, no products (a tied wte is the head too)
        share = config.moe_top_k / config.n_experts if expert_index(name) is not None else 1.0
        weights += math.prod(shape) * share
    return 6 * weights + 6 * config.n_layer * seq_len * config.n_embd


def _duration(seconds: float) -> str:
    seconds = int(round(seconds))
    hours, rest = divmod(seconds, 3600)
    return f"{hours}:{rest // 60:02d}:{rest % 60:02d}" if hours else f"{rest // 60}:{rest % 60:02d}"


def reaches_a_terminal(stream: TextIO, environ: Mapping[str, str] = os.environ) -> bool:
    """Whether rank 0's output reaches a person's terminal, where a progress line may rewrite itself in place.
    The self-launching parent says (TERMINAL); else the stream itself — except under Open MPI's mpirun, which
    hands every rank a pseudo-terminal whatever its own output is (a pipe, a file: the log would fill with
    ESC[K), so there only TERMINAL says yes."""
    if environ.get(TERMINAL) in ("0", "1"):
        return environ[TERMINAL] == "1"
    return "OMPI_COMM_WORLD_SIZE" not in environ and stream.isatty()


class Reporter:
    """Rank 0's view of training: a progress line and the JSON log; other ranks print nothing."""

    def __init__(self, settings: TrainSettings, config: GPTConfig, is_root: bool, stream: TextIO = sys.stdout,
                 peak_flops: float = 0.0, first_step: int = 0) -> None:
        self.settings, self.is_root, self.stream = settings, is_root, stream
        self.interactive = is_root and reaches_a_terminal(stream)
        output = settings.output
        continues = output.resume or os.environ.get(CONTINUE_LOG) == "1"
        self.log = open(output.log_json, "a" if continues else "w") if is_root and output.log_json else None
        self.tensorboard = TensorBoardLog(output.tensorboard) if is_root and output.tensorboard else NoTensorBoard()
        self.every = max(1, settings.data.steps // 20)
        self.recent_losses: list[float] = []  # since the last kept line: one batch's loss is noisy
        self.recent_steps: deque[tuple[int, float]] = deque(maxlen=MOVING_STEPS)  # (tokens, seconds)
        self.flops_per_token = model_flops_per_token(config, settings.data.seq_len)
        self.peak_flops, self.first_step, self.started = peak_flops, first_step, time.perf_counter()
        if is_root:
            compute = f" ({settings.model.compute_dtype} compute)" if settings.model.compute_dtype else ""
            compute += f", FP8 {settings.model.fp8} GEMMs" if settings.model.fp8 != "none" else ""
            self.say(f"{describe_model(config)} {plural(config.n_layer, 'layer')}, {config.n_embd} channels, "
                     f"{plural(config.n_head, 'head')}{_kv_heads(config)}, vocab {config.vocab_size}: "
                     f"{config.parameter_count() / 1e6:.2f} M parameters; {settings.data.batch_size}×"
                     f"{settings.data.seq_len} tokens per step, {settings.model.dtype}{compute}")

    def step(self, record: dict) -> None:
        """Log one step's record; print its line (kept every `every` steps, at the first and last step and with a
        validation loss; rewritten in place between them on a terminal). A loss that is not finite stops."""
        if not self.is_root:
            return
        if self.log is not None:
            self.log.write(json.dumps(record) + "\n")
            self.log.flush()
        if os.environ.get(PROGRESS):  # for the --elastic parent: how far the run got before a loss
            Path(os.environ[PROGRESS]).write_text(f"{record['step']}\n")
        self.tensorboard.add(record)
        step, steps = record["step"], self.settings.data.steps
        self.recent_losses.append(record["loss"])
        self.recent_steps.append((record["tokens"], record["time_s"]))
        kept = step % self.every == 0 or step == self.first_step + 1 or "val_loss" in record or step == steps
        line = self.line(record)
        if self.interactive:  # the cursor goes back to the line's start: the next line overwrites it
            self.stream.write(f"{line}\033[K{chr(10) if kept else chr(13)}")
            self.stream.flush()
        elif kept:
            self.say(line)
        if kept:
            self.recent_losses.clear()
        if not math.isfinite(record["loss"]):
            raise FloatingPointError(f"the loss became {record['loss']} at step {step}/{steps}; try a smaller --lr")

    def line(self, record: dict) -> str:
        step, steps = record["step"], self.settings.data.steps
        mean = sum(self.recent_losses) / len(self.recent_losses)
        tokens, seconds = (sum(column) for column in zip(*self.recent_steps, strict=True))
        tokens_per_second = tokens / seconds if seconds > 0 else 0.0
        milliseconds = 1000 * seconds / len(self.recent_steps)
        line = (f"step {step:>5}/{steps} | loss {record['loss']:.4f}, mean of {len(self.recent_losses):>3} "
                f"{mean:.4f} | lr {record['lr']:.2e} | {tokens_per_second:,.0f} tok/s, {milliseconds:,.0f} ms/step")
        if self.peak_flops > 0:
            line += f", MFU {tokens_per_second * self.flops_per_token / self.peak_flops:.2%}"
        if "router" in record:
            line += (f" | aux {record['aux_loss']:.4f} | load max/mean {record['router']['max_over_mean_load']:.2f}, "
                     f"dropped {record['router']['dropped_tokens']}")
        if "val_loss" in record:
            line += f" | val {record['val_loss']:.4f}"
        elapsed, remaining = time.perf_counter() - self.started, (steps - step) * seconds / len(self.recent_steps)
        return line + f" | {_duration(elapsed)} elapsed, ETA {_duration(remaining)}"

    def say_from_every_rank(self, text: str, world: Any) -> None:
        """Print each rank's text in rank order (gathered to rank 0, so lines never interleave)."""
        texts = world.comm.gather(text, root=0)
        if self.is_root:
            self.say("\n".join(texts))

    def event(self, record: dict) -> None:
        """A record that is not a step's (an in-place recovery's restart event) into --log-json."""
        if self.log is not None:
            self.log.write(json.dumps(record) + "\n")
            self.log.flush()

    def say(self, text: str) -> None:
        if self.is_root:
            if self.interactive:  # clears a progress line the cursor sits at the start of
                self.stream.write("\033[K")
            print(text, file=self.stream, flush=True)

    def finish(self) -> None:
        if self.log is not None:
            self.log.close()
        self.tensorboard.close()
