"""The flight recorder (`collectives.flight`) and the hang analysis (`mpiparallel debug hang`): jobs hung on
purpose — a rank that skips a collective, a size mismatch, a send never received, a rank stopped inside a
collective — under a bare mpiexec with SIGUSR2, and under the self-launching parent's stall watchdog (a hung
pipeline rank too, which only the records single out); the analysis names the rank, the call and the peer each
time. With the recorder off, the same dumps name nothing. `--check-collectives` turns a size mismatch, and a
pipeline schedule whose messages do not pair up, into one clear error (unchecked: a hang or an error far away)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from mpi_harness import RankFailure, mpiexec_path, run_on_ranks
from processes import ended, processes_under, start_job
from workers import pipeline_checks

from collectives import flight
from mpiparallel.jobs.hang import analyse

ROOT = Path(__file__).resolve().parents[2]
PROGRAM = ROOT / "tests" / "support" / "hang_program.py"


def _rank_pids(job: subprocess.Popen, ranks: int, timeout: float = 60) -> dict[int, int]:
    """Rank -> PID of the job's ranks (the processes below it running the program, by their PMI_RANK)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = {}
        for pid in processes_under(job.pid):
            try:
                environment = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
                command = Path(f"/proc/{pid}/cmdline").read_bytes()
            except OSError:
                continue
            if PROGRAM.name.encode() in command and b"mpiexec" not in command:
                for entry in environment:
                    if entry.startswith(b"PMI_RANK="):
                        found[int(entry.split(b"=")[1])] = pid
        if len(found) == ranks:
            return found
        time.sleep(0.1)
    raise AssertionError(f"the job's {ranks} ranks did not all start within {timeout} s")


def _hang(scenario: str, ranks: int, folder: Path, stop: int | None = None,
          env: dict[str, str] | None = None) -> list[str]:
    """Run a scenario of hang_program.py, wait until every rank is past its first calls (and `stop` stopped), send
    SIGUSR2 to every rank, collect the dumps, end the job; the analysis's lines."""
    job = start_job([mpiexec_path(), "-n", str(ranks), sys.executable, str(PROGRAM), scenario, str(folder)],
                    cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                    env={**os.environ, "PYTHONPATH": str(ROOT), **(env or {})})
    pids = _rank_pids(job, ranks)
    deadline = time.monotonic() + 60
    while not all((folder / f"ready-{rank}").exists() for rank in range(ranks)):
        assert time.monotonic() < deadline and job.poll() is None, ended(job, timeout=5)
        time.sleep(0.05)
    if stop is not None:
        os.kill(pids[stop], signal.SIGSTOP)
    time.sleep(1.0)  # long enough for every rank to be inside the call it hangs in
    asked = time.time()
    for rank, pid in pids.items():
        if rank != stop:
            os.kill(pid, signal.SIGUSR2)
    while not all(_written_after(folder / f"flight-rank-{rank}.json", asked) for rank in pids if rank != stop):
        assert time.time() - asked < 20, "the ranks did not write their flight records within 20 s"
        time.sleep(0.05)
    os.killpg(job.pid, signal.SIGKILL)
    ended(job, timeout=30)
    return analyse(folder)


def _written_after(path: Path, moment: float) -> bool:
    return path.exists() and path.stat().st_mtime >= moment - 0.5 and path.read_text().endswith("}")


def test_a_rank_that_skips_a_collective_is_named_with_where_it_is_instead(tmp_path):
    lines = _hang("skip", 3, tmp_path)
    report = "\n".join(lines)
    assert "flight records of 3 of 3 ranks" in report, report
    assert "rank 2 never entered #3: its last call here is #2; it is in pair {1,2} all_reduce #0" in report, report
    assert "receiving from rank 1" in report, report
    assert "world {0,1,2}: rank 0 waits in all_reduce #3 (ring, float64, 1000 elements, step 0" in report, report
    assert "rank 1 waits in all_reduce #3" in report, report
    assert "ranks 0, 1, 2 wait in calls on one another and on no rank outside them" in report, report


def test_a_size_mismatch_is_named_with_both_sizes(tmp_path):
    lines = _hang("mismatch", 2, tmp_path)
    report = "\n".join(lines)
    assert "world {0,1}: mismatch at #2: rank 0: all_reduce of 1000 float64; rank 1: all_reduce of 2000 float64" \
        in report, report
    reasons = {json.loads((tmp_path / f"flight-rank-{rank}.json").read_text())["reason"] for rank in (0, 1)}
    assert "SIGUSR2" in reasons


