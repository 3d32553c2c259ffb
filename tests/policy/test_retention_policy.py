"""The retention rule (`spotckpt.policy`) where retention, gc and incremental references meet:
gc racing a save that retires, a damaged old manifest, a planted step of an unknown format, and
an object the store lists under a key spotckpt never writes. Real saves into a local folder,
real damaged and planted bytes."""

from __future__ import annotations

import json
import logging
import os
import shutil
import uuid
from collections.abc import Callable, Iterator
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from spotckpt import CheckpointManager, TrainState
from spotckpt.catalog import Catalog
from spotckpt.distributed import Collective
from spotckpt.errors import CheckpointError, NoCheckpointError
from spotckpt.format.manifest import MAX_MANIFEST_BYTES
from spotckpt.gc import collect_garbage
from spotckpt.layout import TIER_RECORD_NAME, manifest_key, step_folder, tier_record_key
from spotckpt.policy import RetentionPolicy, StepReading
from spotckpt.redundancy import NO_REDUNDANCY
from spotckpt.storage import ObjectInfo, ObjectStore, open_store
from spotckpt.storage.memory import _BUCKETS
from spotckpt.tiers.fast_tier import FastTier
from spotckpt.tiers.record import TierRecord
from spotckpt.tiers.retention import TierReadings
from spotckpt.verify import verify_checkpoint

from tests_support import FailingStore, assert_equal


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(256, 300), nn.Linear(300, 256))


def _manager(root: Path | str, **kwargs: Any) -> CheckpointManager:
    options: dict[str, Any] = {"incremental": True, "preemption": False, "keep_last": None}
    return CheckpointManager(str(root), **(options | kwargs))


def _save(mgr: CheckpointManager, step: int, model: nn.Module) -> dict[str, torch.Tensor]:
    """Save `step` with only the last bias changed, so that the weights are referenced."""
    with torch.no_grad():
        model[1].bias.add_(1.0)
    mgr.save(step, TrainState(model=model, rng=False), blocking=True)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _restored(root: Path, step: int | None = None) -> tuple[int | None, dict[str, torch.Tensor]]:
    model = _model()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(7)
    with _manager(root) as mgr:
        got = mgr.restore(TrainState(model=model, rng=False), step=step)
    return got, {k: v.clone() for k, v in model.state_dict().items()}


def _referencing_steps(root: Path, count: int) -> tuple[nn.Module, dict[int, dict[str, Any]]]:
    model = _model()
    states = {}
    with _manager(root) as mgr:
        for step in range(1, count + 1):
            states[step] = _save(mgr, step, model)
    manifest = Catalog(open_store(str(root))).read_manifest(count)
    assert manifest.incremental is not None and manifest.referenced_bytes > 0
    return model, states


class AfterScan(FailingStore):
    """Runs `then` once, right after the first full listing of the step folders (gc's scan)."""

    def __init__(self, inner: ObjectStore, then: Callable[[], None]) -> None:
        super().__init__(inner, 1 << 62)
        self.then: Callable[[], None] | None = then

    def list(self, prefix: str = "") -> Iterator[ObjectInfo]:
        yield from super().list(prefix)
        if prefix == "step-" and self.then is not None:
            then, self.then = self.then, None
            then()


@pytest.mark.timeout(120)
def test_gc_racing_a_save_that_retires_keeps_what_the_new_step_references(tmp_path: Path) -> None:
    """Item 1: gc scans; the job commits step 3 (referencing step 2's object) and retires step
    2; gc, from its scan, must not delete step 2's attempt folder."""
    model, states = _referencing_steps(tmp_path, 2)
    job = _manager(tmp_path, keep_last=1)

    def commit_and_retire() -> None:
        states[3] = _save(job, 3, model)

    try:
        store = AfterScan(open_store(str(tmp_path)), commit_and_retire)
        collect_garbage(store, safety_age_s=0)
    finally:
        job.close()
    assert Catalog(open_store(str(tmp_path))).steps() == [3]
    assert verify_checkpoint(open_store(str(tmp_path)), 3).ok
    got, state = _restored(tmp_path)
    assert got == 3
    assert_equal(states[3], state)


def _damage(root: Path, step: int) -> None:
    path = root / manifest_key(step)
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x55
    path.write_bytes(bytes(data[:-7]))


