"""Bytes each rank sends in one optimizer step, axis by axis: the formulas of the parallel modules' docstrings
evaluated for one run, to print beside what the communicators' ledgers counted.

Every collective's volume is the β term of its cost formula in `collectives.cost_model` (bytes sent per rank by
the algorithm `algo="auto"` picks for that size), so ring all-reduce gives 2(n−1)/n·S and recursive doubling
log2(n)·S. With S = b·s·h·e the bytes of one activation on this rank (b rows of a microbatch, s its positions
here, h channels, e bytes per element), m microbatches, L the blocks this rank holds and G the bytes of the
gradient buckets an engine reduces:

    dp    DP all-reduce once per step: AR(G); ZeRO-1: RS(G) + AG(G); ZeRO-2: m·RS(G) + AG(G);
          ZeRO-3: m·(RS(G) + each bucket's all-gathers per microbatch); under a pipeline schedule ZeRO-2 and
          ZeRO-3 reduce once per step and gather once: RS(G) + AG(G)           (`mpiparallel.axes.data_parallel`);
          with hybrid sharding the same on the shard group (dp_shard), and on dp_replicate AR(G/N), each
          rank's shard summed with its replicas
    tp    per microbatch: 4 AR(S) per block (2 forward, 2 backward; SP: AG + RS in their place; with MoE only
          attention's 2, the experts being replicated over TP), one more forward's worth with --recompute full;
          AR(S) for the embedding and for the head's input; the vocab-parallel cross-entropy's AR of b·s and
          2·b·s values; SP: once per step an AR of the gradients that are partial sums over tp (the LayerNorms'
          (4L + 2)·h; with MoE also the router and experts; MTP's norms and eh_proj); on the head's rank each MTP
          module (DeepSeek-V3) over all s positions: an embedding, a block and a head exchange, the
          cross-entropy's (`models.multi_token`)
    pp    per microbatch and stage boundary to another rank: S forward, S backward; the tied embedding's
          gradient once per step between the first and last stage's ranks (`mpiparallel.axes.pipeline_parallel`)
    cp    per block and microbatch (MLA: all-gather of its compressed [latent | RoPE key], (c−1)/c·bs·(r + d_r)
          forward, and the reduce-scatter of its gradient, the same backward; Ulysses adds the all-to-alls of q
          and the output, (c−1)/c²·bs·H·(d_n + d_r + d_v) each way; ring sends the same blocks forward and
          backward, plus c hops of their float32-or-wider gradients, bs·(r + d_r)), K and V of the whole sequence:
          ring 2(c−1)/c·bs·h_kv forward and
          2(2c−1)/c·bs·h_kv backward, all-gather 2(c−1)/c and 4(c−1)/c, with h_kv = n_kv·d channels of this TP
          rank (= h/tp for multi-head attention: GQA moves n_kv/n_head of it); Ulysses 2(c−1)/c²·bs·(h + h_kv')
          each way, h_kv' = max(n_kv, c)·d (4(c−1)/c²·bsh for multi-head attention) (`axes.context_parallel`);
          on the head's rank the MTP modules' blocks too, and per microbatch the all-gather of the targets,
          (c−1)/c·b·s int64 ids (`models.multi_token`); DeepSeek-V3's sequence-wise loss: per MoE block and
          forward, AR of the b × E expert counts per sequence (float64; under SP over tp too) (`models.deepseek_moe`)
    tp    (llama, tp > n_kv) per block and microbatch besides: the K/V weight gradients summed over the tp/n_kv
          ranks holding each KV head, 2·AR(h·d)

    ep    what the router sends decides it, so the MoE layers count per EP peer p, as they plan, the rows they
          send (r→p) and receive (r←p) (`axes.expert_parallel.ExpertTraffic`); with B = h·e bytes a row, B' the
          forward dispatch's row (FP8: h + 4⌈h/128⌉), S experts per rank, each forward and backward exchange gives
            flat          forward  r→p·B' + r←p·B + 8·S + 2·8      backward (r→p + r←p)·B + 2·8
                          (rows there and back, the expert counts, each all-to-allv's own count)
            hierarchical  forward  r→p·B' + r←p·B + v→p·g + 8·c→p + (16 | 8·S)      backward (r→p + r←p)·B + v←p·g
                          (the two-hop dispatch of `collectives.two_hop`: p is a lane peer on another node, to
                          which r→p is one row per token for p's node, or a rank of this node, to which r→p is one
                          row per assignment; v the gates (g bytes) and their gradients, c the plan's codes,
                          16 B of counts to a lane peer, 8·S to a node peer)
          summed over the peers; across nodes, over the peers on other nodes only.

Across nodes. The same formulas, with each collective's bytes replaced by the bytes of it that leave the node
(`collectives.topology.inter_node_bytes`: the ring's 2(n−1)/n·S if the rank's ring neighbour is on another
node, the hierarchical all-reduce's 2(N−1)/N·S/k, …), give each axis's inter-node bytes: `AcrossNodesMesh` hands
the formulas communicators seen that way. An axis whose ranks share a node (tp inside a node) sends 0 across.
Pipeline boundaries count when the neighbouring stage's rank is on another node; cp's ring of K/V has no
inter-node formula here (unless the cp group is on one node: 0).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from collectives import Communicator
from collectives.cost_model import CostModel, auto_algorithm, predict
from collectives.topology import inter_node_bytes

BYTES_ONLY = CostModel(alpha=0.0, beta=1.0, gamma=0.0)  # a formula's β term: the bytes it sends


def collective_bytes(collective: str, nbytes: float, comm: Communicator) -> float:
    """Bytes one rank sends in `collective` of `nbytes` (all_gather: the gathered size) over `comm`."""
    if comm.size == 1 or nbytes == 0:
        return 0.0
    if isinstance(comm, AcrossNodes):
        return comm.collective_bytes(collective, nbytes)
    return predict(BYTES_ONLY, collective, auto_algorithm(comm, collective, int(nbytes)), nbytes, comm.size,
                   comm.topology.count)


class AcrossNodes:
    """A communicator seen through its node boundary: `collective_bytes` on it gives the bytes that leave the
    node (NaN where no inter-node formula is written for the algorithm "auto" runs)."""

    def __init__(self, comm: Communicator) -> None:
        self.comm, self.size, self.rank, self.remote = comm, comm.size, comm.rank, comm.remote

    def collective_bytes(self, collective: str, nbytes: float) -> float:
        if not self.comm.topology.spans_nodes:
            return 0.0
        algo = auto_algorithm(self.comm, collective, int(nbytes))
        found = inter_node_bytes(collective, algo, nbytes, self.comm.nodes, self.comm.rank)
        return float("nan") if found is None else found


class AcrossNodesMesh:
    """A mesh whose axis communicators are seen `AcrossNodes` (for the per-axis inter-node formulas)."""

    def __init__(self, mesh: Any) -> None:
        self.mesh, self.shape = mesh, mesh.shape
        self._axes = {axis: AcrossNodes(comm) for axis, comm in mesh.communicators().items()}
        for axis, view in self._axes.items():
            setattr(self, axis, view)

    def communicators(self) -> dict[str, AcrossNodes]:
        return self._axes


@dataclass
class AxisTraffic:
    """What one rank sends on one axis in one step: the formula's prediction and the ledger's count."""

    axis: str
    predicted: float | None  # None: no formula (data-dependent)
    counted: int


@dataclass
class RunShape:
    """The sizes the formulas need, for this rank."""

    rows: int               # b: sequences per microbatch on this rank
    positions: int          # s: sequence positions held by this rank (÷ cp)
    channels: int           # h
    itemsize: int           # e: the compute dtype's bytes (activations)
    microbatches: int       # m
    blocks: int             # L: transformer blocks on this rank
    has_embedding: bool
    has_head: bool
    sp: bool
    recompute: str
    seq_len: int            # the whole sequence (cp's K/V)
    cp_attention: str
    moe: bool               # experts replace the MLP, replicated over TP: only attention exchanges over tp
    grad_itemsize: int = 0  # bytes of a gradient element (0: itemsize)
    n_head: int = 1         # query heads of the whole model (the llama family's KV heads below)
    kv_heads: int = 1       # KV heads of the whole model (n_head for multi-head attention)
    tp: int = 1
    dense_blocks: int | None = None  # blocks with a dense MLP among `blocks` (None: all, or none with moe)
    latent_width: int = 0   # MLA (deepseek_v3): r + d_r, the compressed KV row its CP gathers (0: other attention)
    mtp_depth: int = 0      # DeepSeek-V3's multi-token-prediction modules (on the head's rank)
    latent_heads_width: int = 0  # MLA: n_head·(d_n + d_r + d_v), what Ulysses sends of q and the output per token
    balanced_layers: int = 0  # DeepSeek-V3's MoE blocks here with the sequence-wise loss on (its counts cross cp, sp)
    experts: int = 0        # E

    @property
    def dense_mlps(self) -> int:
        """This rank's blocks whose MLP is split over tp (DeepSeek-V3's first dense blocks among MoE ones)."""
        if self.dense_blocks is not None:
            return self.dense_blocks
        return 0 if self.moe else self.blocks

    @property
    def gradient_bytes(self) -> int:
        return self.grad_itemsize or self.itemsize

    @property
    def statistics_bytes(self) -> int:
        """The softmax statistics' element: float32 or wider (the compute dtype when that is wider)."""
        return max(self.itemsize, 4)

    @property
    def local_heads(self) -> tuple[int, int, int]:
        """(query heads, KV heads, head size) on one TP rank; a KV head shared by tp/n_kv ranks is on each."""
        n_head, kv_heads = max(self.n_head, 1), max(self.kv_heads, 1)
        return n_head // self.tp, max(kv_heads // self.tp, 1), self.channels // n_head


