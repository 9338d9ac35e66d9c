"""Every `mpiparallel train` option, in groups, with its default: the one place the defaults are written — the
model's own choices read theirs from `models.config.GPTConfig`, so each is written once, there.

The command line (`mpiparallel.commands.cli`) reads its defaults from here (`default`), so a script that builds
`TrainSettings.from_options(...)` and the command that parses flags train the same model. Nothing here imports
NumPy or MPI: the command line imports it to build its options before any rank starts.

One vocabulary: an option that sets a GPTConfig field has that field's name, except the five the command line
has always spelled shorter (`CONFIG_FIELDS`: --experts is n_experts, --top-k moe_top_k, …).
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Any

from models.config import GPTConfig

CONFIG_FIELDS = {"experts": "n_experts", "top_k": "moe_top_k", "capacity_factor": "moe_capacity_factor",
                 "shared_experts": "n_shared_experts", "first_k_dense": "first_k_dense_replace"}
"""ModelSettings' names that differ from the GPTConfig fields they set (the command line's flags: a contract)."""


@dataclass(frozen=True)
class ModelSettings:
    """The model: its family and shape (or `init`, a Hugging Face directory to start from), seed, precision,
    device, the activation recomputation mode, and a mixture of experts (experts > 0) with its routing settings."""

    n_layer: int = GPTConfig.n_layer
    n_head: int = GPTConfig.n_head
    n_embd: int = GPTConfig.n_embd
    vocab_size: int | None = None  # None: the data's (data.json), else 256 (bytes)
    n_positions: int = GPTConfig.n_positions
    seed: int = 0
    dtype: str = "float32"
    compute_dtype: str | None = None  # None: dtype (mixed precision: bfloat16 or float16)
    grad_dtype: str | None = None  # None: dtype
    fp8: str = "none"  # "blockwise": the linears inside the blocks multiply in E4M3 (needs bfloat16 compute)
    loss_scale: str | None = None  # None: "dynamic" for float16, else off
    device: str = "cpu"
    init: str | None = None
    recompute: str = "none"
    attention: str = "causal"  # "document": each token attends only within its document (`models.documents`)
    query_block: int | None = None  # attention's rows per causal block; None: 64 on a CPU, 1024 on a GPU
    experts: int = GPTConfig.n_experts
    top_k: int = GPTConfig.moe_top_k
    moe_aux_coef: float | None = None  # None: GPTConfig's, or 0 for deepseek_v3 (which balances otherwise)
    moe_aux_scope: str = "local"  # "global": one Switch aux loss over the step's whole batch (`models.moe`)
    capacity_factor: float = GPTConfig.moe_capacity_factor
    moe_renormalize: bool = GPTConfig.moe_renormalize
    moe_bias_rate: float = GPTConfig.moe_bias_rate
    arch: str = GPTConfig.arch
    n_kv_head: int | None = None
    ffn_hidden: int | None = None
    rope_theta: float = GPTConfig.rope_theta
    tie_embeddings: bool | None = None
    q_lora_rank: int | None = None  # deepseek_v3's (None: the defaults `inputs.deepseek_choices` states)
    kv_lora_rank: int | None = None
    qk_nope_head_dim: int | None = None
    qk_rope_head_dim: int | None = None
    v_head_dim: int | None = None
    moe_ffn_hidden: int | None = None
    shared_experts: int = 1  # deepseek_v3's one shared expert (GPTConfig's 0 is a model without any)
    n_group: int = GPTConfig.n_group
    topk_group: int = GPTConfig.topk_group
    routed_scaling_factor: float = GPTConfig.routed_scaling_factor
    first_k_dense: int = GPTConfig.first_k_dense_replace
    moe_seq_aux_coef: float = GPTConfig.moe_seq_aux_coef
    mtp_depth: int = GPTConfig.mtp_depth
    mtp_weight: float = GPTConfig.mtp_weight


@dataclass(frozen=True)
class MeshSettings:
    """How the ranks share the work: the axis sizes (dp None: the ranks left over), sequence parallelism, the ZeRO
    stage, microbatches per DP rank (None: pp, so a pipeline is filled; as `mpiparallel schedule`), the pipeline
    schedule, and the gradient buckets."""

    dp: int | None = None
    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1
    ep_dispatch: str = "flat"  # "hierarchical": DeepSeek-V3's two-hop node-limited dispatch (`collectives.two_hop`)
    sp: bool = False
    zero: int = 0
    dp_shard: int | None = None  # hybrid sharding: ZeRO shards over groups of this many DP ranks (None: all of dp)
    microbatches: int | None = None
    schedule: str = "1f1b"
    virtual_stages: int | None = None  # None: 2 for interleaved, else 1 (as `mpiparallel schedule`)
    cp_attention: str = "ring"
    bucket_mb: float = 25.0
    overlap: bool = True


@dataclass(frozen=True)
class OptimizerSettings:
    """The update rule and the learning-rate schedule."""

    optimizer: str = "adamw"
    lr: float = 1e-3
    weight_decay: float = 0.0
    grad_clip: float = 0.0
    lr_schedule: str = "constant"
    warmup_steps: int = 0
    exp_avg_dtype: str = "float32"  # AdamW's moments: "float32" keeps them at --dtype; "bfloat16" halves them


@dataclass(frozen=True)
class DataSettings:
    """What is read: the tokens (file, shard, glob or folder; see `data.dataset`), the batch shape and order, how
    many steps, and the held-out validation."""

    data: str | None = None
    val_data: str | None = None
    shuffle: bool = False
    seq_len: int = 128
    batch_size: int = 8
    steps: int = 200
    eval_every: int = 0
    eval_batches: int = 4
    validation_fraction: float = 0.1
    eot_id: int | None = None  # the end-of-text id that opens a document (--attention document); None: data.json's


@dataclass(frozen=True)
class OutputSettings:
    """What is written and printed: the final model, training checkpoints, the JSON log, reports, a sample."""

    save: str | None = None
    save_dtype: str | None = None  # None: the master weights' dtype (--dtype)
    checkpoint_dir: str | None = None
    checkpoint_every: int = 0  # 0 with a checkpoint_dir: one checkpoint, after the last step
    keep_checkpoints: int = 0  # 0: keep every checkpoint (the log says the disk they use)
    resume: bool = False
    resume_from: str | None = None  # a step of checkpoint_dir, or a checkpoint folder (implies resume)
    log_json: str | None = None
    tensorboard: str | None = None  # a folder for TensorBoard's event files (needs tensorboardX)
    trace: str | None = None
    sample_tokens: int = 0
    show_mesh: bool = False
    memory_report: bool = False


@dataclass(frozen=True)
class ElasticSettings:
    """How the self-launching parent supervises the run. `--elastic`: the survivors of a lost rank or host go on
    in place under an MPI with ULFM (`recovery`), else the parent relaunches them (`elastic_mode` forces either): at
    least `min_ranks` of them, at most `max_restarts` times, from the survivors' memory or the newest complete
    checkpoint. `stall_timeout`: it ends a job none of whose ranks made progress for that many seconds, naming the
    rank behind (0: never; `commands/stall.py`)."""

    elastic: bool = False
    elastic_mode: str = "auto"  # "in-place" (ULFM: the survivors go on), "relaunch", or auto: in place where MPI can
    min_ranks: int = 1
    max_restarts: int = 3
    stall_timeout: float = 600.0  # PyTorch's NCCL watchdog's default


@dataclass(frozen=True)
class DebugSettings:
    """Finding what went wrong: where the ranks write their flight recorders (`flight_dir`; None:
    $MPIPARALLEL_FLIGHT_DIR, else the working directory), and whether every collective first checks that all ranks
    call it alike (`check_collectives`: a mismatch becomes one error on every rank instead of a hang)."""

    flight_dir: str | None = None
    check_collectives: bool = False


@dataclass(frozen=True)
class TrainSettings:
    """Every `mpiparallel train` option, after parsing, in groups (see the command's --help for their meaning)."""

    model: ModelSettings = ModelSettings()
    mesh: MeshSettings = MeshSettings()
    optimizer: OptimizerSettings = OptimizerSettings()
    data: DataSettings = DataSettings()
    output: OutputSettings = OutputSettings()
    elastic: ElasticSettings = ElasticSettings()
    debug: DebugSettings = DebugSettings()

    @classmethod
    def from_options(cls, **options: Any) -> TrainSettings:
        """Settings from flat option names (the command line's: n_layer=…, zero=…), each put in its group."""
        return cls().with_options(**options)

    def with_options(self, **options: Any) -> TrainSettings:
        """A copy with the given flat options changed; an unknown name is an error."""
        groups: dict[str, dict[str, Any]] = {}
        for name, value in options.items():
            group = _GROUP_OF.get(name)
            if group is None:
                raise TypeError(f"TrainSettings has no option {name!r}")
            groups.setdefault(group, {})[name] = value
        return replace(self, **{group: replace(getattr(self, group), **values) for group, values in groups.items()})


_GROUP_OF = {option.name: group.name for group in fields(TrainSettings) for option in fields(group.default)}


def default(option: str) -> Any:
    """The default of a flat option name (the command line's: "n_layer", "zero", …)."""
    group = getattr(TrainSettings(), _GROUP_OF[option])
    return getattr(group, option)


def moment_dtype(optimizer: OptimizerSettings) -> str | None:
    """The AdamW moments' dtype: "bfloat16" with --exp-avg-dtype bfloat16, else None (the master dtype)."""
    return "bfloat16" if optimizer.exp_avg_dtype == "bfloat16" else None
