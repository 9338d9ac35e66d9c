"""`mpiparallel data prepare` and `data info`: shards that decode back to the input text (through transformers'
own loading of the written tokenizer.json), the shard format chosen by vocabulary, and one clear error for each
bad input with nothing half-written."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
from mpi_harness import run_with_timeout

from mpiparallel.data import open_data
from mpiparallel.data import prepare as preparing
from mpiparallel.data.shards import MappedShard, read_header
from mpiparallel.data.tokenizer import END_OF_TEXT, load_tokenizer
from mpiparallel.errors import ConfigError

DOCUMENTS = ["The quick brown fox jumps over the lazy dog.\n" * 20,
             "Ünïcödé — ✓ and emoji 🚀 survive\r\nwith CRLF and    spaces\t\ttabs.\n",
             "",
             "def f(x):\n    return x * 2  # code too\n" * 30]


def mpiparallel(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return run_with_timeout([sys.executable, "-m", "mpiparallel", *args], timeout)


def corpus(tmp_path):
    """A folder of two text files (one in a subfolder) and a .jsonl file of two documents; returns the inputs and
    the documents in the order prepare reads them."""
    folder = tmp_path / "texts"
    (folder / "sub").mkdir(parents=True)
    (folder / "a.txt").write_bytes(DOCUMENTS[0].encode())
    (folder / "sub" / "b.txt").write_bytes(DOCUMENTS[1].encode())
    (folder / ".hidden.txt").write_text("never read")
    jsonl = tmp_path / "more.jsonl"
    jsonl.write_text("\n".join(json.dumps({"text": text, "id": i}) for i, text in enumerate(DOCUMENTS[2:])) + "\n")
    return [str(folder), str(jsonl)], DOCUMENTS


def all_tokens(folder) -> np.ndarray:
    """val then train shards, in the order prepare wrote them."""
    info = json.loads((folder / "data.json").read_text())
    return np.concatenate([MappedShard(folder / shard["file"]).read(0, shard["tokens"]) for shard in info["shards"]])


def test_bpe_shards_decode_back_to_the_input_through_transformers(tmp_path):
    from transformers import AutoTokenizer

    inputs, documents = corpus(tmp_path)
    out = tmp_path / "data"
    info = preparing.prepare(inputs, out, "bpe", vocab_size=300, val_tokens=50, shard_tokens=97)
    assert info["vocab_size"] == 300 and info["documents"] == 4 and info["shard_version"] == 1
    assert [s["file"] for s in info["shards"]][:2] == ["val_000000.bin", "train_000000.bin"]
    assert all(s["tokens"] == 97 for s in info["shards"][1:-1]) and len(info["shards"]) > 4  # documents cross shards
    tokens = all_tokens(out)
    assert info["val_tokens"] + info["train_tokens"] == len(tokens)
    loaded = AutoTokenizer.from_pretrained(str(out))  # transformers' own loading of what prepare wrote
    assert loaded.decode(tokens.tolist()) == "".join(END_OF_TEXT + document for document in documents)
    assert (tokens == info["eot_id"]).sum() == len(documents)
    assert loaded.eos_token == END_OF_TEXT
    # the written tokenizer given back as PATH encodes the same ids
    again = preparing.prepare(inputs, tmp_path / "again", str(out / "tokenizer.json"), val_tokens=50,
                              shard_tokens=97)
    np.testing.assert_array_equal(all_tokens(tmp_path / "again"), tokens)
    assert again["tokenizer_sha256"] == info["tokenizer_sha256"]
    assert open_data(str(out)).vocab_size == 300


def test_byte_shards_are_the_utf8_bytes_after_an_end_of_text_token(tmp_path):
    inputs, documents = corpus(tmp_path)
    info = preparing.prepare(inputs, tmp_path / "data", "byte", val_tokens=0)
    assert info["vocab_size"] == 257 and info["eot_id"] == 256 and info["shards"][0]["file"] == "train_000000.bin"
    assert not (tmp_path / "data" / "tokenizer.json").exists()
    expected = []
    for document in documents:
        expected += [256, *document.encode()]
    np.testing.assert_array_equal(all_tokens(tmp_path / "data"), expected)


def test_a_vocabulary_beyond_uint16_writes_version_7_shards(tmp_path):
    import tokenizers
    from tokenizers import models, pre_tokenizers

    vocab = {f"w{i}": i for i in range(69_999)} | {END_OF_TEXT: 69_999, "[UNK]": 70_000}
    big = tokenizers.Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    big.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    big.add_special_tokens([END_OF_TEXT])
    big.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "doc.txt").write_text("w69998 w5 w65536")
    info = preparing.prepare([tmp_path / "doc.txt"], tmp_path / "data", str(tmp_path), val_tokens=0)
    assert info["shard_version"] == 7 and info["eot_id"] == 69_999
    assert read_header(tmp_path / "data" / "train_000000.bin").version == 7
    np.testing.assert_array_equal(all_tokens(tmp_path / "data"), [69_999, 69_998, 5, 65_536])


def test_prepare_and_info_from_the_command_line(tmp_path):
    inputs, _ = corpus(tmp_path)
    out = tmp_path / "data"
    result = mpiparallel("data", "prepare", *inputs, "--out", str(out), "--tokenizer", "bpe", "--vocab-size", "280",
                         "--val-tokens", "40")
    assert result.returncode == 0, result.stderr
    assert "tokens/s" in result.stderr and f"wrote {out}" in result.stdout
    shown = mpiparallel("data", "info", str(out))
    assert shown.returncode == 0, shown.stderr
    assert "magic 20240520 version 1 (uint16)" in shown.stdout and "vocabulary 280" in shown.stdout
    assert "decoded: '<|endoftext|>The quick brown fox" in shown.stdout
    one = mpiparallel("data", "info", str(out / "val_000000.bin"), "--tokens", "4")
    assert one.returncode == 0 and "first 4 tokens of val_000000.bin" in one.stdout


def test_bad_inputs_are_one_clear_error_each_and_leave_nothing_behind(tmp_path):
    inputs, _ = corpus(tmp_path)
    (tmp_path / "latin1.txt").write_bytes("caf\xe9".encode("latin-1"))
    (tmp_path / "notext.jsonl").write_text('{"content": "x"}\n')
    (tmp_path / "broken.json").write_text("{not json")
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("taken")
    cases = [([str(tmp_path / "latin1.txt")], "byte", {}, "is not UTF-8 text"),
             ([str(tmp_path / "notext.jsonl")], "byte", {}, r'notext.jsonl:1 has no "text" string field'),
             (inputs, str(tmp_path / "broken.json"), {}, "cannot read tokenizer"),
             (inputs, str(tmp_path), {}, "has no tokenizer.json"),
             (inputs, "bpe", {}, "needs --vocab-size"),
             (inputs, "bpe", {"vocab_size": 100}, "at least 257"),
             (inputs, "byte", {"val_tokens": 10**6}, "none are left for training"),
             ([str(tmp_path / "missing.txt")], "byte", {}, "does not exist")]
    for files, tokenizer, options, message in cases:
        with pytest.raises(ConfigError, match=message):
            preparing.prepare(files, tmp_path / "out", tokenizer, **options)
        assert not (tmp_path / "out").exists()
    with pytest.raises(ConfigError, match="already exists and is not empty"):
        preparing.prepare(inputs, tmp_path / "full", "byte")
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []  # no partial folders


def test_an_interrupted_prepare_leaves_no_folder(tmp_path, monkeypatch):
    inputs, _ = corpus(tmp_path)
    calls = []

    def interrupted(self, texts):
        calls.append(len(texts))
        raise KeyboardInterrupt

    monkeypatch.setattr(preparing.tokenizers_.ByteTokenizer, "encode_batch", interrupted)
    with pytest.raises(KeyboardInterrupt):
        preparing.prepare(inputs, tmp_path / "out", "byte")
    assert calls and not (tmp_path / "out").exists()
    assert [p for p in tmp_path.iterdir() if p.name.startswith(".")] == []


def test_an_existing_tokenizer_names_its_end_of_text_token_or_it_is_an_error(tmp_path):
    import tokenizers
    from tokenizers import models

    plain = tokenizers.Tokenizer(models.WordLevel({"a": 0, "</s>": 1, "[UNK]": 2}, unk_token="[UNK]"))
    plain.save(str(tmp_path / "tokenizer.json"))
    assert load_tokenizer(tmp_path).eot_id == 1  # Llama 2's </s> taken as end-of-text
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": {"content": "a"}}))
    assert load_tokenizer(tmp_path).eot_id == 0  # the config's eos_token wins
    (tmp_path / "tokenizer_config.json").unlink()
    none = tokenizers.Tokenizer(models.WordLevel({"a": 0, "[UNK]": 1}, unk_token="[UNK]"))
    none.save(str(tmp_path / "tokenizer.json"))
    with pytest.raises(ConfigError, match="has no end-of-text token"):
        load_tokenizer(tmp_path / "tokenizer.json")


def test_train_on_a_prepared_folder_samples_and_saves_through_its_tokenizer(tmp_path):
    from transformers import AutoTokenizer

    inputs, _ = corpus(tmp_path)
    out = tmp_path / "data"
    info = preparing.prepare(inputs, out, "bpe", vocab_size=300, val_tokens=200)
    model = tmp_path / "model"
    log = tmp_path / "log.jsonl"
    result = mpiparallel("train", "--n-layer", "1", "--n-embd", "16", "--n-head", "2", "--seq-len", "16",
                         "--batch-size", "2", "--steps", "4", "--data", str(out), "--eval-every", "2",
                         "--eval-batches", "2", "--sample-tokens", "12", "--save", str(model), "--log-json", str(log))
    assert result.returncode == 0, result.stderr
    assert "vocab 300" in result.stdout  # the vocabulary comes from data.json
    records = [json.loads(line) for line in log.read_text().splitlines()]
    assert "val_loss" in records[1] and "val_loss" in records[3]
    loaded = AutoTokenizer.from_pretrained(str(model))  # beside the model, as transformers looks for it
    sample = result.stdout.strip().splitlines()[-1]
    assert sample.startswith("The")
    assert loaded.decode(loaded.encode("The quick")) == "The quick"
    assert json.loads((model / "config.json").read_text())["vocab_size"] == info["vocab_size"]
    generated = mpiparallel("generate", "--init", str(model), "--prompt", "def f", "--tokens", "5")
    assert generated.returncode == 0, generated.stderr
    assert generated.stdout.startswith("def f")
    too_small = mpiparallel("train", "--n-layer", "1", "--n-embd", "16", "--n-head", "2", "--seq-len", "16",
                            "--batch-size", "2", "--steps", "1", "--data", str(out), "--vocab-size", "256")
    assert too_small.returncode != 0 and too_small.stderr.count("Error:") == 1
    assert "tokenizer of vocabulary 300" in too_small.stderr and "--vocab-size 300" in too_small.stderr


def test_the_default_corpus_can_be_prepared_offline(tmp_path):
    from mpiparallel.data.sources import default_corpus_documents

    info = preparing.prepare([], tmp_path / "data", "byte", val_tokens=1000, default_corpus=True)
    documents = default_corpus_documents()[0]
    assert info["inputs"] == ["(default corpus)"] and info["documents"] == len(documents)
    expected = [token for document in documents for token in (256, *document.encode("utf-8"))]
    np.testing.assert_array_equal(all_tokens(tmp_path / "data"), expected)
    with pytest.raises(ConfigError, match="hold no files"):
        preparing.prepare([], tmp_path / "none", "byte")


def test_val_data_names_the_validation_tokens_and_a_broken_tokenizer_stops_training_at_once(tmp_path):
    inputs, _ = corpus(tmp_path)
    out = tmp_path / "data"
    preparing.prepare(inputs, out, "byte", val_tokens=300)
    val = MappedShard(out / "val_000000.bin").read(0, 300)
    np.save(tmp_path / "val.npy", val)
    common = ["--n-layer", "1", "--n-embd", "16", "--n-head", "2", "--seq-len", "16", "--batch-size", "2",
              "--steps", "2", "--eval-every", "2", "--eval-batches", "3"]
    losses = {}
    for name, options in {"folder": [], "shard": ["--val-data", str(out / "val_000000.bin")],
                          "npy": ["--val-data", str(tmp_path / "val.npy")]}.items():
        log = tmp_path / f"{name}.jsonl"
        result = mpiparallel("train", *common, "--data", str(out), *options, "--log-json", str(log))
        assert result.returncode == 0, result.stderr
        losses[name] = json.loads(log.read_text().splitlines()[-1])["val_loss"]
    assert losses["folder"] == losses["shard"] == losses["npy"]  # the val shard, whichever way it is named
    (out / "tokenizer.json").write_text("{broken")
    broken = mpiparallel("train", "-n", "2", *common, "--data", str(out))
    assert broken.returncode != 0 and broken.stderr.count("Error:") == 1
    assert "cannot read tokenizer" in broken.stderr
