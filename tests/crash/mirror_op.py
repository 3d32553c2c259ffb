"""The crash explorer's ``mirror`` operation: committed steps copied to a second root with
`spotckpt.mirroring.Mirror`, a fault at any store call of the copy (the mirror's calls are named
``mirror/<key>``; the source's reads are points too).

The set-up commits `SOURCE_STEPS` to the job's root (no retention there: every step is there to
copy). The operation copies step 1, then step 2, one `Mirror.copy_step` each, then
`Mirror.catch_up` with `KEEP_LAST` copies step 3 and retires step 1 at the mirror (whose
objects the incremental steps 2 and 3 reference). A recovery checks the mirror as the fault
left it (every step it lists was committed at the source, verifies and restores bit-exact; the
newest `KEEP_LAST` of the steps it was told were mirrored are still listed), then runs a
fault-free catch-up and checks the mirror with the explorer's checker as a job restarted on it
would see it: the source's newest `KEEP_LAST` steps there bit-exact, gc leaving nothing else.
"""

from __future__ import annotations

import traceback
from pathlib import Path

import seam_run
from checker import Expectation, Recovery, check
from recorder import RecordingStore, Trace
from scenarios import KEEP_LAST, Root, Scenario, _close, _manager, features_on, settings

from spotckpt import CheckpointManager
from spotckpt.catalog import Catalog
from spotckpt.errors import CheckpointError
from spotckpt.format.signing import Keyring
from spotckpt.layout import referenced_folders, step_folder
from spotckpt.mirroring import Mirror
from spotckpt.storage import ObjectStore
from spotckpt.verify import verify_checkpoint

PREFIX = "mirror/"
"""How the trace names the mirror's keys (a rebuilt state puts them into the mirror's root)."""
SOURCE_STEPS = (1, 2, 3)
FEATURE_SETS: tuple[tuple[str, ...], ...] = (
    (),
    ("incremental",),
    ("signed",),
    ("incremental", "signed"),
    ("compressed",),
    ("indexed",),
)
"""The feature sets mirrored (how a step's objects are laid out and checked differs)."""


class MirrorRecordingStore(RecordingStore):
    """The mirror's store, recorded in the same trace with its keys named ``mirror/<key>``."""

    def named(self, key: str) -> str:
        return f"{PREFIX}{key}"


def target(root: Root) -> Root:
    """The mirror's root beside the job's `root`, an empty folder until written (a bucket
    exists before its first object); the root that the actor kinds act on."""
    if "://" in root.uri:
        raise SystemExit("the mirror operation is explored on the local folder only")
    mirror = Root(str(root.folder / "mirror"), root.folder, root.key)
    Path(mirror.uri).mkdir(parents=True, exist_ok=True)
    return mirror


def setup(scenario: Scenario, root: Root, store: RecordingStore, trace: Trace) -> None:
    """Commit `SOURCE_STEPS` to the job's root, every one kept."""
    target(root)
    manager = _manager(scenario, root, store, keep_last=None)
    for step in SOURCE_STEPS:
        manager.save(step, seam_run.state(step))
        manager.wait()
        trace.mark("committed", step)
    _close(manager, trace)


def operate(scenario: Scenario, root: Root, store: RecordingStore, trace: Trace) -> None:
    """Copy steps 1 and 2 one at a time, then catch up with retention (step 3 copied, step 1
    retired); marks ``mirroring`` before a step's copy and ``mirrored`` once it returned."""
    keys = seam_run.keyring(scenario.cell, root.paths)
    mirror_store = MirrorRecordingStore(target(root).open(), trace)
    mirror = Mirror(Catalog(store, keys), Catalog(mirror_store, keys))
    try:
        for step in SOURCE_STEPS[:2]:
            trace.mark("mirroring", step)
            mirror.copy_step(step)
            trace.mark("mirrored", step)
        trace.mark("mirroring", SOURCE_STEPS[2])
        report = mirror.catch_up(keep_last=KEEP_LAST)
        for copied in report.copied:
            trace.mark("mirrored", copied.step)
    finally:
        mirror_store.close()


