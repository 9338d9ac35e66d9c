"""The processes a test's job started: a rank's PID by its rank, waiting for a job's steps or its end."""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from pathlib import Path


def _parent_of(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def _descends_from(pid: int, ancestor: int) -> bool:
    while pid > 1:
        try:
            pid = _parent_of(pid)
        except (OSError, IndexError, ValueError):
            return False
        if pid == ancestor:
            return True
    return False


def rank_pid(job: int, rank: int) -> int:
    """The PID of `rank` among the processes `job` started (its launcher variable, MPICH's PMI_RANK or Open MPI's
    OMPI_COMM_WORLD_RANK, read from /proc)."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            environment = (entry / "environ").read_bytes().split(b"\0")
            command = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        told = {f"PMI_RANK={rank}".encode(), f"OMPI_COMM_WORLD_RANK={rank}".encode()}
        if told & set(environment) and b"mpiparallel" in command and \
                _descends_from(int(entry.name), job):
            return int(entry.name)
    raise AssertionError(f"no rank {rank} under process {job}")


def processes_under(job: int) -> list[int]:
    """The PIDs of every process below `job` now (mpiexec, hydra's proxy, the ranks, …)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and _descends_from(int(entry.name), job):
            found.append(int(entry.name))
    return found


def still_running(pids: list[int], within_s: float = 10) -> list[int]:
    """Those of `pids` still running (not ended, not a zombie) after up to `within_s` seconds: [] when all ended."""
    deadline = time.monotonic() + within_s
    while True:
        left = [pid for pid in pids if _running(pid)]
        if not left or time.monotonic() >= deadline:
            return left
        time.sleep(0.05)


def _running(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")


_STARTED: list[subprocess.Popen] = []


def start_job(command: list[str], timeout: float = 600, **options) -> subprocess.Popen:
    """Start `command` in a process group of its own. Every wait on it is bounded (`wait_for_steps`, `ended`),
    `kill_leftover_jobs` (run after every test by tests/conftest.py) kills the group of any job still running, and
    a job still running after `timeout` seconds (pytest-timeout's per-test bound) is killed whatever the test is
    doing, so a failed test leaves no rank behind and no job outlives its test."""
    job = subprocess.Popen(command, start_new_session=True, **options)
    _STARTED.append(job)
    deadline = threading.Timer(timeout, lambda: job.poll() is None and _kill_group_now(job))
    deadline.daemon = True
    deadline.start()
    return job


def _kill_group_now(job: subprocess.Popen) -> None:
    try:
        os.killpg(job.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def kill_leftover_jobs() -> None:
    for job in _STARTED:
        if job.poll() is None:
            _kill_group(job)
    _STARTED.clear()


def _kill_group(job: subprocess.Popen) -> tuple[str, str]:
    """SIGKILL the job's whole group (mpiexec and its ranks); what it printed, read with a bound."""
    try:
        os.killpg(job.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    try:
        return job.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        return "", "(its output did not close within 30 s)"


def end_job(job: subprocess.Popen) -> str:
    """End a job that may still run (SIGKILL to its group); what it printed (its stdout)."""
    return (_kill_group(job) if job.poll() is None else job.communicate(timeout=30))[0] or ""


def wait_for_steps(log: Path, steps: int, job: subprocess.Popen, timeout: float = 120) -> None:
    """Until the JSON log holds `steps` lines; the job ending first, or `timeout` seconds, fail (the job killed)."""
    deadline = time.monotonic() + timeout
    while not (log.exists() and len(log.read_text().splitlines()) >= steps):
        if job.poll() is not None or time.monotonic() >= deadline:
            stdout, stderr = _kill_group(job)
            raise AssertionError(f"{steps} steps not logged within {timeout} s (exit {job.returncode}):\n"
                                 f"{(stdout or '')[-2000:]}\n{(stderr or '')[-2000:]}")
        time.sleep(0.1)


def wait_for_steps_after_restart(log: Path, steps: int, job: subprocess.Popen, timeout: float = 120) -> None:
    """Until the JSON log holds `steps` lines after its last restart event: the relaunched job trains, so every
    one of its ranks has started (the old job's last lines can still arrive after the kill that ended it)."""
    def after_restart() -> int:
        lines = log.read_text().splitlines() if log.exists() else []
        # matched, not parsed: the last line may be half-written
        restarts = [index for index, line in enumerate(lines) if '"event": "restart"' in line]
        return len(lines) - 1 - restarts[-1] if restarts else 0

    deadline = time.monotonic() + timeout
    while after_restart() < steps:
        if job.poll() is not None or time.monotonic() >= deadline:
            stdout, stderr = _kill_group(job)
            raise AssertionError(f"{steps} steps after a restart not logged within {timeout} s (exit "
                                 f"{job.returncode}):\n{(stdout or '')[-2000:]}\n{(stderr or '')[-2000:]}")
        time.sleep(0.1)


def ended(job: subprocess.Popen, timeout: float = 120) -> tuple[int, str, str]:
    try:
        stdout, stderr = job.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        stdout, stderr = _kill_group(job)
        raise AssertionError(f"the job did not end within {timeout} s:\n{stdout[-2000:]}\n{stderr[-2000:]}") from None
    return job.returncode, stdout, stderr


SHARED_MEMORY = Path("/dev/shm")
LEFT_SEGMENTS = ("mpich_shm_*", "sm_segment.*")
"""The shared-memory files MPICH (`mpich_shm_…`) and Open MPI (`sm_segment.HOST-…`) make for the ranks of a node:
each unlinks its own once every rank has mapped it, but ranks killed before that (the fault tests kill many) leave
them, 3–4 MB each — 59 in one suite run here, 3.2 GB on this machine after a day of runs."""


def segments_made_since(moment: float) -> list[Path]:
    """The MPI shared-memory files made after `moment` that no process holds open or mapped: left by killed ranks."""
    made = [path for pattern in LEFT_SEGMENTS for path in SHARED_MEMORY.glob(pattern)
            if _changed_at(path) >= moment]
    return [path for path in made if path not in _held_shared_memory()] if made else []


def _changed_at(path: Path) -> float:
    try:
        return path.stat().st_ctime
    except OSError:
        return float("-inf")


def _held_shared_memory() -> set[Path]:
    """Every /dev/shm file some process has open or mapped."""
    held = set()
    for process in Path("/proc").iterdir():
        if not process.name.isdigit():
            continue
        try:
            held |= {Path(line.split(maxsplit=5)[5].removesuffix(" (deleted)"))
                     for line in (process / "maps").read_text().splitlines() if " /dev/shm/" in line}
            descriptors = list((process / "fd").iterdir())
        except OSError:  # ended meanwhile
            continue
        for entry in descriptors:
            try:
                target = os.readlink(entry)
            except OSError:
                continue
            if target.startswith("/dev/shm/"):
                held.add(Path(target))
    return held
