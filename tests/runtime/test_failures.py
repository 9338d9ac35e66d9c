"""How a job ends when a rank fails: quickly, non-zero, and with one message that names the rank.

- A rank SIGKILLed in the middle of training (no chance to say anything): mpiexec ends the others, and the
  self-launching parent names the lost rank instead of hydra's banner with a bare PID.
- An exception on one rank of `train`, `bench` or `verify`: that rank's message, once, and MPI_Abort for the rest.
  The exception is planted by a `sitecustomize` module that replaces `Communicator.run` and `start` (every
  hand-written collective goes through one of them) in the ranks with versions that raise on rank 1 at its
  fifth collective.
"""

from __future__ import annotations

import json
import os
import resource
import select
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
from mpi_harness import mpiexec_path, run_with_timeout
from processes import rank_pid, start_job

from mpiparallel.errors import ExitCode
from mpiparallel.jobs import launch

TINY = ["--n-layer", "2", "--n-embd", "16", "--n-head", "2", "--seq-len", "8", "--batch-size", "4", "--threads", "1"]
ENDS_WITHIN = 10.0
"""Seconds from the failure to the end of the whole job."""

KILLS_UNDER_LOAD = int(os.environ.get("MPIPARALLEL_TEST_KILLS_UNDER_LOAD", "5"))
"""How many times the kill is repeated with the CPU busy (more to hunt a race)."""


def kill_rank_1_mid_training(log: Path, python: str = sys.executable) -> tuple[int, str]:
    """Start `train` on 3 ranks, SIGKILL rank 1 once training is under way, and check that the job ends within
    ENDS_WITHIN seconds, non-zero, with one line that names rank 1 and no other rank. Returns rank 1's PID and
    the job's output. `python`: the interpreter (another environment's, for another MPI)."""
    command = ["train", "-n", "3", *TINY, "--batch-size", "6", "--steps", "100000", "--log-json", str(log)]
    job = subprocess.Popen([python, "-m", "mpiparallel", *command], stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True, start_new_session=True,
                           env={**os.environ, "PYTHONUNBUFFERED": "1"})
    # bounded: a 120 s deadline to start, communicate(timeout=ENDS_WITHIN) after the kill, killpg in `finally`
    try:
        deadline = time.monotonic() + 120
        while not (log.exists() and len(log.read_text().splitlines()) >= 3):  # training is under way
            assert job.poll() is None and time.monotonic() < deadline, job.communicate()
            time.sleep(0.05)
        victim = rank_pid(job.pid, 1)
        killed = time.monotonic()
        os.kill(victim, signal.SIGKILL)
        out, err = job.communicate(timeout=ENDS_WITHIN)
        seconds = time.monotonic() - killed
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
            job.communicate()
    assert job.returncode == ExitCode.LOST_RANK and seconds < ENDS_WITHIN, (job.returncode, err)
    lost = [line for line in (out + err).splitlines() if " was lost: " in line]
    assert len(lost) == 1 and lost[0].startswith(f"mpiparallel: rank 1 (pid {victim}) was lost: "), (victim, out + err)
    assert lost[0].count(" was lost: ") == 1, lost  # no rank that mpiexec killed afterwards
    assert "BAD TERMINATION" not in out + err and "prterun" not in out + err and "Traceback" not in out + err
    return victim, out + err


@pytest.mark.skipif(not Path("/proc/self/environ").exists(), reason="finds the rank's PID in Linux's /proc")
def test_a_rank_killed_mid_training_ends_the_job_within_10_s_naming_it(tmp_path):
    kill_rank_1_mid_training(tmp_path / "log.jsonl")
    assert json.loads((tmp_path / "log.jsonl").read_text().splitlines()[-1])["step"] >= 2


@pytest.mark.skipif(not Path("/proc/self/environ").exists(), reason="finds the rank's PID in Linux's /proc")
def test_the_rank_killed_first_is_named_with_the_cpu_busy(tmp_path):
    """The same kill, again and again, with every core busy: mpiexec's own SIGKILL of the survivors must never be
    taken for the first death (seen once on a loaded machine, when the order of the processes' ends was used)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 2
    spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(cores)]
    # bounded: the spinners are killed in `finally`; each job below has its own timeout
    try:
        for attempt in range(KILLS_UNDER_LOAD):
            kill_rank_1_mid_training(tmp_path / f"log-{attempt}.jsonl")
    finally:
        for spinner in spinners:
            spinner.kill()
            spinner.wait()


FAKE_RANK = textwrap.dedent("""
    # registers with the watcher as a rank does; when told, closes its files' connection and lingers as a dying
    # process does while its last thread exits
    import os, sys, time
    from mpiparallel.jobs import launch

    launch._register_pid()
    while not os.path.exists(sys.argv[1]):
        time.sleep(0.01)
    launch._connection_to_parent[0].close()
    time.sleep(3)
