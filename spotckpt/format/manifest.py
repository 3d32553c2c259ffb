"""The manifest: the JSON commit record of one checkpoint, and DCP metadata to and from it.

A checkpoint exists exactly when ``step-<N>/manifest.json`` exists. The manifest names every
data object (size, CRC32C), every tensor (dtype, global shape, chunks, where each chunk's bytes lie
and their per-block CRC32Cs) and every non-tensor value. It is plain JSON: nothing in it is ever
unpickled. Everything read from a bucket is validated here before use; a bad manifest raises
`ManifestError` that names the problem.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Any

from spotckpt.errors import ManifestError
from spotckpt.format import bounded_json
from spotckpt.format.codecs import ENCODINGS
from spotckpt.format.dtypes import BY_NAME, MAX_DIMS
from spotckpt.format.encodings import FEATURE as ENCODED
from spotckpt.format.features import parse_format
from spotckpt.format.packed import FEATURE as PACKED
from spotckpt.format.packed import pack_groups, pack_json, parse_packs, unpacked
from spotckpt.format.records import ChunkLocation, ObjectRecord, TensorChunk, TensorRecord
from spotckpt.format.references import FEATURE as REFERENCES
from spotckpt.format.references import is_reference, referenced_step
from spotckpt.storage.base import InvalidKeyError, check_key

if TYPE_CHECKING:  # torch loads only for DCP metadata (`Manifest.to_dcp`)
    from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex

FORMAT_VERSION = "spotckpt/1"
MAX_MANIFEST_BYTES = 256 << 20
MAX_OBJECTS = 1_000_000
MAX_ENTRIES = 5_000_000
MAX_BLOCK_SIZE = 1 << 30
MAX_INT = (1 << 63) - 1  # sizes, offsets, steps and element counts must fit an int64
MAX_TILING_CORNERS = 1 << 24  # work bound of the tiling check, summed over all chunks
_HEX = frozenset("0123456789abcdef")


def check_manifest_size(size: int, step: int) -> None:
    """Refuse (ManifestError) a manifest of `size` bytes beyond the bound, before it is read."""
    if size > MAX_MANIFEST_BYTES:
        raise ManifestError(
            f"manifest of step {step} is {size} bytes, more than the {MAX_MANIFEST_BYTES} allowed"
        )


@dataclass(frozen=True)
class Incremental:
    """What an incremental save records: the job whose steps it may reference (a later save
    references only a step of its own job), and how many incremental saves in a row led to it
    (a full rewrite follows after `spotckpt.engine.incremental.FULL_REWRITE_AFTER`)."""

    job: str
    depth: int


@dataclass(kw_only=True)
class Manifest:
    """The commit record of one checkpoint."""

    step: int
    attempt: str
    world_size: int
    block_size: int
    objects: dict[str, ObjectRecord]
    tensors: dict[str, TensorRecord]
    values: dict[str, ChunkLocation]
    created_at: str = field(default_factory=lambda: datetime.now(timezone.utc).isoformat())
    versions: dict[str, str] = field(default_factory=dict)
    user_metadata: dict[str, Any] = field(default_factory=dict)
    planner_data: dict[str, list[str | int]] = field(default_factory=dict)
    format: str = FORMAT_VERSION
    incremental: Incremental | None = None

    @property
    def features(self) -> frozenset[str]:
        """The named format features this manifest uses (`spotckpt.format.features`)."""
        return frozenset(self.format.split("+")[1:])

    @property
    def total_bytes(self) -> int:
        """Bytes of all data objects."""
        return sum(o.size for o in self.objects.values())

    @property
    def written_bytes(self) -> int:
        """Bytes of the objects this step's save wrote (not those it references)."""
        return sum(o.size for o in self.objects.values() if not is_reference(o.key))

    def locations(self) -> Iterator[ChunkLocation]:
        """Where every tensor chunk and value lies."""
        for tensor in self.tensors.values():
            for chunk in tensor.chunks:
                yield chunk.location
        yield from self.values.values()

    @property
    def referenced_bytes(self) -> int:
        """Stored bytes of tensor chunks and values that lie in earlier steps' objects
        (references)."""
        return sum(loc.stored_length for loc in self.locations() if is_reference(loc.key))

    def to_json(self) -> bytes:
        """Serialise to UTF-8 JSON; ValueError if `user_metadata` is beyond what `from_json` reads
        (nested too deep, or a number of too many digits). An indexed manifest (read from a
        ``spotckpt/2`` root and its parts) is written by its writer only, never re-encoded."""
        if self.format.split("+")[0] != FORMAT_VERSION:
            raise ManifestError(f"a {self.format} manifest is not re-encoded as one document")
        metadata = json.dumps({"user_metadata": self.user_metadata}).encode()
        bounded_json.check_bounds(metadata, "user_metadata")
        groups = pack_groups(self.tensors) if PACKED in self.features else []
        document = {
            "format": self.format,
            "step": self.step,
            "attempt": self.attempt,
            "created_at": self.created_at,
            "world_size": self.world_size,
            "versions": self.versions,
            "block_size": self.block_size,
            "objects": [_object_json(o) for o in self.objects.values()],
            "tensors": {fqn: _tensor_json(t) for fqn, t in unpacked(self.tensors, groups)},
            "values": {fqn: _location_json(v) for fqn, v in self.values.items()},
            "planner_data": self.planner_data,
            "user_metadata": self.user_metadata,
        }
        if groups:
            document["packs"] = [pack_json(self.tensors, group) for group in groups]
        if self.incremental is not None:
            document["incremental"] = {
                "job": self.incremental.job,
                "depth": self.incremental.depth,
            }
        return json.dumps(document, separators=(",", ":")).encode()

    @classmethod
    def from_json(cls, data: bytes, *, expected_step: int | None = None) -> Manifest:
        """Parse and validate; raises ManifestError naming the first problem found."""
        try:
            return _parse(data, expected_step)
        except InvalidKeyError as error:
            raise ManifestError(f"manifest holds an unsafe object key: {error}") from None

    def to_dcp(self) -> tuple[Metadata, dict[MetadataIndex, ChunkLocation]]:
        """DCP metadata for a load, and where each stored item's bytes lie."""
        import torch
        from torch.distributed.checkpoint.metadata import (
            BytesStorageMetadata,
            ChunkStorageMetadata,
            Metadata,
            MetadataIndex,
            TensorProperties,
            TensorStorageMetadata,
        )

        state: dict[str, TensorStorageMetadata | BytesStorageMetadata] = {}
        locations: dict[MetadataIndex, ChunkLocation] = {}
        # one properties value per dtype, one Size per shape for a whole-tensor chunk: a restore
        # of 20,000 small tensors spent a tenth of its time building these
        properties = {name: TensorProperties(dtype=BY_NAME[name].torch_dtype) for name in BY_NAME}
        for fqn, tensor in self.tensors.items():
            shape = torch.Size(tensor.shape)
            chunks = []
            for chunk in tensor.chunks:
                offsets = torch.Size(chunk.offsets)
                sizes = shape if chunk.sizes == tensor.shape else torch.Size(chunk.sizes)
                chunks.append(ChunkStorageMetadata(offsets, sizes))
                locations[MetadataIndex(fqn, offsets)] = chunk.location
            state[fqn] = TensorStorageMetadata(properties[tensor.dtype], shape, chunks)
        for fqn, location in self.values.items():
            state[fqn] = BytesStorageMetadata()
            locations[MetadataIndex(fqn)] = location
        planner_data = {fqn: tuple(path) for fqn, path in self.planner_data.items()}
        metadata = Metadata(state_dict_metadata=state, planner_data=planner_data)
        metadata.storage_data = locations
        return metadata, locations


