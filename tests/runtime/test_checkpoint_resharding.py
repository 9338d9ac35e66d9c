"""Training checkpoints across meshes: saved on one mesh, resumed bit for bit on the same mesh and within 1e-9
(float64) on others; replicas written once; a run killed while saving leaves the previous checkpoint in charge."""

from __future__ import annotations

import json
import sys

import numpy as np
import pytest
from mpi_harness import RankFailure, run_on_ranks, run_with_timeout
from workers import checkpoint_checks

from mpiparallel.axes.tensor_parallel import tensor_parallel_placement
from mpiparallel.checkpoints.sharded import MANIFEST, TrainingCheckpoint, latest_training_checkpoint, step_folder

TINY = {"n_head": 4, "n_embd": 16, "seq_len": 8, "batch_size": 4, "steps": 4, "dtype": "float64", "lr": 1e-2,
        "weight_decay": 0.1, "grad_clip": 0.5, "bucket_mb": 0.001}


@pytest.fixture
def tokens(tmp_path) -> str:
    """Random token ids over a vocabulary of 257, which tp 2 and tp 4 both pad."""
    path = tmp_path / "tokens.npy"
    np.save(path, np.random.default_rng(0).integers(0, 257, 2000))
    return str(path)


def assert_resumed(results: list[dict], every: int, steps: int) -> None:
    """The first mesh is the one that saved: bit for bit; every other within 1e-9."""
    for i, result in enumerate(results):
        assert result["steps"] == list(range(every + 1, steps + 1)), result
        assert result["tensors"], result
        if i == 0:
            assert result["bitwise"], result
        assert result["loss_error"] <= 1e-9 and result["weight_error"] <= 1e-9, result


def coverage(entry: dict) -> np.ndarray:
    """How many shards hold each element of a manifest entry's tensor."""
    count = np.zeros(entry["shape"], int)
    for shard in entry["shards"]:
        count[tuple(slice(o, o + n) for o, n in zip(shard["offsets"], shard["sizes"], strict=True))] += 1
    return count


def files_of(entry: dict) -> set[str]:
    return {shard["file"] for shard in entry["shards"]}


def test_dp2_tp2_zero1_resumes_on_tp4_pp2_zbv_and_dp4_zero3(tmp_path, tokens):
    common = TINY | {"n_layer": 4, "vocab_size": 257, "data": tokens}
    meshes = [{"tp": 2, "zero": 1}, {"tp": 4}, {"pp": 2, "schedule": "zbv"}, {"zero": 3}]
    results = run_on_ranks(4, checkpoint_checks.resume_on_other_meshes, timeout=300, common=common,
                           saved_mesh=meshes[0], resumed_meshes=meshes, directory=str(tmp_path), every=2)[0]
    assert_resumed(results, every=2, steps=4)

    folder = step_folder(tmp_path / "saved" / "checkpoints", 2)
    manifest = json.loads((folder / MANIFEST).read_text())
    assert manifest["step"] == 2 and manifest["data_position"]["next_step"] == 2
    assert {key: manifest["mesh"][key] for key in ("world_size", "dp", "tp", "pp", "zero")} == {
        "world_size": 4, "dp": 2, "tp": 2, "pp": 1, "zero": 1}
    ranks = [f"rank-0000{r}.safetensors" for r in range(4)]
    assert sorted(path.name for path in folder.iterdir()) == [MANIFEST, *ranks]  # every rank wrote, nothing else
    tensors = manifest["tensors"]
    assert len(tensors) == 3 * (2 + 4 * 12 + 2)  # parameters and both AdamW moments
    for name, entry in tensors.items():
        assert (coverage(entry) == 1).all(), name  # every element written once: replicas too
    tp_rank_0, tp_rank_1 = {"rank-00000.safetensors", "rank-00002.safetensors"}, {"rank-00001.safetensors",
                                                                                 "rank-00003.safetensors"}
    for name, entry in tensors.items():
        if tensor_parallel_placement(name.split("/")[-1]):  # cut over tp: both TP ranks wrote their columns/rows
            assert files_of(entry) & tp_rank_0 and files_of(entry) & tp_rank_1, name
        else:  # replicated over tp: only TP rank 0 wrote it
            assert files_of(entry) <= tp_rank_0, name

    info = run_with_timeout([sys.executable, "-m", "mpiparallel", "checkpoint", "info",
                             str(tmp_path / "saved" / "checkpoints")], timeout=60)
    assert info.returncode == 0, info.stderr
    assert "step-00000004: step 4" in info.stdout and "4 ranks: dp 2 × tp 2 × pp 1 × cp 1" in info.stdout
    assert "zero 1" in info.stdout
    wte = next(line for line in info.stdout.splitlines() if line.split()[:1] == ["transformer.wte.weight"])
    assert wte.split()[1:3] == ["float64", "257×16"] and "[0:129, 0:16] [129:257, 0:16]" in wte


