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

Each rank's object goes through transforms chosen once for it (`spotckpt.engine.transforms`):
its encoding (`WriterOptions.encodings`: raw safetensors, or, with compression, chunks of a block
or more compressed block by block in an object without a header, `spotckpt.format.encodings`),
the unchanged-chunk filter and the strong hasher; the manifest records each chunk's codec.

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
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, StorageMeta
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItem, WriteItemType
from torch.distributed.checkpoint.storage import StorageWriter, WriteResult
from torch.futures import Future

from spotckpt.catalog import Catalog
from spotckpt.digest import step_digest
from spotckpt.engine.cancel import CancellableWriter, Cancellation
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
from spotckpt.engine.transforms import (
    ChunkHashing,
    EncodingChoice,
    ObjectTransforms,
    Unchanged,
    UnchangedFilter,
    resolved_bytes,
)
from spotckpt.errors import (
    InvalidTypeError,
    SaveFailedError,
    UnsupportedValueError,
    ValueLoadError,
)
from spotckpt.format.compression import Compression
from spotckpt.format.dtypes import BY_NAME, dtype_of
from spotckpt.format.encodings import Encoding, ObjectStream
from spotckpt.format.features import format_string
from spotckpt.format.index import INDEXED_FORMAT
from spotckpt.format.manifest import FORMAT_VERSION, ChunkLocation, Manifest, ObjectRecord
from spotckpt.format.safetensors_io import DEFAULT_BLOCK_SIZE, StoredRange, TensorSpec
from spotckpt.format.signing import Keyring
from spotckpt.layout import (
    compressed_object_key,
    index_part_key,
    new_attempt_id,
    rank_object_key,
    step_folder,
    step_key,
)
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


@dataclass(frozen=True)
class _Object:
    """One rank's object to upload: its key, its items in order (and their header entries),
    where their bytes come from, and what the unchanged-chunk filter made of them."""

    key: str
    items: list[WriteItem]
    specs: list[TensorSpec]
    planner: SavePlanner
    values: dict[MetadataIndex, memoryview]
    unchanged: Unchanged


_Placed = tuple[MetadataIndex, ChunkLocation, PackedMember | None]
"""Where one item (or member of a pack) lies."""


def _item_name(item: WriteItem) -> str:
    if item.type == WriteItemType.BYTE_IO:
        return VALUE_PREFIX + item.index.fqn
    offsets = item.tensor_data.chunk.offsets if item.tensor_data else ()
    if any(offsets):
        return f"{item.index.fqn}@{','.join(map(str, offsets))}"
    return item.index.fqn


@dataclass(frozen=True)
class WriterOptions:
    """How `ObjectStoreWriter` writes a step, besides its store and step number.

    `attempt` is the attempt id the coordinator uses instead of drawing one, given by a caller
    that must know it without hearing back from a child process (to discard the attempt after a
    failure). `incremental` references unchanged chunks of the newest committed step of job
    `job` (the root's `spotckpt.catalog.JobIdentity` id; without it every chunk is written, with
    hashes). `encodings` picks each object's encoding (`spotckpt.engine.transforms`; by default
    `spotckpt.format.compression.Compression` ``"off"``: raw). `index_parts` forces (or, False,
    prevents) index parts; None: from `INDEX_MIN_RANKS` ranks on.
    """

    block_size: int = DEFAULT_BLOCK_SIZE
    prefix_spread: bool = False
    user_metadata: dict[str, Any] | None = None
    versions: dict[str, str] | None = None
    on_written: Callable[[], None] | None = None
    index_parts: bool | None = None
    attempt: str | None = None
    incremental: bool = False
    guard: Guard | None = None
    keyring: Keyring | None = None
    job: str | None = None
    encodings: EncodingChoice = field(default_factory=Compression)
    overwrite: bool = False
    """Replace the step's manifest when it is committed already (`Catalog.commit_bytes`):
    DCP's own writers overwrite; the manager never does."""


