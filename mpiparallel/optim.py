"""Optimizers (SGD, AdamW), gradient-norm clipping and the learning-rate schedule.

The math lives in pure functions on arrays — `sgd_update` and `adamw_update` change one parameter array and its
optimizer state in place and know nothing about names, models or ranks. The classes `SGD` and `AdamW` only
decide which arrays to pass (every parameter, weight decay for ≥2-D weights) and keep the step count. ZeRO
reuses the same functions on one rank's slice of a flat parameter/gradient vector, one call per parameter
segment in the slice (weight decay depends on the parameter): the update is elementwise, so updating slices and
gathering them gives exactly the full update.

`adamw_update` is PyTorch's torch.optim.AdamW (foreach=False, amsgrad=False) step for step (on GPU arrays as
one fused kernel, models.kernels.ADAMW, with the same operations in the same order; on the CPU the same kernel
compiled, models.host_kernels, with the NumPy passes' numbers bit for bit, or those passes where it cannot run):

    p ← p·(1 − lr·wd)
    m ← β1·m + (1 − β1)·g
    v ← β2·v + (1 − β2)·g²
    p ← p − lr/(1 − β1^t) · m / (√v / √(1 − β2^t) + ε)

Communication: none. `global_grad_norm` takes a callback that turns this rank's sum of squares into the global
one, so the caller (who owns the communicators) decides which ranks hold distinct gradient pieces.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from collectives.backend import Array, get_array_module, is_device_array
from models import host_kernels
from models.kernels import ADAMW
from models.parameter import Parameter

from .errors import ConfigError

SCHEDULES = ("constant", "cosine")
CLIP_EPSILON = 1e-6
"""Added to the norm before dividing, as torch.nn.utils.clip_grad_norm_ does (no division by zero)."""


# ---------------------------------------------------------------------------------------------------------------
# Pure updates on arrays (in place; `scratch` is an optional buffer of the parameter's shape and dtype to reuse).
# ---------------------------------------------------------------------------------------------------------------


def sgd_update(param: Array, grad: Array, lr: float, scratch: Array | None = None) -> None:
    """Plain SGD, in place: param ← param − lr·grad (no momentum, no weight decay)."""
    xp = get_array_module(param)
    step = xp.multiply(grad, -lr, out=_scratch_for(param, scratch))
    param += step


CPU_BLOCK = 1 << 18
"""Elements per block of the NumPy AdamW step. Its ten or so passes run over one block of p, g, m, v and the scratch
(five arrays of 1 MiB in float32, which stay in the caches) before the next block, so a large parameter comes from
memory once per step instead of once per pass. Measured on this project's reference CPU (AMD EPYC, 1 MiB L2 per
core, 32 MiB L3) over GPT-2 124M's parameters: 385 ms a step whole, 289 ms in blocks of 2^18 (268 at 2^19, 313 at
2^21, 374 at 2^14: small blocks pay NumPy's per-call cost). A parameter no larger is one block."""


def adamw_update(param: Array, grad: Array, exp_avg: Array, exp_avg_sq: Array, step: int, lr: float,
                 beta1: float, beta2: float, eps: float, weight_decay: float, scratch: Array | None = None) -> None:
    """One AdamW step on `param`, updating the moments `exp_avg` (m) and `exp_avg_sq` (v) in place.

    `step` is the 1-based number of this update (t in the bias corrections). The formulas are PyTorch's
    (PyTorch evaluates m as a lerp and the last line as one addcdiv, so results agree to rounding); one scratch
    buffer holds every intermediate, so a step allocates nothing when `scratch` is given. On the CPU a parameter
    larger than `CPU_BLOCK` elements is updated block by block (the same numbers: every operation is elementwise).
    """
    if step < 1:
        raise ValueError(f"AdamW step count starts at 1, got {step}")
    kernel_arguments = dict(param=param, grad=grad, exp_avg=exp_avg, exp_avg_sq=exp_avg_sq,
                            **adamw_kernel_scalars(step, lr, beta1, beta2, eps, weight_decay),
                            new_param=param, new_exp_avg=exp_avg, new_exp_avg_sq=exp_avg_sq)
    if is_device_array(param):  # one fused pass over p, g, m, v instead of about ten
        ADAMW(**kernel_arguments)
        return
    if host_kernels.run(ADAMW, **kernel_arguments) is not None:  # the same pass compiled for the CPU
        return
    arrays = (param, grad, exp_avg, exp_avg_sq)
    work = _scratch_for(param, scratch)
    if param.size <= CPU_BLOCK or not all(array.flags.c_contiguous for array in (*arrays, work)):
        _adamw_passes(*arrays, work, step, lr, beta1, beta2, eps, weight_decay)
        return
    flat = [array.reshape(-1) for array in (*arrays, work)]  # views: every array is contiguous
    for start in range(0, param.size, CPU_BLOCK):
        block = slice(start, start + CPU_BLOCK)
        _adamw_passes(*(array[block] for array in flat), step, lr, beta1, beta2, eps, weight_decay)


