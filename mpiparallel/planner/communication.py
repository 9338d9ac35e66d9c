"""What each unit exchanges per microbatch, and what a collective costs on a mesh axis.

Volumes (`mpiparallel.traffic`'s) per block and microbatch, with t = b·s/cp this rank's tokens and h_kv = n_kv'·d
this TP rank's KV channels:

    tp   2 all-reduces of t·h each way (1 with MoE: the experts are replicated over TP); under SP a reduce-scatter
         and an all-gather in place of each; with --recompute full the forward's again; when tp > n_kv the k and
         v weight gradients (h·d each) all-reduced over the tp/n_kv ranks that hold each KV head
    cp   ring 2(c−1)·t·h_kv forward, 2(2c−1)·t·h_kv backward; all-gather 2c·t·h_kv forward, again backward plus
         the gradients' reduce-scatter; Ulysses all-to-alls of t·(h/tp + 2·max(n_kv', c)·d) and t·h/tp each way;
         MLA moves its compressed [latent | RoPE key] rows, r + d_r per token, instead of K and V
    ep   dispatch and combine of every routed token each way, K copies per token: inside a node one all-to-all of
         K·t·h; across N nodes the flat dispatch's K·(N − 1)/N copies per token over the network, the node-limited
         two-hop dispatch's M·(N − 1)/N, then NVLink (`deepseek.dispatch_copies`), both shares at once

Time: ranks are numbered tp innermost, then cp, dp (ep inside dp), pp; a group of n ranks `stride` apart spans
⌈n / (gpus_per_node/stride)⌉ nodes and is priced on NVLink inside a node, on the two-tier model (inside and
across) once it spans nodes. A collective costs the cheapest algorithm's α-β-γ prediction, as algo="auto" picks it
(`collectives.cost_model`); a ring pass of K/V is n − 1 messages of nbytes/(n − 1). Bytes one rank sends:
all-reduce 2(n−1)/n of the buffer, reduce-scatter, all-gather and all-to-all (n−1)/n, a ring pass or send all.
"""

from __future__ import annotations

import math
from dataclasses import replace
from functools import lru_cache
from typing import NamedTuple

from collectives.cost_model import CostModel, choose, predict
from mpiparallel.axes.tensor_parallel import key_value_replicas

from . import deepseek
from .hardware import Cluster
from .layout import Layout
from .shapes import Model, local_kv_heads, moe_tokens


class Collective(NamedTuple):
    """A collective a unit waits for: its name, the bytes of its buffer (all_gather: the gathered size), its
    mesh axis, and the ranks of that axis taking part (0: all of them)."""

    name: str
    nbytes: float
    axis: str
    ranks: int = 0


def tp_exchanges(nbytes: float, layout: Layout, count: int) -> tuple[Collective, ...]:
    """`count` exchanges of one activation over tp: an all-reduce each, or under SP a reduce-scatter and an
    all-gather in its place (the same volume)."""
    if layout.tp == 1:
        return ()
    one = (Collective("reduce_scatter", nbytes, "tp"), Collective("all_gather", nbytes, "tp")) if layout.sp \
        else (Collective("all_reduce", nbytes, "tp"),)
    return one * count


def block_collectives(model: Model, layout: Layout, tokens: int, item: float, moe: bool | None = None,
                      dispatch: float | None = None) -> tuple[tuple[Collective, ...], tuple[Collective, ...]]:
    """(forward, backward) collectives of one block and microbatch, as `mpiparallel.traffic` counts them:
    tp two exchanges each way (one with MoE: the experts are replicated over TP), cp the K/V of the chosen
    attention, ep the dispatch and combine; backward also the KV weight gradients' all-reduces over the tp/n_kv
    ranks that hold each KV head (llama, tp > n_kv), and with --recompute full the forward's again."""
    moe = bool(model.experts) if moe is None else moe
    s = tokens * model.n_embd * item
    exchanges = tp_exchanges(s, layout, 1 if moe else 2)
    cp_forward, cp_backward = context_parallel_collectives(model, layout, tokens, item)
    forward, backward = exchanges + cp_forward, exchanges + cp_backward
    if moe and layout.ep > 1:  # dispatch and combine of every routed token (`ep_exchange`: its K copies)
        routed = moe_tokens(layout, tokens) * model.n_embd
        moved = (Collective("dispatch", routed * (dispatch or item), "ep"), Collective("combine", routed * item, "ep"))
        forward, backward = forward + moved, backward + moved
    copies = key_value_replicas(model.kv_heads, layout.tp) if model.is_llama else 1
    if copies > 1:
        backward += (Collective("all_reduce", model.n_embd * model.head_dim * item, "tp", copies),) * 2
    if layout.recompute == "full":
        backward = forward + backward
    return forward, backward


