"""Hugging Face checkpoints round-trip bit-exactly, load in transformers, and fail with clear messages."""

from __future__ import annotations

import copy
import json
import os

import numpy as np
import pytest
import safetensors
import safetensors.numpy

from models.gpt import GPT, GPTConfig, parameter_shapes
from mpiparallel import checkpoint
from mpiparallel.checkpoint import (
    gpt2_config_json,
    latest_training_checkpoint,
    load_pretrained,
    load_training_checkpoint,
    save_pretrained,
    save_training_checkpoint,
)
from mpiparallel.errors import ConfigError
from mpiparallel.optim import AdamW

CONFIG = GPTConfig(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=4)


def tiny_model(dtype=np.float32, seed: int = 3) -> GPT:
    return GPT(CONFIG, seed=seed, dtype=dtype)


def saved_model(tmp_path, dtype=np.float32):
    directory = tmp_path / "model"
    model = tiny_model(dtype)
    save_pretrained(directory, CONFIG, model.state_dict())
    return directory, model


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
    (edit_config(model_type="llama"), "model_type"),
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


# -- training checkpoints ----------------------------------------------------------------------------------------


def trained(model: GPT, steps: int) -> AdamW:
    optimizer = AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    tokens = np.arange(17) % CONFIG.vocab_size
    for _ in range(steps):
        model.zero_grad()
        model.backward(model.forward(tokens[None, :-1], tokens[None, 1:])[1])
        optimizer.step()
    return optimizer


def test_training_checkpoint_round_trips_model_optimizer_and_trainer_state(tmp_path):
    model = tiny_model(np.float64)
    optimizer = trained(model, 2)
    rng = np.random.default_rng(5)
    path = save_training_checkpoint(tmp_path, 2, CONFIG, model.state_dict(), optimizer.state_dict(),
                                    extra={"settings": {"lr": 0.01}}, rng_state=rng.bit_generator.state)
    assert path == tmp_path / "step_00000002"
    config, tensors, optimizer_state, trainer_state = load_training_checkpoint(path)
    assert config == CONFIG
    for name, value in model.state_dict().items():
        np.testing.assert_array_equal(tensors[name], value)
    assert optimizer_state["optimizer"] == "adamw" and optimizer_state["step"] == 2
    for key in ("exp_avg", "exp_avg_sq"):
        assert set(optimizer_state[key]) == set(parameter_shapes(CONFIG))
        for name, value in getattr(optimizer, key).items():
            np.testing.assert_array_equal(optimizer_state[key][name], value)
    assert trainer_state["step"] == 2 and trainer_state["extra"] == {"settings": {"lr": 0.01}}
    restored = np.random.default_rng()
    restored.bit_generator.state = trainer_state["rng_state"]
    assert restored.integers(1 << 60) == rng.integers(1 << 60)
    assert load_pretrained(path)[0] == CONFIG  # every training checkpoint is also a model checkpoint


def test_resuming_from_a_training_checkpoint_continues_like_an_uninterrupted_run(tmp_path):
    uninterrupted = tiny_model(np.float64)
    trained(uninterrupted, 4)

    first_half = tiny_model(np.float64)
    save_training_checkpoint(tmp_path, 2, CONFIG, first_half.state_dict(), trained(first_half, 2).state_dict())
    _, tensors, optimizer_state, _ = load_training_checkpoint(latest_training_checkpoint(tmp_path))
    resumed = tiny_model(np.float64, seed=99)
    resumed.load_state_dict(tensors)
    optimizer = AdamW(resumed.parameters(), lr=1e-2, weight_decay=0.1)
    optimizer.load_state_dict(optimizer_state)
    tokens = np.arange(17) % CONFIG.vocab_size
    for _ in range(2):
        resumed.zero_grad()
        resumed.backward(resumed.forward(tokens[None, :-1], tokens[None, 1:])[1])
        optimizer.step()
    for name, value in uninterrupted.state_dict().items():
        np.testing.assert_array_equal(resumed.state_dict()[name], value)


