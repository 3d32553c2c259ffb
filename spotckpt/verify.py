"""`verify_checkpoint`: check every byte of a committed checkpoint against its manifest.

The manifest must parse and validate; every data object it lists must exist with the listed size;
each object is streamed with ranged reads (``piece_size`` at a time, never whole) and its CRC32C
compared with the manifest's. In the same pass the per-block CRC32Cs of every tensor chunk and
value are checked, so a damaged object is reported with the tensors whose bytes are damaged, and
every undamaged value is loaded with ``torch.load(weights_only=True)``, as a restore would.
Every problem is reported, not only the first; a report with no problems is ``ok``.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from typing import Any

from spotckpt.checksum import crc32c
from spotckpt.errors import NoCheckpointError
from spotckpt.format.manifest import (
    ChunkLocation,
    Manifest,
    ManifestError,
    ObjectRecord,
    manifest_key,
    step_folder,
)
from spotckpt.storage.base import ObjectInfo, ObjectNotFoundError, ObjectStore
from spotckpt.values import ValueLoadError, load_plain

DEFAULT_PIECE_SIZE = 16 << 20
VALUE_LABEL = "value "
ProgressFn = Callable[[int, int], None]
"""Called as ``progress(bytes_done, bytes_total)`` with running totals as bytes are checked."""


@dataclass(frozen=True)
class Problem:
    """One thing wrong with a checkpoint.

    `kind` is ``manifest`` (does not parse or validate), ``missing`` (object absent), ``size``
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

    @property
    def ok(self) -> bool:
        """True when no problem was found."""
        return not self.problems

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready form."""
        return {
            "step": self.step,
            "ok": self.ok,
            "bytes_checked": self.bytes_checked,
            "objects_checked": self.objects_checked,
            "problems": [asdict(p) | {"tensors": list(p.tensors)} for p in self.problems],
        }


@dataclass(frozen=True)
class _Block:
    """One CRC block of a stored item, in absolute object offsets."""

    start: int
    end: int
    crc: int
    name: str


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
) -> VerifyReport:
    """Check the committed checkpoint of `step` in `store`; see the module docstring.

    Raises NoCheckpointError when the step has no manifest. Storage failures that say nothing
    about the checkpoint itself (permission denied, network) propagate.
    """
    if piece_size < 1 or max_workers < 1:
        raise ValueError("piece_size and max_workers must be positive")
    report = VerifyReport(step=step)
    key = manifest_key(step)
    try:
        data = store.get(key)
    except ObjectNotFoundError:
        raise NoCheckpointError(f"step {step} has no committed checkpoint at {store.uri}") from None
    try:
        manifest = Manifest.from_json(data, expected_step=step)
    except ManifestError as error:
        report.problems.append(Problem("manifest", key, str(error)))
        return report
    _check_objects(store, manifest, report, progress, piece_size, max_workers)
    return report


def _check_objects(
    store: ObjectStore,
    manifest: Manifest,
    report: VerifyReport,
    progress: ProgressFn | None,
    piece_size: int,
    max_workers: int,
) -> None:
    folder = step_folder(manifest.step)
    listed = {info.key: info for info in store.list(f"{folder}/")}
    blocks = _blocks_by_object(manifest)
    values: dict[str, list[str]] = {}
    for fqn, location in manifest.values.items():
        values.setdefault(location.key, []).append(fqn)
    present: list[ObjectRecord] = []
    for record in manifest.objects.values():
        problem = _presence_problem(folder, record, listed.get(f"{folder}/{record.key}"), blocks)
        if problem is None:
            present.append(record)
        else:
            report.problems.append(problem)
    counter = _Progress(sum(r.size for r in present), progress)
    with ThreadPoolExecutor(max_workers, thread_name_prefix="spotckpt-verify") as pool:
        futures = [
            pool.submit(
                _check_object,
                store,
                folder,
                r,
                (blocks.get(r.key, []), values.get(r.key, [])),
                piece_size,
                counter,
            )
            for r in present
        ]
        for future in futures:
            report.problems.extend(future.result())
    report.objects_checked = len(present)
    report.bytes_checked = counter.done


def _presence_problem(
    folder: str, record: ObjectRecord, info: ObjectInfo | None, blocks: dict[str, list[_Block]]
) -> Problem | None:
    key = f"{folder}/{record.key}"
    names = _names(blocks.get(record.key, []))
    if info is None:
        return Problem("missing", key, f"object {key} is missing", names)
    if info.size != record.size:
        return Problem(
            "size",
            key,
            f"object {key} has {info.size} bytes, the manifest says {record.size}",
            names,
        )
    return None


def _blocks_by_object(manifest: Manifest) -> dict[str, list[_Block]]:
    """Every CRC block of every tensor chunk and value, grouped by object and sorted."""
    blocks: dict[str, list[_Block]] = {}
    for name, location in _locations(manifest):
        size = manifest.block_size
        for index, crc in enumerate(location.block_crc32c):
            start = location.offset + index * size
            end = min(location.offset + location.length, start + size)
            blocks.setdefault(location.key, []).append(_Block(start, end, crc, name))
    for entries in blocks.values():
        entries.sort(key=lambda b: (b.start, b.end))
    return blocks


def _locations(manifest: Manifest) -> Iterator[tuple[str, ChunkLocation]]:
    for fqn, tensor in manifest.tensors.items():
        for chunk in tensor.chunks:
            yield fqn, chunk.location
    for fqn, location in manifest.values.items():
        yield f"{VALUE_LABEL}{fqn}", location


def _names(blocks: list[_Block]) -> tuple[str, ...]:
    """Distinct names in `blocks`, tensors before values."""
    names = dict.fromkeys(b.name for b in blocks)
    return tuple(sorted(names, key=lambda n: n.startswith(VALUE_LABEL)))


def _check_object(
    store: ObjectStore,
    folder: str,
    record: ObjectRecord,
    inside: tuple[list[_Block], list[str]],
    piece_size: int,
    counter: _Progress,
) -> list[Problem]:
    """Stream one object, comparing its CRC32C and every block CRC32C inside it.

    `inside` holds the object's CRC blocks and the names of the values stored in it.
    """
    blocks, values = inside
    key = f"{folder}/{record.key}"
    checker = _BlockChecker(blocks)
    crc = 0
    position = 0
    while position < record.size:
        length = min(piece_size, record.size - position)
        try:
            piece = store.get_range(key, position, length)
        except ObjectNotFoundError:
            return [Problem("missing", key, f"object {key} disappeared while being read")]
        if len(piece) != length:
            return [
                Problem(
                    "size",
                    key,
                    f"object {key} ended at byte {position + len(piece)} while being read; "
                    f"the manifest says {record.size}",
                    _names(blocks),
                )
            ]
        crc = crc32c(piece, crc)
        checker.feed(position, memoryview(piece))
        position += length
        counter.add(length)
    return _crc_problems(key, record, crc, checker.damaged) + _value_problems(key, checker, values)


def _value_problems(key: str, checker: _BlockChecker, values: list[str]) -> list[Problem]:
    """Load each undamaged value of the object as a restore would; report those that fail."""
    problems = []
    for fqn in values:
        name = f"{VALUE_LABEL}{fqn}"
        if name in checker.damaged:
            continue
        try:
            load_plain(checker.values.get(name, b""), fqn)
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


class _BlockChecker:
    """Follows sorted CRC blocks across consecutive pieces of one object."""

    def __init__(self, blocks: list[_Block]) -> None:
        self.blocks = blocks
        self.index = 0
        self.crc = 0
        self.damaged: list[str] = []
        self.values: dict[str, bytearray] = {}

    def feed(self, offset: int, piece: memoryview) -> None:
        """Account for the bytes of `piece`, which starts at `offset` in the object."""
        end = offset + piece.nbytes
        while self.index < len(self.blocks):
            block = self.blocks[self.index]
            if block.start >= end:
                return
            lo, hi = max(block.start, offset), min(block.end, end)
            if hi > lo:
                self.crc = crc32c(piece[lo - offset : hi - offset], self.crc)
                if block.name.startswith(VALUE_LABEL):
                    self.values.setdefault(block.name, bytearray()).extend(
                        piece[lo - offset : hi - offset]
                    )
            if block.end > end:
                return
            self._close(block)

    def _close(self, block: _Block) -> None:
        if self.crc != block.crc and block.name not in self.damaged:
            self.damaged.append(block.name)
        self.crc = 0
        self.index += 1
