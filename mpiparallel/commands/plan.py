"""`mpiparallel plan`: the layouts of a model on a cluster that fit, ranked by predicted step time.

No MPI unless `--calibrate`, which measures this machine on `-n` ranks (relaunching under mpiexec) and writes
the file that `--machine` reads. The arithmetic is in `mpiparallel.planner`.
"""

from __future__ import annotations

import json
import re
from dataclasses import fields, replace
from pathlib import Path
from typing import Any

import click

from .. import process
from ..errors import ConfigError
from ..jobs import launch
from ..schedules import SCHEDULES

_SIZE = re.compile(r"^\s*([0-9.]+(?:e[0-9]+)?)\s*([kmgt]?)(i?)b?\s*$", re.IGNORECASE)
DEFAULT_MACHINE = Path.home() / ".cache" / "mpiparallel" / "machine.json"
GPU_PRESETS = ("a100-80gb", "a100-40gb", "h100-sxm", "h800", "h200")
"""`planner.gpus.GPUS`'s names (spelled here so that the command line starts without importing the planner)."""
SOFTWARE_NAMES = ("mpiparallel", "megatron-2021", "flash-fsdp", "hai-llm")
"""`planner.core.SOFTWARE`'s names."""
DEEPSEEK_SHAPE = (
    ("q_lora_rank", 1, "deepseek_v3: query down-projection rank (train's default: none, one q_proj)."),
    ("kv_lora_rank", 1, "deepseek_v3: compressed KV latent channels (cached: + the RoPE key's)."),
    ("qk_nope_head_dim", 1, "deepseek_v3: query/key channels per head without RoPE."),
    ("qk_rope_head_dim", 2, "deepseek_v3: RoPE channels per head, one key shared by all heads."),
    ("v_head_dim", 1, "deepseek_v3: value channels per head."),
    ("moe_ffn_hidden", 1, "deepseek_v3: SwiGLU width of each routed and shared expert."),
    ("shared_experts", 0, "deepseek_v3: always-on shared experts."),
    ("n_group", 1, "deepseek_v3: expert groups of group-limited routing (the nodes: node-limited dispatch)."),
    ("topk_group", 1, "deepseek_v3: groups (nodes) each token may use, M."),
    ("first_k_dense", 0, "deepseek_v3: the first blocks keep a dense MLP."),
    ("mtp_depth", 0, "deepseek_v3: multi-token-prediction modules (on the last stage)."),
)
"""`plan`'s deepseek_v3 shape options: train's names (their defaults are train's, `train.inputs.deepseek_choices`)."""


class MemorySize(click.ParamType):
    """80GB (10^9), 80GiB (2^30), 512MB, or plain bytes."""

    name = "size"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> float:
        if isinstance(value, float):
            return value
        match = _SIZE.match(str(value))
        if match is None:
            self.fail(f"{value!r} is not a memory size like 80GB, 80GiB or 512MB", param, ctx)
        number, prefix, binary = match.groups()
        power = "_KMGT".index(prefix.upper()) if prefix else 0
        return float(number) * (1024 if binary else 1000) ** power


def _model_options(function: Any) -> Any:
    options = [
        click.option("--arch", type=click.Choice(["gpt2", "llama", "deepseek_v3"]), default="gpt2",
                     help="Model family (train's --arch): llama has RoPE, RMSNorm, GQA, SwiGLU and an untied head; "
                          "deepseek_v3 multi-head latent attention and DeepSeekMoE (without a shape: DeepSeek-V3's "
                          "published config, seq 4096)."),
        click.option("--init", "init_dir", type=click.Path(file_okay=False, exists=True, path_type=Path),
                     default=None, help="The model of a folder's config.json (train's --init: llama, Mixtral or "
                                        "deepseek_v3)."),
        click.option("--params", type=click.FloatRange(min=1), default=None,
                     help="Parameter count (e.g. 70e9); the shape is inferred (h ≈ 128·layers, 128 channels per "
                          "head; llama n_head/4 KV heads) unless given."),
        click.option("--n-layer", type=click.IntRange(min=1), default=None, help="Blocks. [default: 4]"),
        click.option("--n-embd", type=click.IntRange(min=1), default=None, help="Channels. [default: 128]"),
        click.option("--n-head", type=click.IntRange(min=1), default=None, help="Heads. [default: 4]"),
        click.option("--seq-len", type=click.IntRange(min=1), default=None,
                     help="Tokens per sequence. [default: 128, or 2048 with --params]"),
        click.option("--vocab-size", type=click.IntRange(min=1), default=None,
                     help="Vocabulary. [default: 256, or 50257 with --params]"),
        click.option("--document-length", type=click.IntRange(min=1), default=None,
                     help="train --attention document: the packed documents' mean length in tokens; attention's "
                          "work and saved probabilities fall to its documents' (scripts/bench_documents.py measures "
                          "a data folder's). [default: causal over the whole sequence]"),
        click.option("--n-positions", type=click.IntRange(min=1), default=None,
                     help="Position embeddings. [default: max(1024, seq-len), as train]"),
        click.option("--experts", type=click.IntRange(min=0), default=0, help="MoE experts per block (0: dense)."),
        click.option("--top-k", type=click.IntRange(min=1), default=2, help="Experts per token."),
        click.option("--n-kv-head", type=click.IntRange(min=0), default=0,
                     help="llama: KV heads (grouped-query attention; 0: n_head, or n_head/4 with --params)."),
        click.option("--ffn-hidden", type=click.IntRange(min=0), default=0,
                     help="llama: SwiGLU hidden units (0: 8/3·n_embd rounded up to a multiple of 64)."),
        click.option("--tie-embeddings/--no-tie-embeddings", default=None,
                     help="llama: tie the LM head to the token embedding. [default: untied; GPT-2 always ties]"),
        *[click.option(f"--{name.replace('_', '-')}", type=click.IntRange(min=low), default=None, help=text)
          for name, low, text in DEEPSEEK_SHAPE],
    ]
    for option in reversed(options):
        function = option(function)
    return function


