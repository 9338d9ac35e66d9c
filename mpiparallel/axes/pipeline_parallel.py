"""Pipeline parallelism: the model cut into stages on different ranks, microbatches flowing through them in the
order a schedule prescribes (`mpiparallel.schedules`: GPipe, 1F1B, interleaved, ZB-H1, ZB-V, DualPipeV).

The model is a row of units — embedding, n_layer blocks, head — and `stage_units` cuts it into pp·V stages
(chunks): the blocks as evenly as possible, earlier stages taking the extra one, the embedding with the first
stage and the final LayerNorm + head + loss with the last. Each rank builds only the units of its stages
(`PipelineStages`, the axis the model is split over), and `PipelineExecutor` runs its list of actions:

    F(s, m)   forward of stage s on microbatch m (`Transformer.forward(x, units=…)`), its saved state kept for backward
    I(s, m)   input-gradient pass: d(stage input), which the previous stage waits for
    W(s, m)   weight-gradient pass, as late as the schedule likes; frees m's saved state of stage s
    B(s, m)   I and W at once
    SEND_F / RECV_F, SEND_B / RECV_B   the activations and their gradients between neighbouring stages

Communication, per microbatch and stage boundary (between ranks): forward one activation of b·s·h elements
(b rows per microbatch; with --sp its sequence slice, b·s·h/tp), backward its gradient, the same size — the
wrappers below name both directions. Sends and receives are nonblocking: a receive is posted when the schedule lists
it and completed only when the compute action that reads it starts; a send completes in the background (all are
finished at the end of the step). With `--check-collectives` (the communicator's check_arguments) each step first
checks that every stage's sends and receives pair up — peer, tag, shape, dtype — across the pipeline
(`collectives.check_messages`: one small all-gather), and each send that its data has the shape its receiver
expects: a mismatched schedule is one clear error on every rank, not a hang. On a GPU with an MPI that cannot read
device memory, sends are staged through host memory and receives land in host buffers, copied to the GPU when the
action needs them. Once per step the tied token embedding, which the first stage reads for the embedding and the
last for the LM head, gets the sum of both stages' gradients: one exchange of V·h elements (÷ tp) between those two
ranks (none when one rank holds both, as in the V schedules).

Cost: with per-stage times F, I, W the pipeline idles the schedule's bubble (GPipe and 1F1B: (p−1)(F+I+W) per
rank, a fraction (p−1)/(m+p−1)); every boundary moves 2·m·b·s·h elements per step; peak activation memory is the
schedule's microbatches in flight per stage times the stage's saved bytes (`models.layers.block_activation_elements`).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from collectives import CollectiveMismatchError, Communicator, Message, check_messages
from collectives.backend import Array, HostStaging, get_array_module
from collectives.communicator import FIRST_COLLECTIVE_TAG, Posted
from models.axis import PipelineAxis
from models.documents import ONE_DOCUMENT
from models.layers import distinct_bytes
from models.parameter import HELD, PARTIAL, Placement
from models.transformer import NO_HOOKS, Transformer

from ..errors import ConfigError
from ..schedules import (
    BACKWARD_INPUT,
    BACKWARD_WEIGHT,
    FORWARD,
    FULL_BACKWARD,
    RECV_B,
    RECV_F,
    SEND_B,
    SEND_F,
    Action,
    Schedule,
    stage_units,
)

PP_AXIS = "pp"
TIED_WEIGHT = "transformer.wte.weight"


def local_units(schedule: Schedule, rank: int, n_layer: int) -> list[int]:
    """Every unit this pipeline rank holds (`PipelineStages.held_units`)."""
    stages = stage_units(n_layer, schedule.num_stages)
    return sorted(unit for stage in schedule.stages_of(rank) for unit in stages[stage])


# -- the communication: forward above, backward right under it -------------------------------------------------

TIED_GRADIENT_TAG = FIRST_COLLECTIVE_TAG - 1
"""Point-to-point tags stay below the collectives' (MPI guarantees tags up to 32767 only)."""


def _tag(stage: int, microbatch: int, gradient: bool, microbatches: int) -> int:
    """One tag per message of a step: the receiving stage, the microbatch and the direction."""
    return 2 * (stage * microbatches + microbatch) + int(gradient)


def check_tag_space(stages: int, microbatches: int) -> None:
    """Every message of a step needs its own tag below `TIED_GRADIENT_TAG`."""
    if 2 * stages * microbatches > TIED_GRADIENT_TAG:
        raise ConfigError(f"{stages} stages × {microbatches} microbatches need more message tags than MPI "
                          f"guarantees ({TIED_GRADIENT_TAG}); use fewer microbatches per step")


