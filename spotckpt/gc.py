"""`collect_garbage`: delete what failed saves left behind, and apply retention.

What is collected, from one listing of the checkpoint root:
- attempt folders (``step-N/a-<id>/``) of committed steps that the manifest does not reference;
- step folders that have no manifest at all (saves that never committed);
- unfinished multipart uploads (for local folders: leftover temporary files);
- with `keep_last`, committed checkpoints older than the newest `keep_last` ones (the manifest is
  deleted first, so a checkpoint is never half-visible; the newest committed one never goes).

Anything whose newest object (or open upload) is younger than `safety_age_s` is left alone: it may
belong to a save that is still writing. Just before an uncommitted folder is deleted its manifest
is looked for again, so a save that commits meanwhile keeps its objects.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from typing import Any

from spotckpt.format.manifest import (
    MANIFEST_NAME,
    Manifest,
    ManifestError,
    manifest_key,
    parse_step_folder,
    step_folder,
)
from spotckpt.storage.base import ObjectInfo, ObjectNotFoundError, ObjectStore, UploadInfo

log = logging.getLogger("spotckpt")


@dataclass(frozen=True)
class GcAction:
    """One thing deleted (or, in a dry run, that would be).

    `kind` is ``attempt`` (unreferenced attempt folder of a committed step), ``uncommitted`` (step
    folder without a manifest), ``upload`` (unfinished upload) or ``retention`` (a committed
    checkpoint beyond `keep_last`). `target` is a folder prefix or a key, relative to the root.
    """

    kind: str
    target: str
    objects: int
    bytes: int
    age_s: float | None
    step: int | None = None


@dataclass
class GcReport:
    """What `collect_garbage` deleted (or would delete) and what it left alone, and why."""

    dry_run: bool
    actions: list[GcAction] = field(default_factory=list)
    kept: list[str] = field(default_factory=list)

    @property
    def bytes_freed(self) -> int:
        """Bytes of the deleted objects."""
        return sum(a.bytes for a in self.actions)

    @property
    def objects_deleted(self) -> int:
        """Number of deleted objects."""
        return sum(a.objects for a in self.actions)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready form."""
        return {
            "dry_run": self.dry_run,
            "objects_deleted": self.objects_deleted,
            "bytes_freed": self.bytes_freed,
            "actions": [asdict(a) for a in self.actions],
            "kept": list(self.kept),
        }


@dataclass
class ObjectGroup:
    """Objects under one prefix, with the time of the newest activity there."""

    prefix: str
    objects: list[ObjectInfo] = field(default_factory=list)
    uploads: list[UploadInfo] = field(default_factory=list)

    def newest(self) -> datetime | None:
        """Newest modification or upload start; None if any time is unknown (never old)."""
        times = [o.last_modified for o in self.objects] + [u.initiated for u in self.uploads]
        if not times or any(t is None for t in times):
            return None
        return max(_aware(t) for t in times if t is not None)


@dataclass
class StepFolder:
    """One step folder: its manifest (if any) and its objects by attempt."""

    step: int
    has_manifest: bool = False
    attempts: dict[str, ObjectGroup] = field(default_factory=dict)
    everything: list[ObjectInfo] = field(default_factory=list)
    uploads: list[UploadInfo] = field(default_factory=list)


def collect_garbage(
    store: ObjectStore,
    *,
    keep_last: int | None = None,
    safety_age_s: float = 3600.0,
    dry_run: bool = False,
    now: datetime | None = None,
) -> GcReport:
    """Collect garbage under `store`'s root; see the module docstring. Returns the report."""
    if keep_last is not None and keep_last < 1:
        raise ValueError("keep_last must be at least 1: the newest checkpoint is never deleted")
    if safety_age_s < 0:
        raise ValueError("safety_age_s must not be negative")
    now = _aware(now) if now is not None else datetime.now(timezone.utc)
    report = GcReport(dry_run=dry_run)
    steps, uploads = scan_root(store)
    committed = sorted(s for s, info in steps.items() if info.has_manifest)
    retired = set(committed[:-keep_last]) if keep_last is not None else set()
    for step in sorted(retired):
        _retire(store, steps[step], report)
    for step, info in sorted(steps.items()):
        if step in retired:
            continue
        if info.has_manifest:
            _collect_attempts(store, info, now, safety_age_s, report)
        else:
            _collect_uncommitted(store, info, now, safety_age_s, report)
    _abort_uploads(store, uploads, now, safety_age_s, report)
    return report


def _aware(moment: datetime) -> datetime:
    return moment if moment.tzinfo is not None else moment.replace(tzinfo=timezone.utc)


def scan_root(
    store: ObjectStore, *, with_uploads: bool = True
) -> tuple[dict[int, StepFolder], list[UploadInfo]]:
    """Step folders by step (from one listing), and the unfinished uploads under the root
    (not asked for, and empty, unless `with_uploads`)."""
    uploads = store.list_uploads("") if with_uploads else []
    return _group(store.list("step-"), uploads), uploads


def _group(objects: Iterable[ObjectInfo], uploads: list[UploadInfo]) -> dict[int, StepFolder]:
    steps: dict[int, StepFolder] = {}
    for info in objects:
        entry = _step_entry(steps, info.key)
        if entry is None:
            continue
        entry.everything.append(info)
        rest = info.key.partition("/")[2]
        if rest == MANIFEST_NAME:
            entry.has_manifest = True
        attempt = _attempt_of(rest)
        if attempt is not None:
            _attempt_group(entry, attempt).objects.append(info)
    for upload in uploads:
        entry = _step_entry(steps, upload.key)
        if entry is None:
            continue
        entry.uploads.append(upload)
        attempt = _attempt_of(upload.key.partition("/")[2])
        if attempt is not None:
            _attempt_group(entry, attempt).uploads.append(upload)
    return steps