def _cluster_options(function: Any) -> Any:
    options = [
        click.option("--gpus", type=click.IntRange(min=1), default=8, help="GPUs (ranks) in all."),
        click.option("--gpu-memory", type=MemorySize(), default="80GB", help="Memory per GPU."),
        click.option("--gpus-per-node", type=click.IntRange(min=1), default=8, help="GPUs per node."),
        click.option("--intra-bandwidth", type=click.FloatRange(min=0, min_open=True), default=450.0,
                     help="GB/s one GPU sends inside a node (NVLink)."),
        click.option("--intra-latency", type=click.FloatRange(min=0), default=5.0,
                     help="Microseconds per message inside a node."),
        click.option("--inter-bandwidth", type=click.FloatRange(min=0, min_open=True), default=50.0,
                     help="GB/s one GPU sends across nodes (400 Gb/s InfiniBand)."),
        click.option("--inter-latency", type=click.FloatRange(min=0), default=10.0,
                     help="Microseconds per message across nodes."),
        click.option("--peak-flops", type=click.FloatRange(min=0, min_open=True), default=989e12,
                     help="Peak matmul FLOP/s per GPU (H100 bf16 dense)."),
        click.option("--memory-bandwidth", type=click.FloatRange(min=0, min_open=True), default=3.35e12,
                     help="Bytes/s of GPU memory (elementwise work)."),
        click.option("--efficiency", type=click.FloatRange(min=0, max=1, min_open=True), default=0.5,
                     help="Fraction of the peak rates reached."),
        click.option("--gpu", type=click.Choice(GPU_PRESETS), default=None,
                     help="A GPU preset (mpiparallel/planner/gpus.py, each figure with its source): its memory, "
                          "NVLink and network bandwidth and latency, and matrix products timed by shape at its "
                          "measured matmul ceiling; replaces the rate options and --efficiency (--gpu-memory and "
                          "--gpus-per-node still apply when given)."),
        click.option("--gemm-measured", type=click.Path(dir_okay=False, path_type=Path), default=None,
                     help="A chip's matrix products as scripts/measure_gemm.py measured them (its gemm.json): the "
                          "measured MAMF, sustained-load factor and product times replace its preset's "
                          "(docs/published-runs.md, \"Measuring a chip\"); sets --gpu to the measured preset."),
        click.option("--software", type=click.Choice(SOFTWARE_NAMES), default="mpiparallel",
                     help="The code base that runs the layout: this project's layers, Megatron-LM as in 2021 "
                          "(dense attention, pipeline scatter/gather, DP after backward) or FlashAttention + FSDP "
                          "(as Llama 3 describes)."),
        click.option("--machine", type=click.Path(dir_okay=False, path_type=Path), default=None,
                     help="Rates and α, β, γ measured by `plan --calibrate` (one machine; --gpus ranks on it; an "
                          "explicit --gpus-per-node and --inter-bandwidth/--inter-latency cut it into hosts with a "
                          "shaped link, as `mpiparallel cluster up --link-rate` does)."),
    ]
    for option in reversed(options):
        function = option(function)
    return function


