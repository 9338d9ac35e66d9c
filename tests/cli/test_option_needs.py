"""Every option of `train` that needs another (`option_needs.TRAIN_NEEDS`) is one clear error without it, and no
error with it. Before, `train -n 2 --min-ranks 4 --steps 4` and `--max-restarts 2` without --elastic trained and
exited 0."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from mpiparallel.commands.cli import main, train
from mpiparallel.commands.option_needs import TRAIN_NEEDS, check_needs
from mpiparallel.errors import ExitCode

DEEPSEEK = ["--arch", "deepseek_v3"]
CASES = {  # option: (the option given, with whatever else it takes; what it needs)
    "--save-dtype": (["--save-dtype", "float32"], ["--save", "out"]),
    "--checkpoint-every": (["--checkpoint-every", "2"], ["--checkpoint-dir", "ck"]),
    "--keep-checkpoints": (["--keep-checkpoints", "2"], ["--checkpoint-dir", "ck"]),
    "--min-ranks": (["--min-ranks", "4"], ["--elastic"]),
    "--max-restarts": (["--max-restarts", "2"], ["--elastic"]),
    "--elastic-mode": (["--elastic-mode", "relaunch"], ["--elastic"]),
    "--eval-batches": (["--eval-batches", "3"], ["--eval-every", "10"]),
    "--val-data": (["--val-data", "val.npy"], ["--eval-every", "10"]),
    "--validation-fraction": (["--validation-fraction", "0.2"], ["--eval-every", "10"]),
    "--weight-decay": (["--optimizer", "sgd", "--weight-decay", "0.1"], ["--optimizer", "adamw"]),
    "--top-k": (["--top-k", "2"], ["--experts", "4"]),
    "--moe-aux-coef": (["--moe-aux-coef", "0.1"], ["--experts", "4"]),
    "--moe-aux-scope": (["--moe-aux-scope", "global"], ["--experts", "4"]),
    "--capacity-factor": (["--capacity-factor", "1.5"], ["--experts", "4"]),
    "--no-moe-renormalize": (["--no-moe-renormalize"], ["--experts", "4"]),
    "--moe-bias-rate": (["--moe-bias-rate", "0.001"], ["--experts", "4"]),
    "--n-group": ([*DEEPSEEK, "--n-group", "2"], ["--experts", "4"]),
    "--topk-group": ([*DEEPSEEK, "--topk-group", "1"], ["--init", "some-deepseek-folder"]),
    "--routed-scaling-factor": ([*DEEPSEEK, "--routed-scaling-factor", "2.5"], ["--experts", "4"]),
    "--first-k-dense": ([*DEEPSEEK, "--first-k-dense", "1"], ["--experts", "4"]),
    "--moe-seq-aux-coef": ([*DEEPSEEK, "--moe-seq-aux-coef", "0.001"], ["--experts", "4"]),
    "--mtp-weight": ([*DEEPSEEK, "--mtp-weight", "0.3"], ["--mtp-depth", "1"]),
    "--dp-shard": (["--dp-shard", "2"], ["--zero", "3"]),
    "--eot-id": (["--eot-id", "3"], ["--attention", "document"]),
}


def test_every_row_of_the_table_has_a_case():
    assert set(CASES) == {rule.option for rule in TRAIN_NEEDS}


@pytest.mark.parametrize("rule", TRAIN_NEEDS, ids=lambda rule: rule.option)
def test_an_option_without_what_it_needs_is_one_clear_error(rule):
    given, _ = CASES[rule.option]
    result = CliRunner().invoke(main, ["train", "--steps", "1", *given])
    assert result.exit_code == ExitCode.BAD_INPUT, result.output
    assert f"Error: {rule.option} needs {rule.needs}" in result.output, result.output


@pytest.mark.parametrize("rule", TRAIN_NEEDS, ids=lambda rule: rule.option)
def test_with_what_it_needs_the_option_passes(rule):
    given, needed = CASES[rule.option]
    context = train.make_context("train", ["--steps", "1", *given, *needed])
    check_needs(context, context.params)  # raises click.UsageError if any rule still fails


def test_a_default_left_alone_needs_nothing():
    context = train.make_context("train", ["--steps", "1"])
    check_needs(context, context.params)
