"""`verify_checkpoint`: check every byte of a committed checkpoint against its manifest.

The manifest must parse and validate; every data object it lists (its own, and those of earlier
steps it references) must exist with the listed size;
each object is streamed with ranged reads (``piece_size`` at a time, never whole) and its CRC32C
compared with the manifest's. In the same pass the per-block CRC32Cs of every tensor chunk and
value are checked, so a damaged object is reported with the tensors whose bytes are damaged, and
every undamaged value is loaded with ``torch.load(weights_only=True)``, as a restore would.
Every problem is reported, not only the first; a report with no problems is ``ok``.
"""

from __future__ import annotations

import json
import re
import threading
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from typing import Any

from spotckpt.catalog import Catalog
from spotckpt.checksum import crc32c
from spotckpt.digest import step_digest
from spotckpt.engine.chunks import BlockCheck, ChunkReader, StoredBlockCheck, block_check, describe
from spotckpt.errors import (
    CheckpointError,
    ChecksumMismatchError,
    CorruptCheckpointError,
    InvalidArgumentError,
    ManifestError,
    ObjectMissingError,
    ObjectSizeError,
    ValueLoadError,
)
from spotckpt.format.manifest import ChunkLocation, Manifest, ObjectRecord
from spotckpt.format.references import object_path
from spotckpt.format.signing import SIGNED, Keyring, key_id, new_hasher
from spotckpt.layout import manifest_key, referenced_folders, step_folder
from spotckpt.storage.base import ObjectInfo, ObjectStore
from spotckpt.values import load_plain

DEFAULT_PIECE_SIZE = 16 << 20
VALUE_LABEL = "value "
ProgressFn = Callable[[int, int], None]
"""Called as ``progress(bytes_done, bytes_total)`` with running totals as bytes are checked."""


@dataclass(frozen=True)
class Problem:
    """One thing wrong with a checkpoint.

    `kind` is ``manifest`` (does not parse or validate, is unsigned or wrongly signed while a key
    is configured, or one of its index parts is missing or damaged), ``blake3`` (the object's
    strong hash differs from its signed manifest's), ``missing`` (object absent), ``size``
    (object size differs), ``crc32c`` (object checksum differs), ``blocks`` (a tensor chunk's
    block checksums differ while the object's matches: the manifest disagrees with itself) or
    ``value`` (a stored value's bytes are intact but do not load with weights_only=True).
    `key` is relative to the checkpoint root; `tensors` names what is stored in the damaged part.
    """

    kind: str
    key: str
    message: str
    tensors: tuple[str, ...] = ()


