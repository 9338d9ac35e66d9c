"""Hybrid sharding (`train --dp-shard N`, HSDP): ZeRO shards inside groups of N consecutive DP ranks, the dp/N
groups hold replicas summed with one all-reduce of each shard. Every stage equals the serial model in float64
(GPT-2, llama, Mixtral, DeepSeek-V3; with tp + SP, pp and cp beside it; gradient clipping counting each shard
once); the bytes on the shard groups and between the replicas equal the formulas; a checkpoint saved with one N
resumes with another, with none, and on a mesh without ZeRO, and each replica is written once; the planner times
and picks it; bad values are one clear error."""

from __future__ import annotations

import json
import re
import sys

import numpy as np
import pytest
from mpi_harness import assert_equals_serial, parallel_training, run_on_ranks, run_with_timeout, serial_training
from workers import checkpoint_checks

from collectives.cost_model import CostModel
from mpiparallel.checkpoints.sharded import MANIFEST, step_folder

COMMON = {"n_layer": 2, "n_head": 2, "n_embd": 32, "seq_len": 16, "batch_size": 8, "steps": 3, "dtype": "float64",
          "grad_clip": 0.5, "weight_decay": 0.1, "vocab_size": 257, "lr": 1e-2, "bucket_mb": 0.01}
GPT2 = [
    {"dp": 4, "zero": 1, "dp_shard": 2},
    {"dp": 4, "zero": 2, "dp_shard": 2, "microbatches": 2},
    {"dp": 4, "zero": 3, "dp_shard": 2, "microbatches": 2},
    {"dp": 4, "zero": 3, "dp_shard": 1},  # every rank its own group: nothing sharded, four replicas
    {"dp": 2, "tp": 2, "sp": True, "zero": 3, "dp_shard": 1},
    {"dp": 2, "pp": 2, "zero": 2, "dp_shard": 1, "microbatches": 2},
    {"dp": 2, "cp": 2, "zero": 3, "dp_shard": 1},  # the shard group is dp_shard × cp: the two CP ranks
]
LLAMA = [
    {"dp": 4, "zero": 3, "dp_shard": 2, "microbatches": 2},
    {"dp": 4, "zero": 1, "dp_shard": 2},
]


FAMILIES = {
    "gpt2": {},
    "llama": {"arch": "llama", "n_kv_head": 1},
    # Mixtral's experts (no EP: replicated over dp, sharded with the dense parameters); aux loss off, as in
    # test_composition (its token sets differ between the serial and a parallel run)
    "mixtral": {"arch": "llama", "n_kv_head": 1, "ffn_hidden": 24, "experts": 4, "top_k": 2, "moe_aux_coef": 0.0},
    # DeepSeek-V3: latent attention, a dense first block, DeepSeekMoE with a shared expert and the selection bias
    "deepseek_v3": {"arch": "deepseek_v3", "kv_lora_rank": 8, "qk_nope_head_dim": 4, "qk_rope_head_dim": 4,
                    "v_head_dim": 3, "ffn_hidden": 24, "experts": 4, "top_k": 2, "moe_ffn_hidden": 6,
                    "first_k_dense": 1, "moe_bias_rate": 0.01},
}
ONE_OF_EACH = [{"dp": 4, "zero": 3, "dp_shard": 2, "microbatches": 2}, {"dp": 4, "zero": 1, "dp_shard": 2},
               {"dp": 4, "zero": 2, "dp_shard": 2, "microbatches": 2}]
WITH_EXPERTS = [*ONE_OF_EACH,  # EP inside each shard group: the experts' states shard and replicate with it
                {"dp": 4, "ep": 2, "zero": 3, "dp_shard": 2, "microbatches": 2},
                {"dp": 4, "ep": 2, "zero": 1, "dp_shard": 2}]


@pytest.mark.parametrize("family, configs", [("gpt2", GPT2), ("llama", LLAMA + ONE_OF_EACH[2:]),
                                             ("mixtral", WITH_EXPERTS), ("deepseek_v3", WITH_EXPERTS)])
def test_every_zero_stage_with_hybrid_sharding_equals_serial(tmp_path, family, configs):
    common = COMMON | FAMILIES[family]
    reference = serial_training(common, tmp_path)
    for result in parallel_training(4, common, configs, reference, timeout=400):
        assert_equals_serial(result, common["steps"], 1e-9)


HSDP_MESHES = [
    "--dp 4 --zero 3 --dp-shard 2 --microbatches 2",
    "--dp 4 --zero 1 --dp-shard 2",
    "--pp 2 --dp 2 --zero 2 --dp-shard 1 --microbatches 2",
    "--cp 2 --dp 2 --zero 3 --dp-shard 1",
    "--experts 4 --top-k 2 --dp 4 --ep 2 --zero 3 --dp-shard 2",
]
ROW = r"(\w+) ([\d.]+) MB \(formula ([\d.]+) MB, ratio ([\d.]+)\)"


