"""Packed tensor records (format feature ``packed``): a run of small tensors as one compact record.

A step of 20,000 small tensors (an MoE model's per-expert norms and biases, their optimizer
state) wrote 20,000 JSON records of dtype, shape, chunk, location and CRC32Cs, and a restore
spent a quarter of its time parsing and checking them one by one. Yet most of what they say is
implied: the tensors of a pack (`spotckpt.engine.packing`) are stored whole, back to back, in one
object. So a manifest that names the ``packed`` feature writes every run of at least
`MIN_MEMBERS` such tensors as one record of its ``"packs"`` list, with numbers as packed arrays
(little-endian, base64):

- ``key`` and ``offset``: the object, and where the first member's bytes start;
- ``names``: the members' names, in the order their bytes lie;
- ``dtypes`` (a table of dtype names) and ``dtype`` (uint8, each member's index into it);
- ``ndims`` (uint8, each member's number of dimensions) and ``dims`` (int64, every member's
  dimensions in turn);
- ``crc32c`` (uint32): every member's block CRC32Cs in turn;
- ``blake3`` (32 bytes per member; incremental saves only): each member's hash.

What can be derived is not stored: a member's length is its element count times its dtype's size,
its offset the end of the member before it, its block count ``max(1, ceil(length / block
size))``. The parser (`parse_packs`) checks everything over whole arrays with numpy, then yields
the very `TensorRecord` each member had before it was packed: nothing past the manifest knows a
tensor was packed, and a packed manifest re-encodes to the same bytes. (One thing differs: the
order of the manifest's tensors, which the tools follow, is those outside packed records in the
writer's order, then the packed ones in byte order.) Tensors that do not fit
(several chunks, compressed, a run too short) stay in ``"tensors"`` as before. A manifest
without such a run does not name the feature, so older spotckpt versions keep reading it.
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import numpy as np

from spotckpt.errors import ManifestError
from spotckpt.format.dtypes import BY_NAME, MAX_DIMS
from spotckpt.format.records import ChunkLocation, ObjectRecord, TensorChunk, TensorRecord

FEATURE = "packed"
"""The manifest feature name (`spotckpt.format.features`) of a manifest with packed records."""
MIN_MEMBERS = 16
"""The fewest back-to-back tensors written as one packed record: below it, the JSON form's cost
is small, and the step stays readable by spotckpt versions that predate the feature."""
MAX_MEMBERS = 2_000_000
"""The most tensors all packed records of a manifest may hold. A packed tensor takes about 16
bytes of manifest but its records about 700 bytes of memory: this keeps what a packed manifest
may cost about where the JSON form's size bound keeps it (1.6 million tensors)."""
_DIGEST_BYTES = 32

_Stored = tuple[str, int, int, str, str, tuple[int, ...]]


# Writing ---------------------------------------------------------------------------------------


Placed = tuple[str, ChunkLocation]
"""A named item and where its bytes lie."""


def back_to_back(
    items: Iterable[Placed], least: int, joins: Callable[[ChunkLocation, ChunkLocation], bool]
) -> list[list[Placed]]:
    """The runs of at least `least` of `items` whose bytes lie back to back in one object, each
    in byte order; `joins(first, location)` may end a run before an item that would extend it (a
    bound on a run's bytes, a property its items must share). The one finder of such runs, for
    the packed records written here and the runs a restore reads whole
    (`spotckpt.engine.packing.small_runs`)."""
    ordered = sorted(items, key=lambda i: (i[1].key, i[1].offset, i[1].length, i[0]))
    runs: list[list[Placed]] = []
    run: list[Placed] = []
    for item in ordered:
        location = item[1]
        if run:
            first, last = run[0][1], run[-1][1]
            adjacent = location.key == last.key and location.offset == last.offset + last.length
            if not adjacent or not joins(first, location):
                if len(run) >= least:
                    runs.append(run)
                run = []
        run.append(item)
    if len(run) >= least:
        runs.append(run)
    return runs


def pack_groups(tensors: Mapping[str, TensorRecord]) -> list[list[str]]:
    """The names of the tensors written as packed records, one list per record in byte order:
    runs of at least `MIN_MEMBERS` tensors stored whole, uncompressed, back to back in one
    object, all with a BLAKE3 or all without."""
    candidates = [
        (fqn, record.chunks[0].location)
        for fqn, record in tensors.items()
        if len(record.chunks) == 1
        and record.chunks[0].sizes == record.shape
        and not record.chunks[0].location.codec
        and not any(record.chunks[0].offsets)
    ]
    runs = back_to_back(candidates, MIN_MEMBERS, _same_hashing)
    return [[fqn for fqn, _location in run] for run in runs]


def _same_hashing(first: ChunkLocation, location: ChunkLocation) -> bool:
    return bool(first.blake3) == bool(location.blake3)


