"""The training state across the mesh: gathered into the serial model's tensors (`--save`, samples), written
as a training checkpoint every `--checkpoint-every` steps, and read back on any mesh (`--resume`).

Every rank writes the pieces it holds (replicas once) and reads the pieces it needs: resuming on another mesh
reshards on load (`checkpoints.sharded`). The parameters are loaded into the model before the data-parallel
engines take them over (`parallelize`), the optimizer's moments into the optimizer after.
"""

from __future__ import annotations

import time
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

from models import parameter
from models.precision import dtype_named
from models.transformer import GPTConfig, Transformer, expert_bias_shapes, parameter_shapes

from .. import data
from ..checkpoints import hugging_face, sharded, upkeep
from ..checkpoints.sharded import MOMENT_KEYS, TrainingCheckpoint, load_pieces
from ..errors import ConfigError, on_every_rank
from ..mesh import Mesh
from ..text import plural
from .parallelize import virtual_stages
from .settings import TrainSettings

if TYPE_CHECKING:
    from .step import Trainer


def gather_over_model_axes(model: Transformer, mesh: Mesh, tensors: dict[str, Any]) -> dict[str, Any]:
    """Whole-along-dp arrays of this rank's pieces (by name) -> the serial tensors in checkpoint order: TP shards
    gathered, every pipeline stage's and EP rank's tensors collected (`models.parameter.gather_over_model_axes`)."""
    whole = parameter.gather_over_model_axes(tensors, model.params, {"tp": mesh.tp, "pp": mesh.pp, "ep": mesh.ep})
    order = [*parameter_shapes(model.config), *expert_bias_shapes(model.config)]
    return {name: whole[name] for name in order if name in whole}


def full_model_tensors(trainer: Trainer) -> dict[str, Any]:
    """The serial model's tensors by name — parameters gathered over DP (ZeRO-3), TP, PP and EP — then the MoE
    expert biases."""
    biases = {name: bias.copy() for name, bias in trainer.model.expert_biases.items()}
    return gather_over_model_axes(trainer.model, trainer.mesh, trainer.engine.full_parameters() | biases)


def save_model(settings: TrainSettings, config: GPTConfig, full: dict[str, Any], tokenizer: Any,
               world: Any) -> None:
    """--save: a Hugging Face folder from rank 0 (at --save-dtype), with the tokenizer that decodes it."""
    if world.rank == 0:
        saved_dtype = dtype_named(settings.output.save_dtype or settings.model.dtype)
        hugging_face.save_pretrained(settings.output.save, config,
                                   {name: value.astype(saved_dtype, copy=False) for name, value in full.items()})
        if tokenizer is not None:  # beside the model, where AutoTokenizer.from_pretrained looks for it
            tokenizer.save(Path(settings.output.save))
    world.barrier()


def held_pieces(trainer: Trainer) -> list[tuple[sharded.Piece, Any]]:
    """The parameters (master copies), AdamW moments and expert biases this rank holds, as checkpoint pieces
    (what it writes in a checkpoint, and offers the survivors of a lost rank: `recovery`)."""
    model = trainer.model
    ranks, pieces = model.axis_ranks(), trainer.engine.optimizer_parameters()
    state = trainer.optimizer.state_dict()
    held = sharded.parameter_pieces(pieces, ranks)
    for key in MOMENT_KEYS:
        if key in state:
            held += sharded.parameter_pieces(pieces, ranks, state[key], prefix=f"{key}/")
    return held + sharded.expert_bias_pieces(model.expert_biases)


def expected_tensors(config: GPTConfig, optimizer: Any) -> list[str]:
    """The logical tensors of a training state: the parameters, the expert biases, the moments of `optimizer`
    (None: unknown here, a spare's view — the ranks of the step say it)."""
    names = list(parameter_shapes(config))
    state = optimizer.state_dict() if optimizer is not None else {}
    moments = [f"{key}/{name}" for key in MOMENT_KEYS if key in state for name in names]
    return names + list(expert_bias_shapes(config)) + moments