class ObjectStoreWriter(StorageWriter):
    """Writes one checkpoint step into `store` through DCP, as `options` say; see the module
    docstring.

    It pickles with its store, which rebuilds itself where it is unpickled (DCP's process-mode
    async save runs the writer in a child process; the caller's copy then keeps ``manifest`` at
    None and ``attempt`` at what it was given: read the outcome back from the store).
    """

    def __init__(self, store: ObjectStore, step: int, options: WriterOptions | None = None) -> None:
        super().__init__()
        options = options if options is not None else WriterOptions()
        keyring = options.keyring
        self.keyring = keyring if keyring is not None and keyring.signer is not None else None
        if self.keyring is not None and options.job is None:
            raise SaveFailedError(
                f"save of step {step} refused: a signing key is configured, but the root has no "
                "readable job identity (job.json) to sign the manifest for"
            )
        self.encodings = options.encodings
        self.incremental = options.incremental
        self.base: Base | None = None
        self.guard = options.guard
        self.job = options.job
        self.index_parts = options.index_parts
        self.overwrite = options.overwrite
        self.store = store
        self.catalog = Catalog(store, keyring)  # a base is read under the job's keyring
        self.step = step
        self.block_size = options.block_size
        self.prefix_spread = options.prefix_spread
        self.user_metadata = dict(options.user_metadata or {})
        self.versions = dict(options.versions or {})
        self.on_written = options.on_written
        self.is_coordinator = False
        self.rank = 0
        self.planned_attempt = options.attempt
        self.attempt: str | None = options.attempt
        self.manifest: Manifest | None = None
        self._stream: ObjectStream | None = None
        self.digest: str | None = None
        """The committed step's digest (`spotckpt.digest`), for its save event."""
        self.manifest_data: bytes | None = None
        """The committed manifest's (or indexed root's) bytes, for retention's reading."""
        self.cancellation = Cancellation()
        """Set at a notice that leaves this save no time: its next write raises."""

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
        is committed in the store (a committed checkpoint is never overwritten, unless the
        writer was built to overwrite it)."""
        if not self.overwrite:
            self.catalog.check_not_committed(self.step)

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        future: Future[list[WriteResult]] = Future()
        assignment = plan.storage_data
        if not isinstance(assignment, RankAssignment):
            raise InvalidTypeError(
                "ObjectStoreWriter.write_data needs a plan from prepare_global_plan"
            )
        self.attempt = assignment.attempt
        transforms = self._transforms(assignment)
        results = (
            self._write_object(plan.items, planner, assignment.key, transforms)
            if plan.items
            else []
        )
        if assignment.indexed and results:
            results = [self._write_index_part(results, plan.items)]
        if self.on_written is not None:
            self.on_written()
        future.set_result(results)
        return future

    def _transforms(self, assignment: RankAssignment) -> ObjectTransforms:
        """This rank's object's transforms (`spotckpt.engine.transforms`): an incremental save
        (one-document manifests only) compares with its base; an indexed one stores raw."""
        hashing = self.incremental and not assignment.indexed
        signing = self.keyring is not None
        self.base = (
            load_base(self.catalog, assignment.base, self.job, signing=signing) if hashing else None
        )
        return ObjectTransforms(
            self.encodings,
            None if self.base is None else UnchangedFilter(self.base),
            ChunkHashing(signing=signing, chunks=hashing),
            encodable=not assignment.indexed,
        )

    def _write_object(
        self,
        items: list[WriteItem],
        planner: SavePlanner,
        key: str,
        transforms: ObjectTransforms,
    ) -> list[WriteResult]:
        values = {
            item.index: _value_bytes(planner.resolve_data(item), item.index.fqn)
            for item in items
            if item.type == WriteItemType.BYTE_IO
        }
        unchanged = transforms.split(items, planner)
        ordered = sorted(
            (item for item in items if item.index not in unchanged.skipped),
            key=lambda i: i.type != WriteItemType.BYTE_IO,
        )
        if not ordered:
            return unchanged.reused
        specs = [self._spec(item, values) for item in ordered]
        samples = _samples(ordered, specs, planner, values, unchanged.resolved)
        encoding = transforms.encoding(samples, self.block_size)
        if not encoding.plain:
            key = compressed_object_key(key)
        written = _Object(key, ordered, specs, planner, values, unchanged)
        placed, record = self._upload(written, encoding, transforms)
        return unchanged.reused + [
            WriteResult(index, location.length, WrittenItem(location, record, member))
            for index, location, member in placed
        ]

    def _upload(
        self, written: _Object, encoding: Encoding, transforms: ObjectTransforms
    ) -> tuple[list[_Placed], ObjectRecord]:
        """Stream the object's items through `encoding`; where each item (or member) lies, and
        the object's record."""
        metadata = {"format": "pt", "spotckpt.step": str(self.step)}
        writer = CancellableWriter(
            self.store.open_writer(step_key(self.step, written.key)), self.cancellation, self.step
        )
        hasher = transforms.hashing.object_hasher()
        placed: list[_Placed] = []
        started = time.monotonic()
        with writer:
            stream = encoding.open(writer, written.specs, metadata, self.block_size, hasher)
            self._stream = stream
            try:
                for item, spec in zip(written.items, written.specs, strict=True):
                    placed += self._place(stream, written, item, spec, transforms.hashing)
                size, crc = stream.finish()
            finally:
                stream.close()
        transforms.uploaded(encoding, size, time.monotonic() - started)
        strong = hasher.hexdigest() if hasher is not None else None
        record = ObjectRecord(key=written.key, size=size, crc32c=crc, rank=self.rank, blake3=strong)
        return placed, record

    @staticmethod
    def _place(
        stream: ObjectStream,
        written: _Object,
        item: WriteItem,
        spec: TensorSpec,
        hashing: ChunkHashing,
    ) -> list[_Placed]:
        """Store one item (a value, a tensor chunk or a pack of small tensors); where it (each
        member of a pack) lies, with the hashes the save keeps."""
        value = item.index in written.values
        data = _bytes_of(item, written.planner, written.values, written.unchanged.resolved)
        members = members_of(written.planner, item.index.fqn)
        pieces: list[StoredRange]
        if value:
            pieces = [stream.write_value(spec.name, data)]
        elif members is None:
            pieces = [stream.write_chunk(spec.name, data, spec.dtype.itemsize)]
        else:
            parts = [(m.offset, m.nbytes, BY_NAME[m.dtype].itemsize) for m in members]
            pieces = stream.write_members(spec.name, data, parts)
        # While the object's last parts upload: where each item (or member) lies.
        hashes = written.unchanged.digests.get(item.index, ()) or hashing.of(data, members, value)
        if members is None:
            return [(item.index, _location(written.key, pieces[0], hashes), None)]
        return [
            (
                MetadataIndex(member.fqn, torch.Size([0] * len(member.shape))),
                _location(written.key, piece, hashes[number : number + 1]),
                member,
            )
            for number, (member, piece) in enumerate(zip(members, pieces, strict=True))
        ]

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
            self.catalog.commit_bytes(
                self.step, summary.attempt, data, referenced, overwrite=self.overwrite
            )
            self.manifest, self.digest = summary, digest  # committed: nothing may undo it now
            self.manifest_data = data
            return
        manifest = self.build_manifest(metadata, results)  # its format names how it stores
        if self.incremental:
            manifest.incremental = record_of(manifest, self.job or "", self.base)
            features = manifest.features | features_of(manifest)
            manifest.format = format_string(FORMAT_VERSION, features)
        if self.keyring is not None and (missing := unhashed(manifest)):
            raise SaveFailedError(
                f"save of step {self.step} refused: objects {missing[:3]} have no BLAKE3, and a "
                "signed manifest vouches only for strong hashes"
            )
        data = self.encode(manifest)
        digest = step_digest(data, manifest.objects.values())
        self.catalog.commit(manifest, data, overwrite=self.overwrite)
        self.manifest, self.digest = manifest, digest  # committed: nothing may undo it now
        self.manifest_data = data

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