def _object_json(record: ObjectRecord) -> dict[str, Any]:
    document = {"key": record.key, "size": record.size, "crc32c": record.crc32c}
    return {**document, "rank": record.rank, **strong_hash_json(record)}


def strong_hash_json(record: ObjectRecord) -> dict[str, Any]:
    """An object record's strong hash field, when it has one (signed manifests)."""
    return {} if record.blake3 is None else {"blake3": record.blake3}


def parse_strong_hash(entry: dict[str, Any], where: str) -> str | None:
    """An object entry's BLAKE3 (64 lowercase hex digits), or None when it has none."""
    value = entry.get("blake3")
    if value is None:
        return None
    if not (isinstance(value, str) and len(value) == 64 and set(value) <= set("0123456789abcdef")):
        raise _fail(f"{where}: blake3 is not 64 lowercase hex digits")
    return value


def _location_json(location: ChunkLocation, **leading: Any) -> dict[str, Any]:
    """`location`'s fields, after the `leading` ones (a chunk's offsets and sizes). Tuples stay
    tuples: json.dumps writes a tuple exactly as the list of its items."""
    document = leading
    document["key"] = location.key
    document["offset"] = location.offset
    document["length"] = location.length
    document["block_crc32c"] = location.block_crc32c
    if location.blake3:
        document["blake3"] = location.blake3
    if location.codec:
        document["codec"] = location.codec
        document["stored_lengths"] = location.stored_lengths
        document["stored_crc32c"] = location.stored_crc32c
    return document


