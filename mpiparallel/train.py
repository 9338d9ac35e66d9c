"""The training loop behind `mpiparallel train`, and the sampling behind `mpiparallel generate`.

One step: take the step's batch (llm.c's order, see `data`), zero the gradients, forward (mean token
cross-entropy over the global batch), backward, clip the global gradient norm, set the step's learning rate,
update. Around it: validation loss every `--eval-every` steps on held-out data, training checkpoints every
`--checkpoint-every` steps (and `--resume` from the newest), a Hugging Face directory at the end (`--save`),
one JSON line per step (`--log-json`), and a progress line on rank 0.

The mesh: data parallelism with ZeRO 0–3 (`data_parallel`), tensor/sequence (`models.tensor_parallel`), pipeline
(`pipeline_parallel`), context (`models.context_parallel`) and expert parallelism (`models.moe`), in any
combination (tests/test_composition.py). Everything that depends on how a parameter is spread over the mesh —
which axes its gradient is summed over, which rank counts it in the global norm, what each rank holds, how
checkpoints gather and cut it — is derived from its placement record (`models.parameter`).
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import Any, TextIO

import numpy as np

import collectives
from collectives import Communicator, backend
from models.context_parallel import ContextParallelGroup, zigzag_shard
from models.gpt import GPT, GPTConfig, expert_bias_shapes, parameter_shapes
from models.layers import block_activation_elements
from models.moe import expert_bias_name, expert_index, update_expert_bias
from models.parameter import (
    HELD,
    PARTIAL,
    Partial,
    counts_once,
    gather_tensor,
    local_shape,
    reduce_partial_gradients,
)
from models.precision import LossScaler, dtype_named, has_overflow, is_narrow, model_state_bytes
from models.tensor_parallel import TensorParallelGPT, check_tensor_parallel_shape

from . import checkpoint, data, optim, traffic, training_checkpoint
from .data_parallel import DataParallel, DataParallelGroups
from .errors import ConfigError
from .mesh import Mesh, MeshShape
from .pipeline_parallel import (
    PP_AXIS,
    TIED_WEIGHT,
    PipelineExecutor,
    check_tag_space,
    local_units,
    stage_units,
    sum_tied_gradient,
)
from .schedules import Schedule, build_schedule
from .trace import Tracer
from .training_checkpoint import MOMENT_KEYS, TrainingCheckpoint, load_pieces, on_every_rank


@dataclass(frozen=True)
class ModelSettings:
    """The model: its family and shape (or `init`, a Hugging Face directory to start from), seed, precision,
    device, the activation recomputation mode, and a mixture of experts (experts > 0) with its routing settings."""

    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 128
    vocab_size: int | None = None  # None: the data's (data.json), else 256 (bytes)
    n_positions: int = 1024
    seed: int = 0
    dtype: str = "float32"
    compute_dtype: str | None = None  # None: dtype (mixed precision: bfloat16 or float16)
    grad_dtype: str | None = None  # None: dtype
    loss_scale: str | None = None  # None: "dynamic" for float16, else off
    device: str = "cpu"
    init: str | None = None
    recompute: str = "none"
    experts: int = 0
    top_k: int = 2
    moe_aux_coef: float | None = None  # None: 0.01, or 0 for deepseek_v3 (which balances otherwise)
    capacity_factor: float = 0.0
    moe_renormalize: bool = True
    moe_bias_rate: float = 0.0
    arch: str = "gpt2"
    n_kv_head: int | None = None
    ffn_hidden: int | None = None
    rope_theta: float = 10000.0
    tie_embeddings: bool | None = None
    q_lora_rank: int | None = None  # deepseek_v3's (None: the defaults `_deepseek_choices` states)
    kv_lora_rank: int | None = None
    qk_nope_head_dim: int | None = None
    qk_rope_head_dim: int | None = None
    v_head_dim: int | None = None
    moe_ffn_hidden: int | None = None
    shared_experts: int = 1
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    first_k_dense: int = 0
    moe_seq_aux_coef: float = 0.0
    mtp_depth: int = 0
    mtp_weight: float = 0.3


@dataclass(frozen=True)
class MeshSettings:
    """How the ranks share the work: the axis sizes (dp None: the ranks left over), sequence parallelism, the ZeRO
    stage, microbatches per DP rank (None: pp, so a pipeline is filled), the pipeline schedule, and the gradient
    buckets."""

    dp: int | None = None
    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1
    sp: bool = False
    zero: int = 0
    microbatches: int | None = None
    schedule: str = "1f1b"
    virtual_stages: int = 1
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


@dataclass(frozen=True)
class OutputSettings:
    """What is written and printed: the final model, training checkpoints, the JSON log, reports, a sample."""

    save: str | None = None
    save_dtype: str | None = None  # None: the master weights' dtype (--dtype)
    checkpoint_dir: str | None = None
    checkpoint_every: int = 0
    resume: bool = False
    log_json: str | None = None
    trace: str | None = None
    sample_tokens: int = 0
    show_mesh: bool = False
    memory_report: bool = False


@dataclass(frozen=True)
class TrainSettings:
    """Every `mpiparallel train` option, after parsing, in groups (see the command's --help for their meaning)."""

    model: ModelSettings = ModelSettings()
    mesh: MeshSettings = MeshSettings()
    optimizer: OptimizerSettings = OptimizerSettings()
    data: DataSettings = DataSettings()
    output: OutputSettings = OutputSettings()

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


def run(settings: TrainSettings) -> int:
    """Train as `settings` says; return the exit status."""
    from mpi4py import MPI

    mesh = _build_mesh(settings, MPI.COMM_WORLD)
    xp = _array_library(settings, mesh)
    is_root = mesh.world.rank == 0
    if settings.output.show_mesh and is_root:
        print(mesh.describe(), flush=True)
    if mesh.topology_warning() and is_root:
        print(mesh.topology_warning(), flush=True)
    _check_batch(settings, mesh)
    dataset, validation = _open_data(settings, mesh.world)
    settings = _settle_vocab(settings, dataset)
    config = _model_config(settings)
    schedule = _build_schedule(settings, mesh, config)
    model = _build_model(settings, mesh, config, schedule, xp)
    train_tokens, validation_tokens = _batches(settings, config, dataset, validation)
    tokenizer = on_every_rank(mesh.world, lambda: _tokenizer(settings, dataset, config))  # read now: errors early
    data_identity = _data_identity(settings, dataset)
    resumed, first_step = _resume(settings, model, mesh, data_identity)
    # a pipeline schedule interleaves microbatches and splits backward: the gradients are reduced after it
    engine = _build_engines(model, mesh, settings, overlap=settings.mesh.overlap and schedule is None)
    optimizer = _build_optimizer(settings, engine.optimizer_parameters())
    trainer = Trainer(model, engine, optimizer, mesh, settings, schedule)
    trainer.data_identity = data_identity
    if resumed is not None:
        trainer.load_optimizer_state(resumed)
    reporter = Reporter(settings, config, is_root=is_root)
    if settings.output.trace:
        trainer.tracer = Tracer.for_mesh(mesh, {"mesh": asdict(mesh.shape), "schedule": settings.mesh.schedule})
    if settings.model.device == "gpu":
        reporter.say(f"on GPU (CuPy); GPU buffers reach MPI by {backend.transfer_path()}")
    for step in range(first_step, settings.data.steps):
        record = trainer.step(train_tokens, step)
        if _due(step, settings.data.eval_every, settings.data.steps):
            record["val_loss"] = trainer.evaluate(validation_tokens)
        reporter.step(record)
        if settings.output.memory_report and step == first_step:
            reporter.say_from_every_rank(trainer.memory_report(), mesh.world)
        if _due(step, settings.output.checkpoint_every, settings.data.steps) and settings.output.checkpoint_dir:
            trainer.save_training_checkpoint(step + 1, train_tokens)
    reporter.finish()
    if mesh.world.size > 1 and settings.data.steps > first_step:
        reporter.say("bytes each rank sent in the last step, per mesh axis, beside the formula that predicts them "
                     "(mpiparallel/traffic.py):")
        line = traffic.format_line(mesh.world.rank, trainer.traffic_by_axis(record["comm_bytes"]))
        reporter.say_from_every_rank(line, mesh.world)
        if "inter_node_bytes" in record:
            reporter.say("of them, the bytes sent to another node, beside the formula's:")
            rows = trainer.traffic_by_axis(record["inter_node_bytes"], across_nodes=True)
            reporter.say_from_every_rank(traffic.format_line(mesh.world.rank, rows, "across nodes"), mesh.world)
    if trainer.tracer is not None:
        trainer.tracer.write(settings.output.trace)
        reporter.say(f"wrote the trace to {settings.output.trace}")
    full = trainer.full_model_tensors() if settings.output.save or settings.output.sample_tokens else None
    if settings.output.save:
        if is_root:
            saved_dtype = dtype_named(settings.output.save_dtype or settings.model.dtype)
            checkpoint.save_pretrained(settings.output.save, config,
                                       {name: value.astype(saved_dtype, copy=False) for name, value in full.items()})
            if tokenizer is not None:  # beside the model, where AutoTokenizer.from_pretrained looks for it
                tokenizer.save(Path(settings.output.save))
        mesh.world.barrier()
        reporter.say(f"saved the model to {settings.output.save}")
    if settings.output.sample_tokens and is_root:
        if tokenizer is None:
            reporter.say(f"no sample: the vocabulary has {config.vocab_size} tokens and neither the data nor the "
                         f"model folder has a tokenizer.json to decode them")
        else:
            serial = GPT(config, dtype=np.dtype(settings.model.dtype))
            serial.load_state_dict(full)
            reporter.say(sample_text(serial, prompt="The " if tokenizer.kind == "byte" else "The",
                                     new_tokens=settings.output.sample_tokens, seed=settings.model.seed,
                                     window=settings.data.seq_len, tokenizer=tokenizer))
    return 0


def _tokenizer(settings: TrainSettings, dataset: data.Dataset, config: GPTConfig) -> data.Tokenizer | None:
    """What decodes this model's tokens: the data folder's tokenizer, else the --init folder's, else bytes when
    the vocabulary is bytes (256, or 257 with the end-of-text token of `data prepare --tokenizer byte`)."""
    found = data.tokenizer_of_folder(dataset.folder, dataset.info) or data.tokenizer_of_folder(settings.model.init)
    if found is None and config.vocab_size <= data.ByteTokenizer.vocab_size:
        return data.ByteTokenizer()
    return found


class Trainer:
    """One optimizer step over the mesh: each DP rank runs its rows of the batch, microbatch by microbatch, with
    the data-parallel engine as the model's hooks; then clipping, the update, and the bookkeeping."""

    def __init__(self, model: GPT, engine: DataParallel, optimizer: Any, mesh: Mesh, settings: TrainSettings,
                 schedule: Schedule | None = None) -> None:
        self.model, self.engine, self.optimizer, self.mesh, self.settings = model, engine, optimizer, mesh, settings
        self.microbatches = microbatch_count(settings, mesh)
        self.pipeline = None if schedule is None else PipelineExecutor(
            model, schedule, mesh.pp, activation_shape(settings, mesh, model.config), model.compute_dtype)
        self.activation_bytes = 0  # what the first microbatch's forward saved for backward, all units
        self.block_activation_bytes = 0  # of that, one transformer block's
        self.tracer: Tracer | None = None  # --trace: records each step, pipeline action and collective
        self.data_identity: dict[str, Any] = {}  # the data's fingerprint and order, recorded in checkpoints
        self.scaler = loss_scaler(settings.model)  # float16's loss scaling (None: off)
        self.forced_overflows = forced_overflows(mesh.world.rank)

    def step(self, tokens: data.TokenBatches | np.ndarray, step: int) -> dict:
        """One optimizer step on the step's batch; returns the log record (loss before the update)."""
        settings, engine = self.settings, self.engine
        start, sent_before = time.perf_counter(), self._bytes_sent()
        inter_node_before = self._inter_node_bytes_sent()
        scale = 1.0 if self.scaler is None else self.scaler.scale
        self.model.set_loss_scale(scale)
        pieces = data.microbatches(*self._rows_here(self._as_batches(tokens), step), self.microbatches)
        global_tokens = settings.data.batch_size * settings.data.seq_len
        engine.zero_grad()
        self.router = RouterTally()
        if self.pipeline is None:
            loss = self._microbatches_one_after_another(pieces, global_tokens)
        else:
            with engine.unhooked():  # the schedule runs the model without the engine's hooks
                loss = self.pipeline.step(pieces, global_tokens, self.router.add)
            if self.tracer is not None:
                self.tracer.pipeline_actions(self.pipeline.timeline, self.pipeline.schedule.stage_ranks, step)
            self.activation_bytes = self.pipeline.peak_saved_bytes
            self.block_activation_bytes = self.pipeline.block_saved_bytes
            sum_tied_gradient(self.model, self.mesh.pp, self.pipeline.schedule.stage_ranks[0],
                              self.pipeline.schedule.stage_ranks[-1])
        engine.finish_gradients()
        # the data-parallel engine summed over dp; any other axis with partial gradients (tp under --sp) here
        reduce_partial_gradients(engine.optimizer_parameters(), {"tp": self.mesh.tp})
        updates = step - (0 if self.scaler is None else self.scaler.skipped)  # skipped steps hold the schedule
        skipped = self._overflowed(step) if self.scaler is not None else False
        grad_norm = None if skipped else self._clip_gradients(1.0 / scale)
        schedule = settings.optimizer
        lr = optim.learning_rate(updates, schedule.lr, schedule.lr_schedule, schedule.warmup_steps, settings.data.steps)
        if not skipped:
            self.optimizer.step(lr)
            engine.after_update()
        record = {"step": step, "loss": self._sum_losses(loss) / scale, "lr": lr, "tokens": global_tokens}
        if self.scaler is not None:
            record |= {"loss_scale": scale, "skipped": skipped}
        if self.model.config.n_experts:
            record |= self._balance_experts()
        sent = {axis: after - sent_before[axis] for axis, after in self._bytes_sent().items()}
        if self.mesh.world.topology.spans_nodes:  # the bytes of `sent` that left this rank's node
            record["inter_node_bytes"] = {axis: after - inter_node_before[axis]
                                          for axis, after in self._inter_node_bytes_sent().items()}
        if self.tracer is not None:
            self.tracer.step(step, start, time.perf_counter())
        return record | {"time_s": time.perf_counter() - start, "grad_norm": grad_norm, "comm_bytes": sent}

    def _balance_experts(self) -> dict:
        """The step's aux loss and router statistics over the global batch; with --moe-bias-rate, each local
        layer's expert bias moved toward its under-loaded experts (its counts over every microbatch and rank)."""
        config, mesh, layers = self.model.config, self.mesh, self.router.layers
        if config.moe_bias_rate > 0:
            for layer, stats in layers.items():
                counts = self._over_token_sets(_sum_array_over(mesh.dp_cp, stats.assignments))
                update_expert_bias(self.model.expert_biases[expert_bias_name(layer)], counts, config.moe_bias_rate)
        assignments = sum((stats.assignments for stats in layers.values()), np.zeros(config.n_experts))
        dropped = sum(stats.dropped_tokens for stats in layers.values())
        totals = _sum_array_over(mesh.world, np.append(assignments, dropped))  # every layer and token …
        per_expert = totals[:-1] / (1 if self.settings.mesh.sp else mesh.tp.size)  # … once (TP ranks share tokens)
        load = float(per_expert.max() / per_expert.mean()) if per_expert.sum() else 0.0
        aux = self._over_token_sets(np.array([self.router.aux_loss]))[0]
        return {"aux_loss": self._sum_losses(aux),
                "router": {"tokens_per_expert": per_expert.astype(int).tolist(),
                           "dropped_tokens": int(totals[-1] / (1 if self.settings.mesh.sp else self.mesh.tp.size)),
                           "max_over_mean_load": load}}

    def _over_token_sets(self, values: np.ndarray) -> np.ndarray:
        """With --sp each TP rank routes only its slice of the sequence: its own token set, summed over tp."""
        return _sum_array_over(self.mesh.tp, values) if self.settings.mesh.sp else values

    def _microbatches_one_after_another(self, pieces: list, normalizer: int) -> float:
        """Forward and backward of each microbatch in turn, the data-parallel engine hooked in to overlap the
        gradient reduction with the last microbatch's backward."""
        loss = 0.0
        for i, (x, y) in enumerate(pieces):
            with self.engine.microbatch(last=i == len(pieces) - 1):
                microbatch_loss, saved = self.model.forward(x, y, normalizer=normalizer, hooks=self.engine)
                loss += microbatch_loss - saved.aux_loss  # the cross-entropy; the aux loss is logged apart
                self.router.add(saved)
                if i == 0:
                    self.activation_bytes = saved.nbytes()
                    self.block_activation_bytes = saved.per_unit[1].nbytes() if self.model.blocks else 0
                self.model.backward(saved, hooks=self.engine)
        return loss

    def _as_batches(self, tokens: data.TokenBatches | np.ndarray) -> data.TokenBatches:
        """Batches in the contract's order; a bare token array is read in order (no shuffle)."""
        if isinstance(tokens, data.TokenBatches):
            return tokens
        return data.in_memory(tokens, self.settings.data.batch_size, self.settings.data.seq_len)

    def _rows_here(self, batches: data.TokenBatches, step: int) -> tuple[np.ndarray, np.ndarray]:
        """This rank's share of the step's batch, read alone: its DP rank's rows, and of those its CP rank's two
        zigzag chunks of every sequence. Memory-mapped tokens are checked against the vocabulary as they are read;
        a bad id on any rank stops every rank with one message (`on_every_rank`)."""
        mesh = self.mesh

        def read() -> tuple[np.ndarray, np.ndarray]:
            return batches.rows_for_rank(step, mesh.dp.rank, mesh.dp.size)

        x, y = on_every_rank(mesh.world, read) if batches.checked_when_read else read()
        if mesh.cp.size == 1:
            return x, y
        return zigzag_shard(x, mesh.cp.rank, mesh.cp.size), zigzag_shard(y, mesh.cp.rank, mesh.cp.size)

    def _sum_losses(self, local: float) -> float:
        """The global batch's loss: summed over DP and CP ranks (each holds other tokens), and over pipeline ranks
        (only the last stage's has it)."""
        total = _sum_over(self.mesh.dp_cp, local)
        return _sum_over(self.mesh.pp, total) if self.pipeline is not None else total

    def _overflowed(self, step: int) -> bool:
        """Whether any rank's gradients hold an inf or NaN — agreed over the whole world (a sum of votes), so that
        every rank skips the same steps and no pipeline or collective waits for a rank that went on — and the
        scaler's update with that vote (its scale backs off after `hysteresis` overflows)."""
        grads = [piece.grad for piece in self.engine.optimizer_parameters()]
        local = has_overflow(grads) or step in self.forced_overflows
        overflow = _sum_over(self.mesh.world, float(local)) > 0
        return self.scaler.update(overflow)

    def _clip_gradients(self, unscale: float = 1.0) -> float:
        """Global gradient-norm clipping over the whole mesh; returns the norm before clipping. `unscale` first
        divides a loss-scaled gradient by its scale.

        One all-reduce over every rank of Σ g² over the pieces this rank counts: by their placement, a piece
        sharded over an axis (tp shards, ZeRO segments) counts on every rank of it, a replica only once."""
        if unscale != 1.0:
            for piece in self.engine.optimizer_parameters():
                piece.grad *= unscale
        coordinates, expert = asdict(self.mesh.coordinates), self.mesh.expert_coordinates()

        def counts(piece: Any) -> bool:  # experts also name the two axes dp splits into under EP
            return counts_once(piece.placement, coordinates | {a: c for a, c in expert.items() if a in piece.placement})

        return optim.clip_grad_norm(self.engine.optimizer_parameters(), self.settings.optimizer.grad_clip,
                                    lambda local: _sum_over(self.mesh.world, local), counts=counts)

    def full_model_tensors(self) -> dict[str, np.ndarray]:
        """The serial model's tensors by name: gathered over DP (ZeRO-3) and TP shards, padding removed, every
        pipeline stage's and EP rank's; then the MoE expert biases."""
        parameters = self._gather_over_model_axes(self.engine.full_parameters())
        biases = self._merge_held({name: bias.copy() for name, bias in self.model.expert_biases.items()})
        return parameters | {name: biases[name] for name in expert_bias_shapes(self.model.config)}

    def _gather_over_model_axes(self, tensors: dict[str, Any]) -> dict[str, Any]:
        """Whole-parameter arrays of this rank's shards (by parameter name) -> the serial tensors: TP shards
        gathered, and with pipeline stages every stage's parameters collected from its rank."""
        comms = {"tp": self.mesh.tp}
        whole = {name: gather_tensor(tensors[name], param.placement, comms, param.full_shape)
                 for name, param in self.model.params.items()}
        merged = self._merge_held(whole)
        return {name: merged[name] for name in parameter_shapes(self.model.config)}

    def _merge_held(self, tensors: dict[str, Any]) -> dict[str, Any]:
        """Tensors that only some ranks hold (pipeline stages' layers, EP ranks' experts) collected from all."""
        for axis in ("pp", "ep"):
            comm = getattr(self.mesh, axis)
            if comm.size > 1:
                merged: dict[str, Any] = {}
                for held in comm.comm.allgather({k: backend.to_host(v) for k, v in tensors.items()}):
                    merged |= held  # the tied wte comes from two stages, equal after every step
                tensors = merged
        return tensors

    def evaluate(self, tokens: data.TokenBatches | np.ndarray) -> float:
        """Mean loss over the first `eval_batches` held-out batches (in order), each DP rank taking its rows (no
        update)."""
        settings, losses, batches = self.settings, [], self._as_batches(tokens)
        normalizer = settings.data.batch_size * settings.data.seq_len
        self.model.set_loss_scale(1.0)  # no backward here: the plain loss (the next step sets its scale again)
        for i in range(settings.data.eval_batches):
            x, y = self._rows_here(batches, i)
            if self.pipeline is None:
                out, saved = self.model.forward(x, y, normalizer=normalizer, hooks=self.engine)
                loss = out - saved.aux_loss
            else:
                with self.engine.unhooked(backward=False):
                    loss = self.pipeline.forward_only(data.microbatches(x, y, self.microbatches), normalizer)
            losses.append(self._sum_losses(loss))
            self.engine.release_all()
        return float(np.mean(losses))

    def save_training_checkpoint(self, steps_done: int, batches: data.TokenBatches) -> None:
        """Every rank writes the parameters, AdamW moments and expert biases it holds (replicas once), rank 0 the
        manifest (`training_checkpoint`); `batches` (the training data's order) places the data position."""
        ranks, pieces = self.model.axis_ranks(), self.engine.optimizer_parameters()
        state = self.optimizer.state_dict()
        held = training_checkpoint.parameter_pieces(pieces, ranks)
        for key in MOMENT_KEYS:
            if key in state:
                held += training_checkpoint.parameter_pieces(pieces, ranks, state[key], prefix=f"{key}/")
        held += training_checkpoint.expert_bias_pieces(self.model.expert_biases)
        marked = [(piece, array, training_checkpoint.writes_copy(piece.placement, self.mesh))
                  for piece, array in held]
        training_checkpoint.save(self.settings.output.checkpoint_dir, steps_done, marked, self.mesh.world,
                                 self._checkpoint_description(steps_done, batches), self._tensor_names(state))

    def _checkpoint_description(self, steps_done: int, batches: data.TokenBatches) -> dict[str, Any]:
        """The manifest's account of the run: data position (and the data's fingerprint), settings, the mesh, the
        model, the optimizer scalars."""
        settings, shape, layout = self.settings, self.mesh.shape, self.settings.mesh
        count = batches.batch_count
        return {
            "data_position": {"next_step": steps_done, "epoch": steps_done // count,
                              "batch": batches.order.batch_number(steps_done), "batches_per_pass": count,
                              "tokens_consumed": steps_done * settings.data.batch_size * settings.data.seq_len,
                              **self.data_identity},
            "settings": asdict(settings),
            "mesh": {"world_size": self.mesh.world.size, **asdict(shape), "sp": layout.sp, "zero": layout.zero,
                     "schedule": layout.schedule if shape.pp > 1 else None, "microbatches": self.microbatches,
                     "virtual_stages": layout.virtual_stages},
            "model": self.model.config.to_dict(),
            "optimizer": {key: value for key, value in self.optimizer.state_dict().items() if key not in MOMENT_KEYS},
            "loss_scaler": None if self.scaler is None else self.scaler.state_dict(),
        }

    def _tensor_names(self, optimizer_state: dict) -> list[str]:
        """The logical tensors a checkpoint holds: parameters in checkpoint order, expert biases, the moments."""
        names = list(parameter_shapes(self.model.config))
        moments = [f"{key}/{name}" for key in MOMENT_KEYS if key in optimizer_state for name in names]
        return names + list(expert_bias_shapes(self.model.config)) + moments

    def load_optimizer_state(self, saved: TrainingCheckpoint) -> None:
        """Restore the optimizer from a checkpoint of any mesh: each rank reads its own pieces of the moments."""
        state = saved.optimizer_scalars(self.optimizer.name)
        pieces, ranks = self.engine.optimizer_parameters(), self.model.axis_ranks()
        held = []
        for key in MOMENT_KEYS:
            if hasattr(self.optimizer, key):
                state[key] = getattr(self.optimizer, key)  # read straight into the optimizer's buffers
                held += training_checkpoint.parameter_pieces(pieces, ranks, state[key], prefix=f"{key}/")
        on_every_rank(self.mesh.world, lambda: load_pieces(saved, held))
        self.optimizer.load_state_dict(state)
        scaler_state = saved.manifest.get("loss_scaler")
        if self.scaler is not None and scaler_state:
            self.scaler.load_state_dict(scaler_state)

    def memory_report(self) -> str:
        """Bytes this rank holds, measured from the arrays, next to what the ZeRO arithmetic predicts."""
        held = self.engine.memory(self.optimizer) | {"activations": self.activation_bytes}
        n, model = self.mesh.dp.size, self.model
        sizes = {"tp": self.mesh.tp.size}  # from the placements: this rank's shard of every parameter
        count = sum(math.prod(local_shape(p.full_shape, p.placement, sizes)) for p in self.model.parameters())
        per_parameter = model_state_bytes(model.compute_dtype, model.master_dtype, model.grad_dtype,
                                          self.settings.optimizer.optimizer, self.settings.mesh.zero, n)
        theory = {kind: count * size for kind, size in per_parameter.items()}
        precision = f"{model.compute_dtype.name} compute, {model.grad_dtype.name} gradients, " \
                    f"{model.master_dtype.name} master and optimizer state"
        lines = [f"rank {self.mesh.world.rank} (zero {self.settings.mesh.zero}, dp {n}; {precision}): "
                 f"{count:,} parameters, {sum(per_parameter.values()):.2f} bytes per parameter "
                 f"({' + '.join(f'{size:g}' for size in per_parameter.values())})"]
        for kind, measured in held.items():
            expected = f"{theory[kind] / 2**20:10.2f} MiB" if kind in theory else "          -"
            lines.append(f"  {kind:<16} {measured / 2**20:10.2f} MiB held   theory {expected}")
        total = sum(v for k, v in held.items() if k in theory)
        lines.append(f"  {'model states':<16} {total / 2**20:10.2f} MiB held   theory "
                     f"{sum(theory.values()) / 2**20:10.2f} MiB")
        formula = self._block_activation_formula()
        shown = f"{formula / 2**20:10.2f} MiB" if formula else "         - (none yet for --cp or --experts)"
        lines.append(f"  {'one block':<16} {self.block_activation_bytes / 2**20:10.2f} MiB saved  formula {shown} "
                     f"(per microbatch, --recompute {self.settings.model.recompute}; "
                     f"exactly {self.block_activation_bytes} bytes saved, formula {formula})")
        return "\n".join(lines)

    def _block_activation_formula(self) -> int:
        """`models.layers.block_activation_elements` for this run's microbatch, in bytes (0: no formula yet for
        context-parallel attention or experts)."""
        settings, config = self.settings, self.model.config
        if self.mesh.cp.size > 1 or config.n_experts:
            return 0
        rows = settings.data.batch_size // (self.mesh.dp.size * self.microbatches)
        return self.model.compute_dtype.itemsize * block_activation_elements(
            rows, settings.data.seq_len, config.n_embd, config.n_head, self.mesh.tp.size, settings.mesh.sp,
            settings.model.recompute, self.model.query_block, config.kv_heads,
            config.ffn_width if config.is_llama else None)

    def traffic_by_axis(self, counted: dict[str, int], across_nodes: bool = False) -> list[traffic.AxisTraffic]:
        """The step's bytes sent per axis (`counted`, from its log record) beside what the formulas predict;
        `across_nodes`: only the bytes that left the node (`counted` from the record's inter_node_bytes)."""
        settings, config = self.settings, self.model.config
        mesh = traffic.AcrossNodesMesh(self.mesh) if across_nodes else self.mesh
        local = set(self.model.local_units)
        shape = traffic.RunShape(
            rows=settings.data.batch_size // (mesh.shape.dp * self.microbatches),
            positions=settings.data.seq_len // mesh.shape.cp, channels=config.n_embd,
            itemsize=self.model.compute_dtype.itemsize, grad_itemsize=self.model.grad_dtype.itemsize,
            microbatches=self.microbatches,
            blocks=len(local - {0, config.n_layer + 1}), has_embedding=0 in local,
            has_head=config.n_layer + 1 in local, sp=settings.mesh.sp, recompute=settings.model.recompute,
            seq_len=settings.data.seq_len, cp_attention=settings.mesh.cp_attention, moe=bool(config.n_experts),
            n_head=config.n_head, kv_heads=config.kv_heads, tp=mesh.shape.tp,
            dense_blocks=sum(not config.is_moe_layer(unit - 1) for unit in local - {0, config.n_layer + 1}),
            latent_width=config.kv_lora_rank + config.qk_rope_head_dim if config.is_deepseek else 0,
            mtp_depth=config.mtp_depth, latent_heads_width=config.n_head * (
                config.qk_nope_head_dim + config.qk_rope_head_dim + config.v_head_dim) if config.is_deepseek else 0)
        partial = sum(piece.grad.nbytes for piece in self.engine.optimizer_parameters()
                      if isinstance(piece.placement.get("tp"), Partial))
        key_value_group = getattr(self.model, "key_value_group", None)  # KV heads held by several TP ranks
        axis_of = {id(comm): axis for axis, comm in self.mesh.communicators().items()}
        engines = getattr(self.engine, "engines", [self.engine])
        predicted: dict[str, float | None] = {
            "tp": traffic.tensor_parallel_bytes(shape, mesh.tp, partial, None if across_nodes else key_value_group),
            "cp": traffic.context_parallel_bytes(shape, mesh.shape.cp, mesh.shape.tp) if not across_nodes
            else traffic.context_parallel_inter_node_bytes(shape, mesh.cp), "ep": None}
        for engine in engines:
            axis = axis_of.get(id(engine.comm))
            if axis is not None:
                predicted[axis] = predicted.get(axis) or 0.0
                predicted[axis] += traffic.data_parallel_bytes(engine, self.microbatches, shape.itemsize,
                                                               hooked=self.pipeline is None,
                                                               comm=mesh.communicators()[axis])
        if self.pipeline is not None:
            wte = self.model.params.get(TIED_WEIGHT) if config.head_reads_embedding else None  # ZeRO-3 may have freed
            tied = 0 if wte is None else shape.gradient_bytes * math.prod(
                local_shape(wte.full_shape, wte.placement, {"tp": mesh.shape.tp}))
            predicted["pp"] = traffic.pipeline_bytes(shape, self.pipeline.schedule, mesh.pp.rank, mesh.shape.tp, tied,
                                                     crossing=mesh.pp.remote if across_nodes else None)
        if mesh.shape.ep > 1 or config.n_experts:
            predicted["ep"] = None  # the router decides how many rows leave this rank
        if across_nodes:  # an axis kept inside nodes shows its 0
            return traffic.report(counted, predicted, keep={a for a, c in mesh.communicators().items() if c.size > 1})
        return traffic.report(counted, predicted)

    def _bytes_sent(self) -> dict[str, int]:
        sent = {axis: comm.ledger.total_sent() for axis, comm in self.mesh.communicators().items()}
        copies = getattr(self.model, "key_value_group", None)  # KV heads replicated over tp: part of tp's traffic
        if copies is not None:
            sent["tp"] += copies.ledger.total_sent()
        return sent

    def _inter_node_bytes_sent(self) -> dict[str, int]:
        return {axis: comm.ledger.inter_node_sent() for axis, comm in self.mesh.communicators().items()}


class RouterTally:
    """A step's router statistics and aux loss, from the saved state of this rank's forwards (its token sets and
    layers); empty for a dense model."""

    def __init__(self) -> None:
        self.layers: dict[int, Any] = {}
        self.aux_loss = 0.0

    def add(self, saved: Any) -> None:
        self.aux_loss += saved.aux_loss
        for layer, stats in saved.router_stats.items():
            self.layers[layer] = stats if layer not in self.layers else self.layers[layer] + stats


def _sum_array_over(comm: Communicator, values: np.ndarray) -> np.ndarray:
    """An array summed over the ranks of `comm` (MPI's own all-reduce, outside the ledger)."""
    return collectives.all_reduce(np.asarray(values, dtype=np.float64), comm, algo="mpi")


def _sum_over(comm: Communicator, value: float) -> float:
    """A scalar summed over the ranks of `comm` (MPI's own all-reduce: bookkeeping stays out of the ledger)."""
    return float(collectives.all_reduce(np.array([value]), comm, algo="mpi")[0])


def sample_text(model: GPT, prompt: str | None, new_tokens: int, seed: int, temperature: float = 0.8,
                top_k: int | None = 40, window: int | None = None, tokenizer: data.Tokenizer | None = None) -> str:
    """Tokens sampled after `prompt`, encoded and decoded by `tokenizer` (default: bytes, as UTF-8 with bad bytes
    replaced); no prompt starts a document (the end-of-text token) and shows only what follows. `window`: the
    most positions the model attends over (its training sequence length)."""
    tokenizer = tokenizer or data.ByteTokenizer()
    prompt_ids = tokenizer.encode_batch([prompt])[0] if prompt else np.array([tokenizer.eot_id])
    new = model.generate(prompt_ids, new_tokens, temperature, top_k, np.random.default_rng(seed), window)
    if not prompt:
        return tokenizer.decode(new.tolist())
    return tokenizer.decode([*prompt_ids.tolist(), *new.tolist()])


# -- setting up ---------------------------------------------------------------------------------------------

def _build_mesh(settings: TrainSettings, world: Any) -> Mesh:
    layout = settings.mesh
    shape = MeshShape(dp=layout.dp, tp=layout.tp, pp=layout.pp, cp=layout.cp, ep=layout.ep)
    mesh = Mesh(world, shape)
    if settings.mesh.sp and mesh.shape.tp == 1:
        raise ConfigError("--sp (sequence parallelism) works inside a tensor-parallel group: give --tp > 1")
    return mesh


def _check_batch(settings: TrainSettings, mesh: Mesh) -> None:
    share = mesh.shape.dp * microbatch_count(settings, mesh)
    if settings.data.batch_size % share:
        raise ConfigError(f"--batch-size {settings.data.batch_size} must be divisible by dp × microbatches = "
                          f"{mesh.shape.dp} × {microbatch_count(settings, mesh)} = {share}")


def _array_library(settings: TrainSettings, mesh: Mesh) -> Any:
    """NumPy, or CuPy with this rank bound to a GPU of its machine (--device gpu)."""
    if settings.model.device == "cpu":
        return np
    reason = backend.gpu_unavailable_reason()
    if reason is not None:
        raise ConfigError(f"--device gpu: {reason}")
    backend.bind_device(mesh.world.comm)
    return backend.gpu_array_module()


def microbatch_count(settings: TrainSettings, mesh: Mesh) -> int:
    """--microbatches, by default pp (one per stage: the least that fills a pipeline; 1 without one)."""
    return settings.mesh.microbatches or mesh.shape.pp


def activation_shape(settings: TrainSettings, mesh: Mesh, config: GPTConfig) -> tuple[int, int, int]:
    """The (rows, positions, channels) activation one microbatch hands from stage to stage on this rank."""
    rows = settings.data.batch_size // (mesh.shape.dp * microbatch_count(settings, mesh))
    positions = settings.data.seq_len // mesh.shape.cp // (mesh.shape.tp if settings.mesh.sp else 1)
    return rows, positions, config.n_embd


def _model_config(settings: TrainSettings) -> GPTConfig:
    """The model's shape: from --init's config.json, or from the flags."""
    if settings.model.init:
        config = checkpoint.load_pretrained(settings.model.init)[0]
    else:
        shape = settings.model
        try:
            config = GPTConfig(vocab_size=shape.vocab_size, n_positions=max(shape.n_positions, settings.data.seq_len),
                               n_embd=shape.n_embd, n_layer=shape.n_layer, n_head=shape.n_head,
                               n_experts=shape.experts, moe_top_k=shape.top_k, moe_renormalize=shape.moe_renormalize,
                               moe_aux_coef=_switch_aux_coef(shape), moe_capacity_factor=shape.capacity_factor,
                               moe_bias_rate=shape.moe_bias_rate, **_family_choices(shape))
        except ValueError as error:
            raise ConfigError(str(error)) from None
    if settings.data.seq_len > config.n_positions:
        raise ConfigError(f"--seq-len {settings.data.seq_len} exceeds the model's n_positions ({config.n_positions})")
    return config


def loss_scaler(model: ModelSettings) -> LossScaler | None:
    """--loss-scale: "dynamic" (the default for float16 compute), a fixed number, or none (other dtypes)."""
    choice = model.loss_scale or ("dynamic" if model.compute_dtype == "float16" else None)
    if choice is None or choice == "none":
        return None
    if choice == "dynamic":
        return LossScaler()
    try:
        scale = float(choice)
    except ValueError:
        raise ConfigError(f"--loss-scale must be 'dynamic', 'none' or a positive number, got {choice!r}") from None
    if not scale > 0:
        raise ConfigError(f"--loss-scale must be positive, got {choice}")
    return LossScaler(scale=scale, dynamic=False)


def forced_overflows(rank: int) -> set[int]:
    """The steps at which this rank pretends its gradients overflowed: MPIPARALLEL_FORCE_OVERFLOW="STEP@RANK,…"
    (for tests and demonstrations of the skip that every rank must agree on)."""
    forced = set()
    for item in filter(None, os.environ.get("MPIPARALLEL_FORCE_OVERFLOW", "").split(",")):
        step, _, on = item.partition("@")
        if int(on or rank) == rank:
            forced.add(int(step))
    return forced


def _family_choices(shape: ModelSettings) -> dict[str, Any]:
    """The GPTConfig fields of --arch and its llama options; a llama option given for GPT-2 is one clear error."""
    choices = {"n_kv_head": shape.n_kv_head, "ffn_hidden": shape.ffn_hidden, "tie_embeddings": shape.tie_embeddings}
    given = [f"--{name.replace('_', '-')}" for name, value in choices.items() if value is not None]
    if shape.rope_theta != 10000.0:
        given.append("--rope-theta")
    if shape.arch == "gpt2" and given:
        raise ConfigError(f"{', '.join(given)} set(s) a llama choice: add --arch llama (GPT-2 has multi-head "
                          f"attention, a 4·n_embd MLP, learned positions and a tied head)")
    deepseek = _deepseek_choices(shape)
    return {"arch": shape.arch, "n_kv_head": shape.n_kv_head or 0, "ffn_hidden": shape.ffn_hidden or 0,
            "rope_theta": shape.rope_theta, "tie_embeddings": shape.tie_embeddings} | deepseek


DEEPSEEK_DEFAULTS = {"shared_experts": 1, "n_group": 1, "topk_group": 1, "routed_scaling_factor": 1.0,
                     "first_k_dense": 0, "moe_seq_aux_coef": 0.0, "mtp_depth": 0, "mtp_weight": 0.3}
DEEPSEEK_SIZES = ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
                  "moe_ffn_hidden")