def _choice_options(function: Any) -> Any:
    options = [click.option(f"--{axis}", type=click.IntRange(min=1), default=None,
                            help=f"Fix the {axis.upper()} degree (searched otherwise).")
               for axis in ("dp", "tp", "pp", "cp", "ep")]
    options += [
        click.option("--zero", type=click.IntRange(0, 3), default=None, help="Fix the ZeRO stage."),
        click.option("--dp-shard", type=click.IntRange(min=1), default=None,
                     help="Fix hybrid sharding's shard group (train --dp-shard; the search tries a node's DP "
                          "ranks with ZeRO)."),
        click.option("--microbatches", type=click.IntRange(min=1), default=None, help="Fix the microbatches."),
        click.option("--schedule", type=click.Choice(SCHEDULES), default=None, help="Fix the pipeline schedule."),
        click.option("--virtual-stages", type=click.IntRange(min=1), default=None,
                     help="Stages per rank of the interleaved schedule (Megatron's v). [default: 2]"),
        click.option("--recompute", type=click.Choice(["none", "selective", "full"]), default=None,
                     help="Fix activation recomputation."),
        click.option("--sp/--no-sp", default=None, help="Fix sequence parallelism (with tp > 1)."),
        click.option("--cp-attention", type=click.Choice(["ring", "all-gather", "ulysses"]), default=None,
                     help="Fix the context-parallel attention (with cp > 1; searched otherwise)."),
        click.option("--ep-dispatch", type=click.Choice(["flat", "hierarchical"]), default=None,
                     help="Fix the EP all-to-all: flat (a copy per expert) or hierarchical (deepseek_v3 with "
                          "node-limited routing: across nodes once per target node, then NVLink); searched "
                          "otherwise."),
    ]
    for option in reversed(options):
        function = option(function)
    return function


@click.command(context_settings={"show_default": True})
@_model_options
@_cluster_options
@_choice_options
@click.option("--batch-size", type=click.IntRange(min=1), default=None,
              help="Global batch in sequences. [default: 8, or 4 per GPU with --params]")
@click.option("--precision", type=click.Choice(["mixed", "bfloat16", "fp8", "float32", "float64"]), default=None,
              help="mixed: bf16 weights and gradients + fp32 master and AdamW moments (16 bytes/parameter, train "
                   "--compute-dtype bfloat16 --grad-dtype bfloat16); bfloat16: with fp32 gradients (18, train's "
                   "--compute-dtype bfloat16); fp8: DeepSeek-V3's fp32 gradients and master, bf16 moments (14, "
                   "train's --fp8 blockwise --compute-dtype bfloat16 --exp-avg-dtype bfloat16); float32/64: train's "
                   "--dtype. [default: mixed, float32 with --machine]")
@click.option("--optimizer", type=click.Choice(["adamw", "sgd"]), default="adamw", help="Optimizer state kept.")
@click.option("--bytes-per-param", type=click.FloatRange(min=0, min_open=True), default=None,
              help="Model-state bytes per parameter (the weights alone with --weights-only).")
@click.option("--weights-only", is_flag=True,
              help="Count only the weights (no gradients, optimizer state or activations): how many GPUs must "
                   "share them; skips the layout search.")
@click.option("--max-bubble", type=click.FloatRange(min=0, max=1, min_open=True, max_open=True), default=None,
              help="With --pp: the fewest microbatches each schedule needs for a bubble below this fraction.")
@click.option("--top", type=click.IntRange(min=0), default=10, help="Layouts shown (0: all that fit).")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON document instead of tables.")
@click.option("--html", "html_path", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Write the interactive parallelism map (one self-contained page) for this model on --gpus "
                   "(at most 16) and exit.")
@click.option("--calibrate", is_flag=True,
              help="Measure α, β, γ and the matmul and elementwise rates here on -n ranks and write them to "
                   "--machine (default ~/.cache/mpiparallel/machine.json).")
@click.option("-n", "--np", "ranks", type=click.IntRange(min=1), default=None, metavar="N",
              help="Ranks for --calibrate (relaunches under mpiexec). [default: 2]")
