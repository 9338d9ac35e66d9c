"""`train` ends with each rank's bytes per mesh axis beside the formulas of mpiparallel/traffic.py: on every mesh
below, every axis that sent anything has a formula, and it equals the ledger (ep's evaluated on the rows the router
sent: `mpiparallel.axes.expert_parallel.ExpertTraffic`)."""

from __future__ import annotations

import re
import sys

import pytest
from mpi_harness import run_with_timeout

from collectives.cost_model import predict
from mpiparallel.traffic import BYTES_ONLY

TINY = ["--n-layer", "2", "--n-embd", "32", "--n-head", "4", "--seq-len", "32", "--batch-size", "8", "--steps", "2"]
MESHES = [
    (2, "--dp 2 --zero 3 --microbatches 2"),
    (2, "--dp 2 --zero 2 --microbatches 2"),
    (2, "--tp 2 --sp --recompute full"),
    (2, "--pp 2 --schedule zb --microbatches 4"),
    (2, "--cp 2 --cp-attention ulysses"),
    (4, "--dp 2 --tp 2 --zero 1"),
    (4, "--tp 2 --sp --pp 2 --n-layer 3 --microbatches 2"),
    (4, "--dp 4 --zero 3 --bucket-mb 0.01"),
    (4, "--cp 2 --tp 2 --cp-attention all-gather"),
    (4, "--pp 2 --schedule zbv --n-layer 4 --dp 2"),
    (4, "--pp 2 --dp 2 --zero 2 --microbatches 2"),
    (4, "--pp 2 --dp 2 --zero 3 --microbatches 2 --bucket-mb 0.01"),
    (4, "--experts 4 --top-k 2 --tp 2 --sp --dp 2 --ep 2"),
    # the llama family: GQA's K/V over cp (n_kv of n_head), Ulysses replicating KV heads, KV heads past tp
    (2, "--arch llama --n-kv-head 2 --cp 2 --recompute full"),
    (2, "--arch llama --n-kv-head 1 --cp 2 --cp-attention ulysses"),
    (4, "--arch llama --n-kv-head 1 --tp 4 --sp --microbatches 2"),
    (4, "--arch llama --n-kv-head 2 --tp 2 --cp 2 --cp-attention all-gather --pp 1"),
    (4, "--arch llama --n-kv-head 2 --pp 2 --dp 2 --experts 4 --ep 2 --top-k 2"),
    # DeepSeek-V3: a dense first block beside MoE ones over tp, the compressed latent gathered over cp,
    # the replicated down-projections' partial gradients summed over tp
    (4, "--arch deepseek_v3 --n-layer 3 --experts 4 --top-k 2 --first-k-dense 1 --q-lora-rank 8 --tp 2 --cp 2 "
        "--cp-attention all-gather --recompute full"),
    (2, "--arch deepseek_v3 --experts 4 --top-k 2 --first-k-dense 1 --tp 2 --sp"),
    (2, "--arch deepseek_v3 --experts 4 --top-k 2 --mtp-depth 2 --tp 2 --recompute full"),  # MTP on the head rank
    (2, "--arch deepseek_v3 --experts 4 --top-k 2 --mtp-depth 1 --pp 2"),  # wte's gradient between the end stages
    # MTP on SP's slices and CP's chunks: its blocks, its replicated norms' partial gradients, the targets' gather
    (4, "--arch deepseek_v3 --experts 4 --top-k 2 --mtp-depth 2 --tp 2 --sp --cp 2 --cp-attention ring"),
    (4, "--arch deepseek_v3 --experts 4 --top-k 2 --tp 2 --cp 2 --cp-attention ulysses --recompute full"),
    (4, "--arch deepseek_v3 --cp 4 --cp-attention ring"),
    # the sequence-wise loss on split sequences: its expert counts summed over cp and, under SP, tp
    (4, "--arch deepseek_v3 --experts 4 --top-k 2 --moe-seq-aux-coef 0.1 --tp 2 --sp --cp 2 --recompute full"),
    # packed documents and the global aux loss (its counting pass's bytes are logged apart)
    (2, "--attention document --cp 2 --experts 4 --top-k 2 --moe-aux-scope global --microbatches 2"),
    (2, "--experts 4 --top-k 2 --moe-aux-scope global --zero 3 --microbatches 2"),  # the pass's gathers apart
    # ep: the rows the routers sent, with MTP's MoE blocks and full recomputation's second dispatch; FP8 dispatch
    (4, "--arch deepseek_v3 --experts 4 --top-k 2 --mtp-depth 1 --dp 4 --ep 4 --recompute full"),
    (2, "--arch llama --experts 4 --top-k 2 --dp 2 --ep 2 --compute-dtype bfloat16 --fp8 blockwise"),
]
LINE = re.compile(r"^rank (\d+): (.*)$")
AXIS = re.compile(r"(\w+) ([\d.]+) MB \((?:formula ([\d.]+) MB, ratio ([\d.]+)|no formula[^)]*)\)")


def traffic_lines(ranks: int, options: str) -> dict[int, list[tuple[str, str | None]]]:
    command = [sys.executable, "-m", "mpiparallel", "train", "-n", str(ranks), *TINY, *options.split()]
    result = run_with_timeout(command, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    tail = result.stdout.split("beside the formula that predicts them")[1]
    rows = {}
    for line in tail.splitlines():
        if match := LINE.match(line):
            rows[int(match[1])] = [(axis, ratio) for axis, _, _, ratio in AXIS.findall(match[2])]
    assert sorted(rows) == list(range(ranks)), result.stdout
    return rows


@pytest.mark.parametrize(("ranks", "options"), MESHES)
def test_every_axis_sends_what_its_formula_predicts(ranks, options):
    for rank, axes in traffic_lines(ranks, options).items():
        assert axes, f"rank {rank} reported no traffic"
        for axis, ratio in axes:
            assert ratio == "1.0000", f"rank {rank} axis {axis}: ratio {ratio} ({options})"


def test_a_collectives_bytes_are_its_cost_formulas_beta_term():
    assert predict(BYTES_ONLY, "all_reduce", "ring", 1000, 4) == 1500  # 2(n−1)/n·S
    assert predict(BYTES_ONLY, "all_reduce", "recursive_doubling", 1000, 4) == 2000  # log2(n)·S
    assert predict(BYTES_ONLY, "all_gather", "ring", 1000, 4) == 750  # (n−1)/n of the gathered size
