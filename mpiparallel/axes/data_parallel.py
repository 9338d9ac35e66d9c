"""Data parallelism: gradient buckets reduced while backward runs, and ZeRO stages 1, 2 and 3.

Every data-parallel (DP) rank holds the same model and computes gradients on its own rows of the batch; the
loss of each rank is its token losses divided by the *global* token count, so summing the ranks' gradients
gives the gradient of the global mean loss. What differs between the stages is what each rank keeps and how
the sum is formed (n DP ranks, G = P = the parameters' bytes, Adam keeping two moments):

    stage       communication per step, bytes sent per rank          memory per rank (params, grads, moments)
    DP          all-reduce of grads            2(n−1)/n·G            P + G + 2P
    ZeRO-1      reduce-scatter grads + all-gather params  (n−1)/n·G + (n−1)/n·P = the same total
                                                                     P + G + 2P/n
    ZeRO-2      as ZeRO-1 (per microbatch)                           P + G/n + 2P/n
    ZeRO-3      as ZeRO-2, plus an all-gather of each unit's params before its forward and again before its
                backward: + 2(n−1)/n·P per microbatch                P/n + G/n + 2P/n

Hybrid sharding (HSDP, `--dp-shard N`; PyTorch FSDP's HYBRID_SHARD, torchtitan's dp_replicate × dp_shard): the
ZeRO stages shard over a group of N ranks (`comm`, one node when N·tp·cp is its rank count) and the dp/N = r
groups hold replicas; after the reduce-scatter inside the group, each rank all-reduces its shard of the gradients
with the ranks holding the same shard in the other groups (`replicas`). Parameters are gathered inside the group
only. Per rank and step (Ψ = G = P):

    inside the group    as the stage above with n = N (ZeRO-3: (N−1)/N·Ψ reduce-scatter + 2(N−1)/N·Ψ gathers)
    across the groups   2(r−1)/r·Ψ/N: the replicas' all-reduce of one shard — the only traffic between groups
    memory              as the stage with n = N: the sharded states are N times smaller, not dp times

The stages are four classes, each extending the one before by what it shards, so that a reader can compare them
method by method: `DataParallel` (plain: whole gradients all-reduced), `ZeRO1` (flat parameter buffers, the
optimizer on this rank's slices, reduce-scatter then all-gather), `ZeRO2` (gradient slices accumulated every
microbatch, full buffers only while in use), `ZeRO3` (parameter slices, gathered unit by unit).
`data_parallel(model, comm, zero=k)` builds stage k.

Layout. Parameters are laid out in the order their gradients become final during backward (head first, the
embedding last: the tied wte is final only after the embedding's backward) and grouped into buckets of about
`bucket_mb`, never splitting a model unit (the embedding, one block, the head). Each bucket is one flat array,
padded to a multiple of n; a rank owns the same 1/n slice of every bucket. `Parameter.data`/`.grad` become
views into the flat arrays, so the layers write straight into the buffers that are communicated.

Overlap. The engine is the model's `ParameterHooks`: when backward finishes a unit, every bucket whose
gradients are now final starts its asynchronous reduction (all-reduce, or reduce-scatter for ZeRO), and every
hook progresses the reductions in flight (`test()`), so communication runs while later layers compute;
`finish_gradients()` waits for what is left. ZeRO-3 also gathers each unit's parameters before it runs,
prefetching the next unit's, and frees them afterwards.

Pipelines. A pipeline schedule runs the model without these hooks (it interleaves microbatches and splits
backward into input and weight passes), inside `unhooked()`: every stage reduces once per step, after the
schedule — ZeRO-2/3 accumulate full gradients over the microbatches and reduce-scatter them then (ZeRO-1's
traffic), and ZeRO-3 gathers all of the rank's parameters at the step's start (one all-gather of P) and frees
them at its end.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from typing import Any

import numpy as np

import collectives
from collectives import Communicator
from collectives.backend import Array, get_array_module
from models.layers import distinct_bytes
from models.moe import expert_index
from models.parameter import HELD, PARTIAL, FlatShard, Parameter
from models.transformer import ParameterHooks

from ..errors import ConfigError
from ..mesh import Mesh

ZERO_STAGES = (0, 1, 2, 3)
DP_AXIS = "dp"


@dataclass
class Bucket:
    """A run of parameters sharing one flat gradient (and, for ZeRO, parameter) buffer."""

    params: list[Parameter]
    offsets: list[int]            # where each parameter starts in the flat buffer
    size: int                     # elements used
    padded: int                   # elements allocated: a multiple of the DP size
    final_after: int              # its gradients are complete once backward has finished this unit
    used_by: set[int] = field(default_factory=set)  # the units whose computation reads these parameters

    def shard(self, rank: int, ranks: int) -> slice:
        width = self.padded // ranks
        return slice(rank * width, (rank + 1) * width)


def build_buckets(units: list[list[Parameter]], bucket_bytes: int, ranks: int) -> list[Bucket]:
    """Group the parameters, in the order their gradients become final, into buckets of ≥ bucket_bytes."""
    final_unit = {}
    for unit, params in enumerate(units):  # a parameter's gradient is final after its earliest unit's backward
        for param in params:
            final_unit.setdefault(id(param), (unit, param))
    order = sorted(final_unit.values(), key=lambda pair: -pair[0])
    buckets: list[Bucket] = []
    current: list[tuple[int, Parameter]] = []
    for position, (unit, param) in enumerate(order):
        current.append((unit, param))
        unit_ends = position + 1 == len(order) or order[position + 1][0] != unit
        if unit_ends and sum(p.data.nbytes for _, p in current) >= bucket_bytes:
            buckets.append(_bucket(current, ranks))
            current = []
    if current:
        buckets.append(_bucket(current, ranks))
    for bucket in buckets:
        members = {id(p) for p in bucket.params}
        bucket.used_by = {unit for unit, params in enumerate(units) if members & {id(p) for p in params}}
    return buckets


def _bucket(members: list[tuple[int, Parameter]], ranks: int) -> Bucket:
    params = [param for _, param in members]
    offsets = np.cumsum([0] + [p.data.size for p in params]).tolist()
    size = offsets[-1]
    return Bucket(params, offsets[:-1], size, -(-size // ranks) * ranks, min(unit for unit, _ in members))


class ShardSegment:
    """The part of one parameter that lies in this rank's shard of a bucket: what ZeRO's optimizer updates.

    `data` and `grad` are 1-D views into the shard buffers; `full_shape` tells the optimizer the parameter's
    real shape (AdamW decays only ≥2-D weights). Under mixed precision `master` is the view of this rank's shard
    of the master weights (ZeRO shards them with the moments), else None.
    """

    __slots__ = ("name", "data", "grad", "full_shape", "placement", "parameter", "start", "stop", "master")

    def __init__(self, parameter: Parameter, start: int, stop: int, data: Array, grad: Array,
                 full_shape: tuple[int, ...], axes: tuple[str, ...], master: Array | None = None) -> None:
        self.name, self.data, self.grad, self.full_shape = f"{parameter.name}[{start}:{stop}]", data, grad, full_shape
        self.master = master
        self.parameter, self.start, self.stop = parameter, start, stop
        self.placement = parameter.placement | {axis: FlatShard(start, stop) for axis in axes}


class DataParallel(ParameterHooks):
    """Plain data parallelism over `comm` for `model` (anything with `units()` and the ParameterHooks protocol):
    every rank keeps whole parameters, gradients and optimizer state, and all-reduces the gradients. The ZeRO
    stages below extend it, each sharding one thing more; `data_parallel(..., zero=k)` builds stage k.

    Per step:
        engine.zero_grad()
        for i, (x, y) in enumerate(microbatches):
            with engine.microbatch(last=i == len(microbatches) - 1):
                loss_i, saved = model.forward(x, y, normalizer, hooks=engine)
                model.backward(saved, hooks=engine)
        engine.finish_gradients()
        ... clip over engine.optimizer_parameters() (each piece's placement says which ranks count it)
        optimizer.step(lr)             # an optimizer built over engine.optimizer_parameters()
        engine.after_update()

    `axes` are the mesh axes `comm` spans (("dp",), or ("dp", "cp") when context-parallel ranks also sum their
    gradients): every parameter's placement gains `Partial` on them (each rank's gradient is its tokens' share);
    ZeRO's optimizer pieces carry `FlatShard` on them instead. `select` (default: all) picks the parameters
    this engine reduces, for models whose parameters are summed over different groups (experts). `replicas`
    (ZeRO only): hybrid sharding's other shard groups — the ranks holding this rank's shard there, with which
    each reduced gradient shard is summed (placement `Partial` on `replica_axis` until then).
    """

    zero = 0

    def __init__(self, model: Any, comm: Communicator, bucket_mb: float = 25.0, overlap: bool = True,
                 algo: str = "auto", axes: tuple[str, ...] = (DP_AXIS,),
                 select: Callable[[Parameter], bool] | None = None, replicas: Communicator | None = None,
                 replica_axis: str = "dp_replicate") -> None:
        if bucket_mb <= 0:
            raise ConfigError(f"--bucket-mb must be positive, got {bucket_mb}")
        self.model, self.comm, self.overlap, self.algo, self.axes = model, comm, overlap, algo, axes
        self.replicas = replicas if replicas is not None and replicas.size > 1 else None
        self.units = [[param for param in params if select is None or select(param)]
                      for params in model.unit_parameters()]
        summed_over = axes + ((replica_axis,) if self.replicas is not None else ())
        for params in self.units:
            for param in params:
                param.placement |= {axis: PARTIAL for axis in summed_over}
        self.buckets = build_buckets(self.units, int(bucket_mb * 2**20), comm.size)
        first = self.buckets[0].params[0]
        self.xp = get_array_module(first.data)
        self.dtype, self.grad_dtype = first.data.dtype, first.grad.dtype  # compute and gradient dtypes
        self.master_dtype = None if first.master is None else first.master.dtype  # mixed precision
        self._shapes = {id(p): tuple(p.data.shape) for bucket in self.buckets for p in bucket.params}
        self._in_flight: dict[int, Any] = {}       # bucket index -> handle of its gradient reduction
        self._last_microbatch = True
        self._unhooked_backward = False  # the step's backward ran without the hooks: finish_gradients reduces all
        self.flat_params: list[Array | None] = []  # ZeRO: each bucket's parameters as one flat buffer
        self.param_shards: list[Array] = []        # ZeRO: this rank's slice of them
        self.master_shards: list[Array] = []       # ZeRO under mixed precision: this rank's slice of the masters
        self.grad_shards: list[Array] = []         # ZeRO: this rank's slice of the reduced gradients
        self.flat_grads: list[Array | None] = [None] * len(self.buckets)
        self._lay_out_parameters()
        self._lay_out_gradients()

    # -- layout ---------------------------------------------------------------------------------------------

    def _lay_out_parameters(self) -> None:
        """Plain DP leaves the parameters where they are: only gradients are communicated."""

    def _lay_out_gradients(self) -> None:
        """One full flat gradient buffer per bucket, which the layers write into and the all-reduce sums."""
        for index in range(len(self.buckets)):
            self._allocate_gradients(index)

    def _shard(self, bucket: Bucket) -> slice:
        return bucket.shard(self.comm.rank, self.comm.size)

    def _allocate_gradients(self, index: int) -> None:
        bucket = self.buckets[index]
        flat = self.xp.zeros(bucket.padded, self.grad_dtype)
        self.flat_grads[index] = flat
        for param, offset in zip(bucket.params, bucket.offsets, strict=True):
            param.grad = flat[offset:offset + self._size(param)].reshape(self._shape(param))

    def _shape(self, param: Parameter) -> tuple[int, ...]:
        """A parameter's full shape, also while ZeRO-3 has released its data."""
        return self._shapes[id(param)]

    def _size(self, param: Parameter) -> int:
        return int(np.prod(self._shape(param), dtype=np.int64))

    # -- a step -----------------------------------------------------------------------------------------------

    def parameter_count(self) -> int:
        """Elements in this rank's model parameters (all of them, before any ZeRO sharding)."""
        return sum(int(np.prod(shape, dtype=np.int64)) for shape in self._shapes.values())

    def optimizer_parameters(self) -> list:
        """What the optimizer updates: the whole parameters."""
        return [p for bucket in self.buckets for p in bucket.params]

    def zero_grad(self) -> None:
        for flat in self.flat_grads:
            if flat is not None:
                flat[...] = 0

    @contextmanager
    def microbatch(self, last: bool):
        """Marks one forward + backward; DP and ZeRO-1 reduce gradients only in the last one."""
        self._last_microbatch = last
        yield

    @contextmanager
    def unhooked(self, backward: bool = True):
        """For a caller that runs the model without these hooks — a pipeline schedule, which interleaves
        microbatches and splits backward, so nothing can be gathered or reduced unit by unit: `finish_gradients`
        then reduces every bucket once (ZeRO-2 and -3 add their own preparations)."""
        self._unhooked_backward = backward
        try:
            yield
        finally:
            self.release_all()

    def _reduces_now(self) -> bool:
        """Whether this microbatch's backward reduces: only the last one accumulates into reduced gradients."""
        return self._last_microbatch

    # hooks called by the model around each unit

    def before_backward(self, unit: int) -> None:
        self._progress()

    def after_backward(self, unit: int) -> None:
        if self.overlap and self._reduces_now():
            for index, bucket in enumerate(self.buckets):
                if bucket.final_after == unit:
                    self._start_reduction(index)
        self._progress()

    def finish_gradients(self) -> None:
        """Wait for every gradient reduction (starting those not overlapped)."""
        for index in range(len(self.buckets)):
            if index not in self._in_flight and (not self.overlap or self._unhooked_backward):
                self._start_reduction(index)
        self._unhooked_backward = False
        for index in list(self._in_flight):
            self._complete_reduction(index)

    def after_update(self) -> None:
        """Nothing: every rank updated its whole parameters."""

    # -- gradient reductions ---------------------------------------------------------------------------------

    def _start_reduction(self, index: int) -> None:
        flat = self.flat_grads[index]
        self._in_flight[index] = collectives.all_reduce_async(flat, self.comm, "sum", self.algo, out=flat)

    def _complete_reduction(self, index: int) -> None:
        self._in_flight.pop(index).wait()

    def _progress(self) -> None:
        """Advance every reduction in flight (MPI progresses a message only while some call is inside it)."""
        for handle in self._in_flight.values():
            handle.test()

    # -- inspection ------------------------------------------------------------------------------------------

    def full_parameters(self) -> dict[str, Array]:
        """Every parameter's full value by name — the master weights under mixed precision (for checkpoints and
        tests)."""
        return {param.name: (param.data if param.master is None else param.master).copy()
                for bucket in self.buckets for param in bucket.params}

    def _unflatten(self, bucket: Bucket, flat: Array) -> dict[str, Array]:
        return {param.name: flat[offset:offset + self._size(param)].reshape(self._shape(param)).copy()
                for param, offset in zip(bucket.params, bucket.offsets, strict=True)}

    def release_all(self) -> None:
        """Free whatever parameters a stage gathered (ZeRO-3, after a forward-only pass such as validation)."""

    def full_gradients(self) -> dict[str, Array]:
        """Every parameter's reduced gradient by name (tests, debugging)."""
        grads = {}
        for index, bucket in enumerate(self.buckets):
            grads |= self._unflatten(bucket, self._reduced_gradients(index))
        return grads

    def _reduced_gradients(self, index: int) -> Array:
        return self.flat_grads[index]

    def memory(self, optimizer: Any) -> dict[str, int]:
        """Bytes this rank holds between steps in parameters, gradients and optimizer state, from the arrays."""
        grads = distinct_bytes(self.flat_grads, self.grad_shards)  # ZeRO-1's shards are views of the buffers
        state = sum(a.nbytes for a in getattr(optimizer, "exp_avg", {}).values())
        state += sum(a.nbytes for a in getattr(optimizer, "exp_avg_sq", {}).values())
        # mixed precision: the master weights are optimizer state (the ZeRO paper's 12Ψ = master + m + v)
        state += sum(s.nbytes for s in self.master_shards) + sum(
            p.master.nbytes for b in self.buckets for p in b.params if p.master is not None)
        return {"parameters": self._parameter_bytes(), "gradients": grads, "optimizer_state": state}

    def _parameter_bytes(self) -> int:
        return sum(p.data.nbytes for b in self.buckets for p in b.params)


class ZeRO1(DataParallel):
    """ZeRO stage 1: the optimizer state is sharded. Each bucket's parameters become views of one flat buffer a
    rank owns 1/n of; the optimizer updates only this rank's slices (`ShardSegment`s, with the master weights'
    slices under mixed precision); the last microbatch's gradients are reduce-scattered into that slice, and
    after the update every rank all-gathers the updated slices back into the full parameters."""

    zero = 1

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._segments = self._shard_segments()

    def _lay_out_parameters(self) -> None:
        """Parameters become views of flat per-bucket buffers; this rank's slice of each is its shard."""
        for bucket in self.buckets:
            flat = self._flat_parameters(bucket)
            self.flat_params.append(flat)
            self.param_shards.append(flat[self._shard(bucket)])
            self._point_parameters_at(bucket, flat)

    def _flat_parameters(self, bucket: Bucket) -> Array:
        """The bucket's parameters copied into one padded flat buffer (and, under mixed precision, this rank's
        shard of their master weights kept aside)."""
        flat = self.xp.zeros(bucket.padded, self.dtype)
        for param, offset in zip(bucket.params, bucket.offsets, strict=True):
            flat[offset:offset + param.data.size] = param.data.reshape(-1)
        if self.master_dtype is not None:
            self.master_shards.append(self._master_shard(bucket))
        return flat

    def _master_shard(self, bucket: Bucket) -> Array:
        """This rank's shard of the bucket's master weights; the parameters let go of their whole masters (ZeRO
        shards them, with the moments: 12Ψ/n of the paper's 16Ψ)."""
        flat = self.xp.zeros(bucket.padded, self.master_dtype)
        for param, offset in zip(bucket.params, bucket.offsets, strict=True):
            flat[offset:offset + param.master.size] = param.master.reshape(-1)
            param.master = None
        return flat[self._shard(bucket)].copy()

    def _lay_out_gradients(self) -> None:
        """Full gradient buffers, as plain DP; the reduced shard overwrites this rank's part of each."""
        super()._lay_out_gradients()
        self.grad_shards = [flat[self._shard(bucket)] for flat, bucket in zip(self.flat_grads, self.buckets,
                                                                                strict=True)]

    def _point_parameters_at(self, bucket: Bucket, flat: Array) -> None:
        for param, offset in zip(bucket.params, bucket.offsets, strict=True):
            param.data = flat[offset:offset + self._size(param)].reshape(self._shape(param))

    def _shard_segments(self) -> list[ShardSegment]:
        """The pieces of parameters inside this rank's shards, as the optimizer's parameters."""
        segments = []
        for index, bucket in enumerate(self.buckets):
            shard = self._shard(bucket)
            for param, offset in zip(bucket.params, bucket.offsets, strict=True):
                lo, hi = max(offset, shard.start), min(offset + self._size(param), shard.stop)
                if lo < hi:
                    local = slice(lo - shard.start, hi - shard.start)
                    master = self.master_shards[index][local] if self.master_shards else None
                    segments.append(ShardSegment(param, lo - offset, hi - offset, self.param_shards[index][local],
                                                 self.grad_shards[index][local], self._shape(param), self.axes,
                                                 master))
        return segments

    def optimizer_parameters(self) -> list:
        """What the optimizer updates: this rank's shard segments."""
        return self._segments

    def zero_grad(self) -> None:
        super().zero_grad()
        for shard in self.grad_shards:
            shard[...] = 0

    def finish_gradients(self) -> None:
        """Every reduce-scatter finished (`DataParallel`'s); with hybrid sharding each reduced shard is then
        summed with its replicas in the other shard groups — one all-reduce of Ψ/N per rank, the only bytes that
        leave the group."""
        super().finish_gradients()
        if self.replicas is not None:
            handles = [collectives.all_reduce_async(shard, self.replicas, "sum", self.algo, out=shard)
                       for shard in self.grad_shards]
            for handle in handles:
                handle.wait()

    def after_update(self) -> None:
        """All-gather the updated parameter shards into the full parameters."""
        handles = [collectives.all_gather_async(shard, self.comm, self.algo, out=flat)
                   for shard, flat in zip(self.param_shards, self.flat_params, strict=True)]
        for handle in handles:
            handle.wait()

    def _start_reduction(self, index: int) -> None:
        self._in_flight[index] = collectives.reduce_scatter_async(self.flat_grads[index], self.comm, "sum",
                                                                  self.algo)

    def _complete_reduction(self, index: int) -> None:
        """Reduced once per step, from the last microbatch's full buffer."""
        self.grad_shards[index][...] = self._in_flight.pop(index).wait()

    def full_parameters(self) -> dict[str, Array]:
        """As DP's, with the master weights gathered from their shards under mixed precision."""
        if not self.master_shards:
            return super().full_parameters()
        return self._gathered(self.master_shards)

    def _gathered(self, shards: list[Array]) -> dict[str, Array]:
        values = {}
        for bucket, shard in zip(self.buckets, shards, strict=True):
            values |= self._unflatten(bucket, collectives.all_gather(shard, self.comm, algo="mpi"))
        return values

    def _reduced_gradients(self, index: int) -> Array:
        return collectives.all_gather(self.grad_shards[index], self.comm, algo="mpi")

    def _parameter_bytes(self) -> int:
        return sum(f.nbytes for f in self.flat_params)


class ZeRO2(ZeRO1):
    """ZeRO stage 2: the gradients are sharded too. Every microbatch's gradients are reduce-scattered as soon as a
    bucket is final and accumulated into this rank's slice; a bucket's full gradient buffer exists only while
    backward fills it and its reduction reads it."""

    zero = 2

    def _lay_out_gradients(self) -> None:
        """Per-rank accumulators of the reduced shard; full buffers are made when backward needs them."""
        self.grad_shards = [self.xp.zeros(bucket.padded // self.comm.size, self.grad_dtype)
                            for bucket in self.buckets]

    def _free_gradients(self, index: int) -> None:
        self.flat_grads[index] = None
        for param in self.buckets[index].params:
            param.grad = None

    @contextmanager
    def unhooked(self, backward: bool = True):
        """With `backward`, every bucket gets a full gradient buffer for all microbatches to accumulate into,
        reduce-scattered once by `finish_gradients`: one reduce-scatter of G per step instead of one per
        microbatch, and full gradients held while the step runs."""
        if backward:
            for index, flat in enumerate(self.flat_grads):
                if flat is None:
                    self._allocate_gradients(index)
        with super().unhooked(backward):
            yield

    def _reduces_now(self) -> bool:
        return True  # every microbatch's gradients are reduced and accumulated

    def before_backward(self, unit: int) -> None:
        for index, bucket in enumerate(self.buckets):
            if unit in bucket.used_by:
                if index in self._in_flight:  # the previous microbatch's reduction still reads the buffer
                    self._complete_reduction(index)
                if self.flat_grads[index] is None:
                    self._allocate_gradients(index)
        super().before_backward(unit)

    def _complete_reduction(self, index: int) -> None:
        """Reduced every microbatch, accumulated here; the full buffer is freed."""
        self.grad_shards[index] += self._in_flight.pop(index).wait()
        self._free_gradients(index)

    def _progress(self) -> None:
        """Advance every reduction in flight and finish those done, freeing their buffers."""
        for index, handle in list(self._in_flight.items()):
            if handle.test():
                self._complete_reduction(index)


class ZeRO3(ZeRO2):
    """ZeRO stage 3: the parameters are sharded too. A rank keeps only its slice of each bucket; each unit's
    buckets are all-gathered before its forward and again before its backward (prefetching the next unit's while
    this one computes) and freed after, so a rank holds whole parameters of at most two units at a time."""

    zero = 3

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._gathering: dict[int, Any] = {}  # bucket index -> handle of its parameter all-gather
        super().__init__(*args, **kwargs)

    def _lay_out_parameters(self) -> None:
        """Only this rank's slice of each bucket is kept; the parameters point at nothing until gathered."""
        self._released = self.xp.empty(0, self.dtype)  # what a parameter points at between uses
        for bucket in self.buckets:
            flat = self._flat_parameters(bucket)
            self.param_shards.append(flat[self._shard(bucket)].copy())
            self.flat_params.append(None)
            self._release_parameters(bucket)

    def _release_parameters(self, bucket: Bucket) -> None:
        """Drop the gathered parameters (the flat buffer goes when its last view does)."""
        for param in bucket.params:
            param.data = self._released

    @contextmanager
    def unhooked(self, backward: bool = True):
        """Every parameter is gathered on entry (one all-gather of P per step instead of two per microbatch) and
        freed on exit."""
        handles = {index: collectives.all_gather_async(shard, self.comm, self.algo)
                   for index, shard in enumerate(self.param_shards) if self.flat_params[index] is None}
        for index, handle in handles.items():
            self.flat_params[index] = handle.wait()
            self._point_parameters_at(self.buckets[index], self.flat_params[index])
        with super().unhooked(backward):
            yield

    def before_forward(self, unit: int) -> None:
        self._gather_for(unit, backward=False)

    def after_forward(self, unit: int) -> None:
        self._release_after(unit, backward=False)

    def before_backward(self, unit: int) -> None:
        self._gather_for(unit, backward=True)
        super().before_backward(unit)

    def after_backward(self, unit: int) -> None:
        self._release_after(unit, backward=True)
        super().after_backward(unit)

    def after_update(self) -> None:
        """Nothing: the updated shards are gathered when the next forward needs them."""

    def _progress(self) -> None:
        super()._progress()
        for handle in self._gathering.values():
            handle.test()

    # -- gathering parameters unit by unit -------------------------------------------------------------------

    def _visits(self) -> list[tuple[int, bool]]:
        """The order units run in one microbatch: forward 0…U−1, then backward U−1…0."""
        count = len(self.units)
        return [(u, False) for u in range(count)] + [(u, True) for u in reversed(range(count))]

    def gathers_per_microbatch(self, index: int) -> int:
        """How often bucket `index` is all-gathered in one microbatch — once per run of consecutive units that
        read it, since it is freed when the next unit does not."""
        needed = [index in self._needed(unit) for unit, _ in self._visits()]
        return sum(now and (position == 0 or not needed[position - 1]) for position, now in enumerate(needed))

    def _needed(self, unit: int) -> list[int]:
        return [index for index, bucket in enumerate(self.buckets) if unit in bucket.used_by]

    def _start_gather(self, index: int) -> None:
        if index not in self._gathering and self.flat_params[index] is None:
            self._gathering[index] = collectives.all_gather_async(self.param_shards[index], self.comm, self.algo)

    def _gather_for(self, unit: int, backward: bool) -> None:
        for index in self._needed(unit):
            self._start_gather(index)
        visits = self._visits()
        position = visits.index((unit, backward))
        if position + 1 < len(visits):  # prefetch what the next unit needs while this one computes
            for index in self._needed(visits[position + 1][0]):
                self._start_gather(index)
        for index in self._needed(unit):
            if index in self._gathering:
                flat = self._gathering.pop(index).wait()
                self.flat_params[index] = flat
                self._point_parameters_at(self.buckets[index], flat)

    def _release_after(self, unit: int, backward: bool) -> None:
        visits = self._visits()
        position = visits.index((unit, backward))
        upcoming = set(self._needed(visits[position + 1][0])) if position + 1 < len(visits) else set()
        for index in self._needed(unit):
            if index not in upcoming and self.flat_params[index] is not None:
                self.flat_params[index] = None
                self._release_parameters(self.buckets[index])

    def release_all(self) -> None:
        """Free every gathered parameter (after a forward-only pass such as validation)."""
        for index, bucket in enumerate(self.buckets):
            if self.flat_params[index] is not None:
                self.flat_params[index] = None
                self._release_parameters(bucket)

    def full_parameters(self) -> dict[str, Array]:
        """Gathered from the shards: the master weights' under mixed precision, else the parameters'."""
        return self._gathered(self.master_shards or self.param_shards)

    def _parameter_bytes(self) -> int:
        return sum(s.nbytes for s in self.param_shards)


STAGES: dict[int, type[DataParallel]] = {0: DataParallel, 1: ZeRO1, 2: ZeRO2, 3: ZeRO3}


def data_parallel(model: Any, comm: Communicator, zero: int = 0, **options: Any) -> DataParallel:
    """The engine of ZeRO stage `zero` (0: plain data parallelism) over `comm`; `options` as `DataParallel`'s."""
    if zero not in ZERO_STAGES:
        raise ConfigError(f"--zero must be one of {ZERO_STAGES}, got {zero}")
    replicas = options.get("replicas")
    if zero == 0 and replicas is not None and replicas.size > 1:
        raise ConfigError("--dp-shard shards ZeRO's states over groups of ranks: give --zero 1, 2 or 3 (plain data "
                          "parallelism shards nothing)")
    return STAGES[zero](model, comm, **options)


class DataParallelGroups(ParameterHooks):
    """Several `DataParallel` engines over one model, each reducing its own parameters over its own ranks — the
    dense parameters over dp (×cp) and, with expert parallelism, each expert over the ranks holding a copy of it
    (expert_dp). The model takes one hooks object: this one calls every engine's; the rest is each engine's in
    turn."""

    def __init__(self, engines: list[DataParallel]) -> None:
        self.engines = engines

    def before_forward(self, unit: int) -> None:
        for engine in self.engines:
            engine.before_forward(unit)

    def after_forward(self, unit: int) -> None:
        for engine in self.engines:
            engine.after_forward(unit)

    def before_backward(self, unit: int) -> None:
        for engine in self.engines:
            engine.before_backward(unit)

    def after_backward(self, unit: int) -> None:
        for engine in self.engines:
            engine.after_backward(unit)

    @contextmanager
    def microbatch(self, last: bool):
        with ExitStack() as stack:
            for engine in self.engines:
                stack.enter_context(engine.microbatch(last))
            yield

    @contextmanager
    def unhooked(self, backward: bool = True):
        with ExitStack() as stack:
            for engine in self.engines:
                stack.enter_context(engine.unhooked(backward))
            yield

    def zero_grad(self) -> None:
        for engine in self.engines:
            engine.zero_grad()

    def finish_gradients(self) -> None:
        for engine in self.engines:
            engine.finish_gradients()

    def after_update(self) -> None:
        for engine in self.engines:
            engine.after_update()

    def release_all(self) -> None:
        for engine in self.engines:
            engine.release_all()

    def optimizer_parameters(self) -> list:
        return [piece for engine in self.engines for piece in engine.optimizer_parameters()]

    def parameter_count(self) -> int:
        return sum(engine.parameter_count() for engine in self.engines)

    def full_parameters(self) -> dict[str, Array]:
        return {name: value for engine in self.engines for name, value in engine.full_parameters().items()}

    def memory(self, optimizer: Any) -> dict[str, int]:
        """Parameters and gradients of every engine; the optimizer's state (one optimizer over all) once."""
        held = [engine.memory(optimizer) for engine in self.engines]
        return {"parameters": sum(h["parameters"] for h in held), "gradients": sum(h["gradients"] for h in held),
                "optimizer_state": held[0]["optimizer_state"]}


def data_parallel_engines(model: Any, mesh: Mesh, zero: int = 0, bucket_mb: float = 25.0,
                          overlap: bool = True) -> DataParallelGroups:
    """The dp axis of a training mesh: gradients summed over dp, and over cp too (those ranks saw other tokens of
    the same sequences). With expert parallelism dp splits into (expert_dp, ep): each EP rank holds other experts
    (placement `Held` on "dp"), so the experts are summed only over the ranks holding the same ones (expert_dp,
    ×cp), in their own engine. With hybrid sharding both engines shard inside this rank's shard group (the
    experts over its ranks holding the same experts, expert_dp_shard) and sum their shards over dp_replicate."""
    options = {"zero": zero, "bucket_mb": bucket_mb, "overlap": overlap}
    cp = ("cp",) if mesh.shape.cp > 1 else ()
    comm, axes = mesh.shard_group(), ("dp", *cp)
    if mesh.shape.hybrid:  # ZeRO inside each shard group, its shards summed over the groups (dp_replicate)
        axes = ("dp_shard", *cp)
        options["replicas"] = mesh.dp_replicate
    if mesh.shape.ep == 1:
        return DataParallelGroups([data_parallel(model, comm, axes=axes, **options)])
    for name, param in model.params.items():
        if expert_index(name) is not None:
            param.placement[DP_AXIS] = HELD
    expert_comm = mesh.expert_shard_group()
    expert_axes = ("expert_dp_shard" if mesh.shape.hybrid else "expert_dp", *cp)
    return DataParallelGroups([
        data_parallel(model, comm, axes=axes, select=lambda param: expert_index(param.name) is None, **options),
        data_parallel(model, expert_comm, axes=expert_axes, select=lambda param: expert_index(param.name) is not None,
                      **options)])
