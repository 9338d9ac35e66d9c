"""What a step costs: its wall time, the bytes each rank sent per mesh axis (and of them, across nodes), the
trace (`--trace`), and the bytes each rank holds (`--memory-report`) — each beside the formula that predicts it.

The byte counts come from the communicators' ledgers (`collectives.Communicator.ledger`): `StepMeter` reads them
before and after the step. Bookkeeping sums (losses, norms, votes) use MPI's own all-reduce outside the ledger
(`sum_over`), so the ledger holds exactly the training traffic the formulas predict.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

import collectives
from collectives import Communicator
from models.layers import block_activation_elements
from models.parameter import Partial, local_shape
from models.precision import model_state_bytes
from models.transformer import Transformer

from .. import traffic
from ..axes.pipeline_parallel import TIED_WEIGHT
from ..mesh import Mesh
from .settings import moment_dtype

if TYPE_CHECKING:
    from .step import Trainer


def sum_array_over(comm: Communicator, values: np.ndarray) -> np.ndarray:
    """An array summed over the ranks of `comm` (MPI's own all-reduce, outside the ledger)."""
    return collectives.all_reduce(np.asarray(values, dtype=np.float64), comm, algo="mpi")


def sum_over(comm: Communicator, value: float) -> float:
    """A scalar summed over the ranks of `comm` (MPI's own all-reduce: bookkeeping stays out of the ledger)."""
    return float(collectives.all_reduce(np.array([value]), comm, algo="mpi")[0])


class NoTracer:
    """No --trace: records nothing."""

    def step(self, step: int, start: float, end: float) -> None:
        """Nothing to record."""

    def pipeline_actions(self, timeline: Any, stage_ranks: Any, step: int) -> None:
        """Nothing to record."""

    def write(self, path: str) -> bool:
        return False


NO_TRACER = NoTracer()


@dataclass
class Clock:
    """A step's start: the time, and every ledger's count of bytes sent so far (all, and across nodes)."""

    start: float
    sent: dict[str, int]
    inter_node: dict[str, int]
    apart: dict[str, dict[str, int]] = field(default_factory=dict)  # bytes sent outside the formulas, by name


class StepMeter:
    """The time and bytes per mesh axis of one step, and the trace's step event."""

    def __init__(self, mesh: Mesh, model: Transformer, tracer: Any = NO_TRACER) -> None:
        self.mesh, self.tracer = mesh, tracer
        self.key_value_group = model.tp.key_value_group  # KV heads replicated over tp: part of tp's traffic
        self.across_nodes = mesh.world.topology.spans_nodes

    def start(self) -> Clock:
        return Clock(time.perf_counter(), self._bytes_sent(), self._inter_node_bytes_sent())

    def apart(self, clock: Clock, name: str, work: Callable[[], Any]) -> Clock:
        """Run `work` inside the step's time but outside its bytes per axis, which the traffic formulas predict
        without it (the global aux loss's counting pass): the bytes it sends go to the step's record as `name`
        (when there are any). Returns the clock with its byte counts moved past them."""
        sent, inter_node = self._bytes_sent(), self._inter_node_bytes_sent()
        work()
        apart = {axis: after - sent[axis] for axis, after in self._bytes_sent().items()}
        moved = {axis: after - inter_node[axis] for axis, after in self._inter_node_bytes_sent().items()}
        clock.apart[name] = apart
        return Clock(clock.start, {axis: clock.sent[axis] + apart[axis] for axis in apart},
                     {axis: clock.inter_node[axis] + moved[axis] for axis in moved}, clock.apart)

    def finish(self, clock: Clock, step: int) -> dict[str, Any]:
        """The step's record fields: `time_s`, `comm_bytes` per axis, and `inter_node_bytes` on several nodes."""
        sent = {axis: after - clock.sent[axis] for axis, after in self._bytes_sent().items()}
        record: dict[str, Any] = {"comm_bytes": sent}
        record |= {name: bytes_apart for name, bytes_apart in clock.apart.items() if any(bytes_apart.values())}
        if self.across_nodes:  # the bytes of `sent` that left this rank's node
            record["inter_node_bytes"] = {axis: after - clock.inter_node[axis]
                                          for axis, after in self._inter_node_bytes_sent().items()}
        end = time.perf_counter()
        self.tracer.step(step, clock.start, end)
        return record | {"time_s": end - clock.start}

    def _bytes_sent(self) -> dict[str, int]:
        sent = {axis: comm.ledger.total_sent() for axis, comm in self.mesh.communicators().items()}
        if self.key_value_group is not None:
            sent["tp"] += self.key_value_group.ledger.total_sent()
        return sent

    def _inter_node_bytes_sent(self) -> dict[str, int]:
        return {axis: comm.ledger.inter_node_sent() for axis, comm in self.mesh.communicators().items()}


# -- --memory-report -----------------------------------------------------------------------------------------

def memory_report(trainer: Trainer) -> str:
    """Bytes this rank holds, measured from the arrays, next to what the ZeRO arithmetic predicts."""
    model, mesh, settings = trainer.model, trainer.mesh, trainer.settings
    held = trainer.engine.memory(trainer.optimizer) | {"activations": trainer.passes.activation_bytes}
    n = mesh.shard_group().size  # the ranks ZeRO shards over: dp (×cp), or a hybrid shard group
    sizes = {"tp": mesh.tp.size}  # from the placements: this rank's shard of every parameter
    count = sum(math.prod(local_shape(p.full_shape, p.placement, sizes)) for p in model.parameters())
    moments = moment_dtype(settings.optimizer)
    per_parameter = model_state_bytes(model.compute_dtype, model.master_dtype, model.grad_dtype,
                                      settings.optimizer.optimizer, settings.mesh.zero, n, moments)
    theory = {kind: count * size for kind, size in per_parameter.items()}
    precision = (f"{model.compute_dtype.name} compute{' (FP8 GEMMs)' if model.fp8 != 'none' else ''}, "
                 f"{model.grad_dtype.name} gradients, {model.master_dtype.name} master, "
                 f"{moments or model.master_dtype.name} moments")
    sharding = f"dp {mesh.shape.dp}" + (f", sharded over {mesh.shape.dp_shard}" if mesh.shape.hybrid else "")
    lines = [f"rank {mesh.world.rank} (zero {settings.mesh.zero}, {sharding}; {precision}): "
             f"{count:,} parameters, {sum(per_parameter.values()):.2f} bytes per parameter "
             f"({' + '.join(f'{size:g}' for size in per_parameter.values())})"]
    for kind, measured in held.items():
        expected = f"{theory[kind] / 2**20:10.2f} MiB" if kind in theory else "          -"
        lines.append(f"  {kind:<16} {measured / 2**20:10.2f} MiB held   theory {expected}")
    total = sum(v for k, v in held.items() if k in theory)
    lines.append(f"  {'model states':<16} {total / 2**20:10.2f} MiB held   theory "
                 f"{sum(theory.values()) / 2**20:10.2f} MiB")
    formula = block_activation_formula(trainer)
    shown = f"{formula / 2**20:10.2f} MiB" if formula else "         - (none yet for --cp or --experts)"
    saved = trainer.passes.block_activation_bytes
    lines.append(f"  {'one block':<16} {saved / 2**20:10.2f} MiB saved  formula {shown} "
                 f"(per microbatch, --recompute {settings.model.recompute}; "
                 f"exactly {saved} bytes saved, formula {formula})")
    return "\n".join(lines)


def block_activation_formula(trainer: Trainer) -> int:
    """`models.layers.block_activation_elements` for this run's microbatch, in bytes (0: no formula yet for
    context-parallel attention or experts)."""
    settings, config, mesh = trainer.settings, trainer.model.config, trainer.mesh
    if mesh.cp.size > 1 or config.n_experts:
        return 0
    return trainer.model.compute_dtype.itemsize * block_activation_elements(
        trainer.microbatch_rows, settings.data.seq_len, config.n_embd, config.n_head, mesh.tp.size,
        settings.mesh.sp, settings.model.recompute, trainer.model.query_block, config.kv_heads,
        config.ffn_width if config.is_llama else None, trainer.passes.block_documents)


# -- bytes per axis beside the formulas ------------------------------------------------------------------------

def traffic_by_axis(trainer: Trainer, counted: dict[str, int], across_nodes: bool = False) -> list[traffic.AxisTraffic]:
    """The step's bytes sent per axis (`counted`, from its log record) beside what the formulas predict;
    `across_nodes`: only the bytes that left the node (`counted` from the record's inter_node_bytes)."""
    settings, model, config = trainer.settings, trainer.model, trainer.model.config
    mesh = traffic.AcrossNodesMesh(trainer.mesh) if across_nodes else trainer.mesh
    local = set(model.local_units)
    shape = traffic.RunShape(
        rows=trainer.microbatch_rows, positions=settings.data.seq_len // mesh.shape.cp, channels=config.n_embd,
        itemsize=model.compute_dtype.itemsize, grad_itemsize=model.grad_dtype.itemsize,
        microbatches=trainer.microbatches,
        blocks=len(local - {0, config.n_layer + 1}), has_embedding=0 in local,
        has_head=config.n_layer + 1 in local, sp=settings.mesh.sp, recompute=settings.model.recompute,
        seq_len=settings.data.seq_len, cp_attention=settings.mesh.cp_attention, moe=bool(config.n_experts),
        n_head=config.n_head, kv_heads=config.kv_heads, tp=mesh.shape.tp,
        dense_blocks=sum(not config.is_moe_layer(unit - 1) for unit in local - {0, config.n_layer + 1}),
        latent_width=config.kv_lora_rank + config.qk_rope_head_dim if config.is_deepseek else 0,
        mtp_depth=config.mtp_depth, latent_heads_width=config.n_head * (
            config.qk_nope_head_dim + config.qk_rope_head_dim + config.v_head_dim) if config.is_deepseek else 0,
        experts=config.n_experts, balanced_layers=sum(config.is_moe_layer(unit - 1) for unit in
                                                      local - {0, config.n_layer + 1})
        if config.is_deepseek and config.moe_seq_aux_coef else 0)
    partial = sum(piece.grad.nbytes for piece in trainer.engine.optimizer_parameters()
                  if isinstance(piece.placement.get("tp"), Partial))
    key_value_group = None if across_nodes else model.tp.key_value_group  # KV heads held by several TP ranks
    predicted: dict[str, float | None] = {
        "tp": traffic.tensor_parallel_bytes(shape, mesh.tp, partial, key_value_group),
        "cp": traffic.context_parallel_bytes(shape, mesh.shape.cp, mesh.shape.tp, mesh.cp) if not across_nodes
        else traffic.context_parallel_inter_node_bytes(shape, mesh.cp),
        "ep": expert_parallel_formula(trainer, across_nodes)}
    axis_of = {id(comm): axis for axis, comm in trainer.mesh.communicators().items()}
    for engine in trainer.engine.engines:
        axis = axis_of.get(id(engine.comm))
        if axis is not None:
            predicted[axis] = (predicted.get(axis) or 0.0) + traffic.data_parallel_bytes(
                engine, trainer.microbatches, shape.itemsize, hooked=trainer.passes.hooked,
                comm=mesh.communicators()[axis])
        if engine.replicas is not None:  # hybrid sharding: the shards summed over the groups
            axis = axis_of[id(engine.replicas)]
            predicted[axis] = (predicted.get(axis) or 0.0) + traffic.replica_bytes(
                engine, shape.itemsize, mesh.communicators()[axis])
    if trainer.schedule is not None:
        wte = model.params.get(TIED_WEIGHT) if config.head_reads_embedding else None  # ZeRO-3 may have freed it
        tied = 0 if wte is None else shape.gradient_bytes * math.prod(
            local_shape(wte.full_shape, wte.placement, {"tp": mesh.shape.tp}))
        predicted["pp"] = traffic.pipeline_bytes(shape, trainer.schedule, mesh.pp.rank, mesh.shape.tp, tied,
                                                 crossing=mesh.pp.remote if across_nodes else None)
    if across_nodes:  # an axis kept inside nodes shows its 0
        return traffic.report(counted, predicted, keep={a for a, c in mesh.communicators().items() if c.size > 1})
    return traffic.report(counted, predicted)


def expert_parallel_formula(trainer: Trainer, across_nodes: bool) -> float | None:
    """`traffic.expert_parallel_bytes` on the last step's counts of this rank's MoE layers (None without EP)."""
    model, counts = trainer.model, getattr(trainer.experts, "last_traffic", None)
    if not model.ep.parallel or counts is None:
        return None
    channels, itemsize = model.config.n_embd, model.compute_dtype.itemsize
    dispatch_row = channels + 4 * math.ceil(channels / 128) if model.fp8 != "none" else channels * itemsize
    return traffic.expert_parallel_bytes(counts, model.ep.dispatch, model.ep.comm, channels * itemsize, dispatch_row,
                                         counts["value_bytes"], model.config.n_experts // model.ep.size, across_nodes)


# -- MFU's denominator -----------------------------------------------------------------------------------------

def peak_flops(device: str, mesh: Mesh, n_embd: int, rows: int, compute_dtype: str = "float32") -> float:
    """The matmul FLOP/s of all ranks together, as the planner assumes them: on GPU the dense tensor-core peak of
    the device for the compute dtype (`planner.peak_flops`, the same figure `plan --gpu` divides by; an H100's
    `planner.DEFAULT_PEAK_FLOPS` for a device without a preset); on CPU the rate `plan --calibrate` measures (the
    model's MLP products on every rank at once, `planner.calibrate.matmul_rate`), measured here in three rounds."""
    from ..planner.calibrate import matmul_rate

    if device == "gpu":
        return gpu_peak_flops(compute_dtype) * mesh.world.size
    # at least the shapes of a 256-channel model: smaller products are dominated by per-call costs, not a peak.
    # Three single products, their median: every run pays it at start (0.03 s on 2 ranks of a 2-core machine,
    # within 4 % of ten products' median, 0.1 s)
    per_rank = matmul_rate(max(n_embd, 256), max(rows, 1024), mesh.world.comm.Barrier, repeats=1, rounds=3)
    return sum_over(mesh.world, per_rank)


def gpu_peak_flops(compute_dtype: str) -> float:
    """This rank's GPU's dense peak for `compute_dtype` by its CUDA name (the planner's presets), else an H100's
    bfloat16 peak (what `plan` assumes without `--gpu`)."""
    from collectives.backend import gpu_array_module

    from ..planner import DEFAULT_PEAK_FLOPS
    from ..planner import peak_flops as preset_peak

    name = gpu_array_module().cuda.runtime.getDeviceProperties(0)["name"]
    try:
        return preset_peak(name.decode() if isinstance(name, bytes) else str(name), compute_dtype)
    except ValueError:
        return DEFAULT_PEAK_FLOPS
