"""DCP storage back end: `ObjectStoreWriter` and `ObjectStoreReader` for any `ObjectStore`.

Save (DCP's call order): ``reset`` -> ``set_up_storage_writer`` -> ``prepare_local_plan`` ->
``prepare_global_plan`` (coordinator: refuses a step that is already committed, draws the attempt
id, assigns each rank its object key) -> ``write_data`` (every rank streams one safetensors object
of its own items) -> ``finish`` (coordinator, after every rank succeeded: writes the manifest
create-only, the commit point, then the ``latest.json`` hint).

Load: ``read_metadata`` comes from a validated `Manifest`; ``read_data`` first checks that every
object it reads from exists with the manifest's size, then fetches with parallel ranged reads.
A tensor piece of half a read (8 MiB) or more that can take the stored bytes as they are (a
contiguous CPU destination of the stored dtype and shape) is read straight into its memory, in
pieces of at most ``max_read_bytes``, and its CRC32C blocks are checked there, in the reading
thread: no intermediate buffer, no copy. Smaller pieces (and those needing a strided copy or
another device) are widened to CRC block boundaries, coalesced with their neighbours into one
ranged read each, verified, and copied out. Non-tensor values are unpickled only with
``torch.load(weights_only=True)``, whatever planner is in use.
"""

from __future__ import annotations

import dataclasses
import functools
import io
import itertools
import logging
import math
import threading
from collections.abc import Callable
from concurrent.futures import Future as PoolFuture
from concurrent.futures import ThreadPoolExecutor, as_completed, wait
from dataclasses import dataclass
from typing import Any, cast

import numpy as np
import torch
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    LoadPlanner,
    ReadItem,
    SavePlan,
    SavePlanner,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.storage import StorageReader, StorageWriter, WriteResult
from torch.futures import Future

