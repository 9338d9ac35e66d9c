"""`plan --html`: the interactive parallelism map, one self-contained page (inline CSS and JS, no network).

Python evaluates every layout of a small cluster (each dp·tp·pp·cp dividing the GPU count, ep, ZeRO, schedule;
microbatches 2·pp, no recomputation) with the planner and writes, per layout and per GPU, what it holds (layers,
parameter shards, optimizer shard, experts, sequence chunks, batch rows) and what it sends per step on each axis.
The script only displays: the reader toggles each axis and its degree, and the URL hash names the layout
(`#dp=2&tp=2&pp=2&cp=1&ep=1&zero=1&schedule=1f1b`), so a link (or a headless browser) opens one directly.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ..schedules import stage_units
from .hardware import Cluster
from .layout import Choices, Layout, Precision
from .search import candidate_layouts, evaluate
from .shapes import Model


def layout_key(layout: Layout) -> str:
    schedule = layout.schedule if layout.pp > 1 else "-"
    return (f"dp={layout.dp}&tp={layout.tp}&pp={layout.pp}&cp={layout.cp}&ep={layout.ep}&zero={layout.zero}"
            f"&schedule={schedule}")


def page_layouts(model: Model, cluster: Cluster) -> list[Layout]:
    """Every mesh on a divisor of the GPUs, with ep, ZeRO and schedule; 2·pp microbatches, no recomputation."""
    found = []
    for gpus in (g for g in range(1, cluster.gpus + 1) if cluster.gpus % g == 0):
        sub = Cluster(gpus, cluster.gpu_memory, cluster.gpus_per_node, cluster.intra, cluster.inter,
                      cluster.matmul_flops, cluster.elementwise_bytes)
        for pp in (p for p in range(1, gpus + 1) if gpus % p == 0):
            rows_needed = 2 * pp
            choices = Choices(batch_size=max(8, rows_needed * gpus), pp=pp, microbatches=2 * pp, recompute="none",
                              sp=False, cp_attention="ring")
            found += [layout for layout in candidate_layouts(model, sub, choices)
                      if layout.zero <= 1 or layout.pp == 1]
    return found


def gpu_contents(model: Model, layout: Layout, batch: int) -> list[dict[str, Any]]:
    """For every GPU of the layout: its coordinates and what it holds, as lines of text."""
    chunks = stage_units(model.n_layer, layout.pp * layout.chunks)
    placement = _stage_ranks(layout)
    gpus = []
    for rank in range(layout.world):
        tp_i, rest = rank % layout.tp, rank // layout.tp
        cp_i, rest = rest % layout.cp, rest // layout.cp
        dp_i, pp_i = rest % layout.dp, rest // layout.dp
        ep_i = dp_i % layout.ep
        holds = ["layers: " + "; ".join(_describe_units(chunks[s], model.n_layer)
                                       for s, owner in enumerate(placement) if owner == pp_i)]
        if layout.tp > 1:
            holds.append(f"tp shard {tp_i + 1}/{layout.tp} of every matrix (heads {tp_i * model.n_head // layout.tp}"
                         f"–{(tp_i + 1) * model.n_head // layout.tp - 1})")
        if layout.zero:
            sharded = ["optimizer state", "gradients", "parameters"][:layout.zero]
            holds.append(f"ZeRO-{layout.zero}: {', '.join(sharded)} shard {dp_i + 1}/{layout.dp}")
        if model.experts:
            per = model.experts // layout.ep
            holds.append(f"experts {ep_i * per}–{(ep_i + 1) * per - 1} of {model.experts}")
        if layout.cp > 1:
            holds.append(f"sequence chunks {cp_i} and {2 * layout.cp - 1 - cp_i} of {2 * layout.cp}")
        rows = batch // layout.dp
        holds.append(f"batch rows {dp_i * rows}–{(dp_i + 1) * rows - 1}")
        gpus.append({"rank": rank, "coords": {"dp": dp_i, "tp": tp_i, "pp": pp_i, "cp": cp_i, "ep": ep_i},
                     "holds": holds})
    return gpus


def _stage_ranks(layout: Layout) -> list[int]:
    stages = layout.pp * layout.chunks
    if layout.chunks == 2 and layout.schedule != "interleaved":  # the V: rank r holds r and 2·pp−1−r
        return list(range(layout.pp)) + list(reversed(range(layout.pp)))
    return [s % layout.pp for s in range(stages)]


def _describe_units(units: range, n_layer: int) -> str:
    parts = []
    blocks = [u - 1 for u in units if 1 <= u <= n_layer]
    if 0 in units:
        parts.append("embedding")
    if blocks:
        parts.append(f"block {blocks[0]}" if len(blocks) == 1 else f"blocks {blocks[0]}–{blocks[-1]}")
    if n_layer + 1 in units:
        parts.append("head")
    return ", ".join(parts)


def page_data(model: Model, cluster: Cluster, precision: Precision, batch: int) -> dict[str, Any]:
    """The planner's results for every layout of the page, keyed like the URL hash."""
    layouts = {}
    for layout in page_layouts(model, cluster):
        rows_batch = max(batch, 2 * layout.pp * layout.dp)
        rows_batch = -(-rows_batch // (layout.dp * layout.microbatches)) * layout.dp * layout.microbatches
        result = evaluate(model, cluster, precision, layout, rows_batch)
        per_rank = [result.rank_memory(rank)["total"] for rank in range(layout.world)]
        gpus = gpu_contents(model, layout, rows_batch)
        for gpu, memory in zip(gpus, per_rank, strict=True):
            gpu["memory"] = memory
            gpu["sends"] = {axis: result.comm_bytes[axis] for axis in ("dp", "tp", "pp", "cp", "ep")
                            if getattr(layout, axis) > 1}
        layouts[layout_key(layout)] = {"label": layout.label(), "step_s": result.step_s, "bubble": result.bubble,
                                       "fits": result.fits, "batch": rows_batch, "microbatches": layout.microbatches,
                                       "comm_s": result.comm_s, "gpus": gpus}
    options = {axis: sorted({int(key.split(f"{axis}=")[1].split("&")[0]) for key in layouts})
               for axis in ("dp", "tp", "pp", "cp", "ep", "zero")}
    options["schedule"] = sorted({key.split("schedule=")[1] for key in layouts})
    return {"model": {"n_layer": model.n_layer, "n_embd": model.n_embd, "n_head": model.n_head,
                      "seq_len": model.seq_len, "vocab_size": model.vocab_size, "experts": model.experts,
                      "arch": model.arch, "kv_heads": model.kv_heads},
            "gpus": cluster.gpus, "gpu_memory": cluster.gpu_memory, "options": options, "layouts": layouts}


def write_page(path: Path, model: Model, cluster: Cluster, precision: Precision, batch: int) -> int:
    """Write the page; returns the number of layouts in it."""
    data = page_data(model, cluster, precision, batch)
    payload = json.dumps(data, separators=(",", ":")).replace("</", "<\\/")
    Path(path).write_text(_PAGE.replace("__DATA__", payload))
    return len(data["layouts"])


_PAGE = """<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>mpiparallel: the parallelism map</title>
<style>
body{font-family:system-ui,sans-serif;margin:16px;background:#fafafa;color:#222}
h1{font-size:20px;margin:0 0 8px}
#controls{display:flex;flex-wrap:wrap;gap:14px;margin:8px 0;padding:8px;background:#fff;border:1px solid #ddd}
#controls label{font-weight:600;margin-right:4px}
#controls button{margin:1px;padding:2px 8px;border:1px solid #999;background:#eee;cursor:pointer}
#controls button.on{background:#2a6ad8;color:#fff;border-color:#2a6ad8}
#controls button:disabled{opacity:.35;cursor:default}
#summary{margin:8px 0;font-size:14px}
#summary .bad{color:#b00;font-weight:700}
#gpus{display:grid;grid-template-columns:repeat(4,1fr);gap:8px}
.gpu{background:#fff;border:2px solid #888;border-radius:6px;padding:6px;font-size:12px}
.gpu h3{margin:0 0 4px;font-size:13px}
.gpu ul{margin:2px 0;padding-left:16px}
.sends{color:#444}
.pp0{border-color:#2a6ad8}.pp1{border-color:#d8842a}.pp2{border-color:#2aa84a}.pp3{border-color:#a82a9a}
.pp4{border-color:#777}.pp5{border-color:#c33}.pp6{border-color:#3aa}.pp7{border-color:#aa3}
</style></head><body>
<h1>The parallelism map</h1>
<div id="model"></div>
<div id="controls"></div>
<div id="summary"></div>
<div id="gpus"></div>
<script id="plan-data" type="application/json">__DATA__</script>
<script>
const DATA = JSON.parse(document.getElementById('plan-data').textContent);
const AXES = ['dp', 'tp', 'pp', 'cp', 'ep', 'zero', 'schedule'];
let state = {dp: 1, tp: 1, pp: 1, cp: 1, ep: 1, zero: 0, schedule: '-'};
function key(s) { return AXES.map(a => a + '=' + s[a]).join('&'); }
function fmtBytes(b) {
  for (const [u, s] of [['GB', 1e9], ['MB', 1e6], ['kB', 1e3]]) if (b >= s) return (b / s).toFixed(2) + ' ' + u;
  return Math.round(b) + ' B';
}
function nearest(s) {
  if (DATA.layouts[key(s)]) return s;
  for (const axis of ['schedule', 'zero', 'ep', 'cp', 'dp', 'tp', 'pp']) {
    for (const v of DATA.options[axis]) {
      const t = Object.assign({}, s, {[axis]: v});
      if (DATA.layouts[key(t)]) return t;
    }
  }
  return {dp: 1, tp: 1, pp: 1, cp: 1, ep: 1, zero: 0, schedule: '-'};
}
function controls() {
  const box = document.getElementById('controls');
  box.innerHTML = '';
  for (const axis of AXES) {
    const group = document.createElement('div');
    group.innerHTML = '<label>' + axis + '</label>';
    for (const v of DATA.options[axis]) {
      const b = document.createElement('button');
      b.textContent = v;
      b.id = 'set-' + axis + '-' + v;
      const t = Object.assign({}, state, {[axis]: v});
      b.className = String(state[axis]) === String(v) ? 'on' : '';
      b.disabled = !DATA.layouts[key(nearest(t))];
      b.onclick = () => { state = nearest(t); location.hash = key(state); };
      group.appendChild(b);
    }
    box.appendChild(group);
  }
}
function render() {
  const plan = DATA.layouts[key(state)];
  controls();
  const summary = document.getElementById('summary');
  summary.innerHTML = '<b id="layout-label">' + plan.label + '</b> on ' + plan.gpus.length + ' of ' + DATA.gpus +
    ' GPUs, batch ' + plan.batch + ' sequences in ' + plan.microbatches + ' microbatches: predicted step ' +
    (plan.step_s * 1e3).toFixed(3) + ' ms, bubble ' + (plan.bubble * 100).toFixed(1) + '%' +
    (plan.fits ? '' : ' <span class="bad">does not fit in ' + fmtBytes(DATA.gpu_memory) + '</span>');
  const grid = document.getElementById('gpus');
  grid.innerHTML = '';
  for (const gpu of plan.gpus) {
    const card = document.createElement('div');
    card.className = 'gpu pp' + (gpu.coords.pp % 8);
    card.id = 'gpu-' + gpu.rank;
    card.dataset.rank = gpu.rank;
    const coords = Object.entries(gpu.coords).map(([a, i]) => a + ' ' + i).join(', ');
    const sends = Object.entries(gpu.sends).map(([a, b]) => '<li>' + a + ': ' + fmtBytes(b) + '</li>').join('');
    card.innerHTML = '<h3>GPU ' + gpu.rank + ' <small>(' + coords + ')</small></h3>' +
      '<ul class="holds">' + gpu.holds.map(h => '<li>' + h + '</li>').join('') + '</ul>' +
      '<div>memory ' + fmtBytes(gpu.memory) + '</div>' +
      '<div class="sends">sends per step:<ul>' + (sends || '<li>nothing</li>') + '</ul></div>';
    grid.appendChild(card);
  }
}
function fromHash() {
  const wanted = Object.assign({}, state);
  for (const part of location.hash.replace(/^#/, '').split('&')) {
    const [a, v] = part.split('=');
    if (AXES.includes(a) && v !== undefined) wanted[a] = a === 'schedule' ? v : Number(v);
  }
  state = nearest(wanted);
  render();
}
const m = DATA.model;
document.getElementById('model').textContent = (m.arch === 'llama' ? 'Llama ' : 'GPT-2 ') + m.n_layer +
  ' layers, ' + m.n_embd + ' channels, ' + m.n_head + ' heads' +
  (m.arch === 'llama' ? ' (' + m.kv_heads + ' KV heads)' : '') + ', seq ' + m.seq_len + ', vocab ' + m.vocab_size +
  (m.experts ? ', ' + m.experts + ' experts' : '') +
  '; toggle each axis and its degree; the URL hash names the layout.';
window.addEventListener('hashchange', fromHash);
fromHash();
</script></body></html>
"""

