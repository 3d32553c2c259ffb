"""Manifests built from a save: what each rank reports, and the manifest or indexed root the
coordinator commits.

Every rank's ``write_data`` returns one `WrittenItem` per DCP item (where its bytes lie, in which
object, and for a member of a pack its dtype and shape); from `INDEX_MIN_RANKS` ranks on it writes
an index part of its own instead and returns a single `RankSummary`. The coordinator's
``finish`` turns DCP's global metadata and those results into a `Manifest` (`build_manifest`),
or into the root of an indexed manifest (`build_root`, linear in the number of chunks: numpy over
every chunk of the job). The formats themselves are `spotckpt.format`'s; nothing here reads or
writes the store.
"""

from __future__ import annotations

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
from spotckpt.format.index import (
    INDEXED_FORMAT,
    IndexedTensor,
    PartRecord,
    Runs,
    part_json,
    root_json,
    tiling_of,
)
from spotckpt.format.manifest import (
    ChunkLocation,
    Manifest,
    ObjectRecord,
    TensorChunk,
    TensorRecord,
)


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
    the coordinator never touches a Python object per chunk."""

    record: ObjectRecord
    part: PartRecord
    values: dict[str, ChunkLocation]
    names: tuple[str, ...]
    dims: np.ndarray
    offsets: np.ndarray
    sizes: np.ndarray


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
    summary = RankSummary(
        record,
        PartRecord(key, len(data), crc32c(data), rank),
        values,
        tuple(i.index.fqn for i in tensors),
        dims,
        offsets,
        sizes,
    )
    index = MetadataIndex(SUMMARY_NAME)
    return data, WriteResult(index=index, size_in_bytes=record.size, storage_data=summary)


def is_indexed(results: list[list[WriteResult]]) -> bool:
    """Whether the ranks reported an indexed save (a `RankSummary` each)."""
    return any(isinstance(r.storage_data, RankSummary) for rank in results for r in rank[:1])


def build_root(
    header: ManifestHeader, metadata: Metadata, results: list[list[WriteResult]]
) -> tuple[Manifest, bytes]:
    """The root of an indexed manifest from DCP's metadata and who wrote what (linear in the
    number of chunks), and a summary Manifest (its objects, no tensors)."""
    summaries = {rank: r[0].storage_data for rank, r in enumerate(results) if r}
    parts = {rank: summary.part for rank, summary in summaries.items()}
    objects = {summary.record.key: summary.record for summary in summaries.values()}
    values = {
        fqn: (summary.record, location)
        for summary in summaries.values()
        for fqn, location in summary.values.items()
    }
    tensors = _indexed_tensors(metadata, summaries)
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
    return Manifest(
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


def _member_record(item: WrittenItem) -> TensorRecord:
    """The manifest record of a packed tensor: one chunk, the whole tensor."""
    member = cast(PackedMember, item.member)
    chunk = TensorChunk(
        offsets=(0,) * len(member.shape), sizes=member.shape, location=item.location
    )
    return TensorRecord(dtype=member.dtype, shape=member.shape, chunks=(chunk,))


def _indexed_tensors(
    metadata: Metadata, summaries: dict[int, RankSummary]
) -> dict[str, IndexedTensor]:
    """Every tensor of a root, from all ranks' summaries at once (numpy over every chunk of
    the job; Python only once per tensor and per rank)."""
    entries = {
        fqn: entry
        for fqn, entry in metadata.state_dict_metadata.items()
        if isinstance(entry, TensorStorageMetadata)
    }
    number = {fqn: i for i, fqn in enumerate(entries)}
    known: dict[tuple[str, ...], np.ndarray] = {}  # ranks of one layout share their names
    width = max((s.offsets.shape[1] for s in summaries.values()), default=0)
    ids, ranks, offsets, sizes = [], [], [], []
    for rank, summary in summaries.items():
        if summary.names not in known:
            known[summary.names] = np.fromiter(
                (number[name] for name in summary.names), np.int64, len(summary.names)
            )
        ids.append(known[summary.names])
        ranks.append(np.full(len(summary.names), rank, dtype=np.int64))
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
