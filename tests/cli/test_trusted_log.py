"""A log a user can trust: what `train` prints and refuses, `--help`'s defaults, `plan` with nothing feasible,
and counts in words ("1 rank")."""

from __future__ import annotations

import io
import json
import os
import pty
import select
import subprocess
import sys
import time

import click
import pytest
from mpi_harness import run_with_timeout
from optional import optional_module
from processes import start_job

from models.transformer import GPTConfig, Transformer
from mpiparallel import data
from mpiparallel.checkpoints import hugging_face
from mpiparallel.commands.cli import main
from mpiparallel.errors import ExitCode
from mpiparallel.train import Reporter, TrainSettings

TINY = ["--n-layer", "1", "--n-embd", "32", "--n-head", "2", "--seq-len", "16", "--batch-size", "2"]
CONFIG = GPTConfig(vocab_size=64, n_positions=16, n_embd=8, n_layer=1, n_head=2)


def mpiparallel(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return run_with_timeout([sys.executable, "-m", "mpiparallel", *args], timeout)


def reported(records: list[dict], steps: int = 40) -> tuple[list[str], str]:
    """The lines a non-terminal Reporter prints for `records`, and the error a non-finite loss raises."""
    stream = io.StringIO()
    reporter = Reporter(TrainSettings.from_options(steps=steps), CONFIG, is_root=True, stream=stream,
                        peak_flops=1e9)
    error = ""
    try:
        for record in records:
            reporter.step(record)
    except FloatingPointError as raised:
        error = str(raised)
    return stream.getvalue().splitlines()[1:], error


def record(step: int, seconds: float, loss: float = 3.0) -> dict:
    return {"step": step, "loss": loss, "lr": 1e-3, "tokens": 1000, "time_s": seconds}


def test_tokens_per_second_is_a_moving_mean_beside_ms_per_step_mfu_elapsed_and_eta():
    """Steps of 1 s then one of 3 s: the line after the slow step shows 1000·3 / (1 + 1 + 3) = 600 tok/s and
    1,667 ms/step, not the last step's 333 tok/s; MFU = 600 tok/s · FLOPs per token / 1e9."""
    lines, _ = reported([record(1, 1.0), record(2, 1.0), record(3, 3.0)], steps=3)
    last = lines[-1]
    assert "| 600 tok/s, 1,667 ms/step" in last, last
    assert "elapsed" in last and "ETA 0:00" in last
    from mpiparallel.train.reports import model_flops_per_token

    assert f"MFU {600 * model_flops_per_token(CONFIG, 128) / 1e9:.2%}" in last


def test_the_nan_error_names_the_step_as_the_progress_line_does():
    lines, error = reported([record(1, 1.0), record(2, 1.0, loss=float("nan"))], steps=2)
    assert lines[-1].startswith("step     2/2 |")
    assert "at step 2/2;" in error


def test_mfu_counts_six_flops_per_weight_and_the_causal_attention():
    from mpiparallel.train.reports import model_flops_per_token

    dense = GPTConfig(vocab_size=100, n_positions=32, n_embd=16, n_layer=2, n_head=2)
    blocks = 2 * (16 * 48 + 48 + 16 * 16 + 16 + 16 * 64 + 64 + 64 * 16 + 16 + 4 * 16)
    weights = blocks + 2 * 16 + 100 * 16  # the final LayerNorm, the tied head (wpe: a lookup)
    assert model_flops_per_token(dense, 32) == 6 * weights + 6 * 2 * 32 * 16


def test_progress_line_rewrites_itself_under_mpiexec_when_the_launchers_output_is_a_terminal(tmp_path):
    """`-n 2` with a terminal: rank 0's output reaches it through mpiexec's pipes; the self-launching parent says
    it is a terminal, and its relay passes each rewritten line (ending in a carriage return) on at once."""
    primary, secondary = pty.openpty()
    process = start_job([sys.executable, "-m", "mpiparallel", "train", "-n", "2", *TINY, "--steps", "40"],
                        stdout=secondary, stderr=subprocess.PIPE)
    os.close(secondary)
    output, deadline = b"", time.monotonic() + 300
    while time.monotonic() < deadline:
        if not select.select([primary], [], [], max(0.0, deadline - time.monotonic()))[0]:
            break  # no output before the deadline: the assertions below fail, the job is killed
        try:
            chunk = os.read(primary, 1 << 16)
        except OSError:  # the terminal closed: every writer has ended
            break
        if not chunk:
            break
        output += chunk
    process.kill()
    assert process.wait(timeout=30) == 0, process.stderr.read().decode()
    text = output.decode(errors="replace")
    rewritten = [piece for piece in text.split("\n") if "\033[K\r" in piece]
    assert rewritten, text[-2000:]  # steps 1, 3, 5, … (every 2nd line stays) were rewritten in place
    assert "step    40/40" in text


def test_init_from_a_model_folder_with_another_tokenizer_than_the_data_is_one_clear_error(tmp_path):
    """The model folder's tokenizer (a BPE of 300 tokens) is not the default corpus's (2,048 tokens)."""
    text = tmp_path / "other.txt"
    text.write_text("A different text, with other words, to learn another tokenizer from. " * 200)
    prepared = mpiparallel("data", "prepare", str(text), "--out", str(tmp_path / "other"), "--tokenizer", "bpe",
                           "--vocab-size", "300", "--val-tokens", "0")
    assert prepared.returncode == 0, prepared.stderr
    model = tmp_path / "model"
    config = GPTConfig(vocab_size=4096, n_positions=64, n_embd=16, n_layer=1, n_head=2)
    hugging_face.save_pretrained(model, config, Transformer(config).state_dict())
    data.tokenizer_of_folder(tmp_path / "other").save(model)
    result = mpiparallel("train", "--init", str(model), "--steps", "1", "--seq-len", "16", "--batch-size", "2")
    assert result.returncode != 0
    errors = [line for line in result.stderr.splitlines() if "rror" in line]
    assert len(errors) == 1 and "Traceback" not in result.stderr, result.stderr
    assert "tokenizer" in errors[0] and "300 tokens" in errors[0] and "2048 tokens" in errors[0], errors[0]


def test_flags_that_turn_something_off_do_not_show_default_true():
    help_text = mpiparallel("train", "--help").stdout
    for flag in ("--no-overlap", "--no-moe-renormalize"):
        block = help_text.split(flag, 1)[1].split("\n  --", 1)[0]
        assert "[default: True]" not in block and "[default: off" in " ".join(block.split()), block


def test_generate_help_names_every_family():
    assert "GPT-2, Llama or Mixtral" in " ".join(mpiparallel("generate", "--help").stdout.split())


def test_train_and_schedule_default_to_the_same_microbatches_and_virtual_stages(tmp_path):
    """Both take pp microbatches and, for interleaved, 2 stages per rank."""
    out = tmp_path / "schedule.json"
    assert mpiparallel("schedule", "--pp", "4", "--schedule", "interleaved", "--json", str(out)).returncode == 0
    simulated = json.loads(out.read_text())
    assert (simulated["microbatches"], simulated["virtual_stages"]) == (4, 2)
    from mpiparallel.train.parallelize import virtual_stages

    settings = TrainSettings.from_options(pp=4, schedule="interleaved")
    assert settings.mesh.microbatches is None and virtual_stages(settings) == 2
    assert "[default: pp" in " ".join(mpiparallel("train", "--help").stdout.split())


def test_every_train_option_takes_its_default_from_the_settings():
    from mpiparallel.train.settings import _GROUP_OF, default

    command = main.commands["train"]
    options = {param.name: param for param in command.params if isinstance(param, click.Option)}
    shared = set(_GROUP_OF) & set(options)
    assert set(_GROUP_OF) - shared == {"n_positions"}  # the one setting with no flag (--init's config sets it)
    for name in shared:
        assert options[name].default == default(name), name


def test_counts_of_one_are_singular(tmp_path):
    text = tmp_path / "one.txt"
    text.write_text("one document only")
    prepared = mpiparallel("data", "prepare", str(text), "--out", str(tmp_path / "one"), "--val-tokens", "0")
    assert "from 1 document |" in prepared.stderr and "in 1 shard," in prepared.stdout, prepared
    assert prepared.stdout.rstrip().endswith("from 1 document"), prepared.stdout
    shown = mpiparallel("train", *TINY, "--steps", "1", "--show-mesh", "--data", str(tmp_path / "one.txt"),
                        "--seq-len", "4", "--batch-size", "1")
    assert "= 1 rank;" in shown.stdout and "1 layer," in shown.stdout and "2 heads" in shown.stdout, shown.stdout


@pytest.mark.parametrize(("options", "named"), [
    (["--params", "70e9", "--gpus", "2", "--gpu-memory", "8GB"], "memory: of 384 layouts the smallest needs"),
    (["--gpus", "4", "--tp", "3"], "the fixed choices (--tp 3) leave no layout"),
])
def test_plan_with_nothing_feasible_says_which_constraint_and_fails(options, named):
    result = mpiparallel("plan", *options)
    assert result.returncode == ExitCode.BAD_INPUT
    assert named in result.stderr, result.stderr
    assert "the fastest 0" not in result.stdout
    as_json = mpiparallel("plan", *options, "--json")
    assert as_json.returncode == ExitCode.BAD_INPUT and named in json.loads(as_json.stdout)["why_none"]


def test_plan_answering_max_bubble_prints_why_no_layout_fits_and_succeeds():
    """The exercise (each schedule's fewest microbatches) is answered, so exit 0; the reason no layout fits is a
    line of the text too, not only --json's why_none (before: "0 of 0 layouts fit" and nothing more)."""
    result = mpiparallel("plan", "--pp", "8", "--max-bubble", "0.1")
    assert result.returncode == 0, result.stderr
    assert "fewest microbatches for the bubble asked: gpipe 64" in result.stdout
    assert result.stdout.rstrip().endswith("no layout fits: the fixed choices (--pp 8) leave no layout train accepts "
                                           "on 8 GPUs with batch 8; leaving --pp to the search finds some")


def test_plans_help_example_keeps_its_line_continuation():
    """A backslash-newline in a docstring is Python's line continuation: the third example printed as one line with
    a gap of spaces in it."""
    shown = mpiparallel("plan", "--help").stdout
    assert "--ffn-hidden 14336 \\\n        --vocab-size 128256" in shown, shown


def test_blas_threads_leave_out_the_cores_a_busy_machine_keeps_busy():
    """On an idle node each rank gets its share of the cores; with other jobs running (load average 20 on 2
    cores, where 2 threads ran 2.6–4× slower than 1) one thread; never fewer than 1."""
    from mpiparallel.process import limit_blas_threads

    cores = len(os.sched_getaffinity(0))
    assert limit_blas_threads(None, environ={}, load=0.3) == cores
    assert limit_blas_threads(None, environ={}, load=20.0) == 1
    assert limit_blas_threads(None, environ={"MPI_LOCALNRANKS": str(2 * cores)}, load=0.0) == 1
    if cores >= 2:
        assert limit_blas_threads(None, environ={}, load=cores - 1.0) == 1
    assert limit_blas_threads(None, environ={"OMP_NUM_THREADS": "3"}, load=20.0) == 3


def tensorboard_scalars(folder) -> dict[str, dict[int, float]]:
    """Every scalar in the event files of `folder`: TFRecords (length, its CRC, an Event protobuf, its CRC)."""
    event_pb2 = optional_module("tensorboardX.proto.event_pb2", "--tensorboard writes with tensorboardX")
    scalars: dict[str, dict[int, float]] = {}
    for path in sorted(folder.glob("events.out.tfevents.*")):
        raw, offset = path.read_bytes(), 0
        while offset < len(raw):
            length = int.from_bytes(raw[offset:offset + 8], "little")
            event = event_pb2.Event.FromString(raw[offset + 12:offset + 12 + length])
            offset += 12 + length + 4
            for value in event.summary.value:
                scalars.setdefault(value.tag, {})[event.step] = value.simple_value
    return scalars


def test_tensorboard_gets_each_steps_loss_throughput_and_bytes_per_axis(tmp_path):
    optional_module("tensorboardX", "--tensorboard writes with tensorboardX")
    log, board = tmp_path / "log.jsonl", tmp_path / "board"
    result = mpiparallel("train", "-n", "2", *TINY, "--steps", "3", "--log-json", str(log), "--tensorboard",
                         str(board))
    assert result.returncode == 0, result.stderr
    records = [json.loads(line) for line in log.read_text().splitlines()]
    scalars = tensorboard_scalars(board)
    assert scalars["loss/train"] == pytest.approx({r["step"]: r["loss"] for r in records}, rel=1e-6)
    assert scalars["bytes_sent/dp"] == {r["step"]: r["comm_bytes"]["dp"] for r in records}
    assert scalars["bytes_sent/dp"][1] > 0
    speeds = {r["step"]: r["tokens"] / r["time_s"] for r in records}
    assert scalars["throughput/tokens_per_second"] == pytest.approx(speeds, rel=1e-6)


def test_plot_draws_the_logs_loss_tokens_per_second_and_bytes_per_axis(tmp_path):
    optional_module("matplotlib", "mpiparallel plot draws with matplotlib")
    from mpiparallel.commands.plot import draw, read_log

    log = tmp_path / "log.jsonl"
    records = [{"step": s + 1, "loss": 5.0 - s, "lr": 1e-3, "tokens": 100, "time_s": 0.5 + s,
                "comm_bytes": {"dp": 1000 * (s + 1), "tp": 7}} for s in range(4)]
    records[3]["val_loss"] = 2.5
    log.write_text("".join(json.dumps(r) + "\n" for r in [*records, {"event": "restart", "step": 2}]))
    figure = draw(read_log(log))
    loss, speed, traffic = figure.axes
    assert list(loss.lines[0].get_ydata()) == [5.0, 4.0, 3.0, 2.0] and list(loss.lines[1].get_ydata()) == [2.5]
    assert list(speed.lines[0].get_ydata()) == pytest.approx([200, 100 / 1.5, 40, 100 / 3.5])
    assert {line.get_label(): list(line.get_ydata()) for line in traffic.lines} == {
        "dp": [0.001, 0.002, 0.003, 0.004], "tp": [7e-6] * 4}
    result = mpiparallel("plot", str(log), "-o", str(tmp_path / "run.png"))
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "run.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_one_step_numbering_in_the_console_the_json_log_the_checkpoints_and_the_resume_line(tmp_path):
    """Step k is the k-th step everywhere: the console's "step k/N", the JSON log's "step": k, the checkpoint
    folder step-k saved after it, and "resumed from step k" before step k + 1."""
    log, checkpoints = tmp_path / "log.jsonl", tmp_path / "checkpoints"
    first = mpiparallel("train", *TINY, "--steps", "3", "--log-json", str(log),
                        "--checkpoint-dir", str(checkpoints), "--checkpoint-every", "3")
    assert first.returncode == 0, first.stderr
    console = [int(line.split()[1].split("/")[0]) for line in first.stdout.splitlines() if line.startswith("step ")]
    assert console == [r["step"] for r in map(json.loads, log.read_text().splitlines())] == [1, 2, 3], first.stdout
    assert sorted(path.name for path in checkpoints.iterdir()) == ["step-00000003"]
    resumed = mpiparallel("train", *TINY, "--steps", "4", "--log-json", str(log), "--checkpoint-dir",
                          str(checkpoints), "--resume")
    assert resumed.returncode == 0, resumed.stderr
    assert "resumed from step 3" in resumed.stdout + resumed.stderr
    assert [r["step"] for r in map(json.loads, log.read_text().splitlines())] == [1, 2, 3, 4]  # appended
    assert "step     4/4 |" in resumed.stdout
