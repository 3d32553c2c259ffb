"""Rank processes of the replica check on non-tensor values (`tests/engine/test_replica_values.py`).

Each rank saves, for every kind of value in `KINDS`, a state holding one tensor and the value
under the same (shared) name, with ``replica_check="all"``: first a value that differs by rank,
then one that every rank holds alike; then it restores the latter. What happened comes back as
one JSON file per rank.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from spotckpt import CheckpointManager
from spotckpt.errors import ReplicaMismatchError

KINDS: dict[str, Callable[[int], Any]] = {
    "int": lambda r: 1000 + r,
    "float": lambda r: 0.25 + r / 8,
    "numpy_array": lambda r: np.arange(6, dtype=np.float32).reshape(2, 3) + r,
    "numpy_scalar": lambda r: np.float64(1.5 + r),
    "str": lambda r: f"host-{r}",
    "nested": lambda r: {"a": [1, 2, {"b": r}], "c": ("x", r * 0.5), "d": "same"},
    "bytes": lambda r: bytes([1, 2, 3, r]),
}
"""Each kind's value as rank r holds it (r = 0 on every rank: the agreeing case)."""
KEY = "stat"
"""The shared name every value is saved under."""


def same(a: Any, b: Any) -> bool:
    """Whether a restored value equals the saved one, type included (numpy compared as arrays)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, (np.ndarray, np.generic)):
        return bool(a.dtype == b.dtype and a.shape == b.shape and np.array_equal(a, b))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)


def value_matrix(rank: int, world: int, args: dict[str, Any]) -> None:
    """For each kind: a differing value is refused on every rank and nothing is committed; an
    agreeing one commits and restores on every rank."""
    results: dict[str, dict[str, Any]] = {}
    manager = CheckpointManager(args["uri"], preemption=False, replica_check="all")
    for index, (kind, make) in enumerate(KINDS.items()):
        differing, agreeing = 2 * index + 1, 2 * index + 2
        refused = ""
        try:
            manager.save(differing, {"w": torch.ones(8), KEY: make(rank)})
        except ReplicaMismatchError as error:
            refused = str(error)
        steps_after_refusal = manager.steps()
        manager.save(agreeing, {"w": torch.ones(8), KEY: make(0)})
        state = {"w": torch.zeros(8), KEY: make(7)}  # same structure, other values
        restored = manager.restore(state, agreeing)
        results[kind] = {
            "refused": refused,
            "committed_after_refusal": differing in steps_after_refusal,
            "restored_step": restored,
            "restored_equal": same(state[KEY], make(0)) and bool(state["w"].eq(1).all()),
        }
    (Path(args["out"]) / f"values-{rank}.json").write_text(json.dumps(results))
    manager.close()


SCENARIOS: dict[str, Callable[[int, int, dict[str, Any]], None]] = {"value_matrix": value_matrix}


def main() -> None:
    scenario, rank, world, port, raw = sys.argv[1:6]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", rank=int(rank), world_size=int(world), timeout=timedelta(seconds=60)
    )
    SCENARIOS[scenario](int(rank), int(world), json.loads(raw))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
