"""Mixed precision (`models.precision`): what "parallel equals serial" means when every layer rounds.

- The plumbing: a compute dtype equal to --dtype is the float64 path bit for bit (the composition matrix runs it).
- Serial bfloat16 against an independent reference: PyTorch with the same scheme (bf16 weights and activations,
  float32 master weights and AdamW). Both round every intermediate to bf16 (unit roundoff u = 2⁻⁸), but at
  different places (PyTorch after each operation, ours after each layer), so their losses agree to a few u, not
  to float32's 1e-7: the test allows 4u ≈ 1.6 %, and the updates must point the same way.
- Every mesh in bfloat16 against the serial bfloat16 run: the same roundings, in another summation order (TP's
  partial sums, CP's blocks of keys): per-step losses within u/4 ≈ 1e-3 (measured: ≤ 1e-4).
- The loss scaler's arithmetic, and a forced overflow on a 4-rank pipeline × tensor-parallel mesh: every rank
  skips the same steps, nothing hangs, the scale backs off.
- The bytes: ZeRO's bytes per parameter measured equal to the formula, TP's bytes halved.
"""

from __future__ import annotations

import json
import math
import os
import sys

import numpy as np
import pytest
from mpi_harness import run_on_ranks, run_with_timeout
from optional import optional_module
from workers import composition_checks

from models.precision import DTYPES, LossScaler, model_state_bytes
from models.transformer import GPTConfig, Transformer
from mpiparallel import optim
from mpiparallel.checkpoints.hugging_face import save_pretrained

BF16_ROUNDOFF = 2.0**-8
TINY = ["--n-layer", "2", "--n-embd", "32", "--n-head", "4", "--seq-len", "32", "--batch-size", "8", "--threads", "1"]


def test_the_scaler_doubles_after_clean_steps_and_halves_after_its_hysteresis_never_below_one():
    scaler = LossScaler(growth_interval=3)
    assert scaler.scale == 2.0**16
    assert [scaler.update(False) for _ in range(3)] == [False] * 3 and scaler.scale == 2.0**17
    assert scaler.update(True) and scaler.scale == 2.0**17  # the first overflow: skipped, scale kept (hysteresis 2)
    assert scaler.update(True) and scaler.scale == 2.0**16  # the second: halved
    floor = LossScaler(scale=1.0, hysteresis=1)
    assert floor.update(True) and floor.scale == 1.0
    fixed = LossScaler(scale=8.0, dynamic=False)
    assert fixed.update(True) and [fixed.update(False) for _ in range(2000)] and fixed.scale == 8.0
    restored = LossScaler()
    restored.load_state_dict(scaler.state_dict())
    assert restored.state_dict() == scaler.state_dict() == {"scale": 2.0**16, "clean_steps": 0, "overflows_left": 2,
                                                             "skipped": 2}


def test_bytes_per_parameter_are_the_zero_papers():
    def total(**kwargs) -> float:
        return sum(model_state_bytes(**kwargs).values())

    assert total(compute="bfloat16", master="float32", grad="float32") == 18  # 2 + 4 + (4 + 8)
    assert total(compute="bfloat16", master="float32", grad="bfloat16") == 16  # the paper's 2Ψ + 2Ψ + 12Ψ
    assert total(compute="bfloat16", master="float32", grad="float32", zero=1, dp=2) == 12  # 2 + 4 + 12/2
    assert total(compute="bfloat16", master="float32", grad="bfloat16", zero=3, dp=2) == 8  # 16/2
    assert total(compute="float32", master="float32", grad="float32") == 16  # no master copy: 4 + 4 + 8


CONFIG = GPTConfig(vocab_size=61, n_positions=16, n_embd=16, n_layer=2, n_head=4)


def test_a_compute_dtype_equal_to_the_master_dtype_is_the_plain_path_bit_for_bit():
    tokens = np.random.default_rng(0).integers(0, 61, (2, 16))
    plain = Transformer(CONFIG, dtype=np.float64)
    explicit = Transformer(CONFIG, dtype=np.float64, compute_dtype="float64")
    for model in (plain, explicit):
        model.backward(model.forward(tokens, tokens)[1])
    assert all(p.master is None for p in explicit.parameters())
    for a, b in zip(plain.parameters(), explicit.parameters(), strict=True):
        np.testing.assert_array_equal(a.grad, b.grad)