@dataclass
class VerifyReport:
    """The outcome of `verify_checkpoint`."""

    step: int
    problems: list[Problem] = field(default_factory=list)
    bytes_checked: int = 0
    objects_checked: int = 0
    digest: str | None = None
    """The step's digest (`spotckpt.digest`), when asked for: stands for the bytes if ok."""
    signature: SignatureCheck | None = None
    """What was checked of the manifest's signature (None: the manifest did not read)."""

    @property
    def ok(self) -> bool:
        """True when no problem was found."""
        return not self.problems

    def error(self) -> CheckpointError | None:
        """The error a restore of this step meets first (None when ok): damage before a value
        that does not load, since a restore falls back from damage but not from such a value."""
        if not self.problems:
            return None
        first = min(self.problems, key=lambda p: p.kind == "value")
        return _ERRORS[first.kind](f"checkpoint step {self.step}: {first.message}")

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready form."""
        return (
            {
                "step": self.step,
                "ok": self.ok,
                "bytes_checked": self.bytes_checked,
                "objects_checked": self.objects_checked,
                "problems": [asdict(p) | {"tensors": list(p.tensors)} for p in self.problems],
            }
            | ({} if self.digest is None else {"digest": self.digest})
            | ({} if self.signature is None else {"signature": asdict(self.signature)})
        )


_KEY_ID = re.compile(r"[0-9a-f]{16}")


@dataclass(frozen=True)
class SignatureCheck:
    """What a verify checked of the manifest's signature, named by public key ids only.

    `status`: ``checked`` (signed, and the signature verified under an accepted key, `key`),
    ``accepted-unsigned`` (unsigned, read under ``accept_unsigned``), ``not-checked`` (signed
    with the key the manifest names, but no key is configured to check it with) or ``unsigned``
    (unsigned, and no key is configured)."""

    status: str
    key: str | None = None

    def describe(self) -> str:
        """The phrase of the success line: ``signature checked with key 1a2b...``."""
        key = self.key or "unknown"
        return {
            "checked": f"signature checked with key {key}",
            "accepted-unsigned": "unsigned, accepted (accept_unsigned)",
            "not-checked": f"signed with key {key}, signature not checked: no key configured",
            "unsigned": "unsigned, no key configured",
        }[self.status]

    @classmethod
    def of(cls, data: bytes, manifest: Manifest, keyring: Keyring | None) -> SignatureCheck:
        """The check of a manifest (its bytes, `data`) that the catalog has read, and so
        checked, with `keyring`."""
        signature = json.loads(data).get("signature")
        named = signature.get("key") if isinstance(signature, dict) else None
        shown = named if isinstance(named, str) and _KEY_ID.fullmatch(named) else None
        if keyring is None or not keyring.enforcing:
            signed = signature is not None or SIGNED in manifest.features
            return cls("not-checked", shown) if signed else cls("unsigned")
        if signature is None:
            return cls("accepted-unsigned")  # else the catalog would have refused it
        accepted = {key_id(public) for public in keyring.verifiers}
        return cls("checked", shown if shown in accepted else None)


_ERRORS: dict[str, type[CheckpointError]] = {
    "manifest": ManifestError,
    "missing": ObjectMissingError,
    "size": ObjectSizeError,
    "crc32c": ChecksumMismatchError,
    "blocks": ChecksumMismatchError,
    "blake3": ChecksumMismatchError,
    "value": ValueLoadError,
}
"""The error of each kind of `Problem`, as a restore that meets it raises it."""


@dataclass(frozen=True)
class _Stored:
    """A tensor chunk or value inside an object, with the check that follows its bytes."""

    name: str
    location: ChunkLocation
    check: BlockCheck | StoredBlockCheck
    value: bytearray | None  # a value's bytes, gathered to load it


class _Progress:
    """Thread-safe running total handed to the caller's callback."""

    def __init__(self, total: int, callback: ProgressFn | None) -> None:
        self.total = total
        self.done = 0
        self.callback = callback
        self.lock = threading.Lock()

    def add(self, count: int) -> None:
        with self.lock:
            self.done += count
            if self.callback is not None:
                self.callback(self.done, self.total)


def verify_checkpoint(
    store: ObjectStore,
    step: int,
    *,
    progress: ProgressFn | None = None,
    piece_size: int = DEFAULT_PIECE_SIZE,
    max_workers: int = 4,
    keyring: Keyring | None = None,
    digest: bool = False,
) -> VerifyReport:
    """Check the committed checkpoint of `step` in `store`; see the module docstring. With a
    `keyring`, the manifest must also be signed for this step and job, and in a signed
    manifest every object's BLAKE3 is checked too (`spotckpt.format.signing`); an object whose
    record in a signed manifest has none (a signed step of an older spotckpt referencing an
    object written unsigned) is a ``blake3`` problem: the signature does not cover its bytes.
    With `digest`,
    the report also holds the step's digest (`spotckpt.digest`).

    Raises NoCheckpointError when the step has no manifest. Storage failures that say nothing
    about the checkpoint itself (permission denied, network) propagate.
    """
    if piece_size < 1 or max_workers < 1:
        raise InvalidArgumentError("piece_size and max_workers must be positive")
    report = VerifyReport(step=step)
    key = manifest_key(step)
    catalog = Catalog(store, keyring)
    try:
        data = catalog.manifest_bytes(step)
        manifest = catalog.read_manifest(step, data=data)
    except (ManifestError, CorruptCheckpointError) as error:  # an index part's too
        report.problems.append(Problem("manifest", key, str(error)))
        return report
    report.signature = SignatureCheck.of(data, manifest, keyring)
    if digest:
        report.digest = step_digest(data, manifest.objects.values())
    if catalog.keyring is not None and SIGNED in manifest.features:
        report.problems += _unhashed_problems(manifest)
    _check_objects(store, manifest, report, progress, piece_size, max_workers)
    return report


