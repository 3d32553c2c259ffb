"""The indexed manifest (``spotckpt/2``): a small root that commits, per-rank index parts.

With one JSON document holding every chunk of every tensor, a job of thousands of ranks makes a
manifest of hundreds of MB that every restoring rank reads and parses whole. The indexed form
splits it:

- **Index parts** ``a-<attempt>/index-r<rank>.json``, one per rank that wrote data, written by
  that rank next to its object: its object's size and CRC32C, and the location (offset, length,
  block CRC32Cs) of each tensor chunk it wrote; in a signed save also ``"blake3"``, per tensor
  the BLAKE3 of each of its chunks in the same order (a reader that predates it ignores it).
- **The root** ``manifest.json``, still the single create-only commit point, written last by the
  coordinator: the parts (key, size, CRC32C, rank), and per tensor its dtype, shape, how its
  chunks tile it and which rank wrote each. The tiling is a grid (per dimension the chunk
  boundaries, ``{"every": s}`` for the even splits DTensor's ``Shard`` makes) or, for anything
  else, the explicit list of chunks. Writers are runs ``[first, count, stride]`` over the
  chunks in row-major grid order: FSDP's "chunk i by rank i" is one run. Non-tensor values
  (few, small, loaded by every rank) keep their whole location in the root.

A restoring rank reads the root, works out from its own shards' boxes which chunks it needs
(`overlapping_chunks`) and so which parts (`part_ranks`), and reads only those; tools that need
everything (verify, gc, export) read every part (`every_chunk`). Either way
`manifest_from_parts` gives a `Manifest`, the same structure as a ``spotckpt/1`` manifest (which
stays readable as before). Every part is checked against the root's size and CRC32C before it is
parsed (`parse_part`), and then like a manifest. This module reads nothing from a store:
`spotckpt.catalog.Catalog.read_manifest` does.
"""

from __future__ import annotations

import bisect
import dataclasses
import itertools
import json
import math
import re
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from spotckpt.checksum import crc32c
from spotckpt.errors import CorruptCheckpointError, ManifestError
from spotckpt.format import bounded_json
from spotckpt.format.dtypes import BY_NAME, MAX_DIMS
from spotckpt.format.features import format_string, parse_format
from spotckpt.format.manifest import (
    MAX_INT,
    ChunkLocation,
    Manifest,
    ObjectRecord,
    Stored,
    TensorChunk,
    TensorRecord,
    check_disjoint,
    check_tiling,
    manifest_document,
    parse_location,
    parse_strong_hash,
    stored_values,
    strong_hash_json,
)
from spotckpt.storage.base import InvalidKeyError, check_key

INDEXED_FORMAT = "spotckpt/2"
PART_FORMAT = "spotckpt-index/1"
MAX_PART_BYTES = 256 << 20
MIN_CHUNK_ENTRY_BYTES = len("[[],0,0,[0]]")
"""The fewest bytes in which an index part can locate one chunk: a root that names a rank the
writer of more chunks than its part's size can hold is forged."""
_FORMAT_FIELD = re.compile(r'"format"\s*:\s*"([^"]{0,256})"')
Box = tuple[tuple[int, ...], tuple[int, ...]]
"""A chunk or shard: (offsets, sizes)."""


def manifest_format(data: bytes) -> str | None:
    """The ``format`` a manifest declares, read from its first bytes (None if not found there);
    whitespace is allowed, since JSON allows it (a hand-edited manifest is still dispatched)."""
    found = _FORMAT_FIELD.search(data[:512].decode("utf-8", "replace"))
    return found.group(1) if found else None


# The tiling of one tensor -------------------------------------------------------------------------


