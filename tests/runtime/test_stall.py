"""A job whose ranks stop making progress ends with one line naming the rank behind — never a silent hang.

The self-launching parent's stall watchdog (`mpiparallel/jobs/stall.py`) reads the ranks' progress reports
(`mpiparallel/train/progress.py`). Here: a rank SIGSTOPped mid-run, and a rank that hangs inside a step
(MPIPARALLEL_STALL_AT), each end the job within the timeout plus a few seconds, non-zero, with one line naming that
rank, an event in the JSON log, and no process left; --elastic relaunches without a stopped rank; --stall-timeout
0 and a long run whose every phase is short are not stopped; bad values are one clear error. Tiny model, timeouts
of a few seconds."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from mpi_harness import train_error
from processes import ended, processes_under, rank_pid, start_job, still_running, wait_for_steps

from mpiparallel.errors import ExitCode
from mpiparallel.jobs.stall import RankProgress, Stall, behind

TINY = ["--n-layer", "1", "--n-head", "2", "--n-embd", "16", "--seq-len", "8", "--vocab-size", "257", "--threads",
        "1"]
TIMEOUT_S = 3
ENDS_WITHIN = TIMEOUT_S + 12.0
"""Seconds from the stop to the job's end: the timeout, one poll (1 s), the kill, and room for a loaded machine."""

pytestmark = pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="finds the ranks' PIDs in Linux's /proc")


@pytest.fixture
def tokens(tmp_path) -> str:
    path = tmp_path / "tokens.npy"
    np.save(path, np.random.default_rng(0).integers(0, 257, 2000))
    return str(path)


def start_training(tmp_path: Path, tokens: str, ranks: int, *extra: str, env: dict[str, str] | None = None
                   ) -> subprocess.Popen:
    """`train -n RANKS` on the tiny model for many steps, logging to tmp_path/log.jsonl (every wait on it is bounded:
    wait_for_steps, ended; a job left running is killed after the test)."""
    return start_job([sys.executable, "-m", "mpiparallel", "train", "-n", str(ranks), *TINY, "--data", tokens,
                      "--log-json", str(tmp_path / "log.jsonl"), *extra], stdout=subprocess.PIPE,
                     stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})})


def records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def stall_lines(output: str) -> list[str]:
    return [line for line in output.splitlines() if "stalled" in line]


def waiting_ranks(line: str) -> list[int]:
    """The ranks a stall line says wait (`rank 0 waits in …; ranks 2, 3 wait in …`: where they stopped may differ)."""
    clauses = [clause.split(" wait")[0] for clause in line.split("; ")
               if " wait in " in clause or " waits in " in clause]
    return sorted(int(rank) for clause in clauses for rank in clause.split(" ", 1)[1].split(", "))


def test_a_stopped_rank_ends_the_job_within_the_timeout_with_one_line_naming_it(tmp_path, tokens):
    job = start_training(tmp_path, tokens, 3, "--batch-size", "6", "--steps", "1000000", "--stall-timeout",
                         str(TIMEOUT_S))
    wait_for_steps(tmp_path / "log.jsonl", 3, job)
    processes = processes_under(job.pid)
    os.kill(rank_pid(job.pid, 1), signal.SIGSTOP)
    stopped = time.monotonic()
    status, stdout, stderr = ended(job, timeout=ENDS_WITHIN)
    seconds = time.monotonic() - stopped
    output = stdout + stderr
    assert status == ExitCode.STALL and seconds < ENDS_WITHIN, (status, seconds, output)
    [line] = stall_lines(output)
    assert line.startswith("mpiparallel: stalled: rank 1 (stopped: SIGSTOP or a debugger) has not finished step "), line
    assert waiting_ranks(line) == [0, 2] and line.endswith(f"(--stall-timeout {TIMEOUT_S}): ended every rank"), line
    assert "Traceback" not in output and "BAD TERMINATION" not in output and "was lost" not in output, output
    event = records(tmp_path / "log.jsonl")[-1]
    assert event["event"] == "stall" and event["behind"] == [1] and event["timeout"] == TIMEOUT_S
    assert [rank["stopped"] for rank in event["ranks"]] == [False, True, False]
    assert still_running(processes) == [], "processes left behind"