@pytest.mark.parametrize("options", HSDP_MESHES)
def test_the_shard_groups_and_the_replicas_send_what_their_formulas_say(options):
    """The ledger's bytes per axis beside `traffic`'s formulas: ZeRO's on the shard group, AR(G/N) on dp_replicate."""
    command = [sys.executable, "-m", "mpiparallel", "train", "-n", "4", "--n-layer", "2", "--n-embd", "32",
               "--n-head", "4", "--seq-len", "32", "--batch-size", "8", "--steps", "2", *options.split()]
    result = run_with_timeout(command, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    tail = result.stdout.split("beside the formula that predicts them")[1]
    lines = [line for line in tail.splitlines() if line.startswith("rank ")]
    assert len(lines) == 4, result.stdout
    for line in lines:
        axes = {axis: (float(counted), ratio) for axis, counted, _, ratio in re.findall(ROW, line)}
        shard_axis = "dp_shard_cp" if "--cp" in options else "dp_shard"
        assert axes["dp_replicate"][0] > 0 and axes["dp_replicate"][1] == "1.0000", line
        if "--dp-shard 1" not in options or "--cp" in options:  # a group of one rank sends nothing
            assert axes[shard_axis][0] > 0 and axes[shard_axis][1] == "1.0000", line
        assert all(ratio == "1.0000" for _, ratio in axes.values()), line


def test_show_mesh_and_the_memory_report_say_how_the_states_are_sharded():
    result = run_with_timeout([sys.executable, "-m", "mpiparallel", "train", "-n", "4", "--n-layer", "1",
                               "--n-embd", "32", "--n-head", "2", "--seq-len", "16", "--batch-size", "4", "--steps",
                               "1", "--zero", "3", "--dp-shard", "2", "--show-mesh", "--memory-report"], timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "hybrid sharding: ZeRO shards over dp_shard groups of 2 DP ranks (dp_shard = dp mod 2), 2 replicas " \
           "summed over dp_replicate" in result.stdout, result.stdout
    assert "(zero 3, dp 4, sharded over 2; " in result.stdout, result.stdout
    held = {}
    for line in result.stdout.splitlines():
        parts = line.split()
        if parts[:1] == ["model"] and parts[1] == "states":
            held[len(held)] = (float(parts[2]), float(parts[6]))
    assert held and all(abs(measured - theory) <= 0.01 * theory + 0.01 for measured, theory in held.values()), \
        result.stdout


@pytest.mark.parametrize("options, fragment", [
    (["--zero", "3", "--dp-shard", "3"], "--dp-shard 3 must divide the data-parallel size 4"),
    (["--dp-shard", "2"], "--dp-shard needs --zero 1, 2 or 3"),
    (["--zero", "1", "--dp-shard", "2", "--experts", "4", "--ep", "4"], "--dp-shard 2 must be a multiple of --ep 4"),
])
def test_bad_hybrid_sharding_settings_are_one_clear_error(options, fragment):
    result = run_with_timeout([sys.executable, "-m", "mpiparallel", "train", "-n", "4", "--n-layer", "1",
                               "--steps", "1", *options], timeout=120)
    assert result.returncode == 2, result.stdout + result.stderr
    assert fragment in result.stderr and result.stderr.count(fragment) == 1, result.stderr
    assert "Traceback" not in result.stderr


CHECKPOINTED = {"n_layer": 2, "n_head": 4, "n_embd": 16, "seq_len": 8, "batch_size": 4, "steps": 4,
                "dtype": "float64", "lr": 1e-2, "weight_decay": 0.1, "grad_clip": 0.5, "bucket_mb": 0.001,
                "vocab_size": 257}


def test_a_checkpoint_saved_with_one_shard_group_size_resumes_with_any_other(tmp_path):
    """Saved at dp 4, ZeRO-3 over groups of 2; resumed bit for bit there, and within 1e-9 over groups of 4 (plain
    ZeRO-3), of 1 (ZeRO-1, four replicas) and with tp 2 and no ZeRO. Every element written once: the second
    group's replica is not."""
    tokens = tmp_path / "tokens.npy"
    np.save(tokens, np.random.default_rng(0).integers(0, 257, 2000))
    meshes = [{"zero": 3, "dp_shard": 2}, {"zero": 3}, {"zero": 1, "dp_shard": 1}, {"tp": 2}]
    results = run_on_ranks(4, checkpoint_checks.resume_on_other_meshes, timeout=400,
                           common=CHECKPOINTED | {"data": str(tokens)}, saved_mesh=meshes[0], resumed_meshes=meshes,
                           directory=str(tmp_path), every=2)[0]
    for i, result in enumerate(results):
        assert result["steps"] == [3, 4] and result["tensors"], result
        assert result["bitwise"] or i > 0, result
        assert result["loss_error"] <= 1e-9 and result["weight_error"] <= 1e-9, result
    manifest = json.loads((step_folder(tmp_path / "saved" / "checkpoints", 2) / MANIFEST).read_text())
    assert manifest["mesh"]["dp_shard"] == 2 and manifest["mesh"]["zero"] == 3
    writers = set()
    for name, entry in manifest["tensors"].items():
        count = np.zeros(entry["shape"], int)
        for shard in entry["shards"]:
            count[tuple(slice(o, o + n) for o, n in zip(shard["offsets"], shard["sizes"], strict=True))] += 1
            writers.add(shard["file"])
        assert (count == 1).all(), name
    assert writers == {"rank-00000.safetensors", "rank-00001.safetensors"}  # the first group; its replica wrote none


def test_the_planner_shards_inside_a_node_and_picks_hsdp_where_the_link_between_nodes_is_slow():
    """Two nodes of 4: ZeRO-3 over 4 ranks holds twice the states of ZeRO-3 over 8, and its reductions send fewer
    bytes over the slow link between nodes — on a 1 GB/s network the planner times it faster and picks it; on a
    network as fast as NVLink the two are within 1 %."""
    from mpiparallel.planner import PRECISIONS, Choices, Cluster, Layout, Model, evaluate, plan

    model, precision = Model(8, 1024, 16, 512, 32000), PRECISIONS["float32"]
    slow = Cluster(gpus=8, gpus_per_node=4, inter=CostModel(alpha=10e-6, beta=1 / 1e9, gamma=1 / 1.5e12))
    over_all = evaluate(model, slow, precision, Layout(dp=8, zero=3), 8)
    hybrid = evaluate(model, slow, precision, Layout(dp=8, zero=3, dp_shard=4), 8)
    for kind in ("parameters", "gradients", "optimizer_state"):
        assert hybrid.memory_per_rank[0][kind] == pytest.approx(2 * over_all.memory_per_rank[0][kind])
    assert hybrid.step_s < over_all.step_s
    plans, _ = plan(model, slow, precision, Choices(8, dp=8, zero=3, microbatches=1, recompute="none"))
    assert plans[0].layout.dp_shard == 4, [p.layout.label() for p in plans]
    assert "z3/4" in plans[0].layout.label()
    fast = Cluster(gpus=8, gpus_per_node=4, inter=Cluster().intra)
    fast_gain = (evaluate(model, fast, precision, Layout(dp=8, zero=3), 8).step_s
                 / evaluate(model, fast, precision, Layout(dp=8, zero=3, dp_shard=4), 8).step_s)
    assert over_all.step_s / hybrid.step_s > 1.05 and fast_gain < 1.01, (over_all.step_s / hybrid.step_s, fast_gain)


MACHINE = {"alpha": 1e-5, "beta": 1.85e-10, "gamma": 1.4e-11, "matmul_flops": 4e10, "elementwise_bytes": 3.4e9,
           "ranks": 4, "cores": 2, "memory_bytes": 25e9, "compute_efficiency": 1.0}
"""A calibrated machine's file (`plan --calibrate`), with this machine's figures rounded."""


def _planned(machine: str, *options: str) -> tuple[float, str]:
    """The fastest layout's predicted step and label."""
    result = run_with_timeout([sys.executable, "-m", "mpiparallel", "plan", "--machine", machine, "--gpus", "4",
                               "--dp", "4", "--zero", "3", "--microbatches", "2", "--recompute", "none",
                               "--n-layer", "2", "--n-embd", "256", "--n-head", "4", "--seq-len", "128",
                               "--vocab-size", "256", "--batch-size", "8", "--precision", "float32", "--json",
                               *options], timeout=120)
    assert result.returncode == 0, result.stderr
    fastest = json.loads(result.stdout)["layouts"][0]
    return fastest["step_s"], fastest["label"]


def test_plan_cuts_a_calibrated_machine_into_hosts_with_a_shaped_link(tmp_path):
    """`plan --machine FILE --gpus-per-node 2 --inter-bandwidth B`: the namespace cluster's 2 hosts of 2 on this
    machine, each rank's share of a 200 Mbit/s link between them — ZeRO-3 over the 4 ranks is timed slower than
    on one host, and hybrid sharding with a group per host faster than it, which the search then picks
    (docs/clusters.md has both beside the measurement)."""
    machine = tmp_path / "machine.json"
    machine.write_text(json.dumps(MACHINE))
    one_host, _ = _planned(str(machine), "--dp-shard", "4")
    hosts = ("--gpus-per-node", "2", "--inter-bandwidth", "0.0125", "--inter-latency", "50")
    zero3, label = _planned(str(machine), *hosts, "--dp-shard", "4")
    hybrid, picked = _planned(str(machine), *hosts)  # searched: the planner picks a shard group per host
    assert zero3 > 2 * one_host and hybrid < 0.75 * zero3, (one_host, zero3, hybrid)
    assert " z3 " in label and " z3/2 " in picked, (label, picked)
