"""``replica_check="all"`` on non-tensor values under a shared name, with real gloo ranks: a
value that differs by rank is refused like a tensor would be; an agreeing one commits and
restores. One pair of rank processes runs the whole matrix of kinds
(`integrity_worker.value_matrix`)."""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import pytest

from spotckpt.engine.guards import Guard, check_replicas, value_digest
from spotckpt.errors import ReplicaMismatchError

import integrity_worker
from dist_worker import launch_ranks

pytestmark = pytest.mark.process

WORLD = 2


@pytest.fixture(scope="module")
def matrix(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    """Each rank's results over `integrity_worker.VALUE_KINDS`."""
    tmp = tmp_path_factory.mktemp("values")
    args = {"uri": str(tmp / "ck"), "out": str(tmp)}
    results = launch_ranks(
        WORLD, "value_matrix", args, worker=integrity_worker.__file__, timeout=600
    )
    for rank, result in enumerate(results):
        assert result.returncode == 0, f"rank {rank}:\n{result.stdout[-4000:]}"
    return [json.loads((tmp / f"values-{rank}.json").read_text()) for rank in range(WORLD)]


@pytest.mark.timeout(600)
@pytest.mark.parametrize("kind", sorted(integrity_worker.VALUE_KINDS))
def test_a_value_that_differs_by_rank_is_refused_and_an_agreeing_one_restores(
    matrix: list[dict[str, Any]], kind: str
) -> None:
    for rank, results in enumerate(matrix):
        outcome = results[kind]
        assert "'stat" in outcome["refused"], f"rank {rank}: {kind} was not refused"
        assert "rank(s) [0] hold one copy" in outcome["refused"]
        assert "rank(s) [1] hold one copy" in outcome["refused"]
        assert not outcome["committed_after_refusal"]
        assert outcome["restored_step"] is not None and outcome["restored_equal"], rank


def test_equal_values_have_one_digest_whatever_their_objects() -> None:
    shared = "key"
    one = {shared: [shared, shared], "n": np.arange(3), "f": 0.1 + 0.2}
    other = {"key": ["ke" + "y", "k" + "ey"], "n": np.arange(3), "f": 0.30000000000000004}
    assert value_digest(one) == value_digest(other)
    assert value_digest(1) != value_digest(1.0) != value_digest(True)
    assert value_digest(np.arange(3)) != value_digest(np.arange(3, dtype=np.int32))
    assert value_digest([1, 2]) != value_digest((1, 2)) != value_digest([[1], 2])


def test_the_refusal_names_a_value_and_its_ranks() -> None:
    reports = [{"w": 5, "stat": value_digest(r)} for r in (0, 0, 1)]
    with pytest.raises(ReplicaMismatchError, match=r"'stat'.*rank\(s\) \[2\] hold one copy"):
        check_replicas(3, reports)
    assert Guard(3, "all", world_size=3).compares_replicas
