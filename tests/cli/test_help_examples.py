"""Every example in every `--help` runs: taken from the commands themselves (so a new example is run too), one test
each, run in order in one folder (an example may read what an earlier one wrote: run the module whole), each
shortened by options appended after it
(click keeps an option's last value: `--steps 2`, a smaller size sweep) that leave its configuration as written.

An example that needs a GPU, on a machine without one, must end with one clear error and no traceback."""

from __future__ import annotations

import os
import shlex
import sys
from pathlib import Path

import click
import pytest
from mpi_harness import run_with_timeout

from models.transformer import GPTConfig, Transformer
from mpiparallel.checkpoints import hugging_face
from mpiparallel.commands.cli import main

SHORTER = {  # appended to a command's examples so that they run in seconds on a loaded 2-core machine
    "train": ["--steps", "2"],
    "bench": ["-b", "8", "-e", "4K", "--iters", "1", "-w", "0"],
    "verify": ["--max-count", "40"],
    "generate": ["--tokens", "5"],
}
NEEDS_GPU = ("--compare nccl", "--against nccl", "--device gpu")


def commands(group: click.Group = main, prefix: tuple[str, ...] = ()) -> list[tuple[tuple[str, ...], click.Command]]:
    found = []
    for name, command in sorted(group.commands.items()):
        found.append(((*prefix, name), command))
        if isinstance(command, click.Group):
            found += commands(command, (*prefix, name))
    return found


WRITERS_FIRST = (("data", "prepare"), ("train",))
"""Commands whose examples write what others' read (data folders, model folders): their examples run first."""


def help_examples() -> list[str]:
    """The example lines of every command's help (continuation lines joined; `a && b` is two), the writers'
    first."""
    examples = []
    found = commands()
    for _, command in sorted(found, key=lambda entry: entry[0] not in WRITERS_FIRST):
        lines = (command.help or "").replace("Example:", "Examples:").split("Examples:", 1)[1:]
        text = lines[0].replace("\\\n", " ") if lines else ""
        for line in text.splitlines():
            for part in line.split("&&"):
                if part.strip().startswith(("mpiparallel ", "mpiexec ")):
                    examples.append(" ".join(part.split()))
    return examples


def as_arguments(example: str, home: Path) -> list[str]:
    """The example as `python -m mpiparallel` arguments: `mpiexec -n N mpiparallel ARGS` becomes `ARGS -n N`, `~`
    is `home`, and the command's SHORTER options follow."""
    words = [word.replace("~/", f"{home}/") for word in shlex.split(example)]
    ranks = []
    if words[0] == "mpiexec":
        ranks, words = ["-n", words[2]], words[3:]
    words = words[1:]
    return [*words, *ranks, *SHORTER.get(words[0], [])]


def make_inputs(folder: Path) -> None:
    """The files the examples name: text, a folder of books, JSON lines, a model folder with a tokenizer, a
    GPT-2-sized vocabulary folder for --prompt-ids."""
    text = "".join(f"Line {i}: the quick brown fox jumps over the lazy dog, again and again.\n" for i in range(3000))
    (folder / "corpus.txt").write_text(text)
    (folder / "books").mkdir()
    for i in range(3):
        (folder / "books" / f"book{i}.txt").write_text(text[i::3] * 2)
    (folder / "corpus.jsonl").write_text("".join(f'{{"text": "{line}"}}\n' for line in text.splitlines()))
    config = GPTConfig(vocab_size=50257, n_positions=64, n_embd=16, n_layer=1, n_head=2)
    hugging_face.save_pretrained(folder / "gpt2-dir", config, Transformer(config).state_dict())


def gpu_available() -> bool:
    from collectives import backend

    return backend.gpu_unavailable_reason() is None


def test_the_help_examples_are_found_and_show_every_parallel_axis():
    examples = help_examples()
    assert any(example.startswith("mpiexec -n 8 mpiparallel bench") for example in examples)
    for flag in ("--tp", "--pp", "--cp", "--ep", "--zero", "--sp", "--schedule zbv"):
        assert any(f" {flag} " in f"{example} " for example in examples), flag


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One folder for all the examples, in which they run in order (an example may read an earlier one's output)."""
    made = tmp_path_factory.mktemp("examples")
    make_inputs(made)
    return made


@pytest.mark.parametrize("example", help_examples())
def test_help_example_runs(example: str, folder: Path) -> None:
    prepare_for(example, folder)
    arguments = as_arguments(example, folder)
    result = run_with_timeout([sys.executable, "-m", "mpiparallel", *arguments], timeout=580, cwd=folder,
                              env={**os.environ, "HOME": str(folder)})  # plan --calibrate writes to ~
    if any(flag in example for flag in NEEDS_GPU) and not gpu_available():
        assert result.returncode != 0 and "Traceback" not in result.stderr and "rror" in result.stderr, \
            f"without a GPU, expected one clear error; got {result.returncode}: {result.stderr[-800:]}"
    else:
        assert result.returncode == 0, f"run as {' '.join(arguments)}: {result.stderr[-1500:]}"


def prepare_for(example: str, folder: Path) -> None:
    """What an example reads that no earlier example writes: a tokenizer folder, a checkpoint, an llm.c shard."""
    if example.startswith("mpiparallel data prepare corpus.jsonl"):
        (folder / "gpt2-model-folder").mkdir(exist_ok=True)
        (folder / "gpt2-model-folder" / "tokenizer.json").write_bytes(
            (folder / "data" / "books" / "tokenizer.json").read_bytes())
    if example.startswith(("mpiparallel checkpoint info checkpoints/", "mpiparallel checkpoint export checkpoints/")):
        made = run_with_timeout([sys.executable, "-m", "mpiparallel", "train", "--steps", "1", "--checkpoint-dir",
                                 "checkpoints", "--checkpoint-every", "1"], timeout=580, cwd=folder)
        assert made.returncode == 0, made.stderr
    if "fineweb10B/" in example:  # an llm.c shard, as fineweb.py writes them: one of ours
        (folder / "fineweb10B").mkdir(exist_ok=True)
        (folder / "fineweb10B" / "fineweb_val_000000.bin").write_bytes(
            (folder / "data" / "books" / "val_000000.bin").read_bytes())
