"""float16's loss scaling in the step: the scaler of `--loss-scale`, or one that does nothing.

With a scaler, the loss is multiplied by S before backward, every rank votes whether its gradients overflowed
(one all-reduce over the world), and an overflow skips the update on every rank together; the learning-rate
schedule does not advance over skipped steps (`models.precision.LossScaler` keeps the count and the scale).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from models.precision import LossScaler

from ..errors import ConfigError
from .settings import ModelSettings


class StepLossScaler(LossScaler):
    """`LossScaler` as the step uses it: the overflow vote taken, and its fields logged."""

    def skip_step(self, overflowed: Callable[[], bool]) -> bool:
        """Vote (`overflowed`: agreed over every rank), update the scale; whether this step is skipped."""
        return self.update(overflowed())

    def record(self, scale: float, skipped: bool) -> dict[str, Any]:
        return {"loss_scale": scale, "skipped": skipped}


class NoLossScaling:
    """No loss scaling: scale 1, no vote, nothing skipped, nothing logged or saved."""

    scale, skipped = 1.0, 0

    def skip_step(self, overflowed: Callable[[], bool]) -> bool:
        return False

    def record(self, scale: float, skipped: bool) -> dict[str, Any]:
        return {}

    def state_dict(self) -> None:
        return None

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """A checkpoint saved with a scaler, resumed without one: its scale no longer applies."""


def loss_scaler(model: ModelSettings) -> StepLossScaler | NoLossScaling:
    """--loss-scale: "dynamic" (the default for float16 compute), a fixed number, or none (other dtypes)."""
    choice = model.loss_scale or ("dynamic" if model.compute_dtype == "float16" else None)
    if choice is None or choice == "none":
        return NoLossScaling()
    if choice == "dynamic":
        return StepLossScaler()
    try:
        scale = float(choice)
    except ValueError:
        raise ConfigError(f"--loss-scale must be 'dynamic', 'none' or a positive number, got {choice!r}") from None
    if not scale > 0:
        raise ConfigError(f"--loss-scale must be positive, got {choice}")
    return StepLossScaler(scale=scale, dynamic=False)


def forced_overflows(rank: int) -> set[int]:
    """The steps at which this rank pretends its gradients overflowed: MPIPARALLEL_FORCE_OVERFLOW="STEP@RANK,…"
    (for tests and demonstrations of the skip that every rank must agree on)."""
    forced = set()
    for item in filter(None, os.environ.get("MPIPARALLEL_FORCE_OVERFLOW", "").split(",")):
        step, _, on = item.partition("@")
        if int(on or rank) == rank:
            forced.add(int(step))
    return forced
