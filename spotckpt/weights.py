"""Reading a checkpoint's tensors without a training job: `open_checkpoint` and `load_weights`.

An evaluation or inference job wants the newest weights, or a few tensors, straight from the
bucket, without the optimizer and without building the training objects. `open_checkpoint` opens
one committed step the way safetensors' ``safe_open`` opens a file: ``keys()``, ``metadata()``,
``get_tensor(name)`` and ``get_slice(name)[...]``. Nothing but the manifest is read when it opens;
each tensor (or slice) is assembled from the chunks the ranks saved, however many there were:

- only the chunks that overlap what is asked are read, and of each only the bytes from the
  first element asked to the last (widened to the manifest's CRC32C blocks, as a block's CRC can
  only be checked whole), in pieces of at most `PIECE_BYTES`, several at a time;
- every block read is checked against the manifest's CRC32C (`spotckpt.engine.chunks`), and every
  range against the object's real size before anything is allocated for it, so a corrupt or
  truncated object is a `CorruptCheckpointError` naming the object, the bytes and the tensor;
- memory holds the tensor asked for plus, where a chunk's bytes are not the destination's own
  layout, that chunk's range: a whole chunk that lands contiguously in the result is read
  straight into the result's memory.

An indexed manifest (``spotckpt/2``, from many ranks) is read as its root when opened; the index
parts that locate a tensor's chunks are read when the tensor is asked for (`load_weights` asks for
every tensor it loads at once).

`load_weights` fills an ``nn.Module`` in place from the tensors under `prefix` (``model.``, where
`TrainState` keeps its model), on any world size: a DTensor (FSDP2, tensor parallel) gets only
its rank's local box, read as a slice; a plain tensor gets the whole tensor.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    MetadataIndex,
    TensorStorageMetadata,
)

from spotckpt.catalog import Catalog
from spotckpt.engine.chunks import ChunkReader, strong_hashes
from spotckpt.engine.dcp_standard import STANDARD_STEP, StandardCheckpoint, find_standard
from spotckpt.errors import (
    CorruptCheckpointError,
    InvalidArgumentError,
    InvalidTypeError,
    KeyMismatchError,
    ManifestError,
    NoCheckpointError,
)
from spotckpt.format.dtypes import BY_NAME, DType
from spotckpt.format.features import parse_format
from spotckpt.format.index import INDEXED_FORMAT
from spotckpt.format.manifest import FORMAT_VERSION, Manifest, TensorChunk, TensorRecord
from spotckpt.layout import step_folder
from spotckpt.storage.base import ObjectStore
from spotckpt.storage.registry import open_store

PIECE_BYTES = 16 << 20
"""A chunk's bytes are fetched in verified pieces of at most this many bytes (whole blocks)."""
PARALLEL_READS = 8
"""Pieces fetched at the same time."""
PARALLEL_TENSORS = 4
"""Tensors `CheckpointFile.fill` (and so `load_weights`) reads at the same time."""

Box = tuple[tuple[int, ...], tuple[int, ...]]
"""Offsets and sizes of a box of a tensor, one entry per dimension."""


def open_checkpoint(
    uri: str | ObjectStore, step: int | None = None, **storage_options: Any
) -> OpenCheckpoint:
    """Open committed step `step` (default: the latest) of the checkpoint root `uri` for lazy
    reads; use it as a context manager. `storage_options` go to the store, as in
    ``CheckpointManager(storage_options=...)``. Where the root has no committed step of
    spotckpt's, a standard DCP checkpoint (`uri` itself, or its ``step-<N>/`` folder) opens as
    a `StandardCheckpointFile`, with the same reads.

    NoCheckpointError when the root has no committed step (or not `step`); ManifestError when
    its manifest is damaged.
    """
    owned = isinstance(uri, str)
    if not owned and storage_options:
        raise InvalidArgumentError(
            "storage options go with a URI; an open store was given: "
            + ", ".join(sorted(storage_options))
        )
    store = open_store(uri, **storage_options) if isinstance(uri, str) else uri
    try:
        try:
            return CheckpointFile(store, step, owns_store=owned)
        except NoCheckpointError:
            folder = find_standard(store, step)
            if folder is None:
                raise
            return StandardCheckpointFile(store, folder, step, owns_store=owned)
    except BaseException:
        if owned:
            store.close()
        raise