""")


@pytest.mark.skipif(not hasattr(os, "pidfd_open"), reason="the watcher needs Linux pidfds")
def test_the_first_death_is_the_first_rank_whose_files_closed_not_the_first_zombie(tmp_path):
    """Rank 1's files close (the moment hydra learns of a death and kills the others) while its process lingers;
    rank 0 is killed after that and ends at once. Rank 1 died first, though rank 0 was the first to end."""
    pids = tmp_path / "pids"
    pids.mkdir()
    watcher = launch.Endings(pids, ranks=2)
    watcher.start()
    ranks = [subprocess.Popen([sys.executable, "-c", FAKE_RANK, str(tmp_path / f"go-{rank}")],
                              env={**os.environ, launch.RANK_PIDS: str(pids), "PMI_RANK": str(rank)})
             for rank in (0, 1)]  # bounded: every wait below has a deadline or timeout, killed in `finally`
    try:
        registered_by = time.monotonic() + 60
        while len(launch._registered(pids)) < 2:
            assert time.monotonic() < registered_by, "the fake ranks never connected"
            time.sleep(0.01)
        time.sleep(0.2)  # both connected
        (tmp_path / "go-1").touch()
        noticed_by = time.monotonic() + 1.5  # well before rank 1's process ends
        while not watcher.order and time.monotonic() < noticed_by:
            time.sleep(0.01)
        ranks[0].kill()
        ranks[0].wait(timeout=60)
        watcher.join(timeout=10)
    finally:
        for process in ranks:
            process.kill()
            process.wait(timeout=60)
    assert watcher.order == [[(1, ranks[1].pid)], [(0, ranks[0].pid)]]
    message = launch.lost_rank_message("", launch._registered(pids), watcher.order, watcher.how)
    assert message is not None and message.startswith(f"mpiparallel: rank 1 (pid {ranks[1].pid}) was lost: ")


CLOSING_RANK = textwrap.dedent("""
    # registers as a rank does; when told, closes its connection, says so, and exits
    import os, sys, time
    from mpiparallel.jobs import launch

    launch._register_pid()
    while not os.path.exists(sys.argv[1]):
        time.sleep(0.01)
    launch._connection_to_parent[0].close()
    open(sys.argv[1] + ".closed", "w").close()
""")


class LateWatcher(launch.Endings):
    """The watcher of a loaded machine: once both ranks are connected, it does not look again until `late` is
    set — by then both connections have closed."""

    def __init__(self, pids: Path) -> None:
        super().__init__(pids, ranks=2)
        self.late = threading.Event()

    def _watch_new_ranks(self) -> list[int]:
        gone = super()._watch_new_ranks()
        if len(self.connections) == 2 and all(pid is not None for _, pid in self.connections.values()):
            self.late.wait(60)
        return gone


@pytest.mark.skipif(not hasattr(os, "pidfd_open"), reason="the watcher needs Linux pidfds")
def test_a_watcher_that_wakes_late_still_names_only_the_rank_that_ended_first(tmp_path):
    """Rank 1 closes its connection, then rank 0 (which connected first, so holds the lower descriptor), both
    before the watcher looks: it still sees rank 1 end first and names rank 1 alone."""
    pids = tmp_path / "pids"
    pids.mkdir()
    watcher = LateWatcher(pids)
    watcher.start()
    ranks = []
    try:  # bounded: every wait below has a deadline or timeout, the processes killed in `finally`
        for rank in (0, 1):
            ranks.append(start_job([sys.executable, "-c", CLOSING_RANK, str(tmp_path / f"go-{rank}")],
                                   env={**os.environ, launch.RANK_PIDS: str(pids), "PMI_RANK": str(rank)}))
            connected_by = time.monotonic() + 60
            while len(watcher.connections) <= rank or None in [pid for _, pid in watcher.connections.values()]:
                assert time.monotonic() < connected_by, "the fake rank never connected"
                time.sleep(0.01)
        for rank in (1, 0):
            (tmp_path / f"go-{rank}").touch()
            closed_by = time.monotonic() + 60
            while not (tmp_path / f"go-{rank}.closed").exists():
                assert time.monotonic() < closed_by, "the fake rank never closed its connection"
                time.sleep(0.01)
        watcher.late.set()
        watcher.join(timeout=20)
    finally:
        watcher.late.set()
        for process in ranks:
            process.kill()
            process.wait(timeout=60)
    assert watcher.order == [[(1, ranks[1].pid)], [(0, ranks[0].pid)]]
    message = launch.lost_rank_message("", launch._registered(pids), watcher.order, watcher.how)
    assert message is not None and message.startswith(f"mpiparallel: rank 1 (pid {ranks[1].pid}) was lost: ")
    assert "rank 0" not in message


REGISTERING_RANK = textwrap.dedent("""
    # registers as a rank does and reports where its connection to the parent is held
    import os, sys
    from mpiparallel.jobs import launch

    launch._register_pid()
    connection = launch._connection_to_parent[0]
    descriptors = [int(name) for name in os.listdir("/proc/self/fd")]
    print(connection.fileno(), max(descriptors), os.get_inheritable(connection.fileno()), connection.getpeername())