def pack_json(tensors: Mapping[str, TensorRecord], names: list[str]) -> dict[str, Any]:
    """The packed record of the tensors `names` (one group of `pack_groups`)."""
    records = [tensors[name] for name in names]
    table = sorted({record.dtype for record in records})
    codes = {name: code for code, name in enumerate(table)}
    locations = [record.chunks[0].location for record in records]
    document: dict[str, Any] = {
        "key": locations[0].key,
        "offset": locations[0].offset,
        "names": names,
        "dtypes": table,
        "dtype": _b64(np.array([codes[r.dtype] for r in records], np.uint8)),
        "ndims": _b64(np.array([len(r.shape) for r in records], np.uint8)),
        "dims": _b64(np.array([d for r in records for d in r.shape], "<i8")),
        "crc32c": _b64(np.array([c for loc in locations for c in loc.block_crc32c], "<u4")),
    }
    if locations[0].blake3:
        document["blake3"] = base64.b64encode(
            b"".join(bytes.fromhex(loc.blake3) for loc in locations)
        ).decode()
    return document


def _b64(array: np.ndarray) -> str:
    return base64.b64encode(array.tobytes()).decode()


# Reading ---------------------------------------------------------------------------------------


def parse_packs(
    entries: Any,
    objects: Mapping[str, ObjectRecord],
    block_size: int,
    *,
    listed: int,
    maximum: int,
) -> tuple[dict[str, TensorRecord], list[_Stored]]:
    """The members of every packed record of `entries` (a manifest's ``"packs"``) as
    `TensorRecord`s by name, and each record's byte range (for the disjointness check); with the
    `listed` tensors and values outside them, at most `maximum`. ManifestError names the first
    problem."""
    if not isinstance(entries, list):
        raise ManifestError("manifest 'packs' must be a list")
    tensors: dict[str, TensorRecord] = {}
    ranges: list[_Stored] = []
    for number, entry in enumerate(entries):
        where = f"packed record {number}"
        if not isinstance(entry, dict):
            raise ManifestError(f"{where}: must be a JSON object")
        names = entry.get("names")
        held = len(tensors) + (len(names) if isinstance(names, list) else 0)
        if listed + held > maximum:
            raise ManifestError(f"manifest lists more than {maximum} tensors and values")
        if held > MAX_MEMBERS:
            raise ManifestError(f"manifest's packed records hold more than {MAX_MEMBERS} tensors")
        members = _parse_pack(entry, objects, block_size, where)
        for fqn, record in members:
            if tensors.setdefault(fqn, record) is not record:
                raise ManifestError(f"{where}: tensor {fqn!r} is listed twice")
        if members:
            first, last = members[0][1].chunks[0].location, members[-1][1].chunks[0].location
            ranges.append(
                (first.key, first.offset, last.offset + last.length, "tensor", members[0][0], ())
            )
    return tensors, ranges


