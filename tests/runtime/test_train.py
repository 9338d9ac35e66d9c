"""`mpiparallel train` and `generate` end to end, and the serial model's learning behaviour."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys

import numpy as np
import pytest
from commands import mpiparallel
from mpi_harness import run_with_timeout

from models.transformer import GPTConfig, Transformer
from mpiparallel import optim

TINY = ["--n-layer", "1", "--n-embd", "32", "--n-head", "2", "--seq-len", "32", "--batch-size", "4"]


def read_log(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_training_on_the_default_corpus_lowers_the_loss_and_logs_every_step(tmp_path):
    log = tmp_path / "log.jsonl"
    result = mpiparallel("train", *TINY, "--steps", "40", "--lr", "3e-3", "--log-json", str(log),
                         "--sample-tokens", "40")
    assert result.returncode == 0, result.stderr
    records = read_log(log)
    assert [r["step"] for r in records] == list(range(1, 41))
    for record in records:
        assert {"step", "loss", "lr", "tokens", "time_s", "comm_bytes"} <= set(record)
        assert record["tokens"] == 4 * 32
    first, last = np.mean([r["loss"] for r in records[:5]]), np.mean([r["loss"] for r in records[-5:]])
    assert first > 7.0 and last < first - 1.0  # from ≈ ln 2048 = 7.6 to clearly lower
    assert "M parameters" in result.stdout and "step    40/40" in result.stdout


def test_a_small_model_overfits_one_batch():
    config = GPTConfig(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2)
    model = Transformer(config, seed=0, dtype=np.float64)
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 64, (4, 17))
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    optimizer = optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(150):
        model.zero_grad()
        loss, saved = model.forward(inputs, targets)
        model.backward(saved)
        optimizer.step()
    assert loss < 0.05


def test_save_then_generate_and_reload_round_trip(tmp_path):
    saved = tmp_path / "model"
    result = mpiparallel("train", *TINY, "--steps", "3", "--save", str(saved))
    assert result.returncode == 0, result.stderr
    assert (saved / "config.json").exists() and (saved / "model.safetensors").exists()
    generated = mpiparallel("generate", "--init", str(saved), "--prompt", "The ", "--tokens", "20")
    assert generated.returncode == 0, generated.stderr
    assert generated.stdout.startswith("The ")
    again = mpiparallel("train", *TINY, "--steps", "2", "--init", str(saved), "--lr", "0", "--save",
                        str(tmp_path / "again"))
    assert again.returncode == 0, again.stderr
    from mpiparallel.checkpoints import hugging_face

    _, first, _ = hugging_face.load_pretrained(saved)
    _, second, _ = hugging_face.load_pretrained(tmp_path / "again")
    for name, value in first.items():  # lr 0: loading and saving changed nothing, bit for bit
        np.testing.assert_array_equal(value, second[name])


def test_resume_continues_exactly_where_an_uninterrupted_run_would_be(tmp_path):
    # The first run stops after 3 of 6 steps, as an interrupted job would (a constant schedule after warmup
    # does not depend on --steps, so both runs see the same learning rates).
    common = [*TINY, "--steps", "6", "--grad-clip", "1.0", "--warmup-steps", "2"]
    straight = mpiparallel("train", *common, "--log-json", str(tmp_path / "straight.jsonl"),
                           "--save", str(tmp_path / "straight"))
    assert straight.returncode == 0, straight.stderr
    checkpoints = tmp_path / "checkpoints"
    first_half = mpiparallel("train", *TINY, "--steps", "3", "--grad-clip", "1.0", "--warmup-steps", "2",
                             "--checkpoint-dir", str(checkpoints), "--checkpoint-every", "3")
    assert first_half.returncode == 0, first_half.stderr
    resumed = mpiparallel("train", *common, "--checkpoint-dir", str(checkpoints), "--resume",
                          "--log-json", str(tmp_path / "resumed.jsonl"), "--save", str(tmp_path / "resumed"))
    assert resumed.returncode == 0, resumed.stderr
    assert [r["step"] for r in read_log(tmp_path / "resumed.jsonl")] == [4, 5, 6]
    straight_losses = [r["loss"] for r in read_log(tmp_path / "straight.jsonl")][3:]
    assert [r["loss"] for r in read_log(tmp_path / "resumed.jsonl")] == straight_losses
    from mpiparallel.checkpoints import hugging_face

    _, a, _ = hugging_face.load_pretrained(tmp_path / "straight")
    _, b, _ = hugging_face.load_pretrained(tmp_path / "resumed")
    for name in a:
        np.testing.assert_array_equal(a[name], b[name])


@pytest.mark.parametrize("mesh", [
    ["-n", "2", "--zero", "0"],
    ["-n", "2", "--zero", "1"],
    ["-n", "2", "--zero", "2"],
    ["-n", "2", "--zero", "3"],
    ["-n", "2", "--tp", "2"],
    ["-n", "2", "--tp", "2", "--sp"],
], ids=["dp2", "dp2-zero1", "dp2-zero2", "dp2-zero3", "tp2", "tp2-sp"])
def test_resume_on_a_parallel_mesh_is_bitwise(tmp_path, mesh):
    """Checkpoints gather sharded parameters and AdamW moments (ZeRO shards, TP shards) and resume cuts them again:
    the resumed steps' losses and the final weights equal the uninterrupted run's bit for bit."""
    common = [*TINY, *mesh, "--steps", "4", "--grad-clip", "0.5", "--weight-decay", "0.1", "--vocab-size", "2049",
              "--bucket-mb", "0.01"]
    straight = mpiparallel("train", *common, "--log-json", str(tmp_path / "straight.jsonl"),
                           "--save", str(tmp_path / "straight"))
    assert straight.returncode == 0, straight.stderr
    checkpoints = tmp_path / "checkpoints"
    first_half = mpiparallel("train", *common, "--checkpoint-dir", str(checkpoints), "--checkpoint-every", "2")
    assert first_half.returncode == 0, first_half.stderr
    shutil.rmtree(checkpoints / "step-00000004")  # resume from the middle
    resumed = mpiparallel("train", *common, "--checkpoint-dir", str(checkpoints), "--resume",
                          "--log-json", str(tmp_path / "resumed.jsonl"), "--save", str(tmp_path / "resumed"))
    assert resumed.returncode == 0, resumed.stderr
    assert [r["step"] for r in read_log(tmp_path / "resumed.jsonl")] == [3, 4]
    straight_losses = [r["loss"] for r in read_log(tmp_path / "straight.jsonl")][2:]
    assert [r["loss"] for r in read_log(tmp_path / "resumed.jsonl")] == straight_losses
    from mpiparallel.checkpoints import hugging_face

    _, a, _ = hugging_face.load_pretrained(tmp_path / "straight")
    _, b, _ = hugging_face.load_pretrained(tmp_path / "resumed")
    for name in a:
        np.testing.assert_array_equal(a[name], b[name])


@pytest.mark.parametrize("mesh", [[], ["-n", "2", "--zero", "3"], ["-n", "2", "--tp", "2", "--sp"]],
                         ids=["serial", "dp2-zero3", "tp2-sp"])
def test_recomputation_trains_the_same_numbers_with_the_formulas_activation_bytes(tmp_path, mesh):
    common = [*TINY, *mesh, "--steps", "2", "--dtype", "float64", "--grad-clip", "0.5", "--memory-report"]
    saved_per_block = {}
    for mode in ("none", "selective", "full"):
        run = mpiparallel("train", *common, "--recompute", mode, "--log-json", str(tmp_path / f"{mode}.jsonl"),
                          "--save", str(tmp_path / mode))
        assert run.returncode == 0, run.stderr
        blocks = [re.search(r"exactly (\d+) bytes saved, formula (\d+)\)", line)
                  for line in run.stdout.splitlines() if line.strip().startswith("one block")]
        assert len(blocks) == max(1, int(mesh[1]) if mesh else 1)  # one line per rank
        for block in blocks:  # "one block … exactly X bytes saved, formula Y)": measured equals the formula
            assert block is not None and int(block[1]) == int(block[2]) > 0, run.stdout
        saved_per_block[mode] = int(blocks[0][1])
    assert saved_per_block["full"] < saved_per_block["selective"] < saved_per_block["none"]
    from mpiparallel.checkpoints import hugging_face

    _, want, _ = hugging_face.load_pretrained(tmp_path / "none")
    for mode in ("selective", "full"):
        for a, b in zip(read_log(tmp_path / "none.jsonl"), read_log(tmp_path / f"{mode}.jsonl"), strict=True):
            assert b["loss"] == pytest.approx(a["loss"], rel=1e-12)
        _, got, _ = hugging_face.load_pretrained(tmp_path / mode)
        for name in want:
            np.testing.assert_allclose(got[name], want[name], rtol=1e-12, atol=1e-15)


def _assert_one_clear_error(result: subprocess.CompletedProcess, *fragments: str) -> None:
    assert result.returncode != 0
    output = result.stdout + result.stderr
    assert sum(line.startswith("Error") for line in output.splitlines()) == 1, output
    assert "Traceback" not in output, output
    for fragment in fragments:
        assert fragment in output, output


@pytest.mark.parametrize("args, fragments", [
    (["--n-embd", "30", "--n-head", "4"], ["divisible"]),
    (["--init", "/nonexistent/model"], ["/nonexistent/model"]),
    (["--data", "/nonexistent/data.txt"], ["/nonexistent/data.txt"]),
    (["-n", "2", "--ep", "2"], ["--ep 2", "give --experts"]),
    (["--dp", "3"], ["does not match"]),
], ids=["heads", "missing-init", "missing-data", "mesh", "dp-mismatch"])
def test_bad_input_gives_one_clear_error(args, fragments):
    _assert_one_clear_error(mpiparallel("train", *TINY, "--steps", "1", *args), *fragments)


def test_data_shorter_than_one_batch_is_an_error(tmp_path):
    short = tmp_path / "short.txt"
    short.write_text("too short")
    _assert_one_clear_error(mpiparallel("train", *TINY, "--steps", "1", "--data", str(short)), "tokens")


def test_config_that_does_not_match_the_tensors_is_an_error(tmp_path):
    saved = tmp_path / "model"
    assert mpiparallel("train", *TINY, "--steps", "1", "--save", str(saved)).returncode == 0
    config = json.loads((saved / "config.json").read_text())
    config["n_positions"] = 16
    (saved / "config.json").write_text(json.dumps(config))
    _assert_one_clear_error(mpiparallel("train", *TINY, "--steps", "1", "--init", str(saved)), "wpe")


def test_corrupt_checkpoint_is_an_error(tmp_path):
    saved = tmp_path / "model"
    assert mpiparallel("train", *TINY, "--steps", "1", "--save", str(saved)).returncode == 0
    (saved / "model.safetensors").write_bytes(b"not a safetensors file")
    _assert_one_clear_error(mpiparallel("train", *TINY, "--steps", "1", "--init", str(saved)), "safetensors")


def test_seq_len_beyond_the_checkpoint_n_positions_is_an_error(tmp_path):
    from mpiparallel.checkpoints import hugging_face

    config = GPTConfig(vocab_size=256, n_positions=16, n_embd=32, n_layer=1, n_head=2)
    hugging_face.save_pretrained(tmp_path / "short", config, Transformer(config).state_dict())
    _assert_one_clear_error(mpiparallel("train", *TINY, "--steps", "1", "--init", str(tmp_path / "short")),
                            "n_positions")


def test_batch_not_divisible_by_dp_times_microbatches_is_an_error():
    _assert_one_clear_error(mpiparallel("train", *TINY, "--steps", "1", "-n", "2", "--microbatches", "4"),
                            "divisible by dp × microbatches")


@pytest.mark.parametrize("mesh", [
    ["-n", "2", "--zero", "0"],
    ["-n", "2", "--zero", "3"],
    ["-n", "2", "--tp", "2"],
    ["-n", "2", "--tp", "2", "--sp"],
    ["-n", "4", "--tp", "2", "--sp", "--zero", "2"],
], ids=["dp2", "dp2-zero3", "tp2", "tp2-sp", "tp2-sp-dp2-zero2"])
def test_parallel_training_from_the_command_line_equals_serial(tmp_path, mesh):
    """float64, clipping and weight decay on, a vocabulary (2049) that tp does not divide: same losses, same model."""
    common = [*TINY, "--steps", "3", "--dtype", "float64", "--grad-clip", "0.5", "--weight-decay", "0.1",
              "--vocab-size", "2049"]
    serial = mpiparallel("train", *common, "--log-json", str(tmp_path / "serial.jsonl"), "--save",
                         str(tmp_path / "serial"))
    assert serial.returncode == 0, serial.stderr
    parallel = mpiparallel("train", *common, *mesh, "--microbatches", "2", "--bucket-mb", "0.01",
                           "--log-json", str(tmp_path / "parallel.jsonl"), "--save", str(tmp_path / "parallel"))
    assert parallel.returncode == 0, parallel.stderr
    for want, got in zip(read_log(tmp_path / "serial.jsonl"), read_log(tmp_path / "parallel.jsonl"), strict=True):
        assert got["loss"] == pytest.approx(want["loss"], rel=1e-9)
        assert sum(got["comm_bytes"].values()) > 0 and sum(want["comm_bytes"].values()) == 0
    from mpiparallel.checkpoints import hugging_face

    _, a, _ = hugging_face.load_pretrained(tmp_path / "serial")
    _, b, _ = hugging_face.load_pretrained(tmp_path / "parallel")
    assert a.keys() == b.keys()
    for name in a:
        np.testing.assert_allclose(b[name], a[name], rtol=1e-9, atol=1e-12)


def test_tensor_parallel_shape_errors_are_clear():
    _assert_one_clear_error(mpiparallel("train", *TINY, "--steps", "1", "-n", "2", "--tp", "2", "--n-head", "1",
                                        "--n-embd", "32"), "n_head (1) divisible by tp (2)")
    _assert_one_clear_error(mpiparallel("train", *TINY[:-4], "--seq-len", "31", "--batch-size", "4", "--steps", "1",
                                        "-n", "2", "--tp", "2", "--sp"), "--seq-len 31 must be divisible by 2")
    _assert_one_clear_error(mpiparallel("train", *TINY, "--steps", "1", "--sp"), "--tp > 1")


FREE_AND_REFAULT = """
import resource, sys
import numpy as np
from mpiparallel.process import keep_freed_memory
if sys.argv[1] == "keep":
    assert keep_freed_memory()