class CheckpointFile:
    """One committed step opened for lazy reads (see the module docstring); thread-safe reads."""

    def __init__(self, store: ObjectStore, step: int | None, *, owns_store: bool = False) -> None:
        self._store = store
        self._owns_store = owns_store
        self._catalog = Catalog(store)
        self.step = self._catalog.resolve(step)
        self._data = self._catalog.manifest_bytes(self.step)
        # A flat manifest is read whole; of an indexed one only the root (no index part).
        self._manifest = self._catalog.read_manifest(
            self.step, lambda root: ({}, ()), data=self._data
        )
        layout, _ = parse_format(self._manifest.format, (FORMAT_VERSION, INDEXED_FORMAT))
        self._indexed = layout == INDEXED_FORMAT
        self._chunks = ChunkReader(
            store,
            step_folder(self.step),
            self._manifest.block_size,
            {key: record.size for key, record in self._manifest.objects.items()},
            strong=strong_hashes(self._manifest),
        )
        self._lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = ThreadPoolExecutor(
            PARALLEL_READS, thread_name_prefix="spotckpt-read"
        )

    def __enter__(self) -> CheckpointFile:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()

    def close(self) -> None:
        """Stop the reader threads, and close the store when `open_checkpoint` opened it."""
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None
            if self._owns_store:
                self._store.close()

    @property
    def uri(self) -> str:
        """The checkpoint root's URI."""
        return self._store.uri

    def keys(self) -> list[str]:
        """The tensors' names, in the manifest's order (values such as the step are not listed:
        `metadata` has them)."""
        return list(self._manifest.tensors)

    def __contains__(self, name: object) -> bool:
        return name in self._manifest.tensors

    def __iter__(self) -> Iterator[str]:
        return iter(self._manifest.tensors)

    def metadata(self) -> dict[str, Any]:
        """What the manifest says about the checkpoint, besides its tensors: ``step``,
        ``world_size`` (ranks that saved it), ``created_at``, ``user_metadata`` (what the trainer
        attached), ``versions`` (of the saving software), ``format`` and ``attempt``."""
        manifest = self._manifest
        return {
            "step": manifest.step,
            "world_size": manifest.world_size,
            "created_at": manifest.created_at,
            "user_metadata": dict(manifest.user_metadata),
            "versions": dict(manifest.versions),
            "format": manifest.format,
            "attempt": manifest.attempt,
        }

    def shape(self, name: str) -> tuple[int, ...]:
        """The tensor's global shape (as saved, however many ranks held pieces of it)."""
        return self._record(name).shape

    def dtype(self, name: str) -> torch.dtype:
        """The tensor's dtype."""
        return BY_NAME[self._record(name).dtype].torch_dtype

    def get_tensor(self, name: str) -> torch.Tensor:
        """The whole tensor, assembled from every rank's pieces and CRC-checked."""
        record = self._record(name)
        return self.read_boxes({name: [((0,) * len(record.shape), record.shape)]})[name][0]

    def get_slice(self, name: str) -> TensorSlice:
        """A handle whose ``[...]`` reads only the part of the tensor it names."""
        return TensorSlice(self, name, self.shape(name), self.dtype(name))

    def read_boxes(self, boxes: Mapping[str, Sequence[Box]]) -> dict[str, list[torch.Tensor]]:
        """The tensors of each (offsets, sizes) box, by name; one manifest lookup for all of them
        (an indexed manifest reads the index parts of every box at once)."""
        records = self._located(boxes)
        return {
            name: [self._read_box(name, records[name], box) for box in wanted]
            for name, wanted in boxes.items()
        }

    def fill(self, targets: Mapping[str, tuple[Box, torch.Tensor]]) -> None:
        """Copy each named tensor's box into its destination (of the box's shape, any dtype or
        device), `PARALLEL_TENSORS` tensors at a time: a CPU destination of the stored dtype is
        read into directly, any other through a buffer of its size. On an error some
        destinations may already hold the checkpoint's values."""
        records = self._located({name: [box] for name, (box, _) in targets.items()})

        def one(name: str) -> None:
            box, given = targets[name]
            destination = given.detach()  # the same memory, written outside autograd
            record = records[name]
            stored = BY_NAME[record.dtype].torch_dtype
            if destination.device.type == "cpu" and destination.dtype == stored:
                self._read_into(name, record, box, destination)
            else:
                destination.copy_(self._read_box(name, record, box))

        with ThreadPoolExecutor(PARALLEL_TENSORS, thread_name_prefix="spotckpt-fill") as pool:
            for _ in pool.map(one, targets):
                pass

    def _record(self, name: str) -> TensorRecord:
        record = self._manifest.tensors.get(name)
        if record is None:
            raise KeyMismatchError(
                f"step {self.step} at {self.uri} has no tensor {name!r} "
                f"({len(self._manifest.tensors)} tensors; keys() lists them)"
            )
        return record

    def _located(self, boxes: Mapping[str, Sequence[Box]]) -> dict[str, TensorRecord]:
        """The records of the tensors in `boxes`, with (at least) the chunks that overlap them;
        InvalidArgumentError for a box outside its tensor."""
        for name, wanted in boxes.items():
            shape = self._record(name).shape
            for box in wanted:
                _check_box(name, shape, box)
        if not self._indexed:
            return {name: self._manifest.tensors[name] for name in boxes}
        wanted_boxes = {name: list(b) for name, b in boxes.items()}
        manifest: Manifest = self._catalog.read_manifest(
            self.step, lambda root: (wanted_boxes, ()), data=self._data
        )
        with self._lock:  # the objects of the parts just read join those known
            self._chunks.learn(manifest.objects)
        return {name: manifest.tensors[name] for name in boxes}

    def _read_box(self, name: str, record: TensorRecord, box: Box) -> torch.Tensor:
        out = torch.empty(box[1], dtype=BY_NAME[record.dtype].torch_dtype)
        self._read_into(name, record, box, out)
        return out

    def _read_into(self, name: str, record: TensorRecord, box: Box, out: torch.Tensor) -> None:
        """Box `box` of the tensor into `out`, a CPU tensor of the box's shape and stored dtype."""
        stored = BY_NAME[record.dtype]
        offsets, sizes = box
        pieces = [(c, part) for c in record.chunks if (part := _overlap(c, box)) is not None]
        for chunk, _ in pieces:  # forged sizes are refused before anything is read
            self._chunks.check_chunk(chunk.location, name)
        if not out.numel():
            return
        covered = sum(math.prod(part[1]) for _, part in pieces)
        if covered != out.numel():
            raise ManifestError(
                f"tensor {name!r}: the manifest's chunks cover {covered} of the {out.numel()} "
                f"elements of box {list(offsets)}+{list(sizes)}"
            )
        for chunk, part in pieces:
            self._read_chunk_part(name, stored, chunk, part, box[0], out)

    def _read_chunk_part(
        self,
        name: str,
        stored: DType,
        chunk: TensorChunk,
        part: Box,
        origin: tuple[int, ...],
        out: torch.Tensor,
    ) -> None:
        """Copy `part` (global offsets and sizes) of `chunk` into `out`, the tensor of the box
        that starts at `origin`."""
        low, size = part
        local = tuple(lo - co for lo, co in zip(low, chunk.offsets, strict=True))
        target = out[
            tuple(slice(lo - o, lo - o + s) for lo, o, s in zip(low, origin, size, strict=True))
        ]
        whole = local == (0,) * len(local) and size == chunk.sizes
        if whole and target.is_contiguous():
            self._fetch(name, chunk, 0, chunk.location.length, _bytes_of(target))
            return
        itemsize = stored.itemsize
        strides = [math.prod(chunk.sizes[d + 1 :]) for d in range(len(chunk.sizes))]
        first = sum(lo * st for lo, st in zip(local, strides, strict=True))
        last = sum((lo + s - 1) * st for lo, s, st in zip(local, size, strides, strict=True)) + 1
        span = self._chunks.span(chunk.location, first * itemsize, last * itemsize)
        buffer = bytearray(span.end - span.start)
        self._fetch(name, chunk, span.start, span.end, memoryview(buffer))
        skip = first * itemsize - span.start
        flat = torch.frombuffer(buffer, dtype=torch.uint8)[skip : skip + (last - first) * itemsize]
        elements = flat.view(stored.torch_dtype)
        target.copy_(elements.as_strided(size, strides, elements.storage_offset()))

    def _fetch(self, name: str, chunk: TensorChunk, start: int, end: int, into: memoryview) -> None:
        """Bytes `start`..`end` of a chunk (block-aligned at `start`) into `into`, in verified
        pieces fetched in parallel."""
        location = chunk.location
        block = self._chunks.block_size
        step = max(1, PIECE_BYTES // block) * block
        if self._pool is None:
            raise InvalidArgumentError(f"checkpoint {self.uri} step {self.step} is closed")

        def piece(at: int) -> None:
            stop = min(at + step, end)
            view = into[at - start : stop - start]
            self._chunks.read_chunk_into(location, at // block, view, (name,))
            self._chunks.verify(view, location, at // block, name)

        if end == start:
            self._chunks.verify(b"", location, 0, name)
            return
        for future in [self._pool.submit(piece, at) for at in range(start, end, step)]:
            future.result()
        if end - start > step:  # several pieces: the whole chunk's BLAKE3 (a signed step's)
            self._chunks.check_strong(into, location, name)


class StandardCheckpointFile:
    """A standard DCP checkpoint opened for lazy reads (`open_checkpoint` where the root holds
    one): each tensor assembled from the chunks that overlap what is asked, each chunk read
    whole (a ``torch.save`` item loads only whole) after its object's size was checked
    (`spotckpt.engine.dcp_standard`: standard checkpoints carry no CRCs)."""

    def __init__(
        self, store: ObjectStore, folder: str, step: int | None, *, owns_store: bool = False
    ) -> None:
        self._checkpoint = StandardCheckpoint(store, folder)
        self._owns_store = owns_store
        self.step = step if step is not None else _folder_step(folder)
        self._tensors = {
            fqn: entry
            for fqn, entry in self._checkpoint.metadata.state_dict_metadata.items()
            if isinstance(entry, TensorStorageMetadata)
        }

    def __enter__(self) -> StandardCheckpointFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Close the store when `open_checkpoint` opened it."""
        if self._owns_store:
            self._owns_store = False
            self._checkpoint.store.close()

    @property
    def uri(self) -> str:
        """The checkpoint folder's URI."""
        return self._checkpoint.uri

    def keys(self) -> list[str]:
        """The tensors' names, in the metadata's order (pickled values are not listed)."""
        return list(self._tensors)

    def __contains__(self, name: object) -> bool:
        return name in self._tensors

    def __iter__(self) -> Iterator[str]:
        return iter(self._tensors)

    def metadata(self) -> dict[str, Any]:
        """What a standard checkpoint says besides its tensors: ``step`` (from its folder's
        name; None when it has none), ``format`` (``"dcp"``) and DCP's ``version``."""
        return {"step": self.step, "format": "dcp", "version": self._checkpoint.metadata.version}

    def shape(self, name: str) -> tuple[int, ...]:
        """The tensor's global shape."""
        return tuple(self._entry(name).size)

    def dtype(self, name: str) -> torch.dtype:
        """The tensor's dtype."""
        return self._entry(name).properties.dtype

    def get_tensor(self, name: str) -> torch.Tensor:
        """The whole tensor, assembled from every rank's chunks."""
        shape = self.shape(name)
        return self.read_boxes({name: [((0,) * len(shape), shape)]})[name][0]

    def get_slice(self, name: str) -> TensorSlice:
        """A handle whose ``[...]`` reads only the chunks that hold the part it names."""
        return TensorSlice(self, name, self.shape(name), self.dtype(name))

    def read_boxes(self, boxes: Mapping[str, Sequence[Box]]) -> dict[str, list[torch.Tensor]]:
        """The tensors of each (offsets, sizes) box, by name."""
        return {
            name: [self._read_box(name, box) for box in wanted] for name, wanted in boxes.items()
        }

    def fill(self, targets: Mapping[str, tuple[Box, torch.Tensor]]) -> None:
        """Copy each named tensor's box into its destination (of the box's shape, any dtype or
        device)."""
        for name, (box, destination) in targets.items():
            destination.detach().copy_(self._read_box(name, box))

    def _entry(self, name: str) -> TensorStorageMetadata:
        entry = self._tensors.get(name)
        if entry is None:
            raise KeyMismatchError(
                f"the DCP checkpoint {self.uri} has no tensor {name!r} "
                f"({len(self._tensors)} tensors; keys() lists them)"
            )
        return entry

    def _read_box(self, name: str, box: Box) -> torch.Tensor:
        entry = self._entry(name)
        _check_box(name, tuple(entry.size), box)
        result = torch.zeros(box[1], dtype=entry.properties.dtype)  # never another's bytes
        wanted = []
        for chunk in entry.chunks:
            held = _overlap(chunk, box)
            if held is not None:
                wanted.append((self._checkpoint.item(MetadataIndex(name, chunk.offsets)), held))
        covered = 0
        for item, (low, size) in wanted:
            stored = self._checkpoint.read(item)
            if not isinstance(stored, torch.Tensor) or item.chunk is None:
                raise CorruptCheckpointError(f"{self.uri}: {name!r} is not stored as a tensor")
            source = stored[_region(low, size, tuple(item.chunk.offsets))]
            result[_region(low, size, box[0])] = source
            covered += math.prod(size)
        if covered < math.prod(box[1]):
            raise CorruptCheckpointError(
                f"{self.uri}: the chunks of {name!r} do not cover {list(box[0])}+{list(box[1])}"
            )
        return result


OpenCheckpoint = CheckpointFile | StandardCheckpointFile
"""What `open_checkpoint` returns: a committed spotckpt step, or a standard DCP checkpoint."""


def _region(low: Sequence[int], size: Sequence[int], origin: Sequence[int]) -> tuple[slice, ...]:
    """The slices of the box (`low`, `size`) in a tensor whose first element is at `origin`."""
    return tuple(slice(lo - o, lo - o + n) for lo, n, o in zip(low, size, origin, strict=True))


def _folder_step(folder: str) -> int | None:
    match = STANDARD_STEP.fullmatch(folder)
    return int(match.group(1)) if match is not None else None


class TensorSlice:
    """A tensor of an open checkpoint, read in part: ``[rows]``, ``[:, 2:5]``, ``[..., 0]``."""

    def __init__(
        self, file: OpenCheckpoint, name: str, shape: tuple[int, ...], dtype: torch.dtype
    ) -> None:
        self._file = file
        self.name = name
        self.shape = shape
        self.dtype = dtype

    def get_shape(self) -> list[int]:
        """The tensor's global shape (safetensors' spelling)."""
        return list(self.shape)

    def get_dtype(self) -> torch.dtype:
        """The tensor's dtype."""
        return self.dtype

    def __getitem__(self, index: Any) -> torch.Tensor:
        """Integers, slices (with steps) and one ``...``, as for a tensor; reads only the box
        from the first to the last element asked for in each dimension."""
        box, picks = _box_of(self.name, self.shape, index)
        tensor = self._file.read_boxes({self.name: [box]})[self.name][0]
        return tensor[picks]


@dataclass
class LoadedWeights:
    """What `load_weights` did."""

    step: int | None
    """The step loaded; None for a standard DCP checkpoint whose folder names no step."""
    loaded: list[str] = field(default_factory=list)
    """The module's state-dict keys filled from the checkpoint."""
    missing: list[str] = field(default_factory=list)
    """Module keys the checkpoint lacks (left as they were; only with ``strict=False``)."""
    unexpected: list[str] = field(default_factory=list)
    """Checkpoint tensors under the prefix the module lacks (only with ``strict=False``)."""


def load_weights(
    uri: str | ObjectStore,
    model: nn.Module,
    prefix: str = "model.",
    step: int | None = None,
    *,
    strict: bool = True,
    **storage_options: Any,
) -> LoadedWeights:
    """Fill `model`'s parameters and buffers in place from checkpoint step `step` (default: the
    latest), reading the tensors named `prefix` + the module's state-dict keys; on any world
    size (each rank reads only its DTensors' local boxes) and without an optimizer.

    KeyMismatchError, unless `strict` is off, when the module and the checkpoint disagree on the
    keys (both lists are named); InvalidArgumentError when a shape differs (dtypes are cast).
    """
    if not isinstance(model, nn.Module):
        raise InvalidTypeError(f"load_weights needs an nn.Module, got {type(model).__name__}")
    state = model.state_dict()
    with open_checkpoint(uri, step, **storage_options) as checkpoint:
        stored = {n[len(prefix) :] for n in checkpoint if n.startswith(prefix)}
        missing = sorted(set(state) - stored)
        unexpected = sorted(stored - set(state))
        if strict and (missing or unexpected):
            raise KeyMismatchError(_key_message(checkpoint, prefix, missing, unexpected))
        loaded = sorted(key for key in state if key in stored)
        checkpoint.fill(
            {
                prefix + key: (_local_box(prefix + key, checkpoint, state[key]), _local(state[key]))
                for key in loaded
            }
        )
        return LoadedWeights(checkpoint.step, loaded, missing, unexpected)


def _key_message(
    checkpoint: OpenCheckpoint, prefix: str, missing: list[str], unexpected: list[str]
) -> str:
    where = f"step {checkpoint.step} at {checkpoint.uri}"
    parts = []
    if missing:
        parts.append(f"missing from the checkpoint (as {prefix!r} + key): {_names(missing)}")
    if unexpected:
        parts.append(f"in the checkpoint but not in the module: {_names(unexpected)}")
    hint = "pass strict=False to load the keys both have"
    if missing and not any(n.startswith(prefix) for n in checkpoint):
        tops = sorted({n.split(".")[0] + "." for n in checkpoint})
        hint = f"no tensor starts with {prefix!r}; tensor names start with: {', '.join(tops)}"
    return f"the module's keys and {where} differ: {'; '.join(parts)} ({hint})"


def _names(names: list[str], shown: int = 5) -> str:
    more = len(names) - shown
    return ", ".join(repr(n) for n in names[:shown]) + (f" and {more} more" if more > 0 else "")


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """The rank's own part of a DTensor, or the tensor itself."""
    from torch.distributed.tensor import DTensor

    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _local_box(name: str, checkpoint: OpenCheckpoint, tensor: torch.Tensor) -> Box:
    """The box of the stored tensor that this rank's `tensor` holds; InvalidArgumentError when
    the shapes differ (a dtype is cast, as ``load_state_dict`` does)."""
    from torch.distributed.tensor import DTensor

    shape = checkpoint.shape(name)
    if tuple(tensor.shape) != shape:
        raise InvalidArgumentError(
            f"tensor {name!r} has shape {list(shape)} in step {checkpoint.step}, the module's "
            f"has {list(tensor.shape)}"
        )
    if not isinstance(tensor, DTensor):
        return (0,) * len(shape), shape
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    sizes, offsets = compute_local_shape_and_global_offset(
        shape, tensor.device_mesh, tensor.placements
    )
    return tuple(offsets), tuple(sizes)


def _bytes_of(tensor: torch.Tensor) -> memoryview:
    """A writable byte view of a contiguous CPU tensor's memory."""
    flat = tensor.reshape(-1)
    if flat.dtype != torch.uint8:
        flat = flat.view(torch.uint8)
    return memoryview(flat.numpy()).cast("B")  # type: ignore[arg-type]


def _overlap(chunk: TensorChunk | ChunkStorageMetadata, box: Box) -> Box | None:
    """The part of `box` that `chunk` holds (global offsets, sizes), or None."""
    low, size = [], []
    for co, cs, bo, bs in zip(chunk.offsets, chunk.sizes, box[0], box[1], strict=True):
        lo, hi = max(co, bo), min(co + cs, bo + bs)
        if hi <= lo:
            return None
        low.append(lo)
        size.append(hi - lo)
    return tuple(low), tuple(size)


def _check_box(name: str, shape: tuple[int, ...], box: Box) -> None:
    offsets, sizes = box
    if len(offsets) != len(shape) or len(sizes) != len(shape):
        raise InvalidArgumentError(f"tensor {name!r} has {len(shape)} dimensions, not {len(sizes)}")
    for o, s, n in zip(offsets, sizes, shape, strict=True):
        if o < 0 or s < 0 or o + s > n:
            raise InvalidArgumentError(
                f"box {list(offsets)}+{list(sizes)} lies outside tensor {name!r} {list(shape)}"
            )


def _box_of(name: str, shape: tuple[int, ...], index: Any) -> tuple[Box, tuple[Any, ...]]:
    """The box to read for `index`, and the index that picks the answer out of that box."""
    items = index if isinstance(index, tuple) else (index,)
    if sum(item is Ellipsis for item in items) > 1:
        raise InvalidArgumentError(f"tensor {name!r}: an index can hold only one '...'")
    if Ellipsis in items:
        at = items.index(Ellipsis)
        fill = len(shape) - (len(items) - 1)
        items = (*items[:at], *(slice(None),) * max(0, fill), *items[at + 1 :])
    if len(items) > len(shape):
        raise InvalidArgumentError(
            f"tensor {name!r} has {len(shape)} dimensions, the index names {len(items)}"
        )
    items = (*items, *(slice(None),) * (len(shape) - len(items)))
    offsets: list[int] = []
    sizes: list[int] = []
    picks: list[int | slice] = []
    for dim, (item, extent) in enumerate(zip(items, shape, strict=True)):
        if isinstance(item, bool) or not isinstance(item, (int, slice)):
            raise InvalidArgumentError(
                f"tensor {name!r}: index {item!r} in dimension {dim} is not an int or a slice"
            )
        if isinstance(item, int):
            position = item + extent if item < 0 else item
            if not 0 <= position < extent:
                raise InvalidArgumentError(
                    f"tensor {name!r}: index {item} is out of range for dimension {dim} of "
                    f"size {extent}"
                )
            offsets.append(position)
            sizes.append(1)
            picks.append(0)
            continue
        start, stop, stride = item.indices(extent)
        if stride < 0:
            raise InvalidArgumentError(f"tensor {name!r}: negative slice steps are not supported")
        count = len(range(start, stop, stride))
        offsets.append(start if count else 0)
        sizes.append((count - 1) * stride + 1 if count else 0)
        picks.append(slice(None, None, stride))
    return (tuple(offsets), tuple(sizes)), tuple(picks)