from spotckpt.catalog import (
    Catalog,
    index_part_key,
    new_attempt_id,
    rank_object_key,
    step_folder,
    step_key,
)
from spotckpt.checksum import crc32c
from spotckpt.chunks import ChunkReader
from spotckpt.errors import (
    CheckpointError,
    CorruptCheckpointError,
    InvalidArgumentError,
    InvalidTypeError,
)
from spotckpt.format.dtypes import BY_NAME, dtype_of
from spotckpt.format.index import (
    INDEXED_FORMAT,
    Box,
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
from spotckpt.format.safetensors_io import (
    DEFAULT_BLOCK_SIZE,
    SafetensorsStreamWriter,
    StoredRange,
    TensorSpec,
    block_crcs,
    tensor_bytes,
)
from spotckpt.packing import (
    PACK_PREFIX,
    PackedMember,
    PackingSavePlanner,
    Run,
    members_of,
    small_runs,
)
from spotckpt.storage.base import ObjectStore
from spotckpt.values import UnsupportedValueError, ValueLoadError, load_plain

log = logging.getLogger("spotckpt")
VALUE_PREFIX = "__value__/"


IN_PLACE_SHARE = 2
"""A tensor piece of at least ``max_read_bytes / IN_PLACE_SHARE`` (8 MiB by default) is read
straight into its destination, in pieces of at most ``max_read_bytes`` read in parallel; smaller
ones are coalesced with their neighbours into ranged reads of up to ``max_read_bytes`` and
copied out: a request of its own per mid-sized tensor would cost more than the copy."""

INDEX_MIN_RANKS = 32
"""From this many ranks on, a save writes an indexed manifest (`spotckpt.format.index`)."""


@dataclass(frozen=True)
class RankAssignment:
    """What the coordinator tells each rank: the attempt, the key of its object and whether
    it writes an index part."""

    attempt: str
    key: str
    indexed: bool = False


@dataclass(frozen=True)
class WrittenItem:
    """A WriteResult's storage data: where the item's bytes lie, and the object holding them;
    for a member of a pack (`spotckpt.packing`), also its dtype and shape."""

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


def _item_name(item: WriteItem) -> str:
    if item.type == WriteItemType.BYTE_IO:
        return VALUE_PREFIX + item.index.fqn
    offsets = item.tensor_data.chunk.offsets if item.tensor_data else ()
    if any(offsets):
        return f"{item.index.fqn}@{','.join(map(str, offsets))}"
    return item.index.fqn


class ObjectStoreWriter(StorageWriter):
    """Writes one checkpoint step into `store` through DCP; see the module docstring.

    It pickles with its store, which rebuilds itself where it is unpickled (DCP's process-mode
    async save runs the writer in a child process; the caller's copy then keeps ``attempt`` and
    ``manifest`` at None: read the outcome back from the store).
    """

    def __init__(
        self,
        store: ObjectStore,
        step: int,
        *,
        block_size: int = DEFAULT_BLOCK_SIZE,
        prefix_spread: bool = False,
        user_metadata: dict[str, Any] | None = None,
        versions: dict[str, str] | None = None,
        on_written: Callable[[], None] | None = None,
        index_parts: bool | None = None,
    ) -> None:
        super().__init__()
        self.index_parts = index_parts
        self.store = store
        self.catalog = Catalog(store)
        self.step = step
        self.block_size = block_size
        self.prefix_spread = prefix_spread
        self.user_metadata = dict(user_metadata or {})
        self.versions = dict(versions or {})
        self.on_written = on_written
        self.is_coordinator = False
        self.rank = 0
        self.attempt: str | None = None
        self.manifest: Manifest | None = None

    def reset(self, checkpoint_id: Any = None) -> None:
        self.attempt = None
        self.manifest = None

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self.is_coordinator = is_coordinator
        self.rank = int(kwargs.get("rank", 0))

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        return plan

    def save_planner(self, world_size: int) -> SavePlanner:
        """The planner to save through this writer with: small tensors in packs
        (`spotckpt.packing`), unless the save writes index parts (from `INDEX_MIN_RANKS` ranks),
        whose summaries describe DCP's items as they are."""
        indexed = self.index_parts
        if indexed is None:
            indexed = world_size >= INDEX_MIN_RANKS
        return DefaultSavePlanner() if indexed else PackingSavePlanner()

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        self.check_step_free()
        attempt = new_attempt_id()
        indexed = self.index_parts
        if indexed is None:
            indexed = len(plans) >= INDEX_MIN_RANKS
        return [
            dataclasses.replace(
                plan,
                storage_data=RankAssignment(
                    attempt, rank_object_key(attempt, rank, self.prefix_spread), indexed
                ),
            )
            for rank, plan in enumerate(plans)
        ]

    def check_step_free(self) -> None:
        """On the coordinator, before any write: CheckpointAlreadyCommittedError if the step
        is committed in the store (a committed checkpoint is never overwritten)."""
        self.catalog.check_not_committed(self.step)

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        future: Future[list[WriteResult]] = Future()
        assignment = plan.storage_data
        if not isinstance(assignment, RankAssignment):
            raise InvalidTypeError(
                "ObjectStoreWriter.write_data needs a plan from prepare_global_plan"
            )
        self.attempt = assignment.attempt
        results = self._write_object(plan.items, planner, assignment.key) if plan.items else []
        if assignment.indexed and results:
            results = self.write_index_part(results, plan.items)
        if self.on_written is not None:
            self.on_written()
        future.set_result(results)
        return future

    def _write_object(
        self, items: list[WriteItem], planner: SavePlanner, key: str
    ) -> list[WriteResult]:
        values = {
            item.index: _value_bytes(planner.resolve_data(item), item.index.fqn)
            for item in items
            if item.type == WriteItemType.BYTE_IO
        }
        ordered = sorted(items, key=lambda i: i.type != WriteItemType.BYTE_IO)
        specs = [self._spec(item, values) for item in ordered]
        metadata = {"format": "pt", "spotckpt.step": str(self.step)}
        writer = self.store.open_writer(step_key(self.step, key))
        placed: list[tuple[MetadataIndex, ChunkLocation, PackedMember | None]] = []
        with writer:
            stream = SafetensorsStreamWriter(writer, specs, metadata, self.block_size)
            for item, spec in zip(ordered, specs, strict=True):
                data = values.get(item.index)
                if data is None:
                    data = tensor_bytes(_cpu_tensor(planner.resolve_data(item)))
                stored = stream.write_tensor(spec.name, data)
                # While the object's last parts upload: where each item (or member) lies.
                members = members_of(planner, item.index.fqn)
                if members is None:
                    location = ChunkLocation(
                        key=key,
                        offset=stored.offset,
                        length=stored.length,
                        block_crc32c=stored.block_crc32c,
                    )
                    placed.append((item.index, location, None))
                else:
                    placed += self._member_locations(members, stored, data, key)
            size, crc = stream.finish()
        record = ObjectRecord(key=key, size=size, crc32c=crc, rank=self.rank)
        return [
            WriteResult(index, location.length, WrittenItem(location, record, member))
            for index, location, member in placed
        ]

    def _member_locations(
        self, members: tuple[PackedMember, ...], stored: StoredRange, data: memoryview, key: str
    ) -> list[tuple[MetadataIndex, ChunkLocation, PackedMember]]:
        """Where each member of a pack lies in object `key`, with its own block CRC32Cs, as if
        it had been written alone."""
        located = []
        for member in members:
            piece = data[member.offset : member.offset + member.nbytes]
            location = ChunkLocation(
                key=key,
                offset=stored.offset + member.offset,
                length=member.nbytes,
                block_crc32c=block_crcs(piece, self.block_size),
            )
            index = MetadataIndex(member.fqn, torch.Size([0] * len(member.shape)))
            located.append((index, location, member))
        return located

    def write_index_part(
        self, results: list[WriteResult], items: list[WriteItem]
    ) -> list[WriteResult]:
        """Write this rank's index part (indexed saves, in `write_data`) and return the one
        WriteResult that stands for all of `results`: a `RankSummary`."""
        chunks: dict[str, list[tuple[tuple[int, ...], ChunkLocation]]] = {}
        values: dict[str, ChunkLocation] = {}
        record = results[0].storage_data.record
        for result in results:
            location = result.storage_data.location
            if result.index.offset is None:
                values[result.index.fqn] = location
            else:
                chunks.setdefault(result.index.fqn, []).append(
                    (tuple(result.index.offset), location)
                )
        attempt = self.attempt or "unknown"
        data = part_json(self.step, attempt, self.rank, record, chunks)
        key = index_part_key(attempt, self.rank)
        self.store.put(step_key(self.step, key), data, create_only=True)
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
            PartRecord(key, len(data), crc32c(data), self.rank),
            values,
            tuple(i.index.fqn for i in tensors),
            dims,
            offsets,
            sizes,
        )
        index = MetadataIndex(SUMMARY_NAME)
        return [WriteResult(index=index, size_in_bytes=record.size, storage_data=summary)]

    def _spec(self, item: WriteItem, values: dict[MetadataIndex, memoryview]) -> TensorSpec:
        name = _item_name(item)
        if item.type == WriteItemType.BYTE_IO:
            return TensorSpec(name, BY_NAME["uint8"], (values[item.index].nbytes,))
        if item.tensor_data is None:
            raise InvalidTypeError(f"write item {item.index.fqn!r} has no tensor data")
        dtype = dtype_of(item.tensor_data.properties.dtype)
        return TensorSpec(name, dtype, tuple(item.tensor_data.chunk.sizes))

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        if any(isinstance(r.storage_data, RankSummary) for rank in results for r in rank[:1]):
            summary, data = self.build_root(metadata, results)
            self.catalog.commit_bytes(self.step, summary.attempt, data)
            self.manifest = summary  # committed: nothing after this point may undo it
            return
        manifest = self.build_manifest(metadata, results)
        self.catalog.commit(manifest, manifest.to_json())
        self.manifest = manifest  # committed: nothing after this point may undo it

    def build_root(
        self, metadata: Metadata, results: list[list[WriteResult]]
    ) -> tuple[Manifest, bytes]:
        """The root of an indexed manifest from DCP's metadata and who wrote what (linear in
        the number of chunks), and a summary Manifest (its objects, no tensors)."""
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
            step=self.step,
            attempt=self.attempt or "unknown",
            world_size=len(results),
            block_size=self.block_size,
            objects=objects,
            tensors={},
            values={},
            versions=self.versions,
            user_metadata=self.user_metadata,
            format=INDEXED_FORMAT,
        )
        data = root_json(
            step=self.step,
            attempt=summary.attempt,
            created_at=summary.created_at,
            world_size=len(results),
            block_size=self.block_size,
            parts=[parts[rank] for rank in sorted(parts)],
            tensors=tensors,
            values=values,
            versions=self.versions,
            planner_data={f: list(p) for f, p in (metadata.planner_data or {}).items()},
            user_metadata=self.user_metadata,
        )
        return summary, data

    def build_manifest(self, metadata: Metadata, results: list[list[WriteResult]]) -> Manifest:
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
            step=self.step,
            attempt=self.attempt or "unknown",
            world_size=len(results),
            block_size=self.block_size,
            objects=objects,
            tensors=tensors,
            values=values,
            versions=self.versions,
            user_metadata=self.user_metadata,
            planner_data=planner_data,
        )

    def storage_meta(self) -> StorageMeta | None:
        return StorageMeta(checkpoint_id=f"{self.store.uri}/{step_folder(self.step)}")

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Any) -> bool:
        return False