def test_latest_training_checkpoint_is_the_highest_complete_step(tmp_path):
    assert latest_training_checkpoint(tmp_path / "none yet") is None
    assert latest_training_checkpoint(tmp_path) is None
    model = tiny_model()
    state = {"optimizer": "sgd", "step": 0}
    for step in (10, 2, 4):
        save_training_checkpoint(tmp_path, step, CONFIG, model.state_dict(), state)
    (tmp_path / "step_00000099").mkdir()  # a directory without trainer_state.json is not a checkpoint
    (tmp_path / ".step_00000050.tmp-abc").mkdir()
    (tmp_path / "notes").mkdir()
    assert latest_training_checkpoint(tmp_path) == tmp_path / "step_00000010"
    _, _, optimizer_state, _ = load_training_checkpoint(tmp_path / "step_00000004")
    assert optimizer_state == state


def test_saving_the_same_step_again_replaces_that_checkpoint(tmp_path):
    state = {"optimizer": "sgd", "step": 3}
    save_training_checkpoint(tmp_path, 3, CONFIG, tiny_model(seed=1).state_dict(), state)
    newer = tiny_model(seed=2)
    save_training_checkpoint(tmp_path, 3, CONFIG, newer.state_dict(), state, extra={"try": 2})
    _, tensors, _, trainer_state = load_training_checkpoint(tmp_path / "step_00000003")
    np.testing.assert_array_equal(tensors["transformer.wpe.weight"], newer.state_dict()["transformer.wpe.weight"])
    assert trainer_state["extra"] == {"try": 2}
    assert leftovers(tmp_path) == []


def test_nested_optimizer_state_is_split_into_arrays_and_json_and_joined_back():
    state = {"optimizer": "custom", "step": np.int64(7), "moments": {"a.weight": np.ones((2, 2))},
             "hyper": {"betas": [0.9, 0.95]}}
    arrays, scalars = checkpoint._split_arrays(state)
    assert set(arrays) == {"moments/a.weight"}
    assert scalars == {"optimizer": "custom", "step": 7, "moments": {}, "hyper": {"betas": [0.9, 0.95]}}
    joined = checkpoint._join_arrays(arrays, scalars)
    expected = copy.deepcopy(state) | {"step": 7}
    assert joined.keys() == expected.keys() and joined["hyper"] == expected["hyper"]
    np.testing.assert_array_equal(joined["moments"]["a.weight"], np.ones((2, 2)))


def test_incomplete_training_checkpoints_are_config_errors(tmp_path):
    path = save_training_checkpoint(tmp_path, 1, CONFIG, tiny_model().state_dict(), {"optimizer": "sgd", "step": 1})
    (path / "optimizer.safetensors").unlink()
    with pytest.raises(ConfigError, match=r"optimizer\.safetensors is missing"):
        load_training_checkpoint(path)
    (path / "trainer_state.json").write_text("{}")
    with pytest.raises(ConfigError, match="no integer 'step'"):
        load_training_checkpoint(path)


# -- transformers ------------------------------------------------------------------------------------------------


INTEROP = "pip install -e '.[interop]'"


def hugging_face():
    """torch and transformers, or a skip that says how to install them."""
    torch = pytest.importorskip("torch", reason=f"needs torch to run transformers' GPT-2: {INTEROP}")
    transformers = pytest.importorskip("transformers", reason=f"needs transformers' GPT-2: {INTEROP}")
    torch.set_num_threads(1)  # a tiny model is no faster on more threads; they would take cores from other work
    return torch, transformers


@pytest.mark.parametrize("dtype, rtol", [(np.float32, 1e-4), (np.float64, 1e-10)])
def test_transformers_loads_our_directory_and_computes_the_same_logits(tmp_path, dtype, rtol):
    torch, transformers = hugging_face()
    if dtype != np.float32 and int(transformers.__version__.split(".")[0]) < 5:
        pytest.skip(f"transformers {transformers.__version__} loads float32 whatever dtype the checkpoint says; "
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
