"""Standard DCP checkpoints: the ``.metadata`` + ``.distcp`` folders that DCP's own writers
(``FileSystemWriter``, ``FsspecWriter``), s3torchconnector's ``S3StorageWriter`` and
``torch_save_to_dcp`` leave, read from any `ObjectStore` without trusting their pickles.

A team that checkpointed a run with DCP switches to spotckpt by reading those folders where they
are (`StandardDcpReader`, ``dcp.load``) or by importing them (`spotckpt.dcp_convert`).

- ``.metadata`` is a pickle, read by `spotckpt.engine.dcp_metadata` without ever handing it a
  real class or function, and checked before anything else is read.
- Each item of a ``.distcp`` object is a ``torch.save`` blob (a tensor chunk) or the raw bytes of
  a pickled value. When the checkpoint is opened, every object an item lies in must exist and
  hold the item's whole range (standard checkpoints carry no CRCs: sizes are what can be
  verified), each chunk's item must be at least as long as the chunk's data, and a tensor's
  chunks must hold exactly its elements: what a read allocates is bounded by the stored bytes.
  A tensor item is a ``torch.save`` zip whose records must all be stored uncompressed and fit
  in the item (a deflated record would inflate past the stored bytes); it loads with
  ``torch.load(weights_only=True)`` and must have the dtype and shape the metadata gives.
  Values are unpickled only with ``weights_only=True`` as well.
- Items written through a DCP stream extension (``_extensions``, such as ZStandard) carry
  ``transform_descriptors``; they are refused with a message, as their decoders would run code
  named by the checkpoint.
"""

from __future__ import annotations

import io
import re
import zipfile
from concurrent.futures import Future as PoolFuture
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.distributed.checkpoint.storage import StorageReader
from torch.futures import Future

from spotckpt.engine.dcp_metadata import METADATA_NAME, read_standard_metadata
from spotckpt.engine.reader import safe_value_stream
from spotckpt.errors import (
    CorruptCheckpointError,
    ObjectMissingError,
    ObjectSizeError,
)
from spotckpt.layout import STEP_PREFIX
from spotckpt.storage.base import ObjectStore, join_key

PARALLEL_READS = 8
"""Items fetched at the same time (each is held in memory until it is loaded)."""


@dataclass(frozen=True)
class Item:
    """One stored item of a standard checkpoint: what a read of it returns and checks."""

    index: MetadataIndex
    stored: _StorageInfo
    chunk: ChunkStorageMetadata | None
    """The tensor chunk the item holds; None for a pickled value."""
    dtype: torch.dtype | None


