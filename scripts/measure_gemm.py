"""This project's own measurement of a GPU's matrix products, in the form the planner reads
(`plan --gemm-measured FILE`, `python -m mpiparallel.planner.published --gemm-measured FILE`;
`mpiparallel/planner/measured.py` says what the planner does with each part).

    python scripts/measure_gemm.py [--out DIR] [--mamf-budget 150] [--product-budget 180] [--sustained 60]
    python scripts/measure_gemm.py --device cpu --preset a100-80gb ...   (the test path: NumPy float32 on the CPU)

Three phases, in this order. Every call is timed with CUDA events, after warm-up calls, and a shape's time is the
median of its calls. The products are CuPy's `matmul` on row-major operands: cuBLAS's `cublasGemmEx` (a batch:
`cublasGemmStridedBatchedEx`) with fp32 accumulation.

1. **MAMF** (maximum achievable matmul FLOP/s, after S. Bekman's mamf-finder): the best rate over a shape search
   bounded by `--mamf-budget` seconds — m, n, k multiples of 256 from 1,024 to 16,384: a few cubes, random shapes,
   then the neighbours of the best; the five best measured again with three times the calls, the MAMF the best of
   those (measuring the leaders again keeps one lucky median from setting it). In bf16, then fp16 on bf16's five
   best shapes. CuPy 14 runs bfloat16 (`ml_dtypes.bfloat16`, CUDA_R_16BF) and float16 matrix products through
   cuBLAS; it has no FP8 dtype (`to_cuda_dtype` refuses float8_e4m3fn), so no FP8 rate is measured.
2. **The planner's products**: every matrix product the planner prices for the published rows
   (`planner.published`, one plan per row, as `python -m mpiparallel.planner.published` prints it) at its exact
   shape — the shapes are the planner's own, recorded while it prices each row's plan (`gpus.gemm_seconds` asks
   the chip for a measured time of every product; here a log answers "none" and notes the shape). Each measured
   time stands beside the time the planner predicts for that product on the chip's preset, and their ratio.
   Products the planner prices as FP8 are listed unmeasured; fractional dimensions (average keys per query,
   routed tokens per expert) are rounded up. Smallest first, until `--product-budget` seconds are spent.
3. **Sustained**: the MAMF's best shape (or `--sustained-shape`) back to back for `--sustained` seconds, two chunks
   always queued so that the GPU never idles; the rate in the first and the last `--window` seconds (clock, power and
   thermal limits under continuous load) and, where NVML answers, the SM clock, power and temperature.

Output: DIR/gemm.json (the planner's input; `measured.load` names the fields it reads) and DIR/gemm.md (the same
for reading). On the CPU (`--device cpu`) the file says so and the planner refuses it: NumPy's float32 BLAS is no
chip's tensor cores; that path exists so that the tests can run the script.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import statistics
import sys
import time
from dataclasses import replace
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mpiparallel.planner import measured, published  # noqa: E402
from mpiparallel.planner.gpus import GPUS, gemm_seconds, preset_for_device  # noqa: E402

TERA = 1e12
PHASE_NOTE = "median of each shape's calls, CUDA events around each call, after warm-up"


class Device:
    """The arrays and the clock of one backend: CuPy on the GPU (CUDA events), NumPy on the CPU (perf_counter).
    Operands are views of three random buffers per dtype that grow as needed (generated once, not per shape)."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        if kind == "gpu":
            from collectives import backend

            self.xp = backend.gpu_array_module()  # RuntimeError with the reason where there is no GPU
            runtime = self.xp.cuda.runtime
            name = runtime.getDeviceProperties(self.xp.cuda.Device().id)["name"]
            self.name = name.decode() if isinstance(name, bytes) else str(name)
            self.versions = {"cupy": self.xp.__version__, "cuda_runtime": runtime.runtimeGetVersion(),
                             "driver": runtime.driverGetVersion()}
            self.dtypes = {"bfloat16": np.dtype(backend.BFLOAT16), "float16": np.dtype(np.float16)}
            self.unsupported = {"float8": "CuPy 14 has no FP8 dtype for matmul (to_cuda_dtype refuses float8_e4m3fn)"}
            try:
                self.batched_bf16_error = check_batched_bf16_gemm(self.xp, self.dtypes["bfloat16"])
            except Exception as error:  # a binding that changed: the batched products are skipped, saying why
                print(f"batched bfloat16 check failed: {error!r}", flush=True)
                self.batched_bf16_error = math.nan
            if not self.batched_bf16_error < BATCHED_BF16_TOLERANCE:
                self.unsupported["batched bfloat16"] = (
                    f"cublasGemmStridedBatchedEx differs from a float32 product by {self.batched_bf16_error:.2g} "
                    f"(over {BATCHED_BF16_TOLERANCE}): batched products are not measured")
        else:
            self.xp = np
            self.name = f"CPU ({platform.processor() or platform.machine()}), NumPy {np.__version__} float32"
            self.versions = {"numpy": np.__version__}
            self.dtypes = {"float32": np.dtype(np.float32)}
            self.unsupported = {"bfloat16": "NumPy has no bf16 BLAS: the CPU path times float32 (a test, not a chip)"}
        self._buffers: dict[tuple[str, str], Any] = {}
        self._rng = np.random.default_rng(0)

    def refuses(self, shape: tuple[int, int, int, int], dtype: str) -> str | None:
        """Why a product of `shape` in `dtype` cannot be measured here, or None."""
        if shape[3] > 1 and dtype == "bfloat16" and "batched bfloat16" in self.unsupported:
            return self.unsupported["batched bfloat16"]
        return None

    def matmul(self, a: Any, b: Any, c: Any) -> None:
        """c = a·b. CuPy 14.2's `matmul` refuses batched bfloat16 (it takes the integer kernel path: "data type 'E'
        not understood", seen on an H200), so a batched bfloat16 product calls cuBLAS's strided-batched GEMM itself
        (`batched_bf16_gemm`), the call CuPy makes for float16."""
        if self.kind == "gpu" and a.ndim == 3 and a.dtype == self.dtypes["bfloat16"]:
            batched_bf16_gemm(self.xp, a, b, c)
        else:
            self.xp.matmul(a, b, out=c)

    @property
    def product_dtype(self) -> str:
        return "bfloat16" if self.kind == "gpu" else "float32"

    def free_bytes(self) -> float:
        if self.kind == "gpu":
            return float(self.xp.cuda.runtime.memGetInfo()[0])
        return math.inf

    def operands(self, shape: tuple[int, int, int, int], dtype: str) -> tuple[Any, Any, Any]:
        """a [count, m, k], b [count, k, n] and the result c [count, m, n] (2-D where count is 1)."""
        m, n, k, count = shape
        lead = (count,) if count > 1 else ()
        return (self._view("a", dtype, lead + (m, k)), self._view("b", dtype, lead + (k, n)),
                self._view("c", dtype, lead + (m, n)))

    def _view(self, role: str, dtype: str, shape: tuple[int, ...]) -> Any:
        size = math.prod(shape)
        buffer = self._buffers.get((role, dtype))
        if buffer is None or buffer.size < size:
            grown = size if buffer is None else max(size, int(1.25 * buffer.size))
            buffer = self._buffers[(role, dtype)] = None  # the old one goes before the new one is made
            if self.kind == "gpu":
                self.xp.get_default_memory_pool().free_all_blocks()
            buffer = self._buffers[(role, dtype)] = self._random(grown, dtype)
        return buffer[:size].reshape(shape)

    def _random(self, size: int, dtype: str) -> Any:
        """Standard normal values (zeros or constants would run faster than real data), made in float32 in chunks
        and converted, so that no float32 copy of the whole buffer is needed."""
        out = self.xp.empty(size, dtype=self.dtypes[dtype])
        chunk = 1 << 26
        for start in range(0, size, chunk):
            stop = min(size, start + chunk)
            values = self._rng.standard_normal(stop - start, dtype=np.float32) if self.kind == "cpu" else \
                self.xp.random.standard_normal(stop - start, dtype=np.float32)
            out[start:stop] = values.astype(self.dtypes[dtype])
        return out

    def call_seconds(self, operands: tuple[Any, Any, Any], calls: int) -> list[float]:
        """Seconds of each of `calls` back-to-back products (c = a·b)."""
        a, b, c = operands
        if self.kind == "cpu":
            seconds = []
            for _ in range(calls):
                start = time.perf_counter()
                np.matmul(a, b, out=c)
                seconds.append(time.perf_counter() - start)
            return seconds
        cuda = self.xp.cuda
        events = [(cuda.Event(), cuda.Event()) for _ in range(calls)]
        for start, stop in events:
            start.record()
            self.matmul(a, b, c)
            stop.record()
        events[-1][1].synchronize()
        return [cuda.get_elapsed_time(start, stop) / 1e3 for start, stop in events]

    def chunk_clock(self) -> ChunkClock:
        return ChunkClock(self)


