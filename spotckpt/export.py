"""`export_hf`: consolidate a checkpoint's model weights into a Hugging Face safetensors folder.

The tensors whose name starts with `prefix` (``model.``: where `TrainState` keeps the parameters
and buffers of its model) are assembled whole from however many ranks saved them (each stored
chunk is fetched with ranged reads and its per-block CRC32Cs verified, then copied into place by
its offsets) and written in the layout ``transformers`` and ``safetensors`` load:
``model.safetensors`` when everything fits in one shard of `max_shard_size` bytes, otherwise
``model-00001-of-0000K.safetensors`` ... plus ``model.safetensors.index.json``
(``{"metadata": {"total_size": N}, "weight_map": {name: file}}``), written last.

Names: by default the prefix is stripped (``model.layers.0.weight`` is written as
``layers.0.weight``), as Hugging Face names parameters relative to the model. Only floating-point
tensors are cast when `dtype` is given; integer and boolean buffers keep their dtype. Each output
file is streamed through the output store's writer: memory holds the tensor being written, the
chunks read ahead (`read_ahead_bytes`), and the store's upload buffers, never a whole shard.
Config and tokenizer files are not part of a checkpoint; copy them beside the export.
"""

from __future__ import annotations

import json
import re
from collections import deque
from collections.abc import Callable, Generator, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch

from spotckpt.catalog import Catalog, step_folder
from spotckpt.chunks import ChunkReader
from spotckpt.errors import InvalidArgumentError
from spotckpt.format.dtypes import BY_NAME, DType, dtype_of
from spotckpt.format.manifest import (
    Manifest,
    TensorChunk,
    TensorRecord,
)
from spotckpt.format.safetensors_io import (
    SafetensorsStreamWriter,
    TensorSpec,
    bytes_to_tensor,
    tensor_bytes,
)
from spotckpt.storage.base import AlreadyExistsError, ObjectStore, open_store

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
DEFAULT_MAX_SHARD_SIZE = 5 * 10**9
_SHARD_NAME = re.compile(r"^model-\d{5}-of-\d{5}\.safetensors$")
_READ_PIECE = 16 << 20
ProgressFn = Callable[[int, int], None]
"""Called as ``progress(bytes_written, bytes_total)`` after each tensor is written."""


@dataclass(frozen=True)
class _Item:
    """One exported tensor: where it comes from and what it becomes."""

    source: str
    record: TensorRecord
    spec: TensorSpec