def _adamw_passes(param: Array, grad: Array, exp_avg: Array, exp_avg_sq: Array, work: Array, step: int, lr: float,
                  beta1: float, beta2: float, eps: float, weight_decay: float) -> None:
    """The NumPy step, one operation per pass, every intermediate in `work`."""
    xp = get_array_module(param)
    if weight_decay != 0:
        param *= 1 - lr * weight_decay  # decoupled: shrinks the weight, never enters m or v

    exp_avg *= beta1
    exp_avg += xp.multiply(grad, 1 - beta1, out=work)

    exp_avg_sq *= beta2
    xp.multiply(grad, 1 - beta2, out=work)
    exp_avg_sq += xp.multiply(work, grad, out=work)

    bias_correction1 = 1 - beta1**step
    bias_correction2 = 1 - beta2**step
    step_size = lr / bias_correction1
    denom = xp.sqrt(exp_avg_sq, out=work)
    denom /= math.sqrt(bias_correction2)
    denom += eps
    update = xp.divide(exp_avg, denom, out=work)
    update *= -step_size
    param += update


def adamw_update_many(updates: Sequence[tuple[Array, Array, Array, Array]], step: int, lr: float, beta1: float,
                      beta2: float, eps: float, weight_decay: float) -> bool:
    """`adamw_update` on every (param, grad, exp_avg, exp_avg_sq) of `updates`, in one call of the compiled CPU
    kernel (models.host_kernels.run_many: the numbers of one call each, bit for bit). Python's cost per call (about
    50 µs) is more than the kernel's own time for most parameters of a small model, so an optimizer step over
    dozens of parameters pays it once. False, nothing updated, where the compiled kernel cannot take them all
    (no compiler, GPU arrays, bfloat16, a non-contiguous slice): the caller updates them one at a time."""
    if step < 1:
        raise ValueError(f"AdamW step count starts at 1, got {step}")
    if any(is_device_array(param) for param, *_ in updates):
        return False  # a GPU's fused kernel runs per parameter (adamw_update)
    tensors = [dict(param=param, grad=grad, exp_avg=exp_avg, exp_avg_sq=exp_avg_sq, new_param=param,
                    new_exp_avg=exp_avg, new_exp_avg_sq=exp_avg_sq) for param, grad, exp_avg, exp_avg_sq in updates]
    return host_kernels.run_many(ADAMW, adamw_kernel_scalars(step, lr, beta1, beta2, eps, weight_decay), tensors)


def adamw_kernel_scalars(step: int, lr: float, beta1: float, beta2: float, eps: float,
                         weight_decay: float) -> dict[str, float]:
    """The scalar arguments of the fused ADAMW kernel, computed in Python as `adamw_update` computes them (a decay
    factor of exactly 1 when weight decay is off, so the kernel's p·decay leaves p unchanged)."""
    return {"decay": 1 - lr * weight_decay if weight_decay != 0 else 1.0, "beta1": float(beta1),
            "one_minus_beta1": 1 - beta1, "beta2": float(beta2), "one_minus_beta2": 1 - beta2,
            "step_size": lr / (1 - beta1**step), "eps": float(eps),
            "sqrt_bias_correction2": math.sqrt(1 - beta2**step)}


def _scratch_for(param: Array, scratch: Array | None) -> Array:
    if scratch is None:
        return get_array_module(param).empty_like(param)
    if scratch.shape != param.shape or scratch.dtype != param.dtype:
        raise ValueError(f"scratch {scratch.shape} {scratch.dtype} does not match param {param.shape} {param.dtype}")
    return scratch


def weight_decay_applies(shape: Sequence[int]) -> bool:
    """Decoupled weight decay acts on matrices (embeddings, linear weights), not on biases or LayerNorm gains."""
    return len(shape) >= 2