def send_forward(activation: Array, comm: Communicator, dest: int, tag: int) -> Posted:
    """Forward: stage s hands its output to stage s+1 on another rank (b·s·h elements). Its backward twin is
    `recv_backward`: the gradient of that output comes back from the same rank."""
    return comm.post_send(activation, dest, tag)


def recv_backward(out: Array, comm: Communicator, source: int, tag: int) -> Posted:
    """Backward of `send_forward`: post the receive of d(stage output) from the next stage's rank."""
    return comm.post_recv(out, source, tag)


def recv_forward(out: Array, comm: Communicator, source: int, tag: int) -> Posted:
    """Forward: post the receive of this stage's input from the previous stage's rank. Its backward twin is
    `send_backward`."""
    return comm.post_recv(out, source, tag)


def send_backward(dinput: Array, comm: Communicator, dest: int, tag: int) -> Posted:
    """Backward of `recv_forward`: send d(stage input) back to the previous stage's rank."""
    return comm.post_send(dinput, dest, tag)


class PipelineStages(PipelineAxis):
    """The pp axis as the model asks for it (`models.axis`): applied with
    `Transformer(config, …).parallelize(PipelineStages(schedule, rank))`, the model holds only the units of this
    rank's stages (`local_units`). Each stage's parameters are held by its rank alone (placement `Held` on "pp");
    a tied token embedding, read by the first stage and the last, holds a partial gradient on both (summed by
    `sum_tied_gradient`) unless one rank holds both (an untied llama head is the last stage's own)."""

    def __init__(self, schedule: Schedule, rank: int) -> None:
        self.schedule, self.rank, self.size = schedule, rank, schedule.pp
        self.shares_embedding = False

    def fit(self, config: Any) -> None:
        self.units = local_units(self.schedule, self.rank, config.n_layer)
        ends_apart = self.schedule.stage_ranks[0] != self.schedule.stage_ranks[-1]
        self.shares_embedding = ends_apart and config.head_reads_embedding

    def held_units(self, unit_count: int) -> tuple[int, ...]:
        return tuple(self.units)

    def placement(self, name: str) -> dict[str, Placement]:
        return {PP_AXIS: PARTIAL if self.shares_embedding and name == TIED_WEIGHT else HELD}


def sum_tied_gradient(model: Transformer, comm: Communicator, first: int, last: int) -> None:
    """The tied token embedding: the first stage's rank (embedding) and the last stage's (LM head) each hold a
    partial gradient; exchange them and add, so both hold the sum (a + b = b + a: bitwise equal on both). An
    untied head (llama's default) shares nothing: no exchange — unless DeepSeek-V3's multi-token prediction reads
    wte on the last stage too."""
    if first == last or comm.rank not in (first, last) or not model.config.head_reads_embedding:
        return
    grad = model.params[TIED_WEIGHT].grad
    other = last if comm.rank == first else first
    xp = get_array_module(grad)
    received = comm.sendrecv(xp.ascontiguousarray(grad), other, xp.empty_like(grad), other, tag=TIED_GRADIENT_TAG)
    grad += received


# -- running one rank's actions ---------------------------------------------------------------------------------

@dataclass
class Timeline:
    """When each action of the last step started and ended, in seconds from the step's start (`started`, a
    `time.perf_counter()` reading)."""

    spans: list[tuple[Action, float, float]] = field(default_factory=list)
    started: float = 0.0

    def compute_time(self) -> float:
        """Seconds spent in F, I, W and B (a receive's wait counts as idle: it is in the next compute's start)."""
        return sum(end - start for action, start, end in self.spans if action.is_compute)

    def makespan(self) -> float:
        return max((end for _, _, end in self.spans), default=0.0)


