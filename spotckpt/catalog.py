"""`Catalog`: reads and changes one checkpoint root's layout (`spotckpt.layout` names it).

The layout's names are `spotckpt.layout`'s; the manifest formats are read by
`spotckpt.manifest_reading.ManifestReader`, retention's view of the steps by
`spotckpt.step_readings.StepReadings`, and steps are deleted under the retention rule
(`spotckpt.policy`) by `spotckpt.step_removal.StepRemoval`. `Catalog` is their front: the DCP
writer and reader, the manager, gc, verify, export and the CLI go through it.

gc learns the store's time from its clock probe (`Catalog.store_time`): object times are the
store's, and a host's own clock may be hours off. A probe left behind by a gc that died is
collected by a later one.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

from spotckpt.errors import (
    AlreadyExistsError,
    CheckpointAlreadyCommittedError,
    CheckpointError,
    InvalidKeyError,
    ManifestError,
    MirrorConflictError,
    NoCheckpointError,
    ObjectNotFoundError,
    SaveFailedError,
    StorageError,
    StoreClockError,
)
from spotckpt.format.index import Root
from spotckpt.format.manifest import Manifest, check_manifest_size
from spotckpt.format.signing import Keyring, keyring_of
from spotckpt.layout import (
    ATTEMPT_PREFIX,
    CLOCK_PROBE_PREFIX,
    JOB_KEY,
    LOOKS_LIKE_STEP,
    MANIFEST_NAME,
    MAX_JOB_BYTES,
    QUARANTINE_PREFIX,
    REASON_NAME,
    STEP_DIGITS,
    STEP_LISTING_DELIMITER,
    STEP_PREFIX,
    JobIdentity,
    attempt_prefix,
    aware,
    clock_probe_key,
    manifest_key,
    parse_step_folder,
    step_folder,
)
from spotckpt.manifest_reading import ManifestReader, WantedFromRoot
from spotckpt.policy import RetentionDecision, StepReading
from spotckpt.step_readings import MISSING_NAMED, StepReadings, missing_objects
from spotckpt.step_removal import StepRemoval
from spotckpt.storage.base import Listing, ObjectInfo, ObjectStore, UploadInfo, check_key
from spotckpt.storage.copying import Expected

log = logging.getLogger("spotckpt")

COPY_PIECE = 512 << 10


@dataclass
class ObjectGroup:
    """Objects and open uploads under one prefix, with the time of the newest activity there."""

    prefix: str
    objects: list[ObjectInfo] = field(default_factory=list)
    uploads: list[UploadInfo] = field(default_factory=list)

    def newest(self) -> datetime | None:
        """Newest write (an upload's latest part counts); None if any time is unknown."""
        times = [o.last_modified for o in self.objects] + [
            u.last_activity or u.initiated for u in self.uploads
        ]
        if not times or any(t is None for t in times):
            return None
        return max(aware(t) for t in times if t is not None)


@dataclass
class StepFolder:
    """One step folder: its manifest (if any), its objects by attempt, quarantined records."""

    step: int
    has_manifest: bool = False
    attempts: dict[str, ObjectGroup] = field(default_factory=dict)
    everything: list[ObjectInfo] = field(default_factory=list)
    uploads: list[UploadInfo] = field(default_factory=list)
    quarantined: list[str] = field(default_factory=list)

    @property
    def folder(self) -> str:
        """The folder name."""
        return step_folder(self.step)


@dataclass
class Scan:
    """Everything under the root, from one listing: step folders, open uploads, look-alikes."""

    steps: dict[int, StepFolder]
    uploads: list[UploadInfo]
    look_alikes: list[str]

    @property
    def committed(self) -> list[int]:
        """Committed steps, ascending."""
        return sorted(s for s, info in self.steps.items() if info.has_manifest)


class Catalog:
    """The layout of one checkpoint root over an `ObjectStore`; see the module docstring."""

    def __init__(self, store: ObjectStore, keyring: Keyring | None = None) -> None:
        """With a `keyring` that holds any key, every manifest read must be signed for this
        root's job (`spotckpt.format.signing`)."""
        self.store = store
        self.keyring = keyring if keyring is not None and keyring.enforcing else None
        self._reported: set[str] = set()
        self._manifests = ManifestReader(store, self.keyring, self.job)
        self._readings = StepReadings(store, self._manifests.read, self._step_listing)
        self._removal = StepRemoval(store, self._readings, self._listed, self._reported)

    @property
    def uri(self) -> str:
        """The root's URI."""
        return self.store.uri

    # Reading ----------------------------------------------------------------------------------

    def steps(self) -> list[int]:
        """Committed steps, ascending; look-alike folders are reported once and left out.

        One delimited listing (`STEP_LISTING_DELIMITER`): each step folder's manifest is listed
        and its attempt objects are rolled up into one prefix, so the cost is about one request
        per 500 steps, however many objects each holds.
        """
        return sorted(self._committed(self._step_listing()))

    def _step_listing(self) -> Listing:
        """The step folders' manifests and other top objects; attempt objects rolled up."""
        listing = self.store.list_delimited(STEP_PREFIX, STEP_LISTING_DELIMITER)
        folders = {info.key.partition("/")[0] for info in listing.objects}
        folders.update(prefix.partition("/")[0] for prefix in listing.prefixes)
        for folder in sorted(folders):
            if parse_step_folder(folder) is None:
                self._report_look_alike(folder)
        return listing

    @staticmethod
    def _committed(listing: Listing) -> set[int]:
        found = set()
        for info in listing.objects:
            folder, _, name = info.key.partition("/")
            step = parse_step_folder(folder)
            if step is not None and name == MANIFEST_NAME:
                found.add(step)
        return found

    def latest(self) -> int | None:
        """The newest committed step, or None."""
        committed = self.steps()
        return committed[-1] if committed else None

    def is_committed(self, step: int) -> bool:
        """Whether `step` has a manifest."""
        return self.store.exists(manifest_key(step))

    def resolve(self, step: int | None) -> int:
        """`step` if it is committed, or the latest committed step; NoCheckpointError if none."""
        if step is None:
            latest = self.latest()
            if latest is None:
                raise NoCheckpointError(f"no committed checkpoint at {self.uri}")
            return latest
        if not self.is_committed(step):
            raise NoCheckpointError(f"step {step} has no committed checkpoint at {self.uri}")
        return step

    def manifest_bytes(self, step: int) -> bytes:
        """The raw manifest of a committed step, size-checked before the read."""
        return self._manifests.raw(step)

    def read_manifest(
        self, step: int, wanted: WantedFromRoot | None = None, *, data: bytes | None = None
    ) -> Manifest:
        """The validated manifest of a committed step (ManifestError, NoCheckpointError); see
        `spotckpt.manifest_reading.ManifestReader.read` (`wanted`: what an indexed one's reader
        needs; `data`: the manifest's bytes when already fetched)."""
        return self._manifests.read(step, wanted, data=data)

    def stored_objects(self, step: int, data: bytes) -> dict[str, Expected]:
        """Every object a committed step needs, by key relative to the root, with what it must
        be (`spotckpt.manifest_reading.ManifestReader.stored_objects`): what a copy of the step
        elsewhere copies and checks."""
        return self._manifests.stored_objects(step, data)

    def check_signed(self, data: bytes, step: int) -> None:
        """SignatureError unless manifest `data` of `step` is signed as this root's keyring
        requires (nothing to check without one)."""
        check_manifest_size(len(data), step)
        self._manifests.check_signed(data, step, f"manifest of step {step}")

    def _parse(self, data: bytes, step: int) -> Manifest | Root:
        """A flat manifest whole, or an indexed one's root."""
        return self._manifests.parse(data, step)

    def read_steps(self) -> list[StepReading]:
        """Every committed step's `StepReading` (retention's view, `spotckpt.policy`), from one
        listing in which every manifest was read (`spotckpt.step_readings.StepReadings.read`).
        StorageError when the steps keep changing, or the store fails."""
        return self._readings.read()

    def learn_committed(self, manifest: Manifest, data: bytes) -> None:
        """Take `manifest` (or an indexed root's summary), committed by this process as `data`,
        for the retention after the commit instead of reading it back
        (`spotckpt.step_readings.StepReadings.committed`), once `data` passes what a reader
        checks before it parses: the size bound and, with a keyring, the signature. What fails
        is left for retention to read back and judge (an unsigned step under a keyring that
        requires signatures takes no slot of keep_last)."""
        try:
            check_manifest_size(len(data), manifest.step)
            self._manifests.check_signed(data, manifest.step, f"manifest of step {manifest.step}")
        except ManifestError:
            return
        self._readings.committed(manifest, len(data))

    def committed_attempt(self, step: int, data: bytes | None = None) -> str | None:
        """The attempt id a step's manifest names (`data`: its bytes when already read); None
        if it has none or it does not parse."""
        try:
            return self._parse(
                data if data is not None else self.manifest_bytes(step), step
            ).attempt
        except (NoCheckpointError, ManifestError):
            return None

    def job(self) -> JobIdentity | None:
        """The root's job identity; None when it has none (an older root, or never saved to).

        A damaged ``job.json`` is a ManifestError: callers decide what an unknown job costs."""
        info = self.store.head(JOB_KEY)
        if info is None:
            return None
        where = f"{self.uri}/{JOB_KEY}"
        if info.size > MAX_JOB_BYTES:
            raise ManifestError(f"job identity {where} is {info.size} bytes: too large")
        try:
            data = self.store.get_range(JOB_KEY, 0, info.size)
        except ObjectNotFoundError:
            return None
        return JobIdentity.from_json(data, where)

    def ensure_job(self) -> JobIdentity:
        """The root's job identity, created (create-only) if it has none yet.

        Of two creators exactly one wins; both return the winner's identity. ManifestError when
        a ``job.json`` is there but damaged: it is never overwritten (it may be another job's).
        """
        found = self.job()
        if found is not None:
            return found
        created = JobIdentity.new()
        try:
            self.store.put(JOB_KEY, created.to_json(), create_only=True)
        except AlreadyExistsError:
            winner = self.job()
            if winner is None:
                raise StorageError(f"{self.uri}/{JOB_KEY} vanished while it was created") from None
            return winner
        return created

    def adopt_job(self, identity: JobIdentity) -> None:
        """Give this root another root's job `identity` (create-only), as a mirror of that root
        needs for its signatures and references to check; MirrorConflictError when the root
        belongs to another job already."""
        found = self.job()
        if found is None:
            try:
                self.store.put(JOB_KEY, identity.to_json(), create_only=True)
                return
            except AlreadyExistsError:
                found = self.job()
        if found is None or found.id != identity.id:
            raise MirrorConflictError(
                f"{self.uri} belongs to job {found.id if found else None!r}, not to job "
                f"{identity.id!r}: a root holds one job's checkpoints"
            )

    def scan(self, *, with_uploads: bool = True) -> Scan:
        """Step folders by step from one listing, and (if asked) the unfinished uploads."""
        uploads = self.store.list_uploads("") if with_uploads else []
        steps: dict[int, StepFolder] = {}
        look_alikes: set[str] = set()
        for info in self._listed(STEP_PREFIX):
            entry = self._entry(steps, info.key, look_alikes)
            if entry is None:
                continue
            entry.everything.append(info)
            rest = info.key.partition("/")[2]
            head, slash, _tail = rest.partition("/")
            if rest == MANIFEST_NAME:
                entry.has_manifest = True
            elif slash and head.startswith(QUARANTINE_PREFIX) and head not in entry.quarantined:
                entry.quarantined.append(head)
            group = self._attempt_group(entry, rest)
            if group is not None:
                group.objects.append(info)
        for upload in uploads:
            entry = self._entry(steps, upload.key, look_alikes)
            if entry is None:
                continue
            entry.uploads.append(upload)
            group = self._attempt_group(entry, upload.key.partition("/")[2])
            if group is not None:
                group.uploads.append(upload)
        return Scan(steps, uploads, sorted(look_alikes))

    def _entry(
        self, steps: dict[int, StepFolder], key: str, look_alikes: set[str]
    ) -> StepFolder | None:
        folder, slash, _rest = key.partition("/")
        step = parse_step_folder(folder)
        if step is None:
            if LOOKS_LIKE_STEP.match(folder):
                look_alikes.add(folder)
            self._report_look_alike(folder)
            return None
        return steps.setdefault(step, StepFolder(step)) if slash else None

    @staticmethod
    def _attempt_group(entry: StepFolder, rest: str) -> ObjectGroup | None:
        head, slash, _tail = rest.partition("/")
        if not slash or not head.startswith(ATTEMPT_PREFIX):
            return None
        return entry.attempts.setdefault(head, ObjectGroup(f"{entry.folder}/{head}/"))

    def quarantined_attempts(self, step: int) -> set[str]:
        """Attempt folders that a quarantine record of `step` keeps for inspection."""
        held: set[str] = set()
        folder = step_folder(step)
        for info in self._listed(f"{folder}/{QUARANTINE_PREFIX}"):
            if not info.key.endswith(f"/{REASON_NAME}") or info.size > 1 << 20:
                continue
            try:
                reason = json.loads(self.store.get(info.key))
            except (ObjectNotFoundError, ValueError):
                continue
            names = reason.get("attempts") if isinstance(reason, dict) else None
            if isinstance(names, list):
                held.update(n for n in names if isinstance(n, str))
        return held

    def _report_look_alike(self, folder: str) -> None:
        if LOOKS_LIKE_STEP.match(folder) and folder not in self._reported:
            self._reported.add(folder)
            log.warning(
                "ignoring %r under %s: it looks like a step folder but is not the canonical "
                "name of one (expected step- and %d ASCII digits); if it holds a standard DCP "
                "checkpoint (.metadata), dcp_reader reads it and `spotckpt import-dcp` imports it",
                folder,
                self.uri,
                STEP_DIGITS,
            )

    # The store's clock -------------------------------------------------------------------------

    def store_time(self) -> datetime:
        """The store's current time: a probe object is written, its time read back, and the
        probe deleted (three requests).

        Object times come from the store's clock, so their ages must be judged by it, not by
        this host's, which may be hours off. StoreClockError when the probe cannot be written
        or the store gives it no time.
        """
        key = clock_probe_key()
        try:
            self.store.put(key, b"")
        except StorageError as error:
            raise StoreClockError(
                f"gc could not write its clock probe {self.uri}/{key} ({error}); it learns the "
                f"store's time from that object and does not run without it (a dry run too): "
                f"allow writes and deletes under {self.uri}/{CLOCK_PROBE_PREFIX}*"
            ) from error
        try:
            info = self.store.head(key)
        finally:
            self.store.delete_many([key])
        if info is None or info.last_modified is None:
            raise StoreClockError(
                f"{self.uri} gave its clock probe {key} no time, so gc cannot tell how old "
                "anything is by the store's clock and deletes nothing; the store must report "
                "when objects were written (S3 Last-Modified, GCS updated, a file's mtime)"
            )
        return aware(info.last_modified)

    def clock_probes(self) -> list[ObjectInfo]:
        """Clock probes still in the store: another gc's, in flight, or one that a gc that died
        left behind."""
        return list(self._listed(CLOCK_PROBE_PREFIX))

    # Committing -------------------------------------------------------------------------------

    def commit(self, manifest: Manifest, data: bytes, *, overwrite: bool = False) -> None:
        """`commit_bytes` for an encoded `manifest`, which references its objects."""
        sizes = {key: record.size for key, record in manifest.objects.items()}
        self.commit_bytes(manifest.step, manifest.attempt, data, sizes, overwrite=overwrite)

    def commit_bytes(
        self,
        step: int,
        attempt: str,
        data: bytes,
        referenced: Mapping[str, int],
        *,
        overwrite: bool = False,
    ) -> None:
        """Write `data` (an encoded manifest or indexed root) create-only: the commit point of
        a save, so that a committed manifest never references a missing object.

        First every object it references (`referenced`: key relative to the step folder, and
        size) is checked (`check_referenced`): one missing or of another size fails the save
        before anything is written. When the put's outcome is ambiguous (a 412 after a retried
        put whose first answer was lost, or an error after the request may have reached the
        store), the manifest is read back: if it names this attempt the save is committed. Raises
        CheckpointAlreadyCommittedError when another writer's manifest is there.

        Once written, the objects are checked again: something that deleted them between the
        first check and the put (a gc with a short safety age, which saw no manifest yet) makes
        the manifest be deleted again and the save fail, rather than stay committed over
        missing objects (an overwrite puts the manifest it replaced back instead, when every
        object that one needs is still there). A gc that runs after the put finds the manifest
        and keeps them.

        With `overwrite` (only `spotckpt.dcp.dcp_writer`'s, as DCP's own writers overwrite) the
        put replaces a manifest already there in one atomic put: a reader sees the old step or
        the new one. The old attempt's objects stay for readers that read the old manifest
        until gc collects them (after its safety age, unless a kept step references them).
        """
        self.check_referenced(step, referenced)
        replaced: bytes | None = None
        if overwrite:
            replaced = self._replaced(step)
            self._replace_manifest(step, attempt, data)
        else:
            self._put_manifest(step, attempt, data)
        wrong = self.missing_objects(step, referenced)
        if wrong:
            if replaced is not None and self._reinstate(step, replaced):
                raise self._missing_error(
                    step,
                    wrong,
                    "was withdrawn right after it was written (the step it replaced is back)",
                )
            self.store.delete_many([manifest_key(step)])
            raise self._missing_error(step, wrong, "was withdrawn right after it was written")

    def _replaced(self, step: int) -> bytes | None:
        """The manifest an overwrite of `step` replaces, for `_reinstate`; None when there is
        none to put back (not committed, gone meanwhile, or not readable)."""
        try:
            return self._manifests.raw(step)
        except (NoCheckpointError, ManifestError, ObjectNotFoundError):
            return None

    def _reinstate(self, step: int, replaced: bytes) -> bool:
        """Put back the manifest an overwrite replaced, when every object it needs is still
        there before and after the put (a gc may have taken them once the new manifest stopped
        naming them); False when it cannot be: then no manifest at all is better than one over
        missing objects."""
        try:
            needed = self.stored_objects(step, replaced)
            if not self._all_there(needed):
                return False
            self.store.put(manifest_key(step), replaced)
            self._readings.forget([step])
            return self._all_there(needed)
        except CheckpointError as error:
            log.warning("step %d: the manifest it replaced cannot be put back: %s", step, error)
            return False

    def _all_there(self, needed: Mapping[str, Expected]) -> bool:
        for key, expected in needed.items():
            info = self.store.head(key)
            if info is None or info.size != expected.size:
                return False
        return True

    def _replace_manifest(self, step: int, attempt: str, data: bytes) -> None:
        self._readings.forget([step])  # what retention read of the old manifest is stale
        try:
            self.store.put(manifest_key(step), data)
        except StorageError:
            if self.committed_attempt(step) == attempt:
                return
            raise

    def _put_manifest(self, step: int, attempt: str, data: bytes) -> None:
        key = manifest_key(step)
        try:
            self.store.put(key, data, create_only=True)
            return
        except AlreadyExistsError:
            if self.committed_attempt(step) == attempt:
                return
            raise CheckpointAlreadyCommittedError(
                f"step {step} was already committed by another writer while this one "
                f"was saving; this attempt ({attempt}) is discarded"
            ) from None
        except StorageError:
            if self.committed_attempt(step) == attempt:
                log.warning(
                    "the manifest put of step %d failed, but reading it back shows it was "
                    "written: the checkpoint is committed",
                    step,
                )
                return
            raise

    def check_referenced(self, step: int, referenced: Mapping[str, int]) -> None:
        """SaveFailedError naming the objects of `referenced` (key relative to the step folder,
        and size) that are missing or of another size. Something deleted or rewrote them after
        their rank wrote them (a gc whose safety age is too short, a lifecycle rule, a person):
        a manifest must not point at them.
        """
        wrong = self.missing_objects(step, referenced)
        if wrong:
            raise self._missing_error(step, wrong, "is not written")

    def _missing_error(self, step: int, wrong: list[str], what: str) -> SaveFailedError:
        more = f" and {len(wrong) - MISSING_NAMED} more" if len(wrong) > MISSING_NAMED else ""
        return SaveFailedError(
            f"the manifest of step {step} {what}: {'; '.join(wrong[:MISSING_NAMED])}"
            f"{more} under {self.uri} (deleted or rewritten after its rank wrote it); save "
            "again, and look for what deletes objects under the root (a gc with a short "
            "--safety-age, a bucket lifecycle rule)"
        )

    def missing_objects(self, step: int, expected: Mapping[str, int]) -> list[str]:
        """The objects of `expected` (key relative to the step folder, and size) that are
        missing or of another size, each described."""
        return missing_objects(self.store, step, expected)

    def check_not_committed(self, step: int) -> None:
        """CheckpointAlreadyCommittedError if `step` has a manifest already."""
        if self.is_committed(step):
            raise CheckpointAlreadyCommittedError(
                f"step {step} is already committed at {self.uri}/{manifest_key(step)}; a "
                "committed checkpoint is never overwritten"
            )

    def discard_attempt(self, step: int, attempt: str) -> None:
        """After a failed save: abort the attempt's uploads and delete its objects.

        Nothing is deleted when a manifest names the attempt (the save did commit) or when that
        cannot be told (the store is unreachable): gc collects what is left.
        """
        try:
            if self.committed_attempt(step) == attempt:
                log.warning("attempt %s of step %d is committed; not discarding it", attempt, step)
                return
            prefix = attempt_prefix(step, attempt)
            for upload in self.store.list_uploads(prefix):
                self.store.abort_upload(upload)
            self.store.delete_many([info.key for info in self._listed(prefix)])
        except StorageError as error:
            log.warning(
                "could not clean up failed attempt %s of step %d: %s (gc will)",
                attempt,
                step,
                error,
            )

    # Deleting ---------------------------------------------------------------------------------

    def delete_step(self, step: int, *, newest: int | None = None) -> None:
        """Delete a committed checkpoint on request, under the retention rule; refuses the newest
        readable one (`newest`, if the caller knows it). See `StepRemoval.delete_step`."""
        self._removal.delete_step(step, newest=newest)

    def retire(self, keep_last: int) -> list[int]:
        """Delete committed checkpoints beyond the newest `keep_last` readable ones under the
        retention rule; returns their steps. See `StepRemoval.retire`."""
        return self._removal.retire(keep_last)

    def remove_steps(
        self, steps: list[int], decision: RetentionDecision, readings: list[StepReading]
    ) -> None:
        """Delete the manifests of `steps`, then what `decision` lets go of their folders and
        of the folders only they needed (`readings`). See `StepRemoval.remove_steps`."""
        self._removal.remove_steps(steps, decision, readings)

    def _listed(self, prefix: str) -> Iterator[ObjectInfo]:
        """`store.list(prefix)` without the keys in step folders (or among gc's probes) that
        spotckpt would never write (an empty or dot segment, say, which some stores accept):
        each is skipped with a warning that names it, once, so that one such object never stops
        retention or gc for the rest. Look-alike folders' keys are listed as they are."""
        for info in self.store.list(prefix):
            try:
                check_key(info.key)
            except InvalidKeyError as error:
                ours = parse_step_folder(info.key.partition("/")[0]) is not None
                if not ours and not info.key.startswith(CLOCK_PROBE_PREFIX):
                    yield info  # a look-alike's: reported by the caller, never deleted
                    continue
                if info.key not in self._reported:
                    self._reported.add(info.key)
                    log.warning(
                        "skipping an object under %s that spotckpt never writes: %s",
                        self.uri,
                        error,
                    )
                continue
            yield info

    def quarantine(self, step: int, reason: str) -> str | None:
        """Move a bad step's manifest aside so the step can be saved again; returns the record.

        The bytes stay for inspection under ``quarantined-<stamp>/`` (readers ignore it, gc keeps
        it and the attempt folders it names); None when the manifest is already gone (the step
        was retired meanwhile, which is not a fault of the checkpoint).
        """
        self._readings.forget([step])
        info = self.store.head(manifest_key(step))
        if info is None:
            return None
        stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%S.%fZ")
        record = f"{step_folder(step)}/{QUARANTINE_PREFIX}{stamp}"
        attempts = sorted(self.scan(with_uploads=False).steps.get(step, StepFolder(step)).attempts)
        self._copy(manifest_key(step), f"{record}/{MANIFEST_NAME}", info.size)
        document = {"step": step, "quarantined_at": stamp, "reason": reason, "attempts": attempts}
        self.store.put(f"{record}/{REASON_NAME}", json.dumps(document, indent=1).encode())
        self.store.delete_many([manifest_key(step)])
        log.warning(
            "quarantined checkpoint step %d (%s): its manifest is kept at %s/%s/; the step can "
            "be saved again",
            step,
            reason,
            self.uri,
            record,
        )
        return record

    def _copy(self, source: str, target: str, size: int) -> None:
        """Copy an object in bounded pieces (a forged manifest may be huge)."""
        with self.store.open_writer(target) as writer:
            for start in range(0, size, COPY_PIECE):
                writer.write(self.store.get_range(source, start, min(COPY_PIECE, size - start)))

    def quarantine_reason(self, step: int, record: str) -> dict[str, Any]:
        """The reason document of a quarantine record (empty if unreadable)."""
        try:
            info = self.store.head(f"{step_folder(step)}/{record}/{REASON_NAME}")
            if info is None or info.size > 1 << 20:
                return {}
            document = json.loads(self.store.get(f"{step_folder(step)}/{record}/{REASON_NAME}"))
        except (StorageError, ValueError):
            return {}
        return document if isinstance(document, dict) else {}

    @classmethod
    def configured(cls, store: ObjectStore, settings: Any) -> Catalog:
        """A catalog that checks signatures as `settings` (a `spotckpt.Config`, a manager's
        settings) configure them: a tool reads a root under the keys its jobs save with."""
        return cls(store, keyring_of(settings))