CUDA_R_16BF, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT, CUBLAS_OP_N = 14, 68, -1, 0  # cuBLAS's and CUDA's enums
BATCHED_BF16_TOLERANCE = 0.02  # bfloat16's rounding of c gives about 0.4 %; a wrong argument gives O(1)


def batched_bf16_gemm(cupy: Any, a: Any, b: Any, c: Any) -> None:
    """c[i] = a[i]·b[i] for row-major C-contiguous bfloat16 a [count, m, k], b [count, k, n], c [count, m, n],
    accumulating in float32: `cublasGemmStridedBatchedEx`. cuBLAS is column-major, and a row-major matrix is its
    transpose in column-major, so cᵀ = bᵀ·aᵀ is asked for: (n × k)·(k × m), leading dimensions n, k and n."""
    from cupy_backends.cuda.libs import cublas

    count, m, k = a.shape
    n = b.shape[2]
    one, zero = np.array(1.0, np.float32), np.array(0.0, np.float32)  # host scalars (cuBLAS's default mode)
    cublas.gemmStridedBatchedEx(
        cupy.cuda.device.get_cublas_handle(), CUBLAS_OP_N, CUBLAS_OP_N, n, m, k, one.ctypes.data,
        b.data.ptr, CUDA_R_16BF, n, k * n, a.data.ptr, CUDA_R_16BF, k, m * k, zero.ctypes.data,
        c.data.ptr, CUDA_R_16BF, n, m * n, count, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT)


