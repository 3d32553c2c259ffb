"""Manifests built from a save: what each rank reports, and the manifest or indexed root the
coordinator commits.

Every rank's ``write_data`` returns one `WrittenItem` per DCP item (where its bytes lie, in which
object, and for a member of a pack its dtype and shape); from `INDEX_MIN_RANKS` ranks on it writes
an index part of its own instead and returns a single `RankSummary`. The coordinator's
``finish`` turns DCP's global metadata and those results into a `Manifest` (`build_manifest`),
or into the root of an indexed manifest (`build_root`, linear in the number of chunks: numpy over
every chunk of the job). The formats themselves are `spotckpt.format`'s; nothing here reads or
writes the store.

Most of a root depends only on the save's layout (every tensor's shape, tiling and writers), and
later saves of a job usually keep their layout: each rank's summary carries a digest of its
layout, and `LayoutCache` keeps the encoded tensors of the last root built, reused (the same
bytes) when every rank reports the same digest and DCP's metadata the same tensors, so that such
a save's root costs the coordinator work per rank, not per chunk.
"""

from __future__ import annotations

import hashlib
import json
import threading
import zlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, cast

import numpy as np
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, TensorStorageMetadata
from torch.distributed.checkpoint.planner import WriteItem, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult

from spotckpt.checksum import crc32c
from spotckpt.engine.packing import PACK_PREFIX, PackedMember
from spotckpt.errors import CheckpointError
from spotckpt.format.dtypes import dtype_of
from spotckpt.format.encodings import FEATURE as ENCODED
from spotckpt.format.features import format_string
from spotckpt.format.index import (
    INDEXED_FORMAT,
    IndexedTensor,
    PartRecord,
    Runs,
    part_json,
    root_json,
    tensors_json,
    tiling_of,
)
from spotckpt.format.manifest import (
    FORMAT_VERSION,
    ChunkLocation,
    Manifest,
    ObjectRecord,
    TensorChunk,
    TensorRecord,
)
from spotckpt.format.packed import FEATURE as PACKED
from spotckpt.format.packed import pack_groups


@dataclass(frozen=True)
class ManifestHeader:
    """What a manifest says of its save besides its objects and tensors."""

    step: int
    attempt: str
    block_size: int
    versions: Mapping[str, str]
    user_metadata: Mapping[str, Any]


@dataclass(frozen=True)
class WrittenItem:
    """A WriteResult's storage data: where the item's bytes lie, and the object holding them;
    for a member of a pack (`spotckpt.engine.packing`), also its dtype and shape."""

    location: ChunkLocation
    record: ObjectRecord
    member: PackedMember | None = None


SUMMARY_NAME = "__spotckpt__/rank-summary"


@dataclass(frozen=True)
class RankSummary:
    """What a rank reports of an indexed save, as its one WriteResult's storage data: its object
    and index part, its values' locations, and the chunks it wrote as arrays (tensor names, then
    offsets and sizes padded to one width, with each row's true number of dimensions), so that
    the coordinator never touches a Python object per chunk. The names travel as one compressed
    JSON list, decoded only when the coordinator builds the tensors anew; `layout` is a digest of
    the names and arrays, for `LayoutCache`."""

    record: ObjectRecord
    part: PartRecord
    values: dict[str, ChunkLocation]
    names: bytes  # zlib(JSON list of the rows' tensor names)
    dims: np.ndarray
    offsets: np.ndarray
    sizes: np.ndarray
    layout: bytes

    def tensor_names(self) -> list[str]:
        """The tensor name of each row."""
        return [str(name) for name in json.loads(zlib.decompress(self.names))]


