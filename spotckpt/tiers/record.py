"""The tier record: what a node's fast-tier step holds beyond the manifest.

Written by each node next to the step's manifest, before it (the manifest is the commit point
in the tier as in the bucket). It names the redundancy and, for erasure coding, every group:
its data object keys in block order (``""`` for a rank that wrote no object), its parity
object keys, the stripe length and the parity objects' sizes and CRC32Cs. Keys are relative to
the step folder, like the manifest's, and are checked the same way when read.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from spotckpt.errors import ManifestError
from spotckpt.format.bounded_json import loads
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
    """A fast-tier step's placement facts; see the module docstring."""

    step: int
    attempt: str
    redundancy: str
    groups: tuple[GroupRecord, ...] = ()

    def to_json(self) -> bytes:
        """Encoded for the tier."""
        document = {
            "format": RECORD_FORMAT,
            "step": self.step,
            "attempt": self.attempt,
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
    def from_json(cls, data: bytes, *, step: int, attempt: str) -> TierRecord:
        """Parse and check a record; ManifestError names what is wrong."""
        if len(data) > MAX_RECORD_BYTES:
            raise ManifestError(f"tier record of step {step} is {len(data)} bytes: too large")
        document = loads(data, f"tier record of step {step}")
        if not isinstance(document, dict) or document.get("format") != RECORD_FORMAT:
            raise ManifestError(f"tier record of step {step} is not a {RECORD_FORMAT} record")
        if document.get("step") != step or document.get("attempt") != attempt:
            raise ManifestError(
                f"tier record of step {step} names step {document.get('step')!r}, attempt "
                f"{document.get('attempt')!r}: not the manifest's ({step}, {attempt!r})"
            )
        groups = document.get("groups")
        if not isinstance(groups, list) or not isinstance(document.get("redundancy"), str):
            raise ManifestError(f"tier record of step {step}: groups or redundancy missing")
        try:
            parsed = tuple(_group(group) for group in groups)
        except (InvalidKeyError, KeyError, TypeError, ValueError) as error:
            raise ManifestError(f"tier record of step {step} is malformed: {error}") from None
        return cls(step, attempt, document["redundancy"], parsed)


def _group(entry: dict[str, object]) -> GroupRecord:
    data = entry["data"]
    parity = entry["parity"]
    block_size = entry["block_size"]
    if not isinstance(data, list) or not isinstance(parity, list):
        raise TypeError("data and parity must be lists")
    if not isinstance(block_size, int) or block_size < 0:
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
    if not (isinstance(size, int) and isinstance(crc, int) and size >= 0 and 0 <= crc < 2**32):
        raise ValueError("parity size and crc32c must be counts")
    return ParityRecord(check_key(_text(entry["key"])), size, crc)


def _text(value: object) -> str:
    if not isinstance(value, str):
        raise TypeError(f"a key must be a string, got {type(value).__name__}")
    return value
