"""Checkpoints that say what they did: options that did nothing are errors (or a stated default), saves and
resumes are logged, old checkpoints are pruned, `--resume-from` picks one, `checkpoint info --verify` finds a
damaged one, `checkpoint export` writes a Hugging Face folder, and unwritable folders fail before step 1."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest
from mpi_harness import run_with_timeout, train_error

from mpiparallel.checkpoints.hugging_face import load_pretrained
from mpiparallel.checkpoints.sharded import MANIFEST, step_folder
from mpiparallel.errors import ExitCode

TINY = ["--n-layer", "1", "--n-head", "2", "--n-embd", "16", "--seq-len", "8", "--batch-size", "4", "--dtype",
        "float64", "--vocab-size", "257", "--threads", "1"]


def train(*arguments: str, ranks: int = 1, timeout: float = 180):
    result = run_with_timeout([sys.executable, "-m", "mpiparallel", "train", "-n", str(ranks), *TINY, *arguments],
                              timeout)
    assert result.returncode == 0, result.stdout + result.stderr
    return result


def losses(path: Path) -> dict[int, float]:
    return {record["step"]: record["loss"] for record in map(json.loads, path.read_text().splitlines())}


@pytest.fixture(scope="module")
def tokens(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("data") / "tokens.npy"
    np.save(path, np.random.default_rng(0).integers(0, 257, 2000))
    return str(path)


@pytest.fixture(scope="module")
def saved_run(tmp_path_factory, tokens):
    """Six steps with a checkpoint every 2 (all kept) and the model --saved: the run the tests read."""
    root = tmp_path_factory.mktemp("run")
    result = train("--data", tokens, "--steps", "6", "--checkpoint-dir", str(root / "ck"), "--checkpoint-every", "2",
                   "--save", str(root / "model"), "--log-json", str(root / "log.jsonl"))
    return root, result.stdout


def test_checkpoint_every_without_a_folder_is_an_error():
    assert "--checkpoint-dir" in train_error(*TINY, "--steps", "2", "--checkpoint-every", "1")


def test_a_checkpoint_folder_alone_saves_once_after_the_last_step(tmp_path, tokens):
    result = train("--data", tokens, "--steps", "3", "--checkpoint-dir", str(tmp_path / "ck"))
    assert [path.name for path in sorted((tmp_path / "ck").iterdir())] == ["step-00000003"]
    assert (step_folder(tmp_path / "ck", 3) / MANIFEST).is_file()
    assert "saved checkpoint step 3 (" in result.stdout and str(step_folder(tmp_path / "ck", 3)) in result.stdout


def test_resume_in_a_folder_without_checkpoints_starts_a_new_run_and_says_so(tmp_path, tokens):
    """One batch script serves the first submission and every requeue: --resume with nothing complete to resume
    from (no folder, an empty one, one whose only save was cut short) is a new run, named in the log; the same
    command again resumes from what the first saved."""
    (tmp_path / "empty").mkdir()
    (tmp_path / "cut" / "step-00000001").mkdir(parents=True)  # a save cut short: no manifest
    for folder in ("empty", "missing", "cut"):
        result = train(*TINY, "--data", tokens, "--steps", "2", "--checkpoint-dir", str(tmp_path / folder),
                       "--resume")
        assert (f"--resume: no complete checkpoint in {tmp_path / folder} yet, so a new run starts at step 0"
                in result.stdout), result.stdout
        assert (tmp_path / folder / "step-00000002" / MANIFEST).is_file()
    again = train(*TINY, "--data", tokens, "--steps", "3", "--checkpoint-dir", str(tmp_path / "empty"), "--resume")
    assert "resumed from step 2 of" in again.stdout and "new run" not in again.stdout


def test_resume_past_steps_is_an_error(saved_run, tokens):
    root, _ = saved_run
    output = train_error(*TINY, "--data", tokens, "--steps", "4", "--checkpoint-dir", str(root / "ck"), "--resume")
    assert "is at step 6 already" in output and "--steps 4" in output


def test_saves_are_logged_with_size_time_and_disk_used(saved_run):
    _, stdout = saved_run
    saved = [line for line in stdout.splitlines() if line.startswith("saved checkpoint step")]
    assert [line.split()[3] for line in saved] == ["2", "4", "6"]
    assert " MB, " in saved[0] and " s) to " in saved[0]
    assert "; 3 checkpoints kept, " in saved[-1] and saved[-1].split("kept, ")[1].split()[1:4] == ["MB", "on", "disk"]


def test_resume_from_a_folder_on_another_mesh_is_logged_and_continues_the_run(saved_run, tokens, tmp_path):
    root, _ = saved_run
    log = tmp_path / "log.jsonl"
    result = train("--data", tokens, "--steps", "6", "--checkpoint-dir", str(tmp_path / "ck"), "--resume-from",
                   str(step_folder(root / "ck", 2)), "--log-json", str(log), ranks=2)
    assert f"resumed from step 2 of {step_folder(root / 'ck', 2)} (saved on mesh 1 rank: serial; now 2 ranks: " \
           f"dp 2)" in result.stdout
    original, resumed = losses(root / "log.jsonl"), losses(log)
    assert sorted(resumed) == [3, 4, 5, 6]
    assert max(abs(resumed[step] - original[step]) / abs(original[step]) for step in resumed) <= 1e-9


def test_resume_from_a_step_number_of_the_checkpoint_folder(saved_run, tokens, tmp_path):
    root, _ = saved_run
    log = tmp_path / "log.jsonl"
    train("--data", tokens, "--steps", "5", "--checkpoint-dir", str(root / "ck"), "--resume-from", "4", "--log-json",
          str(log), "--checkpoint-every", "100")
    assert losses(log) == {5: losses(root / "log.jsonl")[5]}  # same mesh: bit for bit
    output = train_error(*TINY, "--data", tokens, "--steps", "9", "--checkpoint-dir", str(root / "ck"),
                         "--resume-from", "3")
    assert "step-00000003 is not a complete checkpoint" in output and "step 2, step 4" in output


def test_keep_checkpoints_keeps_the_newest(tmp_path, tokens):
    result = train("--data", tokens, "--steps", "5", "--checkpoint-dir", str(tmp_path), "--checkpoint-every", "1",
                   "--keep-checkpoints", "2")
    assert sorted(path.name for path in tmp_path.iterdir()) == ["step-00000004", "step-00000005"]
    assert "removed 1 older one; 2 checkpoints kept" in result.stdout


def info(*arguments: str):
    return run_with_timeout([sys.executable, "-m", "mpiparallel", "checkpoint", "info", *arguments], timeout=60)


def copy_of(folder: Path, target: Path) -> Path:
    target.mkdir()
    for path in folder.iterdir():
        (target / path.name).write_bytes(path.read_bytes())
    return target


def test_info_verify_passes_a_whole_checkpoint_and_fails_a_damaged_one(saved_run, tmp_path):
    root, _ = saved_run
    whole = info("--verify", str(step_folder(root / "ck", 2)))
    assert whole.returncode == 0 and "verified: every shard file" in whole.stdout, whole.stderr
    assert "bytes of data in 1 shard file of" in whole.stdout, whole.stdout  # not "1 shard files"
    manifest = json.loads((step_folder(root / "ck", 2) / MANIFEST).read_text())
    assert all(len(entry["sha256"]) == 64 for entry in manifest["files"])

    for damage, message in [("truncate", "truncated or overwritten"), ("flip", "SHA-256 differs")]:
        folder = copy_of(step_folder(root / "ck", 2), tmp_path / damage)
        shard = folder / "rank-00000.safetensors"
        content = shard.read_bytes()
        shard.write_bytes(content[:-100] if damage == "truncate" else content[:-8] + bytes(8))
        checked = info("--verify", str(folder))
        assert checked.returncode == ExitCode.CORRUPT_CHECKPOINT and message in checked.stderr, checked
        if damage == "truncate":  # even a plain `info` checks the sizes
            assert info(str(folder)).returncode == ExitCode.CORRUPT_CHECKPOINT


def damage(folder: Path, how: str) -> None:
    """Eight bytes flipped in the middle of rank 1's shard, the shard cut short, or the manifest cut short."""
    shard = folder / "rank-00001.safetensors"
    content = shard.read_bytes()
    if how == "flip":
        middle = len(content) // 2
        shard.write_bytes(content[:middle] + bytes(255 - b for b in content[middle:middle + 8]) + content[middle + 8:])
    elif how == "truncate":
        shard.write_bytes(content[:-100])
    else:
        manifest = folder / MANIFEST
        manifest.write_text(manifest.read_text()[:200])


