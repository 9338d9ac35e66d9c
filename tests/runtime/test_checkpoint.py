"""Hugging Face checkpoints round-trip bit-exactly, load in transformers, and fail with clear messages; training
checkpoints' boxes, resharding on read, atomic saves, manifest checks and `checkpoint info`."""

from __future__ import annotations

import itertools
import json
import math
import os
import subprocess
import sys

import numpy as np
import pytest
import safetensors
import safetensors.numpy
from mpi4py import MPI
from mpi_harness import run_with_timeout
from optional import missing, optional_module

from collectives import Communicator
from models.parameter import Sharded, shard_tensor
from models.transformer import GPTConfig, Transformer, parameter_shapes
from mpiparallel.checkpoints.hugging_face import gpt2_config_json, load_pretrained, save_pretrained
from mpiparallel.checkpoints.sharded import (
    Piece,
    TrainingCheckpoint,
    build_manifest,
    find_checkpoint,
    flat_range_boxes,
    latest_training_checkpoint,
    parts,
    publish_manifest,
    save,
    step_folder,
    write_rank_file,
)
from mpiparallel.errors import ConfigError

CONFIG = GPTConfig(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=4)


def tiny_model(dtype=np.float32, seed: int = 3) -> Transformer:
    return randomized_everywhere(Transformer(CONFIG, seed=seed, dtype=dtype), seed)


def saved_model(tmp_path, dtype=np.float32):
    directory = tmp_path / "model"
    model = tiny_model(dtype)
    save_pretrained(directory, CONFIG, model.state_dict())
    return directory, model


def randomized_everywhere(model: Transformer, seed: int) -> Transformer:
    """`model` with every tensor drawn at random, each differently: a fresh model has every LayerNorm weight 1
    and every bias 0, so a swapped or mis-mapped LayerNorm parameter or bias would go unseen (the same logits
    in transformers, the same tensors after a save and load)."""
    rng = np.random.default_rng(seed)
    for param in model.parameters():
        values = rng.standard_normal(param.data.shape)
        if param.name.endswith(".bias"):
            values *= 0.3
        elif param.data.ndim == 1:  # LayerNorm weights: around 1, but each its own
            values = 1 + 0.3 * values
        else:
            values *= 0.1
        param.data[...] = values
    return model


def leftovers(directory) -> list[str]:
    return [name for name in os.listdir(directory) if ".tmp-" in name or ".old-" in name]


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_save_then_load_round_trips_bit_exactly(tmp_path, dtype):
    directory, model = saved_model(tmp_path, dtype)
    config, tensors, raw = load_pretrained(directory)
    assert config == CONFIG
    assert list(tensors) == list(parameter_shapes(CONFIG))
    for name, value in model.state_dict().items():
        assert tensors[name].dtype == dtype
        np.testing.assert_array_equal(tensors[name], value)
    assert raw["model_type"] == "gpt2" and raw["architectures"] == ["GPT2LMHeadModel"]
    assert raw["torch_dtype"] == np.dtype(dtype).name
    assert leftovers(tmp_path) == []


def test_files_follow_gpt2lmheadmodel_conventions(tmp_path):
    directory, _ = saved_model(tmp_path)
    with safetensors.safe_open(str(directory / "model.safetensors"), framework="np") as weights:
        assert weights.metadata() == {"format": "pt"}
        names = set(weights.keys())
        assert "lm_head.weight" not in names and "transformer.lm_head.weight" not in names
        assert weights.get_tensor("transformer.h.0.attn.c_attn.weight").shape == (32, 96)
    raw = json.loads((directory / "config.json").read_text())
    assert raw["n_ctx"] == raw["n_positions"] == 16
    assert raw["activation_function"] == "gelu_new" and raw["layer_norm_epsilon"] == 1e-5
    assert raw["tie_word_embeddings"] is True and raw["n_inner"] is None
    assert raw["eos_token_id"] == raw["bos_token_id"] == 63


def test_eos_token_is_gpt2s_for_its_vocabulary_and_the_last_id_otherwise():
    assert gpt2_config_json(GPTConfig(vocab_size=50257), np.float32)["eos_token_id"] == 50256
    assert gpt2_config_json(GPTConfig(vocab_size=50304), np.float32)["eos_token_id"] == 50256
    assert gpt2_config_json(GPTConfig(vocab_size=256), np.float32)["eos_token_id"] == 255


