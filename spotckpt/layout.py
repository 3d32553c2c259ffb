"""The bucket layout: the name of everything under a checkpoint root, and the job identity.

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
manager, gc, verify, export, the CLI) goes through these names and `spotckpt.catalog.Catalog`,
which reads and changes the layout; the names here are pure functions (no store I/O).

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
import re
import uuid
from dataclasses import dataclass
from datetime import datetime, timezone

from spotckpt.errors import BoundedJSONError, InvalidArgumentError, ManifestError
from spotckpt.format.bounded_json import loads
from spotckpt.format.manifest import MAX_INT, Manifest
from spotckpt.format.references import attempt_of, is_reference, object_path

STEP_PREFIX = "step-"
STEP_DIGITS = 9
MANIFEST_NAME = "manifest.json"
TIER_RECORD_NAME = "tier.json"
ATTEMPT_PREFIX = "a-"
QUARANTINE_PREFIX = "quarantined-"
REASON_NAME = "reason.json"
JOB_KEY = "job.json"
JOB_FORMAT = "spotckpt-job/1"
MAX_JOB_BYTES = 4096
EVENTS_PREFIX = "events/"
EVENT_SUMMARY_KEY = f"{EVENTS_PREFIX}summary.json"
STEP_LISTING_DELIMITER = f"/{ATTEMPT_PREFIX}"
"""Lists step folders without their attempt objects: ``step-N/a-...`` rolls up as ``step-N/a-``."""
CLOCK_PROBE_PREFIX = "gc/clock-"
"""gc's clock probes (`Catalog.store_time`) are written under this prefix of the root."""
_STEP_FOLDER = re.compile(r"step-([0-9]{9,19})")
_EVENT_NAME = re.compile(
    r"events/([0-9]{8}T[0-9]{6}\.[0-9]{6}Z)-([a-z]{1,32})-[0-9a-f]{1,32}-[0-9]{1,12}\.json"
)
LOOKS_LIKE_STEP = re.compile(r"step-\w", re.UNICODE)
"""A folder name that may be meant as a step folder: reported when it is not the canonical one."""
_JOB_ID = re.compile(r"[0-9a-f]{32}")


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
    return aware(moment).astimezone(timezone.utc).strftime("%Y%m%dT%H%M%S.%fZ")


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


def aware(moment: datetime) -> datetime:
    """`moment`, read as UTC when it carries no time zone."""
    return moment if moment.tzinfo is not None else moment.replace(tzinfo=timezone.utc)