def check_batched_bf16_gemm(cupy: Any, bfloat16: Any) -> float:
    """The largest relative difference between `batched_bf16_gemm` and a float32 product of the same values
    (a few units of bfloat16's last place where the call is right; O(1) where an argument is wrong)."""
    a = cupy.random.standard_normal((3, 48, 80), dtype=np.float32).astype(bfloat16)
    b = cupy.random.standard_normal((3, 80, 112), dtype=np.float32).astype(bfloat16)
    c = cupy.empty((3, 48, 112), dtype=bfloat16)
    batched_bf16_gemm(cupy, a, b, c)
    reference = cupy.matmul(a.astype(np.float32), b.astype(np.float32))
    return float(cupy.abs(c.astype(np.float32) - reference).max() / cupy.abs(reference).max())


class ChunkClock:
    """Times chunks of back-to-back calls without letting the device idle: on the GPU an event after each chunk,
    the host waiting only for the chunk two back (two stay queued); on the CPU the wall clock."""

    def __init__(self, device: Device) -> None:
        self.device = device
        self.marks: list[Any] = []

    def start(self) -> None:
        self.marks = [self._mark()]

    def chunk(self, operands: tuple[Any, Any, Any], calls: int) -> None:
        a, b, c = operands
        for _ in range(calls):
            self.device.matmul(a, b, c)
        self.marks.append(self._mark())
        if self.device.kind == "gpu" and len(self.marks) > 3:
            self.marks[-3].synchronize()

    def seconds(self) -> list[float]:
        """Each chunk's seconds, in order (after the last chunk has finished)."""
        if self.device.kind == "cpu":
            return [stop - start for start, stop in zip(self.marks, self.marks[1:], strict=False)]
        self.marks[-1].synchronize()
        elapsed = self.device.xp.cuda.get_elapsed_time
        return [elapsed(start, stop) / 1e3 for start, stop in zip(self.marks, self.marks[1:], strict=False)]

    def _mark(self) -> Any:
        if self.device.kind == "cpu":
            return time.perf_counter()
        event = self.device.xp.cuda.Event()
        event.record()
        return event