def test_extra_config_adds_keys_but_may_not_redefine_ours(tmp_path):
    directory = tmp_path / "noted"  # (MoE keys are read as the model's shape now: a dense model may not claim them)
    save_pretrained(directory, CONFIG, tiny_model().state_dict(), extra_config={"notes": "mpiparallel test"})
    assert load_pretrained(directory)[2]["notes"] == "mpiparallel test"
    with pytest.raises(ValueError, match="n_embd"):
        save_pretrained(tmp_path / "bad", CONFIG, tiny_model().state_dict(), extra_config={"n_embd": 8})
    assert not (tmp_path / "bad").exists() and leftovers(tmp_path) == []


def test_names_without_prefix_lm_head_and_attention_buffers_are_accepted(tmp_path):
    """The layout of the original GPT-2 release: no `transformer.` prefix, plus buffers we do not use."""
    directory, model = saved_model(tmp_path)
    tensors = {name.removeprefix("transformer."): value for name, value in model.state_dict().items()}
    tensors["lm_head.weight"] = tensors["wte.weight"].copy()
    for i in range(CONFIG.n_layer):
        tensors[f"h.{i}.attn.bias"] = np.tril(np.ones((1, 1, 16, 16), np.float32))
        tensors[f"h.{i}.attn.masked_bias"] = np.array(-1e4, np.float32)
    safetensors.numpy.save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    _, loaded, _ = load_pretrained(directory)
    assert set(loaded) == set(parameter_shapes(CONFIG))
    np.testing.assert_array_equal(loaded["transformer.h.1.attn.c_attn.bias"], tensors["h.1.attn.c_attn.bias"])


def test_saving_names_without_prefix_writes_them_with_it(tmp_path):
    tensors = {name.removeprefix("transformer."): value for name, value in tiny_model().state_dict().items()}
    save_pretrained(tmp_path / "model", CONFIG, tensors)
    assert set(load_pretrained(tmp_path / "model")[1]) == set(parameter_shapes(CONFIG))


def test_saving_into_an_existing_directory_replaces_the_model_and_keeps_other_files(tmp_path):
    directory, _ = saved_model(tmp_path)
    (directory / "tokenizer.json").write_text("{}")
    newer = tiny_model(seed=9)
    save_pretrained(directory, CONFIG, newer.state_dict())
    np.testing.assert_array_equal(load_pretrained(directory)[1]["transformer.wte.weight"],
                                  newer.state_dict()["transformer.wte.weight"])
    assert (directory / "tokenizer.json").read_text() == "{}"
    assert leftovers(tmp_path) == []