@click.pass_context
def plan(ctx: click.Context, **options: Any) -> None:
    """Rank the layouts of a model on a cluster by predicted step time.

    Enumerates dp·tp·pp·cp (= --gpus), ep, ZeRO, microbatches, schedule, recomputation and SP — any of them
    fixed by its option — drops the layouts that do not fit in --gpu-memory, and prints the rest fastest first:
    memory per rank (parameters, gradients, optimizer state, activations in flight for the schedule),
    compute, communication per axis from the collectives' α-β formulas, the simulated bubble and the exposed
    communication. The arithmetic is in mpiparallel/planner/core.py's docstring.

    When no layout fits, the reason is printed (in --json as "why_none") and the exit status is 2; with
    --max-bubble, whose answer is each schedule's fewest microbatches, the reason is printed and the status is 0.

    \b
    Examples:
      mpiparallel plan --params 70e9 --gpus 256 --gpu-memory 80GB --weights-only --bytes-per-param 2 --json
      mpiparallel plan --params 7e9 --gpus 64 --batch-size 512 --tp 8
      mpiparallel plan --arch llama --n-layer 32 --n-embd 4096 --n-head 32 --n-kv-head 8 --ffn-hidden 14336 \\
          --vocab-size 128256 --seq-len 8192 --gpus 64 --batch-size 256
      mpiparallel plan --pp 8 --max-bubble 0.1 --json
      mpiparallel plan --calibrate -n 2 && mpiparallel plan --machine ~/.cache/mpiparallel/machine.json --gpus 2
      mpiparallel plan --gpus 8 --n-layer 8 --html map.html
    """
    if options["calibrate"]:
        _calibrate(ctx, options)
        return
    from .. import planner

    model = _model(options, {name for name in ("experts", "top_k", "seq_len")
                             if ctx.get_parameter_source(name) is not click.core.ParameterSource.DEFAULT})
    model = replace(model, document_length=options["document_length"] or 0)
    precision = planner.precision_with(options["precision"] or ("float32" if options["machine"] else "mixed"),
                                       options["optimizer"], options["bytes_per_param"], options["weights_only"])
    explicit = {name for name in ("gpu_memory", "gpus_per_node", "inter_bandwidth", "inter_latency")
                if ctx.get_parameter_source(name) is not click.core.ParameterSource.DEFAULT}
    measurement = _gemm_measurement(options)
    cluster = _cluster(options, explicit, measurement)
    batch = options["batch_size"] or (4 * options["gpus"] if options["params"] else 8)
    choices = planner.Choices(batch, **{name: options[name] for name in (
        "dp", "tp", "pp", "cp", "ep", "zero", "microbatches", "schedule", "recompute", "sp", "cp_attention",
        "virtual_stages", "ep_dispatch", "dp_shard")})
    if options["html_path"] is not None:
        _write_page(options["html_path"], model, cluster, precision, batch)
        return
    document = _answers(model, cluster, precision, choices, options)
    if measurement is not None:
        document["cluster"]["gemm_measured"] = measurement.summary()
    if not options["weights_only"]:
        plans, considered = planner.plan(model, cluster, precision, choices)
        shown = plans if options["top"] == 0 else plans[:options["top"]]
        document |= {"considered": considered, "feasible": len(plans), "layouts": [p.to_json() for p in shown]}
    if document.get("feasible") == 0:
        document["why_none"] = why_nothing_fits(model, cluster, precision, choices)
    if options["as_json"]:
        click.echo(json.dumps(document, indent=1))
    else:
        click.echo(report(document))
    if document.get("feasible") == 0 and "min_microbatches" not in document:  # the layouts were the question
        raise ConfigError(f"no layout fits: {document['why_none']}")


def why_nothing_fits(model: Any, cluster: Any, precision: Any, choices: Any) -> str:
    """Which constraint excluded every layout: the fixed choices that leave none (each named with what freeing it
    would allow), or the memory — the least any layout needs per GPU beside what a GPU has."""
    from .. import planner

    layouts = list(planner.candidate_layouts(model, cluster, choices))
    if not layouts:
        fixed = {field.name: getattr(choices, field.name) for field in fields(choices)
                 if field.name != "batch_size" and getattr(choices, field.name) is not None}
        freeing = [name for name in fixed
                   if next(planner.candidate_layouts(model, cluster, replace(choices, **{name: None})), None)]
        named = ", ".join(f"--{name.replace('_', '-')} {value}" for name, value in fixed.items()) or "none fixed"
        if freeing:
            return (f"the fixed choices ({named}) leave no layout train accepts on {cluster.gpus} GPUs with batch "
                    f"{choices.batch_size}; leaving {' or '.join('--' + n.replace('_', '-') for n in freeing)} to "
                    f"the search finds some")
        return (f"no layout train accepts for this model on {cluster.gpus} GPUs with batch {choices.batch_size} "
                f"(fixed: {named}): the GPUs must split into dp·tp·pp·cp, tp must divide the heads and MLP width, "
                f"pp at most the layers, dp the batch")
    smallest = min((planner.evaluate(model, cluster, precision, layout, choices.batch_size) for layout in layouts),
                   key=lambda result: result.max_memory)
    return (f"memory: of {len(layouts)} layouts the smallest needs {_bytes(smallest.max_memory)} per GPU "
            f"(dp {smallest.layout.dp}, tp {smallest.layout.tp}, pp {smallest.layout.pp}, zero "
            f"{smallest.layout.zero}, recompute {smallest.layout.recompute}), a GPU has "
            f"{_bytes(cluster.gpu_memory)}: {_what_would_fit(layouts, cluster, choices)}")


def _what_would_fit(layouts: list[Any], cluster: Any, choices: Any) -> str:
    """The advice after "no layout fits in memory". A batch smaller than the GPUs caps dp (a rank needs a whole
    sequence), so more GPUs would only deepen the model parallelism that already does not fit: say so."""
    widest = max(layout.dp for layout in layouts)
    if choices.dp is None and widest < cluster.gpus and widest * 2 > choices.batch_size:
        return (f"the batch of {choices.batch_size} sequences allows at most dp {widest}, so every model copy "
                f"spans {cluster.gpus // widest} GPUs; a larger --batch-size lets more of the {cluster.gpus} GPUs "
                f"hold copies (or use more memory: --gpu-memory)")
    return "use more GPUs, more memory (--gpu-memory) or fix fewer choices"


