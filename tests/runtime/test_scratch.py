"""The scratch pool: buffers of 1 MiB or more are reused, never shared while in use, and bounded in total."""

from __future__ import annotations

import numpy as np
import pytest

import collectives.scratch as pool
from collectives.scratch import scratch

LARGE = pool.POOLED_BYTES // 8  # float64 elements in one pooled buffer


@pytest.fixture(autouse=True)
def empty_pool():
    pool.release_pool()
    yield
    pool.release_pool()


def test_a_large_buffer_is_given_back_and_reused():
    x = np.zeros(3, np.float64)
    with scratch(x, LARGE) as first:
        assert first.shape == (LARGE,) and first.dtype == np.float64
        assert pool.pooled_bytes() == 0  # in use
        first_address = first.__array_interface__["data"][0]
    assert pool.pooled_bytes() == LARGE * 8
    with scratch(x.astype(np.float32), 2 * LARGE) as second:  # another dtype reuses the same bytes
        assert second.dtype == np.float32
        assert second.__array_interface__["data"][0] == first_address


def test_buffers_in_use_at_once_are_distinct():
    x = np.zeros(1)
    with scratch(x, LARGE) as a, scratch(x, LARGE) as b:
        assert not np.shares_memory(a, b)
    assert pool.pooled_bytes() == 2 * LARGE * 8


def test_small_buffers_are_not_pooled():
    with scratch(np.zeros(1), 16) as small:
        assert small.shape == (16,)
    assert pool.pooled_bytes() == 0


def test_a_generator_closed_half_way_gives_its_buffer_back():
    def algorithm():
        with scratch(np.zeros(1), LARGE) as landing:
            yield landing
            yield landing

    steps = algorithm()
    next(steps)
    assert pool.pooled_bytes() == 0
    steps.close()
    assert pool.pooled_bytes() == LARGE * 8


def test_the_pool_keeps_at_most_its_limit(monkeypatch):
    monkeypatch.setattr(pool, "POOL_LIMIT_BYTES", 3 * LARGE * 8)
    x = np.zeros(1)
    with scratch(x, LARGE), scratch(x, 2 * LARGE), scratch(x, 3 * LARGE):
        pass
    assert pool.pooled_bytes() == 3 * LARGE * 8  # the largest went; what is left fits the limit
