"""The training state across the mesh: gathered into the serial model's tensors (`--save`, samples), written
as a training checkpoint every `--checkpoint-every` steps, and read back on any mesh (`--resume`).

Every rank writes the pieces it holds (replicas once) and reads the pieces it needs: resuming on another mesh
reshards on load (`training_checkpoint`). The parameters are loaded into the model before the data-parallel
engines take them over (`parallelize`), the optimizer's moments into the optimizer after.
"""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path
from typing import Any

from models import parameter
from models.precision import dtype_named
from models.transformer import GPTConfig, Transformer, expert_bias_shapes, parameter_shapes

from .. import checkpoint, data, training_checkpoint
from ..errors import ConfigError
from ..mesh import Mesh
from ..training_checkpoint import MOMENT_KEYS, TrainingCheckpoint, load_pieces, on_every_rank
from .parallelize import virtual_stages
from .settings import TrainSettings


def gather_over_model_axes(model: Transformer, mesh: Mesh, tensors: dict[str, Any]) -> dict[str, Any]:
    """Whole-along-dp arrays of this rank's pieces (by name) -> the serial tensors in checkpoint order: TP shards
    gathered, every pipeline stage's and EP rank's tensors collected (`models.parameter.gather_over_model_axes`)."""
    whole = parameter.gather_over_model_axes(tensors, model.params, {"tp": mesh.tp, "pp": mesh.pp, "ep": mesh.ep})
    order = [*parameter_shapes(model.config), *expert_bias_shapes(model.config)]
    return {name: whole[name] for name in order if name in whole}


def full_model_tensors(trainer: Any) -> dict[str, Any]:
    """The serial model's tensors by name — parameters gathered over DP (ZeRO-3), TP, PP and EP — then the MoE
    expert biases."""
    biases = {name: bias.copy() for name, bias in trainer.model.expert_biases.items()}
    return gather_over_model_axes(trainer.model, trainer.mesh, trainer.engine.full_parameters() | biases)


def save_model(settings: TrainSettings, config: GPTConfig, full: dict[str, Any], tokenizer: Any,
               world: Any) -> None:
    """--save: a Hugging Face folder from rank 0 (at --save-dtype), with the tokenizer that decodes it."""
    if world.rank == 0:
        saved_dtype = dtype_named(settings.output.save_dtype or settings.model.dtype)
        checkpoint.save_pretrained(settings.output.save, config,
                                   {name: value.astype(saved_dtype, copy=False) for name, value in full.items()})
        if tokenizer is not None:  # beside the model, where AutoTokenizer.from_pretrained looks for it
            tokenizer.save(Path(settings.output.save))
    world.barrier()


def save_training_checkpoint(trainer: Any, steps_done: int, batches: data.TokenBatches,
                             data_identity: dict[str, Any]) -> None:
    """Every rank writes the parameters, AdamW moments and expert biases it holds (replicas once), rank 0 the
    manifest (`training_checkpoint`); `batches` (the training data's order) places the data position."""
    model, mesh = trainer.model, trainer.mesh
    ranks, pieces = model.axis_ranks(), trainer.engine.optimizer_parameters()
    state = trainer.optimizer.state_dict()
    held = training_checkpoint.parameter_pieces(pieces, ranks)
    for key in MOMENT_KEYS:
        if key in state:
            held += training_checkpoint.parameter_pieces(pieces, ranks, state[key], prefix=f"{key}/")
    held += training_checkpoint.expert_bias_pieces(model.expert_biases)
    marked = [(piece, array, training_checkpoint.writes_copy(piece.placement, mesh)) for piece, array in held]
    names = list(parameter_shapes(model.config))
    moments = [f"{key}/{name}" for key in MOMENT_KEYS if key in state for name in names]
    training_checkpoint.save(trainer.settings.output.checkpoint_dir, steps_done, marked, mesh.world,
                             _description(trainer, steps_done, batches, data_identity),
                             names + list(expert_bias_shapes(model.config)) + moments)