class StandardCheckpoint:
    """One standard DCP checkpoint in `folder` of `store`, checked and read item by item."""

    def __init__(
        self, store: ObjectStore, folder: str = "", metadata: Metadata | None = None
    ) -> None:
        """Read and check the metadata, and check every object's size; or take `metadata` as
        another rank read and checked it (with the objects: `spotckpt.restore` opens it on the
        coordinator and hands the others what it found)."""
        self.store = store
        self.folder = folder
        self.metadata = read_standard_metadata(store, folder) if metadata is None else metadata
        self._chunks: dict[tuple[str, tuple[int, ...]], ChunkStorageMetadata] = {
            (fqn, tuple(chunk.offsets)): chunk
            for fqn, entry in self.metadata.state_dict_metadata.items()
            if isinstance(entry, TensorStorageMetadata)
            for chunk in entry.chunks
        }
        # Every object must hold its items' ranges before anything is allocated for them: a
        # tensor's chunks then hold no more data than the objects do. Once, when it opens.
        if metadata is None:
            self._check_objects()

    @property
    def uri(self) -> str:
        """Where the checkpoint is, for messages."""
        base = self.store.uri.rstrip("/")
        return f"{base}/{self.folder}" if self.folder else base

    def key(self, relative_path: str) -> str:
        """The store key of an object the metadata names."""
        return join_key(self.folder, relative_path) if self.folder else relative_path

    def item(self, index: MetadataIndex) -> Item:
        """The stored item at `index` (a ReadItem's ``storage_index``)."""
        stored = self.metadata.storage_data.get(index)
        if stored is None:
            raise CorruptCheckpointError(f"{self.uri}: no stored item for {index.fqn!r}")
        entry = self.metadata.state_dict_metadata.get(index.fqn)
        if isinstance(entry, TensorStorageMetadata):
            chunk = self._chunks.get((index.fqn, tuple(index.offset or ())))
            return Item(index, stored, chunk, entry.properties.dtype)
        return Item(index, stored, None, None)

    def _check_objects(self) -> None:
        """ObjectMissingError / ObjectSizeError unless every object an item lies in exists and
        holds the items' whole ranges (one HEAD per object)."""
        ends: dict[str, int] = {}
        for stored in self.metadata.storage_data.values():
            path = stored.relative_path
            ends[path] = max(ends.get(path, 0), stored.offset + stored.length)
        for path, end in ends.items():
            key = self.key(path)
            info = self.store.head(key)
            if info is None:
                raise ObjectMissingError(f"{self.uri}: object {path!r} of the checkpoint is gone")
            if info.size < end:
                raise ObjectSizeError(
                    f"{self.uri}: object {path!r} is {info.size} bytes; its items reach {end}"
                )

    def read(self, item: Item) -> torch.Tensor | bytes:
        """The item's tensor chunk (dtype and shape checked), or a pickled value's raw bytes."""
        data = self.store.get_range(
            self.key(item.stored.relative_path), item.stored.offset, item.stored.length
        )
        if len(data) != item.stored.length:
            raise ObjectSizeError(
                f"{self.uri}: {item.index.fqn!r} read {len(data)} bytes of {item.stored.length}"
            )
        if item.chunk is None:
            return data
        _check_stored(data, f"{self.uri}: {item.index.fqn!r}")
        try:
            tensor = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
        except Exception as error:
            raise CorruptCheckpointError(
                f"{self.uri}: {item.index.fqn!r} does not load with torch.load(weights_only=True): "
                f"{type(error).__name__}"
            ) from None
        if (
            not isinstance(tensor, torch.Tensor)
            or tensor.dtype != item.dtype
            or tuple(tensor.shape) != tuple(item.chunk.sizes)
        ):
            got = (
                f"{tensor.dtype} {tuple(tensor.shape)}"
                if isinstance(tensor, torch.Tensor)
                else type(tensor).__name__
            )
            raise CorruptCheckpointError(
                f"{self.uri}: {item.index.fqn!r} holds {got}, where the metadata says "
                f"{item.dtype} {tuple(item.chunk.sizes)}"
            )
        return tensor


def _check_stored(data: bytes, what: str) -> None:
    """CorruptCheckpointError unless `data` is a zip whose records are all stored (not
    deflated) and together no longer than `data`: ``torch.save`` writes them so, and a
    deflated record could make ``torch.load`` allocate far more than was read."""
    try:
        with zipfile.ZipFile(io.BytesIO(data)) as archive:
            records = archive.infolist()
    except (zipfile.BadZipFile, ValueError, EOFError) as error:
        if data[8:9] == b"{":  # a safetensors header's length, then its JSON
            raise CorruptCheckpointError(
                f"{what} was written with serialization_format=SAFETENSORS, which spotckpt does "
                "not read (nor does DCP's own FileSystemReader): save with the default format"
            ) from None
        raise CorruptCheckpointError(f"{what} is not a torch.save item: {error}") from None
    if any(r.compress_type != zipfile.ZIP_STORED for r in records) or sum(
        r.file_size for r in records
    ) > len(data):
        raise CorruptCheckpointError(
            f"{what} holds compressed records or more bytes than it is long; torch.save writes "
            "neither"
        )