def _deepseek_choices(shape: ModelSettings) -> dict[str, Any]:
    """The GPTConfig fields of --arch deepseek_v3; one clear error when one is given for another family. Defaults
    (DeepSeek-V2-Lite's proportions): nope and value heads n_embd/n_head, RoPE heads half that (even),
    kv_lora_rank n_embd/4, no query compression, experts ffn_hidden/8 wide, one shared expert."""
    given = [name for name in DEEPSEEK_SIZES if getattr(shape, name) is not None]
    given += [name for name, default in DEEPSEEK_DEFAULTS.items() if getattr(shape, name) != default]
    if shape.arch != "deepseek_v3":
        if given:
            raise ConfigError(f"{', '.join('--' + name.replace('_', '-') for name in given)} set(s) a deepseek_v3 "
                              f"choice: add --arch deepseek_v3")
        return {}
    head = max(shape.n_embd // shape.n_head, 1)
    nope = shape.qk_nope_head_dim or head
    width = shape.ffn_hidden or 64 * -(-(8 * shape.n_embd) // (3 * 64))
    return {"q_lora_rank": shape.q_lora_rank, "kv_lora_rank": shape.kv_lora_rank or max(shape.n_embd // 4, 1),
            "qk_nope_head_dim": nope, "qk_rope_head_dim": shape.qk_rope_head_dim or max(2, nope // 2 // 2 * 2),
            "v_head_dim": shape.v_head_dim or head, "moe_ffn_hidden": shape.moe_ffn_hidden or max(width // 8, 1),
            "n_shared_experts": shape.shared_experts, "n_group": shape.n_group, "topk_group": shape.topk_group,
            "routed_scaling_factor": shape.routed_scaling_factor, "first_k_dense_replace": shape.first_k_dense,
            "moe_seq_aux_coef": shape.moe_seq_aux_coef, "mtp_depth": shape.mtp_depth, "mtp_weight": shape.mtp_weight}


def _switch_aux_coef(shape: ModelSettings) -> float:
    """--moe-aux-coef, by default 0.01 (deepseek_v3: 0; it balances with the bias and the sequence-wise loss)."""
    if shape.moe_aux_coef is not None:
        return shape.moe_aux_coef
    return 0.0 if shape.arch == "deepseek_v3" else 0.01


def _build_schedule(settings: TrainSettings, mesh: Mesh, config: GPTConfig) -> Schedule | None:
    """The pipeline schedule (None without --pp), checked against the model: every stage needs a block."""
    layout = settings.mesh
    if mesh.shape.pp == 1:
        if layout.virtual_stages != 1:
            raise ConfigError("--virtual-stages needs a pipeline: give --pp > 1")
        return None
    try:
        schedule = build_schedule(layout.schedule, mesh.shape.pp, microbatch_count(settings, mesh),
                                  layout.virtual_stages)
    except ValueError as error:
        raise ConfigError(str(error)) from None
    stage_units(config.n_layer, schedule.num_stages)  # raises when there are more stages than layers
    check_tag_space(schedule.num_stages, schedule.microbatches)
    return schedule


def _build_model(settings: TrainSettings, mesh: Mesh, config: GPTConfig, schedule: Schedule | None,
                 xp: Any = np) -> GPT:
    """This rank's model: the serial GPT, or with --tp its tensor-parallel version (this rank's shards of the same
    weights), holding only this pipeline rank's stages; every parameter's placement records the mesh."""
    dtype = np.dtype(settings.model.dtype)
    tp = mesh.shape.tp
    if settings.mesh.sp and settings.data.seq_len % tp:
        raise ConfigError(f"--sp splits the sequence over the {tp} tensor-parallel ranks: --seq-len "
                          f"{settings.data.seq_len} must be divisible by {tp}")
    units = None if schedule is None else local_units(schedule, mesh.pp.rank, config.n_layer)
    _check_experts(config, mesh)
    _check_sequence_balance(settings, mesh, config)
    token_sets = microbatch_count(settings, mesh) * mesh.shape.dp * mesh.shape.cp * (tp if settings.mesh.sp else 1)
    common = {"seed": settings.model.seed, "dtype": dtype, "xp": xp, "recompute": settings.model.recompute,
              "compute_dtype": settings.model.compute_dtype, "grad_dtype": settings.model.grad_dtype,
              "units": units, "context": _context(settings, mesh, config)}
    if config.n_experts:
        common |= {"moe_token_sets": token_sets, "ep_comm": mesh.ep if mesh.shape.ep > 1 else None}
    if tp == 1:
        model = GPT(config, **common)
    else:
        try:
            check_tensor_parallel_shape(config, tp)
        except ValueError as error:
            raise ConfigError(str(error)) from None
        model = TensorParallelGPT(config, mesh.tp, sequence_parallel=settings.mesh.sp, **common)
    if schedule is not None:
        _place_on_pipeline(model, schedule)
    if mesh.shape.ep > 1:  # each EP rank holds other experts: dp is (expert_dp, ep), see `_build_engines`
        for name, param in model.params.items():
            if expert_index(name) is not None:
                param.placement["dp"] = HELD
    if settings.model.init:
        model.load_state_dict(checkpoint.load_pretrained(settings.model.init)[1])
    return model


def _check_experts(config: GPTConfig, mesh: Mesh) -> None:
    """One clear message for each mixture-of-experts setting the mesh cannot run."""
    ep = mesh.shape.ep
    if ep > 1 and not config.n_experts:
        raise ConfigError(f"--ep {ep} spreads experts over ranks: give --experts")
    if config.n_experts and config.n_experts % ep:
        raise ConfigError(f"--ep {ep} must divide --experts {config.n_experts} (each EP rank holds E/ep experts)")


def _check_sequence_balance(settings: TrainSettings, mesh: Mesh, config: GPTConfig) -> None:
    """DeepSeek-V3's sequence-wise balance loss and its multi-token prediction need whole sequences on every
    rank."""
    split = mesh.shape.cp > 1 or (settings.mesh.sp and mesh.shape.tp > 1)
    if config.moe_seq_aux_coef and split:
        raise ConfigError("--moe-seq-aux-coef balances each sequence's routing: it needs whole sequences on every "
                          "rank (no --cp, no --sp)")
    if config.mtp_depth and split:
        raise ConfigError("--mtp-depth shifts whole sequences by a token per module: it runs without --cp and --sp")


def _build_engines(model: GPT, mesh: Mesh, settings: TrainSettings, overlap: bool) -> Any:
    """Data parallelism for the model: gradients summed over dp (×cp); with expert parallelism the experts are
    summed only over the ranks holding the same experts (expert_dp, ×cp), in their own engine."""
    options = {"zero": settings.mesh.zero, "bucket_mb": settings.mesh.bucket_mb, "overlap": overlap}
    comm, axes = _gradient_group(mesh)
    if mesh.shape.ep == 1:
        return DataParallel(model, comm, axes=axes, **options)
    expert_comm = mesh.expert_dp if mesh.shape.cp == 1 else mesh.expert_dp_cp
    expert_axes = ("expert_dp",) if mesh.shape.cp == 1 else ("expert_dp", "cp")
    return DataParallelGroups([
        DataParallel(model, comm, axes=axes, select=lambda param: expert_index(param.name) is None, **options),
        DataParallel(model, expert_comm, axes=expert_axes, select=lambda param: expert_index(param.name) is not None,
                     **options)])


def _context(settings: TrainSettings, mesh: Mesh, config: GPTConfig) -> ContextParallelGroup | None:
    """The CP group and attention variant (None without --cp), after the checks that give one clear message."""
    cp, tp, variant = mesh.shape.cp, mesh.shape.tp, settings.mesh.cp_attention
    if cp == 1:
        return None
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
    return ContextParallelGroup(mesh.cp, variant)


def _gradient_group(mesh: Mesh) -> tuple[Communicator, tuple[str, ...]]:
    """The ranks whose gradients are summed — the data-parallel ranks, and the context-parallel ones too (they saw
    other tokens of the same sequences) — and their mesh axes."""
    return (mesh.dp, ("dp",)) if mesh.shape.cp == 1 else (mesh.dp_cp, ("dp", "cp"))


def _place_on_pipeline(model: GPT, schedule: Schedule) -> None:
    """Each stage's parameters are held by its rank alone; a tied token embedding, read by the first stage and
    the last, holds a partial gradient on both (summed by `sum_tied_gradient`) unless one rank holds both (an
    untied llama head is the last stage's own)."""
    shared = schedule.stage_ranks[0] != schedule.stage_ranks[-1] and model.config.head_reads_embedding
    for name, param in model.params.items():
        param.placement[PP_AXIS] = PARTIAL if shared and name == TIED_WEIGHT else HELD


def _open_data(settings: TrainSettings, world: Communicator) -> tuple[data.Dataset, data.Dataset | None]:
    """--data (memory-mapped shards or tokens in memory) and its validation: --val-data, else the validation
    shards of a data folder, else (None) the last --validation-fraction of the training tokens. Without --data:
    the default corpus's cached BPE folder."""
    path = settings.data.data if settings.data.data is not None else str(_default_corpus_folder(world))
    dataset = data.open_data(path)
    if settings.data.val_data is not None:
        return dataset, data.open_data(settings.data.val_data, role="val")
    return dataset, data.validation_in_folder(path)


def _default_corpus_folder(world: Communicator) -> Path:
    """Rank 0 prepares the default corpus on first use (a few seconds, said on its output) while the others wait;
    then every rank finds it, or, where its node does not share rank 0's cache folder, builds the same files."""
    on_every_rank(world, lambda: data.cached_default_corpus(announce=print) if world.rank == 0 else None)
    return on_every_rank(world, data.cached_default_corpus)


def _settle_vocab(settings: TrainSettings, dataset: data.Dataset) -> TrainSettings:
    """--vocab-size, by default the data's (data.json's tokenizer) or 256 (bytes)."""
    if settings.model.vocab_size is not None:
        return settings
    return settings.with_options(vocab_size=dataset.vocab_size or data.BYTE_VOCAB_SIZE)


def _batches(settings: TrainSettings, config: GPTConfig, dataset: data.Dataset, validation: data.Dataset | None
             ) -> tuple[data.TokenBatches, data.TokenBatches | None]:
    """The training batches in the contract's order and, with --eval-every, the validation batches; every token
    source checked against the model's vocabulary (in memory now; memory-mapped shards as they are read)."""
    vocab, shape = config.vocab_size, (settings.data.batch_size, settings.data.seq_len)
    for source in (dataset, validation):
        if source is not None:
            _check_vocab(source, vocab)
    if validation is None and settings.data.eval_every:
        dataset, validation = dataset.split_tail(settings.data.validation_fraction)
        if validation.token_count < shape[0] * shape[1] + 1:
            raise ConfigError(f"the held-out {settings.data.validation_fraction:.0%} of the data has "
                              f"{validation.token_count} tokens; one validation batch needs {shape[0] * shape[1] + 1}."
                              f" Use more data or a larger --validation-fraction, --val-data, or leave out "
                              f"--eval-every")
    train_batches = dataset.batches(*shape, settings.data.shuffle, settings.model.seed, vocab)
    if validation is None or not settings.data.eval_every:
        return train_batches, None
    return train_batches, validation.batches(*shape, vocab_size=vocab)


def _check_vocab(dataset: data.Dataset, vocab_size: int) -> None:
    """What is known before reading: the ids of tokens in memory, the vocabulary data.json names."""
    needed = dataset.vocab_needed or dataset.vocab_size or 0
    if needed > vocab_size:
        what = "contains token id" if dataset.vocab_needed else "was prepared with a tokenizer of vocabulary"
        shown = needed - 1 if dataset.vocab_needed else needed
        raise ConfigError(f"{dataset.description} {what} {shown}, but the model's vocabulary has {vocab_size} "
                          f"tokens; use --vocab-size {needed} or more")


def _data_identity(settings: TrainSettings, dataset: data.Dataset) -> dict[str, Any]:
    """What a resumed run must find again: the training data's fingerprint and its order."""
    return {"fingerprint": dataset.fingerprint(), "shuffle": settings.data.shuffle}


def _build_optimizer(settings: TrainSettings, params: list) -> Any:
    if settings.optimizer.optimizer == "sgd":
        return optim.SGD(params, lr=settings.optimizer.lr)
    return optim.AdamW(params, lr=settings.optimizer.lr, weight_decay=settings.optimizer.weight_decay)


def _resume(settings: TrainSettings, model: GPT, mesh: Mesh, data_identity: dict[str, Any]
            ) -> tuple[TrainingCheckpoint | None, int]:
    """Load the newest training checkpoint's parameters and expert biases into `model` when --resume is given,
    resharded to this mesh (before the data-parallel engines take the parameters over).

    Returns the checkpoint, for the optimizer state (None when starting fresh), and the first step to run."""
    if not settings.output.resume:
        return None, 0
    if not settings.output.checkpoint_dir:
        raise ConfigError("--resume needs --checkpoint-dir (where the training checkpoints are)")
    directory = settings.output.checkpoint_dir
    # rank 0 chooses, so that every rank resumes from the same step even if the folder changes meanwhile
    latest = on_every_rank(mesh.world, lambda: training_checkpoint.latest_training_checkpoint(directory)
                           if mesh.world.rank == 0 else None)
    latest = mesh.world.comm.bcast(latest, root=0)
    if latest is None:
        return None, 0  # nothing saved yet: start from the beginning, as a restarted job would want

    def load() -> TrainingCheckpoint:
        saved = TrainingCheckpoint(latest)
        saved.check_model(model.config)
        saved.check_data(data_identity)
        held = training_checkpoint.parameter_pieces(model.params.values(), model.axis_ranks())
        load_pieces(saved, held + training_checkpoint.expert_bias_pieces(model.expert_biases))
        for param in model.params.values():  # mixed precision: the working copy is the loaded master, rounded
            if param.master is not None:
                param.data[...] = param.master
        return saved

    saved = on_every_rank(mesh.world, load)
    return saved, saved.step


def _due(step: int, every: int, steps: int) -> bool:
    """Whether a periodic action runs after 0-based `step`: every `every` steps, and after the last one."""
    return every > 0 and ((step + 1) % every == 0 or step + 1 == steps)


# -- reporting ----------------------------------------------------------------------------------------------

def describe_model(config: GPTConfig) -> str:
    """GPT-2, Llama, Mixtral (a llama with experts) or DeepSeek-V3."""
    if not config.is_llama:
        return "GPT-2"
    if config.is_deepseek:
        return "DeepSeek-V3"
    return "Mixtral" if config.n_experts else "Llama"


def kv_heads(config: GPTConfig) -> str:
    return f" ({config.kv_heads} KV)" if config.kv_heads != config.n_head else ""


class Reporter:
    """Rank 0's view of training: a progress line (rewritten in place on a terminal) and the JSON log."""

    def __init__(self, settings: TrainSettings, config: GPTConfig, is_root: bool,
                 stream: TextIO = sys.stdout) -> None:
        self.settings, self.is_root, self.stream = settings, is_root, stream
        self.interactive = is_root and stream.isatty()
        output = settings.output
        self.log = open(output.log_json, "a" if output.resume else "w") if is_root and output.log_json else None
        self.every = max(1, settings.data.steps // 20)
        self.recent_losses: list[float] = []  # since the last printed line: one batch's loss is noisy
        if is_root:
            self.say(f"{describe_model(config)} {config.n_layer} layers, {config.n_embd} channels, "
                     f"{config.n_head} heads{kv_heads(config)}, vocab "
                     f"{config.vocab_size}: {config.parameter_count() / 1e6:.2f} M parameters; "
                     f"{settings.data.batch_size}×{settings.data.seq_len} tokens per step, {settings.model.dtype}"
                     f"{f' ({settings.model.compute_dtype} compute)' if settings.model.compute_dtype else ''}")

    def step(self, record: dict) -> None:
        if not self.is_root:
            return
        if self.log is not None:
            self.log.write(json.dumps(record) + "\n")
            self.log.flush()
        step = record["step"]
        self.recent_losses.append(record["loss"])
        mean = sum(self.recent_losses) / len(self.recent_losses)
        line = (f"step {step + 1:>5}/{self.settings.data.steps} | loss {record['loss']:.4f}, mean of "
                f"{len(self.recent_losses):>3} {mean:.4f} | lr {record['lr']:.2e} | "
                f"{record['tokens'] / record['time_s']:,.0f} tok/s")
        if "router" in record:
            line += (f" | aux {record['aux_loss']:.4f} | load max/mean {record['router']['max_over_mean_load']:.2f}, "
                     f"dropped {record['router']['dropped_tokens']}")
        if "val_loss" in record:
            line += f" | val {record['val_loss']:.4f}"
        steps = self.settings.data.steps
        printed = (step + 1) % self.every == 0 or step == 0 or "val_loss" in record or step + 1 == steps
        if self.interactive:  # every step rewrites the line; the printed ones stay
            self.stream.write(f"\r{line}\033[K{chr(10) if printed else ''}")
            self.stream.flush()
        elif printed:
            self.say(line)
        if printed:
            self.recent_losses.clear()
        if not math.isfinite(record["loss"]):
            raise FloatingPointError(f"the loss became {record['loss']} at step {step}; try a smaller --lr")

    def say_from_every_rank(self, text: str, world: Communicator) -> None:
        """Print each rank's text in rank order (gathered to rank 0, so lines never interleave)."""
        texts = world.comm.gather(text, root=0)
        if self.is_root:
            self.say("\n".join(texts))

    def say(self, text: str) -> None:
        if self.is_root:
            if self.interactive:
                self.stream.write("\r\033[K")
            print(text, file=self.stream, flush=True)

    def finish(self) -> None:
        if self.interactive:
            self.stream.write("\n")
        if self.log is not None:
            self.log.close()


def generate(init: str, prompt: str | None, prompt_ids: list[int] | None, new_tokens: int, temperature: float,
             top_k: int | None, seed: int) -> str:
    """Load a checkpoint and continue the prompt; text through the model folder's tokenizer.json (bytes for a
    byte-level model), token ids when the prompt is given as ids."""
    config, tensors, _ = checkpoint.load_pretrained(init)
    dtype = next(iter(tensors.values())).dtype
    model = GPT(config, dtype=np.float32 if is_narrow(dtype) else dtype)  # a bfloat16 checkpoint computes in float32
    model.load_state_dict(tensors)
    if prompt_ids is None:
        tokenizer = data.tokenizer_of_folder(init)
        if tokenizer is None and config.vocab_size > data.ByteTokenizer.vocab_size:
            raise ConfigError(f"{init} has a vocabulary of {config.vocab_size} tokens, not bytes, and no "
                              f"tokenizer.json: give the prompt as --prompt-ids 15496,11,995")
        if tokenizer is None:
            return sample_text(model, prompt or "\n", new_tokens, seed, temperature, top_k)
        return sample_text(model, prompt, new_tokens, seed, temperature, top_k, tokenizer=tokenizer)
    bad = [t for t in prompt_ids if not 0 <= t < config.vocab_size]
    if bad:
        raise ConfigError(f"--prompt-ids {bad} are outside the vocabulary (0..{config.vocab_size - 1})")
    new = model.generate(np.array(prompt_ids), new_tokens, temperature, top_k, np.random.default_rng(seed))
    return ",".join(str(t) for t in [*prompt_ids, *new.tolist()])

