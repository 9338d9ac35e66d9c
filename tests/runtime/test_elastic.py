"""`train --elastic` on one machine: a rank killed between checkpoints → the run finishes on the survivors (dp
shrunk to one that divides the global batch), equal to the uninterrupted run and to `--resume-from` the same
checkpoint on the new mesh (float64, ≤ 1e-9); too few ranks left or restarts used up → one message, non-zero."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from clusters import assert_no_processes_on
from mpi_harness import run_with_timeout, train_error
from processes import ended, rank_pid, start_job, wait_for_steps

from mpiparallel import cluster as namespace_cluster
from mpiparallel.commands.elastic import survivor_dp

TINY = ["--n-layer", "1", "--n-head", "2", "--n-embd", "16", "--seq-len", "8", "--batch-size", "4", "--dtype",
        "float64", "--vocab-size", "257", "--threads", "1"]
STEPS = 40
LONGER = 150


@pytest.fixture
def tokens(tmp_path) -> str:
    path = tmp_path / "tokens.npy"
    np.save(path, np.random.default_rng(0).integers(0, 257, 2000))
    return str(path)


def records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def last_loss_per_step(log: list[dict]) -> dict[int, float]:
    """The loss of each step as the run finally computed it (steps redone after a restart appear twice)."""
    return {record["step"]: record["loss"] for record in log if "loss" in record}


def worst(a: dict[int, float], b: dict[int, float]) -> float:
    assert a.keys() == b.keys(), (sorted(a), sorted(b))
    return max(abs(a[step] - b[step]) / abs(b[step]) for step in a)


def start_elastic(tmp_path: Path, tokens: str, steps: int, *extra: str) -> subprocess.Popen:
    """`train -n 4 --elastic` with a checkpoint every 5 steps, logging to tmp_path/log.jsonl (every wait on it is
    bounded: wait_for_steps, ended; a job left running is killed after the test)."""
    return start_job([sys.executable, "-m", "mpiparallel", "train", "-n", "4", *TINY, "--data", tokens, "--steps",
                      str(steps), "--checkpoint-dir", str(tmp_path / "ck"), "--checkpoint-every", "5", "--elastic",
                      "--log-json", str(tmp_path / "log.jsonl"), *extra], stdout=subprocess.PIPE,
                     stderr=subprocess.PIPE, text=True)


def elastic_run(tmp_path: Path, tokens: str, *extra: str) -> tuple[int, str, str, Path, int]:
    """A 4-rank dp run of LONGER steps with a checkpoint every 5 whose rank 2 is SIGKILLed after step 7 (LONGER: the
    loss must come mid-run on a quiet machine too)."""
    log = tmp_path / "log.jsonl"
    job = start_elastic(tmp_path, tokens, LONGER, *extra)
    wait_for_steps(log, 7, job)
    os.kill(rank_pid(job.pid, 2), signal.SIGKILL)
    status, stdout, stderr = ended(job, timeout=300)
    return status, stdout, stderr, log, job.pid


def test_a_lost_rank_is_replaced_by_a_smaller_dp_and_the_run_equals_the_uninterrupted_one(tmp_path, tokens):
    status, stdout, stderr, log, _ = elastic_run(tmp_path, tokens)
    assert status == 0, (stdout, stderr)
    log_records = records(log)
    restarts = [record for record in log_records if record.get("event") == "restart"]
    assert len(restarts) == 1, log_records
    restart = restarts[0]
    [lost] = restart["lost"]  # rank 2 alone, not a rank that mpiexec ended because of it
    assert lost == {"rank": 2} and restart["mesh"]["world_size"] == 2 and restart["mesh"]["dp"] == 2
    lost_at = restart["step"]
    # the newest complete checkpoint: the one at a multiple of 5 may still have been saving when the rank died
    resumed_at = int(re.search(r"from the checkpoint of step (\d+)", stderr).group(1))
    assert 7 <= lost_at < LONGER and resumed_at % 5 == 0 and lost_at - 5 <= resumed_at <= lost_at
    assert (f"elastic: lost rank {lost['rank']} after step {lost_at}; restart 1/3 on 2 ranks: dp 2 (global batch 4 "
            f"kept), from the checkpoint of step {resumed_at}: {lost_at - resumed_at} steps redone") in stderr
    assert f"finished after 1 restart, {lost_at - resumed_at} steps redone" in stderr
    assert f"resumed from step {resumed_at} of" in stdout and "now 2 ranks: dp 2" in stdout
    final = last_loss_per_step(log_records)
    assert sorted(final) == list(range(1, LONGER + 1))

    straight = run_with_timeout([sys.executable, "-m", "mpiparallel", "train", "-n", "4", *TINY, "--data", tokens,
                                 "--steps", str(LONGER), "--log-json", str(tmp_path / "straight.jsonl")], timeout=300)
    assert straight.returncode == 0, straight.stderr
    assert worst(final, last_loss_per_step(records(tmp_path / "straight.jsonl"))) <= 1e-9

    folder = tmp_path / "ck" / f"step-{resumed_at:08d}"
    reference = run_with_timeout([sys.executable, "-m", "mpiparallel", "train", "-n", "2", *TINY, "--data", tokens,
                                  "--steps", str(LONGER), "--checkpoint-dir", str(tmp_path / "reference"),
                                  "--resume-from", str(folder), "--log-json", str(tmp_path / "reference.jsonl")],
                                 timeout=300)
    assert reference.returncode == 0, reference.stderr
    after = {step: loss for step, loss in final.items() if step > resumed_at}
    assert worst(after, last_loss_per_step(records(tmp_path / "reference.jsonl"))) <= 1e-9


def test_a_rank_lost_again_after_the_restart_is_replaced_again(tmp_path, tokens):
    """LONGER steps: the second loss must come while the relaunched job still trains (a quiet machine runs
    this model's steps in milliseconds)."""
    log = tmp_path / "log.jsonl"
    job = start_elastic(tmp_path, tokens, LONGER)
    wait_for_steps(log, 7, job)
    os.kill(rank_pid(job.pid, 2), signal.SIGKILL)
    before = len(log.read_text().splitlines())
    wait_for_steps(log, before + 2, job)  # the restart event, then a step of the relaunched job (soon: a quiet
    # machine runs this model's 40 steps in well under a second)
    os.kill(rank_pid(job.pid, 1), signal.SIGKILL)
    status, stdout, stderr = ended(job, timeout=300)
    assert status == 0, (stdout, stderr)
    restarts = [record for record in records(log) if record.get("event") == "restart"]
    assert [record["mesh"]["dp"] for record in restarts] == [2, 1], restarts
    assert "restart 2/3 on 1 rank: serial" in stderr and "finished after 2 restarts" in stderr, stderr
    straight = run_with_timeout([sys.executable, "-m", "mpiparallel", "train", "-n", "4", *TINY, "--data", tokens,
                                 "--steps", str(LONGER), "--log-json", str(tmp_path / "straight.jsonl")], timeout=300)
    assert straight.returncode == 0, straight.stderr
    assert worst(last_loss_per_step(records(log)), last_loss_per_step(records(tmp_path / "straight.jsonl"))) <= 1e-9


@pytest.mark.parametrize(("option", "message"), [(["--min-ranks", "3"], "--min-ranks is 3"),
                                                  (["--max-restarts", "0"], "--max-restarts 0 used up")])
def test_too_few_ranks_left_or_no_restarts_left_ends_the_run_with_one_message(tmp_path, tokens, option, message):
    status, stdout, stderr, _, _ = elastic_run(tmp_path, tokens, *option)
    assert status == 1, (stdout, stderr)
    endings = [line for line in stderr.splitlines() if "giving up" in line]
    assert len(endings) == 1 and message in endings[0] and re.search(r"lost rank \d", endings[0]), stderr


def test_elastic_needs_checkpoints(tokens):
    output = train_error(*TINY, "-n", "2", "--data", tokens, "--elastic", "--checkpoint-dir", "ck")
    assert "--elastic needs --checkpoint-dir and --checkpoint-every" in output


def test_the_survivors_mesh_keeps_the_model_axes_and_a_dp_that_divides_the_batch():
    axes = {"tp": 1, "cp": 1, "pp": 1, "ep": 1}
    assert survivor_dp(3, axes, batch_size=4, microbatches=1) == 2
    assert survivor_dp(3, axes, batch_size=6, microbatches=1) == 3
    assert survivor_dp(6, axes | {"tp": 2}, batch_size=8, microbatches=1) == 2  # 3 does not divide 8
    assert survivor_dp(7, axes | {"pp": 2}, batch_size=8, microbatches=2) == 2  # 3 does not divide 8; 4 rows split in 2
    assert survivor_dp(4, axes | {"ep": 2}, batch_size=12, microbatches=1) == 4
    assert survivor_dp(3, axes | {"ep": 2}, batch_size=12, microbatches=1) == 2  # 3 is no multiple of ep 2
    assert survivor_dp(1, axes | {"tp": 2}, batch_size=4, microbatches=1) is None


def test_a_host_lost_from_a_2_host_cluster_leaves_dp1_tp2_on_the_other_equal_to_the_uninterrupted_run(
        cluster, tmp_path, tokens):  # noqa: F811 (the fixture of test_cluster)
    """dp 2 × tp 2 across 2 hosts of 2 slots; `cluster kill` of the second host between checkpoints: the run
    finishes on the first host's 2 ranks (dp 1 × tp 2), equal to the uninterrupted run (float64, ≤ 1e-9)."""
    made = cluster(nodes=2, ranks_per_node=2)
    log = tmp_path / "log.jsonl"
    mesh = ["--hostfile", str(made.hostfile), "--dp", "2", "--tp", "2"]
    job = start_elastic(tmp_path, tokens, STEPS, *mesh)
    wait_for_steps(log, 7, job)
    namespace_cluster.kill(made.name, made.hosts[1])
    status, stdout, stderr = ended(job, timeout=300)
    assert status == 0, (stdout, stderr)
    restart = next(record for record in records(log) if record.get("event") == "restart")
    assert restart["lost"] == [{"host": made.hosts[1], "ranks": [2, 3]}], restart
    assert restart["mesh"]["world_size"] == 2 and restart["mesh"]["dp"] == 1 and restart["mesh"]["tp"] == 2
    assert f"lost host {made.hosts[1]} (ranks 2, 3) after step {restart['step']}" in stderr
    final = last_loss_per_step(records(log))
    straight = run_with_timeout([sys.executable, "-m", "mpiparallel", "train", "-n", "4", "--tp", "2", *TINY,
                                 "--data", tokens, "--steps", str(STEPS), "--log-json",
                                 str(tmp_path / "straight.jsonl")], timeout=300)
    assert straight.returncode == 0, straight.stderr
    assert worst(final, last_loss_per_step(records(tmp_path / "straight.jsonl"))) <= 1e-9
    assert_no_processes_on(made)