def _member_record(item: WrittenItem) -> TensorRecord:
    """The manifest record of a packed tensor: one chunk, the whole tensor."""
    member = cast(PackedMember, item.member)
    chunk = TensorChunk(
        offsets=(0,) * len(member.shape), sizes=member.shape, location=item.location
    )
    return TensorRecord(dtype=member.dtype, shape=member.shape, chunks=(chunk,))


def _value_bytes(data: Any, fqn: str) -> memoryview:
    """The stored bytes of a value, refused unless a restore can load them (weights_only)."""
    if not isinstance(data, io.BytesIO):
        raise InvalidTypeError(f"DCP resolved a value to {type(data).__name__}, expected BytesIO")
    view = data.getbuffer()
    try:
        load_plain(view, fqn)
    except ValueLoadError as error:
        raise UnsupportedValueError(
            f"value {fqn!r} would not restore, so the save is refused: {error}"
        ) from None
    return view


def _cpu_tensor(data: Any) -> torch.Tensor:
    if not isinstance(data, torch.Tensor):
        raise InvalidTypeError(f"DCP resolved a tensor item to {type(data).__name__}")
    return data.detach().cpu() if data.device.type != "cpu" else data.detach()


# Reading ----------------------------------------------------------------------------------------


@dataclass
class _Need:
    """One read item's byte range within one object, widened to CRC block boundaries."""

    request: ReadItem
    location: ChunkLocation
    start: int
    end: int
    first_block: int
    wanted_start: int
    wanted_end: int
    target: torch.Tensor | None = None
    """The destination, once resolved (tensor items only)."""
    contiguous: bool = False
    """Whether the wanted bytes are exactly the destination's memory (then copied as bytes)."""


