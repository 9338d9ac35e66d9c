"""The data a first run trains on: Python's documentation tokenized by a BPE trained on it, prepared once into the
cache and found there afterwards — by every rank, whether or not the ranks share the cache folder."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from mpi_harness import mpiexec_path, run_with_timeout

from mpiparallel.data import prepare as preparing
from mpiparallel.data.shards import MappedShard
from mpiparallel.data.sources import default_corpus_documents, default_corpus_text
from mpiparallel.data.tokenizer import END_OF_TEXT, load_tokenizer
from mpiparallel.errors import ConfigError

TINY = ["--n-layer", "1", "--n-embd", "16", "--n-head", "2", "--seq-len", "16", "--batch-size", "4", "--steps", "2"]


def files_of(folder) -> dict[str, bytes]:
    return {path.name: path.read_bytes() for path in sorted(folder.iterdir())}


def first_losses(log) -> list[float]:
    return [json.loads(line)["loss"] for line in log.read_text().splitlines()]


def test_the_default_corpus_is_prepared_once_with_its_own_bpe_and_decodes_back_to_the_text(tmp_path):
    said: list[str] = []
    folder = preparing.cached_default_corpus(tmp_path / "a", announce=said.append)
    assert len(said) == 1 and str(folder) in said[0]
    info = json.loads((folder / "data.json").read_text())
    assert info["tokenizer"] == "bpe" and info["vocab_size"] == preparing.DEFAULT_VOCAB_SIZE
    assert info["val_tokens"] == preparing.DEFAULT_VAL_TOKENS
    tokenizer = load_tokenizer(folder)
    tokens = [*MappedShard(folder / "val_000000.bin").read(0, info["val_tokens"]),
              *MappedShard(folder / "train_000000.bin").read(0, info["train_tokens"])]
    documents = default_corpus_documents()[0]
    assert info["documents"] == len(documents) > 50  # a document per topic, each opened by the end-of-text token
    assert tokenizer.decode(tokens) == "".join(END_OF_TEXT + document for document in documents)
    text_bytes = len(default_corpus_text()[0].encode())
    assert 3.0 < text_bytes / len(tokens) < 4.5  # a real BPE: several bytes per token

    built = (folder / "data.json").stat().st_mtime_ns
    assert preparing.cached_default_corpus(tmp_path / "a", announce=said.append) == folder
    assert len(said) == 1 and (folder / "data.json").stat().st_mtime_ns == built  # found, not rebuilt
    again = preparing.cached_default_corpus(tmp_path / "b")
    assert again.name == folder.name and files_of(again) == files_of(folder)  # deterministic, byte for byte


def test_processes_preparing_it_at_once_leave_one_complete_folder(tmp_path):
    """Ranks whose nodes share no cache folder each build it; two processes of one node racing must both succeed
    and leave one folder (the race itself depends on timing: the assertions hold whichever process wins)."""
    code = ("import sys; from pathlib import Path; from mpiparallel.data.prepare import cached_default_corpus; "
            "print(cached_default_corpus(Path(sys.argv[1])))")
    racers = [subprocess.Popen([sys.executable, "-c", code, str(tmp_path)], stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True) for _ in range(3)]
    # bounded: communicate(timeout=120) below; the racers are killed in `finally`
    try:
        results = [racer.communicate(timeout=120) for racer in racers]
    finally:
        for racer in racers:
            racer.kill()
    assert all(racer.returncode == 0 for racer in racers), results
    assert len({out.strip() for out, _ in results}) == 1
    assert [path.name for path in tmp_path.iterdir()] == [os.path.basename(results[0][0].strip())]  # no leftovers


def test_an_unwritable_cache_is_one_clear_error(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    with pytest.raises(ConfigError, match="set MPIPARALLEL_CACHE to a writable folder"):
        preparing.cached_default_corpus(blocker / "cache")
    result = run_with_timeout([sys.executable, "-m", "mpiparallel", "train", "-n", "2", *TINY], 120,
                              env={**os.environ, "MPIPARALLEL_CACHE": str(blocker / "cache")})
    assert result.returncode != 0
    assert (result.stdout + result.stderr).count("cannot prepare the default corpus") == 1, result.stderr
    assert "Traceback" not in result.stderr


def test_training_without_data_builds_the_cache_on_rank_0_and_every_rank_trains_the_same_tokens(tmp_path):
    environment = {**os.environ, "MPIPARALLEL_CACHE": str(tmp_path / "shared")}
    runs = {}
    for name in ("first", "cached"):
        log = tmp_path / f"{name}.jsonl"
        runs[name] = run_with_timeout([sys.executable, "-m", "mpiparallel", "train", "-n", "2", *TINY,
                                       "--log-json", str(log)], 120, env=environment)
        assert runs[name].returncode == 0, runs[name].stderr
        assert "vocab 2048" in runs[name].stdout
    assert runs["first"].stdout.count("preparing the default corpus once") == 1
    assert "preparing the default corpus" not in runs["cached"].stdout
    assert first_losses(tmp_path / "first.jsonl") == first_losses(tmp_path / "cached.jsonl")

    # two "nodes" that share no cache: rank 1 does not find rank 0's folder and builds the same one itself
    separate = tmp_path / "separate.jsonl"
    rank = [sys.executable, "-m", "mpiparallel", "train", *TINY, "--log-json", str(separate)]
    result = run_with_timeout([mpiexec_path(), "-n", "1", "-env", "MPIPARALLEL_CACHE", str(tmp_path / "node0"), *rank,
                               ":", "-n", "1", "-env", "MPIPARALLEL_CACHE", str(tmp_path / "node1"), *rank], 120)
    assert result.returncode == 0, result.stderr
    built = [files_of(next((tmp_path / node).iterdir())) for node in ("node0", "node1")]
    assert built[0] == built[1] == files_of(next((tmp_path / "shared").iterdir()))
    assert first_losses(separate) == first_losses(tmp_path / "first.jsonl")