@pytest.mark.parametrize("where", ["retention", "gc"])
def test_a_damaged_old_manifest_keeps_its_objects(tmp_path: Path, where: str) -> None:
    """Item 2: step 1's manifest damaged; steps 2 and 3 reference its object. Neither the job's
    retention nor gc deletes step 1's objects, and step 3 restores bit-exact."""
    model, states = _referencing_steps(tmp_path, 3)
    _damage(tmp_path, 1)
    before = sorted(p.name for p in (tmp_path / step_folder(1)).rglob("*.safetensors"))
    assert before
    if where == "retention":
        with _manager(tmp_path, keep_last=2) as mgr:
            states[4] = _save(mgr, 4, model)
        newest = 4
    else:
        report = collect_garbage(open_store(str(tmp_path)), keep_last=1, safety_age_s=0)
        assert any("cannot be read" in kept for kept in report.kept)
        newest = 3
    after = sorted(p.name for p in (tmp_path / step_folder(1)).rglob("*.safetensors"))
    assert after == before
    assert (tmp_path / manifest_key(1)).exists()  # left for an operator to look at
    got, state = _restored(tmp_path)
    assert got == newest
    assert_equal(states[newest], state)


FUTURE = json.dumps({"format": "spotckpt/1+fromthefuture"}).encode()


@pytest.mark.parametrize("incremental", [True, False], ids=["incremental", "full"])
def test_a_planted_unreadable_step_takes_no_retention_slot(
    tmp_path: Path, incremental: bool, caplog: pytest.LogCaptureFixture
) -> None:
    """Item 3: an object of a format from the future at step 999999 never takes a slot, nor
    causes the deletion of readable steps; a restart restores the job's newest step; ls and
    verify report it; only gc --delete-unreadable removes it."""
    store = open_store(str(tmp_path))
    store.put(manifest_key(999_999), FUTURE)
    model = _model()
    states = {}
    level = caplog.at_level(logging.WARNING, logger="spotckpt")
    with level, _manager(tmp_path, keep_last=1, incremental=incremental) as mgr:
        for step in range(1, 4):
            states[step] = _save(mgr, step, model)
    assert "999999" in caplog.text and "cannot be read" in caplog.text
    assert Catalog(store).steps() == [3, 999_999]
    got, state = _restored(tmp_path)
    assert got == 3
    assert_equal(states[3], state)
    assert not verify_checkpoint(store, 999_999).ok
    report = collect_garbage(store, keep_last=1, safety_age_s=0)
    assert Catalog(store).steps() == [3, 999_999]
    assert any("999999" in kept for kept in report.kept)
    collect_garbage(store, keep_last=1, safety_age_s=0, delete_unreadable=True)
    assert Catalog(store).steps() == [3]
    got, state = _restored(tmp_path)
    assert got == 3
    assert_equal(states[3], state)