def _tensor_json(tensor: TensorRecord) -> dict[str, Any]:
    return {
        "dtype": tensor.dtype,
        "shape": tensor.shape,
        "chunks": [
            _location_json(c.location, offsets=c.offsets, sizes=c.sizes) for c in tensor.chunks
        ],
    }


# Parsing and validation -----------------------------------------------------------------------


def _fail(message: str) -> ManifestError:
    return ManifestError(message)


def _get(document: dict[str, Any], name: str, kind: type | tuple[type, ...], where: str) -> Any:
    if name not in document:
        raise _fail(f"{where}: missing field {name!r}")
    value = document[name]
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise _fail(f"{where}: field {name!r} has the wrong type")
    return value


def _count(document: dict[str, Any], name: str, where: str) -> int:
    value = document.get(name)
    if type(value) is not int:  # the common case, a plain int, needs no second look
        value = _get(document, name, int, where)  # raises unless an int (missing, another type)
    if not 0 <= value <= MAX_INT:
        raise _fail(f"{where}: {name!r} must be a non-negative integer below 2**63, got {value}")
    return value


def _ints(document: dict[str, Any], name: str, where: str) -> tuple[int, ...]:
    """Field `name` of `document`: a list of non-negative integers below 2**63, as a tuple."""
    value = document.get(name)
    if type(value) is not list:  # the common case, a plain list, needs no second look
        value = _get(document, name, list, where)  # raises unless a list (missing, another type)
    for item in value:  # one pass, no generator: most lists hold one or two items
        if type(item) is not int or not 0 <= item <= MAX_INT:
            raise _fail(f"{where}: expected a list of non-negative integers below 2**63")
    return tuple(value)


def manifest_document(data: bytes) -> dict[str, Any]:
    """A manifest's JSON object, size- and bounds-checked before parsing (ManifestError)."""
    if len(data) > MAX_MANIFEST_BYTES:
        raise _fail(f"manifest is {len(data)} bytes, more than the {MAX_MANIFEST_BYTES} allowed")
    try:
        document = bounded_json.loads(data, "manifest")
    except bounded_json.BoundedJSONError as error:
        raise _fail(str(error)) from None
    if not isinstance(document, dict):
        raise _fail("manifest is not a JSON object")
    return document


