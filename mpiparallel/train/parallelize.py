"""Where each parallel axis enters training: mesh → schedule → model → engines → optimizer, in axis order.

The model is built serially, then every axis that changes what it is made of enters the same way: an axis object
(`models.axis`) handed to `Transformer.parallelize`, which rebuilds the layers asking each axis its part.
Data parallelism changes no layer — every replica runs the same model — so it enters after: its engines take the
built model's parameters over and run as hooks around each unit.

    axis   object (its module in mpiparallel/axes/)     changes                             placement
    pp     `PipelineStages` (pipeline_parallel)          the units this rank holds           Held on "pp"
    tp,sp  `TensorParallel` (tensor_parallel)            linears, embedding, head, heads:    Sharded / Partial
                                                         this rank's shards                  on "tp"
    cp     `ContextParallel` (context_parallel)          the attention, positions            replicated
    ep     `ExpertParallel` (expert_parallel)            the experts held, their dispatch    Held on "ep"
    dp     `data_parallel_engines` (data_parallel)       nothing in the model: owns the      ZeRO segments
                                                         parameters, sums the gradients
    —      `build_optimizer`: over what the engines hand it (ZeRO: this rank's segments)

Every check that a mesh and a model fit together is here, each one clear `ConfigError` on every rank.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from collectives import Communicator
from models.axis import Axis
from models.layers import GPU_QUERY_BLOCK, QUERY_BLOCK
from models.transformer import GPTConfig, Transformer
from mpiparallel.axes.context_parallel import ContextParallel
from mpiparallel.axes.expert_parallel import ExpertParallel
from mpiparallel.axes.tensor_parallel import TensorParallel, check_tensor_parallel_shape

from .. import optim
from ..axes.data_parallel import DataParallelGroups, data_parallel_engines
from ..axes.pipeline_parallel import PipelineStages, check_tag_space, stage_units
from ..checkpoints import hugging_face
from ..errors import ConfigError, on_every_rank
from ..mesh import Mesh, MeshShape
from ..schedules import Schedule, build_schedule, default_microbatches, default_virtual_stages
from .settings import ModelSettings, OptimizerSettings, TrainSettings, moment_dtype


@dataclass
class Parallel:
    """This rank's part of the run: its mesh, the pipeline schedule (None without --pp), its model (its shards and
    stages), the data-parallel engines that own the parameters, and the optimizer over what they hand it."""

    mesh: Mesh
    schedule: Schedule | None
    model: Transformer
    engine: DataParallelGroups
    optimizer: Any


def parallelize(settings: TrainSettings, mesh: Mesh, config: GPTConfig, xp: Any,
                load_weights: Callable[[Transformer], None]) -> Parallel:
    """Build this rank's part of the run, axis by axis; `load_weights` (--resume) fills the model before the
    data-parallel engines take its parameters over."""
    check_batch(settings, mesh)
    schedule = pipeline_schedule(settings, mesh, config)
    model = build_model(settings, mesh, config, schedule, xp)
    load_weights(model)
    # a pipeline schedule interleaves microbatches and splits backward: the gradients are reduced after it
    overlap = settings.mesh.overlap and schedule is None
    engine = data_parallel_engines(model, mesh, settings.mesh.zero, settings.mesh.bucket_mb, overlap)
    optimizer = build_optimizer(settings.optimizer, engine.optimizer_parameters())
    return Parallel(mesh, schedule, model, engine, optimizer)


def build_mesh(settings: TrainSettings, world: Any) -> Mesh:
    """The mesh over `world` (an mpi4py communicator); with --check-collectives every axis's communicator checks
    each collective's arguments across its ranks first (`Communicator.check_arguments`, inherited by the splits)."""
    layout = settings.mesh
    if settings.debug.check_collectives:
        world = Communicator(world, check_arguments=True)
    mesh = Mesh(world, MeshShape(dp=layout.dp, tp=layout.tp, pp=layout.pp, cp=layout.cp, ep=layout.ep,
                                 dp_shard=layout.dp_shard))
    if layout.sp and mesh.shape.tp == 1:
        raise ConfigError("--sp (sequence parallelism) works inside a tensor-parallel group: give --tp > 1")
    return mesh


def microbatch_count(settings: TrainSettings, mesh: Mesh) -> int:
    """--microbatches, by default pp (one per stage: the least that fills a pipeline; 1 without one)."""
    return settings.mesh.microbatches or default_microbatches(mesh.shape.pp)


def virtual_stages(settings: TrainSettings) -> int:
    """--virtual-stages, by default 2 for interleaved, else 1."""
    return settings.mesh.virtual_stages or default_virtual_stages(settings.mesh.schedule)


def microbatch_rows(settings: TrainSettings, mesh: Mesh) -> int:
    """Sequences in one microbatch on one rank: the global batch over dp ranks and microbatches."""
    return settings.data.batch_size // (mesh.shape.dp * microbatch_count(settings, mesh))


def check_batch(settings: TrainSettings, mesh: Mesh) -> None:
    share = mesh.shape.dp * microbatch_count(settings, mesh)
    if settings.data.batch_size % share:
        raise ConfigError(f"--batch-size {settings.data.batch_size} must be divisible by dp × microbatches = "
                          f"{mesh.shape.dp} × {microbatch_count(settings, mesh)} = {share}")


