"""Bad input, for every command and every parallel axis, ends with one clear message and a non-zero exit.

Each row runs the command as a user would (multi-rank rows with `-n 2`, which starts the ranks through mpiexec,
or under a bare `mpiexec -n 2`), and checks: a non-zero exit within 10 s, the row's message exactly once, exactly
one "Error" line, and no Python traceback. Most errors are found before any rank starts or right at its start.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest
from mpi_harness import mpiexec_path, run_with_timeout

import mpiparallel
from mpiparallel.errors import ExitCode

TINY = ["--n-layer", "2", "--n-embd", "16", "--n-head", "2", "--seq-len", "8", "--batch-size", "4", "--steps", "1",
        "--threads", "1"]
TEXT = str(Path(mpiparallel.__file__))  # a text file, read as bytes: no data.json names its end-of-text id
MPIEXEC = "mpiexec"
"""A row starting with this runs under a bare `mpiexec -n 2` instead of starting its own ranks."""

INVALID = [
    # train: the mesh and its axes
    ("dp", ["train", *TINY, "--dp", "3"], "does not match the 1 ranks running"),
    ("tp-ranks", ["train", "-n", "2", *TINY, "--tp", "3"], "2 ranks cannot be split into tp·pp·cp = 3·1·1"),
    ("tp-heads", ["train", "-n", "2", *TINY, "--tp", "2", "--n-head", "3"], "must be divisible by n_head (3)"),
    ("llama-option-on-gpt2", ["train", *TINY, "--n-kv-head", "1"],
     "--n-kv-head set(s) a llama choice: add --arch llama"),
    ("kv-heads-group", ["train", *TINY, "--arch", "llama", "--n-kv-head", "3"],
     "n_head (2) must be divisible by n_kv_head (3)"),
    ("tp-kv-heads", ["train", "-n", "2", *TINY, "--arch", "llama", "--n-head", "6", "--n-embd", "24", "--n-kv-head",
                     "3", "--tp", "2"], "n_kv_head (3) and tp (2) must divide one another"),
    ("ulysses-kv-heads", ["train", "-n", "2", *TINY, "--arch", "llama", "--n-head", "6", "--n-embd", "24",
                          "--n-kv-head", "3", "--cp", "2", "--cp-attention", "ulysses"],
     "the 3 KV head(s) per tensor-parallel rank and cp must divide one another"),
    ("sp-without-tp", ["train", *TINY, "--sp"], "--sp (sequence parallelism) works inside a tensor-parallel group"),
    ("sp-seq-len", ["train", "-n", "2", *TINY, "--tp", "2", "--sp", "--seq-len", "7"],
     "--seq-len 7 must be divisible by 2"),
    ("pp-layers", ["train", "-n", "2", *TINY, "--pp", "2", "--n-layer", "1"],
     "2 pipeline stages (pp × virtual stages) but only 1 layers"),
    ("schedule-name", ["train", "-n", "2", *TINY, "--pp", "2", "--schedule", "pipedream"],
     "Invalid value for '--schedule': 'pipedream' is not one of"),
    ("schedule-microbatches", ["train", "-n", "2", *TINY, "--pp", "2", "--schedule", "zb", "--microbatches", "1"],
     "zb needs at least pp microbatches to fill its cooldown: 1 < pp = 2"),
    ("virtual-stages-without-pp", ["train", *TINY, "--virtual-stages", "2"], "--virtual-stages needs a pipeline"),
    ("global-aux-without-coefficient", ["train", *TINY, "--arch", "deepseek_v3", "--experts", "4",
                                        "--moe-aux-scope", "global"], "--moe-aux-scope global forms the Switch aux"),
    # train: packed documents
    ("document-without-eot", ["train", *TINY, "--attention", "document", "--data", TEXT],
     "has no data.json that names one; give --eot-id N"),
    ("document-eot-outside-vocab", ["train", *TINY, "--attention", "document", "--data", TEXT, "--eot-id", "300"],
     "--eot-id 300 is not a token of the model's vocabulary of 256"),
    ("document-with-mtp", ["train", *TINY, "--attention", "document", "--arch", "deepseek_v3", "--mtp-depth", "1"],
     "--attention document with --mtp-depth is not built yet"),
    ("virtual-stages-1f1b", ["train", "-n", "2", *TINY, "--pp", "2", "--virtual-stages", "2"],
     "1f1b has one stage per rank; virtual stages are for interleaved only"),
    ("zero-range", ["train", *TINY, "--zero", "4"], "Invalid value for '--zero': 4 is not in the range 0<=x<=3"),
    ("pp-ranks", ["train", "-n", "3", *TINY, "--pp", "2"],
     "3 ranks cannot be split into tp·pp·cp = 1·2·1 = 2 model-parallel groups"),
    ("microbatches", ["train", "-n", "2", *TINY, "--microbatches", "3"],
     "--batch-size 4 must be divisible by dp × microbatches = 2 × 3 = 6"),
    ("cp-seq-len", ["train", "-n", "2", *TINY, "--cp", "2", "--seq-len", "6"],
     "--cp 2 cuts each sequence into 2·cp = 4 chunks: --seq-len 6 must be divisible by 4"),
    ("cp-attention", ["train", *TINY, "--cp-attention", "striped"],
     "Invalid value for '--cp-attention': 'striped' is not one of"),
    ("cp-ulysses-heads", ["train", "-n", "2", *TINY, "--cp", "2", "--cp-attention", "ulysses", "--n-head", "3",
                          "--n-embd", "18"], "n_head (3) must be divisible by 2"),
    ("ep-without-experts", ["train", "-n", "2", *TINY, "--ep", "2"], "--ep 2 spreads experts over ranks"),
    ("ep-experts", ["train", "-n", "2", *TINY, "--ep", "2", "--experts", "3"], "--ep 2 must divide --experts 3"),
    ("ep-range", ["train", *TINY, "--ep", "0"], "Invalid value for '--ep': 0 is not in the range x>=1"),
    ("top-k", ["train", *TINY, "--experts", "2", "--top-k", "3"], "'--top-k': each token goes to top-k of the "
                                                                   "experts: 3 is more than --experts 2"),
    ("recompute", ["train", *TINY, "--recompute", "everything"],
     "Invalid value for '--recompute': 'everything' is not one of"),
    # train: files and the rest
    ("data", ["train", *TINY, "--data", "/nonexistent/data.txt"], "/nonexistent/data.txt does not exist"),
    ("init", ["train", *TINY, "--init", "/nonexistent/model"], "/nonexistent/model does not exist"),
    ("resume", ["train", *TINY, "--resume"], "--resume needs --checkpoint-dir"),
    ("trace-folder", ["train", "-n", "2", *TINY, "--trace", "/nonexistent/dir/run.json"],
     "the folder of /nonexistent/dir/run.json does not exist"),
    ("log-json-folder", ["train", *TINY, "--log-json", "/nonexistent/dir/log.jsonl"],
     "the folder of /nonexistent/dir/log.jsonl does not exist"),
    ("dtype", ["train", *TINY, "--dtype", "float16"], "Invalid value for '--dtype': 'float16' is not one of"),
    ("ranks", ["train", "-n", "0", *TINY], "Invalid value for '-n' / '--np': 0 is not in the range x>=1"),
    ("ranks-under-mpiexec", [MPIEXEC, "train", "-n", "3", *TINY], "-n 3 asks for 3 ranks"),
    ("tp-under-mpiexec", [MPIEXEC, "train", *TINY, "--tp", "2", "--n-head", "3"], "must be divisible by n_head (3)"),
    # bench
    ("bench-collective", ["bench", "nonsense"], "Invalid value for 'COLLECTIVE': 'nonsense' is not one of"),
    ("bench-algo", ["bench", "all_reduce", "-n", "2", "--algo", "nonsense"], "all_reduce has no algorithm 'nonsense'"),
    ("bench-sizes", ["bench", "all_reduce", "-b", "1M", "-e", "1K"], "-b/--minbytes (1048576) is larger than"),
    ("bench-steps", ["bench", "all_reduce", "-f", "2", "-i", "8"], "exclude each other"),
    ("bench-datatype", ["bench", "all_reduce", "-d", "badtype"], "'badtype' is not one of"),
    ("bench-root", ["bench", "broadcast", "-n", "2", "--root", "5"], "--root 5 is not a rank of this 2-rank job"),
    # verify
    ("verify-collective", ["verify", "--collective", "nonsense"], "'nonsense' is not one of"),
    ("verify-datatype", ["verify", "-d", "float128"], "'float128' is not one of"),
    ("verify-against", ["verify", "--against", "gloo"], "'gloo' is not one of 'mpi', 'nccl'"),
    # schedule
    ("schedule-fill", ["schedule", "--schedule", "zb", "--pp", "4", "--microbatches", "3"],
     "zb needs at least pp microbatches to fill its cooldown: 3 < pp = 4"),
    ("schedule-costs", ["schedule", "--costs", "1,2"], "'1,2' is not three times F,I,W"),
    ("schedule-pp", ["schedule", "--pp", "0"], "Invalid value for '--pp': 0 is not in the range x>=1"),
    ("schedule-trace", ["schedule", "--trace", "/nonexistent/dir/plan.json"],
     "cannot write /nonexistent/dir/plan.json"),
    # checkpoint
    ("checkpoint-missing", ["checkpoint", "info", "/nonexistent/checkpoints"],
     "/nonexistent/checkpoints does not exist"),
    ("checkpoint-empty", ["checkpoint", "info", "/etc"], "/etc holds no training checkpoint"),
    # generate, and the program itself
    ("generate-init-missing", ["generate"], "Missing option '--init'"),
    ("generate-init", ["generate", "--init", "/nonexistent/model"], "/nonexistent/model does not exist"),
    ("generate-prompts", ["generate", "--init", ".", "--prompt", "a", "--prompt-ids", "1"],
     "give --prompt or --prompt-ids, not both"),
    ("generate-prompt-ids", ["generate", "--init", ".", "--prompt-ids", "a,b"],
     "'a,b' is not a comma-separated list of integers"),
    ("command", ["nonsense"], "No such command 'nonsense'"),
]


def test_the_table_covers_every_command_and_axis():
    arguments = [" ".join(args) for _, args, _ in INVALID]
    assert len(INVALID) >= 25
    for command in ("train", "bench", "verify", "schedule", "generate", "checkpoint"):
        assert any(args[0] == command or args[:2] == [MPIEXEC, command] for _, args, _ in INVALID), command
    for option in ("--dp", "--tp", "--sp", "--pp", "--cp", "--ep", "--zero", "--schedule", "--microbatches",
                   "--virtual-stages", "--experts", "--top-k", "--recompute", "--data", "--init", "--resume"):
        assert any(f" {option} " in f" {text} " for text in arguments), option


@pytest.mark.parametrize("arguments, message", [(args, message) for _, args, message in INVALID],
                         ids=[name for name, _, _ in INVALID])
def test_an_invalid_invocation_ends_with_one_clear_message(tmp_path, arguments, message):
    launcher = [mpiexec_path(), "-n", "2"] if arguments[0] == MPIEXEC else []
    arguments = arguments[1:] if launcher else arguments
    start = time.monotonic()
    finished = run_with_timeout([*launcher, sys.executable, "-m", "mpiparallel", *arguments], 10, cwd=tmp_path)
    output = finished.stdout + finished.stderr
    assert finished.returncode == ExitCode.BAD_INPUT and time.monotonic() - start < 10, output
    assert output.count(message) == 1, output
    assert sum(line.startswith("Error") for line in output.splitlines()) == 1, output
    assert "Traceback" not in output and "failed:" not in output, output
