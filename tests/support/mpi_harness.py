"""Run test code on several MPI ranks from pytest, with a timeout, and collect what each rank returns.

    from workers import collective_checks
    results = run_on_ranks(4, collective_checks.check_against_native, sizes=[0, 1, 7])

launches `mpiexec -n 4 python tests/support/mpi_worker.py …`; every rank imports the function (the test named it
by the object, the harness passes on its module and name), calls it with the keyword arguments, and writes its
JSON-able return value to a file. A rank that raises writes its traceback and aborts the job (MPI_Abort), so the
others cannot hang; a job that still hangs is killed at `timeout` seconds. Either way the test fails with the
failing rank's message. Group many checks into one launch — starting the ranks costs about 0.3 s — with a dict of
`call`s: `run_on_ranks(2, {"ring": call(checks.ring, n=3), "tree": call(checks.tree)})` gives each rank's
{name: result}.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

TESTS_DIR = Path(__file__).resolve().parent
WORKER = TESTS_DIR / "mpi_worker.py"


class RankFailure(AssertionError):
    """A rank raised, the job died, or it timed out."""


def mpiexec_path() -> str:
    """`mpiexec` on PATH, else the one the mpich wheel installs next to the interpreter."""
    beside_python = Path(sys.executable).parent / "mpiexec"
    if beside_python.exists():
        return str(beside_python)
    found = shutil.which("mpiexec")
    if found is None:
        raise RuntimeError("no mpiexec found: pip install mpich (or put your MPI's mpiexec on PATH)")
    return found


class Hang(AssertionError):
    """A command ran past its timeout; its whole process group (mpiexec and every rank) was killed."""


def run_with_timeout(command: list[str], timeout: float, merge_output: bool = False,
                **popen_options: Any) -> subprocess.CompletedProcess:
    """Run `command` in its own process group; past `timeout` seconds kill the group and raise Hang.

    Killing the group, not just the child, is what stops the ranks that mpiexec started."""
    stderr = subprocess.STDOUT if merge_output else subprocess.PIPE
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=stderr, text=True, start_new_session=True,
                               **popen_options)
    try:
        stdout, errors = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        stdout, errors = process.communicate()
        tail = f"{stdout[-2000:]}\n{(errors or '')[-2000:]}"
        raise Hang(f"{' '.join(command)} hung: killed after {timeout} s\n{tail}") from None
    return subprocess.CompletedProcess(command, process.returncode, stdout, errors)


@dataclass(frozen=True)
class Call:
    """A function to run on every rank with its keyword arguments (JSON-able)."""

    function: Callable[..., Any]
    arguments: dict[str, Any] = field(default_factory=dict)

    def job(self) -> dict[str, Any]:
        """What the worker reads: the function's module and name (it imports it) and the arguments."""
        name = self.function.__qualname__
        if "<" in name:
            raise ValueError(f"{name}: a rank imports the function it runs, so it must be defined at module level")
        return {"target": f"{self.function.__module__}:{name}", "arguments": self.arguments}


def call(function: Callable[..., Any], **arguments: Any) -> Call:
    return Call(function, arguments)


def worker_job(target: Callable[..., Any] | Mapping[str, Call], **arguments: Any) -> str:
    """The job `mpi_worker.py` runs, as its command-line argument: one call, or several by name."""
    if callable(target):
        return json.dumps(call(target, **arguments).job())
    if arguments:
        raise TypeError("a group of calls carries its arguments in each call")
    return json.dumps({"calls": {name: each.job() for name, each in target.items()}})


def run_on_ranks(n: int, target: Callable[..., Any] | Mapping[str, Call], timeout: float = 120,
                 env: dict[str, str] | None = None, mpiexec_options: Sequence[str] = (),
                 launcher: Sequence[str] | None = None, python: str | None = None, **kwargs: Any) -> list[Any]:
    """Call `target` (a function, or a dict of named `call`s run one after another) on `n` ranks with `kwargs`;
    return the per-rank results. `mpiexec_options` say where the ranks start (a hostfile and launcher; default:
    this machine); `launcher` replaces `mpiexec … -n N` whole (`srun -N 2 -n 4 --mpi=pmi2`: it must start `n`
    ranks); `python` is the ranks' interpreter (default this one; another environment's for another MPI)."""
    what = getattr(target, "__qualname__", None) or ", ".join(target)
    with tempfile.TemporaryDirectory(prefix="mpitest-") as results_dir:
        start = [*launcher] if launcher is not None else [mpiexec_path(), *mpiexec_options, "-n", str(n)]
        command = [*start, python or sys.executable, str(WORKER), results_dir, worker_job(target, **kwargs)]
        try:
            finished = run_with_timeout(command, timeout, merge_output=True,
                                   env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})})
        except Hang as hang:
            raise RankFailure(f"{what} on {n} ranks: {hang}") from None
        return _collect(Path(results_dir), n, what, finished.returncode, finished.stdout)


def _collect(results_dir: Path, n: int, target: str, returncode: int, output: str) -> list[Any]:
    results, errors = [], []
    for rank in range(n):
        path = results_dir / f"rank{rank}.json"
        if not path.exists():
            results.append(None)
            continue
        record = json.loads(path.read_text())
        if "error" in record:
            errors.append(f"rank {rank}: {record['error']}")
        results.append(record.get("result"))
    if errors:
        raise RankFailure(f"{target} on {n} ranks failed:\n" + "\n".join(errors))
    if returncode != 0 or any(r is None for r in results):
        raise RankFailure(f"{target} on {n} ranks exited with {returncode}\n{output[-3000:]}")
    return results


def train_error(*args: str, timeout: float = 120) -> str:
    """Run `mpiparallel train ARGS`, which must fail with exactly one "Error" line and no traceback on any rank;
    return its output (for the caller to look for what the message must name)."""
    result = run_with_timeout([sys.executable, "-m", "mpiparallel", "train", *args], timeout)
    output = result.stdout + result.stderr
    assert result.returncode != 0, output
    assert sum(line.startswith("Error") for line in output.splitlines()) == 1, output
    assert "Traceback" not in output, output
    return output


def serial_training(common: dict[str, Any], directory: Path) -> str:
    """Train `common` on one rank into `directory` (log.jsonl, model/): the reference parallel runs compare with."""
    from workers import training_checks  # the rank-side halves import mpiparallel's training: loaded when used

    run_on_ranks(1, training_checks.serial_reference, common=common, directory=str(directory))
    return str(directory)


def parallel_training(ranks: int, common: dict[str, Any], configs: list[dict[str, Any]], reference: str,
                      timeout: float = 300, mpiexec_options: Sequence[str] = (), launcher: Sequence[str] | None = None,
                      env: dict[str, str] | None = None, python: str | None = None) -> list[dict]:
    """Train every configuration (options on top of `common`) on `ranks` ranks in one launch; per configuration
    its options, log records and worst relative errors of losses and saved weights against `reference`."""
    from workers import training_checks

    return run_on_ranks(ranks, training_checks.matches_serial, timeout=timeout, mpiexec_options=mpiexec_options,
                        launcher=launcher, env=env, python=python, common=common, configs=configs,
                        reference=reference)[0]


def assert_equals_serial(result: dict, steps: int, tolerance: float = 1e-9) -> None:
    """A `parallel_training` result: every step ran, losses and saved tensors within `tolerance` of serial."""
    assert result["steps"] == steps, result["options"]
    assert result["loss_error"] <= tolerance, (result["options"], result["loss_error"])
    assert result["weight_error"] <= tolerance, (result["options"], result["weight_error"])