@pytest.mark.parametrize("how, problem", [("flip", "rank-00001.safetensors: SHA-256 differs"),
                                          ("truncate", "rank-00001.safetensors has"),
                                          ("manifest", "manifest.json is not valid JSON")])
def test_resume_refuses_a_damaged_checkpoint_naming_the_file_the_step_and_an_older_one(tmp_path, tokens, how,
                                                                                         problem):
    """Two ranks under ZeRO-1 write a shard each; rank 1 checks rank-00001's SHA-256 (each rank hashes its share of
    the files). Before, flipped bytes resumed silently into a NaN loss and "try a smaller --lr"."""
    train("--data", tokens, "--steps", "4", "--checkpoint-dir", str(tmp_path), "--checkpoint-every", "2",
          "--zero", "1", ranks=2)
    damage(step_folder(tmp_path, 4), how)
    result = run_with_timeout([sys.executable, "-m", "mpiparallel", "train", "-n", "2", *TINY, "--zero", "1",
                               "--data", tokens, "--steps", "6", "--checkpoint-dir", str(tmp_path), "--resume"], 120)
    output = result.stdout + result.stderr
    assert result.returncode == ExitCode.CORRUPT_CHECKPOINT, output
    errors = [line for line in output.splitlines() if line.startswith("Error")]
    assert len(errors) == 1 and "Traceback" not in output and "nan" not in output, output
    assert f"{step_folder(tmp_path, 4)} (step 4) is damaged" in errors[0] and problem in errors[0], errors[0]
    assert "--resume-from 2" in errors[0] and "step " not in output.split("Error")[0].replace("--steps", "")