def test_a_crash_while_writing_leaves_no_checkpoint_behind(tmp_path, monkeypatch):
    def fail(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(safetensors.numpy, "save_file", fail)
    with pytest.raises(OSError, match="disk full"):
        save_pretrained(tmp_path / "model", CONFIG, tiny_model().state_dict())
    assert os.listdir(tmp_path) == []


# -- errors ------------------------------------------------------------------------------------------------------


def edit_config(**changes):
    def apply(directory):
        raw = json.loads((directory / "config.json").read_text())
        for key, value in changes.items():
            if value is None:
                raw.pop(key)
            else:
                raw[key] = value
        (directory / "config.json").write_text(json.dumps(raw))
    return apply


def rewrite_weights(edit):
    def apply(directory):
        tensors = safetensors.numpy.load_file(str(directory / "model.safetensors"))
        edit(tensors)
        safetensors.numpy.save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    return apply


def remove(name):
    return lambda directory: (directory / name).unlink()


def write(name, content: bytes):
    return lambda directory: (directory / name).write_bytes(content)


def pytorch_bin_only(directory):
    (directory / "model.safetensors").rename(directory / "pytorch_model.bin")


def shrink_c_fc(tensors):
    tensors["transformer.h.1.mlp.c_fc.weight"] = tensors["transformer.h.1.mlp.c_fc.weight"][:, :8].copy()


def duplicate_without_prefix(tensors):
    tensors["wpe.weight"] = tensors["transformer.wpe.weight"]


@pytest.mark.parametrize("damage, message", [
    (remove("config.json"), r"config\.json is missing"),
    (write("config.json", b"{not json"), "not valid JSON"),
    (write("config.json", b"[1, 2]"), "JSON object"),
    (edit_config(n_head=None), "n_head must be an integer, got None"),
    (edit_config(n_head=5), r"n_embd \(32\) must be divisible by n_head \(5\)"),
    (edit_config(n_embd="32"), "n_embd must be an integer"),
    (edit_config(activation_function="relu"), "activation_function = 'relu' is not supported"),
    (edit_config(model_type="bert"), "model_type"),
    (edit_config(n_inner=100), "n_inner"),
    (remove("model.safetensors"), r"model\.safetensors is missing"),
    (pytorch_bin_only, "only model.safetensors is read"),
    (write("model.safetensors", b"\x08\x00\x00\x00\x00\x00\x00\x00garbage!"), "not a readable safetensors"),
    (rewrite_weights(lambda t: t.pop("transformer.ln_f.bias")), r"lacks 1 tensor\(s\).*transformer\.ln_f\.bias"),
    (rewrite_weights(shrink_c_fc), r"c_fc\.weight is \(32, 8\), the config needs \(32, 128\)"),
    (edit_config(vocab_size=65), r"wte\.weight is \(64, 32\), the config needs \(65, 32\)"),
    (rewrite_weights(duplicate_without_prefix), "both with and without"),
])
def test_broken_checkpoints_are_config_errors_that_name_the_problem(tmp_path, damage, message):
    directory, _ = saved_model(tmp_path)
    damage(directory)
    with pytest.raises(ConfigError, match=message):
        load_pretrained(directory)


def test_missing_directory_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match=r"checkpoint directory .*nowhere does not exist"):
        load_pretrained(tmp_path / "nowhere")
    (tmp_path / "file").write_text("")
    with pytest.raises(ConfigError, match="is a file"):
        save_pretrained(tmp_path / "file", CONFIG, tiny_model().state_dict())


# -- training checkpoints: boxes, resharding, the manifest ------------------------------------------------------


def box(offsets, sizes) -> tuple[slice, ...]:
    return tuple(slice(o, o + n) for o, n in zip(offsets, sizes, strict=True))


@pytest.mark.parametrize("shape", [(7,), (3, 5), (2, 3, 4)])
def test_a_flat_range_is_at_most_2_ndim_minus_1_contiguous_boxes_covering_it_once(shape):
    size = math.prod(shape)
    index = np.arange(size).reshape(shape)
    for start in range(size + 1):
        for stop in range(start, size + 1):
            count = np.zeros(shape, int)
            boxes = flat_range_boxes(shape, start, stop)
            assert len(boxes) <= 2 * len(shape) - 1
            for flat, offsets, sizes in boxes:
                count[box(offsets, sizes)] += 1
                inside = index[box(offsets, sizes)].reshape(-1)
                np.testing.assert_array_equal(inside, np.arange(flat, flat + inside.size))  # one contiguous run
            np.testing.assert_array_equal(count.reshape(-1), (start <= np.arange(size)) & (np.arange(size) < stop))


CUTS = [((257, 4), Sharded(0), 2), ((257, 4), Sharded(0), 3), ((4, 12), Sharded(1, 3), 2), ((12,), Sharded(0, 3), 4),
        ((6, 10), Sharded(1), 4)]


@pytest.mark.parametrize("shape, cut, size", CUTS, ids=["vocab-tp2", "vocab-tp3", "qkv-tp2", "qkv-bias-tp4",
                                                        "columns-padded-tp4"])