def data_parallel_bytes(engine: Any, microbatches: int, itemsize: int, hooked: bool = True,
                        comm: Any = None) -> float:
    """One `DataParallel` engine's bytes per step on its communicator (or `comm`, the same one seen
    `AcrossNodes`). `hooked=False`: the model ran without the engine's per-unit hooks (a pipeline), so ZeRO-2/3
    reduce once per step and ZeRO-3 gathers everything once. Gradients travel at the engine's gradient dtype,
    parameters (ZeRO's all-gathers) at its compute dtype; `itemsize` is used when the engine has neither."""
    comm = engine.comm if comm is None else comm
    grad_size = getattr(getattr(engine, "grad_dtype", None), "itemsize", itemsize)
    param_size = getattr(getattr(engine, "dtype", None), "itemsize", itemsize)
    total = 0.0
    for index, bucket in enumerate(engine.buckets):
        size = bucket.padded * grad_size
        reduce_scatter = collective_bytes("reduce_scatter", size, comm)
        all_gather = collective_bytes("all_gather", bucket.padded * param_size, comm)
        if engine.zero == 0:
            total += collective_bytes("all_reduce", size, comm)
        elif engine.zero == 1 or not hooked:  # ZeRO-3: all-gathered at the start instead of after the update
            total += reduce_scatter + all_gather
        elif engine.zero == 2:
            total += microbatches * reduce_scatter + all_gather
        else:
            total += microbatches * (reduce_scatter + engine.gathers_per_microbatch(index) * all_gather)
    return total