def _step_entry(steps: dict[int, StepFolder], key: str) -> StepFolder | None:
    folder, slash, _rest = key.partition("/")
    step = parse_step_folder(folder)
    if step is None or not slash:
        return None
    return steps.setdefault(step, StepFolder(step))


def _attempt_of(rest: str) -> str | None:
    """The attempt folder name (``a-<id>``) of a key relative to its step folder."""
    head, slash, _tail = rest.partition("/")
    return head if slash and head.startswith("a-") else None


def _attempt_group(entry: StepFolder, attempt: str) -> ObjectGroup:
    prefix = f"{step_folder(entry.step)}/{attempt}/"
    return entry.attempts.setdefault(attempt, ObjectGroup(prefix))


def _age_s(group: ObjectGroup, now: datetime) -> float | None:
    newest = group.newest()
    return None if newest is None else (now - newest).total_seconds()


def _old_enough(age: float | None, safety_age_s: float) -> bool:
    return age is not None and age >= safety_age_s


def _referenced_attempts(store: ObjectStore, step: int) -> set[str]:
    """The attempt folders (``a-<id>``) a step's manifest references.

    A manifest that does not validate raises ManifestError: its folder is then left alone.
    """
    return attempt_folders(Manifest.from_json(store.get(manifest_key(step)), expected_step=step))


def attempt_folders(manifest: Manifest) -> set[str]:
    """The attempt folders (``a-<id>``) whose objects a manifest references."""
    return {key.partition("/")[0] for key in manifest.objects} | {f"a-{manifest.attempt}"}


def _collect_attempts(
    store: ObjectStore, info: StepFolder, now: datetime, safety_age_s: float, report: GcReport
) -> None:
    try:
        referenced = _referenced_attempts(store, info.step)
    except ManifestError as error:
        report.kept.append(f"{step_folder(info.step)}/ (manifest does not validate: {error})")
        log.warning(
            "gc: leaving step %d alone, its manifest does not validate: %s", info.step, error
        )
        return
    except ObjectNotFoundError:
        report.kept.append(f"{step_folder(info.step)}/ (manifest deleted while gc ran)")
        return
    for attempt, group in sorted(info.attempts.items()):
        if attempt in referenced:
            continue
        age = _age_s(group, now)
        if not _old_enough(age, safety_age_s):
            _keep(report, group.prefix, age, safety_age_s)
            continue
        _delete_group(store, "attempt", group, age, info.step, report)


def _collect_uncommitted(
    store: ObjectStore, info: StepFolder, now: datetime, safety_age_s: float, report: GcReport
) -> None:
    group = ObjectGroup(f"{step_folder(info.step)}/", info.everything, info.uploads)
    age = _age_s(group, now)
    if not _old_enough(age, safety_age_s):
        _keep(report, group.prefix, age, safety_age_s)
        return
    if not group.objects:
        return  # only open uploads: aborted below, with the others
    if store.exists(manifest_key(info.step)):
        report.kept.append(f"{group.prefix} (committed while gc ran)")
        log.info("gc: step %d committed while gc ran; left alone", info.step)
        return
    _delete_group(store, "uncommitted", group, age, info.step, report)


def _keep(report: GcReport, prefix: str, age: float | None, safety_age_s: float) -> None:
    why = (
        "time of last write unknown"
        if age is None
        else f"last write {age:.0f} s ago, within the {safety_age_s:.0f} s safety age"
    )
    report.kept.append(f"{prefix} ({why}; may still be writing)")
    log.info("gc: keeping %s: %s", prefix, why)


def _delete_group(
    store: ObjectStore,
    kind: str,
    group: ObjectGroup,
    age: float | None,
    step: int,
    report: GcReport,
) -> None:
    keys = [o.key for o in group.objects]
    action = GcAction(kind, group.prefix, len(keys), sum(o.size for o in group.objects), age, step)
    if not report.dry_run and keys:
        store.delete_many(keys)
    _record(report, action)


def _retire(store: ObjectStore, info: StepFolder, report: GcReport) -> None:
    """Retention: delete a committed checkpoint, manifest first."""
    folder = f"{step_folder(info.step)}/"
    action = GcAction(
        "retention",
        folder,
        len(info.everything),
        sum(o.size for o in info.everything),
        None,
        info.step,
    )
    if not report.dry_run:
        store.delete_many([manifest_key(info.step)])
        store.delete_many([o.key for o in store.list(folder)])
    _record(report, action)


def _abort_uploads(
    store: ObjectStore,
    uploads: list[UploadInfo],
    now: datetime,
    safety_age_s: float,
    report: GcReport,
) -> None:
    for upload in uploads:
        age = None if upload.initiated is None else (now - _aware(upload.initiated)).total_seconds()
        if not _old_enough(age, safety_age_s):
            _keep(report, f"upload {upload.key}", age, safety_age_s)
            continue
        if not report.dry_run:
            store.abort_upload(upload)
        step = parse_step_folder(upload.key.partition("/")[0])
        _record(report, GcAction("upload", upload.key, 0, 0, age, step))


def _record(report: GcReport, action: GcAction) -> None:
    report.actions.append(action)
    verb = "would delete" if report.dry_run else "deleted"
    if action.kind == "upload":
        verb = "would abort" if report.dry_run else "aborted"
    log.info(
        "gc: %s %s %s (%d objects, %d bytes)",
        verb,
        action.kind,
        action.target,
        action.objects,
        action.bytes,
    )