def index_part(
    header: ManifestHeader,
    rank: int,
    results: list[WriteResult],
    items: list[WriteItem],
    key: str,
    seal: Callable[[bytes], bytes] | None = None,
) -> tuple[bytes, WriteResult]:
    """A rank's index part of an indexed save (to be stored under `key`; `seal` signs it when
    the save is signed), and the one WriteResult that stands for all of `results`: a
    `RankSummary`."""
    chunks: dict[str, list[tuple[tuple[int, ...], ChunkLocation]]] = {}
    values: dict[str, ChunkLocation] = {}
    record = results[0].storage_data.record
    for result in results:
        location = result.storage_data.location
        if result.index.offset is None:
            values[result.index.fqn] = location
        else:
            chunks.setdefault(result.index.fqn, []).append((tuple(result.index.offset), location))
    data = part_json(header.step, header.attempt, rank, record, chunks)
    if seal is not None:
        data = seal(data)
    tensors = [i for i in items if i.type != WriteItemType.BYTE_IO and i.tensor_data]
    width = max((len(i.tensor_data.chunk.sizes) for i in tensors if i.tensor_data), default=0)
    offsets = np.zeros((len(tensors), width), dtype=np.int64)
    sizes = np.zeros((len(tensors), width), dtype=np.int64)
    dims = np.zeros(len(tensors), dtype=np.int64)
    for row, item in enumerate(tensors):
        chunk = item.tensor_data.chunk  # type: ignore[union-attr]
        dims[row] = len(chunk.sizes)
        offsets[row, : dims[row]] = chunk.offsets
        sizes[row, : dims[row]] = chunk.sizes
    names = json.dumps([i.index.fqn for i in tensors]).encode()
    summary = RankSummary(
        record,
        PartRecord(key, len(data), crc32c(data), rank),
        values,
        zlib.compress(names, 1),
        dims,
        offsets,
        sizes,
        _layout_digest(names, dims, offsets, sizes),
    )
    index = MetadataIndex(SUMMARY_NAME)
    return data, WriteResult(index=index, size_in_bytes=record.size, storage_data=summary)


def _layout_digest(names: bytes, dims: np.ndarray, offsets: np.ndarray, sizes: np.ndarray) -> bytes:
    """A digest of a rank's layout: its rows' names (length first), then the arrays' shape and
    contents (int64, C order), so that no two layouts share one encoding."""
    digest = hashlib.blake2b(len(names).to_bytes(8, "little"), digest_size=16)
    digest.update(names)
    digest.update(np.array(offsets.shape, dtype=np.int64).tobytes())
    for array in (dims, offsets, sizes):
        digest.update(np.ascontiguousarray(array, dtype=np.int64).tobytes())
    return digest.digest()


def is_indexed(results: list[list[WriteResult]]) -> bool:
    """Whether the ranks reported an indexed save (a `RankSummary` each)."""
    return any(isinstance(r.storage_data, RankSummary) for rank in results for r in rank[:1])


LayoutKey = tuple[tuple[tuple[int, bytes], ...], tuple[tuple[str, tuple[int, ...], str, int], ...]]
"""What a root's tensors depend on: each writing rank's layout digest, and DCP's tensors in order
(name, shape, dtype, number of chunks)."""


class LayoutCache:
    """The encoded tensors of the last root built, by the layout they came from (one entry).

    An entry is reused only for the same `LayoutKey`, which covers every input of the tensors'
    encoding: it holds nothing of a save's step, attempt, objects or data, so it needs no
    invalidation (a failed save, another step, another attempt leave it right), and a changed
    layout simply misses and replaces it. A process's coordinators share `ROOT_CACHE`."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._entry: tuple[LayoutKey, str] | None = None
        self.hits = 0
        self.misses = 0

    def encoded(self, key: LayoutKey, build: Callable[[], str]) -> str:
        """The encoded tensors of `key`: the cached text when it is this key's, else `build`'s
        (then cached)."""
        with self._lock:
            entry = self._entry
            if entry is not None and entry[0] == key:
                self.hits += 1
                return entry[1]
            self.misses += 1
        text = build()
        with self._lock:
            self._entry = (key, text)
        return text

    def clear(self) -> None:
        """Forget the entry (tests and benchmarks: the next root is built in full)."""
        with self._lock:
            self._entry = None


ROOT_CACHE = LayoutCache()


def build_root(
    header: ManifestHeader,
    metadata: Metadata,
    results: list[list[WriteResult]],
    cache: LayoutCache | None = ROOT_CACHE,
) -> tuple[Manifest, bytes]:
    """The root of an indexed manifest from DCP's metadata and who wrote what (linear in the
    number of chunks; when the layout is that of `cache`'s last root, linear in ranks and
    tensors), and a summary Manifest (its objects, no tensors)."""
    summaries = {rank: r[0].storage_data for rank, r in enumerate(results) if r}
    parts = {rank: summary.part for rank, summary in summaries.items()}
    objects = {summary.record.key: summary.record for summary in summaries.values()}
    values = {
        fqn: (summary.record, location)
        for summary in summaries.values()
        for fqn, location in summary.values.items()
    }
    entries = _tensor_entries(metadata)

    def build() -> str:
        return tensors_json(_indexed_tensors(entries, summaries))

    key = _layout_key(entries, summaries)
    tensors = build() if cache is None else cache.encoded(key, build)
    summary = Manifest(
        step=header.step,
        attempt=header.attempt,
        world_size=len(results),
        block_size=header.block_size,
        objects=objects,
        tensors={},
        values={},
        versions=dict(header.versions),
        user_metadata=dict(header.user_metadata),
        format=INDEXED_FORMAT,
    )
    data = root_json(
        step=header.step,
        attempt=header.attempt,
        created_at=summary.created_at,
        world_size=len(results),
        block_size=header.block_size,
        parts=[parts[rank] for rank in sorted(parts)],
        tensors=tensors,
        values=values,
        versions=dict(header.versions),
        planner_data={f: list(p) for f, p in (metadata.planner_data or {}).items()},
        user_metadata=dict(header.user_metadata),
    )
    return summary, data


def indexed_references(results: list[list[WriteResult]]) -> dict[str, int]:
    """Every object an indexed root references, by key (relative to the step folder) with its
    size: each rank's index part, and the object that part describes."""
    summaries = [r[0].storage_data for r in results if r]
    return {s.part.key: s.part.size for s in summaries} | {
        s.record.key: s.record.size for s in summaries
    }