def test_a_pipeline_run_saved_on_pp2_1f1b_resumes_on_tp2_sp_and_on_cp2_tp2(tmp_path, tokens):
    """The tied embedding lives on both pipeline ends (written once, by the first); sequence and context
    parallelism hold it replicated."""
    common = TINY | {"n_layer": 2, "vocab_size": 257, "data": tokens}
    meshes = [{"pp": 2, "zero": 1}, {"tp": 2, "sp": True, "zero": 1}, {"cp": 2, "tp": 2}]
    results = run_on_ranks(4, checkpoint_checks.resume_on_other_meshes, timeout=300, common=common,
                           saved_mesh=meshes[0], resumed_meshes=meshes, directory=str(tmp_path), every=2)[0]
    assert_resumed(results, every=2, steps=4)
    tensors = json.loads((step_folder(tmp_path / "saved" / "checkpoints", 2) / MANIFEST).read_text())["tensors"]
    for name in ("transformer.wte.weight", "exp_avg/transformer.wte.weight"):  # pipeline rank 0: world ranks 0, 1
        assert (coverage(tensors[name]) == 1).all()
        assert files_of(tensors[name]) <= {"rank-00000.safetensors", "rank-00001.safetensors"}
    assert files_of(tensors["transformer.ln_f.weight"]) <= {"rank-00002.safetensors", "rank-00003.safetensors"}


def test_a_llama_saved_on_tp4_with_replicated_kv_heads_resumes_on_pp2_cp2_and_dp4_zero3(tmp_path, tokens):
    """GQA with 2 KV heads: tp 4 holds each on two ranks (written once), the other meshes hold them whole."""
    common = TINY | {"n_layer": 2, "vocab_size": 257, "data": tokens, "arch": "llama", "n_kv_head": 2,
                     "ffn_hidden": 24}
    meshes = [{"tp": 4, "sp": True}, {"pp": 2, "cp": 2, "schedule": "1f1b"}, {"zero": 3},
              {"tp": 2, "cp": 2, "cp_attention": "ulysses"}]
    results = run_on_ranks(4, checkpoint_checks.resume_on_other_meshes, timeout=300, common=common,
                           saved_mesh=meshes[0], resumed_meshes=meshes, directory=str(tmp_path), every=2)[0]
    assert_resumed(results, every=2, steps=4)
    manifest = json.loads((step_folder(tmp_path / "saved" / "checkpoints", 2) / MANIFEST).read_text())
    key = manifest["tensors"]["transformer.h.0.attn.k_proj.weight"]
    assert coverage(key).min() == coverage(key).max() == 1  # each KV head written once, by one of its two holders
    assert len(key["shards"]) == 2


def test_moe_saved_on_ep2_resumes_on_ep4_and_ep1_with_its_expert_biases(tmp_path, tokens):
    common = TINY | {"n_layer": 2, "vocab_size": 257, "data": tokens, "experts": 4, "top_k": 2,
                     "moe_bias_rate": 0.01}
    meshes = [{"ep": 2, "zero": 1}, {"ep": 4}, {"ep": 1, "zero": 1}]
    results = run_on_ranks(4, checkpoint_checks.resume_on_other_meshes, timeout=300, common=common,
                           saved_mesh=meshes[0], resumed_meshes=meshes, directory=str(tmp_path), every=2)[0]
    assert_resumed(results, every=2, steps=4)

    saved = TrainingCheckpoint(step_folder(tmp_path / "saved" / "checkpoints", 2))
    assert saved.manifest["mesh"]["ep"] == 2
    for layer in range(2):
        bias = saved.tensors[f"transformer.h.{layer}.mlp.router.expert_bias"]
        assert bias["shape"] == [4] and (coverage(bias) == 1).all()
        assert np.abs(saved.read_box(f"transformer.h.{layer}.mlp.router.expert_bias", [0], [4])).max() > 0
        for expert in range(4):
            entry = saved.tensors[f"exp_avg/transformer.h.{layer}.mlp.experts.{expert}.c_fc.weight"]
            assert (coverage(entry) == 1).all()
            # expert e lives on EP rank e // 2: world ranks (dp) e // 2 and e // 2 + 2, ZeRO-cut between them
            assert files_of(entry) <= {f"rank-0000{expert // 2}.safetensors", f"rank-0000{expert // 2 + 2}.safetensors"}


def test_a_run_killed_while_saving_resumes_from_the_previous_checkpoint(tmp_path, tokens):
    options = TINY | {"n_layer": 2, "vocab_size": 257, "data": tokens, "steps": 6, "tp": 2, "checkpoint_every": 2}
    with pytest.raises(RankFailure):
        run_on_ranks(2, checkpoint_checks.crash_while_saving, timeout=120, options=options, directory=str(tmp_path),
                     crash_step=4)
    checkpoints = tmp_path / "checkpoints"
    interrupted = step_folder(checkpoints, 4)
    assert sorted(path.name for path in interrupted.iterdir()) == ["rank-00000.safetensors", "rank-00001.safetensors"]
    assert latest_training_checkpoint(checkpoints) == step_folder(checkpoints, 2)
    crashed_log = [json.loads(line) for line in (tmp_path / "log.jsonl").read_text().splitlines()]
    assert [record["step"] for record in crashed_log] == [1, 2, 3, 4]

    arguments = [f"--{key.replace('_', '-')}={value}" for key, value in options.items() if key != "tp"]
    resumed = run_with_timeout([sys.executable, "-m", "mpiparallel", "train", "-n", "2", "--tp", "2", *arguments,
                                "--checkpoint-dir", str(checkpoints), "--resume", "--log-json",
                                str(tmp_path / "resumed.jsonl")], timeout=120)
    assert resumed.returncode == 0, resumed.stderr
    log = [json.loads(line) for line in (tmp_path / "resumed.jsonl").read_text().splitlines()]
    assert [record["step"] for record in log] == [3, 4, 5, 6]
    assert [record["loss"] for record in log[:2]] == [record["loss"] for record in crashed_log[2:]]
    assert (interrupted / MANIFEST).is_file()  # saved again, completely, by the resumed run
    assert latest_training_checkpoint(checkpoints) == step_folder(checkpoints, 6)
