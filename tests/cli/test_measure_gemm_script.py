"""scripts/measure_gemm.py on the CPU (NumPy float32, tiny budgets: the test path; on a GPU it runs as the
`gemm` group of scripts/gpu_check.sh): its JSON has the fields the planner reads, the products it lists are the
planner's own products of the rows asked for, each measured row's ratio is its measured over its predicted time,
and the planner refuses a CPU file. The gpu_check.sh group is wired to it."""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
from mpi_harness import run_with_timeout
from optional import optional_module

from mpiparallel.planner import measured
from mpiparallel.planner.core import unit_costs
from mpiparallel.planner.gpus import GPUS, gemm_seconds
from mpiparallel.planner.published import model_of, predict, published_runs, setup_of

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "measure_gemm.py"
GPU_CHECK = ROOT / "scripts" / "gpu_check.sh"
ROWS = (1, 14)
"""Megatron 1.7B (BF16 products) and DeepSeek-V3 (FP8 linears, MLA, experts, the MTP module)."""


@pytest.fixture(scope="module")
def cpu_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("gemm")
    finished = run_with_timeout([sys.executable, str(SCRIPT), "--device", "cpu", "--preset", "h800", "--rows",
                                 ",".join(map(str, ROWS)), "--mamf-budget", "1", "--product-budget", "2",
                                 "--sustained", "1", "--window", "0.5", "--repeats", "1", "--max-gb", "0.2",
                                 "--out", str(out)], 240, cwd=ROOT)
    assert finished.returncode == 0, finished.stdout[-3000:] + finished.stderr[-3000:]
    return out, json.loads((out / "gemm.json").read_text()), finished.stdout


def planners_products(row: int) -> set[tuple[float, ...]]:
    """Every product shape the planner times in the row's plan, enumerated from the units' costs: each unit's
    forward and recomputed products and, for backward, each forward product's input and weight gradients
    (`core.Gemm.backward_seconds`); a fused attention kernel's (`in_memory` False) is no matrix product of its own.
    A linear under FP8 has one-byte operands."""
    run = published_runs()[row - 1]
    setup, layout = setup_of(run), predict(run).layout
    rows = run.batch // (layout.dp * layout.microbatches)
    fp8 = setup.precision.fp8_gemms and setup.gpu.fp8_mamf_flops is not None
    shapes = set()
    for cost in unit_costs(model_of(run), layout, rows, setup.precision, setup.software):
        backward = [g for f in cost.gemms_forward for g in (f._replace(n=f.k, k=f.n), f._replace(m=f.k, k=f.m))]
        for gemm in (*cost.gemms_forward, *cost.gemms_recomputed, *backward):
            if gemm.in_memory:
                item = 1.0 if fp8 and gemm.linear else setup.precision.activations
                shapes.add((gemm.m, gemm.n, gemm.k, gemm.count, item))
    return shapes


def test_the_file_has_the_mamf_the_products_and_the_sustained_run_labelled_as_a_cpu_run(cpu_run):
    out, document, stdout = cpu_run
    assert document["format"] == measured.FORMAT and document["backend"] == "numpy" and "CPU" in document["device"]
    assert document["preset"] == "h800" and document["dtypes"] == ["float32"] and "bfloat16" in document["unsupported"]
    mamf = document["mamf"]["float32"]
    assert mamf["flops"] > 0 and mamf["tried"] >= 1 and all(size % 64 == 0 for size in mamf["shape"])
    assert mamf["flops"] == max(leader["flops"] for leader in mamf["leaders"])
    sustained = document["sustained"]
    assert sustained["shape"] == mamf["shape"] and sustained["seconds"] >= 0.9  # --sustained 1, less the start
    assert sustained["first_flops"] > 0 and sustained["last_flops"] > 0 and sustained["windows_flops"]
    assert min(0.5, sustained["seconds"] / 2) <= sustained["window_s"] <= sustained["seconds"]
    assert [plan["row"] for plan in document["plans"]] == list(ROWS)
    report = (out / "gemm.md").read_text()
    assert "CPU run (NumPy float32): a test of the script" in report and "## The planner's products" in report
    assert "MAMF float32" in stdout and "wrote" in stdout


def test_the_products_are_the_planners_own_products_of_each_row(cpu_run):
    _, document, _ = cpu_run
    listed = {(p["m"], p["n"], p["k"], p["count"], p["item"]) for p in document["products"]}
    expected = set().union(*(planners_products(row) for row in ROWS))
    assert listed == expected
    for row in ROWS:
        assert {(p["m"], p["n"], p["k"], p["count"], p["item"]) for p in document["products"]
                if row in p["rows"]} == planners_products(row)
    fp8 = [p for p in document["products"] if p["item"] == 1.0]
    assert fp8 and all(p["measured_s"] is None and "FP8" in p["skipped"] for p in fp8)  # DeepSeek-V3's linears


