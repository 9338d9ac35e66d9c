"""The Slurm script is valid bash and passes `mpiparallel train` only options it has; the training benchmark
compares GPT-2 and llama with their PyTorch twins only when both compute the same first loss; the Open MPI root's
script says its use and refuses what it did not make."""

from __future__ import annotations

import os
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
    assert out.count("NumPy's BLAS at") == 2 and "OpenBLAS kernels" in out and "CPU capability" in out, out
    gpt2_table = _side_by_side(out.split("\none step by category")[1])
    named = ("matmul", "attention", "GELU", "LayerNorm", "cross-entropy", "embedding", "optimizer")
    for category in named:
        ours, theirs, with_calls = gpt2_table[category]
        assert ours > 0 and theirs > 0, (category, out)  # torch.profiler's operator names were recognized
        assert with_calls >= theirs, (category, out)  # + calls adds the callers' self times
    assert sum(gpt2_table[category][2] - gpt2_table[category][1] for category in named) > 0, out  # and finds some


def _side_by_side(section: str) -> dict[str, tuple[float, float, float]]:
    """{first word of a category: (ours ms, theirs ms, theirs with calls ms)} from profile_step.side_by_side's
    table, for the rows where every one of the three is there."""
    rows = {}
    for line in section.splitlines()[2:]:
        if line.startswith("step"):
            break
        cells = line[38:].split()
        if len(cells) >= 4:
            rows[line.split()[0]] = (float(cells[0]), float(cells[1]), float(cells[3]))
    return rows


def test_the_layer_profile_counts_products_inside_a_layer_as_its_matmul_part_and_detaches():
    sys.path.insert(0, str(BENCH_TRAIN.parent))
    import profile_step

    class Products:
        def forward(self, x):
            return x

    class Layer:
        products = Products()

        def forward(self, x):
            return self.products.forward(x) + 1

    layer = Layer()
    original = layer.products.forward
    profile = profile_step.LayerProfile()
    profile.wrap(layer, "linear")
    profile.wrap(layer.products, "matmul", {"forward": "forward"}, gemm=True)
    assert layer.forward(1) == 2
    assert profile.totals["linear", "forward"] >= profile.matmul["linear", "forward"] > 0
    assert ("matmul", "forward") not in profile.totals  # inside a layer: the layer's time, not its own row
    assert profile.categories(1, 1.0)["matmul"] == profile.matmul["linear", "forward"]
    profile.detach()
    assert "forward" not in vars(layer) and layer.products.forward == original


def test_the_torch_profile_counts_the_position_rows_add_and_their_gradient_as_the_embeddings():
    """Ours does the position add and d(wpe) in its embedding layer; torch's profile must put the same two operators
    in its embedding row — and neither the residual add nor a bias gradient, which look alike but for their shapes."""
    torch = pytest.importorskip("torch", reason="the profile is torch.profiler's")
    from torch.profiler import ProfilerActivity, profile

    sys.path.insert(0, str(BENCH_TRAIN.parent))
    import profile_step

    batch, length, channels = 2, 6, 8
    token_table, position_table = torch.nn.Embedding(11, channels), torch.nn.Embedding(length, channels)
    linear = torch.nn.Linear(channels, channels)
    tokens = torch.randint(0, 11, (batch, length))
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as profiler:
        x = token_table(tokens) + position_table(torch.arange(length))
        y = x + linear(x)  # a residual add, and a bias whose gradient is a sum over B·T rows
        (y * y).mean().backward()
    events = [(event.key, [list(shape) for shape in event.input_shapes])
              for event in profiler.key_averages(group_by_input_shape=True)]
    picked = sorted((name, shapes[:2]) for name, shapes in events
                    if profile_step.position_work(name, shapes, (batch, length, channels)))
    assert picked == [("aten::add", [[batch, length, channels], [length, channels]]),
                      ("aten::sum", [[batch, length, channels], []])], picked
    assert ("aten::add", [[batch, length, channels], [batch, length, channels], []]) in events  # seen, not picked
    assert any(name == "aten::sum" and shapes[0] == [batch * length, channels] for name, shapes in events)


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


BENCH_DISTRIBUTED = BENCH_TRAIN.parent / "bench_torch_distributed.py"


