"""Settings every test shares."""

from __future__ import annotations

import os

import pytest

from mpiparallel.data.prepare import CACHE_VARIABLE


@pytest.fixture(scope="session", autouse=True)
def fresh_cache_folder(tmp_path_factory: pytest.TempPathFactory) -> None:
    """The runs a test starts (and their ranks) keep prepared data, such as the default corpus's BPE, in one folder
    that starts empty in every test session: the suite does not depend on what a user's cache holds, and the first
    run without --data builds it as a first run on a new machine does."""
    os.environ[CACHE_VARIABLE] = str(tmp_path_factory.mktemp("cache"))