@dataclass
class _Fetch:
    """One ranged read that serves one or more needs.

    `into` is the destination tensor's own memory when the fetch lands in place (one need, a
    piece of one tensor); otherwise the fetch is read into a buffer of its own and copied out.
    """

    key: str
    start: int
    end: int
    needs: list[_Need]
    into: memoryview | None = None


@dataclass
class _Landing:
    """A tensor read in place: its destination and how many of its pieces are in flight."""

    target: torch.Tensor
    pieces_left: int


@dataclass
class ReadStats:
    """Bytes a restore fetched against bytes its read items needed."""

    bytes_read: int = 0
    bytes_needed: int = 0
    requests: int = 0

    @property
    def ratio(self) -> float:
        """Read over needed (1.0 is perfect)."""
        return self.bytes_read / self.bytes_needed if self.bytes_needed else 1.0


@dataclass(frozen=True)
class SharedRead:
    """A tensor piece that several ranks load: `source` reads it, then broadcasts it."""

    key: tuple[Any, ...]
    source: int
    dtype: str
    lengths: tuple[int, ...]


@dataclass
class SharedReads:
    """A rank's part of the shared-read plan: every rank holds the same ordered `reads` (they
    are collectives) and the read items it receives instead of reading them."""

    reads: list[SharedRead]
    receive: dict[tuple[Any, ...], ReadItem]


def _read_key(item: ReadItem) -> tuple[Any, ...]:
    index = item.storage_index
    return (
        index.fqn,
        tuple(index.offset or ()),
        tuple(item.storage_offsets),
        tuple(item.lengths),
    )