""")


def test_a_rank_holds_its_connection_to_the_parent_on_its_highest_descriptor(tmp_path):
    pids = tmp_path / "pids"
    pids.mkdir()
    watcher = launch.Endings(pids, ranks=1)
    watcher.start()
    result = run_with_timeout([sys.executable, "-c", REGISTERING_RANK], timeout=60,
                              env={**os.environ, launch.RANK_PIDS: str(pids), "PMI_RANK": "0"})
    watcher.join(timeout=10)
    assert result.returncode == 0, result.stderr
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    highest = min(soft, launch.HIGHEST_DESCRIPTOR + 1) - 1
    assert result.stdout.split() == [str(highest), str(highest), "False", str(pids / launch.WATCH_SOCKET)]
    assert [[rank for rank, _ in group] for group in watcher.order] == [[0]]


KILLED_RANK = textwrap.dedent("""
    # holds a socket on descriptor 10 (as a rank holds hydra's PMI socket, inherited, low), registers, waits
    import os, socket, sys, time
    from mpiparallel.jobs import launch

    os.dup2(int(sys.argv[1]), 10)
    os.close(int(sys.argv[1]))
    launch._register_pid()
    print("registered", flush=True)
    time.sleep(60)
""")


@pytest.mark.skipif(not hasattr(select, "epoll"), reason="reads the kernel's order of the ends with epoll")
def test_a_killed_rank_releases_its_connection_to_the_parent_before_the_socket_hydra_watches(tmp_path):
    """What hydra sees (the PMI socket, descriptor 10 here) must close after what the watcher sees, or hydra may
    kill the other ranks before the watcher learns which one died. SIGKILLed, the rank's files are released last
    descriptor first; the test watches both ends in one epoll, which hands them over in the order they closed."""
    pids = tmp_path / "pids"
    pids.mkdir()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(pids / launch.WATCH_SOCKET))
    listener.listen(1)
    listener.settimeout(60)
    pmi_ours, pmi_theirs = socket.socketpair()
    rank = start_job([sys.executable, "-c", KILLED_RANK, str(pmi_theirs.fileno())], stdout=subprocess.PIPE,
                     pass_fds=[pmi_theirs.fileno()], env={**os.environ, launch.RANK_PIDS: str(pids), "PMI_RANK": "0"})
    pmi_theirs.close()
    try:
        watched, _ = listener.accept()  # within the listener's 60 s timeout
        assert select.select([rank.stdout], [], [], 60)[0], "the fake rank never said it registered"
        assert rank.stdout.readline() == b"registered\n"
        watched.recv(64)  # the rank's PID, read first: a descriptor already ready would keep its place in epoll's list
        poller = select.epoll()
        poller.register(watched.fileno(), select.EPOLLIN)
        poller.register(pmi_ours.fileno(), select.EPOLLIN)
        rank.kill()
        rank.wait(timeout=60)
        order = [descriptor for descriptor, _ in poller.poll(10)]
    finally:
        rank.kill()
        rank.wait(timeout=60)
    assert order == [watched.fileno(), pmi_ours.fileno()]


PLANTED_FAILURE = textwrap.dedent("""
    # sitecustomize: imported at the start of every Python process; only the ranks plant the failure
    import os

    if "PMI_RANK" in os.environ or "OMPI_COMM_WORLD_RANK" in os.environ:  # MPICH's and Open MPI's launchers
        from collectives.communicator import Communicator
        from mpiparallel.jobs.launch import launcher_rank

        calls = 0

        def failing(original):
            def replacement(self, *args, **kwargs):
                global calls
                calls += 1
                if launcher_rank() == 1 and calls == 5:
                    raise RuntimeError("planted failure on rank 1")
                return original(self, *args, **kwargs)
            return replacement

        Communicator.run = failing(Communicator.run)
        Communicator.start = failing(Communicator.start)
