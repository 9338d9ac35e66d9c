"""Measured on a cluster of namespace hosts (`mpiparallel cluster`) with tbf-shaped links: real hosts, real links,
no emulation variable. Needs root. Three parts, each printing its figures beside a reference measured in the same
run:

    python scripts/bench_cluster.py                              # all three, links shaped to 800mbit
    python scripts/bench_cluster.py --part collectives --link-rate 400mbit --sizes 64K,1M,8M --json out.json

- collectives: all_reduce, reduce_scatter, all_gather on 2 hosts of 2 ranks, every algorithm "auto" may choose
  from (ring, recursive, Rabenseifner, hierarchical) timed at each size, beside the two-tier cost model's
  prediction from constants calibrated on these hosts, and auto's pick (scripts/bench_topology.py's job, run
  on the hosts instead of on emulated nodes).
- tp: `train -n 4 --dp 2 --tp 2` at the same mesh size twice: on 2 hosts of 2 (TP inside a host, DP across) and
  on 4 hosts of 1 (TP across too); the median step time of each, and each axis's bytes that left the host beside
  the formula's, as train prints them.
- heartbeat: the cost of the lost-host heartbeat on a healthy step: the same training launched with and without
  it on 2 hosts of 2, alternating, --rounds times each; median step times and their ratio.
- hsdp: ZeRO-3 over all 4 ranks of 2 hosts of 2 against hybrid sharding with a shard group per host
  (`--dp-shard 2`), at each of --hsdp-rates, alternating, --rounds times each: median step times, and per step the
  bytes that crossed the hosts' links — the veth counters (both hosts, both directions, ÷ steps) beside the
  ledger's inter-node bytes summed over the ranks and the formulas'.

Each part makes its clusters under names unique to this process and takes them down at the end, even on failure.
The machine is shared: read the figures as noisy.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from mpiparallel.jobs import hosts as multi_host  # noqa: E402
from mpiparallel.jobs import namespace_cluster  # noqa: E402

MODEL = ["--n-layer", "2", "--n-head", "4", "--n-embd", "256", "--seq-len", "128", "--batch-size", "8",
         "--vocab-size", "256", "--threads", "1"]
ACROSS = re.compile(r"(\w+) (\d+\.\d+) MB \(formula (\d+\.\d+) MB, ratio (\S+)\)")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--part", choices=["collectives", "tp", "heartbeat", "hsdp", "all"], default="all")
    parser.add_argument("--hsdp-rates", default="200mbit,800mbit,10gbit",
                        help="link rates (tc tbf) of the hsdp part, comma-separated")
    parser.add_argument("--link-rate", default="800mbit", help="tc tbf rate of every host's link")
    parser.add_argument("--sizes", default="64K,1M,8M", help="collective sizes in bytes (K, M suffixes)")
    parser.add_argument("--steps", type=int, default=8, help="training steps per run (the first is not timed)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of timing (collectives, heartbeat)")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    namespace_cluster.check_machine(shaping=True)
    environment = {name: value for name, value in os.environ.items()
                   if name not in ("MPIPARALLEL_RANKS_PER_NODE", "MPIPARALLEL_EMULATED_INTER_NODE")}
    environment.update(PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    report: dict = {"link_rate": args.link_rate}
    with tempfile.TemporaryDirectory(prefix="bench-cluster-") as scratch:
        environment[namespace_cluster.STATE_VARIABLE] = str(Path(scratch) / "clusters")
        os.environ[namespace_cluster.STATE_VARIABLE] = environment[namespace_cluster.STATE_VARIABLE]
        corpus = Path(scratch) / "corpus.txt"
        corpus.write_text((ROOT / "README.md").read_text() * 4)
        if args.part in ("collectives", "all"):
            report["collectives"] = collectives(args, environment, Path(scratch))
        if args.part in ("tp", "all"):
            report["tp"] = tensor_parallel_placement(args, environment, corpus)
        if args.part in ("heartbeat", "all"):
            report["heartbeat"] = heartbeat_cost(args, environment, corpus, Path(scratch))
        if args.part in ("hsdp", "all"):
            report["hsdp"] = hybrid_sharding(args, environment, corpus, Path(scratch))
    if args.json is not None:
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    return 0


_made = iter(range(1 << 16))


@contextmanager
def made_cluster(nodes: int, ranks_per_node: int, link_rate: str | None) -> Iterator[namespace_cluster.Cluster]:
    name = f"b{os.getpid():x}{next(_made):x}"
    try:
        yield namespace_cluster.up(name, nodes, ranks_per_node, link_rate)
    finally:
        namespace_cluster.down(name)


def mpiexec() -> str:
    beside = Path(sys.executable).parent / "mpiexec"
    return str(beside) if beside.exists() else "mpiexec"


# -- collectives ------------------------------------------------------------------------------------------------

def collectives(args: argparse.Namespace, environment: dict[str, str], scratch: Path) -> dict:
    import bench_topology

    results = scratch / "collectives.json"
    with made_cluster(2, 2, args.link_rate) as cluster:
        command = [mpiexec(), *cluster.mpiexec_options(), "-n", "4", sys.executable,
                   str(ROOT / "scripts" / "bench_topology.py"), "--worker", str(results), "--sizes", args.sizes,
                   "--rounds", str(args.rounds)]
        subprocess.run(command, env={**environment, "MPIPARALLEL_CALIBRATION": str(scratch / "calibration.json")},
                       check=True, timeout=3000)
    report = json.loads(results.read_text())
    print(f"## collectives: 4 ranks on 2 hosts of 2 (nodes {report['nodes']}, MPI's shared-memory nodes); each host's "
          f"link shaped to {args.link_rate} (tc tbf)")
    bench_topology.print_rows(report)
    return report


# -- TP inside a host against TP across hosts ---------------------------------------------------------------------

def train_on(cluster: namespace_cluster.Cluster, environment: dict[str, str], corpus: Path, steps: int,
             log: Path, extra: list[str] = ()) -> tuple[float, str]:
    """Median step time (steps after the first) of `train -n 4 --dp 2 --tp 2` on the cluster, and its output."""
    command = [sys.executable, "-m", "mpiparallel", "train", "-n", "4", "--hostfile", str(cluster.hostfile),
               "--dp", "2", "--tp", "2", *MODEL, "--steps", str(steps), "--data", str(corpus), "--log-json",
               str(log), *extra]
    finished = subprocess.run(command, env=environment, capture_output=True, text=True, timeout=3000)
    if finished.returncode != 0:
        raise SystemExit(f"{' '.join(command)} failed:\n{finished.stdout}\n{finished.stderr}")
    return step_time(log), finished.stdout


def step_time(log: Path) -> float:
    times = [json.loads(line)["time_s"] for line in log.read_text().splitlines()][1:]
    return statistics.median(times)


def tensor_parallel_placement(args: argparse.Namespace, environment: dict[str, str], corpus: Path) -> dict:
    print(f"## TP inside a host against TP across hosts: train -n 4 --dp 2 --tp 2, {' '.join(MODEL)}, links shaped "
          f"to {args.link_rate}; median step time of steps 2..{args.steps}")
    rows = {}
    with tempfile.TemporaryDirectory(prefix="bench-tp-") as logs:
        for label, nodes, per_node in (("TP inside (2 hosts of 2)", 2, 2), ("TP across (4 hosts of 1)", 4, 1)):
            with made_cluster(nodes, per_node, args.link_rate) as cluster:
                seconds, output = train_on(cluster, environment, corpus, args.steps, Path(logs) / f"{nodes}.jsonl")
            across = [line for line in output.splitlines() if line.startswith("rank 0 across nodes:")]
            axes = {axis: {"MB": float(mb), "formula_MB": float(formula), "ratio": ratio}
                    for axis, mb, formula, ratio in ACROSS.findall(across[0] if across else "")}
            rows[label] = {"step_s": seconds, "inter_node": axes}
            sent = "  ".join(f"{axis} {v['MB']:.3f} MB (formula {v['formula_MB']:.3f}, ratio {v['ratio']})"
                             for axis, v in axes.items())
            print(f"{label:<26} step {seconds * 1e3:8.1f} ms   rank 0's bytes across hosts per step: {sent}")
    inside, across = rows.values()
    print(f"TP across / TP inside: {across['step_s'] / inside['step_s']:.2f}x the step time")
    return rows


# -- the heartbeat's cost ------------------------------------------------------------------------------------------

def heartbeat_cost(args: argparse.Namespace, environment: dict[str, str], corpus: Path, scratch: Path) -> dict:
    """The same job by mpiexec directly, with the rank-side heartbeat on (sending to a socket here) and off."""
    print(f"## the heartbeat's cost on a healthy step: train -n 4 --dp 2 --tp 2 on 2 hosts of 2 (links unshaped), "
          f"{args.rounds} runs each way, alternating; median step time of steps 2..{args.steps} per run")
    times: dict[str, list[float]] = {"off": [], "on": []}
    with made_cluster(2, 2, None) as cluster:
        sink = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        sink.bind((cluster.bridge_address, 0))
        received = [0]
        threading.Thread(target=_drain, args=(sink, received), daemon=True).start()
        for round_index in range(args.rounds):
            for mode in ("off", "on") if round_index % 2 == 0 else ("on", "off"):
                folder = scratch / f"pids-{mode}-{round_index}"
                folder.mkdir()
                env = {**environment, "MPIPARALLEL_RANK_PIDS": str(folder)}
                if mode == "on":
                    env[multi_host.HEARTBEAT] = f"{cluster.bridge_address}:{sink.getsockname()[1]}"
                log = scratch / f"heartbeat-{mode}-{round_index}.jsonl"
                command = [mpiexec(), *cluster.mpiexec_options(), "-n", "4", sys.executable, "-m", "mpiparallel",
                           "train", "--dp", "2", "--tp", "2", *MODEL, "--steps", str(args.steps), "--data",
                           str(corpus), "--log-json", str(log)]
                subprocess.run(command, env=env, check=True, capture_output=True, timeout=3000)
                times[mode].append(step_time(log))
        sink.close()
    off, on = statistics.median(times["off"]), statistics.median(times["on"])
    print(f"heartbeat off: {off * 1e3:.1f} ms per step (runs: {', '.join(f'{t * 1e3:.1f}' for t in times['off'])})")
    print(f"heartbeat on:  {on * 1e3:.1f} ms per step (runs: {', '.join(f'{t * 1e3:.1f}' for t in times['on'])}); "
          f"{received[0]} heartbeats received")
    print(f"on / off: {on / off:.3f}")
    return {"off_s": times["off"], "on_s": times["on"], "ratio": on / off, "heartbeats": received[0]}


# -- ZeRO-3 across hosts against hybrid sharding ------------------------------------------------------------------

HSDP_RUNS = {"ZeRO-3 over 4": ["--zero", "3"], "HSDP 2 x 2": ["--zero", "3", "--dp-shard", "2"]}


def hybrid_sharding(args: argparse.Namespace, environment: dict[str, str], corpus: Path, scratch: Path) -> dict:
    print(f"## ZeRO-3 over all ranks against hybrid sharding (a shard group per host): train -n 4 --dp 4 "
          f"--microbatches 2, {' '.join(MODEL)} on 2 hosts of 2; median step time of steps 2..{args.steps}, "
          f"{args.rounds} runs each, alternating; bytes across hosts per step")
    report = {}
    for rate in args.hsdp_rates.split(","):
        rows: dict[str, dict] = {label: {"step_s": [], "veth_bytes": [], "ledger_bytes": [], "formula_bytes": []}
                                 for label in HSDP_RUNS}
        with made_cluster(2, 2, rate) as cluster:
            for round_index in range(args.rounds):
                order = list(HSDP_RUNS) if round_index % 2 == 0 else list(reversed(HSDP_RUNS))
                for label in order:
                    _hsdp_run(cluster, environment, corpus, args.steps, scratch, label, round_index, rows[label])
        print(f"links shaped to {rate}:")
        for label, row in rows.items():
            print(f"  {label:<14} step {statistics.median(row['step_s']) * 1e3:8.1f} ms   across hosts per step: "
                  f"veth {statistics.median(row['veth_bytes']) / 1e6:7.3f} MB, ledger "
                  f"{statistics.median(row['ledger_bytes']) / 1e6:7.3f} MB (formula "
                  f"{statistics.median(row['formula_bytes']) / 1e6:7.3f} MB)")
        zero3, hybrid = (statistics.median(rows[label]["step_s"]) for label in HSDP_RUNS)
        print(f"  HSDP / ZeRO-3: {hybrid / zero3:.2f}x the step time")
        report[rate] = rows
    return report


def _hsdp_run(cluster: namespace_cluster.Cluster, environment: dict[str, str], corpus: Path, steps: int,
              scratch: Path, label: str, round_index: int, row: dict) -> None:
    """One run of `label`; appends its median step time and its bytes across the hosts per step to `row`."""
    log = scratch / f"hsdp-{cluster.name}-{label.split()[0]}-{round_index}.jsonl"
    before = sum(namespace_cluster.link_bytes(host) for host in cluster.hosts)
    command = [sys.executable, "-m", "mpiparallel", "train", "-n", "4", "--hostfile", str(cluster.hostfile),
               "--dp", "4", "--microbatches", "2", *HSDP_RUNS[label], *MODEL, "--steps", str(steps), "--data",
               str(corpus), "--log-json", str(log)]
    finished = subprocess.run(command, env=environment, capture_output=True, text=True, timeout=3000)
    if finished.returncode != 0:
        raise SystemExit(f"{' '.join(command)} failed:\n{finished.stdout}\n{finished.stderr}")
    # every host's veth counts what its ranks sent and received: half of the sum is what crossed
    crossed = (sum(namespace_cluster.link_bytes(host) for host in cluster.hosts) - before) / 2
    records = [json.loads(line) for line in log.read_text().splitlines()]
    row["step_s"].append(step_time(log))
    row["veth_bytes"].append(crossed / len(records))  # setup's few bytes spread over the steps
    across = [(float(counted), float(formula)) for line in finished.stdout.splitlines() if " across nodes: " in line
              for _, counted, formula, _ in ACROSS.findall(line)]  # every rank's line, the last step
    row["ledger_bytes"].append(sum(counted for counted, _ in across) * 1e6)
    row["formula_bytes"].append(sum(formula for _, formula in across) * 1e6)


def _drain(sink: socket.socket, received: list[int]) -> None:
    while True:
        try:
            sink.recv(256)
        except OSError:
            return
        received[0] += 1


if __name__ == "__main__":
    sys.exit(main())
