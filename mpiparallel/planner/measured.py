"""A chip's matrix products as this project measured them on it (`scripts/measure_gemm.py`), for the planner:
`plan --gemm-measured FILE` and `python -m mpiparallel.planner.published --gemm-measured FILE`.

The file belongs to one preset of `gpus.GPUS` (the measured device's, `gpus.preset_for_device`) and changes three
things of that preset, each from the measurement and none per run (docs/published-runs.md, "Measuring a chip"):

- **the MAMF.** The best bf16 rate of the script's bounded shape search replaces the published figure
  (S. Bekman's table) as the compute roof of every product the model times (`gpus.gemm_seconds`).
- **sustained clocks.** One large product run back to back: s = min(1, rate in its last window / rate in its
  first), the power and thermal limits of continuous load. The script runs it last, right after the products, so
  its first window finds the chip as the MAMF search and the products left it, and s is what a longer load takes
  off those rates. The roof becomes MAMF_measured · s.
- **the products' shapes.** A product timed at the very shape the planner prices — (m, n, k, count, bytes per
  operand element) — takes its measured time t scaled to the roof it is priced at: t · MAMF_measured / roof.
  At the measured roof that is t / s; a code base that gives SMs to communication lowers the roof
  (`cluster.Cluster.from_preset`) and the time grows with it. Every other product keeps the model at the new roof.

FP8 products keep the preset's FP8 ceiling: CuPy 14 has no FP8 matrix product, so the script measures none.
A measurement made with NumPy on a CPU (the script's test path) names no preset and is refused.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from .gpus import GPU, GPUS

FORMAT = "mpiparallel-gemm-measurement/1"
"""The `format` field of the script's JSON file; the fields this module reads are in `load`'s docstring."""

Shape = tuple[float, float, float, float, float]
"""(m, n, k, count, bytes per operand element): `count` [m, k] × [k, n] products, as `kernel_costs.Gemm` prices them."""


@dataclass(frozen=True)
class GemmMeasurement:
    """What the planner takes from one measurement file."""

    path: str
    device: str
    preset: str
    mamf_flops: float
    """The best bf16 matmul FLOP/s of the shape search."""
    sustained: float
    """min(1, last window's rate / first window's) of the sustained run; 1.0 where none was run."""
    seconds: Mapping[Shape, float]
    """Measured seconds of each product shape the script timed (bf16)."""

    def summary(self) -> dict[str, Any]:
        return {"file": self.path, "device": self.device, "preset": self.preset, "mamf_flops": self.mamf_flops,
                "sustained": self.sustained, "products": len(self.seconds)}


@dataclass(frozen=True, eq=False)
class MeasuredTimes:
    """`gpus.MeasuredGemms`: a measured product's time, scaled from the roof it was measured at to the roof it is
    priced at (eq=False: hashed by identity, as the frozen `GPU` that holds it may be)."""

    seconds: Mapping[Shape, float]
    measured_roof: float

    def __call__(self, m: float, n: float, k: float, count: float, item: float, roof: float) -> float | None:
        measured = self.seconds.get((m, n, k, count, item))
        return None if measured is None else measured * self.measured_roof / roof


def measured_gpu(gpu: GPU, measurement: GemmMeasurement, mamf: bool = True, sustained: bool = True,
                 products: bool = True) -> GPU:
    """`gpu` (the measured preset) with the measurement's parts applied (module docstring): the measured MAMF,
    the sustained factor on it, the measured products. ValueError for another preset."""
    if gpu.name != measurement.preset:
        raise ValueError(f"{measurement.path} was measured on {measurement.device} (preset {measurement.preset}), "
                         f"not on {gpu.name}")
    roof = measurement.mamf_flops if mamf else gpu.mamf_flops
    factor = measurement.sustained if sustained else 1.0
    times = MeasuredTimes(measurement.seconds, roof) if products and measurement.seconds else None
    return replace(gpu, mamf_flops=roof * factor, measured_gemms=times)


def load(path: str | Path) -> GemmMeasurement:
    """Read a file of `scripts/measure_gemm.py`. It reads `format`, `backend` ("cupy"), `device`, `preset` (a
    name of `gpus.GPUS`), `mamf.bfloat16.flops`, `sustained.first_flops` and `sustained.last_flops` (optional:
    `sustained` may be null) and, of each entry of `products` whose `dtype` is "bfloat16" and `measured_s` a
    number, `m`, `n`, `k`, `count`, `item` and `measured_s`. One ValueError naming the file and the field
    otherwise."""
    where = str(path)
    try:
        document = json.loads(Path(path).read_text())
    except OSError as error:
        raise ValueError(f"cannot read {where}: {error.strerror or error}") from None
    except json.JSONDecodeError as error:
        raise ValueError(f"{where} is not JSON: {error}") from None
    if not isinstance(document, dict) or document.get("format") != FORMAT:
        raise ValueError(f"{where} is not a GEMM measurement (its \"format\" is not {FORMAT!r}): write it with "
                         f"scripts/measure_gemm.py")
    if document.get("backend") != "cupy":
        raise ValueError(f"{where} was measured with {document.get('backend')!r} on "
                         f"{document.get('device', 'an unnamed device')}, not on a GPU with CuPy: the planner "
                         f"uses only GPU measurements")
    preset = document.get("preset")
    if preset not in GPUS:
        raise ValueError(f"{where}: its \"preset\" {preset!r} is not one of {', '.join(GPUS)}")
    try:
        mamf = _positive(document["mamf"]["bfloat16"]["flops"], "mamf.bfloat16.flops")
        sustained = _sustained_factor(document.get("sustained"))
        seconds = {_shape(entry): _positive(entry["measured_s"], "products[].measured_s")
                   for entry in document.get("products", [])
                   if entry.get("dtype") == "bfloat16" and entry.get("measured_s") is not None}
    except (KeyError, TypeError) as error:
        raise ValueError(f"{where}: missing or malformed field {error}") from None
    except ValueError as error:
        raise ValueError(f"{where}: {error}") from None
    return GemmMeasurement(where, str(document.get("device")), preset, mamf, sustained, seconds)


def _positive(value: Any, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
        raise ValueError(f"{name} must be a positive number, not {value!r}")
    return float(value)


def _shape(entry: dict[str, Any]) -> Shape:
    return tuple(_positive(entry[name], f"products[].{name}") for name in ("m", "n", "k", "count", "item"))


def _sustained_factor(sustained: dict[str, Any] | None) -> float:
    if sustained is None:
        return 1.0
    first = _positive(sustained["first_flops"], "sustained.first_flops")
    last = _positive(sustained["last_flops"], "sustained.last_flops")
    return min(1.0, last / first)
