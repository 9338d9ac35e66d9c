"""The planner with a chip's measured matrix products (mpiparallel/planner/measured.py, `plan --gemm-measured`,
`python -m mpiparallel.planner.published --gemm-measured`): each part of a measurement file moves the prediction
as the module's formulas say — the measured MAMF replaces the preset's roof, the sustained factor scales it, a
measured product takes its time scaled to the roof it is priced at — and a bad file is one clear error.

The files here are synthetic (built by each test from the preset's own figures): no GPU measured them."""

import json
import math
from dataclasses import replace

import pytest
from click.testing import CliRunner
from commands import mpiparallel

from mpiparallel.planner import measured
from mpiparallel.planner.core import SOFTWARE, Cluster, evaluate
from mpiparallel.planner.gpus import GPUS, gemm_seconds
from mpiparallel.planner.published import predict, predicted, published_runs, table

RUNS = published_runs()


def measurement_file(tmp_path, preset="h100-sxm", mamf=None, sustained=None, products=(), overrides=None):
    """A file as scripts/measure_gemm.py writes it (the fields `measured.load` reads), `overrides` on top."""
    document = {"format": measured.FORMAT, "backend": "cupy", "device": "synthetic test GPU", "preset": preset,
                "mamf": {"bfloat16": {"flops": GPUS[preset].mamf_flops if mamf is None else mamf}},
                "sustained": sustained, "products": list(products)} | (overrides or {})
    path = tmp_path / "gemm.json"
    path.write_text(json.dumps(document))
    return path


def compute_and_traffic(m, n, k, gpu, count=1):
    """The two sides of the roofline `gemm_seconds` takes the larger of, each alone."""
    compute = gemm_seconds(m, n, k, replace(gpu, memory_bandwidth=math.inf), count=count)
    traffic = count * 2 * (m * k + k * n + m * n) / gpu.memory_bandwidth
    return compute, traffic


def test_a_halved_mamf_doubles_the_compute_side_of_every_product_and_nothing_else(tmp_path):
    preset = GPUS["a100-80gb"]
    gpu = measured.measured_gpu(preset, measured.load(measurement_file(tmp_path, preset.name,
                                                                       mamf=preset.mamf_flops / 2)))
    assert gpu.mamf_flops == preset.mamf_flops / 2 and gpu.memory_bandwidth == preset.memory_bandwidth
    for m, n, k, count in [(8192, 8192, 8192, 1), (2048, 2048, 128, 24), (2048, 2304 * 3, 2304, 1)]:
        compute, traffic = compute_and_traffic(m, n, k, preset, count)
        assert gemm_seconds(m, n, k, gpu, count=count) == pytest.approx(max(2 * compute, traffic))


def test_a_measured_row_is_the_plan_of_its_preset_with_the_measured_roof(tmp_path):
    run = RUNS[0]  # Megatron 1.7B on 32 A100
    preset = GPUS[run.gpu]
    half = measured.load(measurement_file(tmp_path, run.gpu, mamf=preset.mamf_flops / 2))
    by_file = predict(run, measurement=half)
    by_hand = predict(run, lambda setup: replace(setup, gpu=replace(setup.gpu, mamf_flops=preset.mamf_flops / 2)))
    assert by_file.step_s == pytest.approx(by_hand.step_s, rel=1e-12)
    assert by_file.step_s > predict(run).step_s  # the products take longer, so the step does


def test_the_sustained_factor_scales_the_roof_by_last_over_first_and_never_raises_it(tmp_path):
    preset = GPUS["h100-sxm"]
    slower = measured.load(measurement_file(tmp_path, mamf=700e12, sustained={"first_flops": 700e12,
                                                                            "last_flops": 630e12}))
    assert slower.sustained == pytest.approx(0.9)
    assert measured.measured_gpu(preset, slower).mamf_flops == pytest.approx(630e12)
    assert measured.measured_gpu(preset, slower, sustained=False).mamf_flops == pytest.approx(700e12)
    assert measured.measured_gpu(preset, slower, mamf=False).mamf_flops == pytest.approx(preset.mamf_flops * 0.9)
    faster = measured.load(measurement_file(tmp_path, sustained={"first_flops": 700e12, "last_flops": 710e12}))
    assert faster.sustained == 1.0