def _parse_pack(
    entry: dict[str, Any],
    objects: Mapping[str, ObjectRecord],
    block_size: int,
    where: str,
) -> list[tuple[str, TensorRecord]]:
    key = _field(entry, "key", str, where)
    stored = objects.get(key)
    if stored is None:
        raise ManifestError(
            f"{where}: refers to object {key[:80]!r}, which the manifest does not list"
        )
    offset = _offset(entry, where)
    names = _field(entry, "names", list, where)
    count = len(names)
    if count == 0:
        raise ManifestError(f"{where}: holds no tensor")
    if not all(isinstance(name, str) for name in names):
        raise ManifestError(f"{where}: names must be strings")
    table = _field(entry, "dtypes", list, where)
    if not 0 < len(table) <= 256 or not all(isinstance(n, str) and n in BY_NAME for n in table):
        raise ManifestError(f"{where}: dtypes must name known dtypes, at most 256")
    codes = _array(entry, "dtype", np.uint8, count, where)
    ndims = _array(entry, "ndims", np.uint8, count, where)
    if int(codes.max()) >= len(table) or int(ndims.max()) > MAX_DIMS:
        raise ManifestError(f"{where}: a dtype index or a number of dimensions is out of range")
    dims = _array(entry, "dims", "<i8", int(ndims.sum()), where)
    lengths = _lengths(codes, ndims, dims, table, stored.size - offset, where)
    ends = np.cumsum(lengths)  # lengths are >= 0 and add up to no more than the object holds
    blocks = np.maximum(1, -(-lengths // block_size))
    crcs = _array(entry, "crc32c", "<u4", int(blocks.sum()), where)
    digests = _digests(entry, count, where)
    starts, crc_list, dims_list = (offset + ends - lengths).tolist(), crcs.tolist(), dims.tolist()
    members = []
    first_crc = first_dim = 0
    for n, (name, start, length, block_count, rank, code) in enumerate(
        zip(
            names,
            starts,
            lengths.tolist(),
            blocks.tolist(),
            ndims.tolist(),
            codes.tolist(),
            strict=True,
        )
    ):
        shape = tuple(dims_list[first_dim : first_dim + rank])
        location = ChunkLocation(
            key=stored.key,
            offset=start,
            length=length,
            block_crc32c=tuple(crc_list[first_crc : first_crc + block_count]),
            blake3=digests[n] if digests else "",
        )
        chunk = TensorChunk(offsets=_ZEROS[rank], sizes=shape, location=location)
        members.append((name, TensorRecord(dtype=table[code], shape=shape, chunks=(chunk,))))
        first_crc += block_count
        first_dim += rank
    return members


_ZEROS = tuple((0,) * rank for rank in range(MAX_DIMS + 1))


def _lengths(
    codes: np.ndarray, ndims: np.ndarray, dims: np.ndarray, table: list[str], room: int, where: str
) -> np.ndarray:
    """Each member's length in bytes, refused (ManifestError) unless all of them fit in `room`
    (the object's bytes from the record's offset on). Memory and work are linear in the bytes of
    the record, and no product may overflow on the way: a forged shape is refused, not wrapped."""
    if room < 0:
        raise ManifestError(f"{where}: its offset lies beyond its object")
    if (dims < 0).any():
        raise ManifestError(f"{where}: a dimension is negative")
    shaped = ndims > 0  # a scalar (no dimension) holds one element
    starts = (np.cumsum(ndims, dtype=np.int64) - ndims)[shaped]
    itemsizes = np.array([BY_NAME[name].itemsize for name in table], np.int64)[codes]
    elements = np.ones(len(ndims), np.int64)
    if len(starts):
        empty = np.minimum.reduceat(dims, starts) == 0
        # in floating point first (an overflow there is inf, never a wrapped value): exact once
        # no product of a member without a zero dimension can exceed the room
        with np.errstate(over="ignore", invalid="ignore"):  # inf, and nan where a zero follows
            approx = np.multiply.reduceat(dims.astype(np.float64), starts)
        approx[empty] = 0
        if (approx * itemsizes[shaped]).sum() > room * (1 + 1e-9) + 1:
            raise ManifestError(f"{where}: its tensors' bytes reach beyond its object")
        with np.errstate(over="ignore"):
            exact = np.multiply.reduceat(dims, starts)
        exact[empty] = 0  # a product with a zero factor may have wrapped before the zero
        elements[shaped] = exact
    lengths = elements * itemsizes
    # exact: a product just past 2**63 (within the margin above) wrapped once, to a negative
    if (lengths < 0).any() or int(lengths.sum(dtype=np.uint64)) > room:
        raise ManifestError(f"{where}: its tensors' bytes reach beyond its object")
    return lengths


def _field(entry: dict[str, Any], name: str, kind: type, where: str) -> Any:
    value = entry.get(name)
    if not isinstance(value, kind) or isinstance(value, bool):
        raise ManifestError(f"{where}: field {name!r} is missing or has the wrong type")
    return value


def _offset(entry: dict[str, Any], where: str) -> int:
    value = _field(entry, "offset", int, where)
    if not 0 <= value < 1 << 63:
        raise ManifestError(f"{where}: 'offset' must be a non-negative integer below 2**63")
    return int(value)


def _array(entry: dict[str, Any], name: str, dtype: Any, count: int, where: str) -> np.ndarray:
    """Field `name`: base64 of exactly `count` little-endian items of `dtype`."""
    raw = _decoded(entry, name, where)
    if len(raw) != count * np.dtype(dtype).itemsize:  # before numpy sees a partial item
        raise ManifestError(f"{where}: {name!r} holds {len(raw)} bytes, {count} items expected")
    return np.frombuffer(raw, dtype)


def _digests(entry: dict[str, Any], count: int, where: str) -> list[str]:
    if "blake3" not in entry:
        return []
    raw = _decoded(entry, "blake3", where)
    if len(raw) != count * _DIGEST_BYTES:
        raise ManifestError(f"{where}: 'blake3' must hold {_DIGEST_BYTES} bytes per tensor")
    return [raw[i : i + _DIGEST_BYTES].hex() for i in range(0, len(raw), _DIGEST_BYTES)]


def _decoded(entry: dict[str, Any], name: str, where: str) -> bytes:
    text = _field(entry, name, str, where)
    try:
        return base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        raise ManifestError(f"{where}: {name!r} is not base64") from None


def unpacked(
    tensors: Mapping[str, TensorRecord], groups: list[list[str]]
) -> Iterator[tuple[str, TensorRecord]]:
    """The tensors of `tensors` that no group of `groups` holds."""
    packed = {name for group in groups for name in group}
    return ((fqn, record) for fqn, record in tensors.items() if fqn not in packed)
