"""Retention's view of one node's fast-tier steps (`TierReadings`), and the tier record's read.

The tier keeps its steps under the bucket's retention rule (`spotckpt.policy`), read on one node.
A tier step of the job is readable when its manifest validates (signed for the job where a
keyring enforces signing, as a restore checks), its tier record parses and fits the manifest,
and every object the manifest names is in the tier at its size. A node holds only its part of a
step saved over several nodes (its ranks' objects, and replicas or parity of others'); whether
the nodes' parts make the step whole is told by a restore over all of them
(`spotckpt.tiers.recovery.choose_step`), so a node checks the objects only when it is the tier's
only node. An unreadable step takes no keep_last slot and, unlike in the bucket by default, is
deleted (`RetentionPolicy.delete_unreadable`, the rule ``gc --delete-unreadable`` applies): the
tier is a cache, nothing restores from such a step, and its room is for steps that can be
restored. A tier step never references another (fast saves are never incremental), so a retired
step's folder goes whole.
"""

from __future__ import annotations

from datetime import datetime

from spotckpt.catalog import Catalog
from spotckpt.errors import (
    CheckpointError,
    ManifestError,
    NoCheckpointError,
)
from spotckpt.format.manifest import Manifest
from spotckpt.format.signing import Keyring
from spotckpt.layout import (
    MANIFEST_NAME,
    STEP_LISTING_DELIMITER,
    STEP_PREFIX,
    TIER_RECORD_NAME,
    attempt_folders,
    parse_step_folder,
    referenced_folders,
    step_folder,
    tier_record_key,
)
from spotckpt.policy import StepReading
from spotckpt.step_readings import missing_objects
from spotckpt.storage.base import ObjectInfo, ObjectStore
from spotckpt.tiers.record import MAX_RECORD_BYTES, TierRecord

Listed = tuple[str, ObjectInfo, ObjectInfo | None]
"""What a reading is known by: the job asked for, the manifest and the tier record as listed."""


def read_record(store: ObjectStore, step: int, attempt: str | None) -> TierRecord:
    """The tier record of `step`, size-checked before the read (ManifestError if damaged)."""
    key = tier_record_key(step)
    info = store.head(key)
    if info is None:
        raise ManifestError(f"tier record of step {step} is missing")
    if info.size > MAX_RECORD_BYTES:
        raise ManifestError(f"tier record of step {step} is {info.size} bytes: too large")
    return TierRecord.from_json(store.get_range(key, 0, info.size), step=step, attempt=attempt)


class TierReadings:
    """The `StepReading`s of one node's committed tier steps of a job, from `catalog` (the
    node's folder); see the module docstring. `whole_here`: this node is the tier's only one.
    A step is read again only when the listing shows its manifest or tier record changed, so a
    prune costs one listing plus the reads of the steps saved since the last one."""

    def __init__(self, catalog: Catalog, keyring: Keyring | None, *, whole_here: bool) -> None:
        self.catalog = catalog
        self.keyring = keyring
        self.whole_here = whole_here
        self._known: dict[int, tuple[Listed, StepReading | None]] = {}

    def read(self, job: str, below: int | None = None) -> list[StepReading]:
        """The readings of the committed steps older than `below` (all when None) whose tier
        record names `job`; a step whose record names another job, or cannot be read (whose
        step it is cannot be told), is not this job's to keep and has none."""
        listing = self.catalog.store.list_delimited(STEP_PREFIX, STEP_LISTING_DELIMITER)
        tops: dict[int, dict[str, ObjectInfo]] = {}
        for info in listing.objects:
            folder, _, name = info.key.partition("/")
            step = parse_step_folder(folder)
            if step is not None and name in (MANIFEST_NAME, TIER_RECORD_NAME):
                tops.setdefault(step, {})[name] = info
        known: dict[int, tuple[Listed, StepReading | None]] = {}
        for step, infos in sorted(tops.items()):
            if MANIFEST_NAME not in infos or (below is not None and step >= below):
                continue
            listed = (job, infos[MANIFEST_NAME], infos.get(TIER_RECORD_NAME))
            before = self._known.get(step)
            if before is not None and before[0] == listed and _timed(listed):
                known[step] = before
            else:
                known[step] = (listed, self._reading(step, job))
        self._known = known
        return [reading for _, reading in known.values() if reading is not None]

    def forget(self, step: int) -> None:
        """Read `step` again next time (its folder was removed: a new save may reuse its name
        with the same sizes within the listing's time resolution)."""
        self._known.pop(step, None)

    def _reading(self, step: int, job: str) -> StepReading | None:
        """Retention's view of tier `step` of `job`; None when it is not `job`'s or vanished."""
        manifest: Manifest | None = None
        problem = ""
        try:
            data = self.catalog.manifest_bytes(step)
            if self.keyring is not None:
                what = f"tier step {step}'s manifest"
                self.keyring.check(data, step=step, job=job, what=what)
            manifest = Manifest.from_json(data, expected_step=step)
        except NoCheckpointError:
            return None  # removed meanwhile (another rank of this node prunes too)
        except (CheckpointError, OSError) as error:  # one bad step never stops the pruning
            problem = f"{type(error).__name__}: {error}"
        try:
            record = read_record(self.catalog.store, step, manifest.attempt if manifest else None)
        except (CheckpointError, OSError):
            return None
        if record.job != job:
            return None
        if manifest is None:
            return StepReading(step, None, problem)
        sizes = {key: entry.size for key, entry in manifest.objects.items()}
        try:
            record.check(sizes)
        except ManifestError as error:
            return StepReading(step, None, f"{type(error).__name__}: {error}")
        try:
            missing = missing_objects(self.catalog.store, step, sizes) if self.whole_here else []
        except (CheckpointError, OSError) as error:
            return StepReading(step, None, f"{type(error).__name__}: {error}")
        if missing:  # this node is the tier: the step cannot be restored
            return StepReading(step, None, f"{len(missing)} object(s) not whole: {missing[0]}")
        own = {f"{step_folder(step)}/{name}" for name in attempt_folders(manifest)}
        return StepReading(step, frozenset(own | referenced_folders(manifest)))


def _timed(listed: Listed) -> bool:
    """Whether the listing gave times, which tell a file rewritten at the same size apart."""
    times: list[datetime | None] = [info.last_modified for info in listed[1:] if info is not None]
    return all(time is not None for time in times)