def test_each_measured_product_stands_beside_the_presets_prediction_and_their_ratio(cpu_run):
    _, document, _ = cpu_run
    chip = GPUS["h800"]
    mamf = document["mamf"]["float32"]["flops"]
    done = [p for p in document["products"] if p["measured_s"] is not None]
    assert done, "the budget measures at least the smallest product"
    for p in document["products"]:
        roof = chip.fp8_mamf_flops if p["item"] == 1.0 else chip.mamf_flops
        assert p["predicted_s"] == gemm_seconds(p["m"], p["n"], p["k"], chip, p["item"], p["count"], roof)
    for p in done:
        shape = p.get("measured_shape", [p["m"], p["n"], p["k"], p["count"]])
        assert shape == [math.ceil(size) for size in (p["m"], p["n"], p["k"], p["count"])]
        assert p["measured_over_predicted"] == pytest.approx(p["measured_s"] / p["predicted_s"])
        at_mamf = gemm_seconds(p["m"], p["n"], p["k"], replace(chip, mamf_flops=mamf), p["item"], p["count"])
        assert p["predicted_at_measured_mamf_s"] == pytest.approx(at_mamf)
        assert p["measured_flops"] == pytest.approx(2 * math.prod(shape) / p["measured_s"])
    flops = [p["flops"] for p in document["products"] if p["item"] != 1.0 and "max-gb" not in p.get("skipped", "")]
    assert flops == sorted(flops)  # smallest first: the budget cuts the largest


def test_the_planner_finds_every_listed_product_when_the_file_comes_back(cpu_run, tmp_path):
    """The file's shapes, through JSON, are the keys the planner looks up: fed back as a GPU file (synthetic: each
    bf16 product at twice its predicted time), every bf16 product of the DeepSeek-V3 row's plan is found in it."""
    _, document, _ = cpu_run
    synthetic = document | {"backend": "cupy", "mamf": {"bfloat16": {"flops": GPUS["h800"].mamf_flops}},
                            "sustained": None,
                            "products": [p | {"dtype": "bfloat16", "measured_s": 2 * p["predicted_s"]}
                                         for p in document["products"] if p["item"] != 1.0]}
    (tmp_path / "gemm.json").write_text(json.dumps(synthetic))
    measurement = measured.load(tmp_path / "gemm.json")
    times = measured.MeasuredTimes(measurement.seconds, measurement.mamf_flops)
    found = []

    def spy(m, n, k, count, item, roof):
        answer = times(m, n, k, count, item, roof)
        found.append(answer is not None or item == 1.0)  # FP8 products are not in the file
        return answer

    run = published_runs()[13]
    predict(run, lambda setup: replace(setup, gpu=replace(setup.gpu, measured_gemms=spy)))
    assert found and all(found)
    assert predict(run, measurement=measurement).step_s > predict(run).step_s


def test_the_planner_refuses_a_cpu_measurement(cpu_run):
    out, _, _ = cpu_run
    with pytest.raises(ValueError, match="not on a GPU with CuPy"):
        measured.load(out / "gemm.json")


def test_bad_options_end_with_one_usage_error():
    for arguments, message in [(["--rows", "0"], "--rows takes row numbers from 1 to 14"),
                               (["--sustained-shape", "8192x8192"], "--sustained-shape takes MxNxK")]:
        finished = run_with_timeout([sys.executable, str(SCRIPT), "--device", "cpu", *arguments], 60, cwd=ROOT)
        assert finished.returncode == 2 and message in finished.stderr and "Traceback" not in finished.stderr


def test_the_gpu_path_uses_only_names_the_installed_cupy_has():
    cupy = optional_module("cupy", "the GPU path of scripts/measure_gemm.py runs on CuPy")
    for name in ("matmul", "empty", "get_default_memory_pool", "random.standard_normal", "cuda.Event",
                 "cuda.get_elapsed_time", "cuda.Device", "cuda.runtime.memGetInfo", "cuda.runtime.getDeviceProperties",
                 "cuda.runtime.runtimeGetVersion", "cuda.runtime.driverGetVersion"):
        target = cupy
        for part in name.split("."):
            target = getattr(target, part)
    used = set(re.findall(r"\bxp\.([a-z][a-z_.]*[a-z])\b", SCRIPT.read_text()))
    assert "matmul" in used, "the script reaches CuPy through Device.xp"
    for name in used:
        target = cupy
        for part in name.split("."):
            target = getattr(target, part, None)
        assert target is not None, f"cupy.{name}"


def test_the_gemm_group_of_gpu_check_runs_the_script_with_options_it_has(tmp_path):
    subprocess.run(["bash", "-n", str(GPU_CHECK)], check=True, timeout=30)
    text = GPU_CHECK.read_text()
    group = text.split("\n    gemm)\n", 1)[1].split(";;", 1)[0]
    assert "scripts/measure_gemm.py" in group and '--out "$REPORT"' in group
    used = set(re.findall(r"(--[a-z][a-z-]+)", group))
    help_text = run_with_timeout([sys.executable, str(SCRIPT), "--help"], 60, cwd=ROOT).stdout
    assert used <= set(re.findall(r"(--[a-z][a-z-]+)", help_text)), used
    finished = run_with_timeout(["bash", str(GPU_CHECK), str(tmp_path / "report"), "gemm", "nonsense"], 30)
    groups = "probe, tests, verify, bench, train, gemm, cpu, cpu-124m"
    assert finished.returncode == 2 and f"unknown group 'nonsense' ({groups})" in finished.stderr
