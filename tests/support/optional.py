"""What the suite needs beyond the install requirements (the interop extra's torch and transformers, a Chromium
for the planner's map): a skip that says how to install it on a developer's machine, a failure in continuous
integration (CI=true, set by .ci/run and by every CI service), where a skip would let a green run hide an
untested part."""

from __future__ import annotations

import importlib
import os
from types import ModuleType

import pytest

IN_CI = os.environ.get("CI", "").lower() in ("true", "1", "yes")  # services write it either way


def missing(reason: str) -> None:
    """Skip the calling test for want of something optional; under CI=true, fail it instead."""
    if IN_CI:
        pytest.fail(f"CI=true, so this may not skip: {reason}", pytrace=False)
    pytest.skip(reason)


def optional_module(name: str, reason: str) -> ModuleType:
    """`import name`, or `missing(reason)` when it is not installed."""
    try:
        return importlib.import_module(name)
    except ImportError:
        missing(f"{reason} ({name} is not installed)")
        raise  # not reached: missing() always raises
