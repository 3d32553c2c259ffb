"""`Catalog`: the only owner of the bucket layout.

```
<root>/
  job.json                               the job identity: a random id, create-only, first save
  step-000001200/                        one folder per step, zero-padded (lexical = numeric)
    manifest.json                        the commit point: written last, create-only
    a-<attempt>/r00000-000.safetensors   the objects of one save attempt, one or more per rank
    quarantined-<stamp>/manifest.json    a bad manifest moved aside by restore (never read)
    quarantined-<stamp>/reason.json      why, when, and which attempt folders it held
  events/                                what saves, preemptions and restores cost (goodput)
    <stamp>-<kind>-<writer>-<n>.json     one small JSON event, create-only, by rank 0 only
    summary.json                         older events compacted: counts, sums, recent values
  gc/clock-<id>                          gc's clock probe: an empty object, deleted at once
```
Event names sort by their UTC stamp (``20260102T030405.123456Z``); `kind` is ``save``,
``preemption`` or ``restore``; `writer` is the id of the coordinator's manager and `n` its
sequence number, so that names never collide. Nothing under ``events/`` is a checkpoint: gc,
retention and restore never look there.
A step is committed exactly when ``step-<N>/manifest.json`` exists, under a folder whose name
is the canonical spelling of N. Look-alike folders (``step-0000000012``, other digits, a trailing
newline) are other names: never listed as committed, restored, or deleted by retention, only
reported. Everything else that reads or changes the layout (the DCP writer and reader, the
manager, gc, verify, export, the CLI) goes through this module.

gc learns the store's time from its clock probe (`Catalog.store_time`): object times are the
store's, and a host's own clock may be hours off. A probe left behind by a gc that died is
collected by a later one.

The job identity (`JobIdentity`, ``job.json``) tells this job's steps from another job's: the
coordinator creates it, create-only, at the job's first save of any kind (`Catalog.ensure_job`)
and every rank holds it; a copy goes into every record that must be tied to this job (a fast-tier
step's `spotckpt.tiers.record.TierRecord`). A root without one (written by an older version, or
never saved to) has no identity: nothing that needs one is trusted there.

Older checkpoints may carry a ``latest.json`` hint at the root; nothing reads it any more, and it
is left alone.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
import uuid
from collections.abc import Callable, Iterable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

from spotckpt.errors import (
    AlreadyExistsError,
    BoundedJSONError,
    CheckpointAlreadyCommittedError,
    CheckpointError,
    CorruptCheckpointError,
    InvalidArgumentError,
    InvalidKeyError,
    ManifestError,
    NoCheckpointError,
    ObjectMissingError,
    ObjectNotFoundError,
    SaveFailedError,
    StorageError,
    StoreClockError,
)
from spotckpt.format.bounded_json import loads
from spotckpt.format.index import (
    INDEXED_FORMAT,
    Box,
    Part,
    Root,
    Wanted,
    check_part_size,
    every_chunk,
    manifest_format,
    manifest_from_parts,
    overlapping_chunks,
    parse_part,
    parse_root,
    part_ranks,
)
from spotckpt.format.manifest import MAX_INT, Manifest, check_manifest_size
from spotckpt.format.references import FEATURE as REFERENCES
from spotckpt.format.references import attempt_of, is_reference, object_path
from spotckpt.format.signing import Keyring
from spotckpt.policy import RetentionPolicy, RetentionDecision, StepReading
from spotckpt.storage.base import Listing, ObjectInfo, ObjectStore, UploadInfo, check_key

log = logging.getLogger("spotckpt")

STEP_PREFIX = "step-"
STEP_DIGITS = 9
MANIFEST_NAME = "manifest.json"
TIER_RECORD_NAME = "tier.json"
ATTEMPT_PREFIX = "a-"
QUARANTINE_PREFIX = "quarantined-"
REASON_NAME = "reason.json"
COPY_PIECE = 512 << 10
JOB_KEY = "job.json"
JOB_FORMAT = "spotckpt-job/1"
MAX_JOB_BYTES = 4096
EVENTS_PREFIX = "events/"
EVENT_SUMMARY_KEY = f"{EVENTS_PREFIX}summary.json"
STEP_LISTING_DELIMITER = f"/{ATTEMPT_PREFIX}"
"""Lists step folders without their attempt objects: ``step-N/a-...`` rolls up as ``step-N/a-``."""
PART_READS = 16
"""Index parts of an indexed manifest are read this many at a time."""
REFERENCE_CHECKS = 16
"""A commit checks the objects its manifest references this many at a time (a HEAD each)."""
LISTED_FROM = 32
"""From this many objects in one attempt folder on, a commit checks them with one listing."""
MISSING_NAMED = 5
"""A failed commit names at most this many of the objects it found missing or resized."""
PART_READ_UNCHECKED = 8 << 20
"""An index part the root claims to be larger than this is first looked up (HEAD), so that a
forged root's claim is never the size of a read before the store confirms it; smaller parts
(nearly all) are read at once, with at most `PART_READS` times this many bytes unconfirmed."""
READ_STEPS_TRIES = 5
"""`Catalog.read_steps` lists again this many times at most while manifests vanish under it."""
RETIRE_FOLDER_LISTINGS = 16
"""Up to this many retired folders, `Catalog.retire` lists each on its own."""
CLOCK_PROBE_PREFIX = "gc/clock-"
"""gc's clock probes (`Catalog.store_time`) are written under this prefix of the root."""
_STEP_FOLDER = re.compile(r"step-([0-9]{9,19})")
_EVENT_NAME = re.compile(
    r"events/([0-9]{8}T[0-9]{6}\.[0-9]{6}Z)-([a-z]{1,32})-[0-9a-f]{1,32}-[0-9]{1,12}\.json"
)
_LOOKS_LIKE_STEP = re.compile(r"step-\w", re.UNICODE)
_JOB_ID = re.compile(r"[0-9a-f]{32}")