def test_a_measured_product_takes_its_time_scaled_to_the_roof_it_is_priced_at(tmp_path):
    preset = GPUS["h800"]
    shape = dict(m=4096, n=7168, k=2048, count=1, item=2)
    seconds = 0.5e-3
    file = measurement_file(tmp_path, "h800", mamf=750e12, sustained={"first_flops": 750e12, "last_flops": 600e12},
                            products=[shape | {"dtype": "bfloat16", "measured_s": seconds},
                                      dict(m=1, n=1, k=1, count=1, item=2, dtype="float16", measured_s=1.0),
                                      dict(m=2, n=2, k=2, count=1, item=2, dtype="bfloat16", measured_s=None)])
    measurement = measured.load(file)
    assert list(measurement.seconds) == [(4096, 7168, 2048, 1, 2)]  # bf16 entries with a time only
    gpu = measured.measured_gpu(preset, measurement)
    factor = 600 / 750
    assert gemm_seconds(4096, 7168, 2048, gpu) == pytest.approx(seconds / factor)
    # a code base holding SMs for communication lowers the roof: the measured time grows with it
    hai = Cluster.from_preset(gpu, 2048, SOFTWARE["hai-llm"]).gpu
    share = (preset.sms - SOFTWARE["hai-llm"].communication_sms) / preset.sms
    assert gemm_seconds(4096, 7168, 2048, hai) == pytest.approx(seconds / (factor * share))
    # an unmeasured product keeps the model at the new roof; so does the same shape at another operand size
    model_at_roof = replace(preset, mamf_flops=750e12 * factor)
    assert gemm_seconds(4096, 7168, 4096, gpu) == gemm_seconds(4096, 7168, 4096, model_at_roof)
    assert gemm_seconds(4096, 7168, 2048, gpu, item=1.0) == gemm_seconds(4096, 7168, 2048, model_at_roof, item=1.0)
    without = measured.measured_gpu(preset, measurement, products=False)
    assert gemm_seconds(4096, 7168, 2048, without) == gemm_seconds(4096, 7168, 2048, model_at_roof)
    assert gpu.fp8_mamf_flops == preset.fp8_mamf_flops  # FP8 is not measured: its ceiling stays


def test_the_published_table_changes_only_the_rows_on_the_measured_chip(tmp_path):
    measurement = measured.load(measurement_file(tmp_path, "h100-sxm", mamf=GPUS["h100-sxm"].mamf_flops * 0.8))
    plain, with_file = table().splitlines(), table(measurement).splitlines()
    assert plain[:2] == with_file[:2] and len(plain) == len(with_file)
    assert plain[2 + len(RUNS):] == with_file[2 + len(RUNS):]  # the memory check's notes: a GEMM file moves no byte
    for run, before, after in zip(RUNS, plain[2:2 + len(RUNS)], with_file[2:2 + len(RUNS)], strict=True):
        if run.gpu != "h100-sxm":
            assert before == after, run.label()
        else:
            figure = predicted(run, predict(run, lambda setup: replace(
                setup, gpu=replace(setup.gpu, mamf_flops=GPUS["h100-sxm"].mamf_flops * 0.8))))
            assert after.split(" | ")[2] == f"{figure:.0f}" != before.split(" | ")[2], run.label()


def test_published_with_a_measurement_prints_the_table_and_each_parts_ratio_on_the_measured_rows(tmp_path, capsys):
    from mpiparallel.planner import published

    path = measurement_file(tmp_path, "h100-sxm", mamf=700e12, sustained={"first_flops": 700e12,
                                                                         "last_flops": 665e12})
    assert published.main(["--gemm-measured", str(path)]) == 0
    printed = capsys.readouterr().out
    llama = [run for run in RUNS if run.gpu == "h100-sxm"]
    cells = [line.rstrip(" |").split(" | ") for line in printed.splitlines() if line.startswith("| ")]
    rows = {row[0]: row[1:] for row in cells}
    assert len(rows["| part"]) == len(llama)
    for name, mamf in (("| measured MAMF", 700e12), ("| + sustained clocks", 665e12)):
        expected = [predicted(run, predict(run, lambda setup, mamf=mamf: replace(
            setup, gpu=replace(setup.gpu, mamf_flops=mamf)))) / run.published for run in llama]
        assert rows[name] == [f"{ratio:.2f}" for ratio in expected]
    assert rows["| + measured products (all of the file)"] == rows["| + sustained clocks"]  # no products in it
    h200 = measured.load(measurement_file(tmp_path, "h200"))
    assert published.measurement_effects(h200).startswith("No published row runs on h200")
    assert published.main(["--gemm-measured", str(tmp_path / "absent.json")]) == 2
    assert capsys.readouterr().err.count("error: cannot read") == 1