def _model(options: dict[str, Any], explicit: set[str] = frozenset()) -> Any:
    from ..planner import Model

    given = [f"--{name.replace('_', '-')}" for name, _, _ in DEEPSEEK_SHAPE if options[name] is not None]
    if options["init_dir"] is not None or options["arch"] == "deepseek_v3":
        return _configured_model(options, explicit)
    if given:
        raise ConfigError(f"{', '.join(given)} set(s) a deepseek_v3 choice: add --arch deepseek_v3")
    shape = [options[name] for name in ("n_layer", "n_embd", "n_head")]
    family = {"arch": options["arch"], "tie_embeddings": options["tie_embeddings"]}
    family |= {name: options[name] for name in ("n_kv_head", "ffn_hidden") if options[name]}
    try:
        if options["params"] and not any(shape):
            inferred = Model.from_parameter_count(options["params"], options["seq_len"] or 2048,
                                                  options["vocab_size"] or 50257, options["arch"])
            model = replace(inferred, experts=options["experts"], top_k=options["top_k"], **family)
        else:
            seq = options["seq_len"] or 128
            model = Model(options["n_layer"] or 4, options["n_embd"] or 128, options["n_head"] or 4, seq,
                          options["vocab_size"] or 256, options["n_positions"] or max(1024, seq),
                          options["experts"], options["top_k"],
                          parameters=int(options["params"]) if options["params"] else None, **family)
    except ValueError as error:
        raise ConfigError(str(error)) from None
    if model.n_embd % model.n_head:
        raise ConfigError(f"--n-embd {model.n_embd} must be divisible by --n-head {model.n_head}")
    if options["experts"] and options["top_k"] > options["experts"]:
        raise ConfigError(f"--top-k {options['top_k']} exceeds --experts {options['experts']}")
    try:
        model.config  # noqa: B018 -- train's checks of the shape (n_kv_head, RoPE's even head size, ...)
    except ValueError as error:
        raise ConfigError(f"the model: {error}") from None
    return model


def _configured_model(options: dict[str, Any], explicit: set[str]) -> Any:
    """The model of --init's config.json, or of --arch deepseek_v3: DeepSeek-V3's published config without a
    shape (seq 4096, its pre-training length), train's deepseek_v3 defaults around a given shape; the
    deepseek_v3 options, --experts, --top-k and --seq-len given replace the configuration's."""
    from models.families import config_fields
    from models.transformer import GPTConfig

    from ..planner import Model, deepseek

    try:
        if options["init_dir"] is not None:
            raw = json.loads((options["init_dir"] / "config.json").read_text())
            fields_ = deepseek.config_json_fields(raw) if raw.get("model_type") == "deepseek_v3" else \
                config_fields(raw)
        elif options["n_layer"] is None and options["n_embd"] is None and options["n_head"] is None:
            fields_ = deepseek.config_json_fields(deepseek.published_config())
        else:
            fields_ = _deepseek_shape_fields(options)
        renamed = {"shared_experts": "n_shared_experts", "first_k_dense": "first_k_dense_replace"}
        fields_ |= {renamed.get(name, name): options[name] for name, _, _ in DEEPSEEK_SHAPE
                    if options[name] is not None}
        fields_ |= {name: options[option] for name, option in (("n_experts", "experts"), ("moe_top_k", "top_k"))
                    if option in explicit}
        seq = options["seq_len"] or (deepseek.PUBLISHED_SEQ_LEN if fields_.get("arch") == "deepseek_v3" else 2048)
        fields_["n_positions"] = max(fields_.get("n_positions", seq), seq)
        config = GPTConfig(**fields_)
    except (OSError, ValueError, TypeError) as error:
        raise ConfigError(f"the model: {error}") from None
    return Model.from_config(config, seq)


def _deepseek_shape_fields(options: dict[str, Any]) -> dict[str, Any]:
    """GPTConfig fields of --arch deepseek_v3 around --n-layer --n-embd --n-head: the deepseek options not given
    take train's defaults (`train.inputs.deepseek_choices`)."""
    from types import SimpleNamespace

    from ..train.inputs import DEEPSEEK_DEFAULTS, DEEPSEEK_SIZES, deepseek_choices

    n_embd, n_head = options["n_embd"] or 128, options["n_head"] or 4
    choices = {name: default if options.get(name) is None else options[name]
               for name, default in DEEPSEEK_DEFAULTS.items()}
    shape = SimpleNamespace(arch="deepseek_v3", n_embd=n_embd, n_head=n_head, ffn_hidden=options["ffn_hidden"] or None,
                            **{name: options[name] for name in DEEPSEEK_SIZES}, **choices)
    return {"arch": "deepseek_v3", "n_layer": options["n_layer"] or 4, "n_embd": n_embd, "n_head": n_head,
            "vocab_size": options["vocab_size"] or 256, "ffn_hidden": options["ffn_hidden"],
            "n_positions": options["n_positions"] or 1024, "moe_aux_coef": 0.0} | deepseek_choices(shape)