def step():  # a step's saved activations, freed together when its backward has run
    saved = [np.ones(1 << 20) for _ in range(8)]
    del saved
step()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(10):
    step()
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_freed_activations_are_reused_without_page_faults_when_malloc_keeps_them():
    faults = {mode: int(run_with_timeout([sys.executable, "-c", FREE_AND_REFAULT, mode], 60).stdout)
              for mode in ("plain", "keep")}
    assert faults["plain"] > 10 * (8 << 20) // 4096  # glibc hands pages back and faults them in again each step
    assert faults["keep"] < faults["plain"] // 100


def test_the_query_block_changes_no_number_and_a_gpu_takes_larger_blocks(tmp_path):
    """--query-block only regroups attention's products: the float64 losses are equal bit for bit (a block of 5 rows
    against the default 64, on a sequence of 32 that the default takes in one block and 5 splits into 7)."""
    logs = {}
    for block in (None, 5):
        log = tmp_path / f"block-{block}.jsonl"
        extra = [] if block is None else ["--query-block", str(block)]
        result = mpiparallel("train", *TINY, "--steps", "3", "--dtype", "float64", "--log-json", str(log), *extra)
        assert result.returncode == 0, result.stderr
        logs[block] = [record["loss"] for record in read_log(log)]
    assert logs[5] == logs[None] and len(logs[5]) == 3
    from mpiparallel.train.parallelize import query_block
    from mpiparallel.train.settings import ModelSettings
    assert query_block(ModelSettings()) == 64 and query_block(ModelSettings(device="gpu")) == 1024
    assert query_block(ModelSettings(device="gpu", query_block=32)) == 32
