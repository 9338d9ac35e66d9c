"""The planner against published runs: the rows of `published_runs.csv` (Megatron-LM 2021 Table 1, Llama 3 405B
Table 4, DeepSeek-V3's 2,048 H800) predicted with one GPU preset per chip and one code-base description per paper
(`software.SOFTWARE`).

Each row fixes what the paper prints (model, GPUs, tp, pp, cp, dp, global batch). What a paper does not print is
set by one rule per paper, never per row:

- Megatron-LM 2021: full recomputation (its eq. 3 counts it), microbatches of one sequence (its Table 2 runs the
  same 530B model with microbatch size 1), the interleaved schedule (§5.1) with the v the planner finds fastest
  among those that split each rank's layers evenly (v ≤ 8), mixed precision, no ZeRO;
- Llama 3: one sequence per microbatch, sequence parallelism (it cites Korthikanti et al. for TP), FSDP as ZeRO-1
  with fp32 gradients (§3.3.2: "reduce-scatter gradients in FP32"), the all-gather CP attention (§3.3.2), the
  interleaved schedule with v = 4 (126 blocks plus an embedding-only and a head-only slot are 128 = 16 ranks × 4
  chunks × 2; the paper does not print V), no recomputation at 8K (§3.3.2: "without activation checkpointing")
  and full recomputation at 128K (the planner's memory model fits nothing less);
- DeepSeek-V3: its published config.json with one MTP module (`deepseek.PUBLISHED_CONFIG`), HAI-LLM as §3.2
  describes it (`software.SOFTWARE["hai-llm"]`), FP8 GEMMs and dispatch (`PRECISIONS["fp8"]`), ZeRO-1 over the 128
  DP ranks (EP64 inside them), the node-limited two-hop dispatch (M = 4 of the 8 nodes an EP group spans,
  §3.2.2), one sequence per microbatch, DualPipe as `dualpipev` (the same bubble, (PP/2 − 1)(F&B + B − 3W),
  Table 2; DualPipeV is its one-copy form), no recomputation beyond what §3.2.3 names (norms and MLA's
  up-projections: not modelled), train's even split of the units over the stages (the report prints none).

`python -m mpiparallel.planner.published` prints the table of docs/published-runs.md; with `--terms`, each row's
ratio with one term of the model changed (`TERMS`); with `--gemm-measured FILE`, the rows on the measured chip
predicted with this project's measurement of it (`planner.measured`), and what each part of it changes.
"""

from __future__ import annotations

import argparse
import csv
import sys
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from models.transformer import GPTConfig

from . import deepseek, measured
from .gpus import GPU, gpu_named
from .hardware import Cluster
from .layout import PRECISIONS, Layout, Precision
from .measured import GemmMeasurement
from .results import Plan
from .search import evaluate
from .shapes import Model
from .software import SOFTWARE, Software

TABLE = Path(__file__).with_name("published_runs.csv")


@dataclass(frozen=True)
class PublishedRun:
    source: str
    params_b: float
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    ffn: int
    vocab: int
    seq: int
    gpus: int
    tp: int
    pp: int
    cp: int
    dp: int
    batch: int
    published: float
    """TFLOP/s per GPU in `count`, or tokens/s per GPU when `count` is "tokens"."""
    count: str
    """"megatron" (Narayanan et al. eq. 3), "mfu" (6·N + 12·l·h·s per token) or "tokens" (tokens/s per GPU)."""
    gpu: str

    def label(self) -> str:
        return f"{self.source} {self.params_b:g}B on {self.gpus:,} (tp{self.tp} pp{self.pp} cp{self.cp} dp{self.dp})"


def published_runs(path: Path = TABLE) -> list[PublishedRun]:
    lines = [line for line in path.read_text().splitlines() if line and not line.startswith("#")]
    return [PublishedRun(**{name: _convert(name, value) for name, value in row.items()})
            for row in csv.DictReader(lines)]


def _convert(name: str, value: str) -> object:
    if name in ("source", "count", "gpu"):
        return value
    return float(value) if name in ("params_b", "published") else int(value)