# ---------------------------------------------------------------------------------------------------------------
# Optimizers over named parameters.
# ---------------------------------------------------------------------------------------------------------------


class _Optimizer:
    """Shared bookkeeping: the parameters, the step count, one scratch buffer as large as the largest parameter."""

    name = ""

    def __init__(self, params: Sequence[Parameter], lr: float) -> None:
        if lr < 0:
            raise ConfigError(f"learning rate must be non-negative, got {lr}")
        self.params = list(params)
        names = [param.name for param in self.params]
        if len(set(names)) != len(names):
            raise ValueError("optimizer parameters must have distinct names")
        self.lr = lr
        self.step_count = 0
        self._scratch: dict[Any, Array] = {}
        self._scratch_size = max((param.data.size for param in self.params), default=0)

    def scratch_like(self, data: Array) -> Array:
        """A view of a reused buffer with `data`'s shape (one buffer per dtype and backend)."""
        xp = get_array_module(data)
        key = (xp.__name__, data.dtype)
        if key not in self._scratch:
            self._scratch[key] = xp.empty(self._scratch_size, dtype=data.dtype)
        return self._scratch[key][:data.size].reshape(data.shape)

    def step(self, lr: float | None = None) -> None:
        """Apply one update to every parameter from its `.grad`; `lr` overrides the constructor's for this step.

        Mixed precision: a parameter with a `master` copy (the weights at --dtype) is updated there, from its
        gradient widened to the master's dtype, and its working copy `data` re-rounded from it (to nearest
        even); the moments are at the master's dtype."""
        self.step_count += 1
        updates = []
        for param in self.params:
            master = getattr(param, "master", None)
            if master is None:
                updates.append((param, param.data, param.grad))
            else:
                updates.append((param, master, param.grad.astype(master.dtype, copy=False)))
        self.update_all(updates, self.lr if lr is None else lr)
        for param in self.params:
            if getattr(param, "master", None) is not None:
                param.data[...] = param.master

    def update_all(self, updates: Sequence[tuple[Parameter, Array, Array]], lr: float) -> None:
        """Update every (param, weights, grad) of the step: one at a time, unless a subclass can do better."""
        for param, weights, grad in updates:
            self.update(param, weights, grad, lr)

    def update(self, param: Parameter, weights: Array, grad: Array, lr: float) -> None:
        """Update `weights` (param's data, or its master copy) from `grad` in place."""
        raise NotImplementedError

    def state_dict(self) -> dict[str, Any]:
        """The optimizer's kind and step count; subclasses add their per-parameter arrays keyed by name."""
        return {"optimizer": self.name, "step": self.step_count}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a `state_dict()`; hyperparameters stay those given to the constructor."""
        if state.get("optimizer") != self.name:
            raise ConfigError(f"the checkpoint holds {state.get('optimizer')!r} optimizer state, "
                              f"this run uses {self.name!r}")
        self.step_count = int(state["step"])


class SGD(_Optimizer):
    """w ← w − lr·g for every parameter."""

    name = "sgd"

    def update(self, param: Parameter, weights: Array, grad: Array, lr: float) -> None:
        sgd_update(weights, grad, lr, self.scratch_like(weights))


def _zeros_like_master(param: Any, dtype: Any = None) -> Array:
    """Optimizer state for a parameter: zeros at `dtype`, else at its master's dtype (mixed precision), else its
    data's."""
    reference = getattr(param, "master", None)
    reference = param.data if reference is None else reference
    return get_array_module(reference).zeros_like(reference, dtype=dtype)