def activation_shape(settings: TrainSettings, mesh: Mesh, config: GPTConfig) -> tuple[int, int, int]:
    """The (rows, positions, channels) activation one microbatch hands from stage to stage on this rank."""
    positions = settings.data.seq_len // mesh.shape.cp // (mesh.shape.tp if settings.mesh.sp else 1)
    return microbatch_rows(settings, mesh), positions, config.n_embd


# -- pp ------------------------------------------------------------------------------------------------------

def pipeline_schedule(settings: TrainSettings, mesh: Mesh, config: GPTConfig) -> Schedule | None:
    """The pipeline schedule (None without --pp), checked against the model: every stage needs a block."""
    layout = settings.mesh
    if mesh.shape.pp == 1:
        if layout.virtual_stages not in (None, 1):
            raise ConfigError("--virtual-stages needs a pipeline: give --pp > 1")
        return None
    try:
        schedule = build_schedule(layout.schedule, mesh.shape.pp, microbatch_count(settings, mesh),
                                  virtual_stages(settings))
    except ValueError as error:
        raise ConfigError(str(error)) from None
    stage_units(config.n_layer, schedule.num_stages)  # raises when there are more stages than layers
    check_tag_space(schedule.num_stages, schedule.microbatches)
    return schedule


# -- tp, sp, cp, ep: the model -------------------------------------------------------------------------------

def query_block(model: ModelSettings) -> int:
    """--query-block, else the device's default (`models.layers.QUERY_BLOCK` on a CPU, `GPU_QUERY_BLOCK` on a GPU)."""
    return model.query_block or (GPU_QUERY_BLOCK if model.device == "gpu" else QUERY_BLOCK)


def build_model(settings: TrainSettings, mesh: Mesh, config: GPTConfig, schedule: Schedule | None,
                xp: Any = np) -> Transformer:
    """This rank's model: the serial Transformer, then split over every axis of the mesh that splits it
    (`model_axes`, `Transformer.parallelize`); every parameter's placement records the mesh."""
    if settings.mesh.sp and settings.data.seq_len % mesh.shape.tp:
        raise ConfigError(f"--sp splits the sequence over the {mesh.shape.tp} tensor-parallel ranks: --seq-len "
                          f"{settings.data.seq_len} must be divisible by {mesh.shape.tp}")
    check_experts(config, mesh)
    on_every_rank(mesh.world, lambda: check_ep_dispatch(settings, mesh, config))
    check_sequence_balance(settings, mesh, config)
    axes = model_axes(settings, mesh, config, schedule)
    try:  # the model checks its own choices (precision, FP8); the command line's error is its message
        model = Transformer(config, seed=settings.model.seed, dtype=np.dtype(settings.model.dtype), xp=xp,
                            recompute=settings.model.recompute, query_block=query_block(settings.model),
                            compute_dtype=settings.model.compute_dtype, grad_dtype=settings.model.grad_dtype,
                            fp8=settings.model.fp8, moe_token_sets=moe_token_sets(settings, mesh, config),
                            moe_aux_scope=settings.model.moe_aux_scope)
    except ValueError as error:
        raise ConfigError(str(error)) from None
    model.parallelize(*axes)
    if settings.model.init:
        model.load_state_dict(hugging_face.load_pretrained(settings.model.init)[1])
    return model


def model_axes(settings: TrainSettings, mesh: Mesh, config: GPTConfig, schedule: Schedule | None) -> list[Axis]:
    """The axes that split this rank's model, in the mesh's order (`models.axis`), after the checks that give one
    clear message each: this pipeline rank's stages, its tensor-parallel shards (with SP: its sequence slice
    between the layers), its context-parallel attention, its experts."""
    axes: list[Axis] = []
    if schedule is not None:
        axes.append(PipelineStages(schedule, mesh.pp.rank))
    if mesh.shape.tp > 1:
        try:
            check_tensor_parallel_shape(config, mesh.shape.tp)
        except ValueError as error:
            raise ConfigError(str(error)) from None
        axes.append(TensorParallel(mesh.tp, sequence_parallel=settings.mesh.sp))
    if mesh.shape.cp > 1:
        axes.append(context(settings, mesh, config))
    if mesh.shape.ep > 1:
        axes.append(ExpertParallel(mesh.ep, settings.mesh.ep_dispatch))
    return axes


def moe_token_sets(settings: TrainSettings, mesh: Mesh, config: GPTConfig) -> int:
    """The token sets one step averages the MoE aux loss over: microbatches × dp × cp (× tp with SP)."""
    if not config.n_experts:
        return 1
    return microbatch_count(settings, mesh) * mesh.shape.dp * mesh.shape.cp * (
        mesh.shape.tp if settings.mesh.sp else 1)