WantedFromRoot = Callable[[Root], tuple[Mapping[str, list[Box]], Iterable[str]]]
"""What a reader needs of an indexed checkpoint, given its root: boxes by tensor, value names."""


def step_folder(step: int) -> str:
    """The folder of a step, zero-padded so that lexical order is numeric order."""
    if step < 0:
        raise InvalidArgumentError(f"step must be non-negative, got {step}")
    return f"{STEP_PREFIX}{step:0{STEP_DIGITS}d}"


def parse_step_folder(name: str) -> int | None:
    """The step of a folder name made by `step_folder`, or None for any other name.

    Only the canonical spelling counts: ASCII digits, exactly `step_folder`'s zero padding,
    nothing before or after. Look-alikes (``step-0000000012``, a fullwidth digit, a trailing
    newline) are other names, not step 12.
    """
    match = _STEP_FOLDER.fullmatch(name)
    if match is None:
        return None
    step = int(match.group(1))
    return step if step <= MAX_INT and step_folder(step) == name else None


def manifest_key(step: int) -> str:
    """Key of a step's manifest, relative to the checkpoint root."""
    return f"{step_folder(step)}/{MANIFEST_NAME}"


def event_stamp(moment: datetime) -> str:
    """The UTC stamp that starts an event's name: fixed width, so lexical order is time order."""
    return _aware(moment).astimezone(timezone.utc).strftime("%Y%m%dT%H%M%S.%fZ")


def event_key(stamp: str, kind: str, writer: str, number: int) -> str:
    """Key of one event object, relative to the root (see the module docstring)."""
    key = f"{EVENTS_PREFIX}{stamp}-{kind}-{writer}-{number}.json"
    if _EVENT_NAME.fullmatch(key) is None:
        raise InvalidArgumentError(f"not a valid event name: {key!r}")
    return key


def parse_event_key(key: str) -> tuple[str, str] | None:
    """``(stamp, kind)`` of a key made by `event_key`, or None for any other key."""
    match = _EVENT_NAME.fullmatch(key)
    return None if match is None else (match.group(1), match.group(2))


def clock_probe_key() -> str:
    """A new key for gc's clock probe: unique, so that two gc runs never share one."""
    return f"{CLOCK_PROBE_PREFIX}{uuid.uuid4().hex}"


def new_attempt_id() -> str:
    """A unique id for one save attempt."""
    return uuid.uuid4().hex[:16]


def attempt_folder(attempt: str) -> str:
    """The folder name (relative to the step folder) of an attempt's objects."""
    return f"{ATTEMPT_PREFIX}{attempt}"


