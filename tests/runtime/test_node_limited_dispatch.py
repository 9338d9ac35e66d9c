"""`train --ep-dispatch hierarchical`, DeepSeek-V3's node-limited two-hop dispatch, against the flat all-to-allv: on
emulated nodes and on a 2-host namespace cluster, the ep axis's bytes (all, and across nodes) equal the formula of
mpiparallel/traffic.py on every rank, the two-hop dispatch sends fewer bytes across nodes when topk_group < nodes,
and both train the same losses. (Equality with the serial model: tests/runtime/test_composition.py's NODES_MATRIX.)
Each condition the dispatch needs and a run lacks is one clear error."""

from __future__ import annotations

import json
import os
import re
import sys

import pytest
from mpi_harness import run_with_timeout

NODES = {"MPIPARALLEL_RANKS_PER_NODE": "2"}
# 8 experts in 2 groups (one per node), top-3 inside 1 group: a token's 3 experts share one node
MODEL = ["--arch", "deepseek_v3", "--n-layer", "2", "--n-embd", "64", "--n-head", "4", "--experts", "8", "--top-k", "3",
         "--n-group", "2", "--topk-group", "1", "--seq-len", "16", "--batch-size", "8", "--steps", "2",
         "--dtype", "float64", "--threads", "1"]
AXIS = re.compile(r"(\w+) ([\d.]+) MB \(formula ([\d.]+) MB, ratio (\S+)\)")


def train(dispatch: str, tmp_path, env: dict | None = None, extra: tuple[str, ...] = ()) -> dict:
    """A 4-rank run (dp 4, ep 4): every rank's ep ratio (all bytes, across nodes), the losses, and the log's ep bytes
    summed over the steps (rank 0)."""
    tmp_path.mkdir(exist_ok=True)
    log = tmp_path / f"{dispatch}.jsonl"
    command = [sys.executable, "-m", "mpiparallel", "train", "-n", "4", *MODEL, "--dp", "4", "--ep", "4",
               "--ep-dispatch", dispatch, "--log-json", str(log), *extra]

    result = run_with_timeout(command, 300, env={**os.environ, **(env or {})})
    assert result.returncode == 0, result.stdout + result.stderr
    ratios = {"all": [], "across": []}
    for line in result.stdout.splitlines():
        if line.startswith("rank"):
            axes = {axis: ratio for axis, _, _, ratio in AXIS.findall(line)}
            ratios["across" if " across nodes: " in line else "all"].append(axes.get("ep"))
    records = [json.loads(line) for line in log.read_text().splitlines()]
    return {"ratios": ratios, "losses": [record["loss"] for record in records],
            "across": records[-1]["inter_node_bytes"]["ep"], "sent": records[-1]["comm_bytes"]["ep"]}


def check_against_flat(flat: dict, hierarchical: dict) -> None:
    for run in (flat, hierarchical):
        assert run["ratios"]["all"] == ["1.0000"] * 4 and run["ratios"]["across"] == ["1.0000"] * 4, run
    assert hierarchical["losses"] == pytest.approx(flat["losses"], rel=1e-12)
    assert 0 < hierarchical["across"] < flat["across"] / 2, (hierarchical, flat)


def test_the_two_hop_dispatch_sends_its_formulas_bytes_and_fewer_across_emulated_nodes(tmp_path):
    check_against_flat(train("flat", tmp_path, NODES), train("hierarchical", tmp_path, NODES))


def test_the_fp8_two_hop_dispatch_sends_e4m3_rows_and_their_scales_as_its_formula_says(tmp_path):
    bfloat16 = ["--compute-dtype", "bfloat16", "--n-embd", "128"]  # one 128-wide tile per row
    runs = {fp8: train("hierarchical", tmp_path / ("fp8" if fp8 else "bf16"), NODES,
                       (*bfloat16, *(["--fp8", "blockwise"] if fp8 else [])))
            for fp8 in (False, True)}
    for run in runs.values():
        assert run["ratios"]["all"] == ["1.0000"] * 4 and run["ratios"]["across"] == ["1.0000"] * 4, run
    assert 0 < runs[True]["across"] < runs[False]["across"], runs  # 128 + 4 bytes a row forward instead of 256


def test_the_two_hop_dispatch_across_two_namespace_hosts(cluster, tmp_path):
    made = cluster(nodes=2, ranks_per_node=2)
    hosts = ("--hostfile", str(made.hostfile))
    check_against_flat(train("flat", tmp_path, extra=hosts), train("hierarchical", tmp_path, extra=hosts))


TINY = ["--n-layer", "2", "--n-embd", "16", "--n-head", "2", "--seq-len", "8", "--batch-size", "4", "--steps", "1",
        "--threads", "1", "--experts", "4", "--top-k", "2", "--ep-dispatch", "hierarchical"]
REFUSED = [  # (ranks per emulated node, arguments, what the one error says)
    (None, ["--dp", "2", "--ep", "2"], "needs --arch deepseek_v3"),
    (None, ["--arch", "deepseek_v3", "--dp", "2"], "give --ep > 1"),
    (None, ["--arch", "deepseek_v3", "--dp", "2", "--ep", "2"], "each EP group of 2 ranks lies on one node"),
    ("1", ["--arch", "deepseek_v3", "--dp", "2", "--ep", "2"],
     "needs --n-group equal to the nodes of the EP group (2: each router group's experts on one node), got "
     "--n-group 1"),
]


@pytest.mark.parametrize("per_node, arguments, message", REFUSED)
def test_a_run_the_two_hop_dispatch_cannot_serve_gets_one_clear_error(tmp_path, per_node, arguments, message):

    env = {key: value for key, value in os.environ.items() if key != "MPIPARALLEL_RANKS_PER_NODE"}
    if per_node:
        env["MPIPARALLEL_RANKS_PER_NODE"] = per_node
    result = run_with_timeout([sys.executable, "-m", "mpiparallel", "train", "-n", "2", *TINY, *arguments], 60,
                              env=env, cwd=tmp_path)
    output = result.stdout + result.stderr
    assert result.returncode != 0 and output.count(message) == 1, output
    assert sum(line.startswith("Error") for line in output.splitlines()) == 1 and "Traceback" not in output, output
