"""`collect_garbage`: delete what failed saves left behind, and apply retention.

What is collected, from one listing of the checkpoint root:
- attempt folders (``step-N/a-<id>/``) of committed steps that the manifest does not reference;
- step folders that have no manifest at all (saves that never committed);
- unfinished multipart uploads (for local folders: leftover temporary files);
- with `keep_last`, committed checkpoints older than the newest `keep_last` ones (the manifest is
  deleted first, so a checkpoint is never half-visible; the newest committed one never goes);
- clock probes that a gc which died left behind.

Ages are judged by the store's clock, never this host's: the times of objects and uploads are
the store's, and a host whose clock runs ahead would see a live save as old. "Now" is the time
the store gives a probe object written for it (`Catalog.store_time`); gc refuses to run when
the store gives none. Anything whose newest activity (an object's write, an open upload's
latest part) is younger than `safety_age_s` is left alone: it may belong to a save that is still
writing, however long ago it started. Just before an uncommitted attempt is deleted its step's
manifest is looked for again, so a save that commits meanwhile keeps its objects. Never
touched: quarantined records and the attempts they hold, look-alike folders (reported), the
newest committed checkpoint.
The layout itself is the catalog's (`spotckpt.catalog`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from typing import Any

from spotckpt.catalog import Catalog, ObjectGroup, StepFolder
from spotckpt.errors import InvalidArgumentError
from spotckpt.format.signing import Keyring
from spotckpt.layout import parse_step_folder
from spotckpt.policy import RetentionDecision, RetentionPolicy
from spotckpt.step_removal import may_delete_key
from spotckpt.storage.base import ObjectStore, UploadInfo
from spotckpt.units import human_size

log = logging.getLogger("spotckpt")


@dataclass(frozen=True)
class GcAction:
    """One thing deleted (or, in a dry run, that would be).

    `kind` is ``attempt`` (unreferenced attempt folder of a committed step), ``uncommitted`` (step
    folder without a manifest), ``upload`` (unfinished upload), ``retention`` (a committed
    checkpoint beyond `keep_last`) or ``probe`` (a clock probe left behind by a gc that died).
    `target` is a folder prefix or a key, relative to the root.
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


def collect_garbage(
    store: ObjectStore,
    *,
    keep_last: int | None = None,
    safety_age_s: float = 3600.0,
    dry_run: bool = False,
    now: datetime | None = None,
    progress: Callable[[int, int], None] | None = None,
    keyring: Keyring | None = None,
    delete_unreadable: bool = False,
) -> GcReport:
    """Collect garbage under `store`'s root; see the module docstring. Returns the report.

    `now` is the store's current time when the caller already knows it; by default the store
    is asked (StoreClockError when it gives no time). `progress(done, total)` is called after
    the scan and as each step folder (then the uploads and probes, as one more) is done.
    `keyring`: where it enforces signing, an unsigned manifest is unreadable (retention rule 2).
    `delete_unreadable` also removes committed steps whose manifest cannot be read.
    """
    if safety_age_s < 0:
        raise InvalidArgumentError("safety_age_s must not be negative")
    policy = RetentionPolicy(keep_last, delete_unreadable)
    report = GcReport(dry_run=dry_run)
    catalog = Catalog(store, keyring)
    now = _aware(now) if now is not None else catalog.store_time()
    scan = catalog.scan()
    report.kept.extend(f"{name}/ (not a canonical step folder)" for name in scan.look_alikes)
    readings = catalog.read_steps()  # after the scan: what any step committed by now needs
    decision = policy.decide(readings)
    committed = {r.step for r in readings}
    for reading in readings:
        if not reading.readable and reading.step in decision.unreadable:
            report.kept.append(
                f"step-{reading.step:09d}/ (manifest cannot be read: {reading.problem}; "
                "what it references is unknown, so older steps' objects stay too)"
            )
            log.warning(
                "gc: leaving step %d alone, its manifest cannot be read (%s); objects of older "
                "steps stay while it is there (--delete-unreadable removes it)",
                reading.step,
                reading.problem,
            )
    advance = _counter(len(scan.steps) + 1, progress)
    for step in decision.retired:
        _retire(catalog, scan.steps.get(step, StepFolder(step)), decision, report)
        advance()
    for step, info in sorted(scan.steps.items()):
        if step in decision.retired:
            continue
        for record in info.quarantined:
            report.kept.append(f"{info.folder}/{record}/ (quarantined for inspection)")
        _collect_attempts(catalog, info, step in committed, decision, now, safety_age_s, report)
        advance()
    _abort_uploads(store, scan.uploads, now, safety_age_s, report)
    _collect_probes(catalog, now, safety_age_s, report)
    advance()
    return report


def _counter(total: int, progress: Callable[[int, int], None] | None) -> Callable[[], None]:
    """A call per unit of work done, reported to `progress` (starting at 0 of `total`)."""
    done = 0
    if progress is not None:
        progress(0, total)

    def advance() -> None:
        nonlocal done
        done += 1
        if progress is not None:
            progress(done, total)

    return advance


