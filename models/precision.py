"""Mixed precision: which tensor lives in which dtype, the casts between them, and the loss scaler's arithmetic.

Three dtypes (`--dtype`, `--compute-dtype`, `--grad-dtype`; DESIGN.md's Precision contract):

    tensor                                          dtype            why
    master weights                                  master (--dtype)  updates of lr·g ≪ w vanish in bfloat16
    AdamW moments m, v                              master, or        running averages: bf16's 2⁻⁸ is noise
                                                    --exp-avg-dtype   next to the gradients' (DeepSeek-V3: bf16)
    weights' working copy (Parameter.data)          compute          what the GEMMs read; re-rounded after a step
    activations, and every activation sent          compute          half the memory and half the bytes
      between ranks (TP, SP, CP, PP, EP)
    gradients (Parameter.grad), their reduction     grad             summed over microbatches and ranks
    inside a layer: GEMM accumulation, norm and      float32 or wider  a bf16 sum of 1000 terms keeps 2-3 digits
      softmax statistics, logits → loss
    the gradient norm                               float64          a sum of squares over every parameter

and with `--fp8 blockwise` (`models.fp8`; needs bfloat16 compute):

    the operands of the three GEMMs of every        E4M3 + float32   4 significant bits suffice for a GEMM's
      linear inside the blocks (attention q/k/v      scale per tile   inputs when each 1×128 tile (128×128
      and output projections, MLP/SwiGLU, experts)                    block of a weight) has its own scale
    their accumulation                              float32, every   the tensor core's ~14-bit accumulator
                                                    128 products      loses ≈ K·2⁻¹⁴; promotion bounds K at 128
    their outputs, and what the layers save         compute (bf16)   the next layer's input, cast on the fly
    embedding, LM head, MoE router, norms,           compute (bf16)   small GEMMs or sensitive ones: logits,
      attention core (q·kᵀ, softmax, p·v), MoE                        gates and statistics decide too much to
      combine, the weights' working copy                              be rounded to 4 bits

bfloat16 on NumPy is `ml_dtypes.bfloat16`, whose arithmetic runs as scalar loops: a layer computing in a narrow
dtype (`Narrowed`) therefore widens its inputs and saved tensors to float32, runs its float32 code — GEMMs on
BLAS, bf16-rounded operands with float32 accumulation, as a tensor core does — and rounds its outputs and what
it saves back to the compute dtype. The arithmetic of a narrow run is thus: every layer's result rounded once to
the compute dtype, every weight a rounded copy of its master.

No communication here; the loss scaler's overflow vote is the caller's all-reduce (`LossScaler.update` takes
the agreed result).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from collectives.backend import NARROW_FLOATS, Array, dtype_named, get_array_module
from collectives.backend import is_floating as _is_floating

DTYPES = {name: dtype_named(name) for name in ("bfloat16", "float16", "float32", "float64")}


def is_narrow(dtype: Any) -> bool:
    """bfloat16 or float16: stored narrow, computed in float32."""
    return np.dtype(dtype) in NARROW_FLOATS


def is_floating(dtype: Any) -> bool:
    """A floating-point dtype, ml_dtypes' bfloat16 included (NumPy files it under kind 'V')."""
    return _is_floating(np.dtype(dtype))


def widen(x: Array) -> Array:
    """x as float32 when it is narrow (a copy), else x itself."""
    return x.astype(np.float32) if is_narrow(x.dtype) else x


def narrow(x: Array, dtype: Any) -> Array:
    """x rounded to the narrow `dtype` (to nearest even), or x itself when `dtype` is not narrow. A value beyond
    the dtype's range becomes ±inf without a warning: float16's loss scaler looks for exactly that."""
    if not is_narrow(dtype) or x.dtype == dtype:
        return x
    with np.errstate(over="ignore"):
        return x.astype(dtype)


def _convert(value: Any, convert: Any) -> Any:
    """`value` with every array in it (Saved objects, lists, tuples, dicts, nested) replaced by convert(array)."""
    if hasattr(value, "__dict__") and type(value).__name__ == "Saved":
        for key, item in vars(value).items():
            setattr(value, key, _convert(item, convert))
        return value
    if isinstance(value, list):
        return [_convert(item, convert) for item in value]
    if isinstance(value, tuple):
        return tuple(_convert(item, convert) for item in value)
    if isinstance(value, dict):
        return {key: _convert(item, convert) for key, item in value.items()}
    if hasattr(value, "dtype") and getattr(value, "ndim", 0) > 0 and is_floating(value.dtype):
        return convert(value)
    return value


def narrow_saved(saved: Any, dtype: Any, names: tuple[str, ...]) -> None:
    """Round the named entries of a `Saved` (arrays, or lists of them) to `dtype` when it is narrow, in place:
    what a layer keeps for backward takes the compute dtype's memory."""
    if is_narrow(dtype):
        for name in names:
            setattr(saved, name, _convert(getattr(saved, name), lambda array: narrow(array, dtype)))


def widen_saved(saved: Any, names: tuple[str, ...]) -> None:
    """The inverse of `narrow_saved` before backward: the named entries as float32 (unchanged when not narrow)."""
    for name in names:
        value = getattr(saved, name, None)
        if value is not None:
            setattr(saved, name, _convert(value, widen))