def test_the_parts_of_a_piece_are_the_global_boxes_its_shard_holds_and_skip_the_padding(shape, cut, size):
    full = np.arange(1, math.prod(shape) + 1).reshape(shape)  # nonzero: the shard's padding is its only zeros
    for rank in range(size):
        local = shard_tensor(full, {"tp": cut}, {"tp": (rank, size)}).reshape(-1)
        for start, stop in [(0, local.size), (1, local.size - 1), (local.size // 3, 2 * local.size // 3)]:
            piece = Piece("t", shape, {"tp": cut}, {"tp": (rank, size)}, start, stop)
            held = local[start:stop]
            real = 0
            for part in parts(piece):
                np.testing.assert_array_equal(part.view(held), full[box(part.offsets, part.sizes)])
                real += math.prod(part.sizes)
            assert real == np.count_nonzero(held)


WEIGHT = np.random.default_rng(0).standard_normal((257, 6))
TP2 = {"tp": Sharded(0)}
DESCRIPTION = {"mesh": {"world_size": 4, "dp": 2, "tp": 2, "pp": 1, "cp": 1, "ep": 1, "zero": 2},
               "model": GPTConfig(vocab_size=257, n_embd=6, n_head=2, n_layer=1).to_dict(),
               "optimizer": {"optimizer": "adamw", "step": 5},
               "data_position": {"next_step": 5, "batch": 5, "batches_per_pass": 9}}


def write_tp2_zero2_checkpoint(folder, tensor=WEIGHT, duplicate=False, drop=False) -> list[list[dict]]:
    """`tensor` as four ranks of tp2 × ZeRO over dp2 would write it (each TP shard's flat range cut unevenly in
    two), then the manifest; optionally with one range written twice, or one missing."""
    folder.mkdir(parents=True)
    every_rank = []
    for dp_rank, tp_rank in itertools.product(range(2), range(2)):
        local = shard_tensor(tensor, TP2, {"tp": (tp_rank, 2)}).reshape(-1)
        cut = local.size // 2 + 4  # inside a row: each range is a partial row and whole rows
        start, stop = (0, cut) if dp_rank == 0 else (cut, local.size)
        piece = Piece("w", tensor.shape, TP2, {"tp": (tp_rank, 2)}, start, stop)
        if not (drop and dp_rank == tp_rank == 1):
            every_rank.append(write_rank_file(folder, 2 * dp_rank + tp_rank, [(piece, local[start:stop])]))
    if duplicate:
        every_rank.append(every_rank[0])
    publish_manifest(folder, build_manifest(folder, 5, DESCRIPTION, every_rank))
    return every_rank


def test_shards_written_on_tp2_with_zero_ranges_read_back_whole_and_on_tp3(tmp_path):
    folder = step_folder(tmp_path, 5)
    write_tp2_zero2_checkpoint(folder)
    saved = TrainingCheckpoint(folder)
    assert saved.step == 5 and len(saved.tensors["w"]["shards"]) == 8
    np.testing.assert_array_equal(saved.read_piece(Piece("w", WEIGHT.shape, {}, {}), np.float64),
                                  WEIGHT.reshape(-1))
    for rank in range(3):
        piece = Piece("w", WEIGHT.shape, TP2, {"tp": (rank, 3)}, 5, 200)
        want = shard_tensor(WEIGHT, TP2, {"tp": (rank, 3)}).reshape(-1)[5:200]
        np.testing.assert_array_equal(saved.read_piece(piece, np.float64), want)
        np.testing.assert_array_equal(saved.read_piece(piece, np.float32), want.astype(np.float32))
    assert sorted(os.listdir(folder)) == ["manifest.json"] + [f"rank-0000{r}.safetensors" for r in range(4)]


def test_a_manifest_refuses_a_replica_written_twice_or_a_piece_nobody_wrote(tmp_path):
    with pytest.raises(RuntimeError, match="wrote .* elements of 1542"):
        write_tp2_zero2_checkpoint(tmp_path / "twice", duplicate=True)
    with pytest.raises(RuntimeError, match="wrote .* elements of 1542"):
        write_tp2_zero2_checkpoint(tmp_path / "missing", drop=True)
    with pytest.raises(RuntimeError, match="no rank wrote v"):
        build_manifest(tmp_path, 5, DESCRIPTION, [], expected=["v"])


def test_save_replaces_a_step_and_a_crash_while_saving_leaves_the_previous_checkpoint(tmp_path, monkeypatch):
    world = Communicator(MPI.COMM_SELF)
    held = [(Piece("w", WEIGHT.shape, {}, {}), WEIGHT, True)]
    save(tmp_path, 2, held, world, {"model": {}})
    save(tmp_path, 4, held, world, {"model": {}})
    save(tmp_path, 4, [(Piece("w", WEIGHT.shape, {}, {}), 2 * WEIGHT, True)], world, {"model": {}})
    assert latest_training_checkpoint(tmp_path) == step_folder(tmp_path, 4)
    np.testing.assert_array_equal(TrainingCheckpoint(step_folder(tmp_path, 4)).read_box("w", [0, 0], [257, 6]),
                                  2 * WEIGHT)

    def fail(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(safetensors.numpy, "save_file", fail)
    with pytest.raises(OSError, match="disk full"):
        save(tmp_path, 4, held, world, {"model": {}})  # a rewrite of step 4 that fails half way
    assert latest_training_checkpoint(tmp_path) == step_folder(tmp_path, 2)
    assert not (step_folder(tmp_path, 4) / "manifest.json").exists()


def test_latest_training_checkpoint_is_the_highest_step_with_a_manifest(tmp_path):
    assert latest_training_checkpoint(tmp_path / "none yet") is None
    assert latest_training_checkpoint(tmp_path) is None
    for step in (10, 2, 4):
        write_tp2_zero2_checkpoint(step_folder(tmp_path, step))
    (tmp_path / "step-00000099").mkdir()  # a save that never finished
    (tmp_path / "step_00000050").mkdir()  # the old layout
    (step_folder(tmp_path, 50).parent / ".step-00000050.tmp").mkdir()
    assert latest_training_checkpoint(tmp_path) == step_folder(tmp_path, 10)
    assert find_checkpoint(tmp_path) == step_folder(tmp_path, 10)
    assert find_checkpoint(step_folder(tmp_path, 4)) == step_folder(tmp_path, 4)
    (tmp_path / "file").write_text("")
    with pytest.raises(ConfigError, match="is a file"):
        latest_training_checkpoint(tmp_path / "file")


def edit_manifest(change):
    def apply(folder):
        manifest = json.loads((folder / "manifest.json").read_text())
        change(manifest)
        (folder / "manifest.json").write_text(json.dumps(manifest))
    return apply


def first_shard(**changes):
    return edit_manifest(lambda manifest: manifest["tensors"]["w"]["shards"][0].update(changes))


@pytest.mark.parametrize("damage, message", [
    (remove("manifest.json"), "manifest.json is missing"),
    (write("manifest.json", b"{oops"), "not valid JSON"),
    (edit_manifest(lambda m: m.update(format="something else")), "not an mpiparallel training checkpoint"),
    (edit_manifest(lambda m: m.pop("step")), "step is missing"),
    (first_shard(file="../elsewhere.safetensors"), "not a file name in the step folder"),
    (first_shard(offsets=[250, 0]), r"outside \[257, 6\]"),
    (edit_manifest(lambda m: m["tensors"]["w"]["shards"].pop()), "do not cover"),
    (remove("rank-00003.safetensors"), "rank-00003.safetensors .* cannot be read"),
    (first_shard(key="nonsense"), "cannot be read"),
])
def test_damaged_training_checkpoints_are_config_errors_that_name_the_problem(tmp_path, damage, message):
    folder = step_folder(tmp_path, 5)
    write_tp2_zero2_checkpoint(folder)
    damage(folder)
    with pytest.raises(ConfigError, match=message):
        TrainingCheckpoint(folder).read_piece(Piece("w", WEIGHT.shape, {}, {}), np.float64)


def test_a_checkpoint_of_another_tensor_shape_or_name_is_a_config_error(tmp_path):
    write_tp2_zero2_checkpoint(step_folder(tmp_path, 5))
    saved = TrainingCheckpoint(step_folder(tmp_path, 5))
    with pytest.raises(ConfigError, match=r"w is \(257, 6\), this run needs \(256, 6\)"):
        saved.read_piece(Piece("w", (256, 6), {}, {}), np.float64)
    with pytest.raises(ConfigError, match="has no tensor v"):
        saved.read_piece(Piece("v", (256, 6), {}, {}), np.float64)
    with pytest.raises(ConfigError, match="holds another model"):
        saved.check_model(CONFIG)


def checkpoint_info(path) -> subprocess.CompletedProcess:
    return run_with_timeout([sys.executable, "-m", "mpiparallel", "checkpoint", "info", str(path)], timeout=60)


def test_checkpoint_info_shows_each_tensors_shards_and_names_bad_paths(tmp_path):
    write_tp2_zero2_checkpoint(step_folder(tmp_path, 5))
    (tmp_path / "step-00000007").mkdir()  # an unfinished save: passed over beside step 5, an error by itself
    shown = checkpoint_info(tmp_path)
    assert shown.returncode == 0, shown.stderr
    assert "step-00000005: step 5" in shown.stdout
    assert "4 ranks: dp 2 × tp 2 × pp 1 × cp 1, ep 1, zero 2" in shown.stdout
    assert "optimizer adamw at step 5; data: next step 5 = batch 5 of 9" in shown.stdout
    line = next(line for line in shown.stdout.splitlines() if line.split()[:1] == ["w"])
    assert line.split()[1:6] == ["float64", "257×6", "8", "in", "4"]
    assert "[0:65, 0:6] [65:66, 0:1] [65:66, 1:6]" in line  # rank 0's range ends 391 = 65·6 + 1 elements in
    for path, message in [(tmp_path / "nowhere", "does not exist"), (tmp_path / "step-00000007", "did not finish"),
                          (tmp_path.parent, "holds no training checkpoint")]:
        result = checkpoint_info(path)
        assert result.returncode == 2, result
        assert result.stderr.startswith("Error: ") and message in result.stderr and "Traceback" not in result.stderr


# -- transformers ------------------------------------------------------------------------------------------------


INTEROP = "pip install -e '.[interop]'"


def hugging_face():
    """torch and transformers, or a skip that says how to install them (a failure under CI=true)."""
    torch = optional_module("torch", f"needs torch to run transformers' GPT-2: {INTEROP}")
    transformers = optional_module("transformers", f"needs transformers' GPT-2: {INTEROP}")
    torch.set_num_threads(1)  # a tiny model is no faster on more threads; they would take cores from other work
    return torch, transformers


@pytest.mark.parametrize("dtype, rtol", [(np.float32, 1e-4), (np.float64, 1e-10)])
def test_transformers_loads_our_directory_and_computes_the_same_logits(tmp_path, dtype, rtol):
    torch, transformers = hugging_face()
    if dtype != np.float32 and int(transformers.__version__.split(".")[0]) < 5:
        missing(f"transformers {transformers.__version__} loads float32 whatever dtype the checkpoint says; "
                    f"5.0 and newer read it: {INTEROP}")
    directory, model = saved_model(tmp_path, dtype)
    hf_model = transformers.GPT2LMHeadModel.from_pretrained(str(directory)).eval()
    assert hf_model.dtype == getattr(torch, np.dtype(dtype).name)  # from config.json's torch_dtype
    tokens = np.random.default_rng(0).integers(0, CONFIG.vocab_size, size=(2, CONFIG.n_positions))
    with torch.no_grad():
        hf_logits = hf_model(torch.from_numpy(tokens)).logits.numpy()
    ours = model.logits(tokens)
    np.testing.assert_allclose(ours, hf_logits, rtol=rtol, atol=rtol / 10)


def test_we_load_what_transformers_saves(tmp_path):
    _, transformers = hugging_face()
    directory, model = saved_model(tmp_path)
    resaved = tmp_path / "resaved"
    transformers.GPT2LMHeadModel.from_pretrained(str(directory)).save_pretrained(str(resaved))
    config, tensors, _ = load_pretrained(resaved)
    assert config == CONFIG
    for name, value in model.state_dict().items():
        np.testing.assert_array_equal(tensors[name], value)


def test_a_moe_checkpoint_without_expert_biases_starts_with_zero_biases(tmp_path):
    """Checkpoints from elsewhere have no aux-loss-free biases: they load with zeros, on the serial model too."""
    config = GPTConfig(vocab_size=32, n_positions=8, n_embd=8, n_layer=1, n_head=2, n_experts=2, moe_bias_rate=0.1)
    model = Transformer(config, seed=1)
    state = {name: value for name, value in model.state_dict().items() if not name.endswith("expert_bias")}
    save_pretrained(tmp_path, config, state)
    _, tensors, _ = load_pretrained(tmp_path)
    np.testing.assert_array_equal(tensors["transformer.h.0.mlp.router.expert_bias"], np.zeros(2, np.float32))
    model.expert_biases["transformer.h.0.mlp.router.expert_bias"][...] = 5.0
    model.load_state_dict(state)
    np.testing.assert_array_equal(model.expert_biases["transformer.h.0.mlp.router.expert_bias"], 0.0)
