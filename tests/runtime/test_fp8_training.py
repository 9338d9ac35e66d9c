"""`train --fp8 blockwise` on every parallel axis against the serial FP8 run, and the FP8 flags' errors.

What "parallel equals serial" means in FP8. A tile's scale depends only on the tile, and the 1×128 tiles of the
forward and input-gradient GEMMs lie inside one token's row, so they are the same on any mesh that keeps a
token's channels together. What can change:

- the weight gradient's 128-token tiles. A rank's (or microbatch's) tokens tile as the serial batch's do when
  their count is a multiple of 128 and they are a contiguous run of the serial order: DP, ZeRO and PP here
  (8 × 32 tokens, 128 per rank or microbatch), and EP here (an expert receives its tokens source rank by source
  rank, which is the serial token order). CP's zigzag chunks (16 tokens of each sequence per rank) tile
  otherwise.
- TP: the tiles are the same (every cut dimension here is a multiple of 128), but the row-parallel partial sums
  are rounded to bfloat16 before they are summed (as in the bfloat16 matrix), so the next layer's input differs
  from serial by bfloat16 roundings, and some of its E4M3 roundings flip.
- a TP shard that cuts a 128-tile of a weight (not here; see mpiparallel/axes/tensor_parallel.py).

The bounds, then. Same tiles and same inputs (DP, ZeRO, PP, EP): the first step's gradients equal serial up to
float32 summation order, ≤ 1e-5 relative — all but wpe, whose gradient is a bfloat16 sum over the batch in the
embedding (FP8 or not: a difference ≤ 2⁻⁷). A flipped E4M3 rounding (TP) or other scales (CP) moves single
gradient elements by up to u₈ = 2⁻⁴ of themselves: ≤ 2u₈ of the largest element. Losses, every step and mesh:
within the bfloat16 matrix's u/4 ≈ 1e-3 (u = 2⁻⁸); measured ≤ 2.2e-4 (docs/fp8.md lists every figure).
"""

from __future__ import annotations

import json
import os
import sys

import pytest
from mpi_harness import run_on_ranks, run_with_timeout
from workers import composition_checks, fp8_checks

BF16_ROUNDOFF = 2.0**-8
E4M3_ROUNDOFF = 2.0**-4
LOSS_BOUND = BF16_ROUNDOFF / 4
SUMMATION_ORDER_BOUND = 1e-4
"""Same tiles and inputs, float32 sums in another order: 4.7e-7 on OpenBLAS's AVX-512 kernels, up to 7.5e-5 on
its AVX2 ones (llama, dp 2 × ZeRO-3: the half batch's products round otherwise) — still 40× below one bfloat16
rounding, so a flipped FP8/bf16 rounding (FLIPPED_ROUNDING_BOUND) is told apart."""
FLIPPED_ROUNDING_BOUND = 2 * E4M3_ROUNDOFF
POSITION_GRADIENT = "transformer.wpe.weight"  # summed over the batch in bfloat16 by the embedding

BASE = {"n_layer": 2, "n_head": 4, "n_embd": 256, "seq_len": 32, "batch_size": 8, "steps": 3, "dtype": "float32",
        "vocab_size": 256, "lr": 1e-3, "compute_dtype": "bfloat16", "fp8": "blockwise", "bucket_mb": 0.25}
MODELS = {"gpt2-fp8": BASE,
          "llama-fp8": {**BASE, "arch": "llama", "n_kv_head": 4, "ffn_hidden": 256, "exp_avg_dtype": "bfloat16"},
          "mixtral-fp8": {**BASE, "arch": "llama", "n_kv_head": 4, "ffn_hidden": 128, "experts": 4,
                          "moe_aux_coef": 0.0}}