def model_of(run: PublishedRun) -> Model:
    if run.source.startswith("deepseek"):
        config = GPTConfig(**deepseek.config_json_fields(deepseek.published_config()))
        return Model.from_config(config, run.seq)
    if run.source.startswith("llama"):
        return Model(run.layers, run.hidden, run.heads, run.seq, run.vocab, n_positions=run.seq, arch="llama",
                     n_kv_head=run.kv_heads, ffn_hidden=run.ffn)
    return Model(run.layers, run.hidden, run.heads, run.seq, run.vocab, n_positions=run.seq)


def _megatron_layouts(run: PublishedRun) -> list[Layout]:
    microbatches = run.batch // run.dp
    if run.pp == 1:
        return [Layout(run.dp, run.tp, 1, microbatches=microbatches, recompute="full")]
    per_rank = run.layers // run.pp
    return [Layout(run.dp, run.tp, run.pp, microbatches=microbatches, schedule="interleaved", recompute="full",
                   virtual_stages=v) for v in range(2, 9) if per_rank % v == 0] \
        or [Layout(run.dp, run.tp, run.pp, microbatches=microbatches, schedule="1f1b", recompute="full")]


def _llama_layouts(run: PublishedRun) -> list[Layout]:
    recompute = "none" if run.seq <= 8192 else "full"
    return [Layout(run.dp, run.tp, run.pp, run.cp, zero=1, microbatches=run.batch // run.dp, schedule="interleaved",
                   recompute=recompute, sp=True, cp_attention="all-gather", virtual_stages=4)]


def _deepseek_layouts(run: PublishedRun) -> list[Layout]:
    return [Layout(run.dp, run.tp, run.pp, run.cp, ep=64, zero=1, microbatches=run.batch // run.dp,
                   schedule="dualpipev", recompute="none", ep_dispatch="hierarchical")]


RULES = {  # per paper: code base, precision, layouts
    "megatron-2021": ("megatron-2021", "mixed", _megatron_layouts),
    "llama3-405b": ("flash-fsdp", "bfloat16", _llama_layouts),
    "deepseek-v3": ("hai-llm", "fp8", _deepseek_layouts),
}


@dataclass(frozen=True)
class Setup:
    """What a row is predicted with: the chip, the code base, the precision, the layouts to choose from."""

    gpu: GPU
    software: Software
    precision: Precision
    layouts: tuple[Layout, ...]


def setup_of(run: PublishedRun, measurement: GemmMeasurement | None = None) -> Setup:
    """The row's paper's rule (module docstring), on its chip as `measurement` has it where that is the row's."""
    code_base, precision, layouts = RULES[run.source]
    gpu = gpu_named(run.gpu)
    if measurement is not None and measurement.preset == run.gpu:
        gpu = measured.measured_gpu(gpu, measurement)
    return Setup(gpu, SOFTWARE[code_base], PRECISIONS[precision], tuple(layouts(run)))


def predict(run: PublishedRun, variant: Callable[[Setup], Setup] | None = None,
            measurement: GemmMeasurement | None = None) -> Plan:
    """The planner's fastest plan of the run under its paper's rule; `variant` changes the setup (to measure
    what one term does: `term_effects`); `measurement` is a chip's measured products (`setup_of`)."""
    setup = setup_of(run, measurement)
    setup = setup if variant is None else variant(setup)
    cluster = Cluster.from_preset(setup.gpu, run.gpus, setup.software)
    plans = [evaluate(model_of(run), cluster, setup.precision, layout, run.batch) for layout in setup.layouts]
    return min(plans, key=lambda plan: plan.step_s)


def _software(**changes: Any) -> Callable[[Setup], Setup]:
    return lambda setup: replace(setup, software=replace(setup.software, **changes))


def _gpu(**scales: float) -> Callable[[Setup], Setup]:
    def scaled(setup: Setup) -> Setup:
        gpu = setup.gpu
        changes = {name: getattr(gpu, name) and getattr(gpu, name) * factor for name, factor in scales.items()}
        return replace(setup, gpu=replace(gpu, **changes))
    return scaled


def _layouts(**changes: Any) -> Callable[[Setup], Setup]:
    return lambda setup: replace(setup, layouts=tuple(replace(layout, **changes) for layout in setup.layouts))


