"""Preemption: SIGTERM or SIGUSR1, to the self-launching parent or to one rank, ends the run after the step in
progress with a checkpoint and a line saying how to resume (exit 128 + the signal), and `--resume` continues it
exactly; SIGINT to the parent alone ends the job as Ctrl-C does. Neither is reported as a lost rank."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from mpi_harness import run_with_timeout
from processes import ended, rank_pid, start_job, wait_for_steps

from mpiparallel.checkpoints.sharded import MANIFEST, latest_training_checkpoint
from mpiparallel.errors import ExitCode

TINY = ["--n-layer", "1", "--n-head", "2", "--n-embd", "16", "--seq-len", "8", "--batch-size", "4", "--dtype",
        "float64", "--vocab-size", "257", "--threads", "1"]
LONG = "100000"
"""Steps of a run that is to be stopped: far more than it can run before the signal."""


@pytest.fixture
def tokens(tmp_path) -> str:
    path = tmp_path / "tokens.npy"
    np.save(path, np.random.default_rng(0).integers(0, 257, 2000))
    return str(path)


def losses(path: Path) -> list[float]:
    return [record["loss"] for record in map(json.loads, path.read_text().splitlines())]


def start(*arguments: str) -> subprocess.Popen:
    return start_job([sys.executable, "-m", "mpiparallel", "train", "-n", "2", *TINY, *arguments],
                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # waits bounded: ended()


def test_sigterm_to_the_launcher_saves_and_resume_continues_exactly(tmp_path, tokens):
    checkpoints, log = tmp_path / "ck", tmp_path / "log.jsonl"
    job = start("--data", tokens, "--steps", LONG, "--checkpoint-dir", str(checkpoints), "--log-json", str(log))
    wait_for_steps(log, 2, job)
    job.send_signal(signal.SIGTERM)
    status, stdout, stderr = ended(job)
    stopped_at = len(losses(log))
    assert status == ExitCode.PREEMPTED_SIGTERM == 143, (stdout, stderr)
    assert f"stopped by SIGTERM after step {stopped_at}/{LONG}; to continue, run the same command with --resume" \
           in stdout, stdout
    assert "lost" not in stderr, stderr
    assert latest_training_checkpoint(checkpoints).name == f"step-{stopped_at:08d}"

    steps = str(stopped_at + 3)
    resumed = run_with_timeout([sys.executable, "-m", "mpiparallel", "train", "-n", "2", *TINY, "--data", tokens,
                                "--steps", steps, "--checkpoint-dir", str(checkpoints), "--resume", "--log-json",
                                str(log)], timeout=180)
    assert resumed.returncode == 0, resumed.stderr
    straight = run_with_timeout([sys.executable, "-m", "mpiparallel", "train", "-n", "2", *TINY, "--data", tokens,
                                 "--steps", steps, "--log-json", str(tmp_path / "straight.jsonl")], timeout=180)
    assert straight.returncode == 0, straight.stderr
    whole, reference = losses(log), losses(tmp_path / "straight.jsonl")
    assert len(whole) == len(reference) == stopped_at + 3
    assert max(abs(a - b) / abs(b) for a, b in zip(whole, reference, strict=True)) <= 1e-9


def test_sigusr1_to_one_rank_stops_every_rank_after_the_same_step(tmp_path, tokens):
    checkpoints, log = tmp_path / "ck", tmp_path / "log.jsonl"
    job = start("--data", tokens, "--steps", LONG, "--checkpoint-dir", str(checkpoints), "--log-json", str(log))
    wait_for_steps(log, 2, job)
    os.kill(rank_pid(job.pid, 1), signal.SIGUSR1)
    status, stdout, stderr = ended(job)
    stopped_at = len(losses(log))
    assert status == ExitCode.PREEMPTED_SIGUSR1 == 138, (stdout, stderr)
    assert f"stopped by SIGUSR1 after step {stopped_at}/" in stdout and "lost" not in stderr, (stdout, stderr)
    folder = latest_training_checkpoint(checkpoints)
    assert folder.name == f"step-{stopped_at:08d}" and (folder / MANIFEST).is_file()
    assert sorted(path.name for path in folder.glob("rank-*")) == ["rank-00000.safetensors"]  # dp 2: replicas once


def test_sigint_to_the_launcher_alone_ends_the_job_and_loses_no_rank(tmp_path, tokens):
    log = tmp_path / "log.jsonl"
    job = start("--data", tokens, "--steps", LONG, "--log-json", str(log))
    wait_for_steps(log, 2, job)
    job.send_signal(signal.SIGINT)
    status, stdout, stderr = ended(job, timeout=60)
    assert status == ExitCode.INTERRUPTED == 130 and "lost" not in stderr, (status, stderr)
    assert len(losses(log)) < int(LONG)