def _aware(moment: datetime) -> datetime:
    return moment if moment.tzinfo is not None else moment.replace(tzinfo=timezone.utc)


def _age_s(group: ObjectGroup, now: datetime) -> float | None:
    newest = group.newest()
    return None if newest is None else (now - newest).total_seconds()


def _old_enough(age: float | None, safety_age_s: float) -> bool:
    return age is not None and age >= safety_age_s


def _collect_attempts(
    catalog: Catalog,
    info: StepFolder,
    committed: bool,
    decision: RetentionDecision,
    now: datetime,
    safety_age_s: float,
    report: GcReport,
) -> None:
    """The attempt folders of one step folder that no kept step needs (`decision`): a failed
    attempt of a committed step, a save that never committed, a retired step's objects that no
    kept step references any more.

    Quarantine records and the attempt folders they name are kept for inspection. Just before
    an attempt of a step that was not committed is deleted, its manifest is looked for again:
    a save that commits meanwhile keeps its objects.
    """
    held = catalog.quarantined_attempts(info.step) if info.quarantined else set()
    for attempt, group in sorted(info.attempts.items()):
        folder = f"{info.folder}/{attempt}"
        if attempt in held:
            report.kept.append(f"{group.prefix} (held by a quarantine record)")
            continue
        if folder in decision.needed:
            if not committed:  # a retired step's objects, held for a kept one
                report.kept.append(f"{group.prefix} (referenced by a kept step)")
            continue
        why = decision.holds_back(info.step)
        if why is not None:
            report.kept.append(f"{group.prefix} ({why})")
            continue
        age = _age_s(group, now)
        if not _old_enough(age, safety_age_s):
            _keep(report, group.prefix, age, safety_age_s)
            continue
        if not group.objects:
            continue  # only open uploads: aborted below, with the others
        if not committed and catalog.is_committed(info.step):
            report.kept.append(f"{group.prefix} (committed while gc ran)")
            log.info("gc: step %d committed while gc ran; left alone", info.step)
            return
        kind = "attempt" if committed else "uncommitted"
        _delete_group(catalog, kind, group, age, info.step, report)


def _keep(report: GcReport, prefix: str, age: float | None, safety_age_s: float) -> None:
    why = (
        "time of last write unknown"
        if age is None
        else f"last write {age:.0f} s ago, within the {safety_age_s:.0f} s safety age"
    )
    report.kept.append(f"{prefix} ({why}; may still be writing)")
    log.info("gc: keeping %s: %s", prefix, why)


def _delete_group(
    catalog: Catalog,
    kind: str,
    group: ObjectGroup,
    age: float | None,
    step: int,
    report: GcReport,
) -> None:
    keys = [o.key for o in group.objects]
    action = GcAction(kind, group.prefix, len(keys), sum(o.size for o in group.objects), age, step)
    if not report.dry_run and keys:
        catalog.store.delete_many(keys)
    _record(report, action)


def _retire(
    catalog: Catalog, info: StepFolder, decision: RetentionDecision, report: GcReport
) -> None:
    """Retention: delete a committed checkpoint, manifest first; never the newest readable one,
    nor the objects that a kept step needs (`decision`)."""
    folder = f"{info.folder}/"
    going = [o for o in info.everything if may_delete_key(o.key, decision)]
    action = GcAction("retention", folder, len(going), sum(o.size for o in going), None, info.step)
    if not report.dry_run:
        catalog.remove_steps([info.step], decision, [])
    _record(report, action)


def _abort_uploads(
    store: ObjectStore,
    uploads: list[UploadInfo],
    now: datetime,
    safety_age_s: float,
    report: GcReport,
) -> None:
    for upload in uploads:
        active = upload.last_activity or upload.initiated
        age = None if active is None else (now - _aware(active)).total_seconds()
        if not _old_enough(age, safety_age_s):
            _keep(report, f"upload {upload.key}", age, safety_age_s)
            continue
        if not report.dry_run:
            store.abort_upload(upload)
        step = parse_step_folder(upload.key.partition("/")[0])
        _record(report, GcAction("upload", upload.key, 0, 0, age, step))


def _collect_probes(catalog: Catalog, now: datetime, safety_age_s: float, report: GcReport) -> None:
    """Delete clock probes older than the safety age (a younger one may be another gc's)."""
    for probe in catalog.clock_probes():
        written = probe.last_modified
        age = None if written is None else (now - _aware(written)).total_seconds()
        if not _old_enough(age, safety_age_s):
            continue
        if not report.dry_run:
            catalog.store.delete_many([probe.key])
        _record(report, GcAction("probe", probe.key, 1, probe.size, age))


def _record(report: GcReport, action: GcAction) -> None:
    report.actions.append(action)
    verb = "would delete" if report.dry_run else "deleted"
    if action.kind == "upload":
        verb = "would abort" if report.dry_run else "aborted"
    log.info(
        "gc: %s %s %s (%d objects, %s)",
        verb,
        action.kind,
        action.target,
        action.objects,
        human_size(action.bytes),
    )