@dataclass
class ExportReport:
    """What `export_hf` wrote."""

    step: int
    out_uri: str
    files: list[str] = field(default_factory=list)
    index: str | None = None
    tensors: int = 0
    total_size: int = 0

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready form."""
        return {
            "step": self.step,
            "out": self.out_uri,
            "files": list(self.files),
            "index": self.index,
            "tensors": self.tensors,
            "total_size": self.total_size,
        }


def export_hf(
    store: ObjectStore,
    step: int,
    out: ObjectStore | str,
    *,
    max_shard_size: int = DEFAULT_MAX_SHARD_SIZE,
    dtype: torch.dtype | None = None,
    prefix: str = "model.",
    strip_prefix: bool = True,
    overwrite: bool = False,
    progress: ProgressFn | None = None,
    read_ahead_bytes: int = 256 << 20,
    max_parallel_reads: int = 8,
) -> ExportReport:
    """Write the model weights of checkpoint `step` to `out` (a store or a URI) in HF layout.

    Raises NoCheckpointError for a step without a manifest, ValueError when no tensor matches
    `prefix`, AlreadyExistsError when `out` holds an export and `overwrite` is off, and
    CorruptCheckpointError when a stored object is missing, truncated or fails its CRC32Cs.
    """
    if max_shard_size < 1:
        raise InvalidArgumentError("max_shard_size must be positive")
    if dtype is not None and not dtype.is_floating_point:
        raise InvalidArgumentError(f"export dtype must be a floating-point type, got {dtype}")
    manifest = Catalog(store).read_manifest(step)
    items = select_tensors(manifest, prefix, strip_prefix, dtype)
    shards = plan_shards([i.spec for i in items], max_shard_size)
    out_store = open_store(out) if isinstance(out, str) else out
    try:
        stale = _existing_export(out_store, overwrite)
        names = shard_names(len(shards))
        report = ExportReport(step=step, out_uri=out_store.uri, tensors=len(items))
        report.total_size = sum(i.spec.nbytes for i in items)
        reader = _TensorStream(store, manifest, read_ahead_bytes, max_parallel_reads)
        tensors = reader.tensors(items)
        done = 0
        try:
            for name, specs in zip(names, shards, strict=True):
                done = _write_shard(out_store, name, specs, tensors, done, report, progress)
                report.files.append(name)
        finally:
            tensors.close()
        if len(shards) > 1:
            report.index = INDEX_FILE
            out_store.put(INDEX_FILE, _index_json(names, shards, report.total_size))
        out_store.delete_many(sorted(set(stale) - set(report.files) - {report.index}))
    finally:
        if isinstance(out, str):
            out_store.close()
    return report


def select_tensors(
    manifest: Manifest, prefix: str, strip_prefix: bool, dtype: torch.dtype | None
) -> list[_Item]:
    """The tensors under `prefix` in manifest order, with their output names and dtypes."""
    items = []
    for fqn, record in manifest.tensors.items():
        if not fqn.startswith(prefix):
            continue
        name = fqn[len(prefix) :] if strip_prefix else fqn
        if not name:
            raise InvalidArgumentError(
                f"tensor {fqn!r} has an empty name once {prefix!r} is stripped"
            )
        stored = BY_NAME[record.dtype]
        cast = dtype if dtype is not None and stored.torch_dtype.is_floating_point else None
        out_dtype = dtype_of(cast) if cast is not None else stored
        items.append(_Item(fqn, record, TensorSpec(name, out_dtype, record.shape)))
    if not items:
        tops = sorted({fqn.split(".")[0] + "." for fqn in manifest.tensors})
        raise InvalidArgumentError(
            f"no tensor of step {manifest.step} starts with {prefix!r}; "
            f"tensor names start with: {', '.join(tops) or 'nothing (no tensors)'}"
        )
    return items


def plan_shards(specs: list[TensorSpec], max_shard_size: int) -> list[list[TensorSpec]]:
    """Greedy split in order: a shard closes when the next tensor would overflow it.

    A tensor larger than `max_shard_size` gets a shard of its own.
    """
    shards: list[list[TensorSpec]] = [[]]
    size = 0
    for spec in specs:
        if shards[-1] and size + spec.nbytes > max_shard_size:
            shards.append([])
            size = 0
        shards[-1].append(spec)
        size += spec.nbytes
    return shards


def shard_names(count: int) -> list[str]:
    """``model.safetensors`` for one shard, else ``model-0000i-of-0000K.safetensors``."""
    if count == 1:
        return [SINGLE_FILE]
    return [f"model-{i:05d}-of-{count:05d}.safetensors" for i in range(1, count + 1)]


def _index_json(names: list[str], shards: list[list[TensorSpec]], total_size: int) -> bytes:
    weight_map = {
        spec.name: name for name, specs in zip(names, shards, strict=True) for spec in specs
    }
    document = {"metadata": {"total_size": total_size}, "weight_map": weight_map}
    return (json.dumps(document, indent=2, sort_keys=True) + "\n").encode()


def _existing_export(out: ObjectStore, overwrite: bool) -> list[str]:
    """Names of a previous export in `out`; raises unless `overwrite` allows replacing them."""
    found = [
        info.key
        for info in out.list("model")
        if info.key in (SINGLE_FILE, INDEX_FILE) or _SHARD_NAME.match(info.key)
    ]
    if found and not overwrite:
        raise AlreadyExistsError(
            f"{out.uri} already holds an export ({found[0]}); pass overwrite=True (--overwrite) "
            "to replace it"
        )
    return found


def _write_shard(
    out: ObjectStore,
    name: str,
    specs: list[TensorSpec],
    tensors: Iterator[torch.Tensor],
    done: int,
    report: ExportReport,
    progress: ProgressFn | None,
) -> int:
    """Stream one output file; returns the running count of bytes written."""
    with out.open_writer(name) as writer:
        stream = SafetensorsStreamWriter(writer, specs, {"format": "pt"})
        for spec in specs:
            tensor = next(tensors)
            stream.write_tensor(spec.name, tensor_bytes(tensor.to(spec.dtype.torch_dtype)))
            done += spec.nbytes
            if progress is not None:
                progress(done, report.total_size)
        stream.finish()
    return done


class _TensorStream:
    """Assembles whole tensors in export order from verified chunks, with a bounded read-ahead."""

    def __init__(
        self, store: ObjectStore, manifest: Manifest, read_ahead_bytes: int, workers: int
    ) -> None:
        self.chunks = ChunkReader(
            store,
            step_folder(manifest.step),
            manifest.block_size,
            {key: record.size for key, record in manifest.objects.items()},
        )
        self.read_ahead_bytes = read_ahead_bytes
        self.workers = workers

    def tensors(self, items: list[_Item]) -> Generator[torch.Tensor, None, None]:
        """Yield each item's whole tensor, in its stored dtype, in order."""
        jobs = [(item, chunk) for item in items for chunk in item.record.chunks]
        pool = ThreadPoolExecutor(self.workers, thread_name_prefix="spotckpt-export")
        fetched = self._prefetch(pool, jobs)
        try:
            for item in items:
                for chunk in item.record.chunks:  # a forged shape is refused, not allocated
                    self.chunks.check_chunk(chunk.location, item.source)
                stored = BY_NAME[item.record.dtype]
                whole = torch.empty(item.record.shape, dtype=stored.torch_dtype)
                for chunk in item.record.chunks:
                    whole[_slices(chunk)].copy_(next(fetched))
                yield whole
        finally:
            fetched.close()
            pool.shutdown(wait=True, cancel_futures=True)

    def _prefetch(
        self, pool: ThreadPoolExecutor, jobs: list[tuple[_Item, TensorChunk]]
    ) -> Generator[torch.Tensor, None, None]:
        pending: deque[tuple[int, Future[torch.Tensor]]] = deque()
        in_flight = 0
        for item, chunk in jobs:
            size = chunk.location.length
            while pending and in_flight + size > self.read_ahead_bytes:
                length, future = pending.popleft()
                in_flight -= length
                yield future.result()
            stored = BY_NAME[item.record.dtype]
            pending.append((size, pool.submit(self._read_chunk, item.source, chunk, stored)))
            in_flight += size
        while pending:
            yield pending.popleft()[1].result()

    def _read_chunk(self, source: str, chunk: TensorChunk, stored: DType) -> torch.Tensor:
        """One chunk as a tensor, read in verified pieces of whole blocks."""
        location = chunk.location
        self.chunks.check_chunk(location, source)
        buffer = bytearray(location.length)
        block_size = self.chunks.block_size
        step = max(1, _READ_PIECE // block_size) * block_size
        for start in range(0, location.length, step):
            piece, _ = self.chunks.read_chunk(
                location, source, start, min(start + step, location.length)
            )
            buffer[start : start + len(piece)] = piece
        if not location.length:
            self.chunks.verify(b"", location, 0, source)
        return bytes_to_tensor(buffer, stored, chunk.sizes)


def _slices(chunk: TensorChunk) -> tuple[slice, ...]:
    return tuple(slice(o, o + s) for o, s in zip(chunk.offsets, chunk.sizes, strict=True))