class PipelineExecutor:
    """Runs this rank's actions of `schedule` over its stages of `model`, one optimizer step per `step` call.

    It holds, per (stage, microbatch): the saved state from F until W (or B) has run, outputs and input gradients
    until they are sent or handed to the neighbouring stage on this rank, and the receives in flight.
    """

    def __init__(self, model: Transformer, schedule: Schedule, comm: Communicator, activation_shape: Sequence[int],
                 dtype: Any) -> None:
        check_tag_space(schedule.num_stages, schedule.microbatches)
        self.model, self.schedule, self.comm, self.dtype = model, schedule, comm, np.dtype(dtype)
        self.xp = get_array_module(next(iter(model.params.values())).data)
        # an MPI library that cannot receive into GPU memory gets host buffers, moved to the GPU once complete
        self.receives_on_host = HostStaging.needed(self.xp.empty(0, self.dtype))
        self.stages = stage_units(model.config.n_layer, schedule.num_stages)
        self.actions = schedule.actions[comm.rank]
        self.activation_shape = tuple(activation_shape)
        self.last_stage = schedule.num_stages - 1
        self.timeline = Timeline()
        self.peak_saved_bytes = 0  # the most activation bytes held at once in the last step
        self.block_saved_bytes = 0  # what one transformer block saved for one microbatch
        self.block_saved_documents: Any = ONE_DOCUMENT  # the documents of that microbatch

    def holds_loss(self) -> bool:
        return self.schedule.stage_ranks[self.last_stage] == self.comm.rank

    def holds_embedding(self) -> bool:
        return self.schedule.stage_ranks[0] == self.comm.rank

    def step(self, microbatches: Sequence[tuple[np.ndarray, np.ndarray, Any]], normalizer: float,
             on_forward: Any = None, on_action: Any = None) -> float:
        """Run the schedule on these microbatches (the same split on every pipeline rank); return the sum of their
        cross-entropies on the rank of the last stage (0 elsewhere). Gradients accumulate in the parameters;
        `on_forward(saved)` sees every forward's saved state (MoE router statistics), `on_action(action)` each
        action before it starts (the progress reports)."""
        self._batches, self._normalizer, self._loss = microbatches, normalizer, 0.0
        self._on_forward = on_forward or (lambda saved: None)
        self._saved: dict[tuple[int, int], Any] = {}
        self._handed: dict[tuple[str, int, int], Array] = {}  # outputs and input gradients not yet consumed
        self._receiving: dict[tuple[str, int, int], tuple[Posted, Array]] = {}
        self._sending: list[tuple[Posted, Array]] = []
        self._check_messages(self.actions)
        start = time.perf_counter()
        self.timeline, self.peak_saved_bytes = Timeline(started=start), 0
        for action in self.actions:
            if on_action is not None:
                on_action(action)
            self._complete_receive_for(action)  # waiting on a neighbour is idle time, not the action's
            began = time.perf_counter() - start
            self._run(action)
            self.timeline.spans.append((action, began, time.perf_counter() - start))
        Posted.wait_all([posted for posted, _ in self._sending])
        leftovers = [key for key in self._saved] + list(self._handed) + list(self._receiving)
        if leftovers:
            raise RuntimeError(f"schedule {self.schedule.name} left work undone on rank {self.comm.rank}: {leftovers}")
        return self._loss

    def _run(self, action: Action) -> None:
        {FORWARD: self._forward, BACKWARD_INPUT: self._backward_input, FULL_BACKWARD: self._backward_input,
         BACKWARD_WEIGHT: self._backward_weights, SEND_F: self._send, SEND_B: self._send,
         RECV_F: self._receive, RECV_B: self._receive}[action.kind](action)

    def _rank_of(self, stage: int) -> int:
        return self.schedule.stage_ranks[stage]

    def _complete_receive_for(self, action: Action) -> None:
        """Before a compute action: wait for the receive of what it reads, if that comes from another rank."""
        key = {FORWARD: ("input",), BACKWARD_INPUT: ("doutput",), FULL_BACKWARD: ("doutput",)}.get(action.kind)
        if key is not None and (key[0], action.stage, action.microbatch) in self._receiving:
            posted, buffer = self._receiving.pop((key[0], action.stage, action.microbatch))
            posted.wait()
            self._handed[key[0], action.stage, action.microbatch] = self.xp.asarray(buffer)

    def _take(self, kind: str, stage: int, microbatch: int) -> Array:
        """An input this action needs: received from another rank, or handed over by a stage on this rank."""
        return self._handed.pop((kind, stage, microbatch))

    def _forward(self, action: Action) -> None:
        stage, microbatch = action.stage, action.microbatch
        tokens, targets, documents = self._batches[microbatch]
        x = tokens if stage == 0 else self._take("input", stage, microbatch)
        out, saved = self.model.forward(x, targets if stage == self.last_stage else None, self._normalizer,
                                        NO_HOOKS, units=self.stages[stage], documents=documents)
        self._saved[stage, microbatch] = saved
        self._measure(saved, documents)
        self._on_forward(saved)
        if stage == self.last_stage:
            self._loss += out - saved.aux_loss  # the cross-entropy: MoE aux losses are reported apart
        else:
            self._handed["input", stage + 1, microbatch] = out  # sent by SEND_F, or read by the next F here

    def _measure(self, saved: Any, documents: Any) -> None:
        self.peak_saved_bytes = max(self.peak_saved_bytes, distinct_bytes(list(self._saved.values())))
        blocks = [unit for unit in saved.units if 1 <= unit <= self.model.config.n_layer]
        if blocks:
            self.block_saved_bytes = saved.per_unit[blocks[0]].nbytes()
            self.block_saved_documents = documents

    def _backward_input(self, action: Action) -> None:
        stage, microbatch = action.stage, action.microbatch
        dout = None if stage == self.last_stage else self._take("doutput", stage, microbatch)
        if action.kind == FULL_BACKWARD:
            dinput = self.model.backward(self._saved.pop((stage, microbatch)), dout)
        else:
            dinput = self.model.backward_input(self._saved[stage, microbatch], dout)
        if stage > 0:
            self._handed["doutput", stage - 1, microbatch] = dinput

    def _backward_weights(self, action: Action) -> None:
        self.model.backward_weights(self._saved.pop((action.stage, action.microbatch)))

    def _peer_and_tag(self, action: Action) -> tuple[int, int]:
        """The rank a SEND or RECV action exchanges with and its message's tag (named by the receiving stage)."""
        stage, microbatch, count = action.stage, action.microbatch, len(self._batches)
        if action.kind == SEND_F:
            return self._rank_of(stage + 1), _tag(stage + 1, microbatch, False, count)
        if action.kind == SEND_B:
            return self._rank_of(stage - 1), _tag(stage - 1, microbatch, True, count)
        if action.kind == RECV_F:
            return self._rank_of(stage - 1), _tag(stage, microbatch, False, count)
        return self._rank_of(stage + 1), _tag(stage, microbatch, True, count)

    def _check_messages(self, actions: Sequence[Action]) -> None:
        """With check_arguments: every rank's sends and receives of this step pair up (see the module docstring)."""
        if not self.comm.check_arguments:
            return
        messages = [Message("send" if action.kind in (SEND_F, SEND_B) else "recv", *self._peer_and_tag(action),
                            self.activation_shape, self.dtype.name)
                    for action in actions if action.kind in (SEND_F, SEND_B, RECV_F, RECV_B)]
        check_messages(self.comm, messages, "the pipeline's messages")

    def _send(self, action: Action) -> None:
        stage, microbatch = action.stage, action.microbatch
        peer, tag = self._peer_and_tag(action)
        if action.kind == SEND_F:
            data = self._handed.pop(("input", stage + 1, microbatch))
            self._check_outgoing(data, peer, tag)
            request = send_forward(data, self.comm, peer, tag)
        else:
            data = self._handed.pop(("doutput", stage - 1, microbatch))
            self._check_outgoing(data, peer, tag)
            request = send_backward(data, self.comm, peer, tag)
        self._sending.append((request, data))

    def _check_outgoing(self, data: Array, peer: int, tag: int) -> None:
        """With check_arguments: the data has the shape and dtype its receiver's buffer has."""
        if self.comm.check_arguments and (tuple(data.shape), data.dtype) != (self.activation_shape, self.dtype):
            sending, expected = (Message("send", peer, tag, tuple(data.shape), data.dtype.name),
                                 Message("recv", self.comm.rank, tag, self.activation_shape, self.dtype.name))
            raise CollectiveMismatchError(
                f"pipeline rank {self.comm.rank} would send rank {peer} tag {tag} as {sending.describe()}; its "
                f"receiver expects {expected.describe()} (check_arguments, MPIPARALLEL_CHECK=1)")

    def _receive(self, action: Action) -> None:
        stage, microbatch = action.stage, action.microbatch
        buffer = (np if self.receives_on_host else self.xp).empty(self.activation_shape, self.dtype)
        peer, tag = self._peer_and_tag(action)
        if action.kind == RECV_F:
            request = recv_forward(buffer, self.comm, peer, tag)
            self._receiving["input", stage, microbatch] = (request, buffer)
        else:
            request = recv_backward(buffer, self.comm, peer, tag)
            self._receiving["doutput", stage, microbatch] = (request, buffer)

    def forward_only(self, microbatches: Sequence[tuple[np.ndarray, np.ndarray, Any]], normalizer: float,
                     on_forward: Any = None) -> float:
        """Validation (and the global aux loss's counting pass): every microbatch through this rank's stages in
        model order, nothing kept for backward, `on_forward(saved)` seeing each forward's saved state; returns
        the summed loss on the last stage's rank (0 elsewhere)."""
        local = self.schedule.stages_of(self.comm.rank)
        forward_actions = []
        for microbatch in range(len(microbatches)):
            for stage in local:
                if stage > 0 and self._rank_of(stage - 1) != self.comm.rank:
                    forward_actions.append(Action(stage, RECV_F, microbatch))
                forward_actions.append(Action(stage, FORWARD, microbatch))
                if stage < self.last_stage and self._rank_of(stage + 1) != self.comm.rank:
                    forward_actions.append(Action(stage, SEND_F, microbatch))
        self._batches, self._normalizer, self._loss = microbatches, normalizer, 0.0
        self._on_forward = on_forward or (lambda saved: None)
        self._saved, self._handed, self._receiving, self._sending = {}, {}, {}, []
        self._check_messages(forward_actions)
        for action in forward_actions:
            self._complete_receive_for(action)
            self._run(action)
            self._saved.clear()
        Posted.wait_all([posted for posted, _ in self._sending])
        self._sending.clear()
        return self._loss
