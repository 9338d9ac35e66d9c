"""The `mpiparallel` command line (click): argument parsing and the hand-off to each command's module.

Everything here is cheap to import: the commands import NumPy, mpi4py and `collectives` only once they run,
after `-n` has (re)launched the ranks, so `--help` is instant and a relaunching parent never starts MPI.
Options that can be checked without MPI are checked before the relaunch (one message, no ranks started); the
rest is checked on every rank and reported once by `launch.run_guarded`.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import sys
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NoReturn

import click

from .. import __version__, process
from ..jobs import launch
from ..jobs.stall import TIMEOUT_VARIABLE as STALL_TIMEOUT_VARIABLE
from ..jobs.stall import StallWatch
from ..train.settings import default
from .checkpoint import checkpoint as checkpoint_command
from .cluster import cluster as cluster_command
from .data import data as data_command
from .debug import debug as debug_command
from .option_needs import check_needs
from .plan import plan as plan_command
from .plot import plot as plot_command
from .schedule import schedule as schedule_command

BENCH_COLLECTIVES = ("all_reduce", "reduce_scatter", "all_gather", "alltoall", "broadcast", "reduce", "sendrecv")
REDUCTION_OPS = ("sum", "prod", "max", "min", "avg")

DATATYPES = {
    "float": "float32", "float32": "float32",
    "double": "float64", "float64": "float64",
    "half": "float16", "float16": "float16",
    "bfloat16": "bfloat16",
    "int32": "int32", "int": "int32",
    "int64": "int64",
}
"""nccl-tests' datatype names and their aliases, mapped to NumPy dtype names."""

_BYTE_SUFFIXES = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


class ByteSize(click.ParamType):
    """A byte count with an optional K, M or G suffix (powers of 1024), as nccl-tests reads -b and -e."""

    name = "bytes"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> int:
        if isinstance(value, int):
            return value
        text = str(value).strip().upper().removesuffix("B")
        number, suffix = (text[:-1], text[-1]) if text[-1:] in _BYTE_SUFFIXES else (text, "")
        try:
            size = int(number) * _BYTE_SUFFIXES[suffix]
        except ValueError:
            self.fail(f"{value!r} is not a byte count like 8, 64K, 1M or 2G", param, ctx)
        if size < 0:
            self.fail(f"{value!r} is negative", param, ctx)
        return size


class _Program(click.Group):
    """The top-level group; its `main` routes every outcome through `launch.run_guarded`.

    click's standalone mode would print a usage error on every rank and turn an exception into a traceback
    per rank; here click only parses and raises, and `run_guarded` decides who reports and how the job ends.
    The raw arguments are kept on the root context so that `-n` can relaunch with them.
    """

    def main(self, args: Sequence[str] | None = None, prog_name: str | None = None, **extra: Any) -> NoReturn:
        argv = list(sys.argv[1:] if args is None else args)
        parse_and_run = functools.partial(super().main, argv, prog_name or "mpiparallel",
                                          standalone_mode=False, obj={"argv": argv}, **extra)
        launch.run_guarded(parse_and_run)


def _argv(ctx: click.Context) -> list[str]:
    root = ctx.find_root()
    return list(root.obj["argv"]) if isinstance(root.obj, dict) else sys.argv[1:]


check_collectives_option = click.option(
    "--check-collectives", is_flag=True,
    help="Every collective first checks across its ranks that all call it with the same operation, shape, dtype, "
         "algorithm and root (one small all-gather per call, timed with it): a mismatch ends the job with one clear "
         "error on every rank instead of a hang. MPIPARALLEL_CHECK=1 does the same.")


def _check_every_collective(enabled: bool) -> None:
    """--check-collectives on a rank: every Communicator made from now on checks (`Communicator.check_arguments`,
    read from MPIPARALLEL_CHECK when one is made)."""
    if enabled:
        from collectives.communicator import CHECK_ARGUMENTS_VARIABLE

        os.environ[CHECK_ARGUMENTS_VARIABLE] = "1"


HOSTFILE = "mpiparallel.hostfile"
"""Where `--hostfile` is kept in the click context's meta, for each command's `launch.ensure_world_size`."""


def ranks_option(command: Callable) -> Callable:
    """The `-n/--np N` and `--hostfile FILE` options every multi-rank command takes."""
    command = click.option(
        "--hostfile", type=click.Path(dir_okay=False, path_type=Path), default=None, metavar="FILE",
        expose_value=False, callback=lambda ctx, param, value: ctx.meta.__setitem__(HOSTFILE, value),
        help="Start the ranks on the hosts of this MPICH hostfile (host:slots per line): through its launcher if "
             "`mpiparallel cluster up` wrote it, else `mpiexec -f FILE`. Default -n: one rank per slot.",
    )(command)
    return click.option(
        "-n", "--np", "ranks", type=click.IntRange(min=1), default=None, metavar="N",
        help="Number of ranks. Outside MPI, relaunch as `mpiexec -n N python -m mpiparallel ...`; "
             "under mpiexec/srun it must equal the job's rank count. Default: the ranks already running.",
    )(command)


@click.group(cls=_Program, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="mpiparallel")
def main() -> None:
    """Distributed LLM training written by hand over MPI.

    Every command runs unchanged under `mpiexec -n N mpiparallel ...` or `srun -n N mpiparallel ...`, or
    starts its own ranks with `-n N`. Set MPIPARALLEL_DEBUG=1 to see full tracebacks.
    """


# -- bench --------------------------------------------------------------------------------------------------

@main.command(context_settings={"show_default": True})
@click.argument("collective", type=click.Choice(BENCH_COLLECTIVES), required=False, metavar="COLLECTIVE")
@ranks_option
@click.option("-b", "--minbytes", type=ByteSize(), default="8", help="Smallest message size (K/M/G suffixes).")
@click.option("-e", "--maxbytes", type=ByteSize(), default="64M", help="Largest message size (K/M/G suffixes).")
@click.option("-f", "--stepfactor", type=click.IntRange(min=2), default=None,
              help="Multiply the size by this factor between rows. [default: 2]")