class AdamW(_Optimizer):
    """PyTorch's AdamW; weight decay only on parameters with ndim ≥ 2; moments kept per parameter name.

    `moment_dtype` (default: the master weights') is the dtype m and v are stored in. bfloat16 (DeepSeek-V3's
    choice, `--exp-avg-dtype bfloat16`) halves their 8 bytes per parameter to 4: each step widens them to the
    weights' dtype, updates there, and rounds them back once (to nearest even) — m and v are running averages,
    whose 2⁻⁸ relative rounding per step is noise next to the gradients', and bfloat16 keeps float32's exponent
    range, so v (squares of small gradients) does not underflow."""

    name = "adamw"

    def __init__(self, params: Sequence[Parameter], lr: float, betas: tuple[float, float] = (0.9, 0.95),
                 eps: float = 1e-8, weight_decay: float = 0.0, moment_dtype: Any = None) -> None:
        super().__init__(params, lr)
        beta1, beta2 = betas
        if not (0 <= beta1 < 1 and 0 <= beta2 < 1):
            raise ConfigError(f"AdamW betas must lie in [0, 1), got {betas}")
        if eps < 0 or weight_decay < 0:
            raise ConfigError(f"AdamW eps and weight decay must be non-negative, got {eps} and {weight_decay}")
        self.beta1, self.beta2, self.eps, self.weight_decay = beta1, beta2, eps, weight_decay
        self.exp_avg = {p.name: _zeros_like_master(p, moment_dtype) for p in self.params}
        self.exp_avg_sq = {p.name: _zeros_like_master(p, moment_dtype) for p in self.params}

    def update_all(self, updates: Sequence[tuple[Parameter, Array, Array]], lr: float) -> None:
        """The parameters whose moments are at their weights' dtype in one compiled call per weight decay where the
        CPU's kernel can take them (adamw_update_many), every other one by `update`."""
        by_decay: dict[float, list[tuple[Parameter, Array, Array]]] = {}
        one_at_a_time = []
        for update in updates:
            param, weights, _ = update
            if self.exp_avg[param.name].dtype == weights.dtype:
                by_decay.setdefault(self._decay(param), []).append(update)
            else:
                one_at_a_time.append(update)  # narrow moments: widened and rounded back by `update`
        for decay, group in by_decay.items():
            arrays = [(weights, grad, self.exp_avg[param.name], self.exp_avg_sq[param.name])
                      for param, weights, grad in group]
            if not adamw_update_many(arrays, self.step_count, lr, self.beta1, self.beta2, self.eps, decay):
                one_at_a_time.extend(group)
        super().update_all(one_at_a_time, lr)

    def _decay(self, param: Parameter) -> float:
        # A ZeRO shard segment is a flat slice of a parameter: its `full_shape` says whether the parameter decays.
        return self.weight_decay if weight_decay_applies(getattr(param, "full_shape", param.data.shape)) else 0.0

    def update(self, param: Parameter, weights: Array, grad: Array, lr: float) -> None:
        decay = self._decay(param)
        stored = self.exp_avg[param.name], self.exp_avg_sq[param.name]
        exp_avg, exp_avg_sq = (moment.astype(weights.dtype, copy=False) for moment in stored)  # narrow: widened
        adamw_update(weights, grad, exp_avg, exp_avg_sq, self.step_count, lr, self.beta1, self.beta2, self.eps,
                     decay, self.scratch_like(weights))
        for moment, updated in zip(stored, (exp_avg, exp_avg_sq), strict=True):
            if updated is not moment:
                moment[...] = updated  # rounded back to the stored dtype

    def state_dict(self) -> dict[str, Any]:
        """{"optimizer": "adamw", "step": t, "exp_avg": {name: m}, "exp_avg_sq": {name: v}} (arrays not copied)."""
        return super().state_dict() | {"exp_avg": dict(self.exp_avg), "exp_avg_sq": dict(self.exp_avg_sq)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        for key in ("exp_avg", "exp_avg_sq"):
            _copy_named_arrays(state.get(key, {}), getattr(self, key), key)


def _copy_named_arrays(source: dict[str, Array], target: dict[str, Array], what: str) -> None:
    """Copy checkpoint arrays into the optimizer's own buffers (keeping their backend and dtype)."""
    if set(source) != set(target):
        missing, unexpected = sorted(set(target) - set(source)), sorted(set(source) - set(target))
        raise ConfigError(f"optimizer state {what} does not match the model: missing {missing[:3]}, "
                          f"unexpected {unexpected[:3]}")
    for name, buffer in target.items():
        value = source[name]
        if tuple(value.shape) != tuple(buffer.shape):
            raise ConfigError(f"optimizer state {what}[{name}] has shape {tuple(value.shape)}, "
                              f"the parameter has {tuple(buffer.shape)}")
        buffer[...] = get_array_module(buffer).asarray(value)


# ---------------------------------------------------------------------------------------------------------------
# Gradient norm and clipping.
# ---------------------------------------------------------------------------------------------------------------


def local_sum_of_squares(grads: Sequence[Array]) -> float:
    """Σ g² over the given arrays, accumulated in float64 whatever the gradients' dtype."""
    total = 0.0
    for grad in grads:
        flat = grad.reshape(-1).astype(np.float64, copy=False)
        total += float(get_array_module(flat).dot(flat, flat))
    return total


def global_grad_norm(params: Sequence[Parameter],
                     reduce_sum_of_squares: Callable[[float], float] | None = None,
                     counts: Callable[[Any], bool] | None = None) -> float:
    """The L2 norm of all gradients together.

    `reduce_sum_of_squares` receives this rank's sum of squares and returns the sum over every rank (an
    all-reduce); leave it out when grads are whole. `counts(param)` says whether this rank's copy of a
    gradient is the one counted in that sum (replicas must count once); default: all.
    """
    total = local_sum_of_squares([param.grad for param in params if counts is None or counts(param)])
    if reduce_sum_of_squares is not None:
        total = float(reduce_sum_of_squares(total))
    return math.sqrt(total)


def clip_grad_norm(params: Sequence[Parameter], max_norm: float,
                   reduce_sum_of_squares: Callable[[float], float] | None = None,
                   counts: Callable[[Any], bool] | None = None) -> float:
    """Scale every grad by min(1, max_norm / (norm + 1e-6)) in place; return the norm before clipping.

    That is torch.nn.utils.clip_grad_norm_'s coefficient. max_norm ≤ 0 turns clipping off (the norm is still
    computed and returned, for logging).
    """
    norm = global_grad_norm(params, reduce_sum_of_squares, counts)
    if max_norm <= 0:
        return norm
    clip_coef = max_norm / (norm + CLIP_EPSILON)
    if clip_coef < 1:
        for param in params:
            param.grad *= clip_coef
    return norm


# ---------------------------------------------------------------------------------------------------------------
# Learning-rate schedule.
# ---------------------------------------------------------------------------------------------------------------


def learning_rate(step: int, base_lr: float, schedule: str = "constant", warmup_steps: int = 0,
                  total_steps: int | None = None, min_lr_fraction: float = 0.1) -> float:
    """The learning rate of 0-based `step`.

    Warmup (step < warmup_steps): base_lr·(step + 1)/warmup_steps, a linear ramp whose last step reaches base_lr.
    Afterwards "constant" stays at base_lr, and "cosine" follows half a cosine from base_lr at step warmup_steps
    to min_lr = min_lr_fraction·base_lr at step total_steps − 1 (and stays at min_lr beyond):

        progress = (step − warmup_steps) / (total_steps − 1 − warmup_steps)
        lr = min_lr + (base_lr − min_lr)·(1 + cos(π·progress))/2

    When warmup leaves a single cosine step (total_steps − 1 == warmup_steps), that step is already at min_lr.
    """
    check_schedule(base_lr, schedule, warmup_steps, total_steps, min_lr_fraction)
    if step < 0:
        raise ConfigError(f"step must be non-negative, got {step}")
    if step < warmup_steps:
        return base_lr * (step + 1) / warmup_steps
    if schedule == "constant":
        return base_lr
    assert total_steps is not None  # check_schedule guarantees it for cosine
    min_lr = min_lr_fraction * base_lr
    decay_steps = total_steps - 1 - warmup_steps
    progress = 1.0 if decay_steps <= 0 else min(1.0, (step - warmup_steps) / decay_steps)
    return min_lr + (base_lr - min_lr) * 0.5 * (1 + math.cos(math.pi * progress))


def check_schedule(base_lr: float, schedule: str, warmup_steps: int, total_steps: int | None,
                   min_lr_fraction: float) -> None:
    """Raise ConfigError for settings `learning_rate` cannot follow (call it once before training starts)."""
    if schedule not in SCHEDULES:
        raise ConfigError(f"unknown learning-rate schedule {schedule!r}; choose one of {', '.join(SCHEDULES)}")
    if base_lr < 0:
        raise ConfigError(f"learning rate must be non-negative, got {base_lr}")
    if warmup_steps < 0:
        raise ConfigError(f"warmup steps must be non-negative, got {warmup_steps}")
    if not 0 <= min_lr_fraction <= 1:
        raise ConfigError(f"min_lr_fraction must lie in [0, 1], got {min_lr_fraction}")
    if schedule == "cosine" and (total_steps is None or total_steps < 1):
        raise ConfigError(f"the cosine schedule needs total_steps ≥ 1, got {total_steps}")