def replica_bytes(engine: Any, itemsize: int, comm: Any = None) -> float:
    """Hybrid sharding: one engine's bytes per step on its replicas' communicator (or `comm`, seen
    `AcrossNodes`): each bucket's reduced shard, padded/N elements at the gradient dtype, all-reduced once."""
    comm = engine.replicas if comm is None else comm
    grad_size = getattr(getattr(engine, "grad_dtype", None), "itemsize", itemsize)
    return sum(collective_bytes("all_reduce", bucket.padded // engine.comm.size * grad_size, comm)
               for bucket in engine.buckets)


def tensor_parallel_bytes(shape: RunShape, comm: Communicator, partial_gradient_bytes: float,
                          key_value_comm: Communicator | None = None) -> float:
    """Bytes per step on the TP group; `partial_gradient_bytes`: this rank's gradients placed `Partial` on tp;
    `key_value_comm`: the ranks holding the same KV heads, when tp exceeds them (llama)."""
    if comm.size == 1:
        return 0.0
    s = shape.rows * shape.positions * shape.channels * shape.itemsize
    exchange = _exchange_bytes(shape, s, comm)
    forwards = 2 if shape.recompute == "full" else 1  # full recomputation reruns each block's forward
    # attention's c_attn/c_proj in every block, the MLP's c_fc/c_proj in the dense ones
    per_microbatch = (shape.blocks + shape.dense_mlps) * (forwards + 1) * exchange
    if shape.has_embedding:
        per_microbatch += exchange
    if shape.has_head:
        per_microbatch += exchange + _cross_entropy_bytes(shape, shape.positions, comm)
        # each MTP module over every position: the embedding, one block (MoE: attention only), the head
        per_microbatch += shape.mtp_depth * (exchange * (2 + (1 if shape.moe else 2) * (forwards + 1))
                                             + _cross_entropy_bytes(shape, shape.positions, comm))
    total = shape.microbatches * per_microbatch
    # KV heads replicated on tp/n_kv ranks: each microbatch's K and V weight gradients summed over the copies
    if key_value_comm is not None:
        total += shape.microbatches * shape.blocks * key_value_gradient_bytes(shape, key_value_comm)
    if shape.sp:  # DeepSeek-V3's sequence-wise loss: each slice's expert counts per sequence, summed over tp
        total += sequence_balance_bytes(shape, comm)
    # SP: the gradients that are partial sums over tp (LayerNorms; with MoE the router and experts), summed once
    return total + collective_bytes("all_reduce", partial_gradient_bytes, comm)


def sequence_balance_bytes(shape: RunShape, comm: Communicator) -> float:
    """DeepSeek-V3's sequence-wise balance loss on split sequences: per balanced MoE block, microbatch and forward
    (two with --recompute full), an all-reduce of the b × E expert counts (float64) over `comm`
    (`models.deepseek_moe`)."""
    forwards = 2 if shape.recompute == "full" else 1
    counts = collective_bytes("all_reduce", shape.rows * shape.experts * 8, comm)
    return shape.microbatches * shape.balanced_layers * forwards * counts


def _exchange_bytes(shape: RunShape, nbytes: float, comm: Communicator) -> float:
    """One exchange of an activation of `nbytes`: an all-reduce, or under SP the all-gather and reduce-scatter."""
    if shape.sp:
        return collective_bytes("all_gather", nbytes, comm) + collective_bytes("reduce_scatter", nbytes, comm)
    return collective_bytes("all_reduce", nbytes, comm)


def _cross_entropy_bytes(shape: RunShape, positions: int, comm: Communicator) -> float:
    """The vocab-parallel cross-entropy's all-reduces: the row maxima, then the sums and target logits."""
    tokens = shape.rows * positions
    return collective_bytes("all_reduce", tokens * shape.statistics_bytes, comm) \
        + collective_bytes("all_reduce", 2 * tokens * shape.statistics_bytes, comm)


def key_value_gradient_bytes(shape: RunShape, copies: Communicator) -> float:
    """Per block and microbatch: the all-reduces of the k_proj and v_proj weight gradients (h × d each) over the
    tp/n_kv ranks that hold the same KV head (`copies`)."""
    _, kv_heads, head_dim = shape.local_heads
    return 2 * collective_bytes("all_reduce", shape.channels * kv_heads * head_dim * shape.gradient_bytes, copies)


def pipeline_bytes(shape: RunShape, schedule: Any, rank: int, tp: int, tied_weight_bytes: float,
                   crossing: Any = None) -> float:
    """Bytes per step this rank sends to other pipeline ranks: activations forward, their gradients backward
    (a sequence slice of them under SP), and the tied embedding's gradient between the end stages. `crossing`
    (a pp communicator's `remote`, or None for every rank on this node): only those sent to another node."""
    s = shape.rows * shape.positions * shape.channels * shape.itemsize / (tp if shape.sp else 1)
    ranks = schedule.stage_ranks

    def counted(other: int) -> bool:
        return other != rank and (crossing is None or crossing[other])

    boundaries = sum((stage + 1 < len(ranks) and counted(ranks[stage + 1])) + (stage > 0 and counted(ranks[stage - 1]))
                     for stage, owner in enumerate(ranks) if owner == rank)
    tied = tied_weight_bytes if counted(ranks[0] if rank == ranks[-1] else ranks[-1]) and ranks[0] != ranks[-1] \
        and rank in (ranks[0], ranks[-1]) else 0.0
    return shape.microbatches * boundaries * s + tied


CP_ELEMENTS = {  # (forward, backward) K/V elements of b·s·h_kv one rank sends per block (axes.context_parallel)
    "ring": lambda c: (2 * (c - 1) / c, 2 * (2 * c - 1) / c),
    "all-gather": lambda c: (2 * (c - 1) / c, 4 * (c - 1) / c),
}


def context_parallel_bytes(shape: RunShape, cp: int, tp: int, comm: Communicator | None = None) -> float:
    """Bytes per step on the CP group, every block and microbatch: ring and all-gather move K and V (h_kv =
    n_kv·d channels of this TP rank: GQA moves n_kv/n_head of multi-head attention's); Ulysses moves q, k, v and
    the output, 2(c−1)/c²·bs·(h + h_kv') each way, h_kv' the KV channels sent (n_kv' = max(n_kv, c) heads); with
    `comm`, DeepSeek-V3's sequence-wise loss's expert counts too (`sequence_balance_bytes`)."""
    if cp == 1:
        return 0.0
    counts = sequence_balance_bytes(shape, comm) if comm is not None else 0.0
    heads, kv_heads, head_dim = shape.local_heads
    tokens = shape.rows * shape.seq_len * shape.itemsize
    forwards = 2 if shape.recompute == "full" else 1
    if shape.latent_width:  # MLA: the [latent | RoPE key] rows all-gathered, their gradients reduce-scattered
        forward = backward = (cp - 1) / cp * tokens * shape.latent_width
        if shape.cp_attention == "ulysses":  # and q and the output by heads: this TP rank's heads
            forward = backward = forward + (cp - 1) / cp**2 * tokens * shape.latent_heads_width / tp
        elif shape.cp_attention == "ring":  # backward: the blocks again, and cp hops of their gradients (widened)
            backward = forward + shape.rows * shape.seq_len * shape.latent_width * shape.statistics_bytes
    elif shape.cp_attention == "ulysses":
        each_way = 2 * (cp - 1) / cp**2 * tokens * (heads + max(kv_heads, cp)) * head_dim
        forward, backward = each_way, each_way
    else:
        forward, backward = (factor * tokens * kv_heads * head_dim for factor in CP_ELEMENTS[shape.cp_attention](cp))
    blocks = shape.blocks + (shape.mtp_depth if shape.has_head else 0)  # MTP modules' blocks on the head's rank
    # MTP: the whole sequences' targets (int64) all-gathered once per microbatch (`models.multi_token`)
    targets = (cp - 1) / cp * shape.rows * shape.seq_len * 8 if shape.mtp_depth and shape.has_head else 0.0
    return shape.microbatches * (blocks * (forwards * forward + backward) + targets) + counts


def expert_parallel_bytes(counts: dict[str, dict[str, Any]], dispatch: str, comm: Any, row_bytes: float,
                          dispatch_row_bytes: float, value_bytes: float, experts_per_rank: int,
                          across_nodes: bool = False) -> float:
    """The ep formula of the module docstring, from one step's `axes.expert_parallel.ExpertTraffic` counts on the
    EP group `comm` (a `Communicator`; `across_nodes`: only the peers on other nodes)."""
    layout = comm.topology
    peers = [p for p in range(comm.size) if p != comm.rank and (not across_nodes or layout.crosses(comm.rank, p))]
    forward, backward = counts["forward"], counts["backward"]
    if dispatch == "flat":
        per_call = np.full(comm.size, 8.0 * experts_per_rank + 16)
        backward_per_call = np.full(comm.size, 16.0)
    else:
        lane = np.isin(np.arange(comm.size), layout.lane(layout.local_rank[comm.rank]))
        node = np.asarray(layout.node_index) == layout.node_index[comm.rank]
        per_call = np.where(lane, 16.0, np.where(node, 8.0 * experts_per_rank, 0.0))
        backward_per_call = np.zeros(comm.size)
    total = (forward["rows_to"] * dispatch_row_bytes + forward["rows_from"] * row_bytes
             + forward["values_to"] * value_bytes + forward["codes_to"] * 8.0 + forward["calls"] * per_call
             + (backward["rows_to"] + backward["rows_from"]) * row_bytes + backward["values_from"] * value_bytes
             + backward["calls"] * backward_per_call)
    return float(total[peers].sum())


def context_parallel_inter_node_bytes(shape: RunShape, cp_comm: Any) -> float | None:
    """CP's bytes across nodes: 0 when the CP group lives on one node, else no formula here (None)."""
    return 0.0 if cp_comm.size == 1 or cp_comm.remote is None else None


def report(counted: dict[str, int], predicted: dict[str, float | None],
           keep: set[str] = frozenset()) -> list[AxisTraffic]:
    """Axis by axis, the ledger's bytes beside the formula's (axes that sent nothing and have no formula left
    out, unless in `keep`)."""
    return [AxisTraffic(axis, predicted.get(axis), bytes_sent) for axis, bytes_sent in counted.items()
            if bytes_sent or predicted.get(axis) or axis in keep]


def format_line(rank: int, rows: list[AxisTraffic], where: str = "") -> str:
    """'rank 0: dp 3.83 MB (formula 3.83 MB, 1.000) | tp …' (`where`: 'rank 0 across nodes: …')."""
    parts = []
    for row in rows:
        if row.predicted is not None and row.predicted != row.predicted:  # NaN: no formula across nodes
            parts.append(f"{row.axis} {row.counted / 1e6:.3f} MB (no inter-node formula for this algorithm)")
        elif row.predicted is None:
            parts.append(f"{row.axis} {row.counted / 1e6:.3f} MB (no formula: depends on routing)")
        else:
            ratio = row.counted / row.predicted if row.predicted else (1.0 if row.counted == 0 else float("inf"))
            parts.append(f"{row.axis} {row.counted / 1e6:.3f} MB (formula {row.predicted / 1e6:.3f} MB, "
                         f"ratio {ratio:.4f})")
    return f"rank {rank}{' ' + where if where else ''}: " + (" | ".join(parts) if parts else "nothing sent")
