"""The resume matrix as pytest cases: each case is a param; a seeded sample runs in `make test`,
the rest is marked slow (`make test-all`). See `harness` for the contract and the comparisons.

``SPOTCKPT_MATRIX_SEED`` picks the sample (default 0); the seed and the sampled case ids are
printed after collection, and the table of results at the end of the session.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from . import harness

SEED = int(os.environ.get("SPOTCKPT_MATRIX_SEED", "0"))
STACKS = harness.discover()
CASES = harness.matrix(STACKS)
SAMPLE = harness.sample(CASES, STACKS, SEED)
SAMPLED = {case.id for case in SAMPLE}


def _param(case: harness.Case) -> object:
    marks = () if case.id in SAMPLED else (pytest.mark.slow,)
    return pytest.param(case, id=case.id, marks=marks)


@pytest.fixture(scope="session")
def matrix_session(tmp_path_factory: pytest.TempPathFactory) -> harness.Session:
    """One session for every case, so that reference runs are shared."""
    workdir = Path(tmp_path_factory.mktemp("resume-matrix"))
    return harness.Session(workdir, STACKS)


@pytest.mark.process
@pytest.mark.parametrize("case", [_param(case) for case in CASES])
def test_resume_matrix(case: harness.Case, matrix_session: harness.Session) -> None:
    result = matrix_session.run_case(case)
    assert result.ok, result.report()


def test_the_matrix_is_a_covering() -> None:
    """Each stack's loaders meet every (workers, signal) pair, and every point is there."""
    for name, stack in STACKS.items():
        cases = [c for c in CASES if c.stack == name and c.point in harness.POINTS]
        for loader in {c.loader for c in cases}:
            signalled = [c for c in cases if c.loader == loader and c.signal != "none"]
            if len(signalled) >= len(harness.COMBOS):
                pairs = {(c.workers, c.signal) for c in signalled}
                assert pairs == set(harness.COMBOS), (name, loader, pairs)
        assert {c.point for c in cases} == set(harness.POINTS) & set(stack.points), name


def test_the_sample_is_reproducible_and_within_budget() -> None:
    assert [c.id for c in harness.sample(CASES, STACKS, SEED)] == [c.id for c in SAMPLE]
    assert len({c.stack for c in SAMPLE}) >= min(len(STACKS), 4)
    refs: set[object] = set()
    estimated = 0.0
    for case in SAMPLE:
        new_ref = harness.needs_reference(case) and harness.ref_key(case) not in refs
        refs.add(harness.ref_key(case))
        estimated += (harness.runs_of(case) + new_ref) * harness.estimate(case, STACKS[case.stack])
    assert estimated <= harness.SAMPLE_BUDGET_S


def test_pause_steps_follow_the_epochs() -> None:
    epochs = {s: (s - 1) // 6 for s in range(1, 21)}  # 6 steps an epoch
    chosen = harness.choose_steps(epochs, 20, 4)
    assert chosen == {"mid": 5, "later": 13, "boundary": 12}
