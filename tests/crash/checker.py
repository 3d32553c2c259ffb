"""The invariants a checkpoint root must keep after any fault, checked by recovering as a user
would (a new manager on the root, `restore`, `ls`, `verify`, `gc`, then a second restore).

- every step reported committed before the fault restores bit-exact, unless retention was
  configured to delete it (not among the newest `keep_last` of what was committed);
- the step in flight is wholly there (verifies, restores bit-exact) or invisible;
- nothing uncommitted is listed or exported (`export-hf`); no listed step misses an object
  (`verify`);
- `restore` takes the newest listed step that is intact (a step damaged by the fault itself
  may be refused, and the older one restored), bit-exact, never an older one; every other
  intact step still listed restores bit-exact when asked for by number;
- a fast-tier-only step restores bit-exact or not at all (its data is not fsynced);
- no raw exception: only spotckpt's own errors;
- `gc` (safety age 0) leaves only the committed steps' objects, no unfinished upload, and
  removes no step; a second recovery gives the same step and bytes.

`seam_run.state(step)` is every step's expected content, on whatever rank count it was saved.
"""

from __future__ import annotations

import tempfile
import traceback
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass, field, replace
from typing import Any

import seam_run

from spotckpt import CheckpointManager
from spotckpt.catalog import Catalog
from spotckpt.errors import CheckpointError
from spotckpt.export import export_hf
from spotckpt.format.signing import Keyring
from spotckpt.gc import collect_garbage
from spotckpt.layout import (
    MANIFEST_NAME,
    QUARANTINE_PREFIX,
    TIER_RECORD_NAME,
    attempt_folders,
    parse_step_folder,
    referenced_folders,
    step_folder,
)
from spotckpt.storage import ObjectStore
from spotckpt.verify import verify_checkpoint


@dataclass
class Expectation:
    """What the fault's moment promises about the root."""

    committed: list[int]
    """Steps the job was told were committed (to the bucket) before the fault."""
    in_flight: set[int] = field(default_factory=set)
    """Steps being saved at the fault: wholly there or invisible."""
    tier_only: set[int] = field(default_factory=set)
    """Steps that may be restored though they are not intact committed ones (saved to the
    fast tier only; or whose damaged bytes they do not read): bit-exact when restored."""
    keep_last: int | None = None
    damaged: set[int] = field(default_factory=set)
    """Steps the fault itself damaged or forged: may be refused, never restored wrong."""

    def __or__(self, suspect: set[int]) -> Expectation:
        """The same, where the `suspect` steps too may be restored (when bit-exact)."""
        return replace(self, tier_only=self.tier_only | suspect)


@dataclass
class Recovery:
    """What the recovery saw, and the invariants it found broken."""

    violations: list[str] = field(default_factory=list)
    restored: int | None = None
    listed: list[int] = field(default_factory=list)
    suspect: set[int] = field(default_factory=set)
    """Listed steps that do not verify because the fault damaged what they reference."""

    def fail(self, text: str) -> None:
        self.violations.append(text)


def check(
    open_root: Callable[[], AbstractContextManager[ObjectStore]],
    manager_settings: dict[str, Any],
    keyring: Keyring | None,
    expect: Expectation,
) -> Recovery:
    """Recover the root as a user would and check every invariant; never raises."""
    seen = Recovery()
    try:
        _check(open_root, manager_settings, keyring, expect, seen)
    except CheckpointError as error:
        seen.fail(f"recovery failed: {type(error).__name__}: {error}")
    except Exception as error:
        seen.fail(
            "raw exception in recovery: " + "".join(traceback.format_exception(error))[-2000:]
        )
    return seen


def _check(
    open_root: Callable[[], AbstractContextManager[ObjectStore]],
    manager_settings: dict[str, Any],
    keyring: Keyring | None,
    expect: Expectation,
    seen: Recovery,
) -> None:
    with open_root() as store:
        _check_root(store, manager_settings, keyring, expect, seen)


def _check_root(
    store: ObjectStore,
    manager_settings: dict[str, Any],
    keyring: Keyring | None,
    expect: Expectation,
    seen: Recovery,
) -> None:
    listed = Catalog(store, keyring).steps()
    seen.listed = listed
    allowed = set(expect.committed) | expect.in_flight | expect.damaged
    for step in sorted(set(listed) - allowed):
        seen.fail(f"step {step} is listed but was never committed")
    for step in sorted(expect.in_flight - set(listed)):
        _refused_export(store, keyring, step, seen)
    intact = _intact(store, keyring, listed, expect, seen)
    everything = sorted(set(expect.committed) | (expect.in_flight & set(listed)))
    kept = everything[-expect.keep_last :] if expect.keep_last else everything
    for step in sorted(set(kept) - set(listed) - expect.damaged):
        seen.fail(f"committed step {step} is gone (retention keeps the newest {expect.keep_last})")
    newest = max(intact, default=None)
    first = _restore(manager_settings, expect | seen.suspect, newest, seen, "restore")
    seen.restored = first
    after = Catalog(store, keyring).steps()  # restore quarantines what it found damaged
    for step in sorted(set(listed) - set(after)):
        if step in intact:
            seen.fail(f"restore removed step {step}, which is intact")
    _gc(store, keyring, after, seen)
    second = _restore(manager_settings, expect | seen.suspect, newest, seen, "second restore")
    if second != first:
        seen.fail(f"a second recovery restored step {second}, the first {first}")
    # Last: a restore of an older step lets the fast tier drop its newer (now stale) steps.
    for step in sorted(set(intact) & set(after) - {first}):
        _restore_step(manager_settings, step, seen)