def expectation(scenario: Scenario, trace: Trace, seq: int) -> Expectation:
    """The steps the operation was told were mirrored before the call numbered `seq`, and the
    one it was copying."""
    mirrored = trace.marked("mirrored", seq)
    in_flight = set(trace.marked("mirroring", seq)) - set(mirrored)
    return Expectation(mirrored, in_flight, keep_last=KEEP_LAST)


def recover(scenario: Scenario, root: Root, expect: Expectation) -> Recovery:
    """Check the mirror as the fault left it, catch it up without a fault, check it again as a
    job restarted on it would (`checker.check`); never raises."""
    seen = Recovery()
    mirror = target(root)
    keys = seam_run.keyring(scenario.cell, root.paths)
    try:
        with features_on(scenario):
            with mirror.opened() as store:
                _check_left(scenario, mirror, store, keys, expect, seen)
            _catch_up(root, mirror, keys, seen)
            chosen = {"uri": mirror.uri, **settings(scenario, mirror, keep_last=None)}
            promised = Expectation(list(SOURCE_STEPS), keep_last=KEEP_LAST, damaged=expect.damaged)
            after = check(mirror.opened, chosen, keys, promised)
    except CheckpointError as error:
        seen.fail(f"mirror recovery failed: {type(error).__name__}: {error}")
        return seen
    except Exception as error:
        seen.fail("raw exception in mirror recovery: " + "".join(traceback.format_exception(error)))
        return seen
    seen.violations += [f"after a fault-free catch-up: {text}" for text in after.violations]
    seen.restored = after.restored
    return seen


def _check_left(
    scenario: Scenario,
    mirror: Root,
    store: ObjectStore,
    keys: Keyring | None,
    expect: Expectation,
    seen: Recovery,
) -> None:
    """Every step the mirror lists was committed at the source, verifies and restores
    bit-exact; the newest `KEEP_LAST` of those it was told were mirrored (and of the one in
    flight, once listed: retention may then retire an older one) are there."""
    listed = Catalog(store, keys).steps()
    seen.listed = listed
    for step in sorted(set(listed) - set(SOURCE_STEPS) - expect.damaged):
        seen.fail(f"the mirror lists step {step}, which the source never committed")
    everything = sorted(set(expect.committed) | (expect.in_flight & set(listed)))
    for step in sorted(set(everything[-KEEP_LAST:]) - set(listed) - expect.damaged):
        seen.fail(f"step {step} was mirrored, and is gone from the mirror")
    chosen = {"uri": mirror.uri, **settings(scenario, mirror, keep_last=None)}
    for step in listed:
        if step in expect.damaged or _references_damaged(store, keys, step, expect.damaged):
            continue
        report = verify_checkpoint(store, step, keyring=keys)
        if not report.ok:
            problems = "; ".join(str(p) for p in report.problems[:3])
            seen.fail(f"the mirror lists step {step}, which does not verify: {problems}")
            continue
        into = seam_run.blank()
        with CheckpointManager(**chosen) as manager:
            got = manager.restore(into, step=step)
        if got != step or not seam_run.same(into, seam_run.state(step)):
            seen.fail(f"step {step} at the mirror does not restore bit-exact (got step {got})")


def _references_damaged(
    store: ObjectStore, keys: Keyring | None, step: int, damaged: set[int]
) -> bool:
    """Whether `step` references objects of a step the fault damaged (an incremental one)."""
    if not damaged:
        return False
    folders = referenced_folders(Catalog(store, keys).read_manifest(step))
    return any(folder.startswith(f"{step_folder(d)}/") for folder in folders for d in damaged)


def _catch_up(root: Root, mirror: Root, keys: Keyring | None, seen: Recovery) -> None:
    """A second catch-up, without a fault, must copy whatever the first left undone."""
    with root.opened() as source, mirror.opened() as store:
        report = Mirror(Catalog(source, keys), Catalog(store, keys)).catch_up(keep_last=KEEP_LAST)
    for step, why in sorted(report.failed.items()):
        seen.fail(f"a fault-free catch-up failed to mirror step {step}: {why}")
