"""`train --elastic`: a run that survives the loss of ranks or hosts, on whatever is left.

The self-launching parent starts the job (`launch.run_job`) and, when it ends having lost ranks (one machine: the
ranks that died without a word; a cluster: every rank of a lost host), relaunches it:

1. the mesh for the survivors keeps the model axes tp·cp·pp (and ep, carved from dp) and shrinks dp to the
   largest size that fits, divides the global batch (which is kept: each DP rank takes more rows, so the loss
   curve continues as one run) and is a multiple of ep;
2. the new job resumes from the newest complete checkpoint of --checkpoint-dir (`--resume-from` its folder),
   resharded on load onto the new mesh; the steps after that checkpoint are redone. A save interrupted by the
   loss has no manifest, so the previous checkpoint is used;
3. one line says what was lost, at which step, the new mesh and the steps redone; --log-json gets
   {"event": "restart", "step", "lost", "mesh"}.

It gives up, with one line and a non-zero exit, when fewer than --min-ranks would be left, no dp fits, or
--max-restarts relaunches are used up. A job that ends for any other reason (an error, a preemption, Ctrl-C)
ends the run with its status: those are not losses.

On one machine the relaunch starts ranks in the same slots (the lost rank's slot is given up). On a cluster of
`mpiparallel cluster` (`--hostfile` of `cluster up`), the relaunch starts on the hosts left: a hostfile without
the lost hosts, written in the parent's own folder, in place of the cluster's. Other hostfiles are refused (no
heartbeat tells which host was lost).
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path
from typing import Any, NoReturn

import click

from ..checkpoint_upkeep import mesh_words
from ..cluster import cluster_of_hostfile
from ..train.reports import PROGRESS
from ..training_checkpoint import TrainingCheckpoint, latest_training_checkpoint
from . import hosts as multi_host
from . import launch


def check_elastic(options: dict[str, Any], ranks: int | None, hostfile: Path | None) -> None:
    """What --elastic needs, checked before any rank starts."""
    if not options["checkpoint_dir"] or not options["checkpoint_every"]:
        raise click.UsageError("--elastic needs --checkpoint-dir and --checkpoint-every (it resumes the survivors "
                               "from the newest checkpoint)")
    if hostfile is not None and cluster_of_hostfile(hostfile) is None:
        raise click.UsageError("--elastic with --hostfile needs a hostfile of `mpiparallel cluster up` (whose lost "
                               "hosts the heartbeats name), or one machine (-n N)")
    if ranks is None:
        raise click.UsageError("--elastic needs -n N: the parent that relaunches the ranks is the one -n starts")
    if ranks < options["min_ranks"]:
        raise click.UsageError(f"-n {ranks} is fewer than --min-ranks {options['min_ranks']}")


def survivor_dp(survivors: int, axes: dict[str, int], batch_size: int, microbatches: int) -> int | None:
    """The largest dp for `survivors` ranks with the model axes kept: dp·tp·cp·pp ≤ survivors, dp divides the
    global batch into DP shares that split into `microbatches`, and ep divides dp. None if none fits."""
    model = axes["tp"] * axes["cp"] * axes["pp"]
    for dp in range(survivors // model, 0, -1):
        if batch_size % dp == 0 and (batch_size // dp) % microbatches == 0 and dp % axes["ep"] == 0:
            return dp
    return None


def run_elastic(ranks: int, argv: list[str], options: dict[str, Any], axes: dict[str, Any],
                hostfile: Path | None = None) -> NoReturn:
    """Run the job, relaunching it on the survivors after each loss; exit with the final job's status."""
    model = axes["tp"] * axes["cp"] * axes["pp"]
    axes = {**axes, "dp": axes["dp"] or ranks // model}
    restarts = redone = 0
    extra: list[str] = []
    cluster = cluster_of_hostfile(hostfile) if hostfile is not None else None
    hosts = multi_host.read_hostfile(hostfile) if cluster is not None else []
    placement = cluster.mpiexec_options() if cluster is not None else []
    with tempfile.TemporaryDirectory(prefix="mpiparallel-elastic-") as folder:
        progress = Path(folder) / "progress"
        while True:
            outcome = launch.run_job(ranks, [*argv, *extra], placement, cluster, environ={PROGRESS: str(progress)})
            lost = len(outcome.lost_ranks) + sum(len(host.ranks) for host in outcome.lost)
            if outcome.status == 0 or lost == 0:
                if outcome.status == 0 and restarts:
                    say(f"elastic: finished after {restarts} restart{'s' if restarts > 1 else ''}, {redone} steps "
                        f"redone")
                raise SystemExit(outcome.status)
            reached = int(progress.read_text()) if progress.is_file() else 0
            latest = latest_training_checkpoint(options["checkpoint_dir"])
            resumed_at = TrainingCheckpoint(latest).step if latest is not None else 0
            survivors = ranks - lost
            what = _what_was_lost(outcome, reached)
            if resumed_at >= options["steps"]:  # lost after the last step's checkpoint: nothing is left to train
                say(f"elastic: {what}, after the checkpoint of the last step ({resumed_at}): the training is complete"
                    + (f"; --save did not run on every rank: `mpiparallel checkpoint export {latest} --out "
                       f"{options['save']}` writes it" if options.get("save") else ""))
                raise SystemExit(0 if not options.get("save") else 1)
            if restarts >= options["max_restarts"]:
                give_up(f"{what}; --max-restarts {options['max_restarts']} used up")
            dp = survivor_dp(survivors, axes, options["batch_size"], options["microbatches"] or axes["pp"])
            if survivors < options["min_ranks"] or dp is None or dp * model < options["min_ranks"]:
                give_up(f"{what}; {survivors} rank{'s' if survivors != 1 else ''} left, and "
                        + (f"--min-ranks is {options['min_ranks']}" if dp is not None or survivors <
                           options["min_ranks"] else f"no dp fits them with tp·cp·pp {model} and batch "
                           f"{options['batch_size']}"))
            axes, ranks = {**axes, "dp": dp}, dp * model
            restarts, redone = restarts + 1, redone + reached - resumed_at
            mesh = {"world_size": ranks, **axes, "zero": options["zero"]}
            say(f"elastic: {what}; restart {restarts}/{options['max_restarts']} on {mesh_words(mesh)} (global batch "
                f"{options['batch_size']} kept), from " + (f"the checkpoint of step {resumed_at}" if latest else
                                                           "step 0 (no checkpoint yet)") +
                f": {reached - resumed_at} steps redone")
            _log_restart(options["log_json"], reached, outcome, mesh)
            extra = ["-n", str(ranks), "--dp", str(dp), *(["--resume-from", str(latest)] if latest else [])]
            progress.unlink(missing_ok=True)
            if cluster is not None:
                hosts = [host for host in hosts if host.name not in {lost.host for lost in outcome.lost}]
                placement = _without_lost_hosts(placement, hosts, Path(folder) / f"hostfile-{restarts}")


def _without_lost_hosts(placement: list[str], hosts: list[multi_host.Host], path: Path) -> list[str]:
    """The cluster's mpiexec options with its hostfile replaced by one of `hosts` (the hosts left)."""
    path.write_text("".join(f"{host.name}:{host.slots}\n" for host in hosts))
    at = placement.index("-f")
    return [*placement[:at + 1], str(path), *placement[at + 2:]]


def _what_was_lost(outcome: launch.JobOutcome, reached: int) -> str:
    hosts = [f"host {host.host} (ranks {', '.join(map(str, host.ranks))})" for host in outcome.lost]
    ranks = [f"rank {rank}" for rank in outcome.lost_ranks]
    return f"lost {' and '.join(hosts + ranks)} after step {reached}"


def _log_restart(log_json: str | None, step: int, outcome: launch.JobOutcome, mesh: dict[str, Any]) -> None:
    if log_json is None:
        return
    lost = [*({"host": host.host, "ranks": list(host.ranks)} for host in outcome.lost),
            *({"rank": rank} for rank in outcome.lost_ranks)]
    with open(log_json, "a", encoding="utf-8") as log:
        log.write(json.dumps({"event": "restart", "step": step, "lost": lost, "mesh": mesh}) + "\n")


def say(text: str) -> None:
    print(f"mpiparallel: {text}", file=sys.stderr, flush=True)


def give_up(text: str) -> NoReturn:
    say(f"elastic: {text}: giving up")
    raise SystemExit(1)
