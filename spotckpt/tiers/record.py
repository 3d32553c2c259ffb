"""The tier record: what a node's fast-tier step holds beyond the manifest.

Written by each node next to the step's manifest, before it (the manifest is the commit point
in the tier as in the bucket), both fsynced. It names the job that wrote the step (the bucket's
`spotckpt.catalog.JobIdentity` id: a restore uses a tier step only when it equals the bucket's),
the redundancy and, for erasure coding, every group: its data object keys in block order (``""``
for a rank that wrote no object), its parity object keys, the stripe length and the parity
objects' sizes and CRC32Cs. Keys are relative to the step folder, like the manifest's, and are
checked the same way when read; every number is bounded, and `TierRecord.check` ties the groups
to the step's manifest (its keys, its sizes) before any of them is used. A record without a job
(written before job identities) parses, and is never used by a restore.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass

from spotckpt.errors import BoundedJSONError, InvalidArgumentError, ManifestError
from spotckpt.format.bounded_json import loads
from spotckpt.format.manifest import MAX_INT
from spotckpt.layout import is_job_id, parity_object_key
from spotckpt.redundancy import MAX_PIECES, parse_redundancy
from spotckpt.storage.base import InvalidKeyError, check_key

RECORD_FORMAT = "spotckpt-tier/1"
MAX_RECORD_BYTES = 64 << 20


@dataclass(frozen=True)
class ParityRecord:
    """One parity object: its key, size and CRC32C."""

    key: str
    size: int
    crc32c: int


@dataclass(frozen=True)
class GroupRecord:
    """One erasure-coded group: data keys in block order, parity objects, stripe length."""

    data: tuple[str, ...]
    parity: tuple[ParityRecord, ...]
    block_size: int


@dataclass(frozen=True)
class TierRecord:
    """A fast-tier step's job and placement facts; see the module docstring."""

    step: int
    attempt: str
    redundancy: str
    groups: tuple[GroupRecord, ...] = ()
    job: str | None = None

    def to_json(self) -> bytes:
        """Encoded for the tier."""
        document = {
            "format": RECORD_FORMAT,
            "step": self.step,
            "attempt": self.attempt,
            "job": self.job,
            "redundancy": self.redundancy,
            "groups": [
                {
                    "data": list(group.data),
                    "parity": [
                        {"key": p.key, "size": p.size, "crc32c": p.crc32c} for p in group.parity
                    ],
                    "block_size": group.block_size,
                }
                for group in self.groups
            ],
        }
        return json.dumps(document, sort_keys=True).encode()

    @classmethod
    def from_json(cls, data: bytes, *, step: int, attempt: str | None) -> TierRecord:
        """Parse and check a record of `step` and `attempt` (None: of any attempt, for what
        needs only the job); ManifestError names what is wrong (empty, truncated, not JSON, a
        field missing, of the wrong type or out of bounds)."""
        if len(data) > MAX_RECORD_BYTES:
            raise ManifestError(f"tier record of step {step} is {len(data)} bytes: too large")
        try:
            document = loads(data, f"tier record of step {step}")
        except BoundedJSONError as error:
            raise ManifestError(str(error)) from None
        if not isinstance(document, dict) or document.get("format") != RECORD_FORMAT:
            raise ManifestError(f"tier record of step {step} is not a {RECORD_FORMAT} record")
        found = document.get("attempt")
        if (
            type(document.get("step")) is not int
            or document["step"] != step
            or not isinstance(found, str)
            or (attempt is not None and found != attempt)
        ):
            raise ManifestError(
                f"tier record of step {step} names step {_shown(document.get('step'))}, attempt "
                f"{_shown(document.get('attempt'))}: not the manifest's ({step}, {attempt!r})"
            )
        job = document.get("job")
        if job is not None and not is_job_id(job):
            raise ManifestError(f"tier record of step {step}: job {_shown(job)} is not a job id")
        groups, redundancy = document.get("groups"), document.get("redundancy")
        if not isinstance(groups, list) or not isinstance(redundancy, str):
            raise ManifestError(f"tier record of step {step}: groups or redundancy missing")
        try:
            parse_redundancy(redundancy)
            parsed = tuple(_group(group) for group in groups)
        except (InvalidArgumentError, InvalidKeyError, KeyError, TypeError, ValueError) as error:
            raise ManifestError(f"tier record of step {step} is malformed: {error}") from None
        return cls(step, found, redundancy, parsed, job)

    def check(self, sizes: Mapping[str, int]) -> None:
        """ManifestError unless the groups fit the step's manifest (`sizes`: its object keys and
        sizes): data keys of the manifest, the stripe length the largest of its group's objects,
        parity objects named for their group and of stripe length."""
        for index, group in enumerate(self.groups):
            keys = [key for key in group.data if key]
            if any(key not in sizes for key in keys):
                raise ManifestError(
                    f"tier record of step {self.step}: group {index} names objects the manifest "
                    "does not list"
                )
            if group.block_size != max((sizes[key] for key in keys), default=0):
                raise ManifestError(
                    f"tier record of step {self.step}: group {index} has stripe length "
                    f"{group.block_size}, not the size of its largest object"
                )
            for j, parity in enumerate(group.parity):
                if parity.key != parity_object_key(self.attempt, index, j):
                    raise ManifestError(
                        f"tier record of step {self.step}: parity {j} of group {index} is "
                        f"{parity.key!r}, not the name of that parity object"
                    )
                if parity.size != group.block_size:
                    raise ManifestError(
                        f"tier record of step {self.step}: parity {j} of group {index} has "
                        f"{parity.size} bytes, not the stripe length"
                    )


def _group(entry: object) -> GroupRecord:
    if not isinstance(entry, dict):
        raise TypeError("a group must be an object")
    data = entry["data"]
    parity = entry["parity"]
    block_size = entry["block_size"]
    if not isinstance(data, list) or not isinstance(parity, list):
        raise TypeError("data and parity must be lists")
    if not data or len(data) + len(parity) > MAX_PIECES:
        raise ValueError(f"a group has 1 to {MAX_PIECES} pieces, data and parity together")
    if not _count(block_size):
        raise ValueError("block_size must be a count of bytes")
    return GroupRecord(
        tuple(key if key == "" else check_key(_text(key)) for key in data),
        tuple(_parity(p) for p in parity),
        block_size,
    )


def _parity(entry: object) -> ParityRecord:
    if not isinstance(entry, dict):
        raise TypeError("a parity entry must be an object")
    size, crc = entry["size"], entry["crc32c"]
    if not (_count(size) and type(crc) is int and 0 <= crc < 2**32):
        raise ValueError("parity size and crc32c must be counts")
    return ParityRecord(check_key(_text(entry["key"])), size, crc)


def _count(value: object) -> bool:
    """Whether `value` is a JSON integer (not a bool) that fits an int64 and is not negative."""
    return type(value) is int and 0 <= value <= MAX_INT


def _text(value: object) -> str:
    if not isinstance(value, str):
        raise TypeError(f"a key must be a string, got {type(value).__name__}")
    return value


def _shown(value: object) -> str:
    """A value from a record, for a message: its repr, cut short."""
    text = repr(value)
    return text if len(text) <= 80 else f"{text[:77]}..."
