"""The crash explorer's killed-process sample (issue 46): real jobs SIGKILLed at a save's
points, on one rank and on one of 2 gloo ranks, leave roots that recover with every invariant
kept (`killed`); and a killed job really died by SIGKILL at the named call."""

from __future__ import annotations

import random
import signal
from pathlib import Path

import pytest
from explore import Verdict, Workspace
from killed import (
    kill_child,
    sample_killed,
    sample_killed_ranks,
    save_point,
)
from scenarios import Scenario, scenarios

from spotckpt.layout import manifest_key
from spotckpt.storage import open_store

SEED = 46
SAVES = [scenario for scenario in scenarios() if scenario.op == "saves"]


def _rank_one_save_point(name: str) -> bool:
    return name.startswith("1:") and save_point(name)


def _clean(verdicts: list[Verdict]) -> None:
    bad = [f"{v.scenario} {v.point}: {v.violations}" for v in verdicts if v.violations]
    if bad:
        pytest.fail("\n".join(bad))


@pytest.mark.process
@pytest.mark.timeout(300)
def test_killed_sample_one_rank(tmp_path: Path) -> None:
    verdicts = sample_killed(SAVES, 3, SEED, Workspace.create(tmp_path), among=save_point)
    assert len(verdicts) == 3
    _clean(verdicts)


@pytest.mark.process
@pytest.mark.timeout(600)
def test_killed_sample_two_ranks(tmp_path: Path) -> None:
    """Rank 1 dies at one of its save points; rank 0, which commits, must give up within the
    lowered collective timeout without committing the step in flight."""
    chosen = random.Random(SEED).choice(SAVES)
    space = Workspace.create(tmp_path)
    verdicts = sample_killed_ranks([chosen], 1, SEED, space, among=_rank_one_save_point)
    assert len(verdicts) == 1
    _clean(verdicts)


@pytest.mark.process
@pytest.mark.timeout(240)
def test_child_dies_by_sigkill_at_the_point(tmp_path: Path) -> None:
    scenario = Scenario.parse("saves-plain-local")
    point = f"0:put:{manifest_key(3)}#0"
    space = Workspace.create(tmp_path)
    root = space.fresh(scenario)
    ended = kill_child(scenario, root, point)
    assert ended.status == -signal.SIGKILL, ended.log
    assert ended.killing == point
    told = [(mark.what, mark.step) for mark in ended.marks]
    assert told == [("committed", 1), ("saving", 2), ("committed", 2), ("saving", 3)]
    bucket = open_store(root.uri)
    assert bucket.exists(manifest_key(2))
    assert not bucket.exists(manifest_key(3))  # it died before the put, not after
