"""Planner checks run on every rank of a TP group (see mpi_harness): what each rank of `TensorParallelTransformer`
actually holds — its parameter shards and, after one forward, its saved activations — for the planner's
prediction to be compared with in tests/runtime/test_planner.py."""

from __future__ import annotations

from typing import Any

import numpy as np

import collectives as C
from models.transformer import GPTConfig, Transformer
from mpiparallel.axes.tensor_parallel import TensorParallel


def held_bytes(configs: list[dict[str, Any]], rows: int, length: int, recompute: str) -> list[dict[str, Any]]:
    """Per config, with and without SP: this rank's parameter bytes, and the bytes its forward saved (float32)
    in all and per unit."""
    found = []
    tokens = np.random.default_rng(3).integers(0, 32, (rows, length))
    for fields in configs:
        for sequence_parallel in (False, True):
            model = Transformer(GPTConfig(**fields), dtype=np.float32, recompute=recompute).parallelize(
                TensorParallel(C.world(), sequence_parallel))
            _, saved = model.forward(tokens, tokens)
            found.append({"parameters": sum(int(param.data.nbytes) for param in model.parameters()),
                          "activations": saved.nbytes(),
                          "per_unit": [saved.per_unit[unit].nbytes() for unit in range(model.unit_count)]})
    return found