def _unhashed_problems(manifest: Manifest) -> list[Problem]:
    """A ``blake3`` problem for each object of a signed manifest whose record has no BLAKE3."""
    folder = step_folder(manifest.step)
    inside = _chunks_by_object(manifest)
    problems = []
    for record in manifest.objects.values():
        if not record.blake3:  # the writer's rule too (`unhashed`)
            key = object_path(folder, record.key)
            names = _names(inside.get(record.key, []))
            message = (
                f"object {key} has no BLAKE3 in the signed manifest: the signature covers only "
                f"its CRC32Cs, which bytes can be replaced with (it holds {describe(names)})"
            )
            problems.append(Problem("blake3", key, message, names))
    return problems


def _check_objects(
    store: ObjectStore,
    manifest: Manifest,
    report: VerifyReport,
    progress: ProgressFn | None,
    piece_size: int,
    max_workers: int,
) -> None:
    folder = step_folder(manifest.step)
    sizes = {key: record.size for key, record in manifest.objects.items()}
    reader = ChunkReader(store, folder, manifest.block_size, sizes)
    prefixes = [f"{folder}/", *(f"{f}/" for f in sorted(referenced_folders(manifest)))]
    listed = {info.key: info for prefix in prefixes for info in store.list(prefix)}
    inside = _chunks_by_object(manifest)
    present: list[ObjectRecord] = []
    for record in manifest.objects.values():
        info = listed.get(reader.path(record.key))
        problem = _presence_problem(reader, record, info, _names(inside.get(record.key, [])))
        if problem is None:
            present.append(record)
        else:
            report.problems.append(problem)
    counter = _Progress(sum(r.size for r in present), progress)
    with ThreadPoolExecutor(max_workers, thread_name_prefix="spotckpt-verify") as pool:
        futures = [
            pool.submit(_check_object, reader, r, inside.get(r.key, []), piece_size, counter)
            for r in present
        ]
        for future in futures:
            report.problems.extend(future.result())
    report.objects_checked = len(present)
    report.bytes_checked = counter.done


def _presence_problem(
    reader: ChunkReader, record: ObjectRecord, info: ObjectInfo | None, names: tuple[str, ...]
) -> Problem | None:
    """A problem when the listing lacks the object or shows another size than the manifest's."""
    key = reader.path(record.key)
    if info is None:
        return Problem(
            "missing", key, f"object {key} is missing (it holds {describe(names)})", names
        )
    if info.size != record.size:
        return Problem(
            "size",
            key,
            f"object {key} has {info.size} bytes, the manifest says {record.size} (it holds "
            f"{describe(names)})",
            names,
        )
    return None


def _chunks_by_object(manifest: Manifest) -> dict[str, list[tuple[str, ChunkLocation]]]:
    """Every tensor chunk and value, with its name, grouped by object and sorted by offset."""
    inside: dict[str, list[tuple[str, ChunkLocation]]] = {}
    for name, location in _locations(manifest):
        inside.setdefault(location.key, []).append((name, location))
    for entries in inside.values():
        entries.sort(key=lambda entry: entry[1].offset)
    return inside


def _names(inside: list[tuple[str, ChunkLocation]]) -> tuple[str, ...]:
    """Distinct names of what an object holds, tensors before values."""
    names = dict.fromkeys(name for name, _location in inside)
    return tuple(sorted(names, key=lambda n: n.startswith(VALUE_LABEL)))


def _locations(manifest: Manifest) -> Iterator[tuple[str, ChunkLocation]]:
    for fqn, tensor in manifest.tensors.items():
        for chunk in tensor.chunks:
            yield fqn, chunk.location
    for fqn, location in manifest.values.items():
        yield f"{VALUE_LABEL}{fqn}", location


