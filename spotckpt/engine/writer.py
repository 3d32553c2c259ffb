"""`ObjectStoreWriter`: DCP's storage writer for any `ObjectStore`, one streamed object per rank.

DCP's call order: ``reset`` -> ``set_up_storage_writer`` -> ``prepare_local_plan`` ->
``prepare_global_plan`` (coordinator: refuses a save whose replicas disagree,
`spotckpt.engine.guards`, and a step that is already committed, draws the attempt
id, assigns each rank its object key) -> ``write_data`` (every rank streams one safetensors object
of its own items: header first, then each item's bytes, through a multipart upload with
part-sized buffers; block CRC32Cs as it goes; from `INDEX_MIN_RANKS` ranks on, also an index part
of its own) -> ``finish`` (coordinator, after every rank succeeded: builds the manifest,
`spotckpt.engine.manifests`, and commits it through the catalog, which first checks that every
object it references is there, then writes it create-only: the commit point).

With `compression` (``"on"``, or ``"auto"`` when `spotckpt.format.compression.pays_off` says so
for this rank's link), a rank writes its object without a safetensors header, its tensor chunks
(and pack members) of a block or more compressed block by block (`spotckpt.format.compression`).

A value (non-tensor state) is refused at save time unless it loads back with
``torch.load(weights_only=True)``.

An incremental save (`incremental`, one-document manifests only) first compares every tensor
chunk with the base step (the newest committed one, named by the coordinator in each rank's
assignment) and references, instead of uploading, each chunk whose bytes the base already holds
(`spotckpt.engine.incremental`); every chunk it writes is hashed too (while it uploads, when the
comparison did not need its hash), for the next save to compare with. A signing save (a keyring
with a signing key) hashes every chunk and value it writes, for reads to check
(`spotckpt.engine.chunks`), reads its base under the keyring and references only a base whose
signature verified (`spotckpt.engine.incremental.may_vouch_for`).
"""

from __future__ import annotations

import dataclasses
import io
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, StorageMeta
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItem, WriteItemType
from torch.distributed.checkpoint.storage import StorageWriter, WriteResult
from torch.futures import Future

from spotckpt.catalog import (
    Catalog,
    compressed_object_key,
    index_part_key,
    new_attempt_id,
    rank_object_key,
    step_folder,
    step_key,
)
from spotckpt.checksum import chunk_hash
from spotckpt.digest import step_digest
from spotckpt.engine.global_plan import PlanCache
from spotckpt.engine.guards import (
    Guard,
    GuardedPackingSavePlanner,
    GuardedSavePlanner,
    check_replicas,
)
from spotckpt.engine.incremental import Base, features_of, load_base, record_of, unhashed
from spotckpt.engine.manifests import (
    ManifestHeader,
    WrittenItem,
    build_manifest,
    build_root,
    index_part,
    indexed_references,
    is_indexed,
)
from spotckpt.engine.packing import PackedMember, PackingSavePlanner, members_of
from spotckpt.engine.planners import ScalingSavePlanner
from spotckpt.errors import (
    InvalidArgumentError,
    InvalidTypeError,
    SaveFailedError,
    UnsupportedValueError,
    ValueLoadError,
)
from spotckpt.format.compression import (
    COMPRESS_THREADS,
    COMPRESSION_MODES,
    MIN_CHUNK_BYTES,
    SAMPLE_BYTES,
    CompressedRange,
    CompressedStreamWriter,
    LinkRate,
    measure,
    pays_off,
)
from spotckpt.format.compression import FEATURE as COMPRESSED
from spotckpt.format.dtypes import BY_NAME, dtype_of
from spotckpt.format.features import format_string
from spotckpt.format.index import INDEXED_FORMAT
from spotckpt.format.manifest import FORMAT_VERSION, ChunkLocation, Manifest, ObjectRecord
from spotckpt.format.safetensors_io import (
    DEFAULT_BLOCK_SIZE,
    SafetensorsStreamWriter,
    StoredRange,
    TensorSpec,
    block_crcs,
    tensor_bytes,
)
from spotckpt.format.signing import Keyring, new_hasher
from spotckpt.storage.base import ObjectStore
from spotckpt.values import load_plain

VALUE_PREFIX = "__value__/"
"""Stored values (non-tensor state) are named with this prefix in a rank's safetensors header."""

INDEX_MIN_RANKS = 32
"""From this many ranks on, a save writes an indexed manifest (`spotckpt.format.index`)."""


