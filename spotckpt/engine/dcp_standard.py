"""Standard DCP checkpoints: the ``.metadata`` + ``.distcp`` folders that DCP's own writers
(``FileSystemWriter``, ``FsspecWriter``), s3torchconnector's ``S3StorageWriter`` and
``torch_save_to_dcp`` leave, read from any `ObjectStore` without trusting their pickles.

A team that checkpointed a run with DCP switches to spotckpt by reading those folders where they
are (`StandardDcpReader`, ``dcp.load``) or by importing them (`spotckpt.dcp_convert`).

- ``.metadata`` is a pickle. `read_standard_metadata` reads it (its size bounded first) with an
  unpickler that admits DCP's metadata classes, torch's dtypes and sizes, paths and plain
  containers, and nothing else: a pickle that names any other global (``os.system``,
  ``builtins.eval``...) is refused before anything is called, with `CorruptCheckpointError`.
  What it describes is then checked (`_check_metadata`): types, every chunk inside its tensor,
  every item's object key valid and its range non-negative.
- Each item of a ``.distcp`` object is a ``torch.save`` blob (a tensor chunk) or the raw bytes of
  a pickled value. When the checkpoint is opened, every object an item lies in must exist and
  hold the item's whole range (standard checkpoints carry no CRCs: sizes are what can be
  verified), each chunk's item must be at least as long as the chunk's data, and a tensor's
  chunks must hold exactly its elements: what a read allocates is bounded by the stored bytes.
  Tensors load with ``torch.load(weights_only=True)`` and must have the dtype and shape the
  metadata gives; values are unpickled only with ``weights_only=True`` as well.
- Items written through a DCP stream extension (``_extensions``, such as ZStandard) carry
  ``transform_descriptors``; they are refused with a message, as their decoders would run code
  named by the checkpoint.
"""

from __future__ import annotations

import io
import math
import pickle
import re
from collections.abc import Callable, Iterator
from concurrent.futures import Future as PoolFuture
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.distributed.checkpoint.storage import StorageReader
from torch.futures import Future

from spotckpt.engine.reader import safe_value_stream
from spotckpt.errors import (
    CorruptCheckpointError,
    InvalidKeyError,
    ObjectMissingError,
    ObjectSizeError,
)
from spotckpt.layout import STEP_PREFIX
from spotckpt.storage.base import ObjectStore, check_key, join_key

METADATA_NAME = ".metadata"
"""The object that makes a folder a standard DCP checkpoint (written last by DCP's writers)."""
MAX_METADATA_BYTES = 512 << 20
"""The largest ``.metadata`` read: far above what a checkpoint of a million tensors needs."""
PARALLEL_READS = 8
"""Items fetched at the same time (each is held in memory until it is loaded)."""

_METADATA_MODULE = "torch.distributed.checkpoint.metadata"
_ADMITTED: frozenset[tuple[str, str]] = frozenset(
    {
        *(
            (_METADATA_MODULE, name)
            for name in (
                "Metadata",
                "MetadataIndex",
                "StorageMeta",
                "TensorProperties",
                "TensorStorageMetadata",
                "BytesStorageMetadata",
                "ChunkStorageMetadata",
                "_MEM_FORMAT_ENCODING",
            )
        ),
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
        ("torch", "Size"),
        ("torch.serialization", "_get_layout"),
        ("collections", "OrderedDict"),
        *(("pathlib", name) for name in ("PosixPath", "WindowsPath", "PurePosixPath")),
        ("pathlib", "PureWindowsPath"),
    }
)
"""The globals a DCP ``.metadata`` pickle may name (besides torch's dtypes): classes whose
construction from pickled fields runs no code of the pickle's choosing."""