def test_info_verify_says_an_older_manifest_has_no_checksums(saved_run, tmp_path):
    root, _ = saved_run
    folder = copy_of(step_folder(root / "ck", 4), tmp_path / "old")
    manifest = json.loads((folder / MANIFEST).read_text())
    for entry in manifest["files"]:
        del entry["sha256"]
    (folder / MANIFEST).write_text(json.dumps(manifest))
    checked = info("--verify", str(folder))
    assert checked.returncode == 0 and "no checksum in the manifest" in checked.stdout, checked


def test_export_writes_the_model_train_save_writes(saved_run, tmp_path):
    root, _ = saved_run
    result = run_with_timeout([sys.executable, "-m", "mpiparallel", "checkpoint", "export", str(root / "ck"),
                               "--out", str(tmp_path / "hf")], timeout=60)
    assert result.returncode == 0 and "exported step 6" in result.stdout, result
    assert "tokenizer: bytes (no tokenizer file" in result.stdout, result.stdout
    config, tensors, _ = load_pretrained(tmp_path / "hf")
    saved_config, saved, _ = load_pretrained(root / "model")
    assert config == saved_config and tensors.keys() == saved.keys()
    assert all(np.array_equal(tensors[name], saved[name]) for name in saved)


def test_export_of_a_default_corpus_run_brings_its_tokenizer_and_public_file_modes(tmp_path):
    """Before: "no tokenizer: copy the data's tokenizer.json beside it" (the default corpus's sits in the cache,
    which nothing named), and model.safetensors 0600 beside a 0644 config.json."""
    shape = ["--n-layer", "1", "--n-head", "2", "--n-embd", "16", "--seq-len", "8", "--batch-size", "4", "--threads",
             "1"]
    result = run_with_timeout([sys.executable, "-m", "mpiparallel", "train", *shape, "--steps", "1",
                               "--checkpoint-dir", str(tmp_path / "ck")], 300)
    assert result.returncode == 0, result.stderr
    exported = run_with_timeout([sys.executable, "-m", "mpiparallel", "checkpoint", "export", str(tmp_path / "ck"),
                                 "--out", str(tmp_path / "hf")], 120)
    assert exported.returncode == 0, exported.stderr
    assert "tokenizer: the default corpus's, in the cache" in exported.stdout, exported.stdout
    hf = tmp_path / "hf"
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= {
        path.name for path in hf.iterdir()}
    modes = {path.name: path.stat().st_mode & 0o777 for path in hf.iterdir()}
    assert len(set(modes.values())) == 1 and modes["config.json"] & 0o044, modes  # all as open() makes them
    sample = run_with_timeout([sys.executable, "-m", "mpiparallel", "generate", "--init", str(hf), "--prompt", "The ",
                               "--tokens", "5", "--threads", "1"], 120)
    assert sample.returncode == 0 and sample.stdout.startswith("The "), sample


@pytest.mark.parametrize("option", ["--save", "--checkpoint-dir"])
def test_an_unwritable_output_folder_fails_before_step_1(tmp_path, tokens, option):
    (tmp_path / "a-file").write_text("not a folder")
    output = train_error(*TINY, "--data", tokens, "--steps", "2", option, str(tmp_path / "a-file" / "model"))
    assert "cannot write to" in output and option in output
    assert "step " not in output.replace("--steps", "")