def context_parallel_collectives(model: Model, layout: Layout, tokens: int,
                                 item: float) -> tuple[tuple[Collective, ...], tuple[Collective, ...]]:
    """(forward, backward) of the CP attention over c ranks, with h_kv = n_kv'·d this TP rank's KV channels and
    t = b·s/c this rank's tokens: ring passes 2(c−1)·t·h_kv forward and 2(2c−1)·t·h_kv backward (K/V again,
    with dK/dV); all-gather gathers K and V of the sequence (2·c·t·h_kv) forward, again backward and
    reduce-scatters their gradients; Ulysses all-to-alls q, k, v (t·(h/tp + 2·max(n_kv', c)·d)) and the
    output (t·h/tp) each way."""
    c = layout.cp
    if c == 1:
        return (), ()
    if model.is_deepseek:
        return _latent_context_collectives(model, layout, tokens, item)
    heads, kv_heads, d = model.n_head // layout.tp, local_kv_heads(model, layout.tp), model.head_dim
    kv = tokens * kv_heads * d * item
    if layout.cp_attention == "ring":
        return ((Collective("ring_pass", 2 * (c - 1) * kv, "cp"),),
                (Collective("ring_pass", 2 * (2 * c - 1) * kv, "cp"),))
    if layout.cp_attention == "all-gather":
        gathered = 2 * c * kv
        return ((Collective("all_gather", gathered, "cp"),),
                (Collective("all_gather", gathered, "cp"), Collective("reduce_scatter", gathered, "cp")))
    into_heads = Collective("all_to_all", tokens * (heads + 2 * max(kv_heads, c)) * d * item, "cp")
    into_sequence = Collective("all_to_all", tokens * heads * d * item, "cp")
    return (into_heads, into_sequence), (into_sequence, into_heads)


def _latent_context_collectives(model: Model, layout: Layout, tokens: int,
                                item: float) -> tuple[tuple[Collective, ...], tuple[Collective, ...]]:
    """MLA's CP moves the compressed [latent | RoPE key] rows, r + d_r per token (`mpiparallel.traffic`): ring
    passes them forward and them and their gradients backward; all-gather gathers them and reduce-scatters their
    gradients; Ulysses does that too and all-to-alls the queries (d_qk per head) and outputs (d_v per head)."""
    c, config = layout.cp, model.config
    latent = tokens * (config.kv_lora_rank + config.qk_rope_head_dim) * item
    if layout.cp_attention == "ring":
        return ((Collective("ring_pass", (c - 1) * latent, "cp"),),
                (Collective("ring_pass", (2 * c - 1) * latent, "cp"),))
    gathered = (Collective("all_gather", c * latent, "cp"),)
    scattered = (Collective("reduce_scatter", c * latent, "cp"),)
    if layout.cp_attention == "all-gather":
        return gathered, gathered + scattered
    heads = model.n_head // layout.tp
    queries = Collective("all_to_all", tokens * heads * model.query_key_dim * item, "cp")
    outputs = Collective("all_to_all", tokens * heads * model.value_dim * item, "cp")
    return gathered + (queries, outputs), gathered + scattered + (outputs, queries)