@click.option("-i", "--stepbytes", type=ByteSize(), default=None,
              help="Add this many bytes between rows instead (exclusive with -f).")
@click.option("--iters", type=click.IntRange(min=1), default=20, help="Timed calls per size.")
@click.option("-w", "--warmup_iters", "warmup_iters", type=click.IntRange(min=0), default=5,
              help="Untimed calls per size before timing.")
@click.option("-c", "--check", type=click.IntRange(0, 1), default=1, help="Check results against exact values.")
@click.option("-d", "--datatype", type=click.Choice(list(DATATYPES), case_sensitive=False), default="float",
              help="Element type (nccl-tests names).")
@click.option("-o", "--op", type=click.Choice(REDUCTION_OPS), default="sum",
              help="Reduction operator (all_reduce, reduce_scatter, reduce).")
@click.option("--root", type=click.IntRange(min=0), default=0, help="Root rank of broadcast and reduce.")
@click.option("--algo", default="auto",
              help="Algorithm: auto (the cost model's choice per size), mpi (the library's own), or a "
                   "hand-written one; a wrong name lists the valid ones.")
@click.option("--compare", type=click.Choice(["mpi", "nccl"]), default=None,
              help="Also time the MPI library's own collective, or NCCL's (on GPU buffers), interleaved per "
                   "size, and print its busbw and the ratio of its time to ours.")
@click.option("--device", type=click.Choice(["cpu", "gpu"]), default=None,
              help="Where the buffers live: NumPy arrays, or CuPy arrays on each rank's GPU (local rank mod GPU "
                   "count); timings wait for the GPU. [default: gpu with --compare nccl, else cpu]")
@click.option("--calibrate", is_flag=True,
              help="Measure the cost model's alpha, beta and gamma first and save them for algo=auto.")