class Narrowed:
    """A layer run in float32 on narrow tensors: inputs and saved tensors widened on the way in, outputs and saved
    tensors (but its `statistics`) rounded to `dtype` on the way out. Gradients are added into `Parameter.grad`
    by the float32 code, at the grad dtype. Only layers without communication are wrapped: collectives see the
    narrow tensors."""

    def __init__(self, layer: Any, dtype: Any, statistics: tuple[str, ...] = ()) -> None:
        """`statistics`: names of saved entries kept at float32 (a norm's 1/rms, 1/std and its weights' gradients
        between the input and the weight pass: `_Norm.kept_wide`)."""
        self.layer, self.dtype, self.statistics = layer, np.dtype(dtype), statistics

    def __getattr__(self, name: str) -> Any:  # the wrapped layer's parameters and settings
        return getattr(self.__dict__["layer"], name)

    def _narrowed(self, saved: Any) -> Any:
        kept = {name: getattr(saved, name) for name in self.statistics if hasattr(saved, name)}
        _convert(saved, lambda array: narrow(array, self.dtype))
        for name, value in kept.items():
            setattr(saved, name, value)
        return saved

    def forward(self, x: Array, *args: Any, **kwargs: Any) -> tuple[Any, Any]:
        out, saved = self.layer.forward(widen(x), *args, **kwargs)
        return (narrow(out, self.dtype) if hasattr(out, "dtype") else out), self._narrowed(saved)

    def backward_input(self, saved: Any, dout: Array | None = None) -> Array | None:
        _convert(saved, widen)
        dx = self.layer.backward_input(saved, None if dout is None else widen(dout))
        self._narrowed(saved)
        return None if dx is None else narrow(dx, self.dtype)

    def backward_weights(self, saved: Any) -> None:
        self.layer.backward_weights(_convert(saved, widen))

    def backward(self, saved: Any, dout: Array | None = None) -> Array | None:
        _convert(saved, widen)
        dx = self.layer.backward_input(saved, None if dout is None else widen(dout))
        self.layer.backward_weights(saved)
        return None if dx is None else narrow(dx, self.dtype)


# -- bytes per parameter (the ZeRO paper's accounting, used by --memory-report and the planner) -----------------


def model_state_bytes(compute: Any, master: Any, grad: Any, optimizer: str = "adamw", zero: int = 0,
                      dp: int = 1, moments: Any = None) -> dict[str, float]:
    """Bytes per parameter each rank holds in parameters, gradients and optimizer state.

    parameters: the compute dtype's working copy (ZeRO-3: ÷ dp); gradients: the grad dtype (ZeRO-2/3: ÷ dp);
    optimizer state: AdamW's two moments at `moments` (default: the master dtype), plus the master weights when
    the compute dtype is narrower (ZeRO-1/2/3: ÷ dp). bf16 compute, float32 grads and master: 2 + 4 + 12 = 18 B;
    bf16 grads: the paper's 2 + 2 + 12 = 16 B; ZeRO-1 over 2 ranks with float32 grads: 2 + 4 + 6 = 12 B;
    DeepSeek-V3's bf16 moments with float32 grads and master: 2 + 4 + (4 + 4) = 14 B. FP8 adds nothing here:
    the E4M3 copies of a weight live only during its GEMMs (the working copy stays bf16)."""
    compute, master, grad = dtype_named(compute), dtype_named(master), dtype_named(grad)
    moment_size = dtype_named(moments).itemsize if moments is not None else master.itemsize
    state = (2 * moment_size if optimizer == "adamw" else 0) + (compute != master) * master.itemsize
    return {"parameters": compute.itemsize / (dp if zero >= 3 else 1),
            "gradients": grad.itemsize / (dp if zero >= 2 else 1),
            "optimizer_state": state / (dp if zero >= 1 else 1)}


# -- loss scaling (float16) ------------------------------------------------------------------------------------


@dataclass
class LossScaler:
    """The loss scale S: backward starts from S·d(loss), so that float16 gradients stay above its 6·10⁻⁸ floor;
    the optimizer sees the gradients divided by S again.

    Dynamic (`dynamic=True`, the default for float16): start at 2^16; after `growth_interval` (1000) clean steps
    in a row, double; on an overflow (a gradient that is inf or NaN on any rank — the caller agrees on it over
    every rank before calling `update`), skip the step, and after `hysteresis` (2) overflows halve S, never
    below 1. A fixed scale never changes; its overflows still skip the step."""

    scale: float = 2.0**16
    dynamic: bool = True
    growth_interval: int = 1000
    hysteresis: int = 2
    clean_steps: int = 0
    overflows_left: int = 2
    skipped: int = 0

    def update(self, overflow: bool) -> bool:
        """Record one step's agreed overflow vote; returns whether the step must be skipped."""
        if overflow:
            self.skipped += 1
            self.clean_steps = 0
            if self.dynamic:
                self.overflows_left -= 1
                if self.overflows_left <= 0:
                    self.scale = max(self.scale / 2, 1.0)
                    self.overflows_left = self.hysteresis
            return True
        self.clean_steps += 1
        if self.dynamic and self.clean_steps % self.growth_interval == 0:
            self.scale *= 2
        return False

    def state_dict(self) -> dict[str, Any]:
        return {"scale": self.scale, "clean_steps": self.clean_steps, "overflows_left": self.overflows_left,
                "skipped": self.skipped}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.scale = float(state["scale"])
        self.clean_steps, self.overflows_left = int(state["clean_steps"]), int(state["overflows_left"])
        self.skipped = int(state["skipped"])


def has_overflow(grads: list[Array]) -> bool:
    """Whether any gradient holds an inf or NaN (this rank's; the caller agrees over every rank)."""
    return any(not bool(get_array_module(grad).isfinite(grad).all()) for grad in grads if grad is not None)