def test_norm_statistics_stay_float32_while_the_rest_of_what_is_saved_is_bfloat16():
    model = Transformer(GPTConfig(arch="llama", vocab_size=61, n_positions=16, n_embd=16, n_layer=1, n_head=4),
                        compute_dtype="bfloat16")
    tokens = np.random.default_rng(0).integers(0, 61, (2, 16))
    saved = model.forward(tokens, tokens)[1].per_unit[1]
    assert saved.ln_1.rstd.dtype == np.float32 and saved.ln_1.normalized.dtype == DTYPES["bfloat16"]


def test_the_working_copy_is_the_master_rounded_and_the_master_keeps_what_bf16_would_lose():
    model = Transformer(CONFIG, dtype=np.float32, compute_dtype="bfloat16")
    param = model.params["transformer.h.0.mlp.c_fc.weight"]
    assert param.data.dtype == DTYPES["bfloat16"]
    assert param.master.dtype == np.float32 and param.grad.dtype == np.float32
    before = param.master.copy()
    optimizer = optim.SGD(model.parameters(), lr=1.0)
    for p in model.parameters():
        p.grad[...] = 1e-6  # far below bf16's spacing near 0.02 (about 1e-4): lost in bf16, kept in float32
    optimizer.step()
    np.testing.assert_array_equal(param.master, before - np.float32(1e-6))
    np.testing.assert_array_equal(param.data, param.master.astype(DTYPES["bfloat16"]))


def torch_same_scheme(torch, transformers, directory, lr: float):
    """transformers' GPT-2 in bfloat16 with float32 master weights and AdamW on them (the scheme we implement)."""
    model = transformers.GPT2LMHeadModel.from_pretrained(str(directory), dtype=torch.float32)
    masters = [p.detach().clone() for p in model.parameters()]
    model = model.to(torch.bfloat16)
    decayed = [m for m in masters if m.ndim >= 2]
    optimizer = torch.optim.AdamW([{"params": decayed, "weight_decay": 0.1},
                                   {"params": [m for m in masters if m.ndim < 2], "weight_decay": 0.0}],
                                  lr=lr, betas=(0.9, 0.95), eps=1e-8)
    return model, masters, optimizer


def test_serial_bfloat16_follows_pytorch_with_the_same_scheme(tmp_path):
    torch = optional_module("torch", "needs torch for the bfloat16 reference: pip install -e '.[interop]'")
    transformers = optional_module("transformers", "needs transformers' GPT-2: pip install -e '.[interop]'")
    torch.set_num_threads(1)
    config = GPTConfig(vocab_size=61, n_positions=16, n_embd=32, n_layer=2, n_head=4)
    master = Transformer(config, seed=1, dtype=np.float32)
    save_pretrained(tmp_path, config, master.state_dict())
    ours = Transformer(config, seed=1, dtype=np.float32, compute_dtype="bfloat16")
    lr = 3e-3
    our_optimizer = optim.AdamW(ours.parameters(), lr=lr, weight_decay=0.1)
    theirs, masters, their_optimizer = torch_same_scheme(torch, transformers, tmp_path, lr)
    start = {name: p.master.copy() for name, p in ours.params.items()}
    rng = np.random.default_rng(3)
    for _ in range(3):
        window = rng.integers(0, 61, size=(4, 17))
        inputs, targets = window[:, :-1], window[:, 1:]
        ours.zero_grad()
        loss, saved = ours.forward(inputs, targets)
        ours.backward(saved)
        our_optimizer.step()
        logits = theirs(torch.from_numpy(inputs)).logits.float()
        their_loss = torch.nn.functional.cross_entropy(logits.reshape(-1, 61), torch.from_numpy(targets).reshape(-1))
        theirs.zero_grad()
        their_loss.backward()
        for m, p in zip(masters, theirs.parameters(), strict=True):
            m.grad = p.grad.float()
        their_optimizer.step()
        with torch.no_grad():
            for m, p in zip(masters, theirs.parameters(), strict=True):
                p.copy_(m)
        assert loss == pytest.approx(their_loss.item(), rel=4 * BF16_ROUNDOFF)
    by_name = dict(zip([name for name, _ in theirs.named_parameters()], masters, strict=True))
    ours_moved = np.concatenate([(p.master - start[name]).ravel() for name, p in ours.params.items()])
    theirs_moved = np.concatenate([(by_name[name].detach().numpy() - start[name]).ravel() for name in ours.params])
    cosine = ours_moved @ theirs_moved / (np.linalg.norm(ours_moved) * np.linalg.norm(theirs_moved))
    # the same updates, up to bf16's noise on the gradients (which dominates only where the exact gradient is ~0,
    # such as the key bias, to which softmax is blind)
    assert cosine > 0.98, cosine