def ep_exchange(model: Model, layout: Layout, cluster: Cluster, nbytes: float) -> tuple[float, float, float]:
    """Seconds, bytes sent and bytes sent across nodes of one dispatch (or combine) of `nbytes` of routed tokens
    (one copy each) over ep: K copies per token. Inside a node the all-to-all's α-β price; across nodes the copies
    of `deepseek.dispatch_copies` (flat, or node-limited two-hop), the network's and NVLink's shares running at
    once (each α per peer)."""
    link, nodes = axis_link(layout, "ep", cluster), axis_nodes(layout, "ep", cluster)
    per_node = layout.ep // nodes
    topk_group = model.config.topk_group if model.is_deepseek else model.top_k
    inter, intra = deepseek.dispatch_copies(model.top_k, topk_group, nodes, per_node, layout.ep_dispatch)
    if nodes == 1:
        volume = model.top_k * nbytes
        return (collective_seconds("all_to_all", volume, layout.ep, link),
                collective_bytes_sent("all_to_all", volume, layout.ep), 0.0)
    across = link.across()
    inter_peers = nodes - 1 if layout.ep_dispatch == "hierarchical" else layout.ep - per_node
    seconds = max(inter_peers * across.alpha + inter * nbytes * across.beta,
                  (per_node - 1) * link.alpha + intra * nbytes * link.beta)
    return seconds, (inter + intra) * nbytes, inter * nbytes


def axis_stride(layout: Layout, axis: str) -> int:
    """Rank distance between neighbours of `axis` (innermost first: tp, cp, dp, pp; ep inside dp)."""
    return {"tp": 1, "cp": layout.tp, "dp": layout.tp * layout.cp, "ep": layout.tp * layout.cp,
            "pp": layout.tp * layout.cp * layout.dp}[axis]


def axis_size(layout: Layout, axis: str) -> int:
    return getattr(layout, axis)


def axis_link(layout: Layout, axis: str, cluster: Cluster) -> CostModel:
    """NVLink-like inside a node; once the group spans nodes, the two-tier model (inside and across) that the
    collectives' cost model prices flat and hierarchical algorithms with."""
    return group_link(axis_stride(layout, axis), axis_size(layout, axis), cluster)


def group_link(stride: int, ranks: int, cluster: Cluster) -> CostModel:
    if stride * ranks <= cluster.gpus_per_node:
        return cluster.intra
    return replace(cluster.intra, alpha_inter=cluster.inter.alpha, beta_inter=cluster.inter.beta)


def group_nodes(stride: int, ranks: int, cluster: Cluster) -> int:
    """Nodes a group of `ranks` ranks `stride` apart spans (nodes of gpus_per_node consecutive ranks)."""
    per_node = max(1, min(ranks, cluster.gpus_per_node // stride))
    return math.ceil(ranks / per_node)


def axis_nodes(layout: Layout, axis: str, cluster: Cluster) -> int:
    return group_nodes(axis_stride(layout, axis), axis_size(layout, axis), cluster)


@lru_cache(maxsize=65536, typed=True)
def collective_seconds(name: str, nbytes: float, ranks: int, link: CostModel, nodes: int = 1) -> float:
    """The cheapest algorithm's predicted time, as algo="auto" would choose it (`collectives.cost_model`, with
    hierarchical algorithms where the group spans `nodes` > 1); a ring pass of K/V is ranks − 1 point-to-point
    messages of nbytes/(ranks − 1). Cached: the search asks the same ones for many layouts."""
    if ranks <= 1 or nbytes <= 0:
        return 0.0
    if name in ("ring_pass", "send"):
        steps = ranks - 1 if name == "ring_pass" else 1
        crossing = link.across() if nodes > 1 else link
        return steps * (crossing.alpha + nbytes / steps * crossing.beta)
    algo = choose(link, name, int(nbytes), ranks, nodes)
    return predict(link, name, algo, int(nbytes), ranks, nodes)


def collective_bytes_sent(name: str, nbytes: float, ranks: int) -> float:
    """Bytes one rank sends (bandwidth-optimal algorithms)."""
    if ranks <= 1:
        return 0.0
    fraction = (ranks - 1) / ranks
    return {"all_reduce": 2 * fraction, "reduce_scatter": fraction, "all_gather": fraction,
            "all_to_all": fraction, "ring_pass": 1.0, "send": 1.0}[name] * nbytes