def save_training_checkpoint(trainer: Trainer, steps_done: int, batches: data.TokenBatches,
                             data_identity: dict[str, Any]) -> Path:
    """Every rank writes the parameters, AdamW moments and expert biases it holds (replicas once), rank 0 the
    manifest (`checkpoints.sharded`); `batches` (the training data's order) places the data position."""
    mesh = trainer.mesh
    marked = [(piece, array, sharded.writes_copy(piece.placement, mesh)) for piece, array in held_pieces(trainer)]
    return sharded.save(trainer.settings.output.checkpoint_dir, steps_done, marked, mesh.world,
                        _description(trainer, steps_done, batches, data_identity),
                        expected_tensors(trainer.model.config, trainer.optimizer))


def save_and_describe(trainer: Trainer, steps_done: int, batches: data.TokenBatches, data_identity: dict[str, Any]
                      ) -> str:
    """Save a training checkpoint, drop those beyond --keep-checkpoints; the log line that says what it did."""
    started = time.perf_counter()
    folder = save_training_checkpoint(trainer, steps_done, batches, data_identity)
    seconds = time.perf_counter() - started
    if trainer.mesh.world.rank != 0:
        return ""
    output = trainer.settings.output
    removed = upkeep.prune(output.checkpoint_dir, output.keep_checkpoints)
    kept = upkeep.complete_steps(output.checkpoint_dir)
    disk = sum(upkeep.folder_bytes(path) for path in kept)
    dropped = f", removed {plural(len(removed), 'older one')}" if removed else ""
    return (f"saved checkpoint step {steps_done} ({upkeep.folder_bytes(folder) / 1e6:.1f} MB, "
            f"{seconds:.2f} s) to {folder}{dropped}; {plural(len(kept), 'checkpoint')} kept, {disk / 1e6:.1f} MB "
            f"on disk" + ("" if output.keep_checkpoints else " (--keep-checkpoints N keeps the newest N)"))


