"""The Slurm script is valid bash and passes `mpiparallel train` only options it has; the training benchmark
compares GPT-2 and llama with their PyTorch twins only when both compute the same first loss."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

SLURM = Path(__file__).resolve().parents[2] / "scripts" / "slurm_train.sh"


def test_the_slurm_script_parses_and_uses_only_real_train_options():
    subprocess.run(["bash", "-n", str(SLURM)], check=True, timeout=30)
    command = SLURM.read_text().split("\nsrun ", 1)[1]
    used = set(re.findall(r"(--[a-z][a-z-]+)", command)) - {"--mpi"}  # srun's own option
    help_text = subprocess.run([sys.executable, "-m", "mpiparallel", "train", "--help"], capture_output=True,
                               text=True, timeout=60, check=True).stdout
    offered = set(re.findall(r"(--[a-z][a-z-]+)", help_text))
    assert used and used <= offered, sorted(used - offered)


BENCH_TRAIN = Path(__file__).resolve().parents[2] / "scripts" / "bench_train.py"
TINY_MODELS = ["--layers", "1", "--embd", "32", "--heads", "4", "--kv-heads", "2", "--ffn-hidden", "48", "--seq", "16",
               "--batch", "2", "--steps", "2", "--warmup", "1"]


def _bench_train(*args: str, patch: str = "pass") -> subprocess.CompletedProcess:
    """scripts/bench_train.py ARGS in a fresh interpreter, after the Python statement `patch`."""
    program = (f"import sys; sys.path.insert(0, {str(BENCH_TRAIN.parent)!r}); import bench_train; {patch}; "
               "bench_train.main(sys.argv[1:])")
    return subprocess.run([sys.executable, "-c", program, *args], capture_output=True, text=True, timeout=300,
                          cwd=BENCH_TRAIN.parent.parent)


def test_the_training_benchmark_compares_gpt2_and_llama_on_the_same_computation():
    pytest.importorskip("transformers", reason="the llama comparison runs transformers' LlamaForCausalLM")
    result = _bench_train(*TINY_MODELS, "--model", "both", "--profile")
    assert result.returncode == 0, result.stderr[-3000:]
    out = result.stdout
    assert out.count("first step agrees") == 2, out  # GPT-2 vs torch, llama vs transformers
    assert "LlamaForCausalLM (attention eager" in out and "4 heads of 8 / 2 KV heads, SwiGLU 48" in out, out
    summary = out.split("\nsummary (tokens/s")[1].splitlines()[1:]
    assert [line.split()[0] for line in summary if line.strip()] == ["gpt2", "llama"], out
    assert all("ratio ours/theirs" in line for line in summary if line.strip()), out
    for layer in ("rmsnorm", "rope", "swiglu", "linear q|k|v", "linear gate|up", "gelu", "adamw"):
        assert f"\n{layer} " in out, layer  # both profiles' rows


SHIFTED_LOSS = ("forward = bench_train.TransformersLlama.forward; "
                "bench_train.TransformersLlama.forward = lambda self, *a: forward(self, *a) + 1e-2")
SCALED_KEYS = ("import torch; init = bench_train.TransformersLlama.__init__; "
               "bench_train.TransformersLlama.__init__ = lambda self, *a: (init(self, *a), "
               "torch.no_grad()(self.llama.model.layers[0].self_attn.k_proj.weight.mul_)(1.01))[0]")


@pytest.mark.parametrize("patch", [SHIFTED_LOSS, SCALED_KEYS], ids=["loss-shifted", "keys-scaled"])
def test_the_training_benchmark_stops_when_the_first_step_differs(patch):
    """A different loss stops it, and so does a weight the first loss hardly sees (K at initialization, 1% off:
    the loss is unchanged to float32 precision, the gradients are not)."""
    pytest.importorskip("transformers", reason="the llama comparison runs transformers' LlamaForCausalLM")
    result = _bench_train(*TINY_MODELS, "--model", "llama", patch=patch)
    assert result.returncode != 0
    assert "first step DIFFERS" in result.stderr and "not compared" in result.stderr, result.stderr[-2000:]
    assert "tokens/s" not in result.stdout  # no timings reported for different computations