@dataclass(frozen=True)
class Cuts:
    """Chunk boundaries along one dimension: explicit starts, or ``min(i * every, extent)`` for
    ``i < count`` (DTensor's even splits; a trailing empty shard starts at the extent)."""

    extent: int
    starts: tuple[int, ...] = ()
    every: int = 0
    intervals: int = 0  # with `every`

    @property
    def count(self) -> int:
        """Number of intervals."""
        return self.intervals if self.every else len(self.starts)

    def start(self, i: int) -> int:
        """Start of interval `i`."""
        return min(i * self.every, self.extent) if self.every else self.starts[i]

    def length(self, i: int) -> int:
        """Length of interval `i`."""
        end = self.start(i + 1) if i + 1 < self.count else self.extent
        return end - self.start(i)

    def index(self, offset: int) -> int | None:
        """The interval starting at `offset`, if one does."""
        if self.every:
            i = -(-offset // self.every) if offset == self.extent else offset // self.every
            i = min(i, self.count - 1)
        else:
            i = bisect.bisect_left(self.starts, offset)
        return i if i < self.count and self.start(i) == offset else None

    def overlapping(self, begin: int, size: int) -> range:
        """Indices of the intervals that overlap ``[begin, begin + size)``."""
        if size <= 0:
            return range(0)
        last = begin + size - 1
        if self.every:
            return range(begin // self.every, min(self.count, last // self.every + 1))
        return range(
            bisect.bisect_right(self.starts, begin) - 1, bisect.bisect_right(self.starts, last)
        )

    def to_json(self) -> Any:
        """``{"every": s, "count": k}`` or the list of starts."""
        return {"every": self.every, "count": self.intervals} if self.every else list(self.starts)


@dataclass(frozen=True)
class Runs:
    """Chunk writers: runs ``(first chunk, first rank, count, stride)`` in chunk order."""

    runs: tuple[tuple[int, int, int, int], ...]

    def rank(self, chunk: int) -> int:
        """The rank that wrote chunk number `chunk`."""
        at = bisect.bisect_right(self.runs, (chunk, MAX_INT)) - 1
        begin, first, _count, stride = self.runs[at]
        return first + (chunk - begin) * stride

    @property
    def total(self) -> int:
        """Number of chunks covered."""
        return sum(run[2] for run in self.runs)

    def to_json(self) -> list[list[int]]:
        """``[[first rank, count, stride], ...]``."""
        return [[first, count, stride] for _begin, first, count, stride in self.runs]

    @classmethod
    def of(cls, ranks: Iterable[int]) -> Runs:
        """Run-length encode a sequence of writer ranks (one numpy pass, then one step per
        run)."""
        values = np.fromiter(ranks, dtype=np.int64)
        if len(values) < 3:
            return cls._of_few([int(v) for v in values])
        steps = np.diff(values)
        segment = np.concatenate(([0], np.cumsum(steps[1:] != steps[:-1])))
        ends = np.append(np.flatnonzero(np.diff(segment)) + 1, len(steps))
        runs = []
        begin = 0
        while begin < len(values):
            if begin == len(values) - 1:
                runs.append((begin, int(values[begin]), 1, 0))
                break
            end = int(ends[segment[begin]])  # steps[begin:end] are all the same
            runs.append((begin, int(values[begin]), end - begin + 1, int(steps[begin])))
            begin = end + 1
        return cls(tuple(runs))

    @classmethod
    def _of_few(cls, ranks: list[int]) -> Runs:
        runs: list[list[int]] = []
        for chunk, rank in enumerate(ranks):
            if runs:
                begin, first, count, stride = runs[-1]
                if count == 1 or first + count * stride == rank:
                    runs[-1] = [begin, first, count + 1, rank - first if count == 1 else stride]
                    continue
            runs.append([chunk, rank, 1, 0])
        return cls(tuple((b, f, c, s) for b, f, c, s in runs))


@dataclass(frozen=True)
class IndexedTensor:
    """One tensor in a root: dtype, shape, its chunks (a grid or a list) and their writers."""

    dtype: str
    shape: tuple[int, ...]
    writers: Runs
    grid: tuple[Cuts, ...] | None = None
    boxes: tuple[Box, ...] = ()

    @property
    def chunk_count(self) -> int:
        """Number of chunks."""
        return math.prod(c.count for c in self.grid) if self.grid is not None else len(self.boxes)

    def chunk(self, number: int) -> Box:
        """Chunk `number` (row-major over the grid)."""
        if self.grid is None:
            return self.boxes[number]
        index = []
        for cuts in reversed(self.grid):
            number, i = divmod(number, cuts.count)
            index.append(i)
        index.reverse()
        offsets = tuple(c.start(i) for c, i in zip(self.grid, index, strict=True))
        return offsets, tuple(c.length(i) for c, i in zip(self.grid, index, strict=True))

    def overlapping(self, box: Box) -> list[int]:
        """Numbers of the chunks that overlap `box`; for an empty box, the (empty) chunk that
        starts where it does, which DCP's planning may ask for."""
        offsets, sizes = box
        if not all(sizes):
            return self._starting_at(offsets)
        if self.grid is None:
            return [
                n
                for n, (o, s) in enumerate(self.boxes)
                if all(
                    a < b + t and b < a + u for a, u, b, t in zip(o, s, offsets, sizes, strict=True)
                )
            ]
        ranges = [c.overlapping(o, s) for c, o, s in zip(self.grid, offsets, sizes, strict=True)]
        numbers = [0]
        for cuts, indices in zip(self.grid, ranges, strict=True):
            numbers = [n * cuts.count + i for n in numbers for i in indices]
        return numbers

    def _starting_at(self, offsets: tuple[int, ...]) -> list[int]:
        if self.grid is None:
            return [n for n, (o, _) in enumerate(self.boxes) if o == offsets]
        number = 0
        for cuts, offset in zip(self.grid, offsets, strict=True):
            i = cuts.index(offset)
            if i is None:
                return []
            number = number * cuts.count + i
        return [number]


def tiling_of(
    shape: tuple[int, ...], offsets: Any, sizes: Any
) -> tuple[tuple[Cuts, ...] | None, np.ndarray | None]:
    """The grid of the chunks (their `offsets` and `sizes`) when they form one, and the order
    that puts them in row-major grid order; else (None, None). Vectorised: a few numpy passes
    per tensor, whatever the number of chunks."""
    dims = len(shape)
    starts = np.asarray(offsets, dtype=np.int64).reshape(-1, dims) if dims else None
    if starts is None:  # a 0-dim tensor: one chunk, or something else
        return ((), np.zeros(1, dtype=np.int64)) if len(offsets) in (0, 1) else (None, None)
    count = len(starts)
    lengths = np.asarray(sizes, dtype=np.int64).reshape(count, dims)
    cuts, index = [], []
    for d in range(dims):
        unique = np.unique(starts[:, d])
        if unique[0] != 0:
            return None, None
        position = np.searchsorted(unique, starts[:, d])
        expected = np.diff(np.append(unique, shape[d]))
        if not np.array_equal(expected[position], lengths[:, d]):
            return None, None
        cuts.append(_cuts(shape[d], unique))
        index.append(position)
    if math.prod(c.count for c in cuts) != count:
        return None, None
    linear = np.ravel_multi_index(index, [c.count for c in cuts])
    order = np.argsort(linear, kind="stable")
    if not np.array_equal(linear[order], np.arange(count)):
        return None, None
    return tuple(cuts), order


def _cuts(extent: int, starts: np.ndarray) -> Cuts:
    step = int(starts[1]) if len(starts) > 1 else 0
    even = np.minimum(np.arange(len(starts), dtype=np.int64) * step, extent)
    if step and np.array_equal(starts, even):
        return Cuts(extent, every=step, intervals=len(starts))
    return Cuts(extent, starts=tuple(int(x) for x in starts))


# Writing ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PartRecord:
    """One rank's index part, as the root lists it."""

    key: str
    size: int
    crc32c: int
    rank: int


def part_json(
    step: int,
    attempt: str,
    rank: int,
    record: ObjectRecord,
    chunks: Mapping[str, list[tuple[tuple[int, ...], ChunkLocation]]],
) -> bytes:
    """One rank's index part: its object and where each of its tensor chunks lies."""
    document = {
        "format": PART_FORMAT,
        "step": step,
        "attempt": attempt,
        "rank": rank,
        "object": {
            "key": record.key,
            "size": record.size,
            "crc32c": record.crc32c,
            **strong_hash_json(record),
        },
        "chunks": {
            fqn: [[list(o), c.offset, c.length, list(c.block_crc32c)] for o, c in entries]
            for fqn, entries in chunks.items()
        },
    }
    if any(c.blake3 for entries in chunks.values() for _, c in entries):  # a signed save's
        document["blake3"] = {
            fqn: [c.blake3 for _, c in entries] for fqn, entries in chunks.items()
        }
    return json.dumps(document, separators=(",", ":")).encode()


def root_json(
    *,
    step: int,
    attempt: str,
    created_at: str,
    world_size: int,
    block_size: int,
    parts: list[PartRecord],
    tensors: Mapping[str, IndexedTensor] | str,
    values: Mapping[str, tuple[ObjectRecord, ChunkLocation]],
    versions: Mapping[str, str],
    planner_data: Mapping[str, list[str | int]],
    user_metadata: Mapping[str, Any],
    features: Iterable[str] = (),
) -> bytes:
    """The root manifest (the commit point) of an indexed checkpoint, using format `features`.

    `tensors` may come encoded already (`tensors_json`): a later save of the same layout reuses
    that text instead of encoding every tensor again. Either way the bytes are those of one
    compact ``json.dumps`` of the whole document."""
    metadata = json.dumps({"user_metadata": user_metadata}).encode()
    bounded_json.check_bounds(metadata, "user_metadata")
    head = {
        "format": format_string(INDEXED_FORMAT, features),
        "step": step,
        "attempt": attempt,
        "created_at": created_at,
        "world_size": world_size,
        "versions": dict(versions),
        "block_size": block_size,
        "parts": [
            {"key": p.key, "size": p.size, "crc32c": p.crc32c, "rank": p.rank} for p in parts
        ],
    }
    tail = {
        "values": {fqn: _value_json(record, v) for fqn, (record, v) in values.items()},
        "planner_data": dict(planner_data),
        "user_metadata": dict(user_metadata),
    }
    encoded = tensors if isinstance(tensors, str) else tensors_json(tensors)
    # `{head...,"tensors":...,tail...}`: what json.dumps writes for the document in this order
    text = f'{_compact(head)[:-1]},"tensors":{encoded},{_compact(tail)[1:]}'
    return text.encode()


def tensors_json(tensors: Mapping[str, IndexedTensor]) -> str:
    """The ``tensors`` member of a root, encoded: it depends on the save's layout alone (shapes,
    tilings, writers), so a save whose layout did not change may reuse it (`root_json`)."""
    return _compact({fqn: _tensor_json(t) for fqn, t in tensors.items()})


def _compact(document: Any) -> str:
    return json.dumps(document, separators=(",", ":"))


def _value_json(record: ObjectRecord, location: ChunkLocation) -> dict[str, Any]:
    return {
        "object": {
            "key": record.key,
            "size": record.size,
            "crc32c": record.crc32c,
            "rank": record.rank,
            **strong_hash_json(record),
        },
        "offset": location.offset,
        "length": location.length,
        "block_crc32c": list(location.block_crc32c),
        **({"blake3": location.blake3} if location.blake3 else {}),
    }


def _tensor_json(tensor: IndexedTensor) -> dict[str, Any]:
    entry: dict[str, Any] = {
        "dtype": tensor.dtype,
        "shape": list(tensor.shape),
        "writers": tensor.writers.to_json(),
    }
    if tensor.grid is not None:
        entry["grid"] = [c.to_json() for c in tensor.grid]
    else:
        entry["chunks"] = [[list(o), list(s)] for o, s in tensor.boxes]
    return entry


# Reading ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Root:
    """A parsed, checked root manifest."""

    step: int
    attempt: str
    created_at: str
    world_size: int
    block_size: int
    parts: dict[int, PartRecord]
    tensors: dict[str, IndexedTensor]
    values: dict[str, tuple[ObjectRecord, ChunkLocation]]
    versions: dict[str, str]
    planner_data: dict[str, list[str | int]]
    user_metadata: dict[str, Any]
    format: str = INDEXED_FORMAT


def _fail(message: str) -> ManifestError:
    return ManifestError(message)


def parse_root(data: bytes, expected_step: int | None = None) -> Root:
    """Parse and check a ``spotckpt/2`` root; ManifestError names the first problem."""
    document = manifest_document(data)
    parse_format(document.get("format"), (INDEXED_FORMAT,))
    try:
        return _root(document, expected_step)
    except InvalidKeyError as error:
        raise _fail(f"manifest holds an unsafe object key: {error}") from None
    except ManifestError:
        raise  # names its problem already (and is a ValueError)
    except (KeyError, TypeError, ValueError, IndexError) as error:
        raise _fail(f"manifest is malformed: {type(error).__name__}: {error}") from None


def _count(value: Any, what: str) -> int:
    if type(value) is not int or not 0 <= value <= MAX_INT:
        raise _fail(f"manifest {what} must be a non-negative integer below 2**63")
    return value


def _root(document: dict[str, Any], expected_step: int | None) -> Root:
    step = _count(document["step"], "step")
    if expected_step is not None and step != expected_step:
        raise _fail(f"manifest in the folder of step {expected_step} claims step {step}")
    world_size = _count(document["world_size"], "world_size")
    block_size = _count(document["block_size"], "block_size")
    if world_size < 1 or not 0 < block_size <= 1 << 30:
        raise _fail("manifest world_size or block_size out of range")
    parts: dict[int, PartRecord] = {}
    for entry in document["parts"]:
        rank = _count(entry["rank"], "part rank")
        key = check_key(entry["key"])
        crc = _count(entry["crc32c"], "part crc32c")
        if rank >= world_size or rank in parts or "/" not in key or crc >= 1 << 32:
            raise _fail(f"manifest part {key!r}: bad rank, key or crc32c")
        parts[rank] = PartRecord(key, _count(entry["size"], "part size"), crc, rank)
    claimed: dict[int, int] = {}
    tensors = {
        str(fqn): _tensor(str(fqn), entry, parts, claimed)
        for fqn, entry in document["tensors"].items()
    }
    _check_claims(claimed, parts)
    values = {
        str(fqn): _value(str(fqn), entry, document["attempt"], world_size, block_size)
        for fqn, entry in document["values"].items()
    }
    if tensors.keys() & values.keys():
        raise _fail("manifest lists a name both as a tensor and as a value")
    check_disjoint(stored_values((fqn, location) for fqn, (_, location) in values.items()))
    planner_data = document.get("planner_data", {})
    user_metadata = document.get("user_metadata", {})
    versions = document.get("versions", {})
    if not all(isinstance(x, dict) for x in (planner_data, user_metadata, versions)):
        raise _fail("manifest planner_data, user_metadata and versions must be JSON objects")
    return Root(
        step=step,
        attempt=str(document["attempt"]),
        created_at=str(document["created_at"]),
        world_size=world_size,
        block_size=block_size,
        parts=parts,
        tensors=tensors,
        values=values,
        versions={str(k): str(v) for k, v in versions.items()},
        planner_data=planner_data,
        user_metadata=user_metadata,
        format=str(document["format"]),
    )


def _value(
    fqn: str, entry: dict[str, Any], attempt: Any, world_size: int, block_size: int
) -> tuple[ObjectRecord, ChunkLocation]:
    """A value's object and location, held in the root itself (values are few and small, and
    every rank loads them: no rank reads a part for them)."""
    where = f"value {fqn!r}"
    record = _object(entry["object"], attempt, where)
    if record.rank >= world_size:
        raise _fail(f"{where}: rank {record.rank} is not below the world_size of {world_size}")
    spec = {k: entry[k] for k in ("offset", "length", "block_crc32c")}
    spec["key"] = record.key
    if "blake3" in entry:
        spec["blake3"] = entry["blake3"]
    return record, parse_location(spec, {record.key: record}, block_size, where)


def _object(entry: dict[str, Any], attempt: Any, where: str) -> ObjectRecord:
    key = check_key(entry["key"])
    if "/" not in key or key.partition("/")[0] != f"a-{attempt}":
        raise _fail(f"{where}: object {key!r} is outside the attempt's folder")
    crc = _count(entry["crc32c"], "object crc32c")
    if crc >= 1 << 32:
        raise _fail(f"{where}: crc32c is not a 32-bit value")
    rank = _count(entry.get("rank", 0), "object rank")
    size = _count(entry["size"], "object size")
    strong = parse_strong_hash(entry, where)
    return ObjectRecord(key=key, size=size, crc32c=crc, rank=rank, blake3=strong)


def _writer(rank: Any, parts: Mapping[int, Any], where: str) -> int:
    if type(rank) is not int or rank not in parts:
        raise _fail(f"{where}: written by rank {rank!r}, which has no index part")
    return rank


def _tensor(
    fqn: str, entry: dict[str, Any], parts: dict[int, PartRecord], claimed: dict[int, int]
) -> IndexedTensor:
    where = f"tensor {fqn!r}"
    dtype = str(entry["dtype"])
    if dtype not in BY_NAME:
        raise _fail(f"{where}: unknown dtype {dtype!r}")
    shape = tuple(_count(d, f"{where} shape") for d in entry["shape"])
    if len(shape) > MAX_DIMS or math.prod(shape) > MAX_INT:
        raise _fail(f"{where}: shape {list(shape)} is too large")
    writers = _writers(entry["writers"], parts, claimed, where)
    if "grid" in entry:
        tensor = IndexedTensor(dtype, shape, writers, grid=_grid(entry["grid"], shape, where))
    else:
        boxes = tuple(_box(b, shape, where) for b in entry["chunks"])
        check_tiling(fqn, shape, list(boxes))
        tensor = IndexedTensor(dtype, shape, writers, boxes=boxes)
    if writers.total != tensor.chunk_count:
        raise _fail(f"{where}: {writers.total} writers for {tensor.chunk_count} chunks")
    return tensor


def _writers(
    entries: list[Any], parts: dict[int, PartRecord], claimed: dict[int, int], where: str
) -> Runs:
    """A tensor's writer runs, counting in `claimed` how many chunks each rank is said to write.

    A strided run names as many distinct ranks as chunks, so never more than there are parts;
    its first and last rank are checked here, the others where their chunks are used
    (`part_ranks`, `manifest_from_parts`), which keeps a root's checks linear in its size. A run
    of stride 0 gives all its chunks to one rank, whose part must be large enough to locate them
    (`_check_claims`).
    """
    runs = []
    begin = 0
    for first, count, stride in entries:
        first, count = _count(first, "writer"), _count(count, "writer count")
        if type(stride) is not int or count < 1:
            raise _fail(f"{where}: bad writer run")
        if stride and count > len(parts):
            raise _fail(
                f"{where}: writer run {[first, count, stride]} names {count} ranks, more than "
                f"the {len(parts)} with an index part"
            )
        for rank in (first, first + (count - 1) * stride):
            _writer(rank, parts, where)
        if not stride:
            claimed[first] = claimed.get(first, 0) + count
        runs.append((begin, first, count, stride))
        begin += count
    return Runs(tuple(runs))


def _check_claims(claimed: dict[int, int], parts: dict[int, PartRecord]) -> None:
    """ManifestError when a rank is said to write more chunks than its index part can locate:
    checked before anything is allocated per chunk (a 500-byte root may claim 2**40 chunks)."""
    for rank, chunks in claimed.items():
        part = parts[rank]
        if chunks > part.size // MIN_CHUNK_ENTRY_BYTES:
            raise _fail(
                f"manifest names rank {rank} the writer of {chunks} chunks, more than its "
                f"{part.size}-byte index part {part.key!r} can locate"
            )


def _grid(entry: list[Any], shape: tuple[int, ...], where: str) -> tuple[Cuts, ...]:
    if len(entry) != len(shape):
        raise _fail(f"{where}: grid rank differs from the shape's")
    cuts = []
    for extent, spec in zip(shape, entry, strict=True):
        if isinstance(spec, dict):
            every = _count(spec["every"], f"{where} grid step")
            count = _count(spec["count"], f"{where} grid count")
            # min(i * every, extent) must rise: only the last start may reach the extent
            if every < 1 or count < 1 or (count > 1 and (count - 2) * every >= extent):
                raise _fail(f"{where}: grid step and count do not cut the shape")
            cuts.append(Cuts(extent, every=every, intervals=count))
            continue
        starts = tuple(_count(s, f"{where} grid") for s in spec)
        ascending = all(a < b for a, b in itertools.pairwise(starts))
        if not starts or starts[0] != 0 or not ascending or starts[-1] > extent:
            raise _fail(f"{where}: grid starts must rise from 0 within the shape")
        cuts.append(Cuts(extent, starts=starts))
    return tuple(cuts)


def _box(entry: list[Any], shape: tuple[int, ...], where: str) -> Box:
    offsets = tuple(_count(v, where) for v in entry[0])
    sizes = tuple(_count(v, where) for v in entry[1])
    if len(offsets) != len(shape) or len(sizes) != len(shape):
        raise _fail(f"{where}: chunk rank differs from the shape's")
    if any(o + s > d for o, s, d in zip(offsets, sizes, shape, strict=True)):
        raise _fail(f"{where}: chunk reaches outside shape {list(shape)}")
    return offsets, sizes


# Parts --------------------------------------------------------------------------------------------


@dataclass
class Part:
    """One rank's index part, parsed: its object, and each chunk's location by tensor name and
    chunk offsets."""

    record: ObjectRecord
    chunks: dict[str, dict[tuple[int, ...], ChunkLocation]]


def check_part_size(root: Root, rank: int) -> PartRecord:
    """The record of `rank`'s index part, refused (ManifestError) if it is larger than allowed:
    checked before a byte of it is read."""
    record = root.parts[rank]
    if record.size > MAX_PART_BYTES:
        raise _fail(f"index part {record.key} is {record.size} bytes, more than allowed")
    return record


def parse_part(data: bytes, root: Root, rank: int, folder: str) -> Part:
    """Check `rank`'s index part against the root's size and CRC32C, then parse it."""
    record = root.parts[rank]
    if len(data) != record.size or crc32c(data) != record.crc32c:
        raise CorruptCheckpointError(
            f"index part {folder}/{record.key} does not match the manifest's size and CRC32C"
        )
    try:
        return _parse_part(data, root, rank)
    except InvalidKeyError as error:
        raise _fail(f"index part of rank {rank} holds an unsafe key: {error}") from None
    except ManifestError:
        raise  # names its problem already (and is a ValueError)
    except (KeyError, TypeError, ValueError, IndexError) as error:
        raise _fail(
            f"index part of rank {rank} is malformed: {type(error).__name__}: {error}"
        ) from None


def _parse_part(data: bytes, root: Root, rank: int) -> Part:
    document = bounded_json.loads(data, f"index part of rank {rank}")
    if (
        document.get("format") != PART_FORMAT
        or document.get("step") != root.step
        or document.get("attempt") != root.attempt
        or document.get("rank") != rank
    ):
        raise _fail(f"index part of rank {rank} does not belong to this manifest")
    record = dataclasses.replace(
        _object(document["object"], root.attempt, f"index part of rank {rank}"), rank=rank
    )
    key = record.key
    objects = {key: record}

    hashes = document.get("blake3", {})
    if not isinstance(hashes, dict):
        raise _fail(f"index part of rank {rank}: blake3 must be a JSON object")

    def location(fqn: str, number: int, entry: Any) -> ChunkLocation:
        offset, length, crcs = entry[1:]
        spec = {"key": key, "offset": offset, "length": length, "block_crc32c": crcs}
        digests = hashes.get(fqn)
        if digests is not None:
            if not isinstance(digests, list) or len(digests) != len(document["chunks"][fqn]):
                raise _fail(f"index part of rank {rank}: tensor {fqn!r} has a wrong blake3 list")
            spec["blake3"] = digests[number]
        return parse_location(spec, objects, root.block_size, f"tensor {fqn!r}")

    chunks = {
        str(fqn): {
            tuple(_count(o, "chunk offset") for o in entry[0]): location(fqn, number, entry)
            for number, entry in enumerate(entries)
        }
        for fqn, entries in document["chunks"].items()
    }
    values = ((f, v) for f, (_, v) in root.values.items() if v.key == key)
    check_disjoint(itertools.chain(_stored_chunks(chunks), stored_values(values)))
    return Part(record, chunks)


def _stored_chunks(chunks: dict[str, dict[tuple[int, ...], ChunkLocation]]) -> Iterator[Stored]:
    for fqn, located in chunks.items():
        for offsets, at in located.items():
            yield at.key, at.offset, at.offset + at.length, "tensor", fqn, offsets


# Manifests from a root ------------------------------------------------------------------------


Wanted = dict[str, Sequence[int]]
"""Chunk numbers by tensor name: the chunks of a root a reader needs."""


def every_chunk(root: Root) -> Wanted:
    """Every chunk of every tensor (verify, gc and export read the whole checkpoint, and so every
    part), as ranges: nothing is allocated per chunk before the parts that locate them are read."""
    return {fqn: range(t.chunk_count) for fqn, t in root.tensors.items()}


def overlapping_chunks(root: Root, boxes: Mapping[str, list[Box]]) -> Wanted:
    """The chunks overlapping `boxes` (by tensor name); every tensor of the root is listed
    (what is not wanted, with no chunks), so that key checks see the whole checkpoint."""
    return {
        fqn: sorted({n for box in boxes.get(fqn, ()) for n in tensor.overlapping(box)})
        for fqn, tensor in root.tensors.items()
    }


def part_ranks(root: Root, wanted: Wanted) -> set[int]:
    """The ranks whose index parts locate the `wanted` chunks (ManifestError for a writer
    without a part)."""
    return {
        _writer(root.tensors[fqn].writers.rank(n), root.parts, f"tensor {fqn!r}")
        for fqn, numbers in wanted.items()
        for n in numbers
    }


def manifest_from_parts(
    root: Root, wanted: Wanted, values: Iterable[str], parts: Mapping[int, Part]
) -> Manifest:
    """A `Manifest` of the `wanted` chunks and the named `values` of `root`, located by `parts`
    (at least those of `part_ranks`; every part for `every_chunk`)."""
    tensors = {}
    for fqn, numbers in wanted.items():
        tensor = root.tensors[fqn]
        chunks = []
        for number in numbers:
            offsets, sizes = tensor.chunk(number)
            part = parts[_writer(tensor.writers.rank(number), parts, f"tensor {fqn!r}")]
            location = part.chunks.get(fqn, {}).get(offsets)
            if location is None:
                raise _fail(f"tensor {fqn!r}: no location for its chunk at {list(offsets)}")
            if location.length != math.prod(sizes) * BY_NAME[tensor.dtype].itemsize:
                raise _fail(f"tensor {fqn!r}: chunk at {list(offsets)} has the wrong length")
            chunks.append(TensorChunk(offsets=offsets, sizes=sizes, location=location))
        tensors[fqn] = TensorRecord(dtype=tensor.dtype, shape=tensor.shape, chunks=tuple(chunks))
    names = set(values) & set(root.values)
    found = {fqn: root.values[fqn][1] for fqn in names}
    objects = {p.record.key: p.record for p in parts.values()}
    objects.update({root.values[fqn][0].key: root.values[fqn][0] for fqn in names})
    return Manifest(
        step=root.step,
        attempt=root.attempt,
        world_size=root.world_size,
        block_size=root.block_size,
        objects=objects,
        tensors=tensors,
        values=found,
        created_at=root.created_at,
        versions=root.versions,
        user_metadata=root.user_metadata,
        planner_data=root.planner_data,
        format=root.format,
    )
