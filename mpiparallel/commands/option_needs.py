"""Options whose effect depends on another option: given without it, they would do nothing, so each is one clear
error before any rank starts ("--min-ranks needs --elastic"), never a run that silently ignores it.

One table for `train`, in the order of its --help. An option counts as given when it comes from the command line
or its environment variable, whatever its value (`--min-ranks 1` without --elastic is an error too: it says
something the run will not do). Requirements that need the mesh or the model resolved first are checked where
those are built, each with one message as here: --sp needs --tp (parallelize), --virtual-stages needs a pipeline
schedule that has them (parallelize), --ep needs --experts (settings), llama's and deepseek_v3's options need
their --arch (settings), --fp8 needs --compute-dtype bfloat16 and --exp-avg-dtype bfloat16 needs --optimizer
adamw (parallelize), --ep-dispatch hierarchical needs
deepseek_v3's group-limited router (parallelize). --schedule and --cp-attention are left out on purpose: an
--elastic relaunch may shrink pp or cp to 1 under the same command line.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import click
from click.core import ParameterSource


@dataclass(frozen=True)
class Needs:
    option: str
    """The option as typed (`--min-ranks`)."""
    key: str
    """Its parameter name in the command's options (`min_ranks`)."""
    needs: str
    """What it needs, in words that finish "OPTION needs …"."""
    met: Callable[[Mapping[str, Any]], bool]
    """Whether the command's options give it what it needs."""


def _has_experts(options: Mapping[str, Any]) -> bool:
    return bool(options["experts"]) or options["init"] is not None  # an --init folder's config may hold experts


def _moe(option: str, key: str) -> Needs:
    return Needs(option, key, "--experts (it shapes the mixture of experts; without experts there is none)",
                 _has_experts)


TRAIN_NEEDS: tuple[Needs, ...] = (
    Needs("--save-dtype", "save_dtype", "--save (the folder it writes in that dtype)",
          lambda o: o["save"] is not None),
    Needs("--checkpoint-every", "checkpoint_every", "--checkpoint-dir (where the checkpoints go)",
          lambda o: o["checkpoint_dir"] is not None),
    Needs("--keep-checkpoints", "keep_checkpoints", "--checkpoint-dir (whose newest checkpoints it keeps)",
          lambda o: o["checkpoint_dir"] is not None),
    Needs("--min-ranks", "min_ranks", "--elastic (only an elastic run continues on fewer ranks)",
          lambda o: o["elastic"]),
    Needs("--elastic-mode", "elastic_mode", "--elastic (it says how an elastic run goes on)", lambda o: o["elastic"]),
    Needs("--max-restarts", "max_restarts", "--elastic (only an elastic run relaunches)", lambda o: o["elastic"]),
    Needs("--eval-batches", "eval_batches", "--eval-every N (validation losses are computed only then)",
          lambda o: o["eval_every"] > 0),
    Needs("--val-data", "val_data", "--eval-every N (validation losses are computed only then)",
          lambda o: o["eval_every"] > 0),
    Needs("--validation-fraction", "validation_fraction", "--eval-every N (validation losses are computed only then)",
          lambda o: o["eval_every"] > 0),
    Needs("--weight-decay", "weight_decay", "--optimizer adamw (sgd has no weight decay)",
          lambda o: o["optimizer"] == "adamw"),
    _moe("--top-k", "top_k"),
    _moe("--moe-aux-coef", "moe_aux_coef"),
    _moe("--moe-aux-scope", "moe_aux_scope"),
    _moe("--capacity-factor", "capacity_factor"),
    _moe("--no-moe-renormalize", "moe_renormalize"),
    _moe("--moe-bias-rate", "moe_bias_rate"),
    _moe("--n-group", "n_group"),
    _moe("--topk-group", "topk_group"),
    _moe("--routed-scaling-factor", "routed_scaling_factor"),
    _moe("--first-k-dense", "first_k_dense"),
    _moe("--moe-seq-aux-coef", "moe_seq_aux_coef"),
    Needs("--mtp-weight", "mtp_weight", "--mtp-depth 1 or more (the multi-token-prediction losses it weighs)",
          lambda o: o["mtp_depth"] > 0 or o["init"] is not None),
    Needs("--dp-shard", "dp_shard", "--zero 1, 2 or 3 (it says over how many ranks ZeRO shards)",
          lambda o: o["zero"] > 0),
    Needs("--eot-id", "eot_id", "--attention document (the token that opens each document)",
          lambda o: o["attention"] == "document"),
)


def check_needs(ctx: click.Context, options: Mapping[str, Any], table: tuple[Needs, ...] = TRAIN_NEEDS) -> None:
    """One UsageError for the first option of `table` given without what it needs."""
    for rule in table:
        if ctx.get_parameter_source(rule.key) in (ParameterSource.COMMANDLINE, ParameterSource.ENVIRONMENT) \
                and not rule.met(options):
            raise click.UsageError(f"{rule.option} needs {rule.needs}")
