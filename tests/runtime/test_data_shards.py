"""llm.c shards and the batch order over them: the header layout, memory-mapped reads, the order across shard
boundaries and under --shuffle, and training on shards against training on the same tokens in a `.npy`."""

from __future__ import annotations

import json
import struct
import subprocess
import sys

import numpy as np
import pytest
from mpi_harness import run_with_timeout

from mpiparallel.data import BatchOrder, in_memory, open_data
from mpiparallel.data.shards import MappedShard, read_header, resident_bytes, write_shard
from mpiparallel.errors import ConfigError

TINY = ["--n-layer", "1", "--n-embd", "16", "--n-head", "2", "--seq-len", "8", "--batch-size", "4",
        "--dtype", "float64", "--lr", "1e-2"]
B, T = 4, 8


def mpiparallel(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return run_with_timeout([sys.executable, "-m", "mpiparallel", *args], timeout)


def llmc_shard_by_hand(path, tokens, version: int) -> None:
    """A shard written as llm.c's Python writer does, without our writer: 256 int32 then the tokens."""
    magic = {1: 20240520, 7: 20240801}[version]
    header = struct.pack("<256i", magic, version, len(tokens), *([0] * 253))
    fmt = "<%dH" if version == 1 else "<%dI"
    path.write_bytes(header + struct.pack(fmt % len(tokens), *tokens))


@pytest.mark.parametrize("version, top", [(1, 50256), (7, 128255)])
def test_a_shard_written_by_hand_in_llmc_layout_reads_back(tmp_path, version, top):
    tokens = [top, 0, 1, 65535 if version == 1 else 70000, 7]
    path = tmp_path / "fineweb_train_000001.bin"
    llmc_shard_by_hand(path, tokens, version)
    header = read_header(path)
    assert (header.version, header.token_count) == (version, 5)
    np.testing.assert_array_equal(MappedShard(path).read(0, 5), tokens)
    ours = tmp_path / "ours.bin"
    write_shard(ours, np.array(tokens), version)
    assert ours.read_bytes() == path.read_bytes()  # our writer produces llm.c's bytes exactly


def test_bad_shards_are_one_clear_error_each(tmp_path):
    good = tmp_path / "good.bin"
    llmc_shard_by_hand(good, list(range(10)), 1)
    raw = good.read_bytes()
    cases = {"magic": (struct.pack("<i", 12345) + raw[4:], "not an llm.c token shard: magic 12345"),
             "version": (raw[:4] + struct.pack("<i", 7) + raw[8:], "magic 20240520 version 7"),
             "truncated": (raw[:-3], "truncated: its header promises 10 tokens"),
             "long": (raw + b"\0\0", "longer than its header says"),
             "short": (raw[:100], "shorter than an llm.c shard header")}
    for name, (content, message) in cases.items():
        path = tmp_path / f"{name}.bin"
        path.write_bytes(content)
        with pytest.raises(ConfigError, match=message):
            MappedShard(path)
    with pytest.raises(ConfigError, match="matches no file"):
        open_data(str(tmp_path / "nothing_*.bin"))
    with pytest.raises(ConfigError, match=r"has no \*train\*\.bin shards"):
        open_data(str(tmp_path))


def test_the_order_numbers_each_shards_full_batches_and_never_crosses_a_shard():
    lengths = [2 * B * T + 5, B * T, 3 * B * T + 1]  # K = 2, 0 (one token short), 3
    order = BatchOrder(lengths, B, T)
    assert order.batch_count == 5
    expected = [(0, 0), (0, B * T), (2, 0), (2, B * T), (2, 2 * B * T)]
    assert [order.locate(step) for step in range(10)] == expected * 2  # and wraps around after K
    with pytest.raises(ConfigError, match=r"has 10 tokens in 2 shards .* a batch never crosses a shard"):
        BatchOrder([5, 5], 1, 8)


def test_shuffle_permutes_each_epoch_as_a_pure_function_of_seed_and_epoch():
    order = BatchOrder([B * T * 50 + 1], B, T, shuffle=True, seed=3)
    epochs = [[order.batch_number(e * 50 + i) for i in range(50)] for e in range(3)]
    for epoch in epochs:
        assert sorted(epoch) == list(range(50))  # every batch once per epoch
    assert epochs[0] != epochs[1] != epochs[2] and epochs[0] != list(range(50))
    again = BatchOrder([B * T * 50 + 1], B, T, shuffle=True, seed=3)
    assert [again.batch_number(s) for s in (120, 3, 77)] == [epochs[2][20], epochs[0][3], epochs[1][27]]
    other_seed = BatchOrder([B * T * 50 + 1], B, T, shuffle=True, seed=4)
    assert [other_seed.batch_number(i) for i in range(50)] != epochs[0]


def test_a_rank_reads_only_its_rows_and_they_are_the_batchs_rows():
    tokens = np.arange(1000)
    reads = []
    batches = in_memory(tokens, B, T)
    reader = batches.reader
    batches.reader = lambda *span: reads.append(span) or reader(*span)
    whole_inputs, whole_targets = batches.batch(3)
    for rank in range(2):
        inputs, targets = batches.rows_for_rank(3, rank, 2)
        np.testing.assert_array_equal(inputs, whole_inputs[2 * rank:2 * rank + 2])
        np.testing.assert_array_equal(targets, whole_targets[2 * rank:2 * rank + 2])
    start = 3 * B * T
    assert reads[1:] == [(0, start, start + 2 * T + 1), (0, start + 2 * T, start + 4 * T + 1)]


def test_reading_a_whole_shard_does_not_grow_the_resident_set(tmp_path):
    path = tmp_path / "big.bin"
    count = 48 << 20  # 96 MiB of uint16
    with open(path, "wb") as file:
        file.write(struct.pack("<256i", 20240520, 1, count, *([0] * 253)))
        file.truncate(1024 + 2 * count)  # zeros, without writing them from this process
    shard = MappedShard(path)
    before, _ = resident_bytes()
    chunk = 1 << 20
    for start in range(0, count, chunk):
        shard.read(start, start + chunk)
    after, _ = resident_bytes()
    assert after - before < 16 << 20, f"resident set grew by {(after - before) >> 20} MiB reading 96 MiB"


def _shards_of(tokens: np.ndarray, folder, counts, version: int, tail: int = 3) -> None:
    """Cut `tokens` into shards of `counts` full batches; consecutive shards share their boundary token (the last
    target of one shard's last window is the first input of the next shard's first), and each shard gets `tail`
    junk tokens after its last window, which the order must never read."""
    folder.mkdir()
    start = 0
    for i, k in enumerate(counts):
        window = tokens[start:start + k * B * T + 1]
        junk = np.full(tail, 63)
        write_shard(folder / f"train_{i:06d}.bin", np.concatenate([window, junk]), version)
        start += k * B * T


@pytest.mark.parametrize("version", [1, 7])
def test_npy_and_shards_of_the_same_tokens_train_bit_identically_across_shard_boundaries(tmp_path, version):
    rng = np.random.default_rng(version)
    counts = [2, 1, 3]
    tokens = rng.integers(0, 60, sum(counts) * B * T + 1)
    np.save(tmp_path / "tokens.npy", tokens.astype(np.uint16))
    _shards_of(tokens, tmp_path / "shards", counts, version)
    runs = {"npy": str(tmp_path / "tokens.npy"), "glob": str(tmp_path / "shards" / "train_*.bin")}
    logs = {}
    for name, data in runs.items():
        log = tmp_path / f"{name}.jsonl"
        result = mpiparallel("train", *TINY, "--vocab-size", "64", "--steps", "8", "--data", data,
                             "--log-json", str(log), "--save", str(tmp_path / name))
        assert result.returncode == 0, result.stderr
        logs[name] = [json.loads(line)["loss"] for line in log.read_text().splitlines()]
    assert logs["npy"] == logs["glob"]  # 8 steps: every batch of all three shards, then wrapping around
    npy_weights = (tmp_path / "npy" / "model.safetensors").read_bytes()
    assert npy_weights == (tmp_path / "glob" / "model.safetensors").read_bytes()
    one_shard = tmp_path / "one.bin"
    write_shard(one_shard, tokens, version)
    log = tmp_path / "one.jsonl"
    result = mpiparallel("train", *TINY, "--vocab-size", "64", "--steps", "4", "--data", str(one_shard),
                         "--eval-every", "2", "--eval-batches", "1", "--validation-fraction", "0.3",
                         "--log-json", str(log))
    assert result.returncode == 0, result.stderr
    npy_log = tmp_path / "npy_eval.jsonl"
    result = mpiparallel("train", *TINY, "--vocab-size", "64", "--steps", "4", "--data", runs["npy"],
                         "--eval-every", "2", "--eval-batches", "1", "--validation-fraction", "0.3",
                         "--log-json", str(npy_log))
    assert result.returncode == 0, result.stderr
    assert log.read_text() != "" and [json.loads(x)["loss"] for x in log.read_text().splitlines()] == \
        [json.loads(x)["loss"] for x in npy_log.read_text().splitlines()]
    assert [json.loads(x).get("val_loss") for x in log.read_text().splitlines()] == \
        [json.loads(x).get("val_loss") for x in npy_log.read_text().splitlines()]


@pytest.mark.parametrize("shuffle", [[], ["--shuffle"]])
def test_a_run_resumed_on_another_mesh_sees_the_same_tokens(tmp_path, shuffle):
    rng = np.random.default_rng(7)
    _shards_of(rng.integers(0, 60, 5 * B * T + 1), tmp_path / "data", [2, 3], 1)
    common = [*TINY, "--vocab-size", "64", "--data", str(tmp_path / "data"), *shuffle]
    whole = tmp_path / "whole.jsonl"
    result = mpiparallel("train", *common, "--steps", "8", "--log-json", str(whole))  # 8 steps: into epoch 2
    assert result.returncode == 0, result.stderr
    part = tmp_path / "part.jsonl"
    checkpoints = ["--checkpoint-dir", str(tmp_path / "ckpt"), "--checkpoint-every", "3"]
    result = mpiparallel("train", "-n", "2", *common, "--steps", "3", "--log-json", str(part), *checkpoints)
    assert result.returncode == 0, result.stderr
    result = mpiparallel("train", *common, "--steps", "8", "--resume", "--log-json", str(part), *checkpoints)
    assert result.returncode == 0, result.stderr
    expected = [json.loads(line)["loss"] for line in whole.read_text().splitlines()]
    resumed = [json.loads(line)["loss"] for line in part.read_text().splitlines()]
    np.testing.assert_allclose(resumed, expected, rtol=1e-9, atol=0)
    manifest = json.loads((tmp_path / "ckpt" / "step-00000006" / "manifest.json").read_text())
    position = manifest["data_position"]
    assert position["fingerprint"]["files"][0]["name"] == "train_000000.bin"
    assert position["shuffle"] == bool(shuffle) and position["epoch"] == 1 and position["batches_per_pass"] == 5
    # the same checkpoint against other data, or another order, is one clear error
    write_shard(tmp_path / "data" / "train_000002.bin", np.arange(40), 1)
    other = mpiparallel("train", *common, "--steps", "9", "--resume", *checkpoints)
    assert other.returncode != 0 and other.stderr.count("Error:") == 1
    assert "cannot resume from" in other.stderr and "on other data" in other.stderr
    (tmp_path / "data" / "train_000002.bin").unlink()
    flipped = [*TINY, "--vocab-size", "64", "--data", str(tmp_path / "data"), *([] if shuffle else ["--shuffle"])]
    other = mpiparallel("train", *flipped, "--steps", "9", "--resume", *checkpoints)
    assert other.returncode != 0 and "--shuffle was" in other.stderr


def test_token_ids_beyond_the_vocabulary_in_a_shard_stop_every_rank_with_one_message(tmp_path):
    folder = tmp_path / "data"
    folder.mkdir()
    tokens = np.zeros(6 * B * T + 1, dtype=np.int64)
    tokens[3 * B * T + 2 * T + 5] = 300  # in the fourth batch, the second rank's rows
    write_shard(folder / "train_000000.bin", tokens, 1)
    result = mpiparallel("train", "-n", "2", *TINY, "--steps", "5", "--data", str(folder))
    assert result.returncode != 0
    assert result.stderr.count("Error:") == 1 and "Traceback" not in result.stderr
    assert "holds token id 300" in result.stderr and "--vocab-size 301" in result.stderr
    short = mpiparallel("train", *TINY, "--steps", "1", "--data", str(folder / "train_000000.bin"),
                        "--batch-size", "64")
    assert short.returncode != 0 and "one batch of 64×8 needs 513" in short.stderr
