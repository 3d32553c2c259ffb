"""The crash explorer in `make test`: a seeded sample of trace-derived crash points over the
scenarios, the points where violations were found (kept as regressions), and planted bugs that
the explorer must catch (so that "no violations" means something).

The whole exploration is `make crash` (`python tests/crash/explore.py`); `SPOTCKPT_CRASH_SEED`
picks this sample (default 46).
"""

from __future__ import annotations

import os
import random
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from explore import (
    Plan,
    Verdict,
    Workspace,
    _at_most_per_server,
    explore,
    explore_point,
    plan,
    record,
    report,
)
from recorder import CRASH_KINDS
from scenarios import Scenario, scenarios

import spotckpt.policy
from spotckpt.catalog import Catalog
from spotckpt.layout import manifest_key
from spotckpt.mirroring import Mirror, StepCopy

SEED = int(os.environ.get("SPOTCKPT_CRASH_SEED", "46"))
SAMPLE_POINTS = 300
SAMPLE_SCENARIOS = 10
ALWAYS_SAMPLED = ("saves", "gc", "mirror", "overwrite")
"""Operations a scenario of which is always in the sample."""
OVERWRITE_PUT = "0:put:step-000000005/manifest.json#1"
"""The overwriting save's manifest put (``#0`` is the set-up's first save)."""


@pytest.fixture
def space(tmp_path: Path) -> Iterator[Workspace]:
    yield Workspace.create(tmp_path / "crash")


def _only(verdicts: list[Verdict]) -> list[str]:
    return [f"{v.scenario} {v.point} {v.kind}: {v.violations}" for v in verdicts if v.violations]


@pytest.mark.timeout(300)
def test_a_sample_of_crash_points_keeps_every_invariant(space: Workspace) -> None:
    """At least 300 trace-derived points (a crash before a call, or after it with the answer
    lost) on scenarios drawn from every operation (saves, gc, a mirror's copy and DCP's
    overwrite always among them); each state recovered and checked."""
    rng = random.Random(SEED)
    rebuilt = [s for s in scenarios() if not s.tier]
    chosen = [rng.choice([s for s in rebuilt if s.op == op]) for op in ALWAYS_SAMPLED]
    chosen += rng.sample([s for s in rebuilt if s not in chosen], SAMPLE_SCENARIOS - len(chosen))
    todo = plan(chosen, CRASH_KINDS, space, SAMPLE_POINTS, SEED)
    verdicts = explore(todo, space)
    lines = list(report(verdicts))
    print("\n".join(lines))
    assert len(verdicts) >= SAMPLE_POINTS
    assert lines[-1] == f"crash points explored: {len(verdicts)}, violations: 0", _only(verdicts)


REGRESSIONS = [
    # gc (safety age 0) between the commit's existence check and the manifest's put: the
    # manifest was committed over deleted objects; now the commit checks again and withdraws it.
    ("saves-plain-local", "0:put:step-000000002/manifest.json#0", "gc"),
    ("saves-incremental-local", "0:put:step-000000003/manifest.json#0", "gc"),
    ("saves-incremental-local", "0:head:step-000000001/a-~0/r00000-000.safetensors#3", "gc"),
    # gc right before an overwrite's manifest put took the new attempt's objects; the put
    # replaced the old manifest and the commit's second check deleted it: no step was left.
    # Now the commit puts the replaced manifest back (its objects are all still there).
    ("overwrite-plain-local", "0:put:step-000000005/manifest.json#1", "gc"),
    ("overwrite-compressed-local", "0:put:step-000000005/manifest.json#1", "gc"),
]


@pytest.mark.parametrize(("scenario", "point", "kind"), REGRESSIONS)
@pytest.mark.timeout(120)
def test_points_that_broke_before(scenario: str, point: str, kind: str, space: Workspace) -> None:
    (verdict,) = _at(Scenario.parse(scenario), point, kind, space)
    assert verdict.violations == []


def _at(scenario: Scenario, point: str, kind: str, space: Workspace) -> list[Verdict]:
    recorded = record(scenario, space)
    calls = [call for call in recorded.points() if call.name == point]
    assert calls, f"{point} is not a point of {scenario.id}: {[c.name for c in recorded.points()]}"
    return [explore_point(recorded, calls[0], kind, space, {})]