def build_manifest(
    header: ManifestHeader, metadata: Metadata, results: list[list[WriteResult]]
) -> Manifest:
    """Turn DCP's global metadata and every rank's results into the manifest."""
    written: dict[MetadataIndex, WrittenItem] = {}
    objects: dict[str, ObjectRecord] = {}
    tensors: dict[str, TensorRecord] = {}
    for rank_results in results:
        for result in rank_results:
            item = result.storage_data
            written[result.index] = item
            objects[item.record.key] = item.record
            if item.member is not None:
                tensors.setdefault(item.member.fqn, _member_record(item))
    values: dict[str, ChunkLocation] = {}
    for fqn, entry in metadata.state_dict_metadata.items():
        if fqn.startswith(PACK_PREFIX):
            continue  # its members were recorded above
        if not isinstance(entry, TensorStorageMetadata):
            values[fqn] = written[MetadataIndex(fqn)].location
            continue
        chunks = tuple(
            TensorChunk(
                offsets=tuple(chunk.offsets),
                sizes=tuple(chunk.sizes),
                location=written[MetadataIndex(fqn, chunk.offsets)].location,
            )
            for chunk in entry.chunks
        )
        tensors[fqn] = TensorRecord(
            dtype=dtype_of(entry.properties.dtype).name, shape=tuple(entry.size), chunks=chunks
        )
    planner_data = {fqn: list(path) for fqn, path in (metadata.planner_data or {}).items()}
    manifest = Manifest(
        step=header.step,
        attempt=header.attempt,
        world_size=len(results),
        block_size=header.block_size,
        objects=objects,
        tensors=tensors,
        values=values,
        versions=dict(header.versions),
        user_metadata=dict(header.user_metadata),
        planner_data=planner_data,
    )
    manifest.format = format_string(FORMAT_VERSION, stored_features(manifest))
    return manifest


def stored_features(manifest: Manifest) -> set[str]:
    """The format features a flat manifest needs for how it stores its tensors: compressed
    chunks, and packed records for runs of small ones. Decided here, once, for every writer that
    builds one (the bucket's and the fast tier's: a tier's manifest is the bucket's, byte for
    byte, once drained); what it references is the incremental save's to add."""
    features = set()
    if any(location.codec for location in manifest.locations()):
        features.add(ENCODED)
    if pack_groups(manifest.tensors):  # runs of small tensors: one compact record each
        features.add(PACKED)
    return features


def _member_record(item: WrittenItem) -> TensorRecord:
    """The manifest record of a packed tensor: one chunk, the whole tensor."""
    member = cast(PackedMember, item.member)
    chunk = TensorChunk(
        offsets=(0,) * len(member.shape), sizes=member.shape, location=item.location
    )
    return TensorRecord(dtype=member.dtype, shape=member.shape, chunks=(chunk,))