def test_an_object_under_a_key_spotckpt_never_writes_is_skipped(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Item 13 (Azure lists ``.../<attempt>//x``; its own test is in tests/storage/test_azure.py):
    such an object in a retired step stops neither retention nor gc; both warn, name it, and
    go on with the rest. The memory store holds the object as such a store would list it."""
    uri = f"memory://odd-key-{uuid.uuid4().hex}"
    model = _model()
    states = {}
    odd = f"{step_folder(1)}/a-odd//x"
    with caplog.at_level(logging.WARNING, logger="spotckpt"):
        with _manager(uri, keep_last=1, incremental=False) as mgr:
            states[1] = _save(mgr, 1, model)
            _BUCKETS[uri.removeprefix("memory://")][odd] = (b"odd", datetime.now(timezone.utc))
            states[2] = _save(mgr, 2, model)
            states[3] = _save(mgr, 3, model)
        store = open_store(uri)
        assert Catalog(store).steps() == [3]
        assert odd in caplog.text
        assert [k for k in _BUCKETS[uri.removeprefix("memory://")] if step_folder(1) in k] == [odd]
        store.put(f"{step_folder(2)}/a-left/r00000-000.safetensors", b"x")  # a failed save's
        report = collect_garbage(store, safety_age_s=0)
    assert [a.target for a in report.actions if a.kind == "uncommitted"] == [
        f"{step_folder(2)}/a-left/"
    ]
    assert verify_checkpoint(store, 3).ok
    model = _model()
    with _manager(uri) as mgr:
        assert mgr.restore(TrainState(model=model, rng=False)) == 3
    assert_equal(states[3], {k: v.clone() for k, v in model.state_dict().items()})


# The rule itself ----------------------------------------------------------------------------------


def _reading(step: int, *needs: str) -> StepReading:
    return StepReading(step, frozenset(needs))


def test_the_rule_counts_only_readable_steps_and_shields_older_folders() -> None:
    readings = [
        _reading(1, "step-000000001/a-x"),
        StepReading(2, None, "damaged"),
        _reading(3, "step-000000003/a-y", "step-000000001/a-x"),
        _reading(4, "step-000000004/a-z"),
        StepReading(9, None, "from the future"),
    ]
    decision = RetentionPolicy(1).decide(readings)
    assert decision.kept == (4,) and decision.retired == (1, 3) and decision.unreadable == (2, 9)
    assert not decision.may_delete("step-000000003/a-y", 3)  # step 9 may reference it
    assert decision.holds_back(3) is not None
    forced = RetentionPolicy(1, delete_unreadable=True).decide(readings)
    assert forced.retired == (1, 2, 3, 9) and forced.unreadable == ()
    assert forced.may_delete("step-000000003/a-y", 3)
    assert not forced.may_delete("step-000000004/a-z", 4)
    with pytest.raises(ValueError, match="at least 1"):
        RetentionPolicy(0)


def test_delete_step_names_a_missing_step_and_refuses_the_newest_readable(tmp_path: Path) -> None:
    """An explicit delete: a step with no manifest is NoCheckpointError (not "the newest"), the
    newest readable step is refused even below a planted unreadable one, which may be deleted."""
    states = _referencing_steps(tmp_path, 2)[1]
    store = open_store(str(tmp_path))
    store.put(manifest_key(999_999), FUTURE)
    catalog = Catalog(store)
    with pytest.raises(NoCheckpointError):
        catalog.delete_step(7)
    with pytest.raises(CheckpointError, match="newest committed checkpoint"):
        catalog.delete_step(2)
    catalog.delete_step(999_999)
    assert catalog.steps() == [1, 2]
    got, state = _restored(tmp_path)
    assert got == 2
    assert_equal(states[2], state)


@pytest.mark.parametrize("where", ["retention", "gc"])
def test_a_copied_manifest_without_its_objects_takes_no_slot(tmp_path: Path, where: str) -> None:
    """A manifest that validates but whose objects are not there (copied without them, as a
    partial sync does, or planted without a key) cannot be restored: it takes no keep_last
    slot, so the steps that can be restored stay."""
    model, states = _referencing_steps(tmp_path, 2)
    planted = tmp_path / manifest_key(999)
    planted.parent.mkdir()
    document = json.loads((tmp_path / manifest_key(2)).read_bytes())
    planted.write_text(json.dumps(document | {"step": 999}))
    assert Catalog(open_store(str(tmp_path))).steps() == [1, 2, 999]
    if where == "retention":
        with _manager(tmp_path, keep_last=1) as mgr:
            states[3] = _save(mgr, 3, model)
        newest = 3
    else:
        report = collect_garbage(open_store(str(tmp_path)), keep_last=1, safety_age_s=0)
        assert any("step-000000999/ (manifest cannot be read" in kept for kept in report.kept)
        newest = 2
    assert Catalog(open_store(str(tmp_path))).steps() == [newest, 999]
    got, state = _restored(tmp_path)
    assert got == newest
    assert_equal(states[newest], state)


# Retention, gc and the fast tier agree ------------------------------------------------------------

HISTORIES = ("full", "referenced", "unreadable", "missing-object")
"""Four saved steps each: full saves; incremental saves that reference step 1's attempt; the
same with step 3's manifest damaged; the same with an object of step 2's own attempt deleted."""


@pytest.fixture(scope="module")
def histories(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Each history of `HISTORIES`, saved once into a folder of its own (copied by each case)."""
    roots = {}
    for history in HISTORIES:
        root = tmp_path_factory.mktemp(history)
        model = _model()
        with _manager(root, incremental=history != "full") as mgr:
            for step in range(1, 5):
                _save(mgr, step, model)
        if history == "unreadable":
            _damage(root, 3)
        if history == "missing-object":
            own = Catalog(open_store(str(root))).read_manifest(2).attempt
            next((root / step_folder(2) / f"a-{own}").rglob("*.safetensors")).unlink()
        roots[history] = root
    return roots


def _objects(root: Path) -> set[str]:
    """Every file under the step folders, relative to the root (tier records aside)."""
    return {
        str(p.relative_to(root))
        for p in root.glob("step-*/**/*")
        if p.is_file() and p.name != TIER_RECORD_NAME
    }


def _as_tier(root: Path) -> str:
    """`root` made into a node's fast-tier folder of the same steps: a tier record for each, tied
    to the root's job. Returns the job id."""
    store = open_store(str(root))
    job = Catalog(store).job()
    assert job is not None
    for step in Catalog(store).steps():
        attempt = next(p.name for p in (root / step_folder(step)).iterdir() if p.name[:2] == "a-")
        record = TierRecord(step, attempt.removeprefix("a-"), str(NO_REDUNDANCY), (), job.id)
        store.put(tier_record_key(step), record.to_json())
    return job.id


def _pruned(
    histories: dict[str, Path], tmp_path: Path, history: str, keep_last: int
) -> dict[str, Path]:
    """Copies of `history` after `Catalog.retire`, `collect_garbage` (safety age 0; also with
    ``delete_unreadable``) and the fast tier's pruning, each with `keep_last`."""
    copies = {}
    for name in ("retire", "gc", "gc-unreadable", "tier"):
        copies[name] = tmp_path / name
        shutil.copytree(histories[history], copies[name])
    Catalog(open_store(str(copies["retire"]))).retire(keep_last)
    collect_garbage(open_store(str(copies["gc"])), keep_last=keep_last, safety_age_s=0)
    collect_garbage(
        open_store(str(copies["gc-unreadable"])),
        keep_last=keep_last,
        safety_age_s=0,
        delete_unreadable=True,
    )
    job = _as_tier(copies["tier"])
    tier = FastTier(
        str(copies["tier"]),
        redundancy=NO_REDUNDANCY,
        keep_last=keep_last,
        collective=Collective(60.0),
    )
    tier.prune(job)
    return copies


@pytest.mark.parametrize("keep_last", [1, 2, 3])
@pytest.mark.parametrize("history", HISTORIES)
def test_retention_and_gc_agree_on_which_steps_and_objects_go(
    histories: dict[str, Path], tmp_path: Path, history: str, keep_last: int
) -> None:
    """One rule (`spotckpt.policy.RetentionPolicy`): `Catalog.retire` and `collect_garbage`
    keep the same steps of equivalent histories and delete the same objects; every readable
    step they keep still verifies."""
    copies = _pruned(histories, tmp_path, history, keep_last)
    kept = {name: Catalog(open_store(str(root))).steps() for name, root in copies.items()}
    assert kept["retire"] == kept["gc"], kept
    assert _objects(copies["retire"]) == _objects(copies["gc"])
    readings = Catalog(open_store(str(copies["retire"]))).read_steps()
    for reading in readings:
        if reading.readable:
            assert verify_checkpoint(open_store(str(copies["retire"])), reading.step).ok


@pytest.mark.parametrize("keep_last", [1, 2, 3])
@pytest.mark.parametrize("history", HISTORIES)
def test_the_tier_keeps_the_steps_retention_keeps(
    histories: dict[str, Path], tmp_path: Path, history: str, keep_last: int
) -> None:
    """The fast tier's pruning (a node that is the whole tier) keeps the same steps of an
    equivalent history as ``gc --delete-unreadable``, and the readable steps `Catalog.retire`
    keeps: an unreadable step takes no slot and, the tier being a cache, goes (the tier's steps
    never reference others: a retired tier step's folder goes whole)."""
    copies = _pruned(histories, tmp_path, history, keep_last)
    kept = {name: Catalog(open_store(str(root))).steps() for name, root in copies.items()}
    assert kept["tier"] == kept["gc-unreadable"], kept
    readings = Catalog(open_store(str(copies["retire"]))).read_steps()
    assert kept["tier"] == [r.step for r in readings if r.readable], kept


def test_a_node_that_is_not_the_whole_tier_keeps_a_step_whose_objects_are_elsewhere(
    histories: dict[str, Path], tmp_path: Path
) -> None:
    """A node holds only its part of a step saved over several nodes: an object it lacks makes
    the step unreadable only where the node is the whole tier (a restore judges the union)."""
    root = tmp_path / "tier"
    shutil.copytree(histories["missing-object"], root)
    job = _as_tier(root)
    catalog = Catalog(open_store(str(root)))
    whole = TierReadings(catalog, None, whole_here=True).read(job)
    part = TierReadings(catalog, None, whole_here=False).read(job, below=4)
    assert [r.step for r in whole if not r.readable] == [2]
    assert [r.step for r in part] == [1, 2, 3] and all(r.readable for r in part)
    assert TierReadings(catalog, None, whole_here=False).read("another-job") == []


def test_one_tier_step_that_cannot_be_read_never_stops_the_pruning(
    histories: dict[str, Path], tmp_path: Path
) -> None:
    """A tier manifest beyond the size bound (refused before it is read) makes its step
    unreadable: it goes, and every other step is still pruned by the rule."""
    root = tmp_path / "tier"
    shutil.copytree(histories["full"], root)
    job = _as_tier(root)
    os.truncate(root / manifest_key(2), MAX_MANIFEST_BYTES + 1)  # sparse: no real bytes
    tier = FastTier(str(root), redundancy=NO_REDUNDANCY, keep_last=1, collective=Collective(60.0))
    tier.prune(job)
    assert Catalog(open_store(str(root))).steps() == [4]
