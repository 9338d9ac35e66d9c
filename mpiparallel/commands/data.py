"""`mpiparallel data prepare` and `data info`: tokenize text into llm.c shards, and look into shards. No MPI."""

from __future__ import annotations

from pathlib import Path

import click


@click.group()
def data() -> None:
    """Prepare token shards for `train --data`, and inspect them (llm.c's too)."""


@data.command(context_settings={"show_default": True})
@click.argument("inputs", nargs=-1, metavar="INPUT...")
@click.option("--default-corpus", is_flag=True,
              help="Also (first) the corpus `train` uses without --data: Python's documentation, offline.")
@click.option("--out", type=click.Path(path_type=Path), required=True,
              help="Folder to write (must not exist, or be empty): train_*.bin, val_000000.bin, tokenizer.json, "
                   "data.json.")
@click.option("--tokenizer", default="byte", metavar="byte|bpe|PATH",
              help="byte: the 256 raw bytes (+ end-of-text); bpe: train a byte-level BPE on the inputs (offline, "
                   "Hugging Face tokenizers); PATH: a tokenizer.json or a model folder holding one (GPT-2's, Llama's).")
@click.option("--vocab-size", type=click.IntRange(min=1), default=None, help="The BPE's vocabulary (--tokenizer bpe).")
@click.option("--val-tokens", type=click.IntRange(min=0), default=32_768,
              help="Tokens, from the start, that form val_000000.bin (0: no validation shard).")
@click.option("--shard-tokens", type=click.IntRange(min=1), default=100_000_000, help="Tokens per train shard.")
def prepare(inputs: tuple[str, ...], default_corpus: bool, out: Path, tokenizer: str, vocab_size: int | None,
            val_tokens: int, shard_tokens: int) -> None:
    """Tokenize text files, folders of them, or .jsonl files (their "text" field) into llm.c shards.

    Each text file is one document, each .jsonl line another; an end-of-text token goes before each. Shards
    hold uint16 tokens (llm.c version 1) when the vocabulary fits, else uint32 (version 7). Memory stays bounded
    whatever the corpus size; the folder appears only when complete.

    \b
    Examples:
      mpiparallel data prepare --default-corpus --out data/pydoc --tokenizer bpe --vocab-size 2048
      mpiparallel data prepare books/ --out data/books --tokenizer bpe --vocab-size 8192
      mpiparallel data prepare corpus.jsonl --out data/gpt2 --tokenizer gpt2-model-folder/
      mpiparallel train --data data/books --eval-every 100 --sample-tokens 200
    """
    if not inputs and not default_corpus:
        raise click.UsageError("give INPUT files or folders, or --default-corpus")
    from ..data import prepare as preparing
    from ..text import plural

    info = preparing.prepare(inputs, out, tokenizer, vocab_size, val_tokens, shard_tokens,
                             default_corpus=default_corpus)
    shards = len(info["shards"]) - (val_tokens > 0)
    click.echo(f"wrote {out}: {plural(info['train_tokens'], 'train token')} in {plural(shards, 'shard')}, "
               f"{plural(info['val_tokens'], 'val token')}, vocabulary {info['vocab_size']} "
               f"(end-of-text {info['eot_id']}), from {plural(info['documents'], 'document')}")


@data.command()
@click.argument("path", type=click.Path(path_type=Path))
@click.option("--tokens", "first_tokens", type=click.IntRange(min=0), default=32, show_default=True,
              help="How many of the first tokens to show, decoded.")
def info(path: Path, first_tokens: int) -> None:
    """Print a data folder's or one shard's header, token counts, tokenizer and first tokens decoded.

    \b
    Examples:
      mpiparallel data info data/books
      mpiparallel data info fineweb10B/fineweb_val_000000.bin
    """
    from ..data import prepare as preparing

    click.echo(preparing.describe(path, first_tokens))