def _parse(data: bytes, expected_step: int | None) -> Manifest:
    document = manifest_document(data)
    _layout, features = parse_format(document.get("format"), (FORMAT_VERSION,))
    version = str(document["format"])
    step = _count(document, "step", "manifest")
    if expected_step is not None and step != expected_step:
        raise _fail(f"manifest in the folder of step {expected_step} claims step {step}")
    block_size = _count(document, "block_size", "manifest")
    if not 0 < block_size <= MAX_BLOCK_SIZE:
        raise _fail(f"manifest block_size {block_size} is out of range")
    world_size = _count(document, "world_size", "manifest")
    if world_size < 1:
        raise _fail(f"manifest world_size must be at least 1, got {world_size}")
    objects = _parse_objects(
        _get(document, "objects", list, "manifest"), world_size, step, REFERENCES in features
    )
    incremental = _parse_incremental(document.get("incremental"))
    if incremental is None and REFERENCES in features:
        raise _fail("manifest uses references but does not say of which job (no 'incremental')")
    tensors_json = _get(document, "tensors", dict, "manifest")
    values_json = _get(document, "values", dict, "manifest")
    both_kinds = len(tensors_json) + len(values_json)
    if both_kinds > MAX_ENTRIES:
        raise _fail(f"manifest lists more than {MAX_ENTRIES} tensors and values")
    both = tensors_json.keys() & values_json.keys()
    if both:
        raise _fail(f"manifest lists {sorted(both)[0]!r} both as a tensor and as a value")
    packed, pack_ranges = _parse_packs(document, features, objects, block_size, both_kinds)
    compressed = ENCODED in features
    tensors = {
        fqn: _parse_tensor(fqn, entry, objects, block_size, compressed)
        for fqn, entry in tensors_json.items()
    }
    _check_tilings(tensors)
    values = {
        fqn: parse_location(entry, objects, block_size, f"value {fqn!r}", compressed)
        for fqn, entry in values_json.items()
    }
    stored = (stored_chunks(tensors.items()), pack_ranges, stored_values(values.items()))
    check_disjoint(itertools.chain(*stored))
    clash = next((fqn for fqn in packed if fqn in tensors_json or fqn in values_json), None)
    if clash is not None:
        raise _fail(f"manifest lists {clash!r} both in a packed record and elsewhere")
    tensors.update(packed)
    planner_data = document.get("planner_data", {})
    if not isinstance(planner_data, dict) or not all(map(_is_path, planner_data.values())):
        raise _fail("manifest planner_data must map names to lists of keys")
    user_metadata = document.get("user_metadata", {})
    versions = document.get("versions", {})
    if not isinstance(user_metadata, dict) or not isinstance(versions, dict):
        raise _fail("manifest user_metadata and versions must be JSON objects")
    return Manifest(
        step=step,
        attempt=str(_get(document, "attempt", str, "manifest")),
        created_at=str(_get(document, "created_at", str, "manifest")),
        world_size=world_size,
        block_size=block_size,
        objects=objects,
        tensors=tensors,
        values=values,
        versions={str(k): str(v) for k, v in versions.items()},
        user_metadata=user_metadata,
        planner_data=planner_data,
        format=version,
        incremental=incremental,
    )


def _parse_packs(
    document: dict[str, Any],
    features: frozenset[str],
    objects: dict[str, ObjectRecord],
    block_size: int,
    listed: int,
) -> tuple[dict[str, TensorRecord], list[Stored]]:
    """The tensors of the manifest's packed records (`spotckpt.format.packed`) and each record's
    byte range; none where it has none, refused where it has some but does not name the feature."""
    entries = document.get("packs")
    if entries is None:
        return {}, []
    if PACKED not in features:
        raise _fail("manifest has packed records, but its format does not name the feature")
    return parse_packs(entries, objects, block_size, listed=listed, maximum=MAX_ENTRIES)


def _is_path(path: Any) -> bool:
    """Whether `path` is a planner_data path: a list of keys (strings and integers)."""
    # map, not a generator: one call per tensor, and most paths hold one key
    return isinstance(path, list) and all(map(isinstance, path, itertools.repeat((str, int))))


def _parse_incremental(entry: Any) -> Incremental | None:
    if entry is None:
        return None
    if not isinstance(entry, dict):
        raise _fail("manifest 'incremental' must be a JSON object")
    job = _get(entry, "job", str, "manifest incremental")
    if len(job) > 64:
        raise _fail("manifest incremental job id is too long")
    return Incremental(job=job, depth=_count(entry, "depth", "manifest incremental"))