def _description(trainer: Trainer, steps_done: int, batches: data.TokenBatches,
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


def checkpoint_to_resume(settings: TrainSettings, mesh: Mesh) -> str | None:
    """The training checkpoint --resume / --resume-from continues from (None without them), the same on every
    rank: rank 0 chooses, so that the folder may change meanwhile. None too when --resume finds no checkpoint in
    the folder yet (the run starts at step 0 and says so). One clear error when --resume-from names none, or when
    the checkpoint is at --steps already."""
    output = settings.output
    if not output.resume and output.resume_from is None:
        return None

    def choose() -> str | None:
        if mesh.world.rank != 0:
            return None
        path = _resume_path(output.checkpoint_dir, output.resume_from)
        if path is None:
            return None
        step = TrainingCheckpoint(path).step
        if step >= settings.data.steps:
            raise ConfigError(f"the checkpoint {path} is at step {step} already, and --steps {settings.data.steps} "
                              f"counts from the start of training: give --steps above {step} to train on")
        return str(path)

    return mesh.world.broadcast_object(on_every_rank(mesh.world, choose), root=0)


def _resume_path(directory: str | None, resume_from: str | None) -> Path | None:
    """--resume: the newest complete checkpoint of `directory`, or None where it holds none yet (a new run: so that
    one script serves the first submission of a batch job and every requeue, even one whose first save was cut
    short); --resume-from STEP: that step's;
    --resume-from DIR: a step folder, or a checkpoint directory's newest."""
    if resume_from is not None and not resume_from.isdigit():
        return sharded.find_checkpoint(resume_from)
    if not directory:
        raise ConfigError("--resume needs --checkpoint-dir (where the training checkpoints are)")
    if resume_from is not None:
        folder = sharded.step_folder(directory, int(resume_from))
        if not (folder / sharded.MANIFEST).is_file():
            steps = [int(path.name.split("-")[1]) for path in upkeep.complete_steps(directory)]
            raise ConfigError(f"--resume-from {resume_from}: {folder} is not a complete checkpoint; complete ones: "
                              f"{', '.join(f'step {step}' for step in steps) or 'none'}")
        return folder
    return sharded.latest_training_checkpoint(directory)


def load_model_state(path: str, model: Transformer, mesh: Mesh, data_identity: dict[str, Any]) -> TrainingCheckpoint:
    """The checkpoint's parameters and expert biases into `model`, resharded to this mesh, after checking that
    its files are the ones saved (sizes and SHA-256, the ranks sharing the files) and that it was saved from the
    same model and data."""
    def load() -> TrainingCheckpoint:
        saved = TrainingCheckpoint(path)
        upkeep.verify_before_resume(saved, mesh.world.rank, mesh.world.size)
        saved.check_model(model.config)
        saved.check_data(data_identity)
        held = sharded.parameter_pieces(model.params.values(), model.axis_ranks())
        load_pieces(saved, held + sharded.expert_bias_pieces(model.expert_biases))
        for param in model.params.values():  # mixed precision: the working copy is the loaded master, rounded
            if param.master is not None:
                param.data[...] = param.master
        return saved

    return on_every_rank(mesh.world, load)


def load_optimizer_state(trainer: Trainer, saved: TrainingCheckpoint) -> None:
    """Restore the optimizer (and the loss scaler) from a checkpoint of any mesh: each rank reads its own pieces
    of the moments."""
    optimizer = trainer.optimizer
    state = saved.optimizer_scalars(optimizer.name)
    pieces, ranks = trainer.engine.optimizer_parameters(), trainer.model.axis_ranks()
    held = []
    for key in MOMENT_KEYS:
        if hasattr(optimizer, key):
            state[key] = getattr(optimizer, key)  # read straight into the optimizer's buffers
            held += sharded.parameter_pieces(pieces, ranks, state[key], prefix=f"{key}/")
    on_every_rank(trainer.mesh.world, lambda: load_pieces(saved, held))
    optimizer.load_state_dict(state)
    if saved.manifest.get("loss_scaler"):
        trainer.scaler.load_state_dict(saved.manifest["loss_scaler"])


class Resume:
    """--resume in its two parts: the model's parameters (before the data-parallel engines take them over) and
    the optimizer's state (after); without --resume, or with no checkpoint yet, both do nothing."""

    def __init__(self, settings: TrainSettings, mesh: Mesh, data_identity: dict[str, Any]) -> None:
        self.path, self.mesh, self.data_identity = checkpoint_to_resume(settings, mesh), mesh, data_identity
        self.saved: TrainingCheckpoint | None = None
        self.new_run_in = settings.output.checkpoint_dir if settings.output.resume and self.path is None else None
        self.zero = settings.mesh.zero

    @property
    def first_step(self) -> int:
        return 0 if self.saved is None else self.saved.step

    def bind(self, mesh: Mesh, data_identity: dict[str, Any]) -> None:
        """Given at construction."""

    def load_model(self, model: Transformer) -> None:
        if self.path is not None:
            self.saved = load_model_state(self.path, model, self.mesh, self.data_identity)

    def load_optimizer(self, trainer: Trainer) -> None:
        if self.saved is not None:
            load_optimizer_state(trainer, self.saved)

    def story(self) -> str | None:
        """The log line of a resumed run: from which step and folder, saved on which mesh, run on which now."""
        if self.new_run_in is not None:
            return f"--resume: no complete checkpoint in {self.new_run_in} yet, so a new run starts at step 0"
        if self.saved is None:
            return None
        now = {"world_size": self.mesh.world.size, **asdict(self.mesh.shape), "zero": self.zero}
        saved_on = upkeep.mesh_words(self.saved.manifest.get("mesh", {}))
        return (f"resumed from step {self.saved.step} of {self.saved.folder} (saved on mesh {saved_on}; now "
                f"{upkeep.mesh_words(now)})")