def _location(key: str, stored: StoredRange, hashes: tuple[str, ...]) -> ChunkLocation:
    """The manifest location of bytes stored at `stored` in object `key`, with their hash."""
    return ChunkLocation(
        key=key,
        offset=stored.offset,
        length=stored.length,
        block_crc32c=stored.block_crc32c,
        blake3=hashes[0] if hashes else "",
        **stored.codec_fields(),
    )


def _bytes_of(
    item: WriteItem,
    planner: SavePlanner,
    values: dict[MetadataIndex, memoryview],
    resolved: dict[MetadataIndex, memoryview],
) -> memoryview:
    """An item's bytes: a value's, a tensor's resolved earlier (once), else resolved now."""
    if item.index in values:
        return values[item.index]
    if item.index in resolved:
        return resolved.pop(item.index)
    return resolved_bytes(planner, item)


def _samples(
    items: list[WriteItem],
    specs: list[TensorSpec],
    planner: SavePlanner,
    values: dict[MetadataIndex, memoryview],
    resolved: dict[MetadataIndex, memoryview],
) -> Iterator[tuple[memoryview, int]]:
    """The object's tensor bytes (each member of a pack on its own) with their element sizes,
    resolved as they are asked for, and kept in `resolved` for the upload."""
    for item, spec in zip(items, specs, strict=True):
        if item.index in values:
            continue
        data = resolved.get(item.index)
        if data is None:
            data = resolved[item.index] = resolved_bytes(planner, item)
        members = members_of(planner, item.index.fqn)
        if members is None:
            yield data, spec.dtype.itemsize
        else:
            for m in members:
                yield data[m.offset : m.offset + m.nbytes], BY_NAME[m.dtype].itemsize


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