def _gemm_measurement(options: dict[str, Any]) -> Any:
    """`--gemm-measured`'s file read (`planner.measured.load`), checked against --gpu and --machine; None without
    the option."""
    from ..planner import measured

    if options["gemm_measured"] is None:
        return None
    if options["machine"] is not None:
        raise ConfigError("--gemm-measured changes a GPU preset; --machine describes a measured machine of its own: "
                          "give one of them")
    try:
        measurement = measured.load(options["gemm_measured"])
    except ValueError as error:
        raise ConfigError(f"--gemm-measured: {error}") from None
    if options["gpu"] not in (None, measurement.preset):
        raise ConfigError(f"--gemm-measured: {measurement.path} was measured on {measurement.device} (preset "
                          f"{measurement.preset}), not on --gpu {options['gpu']}")
    return measurement


def _cluster(options: dict[str, Any], explicit: set[str] = frozenset(), measurement: Any = None) -> Any:
    from collectives.cost_model import CostModel

    from ..planner import Cluster, load_machine
    from ..planner.gpus import gpu_named
    from ..planner.measured import measured_gpu
    from ..planner.software import SOFTWARE

    software = SOFTWARE[options["software"]]
    if options["gpu"] is not None or measurement is not None:
        gpu = gpu_named(options["gpu"] or measurement.preset)
        gpu = gpu if measurement is None else measured_gpu(gpu, measurement)
        cluster = Cluster.from_preset(gpu, options["gpus"], software,
                                      options["gpus_per_node"] if "gpus_per_node" in explicit else None)
        return replace(cluster, gpu_memory=options["gpu_memory"]) if "gpu_memory" in explicit else cluster

    if options["machine"] is not None:
        try:
            machine = load_machine(options["machine"], options["gpus"],
                                   options["gpu_memory"] if "gpu_memory" in explicit else None)
        except (OSError, ValueError, KeyError) as error:
            raise ConfigError(f"cannot read the machine file {options['machine']}: {error}") from None
        return _as_hosts(machine, options, explicit)
    efficiency = options["efficiency"]
    return Cluster(gpus=options["gpus"], gpu_memory=options["gpu_memory"],
                   gpus_per_node=min(options["gpus_per_node"], options["gpus"]),
                   intra=CostModel(options["intra_latency"] * 1e-6, 1 / (options["intra_bandwidth"] * 1e9),
                                   1 / (options["memory_bandwidth"] * efficiency)),
                   inter=CostModel(options["inter_latency"] * 1e-6, 1 / (options["inter_bandwidth"] * 1e9),
                                   1 / (options["memory_bandwidth"] * efficiency)),
                   matmul_flops=options["peak_flops"] * efficiency,
                   elementwise_bytes=options["memory_bandwidth"] * efficiency, software=software,
                   peak_flops=options["peak_flops"])


def _as_hosts(machine: Any, options: dict[str, Any], explicit: set[str]) -> Any:
    """A calibrated machine cut into hosts, as `mpiparallel cluster` makes them on it: an explicit
    --gpus-per-node says how many ranks a host holds (they still share the machine's cores), an explicit
    --inter-bandwidth and --inter-latency what one rank gets of a host's (shaped) link."""
    from collectives.cost_model import CostModel

    if "gpus_per_node" in explicit:
        machine = replace(machine, gpus_per_node=min(options["gpus_per_node"], machine.gpus))
    if explicit & {"inter_bandwidth", "inter_latency"}:
        latency = options["inter_latency"] * 1e-6 if "inter_latency" in explicit else machine.inter.alpha
        beta = 1 / (options["inter_bandwidth"] * 1e9) if "inter_bandwidth" in explicit else machine.inter.beta
        machine = replace(machine, inter=CostModel(latency, beta, machine.intra.gamma))
    return machine


def _answers(model: Any, cluster: Any, precision: Any, choices: Any, options: dict[str, Any]) -> dict[str, Any]:
    """The model, cluster and the closed-form answers (the seeds' exercises)."""
    from dataclasses import asdict

    from .. import planner

    document: dict[str, Any] = {
        "model": asdict(model) | {"total_parameters": model.total_parameters(), "kv_heads": model.kv_heads,
                                  "ffn_width": model.ffn_width, "tied": model.tied},
        "cluster": {"gpus": cluster.gpus, "gpu_memory": cluster.gpu_memory, "gpus_per_node": cluster.gpus_per_node,
                    "intra": asdict(cluster.intra), "inter": asdict(cluster.inter),
                    "matmul_flops": cluster.matmul_flops, "elementwise_bytes": cluster.elementwise_bytes,
                    "kind": "gpu" if cluster.cpu_cores is None else "cpu",
                    **({} if cluster.cpu_cores is None else {"cpu_cores": cluster.cpu_cores})},
        "precision": asdict(precision), "batch_size": choices.batch_size,
        "min_model_parallel": planner.min_model_parallel(model, precision, cluster.gpu_memory),
    }
    if model.is_deepseek:
        document["deepseek_v3"] = deepseek_counts(model, precision)
    dp = planner.data_parallel_degree(cluster.gpus, choices)
    if dp is not None:
        document["dp"] = dp
    if options["max_bubble"] is not None:
        if not options["pp"] or options["pp"] < 2:
            raise ConfigError("--max-bubble needs a pipeline: give --pp 2 or more")
        try:
            document["min_microbatches"] = {name: planner.min_microbatches(name, options["pp"], options["max_bubble"])
                                            for name in SCHEDULES}
        except ValueError as error:
            raise ConfigError(str(error)) from None
    return document