TERMS: dict[str, tuple[Callable[[Setup], Setup], tuple[str, ...]]] = {
    # sensitivities of terms the model holds or leaves out, each once per chip or code base (never per row)
    "collectives at 80 % of the link rates": (_gpu(nvlink_bandwidth=0.8, network_bandwidth=0.8), ()),
    "no message latency (α = 0)": (_gpu(nvlink_latency=0, network_latency=0), ()),
    "half the memory bandwidth (elementwise passes ×2)": (_gpu(memory_bandwidth=0.5), ()),
    "GEMMs at 90 % of the MAMF": (_gpu(mamf_flops=0.9, fp8_mamf_flops=0.9), ()),
    "DP reduction after the schedule, not overlapped": (_software(dp_overlap="never"), ("llama3-405b",)),
    "no DualPipe overlap (EP and PP waited for)": (_software(chunk_overlap=False), ("deepseek-v3",)),
    "no SMs held by communication": (_software(communication_sms=0), ("deepseek-v3",)),
    "no MLA norm/up-projection recomputation": (_software(recompute_latent=False), ("deepseek-v3",)),
    "flat EP dispatch (a copy per expert across nodes)": (_layouts(ep_dispatch="flat"), ("deepseek-v3",)),
    "BF16 GEMMs and dispatch": (lambda setup: replace(setup, precision=PRECISIONS["bfloat16"]), ("deepseek-v3",)),
}
"""`python -m mpiparallel.planner.published --terms`: each row's ratio with one term changed (docs/published-runs.md);
the sources a term applies to (all when empty)."""


def term_effects(measurement: GemmMeasurement | None = None) -> str:
    """The ratio predicted / published of every row, as the model has it and with each of `TERMS` changed."""
    runs = published_runs()
    lines = ["| term | " + " | ".join(_short(run) for run in runs) + " |", "|---|" + "---:|" * len(runs)]
    rows = {"the model": None} | {name: variant for name, (variant, _) in TERMS.items()}
    for name, variant in rows.items():
        sources = TERMS[name][1] if name in TERMS else ()
        cells = [f"{predicted(run, predict(run, variant, measurement)) / run.published:.2f}"
                 if not sources or run.source in sources
                 else "" for run in runs]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _short(run: PublishedRun) -> str:
    name = {"megatron-2021": "M", "llama3-405b": "L", "deepseek-v3": "DS"}[run.source]
    return f"{name} {run.params_b:g}B" if run.source == "megatron-2021" else f"{name} {run.gpus // 1024}K cp{run.cp}"


def predicted(run: PublishedRun, plan: Plan) -> float:
    """The plan's figure in the paper's count: model TFLOP/s per GPU, or tokens/s per GPU."""
    if run.count == "tokens":
        return plan.tokens_per_s / run.gpus
    return plan.megatron_tflops if run.count == "megatron" else plan.model_tflops


def dominant_term(plan: Plan) -> str:
    """What the step spends beyond the matrix products' and passes' own time, largest first."""
    step = plan.step_s
    terms = {"compute (GEMMs at the MAMF, elementwise passes)": plan.compute_s / step,
             "bubble": plan.bubble, "exposed communication": plan.exposed_comm_s / step}
    return ", ".join(f"{name} {share:.0%}" for name, share in sorted(terms.items(), key=lambda t: -t[1]))


OVER_MEMORY = {  # per paper: why its published layout needs more than the chip holds in the planner's memory model
    "llama3-405b": "the planner keeps ZeRO-1's float32 gradients whole on every DP rank and gives the first pipeline "
                   "rank its full share of layers; Llama 3 §3.3.2 takes one layer off the first and the last stages "
                   "and frees each stage's input and output tensors as soon as they are used, which it does not model",
    "deepseek-v3": "the planner keeps a block's activations as this project's layers do (bfloat16, MLA's up-projected "
                   "q, k and v, every routed row's input and output); DeepSeek-V3 caches activations in FP8 "
                   "(§3.3.3) and recomputes the RMSNorms and MLA up-projections in backward (§3.2.3), which it "
                   "counts in time, not in memory",
}