def _check_object(
    reader: ChunkReader,
    record: ObjectRecord,
    inside: list[tuple[str, ChunkLocation]],
    piece_size: int,
    counter: _Progress,
) -> list[Problem]:
    """Stream one object, comparing its CRC32C and the block CRC32Cs of what is `inside` it
    (names and locations, by offset)."""
    key = reader.path(record.key)
    follower = _Follower(
        [
            _Stored(
                name,
                location,
                block_check(location, reader.block_size),
                bytearray() if name.startswith(VALUE_LABEL) else None,
            )
            for name, location in inside
        ]
    )
    names = _names(inside)
    crc = 0
    strong = new_hasher() if record.blake3 is not None else None
    position = 0
    while position < record.size:
        length = min(piece_size, record.size - position)
        try:
            piece = reader.read(record.key, position, position + length, names)
        except ObjectMissingError as error:
            return [Problem("missing", key, str(error), names)]
        except ObjectSizeError as error:
            return [Problem("size", key, str(error), names)]
        crc = crc32c(piece, crc)
        if strong is not None:
            strong.update(piece)
        follower.feed(position, memoryview(piece))
        position += length
        counter.add(length)
    damaged = follower.damaged()
    problems = _crc_problems(key, record, crc, damaged)
    if strong is not None and strong.hexdigest() != record.blake3:
        problems.append(
            Problem(
                "blake3",
                key,
                f"object {key}: its BLAKE3 differs from the signed manifest's (bytes replaced, "
                f"perhaps with their CRC32Cs kept; it holds {describe(names)})",
                names,
            )
        )
    return problems + _value_problems(key, follower, damaged)


def _value_problems(key: str, follower: _Follower, damaged: list[str]) -> list[Problem]:
    """Load each undamaged value of the object as a restore would; report those that fail."""
    problems = []
    for stored in follower.stored:
        name = stored.name
        if stored.value is None or name in damaged:
            continue
        try:
            load_plain(stored.value, name.removeprefix(VALUE_LABEL))
        except ValueLoadError as error:
            problems.append(Problem("value", key, f"{name} in object {key}: {error}", (name,)))
    return problems


def _crc_problems(key: str, record: ObjectRecord, crc: int, damaged: list[str]) -> list[Problem]:
    if crc != record.crc32c:
        where = f"; damaged: {', '.join(damaged)}" if damaged else ""
        return [
            Problem(
                "crc32c",
                key,
                f"object {key} CRC32C is {crc:08x}, the manifest says {record.crc32c:08x}{where}",
                tuple(damaged),
            )
        ]
    if damaged:
        return [
            Problem(
                "blocks",
                key,
                f"object {key} matches its CRC32C but block checksums of {', '.join(damaged)} "
                "do not: the manifest is inconsistent",
                tuple(damaged),
            )
        ]
    return []


class _Follower:
    """Feeds consecutive pieces of one object to the block checks of what lies in each piece."""

    def __init__(self, stored: list[_Stored]) -> None:
        self.stored = stored
        self.waiting = deque(stored)
        self.active: list[_Stored] = []

    def feed(self, offset: int, piece: memoryview) -> None:
        """Account for the bytes of `piece`, which starts at `offset` in the object."""
        end = offset + piece.nbytes
        while self.waiting and self.waiting[0].location.offset < end:
            self.active.append(self.waiting.popleft())
        unfinished = []
        for stored in self.active:
            stored_end = stored.location.offset + stored.location.stored_length
            lo, hi = max(stored.location.offset, offset), min(stored_end, end)
            if hi > lo:
                part = piece[lo - offset : hi - offset]
                stored.check.feed(part)
                if stored.value is not None:
                    stored.value.extend(part)
            if stored_end > end:
                unfinished.append(stored)
        self.active = unfinished

    def damaged(self) -> list[str]:
        """Once every piece was fed: the names whose block checksums differ, in object order."""
        return list(dict.fromkeys(s.name for s in self.stored if s.check.finish() is not None))