def test_plan_with_a_measurement_prices_the_layout_as_the_planner_does_with_it(tmp_path):
    from mpiparallel.commands import plan as plan_command
    from mpiparallel.planner.core import PRECISIONS, Layout, Model

    path = measurement_file(tmp_path, "h100-sxm", mamf=600e12, sustained={"first_flops": 600e12,
                                                                         "last_flops": 540e12})
    arguments = ["--software", "flash-fsdp", "--arch", "llama", "--n-layer", "4", "--n-embd", "4096", "--n-head",
                 "32", "--n-kv-head", "8", "--ffn-hidden", "14336", "--vocab-size", "128256", "--seq-len", "8192",
                 "--gpus", "8", "--batch-size", "8", "--tp", "8", "--pp", "1", "--zero", "0", "--microbatches", "1",
                 "--recompute", "none", "--sp", "--precision", "bfloat16", "--json"]
    result = CliRunner().invoke(plan_command.plan, [*arguments, "--gemm-measured", str(path)])
    assert result.exit_code == 0, result.output
    document = json.loads(result.output)
    assert document["cluster"]["gemm_measured"]["sustained"] == pytest.approx(0.9)
    model = Model(4, 4096, 32, 8192, 128256, n_positions=8192, arch="llama", n_kv_head=8, ffn_hidden=14336)
    gpu = measured.measured_gpu(GPUS["h100-sxm"], measured.load(path))
    expected = evaluate(model, Cluster.from_preset(gpu, 8, SOFTWARE["flash-fsdp"]), PRECISIONS["bfloat16"],
                        Layout(1, 8, 1, zero=0, microbatches=1, recompute="none", sp=True), 8)
    assert document["layouts"][0]["step_s"] == pytest.approx(expected.step_s, rel=1e-12)
    preset = CliRunner().invoke(plan_command.plan, [*arguments, "--gpu", "h100-sxm"])
    assert json.loads(preset.output)["layouts"][0]["step_s"] < expected.step_s  # 540 < 794.5 TFLOP/s


BAD_FILES = [
    ("missing", None, "cannot read"),
    ("not-json", "{not json", "is not JSON"),
    ("other-format", {"format": "something else"}, "is not a GEMM measurement"),
    ("cpu", {"backend": "numpy", "device": "CPU (x86_64)"}, "was measured with 'numpy' on CPU (x86_64)"),
    ("preset", {"preset": "tpu-v5"}, "\"preset\" 'tpu-v5' is not one of"),
    ("mamf-missing", {"mamf": {}}, "missing or malformed field 'bfloat16'"),
    ("mamf-negative", {"mamf": {"bfloat16": {"flops": -1}}}, "mamf.bfloat16.flops must be a positive number"),
    ("product", {"products": [{"m": 1, "n": 1, "count": 1, "item": 2, "dtype": "bfloat16", "measured_s": 1}]},
     "missing or malformed field 'k'"),
    ("sustained", {"sustained": {"first_flops": 0, "last_flops": 1}}, "sustained.first_flops must be a positive"),
]


def bad_file(tmp_path, content):
    """No file (None), a file of this text (str), or a measurement file with these fields changed (dict)."""
    if content is None:
        return tmp_path / "absent.json"
    if isinstance(content, str):
        (tmp_path / "gemm.json").write_text(content)
        return tmp_path / "gemm.json"
    return measurement_file(tmp_path, overrides=content)


@pytest.mark.parametrize("content, message", [(content, message) for _, content, message in BAD_FILES],
                         ids=[name for name, _, _ in BAD_FILES])
def test_a_bad_measurement_file_is_one_value_error_naming_the_file(tmp_path, content, message):
    path = bad_file(tmp_path, content)
    with pytest.raises(ValueError) as error:
        measured.load(path)
    assert message in str(error.value) and str(path) in str(error.value)


@pytest.mark.parametrize("arguments, message", [
    (["plan", "--gemm-measured", "/nonexistent/gemm.json"], "cannot read /nonexistent/gemm.json"),
    (["plan", "--gpu", "a100-80gb", "--gemm-measured", "{file}"], "(preset h100-sxm), not on --gpu a100-80gb"),
    (["plan", "--machine", "{file}", "--gemm-measured", "{file}"], "give one of them"),
], ids=["missing", "other-preset", "with-machine"])
def test_plan_refuses_a_measurement_it_cannot_use_with_one_clear_error(tmp_path, arguments, message):
    path = measurement_file(tmp_path)
    finished = mpiparallel(*[argument.replace("{file}", str(path)) for argument in arguments], timeout=60)
    output = finished.stdout + finished.stderr
    assert finished.returncode != 0 and output.count(message) == 1, output
    assert sum(line.startswith("Error") for line in output.splitlines()) == 1 and "Traceback" not in output, output