def memory_check(run: PublishedRun, plan: Plan) -> tuple[float, float]:
    """(the largest rank's bytes in the planner's memory model, the chip's memory): what `plan` checks."""
    return plan.max_memory, gpu_named(run.gpu).memory


def table(measurement: GemmMeasurement | None = None) -> str:
    """One line per row (its prediction, its layout and the planner's memory check of it), then why each row whose
    layout does not fit the planner's memory model still ran (`OVER_MEMORY`)."""
    lines = ["| run | published (count) | predicted | ratio | layout | step s | compute | bubble | exposed comm "
             "| MFU | memory per GPU |",
             "|---|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|"]
    over = []
    for run in published_runs():
        plan = predict(run, measurement=measurement)
        figure = predicted(run, plan)
        needed, holds = memory_check(run, plan)
        fits = "" if needed <= holds else f" > {holds / 1e9:.1f}"
        if needed > holds:
            over.append(f"- {run.label()}: {needed / 1e9:.1f} GB of a {holds / 1e9:.1f} GB {run.gpu}: "
                        f"{OVER_MEMORY[run.source]}.")
        lines.append(f"| {run.label()} | {run.published:g} ({run.count}) | {figure:.0f} | "
                     f"{figure / run.published:.2f} | {plan.layout.label()} | {plan.step_s:.2f} | "
                     f"{plan.compute_s / plan.step_s:.0%} | {plan.bubble:.1%} | "
                     f"{plan.exposed_comm_s / plan.step_s:.0%} | {plan.mfu:.1%} | {needed / 1e9:.1f} GB{fits} |")
    if over:
        lines += ["", "Layouts over the planner's memory check (`plan` refuses them as they are):", *over]
    return "\n".join(lines)


MEASURED_PARTS = {  # `measured.measured_gpu`'s parts, added one at a time
    "the preset": None,
    "measured MAMF": dict(sustained=False, products=False),
    "+ sustained clocks": dict(products=False),
    "+ measured products (all of the file)": {},
}


def measurement_effects(measurement: GemmMeasurement) -> str:
    """The ratio predicted / published of each row on the measured chip, as the parts of the measurement are
    added to its preset one at a time (`MEASURED_PARTS`)."""
    runs = [run for run in published_runs() if run.gpu == measurement.preset]
    if not runs:
        chips = sorted({run.gpu for run in published_runs()})
        return (f"No published row runs on {measurement.preset} (the rows run on {', '.join(chips)}): "
                f"the measurement changes none of them.")
    preset_mamf = gpu_named(measurement.preset).mamf_flops
    lines = [f"Rows on {measurement.preset}, measured on {measurement.device} ({measurement.path}): MAMF "
             f"{measurement.mamf_flops / 1e12:.1f} TFLOP/s (preset {preset_mamf / 1e12:.1f}), "
             f"sustained ×{measurement.sustained:.3f}, {len(measurement.seconds)} products measured.", "",
             "| part | " + " | ".join(_short(run) for run in runs) + " |", "|---|" + "---:|" * len(runs)]
    for name, parts in MEASURED_PARTS.items():
        variant = None if parts is None else \
            (lambda setup, parts=parts: replace(setup, gpu=measured.measured_gpu(setup.gpu, measurement, **parts)))
        cells = [f"{predicted(run, predict(run, variant)) / run.published:.2f}" for run in runs]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mpiparallel.planner.published",
                                     description="The planner against the published runs (docs/published-runs.md).")
    parser.add_argument("--terms", action="store_true", help="each row's ratio with one term of the model changed")
    parser.add_argument("--gemm-measured", metavar="FILE",
                        help="predict the rows on the measured chip with scripts/measure_gemm.py's FILE")
    options = parser.parse_args(argv)
    measurement = None
    if options.gemm_measured is not None:
        try:
            measurement = measured.load(options.gemm_measured)
        except ValueError as error:
            print(f"error: {error}", file=sys.stderr)
            return 2
    print(term_effects(measurement) if options.terms else table(measurement))
    if measurement is not None and not options.terms:
        print()
        print(measurement_effects(measurement))
    return 0


if __name__ == "__main__":
    sys.exit(main())