@pytest.mark.timeout(120)
def test_a_commit_without_its_existence_checks_is_caught(
    space: Workspace, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Planted bug: the commit no longer checks that its objects exist; gc before the put."""
    monkeypatch.setattr(Catalog, "missing_objects", lambda self, step, expected: [])
    (verdict,) = _at(Scenario.parse(REGRESSIONS[0][0]), REGRESSIONS[0][1], "gc", space)
    assert any("does not verify" in text for text in verdict.violations), verdict


@pytest.mark.timeout(180)
def test_retention_that_ignores_references_is_caught(
    space: Workspace, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Planted bug: retention deletes a retired step's folders although a kept incremental
    step still references them; crashes anywhere in the saves find it."""

    def careless(self: spotckpt.policy.RetentionDecision, folder: str, step: int) -> bool:
        return step in self.retired

    monkeypatch.setattr(spotckpt.policy.RetentionDecision, "may_delete", careless)
    todo = plan([Scenario.parse("saves-incremental-local")], ("crash",), space, None, SEED)
    verdicts = explore(Plan(todo.items[-20:]), space)
    lines = list(report(verdicts))
    assert not lines[-1].endswith("violations: 0"), lines
    assert any("reproduce: python tests/crash/explore.py" in line for line in lines)


@pytest.mark.timeout(120)
def test_a_mirror_that_commits_before_it_copies_is_caught(
    space: Workspace, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Planted bug: a mirror's copy puts the manifest first, then the objects; a crash at any
    object of step 1's copy leaves the mirror listing a step it does not hold."""

    def manifest_first(self: Mirror, step: int) -> StepCopy:
        data = self.source.manifest_bytes(step)
        if self.target.is_committed(step):
            return StepCopy(step, already=True)
        needed = self.source.stored_objects(step, data)
        self._same_job()
        self.target.store.put(manifest_key(step), data)
        self._copy_objects(needed)
        return StepCopy(step)

    monkeypatch.setattr(Mirror, "copy_step", manifest_first)
    todo = plan([Scenario.parse("mirror-plain-local")], ("crash",), space, None, SEED)
    todo.items = [i for i in todo.items if i[1].name.startswith("0:open:mirror/step-000000001/")]
    verdicts = explore(todo, space)
    assert todo.items and all(v.violations for v in verdicts), _only(verdicts)
    assert any("does not verify" in text for v in verdicts for text in v.violations)


@pytest.mark.timeout(120)
def test_an_overwrite_that_deletes_the_old_manifest_first_is_caught(
    space: Workspace, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Planted bug: DCP's overwrite deletes the old manifest, then puts the new; a crash at
    the put leaves no step, where docs/dcp.md promises the old one or the new."""

    def delete_first(self: Catalog, step: int, attempt: str, data: bytes) -> None:
        self.store.delete_many([manifest_key(step)])
        self.store.put(manifest_key(step), data)

    monkeypatch.setattr(Catalog, "_replace_manifest", delete_first)
    (verdict,) = _at(Scenario.parse("overwrite-plain-local"), OVERWRITE_PUT, "crash", space)
    assert any("the steps listed are []" in text for text in verdict.violations), verdict


@pytest.mark.process
@pytest.mark.timeout(240)
def test_the_commands_in_the_docs_run() -> None:
    """docs/guarantees.md's commands: a sample, and a violation's reproducer for one point."""
    explorer = Path(__file__).with_name("explore.py")
    scenario, point, kind = REGRESSIONS[1]
    for args in (
        ["--sample", "30", "--kind", "crash", "--kind", "lost"],
        ["--scenario", scenario, "--point", point, "--kind", kind],
    ):
        done = subprocess.run(
            [sys.executable, str(explorer), *args], capture_output=True, text=True, timeout=200
        )
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        last = done.stdout.splitlines()[-1]
        assert last.startswith("crash points explored: ") and last.endswith(", violations: 0")


def test_a_server_sample_keeps_every_local_point_and_at_most_n_per_server() -> None:
    """`make crash` fits in two hours by sampling the servers' points (seconds a replay)."""

    def item(backend: str, n: int) -> tuple[Any, Any, str]:
        return (SimpleNamespace(scenario=SimpleNamespace(backend=backend)), n, "crash")

    items = [item(b, n) for n in range(50) for b in ("local", "s3", "gcs")]
    kept = _at_most_per_server(items, 7, random.Random(SEED))
    assert [i for i in kept if i[0].scenario.backend == "local"] == items[0::3]
    for backend in ("s3", "gcs"):
        theirs = [i[1] for i in kept if i[0].scenario.backend == backend]
        assert len(theirs) == 7 and theirs == sorted(theirs)
    assert kept == _at_most_per_server(items, 7, random.Random(SEED))