def context(settings: TrainSettings, mesh: Mesh, config: GPTConfig) -> ContextParallel:
    """The CP axis with its attention variant, after the checks that give one clear message."""
    cp, tp, variant = mesh.shape.cp, mesh.shape.tp, settings.mesh.cp_attention
    if settings.data.seq_len % (2 * cp):
        raise ConfigError(f"--cp {cp} cuts each sequence into 2·cp = {2 * cp} chunks: --seq-len "
                          f"{settings.data.seq_len} must be divisible by {2 * cp}")
    if settings.mesh.sp and (settings.data.seq_len // cp) % tp:
        raise ConfigError(f"--sp with --cp {cp}: each CP rank's {settings.data.seq_len // cp} tokens must be "
                          f"divisible by tp ({tp})")
    if variant == "ulysses" and config.n_head % (cp * tp):
        raise ConfigError(f"--cp-attention ulysses shares the heads out over cp·tp = {cp * tp} ranks: n_head "
                          f"({config.n_head}) must be divisible by {cp * tp}")
    kv_heads = max(config.kv_heads // tp, 1)  # per TP rank
    if variant == "ulysses" and kv_heads % cp and cp % kv_heads:
        raise ConfigError(f"--cp-attention ulysses shares the KV heads out over --cp {cp} ranks: the {kv_heads} KV "
                          f"head(s) per tensor-parallel rank and cp must divide one another")
    return ContextParallel(mesh.cp, variant)


def check_experts(config: GPTConfig, mesh: Mesh) -> None:
    """One clear message for each mixture-of-experts setting the mesh cannot run."""
    ep = mesh.shape.ep
    if ep > 1 and not config.n_experts:
        raise ConfigError(f"--ep {ep} spreads experts over ranks: give --experts")
    if config.n_experts and config.n_experts % ep:
        raise ConfigError(f"--ep {ep} must divide --experts {config.n_experts} (each EP rank holds E/ep experts)")


def check_ep_dispatch(settings: TrainSettings, mesh: Mesh, config: GPTConfig) -> None:
    """--ep-dispatch hierarchical is DeepSeek-V3's node-limited dispatch: it needs the group-limited router and an EP
    group over nodes of equal size whose node b holds exactly router group b's experts, so that each token's
    experts lie on at most --topk-group nodes. Run on every rank (EP groups may lie differently)."""
    if settings.mesh.ep_dispatch == "flat":
        return
    what = "--ep-dispatch hierarchical (DeepSeek-V3's node-limited two-hop dispatch)"
    if not config.is_deepseek:
        raise ConfigError(f"{what} needs --arch deepseek_v3: its group-limited router (--n-group, --topk-group) is "
                          f"what keeps each token's experts on few nodes")
    if mesh.shape.ep == 1:
        raise ConfigError(f"{what} moves tokens between expert-parallel ranks: give --ep > 1")
    layout, ep = mesh.ep.topology, mesh.shape.ep
    sizes = [len(members) for members in layout.members]
    if not layout.spans_nodes:
        raise ConfigError(f"{what} crosses nodes once per target node, but each EP group of {ep} ranks lies on one "
                          f"node: use --ep-dispatch flat, or an EP group spanning nodes (MPIPARALLEL_RANKS_PER_NODE "
                          f"emulates nodes on one machine)")
    if not layout.even:
        raise ConfigError(f"{what} needs the EP group's nodes to hold equally many of its ranks, got {sizes}")
    if config.n_group != layout.count:
        raise ConfigError(f"{what} needs --n-group equal to the nodes of the EP group ({layout.count}: each router "
                          f"group's experts on one node), got --n-group {config.n_group}")
    per_rank, per_group = config.n_experts // ep, config.n_experts // config.n_group
    for group in range(config.n_group):
        nodes = {layout.node_index[expert // per_rank] for expert in range(group * per_group, (group + 1) * per_group)}
        if len(nodes) > 1:
            raise ConfigError(f"{what} needs each router group's experts on one node, but group {group}'s experts "
                              f"(EP ranks {group * per_group // per_rank}…{((group + 1) * per_group - 1) // per_rank})"
                              f" lie on nodes {sorted(nodes)}: the mesh must put consecutive EP ranks on one node")


def check_sequence_balance(settings: TrainSettings, mesh: Mesh, config: GPTConfig) -> None:
    """DeepSeek-V3's multi-token prediction needs a token left to predict (it runs under --cp and --sp:
    `models.multi_token`; so does the sequence-wise balance loss, its counts summed over the ranks that split a
    sequence: `models.deepseek_moe`)."""
    if config.mtp_depth >= settings.data.seq_len:
        raise ConfigError(f"--mtp-depth {config.mtp_depth}: module k predicts the token k + 1 ahead, so --seq-len "
                          f"({settings.data.seq_len}) must exceed the depth")


# -- the update ----------------------------------------------------------------------------------------------

def build_optimizer(settings: OptimizerSettings, params: list) -> Any:
    moments = moment_dtype(settings)
    if settings.optimizer == "sgd":
        if moments is not None:
            raise ConfigError("--exp-avg-dtype bfloat16 stores AdamW's moments; --optimizer sgd has none")
        return optim.SGD(params, lr=settings.lr)
    return optim.AdamW(params, lr=settings.lr, weight_decay=settings.weight_decay, moment_dtype=moments)
