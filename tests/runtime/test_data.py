"""Token files, the default corpus and llm.c's batch order, as `mpiparallel.data` states them."""

from __future__ import annotations

import sys

import numpy as np
import pytest

from mpiparallel.data import (
    TokenData,
    batch_for_step,
    check_vocab,
    default_corpus,
    full_batch_count,
    load_tokens,
    microbatches,
    rows_for_rank,
    split_train_validation,
)
from mpiparallel.errors import ConfigError


def test_step_reads_window_j_and_targets_are_the_inputs_shifted_by_one():
    tokens = np.arange(100)
    inputs, targets = batch_for_step(tokens, 1, batch_size=2, seq_len=3)  # B·T = 6, window [6, 13)
    np.testing.assert_array_equal(inputs, [[6, 7, 8], [9, 10, 11]])
    np.testing.assert_array_equal(targets, [[7, 8, 9], [10, 11, 12]])


def test_steps_wrap_around_after_k_full_batches():
    tokens = np.arange(26)  # K = ⌊25 / 6⌋ = 4
    assert full_batch_count(len(tokens), 2, 3) == 4
    for step in range(12):
        inputs, targets = batch_for_step(tokens, step, 2, 3)
        start = (step % 4) * 6
        np.testing.assert_array_equal(inputs.reshape(-1), np.arange(start, start + 6))
        np.testing.assert_array_equal(targets.reshape(-1), np.arange(start + 1, start + 7))


def test_the_last_full_batch_may_end_on_the_last_token():
    tokens = np.arange(13)  # exactly 2·6 + 1 tokens: two batches
    _, targets = batch_for_step(tokens, 1, 2, 3)
    assert targets[-1, -1] == 12
    assert full_batch_count(12, 2, 3) == 1


def test_too_little_data_for_one_batch_is_a_config_error():
    with pytest.raises(ConfigError, match=r"data has 6 tokens, one batch of 2×3 needs 7"):
        batch_for_step(np.arange(6), 0, 2, 3)


def test_rows_for_rank_keeps_contiguous_equal_row_blocks():
    inputs, targets = batch_for_step(np.arange(100), 0, 4, 2)
    kept = [rows_for_rank(inputs, targets, rank, 2) for rank in range(2)]
    np.testing.assert_array_equal(kept[0][0], inputs[:2])
    np.testing.assert_array_equal(kept[1][1], targets[2:])
    with pytest.raises(ConfigError, match="not divisible by 3"):
        rows_for_rank(inputs, targets, 0, 3)


def test_microbatches_split_rows_in_order():
    inputs, targets = batch_for_step(np.arange(100), 0, 4, 2)
    parts = microbatches(inputs, targets, 4)
    assert len(parts) == 4
    for i, (micro_inputs, micro_targets, _) in enumerate(parts):
        np.testing.assert_array_equal(micro_inputs, inputs[i:i + 1])
        np.testing.assert_array_equal(micro_targets, targets[i:i + 1])
    with pytest.raises(ConfigError, match="3 equal microbatches"):
        microbatches(inputs, targets, 3)


def test_validation_is_the_last_contiguous_fraction():
    train, validation = split_train_validation(np.arange(100), 0.1)
    np.testing.assert_array_equal(train, np.arange(90))
    np.testing.assert_array_equal(validation, np.arange(90, 100))
    train, validation = split_train_validation(np.arange(100), 0.0)
    assert len(train) == 100 and len(validation) == 0
    with pytest.raises(ConfigError, match="validation fraction"):
        split_train_validation(np.arange(10), 1.0)


def test_default_corpus_is_python_documentation_in_mostly_printable_ascii():
    corpus = load_tokens(None)
    assert corpus.tokens.dtype == np.int64 and corpus.tokens.ndim == 1
    assert len(corpus.tokens) > 100_000
    printable = (corpus.tokens >= 32) & (corpus.tokens < 127) | (corpus.tokens == ord("\n"))
    assert printable.mean() > 0.99
    assert corpus.vocab_size_needed <= 256
    assert "pydoc_data" in corpus.description
    assert b"for" in bytes(corpus.tokens[:5000].astype(np.uint8))


def test_default_corpus_falls_back_to_stdlib_docstrings_without_pydoc_data(monkeypatch):
    monkeypatch.setitem(sys.modules, "pydoc_data.topics", None)  # makes the import fail
    corpus = default_corpus()
    assert "standard-library" in corpus.description
    assert len(corpus.tokens) > 50_000
    np.testing.assert_array_equal(corpus.tokens, default_corpus().tokens)  # deterministic


def test_text_file_is_read_as_utf8_bytes(tmp_path):
    path = tmp_path / "tiny.txt"
    path.write_text("héllo", encoding="utf-8")
    data = load_tokens(str(path))
    np.testing.assert_array_equal(data.tokens, list("héllo".encode()))
    assert data.tokens.dtype == np.int64
    assert data.vocab_size_needed == max("héllo".encode()) + 1
    assert str(path) in data.description


def test_npy_file_gives_its_token_ids(tmp_path):
    path = tmp_path / "tokens.npy"
    np.save(path, np.array([5, 0, 50256, 7], dtype=np.uint16))
    data = load_tokens(path)
    np.testing.assert_array_equal(data.tokens, [5, 0, 50256, 7])
    assert data.tokens.dtype == np.int64 and data.vocab_size_needed == 50257


@pytest.mark.parametrize("array, message", [
    (np.zeros((2, 3), dtype=np.int32), "2-D"),
    (np.zeros(4, dtype=np.float32), "float32"),
    (np.array([1, -2, 3]), "negative token id"),
    (np.array([], dtype=np.int64), "no tokens"),
])
def test_bad_npy_contents_are_config_errors(tmp_path, array, message):
    path = tmp_path / "bad.npy"
    np.save(path, array)
    with pytest.raises(ConfigError, match=message):
        load_tokens(path)


def test_corrupt_npy_and_missing_files_are_config_errors(tmp_path):
    corrupt = tmp_path / "corrupt.npy"
    corrupt.write_bytes(b"not an array")
    with pytest.raises(ConfigError, match="not a readable .npy"):
        load_tokens(corrupt)
    with pytest.raises(ConfigError, match=r"nowhere\.txt does not exist"):
        load_tokens(tmp_path / "nowhere.txt")
    with pytest.raises(ConfigError, match="is a directory"):
        load_tokens(tmp_path)
    empty = tmp_path / "empty.txt"
    empty.write_bytes(b"")
    with pytest.raises(ConfigError, match="no tokens"):
        load_tokens(empty)


def test_token_ids_beyond_the_vocabulary_are_config_errors():
    data = TokenData(np.array([1, 300]), 301, "tokens.npy")
    check_vocab(data, 301)
    with pytest.raises(ConfigError, match="token id 300.*--vocab-size 301"):
        check_vocab(data, 256)