def test_the_distributed_benchmark_runs_ddp_and_fsdp2_on_the_same_computation():
    """train -n 2 (and --zero 3) against DDP and FSDP2 over gloo on a tiny GPT-2: both kinds run, every step's loss
    agrees, and a ratio is reported (its value is the machine's, not asserted)."""
    pytest.importorskip("torch", reason="the comparison runs torch.distributed")
    result = subprocess.run([sys.executable, str(BENCH_DISTRIBUTED), "--layers", "1", "--embd", "32", "--heads", "4",
                             "--seq", "16", "--batch-per-rank", "2", "--steps", "2", "--warmup", "1", "--repeats", "1"],
                            capture_output=True, text=True, timeout=300, cwd=BENCH_TRAIN.parent.parent)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    out = result.stdout
    assert "against DDP (gloo)" in out and "against FSDP2 (gloo)" in out, out
    drifts = [float(m) for m in re.findall(r"largest loss difference over the steps ([0-9.e+-]+)", out)]
    assert len(drifts) == 2 and max(drifts) < 1e-4, out
    assert re.search(r"summary: ddp [0-9.]+×, fsdp [0-9.]+×", out), out


GPU_CHECK = BENCH_TRAIN.parent / "gpu_check.sh"


def test_the_gpu_checks_cpu_groups_run_without_a_gpu_and_pass_only_options_the_benchmarks_have(tmp_path):
    """The `cpu` and `cpu-124m` groups (issue 47's comparison on a lent machine's host CPU) need no GPU: here the
    host's line is written and each benchmark step starts — a one-second STEP_TIMEOUT then ends it (exit 124), so
    the test costs seconds; what the steps print is bench_train's and bench_torch_distributed's own tests' matter."""
    text = GPU_CHECK.read_text()
    for group, script in (("cpu", BENCH_TRAIN), ("cpu", BENCH_DISTRIBUTED), ("cpu-124m", BENCH_TRAIN)):
        body = text.split(f"\n    {group})\n", 1)[1].split(";;", 1)[0]
        command = next(part for part in body.split('"$PYTHON" ')[1:] if part.startswith(f"scripts/{script.name}"))
        command = command.split("\n        step ", 1)[0]  # to the next step
        help_text = subprocess.run([sys.executable, str(script), "--help"], capture_output=True, text=True,
                                   timeout=120, check=True).stdout
        used = set(re.findall(r"(--[a-z][a-z-]+)", command))
        assert used and used <= set(re.findall(r"(--[a-z][a-z-]+)", help_text)), (group, sorted(used))
    finished = subprocess.run(["bash", str(GPU_CHECK), str(tmp_path / "report"), "cpu", "cpu-124m"],
                              capture_output=True, text=True, timeout=120, env={**os.environ, "STEP_TIMEOUT": "1"})
    assert "no GPU to check" not in finished.stderr, finished.stderr
    report = (tmp_path / "report" / "report.md").read_text()
    assert re.search(r"host CPU: .+, \d+ logical CPUs; ", report), report
    for step in ("cpu-train-gpt2", "cpu-ddp-fsdp2", "cpu-train-gpt2-124m"):
        assert f"## {step} — FAILED (exit 124)" in report, report  # reached, and ended by the step timeout
    assert finished.returncode == 1 and (tmp_path / "report" / "logs.tar.gz").exists()


OPEN_MPI_ROOT = SLURM.parent / "open_mpi_root.sh"


def test_the_open_mpi_root_script_says_its_use_and_refuses_a_folder_it_did_not_make(tmp_path):
    """`--help` prints the three commands (exit 0); no command or an unknown one prints them as an error (exit 2);
    `run` in a folder that is not a root it made is one line naming `make`, with nothing mounted (making a root
    takes debootstrap and five minutes: docs/clusters.md has what it measured inside one)."""
    def script(*arguments: str) -> subprocess.CompletedProcess:
        return subprocess.run(["bash", str(OPEN_MPI_ROOT), *arguments], capture_output=True, text=True, timeout=30)

    told = script("--help")
    assert told.returncode == 0 and all(f"open_mpi_root.sh {command}" in told.stdout
                                        for command in ("make", "run", "unmount")), told
    for wrong in ([], ["remake"], ["run", str(tmp_path)]):
        refused = script(*wrong)
        assert refused.returncode == 2 and "open_mpi_root.sh make [ROOT]" in refused.stderr, (wrong, refused)
    refused = script("run", str(tmp_path), "true")
    assert refused.returncode == 1 and refused.stderr.strip() == \
        f"{tmp_path} is not a root this script made: scripts/open_mpi_root.sh make {tmp_path}", refused
    assert subprocess.run(["mountpoint", "-q", str(tmp_path)], timeout=30).returncode != 0  # nothing mounted