def test_a_rank_that_hangs_inside_a_step_is_named_with_where_the_others_wait(tmp_path, tokens):
    """The timeout from MPIPARALLEL_STALL_TIMEOUT; rank 2 hangs, alive, at step 4's first forward."""
    job = start_training(tmp_path, tokens, 3, "--batch-size", "6", "--steps", "1000",
                         env={"MPIPARALLEL_STALL_TIMEOUT": str(TIMEOUT_S), "MPIPARALLEL_STALL_AT": "4@2"})
    wait_for_steps(tmp_path / "log.jsonl", 3, job)
    processes = processes_under(job.pid)
    status, stdout, stderr = ended(job, timeout=60 + ENDS_WITHIN)
    output = stdout + stderr
    assert status == ExitCode.STALL, output
    [line] = stall_lines(output)
    assert line.startswith("mpiparallel: stalled: rank 2 has not finished step 4 (forward, microbatch 0) for "), line
    assert "; ranks 0, 1 wait in step 4 (gradient reduction); no rank made progress for " in line, line
    assert "Traceback" not in output and "was lost" not in output, output
    assert [record["step"] for record in records(tmp_path / "log.jsonl")[:-1]] == [1, 2, 3]
    assert records(tmp_path / "log.jsonl")[-1]["behind"] == [2]
    assert still_running(processes) == [], "processes left behind"


def test_stall_timeout_0_turns_the_watchdog_off(tmp_path, tokens):
    """0 on the command line wins over MPIPARALLEL_STALL_TIMEOUT=1: a rank stopped for 4 s is waited for, and the
    run finishes once it continues."""
    job = start_training(tmp_path, tokens, 2, "--batch-size", "4", "--steps", "40", "--stall-timeout", "0",
                         env={"MPIPARALLEL_STALL_TIMEOUT": "1", "MPIPARALLEL_STALL_AT": ""})
    wait_for_steps(tmp_path / "log.jsonl", 3, job)
    victim = rank_pid(job.pid, 1)
    os.kill(victim, signal.SIGSTOP)
    time.sleep(4)
    assert job.poll() is None, ended(job, timeout=30)
    os.kill(victim, signal.SIGCONT)
    status, stdout, stderr = ended(job, timeout=120)
    assert status == 0 and not stall_lines(stdout + stderr), stdout + stderr
    assert records(tmp_path / "log.jsonl")[-1]["step"] == 40


def test_a_long_run_whose_every_phase_is_short_is_not_stopped(tmp_path, tokens):
    """Many steps with validation and checkpoint saves, far longer than the 2 s timeout in all (measured: 8 s on the
    shared 2-core machine), each phase far shorter: no stall."""
    job = start_training(tmp_path, tokens, 2, "--batch-size", "4", "--steps", "3000", "--eval-every", "200",
                         "--checkpoint-dir", str(tmp_path / "ck"), "--checkpoint-every", "1000", "--stall-timeout", "2")
    wait_for_steps(tmp_path / "log.jsonl", 1, job)
    started = time.monotonic()
    status, stdout, stderr = ended(job, timeout=300)
    assert status == 0 and not stall_lines(stdout + stderr), stdout + stderr
    assert time.monotonic() - started > 2, "the run was too short to show anything"
    assert records(tmp_path / "log.jsonl")[-1]["step"] == 3000


def test_a_temporary_folder_too_deep_for_a_socket_turns_the_watchdog_off_with_one_line(tmp_path, tokens):
    """A Unix socket's path holds at most 107 bytes: under a long TMPDIR (clusters set deep per-job ones) the
    watchdog cannot listen. The run must still train (it failed on its first version: `OSError: AF_UNIX path too
    long`), saying once that the watchdog is off."""
    deep = tmp_path / ("t" * 100)
    deep.mkdir()
    job = start_training(tmp_path, tokens, 2, "--batch-size", "4", "--steps", "3", env={"TMPDIR": str(deep)})
    status, stdout, stderr = ended(job, timeout=120)
    assert status == 0, stdout + stderr
    assert (stdout + stderr).count("the stall watchdog is off for this job") == 1, stdout + stderr
    assert records(tmp_path / "log.jsonl")[-1]["step"] == 3