DOCUMENTS = {"attention": "document", "eot_id": ord(" ")}  # the byte corpus's words as documents
MODELS |= {"gpt2-fp8-doc": {**MODELS["gpt2-fp8"], **DOCUMENTS}, "llama-fp8-doc": {**MODELS["llama-fp8"], **DOCUMENTS}}
SAME = "same tiles and inputs"
FLIPS = "bf16 partial sums: flips"
OTHER_TILES = "other weight-gradient tiles"
MESHES = {
    2: [("gpt2-fp8", {"dp": 2, "zero": 1}, SAME), ("gpt2-fp8", {"pp": 2}, SAME),
        ("llama-fp8", {"dp": 2, "zero": 3}, SAME), ("mixtral-fp8", {"dp": 2, "ep": 2}, SAME),
        ("gpt2-fp8", {"tp": 2, "sp": True}, FLIPS), ("llama-fp8", {"tp": 2}, FLIPS),
        ("gpt2-fp8", {"cp": 2}, OTHER_TILES), ("llama-fp8", {"cp": 2, "cp_attention": "ulysses"}, OTHER_TILES),
        ("gpt2-fp8-doc", {"dp": 2, "zero": 2}, SAME), ("llama-fp8-doc", {"cp": 2}, OTHER_TILES)],
}


@pytest.fixture(scope="module")
def fp8_runs(tmp_path_factory) -> list[tuple[dict, str]]:
    directory = str(tmp_path_factory.mktemp("serial-fp8"))
    run_on_ranks(1, composition_checks.serial_references, timeout=600, models=MODELS, directory=directory)
    results = []
    for ranks, rows in MESHES.items():
        measured = run_on_ranks(ranks, fp8_checks.matches_serial_per_step, timeout=900, models=MODELS,
                                runs=[(model, options) for model, options, _ in rows], references=directory)[0]
        results += [(result, kind) for result, (_, _, kind) in zip(measured, rows, strict=True)]
    for result, kind in results:  # the figures docs/fp8.md quotes
        errors = result["first_step_gradient_errors"]
        print(f"{result['model']:<12} {str(result['options']):<40} {kind:<28} losses "
              + " ".join(f"{error:.1e}" for error in result["loss_errors"])
              + f"; first step's gradients {max(errors.values()):.1e} "
              f"({max(e for name, e in errors.items() if name != POSITION_GRADIENT):.1e} without wpe)")
    return results


def test_every_axis_in_fp8_follows_the_serial_fp8_run(fp8_runs):
    assert len(fp8_runs) == sum(len(rows) for rows in MESHES.values())
    for result, kind in fp8_runs:
        where = (result["model"], result["options"])
        assert result["steps"] == 3 and max(result["loss_errors"]) <= LOSS_BOUND, (where, result["loss_errors"])
        errors = result["first_step_gradient_errors"]
        if kind == SAME:
            assert errors.get(POSITION_GRADIENT, 0.0) <= 2.0**-7, where
            others = max(error for name, error in errors.items() if name != POSITION_GRADIENT)
            assert others <= SUMMATION_ORDER_BOUND, (where, others)
        else:
            assert max(errors.values()) <= FLIPPED_ROUNDING_BOUND, (where, max(errors.values()))


TINY = ["--n-layer", "2", "--n-embd", "16", "--n-head", "2", "--seq-len", "8", "--batch-size", "4", "--steps", "1",
        "--threads", "1"]


@pytest.mark.parametrize(("args", "message"), [
    (["--fp8", "blockwise"], "--fp8 blockwise needs --compute-dtype bfloat16"),
    (["-n", "2", "--tp", "2", "--fp8", "blockwise", "--compute-dtype", "float16"],
     "--fp8 blockwise needs --compute-dtype bfloat16"),
    (["--optimizer", "sgd", "--exp-avg-dtype", "bfloat16"], "--optimizer sgd has none"),
    (["--fp8", "tensorwise"], "Invalid value for '--fp8'"),
])
def test_fp8_flags_misused_stop_with_one_clear_error(args, message):
    result = run_with_timeout([sys.executable, "-m", "mpiparallel", "train", *TINY, *args], 60, env=dict(os.environ))
    output = result.stdout + result.stderr
    assert result.returncode != 0 and output.count(message) == 1, output[-2000:]
    assert "Traceback" not in output