@dataclass(frozen=True)
class RankAssignment:
    """What the coordinator tells each rank: the attempt, the key of its object, whether
    it writes an index part, and (incremental saves) the base step it may reference."""

    attempt: str
    key: str
    indexed: bool = False
    base: int | None = None


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
    async save runs the writer in a child process; the caller's copy then keeps ``manifest`` at
    None and ``attempt`` at what it was given: read the outcome back from the store). `attempt`
    is the attempt id the coordinator uses instead of drawing one, given by a caller that must
    know it without hearing back from that child (to discard the attempt after a failure).
    `incremental` references unchanged chunks of the newest committed step of job `job` (the
    root's `spotckpt.catalog.JobIdentity` id; without it every chunk is written, with hashes).
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
        attempt: str | None = None,
        incremental: bool = False,
        guard: Guard | None = None,
        keyring: Keyring | None = None,
        job: str | None = None,
        compression: str = "off",
        link: LinkRate | None = None,
    ) -> None:
        super().__init__()
        if compression not in COMPRESSION_MODES:
            raise InvalidArgumentError(
                f"compression must be one of {COMPRESSION_MODES}, got {compression!r}"
            )
        self.compression = compression
        self.link = link if link is not None else LinkRate()
        self.incremental = incremental
        self.base: Base | None = None
        self.guard = guard
        self.keyring = keyring if keyring is not None and keyring.signer is not None else None
        if self.keyring is not None and job is None:
            raise SaveFailedError(
                f"save of step {step} refused: a signing key is configured, but the root has no "
                "readable job identity (job.json) to sign the manifest for"
            )
        self.job = job
        self.index_parts = index_parts
        self.store = store
        self.catalog = Catalog(store, keyring)  # a base is read under the job's keyring
        self.step = step
        self.block_size = block_size
        self.prefix_spread = prefix_spread
        self.user_metadata = dict(user_metadata or {})
        self.versions = dict(versions or {})
        self.on_written = on_written
        self.is_coordinator = False
        self.rank = 0
        self.planned_attempt = attempt
        self.attempt: str | None = attempt
        self.manifest: Manifest | None = None
        self._stream: SafetensorsStreamWriter | CompressedStreamWriter | None = None
        self.digest: str | None = None
        """The committed step's digest (`spotckpt.digest`), for its save event."""

    def reset(self, checkpoint_id: Any = None) -> None:
        self.attempt = self.planned_attempt
        self.manifest = None
        self._stream = None
        self.digest = None

    def progress(self) -> tuple[int, int]:
        """Bytes of this rank's object written so far, and its size (0 before it starts)."""
        stream = self._stream
        return (0, 0) if stream is None else (stream.written, stream.total)

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self.is_coordinator = is_coordinator
        self.rank = int(kwargs.get("rank", 0))

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        return plan

    def save_planner(self, world_size: int, cache: PlanCache | None = None) -> SavePlanner:
        """The planner to save through this writer with: small tensors in packs
        (`spotckpt.engine.packing`), unless the save writes index parts (from `INDEX_MIN_RANKS`
        ranks), whose summaries describe DCP's items as they are; those plan at scale
        (`spotckpt.engine.planners.ScalingSavePlanner`, remembering plans in `cache`). With the
        checks of `guard` (`spotckpt.engine.guards`) active, an indexed save plans through DCP's
        own planner instead, whose local plans carry each rank's fingerprints."""
        indexed = self.index_parts
        if indexed is None:
            indexed = world_size >= INDEX_MIN_RANKS
        if self.guard is not None and self.guard.active:
            guarded = GuardedSavePlanner if indexed else GuardedPackingSavePlanner
            return guarded(self.guard)
        return ScalingSavePlanner(cache) if indexed else PackingSavePlanner()

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        if self.guard is not None and self.guard.compares_replicas:
            check_replicas(self.step, [plan.storage_data for plan in plans])
        self.check_step_free()
        attempt = self.planned_attempt or new_attempt_id()
        indexed = self.index_parts
        if indexed is None:
            indexed = len(plans) >= INDEX_MIN_RANKS
        base = None
        if self.incremental and not indexed:
            latest = self.catalog.latest()
            base = latest if latest is not None and latest < self.step else None
        return [
            dataclasses.replace(
                plan,
                storage_data=RankAssignment(
                    attempt, rank_object_key(attempt, rank, self.prefix_spread), indexed, base
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
        hashing = self.incremental and not assignment.indexed
        signing = self.keyring is not None
        self.base = (
            load_base(self.catalog, assignment.base, self.job, signing=signing) if hashing else None
        )
        compressing = self.compression != "off" and not assignment.indexed
        results = (
            self._write_object(plan.items, planner, assignment.key, hashing, compressing)
            if plan.items
            else []
        )
        if assignment.indexed and results:
            results = [self._write_index_part(results, plan.items)]
        if self.on_written is not None:
            self.on_written()
        future.set_result(results)
        return future

    def _write_object(
        self,
        items: list[WriteItem],
        planner: SavePlanner,
        key: str,
        hashing: bool,
        compressing: bool,
    ) -> list[WriteResult]:
        values = {
            item.index: _value_bytes(planner.resolve_data(item), item.index.fqn)
            for item in items
            if item.type == WriteItemType.BYTE_IO
        }
        tensors: dict[MetadataIndex, memoryview] = {}
        digests: dict[MetadataIndex, tuple[str, ...]] = {}
        reused: list[WriteResult] = []
        skipped: set[MetadataIndex] = set()
        if self.base is not None:  # compare every chunk first: what is unchanged never uploads
            for item in items:
                if item.type != WriteItemType.BYTE_IO:
                    data = tensor_bytes(_cpu_tensor(planner.resolve_data(item)))
                    found = self._unchanged(item, planner, data, digests)
                    if found is None:
                        tensors[item.index] = data
                    else:
                        reused += found
                        skipped.add(item.index)
        ordered = sorted(
            (item for item in items if item.index not in skipped),
            key=lambda i: i.type != WriteItemType.BYTE_IO,
        )
        if not ordered:
            return reused
        specs = [self._spec(item, values) for item in ordered]
        if compressing:
            compressing = self._compresses(ordered, specs, planner, values, tensors)
        if compressing:
            key = compressed_object_key(key)
        metadata = {"format": "pt", "spotckpt.step": str(self.step)}
        writer = self.store.open_writer(step_key(self.step, key))
        placed: list[tuple[MetadataIndex, ChunkLocation, PackedMember | None]] = []
        signing = self.keyring is not None  # every chunk's BLAKE3 too: reads check them
        hasher = new_hasher() if signing else None
        started = time.monotonic()
        with writer:
            stream: SafetensorsStreamWriter | CompressedStreamWriter
            if compressing:
                total = sum(spec.nbytes for spec in specs)
                stream = CompressedStreamWriter(writer, self.block_size, hasher, total=total)
            else:
                stream = SafetensorsStreamWriter(writer, specs, metadata, self.block_size, hasher)
            self._stream = stream
            try:
                for item, spec in zip(ordered, specs, strict=True):
                    data = self._bytes_of(item, planner, values, tensors)
                    members = members_of(planner, item.index.fqn)
                    pieces: list[StoredRange | CompressedRange]
                    if isinstance(stream, CompressedStreamWriter):
                        pieces = list(_write_compressing(stream, item, spec, data, members))
                    else:
                        pieces = [stream.write_tensor(spec.name, data)]
                    # While the object's last parts upload: where each item (or member) lies.
                    hashes = digests.get(item.index, ())
                    if not hashes and (signing or (hashing and item.index not in values)):
                        hashes = _hashes(data, members)
                    if members is None:
                        location = _location(key, pieces[0], hashes[0] if hashes else "")
                        placed.append((item.index, location, None))
                    elif isinstance(stream, CompressedStreamWriter):  # members stored one by one
                        for number, (member, piece) in enumerate(zip(members, pieces, strict=True)):
                            digest = hashes[number] if hashes else ""
                            index = MetadataIndex(member.fqn, torch.Size([0] * len(member.shape)))
                            placed.append((index, _location(key, piece, digest), member))
                    else:
                        placed += self._member_locations(members, pieces[0], data, key, hashes)
                size, crc = stream.finish()
            finally:
                if isinstance(stream, CompressedStreamWriter):
                    stream.close()
        if not compressing:  # a compressed upload's time says more of the codec than the link
            self.link.observe(size, time.monotonic() - started)
        strong = hasher.hexdigest() if hasher is not None else None
        record = ObjectRecord(key=key, size=size, crc32c=crc, rank=self.rank, blake3=strong)
        return reused + [
            WriteResult(index, location.length, WrittenItem(location, record, member))
            for index, location, member in placed
        ]

    def _compresses(
        self,
        ordered: list[WriteItem],
        specs: list[TensorSpec],
        planner: SavePlanner,
        values: dict[MetadataIndex, memoryview],
        resolved: dict[MetadataIndex, memoryview],
    ) -> bool:
        """Whether this rank's object holds compressed chunks: always with ``"on"``; with
        ``"auto"`` when a sample of its tensors says that compressing makes the save faster on
        the link its earlier saves measured (`spotckpt.format.compression.pays_off`)."""
        if self.compression == "on":
            return True
        if self.link.rate is None:
            return False
        samples: list[tuple[memoryview, int]] = []
        for item, spec in zip(ordered, specs, strict=True):
            if item.index in values:
                continue
            data = resolved.get(item.index)
            if data is None:
                data = resolved[item.index] = tensor_bytes(_cpu_tensor(planner.resolve_data(item)))
            members = members_of(planner, item.index.fqn)
            if members is None:
                samples.append((data, spec.dtype.itemsize))
            else:
                samples += [
                    (data[m.offset : m.offset + m.nbytes], BY_NAME[m.dtype].itemsize)
                    for m in members
                ]
            samples = [(data, size) for data, size in samples if data.nbytes >= MIN_CHUNK_BYTES]
            if sum(data.nbytes for data, _ in samples) >= SAMPLE_BYTES:
                break
        if not samples:
            return False
        ratio, rate = measure(samples, self.block_size, COMPRESS_THREADS)
        return pays_off(ratio, rate, self.link.rate)

    @staticmethod
    def _bytes_of(
        item: WriteItem,
        planner: SavePlanner,
        values: dict[MetadataIndex, memoryview],
        hashed: dict[MetadataIndex, memoryview],
    ) -> memoryview:
        """An item's bytes: a value's, a hashed tensor's (resolved once), else resolved now."""
        if item.index in values:
            return values[item.index]
        if item.index in hashed:
            return hashed.pop(item.index)
        return tensor_bytes(_cpu_tensor(planner.resolve_data(item)))

    def _unchanged(
        self,
        item: WriteItem,
        planner: SavePlanner,
        data: memoryview,
        digests: dict[MetadataIndex, tuple[str, ...]],
    ) -> list[WriteResult] | None:
        """The results that reference the base step's bytes instead of a tensor item (every
        member of a pack) when all of them are unchanged there, else None; the hashes computed
        on the way go into `digests` (the others are computed while the item uploads)."""
        base = self.base
        if base is None:
            return None
        members = members_of(planner, item.index.fqn)
        if members is None:
            tensor = item.tensor_data
            if tensor is None:
                raise InvalidTypeError(f"write item {item.index.fqn!r} has no tensor data")
            stored, digest = base.find(
                (item.index.fqn, tuple(tensor.chunk.offsets)),
                dtype_of(tensor.properties.dtype).name,
                tuple(tensor.size),
                tuple(tensor.chunk.sizes),
                data,
            )
            if digest:
                digests[item.index] = (digest,)
            if stored is None:
                return None
            written = WrittenItem(stored.location, stored.record)
            return [WriteResult(item.index, stored.location.length, written)]
        found = []
        for member in members:
            zeros = (0,) * len(member.shape)
            piece = data[member.offset : member.offset + member.nbytes]
            stored, _digest = base.find(
                (member.fqn, zeros), member.dtype, member.shape, member.shape, piece
            )
            if stored is None:
                return None
            index = MetadataIndex(member.fqn, torch.Size(zeros))
            written = WrittenItem(stored.location, stored.record, member)
            found.append(WriteResult(index, stored.location.length, written))
        return found

    def _member_locations(
        self,
        members: tuple[PackedMember, ...],
        stored: StoredRange | CompressedRange,
        data: memoryview,
        key: str,
        hashes: tuple[str, ...],
    ) -> list[tuple[MetadataIndex, ChunkLocation, PackedMember]]:
        """Where each member of a pack lies in object `key`, with its own block CRC32Cs (and
        hashes, when the save hashed them), as if it had been written alone."""
        located = []
        for number, member in enumerate(members):
            piece = data[member.offset : member.offset + member.nbytes]
            location = ChunkLocation(
                key=key,
                offset=stored.offset + member.offset,
                length=member.nbytes,
                block_crc32c=block_crcs(piece, self.block_size),
                blake3=hashes[number] if hashes else "",
            )
            index = MetadataIndex(member.fqn, torch.Size([0] * len(member.shape)))
            located.append((index, location, member))
        return located

    def _write_index_part(self, results: list[WriteResult], items: list[WriteItem]) -> WriteResult:
        """Store this rank's index part (indexed saves) and return its `RankSummary` result."""
        key = index_part_key(self.attempt or "unknown", self.rank)
        data, summary = index_part(self.header(), self.rank, results, items, key, self._seal)
        self.store.put(step_key(self.step, key), data, create_only=True)
        return summary

    def _spec(self, item: WriteItem, values: dict[MetadataIndex, memoryview]) -> TensorSpec:
        name = _item_name(item)
        if item.type == WriteItemType.BYTE_IO:
            return TensorSpec(name, BY_NAME["uint8"], (values[item.index].nbytes,))
        if item.tensor_data is None:
            raise InvalidTypeError(f"write item {item.index.fqn!r} has no tensor data")
        dtype = dtype_of(item.tensor_data.properties.dtype)
        return TensorSpec(name, dtype, tuple(item.tensor_data.chunk.sizes))

    def header(self) -> ManifestHeader:
        """What this save's manifest says of it besides objects and tensors."""
        return ManifestHeader(
            self.step, self.attempt or "unknown", self.block_size, self.versions, self.user_metadata
        )

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        """On the coordinator, after every rank wrote: commit the manifest (or indexed root)."""
        if is_indexed(results):
            summary, data = build_root(self.header(), metadata, results)
            data = self._seal(data, INDEXED_FORMAT)
            referenced = indexed_references(results)
            digest = step_digest(data, summary.objects.values())
            self.catalog.commit_bytes(self.step, summary.attempt, data, referenced)
            self.manifest, self.digest = summary, digest  # committed: nothing may undo it now
            return
        manifest = self.build_manifest(metadata, results)
        features = set()
        if self.incremental:
            manifest.incremental = record_of(manifest, self.job or "", self.base)
            features |= features_of(manifest)
        if any(location.codec for location in manifest.locations()):
            features.add(COMPRESSED)
        manifest.format = format_string(FORMAT_VERSION, features)
        if self.keyring is not None and (missing := unhashed(manifest)):
            raise SaveFailedError(
                f"save of step {self.step} refused: objects {missing[:3]} have no BLAKE3, and a "
                "signed manifest vouches only for strong hashes"
            )
        data = self.encode(manifest)
        digest = step_digest(data, manifest.objects.values())
        self.catalog.commit(manifest, data)
        self.manifest, self.digest = manifest, digest  # committed: nothing may undo it now

    def encode(self, manifest: Manifest) -> bytes:
        """The bytes of a flat manifest as this save commits it: signed when the writer has a
        signing key (`spotckpt.format.signing`)."""
        return self._seal(manifest.to_json(), FORMAT_VERSION)

    def _seal(self, data: bytes, layout: str | None = None) -> bytes:
        """`data` signed for this job when the writer signs (a manifest or root names the
        ``signed`` feature in its format: `layout`); else as it is."""
        if self.keyring is None or self.job is None:
            return data
        return self.keyring.sign(data, self.job, layout=layout)

    def build_manifest(self, metadata: Metadata, results: list[list[WriteResult]]) -> Manifest:
        """This save's manifest, from DCP's global metadata and every rank's results."""
        return build_manifest(self.header(), metadata, results)

    def storage_meta(self) -> StorageMeta | None:
        return StorageMeta(checkpoint_id=f"{self.store.uri}/{step_folder(self.step)}")

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Any) -> bool:
        return False


def _write_compressing(
    stream: CompressedStreamWriter,
    item: WriteItem,
    spec: TensorSpec,
    data: memoryview,
    members: tuple[PackedMember, ...] | None,
) -> list[CompressedRange]:
    """Store one item in a compressing rank's object: a value raw; a tensor chunk of a block or
    more compressed; a pack member by member (each compressed or raw by its own size and
    dtype), so that every member keeps a location of its own."""
    if item.type == WriteItemType.BYTE_IO:
        return [stream.write_tensor(spec.name, data)]
    if members is None:
        return [_write_piece(stream, data, spec.dtype.itemsize)]
    return [
        _write_piece(stream, data[m.offset : m.offset + m.nbytes], BY_NAME[m.dtype].itemsize)
        for m in members
    ]


def _write_piece(
    stream: CompressedStreamWriter, data: memoryview, itemsize: int
) -> CompressedRange:
    if data.nbytes >= MIN_CHUNK_BYTES:
        return stream.write_compressed(data, itemsize)
    return stream.write_tensor("", data)


def _location(key: str, stored: StoredRange | CompressedRange, digest: str) -> ChunkLocation:
    """The manifest location of bytes stored at `stored` in object `key`."""
    codec = stored.codec_fields() if isinstance(stored, CompressedRange) else {}
    return ChunkLocation(
        key=key,
        offset=stored.offset,
        length=stored.length,
        block_crc32c=stored.block_crc32c,
        blake3=digest,
        **codec,
    )


def _hashes(data: memoryview, members: tuple[PackedMember, ...] | None) -> tuple[str, ...]:
    """The hash of an item's bytes, or of each member's of a pack."""
    if members is None:
        return (chunk_hash(data),)
    return tuple(chunk_hash(data[m.offset : m.offset + m.nbytes]) for m in members)


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