""")


@pytest.mark.parametrize("command, self_launched", [
    (["train", *TINY, "--steps", "20", "--tp", "2"], False),
    (["train", *TINY, "--steps", "20", "--pp", "2"], False),
    (["bench", "all_reduce", "-b", "1K", "-e", "64K", "--iters", "2", "-w", "1"], False),
    (["verify", "--max-count", "100", "--collective", "all_reduce"], False),
    (["train", *TINY, "--steps", "20", "--tp", "2"], True),
    (["bench", "all_reduce", "-b", "1K", "-e", "64K", "--iters", "2", "-w", "1"], True),
], ids=["train-tp", "train-pp", "bench", "verify", "train-tp-self-launched", "bench-self-launched"])
def test_an_exception_on_one_rank_ends_the_job_with_that_ranks_message(tmp_path, command, self_launched):
    raise_on_rank_1(tmp_path, command, self_launched)


def raise_on_rank_1(tmp_path: Path, command: list[str], self_launched: bool, python: str = sys.executable,
                    mpiexec: str | None = None, env: dict[str, str] | None = None) -> str:
    """Run `command` on 2 ranks (self-launched, or under `mpiexec`) with the failure planted in rank 1, and check
    that the job ends soon with status 1 and rank 1's message once; returns the output."""
    (tmp_path / "sitecustomize.py").write_text(PLANTED_FAILURE)
    # the checkout under test goes on the path too: sitecustomize runs before Python adds the working directory,
    # so without it the import below would find whatever copy of the project pip installed last (or none)
    checkout = str(Path(__file__).resolve().parents[2])
    path = os.pathsep.join(filter(None, [str(tmp_path), checkout, os.environ.get("PYTHONPATH")]))
    launch = [python, "-m", "mpiparallel", *command, "-n", "2"] if self_launched else \
        [mpiexec or mpiexec_path(), "-n", "2", python, "-m", "mpiparallel", *command]
    start = time.monotonic()
    finished = run_with_timeout(launch, 60, env={**(env or os.environ), "PYTHONUNBUFFERED": "1", "PYTHONPATH": path})
    output = finished.stdout + finished.stderr
    assert finished.returncode == ExitCode.CRASH and time.monotonic() - start < ENDS_WITHIN + 5, output
    assert output.count("mpiparallel: rank 1 failed: RuntimeError: planted failure on rank 1") == 1, output
    assert output.count("failed:") == 1 and "was lost" not in output and "Traceback" not in output, output
    return output


def test_an_mpi_error_on_a_survivor_says_that_another_rank_probably_died(tmp_path):
    script = tmp_path / "mpi_error.py"
    script.write_text(textwrap.dedent("""
        from mpi4py import MPI
        from mpiparallel.jobs.launch import run_guarded

        def body():
            if MPI.COMM_WORLD.Get_rank() == 0:
                raise MPI.Exception(MPI.ERR_IN_STATUS)  # what a receive from a vanished peer raises
            MPI.COMM_WORLD.Barrier()

        run_guarded(body)
    """))
    finished = run_with_timeout([mpiexec_path(), "-n", "2", sys.executable, str(script)], 30,
                                env={**os.environ, "PYTHONUNBUFFERED": "1"})
    output = finished.stdout + finished.stderr
    assert finished.returncode == ExitCode.CRASH
    assert output.count("rank 0 failed: MPI error: See the MPI_ERROR field in MPI_Status") == 1, output
    assert "another rank has most likely died" in output and "Traceback" not in output


@pytest.mark.skipif(not hasattr(os, "pidfd_open"), reason="the watcher needs Linux pidfds")
def test_a_watcher_still_waiting_when_the_job_folder_is_removed_ends_quietly(tmp_path, monkeypatch):
    """A job that ends before every rank registered (a configuration error on the ranks that did) leaves the
    watcher waiting for the missing rank; the parent then removes the job's folder. The watcher must end without
    a traceback — one was printed under the one clear error line (a CI run of test_invalid_invocations)."""
    failures: list[BaseException] = []
    monkeypatch.setattr(threading, "excepthook", lambda arguments: failures.append(arguments.exc_value))
    pids = tmp_path / "pids"
    pids.mkdir()
    watcher = launch.Endings(pids, ranks=2)
    watcher.start()
    (pids / str(os.getpid())).write_text("0 ")  # one rank registered (this process: it stays alive)
    time.sleep(0.2)  # the watcher has looked at least once
    shutil.rmtree(pids)
    watcher.join(timeout=10)
    assert not watcher.is_alive() and failures == []