def _description(trainer: Any, steps_done: int, batches: data.TokenBatches,
                 data_identity: dict[str, Any]) -> dict[str, Any]:
    """The manifest's account of the run: data position (and the data's fingerprint), settings, the mesh, the
    model, the optimizer scalars, the loss scaler."""
    settings, shape, layout = trainer.settings, trainer.mesh.shape, trainer.settings.mesh
    count = batches.batch_count
    return {
        "data_position": {"next_step": steps_done, "epoch": steps_done // count,
                          "batch": batches.order.batch_number(steps_done), "batches_per_pass": count,
                          "tokens_consumed": steps_done * settings.data.batch_size * settings.data.seq_len,
                          **data_identity},
        "settings": asdict(settings),
        "mesh": {"world_size": trainer.mesh.world.size, **asdict(shape), "sp": layout.sp, "zero": layout.zero,
                 "schedule": layout.schedule if shape.pp > 1 else None, "microbatches": trainer.microbatches,
                 "virtual_stages": virtual_stages(settings)},
        "model": trainer.model.config.to_dict(),
        "optimizer": {key: value for key, value in trainer.optimizer.state_dict().items() if key not in MOMENT_KEYS},
        "loss_scaler": trainer.scaler.state_dict(),
    }


def newest_checkpoint(settings: TrainSettings, mesh: Mesh) -> str | None:
    """The training checkpoint --resume continues from (None: start fresh, as a restarted job would want), the
    same on every rank: rank 0 chooses, so that the folder may change meanwhile."""
    if not settings.output.resume:
        return None
    if not settings.output.checkpoint_dir:
        raise ConfigError("--resume needs --checkpoint-dir (where the training checkpoints are)")
    directory = settings.output.checkpoint_dir
    latest = on_every_rank(mesh.world, lambda: training_checkpoint.latest_training_checkpoint(directory)
                           if mesh.world.rank == 0 else None)
    return mesh.world.comm.bcast(latest, root=0)


def load_model_state(path: str, model: Transformer, mesh: Mesh, data_identity: dict[str, Any]) -> TrainingCheckpoint:
    """The checkpoint's parameters and expert biases into `model`, resharded to this mesh, after checking that
    it was saved from the same model and data."""
    def load() -> TrainingCheckpoint:
        saved = TrainingCheckpoint(path)
        saved.check_model(model.config)
        saved.check_data(data_identity)
        held = training_checkpoint.parameter_pieces(model.params.values(), model.axis_ranks())
        load_pieces(saved, held + training_checkpoint.expert_bias_pieces(model.expert_biases))
        for param in model.params.values():  # mixed precision: the working copy is the loaded master, rounded
            if param.master is not None:
                param.data[...] = param.master
        return saved

    return on_every_rank(mesh.world, load)


def load_optimizer_state(trainer: Any, saved: TrainingCheckpoint) -> None:
    """Restore the optimizer (and the loss scaler) from a checkpoint of any mesh: each rank reads its own pieces
    of the moments."""
    optimizer = trainer.optimizer
    state = saved.optimizer_scalars(optimizer.name)
    pieces, ranks = trainer.engine.optimizer_parameters(), trainer.model.axis_ranks()
    held = []
    for key in MOMENT_KEYS:
        if hasattr(optimizer, key):
            state[key] = getattr(optimizer, key)  # read straight into the optimizer's buffers
            held += training_checkpoint.parameter_pieces(pieces, ranks, state[key], prefix=f"{key}/")
    on_every_rank(trainer.mesh.world, lambda: load_pieces(saved, held))
    optimizer.load_state_dict(state)
    if saved.manifest.get("loss_scaler"):
        trainer.scaler.load_state_dict(saved.manifest["loss_scaler"])


class Resume:
    """--resume in its two parts: the model's parameters (before the data-parallel engines take them over) and
    the optimizer's state (after); without --resume, or with no checkpoint yet, both do nothing."""

    def __init__(self, settings: TrainSettings, mesh: Mesh, data_identity: dict[str, Any]) -> None:
        self.path, self.mesh, self.data_identity = newest_checkpoint(settings, mesh), mesh, data_identity
        self.saved: TrainingCheckpoint | None = None

    @property
    def first_step(self) -> int:
        return 0 if self.saved is None else self.saved.step

    def load_model(self, model: Transformer) -> None:
        if self.path is not None:
            self.saved = load_model_state(self.path, model, self.mesh, self.data_identity)

    def load_optimizer(self, trainer: Any) -> None:
        if self.saved is not None:
            load_optimizer_state(trainer, self.saved)