def deepseek_counts(model: Any, precision: Any) -> dict[str, Any]:
    """DeepSeek-V3's parameter counts (what each counts: `planner.deepseek`), FLOPs per token and KV cache."""
    from ..planner import deepseek, flops_per_token

    counts = model.deepseek_counts
    return {"total_parameters": counts["total"], "activated_parameters": counts["activated"],
            "mtp_parameters": counts["mtp"], "mtp_own_parameters": deepseek.mtp_own_parameters(model.config),
            "flops_per_token": flops_per_token(model),
            "kv_cache": deepseek.kv_cache_bytes_per_token(model.config, precision.activations)}


def _write_page(path: Path, model: Any, cluster: Any, precision: Any, batch: int) -> None:
    from ..planner.page import write_page

    if cluster.gpus > 16:
        raise ConfigError(f"--html draws every GPU: give --gpus 16 or fewer (not {cluster.gpus})")
    try:
        count = write_page(path, model, cluster, precision, batch)
    except OSError as error:
        raise ConfigError(f"cannot write {path}: {error.strerror}") from None
    click.echo(f"wrote {path}: {count} layouts of {cluster.gpus} GPUs")


def _calibrate(ctx: click.Context, options: dict[str, Any]) -> None:
    argv = ctx.find_root().obj["argv"] if isinstance(ctx.find_root().obj, dict) else []
    launch.ensure_world_size(options["ranks"] or 2, argv)
    process.limit_blas_threads(None)
    from ..planner.calibrate import calibrate_machine

    path = options["machine"] or DEFAULT_MACHINE
    n_embd = options["n_embd"] or 128
    shape = {"n_layer": options["n_layer"] or 4, "n_embd": n_embd, "n_head": options["n_head"] or 4,
             "seq_len": options["seq_len"] or 128, "vocab_size": options["vocab_size"] or 256}
    calibrate_machine(path, n_embd, shape=shape)


# -- the tables ---------------------------------------------------------------------------------------------------

def _bytes(value: float) -> str:
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if value >= size:
            return f"{value / size:.2f} {unit}"
    return f"{value:.0f} B"


def _seconds(value: float) -> str:
    return f"{value * 1e3:.3f} ms" if value < 1 else f"{value:.3f} s"


def _measured_note(measurement: dict[str, Any] | None) -> str:
    if measurement is None:
        return ""
    return (f"; matrix products as measured on {measurement['device']} ({measurement['file']}): MAMF "
            f"{measurement['mamf_flops'] / 1e12:.1f} TFLOP/s × sustained {measurement['sustained']:.3f}, "
            f"{measurement['products']} products at their measured times")


def report(document: dict[str, Any]) -> str:
    """The text `plan` prints: the model, the closed-form answers, then one block per layout."""
    model, cluster = document["model"], document["cluster"]
    lines = [f"model: {model['arch']}, {model['n_layer']} layers, {model['n_embd']} channels, {model['n_head']} "
             f"heads{_llama_shape(model)}, seq {model['seq_len']}, vocab {model['vocab_size']}"
             + (f", {model['experts']} experts top-{model['top_k']}" if model["experts"] else "")
             + (f", documents of {model['document_length']} tokens" if model.get("document_length") else "")
             + f": {model['total_parameters']:,} parameters; batch {document['batch_size']} sequences",
             _cluster_line(cluster),
             f"fewest {_unit(cluster)}s that must share the model states ({document['precision']['weights']:g}+"
             f"{document['precision']['gradients']:g}+{document['precision']['optimizer']:g} bytes/parameter): "
             f"{document['min_model_parallel']}"]
    if "deepseek_v3" in document:
        lines += _deepseek_lines(document["deepseek_v3"], model["n_layer"])
    if "dp" in document and document["dp"] != cluster["gpus"]:  # all GPUs: nothing fixed, nothing to say
        lines.append(f"data-parallel degree the fixed tp·pp·cp leave: {document['dp']}")
    if "min_microbatches" in document:
        lines.append("fewest microbatches for the bubble asked: " + ", ".join(
            f"{name} {count}" for name, count in document["min_microbatches"].items()))
    if "layouts" in document:
        shown = f"; the fastest {len(document['layouts'])}:" if document["layouts"] else ""
        lines.append(f"{document['feasible']} of {document['considered']} layouts fit{shown}")
        count = "6·N activated + the MTP module + 6·l·s·H·(d_qk + d_v) per token" if "deepseek_v3" in document \
            else "6·N + 12·l·h·s per token"
        for index, layout in enumerate(document["layouts"], 1):
            lines += ["", *_layout_lines(index, layout, count, _unit(cluster))]
    if "min_microbatches" in document and "why_none" in document:  # answered, so no error follows to say why
        lines.append(f"no layout fits: {document['why_none']}")
    return "\n".join(lines)