def attempt_prefix(step: int, attempt: str) -> str:
    """Prefix (relative to the root) of every object of one save attempt."""
    return f"{step_folder(step)}/{attempt_folder(attempt)}/"


def rank_object_key(attempt: str, rank: int, prefix_spread: bool = False) -> str:
    """Key of a rank's object relative to the step folder; spread over 4096 prefixes if asked
    (S3 partitions request rates by prefix)."""
    name = f"r{rank:05d}-000.safetensors"
    if not prefix_spread:
        return f"{attempt_folder(attempt)}/{name}"
    spread = hashlib.sha256(f"{attempt}/{rank}".encode()).hexdigest()[:3]
    return f"{attempt_folder(attempt)}/{spread}/{name}"


def compressed_object_key(key: str) -> str:
    """Key of a rank's object when it holds compressed chunks (`spotckpt.format.compression`):
    no longer safetensors, so not named as such."""
    return key.removesuffix(".safetensors") + ".zblocks"


def index_part_key(attempt: str, rank: int) -> str:
    """Key (relative to the step folder) of a rank's index part in an indexed manifest."""
    return f"{attempt_folder(attempt)}/index-r{rank:05d}.json"


def parity_object_key(attempt: str, group: int, index: int) -> str:
    """Key (relative to the step folder) of an erasure-coded group's parity piece, in the fast
    tier only; beside the rank objects of the same attempt."""
    return f"{attempt_folder(attempt)}/parity-g{group:05d}-p{index:03d}.ec"


def tier_record_key(step: int) -> str:
    """Key of a fast-tier step's placement record, written just before its manifest."""
    return f"{step_folder(step)}/{TIER_RECORD_NAME}"


def step_key(step: int, relative: str) -> str:
    """A key relative to the root, from one relative to the step folder (as manifests hold;
    a reference into an earlier step's folder is already relative to the root)."""
    return object_path(step_folder(step), relative)


def attempt_folders(manifest: Manifest) -> set[str]:
    """The attempt folders (``a-<id>``) of its own step folder whose objects a manifest
    references."""
    own = {key.partition("/")[0] for key in manifest.objects if not is_reference(key)}
    return own | {attempt_folder(manifest.attempt)}


def referenced_folders(manifest: Manifest) -> set[str]:
    """The attempt folders of earlier steps (``step-N/a-<id>``, relative to the root) whose
    objects a manifest references: they outlive their own step while it is kept."""
    return {attempt_of(key) for key in manifest.objects if is_reference(key)}


@dataclass(frozen=True)
class JobIdentity:
    """One job's identity: ``job.json`` at the checkpoint root (see the module docstring).

    `id` is 32 lowercase hex digits (128 random bits), `created_at` the UTC stamp of its creation.
    Records tied to this job carry `id`; `is_job_id` checks the spelling of a copied one.
    """

    id: str
    created_at: str

    @classmethod
    def new(cls) -> JobIdentity:
        """A fresh identity (not yet stored: `Catalog.ensure_job` stores it)."""
        return cls(uuid.uuid4().hex, event_stamp(datetime.now(timezone.utc)))

    def to_json(self) -> bytes:
        """Encoded for ``job.json``."""
        document = {"format": JOB_FORMAT, "id": self.id, "created_at": self.created_at}
        return json.dumps(document, sort_keys=True).encode()

    @classmethod
    def from_json(cls, data: bytes, where: str) -> JobIdentity:
        """Parse and check ``job.json`` (found at `where`); ManifestError names what is wrong."""
        try:
            document = loads(data, f"job identity {where}")
        except BoundedJSONError as error:
            raise ManifestError(str(error)) from None
        if not isinstance(document, dict) or document.get("format") != JOB_FORMAT:
            raise ManifestError(f"job identity {where} is not a {JOB_FORMAT} document")
        job_id, created = document.get("id"), document.get("created_at")
        if not (is_job_id(job_id) and isinstance(created, str) and len(created) <= 64):
            raise ManifestError(f"job identity {where} has no valid id or creation time")
        return cls(str(job_id), created)


def is_job_id(value: object) -> bool:
    """Whether `value` is spelled like a `JobIdentity.id`."""
    return isinstance(value, str) and _JOB_ID.fullmatch(value) is not None