def _tensor_entries(metadata: Metadata) -> dict[str, TensorStorageMetadata]:
    return {
        fqn: entry
        for fqn, entry in metadata.state_dict_metadata.items()
        if isinstance(entry, TensorStorageMetadata)
    }


def _layout_key(
    entries: dict[str, TensorStorageMetadata], summaries: dict[int, RankSummary]
) -> LayoutKey:
    """Everything `_indexed_tensors` reads, in a form compared in time linear in ranks and
    tensors (each rank's rows by their digest)."""
    tensors = tuple(
        (fqn, tuple(e.size), str(e.properties.dtype), len(e.chunks)) for fqn, e in entries.items()
    )
    return tuple((rank, s.layout) for rank, s in summaries.items()), tensors


def _indexed_tensors(
    entries: dict[str, TensorStorageMetadata], summaries: dict[int, RankSummary]
) -> dict[str, IndexedTensor]:
    """Every tensor of a root, from all ranks' summaries at once (numpy over every chunk of
    the job; Python only once per tensor and per distinct list of names)."""
    number = {fqn: i for i, fqn in enumerate(entries)}
    known: dict[bytes, np.ndarray] = {}  # ranks of one layout share their names
    width = max((s.offsets.shape[1] for s in summaries.values()), default=0)
    ids, ranks, offsets, sizes = [], [], [], []
    for rank, summary in summaries.items():
        if summary.names not in known:
            names = summary.tensor_names()
            if len(names) != len(summary.offsets):
                raise CheckpointError(f"rank {rank} reports {len(names)} names for its chunks")
            try:
                known[summary.names] = np.fromiter(
                    (number[name] for name in names), np.int64, len(names)
                )
            except KeyError as error:
                raise CheckpointError(f"rank {rank} wrote {error}, not in DCP's metadata") from None
        ids.append(known[summary.names])
        ranks.append(np.full(len(ids[-1]), rank, dtype=np.int64))
        pad = ((0, 0), (0, width - summary.offsets.shape[1]))
        offsets.append(np.pad(summary.offsets, pad))
        sizes.append(np.pad(summary.sizes, pad))
    all_ids = np.concatenate(ids) if ids else np.zeros(0, dtype=np.int64)
    order = np.argsort(all_ids, kind="stable")
    bounds = np.searchsorted(all_ids[order], np.arange(len(entries) + 1))
    all_ranks = np.concatenate(ranks)[order] if ranks else all_ids
    all_offsets = np.concatenate(offsets)[order] if offsets else np.zeros((0, 0), np.int64)
    all_sizes = np.concatenate(sizes)[order] if sizes else np.zeros((0, 0), np.int64)
    tensors = {}
    for i, (fqn, entry) in enumerate(entries.items()):
        rows = slice(bounds[i], bounds[i + 1])
        dims = len(entry.size)
        if bounds[i + 1] - bounds[i] != len(entry.chunks):
            raise CheckpointError(
                f"tensor {fqn!r}: the ranks report {bounds[i + 1] - bounds[i]} chunks, DCP's "
                f"metadata {len(entry.chunks)}"
            )
        tensors[fqn] = _indexed_tensor(
            entry, all_offsets[rows, :dims], all_sizes[rows, :dims], all_ranks[rows]
        )
    return tensors


def _indexed_tensor(
    entry: TensorStorageMetadata, offsets: np.ndarray, sizes: np.ndarray, ranks: np.ndarray
) -> IndexedTensor:
    """One tensor of a root: its chunks' grid (or list) and who wrote each chunk."""
    shape = tuple(entry.size)
    dtype = dtype_of(entry.properties.dtype).name
    grid, order = tiling_of(shape, offsets, sizes)
    if grid is not None and order is not None:
        return IndexedTensor(dtype, shape, Runs.of(ranks[order]), grid=grid)
    boxes = tuple(
        (tuple(o), tuple(s)) for o, s in zip(offsets.tolist(), sizes.tolist(), strict=True)
    )
    return IndexedTensor(dtype, shape, Runs.of(ranks), boxes=boxes)
