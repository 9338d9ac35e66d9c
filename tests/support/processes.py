"""The processes a test's job started: a rank's PID by its rank, waiting for a job's steps or its end."""

from __future__ import annotations

import os
import signal
import subprocess
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
    """The PID of `rank` among the processes `job` started (its launcher variable PMI_RANK, read from /proc)."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            environment = (entry / "environ").read_bytes().split(b"\0")
            command = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        if f"PMI_RANK={rank}".encode() in environment and b"mpiparallel" in command and \
                _descends_from(int(entry.name), job):
            return int(entry.name)
    raise AssertionError(f"no rank {rank} under process {job}")


def wait_for_steps(log: Path, steps: int, job: subprocess.Popen, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not (log.exists() and len(log.read_text().splitlines()) >= steps):
        assert job.poll() is None and time.monotonic() < deadline, job.communicate()
        time.sleep(0.1)


def ended(job: subprocess.Popen, timeout: float = 120) -> tuple[int, str, str]:
    try:
        stdout, stderr = job.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(job.pid, signal.SIGKILL)
        stdout, stderr = job.communicate()
        raise AssertionError(f"the job did not end within {timeout} s:\n{stdout[-2000:]}\n{stderr[-2000:]}") from None
    return job.returncode, stdout, stderr