def _deepseek_lines(counts: dict[str, Any], layers: int) -> list[str]:
    kv = counts["kv_cache"]
    return [f"parameters: {counts['total_parameters'] / 1e9:.1f} B total (every routed expert once, embedding and "
            f"head included, no MTP); {counts['activated_parameters'] / 1e9:.1f} B activated per token (attention, "
            f"shared expert, dense blocks, top-k routed experts, embedding and head); MTP "
            f"{counts['mtp_parameters'] / 1e9:.1f} B beside them as the checkpoint stores it "
            f"({counts['mtp_own_parameters'] / 1e9:.1f} B of its own, sharing the embedding and head in training)",
            f"FLOPs per token (MFU's count, MTP included): {counts['flops_per_token'] / 1e9:.1f} G",
            f"KV cache per token: {kv['latent_values_per_block']} values per block (MLA's latent + RoPE key), "
            f"{kv['latent_bytes']:,.0f} bytes over {layers} blocks; {kv['expanded_values_per_block']:,} per block "
            f"({kv['expanded_bytes']:,.0f} bytes) if these heads' keys and values were cached"]


def _llama_shape(model: dict[str, Any]) -> str:
    """' (8 KV heads, SwiGLU 14336, untied head)' for llama; nothing for GPT-2."""
    if model["arch"] != "llama":
        return ""
    return (f" ({model['kv_heads']} KV heads, SwiGLU {model['ffn_width']}, "
            f"{'tied' if model['tied'] else 'untied'} head)")


def _cluster_line(cluster: dict[str, Any]) -> str:
    """What the plan runs on: GPUs, or the ranks of a calibrated CPU machine (its cores and measured rates)."""
    if cluster.get("kind") == "cpu":
        return (f"machine: {cluster['gpus']} ranks on a calibrated CPU machine of {cluster['cpu_cores']} cores, "
                f"{_bytes(cluster['gpu_memory'])} of memory per rank; per rank {cluster['matmul_flops'] / 1e9:.1f} "
                f"GFLOP/s in matrix products and {cluster['elementwise_bytes'] / 1e9:.1f} GB/s elementwise (measured, "
                f"as a real training step reaches them)")
    return (f"cluster: {cluster['gpus']} GPUs of {_bytes(cluster['gpu_memory'])}, {cluster['gpus_per_node']} per node"
            + _measured_note(cluster.get("gemm_measured")))


def _unit(cluster: dict[str, Any]) -> str:
    return "rank" if cluster.get("kind") == "cpu" else "GPU"


def _rate(flops: float, unit: str) -> str:
    """A rate per GPU in TFLOP/s; per CPU rank in GFLOP/s (0.1 TFLOP/s says nothing there)."""
    return f"{flops:.1f} TFLOP/s per GPU" if unit == "GPU" else f"{flops * 1e3:.1f} GFLOP/s per rank"


def _layout_lines(index: int, layout: dict[str, Any], count: str = "6·N + 12·l·h·s per token",
                  unit: str = "GPU") -> list[str]:
    comm = ", ".join(f"{axis} {_seconds(seconds)} ({_bytes(layout['comm_bytes'][axis])}"
                     + (f", {_bytes(layout['ep_inter_node_bytes'])} across nodes"
                        if axis == "ep" and layout["ep_inter_node_bytes"] else "") + ")"
                     for axis, seconds in layout["comm_s"].items() if layout["comm_bytes"][axis] or seconds)
    lines = [f"{index:>3}. {layout['label']}: step {_seconds(layout['step_s'])}, compute "
             f"{_seconds(layout['compute_s'])}, bubble {layout['bubble']:.1%}, exposed comm "
             f"{_seconds(layout['exposed_comm_s'])}",
             f"     throughput: {layout['tokens_per_s']:,.0f} tokens/s; "
             f"{_rate(layout['megatron_tflops_per_gpu'], unit)} in Megatron's count (96·B·s·l·h²·(1 + s/6h + "
             f"V/16lh): GEMMs with full recomputation); {_rate(layout['model_tflops_per_gpu'], unit)} in MFU's count "
             f"({count})" + (f" = MFU {layout['mfu']:.1%}" if layout["mfu"] else ""),
             f"     comm per rank: {comm or 'none'}",
             "     pp rank   parameters    gradients    optimizer  activations        total"]
    for rank in layout["memory_per_rank"]:
        lines.append(f"     {rank['pp_rank']:>7} " + " ".join(f"{_bytes(rank[key]):>12}" for key in (
            "parameters", "gradients", "optimizer_state", "activations", "total")))
    lines += [f"     note: {note}" for note in layout["notes"]]
    return lines