def test_checked_collectives_turn_the_size_mismatch_into_an_error_on_every_rank(tmp_path):
    """MPIPARALLEL_CHECK=1 (`--check-collectives`): the same mismatch raises CollectiveMismatchError on both ranks
    before any message of the call moves — each rank's dump says so."""
    job = start_job([mpiexec_path(), "-n", "2", sys.executable, str(PROGRAM), "mismatch", str(tmp_path)],
                    cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                    env={**os.environ, "PYTHONPATH": str(ROOT), "MPIPARALLEL_CHECK": "1"})
    dumps = [tmp_path / f"flight-rank-{rank}.json" for rank in (0, 1)]
    deadline = time.monotonic() + 60
    while not all(_written_after(path, 0) for path in dumps):
        assert time.monotonic() < deadline and job.poll() is None, ended(job, timeout=5)
        time.sleep(0.05)
    os.killpg(job.pid, signal.SIGKILL)
    ended(job, timeout=30)
    for path in dumps:
        reason = json.loads(path.read_text())["reason"]
        assert reason.startswith("error: CollectiveMismatchError: ranks disagree on a all_reduce call"), reason
        assert "rank 0: all_reduce(shape=(1000,)" in reason and "rank 1: all_reduce(shape=(2000,)" in reason, reason


def test_train_bench_and_verify_take_check_collectives(tmp_path):
    checked = subprocess.run([sys.executable, "-m", "mpiparallel", "train", "-n", "2", "--steps", "2", "--n-layer",
                              "1", "--check-collectives"], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert checked.returncode == 0, checked.stderr
    assert "every collective checks first that all its ranks call it alike" in checked.stdout
    plain = subprocess.run([sys.executable, "-m", "mpiparallel", "train", "-n", "2", "--steps", "1", "--n-layer",
                            "1"], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert plain.returncode == 0 and "checks first" not in plain.stdout, plain.stderr
    for command in (["bench", "all_reduce", "-b", "8", "-e", "64"],
                    ["verify", "--max-count", "40", "--collective", "all_reduce"]):
        result = subprocess.run([sys.executable, "-m", "mpiparallel", *command, "-n", "2", "--check-collectives"],
                                cwd=tmp_path, capture_output=True, text=True, timeout=300)
        assert result.returncode == 0, result.stderr


def test_a_send_never_received_is_named_with_where_the_receiver_is(tmp_path):
    lines = _hang("unreceived", 2, tmp_path)
    report = "\n".join(lines)
    assert "world messages {0,1}: rank 0 waits in send #0 (p2p, float64, 262144 elements, tag 7, sending to rank 1, " \
        "waited on" in report, report
    assert "ranks 0, 1 wait in calls on one another and on no rank outside them" in report, report
    assert "rank 1 posted no receive for it: it is in world {0,1} all_reduce #2" in report, report
    assert "rank 0 never entered #2" in report, report


def test_a_rank_stopped_inside_a_collective_is_named_as_missing_and_as_the_peer_the_others_wait_on(tmp_path):
    lines = _hang("loop", 2, tmp_path, stop=1)
    report = "\n".join(lines)
    assert "flight records of 1 of 2 ranks" in report, report
    assert "no dump from rank 1: stopped or dead" in report, report
    assert "world {0,1}: rank 0 waits in all_reduce #" in report and "receiving from rank 1" in report, report
    assert "held up by rank 1: it left no dump (stopped or dead); rank 0 waits on it" in report, report


def test_the_stall_watchdog_adds_the_flight_records_to_its_line(tmp_path):
    """`train -n 2 --stall-timeout 3` with rank 1 stopped: the stall's line, then the analysis of the records the
    parent asked the ranks for — rank 0 waiting in a call, rank 1 without a dump."""
    log = tmp_path / "log.jsonl"
    job = start_job([sys.executable, "-m", "mpiparallel", "train", "-n", "2", "--n-layer", "1", "--n-embd", "32",
                     "--n-head", "2", "--seq-len", "32", "--batch-size", "4", "--steps", "100000",
                     "--stall-timeout", "3", "--log-json", str(log), "--flight-dir", str(tmp_path)],
                    cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while not (log.exists() and len(log.read_text().splitlines()) >= 3):
        assert time.monotonic() < deadline and job.poll() is None, ended(job, timeout=5)
        time.sleep(0.1)
    stopped = [pid for pid in processes_under(job.pid)
               if b"PMI_RANK=1" in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
               and b"mpiparallel" in Path(f"/proc/{pid}/cmdline").read_bytes()
               and b"mpiexec" not in Path(f"/proc/{pid}/cmdline").read_bytes()]
    assert len(stopped) == 1, stopped
    os.kill(stopped[0], signal.SIGSTOP)
    try:
        status, _, stderr = ended(job, timeout=60)
    finally:
        os.kill(stopped[0], signal.SIGCONT)
    assert status == 7, stderr
    assert "mpiparallel: stalled: rank 1" in stderr, stderr
    assert "no dump from rank 1: stopped or dead" in stderr, stderr
    # where rank 0 waits depends on where rank 1 stopped: a gradient all-reduce (ring: its step and peer), or an
    # agreement of MPI's own (no step to show); either way an open call, and rank 1 named under it
    assert re.search(r"\n  \w+ \{0,1\}: rank 0 waits in \w+ #\d+ \(", stderr), stderr
    assert re.search(r"\n +rank 1: no dump \(stopped or dead\)", stderr), stderr


def test_with_the_recorder_off_the_same_hang_names_nothing(tmp_path):
    """MPIPARALLEL_FLIGHT=0: the dumps hold no calls, so the analysis that named rank 2 above finds no one."""
    lines = _hang("skip", 3, tmp_path, env={"MPIPARALLEL_FLIGHT": "0"})
    report = "\n".join(lines)
    assert "rank 2 never entered" not in report and "waits in" not in report, report
    assert "on one another" not in report and "held up" not in report, report
    assert "every communicator agrees" in report


def test_the_recorder_keeps_the_last_calls_and_its_size_is_checked():
    recorder = flight.FlightRecorder(3, label="x", members=(0,))
    for count in range(5):
        recorder.open("all_reduce", "ring", "float32", count, 4 * count).close()
    assert [call["count"] for call in recorder.as_dict()["calls"]] == [2, 3, 4]
    assert [call["seq"] for call in recorder.as_dict()["calls"]] == [2, 3, 4]
    assert flight.recorded_calls({}) == flight.DEFAULT_CALLS and flight.recorded_calls({"MPIPARALLEL_FLIGHT": "0"}) == 0
    for bad in ("-1", "many"):
        with pytest.raises(ValueError, match="MPIPARALLEL_FLIGHT"):
            flight.recorded_calls({"MPIPARALLEL_FLIGHT": bad})


def test_debug_hang_on_a_folder_without_dumps_is_one_clear_error(tmp_path):
    result = subprocess.run([sys.executable, "-m", "mpiparallel", "debug", "hang", str(tmp_path)],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and "no flight-recorder dumps" in result.stderr, result.stderr
    assert "Traceback" not in result.stderr


def test_a_rank_sets_up_its_recorder_without_importing_numpy():
    """`run_guarded` arms the dump before the command runs; that must not load NumPy, whose BLAS fixes its thread
    count when it loads — before `train` has set each rank's share (a 15× slower step on 2 ranks, seen once)."""
    program = ("import sys; from mpiparallel.jobs import launch; "
               "launch.run_guarded(lambda: print('numpy' in sys.modules, 'mpi4py.MPI' in sys.modules))")
    result = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, timeout=60,
                            env={**os.environ, "PMI_RANK": "0", "PMI_SIZE": "1"})
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["False", "False"], result.stdout


@pytest.mark.parametrize("recorder", ["on", "off"])
def test_a_rank_hung_under_the_pipeline_is_singled_out_by_the_flight_records(tmp_path, recorder):
    """`train --pp 3` with rank 1 (the middle stage) hung, alive, at step 4's first pipeline action: the progress
    reports cannot order pipeline ranks (each stage runs its own actions), so they single out nobody; the flight
    records can — ranks 0 and 2 wait in receives from rank 1, which sits in no call. With the recorder off
    (MPIPARALLEL_FLIGHT=0) the stall's line names nobody: the records are what names it."""
    tokens = tmp_path / "tokens.npy"
    np.save(tokens, np.random.default_rng(0).integers(0, 257, 4000))
    log = tmp_path / "log.jsonl"
    env = {**os.environ, "MPIPARALLEL_STALL_AT": "4@1", "MPIPARALLEL_FLIGHT": "512" if recorder == "on" else "0"}
    job = start_job([sys.executable, "-m", "mpiparallel", "train", "-n", "3", "--pp", "3", "--n-layer", "3",
                     "--n-head", "2", "--n-embd", "16", "--seq-len", "8", "--vocab-size", "257", "--batch-size", "6",
                     "--data", str(tokens), "--steps", "1000", "--stall-timeout", "3", "--log-json", str(log),
                     "--flight-dir", str(tmp_path)], cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                    text=True, env=env)
    status, _, stderr = ended(job, timeout=180)
    [line] = [line for line in stderr.splitlines() if line.startswith("mpiparallel: stalled:")]
    event = json.loads(log.read_text().splitlines()[-1])
    if recorder == "off":
        assert "none is behind the others" in line and event["behind"] == [], line
        return
    assert status == 7, stderr
    assert line.startswith("mpiparallel: stalled: rank 1 (the others wait on it: flight records) has not finished "
                           "step 4 (pipeline action "), line
    for rank in (0, 2):
        assert f"; rank {rank} waits in step 4 (pipeline action " in line, line
    assert "held up by rank 1: it is in no call (computing, or waiting outside the collectives); ranks 0, 2 wait " \
           "on it" in stderr, stderr
    assert re.search(r"pp messages \{0,1,2\}: rank 0 waits in recv #\d+ \(p2p, float32, \d+ elements, tag \d+, "
                     r"receiving from rank 1, waited on", stderr), stderr
    assert event["behind"] == [1] and event["behind_by"] == "flight records", event


PIPELINE = pipeline_checks.broken_step


def test_checked_pipeline_messages_name_a_send_nobody_receives_on_every_rank():
    """`--check-collectives` under --pp: a schedule that lost a receive is one error on both ranks, before any
    message moves; unchecked, the same schedule fails somewhere else with a KeyError that names no message."""
    assert run_on_ranks(2, PIPELINE, breakage="none") == ["no error", "no error"]
    for message in run_on_ranks(2, PIPELINE, breakage="dropped_receive"):
        assert message == ("the pipeline's messages on pp do not pair up (check_arguments, MPIPARALLEL_CHECK=1):\n"
                           "  rank 0 sends rank 1 tag 4 (2×8×16 float64) that rank 1 never receives"), message
    with pytest.raises(RankFailure, match=r"KeyError: \('input', 1, 0\)"):
        run_on_ranks(2, PIPELINE, breakage="dropped_receive", checked=False, timeout=60)


def test_checked_pipeline_messages_name_sizes_that_differ_on_every_rank():
    """Rank 1 expects activations twice as long as rank 0 sends: every mismatched message named on both ranks;
    unchecked, the run fails later in the loss with a broadcasting error."""
    for message in run_on_ranks(2, PIPELINE, breakage="longer_buffer"):
        assert "rank 0 sends rank 1 tag 4 as 2×8×16 float64; rank 1 receives it into 2×16×16 float64" in message
        assert "rank 1 sends rank 0 tag 1 as 2×16×16 float64; rank 0 receives it into 2×8×16 float64" in message
    with pytest.raises(RankFailure, match="operands could not be broadcast"):
        run_on_ranks(2, PIPELINE, breakage="longer_buffer", checked=False, timeout=60)


def test_a_checked_send_whose_data_differs_from_what_its_receiver_expects_is_one_error():
    """The plans agree (both ranks expect 2×16×16) but the data is 2×8×16: the sending rank raises before the
    message moves, and the job ends (the harness aborts it, as `train` does); unchecked, a broadcasting error in
    the last stage's loss."""
    with pytest.raises(RankFailure, match="pipeline rank 0 would send rank 1 tag 4 as 2×8×16 float64; its receiver "
                                          "expects 2×16×16 float64"):
        run_on_ranks(2, PIPELINE, breakage="short_data", timeout=60)
    with pytest.raises(RankFailure, match="operands could not be broadcast"):
        run_on_ranks(2, PIPELINE, breakage="short_data", checked=False, timeout=60)