@click.option("--json", "json_path", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Also write the rows and run metadata to this JSON file.")
@click.option("--plot", "plot_path", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Also draw bus bandwidth against size to this image (needs matplotlib).")
@check_collectives_option
@click.pass_context
def bench(ctx: click.Context, collective: str | None, ranks: int | None, minbytes: int, maxbytes: int,
          stepfactor: int | None, stepbytes: int | None, iters: int, warmup_iters: int, check: int, datatype: str,
          op: str, root: int, algo: str, compare: str | None, device: str | None, calibrate: bool,
          json_path: Path | None, plot_path: Path | None, check_collectives: bool) -> None:
    """Bandwidth benchmark of one collective, printed as nccl-tests prints it.

    COLLECTIVE is one of all_reduce, reduce_scatter, all_gather, alltoall, broadcast, reduce, sendrecv.
    Each row is one message size: time in microseconds (slowest rank's average), algbw = size/time and
    busbw = algbw x the bus factor (2(n-1)/n for all_reduce, (n-1)/n for reduce_scatter, all_gather and
    alltoall, 1 otherwise) in GB/s, and #wrong, the elements that differ from the exact result. `size` is
    the largest buffer (the gathered output of all_gather, the whole input of reduce_scatter and alltoall);
    `count` is the elements per rank. With --calibrate and no COLLECTIVE it only calibrates.

    --device gpu runs on GPU buffers (our collectives through MPI: CUDA-aware, or staged through host
    memory); --compare nccl (which implies --device gpu) adds NCCL's busbw and vs-nccl = NCCL time / ours.
    Ranks that share a GPU need NCCL >= 2.30; NCCL_MULTI_RANK_GPU_ENABLE=1 is set for them when unset.

    \b
    Examples:
      mpiparallel bench all_reduce -n 4 --compare mpi
      mpiparallel bench all_reduce -n 2 --compare nccl -e 256M
      mpiparallel bench all_gather -n 2 -b 1K -e 16M -d double --algo ring
      mpiexec -n 8 mpiparallel bench reduce_scatter -o max --json rs.json --plot rs.png
    """
    if collective is None and not calibrate:
        raise click.UsageError("missing argument COLLECTIVE (or pass --calibrate to only calibrate)")
    if stepfactor is not None and stepbytes is not None:
        raise click.UsageError("-f/--stepfactor and -i/--stepbytes exclude each other; give one")
    if stepbytes == 0:
        raise click.BadParameter("must be positive", param_hint="'-i' / '--stepbytes'")
    if minbytes > maxbytes:
        raise click.UsageError(f"-b/--minbytes ({minbytes}) is larger than -e/--maxbytes ({maxbytes})")
    if compare == "nccl" and device == "cpu":
        raise click.BadParameter("--compare nccl times NCCL on GPU buffers; leave out --device or pass --device gpu",
                                 param_hint="'--device'")
    _check_plotting(plot_path)
    launch.ensure_world_size(ranks, _argv(ctx), ctx.meta.get(HOSTFILE))
    _check_every_collective(check_collectives)

    from . import bench as benchmark

    if collective is not None and algo not in benchmark.valid_algorithms(collective):
        raise click.BadParameter(f"{collective} has no algorithm {algo!r}; "
                                 f"valid: {', '.join(benchmark.valid_algorithms(collective))}",
                                 param_hint="'--algo'")
    settings = benchmark.BenchSettings(
        collective=collective, minbytes=minbytes, maxbytes=maxbytes, stepfactor=stepfactor or 2,
        stepbytes=stepbytes, iters=iters, warmup_iters=warmup_iters, check=bool(check),
        datatype=DATATYPES[datatype.lower()], op=op, root=root, algo=algo, compare=compare,
        device=device or ("gpu" if compare == "nccl" else "cpu"), calibrate=calibrate, json_path=json_path,
        plot_path=plot_path)
    ctx.exit(benchmark.run(settings))


def _check_plotting(plot_path: Path | None) -> None:
    """Fail before any rank starts if --plot cannot work."""
    if plot_path is not None and importlib.util.find_spec("matplotlib") is None:
        raise click.BadParameter("drawing needs matplotlib: pip install matplotlib", param_hint="'--plot'")


# -- verify -------------------------------------------------------------------------------------------------

VERIFY_COLLECTIVES = ("all_reduce", "reduce_scatter", "all_gather", "all_to_all", "all_to_allv", "broadcast",
                      "reduce")
VERIFY_DATATYPES = ("float16", "bfloat16", "float32", "float64", "int32", "int64")


@main.command(context_settings={"show_default": True})
@click.option("--against", type=click.Choice(["mpi", "nccl"]), default="mpi",
              help="Reference library whose collectives define the right answer: the MPI library's own "
                   "collectives, or NVIDIA's NCCL through CuPy (on GPU buffers).")
@click.option("--device", type=click.Choice(["cpu", "gpu"]), default=None,
              help="Where the buffers live: NumPy arrays, or CuPy arrays on each rank's GPU (local rank mod GPU "
                   "count), our collectives still talking through MPI. [default: gpu with --against nccl, "
                   "else cpu]")
@ranks_option
@click.option("--max-count", type=click.IntRange(min=0), default=(1 << 20) + 3,
              help="Largest count in the size sweep (elements per rank block).")
@click.option("--collective", "collectives", type=click.Choice(VERIFY_COLLECTIVES), multiple=True,
              help="Verify only this collective (repeatable). [default: all]")
@click.option("-d", "--datatype", "datatypes", type=click.Choice(VERIFY_DATATYPES), multiple=True,
              help="Verify only this datatype (repeatable). [default: all]")
@click.option("--seed", type=int, default=0, help="Seed of every rank's random inputs.")
@check_collectives_option
@click.pass_context
def verify(ctx: click.Context, against: str, device: str | None, ranks: int | None, max_count: int,
           collectives: tuple[str, ...], datatypes: tuple[str, ...], seed: int, check_collectives: bool) -> None:
    """Check every hand-written algorithm against a reference library, element for element.

    Runs each collective x algorithm x datatype x op (x root for broadcast and reduce) over a sweep of
    counts (0, 1, small odd counts, counts not divisible by the rank count, up to --max-count) with random
    integer-valued inputs, so that every result is exact and must equal the reference bit for bit. Prints
    one row per collective, algorithm, datatype and op, with #wrong = mismatched output elements (plus input
    elements the call modified) summed over ranks and sizes. Exits 0 iff no row is wrong.

    --against nccl runs on GPU buffers: our collectives (through MPI, CUDA-aware or staged through host
    memory) against NCCL's on the same CuPy arrays. It needs CuPy with NCCL and a GPU on every rank; ranks
    that share a GPU need NCCL >= 2.30, and NCCL_MULTI_RANK_GPU_ENABLE=1 is set for them when unset.

    \b
    Examples:
      mpiparallel verify --against mpi -n 4
      mpiexec -n 3 mpiparallel verify --max-count 10000 --collective all_reduce -d float16
      mpiparallel verify --against nccl -n 2 --max-count 100000
      mpiparallel verify --against mpi --device gpu -n 2
    """
    if against == "nccl" and device == "cpu":
        raise click.BadParameter("NCCL runs on GPU buffers only; leave out --device or pass --device gpu",
                                 param_hint="'--device'")
    launch.ensure_world_size(ranks, _argv(ctx), ctx.meta.get(HOSTFILE))
    _check_every_collective(check_collectives)

    from . import verify as verification

    settings = verification.VerifySettings(against=against, device=device, max_count=max_count,
                                           collectives=collectives or VERIFY_COLLECTIVES,
                                           datatypes=datatypes or VERIFY_DATATYPES, seed=seed)
    ctx.exit(verification.run(settings))


# -- train and generate -------------------------------------------------------------------------------------

def threads_option(command: Callable) -> Callable:
    return click.option(
        "--threads", type=click.IntRange(min=1), default=None,
        help="BLAS threads per rank. [default: the cores the node's load average leaves free, divided by its "
             "ranks, at least 1 (on a busy machine spinning BLAS threads fight other jobs); OMP_NUM_THREADS and "
             "OPENBLAS_NUM_THREADS, if set, win]")(command)


def deepseek_options(command: Callable) -> Callable:
    """The DeepSeek-V3 family's options of `train` (`--arch deepseek_v3`; models/deepseek_v3.py)."""
    options = [
        click.option("--q-lora-rank", type=click.IntRange(min=1), default=default("q_lora_rank"),
                     help="deepseek_v3: query down-projection rank (q_a_proj). [default: none, one q_proj]"),
        click.option("--kv-lora-rank", type=click.IntRange(min=1), default=default("kv_lora_rank"),
                     help="deepseek_v3: compressed KV latent channels. [default: n_embd/4]"),
        click.option("--qk-nope-head-dim", type=click.IntRange(min=1), default=default("qk_nope_head_dim"),
                     help="deepseek_v3: query/key channels per head without RoPE. [default: n_embd/n_head]"),
        click.option("--qk-rope-head-dim", type=click.IntRange(min=2), default=default("qk_rope_head_dim"),
                     help="deepseek_v3: RoPE channels per head, one key shared by all heads. [default: half the "
                          "nope width, even]"),
        click.option("--v-head-dim", type=click.IntRange(min=1), default=default("v_head_dim"),
                     help="deepseek_v3: value channels per head. [default: n_embd/n_head]"),
        click.option("--moe-ffn-hidden", type=click.IntRange(min=1), default=default("moe_ffn_hidden"),
                     help="deepseek_v3: SwiGLU width of each routed and shared expert. [default: ffn_hidden/8]"),
        click.option("--shared-experts", type=click.IntRange(min=0), default=default("shared_experts"),
                     help="deepseek_v3: always-on shared experts (one SwiGLU shared-experts × moe-ffn-hidden wide)."),
        click.option("--n-group", type=click.IntRange(min=1), default=default("n_group"),
                     help="deepseek_v3: expert groups of group-limited routing (DeepSeek-V3: the nodes)."),
        click.option("--topk-group", type=click.IntRange(min=1), default=default("topk_group"),
                     help="deepseek_v3: groups each token may use, the best by their top-2 scores' sum."),
        click.option("--routed-scaling-factor", type=click.FloatRange(min=0, min_open=True),
                     default=default("routed_scaling_factor"),
                     help="deepseek_v3: factor on the routed experts' gates."),
        click.option("--first-k-dense", type=click.IntRange(min=0), default=default("first_k_dense"),
                     help="deepseek_v3: the first blocks keep a dense MLP (first_k_dense_replace)."),
        click.option("--moe-seq-aux-coef", type=click.FloatRange(min=0), default=default("moe_seq_aux_coef"),
                     help="deepseek_v3: α of the sequence-wise balance loss (DeepSeek-V3 eq. 17–20)."),
        click.option("--mtp-depth", type=click.IntRange(min=0), default=default("mtp_depth"),
                     help="deepseek_v3: multi-token-prediction modules, module k predicting the token k + 1 ahead."),
        click.option("--mtp-weight", type=click.FloatRange(min=0, min_open=True), default=default("mtp_weight"),
                     help="deepseek_v3: λ, the MTP losses' weight (λ/D each)."),
    ]
    for option in reversed(options):
        command = option(command)
    return command


@main.command(context_settings={"show_default": True})
@ranks_option
@click.option("--n-layer", type=click.IntRange(min=1), default=default("n_layer"), help="Transformer blocks.")
@click.option("--n-head", type=click.IntRange(min=1), default=default("n_head"), help="Attention heads.")
@click.option("--n-embd", type=click.IntRange(min=1), default=default("n_embd"), help="Channels.")
@click.option("--vocab-size", type=click.IntRange(min=1), default=default("vocab_size"),
              help="Vocabulary. [default: the data folder's tokenizer (data.json; 2,048 without --data), else 256 "
                   "(bytes)]")
@click.option("--arch", type=click.Choice(["gpt2", "llama", "deepseek_v3"]), default=default("arch"),
              help="Model family of a model from scratch: gpt2 (learned positions, LayerNorm, GELU, tied head), "
                   "llama (RoPE, RMSNorm, grouped-query attention, SwiGLU, no biases; with --experts: Mixtral) or "
                   "deepseek_v3 (multi-head latent attention; with --experts: DeepSeekMoE).")
@click.option("--n-kv-head", type=click.IntRange(min=1), default=default("n_kv_head"),
              help="llama: key/value heads of grouped-query attention (must divide --n-head). [default: n_head]")
@click.option("--ffn-hidden", type=click.IntRange(min=1), default=default("ffn_hidden"),
              help="llama: SwiGLU hidden units. [default: 8/3·n_embd rounded up to a multiple of 64]")
@click.option("--rope-theta", type=click.FloatRange(min=0, min_open=True), default=default("rope_theta"),
              help="llama: RoPE base θ.")
@click.option("--tie-embeddings/--no-tie-embeddings", default=default("tie_embeddings"),
              help="llama: share the LM head with the token embedding. [default: untied; GPT-2 is always tied]")
@click.option("--seq-len", type=click.IntRange(min=1), default=default("seq_len"), help="Tokens per sequence (T).")
@click.option("--batch-size", type=click.IntRange(min=1), default=default("batch_size"),
              help="Sequences per step, global (B).")
@click.option("--steps", type=click.IntRange(min=0), default=default("steps"),
              help="Total optimizer steps, counted from the start of training (also with --resume).")
@click.option("--lr", type=click.FloatRange(min=0), default=default("lr"), help="Peak learning rate.")
@click.option("--seed", type=int, default=default("seed"),
              help="Seed of the initialization (identical for every mesh).")
@click.option("--optimizer", type=click.Choice(["adamw", "sgd"]), default=default("optimizer"),
              help="adamw: PyTorch's AdamW, betas (0.9, 0.95), eps 1e-8; sgd: w -= lr·g.")
@click.option("--weight-decay", type=click.FloatRange(min=0), default=default("weight_decay"),
              help="AdamW's decoupled weight decay, applied to weights of 2 or more dimensions.")
@click.option("--dtype", type=click.Choice(["float32", "float64"]), default=default("dtype"),
              help="Master weights, optimizer state and (by default) compute and gradients.")
@click.option("--compute-dtype", type=click.Choice(["bfloat16", "float16", "float32", "float64"]),
              default=default("compute_dtype"),
              help="Mixed precision: the working copy of the weights, the activations and every activation sent "
                   "between ranks (bfloat16 on NumPy via ml_dtypes, computed in float32). [default: --dtype]")
@click.option("--grad-dtype", type=click.Choice(["bfloat16", "float32", "float64"]), default=default("grad_dtype"),
              help="Gradients: accumulated over microbatches and reduced in this dtype. [default: --dtype]")
@click.option("--fp8", type=click.Choice(["none", "blockwise"]), default=default("fp8"),
              help="blockwise: every linear inside the blocks multiplies E4M3 operands (DeepSeek-V3: activations "
                   "and output gradients scaled per 1×128 tile, weights per 128×128 block, float32 accumulation "
                   "promoted every 128). Needs --compute-dtype bfloat16. Emulated: slower than bfloat16, not faster.")
@click.option("--exp-avg-dtype", type=click.Choice(["float32", "bfloat16"]), default=default("exp_avg_dtype"),
              help="AdamW's moments m and v: float32 keeps them at --dtype; bfloat16 halves their bytes.")
@click.option("--loss-scale", default=default("loss_scale"), metavar="dynamic|none|S",
              help="Loss scaling: dynamic (start 2^16, ×2 after 1000 clean steps, ×0.5 after 2 overflows), none, or "
                   "a fixed scale. Overflowing steps are skipped on every rank. [default: dynamic for float16]")
@click.option("--device", type=click.Choice(["cpu", "gpu"]), default=default("device"),
              help="Where parameters and compute live: NumPy on the CPU, or CuPy on the GPU of each rank's local "
                   "rank (ranks share GPUs round robin). The report says how GPU buffers reach MPI.")
@click.option("--grad-clip", type=click.FloatRange(min=0), default=default("grad_clip"),
              help="Clip the global gradient norm to this (0: off).")
@click.option("--lr-schedule", type=click.Choice(["constant", "cosine"]), default=default("lr_schedule"),
              help="After warmup: constant, or cosine decay to a tenth of --lr at the last step.")
@click.option("--warmup-steps", type=click.IntRange(min=0), default=default("warmup_steps"),
              help="Linear warmup steps.")
@click.option("--data", default=default("data"), metavar="PATH",
              help="A folder from `mpiparallel data prepare` (or of llm.c shards: *train*.bin, *val*.bin), one .bin "
                   "shard, a quoted glob of shards (memory-mapped), a .npy array of token ids, or any other file read "
                   "as UTF-8 bytes (vocab 256). [default: Python's own documentation text, which ships with every "
                   "Python, tokenized by a 2,048-token BPE trained on it once and cached in $MPIPARALLEL_CACHE "
                   "(default ~/.cache/mpiparallel)]")
@click.option("--val-data", default=default("val_data"), metavar="PATH",
              help="Validation tokens (same kinds as --data) for --eval-every. [default: the data folder's *val*.bin, "
                   "else the last --validation-fraction of --data]")
@click.option("--shuffle", is_flag=True, default=default("shuffle"),
              help="Visit each epoch's batches in a random order seeded by (--seed, epoch): still a function of the "
                   "step, so resume is exact on any mesh.")
@click.option("--init", type=click.Path(file_okay=False), default=default("init"),
              help="Start from this Hugging Face GPT-2, Llama or Mixtral directory; the family and shape come from "
                   "its config.json.")
@click.option("--save", type=click.Path(file_okay=False), default=default("save"),
              help="Write the trained model here as a Hugging Face directory (the master weights).")
@click.option("--save-dtype", type=click.Choice(["bfloat16", "float16", "float32", "float64"]),
              default=default("save_dtype"),
              help="The dtype --save writes the weights in. [default: --dtype]")
@click.option("--checkpoint-dir", type=click.Path(file_okay=False), default=default("checkpoint_dir"),
              help="Where training checkpoints go (model + optimizer state). Alone: one checkpoint, after the last "
                   "step; with --checkpoint-every: also every that many steps.")
@click.option("--checkpoint-every", type=click.IntRange(min=0), default=default("checkpoint_every"),
              help="Steps between checkpoints (needs --checkpoint-dir; 0: only after the last step).")
@click.option("--keep-checkpoints", type=click.IntRange(min=0), default=default("keep_checkpoints"),
              help="Keep only the newest N checkpoints in --checkpoint-dir (0: keep all; each save logs the disk "
                   "they use).")
@click.option("--resume", is_flag=True, default=default("resume"),
              help="Continue from the newest complete checkpoint in --checkpoint-dir (an error if there is none).")
@click.option("--resume-from", default=default("resume_from"), metavar="STEP|DIR",
              help="Continue from the checkpoint of this step in --checkpoint-dir, or from this checkpoint folder "
                   "(a step folder, or a checkpoint directory's newest). Implies --resume.")
@click.option("--elastic", is_flag=True, default=default("elastic"),
              help="When a rank or host is lost, relaunch on the survivors: the same tp·cp·pp·ep, a smaller dp that "
                   "divides the global batch (kept: more rows per DP rank), or where those no longer fit the "
                   "planner's fastest layout that fits in memory; resumed and resharded from the newest complete "
                   "checkpoint. Needs --checkpoint-dir and --checkpoint-every, and -n (not under mpiexec).")
@click.option("--elastic-mode", type=click.Choice(["auto", "in-place", "relaunch"]), default=default("elastic_mode"),
              show_default=True,
              help="--elastic: how the survivors go on. in-place: the same processes revoke, agree, shrink and refill "
                   "the new mesh from each other's memory (needs an MPI with ULFM: Open MPI, which -n starts with "
                   "--with-ft ulfm; a bare mpirun needs it given); relaunch: end every rank and start the survivors "
                   "from the newest checkpoint; auto: in place where the MPI can, else relaunch (the log says which).")
@click.option("--min-ranks", type=click.IntRange(min=1), default=default("min_ranks"),
              help="--elastic: give up (non-zero exit) rather than continue on fewer ranks.")
@click.option("--max-restarts", type=click.IntRange(min=0), default=default("max_restarts"),
              help="--elastic: give up after this many relaunches.")
@click.option("--stall-timeout", type=click.FloatRange(min=0), default=default("stall_timeout"), metavar="SECONDS",
              envvar=STALL_TIMEOUT_VARIABLE, show_envvar=True, callback=lambda ctx, param, value: _finite(value, param),
              help="With -n: when no rank has made progress for this long, end the job with one line naming the rank "
                   "behind and where each rank is (a stopped, deadlocked or starved rank would otherwise hold the "
                   "others in their next collective forever); --elastic relaunches without that rank. 0: never.")
@click.option("--flight-dir", type=click.Path(file_okay=False), default=default("flight_dir"),
              envvar="MPIPARALLEL_FLIGHT_DIR", show_envvar=True,
              help="Where each rank writes its flight recorder (flight-rank-K.json: its last calls on every "
                   "communicator) on SIGUSR2, on an error and when the stall watchdog ends the job — and, given "
                   "here, at the end of the run; `mpiparallel debug hang DIR` reads them. MPIPARALLEL_FLIGHT=N keeps "
                   "N calls per communicator (default 512; 0: off). [default: the working directory]")
@click.option("--check-collectives", is_flag=True, default=default("check_collectives"),
              help="Every collective first checks across its ranks that all call it with the same operation, "
                   "shape, dtype, algorithm and root (one small all-gather per call): a mismatch ends the job with "
                   "one clear error on every rank instead of a hang. MPIPARALLEL_CHECK=1 does the same.")
@click.option("--eval-every", type=click.IntRange(min=0), default=default("eval_every"),
              help="Steps between validation losses on held-out data (0: none).")
@click.option("--eval-batches", type=click.IntRange(min=1), default=default("eval_batches"),
              help="Batches per validation loss.")
@click.option("--validation-fraction", type=click.FloatRange(0, 1, min_open=True, max_open=True),
              default=default("validation_fraction"),
              help="Share of the data, taken from its end, held out for validation (with --eval-every and no "
                   "validation shards).")
@click.option("--log-json", type=click.Path(dir_okay=False), default=default("log_json"),
              help="Write one JSON object per step here (rank 0).")
@click.option("--tensorboard", type=click.Path(file_okay=False), default=default("tensorboard"),
              help="Also write each step's loss, learning rate, tokens/s, gradient norm and bytes per axis as "
                   "TensorBoard scalars to this folder (rank 0; needs tensorboardX: pip install "
                   "'mpiparallel[tensorboard]'). View with `tensorboard --logdir DIR`.")
@click.option("--trace", type=click.Path(dir_okay=False), default=default("trace"),
              help="Write a Chrome trace-event JSON of the run (ui.perfetto.dev, chrome://tracing): per rank the "
                   "steps, pipeline actions and collectives, an arrow from each pipeline send to its receive.")
@click.option("--sample-tokens", type=click.IntRange(min=0), default=default("sample_tokens"),
              help="After training, print a sample of this many tokens, decoded by the data's tokenizer.")
@click.option("--experts", type=click.IntRange(min=0), default=default("experts"),
              help="Replace every block's MLP by this many GPT-2 MLP experts (mixture of experts; 0: dense).")
@click.option("--top-k", type=click.IntRange(min=1), default=default("top_k"), help="Experts each token is routed to.")
@click.option("--moe-aux-coef", type=click.FloatRange(min=0), default=default("moe_aux_coef"),
              help="Weight of the Switch load-balancing loss, per local token set. [default: 0.01; deepseek_v3: 0, "
                   "it balances with --moe-bias-rate and --moe-seq-aux-coef]")
@click.option("--moe-aux-scope", type=click.Choice(["local", "global"]), default=default("moe_aux_scope"),
              help="local: the Switch loss of each token set (a microbatch on a DP×CP rank), averaged — its value "
                   "depends on the mesh; global: one loss from the counts of the whole step's batch, the serial "
                   "model's on any mesh, for one more forward pass a step (it counts the routing first).")
@click.option("--capacity-factor", type=click.FloatRange(min=0), default=default("capacity_factor"),
              help="Rows per expert per token set: ⌈C·K·tokens/E⌉; overflow dropped in token order (0: unlimited).")
@click.option("--no-moe-renormalize", "moe_renormalize", flag_value=False, default=default("moe_renormalize"),
              show_default=False, help="Gates are the raw router probabilities instead of renormalized over the "
                                       "chosen K. [default: off: the chosen K gates are renormalized to sum 1]")
@click.option("--moe-bias-rate", type=click.FloatRange(min=0), default=default("moe_bias_rate"),
              help="Aux-loss-free balancing (DeepSeek-V3): per-expert routing biases move by this rate toward "
                   "under-loaded experts after every step (0: off).")
@deepseek_options
@click.option("--dp", type=click.IntRange(min=1), default=default("dp"),
              help="Data-parallel ranks. [default: the ranks left over by tp·pp·cp]")
@click.option("--tp", type=click.IntRange(min=1), default=default("tp"),
              help="Tensor-parallel ranks (Megatron: attention split by heads, MLP by columns, vocab-parallel "
                   "embedding and cross-entropy).")
@click.option("--sp", is_flag=True, default=default("sp"),
              help="Megatron sequence parallelism inside the tensor-parallel group.")
@click.option("--pp", type=click.IntRange(min=1), default=default("pp"),
              help="Pipeline ranks: the layers are cut into pp × virtual-stages stages, embedding with the first "
                   "and head with the last.")
@click.option("--schedule", type=click.Choice(["gpipe", "1f1b", "interleaved", "zb", "zbv", "dualpipev"]),
              default=default("schedule"),
              help="Pipeline schedule (see `mpiparallel schedule --help` to simulate one).")
@click.option("--virtual-stages", type=click.IntRange(min=1), default=default("virtual_stages"),
              help="Stages per pipeline rank for --schedule interleaved (zbv and dualpipev always use 2). "
                   "[default: 2 for interleaved, else 1; as in `mpiparallel schedule`]")
@click.option("--cp", type=click.IntRange(min=1), default=default("cp"),
              help="Context-parallel ranks: each sequence is cut into 2·cp chunks, rank r holding chunks r and "
                   "2·cp−1−r (zigzag: equal causal work).")
@click.option("--cp-attention", type=click.Choice(["ring", "all-gather", "ulysses"]), default=default("cp_attention"),
              help="How attention sees the other CP ranks' tokens: ring passes K/V blocks around the CP group; "
                   "all-gather gathers K/V once per layer; ulysses re-shards sequence to heads with all-to-alls.")
@click.option("--ep", type=click.IntRange(min=1), default=default("ep"),
              help="Expert-parallel ranks, carved from dp: each holds E/ep experts, tokens reach them by all-to-all.")
@click.option("--ep-dispatch", type=click.Choice(["flat", "hierarchical"]), default=default("ep_dispatch"),
              help="How tokens reach experts on other nodes: flat sends one copy per chosen expert; hierarchical "
                   "(DeepSeek-V3's node-limited dispatch, --arch deepseek_v3 with --n-group = nodes of the EP "
                   "group) crosses to each target node once, then forwards inside the node.")
@click.option("--zero", type=click.IntRange(0, 3), default=default("zero"),
              help="ZeRO stage: 1 shards optimizer state, 2 also gradients, 3 also parameters.")
@click.option("--dp-shard", type=click.IntRange(min=1), default=default("dp_shard"),
              help="Hybrid sharding (HSDP): ZeRO shards over groups of N consecutive DP ranks — a node when "
                   "N·tp·cp is its rank count — and the dp/N groups hold replicas, summed with one all-reduce of "
                   "each shard across them. Needs --zero 1, 2 or 3. [default: all of dp]")
@click.option("--microbatches", type=click.IntRange(min=1), default=default("microbatches"),
              help="Split each DP rank's rows into this many microbatches (gradient accumulation; the pipeline's "
                   "microbatches). [default: pp, so a pipeline is filled]")
@click.option("--bucket-mb", type=click.FloatRange(min=0, min_open=True), default=default("bucket_mb"),
              help="Size of the gradient buckets reduced during backward, in MiB.")
@click.option("--no-overlap", "overlap", flag_value=False, default=default("overlap"), show_default=False,
              help="Reduce gradients only after backward (to measure what overlap saves). [default: off: buckets "
                   "are reduced while backward runs]")
@click.option("--recompute", type=click.Choice(["none", "selective", "full"]), default=default("recompute"),
              help="Activation recomputation (the same numbers, less memory, more compute): selective keeps no "
                   "attention probabilities and recomputes them in backward (no term in seq²); full keeps only "
                   "each block's input and reruns its forward in backward. --memory-report shows the bytes.")
@click.option("--query-block", type=click.IntRange(min=1), default=default("query_block"),
              help="Attention's query rows per causal block (the same numbers; larger: fewer, bigger products and "
                   "more probabilities kept for backward). [default: 64 on a CPU, 1024 on a GPU, where the launches "
                   "of small blocks set the pace]")
@click.option("--attention", type=click.Choice(["causal", "document"]), default=default("attention"),
              help="causal: every token attends to every earlier token of its window; document: only to the earlier "
                   "tokens of its own document (an end-of-text token opens one; the packed documents of llm.c's "
                   "shards and `data prepare`), positions restarting at each document. Blocks of keys wholly in "
                   "earlier documents are skipped.")
@click.option("--eot-id", type=click.IntRange(min=0), default=default("eot_id"),
              help="The end-of-text token id that opens a document (--attention document). [default: the data "
                   "folder's data.json; needed for other token files]")
@click.option("--show-mesh", is_flag=True, default=default("show_mesh"),
              help="Print which world rank holds which mesh coordinates.")
@click.option("--memory-report", is_flag=True, default=default("memory_report"),
              help="Print the bytes each rank holds in parameters, gradients, optimizer state and activations.")
@threads_option
@click.pass_context
def train(ctx: click.Context, ranks: int | None, threads: int | None, dp: int | None, tp: int, pp: int, cp: int,
          ep: int, **options: Any) -> None:
    """Train GPT-2 or a Llama-family model with hand-written forward and backward passes.

    Without --data it trains on the documentation text that ships with Python (a BPE of 2,048 tokens
    trained on it the first time, then cached), so the loss visibly falls and the samples turn to words within
    two minutes on a laptop.

    \b
    Examples:
      mpiparallel train --steps 300 --sample-tokens 300
      mpiparallel train --data corpus.txt --n-layer 6 --n-embd 384 --n-head 6 --lr-schedule cosine \\
          --warmup-steps 50 --steps 2000 --eval-every 100 --save out/
      mpiparallel train --init out/ --data corpus.txt --steps 100 --log-json log.jsonl
      mpiparallel train -n 2 --zero 3 --microbatches 2 --memory-report
      mpiparallel train -n 4 --tp 2 --sp --show-mesh
      mpiparallel train -n 4 --zero 3 --dp-shard 2 --show-mesh
      mpiparallel train -n 4 --pp 4 --schedule zbv --microbatches 8 --n-layer 8
      mpiparallel train -n 4 --cp 2 --tp 2 --cp-attention ulysses
      mpiparallel train -n 4 --experts 8 --top-k 2 --ep 4
      mpiparallel train --arch llama --n-head 8 --n-kv-head 2 --n-embd 128 --steps 300
      mpiparallel train -n 4 --arch llama --n-head 4 --n-kv-head 1 --tp 2 --experts 4 --ep 2
      mpiparallel train --arch deepseek_v3 --experts 8 --top-k 2 --n-group 4 --topk-group 2 --first-k-dense 1
    """
    check_needs(ctx, options)
    _check_output_folders({"--trace": options["trace"], "--log-json": options["log_json"]})
    _check_checkpoint_options(options)
    _check_writable({"--save": options["save"], "--checkpoint-dir": options["checkpoint_dir"]})
    if options["tensorboard"] is not None and importlib.util.find_spec("tensorboardX") is None:
        raise click.BadParameter("writing TensorBoard files needs tensorboardX: pip install 'mpiparallel[tensorboard]'"
                                 " (or pip install tensorboardX)", param_hint="'--tensorboard'")
    if options["experts"] and options["top_k"] > options["experts"]:
        raise click.BadParameter(f"each token goes to top-k of the experts: {options['top_k']} is more than "
                                 f"--experts {options['experts']}", param_hint="'--top-k'")
    if options["elastic"] and not launch.launched_by_mpi():
        from ..jobs.elastic import check_elastic, run_elastic

        check_elastic(options, ranks, ctx.meta.get(HOSTFILE))
        run_elastic(ranks, _argv(ctx), options, {"dp": dp, "tp": tp, "pp": pp, "cp": cp, "ep": ep},
                    ctx.meta.get(HOSTFILE))
    launch.ensure_world_size(ranks, _argv(ctx), ctx.meta.get(HOSTFILE),
                             StallWatch(options["stall_timeout"], options["log_json"], options["flight_dir"]))
    process.limit_blas_threads(threads)
    process.keep_freed_memory()
    from collectives import flight

    from .. import train as training

    if options["flight_dir"] is not None:
        flight.dump_folder = Path(options["flight_dir"])

    settings = training.TrainSettings.from_options(**options, dp=dp, tp=tp, pp=pp, cp=cp, ep=ep)
    status = training.run(settings, _survivors_rule(options))
    if options["flight_dir"] is not None:  # asked for: the last calls of a finished run too
        flight.dump(launch.current_rank(), "end of run")
    ctx.exit(status)


def _survivors_rule(options: dict[str, Any]) -> Any:
    """--elastic's rule for the mesh of the survivors, for in-place recovery (None without --elastic)."""
    if not options["elastic"]:
        return None
    from ..jobs.elastic import in_place_rule

    return in_place_rule(options)


def _check_checkpoint_options(options: dict[str, Any]) -> None:
    """--resume and --resume-from: what they need, one clear error each, before any rank starts (the other
    options that need another are in `option_needs`)."""
    folder, resume_from = options["checkpoint_dir"], options["resume_from"]
    if options["resume"] and not folder and resume_from is None:
        raise click.UsageError("--resume needs --checkpoint-dir (where the training checkpoints are), or give "
                               "--resume-from DIR")
    if resume_from is not None and resume_from.isdigit() and not folder:
        raise click.UsageError(f"--resume-from {resume_from}: a step of which checkpoint folder? Give "
                               f"--checkpoint-dir, or a checkpoint folder")
    if resume_from is not None:
        options["resume"] = True


def _finite(seconds: float, param: click.Parameter) -> float:
    """A FloatRange lets "nan" and "inf" through; a timeout is neither."""
    if seconds != seconds or seconds == float("inf"):
        raise click.BadParameter(f"{seconds} is not a number of seconds (0 or more; 0: never)", param=param)
    return seconds


def _check_writable(folders: dict[str, str | None]) -> None:
    """Folders written during or after training: writable now (they or the nearest folder above them that
    exists), so that a run cannot lose its work at the end to a folder it may not write."""
    for option, folder in folders.items():
        if folder is None:
            continue
        path = Path(folder).resolve()
        if path.exists() and not path.is_dir():
            raise click.BadParameter(f"{folder} is a file, not a folder", param_hint=f"'{option}'")
        existing = next(parent for parent in (path, *path.parents) if parent.exists())
        if not existing.is_dir():
            raise click.BadParameter(f"cannot write to {folder}: {existing} is a file", param_hint=f"'{option}'")
        try:  # access() alone passes a read-only file system, and everything for root
            with tempfile.TemporaryFile(dir=existing, prefix=".mpiparallel-probe-"):
                pass
        except OSError as error:
            raise click.BadParameter(f"cannot write to {folder}: {error.strerror} ({existing})",
                                     param_hint=f"'{option}'") from None


def _check_output_folders(files: dict[str, str | None]) -> None:
    """Files written during or after training: their folder must exist now, not only when they are written."""
    for option, path in files.items():
        if path is not None and not Path(path).resolve().parent.is_dir():
            raise click.BadParameter(f"the folder of {path} does not exist", param_hint=f"'{option}'")


@main.command(context_settings={"show_default": True})
@click.option("--init", type=click.Path(file_okay=False), required=True,
              help="A Hugging Face GPT-2, Llama or Mixtral directory (as written by train --save).")
@click.option("--prompt", default=None,
              help="Text to continue, encoded by the model folder's tokenizer.json (as bytes for byte-level models). "
                   "[default: a newline]")
@click.option("--prompt-ids", default=None,
              help="Comma-separated token ids to continue, for models whose vocabulary is not bytes.")
@click.option("--tokens", "new_tokens", type=click.IntRange(min=1), default=200, help="Tokens to sample.")
@click.option("--temperature", type=click.FloatRange(min=0), default=0.8,
              help="Sampling temperature (0: always the most likely token).")
@click.option("--top-k", type=click.IntRange(min=1), default=40, help="Sample among the k most likely tokens.")
@click.option("--seed", type=int, default=0, help="Seed of the sampler.")
@threads_option
def generate(init: str, prompt: str | None, prompt_ids: str | None, new_tokens: int, temperature: float,
             top_k: int, seed: int, threads: int | None) -> None:
    """Continue a prompt with a trained model (KV-cached sampling, temperature and top-k).

    \b
    Examples:
      mpiparallel generate --init out/ --prompt "The " --tokens 300
      mpiparallel generate --init gpt2-dir/ --prompt-ids 464,2068 --temperature 0
    """
    if prompt is not None and prompt_ids is not None:
        raise click.UsageError("give --prompt or --prompt-ids, not both")
    ids = _parse_ids(prompt_ids) if prompt_ids is not None else None
    process.limit_blas_threads(threads)
    from .. import train as training

    click.echo(training.generate(init, prompt, ids, new_tokens, temperature, top_k, seed))


def _parse_ids(text: str) -> list[int]:
    try:
        ids = [int(part) for part in text.replace(" ", "").split(",") if part]
    except ValueError:
        raise click.BadParameter(f"{text!r} is not a comma-separated list of integers",
                                 param_hint="'--prompt-ids'") from None
    if not ids:
        raise click.BadParameter("needs at least one token id", param_hint="'--prompt-ids'")
    return ids


# -- schedule (no MPI: it simulates the pipeline's ranks) -----------------------------------------------------

main.add_command(schedule_command)
main.add_command(checkpoint_command)
main.add_command(plan_command)
main.add_command(data_command)
main.add_command(cluster_command)
main.add_command(plot_command)
main.add_command(debug_command)