class StandardDcpReader(StorageReader):
    """A StorageReader for ``dcp.load`` of a standard DCP checkpoint in any `ObjectStore` (see
    the module docstring); what `spotckpt.dcp_reader` returns for such a folder."""

    def __init__(self, checkpoint: StandardCheckpoint) -> None:
        super().__init__()
        self.checkpoint = checkpoint

    def reset(self, checkpoint_id: Any = None) -> None:
        return None

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        metadata = self.checkpoint.metadata
        if metadata.storage_meta is None:
            metadata.storage_meta = StorageMeta()
        return metadata

    def set_up_storage_reader(
        self, metadata: Metadata, is_coordinator: bool, *a: Any, **k: Any
    ) -> None:
        return None

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Any) -> bool:
        return False

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        """Read the plan's items, `PARALLEL_READS` at a time, in offset order per object."""
        checkpoint = self.checkpoint
        wanted = {id(r): checkpoint.item(r.storage_index) for r in plan.items}
        requests = sorted(
            plan.items,
            key=lambda r: (wanted[id(r)].stored.relative_path, wanted[id(r)].stored.offset),
        )
        with ThreadPoolExecutor(PARALLEL_READS, thread_name_prefix="spotckpt-dcp-read") as pool:
            pending: list[tuple[ReadItem, PoolFuture[torch.Tensor | bytes]]] = []
            for request in requests:
                pending.append((request, pool.submit(checkpoint.read, wanted[id(request)])))
                if len(pending) >= PARALLEL_READS:
                    _deliver(*pending.pop(0), planner)
            for request, future in pending:
                _deliver(request, future, planner)
        done: Future[None] = Future()
        done.set_result(None)
        return done


def _deliver(
    request: ReadItem, future: PoolFuture[torch.Tensor | bytes], planner: LoadPlanner
) -> None:
    """Hand one read item to the planner (values only after the restricted unpickler)."""
    found = future.result()
    if request.type == LoadItemType.BYTE_IO:
        if isinstance(found, torch.Tensor):
            raise CorruptCheckpointError(f"{request.dest_index.fqn!r} is stored as a tensor")
        planner.load_bytes(request, safe_value_stream(memoryview(found), request.dest_index.fqn))
        return
    if not isinstance(found, torch.Tensor):
        raise CorruptCheckpointError(f"{request.dest_index.fqn!r} is stored as a value")
    piece = found
    for dim, (start, length) in enumerate(
        zip(request.storage_offsets, request.lengths, strict=True)
    ):
        piece = piece.narrow(dim, start, length)
    target = planner.resolve_tensor(request).detach()
    if target.size() != piece.size():
        raise CorruptCheckpointError(
            f"{request.dest_index.fqn!r}: {tuple(piece.size())} read for "
            f"{tuple(target.size())} wanted"
        )
    target.copy_(piece)
    planner.commit_tensor(request, target)


def is_standard_checkpoint(store: ObjectStore, folder: str = "") -> bool:
    """Whether `folder` of `store` holds a standard DCP checkpoint's metadata."""
    return store.exists(join_key(folder, METADATA_NAME) if folder else METADATA_NAME)


STANDARD_STEP = re.compile(r"step-([0-9]{1,18})")
"""A folder of a root holding standard DCP checkpoints by step: ``step-<N>/`` (torchtitan's
naming, any zero padding; spotckpt's own padded folder is one spelling of it)."""


def find_standard(store: ObjectStore, step: int | None) -> str | None:
    """The folder of `store` holding the standard DCP checkpoint of `step`: the root itself when
    it is one (`step` None), else ``step-<N>/`` (the newest such folder for `step` None); None
    when there is none."""
    if step is None and is_standard_checkpoint(store):
        return ""
    found: dict[int, list[str]] = {}
    for prefix in store.list_delimited(STEP_PREFIX, "/").prefixes:
        match = STANDARD_STEP.fullmatch(prefix[:-1])
        if match is not None and (step is None or int(match.group(1)) == step):
            found.setdefault(int(match.group(1)), []).append(prefix[:-1])
    for number in sorted(found, reverse=True):
        for folder in found[number]:  # every spelling: spotckpt's own folder may hold no DCP
            if is_standard_checkpoint(store, folder):
                return folder
    return None