def flops_of(shape: tuple[float, float, float, float]) -> float:
    m, n, k, count = shape
    return 2 * m * n * k * count


def operand_bytes(shape: tuple[int, int, int, int], itemsize: int) -> float:
    m, n, k, count = shape
    return count * (m * k + k * n + m * n) * itemsize


def time_shape(device: Device, shape: tuple[int, int, int, int], dtype: str, repeats: int,
               target_s: float) -> float:
    """The median seconds of one product of `shape`: two warm-up calls (cuBLAS picks its kernel on the first),
    then enough calls to fill about `target_s` (at least `repeats`)."""
    operands = device.operands(shape, dtype)
    device.call_seconds(operands, 2 if device.kind == "gpu" else 1)
    probe = device.call_seconds(operands, 1)[0]
    calls = max(repeats, min(200, int(target_s / max(probe, 1e-9))))
    return statistics.median(device.call_seconds(operands, calls))


# -- 1. the MAMF search ---------------------------------------------------------------------------------------------

def search_grid(device: Device) -> range:
    return range(1024, 16384 + 1, 256) if device.kind == "gpu" else range(64, 512 + 1, 64)


def search_mamf(device: Device, dtype: str, budget_s: float, repeats: int, seed: int) -> dict[str, Any]:
    """The best rate over shapes of `search_grid` within `budget_s` seconds (module docstring, phase 1)."""
    grid = search_grid(device)
    rng = np.random.default_rng(seed)
    deadline = time.monotonic() + budget_s
    target = 0.03 if device.kind == "gpu" else 0.0
    rates: dict[tuple[int, int, int], float] = {}

    def measure(shape: tuple[int, int, int]) -> None:
        if shape not in rates and all(grid.start <= size <= grid.stop - 1 for size in shape):
            m, n, k = shape
            rates[shape] = flops_of((m, n, k, 1)) / time_shape(device, (m, n, k, 1), dtype, repeats, target)

    quarter = [grid[len(grid) * i // 4] for i in range(1, 4)] + [grid[-1]]
    for size in quarter:  # cubes first: there is a rate whatever the budget
        measure((size, size, size))
        if time.monotonic() > deadline:
            break
    while time.monotonic() < deadline - 0.4 * budget_s:  # random shapes for the first 60 % of the budget
        measure(tuple(int(size) for size in rng.choice(grid, 3)))
    while time.monotonic() < deadline - 0.1 * budget_s:  # then the neighbours of the three best
        before = len(rates)
        for m, n, k in sorted(rates, key=rates.get, reverse=True)[:3]:
            for change in ((1, 0, 0), (-1, 0, 0), (0, 1, 0), (0, -1, 0), (0, 0, 1), (0, 0, -1)):
                measure((m + change[0] * grid.step, n + change[1] * grid.step, k + change[2] * grid.step))
        if len(rates) == before:
            break
    leaders = sorted(rates, key=rates.get, reverse=True)[:5]
    return again(device, dtype, leaders, repeats, target, tried=len(rates), budget_s=budget_s)


def again(device: Device, dtype: str, shapes: list[tuple[int, int, int]], repeats: int, target: float,
          tried: int, budget_s: float) -> dict[str, Any]:
    """`shapes` measured again with three times the calls; the best is the MAMF."""
    rates = {shape: flops_of((*shape, 1)) / time_shape(device, (*shape, 1), dtype, 3 * repeats, 3 * target)
             for shape in shapes}
    best = max(rates, key=rates.get)
    return {"flops": rates[best], "shape": list(best), "tried": tried, "budget_s": budget_s,
            "leaders": [{"shape": list(shape), "flops": rate} for shape, rate in rates.items()]}


# -- 2. the planner's products --------------------------------------------------------------------------------------

class ProductLog:
    """Answers the planner's "measured time of this product?" (`gpus.MeasuredGemms`) with None, noting the shape:
    the products the planner prices, as it prices them."""

    def __init__(self) -> None:
        self.shapes: dict[measured.Shape, None] = {}  # in the order first priced

    def __call__(self, m: float, n: float, k: float, count: float, item: float, roof: float) -> None:
        self.shapes.setdefault((m, n, k, count, item), None)


def planner_products(rows: list[int]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The rows' plans (each row's fastest, as the published table has it) and every product shape priced in
    them, each with the rows it appears in."""
    runs = published.published_runs()
    plans, products = [], {}
    for index in rows:
        run = runs[index - 1]
        plan = published.predict(run)
        log = ProductLog()
        published.predict(run, lambda setup, log=log, layout=plan.layout: replace(
            setup, gpu=replace(setup.gpu, measured_gemms=log), layouts=(layout,)))
        plans.append({"row": index, "run": run.label(), "gpu": run.gpu, "layout": plan.layout.label()})
        for shape in log.shapes:
            products.setdefault(shape, []).append(index)
    return plans, [{"shape": shape, "rows": used} for shape, used in products.items()]


def measure_products(device: Device, products: list[dict[str, Any]], preset: str | None, mamf: float,
                     budget_s: float, repeats: int, max_bytes: float) -> list[dict[str, Any]]:
    """Each product's measured median time beside the planner's prediction on `preset` (at the preset's MAMF
    and at the measured `mamf`), smallest first until `budget_s` is spent."""
    dtype = device.product_dtype
    itemsize = device.dtypes[dtype].itemsize
    chip = GPUS.get(preset)
    deadline = time.monotonic() + budget_s
    entries = []
    for product in sorted(products, key=lambda p: flops_of(p["shape"][:4])):
        m, n, k, count, item = product["shape"]
        entry: dict[str, Any] = {"m": m, "n": n, "k": k, "count": count, "item": item, "rows": product["rows"],
                                 "flops": flops_of((m, n, k, count))}
        if chip is not None:
            fp8 = item == 1.0 and chip.fp8_mamf_flops is not None
            roof = chip.fp8_mamf_flops if fp8 else chip.mamf_flops
            entry["predicted_s"] = gemm_seconds(m, n, k, chip, item, count, roof)
            if not fp8:
                entry["predicted_at_measured_mamf_s"] = gemm_seconds(m, n, k, replace(chip, mamf_flops=mamf), item,
                                                                     count)
        measured_shape = tuple(math.ceil(size) for size in (m, n, k, count))
        entry |= {"dtype": "float8" if item == 1.0 else dtype, "measured_s": None}
        if item == 1.0:
            entry["skipped"] = "priced in FP8: CuPy has no FP8 matrix product"
        elif operand_bytes(measured_shape, itemsize) > max_bytes:
            entry["skipped"] = f"operands over --max-gb ({operand_bytes(measured_shape, itemsize) / 1e9:.1f} GB)"
        elif device.refuses(measured_shape, dtype):
            entry["skipped"] = device.refuses(measured_shape, dtype)
        elif time.monotonic() > deadline:
            entry["skipped"] = "--product-budget spent"
        else:
            if measured_shape != (m, n, k, count):
                entry["measured_shape"] = list(measured_shape)
            entry["dtype"] = dtype
            seconds = time_shape(device, measured_shape, dtype, repeats, 0.1 if device.kind == "gpu" else 0.0)
            entry |= {"measured_s": seconds, "measured_flops": flops_of(measured_shape) / seconds}
            if "predicted_s" in entry:
                entry["measured_over_predicted"] = seconds / entry["predicted_s"]
                entry["measured_over_predicted_at_measured_mamf"] = seconds / entry["predicted_at_measured_mamf_s"]
        entries.append(entry)
    return entries


# -- 3. sustained ---------------------------------------------------------------------------------------------------

def telemetry() -> Any:
    """A function returning the SM clock (MHz), power (W) and temperature (°C) of GPU 0 through NVML, or None
    where NVML (nvidia-ml-py) is missing or refuses."""
    try:
        import pynvml

        pynvml.nvmlInit()
        handle = pynvml.nvmlDeviceGetHandleByIndex(0)
    except Exception:
        return None

    def sample() -> dict[str, float] | None:
        try:
            return {"sm_mhz": pynvml.nvmlDeviceGetClockInfo(handle, pynvml.NVML_CLOCK_SM),
                    "power_w": pynvml.nvmlDeviceGetPowerUsage(handle) / 1e3,
                    "temperature_c": pynvml.nvmlDeviceGetTemperature(handle, pynvml.NVML_TEMPERATURE_GPU)}
        except Exception:
            return None
    return sample


def sustained_run(device: Device, shape: tuple[int, int, int], dtype: str, seconds: float,
                  window: float) -> dict[str, Any]:
    """The rate of `shape` run back to back for `seconds`, per `window` (phase 3)."""
    m, n, k = shape
    operands = device.operands((m, n, k, 1), dtype)
    probe = statistics.median(device.call_seconds(operands, 3))
    calls = max(1, int(0.1 / probe))  # chunks of about 0.1 s
    sample = telemetry() if device.kind == "gpu" else None
    samples = []
    clock = device.chunk_clock()
    started = time.monotonic()
    clock.start()
    next_sample = started
    while time.monotonic() - started < seconds:
        clock.chunk(operands, calls)
        if sample is not None and time.monotonic() >= next_sample:
            samples.append({"t": round(time.monotonic() - started, 1)} | (sample() or {}))
            next_sample += window
    chunk_seconds = clock.seconds()
    flops = flops_of((m, n, k, 1)) * calls
    ends = np.cumsum(chunk_seconds)
    total = float(ends[-1])
    window = max(min(window, total / 2), max(chunk_seconds))  # every window holds the end of a chunk

    def rate(low: float, high: float) -> float | None:
        """The rate of the chunks that end inside (low, high] (None: none does)."""
        inside = [s for s, end in zip(chunk_seconds, ends, strict=True) if low < end <= high + 1e-12]
        return flops * len(inside) / sum(inside) if inside else None

    windows = [rate(low, low + window) for low in np.arange(0, total - window + 1e-9, window)]
    return {"shape": list(shape), "dtype": dtype, "seconds": total, "window_s": window, "calls_per_chunk": calls,
            "first_flops": rate(0, window), "last_flops": rate(total - window, total), "windows_flops": windows,
            "samples": samples}


# -- the files ------------------------------------------------------------------------------------------------------

def markdown(document: dict[str, Any]) -> str:
    """gemm.md: the measurement for reading."""
    chip = GPUS.get(document["preset"])
    versions = ", ".join(f"{name} {version}" for name, version in document["versions"].items())
    lines = [f"# GEMM measurement: {document['device']}", "",
             f"{document['date']}; {document['backend']}: {versions}"
             + f"; preset {document['preset'] or 'none'}; {document['timing']}.", ""]
    if document["backend"] != "cupy":
        lines += ["**CPU run (NumPy float32): a test of the script, not a measurement of a chip; the planner "
                  "refuses this file.**", ""]
    lines += ["Not measured: " + "; ".join(f"{k}: {v}" for k, v in document["unsupported"].items()), "",
              "## MAMF (best rate of the shape search)", "", "| dtype | TFLOP/s | shape m×n×k | shapes tried | "
              "preset MAMF | preset peak |", "|---|---:|---|---:|---:|---:|"]
    for dtype, mamf in document["mamf"].items():
        preset = f"{chip.mamf_flops / TERA:.1f}" if chip else "–"
        peak = f"{mamf['flops'] / chip.bf16_flops:.1%} of {chip.bf16_flops / TERA:.0f}" if chip else "–"
        lines.append(f"| {dtype} | {mamf['flops'] / TERA:.1f} | {'×'.join(map(str, mamf['shape']))} | "
                     f"{mamf['tried']} | {preset} | {peak} |")
    sustained = document["sustained"]
    if sustained:
        lines += ["", "## Sustained", "",
                  f"{'×'.join(map(str, sustained['shape']))} {sustained['dtype']} back to back for "
                  f"{sustained['seconds']:.0f} s: first {sustained['window_s']:g} s "
                  f"{_tflops(sustained['first_flops'])} TFLOP/s, last {_tflops(sustained['last_flops'])} "
                  f"(×{_ratio(_over(sustained['last_flops'], sustained['first_flops']))}); per window: "
                  + ", ".join(_tflops(rate) for rate in sustained["windows_flops"])]
        if sustained["samples"]:
            lines.append("NVML (s: SM MHz, W, °C): " + "; ".join(
                f"{s['t']:g}: {s.get('sm_mhz', '?')}, {s.get('power_w', float('nan')):.0f}, "
                f"{s.get('temperature_c', '?')}" for s in sustained["samples"]))
    lines += ["", "## The planner's products", "",
              "Rows: " + "; ".join(f"{p['row']}. {p['run']} ({p['layout']})" for p in document["plans"]), "",
              "| m | n | k | count | rows | dtype | predicted ms | measured ms | measured / predicted | "
              "at measured MAMF | TFLOP/s |", "|---:|---:|---:|---:|---|---|---:|---:|---:|---:|---:|"]
    for p in document["products"]:
        measured_ms = _ms(p["measured_s"]) or p.get("skipped", "")
        lines.append(f"| {p['m']:g} | {p['n']:g} | {p['k']:g} | {p['count']:g} | {','.join(map(str, p['rows']))} | "
                     f"{p['dtype']} | {_ms(p.get('predicted_s'))} | {measured_ms} | "
                     f"{_ratio(p.get('measured_over_predicted'))} | "
                     f"{_ratio(p.get('measured_over_predicted_at_measured_mamf'))} | "
                     f"{_tflops(p.get('measured_flops'))} |")
    if document.get("planner"):
        lines += ["", "## The published rows with this measurement", "", document["planner"]]
    return "\n".join(lines) + "\n"


def _ms(seconds: float | None) -> str:
    return "" if seconds is None else f"{seconds * 1e3:.3f}"


def _ratio(value: float | None) -> str:
    return "–" if value is None else f"{value:.3f}"


def _tflops(flops: float | None) -> str:
    return "–" if flops is None else f"{flops / TERA:.1f}"


def _over(numerator: float | None, denominator: float | None) -> float | None:
    return None if numerator is None or denominator is None else numerator / denominator


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("gemm-measurement"), help="folder for gemm.json, gemm.md")
    parser.add_argument("--device", choices=["gpu", "cpu"], default="gpu",
                        help="gpu: CuPy (the measurement); cpu: NumPy float32 (the test path)")
    parser.add_argument("--preset", choices=list(GPUS), default=None,
                        help="the preset the planner's predictions use (default: the device's)")
    parser.add_argument("--rows", default=None, help="published rows (1-based, comma-separated; default: all)")
    parser.add_argument("--mamf-budget", type=float, default=150.0, help="seconds of MAMF search (bf16)")
    parser.add_argument("--product-budget", type=float, default=180.0, help="seconds for the planner's products")
    parser.add_argument("--sustained", type=float, default=60.0, help="seconds of back-to-back products")
    parser.add_argument("--sustained-shape", default=None, help="MxNxK (default: the MAMF's shape)")
    parser.add_argument("--window", type=float, default=10.0, help="seconds of the sustained run's windows")
    parser.add_argument("--repeats", type=int, default=5, help="fewest timed calls per shape")
    parser.add_argument("--max-gb", type=float, default=None,
                        help="largest operands of one product, GB (default: half the free GPU memory; CPU 1)")
    parser.add_argument("--seed", type=int, default=0, help="the random shapes of the MAMF search")
    options = parser.parse_args(argv)
    runs = len(published.published_runs())
    try:
        options.rows = list(range(1, runs + 1)) if options.rows is None else \
            [int(row) for row in options.rows.split(",")]
        if not all(1 <= row <= runs for row in options.rows):
            raise ValueError
    except ValueError:
        parser.error(f"--rows takes row numbers from 1 to {runs}, comma-separated")
    if options.sustained_shape is not None:
        try:
            options.sustained_shape = tuple(int(size) for size in options.sustained_shape.lower().split("x"))
            assert len(options.sustained_shape) == 3 and min(options.sustained_shape) > 0
        except (ValueError, AssertionError):
            parser.error(f"--sustained-shape takes MxNxK, e.g. 8192x8192x8192 (not {options.sustained_shape!r})")
    return options


def main(argv: list[str] | None = None) -> int:
    options = parse(argv)
    try:
        device = Device(options.device)
    except RuntimeError as error:
        print(f"measure_gemm: {error}", file=sys.stderr)
        return 2
    preset = options.preset or (preset_for_device(device.name).name if preset_for_device(device.name) else None)
    max_bytes = (options.max_gb * 1e9 if options.max_gb is not None else
                 device.free_bytes() / 2 if device.kind == "gpu" else 1e9)
    print(f"device: {device.name}; preset {preset or 'none'}; dtypes {', '.join(device.dtypes)}", flush=True)
    if device.kind == "gpu":
        print(f"batched bfloat16 (cublasGemmStridedBatchedEx): {device.batched_bf16_error:.2g} from float32 "
              f"({'used' if device.refuses((1, 1, 1, 2), 'bfloat16') is None else 'refused'})", flush=True)
    started = time.monotonic()

    first = next(iter(device.dtypes))
    mamf = {first: search_mamf(device, first, options.mamf_budget, options.repeats, options.seed)}
    print(f"MAMF {first}: {mamf[first]['flops'] / TERA:.1f} TFLOP/s at {mamf[first]['shape']} "
          f"({mamf[first]['tried']} shapes)", flush=True)
    for dtype in list(device.dtypes)[1:]:  # the other dtypes on the first one's leaders
        leaders = [tuple(leader["shape"]) for leader in mamf[first]["leaders"]]
        mamf[dtype] = again(device, dtype, leaders, options.repeats, 0.03, tried=len(leaders), budget_s=0)
        print(f"MAMF {dtype}: {mamf[dtype]['flops'] / TERA:.1f} TFLOP/s at {mamf[dtype]['shape']}", flush=True)

    plans, products = planner_products(options.rows)
    entries = measure_products(device, products, preset, mamf[first]["flops"], options.product_budget,
                               options.repeats, max_bytes)
    done = sum(entry["measured_s"] is not None for entry in entries)
    print(f"products: {done} of {len(entries)} measured", flush=True)

    shape = options.sustained_shape or tuple(mamf[first]["shape"])
    sustained = sustained_run(device, shape, first, options.sustained, options.window) if options.sustained > 0 \
        else None
    if sustained:
        print(f"sustained {shape}: first {_tflops(sustained['first_flops'])}, last "
              f"{_tflops(sustained['last_flops'])} TFLOP/s", flush=True)

    document = {"format": measured.FORMAT, "backend": "cupy" if device.kind == "gpu" else "numpy",
                "device": device.name, "preset": preset, "versions": device.versions,
                "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
                "timing": PHASE_NOTE if device.kind == "gpu" else "median of each shape's calls, wall clock",
                "dtypes": list(device.dtypes), "unsupported": device.unsupported, "mamf": mamf, "plans": plans,
                "products": entries, "sustained": sustained, "seconds": time.monotonic() - started}
    options.out.mkdir(parents=True, exist_ok=True)
    path = options.out / "gemm.json"
    path.write_text(json.dumps(document, indent=1))
    if device.kind == "gpu" and preset is not None:
        document["planner"] = published.measurement_effects(measured.load(path))
    (options.out / "gemm.md").write_text(markdown(document))
    print(f"wrote {path} and {options.out / 'gemm.md'} ({document['seconds']:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