def test_the_memory_report_measures_the_bytes_of_fp8_with_bfloat16_moments_as_the_formula_says():
    """ZeRO-1 over 2 ranks with DeepSeek-V3's precision: 2 + 4 + (4 + 2·2)/2 = 10 bytes per parameter, and the
    optimizer state held (float32 master and bfloat16 moments, measured from the arrays) equals the formula."""
    shape = ["--n-layer", "2", "--n-embd", "128", "--n-head", "2", "--seq-len", "8", "--batch-size", "4", "--steps",
             "1", "--threads", "1"]  # 0.66 M parameters: bfloat16 moments save 1.3 MB, seen at 0.01 MiB
    result = run_with_timeout([sys.executable, "-m", "mpiparallel", "train", "-n", "2", *shape, "--zero", "1",
                               "--compute-dtype", "bfloat16", "--fp8", "blockwise", "--exp-avg-dtype", "bfloat16",
                               "--memory-report"], 120, env=dict(os.environ))
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    assert "bfloat16 moments" in result.stdout and "10.00 bytes per parameter (2 + 4 + 4)" in result.stdout
    for kind in ("parameters", "gradients", "optimizer_state"):
        line = next(line for line in result.stdout.splitlines() if line.strip().startswith(kind))
        held, theory = line.split("held")[0].split()[-2], line.split("theory")[1].split()[0]
        assert held == theory, line


def test_ep_dispatches_e4m3_rows_with_their_scales_and_combines_in_bfloat16():
    """FP8 dispatch on 2 EP ranks against one rank holding every expert: the same numbers (the rows are quantized
    before they move, with or without EP; measured: y and the experts' gradients bit for bit), and the forward's
    all-to-allv bytes are the formula's: off-rank rows sent × (h + 4·⌈h/128⌉) for the dispatch, off-rank rows
    received × 2h for the bfloat16 combine (h = 256: 264 bytes a row instead of 512)."""
    results = run_on_ranks(2, fp8_checks.fp8_dispatch, timeout=300)
    for rank in results:
        assert rank["rows_sent"] > 0 and rank["rows_received"] > 0, rank  # tokens do cross ranks
        assert rank["forward_bytes"] == rank["rows_sent"] * (256 + 4 * 2) + rank["rows_received"] * 2 * 256, rank
        # dx is rounded to bfloat16: BLAS may sum a row in another order in a matrix of other height, and one
        # rounding then lands on the neighbouring bfloat16 number (2⁻⁸ of the element at most)
        assert rank["y"] <= 1e-6 and rank["dx"] <= BF16_ROUNDOFF, rank
        assert max(rank["gradients"].values()) <= 1e-5, rank


def test_a_run_with_bfloat16_moments_resumes_exactly(tmp_path):
    """The bfloat16 moments go into the training checkpoint as they are: steps 3-4 after a resume are the
    uninterrupted run's, bit for bit (2 ranks, ZeRO-1, FP8)."""
    common = [sys.executable, "-m", "mpiparallel", "train", "-n", "2", *TINY[:-4], "--zero", "1", "--compute-dtype",
              "bfloat16", "--fp8", "blockwise", "--exp-avg-dtype", "bfloat16", "--threads", "1"]

    def losses(name: str, *args: str) -> list[float]:
        log = tmp_path / f"{name}.jsonl"
        result = run_with_timeout([*common, *args, "--log-json", str(log)], 180, env=dict(os.environ))
        assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
        return [json.loads(line)["loss"] for line in log.read_text().splitlines()]

    whole = losses("whole", "--steps", "4")
    checkpoints = str(tmp_path / "checkpoints")
    first = losses("first", "--steps", "2", "--checkpoint-dir", checkpoints, "--checkpoint-every", "2")
    resumed = losses("resumed", "--steps", "4", "--checkpoint-dir", checkpoints, "--resume")
    assert first + resumed == whole