@pytest.mark.parametrize("value", ["-1", "abc", "nan", "inf"])
def test_a_bad_stall_timeout_is_one_clear_error(value):
    output = train_error("-n", "2", "--steps", "1", "--stall-timeout", value, timeout=60)
    assert "Invalid value for '--stall-timeout'" in output, output


def test_a_bad_stall_timeout_variable_is_one_clear_error():
    result = subprocess.run([sys.executable, "-m", "mpiparallel", "train", "-n", "2", "--steps", "1"], timeout=60,
                            capture_output=True, text=True, env={**os.environ, "MPIPARALLEL_STALL_TIMEOUT": "ten"})
    output = result.stdout + result.stderr
    assert result.returncode == 2 and "Traceback" not in output, output
    [line] = [line for line in output.splitlines() if line.startswith("Error")]
    assert "MPIPARALLEL_STALL_TIMEOUT" in line and "'ten'" in line, output


def test_elastic_relaunches_without_a_stopped_rank(tmp_path, tokens):
    job = start_training(tmp_path, tokens, 4, "--batch-size", "4", "--dtype", "float64", "--steps", "150",
                         "--checkpoint-dir", str(tmp_path / "ck"), "--checkpoint-every", "5", "--elastic",
                         "--stall-timeout", str(TIMEOUT_S))
    wait_for_steps(tmp_path / "log.jsonl", 7, job)
    os.kill(rank_pid(job.pid, 2), signal.SIGSTOP)
    status, stdout, stderr = ended(job, timeout=300)
    assert status == 0, stdout + stderr
    [line] = stall_lines(stderr.replace("lost rank 2 (stalled)", ""))
    assert line.startswith("mpiparallel: stalled: rank 2 (stopped: SIGSTOP or a debugger) has not finished "), line
    assert "elastic: lost rank 2 (stalled) after step " in stderr and "restart 1/3 on 2 ranks: dp 2" in stderr
    log = records(tmp_path / "log.jsonl")
    [restart] = [record for record in log if record.get("event") == "restart"]
    assert restart["lost"] == [{"rank": 2, "stalled": True}]
    assert sorted({record["step"] for record in log if "loss" in record}) == list(range(1, 151))


# -- who is behind, without MPI --------------------------------------------------------------------------------

def progress(rank: int, step: int, phase: str, detail: str = "", since: float = 0.0) -> RankProgress:
    return RankProgress(rank, 1000 + rank, since, step, phase, detail)


def test_the_rank_at_the_earliest_place_is_behind_and_the_others_are_grouped_by_where_they_wait():
    ranks = [progress(0, 41, "gradients", since=5), progress(1, 41, "backward", "3", since=1),
             progress(2, 41, "forward", "3", since=2), progress(3, 41, "gradients", since=4)]
    assert behind(ranks, []) == (2,)
    stall = Stall(600, 601, tuple(ranks), behind(ranks, []), (), at=605)
    assert stall.message() == (
        "mpiparallel: stalled: rank 2 has not finished step 41 (forward, microbatch 3) for 603 s; rank 1 waits in "
        "step 41 (backward, microbatch 3); ranks 0, 3 wait in step 41 (gradient reduction); no rank made progress "
        "for 601 s (--stall-timeout 600): ended every rank")


def test_a_stopped_rank_is_behind_wherever_its_report_is_and_a_tie_names_nobody():
    ranks = [progress(0, 7, "gradients"), progress(1, 7, "gradients"), progress(2, 7, "gradients")]
    assert behind(ranks, [1]) == (1,)
    assert behind(ranks, []) == ()  # a collective hung on every rank: nobody is behind anybody
    pipeline = [progress(0, 3, "pipeline", "0F1"), progress(1, 3, "pipeline", "1F0")]
    assert behind(pipeline, []) == ()  # pipeline actions are not ordered across ranks
    finished = [progress(0, 0, "done"), progress(1, 9, "checkpoint"), progress(2, 9, "checkpoint")]
    assert behind(finished, []) == ()
    stall = Stall(5, 6, (*ranks, progress(3, 0, "done")), (), (), at=6)
    assert stall.message() == (
        "mpiparallel: stalled: ranks 0, 1, 2 have not finished step 7 (gradient reduction) for 6 s; none is behind "
        "the others (each rank still running waits at the same place); rank 3 finished training; no rank made "
        "progress for 6 s (--stall-timeout 5): ended every rank")