def _aware(moment: datetime) -> datetime:
    return moment if moment.tzinfo is not None else moment.replace(tzinfo=timezone.utc)


def _no_chunks(root: Root) -> tuple[Mapping[str, list[Box]], Iterable[str]]:
    """What retention (`Catalog.read_steps`) wants of an indexed root: no chunk, no value (an
    indexed save never references)."""
    return {}, []


_NO_CHUNKS: WantedFromRoot = _no_chunks


def may_delete_key(key: str, decision: RetentionDecision) -> bool:
    """Whether the object `key` (relative to the root, inside a step folder) may be deleted
    under `decision`: an attempt folder's object as `RetentionDecision.may_delete` says, any
    other object of a step folder unless its step's objects are held back."""
    folder, _, rest = key.partition("/")
    step = parse_step_folder(folder)
    if step is None:
        return False
    head, slash, _tail = rest.partition("/")
    if slash and head.startswith(ATTEMPT_PREFIX):
        return decision.may_delete(f"{folder}/{head}", step)
    return decision.holds_back(step) is None


def _described(key: str, size: int, found: ObjectInfo | None) -> str:
    """What is wrong with an object a manifest names (`Catalog.missing_objects`)."""
    if found is None:
        return f"object {key} is missing"
    return f"object {key} is {found.size} bytes, not the {size} written"


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
        return max(_aware(t) for t in times if t is not None)


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
        self._job_id: str | None = None
        self._reported: set[str] = set()
        self._known: dict[int, tuple[ObjectInfo, StepReading]] = {}

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
        key = manifest_key(step)
        info = self.store.head(key)
        if info is None:
            raise NoCheckpointError(f"step {step} has no committed checkpoint at {self.uri}")
        check_manifest_size(info.size, step)
        try:
            return self.store.get_range(key, 0, info.size)
        except ObjectNotFoundError:
            raise NoCheckpointError(
                f"step {step} has no committed checkpoint at {self.uri}"
            ) from None

    def read_manifest(
        self, step: int, wanted: WantedFromRoot | None = None, *, data: bytes | None = None
    ) -> Manifest:
        """The validated manifest of a committed step (ManifestError, NoCheckpointError): the
        only place that knows the manifest formats.

        A ``spotckpt/1`` manifest is one document. An indexed one (``spotckpt/2``) is a root plus
        index parts: with `wanted` (from the root: the boxes of each tensor and the values a
        reader needs) only the parts that locate those chunks are read, and the manifest lists
        just those chunks; without it, every part, checked. `data` is the manifest's bytes when
        already fetched (the coordinator reads them once for every rank).
        """
        if data is None:
            data = self.manifest_bytes(step)
        header = self._parse(data, step)
        self._check_signed(data, step, f"manifest of step {step}")
        if isinstance(header, Manifest):
            if REFERENCES in header.features:
                self._check_job(header)
            return header
        if wanted is None:
            return self._from_parts(header, every_chunk(header), header.values, set(header.parts))
        boxes, values = wanted(header)
        chunks = overlapping_chunks(header, boxes)
        return self._from_parts(header, chunks, values, part_ranks(header, chunks))

    def _check_signed(self, data: bytes, step: int, what: str) -> None:
        """SignatureError unless `data` is signed for `step` of this root's job (only with a
        keyring; the job identity is read when first needed)."""
        if self.keyring is None:
            return
        if self._job_id is None:  # job.json is create-only: once read, it stays
            job = self.job()
            self._job_id = job.id if job is not None else None
        self.keyring.check(data, step=step, job=self._job_id, what=what)

    def _parse(self, data: bytes, step: int) -> Manifest | Root:
        """A flat manifest whole, or an indexed one's root."""
        declared = manifest_format(data)
        if declared is not None and declared.split("+")[0] == INDEXED_FORMAT:
            return parse_root(data, step)
        return Manifest.from_json(data, expected_step=step)

    def _check_job(self, manifest: Manifest) -> None:
        """ManifestError unless a manifest with references was written by this root's job: a
        reference is trusted only into the steps of the job that owns the root."""
        job = self.job()
        claimed = manifest.incremental.job if manifest.incremental else ""
        if job is None or job.id != claimed:
            raise ManifestError(
                f"step {manifest.step} references earlier steps as job {claimed[:32]!r}, but "
                f"{self.uri} belongs to job {job.id if job else None!r}: its references are not "
                "trusted"
            )

    def read_steps(self) -> list[StepReading]:
        """Every committed step's `StepReading` (retention's view, `spotckpt.policy`), from
        one listing in which every manifest was read: a manifest deleted while it is read (by
        retention or gc elsewhere) means a new listing, so that no step that commits meanwhile
        goes unseen. A manifest this catalog read before, unchanged in the listing, is not read
        again. StorageError when the steps keep changing, or the store fails."""
        for _ in range(READ_STEPS_TRIES):
            listing = self._step_listing()
            manifests = {
                step: info
                for info in listing.objects
                if (step := parse_step_folder(info.key.partition("/")[0])) is not None
                and info.key.partition("/")[2] == MANIFEST_NAME
            }
            try:
                readings = self._readings(manifests)
            except NoCheckpointError:
                continue
            return readings
        raise StorageError(
            f"the committed steps under {self.uri} kept changing while retention read them "
            f"({READ_STEPS_TRIES} listings); nothing was deleted"
        )

    def _readings(self, manifests: dict[int, ObjectInfo]) -> list[StepReading]:
        """The readings of the listed `manifests`, reading those not known from before (a
        listed time tells a manifest re-saved at the same step apart; without one, no reuse)."""
        known = {
            step: reading
            for step, (info, reading) in self._known.items()
            if manifests.get(step) == info and info.last_modified is not None
        }
        fresh = [step for step in manifests if step not in known]
        with ThreadPoolExecutor(max(1, min(PART_READS, len(fresh)))) as pool:
            known.update(zip(fresh, pool.map(self._reading, fresh), strict=True))
        self._known = {step: (manifests[step], reading) for step, reading in known.items()}
        return [known[step] for step in sorted(manifests)]

    def _forget(self, steps: Iterable[int]) -> None:
        """Drop the readings of steps whose manifest this catalog removes: a step saved again
        in the same second with a manifest of the same size would look unchanged in a listing
        that gives times to the second."""
        for step in steps:
            self._known.pop(step, None)

    def _reading(self, step: int) -> StepReading:
        """Retention's view of one committed step; NoCheckpointError when it vanished."""
        try:
            manifest = self.read_manifest(step, wanted=_NO_CHUNKS)
        except (ManifestError, CorruptCheckpointError, BoundedJSONError) as error:
            return StepReading(step, None, f"{type(error).__name__}: {error}")
        missing = self.missing_objects(step, {k: r.size for k, r in manifest.objects.items()})
        if missing:  # a manifest copied without its objects, or objects deleted since
            more = (
                f" and {len(missing) - MISSING_NAMED} more" if len(missing) > MISSING_NAMED else ""
            )
            return StepReading(step, None, f"{'; '.join(missing[:MISSING_NAMED])}{more}")
        own = {f"{step_folder(step)}/{name}" for name in attempt_folders(manifest)}
        return StepReading(step, frozenset(own | referenced_folders(manifest)))

    def _from_parts(
        self, root: Root, wanted: Wanted, values: Iterable[str], ranks: set[int]
    ) -> Manifest:
        """The manifest of `wanted` from the index parts of `ranks` (all of them for a full read,
        so that every part is checked)."""
        ordered = sorted(ranks)
        with ThreadPoolExecutor(max(1, min(PART_READS, len(ordered)))) as pool:
            parts = dict(
                zip(ordered, pool.map(lambda r: self._read_part(root, r), ordered), strict=True)
            )
        return manifest_from_parts(root, wanted, values, parts)

    def _read_part(self, root: Root, rank: int) -> Part:
        """Rank `rank`'s index part, checked: ObjectMissingError when it is gone,
        CorruptCheckpointError when it does not match the root, ManifestError when it is
        forged (among others, when its object is not its rank's own)."""
        record = check_part_size(root, rank)
        folder = step_folder(root.step)
        key = f"{folder}/{record.key}"
        try:
            if record.size > PART_READ_UNCHECKED:
                self._check_part_size(key, record.size)
            data = self.store.get_range(key, 0, record.size)
        except ObjectNotFoundError:
            raise ObjectMissingError(f"index part {key} of rank {rank} is missing") from None
        part = parse_part(data, root, rank, folder)
        self._check_signed(data, root.step, f"index part {key}")
        own = {rank_object_key(root.attempt, rank, spread) for spread in (False, True)}
        if part.record.key not in own:
            raise ManifestError(
                f"index part {key} locates its chunks in object {part.record.key!r}, which is "
                f"not rank {rank}'s own"
            )
        return part

    def _check_part_size(self, key: str, size: int) -> None:
        """CorruptCheckpointError unless the part at `key` has the `size` the root claims."""
        info = self.store.head(key)
        if info is None:
            raise ObjectNotFoundError(key)
        if info.size != size:
            raise CorruptCheckpointError(
                f"index part {key} has {info.size} bytes, the manifest says {size}"
            )

    def committed_attempt(self, step: int) -> str | None:
        """The attempt id a step's manifest names; None if it has none or it does not parse."""
        try:
            return self._parse(self.manifest_bytes(step), step).attempt
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
            if _LOOKS_LIKE_STEP.match(folder):
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
        if _LOOKS_LIKE_STEP.match(folder) and folder not in self._reported:
            self._reported.add(folder)
            log.warning(
                "ignoring %r under %s: it looks like a step folder but is not the canonical "
                "name of one (expected step- and %d ASCII digits)",
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
        return _aware(info.last_modified)

    def clock_probes(self) -> list[ObjectInfo]:
        """Clock probes still in the store: another gc's, in flight, or one that a gc that died
        left behind."""
        return list(self._listed(CLOCK_PROBE_PREFIX))

    # Committing -------------------------------------------------------------------------------

    def commit(self, manifest: Manifest, data: bytes) -> None:
        """`commit_bytes` for an encoded `manifest`, which references its objects."""
        sizes = {key: record.size for key, record in manifest.objects.items()}
        self.commit_bytes(manifest.step, manifest.attempt, data, sizes)

    def commit_bytes(
        self, step: int, attempt: str, data: bytes, referenced: Mapping[str, int]
    ) -> None:
        """Write `data` (an encoded manifest or indexed root) create-only: the commit point of
        a save, so that a committed manifest never references a missing object.

        First every object it references (`referenced`: key relative to the step folder, and
        size) is checked (`check_referenced`): one missing or of another size fails the save
        before anything is written. When the put's outcome is ambiguous (a 412 after a retried
        put whose first answer was lost, or an error after the request may have reached the
        store), the manifest is read back: if it names this attempt the save is committed. Raises
        CheckpointAlreadyCommittedError when another writer's manifest is there.
        """
        self.check_referenced(step, referenced)
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
            more = f" and {len(wrong) - MISSING_NAMED} more" if len(wrong) > MISSING_NAMED else ""
            raise SaveFailedError(
                f"the manifest of step {step} is not written: {'; '.join(wrong[:MISSING_NAMED])}"
                f"{more} under {self.uri} (deleted or rewritten after its rank wrote it); save "
                "again, and look for what deletes objects under the root (a gc with a short "
                "--safety-age, a bucket lifecycle rule)"
            )

    def missing_objects(self, step: int, expected: Mapping[str, int]) -> list[str]:
        """The objects of `expected` (key relative to the step folder, and size) that are
        missing or of another size, each described."""
        keys = sorted(expected)
        found = self._found(step, keys) if keys else {}
        return [
            _described(step_key(step, key), expected[key], info)
            for key in keys
            if (info := found[key]) is None or info.size != expected[key]
        ]

    def _found(self, step: int, keys: list[str]) -> dict[str, ObjectInfo | None]:
        """What the store holds at each of `keys` (relative to the step folder): one listing
        of their folder when there are `LISTED_FROM` or more in one (a request per thousand
        keys), else one HEAD each, `REFERENCE_CHECKS` at a time."""
        folders = {key.partition("/")[0] for key in keys}
        if len(keys) >= LISTED_FROM and len(folders) == 1 and "/" in keys[0]:
            prefix = step_key(step, f"{folders.pop()}/")
            listed = {info.key: info for info in self.store.list(prefix)}
            return {key: listed.get(step_key(step, key)) for key in keys}
        with ThreadPoolExecutor(min(REFERENCE_CHECKS, len(keys))) as pool:
            found = pool.map(lambda key: self.store.head(step_key(step, key)), keys)
            return dict(zip(keys, found, strict=True))

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
        """Delete a committed checkpoint on request, manifest first (never half-visible), under
        the retention rule (`spotckpt.policy`): the objects that other steps need outlive it.

        Refuses the newest readable committed step (`newest`, if the caller knows it, is taken
        as the newest step). An unreadable step may be deleted this way: it is an explicit
        request.
        """
        readings = self.read_steps()
        if newest is None:
            readable = [r.step for r in readings if r.readable]
            newest = max(readable) if readable else None
        mine = [r for r in readings if r.step == step]
        if not mine:
            raise NoCheckpointError(f"step {step} has no committed checkpoint at {self.uri}")
        if newest is not None and step >= newest and mine[0].readable:
            raise CheckpointError(
                f"refusing to delete step {step}: it is the newest committed checkpoint at "
                f"{self.uri}"
            )
        others = RetentionPolicy(None).decide(r for r in readings if r.step != step)
        self.remove_steps([step], others, mine)

    def retire(self, keep_last: int) -> list[int]:
        """Delete committed checkpoints beyond the newest `keep_last` readable ones under the
        retention rule (`spotckpt.policy`); returns their steps.

        Every retired manifest goes first (no checkpoint is ever half-visible), then the objects
        of the retired step folders that no kept step needs, and the folders of earlier steps
        that only the retired ones still needed; nothing else: no other folder, look-alike or
        event. An unreadable step is left alone, with a warning. Cost: the step listing, a GET
        of each manifest not read before by this catalog (`read_steps`), then one listing per
        retired folder or, when more than `RETIRE_FOLDER_LISTINGS` retire at once, one listing
        that stops past the last of them.
        """
        readings = self.read_steps()
        decision = RetentionPolicy(keep_last).decide(readings)
        for reading in readings:
            if not reading.readable:
                self._report_unreadable(reading, decision)
        retired = [r for r in readings if r.step in decision.retired]
        self.remove_steps(list(decision.retired), decision, retired)
        return list(decision.retired)

    def remove_steps(
        self, steps: list[int], decision: RetentionDecision, readings: list[StepReading]
    ) -> None:
        """Delete the manifests of `steps`, then the objects of their folders that `decision`
        (`spotckpt.policy`) lets go, then the folders of other steps that only they needed
        (their `readings`; gc passes none and collects those folders itself)."""
        if not steps:
            return
        self._forget(steps)
        self.store.delete_many([manifest_key(step) for step in steps])
        keys = self._folder_keys({step_folder(s) for s in steps})
        self.store.delete_many([k for k in keys if may_delete_key(k, decision)])
        released = {f for r in readings for f in r.needs or ()} - decision.needed
        going = set(steps)
        for folder in sorted(released):
            step = parse_step_folder(folder.partition("/")[0])
            if step is None or step in going or not decision.may_delete(folder, step):
                continue
            self.store.delete_many([info.key for info in self._listed(f"{folder}/")])

    def _report_unreadable(self, reading: StepReading, decision: RetentionDecision) -> None:
        """Warn, once per step, that retention leaves an unreadable step alone."""
        if f"unreadable {reading.step}" in self._reported:
            return
        self._reported.add(f"unreadable {reading.step}")
        log.warning(
            "retention leaves checkpoint step %d under %s alone: its manifest cannot be read "
            "(%s). It takes no slot of keep_last, and neither its objects nor those of older "
            "steps (%s) are deleted while it is there; `spotckpt gc --delete-unreadable` "
            "removes it",
            reading.step,
            self.uri,
            reading.problem,
            "none older" if decision.shield is None else f"before step {decision.shield}",
        )

    def _folder_keys(self, folders: set[str]) -> list[str]:
        """Every key under the given step folders (``<folder>/...``), from as few listings as
        `retire` describes."""
        if len(folders) <= RETIRE_FOLDER_LISTINGS:
            return [info.key for f in sorted(folders) for info in self._listed(f"{f}/")]
        end = f"{max(folders)}0"  # "0" follows "/": past every key of the last folder
        keys = []
        for info in self._listed(STEP_PREFIX):
            if info.key >= end:
                break
            folder, slash, _rest = info.key.partition("/")
            if slash and folder in folders:
                keys.append(info.key)
        return keys

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
        self._forget([step])
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