BASE = {"n_layer": 2, "n_head": 4, "n_embd": 16, "seq_len": 16, "batch_size": 8, "steps": 3, "dtype": "float32",
        "vocab_size": 256, "lr": 1e-2, "compute_dtype": "bfloat16", "bucket_mb": 0.004}
MODELS = {"gpt2-bf16": BASE, "moe-bf16": {**BASE, "experts": 4, "moe_aux_coef": 0.0},
          "llama-bf16": {**BASE, "arch": "llama", "n_kv_head": 2, "ffn_hidden": 24},
          "mixtral-bf16": {**BASE, "arch": "llama", "n_kv_head": 2, "ffn_hidden": 24, "experts": 4,
                           "moe_aux_coef": 0.0}}
MESHES = {
    2: [("gpt2-bf16", {"dp": 2, "zero": 1}), ("gpt2-bf16", {"tp": 2, "sp": True}), ("gpt2-bf16", {"pp": 2}),
        ("gpt2-bf16", {"cp": 2}), ("llama-bf16", {"tp": 2}), ("llama-bf16", {"cp": 2, "cp_attention": "ulysses"}),
        ("mixtral-bf16", {"dp": 2, "ep": 2}), ("moe-bf16", {"dp": 2, "ep": 2, "zero": 1}),
        ("llama-bf16", {"dp": 2, "zero": 3})],
    4: [("gpt2-bf16", {"tp": 2, "pp": 2}), ("llama-bf16", {"tp": 2, "cp": 2}),
        ("llama-bf16", {"dp": 2, "pp": 2, "zero": 2})],
}


@pytest.fixture(scope="module")
def bf16_runs(tmp_path_factory) -> list[dict]:
    directory = str(tmp_path_factory.mktemp("serial-bf16"))
    run_on_ranks(1, composition_checks.serial_references, timeout=300, models=MODELS, directory=directory)
    return [result for ranks, rows in MESHES.items()
            for result in run_on_ranks(ranks, composition_checks.matches_serial, timeout=600,
                                       models=MODELS, runs=rows, references=directory)[0]]


def test_every_axis_in_bfloat16_follows_the_serial_bfloat16_run(bf16_runs):
    assert len(bf16_runs) == sum(len(rows) for rows in MESHES.values())
    for result in bf16_runs:
        assert result["steps"] == 3, result
        assert result["loss_error"] <= BF16_ROUNDOFF / 4, (result["model"], result["options"], result["loss_error"])


def train(*args: str, env: dict | None = None, timeout: float = 300) -> str:
    result = run_with_timeout([sys.executable, "-m", "mpiparallel", "train", *TINY, *args], timeout,
                              env={**os.environ, **(env or {})})
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result.stdout