class _MetadataUnpickler(pickle.Unpickler):
    """An unpickler that resolves only `_ADMITTED` globals and torch's dtypes."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _ADMITTED:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"it names {module}.{name}, which a DCP metadata never does")

    def persistent_load(self, pid: Any) -> Any:
        raise pickle.UnpicklingError("it holds a persistent id, which a DCP metadata never does")


def read_standard_metadata(store: ObjectStore, folder: str = "") -> Metadata:
    """The checked metadata of the standard DCP checkpoint in `folder` of `store`
    (ObjectNotFoundError when it has none; CorruptCheckpointError when it is unsafe or
    malformed)."""
    key = join_key(folder, METADATA_NAME) if folder else METADATA_NAME
    where = f"{store.uri.rstrip('/')}/{key}"
    info = store.head(key)
    if info is None:
        raise ObjectMissingError(f"{where}: no DCP metadata there")
    if info.size > MAX_METADATA_BYTES:
        raise ObjectSizeError(
            f"{where} is {info.size} bytes, more than the {MAX_METADATA_BYTES} a DCP metadata "
            "may be: refused unread"
        )
    data = store.get_range(key, 0, info.size)
    try:
        metadata = _MetadataUnpickler(io.BytesIO(data)).load()
    except Exception as error:  # a malformed pickle raises anything from any class it built
        raise CorruptCheckpointError(
            f"{where} is refused as a DCP metadata: {type(error).__name__}: {error}"
        ) from None
    _check_metadata(metadata, where)
    return metadata


def _check_metadata(metadata: Any, where: str) -> None:
    """CorruptCheckpointError unless `metadata` is what DCP's writers write: typed entries, chunks
    inside their tensors, and a stored item for every chunk and value. A pickle may build an
    admitted class with any fields, or none: a field that is missing or of another type is a
    refusal too."""

    def refuse(why: str) -> CorruptCheckpointError:
        return CorruptCheckpointError(f"{where} is refused as a DCP metadata: {why}")

    try:
        _check_fields(metadata, refuse)
    except (AttributeError, TypeError, ValueError) as error:
        raise refuse(f"it is malformed ({type(error).__name__}: {error})") from None


def _check_fields(metadata: Any, refuse: Callable[[str], CorruptCheckpointError]) -> None:
    if not isinstance(metadata, Metadata):
        raise refuse(f"it holds a {type(metadata).__name__}, not a Metadata")
    if not isinstance(metadata.state_dict_metadata, dict) or not isinstance(
        metadata.storage_data, dict
    ):
        raise refuse("its entries or its storage data are not dicts")
    for index, stored in metadata.storage_data.items():
        if not isinstance(index, MetadataIndex) or not isinstance(stored, _StorageInfo):
            raise refuse(f"storage data entry {index!r} is not a MetadataIndex: _StorageInfo")
        if not _natural(stored.offset) or not _natural(stored.length):
            raise refuse(f"{index.fqn!r} has offset {stored.offset!r}, length {stored.length!r}")
        try:
            check_key(stored.relative_path)
        except InvalidKeyError as error:
            raise refuse(f"{index.fqn!r}: {error}") from None
        if stored.transform_descriptors:
            raise refuse(
                f"{index.fqn!r} was written through DCP stream extensions "
                f"{list(stored.transform_descriptors)!r}, which spotckpt does not run; load it "
                "with DCP's own reader and save it again without _extensions"
            )
    for fqn, entry in metadata.state_dict_metadata.items():
        if not isinstance(fqn, str):
            raise refuse(f"entry {fqn!r} is not named by a string")
        if isinstance(entry, BytesStorageMetadata):
            if MetadataIndex(fqn) not in metadata.storage_data:
                raise refuse(f"value {fqn!r} has no stored item")
            continue
        if not isinstance(entry, TensorStorageMetadata):
            raise refuse(f"{fqn!r} is a {type(entry).__name__}")
        _check_tensor(fqn, entry, metadata.storage_data, refuse)


def _check_tensor(
    fqn: str,
    entry: TensorStorageMetadata,
    stored: dict[Any, Any],
    refuse: Callable[[str], CorruptCheckpointError],
) -> None:
    if not isinstance(entry.properties, TensorProperties) or not isinstance(
        entry.properties.dtype, torch.dtype
    ):
        raise refuse(f"tensor {fqn!r} has no dtype")
    size = tuple(entry.size)
    if not all(_natural(n) for n in size):
        raise refuse(f"tensor {fqn!r} has size {size!r}")
    if not isinstance(entry.chunks, list):
        raise refuse(f"tensor {fqn!r} has no list of chunks")
    itemsize = entry.properties.dtype.itemsize
    covered = 0
    for chunk in entry.chunks:
        if not isinstance(chunk, ChunkStorageMetadata):
            raise refuse(f"tensor {fqn!r} has a chunk of type {type(chunk).__name__}")
        offsets, sizes = tuple(chunk.offsets), tuple(chunk.sizes)
        if len(offsets) != len(size) or len(sizes) != len(size):
            raise refuse(f"tensor {fqn!r}: chunk at {offsets!r} has another rank than {size!r}")
        if not all(
            _natural(o) and _natural(n) and o + n <= whole
            for o, n, whole in zip(offsets, sizes, size, strict=True)
        ):
            raise refuse(f"tensor {fqn!r}: chunk {offsets!r}+{sizes!r} lies outside {size!r}")
        item = stored.get(MetadataIndex(fqn, chunk.offsets))
        if item is None:
            raise refuse(f"tensor {fqn!r}: chunk at {offsets!r} has no stored item")
        volume = math.prod(sizes)
        if item.length < volume * itemsize:  # the stored bytes bound what a read allocates
            raise refuse(
                f"tensor {fqn!r}: chunk at {offsets!r} holds {volume * itemsize} bytes of data "
                f"in an item of {item.length}"
            )
        covered += volume
    if covered != math.prod(size):
        raise refuse(f"tensor {fqn!r}: its chunks hold {covered} elements of its {math.prod(size)}")


def _natural(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


@dataclass(frozen=True)
class Item:
    """One stored item of a standard checkpoint: what a read of it returns and checks."""

    index: MetadataIndex
    fqn: str
    stored: _StorageInfo
    chunk: ChunkStorageMetadata | None
    """The tensor chunk the item holds; None for a pickled value."""
    dtype: torch.dtype | None


class StandardCheckpoint:
    """One standard DCP checkpoint in `folder` of `store`, checked and read item by item."""

    def __init__(self, store: ObjectStore, folder: str = "") -> None:
        self.store = store
        self.folder = folder
        self.metadata = read_standard_metadata(store, folder)
        self._checked: set[str] = set()
        # Every object must hold its items' ranges before anything is allocated for them: a
        # tensor's chunks then hold no more data than the objects do.
        self.check_objects(list(self.items()))

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
            chunk = next(
                (c for c in entry.chunks if tuple(c.offsets) == tuple(index.offset or ())), None
            )
            return Item(index, index.fqn, stored, chunk, entry.properties.dtype)
        return Item(index, index.fqn, stored, None, None)

    def items(self) -> Iterator[Item]:
        """Every stored item, value by value and chunk by chunk."""
        for index in self.metadata.storage_data:
            yield self.item(index)

    def check_objects(self, items: list[Item]) -> None:
        """ObjectMissingError / ObjectSizeError unless every object `items` lie in exists and
        holds their whole ranges (checked once per object, before any item is read)."""
        ends: dict[str, int] = {}
        for item in items:
            path = item.stored.relative_path
            ends[path] = max(ends.get(path, 0), item.stored.offset + item.stored.length)
        for path, end in ends.items():
            if path in self._checked:
                continue
            key = self.key(path)
            info = self.store.head(key)
            if info is None:
                raise ObjectMissingError(f"{self.uri}: object {path!r} of the checkpoint is gone")
            if info.size < end:
                raise ObjectSizeError(
                    f"{self.uri}: object {path!r} is {info.size} bytes; its items reach {end}"
                )
        self._checked.update(ends)

    def read(self, item: Item) -> torch.Tensor | bytes:
        """The item's tensor chunk (dtype and shape checked), or a pickled value's raw bytes."""
        data = self.store.get_range(
            self.key(item.stored.relative_path), item.stored.offset, item.stored.length
        )
        if len(data) != item.stored.length:
            raise ObjectSizeError(
                f"{self.uri}: {item.fqn!r} read {len(data)} bytes of {item.stored.length}"
            )
        if item.chunk is None:
            return data
        try:
            tensor = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
        except Exception as error:
            raise CorruptCheckpointError(
                f"{self.uri}: {item.fqn!r} does not load with torch.load(weights_only=True): "
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
                f"{self.uri}: {item.fqn!r} holds {got}, where the metadata says "
                f"{item.dtype} {tuple(item.chunk.sizes)}"
            )
        return tensor


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
        requests = sorted(
            plan.items,
            key=lambda r: (
                checkpoint.item(r.storage_index).stored.relative_path,
                checkpoint.item(r.storage_index).stored.offset,
            ),
        )
        wanted = {id(r): checkpoint.item(r.storage_index) for r in requests}
        checkpoint.check_objects(list(wanted.values()))
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
    found: dict[int, str] = {}
    for prefix in store.list_delimited(STEP_PREFIX, "/").prefixes:
        match = STANDARD_STEP.fullmatch(prefix[:-1])
        if match is not None and (step is None or int(match.group(1)) == step):
            found.setdefault(int(match.group(1)), prefix[:-1])
    for number in sorted(found, reverse=True):
        if is_standard_checkpoint(store, found[number]):
            return found[number]
    return None