class ObjectStoreReader(StorageReader):
    """Reads one committed checkpoint described by `manifest`; see the module docstring.

    With a process `group`, a tensor piece that several ranks load (DDP replicas, the replicated
    dimension of HSDP) is read from the bucket once, by one of them (spread for balance), and
    broadcast to the others inside `read_data`, so a restart reads the checkpoint about once
    whatever the number of replicas.

    With `offer_runs`, the metadata also offers each run of small tensors (`spotckpt.packing`)
    as one uint8 item, for a load planner that adopts runs (the manager's); plain DCP planners
    would load such an item as a tensor of its own, so it is off by default.
    """

    def __init__(
        self,
        store: ObjectStore,
        manifest: Manifest,
        *,
        max_parallel_reads: int = 8,
        max_read_bytes: int = 16 << 20,
        coalesce_gap: int = 64 << 10,
        group: Any = None,
        offer_runs: bool = False,
    ) -> None:
        super().__init__()
        self.group = group
        self.store = store
        self.manifest = manifest
        self.folder = step_folder(manifest.step)
        self.max_parallel_reads = max_parallel_reads
        self.max_read_bytes = max_read_bytes
        self.coalesce_gap = coalesce_gap
        self.chunks = ChunkReader(
            store,
            self.folder,
            manifest.block_size,
            {key: record.size for key, record in manifest.objects.items()},
        )
        self.metadata, self.locations = manifest.to_dcp()
        self.chunk_sizes = {
            MetadataIndex(fqn, torch.Size(chunk.offsets)): (tensor.dtype, chunk.sizes)
            for fqn, tensor in manifest.tensors.items()
            for chunk in tensor.chunks
        }
        self.offer_runs = offer_runs
        self.runs = small_runs(manifest) if offer_runs else {}
        for name, run in self.runs.items():
            self._offer_run(name, run)
        self.stats = ReadStats()
        self._stats_lock = threading.Lock()

    def __reduce__(self) -> tuple[Any, ...]:
        """Pickle as the store, the manifest and the read settings (the stats start afresh)."""
        if self.group is not None:
            raise InvalidArgumentError(
                "an ObjectStoreReader with a process group cannot be pickled (a group does not "
                "cross processes); build the reader with group=None in the other process"
            )
        rebuild = functools.partial(
            ObjectStoreReader,
            max_parallel_reads=self.max_parallel_reads,
            max_read_bytes=self.max_read_bytes,
            coalesce_gap=self.coalesce_gap,
            offer_runs=self.offer_runs,
        )
        return rebuild, (self.store, self.manifest)

    def _offer_run(self, name: str, run: Run) -> None:
        """Offer DCP a run of small tensors (`spotckpt.packing`) as one more uint8 item, which a
        load planner may load instead of its members; its bytes are checked member by member."""
        size = torch.Size([run.length])
        chunk = ChunkStorageMetadata(torch.Size([0]), size)
        properties = TensorProperties(dtype=torch.uint8)
        self.metadata.state_dict_metadata[name] = TensorStorageMetadata(properties, size, [chunk])
        index = MetadataIndex(name, torch.Size([0]))
        self.locations[index] = ChunkLocation(
            key=run.key, offset=run.offset, length=run.length, block_crc32c=()
        )
        self.chunk_sizes[index] = ("uint8", (run.length,))

    def reset(self, checkpoint_id: Any = None) -> None:
        self.stats = ReadStats()

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        return self.metadata

    def set_up_storage_reader(
        self, metadata: Metadata, is_coordinator: bool, *a: Any, **k: Any
    ) -> None:
        return None

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        """On the coordinator: give each tensor piece wanted by several ranks to one reader."""
        if self.group is None or len(plans) < 2:
            return plans
        wanted: dict[tuple[Any, ...], list[tuple[int, ReadItem]]] = {}
        for rank, plan in enumerate(plans):
            for item in plan.items:
                if item.type != LoadItemType.BYTE_IO:
                    wanted.setdefault(_read_key(item), []).append((rank, item))
        load = [0] * len(plans)
        reads: list[SharedRead] = []
        dropped: list[set[int]] = [set() for _ in plans]  # id() of items others read for them
        for key in sorted(k for k, ranks in wanted.items() if len(ranks) > 1):
            holders = wanted[key]
            item = holders[0][1]
            dtype, _sizes = self.chunk_sizes[item.storage_index]
            nbytes = math.prod(item.lengths) * BY_NAME[dtype].itemsize
            source = min((r for r, _ in holders), key=lambda r: (load[r], r))
            load[source] += nbytes
            reads.append(SharedRead(key, source, dtype, tuple(item.lengths)))
            for rank, held in holders:
                if rank != source:
                    dropped[rank].add(id(held))
        return [
            dataclasses.replace(
                plan,
                items=[i for i in plan.items if id(i) not in dropped[rank]],
                storage_data=SharedReads(
                    reads,
                    {_read_key(i): i for i in plan.items if id(i) in dropped[rank]},
                ),
            )
            for rank, plan in enumerate(plans)
        ]

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Any) -> bool:
        return False

    def byte_ranges(self, plan: LoadPlan) -> dict[str, list[tuple[int, int]]]:
        """The byte ranges ``[start, end)`` of each object that reading `plan` fetches."""
        ranges: dict[str, list[tuple[int, int]]] = {}
        for fetch in self._plan_fetches([self._need(item) for item in plan.items]):
            ranges.setdefault(fetch.key, []).append((fetch.start, fetch.end))
        return ranges

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        self._read_own(plan, planner)
        if isinstance(plan.storage_data, SharedReads):
            self._exchange(plan, plan.storage_data, planner)
        done_future: Future[None] = Future()
        done_future.set_result(None)
        return done_future

    def _exchange(self, plan: LoadPlan, shared: SharedReads, planner: LoadPlanner) -> None:
        """Broadcast each shared piece from its reader; every rank takes part in every one."""
        import torch.distributed as dist

        rank = dist.get_rank(self.group)
        mine = {_read_key(i): i for i in plan.items}
        for read in shared.reads:
            dtype = BY_NAME[read.dtype].torch_dtype
            if read.source == rank:
                buffer = planner.resolve_tensor(mine[read.key]).detach().contiguous()
            else:
                buffer = torch.empty(read.lengths, dtype=dtype)
            dist.broadcast(
                buffer, src=dist.get_global_rank(self.group, read.source), group=self.group
            )
            item = shared.receive.get(read.key)
            if item is not None:
                target = planner.resolve_tensor(item).detach()
                target.copy_(buffer.view(target.shape))
                planner.commit_tensor(item, target)

    def _read_own(self, plan: LoadPlan, planner: LoadPlanner) -> None:
        """Fetch the plan's items with parallel ranged reads; each fetch's CRCs are checked in
        the thread that read it, and tensors are committed here, in the calling thread."""
        fetches, buffered = [], []
        landing: dict[int, _Landing] = {}  # by id() of the read item
        for need in (self._need(item) for item in plan.items):
            target = self._in_place_target(need, planner)
            if target is None:
                buffered.append(need)
                continue
            pieces = self._pieces(need, target)
            landing[id(need.request)] = _Landing(target, len(pieces))
            fetches += pieces
        fetches += self._plan_fetches(buffered)
        fetches.sort(key=lambda fetch: (fetch.key, fetch.start))
        with ThreadPoolExecutor(
            self.max_parallel_reads, thread_name_prefix="spotckpt-read"
        ) as pool:
            self._check_objects(fetches, pool)
            pending = {pool.submit(self._fetch, fetch): fetch for fetch in fetches}
            try:
                for done in as_completed(pending):
                    fetch = pending[done]
                    buffer = done.result()
                    for need in fetch.needs:
                        if fetch.into is None:
                            self._deliver(need, buffer, fetch.start, planner)
                            continue
                        landed = landing[id(need.request)]
                        landed.pieces_left -= 1
                        if not landed.pieces_left:
                            planner.commit_tensor(need.request, landed.target)
            except Exception as error:
                raise _first_failure(pending, error) from None

    def _check_objects(self, fetches: list[_Fetch], pool: ThreadPoolExecutor) -> None:
        """Before any byte is read: every object exists with the size the manifest says, and
        holds what is asked of it (one ``head`` each, in parallel); an error names everything
        that this rank reads from the object."""
        spans: dict[str, tuple[int, int, list[str]]] = {}
        for fetch in fetches:
            start, end, names = spans.get(fetch.key, (fetch.start, fetch.end, []))
            names += [need.request.storage_index.fqn for need in fetch.needs]
            spans[fetch.key] = (min(start, fetch.start), max(end, fetch.end), names)
        checks = pool.map(lambda entry: self.chunks.check_range(entry[0], *entry[1]), spans.items())
        list(checks)  # raises the first failure, in object order

    def _in_place_target(self, need: _Need, planner: LoadPlanner) -> torch.Tensor | None:
        """Resolve a tensor need's destination (kept in `need.target`); return it when the
        stored bytes can be read straight into its memory: a CPU tensor, contiguous, of the
        stored dtype and shape, whose piece is contiguous in the chunk, block-aligned and at
        least half a read (`IN_PLACE_SHARE`)."""
        item = need.request
        if item.type == LoadItemType.BYTE_IO:
            return None
        target = need.target = planner.resolve_tensor(item).detach()
        dtype, _sizes = self.chunk_sizes[item.storage_index]
        stored = BY_NAME[dtype]
        nbytes = math.prod(item.lengths) * stored.itemsize
        need.contiguous = (
            need.wanted_end - need.wanted_start == nbytes
            and target.device.type == "cpu"
            and target.dtype == stored.torch_dtype
            and target.is_contiguous()
            and tuple(target.shape) == tuple(item.lengths)
        )
        aligned = (need.start, need.end) == (need.wanted_start, need.wanted_end)
        large = nbytes >= self.max_read_bytes // IN_PLACE_SHARE
        return target if need.contiguous and aligned and large else None

    def _pieces(self, need: _Need, target: torch.Tensor) -> list[_Fetch]:
        """An in-place need as fetches of at most about `max_read_bytes`, each into its slice of
        the destination's memory, read in parallel; cut at CRC block boundaries, or, for a run
        of small tensors, at its members' boundaries (each member is checked whole)."""
        memory = target.reshape(-1).view(torch.uint8).numpy().data
        run = self.runs.get(need.request.storage_index.fqn)
        cuts = self._block_cuts(need) if run is None else _member_cuts(run, self.max_read_bytes)
        fetches = []
        offset = need.location.offset
        for start, end in itertools.pairwise([*cuts, need.end]):
            first_block = start // self.chunks.block_size
            piece = dataclasses.replace(need, start=start, end=end, first_block=first_block)
            into = memory[start - need.start : end - need.start]
            fetches.append(_Fetch(need.location.key, offset + start, offset + end, [piece], into))
        return fetches

    def _block_cuts(self, need: _Need) -> list[int]:
        block = self.chunks.block_size
        return list(range(need.start, need.end, max(1, self.max_read_bytes // block) * block))

    def _need(self, item: ReadItem) -> _Need:
        location = self.locations.get(item.storage_index)
        if location is None:
            raise CorruptCheckpointError(
                f"checkpoint step {self.manifest.step} has no stored item "
                f"{item.storage_index.fqn!r}"
            )
        if item.type == LoadItemType.BYTE_IO:
            wanted_start, wanted_end = 0, location.length
        else:
            dtype, sizes = self.chunk_sizes[item.storage_index]
            wanted_start, wanted_end = _element_span(
                sizes, item.storage_offsets, item.lengths, BY_NAME[dtype].itemsize
            )
        span = self.chunks.span(location, wanted_start, wanted_end)
        self.stats.bytes_needed += wanted_end - wanted_start
        return _Need(
            item, location, span.start, span.end, span.first_block, wanted_start, wanted_end
        )

    def _plan_fetches(self, needs: list[_Need]) -> list[_Fetch]:
        fetches: list[_Fetch] = []
        ordered = sorted(needs, key=lambda n: (n.location.key, n.location.offset + n.start))
        for need in ordered:
            start = need.location.offset + need.start
            end = need.location.offset + need.end
            last = fetches[-1] if fetches else None
            if (
                last is not None
                and last.key == need.location.key
                and start <= last.end + self.coalesce_gap
                and max(end, last.end) - last.start <= self.max_read_bytes
            ):
                last.end = max(last.end, end)
                last.needs.append(need)
            else:
                fetches.append(_Fetch(need.location.key, start, end, [need]))
        return fetches

    def _fetch(self, fetch: _Fetch) -> memoryview:
        """Read one fetch (into its destination, or a buffer of its own) and check the CRCs of
        every need it serves; runs in a reader thread."""
        view = fetch.into
        if view is None:
            view = memoryview(bytearray(fetch.end - fetch.start))
        names = [need.request.storage_index.fqn for need in fetch.needs]
        self.chunks.read_into(fetch.key, fetch.start, view, names)
        for need in fetch.needs:
            base = need.location.offset + need.start - fetch.start
            piece = view[base : base + need.end - need.start]
            run = self.runs.get(need.request.storage_index.fqn)
            if run is None:
                fqn = need.request.storage_index.fqn
                self.chunks.verify(piece, need.location, need.first_block, fqn)
            else:
                self._verify_run(run, need, piece)
        with self._stats_lock:
            self.stats.bytes_read += view.nbytes
            self.stats.requests += 1
        return view

    def _verify_run(self, run: Run, need: _Need, piece: memoryview) -> None:
        """Check each member of a run, in the piece `need.start`..`need.end` of it (cut at
        member boundaries), on its own bytes."""
        start, end = run.offset + need.start, run.offset + need.end
        for member in run.members:
            at = member.location.offset
            empty_at_end = member.location.length == 0 and at == end == run.offset + run.length
            if start <= at < end or empty_at_end:
                member_bytes = piece[at - start : at - start + member.location.length]
                self.chunks.verify(member_bytes, member.location, 0, member.fqn)

    def _deliver(
        self, need: _Need, buffer: memoryview, buffer_start: int, planner: LoadPlanner
    ) -> None:
        """Hand a need's verified bytes, read into a fetch buffer, to the planner."""
        base = need.location.offset + need.start - buffer_start
        view = buffer[base : base + need.end - need.start]
        item = need.request
        if item.type == LoadItemType.BYTE_IO:
            planner.load_bytes(item, _safe_value_stream(view, item.storage_index.fqn))
            return
        wanted = view[need.wanted_start - need.start : need.wanted_end - need.start]
        target = need.target if need.target is not None else planner.resolve_tensor(item).detach()
        if need.contiguous:
            target.reshape(-1).view(torch.uint8).numpy().data[:] = wanted
            planner.commit_tensor(item, target)
            return
        dtype, sizes = self.chunk_sizes[item.storage_index]
        source = _strided_view(
            wanted, BY_NAME[dtype].torch_dtype, sizes, item.storage_offsets, item.lengths
        )
        if target.shape != source.shape:
            raise CorruptCheckpointError(
                f"{item.storage_index.fqn}: stored piece {tuple(source.shape)} does not fit the "
                f"destination {tuple(target.shape)}"
            )
        target.copy_(source)
        planner.commit_tensor(item, target)


def _member_cuts(run: Run, step: int) -> list[int]:
    """Offsets within a run where pieces of about `step` bytes start, at member boundaries."""
    cuts = [0]
    for member in run.members:
        at = member.location.offset - run.offset
        if at - cuts[-1] >= step:
            cuts.append(at)
    return cuts


def _first_failure(
    pending: dict[PoolFuture[memoryview], _Fetch], error: BaseException
) -> BaseException:
    """After `error`, the failure to report: cancel the fetches not started, wait for the
    running ones, and take the failed fetch first in object order (fetches are submitted in
    that order, so every earlier one has run), so that a damaged object always gets the same
    message; `error` itself when it did not come from a fetch."""
    for future in pending:
        future.cancel()
    wait(pending)
    failed = [
        (pending[f].key, pending[f].start, f.exception())
        for f in pending
        if not f.cancelled() and f.exception() is not None
    ]
    if not any(failure is error for _key, _start, failure in failed):
        return error
    return min(failed, key=lambda entry: (entry[0], entry[1]))[2] or error


def _element_span(
    sizes: tuple[int, ...], offsets: torch.Size, lengths: torch.Size, itemsize: int
) -> tuple[int, int]:
    """Byte range, within a row-major chunk, from the first to the last element of a sub-block."""
    if math.prod(lengths) == 0:
        return 0, 0
    if tuple(lengths) == sizes and not any(offsets):  # the whole chunk
        return 0, math.prod(sizes) * itemsize
    strides = _row_major_strides(sizes)
    first = sum(o * s for o, s in zip(offsets, strides, strict=True))
    last = sum((o + n - 1) * s for o, n, s in zip(offsets, lengths, strides, strict=True))
    return first * itemsize, (last + 1) * itemsize


def _row_major_strides(sizes: tuple[int, ...]) -> list[int]:
    strides = [1] * len(sizes)
    for i in range(len(sizes) - 2, -1, -1):
        strides[i] = strides[i + 1] * sizes[i + 1]
    return strides


def _strided_view(
    data: memoryview,
    dtype: torch.dtype,
    sizes: tuple[int, ...],
    offsets: torch.Size,
    lengths: torch.Size,
) -> torch.Tensor:
    """The sub-block `lengths` of a row-major chunk, given the bytes from its first element."""
    if math.prod(lengths) == 0:
        return torch.empty(tuple(lengths), dtype=dtype)
    raw = torch.frombuffer(data, dtype=torch.uint8)  # a fetch buffer: writable, no warning
    itemsize = torch.empty((), dtype=dtype).element_size()
    if raw.data_ptr() % itemsize:
        raw = raw.clone()
    flat = raw.view(dtype)
    return flat.as_strided(tuple(lengths), _row_major_strides(sizes), flat.storage_offset())


def _safe_value_stream(view: memoryview, fqn: str) -> io.BytesIO:
    """Unpickle a stored value with weights_only=True, then hand DCP a re-serialised copy.

    DCP's default planner unpickles what a reader gives it with the unrestricted loader, so
    bytes from the bucket never reach it: only objects that survived the restricted unpickler do.
    Bytes that pass their CRCs but do not load raise ValueLoadError, which is not corruption.
    """
    value = load_plain(view, fqn)
    stream = io.BytesIO()
    torch.save(value, stream)
    stream.seek(0)
    return stream


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


def wanted_boxes(state_dict: dict[str, Any]) -> tuple[dict[str, list[Box]], set[str]]:
    """What loading `state_dict` reads, as DCP's load planning sees it: the box (offsets,
    sizes) of each local tensor shard by flattened name, and the names of the other values."""
    planner = DefaultLoadPlanner()
    planner.set_up_planner(state_dict, None, False)
    boxes: dict[str, list[Box]] = {}
    values: set[str] = set()
    for fqn, value in planner.state_dict.items():
        if hasattr(value, "__create_chunk_list__"):  # DTensor, or anything planned like it
            chunks = value.__create_chunk_list__()
            boxes[fqn] = [(tuple(c.offsets), tuple(c.sizes)) for c in chunks]
        elif isinstance(value, torch.Tensor):
            boxes[fqn] = [((0,) * value.dim(), tuple(value.shape))]
        else:
            values.add(fqn)
    return boxes, values


# Raw DCP ----------------------------------------------------------------------------------------


def dcp_writer(uri: str, step: int, **storage_options: Any) -> ObjectStoreWriter:
    """A StorageWriter for ``torch.distributed.checkpoint.save`` / ``async_save`` without a
    manager: it streams each rank's objects to `uri` and commits `step` with its manifest, like
    `CheckpointManager.save` (create-only; a committed step is never overwritten)."""
    from spotckpt.storage.registry import open_store
    from spotckpt.version import __version__

    return ObjectStoreWriter(
        open_store(uri, **storage_options),
        step,
        versions={"spotckpt": __version__, "torch": torch.__version__},
    )


def dcp_reader(uri: str, step: int | None = None, **storage_options: Any) -> ObjectStoreReader:
    """A StorageReader for ``torch.distributed.checkpoint.load``: `step`, or the latest
    committed one (NoCheckpointError when there is none). Values are only ever unpickled with
    ``weights_only=True``, whatever load planner DCP is given."""
    from spotckpt.storage.registry import open_store

    catalog = Catalog(open_store(uri, **storage_options))
    return ObjectStoreReader(catalog.store, catalog.read_manifest(catalog.resolve(step)))