def test_a_forced_overflow_on_a_pipeline_of_tensor_parallel_ranks_is_skipped_everywhere(tmp_path):
    """Overflows on one rank at a time (rank 3 at steps 1 and 3, rank 0 at step 2): every rank must skip those
    steps together, or the pipeline's next step would wait forever for a rank that went on."""
    log = tmp_path / "log.jsonl"
    train("-n", "4", "--tp", "2", "--pp", "2", "--compute-dtype", "float16", "--steps", "6", "--log-json", str(log),
          "--eval-every", "3", "--eval-batches", "1", env={"MPIPARALLEL_FORCE_OVERFLOW": "1@3,2@0,3@3"})
    records = [json.loads(line) for line in log.read_text().splitlines()]
    assert all(r["val_loss"] < 10 for r in records if "val_loss" in r)  # unscaled (ln 2048 ≈ 7.6), not S·loss
    assert [r["skipped"] for r in records] == [False, True, True, True, False, False]
    assert [r["loss_scale"] for r in records] == [2.0**16] * 3 + [2.0**15] * 3  # halved after 2 overflows
    assert all(r["lr"] == records[0]["lr"] and math.isfinite(r["loss"]) for r in records)


def test_zero_holds_the_bytes_per_parameter_of_the_precision_in_use():
    out = train("-n", "2", "--zero", "1", "--compute-dtype", "bfloat16", "--steps", "1", "--memory-report")
    assert "12.00 bytes per parameter (2 + 4 + 6)" in out
    out = train("-n", "2", "--zero", "3", "--compute-dtype", "bfloat16", "--grad-dtype", "bfloat16", "--steps", "1",
                "--memory-report")
    assert "8.00 bytes per parameter (1 + 1 + 6)" in out
    for line in out.splitlines():
        if "model states" in line:
            held, theory = line.split("held")[0].split()[-2], line.split("theory")[1].split()[0]
            assert held == theory, line


def test_tensor_parallel_activations_travel_at_half_the_bytes_in_bfloat16():
    def tp_bytes(*extra: str) -> float:
        out = train("-n", "2", "--tp", "2", "--steps", "1", *extra)
        line = next(line for line in out.splitlines() if line.startswith("rank 0:"))
        assert "ratio 1.0000" in line, line
        return float(line.split("tp ")[1].split(" MB")[0])

    float32, bfloat16 = tp_bytes(), tp_bytes("--compute-dtype", "bfloat16")
    assert 0.5 <= bfloat16 / float32 < 0.52  # the activations halve; the cross-entropy's statistics stay float32


def test_the_planner_counts_the_bytes_per_parameter_the_memory_report_does():
    from mpiparallel.planner import PRECISIONS

    for name, (compute, grad) in {"mixed": ("bfloat16", "bfloat16"), "bfloat16": ("bfloat16", "float32"),
                                  "float32": ("float32", "float32")}.items():
        expected = model_state_bytes(compute, "float32", grad)
        plan = PRECISIONS[name]
        assert (plan.weights, plan.gradients, plan.optimizer) == tuple(expected.values()), name


def test_the_scalers_state_is_part_of_training_checkpoints(tmp_path):
    """A resumed float16 run continues with the scale and the skipped steps it had, so the learning-rate
    schedule (held on skipped steps) and the next back-off are the uninterrupted run's."""
    precision = ["--compute-dtype", "float16", "--lr-schedule", "cosine", "--warmup-steps", "2"]
    checkpoints = ["--checkpoint-dir", str(tmp_path / "checkpoints"), "--checkpoint-every", "2"]
    forced = {"MPIPARALLEL_FORCE_OVERFLOW": "0@0,1@0,4@0"}
    whole, resumed = tmp_path / "whole.jsonl", tmp_path / "resumed.jsonl"
    train("--steps", "6", "--log-json", str(whole), *precision, env=forced)
    train("--steps", "2", *precision, *checkpoints, env=forced)
    train("--steps", "6", "--resume", "--log-json", str(resumed), *precision, *checkpoints, env=forced)
    first = [json.loads(line) for line in whole.read_text().splitlines()]
    second = [json.loads(line) for line in resumed.read_text().splitlines()]
    assert [r["step"] for r in second] == [3, 4, 5, 6]
    for a, b in zip(first[2:], second, strict=True):
        assert (a["loss_scale"], a["skipped"], a["lr"]) == (b["loss_scale"], b["skipped"], b["lr"])
    assert first[2]["loss_scale"] == 2.0**15  # two overflows before the checkpoint: halved, and kept on resume
