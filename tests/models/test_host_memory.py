"""Freed host memory kept for the next step (models.host_memory): counted in page faults, in fresh processes.

glibc's thresholds are process-wide and depend on what the process freed before, so every check runs in a child
process of its own. The pattern is a step's in miniature: a block allocated, written and freed, again and again.
At 40 MiB it is above the largest threshold glibc's own adjustment reaches (32 MiB), so with malloc's defaults
every repeat lands on fresh pages — at least one page fault each (4 KiB or 2 MiB pages) — and with the thresholds
set the repeats reuse the first block's pages: no faults.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from models import host_memory

pytestmark = pytest.mark.skipif(host_memory._glibc_mallopt() is None, reason="not glibc: mallopt is not called")

REPEATS = 6
PROGRAM = textwrap.dedent(f"""
    import json, resource, sys
    import numpy as np
    from models import host_memory

    {{setup}}
    def faults():
        return resource.getrusage(resource.RUSAGE_SELF).ru_minflt

    counts = []
    for _ in range({REPEATS}):
        before = faults()
        block = np.empty(40 << 18, np.float32)  # 40 MiB
        block.fill(1.0)
        del block
        counts.append(faults() - before)
    print(json.dumps({{"faults": counts, "status": host_memory.status()}}))
""")


def run_child(setup: str, keep: str = "1") -> dict:
    environment = {**os.environ, host_memory.VARIABLE: keep}
    result = subprocess.run([sys.executable, "-c", PROGRAM.replace("{setup}", setup)], capture_output=True,
                            text=True, timeout=120, env=environment, check=True)
    return json.loads(result.stdout)


def test_kept_memory_is_reused_without_page_faults():
    kept = run_child("assert host_memory.keep_freed_memory()")
    assert kept["status"].startswith("kept"), kept
    assert kept["faults"][0] >= 1, kept  # the first block is fresh pages either way
    assert sum(kept["faults"][1:]) <= 2, kept  # then the heap hands the same pages back


def test_malloc_defaults_fault_on_every_repeat():
    """The same pattern, the thresholds left alone: the baseline the test above must beat (else it proves nothing)."""
    default = run_child("pass")
    assert default["status"].startswith("not asked"), default
    assert min(default["faults"]) >= 1, default


def test_turned_off_by_the_environment_variable():
    off = run_child("assert not host_memory.keep_freed_memory()", keep="0")
    assert off["status"].startswith("off"), off
    assert min(off["faults"]) >= 1, off


def test_a_cpu_transformer_keeps_freed_memory():
    setup = ("from models.config import GPTConfig\nfrom models.transformer import Transformer\n"
             "Transformer(GPTConfig(vocab_size=16, n_positions=8, n_layer=1, n_embd=8, n_head=2))\n")
    kept = run_child(setup)
    assert kept["status"].startswith("kept"), kept
    assert sum(kept["faults"][1:]) <= 2, kept
    assert run_child(setup, keep="0")["status"].startswith("off")


def test_without_glibc_nothing_is_set(monkeypatch):
    monkeypatch.setattr(host_memory, "_glibc_mallopt", lambda: None)
    monkeypatch.setattr(host_memory, "_state", {})  # this process's own status stays as it was
    assert not host_memory.keep_freed_memory()
    assert host_memory.status() == "not glibc (malloc's defaults)"