def _parse_objects(
    entries: list[Any], world_size: int, step: int, references: bool
) -> dict[str, ObjectRecord]:
    if len(entries) > MAX_OBJECTS:
        raise _fail(f"manifest lists {len(entries)} objects, more than {MAX_OBJECTS}")
    objects: dict[str, ObjectRecord] = {}
    for entry in entries:
        if not isinstance(entry, dict):
            raise _fail("manifest object entries must be JSON objects")
        key = check_key(_get(entry, "key", str, "object"))
        if "/" not in key or key in objects:
            raise _fail(f"object key {key!r} is not inside an attempt folder, or listed twice")
        where = f"object {key!r}"
        crc = _count(entry, "crc32c", where)
        if crc >= 1 << 32:
            raise _fail(f"{where}: crc32c is not a 32-bit value")
        rank = _count(entry, "rank", where)
        if is_reference(key):  # written by an earlier step, maybe at another world size
            if not references:
                raise _fail(
                    f"{where} lies outside the step folder, in a manifest without references"
                )
            referenced_step(key, step)
        elif rank >= world_size:
            raise _fail(f"{where}: rank {rank} is not below the world_size of {world_size}")
        objects[key] = ObjectRecord(
            key=key,
            size=_count(entry, "size", where),
            crc32c=crc,
            rank=rank,
            blake3=parse_strong_hash(entry, where),
        )
    return objects