def _refused_export(store: ObjectStore, keyring: Keyring | None, step: int, seen: Recovery) -> None:
    """An uncommitted step is invisible to export-hf too."""
    with tempfile.TemporaryDirectory() as out:
        try:
            export_hf(store, step, out, keyring=keyring)
        except CheckpointError:
            return
    seen.fail(f"export-hf exported step {step}, which is not committed")


def _intact(
    store: ObjectStore,
    keyring: Keyring | None,
    listed: list[int],
    expect: Expectation,
    seen: Recovery,
) -> list[int]:
    """The listed steps that verify; one that does not is a violation unless the fault hit it."""
    intact = []
    for step in listed:
        report = verify_checkpoint(store, step, keyring=keyring)
        if report.ok:
            intact.append(step)
        elif step in expect.damaged or _damaged_below(step, store, keyring, expect):
            seen.suspect.add(step)  # may still restore exactly: the bytes it needs are whole
        else:
            problems = "; ".join(str(p) for p in report.problems[:3])
            seen.fail(f"committed step {step} does not verify: {problems}")
    return intact


def _damaged_below(
    step: int, store: ObjectStore, keyring: Keyring | None, expect: Expectation
) -> bool:
    """Whether `step` references an object of a step the fault damaged (incremental)."""
    if not expect.damaged:
        return False
    manifest = Catalog(store, keyring).read_manifest(step)
    folders = referenced_folders(manifest)
    return any(
        folder.startswith(f"{step_folder(d)}/") for folder in folders for d in expect.damaged
    )


def _restore(
    manager_settings: dict[str, Any],
    expect: Expectation,
    newest: int | None,
    seen: Recovery,
    what: str,
) -> int | None:
    into = seam_run.blank()
    with CheckpointManager(**manager_settings) as manager:
        step = manager.restore(into)
    if step is None:
        if newest is not None:
            seen.fail(f"{what} found nothing, though step {newest} is committed and intact")
        return None
    if not seam_run.same(into, seam_run.state(step)):
        seen.fail(f"{what} of step {step} is not bit-exact")
    floor = newest if newest is not None else -1
    if step < floor:
        seen.fail(f"{what} took step {step}, older than the intact committed step {newest}")
    if step > floor and step not in expect.tier_only:
        seen.fail(f"{what} took step {step}, which is not an intact committed step")
    return step


def _restore_step(manager_settings: dict[str, Any], step: int, seen: Recovery) -> None:
    """An older kept step, asked for by number, restores bit-exact."""
    into = seam_run.blank()
    with CheckpointManager(**manager_settings) as manager:
        got = manager.restore(into, step=step)
    if got != step:
        seen.fail(f"restore of step {step} by number gave {got}")
    elif not seam_run.same(into, seam_run.state(step)):
        seen.fail(f"restore of step {step} by number is not bit-exact")


def _gc(store: ObjectStore, keyring: Keyring | None, listed: list[int], seen: Recovery) -> None:
    """gc removes every leftover and nothing else."""
    collect_garbage(store, safety_age_s=0, keyring=keyring)
    catalog = Catalog(store, keyring)
    after = catalog.steps()
    if after != listed:
        seen.fail(f"gc changed the committed steps from {listed} to {after}")
    files: set[str] = set()
    folders: set[str] = set()  # prefixes, ending with "/"
    for step in after:
        own = step_folder(step)
        files |= {f"{own}/{MANIFEST_NAME}", f"{own}/{TIER_RECORD_NAME}"}
        try:
            manifest = catalog.read_manifest(step)
        except CheckpointError:
            folders.add(f"{own}/")  # unreadable: gc keeps its folder
            continue
        folders |= {f"{own}/{folder}/" for folder in attempt_folders(manifest)}
        folders |= {f"{folder}/" for folder in referenced_folders(manifest)}
    objects = list(store.list("step-"))
    for info in objects:  # gc never touches a quarantined step's folder (kept for a post-mortem)
        if info.key.split("/")[1].startswith(QUARANTINE_PREFIX):
            folders.add(info.key.split("/")[0] + "/")
    for info in objects:
        if parse_step_folder(info.key.split("/")[0]) is None or info.key in files:
            continue
        if not any(info.key.startswith(folder) for folder in folders):
            seen.fail(f"gc left {info.key}, which no committed step references")
    uploads = store.list_uploads("")
    if uploads:
        seen.fail(f"gc left {len(uploads)} unfinished uploads, e.g. {uploads[0].key}")