def parse_location(
    entry: Any,
    objects: dict[str, ObjectRecord],
    block_size: int,
    where: str,
    compressed: bool = False,
) -> ChunkLocation:
    """A chunk's or value's location, checked against its object (ManifestError); a compressed
    one only where the manifest names the ``compressed`` feature."""
    if not isinstance(entry, dict):
        raise _fail(f"{where}: location must be a JSON object")
    key = _get(entry, "key", str, where)  # safe once found: every object key was checked
    record = objects.get(key)
    if record is None:
        raise _fail(f"{where}: refers to object {key!r} that the manifest does not list")
    offset, length = _count(entry, "offset", where), _count(entry, "length", where)
    crcs = _ints(entry, "block_crc32c", where)
    # max(crcs): a count that matches is at least one
    if len(crcs) != max(1, -(-length // block_size)) or max(crcs) >= 1 << 32:
        raise _fail(f"{where}: block_crc32c does not match its length of {length} bytes")
    digest = entry.get("blake3", "")
    if not isinstance(digest, str) or (digest and (len(digest) != 64 or set(digest) - _HEX)):
        raise _fail(f"{where}: blake3 is not 64 lowercase hex digits")
    location = ChunkLocation(  # the record's key: one string for all its chunks, fast to compare
        key=record.key, offset=offset, length=length, block_crc32c=crcs, blake3=digest
    )
    if "codec" in entry:
        if not compressed:
            raise _fail(f"{where}: is compressed, but the manifest does not name the feature")
        location = _compressed_location(entry, location, block_size, where)
    end = offset + location.stored_length
    if end > record.size:
        raise _fail(
            f"{where}: bytes {offset}..{end} lie beyond the {record.size}-byte object {key!r}"
        )
    return location


def _compressed_location(
    entry: dict[str, Any], location: ChunkLocation, block_size: int, where: str
) -> ChunkLocation:
    """`location` with its codec and stored blocks, checked: a known codec, and one stored
    length (no longer than its raw block) and one CRC32C per block."""
    codec = _get(entry, "codec", str, where)
    if not ENCODINGS.knows(codec):
        raise _fail(f"{where}: unknown codec {codec[:40]!r}; known: {ENCODINGS.known()}")
    lengths = _ints(entry, "stored_lengths", where)
    crcs = _ints(entry, "stored_crc32c", where)
    blocks = len(location.block_crc32c)
    raw = [min(block_size, location.length - n * block_size) for n in range(blocks)]
    if len(lengths) != blocks or len(crcs) != blocks or any(c >= 1 << 32 for c in crcs):
        raise _fail(f"{where}: stored_lengths and stored_crc32c must have one entry per block")
    if any(not 0 <= stored <= size for stored, size in zip(lengths, raw, strict=True)):
        raise _fail(f"{where}: a stored block is longer than its raw block")
    return dataclasses.replace(location, codec=codec, stored_lengths=lengths, stored_crc32c=crcs)


def _parse_tensor(
    fqn: str,
    entry: Any,
    objects: dict[str, ObjectRecord],
    block_size: int,
    compressed: bool = False,
) -> TensorRecord:
    where = f"tensor {fqn!r}"
    if not isinstance(entry, dict):
        raise _fail(f"{where}: entry must be a JSON object")
    dtype = BY_NAME.get(_get(entry, "dtype", str, where))
    if dtype is None:
        raise _fail(f"{where}: unknown dtype {entry.get('dtype')!r}")
    shape = _ints(entry, "shape", where)
    if len(shape) > MAX_DIMS:
        raise _fail(f"{where}: {len(shape)} dimensions, more than {MAX_DIMS}")
    elements = math.prod(shape)
    if elements > MAX_INT:
        raise _fail(f"{where}: shape {list(shape)} has 2**63 elements or more")
    chunks = [
        _parse_chunk(chunk, shape, dtype.itemsize, objects, block_size, where, compressed)
        for chunk in _get(entry, "chunks", list, where)
    ]
    if len(chunks) != 1 or chunks[0].sizes != shape:  # else one chunk of the whole tensor
        stored_elements = sum([math.prod(c.sizes) for c in chunks])
        if stored_elements != elements:
            raise _fail(f"{where}: chunks hold {stored_elements} elements, shape needs {elements}")
        if len({c.offsets for c in chunks}) != len(chunks):
            raise _fail(f"{where}: two chunks start at the same offsets")
    return TensorRecord(dtype=dtype.name, shape=shape, chunks=tuple(chunks))


def _parse_chunk(
    chunk: Any,
    shape: tuple[int, ...],
    itemsize: int,
    objects: dict[str, ObjectRecord],
    block_size: int,
    where: str,
    compressed: bool,
) -> TensorChunk:
    if not isinstance(chunk, dict):
        raise _fail(f"{where}: chunk must be a JSON object")
    offsets = _ints(chunk, "offsets", where)
    sizes = _ints(chunk, "sizes", where)
    if len(offsets) != len(shape) or len(sizes) != len(shape):
        raise _fail(f"{where}: chunk rank differs from the tensor's {len(shape)} dimensions")
    if sizes == shape and not any(offsets):
        sizes = shape  # the whole tensor, inside it; one tuple for both
    elif any(o + s > d for o, s, d in zip(offsets, sizes, shape, strict=True)):
        raise _fail(
            f"{where}: chunk at {list(offsets)} of size {list(sizes)} reaches outside shape "
            f"{list(shape)}"
        )
    location = parse_location(chunk, objects, block_size, where, compressed)
    elements = math.prod(sizes)
    if location.length != elements * itemsize:
        raise _fail(
            f"{where}: chunk at {list(offsets)} of {elements} elements of {itemsize} bytes has "
            f"{location.length} bytes"
        )
    return TensorChunk(offsets=offsets, sizes=sizes, location=location)


def _check_tilings(tensors: dict[str, TensorRecord]) -> None:
    """Every tensor's chunks tile its shape: no overlap, no gap; linear work within one budget.

    A tensor's chunks lie inside its shape and hold as many elements as it has (checked when
    parsed), so what remains is that no two overlap. Only the chunks that hold elements matter,
    and only the dimensions along which some of them do not span the whole shape. A lone chunk
    so checked is the whole tensor or holds no element: nothing to check.
    """
    checks = []
    corners = 0
    for fqn, tensor in tensors.items():
        if len(tensor.chunks) < 2:
            continue
        boxes = [(c.offsets, c.sizes) for c in tensor.chunks if all(c.sizes)]
        split = [
            d
            for d, extent in enumerate(tensor.shape)
            if any(offsets[d] or sizes[d] != extent for offsets, sizes in boxes)
        ]
        if split:  # else a single chunk holds the whole tensor
            checks.append((fqn, tensor.shape, boxes, split))
            corners += len(boxes) << len(split)
    if corners > MAX_TILING_CORNERS:
        raise _fail(
            f"manifest chunks have {corners} corners in all, more than {MAX_TILING_CORNERS}: too "
            "many chunks split along too many dimensions"
        )
    for fqn, shape, boxes, split in checks:
        if not _tiles(shape, boxes, split):
            raise _fail(
                f"tensor {fqn!r}: chunks overlap (and so leave a gap) instead of tiling shape "
                f"{list(shape)}"
            )


def check_tiling(
    fqn: str, shape: tuple[int, ...], boxes: list[tuple[tuple[int, ...], tuple[int, ...]]]
) -> None:
    """ManifestError unless `boxes` (inside `shape`) tile it exactly: no overlap, no gap."""
    if sum(math.prod(s) for _, s in boxes) != math.prod(shape):
        raise _fail(f"tensor {fqn!r}: chunks do not hold as many elements as its shape")
    full = [(o, s) for o, s in boxes if all(s)]
    split = [d for d, extent in enumerate(shape) if any(o[d] or s[d] != extent for o, s in full)]
    if len(full) << len(split) > MAX_TILING_CORNERS:
        raise _fail(f"tensor {fqn!r}: too many chunks split along too many dimensions")
    if split and not _tiles(shape, full, split):
        raise _fail(f"tensor {fqn!r}: chunks overlap (and so leave a gap) instead of tiling it")


def _tiles(
    shape: tuple[int, ...], boxes: list[tuple[tuple[int, ...], tuple[int, ...]]], split: list[int]
) -> bool:
    """Whether boxes inside `shape`, as many elements as it holds, tile it (along `split`).

    Corner parity: a box's indicator function is a signed sum of the orthants at its corners, and
    modulo 2 distinct orthants are independent. So the boxes cover each point of the shape an odd
    number of times exactly when the corners that occur an odd number of times are the shape's
    own corners. Covered an odd number of times everywhere, by boxes whose element counts add up
    to the shape's, means covered exactly once.
    """
    odd: set[tuple[int, ...]] = set()
    for offsets, sizes in boxes:
        odd.symmetric_difference_update(
            itertools.product(*[(offsets[d], offsets[d] + sizes[d]) for d in split])
        )
    return odd == set(itertools.product(*[(0, shape[d]) for d in split]))


# Byte ranges: every stored item has bytes of its own ------------------------------------------

Stored = tuple[str, int, int, str, str, tuple[int, ...]]
"""One stored item's bytes: object key, start, end, then what it is (``tensor`` or ``value``),
its name and, for a tensor chunk, its offsets in the tensor."""


def stored_chunks(tensors: Iterable[tuple[str, TensorRecord]]) -> Iterator[Stored]:
    """The byte range of every chunk of `tensors`."""
    for fqn, tensor in tensors:
        for chunk in tensor.chunks:
            location = chunk.location
            end = location.offset + location.stored_length
            yield location.key, location.offset, end, "tensor", fqn, chunk.offsets


def stored_values(values: Iterable[tuple[str, ChunkLocation]]) -> Iterator[Stored]:
    """The byte range of every value of `values`."""
    for fqn, location in values:
        end = location.offset + location.stored_length
        yield location.key, location.offset, end, "value", fqn, ()


def check_disjoint(stored: Iterable[Stored]) -> None:
    """ManifestError if two stored items' bytes overlap inside one object (sorted: n log n).

    Within one step a writer stores each tensor chunk and value once, in bytes of its own: DCP
    writes a replicated item once (the manifest lists one location for it), a pack's members lie
    back to back, and an empty item holds no bytes. Bytes claimed twice can only be a forgery that
    points one item at another's bytes with their CRC32Cs copied, which every checksum passes.
    References into an earlier step's objects keep the ranges that step gave them, disjoint there,
    so the rule holds for them too.
    """
    ranges = sorted(item for item in stored if item[2] > item[1])
    for before, after in itertools.pairwise(ranges):
        if before[0] == after[0] and after[1] < before[2]:
            raise _fail(
                f"object {after[0]!r}: bytes {after[1]}..{after[2]} of {_describe(after)} overlap "
                f"bytes {before[1]}..{before[2]} of {_describe(before)}; every tensor chunk and "
                "value of a step has bytes of its own"
            )


def _describe(item: Stored) -> str:
    _key, _start, _end, kind, fqn, offsets = item
    return f"{kind} {fqn!r}" + (f" (chunk at {list(offsets)})" if any(offsets) else "")
