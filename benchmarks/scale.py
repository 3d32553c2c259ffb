"""Metadata at scale: what N ranks x T tensors cost the coordinator and a restoring rank.

Simulates one save and one restore of a model of T tensors on N ranks, laid out as FSDP
(``Shard(0)`` over N ranks), HSDP (``(Replicate(), Shard(0))`` on a mesh of R replicas x N/R
shards) or DDP (every rank holds every tensor), without N processes and without tensor data: only
DCP's metadata objects are built (`WriteItem`, `WriteResult`, `ChunkStorageMetadata`, ...). The
real code runs on them: DCP's gather (pickled plans unpickled on rank 0), DCP's global save
planning (`DefaultSavePlanner.create_global_plan`, dedup included), spotckpt's key assignment,
manifest building, encoding and commit, a restoring rank's manifest read and parse, DCP's load
planning for that rank (`DefaultLoadPlanner`) and spotckpt's read planning; and `Catalog.latest`
and `Catalog.retire` over a history of S committed steps in a store that counts requests (S3
pages: one list request per 1,000 keys, one delete request per 1,000 keys).

    python benchmarks/scale.py --ranks 512 --tensors 2000 --layout fsdp --steps 1000 --json
    python benchmarks/scale.py --sweep          # the markdown tables of benchmarks/README.md

Seconds (``*_s``) are CPU seconds of the simulating process (`time.process_time`; the work is
single-threaded), so a busy machine inflates them far less than wall time; ``simulate_s`` is the
run's wall time. The cyclic garbage collector is paused (a full collection runs between phases)
unless ``--gc``: with it on, allocation-heavy phases cost up to about 3x more in a large heap.
Memory: ``peak_coordinator_mib`` is the tracemalloc peak of what the commit phase allocates (a
second, traced run of it), ``peak_rss_mib`` the process's peak resident set.

The functions under "Metadata phases" are the only ones that know spotckpt's metadata format;
everything below them only builds DCP objects, times, counts and prints.
"""

from __future__ import annotations

import argparse
import bisect
import builtins
import contextlib
import dataclasses
import gc
import itertools
import json
import math
import pickle
import random
import resource
import subprocess
import sys
import time
import tracemalloc
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
)
from torch.distributed.checkpoint.planner import (
    LoadPlan,
    SavePlan,
    TensorWriteData,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.storage import WriteResult

from spotckpt.catalog import Catalog
from spotckpt.engine.global_plan import PlanCache, apply_global, summarize
from spotckpt.engine.manifests import (
    ROOT_CACHE,
    WrittenItem,
    build_root,
    index_part,
    indexed_references,
)
from spotckpt.engine.planners import ScalingSavePlanner, wanted_boxes
from spotckpt.engine.reader import ObjectStoreReader
from spotckpt.engine.writer import ObjectStoreWriter, RankAssignment, WriterOptions, _item_name
from spotckpt.errors import AlreadyExistsError, CheckpointError, ObjectNotFoundError
from spotckpt.format.dtypes import dtype_of
from spotckpt.format.manifest import ChunkLocation, Manifest, ObjectRecord
from spotckpt.format.safetensors_io import DEFAULT_BLOCK_SIZE, TensorSpec, encode_header
from spotckpt.layout import index_part_key, manifest_key, rank_object_key, step_key
from spotckpt.storage.base import (
    Listing,
    ObjectInfo,
    ObjectStore,
    UploadInfo,
    check_delimiter,
    check_key,
    rolled_up,
)
from spotckpt.storage.memory import MemoryWriter

MIB = 1 << 20
clock = time.process_time  # CPU seconds: the work itself, little inflated by a loaded machine
PAGE_KEYS = 1000  # keys per S3 ListObjectsV2 page and per DeleteObjects request
KEEP_LAST = 3
MAX_HISTORY_KEYS = 5_000_000  # sweep: larger simulated histories are skipped


# Metadata phases: the only code that knows spotckpt's metadata format ------------------------


@dataclass
class CommitOutcome:
    """The coordinator's commit: seconds of each part and the bytes it wrote."""

    build_s: float
    encode_s: float
    put_s: float
    manifest_bytes: int
    index_bytes: int = 0  # index parts, written by the ranks themselves

    @property
    def seconds(self) -> float:
        """The whole commit phase."""
        return self.build_s + self.encode_s + self.put_s


@dataclass
class RestoreOutcome:
    """What one restoring rank read and parsed before DCP plans its load."""

    reader: ObjectStoreReader | None
    metadata_bytes: int
    fetch_s: float
    parse_s: float
    error: str | None = None


@dataclass
class ListingOutcome:
    """Requests and seconds of finding the latest step and of one retention pass."""

    latest: int | None
    latest_requests: dict[str, int]
    latest_s: float
    retention_requests: dict[str, int]
    retention_s: float
    retired: int


def key_assignment_phase(store: ObjectStore, step: int, plans: list[SavePlan]) -> list[SavePlan]:
    """spotckpt's part of the global save plan on the coordinator: refuse a committed step,
    draw the attempt, give each rank its object key; an indexed manifest (as from 32 ranks on)."""
    writer = ObjectStoreWriter(store, step, WriterOptions(index_parts=True))
    return writer.prepare_global_plan(plans)


def rank_phase(
    store: ObjectStore, step: int, rank: int, results: list[WriteResult], items: list[WriteItem]
) -> Any:
    """One rank's own metadata work after its data object is written: its index part, put next
    to its object; DCP then gathers one summary per rank (arrays, not an object per chunk)."""
    if not results:
        return results
    writer = ObjectStoreWriter(store, step)
    attempt = results[0].storage_data.location.key.partition("/")[0].removeprefix("a-")
    writer.attempt = attempt
    key = index_part_key(attempt, rank)
    data, summary = index_part(writer.header(), rank, results, items, key)
    store.put(step_key(step, key), data, create_only=True)
    record = summary.storage_data.record
    store.stand_in(step_key(step, record.key), record.size)  # its data object, written before
    return [summary]


def commit_phase(
    store: ObjectStore, step: int, attempt: str, metadata: Metadata, gathered: list[Any]
) -> CommitOutcome:
    """The coordinator's commit from DCP's global metadata and every rank's gathered output:
    the root manifest (parts, tilings, writer runs, values) built, encoded, and committed: every
    referenced object checked (a HEAD each), then the root put create-only."""
    writer = ObjectStoreWriter(store, step)
    writer.attempt = attempt
    started = clock()
    _summary, data = build_root(writer.header(), metadata, gathered)
    built = clock()
    writer.catalog.commit_bytes(step, attempt, data, indexed_references(gathered))
    parts = sum(r[0].storage_data.part.size for r in gathered if r)  # written by the ranks
    return CommitOutcome(built - started, 0.0, clock() - built, len(data), parts)


class _BytesRead:
    """Counts the bytes served by a store's ranged reads (the parts a restoring rank fetches)."""

    def __init__(self, store: ObjectStore) -> None:
        self.store = store
        self.bytes = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self.store, name)

    def get_range(self, key: str, start: int, length: int) -> bytes:
        data = self.store.get_range(key, start, length)
        self.bytes += len(data)
        return data

    def get_range_into(self, key: str, start: int, buffer: memoryview) -> int:
        placed = self.store.get_range_into(key, start, buffer)
        self.bytes += placed
        return placed


def restore_phase(
    store: ObjectStore, step: int, rank: int, wanted: dict[str, Any]
) -> RestoreOutcome:
    """One restoring rank fetches and parses the metadata it needs for `wanted` (its state dict)
    and builds its reader: the root, then only the index parts its shards' chunks are in."""
    catalog = Catalog(store)
    started = clock()
    try:
        data = catalog.manifest_bytes(step)
    except CheckpointError as error:
        size = (store.head(manifest_key(step)) or ObjectInfo("", 0)).size
        return RestoreOutcome(None, size, clock() - started, 0.0, str(error))
    fetched = clock()
    boxes, values = wanted_boxes(wanted)
    counted = _BytesRead(store)
    parts = Catalog(counted)  # type: ignore[arg-type]
    manifest = parts.read_manifest(step, lambda root: (boxes, values), data=data)
    reader = ObjectStoreReader(store, manifest)
    return RestoreOutcome(reader, len(data) + counted.bytes, fetched - started, clock() - fetched)


def populate_history(store: CountingStore, steps: int, objects_per_step: int) -> None:
    """`steps` committed steps, each a manifest and `objects_per_step` rank objects (empty
    bytes: listing and retention never read them; retention reads the manifests, which name no
    object, as it reads each step's once to tell what the step holds)."""
    for step in range(1, steps + 1):
        attempt = f"{step:016x}"
        for rank in range(objects_per_step):
            store.put(step_key(step, rank_object_key(attempt, rank)), b"")
        empty = Manifest(
            step=step,
            attempt=attempt,
            world_size=objects_per_step,
            block_size=DEFAULT_BLOCK_SIZE,
            objects={},
            tensors={},
            values={},
        )
        store.put(manifest_key(step), empty.to_json())


def listing_phase(store: CountingStore, keep_last: int) -> ListingOutcome:
    """`Catalog.latest()`, then one `Catalog.retire(keep_last)` pass, each counted on its own."""
    catalog = Catalog(store)
    store.reset_counts()
    started = clock()
    latest = catalog.latest()
    latest_s = clock() - started
    latest_requests = store.counts()
    store.reset_counts()
    started = clock()
    retired = catalog.retire(keep_last)
    retention_s = clock() - started
    return ListingOutcome(
        latest, latest_requests, latest_s, store.counts(), retention_s, len(retired)
    )


# An in-process store that counts requests like S3 ---------------------------------------------


class CountingStore:
    """In-process object store with a sorted key index, counting requests as S3 bills them:
    one list request per page of 1,000 keys (1,000 keys and common prefixes for a delimited
    listing; at least one per listing), one delete request per 1,000 keys, one request per put,
    get, ranged get and head. The ranks' data objects are stand-ins, known by their size only
    (`stand_in`): HEAD and listings answer for them, reads do not."""

    def __init__(self, name: str = "scale") -> None:
        self._name = name
        self._objects: dict[str, bytes] = {}
        self._keys: list[str] = []
        self._counts: dict[str, int] = {}
        self._stand_ins: dict[str, int] = {}

    def stand_in(self, key: str, size: int) -> None:
        """A data object of `size` bytes that a simulated rank wrote (no bytes are kept)."""
        if key not in self._stand_ins and key not in self._objects:
            bisect.insort(self._keys, check_key(key))
        self._stand_ins[key] = size

    def _size(self, key: str) -> int:
        data = self._objects.get(key)
        return self._stand_ins[key] if data is None else len(data)

    @property
    def uri(self) -> str:
        """A memory-style URI for messages."""
        return f"memory://{self._name}"

    def counts(self) -> dict[str, int]:
        """Requests by kind (``list``, ``list_keys``, ``delete``, ``put``, ``get``, ``head``)."""
        return dict(self._counts)

    def reset_counts(self) -> None:
        """Start counting afresh."""
        self._counts = {}

    def _count(self, kind: str, n: int = 1) -> None:
        self._counts[kind] = self._counts.get(kind, 0) + n

    def open_writer(self, key: str, *, create_only: bool = False) -> MemoryWriter:
        """A writer that puts the object on commit."""
        return MemoryWriter(self, check_key(key), create_only)  # type: ignore[arg-type]

    def put(self, key: str, data: bytes, *, create_only: bool = False) -> ObjectInfo:
        """Write one object (create-only raises AlreadyExistsError)."""
        self._count("put")
        if key in self._objects or key in self._stand_ins:
            if create_only:
                raise AlreadyExistsError(f"{self.uri}/{key} already exists")
        else:
            bisect.insort(self._keys, check_key(key))
        self._objects[key] = bytes(data)
        return ObjectInfo(key, len(data), datetime.now(timezone.utc))

    def get(self, key: str) -> bytes:
        """Read a whole object."""
        self._count("get")
        if key not in self._objects:
            raise ObjectNotFoundError(f"{self.uri}/{key} does not exist")
        return self._objects[key]

    def get_range(self, key: str, start: int, length: int) -> bytes:
        """Read a byte range."""
        self._count("get")
        if key not in self._objects:
            raise ObjectNotFoundError(f"{self.uri}/{key} does not exist")
        return self._objects[key][start : start + length]

    def get_range_into(self, key: str, start: int, buffer: memoryview) -> int:
        """Read a byte range into `buffer`."""
        data = self.get_range(key, start, buffer.nbytes)
        buffer[: len(data)] = data
        return len(data)

    def head(self, key: str) -> ObjectInfo | None:
        """Size of an object, or None."""
        self._count("head")
        data = self._objects.get(key)
        if data is None:
            size = self._stand_ins.get(key)
            return None if size is None else ObjectInfo(key, size, None)
        return ObjectInfo(key, len(data), None)

    def exists(self, key: str) -> bool:
        """Whether the object exists (one HEAD)."""
        return self.head(key) is not None

    def _under(self, prefix: str) -> list[str]:
        start = bisect.bisect_left(self._keys, prefix)
        end = start
        while end < len(self._keys) and self._keys[end].startswith(prefix):
            end += 1
        return self._keys[start:end]

    def list(self, prefix: str = "") -> Iterator[ObjectInfo]:
        """Keys under `prefix` in order; a request is counted as each page of 1,000 is reached
        (a caller that stops early pays only for the pages it read)."""
        keys = self._under(prefix)
        if not keys:
            self._count("list")
        for number, key in enumerate(keys):
            if number % PAGE_KEYS == 0:
                self._count("list")
            self._count("list_keys")
            yield ObjectInfo(key, self._size(key), None)

    def list_delimited(self, prefix: str, delimiter: str) -> Listing:
        """The delimited listing, rolled up as a server does it (skipping each common prefix's
        keys), one request per 1,000 entries (objects plus prefixes)."""
        check_delimiter(delimiter)
        objects: builtins.list[ObjectInfo] = []
        prefixes: builtins.list[str] = []
        position = bisect.bisect_left(self._keys, prefix)
        while position < len(self._keys) and self._keys[position].startswith(prefix):
            key = self._keys[position]
            common = rolled_up(key, prefix, delimiter)
            if common is None:
                objects.append(ObjectInfo(key, self._size(key), None))
                position += 1
            else:
                prefixes.append(common)
                past = common[:-1] + chr(ord(common[-1]) + 1)  # the first key not under it
                position = bisect.bisect_left(self._keys, past, position)
        entries = len(objects) + len(prefixes)
        self._count("list", max(1, math.ceil(entries / PAGE_KEYS)))
        self._count("list_keys", entries)
        return Listing(objects, prefixes)

    def delete_many(self, keys: Iterable[str]) -> None:
        """Delete objects, one request per 1,000 keys."""
        keys = list(keys)
        self._count("delete", math.ceil(len(keys) / PAGE_KEYS))
        gone = {key for key in keys if self._objects.pop(key, None) is not None}
        gone |= {key for key in keys if self._stand_ins.pop(key, None) is not None}
        if gone:
            self._keys = [key for key in self._keys if key not in gone]

    def list_uploads(self, prefix: str = "") -> builtins.list[UploadInfo]:
        """No multipart uploads in memory."""
        return []

    def abort_upload(self, upload: UploadInfo) -> None:
        """Nothing to abort."""

    def close(self) -> None:
        """Nothing to release."""


# The synthetic model and its layouts -----------------------------------------------------------

FLOAT32 = TensorProperties(dtype=torch.float32)
LAYER = (
    ("attention.wq.weight", "dd"),
    ("attention.wk.weight", "dd"),
    ("attention.wv.weight", "dd"),
    ("attention.wo.weight", "dd"),
    ("feed_forward.w1.weight", "fd"),
    ("feed_forward.w3.weight", "fd"),
    ("feed_forward.w2.weight", "df"),
    ("attention_norm.weight", "d"),
    ("ffn_norm.weight", "d"),
)
# Non-tensor values every rank holds (DCP keeps one copy): name -> pickled size in bytes.
VALUES = {"train.step": 40, "train.rng": 5_200, "optim.param_groups": 400}


@dataclass(frozen=True)
class SimTensor:
    """One tensor of the model: its name, global shape, and its path in the nested state dict."""

    fqn: str
    size: torch.Size
    path: tuple[str, ...]


def model_tensors(count: int, hidden: int) -> list[SimTensor]:
    """The first `count` tensors of a Llama-like model with AdamW state: per layer, 9 weights
    ([d, d] x 4, [f, d] x 2, [d, f], [d] x 2, f = the Llama FFN width) and for each the weight
    and its two moments."""
    ffn = 256 * math.ceil(int(8 * hidden / 3) / 256)
    extents = {"d": hidden, "f": ffn}
    tensors: list[SimTensor] = []
    for layer in range(math.ceil(count / (3 * len(LAYER)))):
        for name, dims in LAYER:
            size = torch.Size(extents[d] for d in dims)
            param = f"layers.{layer}.{name}"
            tensors.append(SimTensor(f"model.{param}", size, ("model", param)))
            for moment in ("exp_avg", "exp_avg_sq"):
                path = ("optim", "state", param, moment)
                tensors.append(SimTensor(".".join(path), size, path))
    return tensors[:count]


@dataclass(frozen=True)
class Layout:
    """How ranks hold the tensors: `shards` pieces along dim 0, each held by `replicas` ranks."""

    name: str
    world: int
    shards: int

    @property
    def replicas(self) -> int:
        """Ranks holding each piece."""
        return self.world // self.shards

    def shard_of(self, rank: int) -> int:
        """Which piece `rank` holds (mesh (replicas, shards), row-major as DeviceMesh)."""
        return rank % self.shards


def make_layout(name: str, world: int, replicas: int) -> Layout:
    """FSDP: N shards; HSDP: N/R shards x R replicas; DDP: one piece on every rank."""
    if name == "fsdp":
        return Layout(name, world, world)
    if name == "ddp":
        return Layout(name, world, 1)
    if world % replicas:
        raise SystemExit(f"--ranks {world} is not a multiple of --replicas {replicas}")
    return Layout(name, world, world // replicas)


def local_chunk(size: torch.Size, shards: int, shard: int) -> ChunkStorageMetadata:
    """DTensor ``Shard(0)``'s piece (torch.chunk semantics: ceil(dim0 / shards) rows, trailing
    pieces short or empty; an empty piece sits at offset dim0, as DTensor places it)."""
    rows = -(-size[0] // shards)
    start = shard * rows
    length = max(0, min(rows, size[0] - start))
    offsets = torch.Size((start if length else size[0], *([0] * (len(size) - 1))))
    return ChunkStorageMetadata(offsets=offsets, sizes=torch.Size((length, *size[1:])))


def local_save_plan(
    tensors: list[SimTensor], layout: Layout, rank: int, mapping: dict[str, tuple[str, ...]]
) -> SavePlan:
    """What `DefaultSavePlanner.create_local_plan` returns on `rank` (values, then tensors)."""
    items = [WriteItem(index=MetadataIndex(fqn), type=WriteItemType.BYTE_IO) for fqn in VALUES]
    kind = WriteItemType.TENSOR if layout.shards == 1 else WriteItemType.SHARD
    shard = layout.shard_of(rank)
    for tensor in tensors:
        chunk = local_chunk(tensor.size, layout.shards, shard)
        items.append(
            WriteItem(
                index=MetadataIndex(tensor.fqn, chunk.offsets),
                type=kind,
                tensor_data=TensorWriteData(chunk=chunk, properties=FLOAT32, size=tensor.size),
            )
        )
    return SavePlan(items, planner_data=mapping)


def write_results(
    plan: SavePlan, rank: int, step: int, block_size: int, rng: random.Random
) -> list[WriteResult]:
    """What `ObjectStoreWriter.write_data` returns for `plan` on `rank`, without the data: the
    real safetensors header length, byte offsets, and a (random) CRC32C per block."""
    if not plan.items:
        return []
    assignment = plan.storage_data
    if not isinstance(assignment, RankAssignment):
        raise TypeError("the plan has no key assignment")
    ordered = sorted(plan.items, key=lambda i: i.type != WriteItemType.BYTE_IO)
    specs = [_spec(item) for item in ordered]
    position = len(encode_header(specs, {"format": "pt", "spotckpt.step": str(step)}))
    stored = []
    for spec in specs:
        blocks = max(1, -(-spec.nbytes // block_size))
        crcs = tuple(rng.getrandbits(32) for _ in range(blocks))
        stored.append((position, spec.nbytes, crcs))
        position += spec.nbytes
    record = ObjectRecord(key=assignment.key, size=position, crc32c=rng.getrandbits(32), rank=rank)
    return [
        WriteResult(
            index=item.index,
            size_in_bytes=length,
            storage_data=WrittenItem(
                ChunkLocation(key=assignment.key, offset=offset, length=length, block_crc32c=crcs),
                record,
            ),
        )
        for item, (offset, length, crcs) in zip(ordered, stored, strict=True)
    ]


def _spec(item: WriteItem) -> TensorSpec:
    """The item as the rank's safetensors header names it (the writer's own naming)."""
    if item.type == WriteItemType.BYTE_IO:
        return TensorSpec(_item_name(item), dtype_of(torch.uint8), (VALUES[item.index.fqn],))
    data = item.tensor_data
    if data is None:
        raise TypeError(f"{item.index.fqn} has no tensor data")
    return TensorSpec(_item_name(item), dtype_of(data.properties.dtype), tuple(data.chunk.sizes))


class LocalPiece(torch.Tensor):
    """Stands for a rank's local tensor in a load, without data (a wrapper tensor with no
    storage): DCP asks it only for its global size and its chunk, through the
    `__create_chunk_list__` protocol that DTensor implements."""

    _chunk: ChunkStorageMetadata

    @staticmethod
    def __new__(cls, size: torch.Size, chunk: ChunkStorageMetadata) -> LocalPiece:
        piece = torch.Tensor._make_wrapper_subclass(cls, size, dtype=torch.float32)
        piece._chunk = chunk
        return piece

    def __create_chunk_list__(self) -> list[ChunkStorageMetadata]:
        return [self._chunk]

    @classmethod
    def __torch_dispatch__(  # type: ignore[override]
        cls, func: Any, types: Any, args: Any = (), kwargs: Any = None
    ) -> Any:
        raise TypeError(f"{func} needs data; a LocalPiece has none (planning only)")


def restore_state_dict(tensors: list[SimTensor], layout: Layout, rank: int) -> dict[str, Any]:
    """The flat state dict a restoring `rank` of the same layout loads into."""
    state: dict[str, Any] = dict.fromkeys(VALUES, 0)
    for tensor in tensors:
        chunk = local_chunk(tensor.size, layout.shards, layout.shard_of(rank))
        state[tensor.fqn] = LocalPiece(tensor.size, chunk)
    return state


@contextlib.contextmanager
def dcp_validation(enabled: bool) -> Iterator[None]:
    """DCP's global-plan validation as it is, or (not `enabled`) replaced by a pass."""
    if enabled:
        yield
        return
    import torch.distributed.checkpoint.default_planner as default_planner

    original = default_planner._validate_global_plan
    default_planner._validate_global_plan = lambda *args: []  # no validation errors
    try:
        yield
    finally:
        default_planner._validate_global_plan = original


class TimedSavePlanner(DefaultSavePlanner):
    """DCP's default save planner, timing the dedup step of its global plan on the way."""

    dedup_s: float | None = None

    def _dedup_save_plans(self, all_plans: list[SavePlan]) -> list[SavePlan]:
        started = clock()
        plans = super()._dedup_save_plans(all_plans)
        self.dedup_s = clock() - started
        return plans


# The simulation --------------------------------------------------------------------------------


@dataclass
class Settings:
    """One simulated configuration."""

    ranks: int
    tensors: int
    layout: str
    steps: int
    replicas: int = 8
    hidden: int = 4096
    objects_per_step: int = 4
    block_size: int = DEFAULT_BLOCK_SIZE
    seed: int = 0
    gc: bool = False
    dcp_validation: bool = True  # False: the global plan check is not run (docs/scale.md)
    planner: str = "spotckpt"  # or "dcp": DCP's default save planner


@dataclass
class Report:
    """Every figure of one run, in the order printed."""

    values: dict[str, Any] = field(default_factory=dict)
    progress: bool = False
    started: float = field(default_factory=time.perf_counter)

    def add(self, **figures: Any) -> None:
        """Record figures (floats rounded for reading)."""
        for name, value in figures.items():
            self.values[name] = round(value, 6) if isinstance(value, float) else value

    def mark(self, phase: str) -> None:
        """With `progress`, a line on stderr: the phase done, time so far, resident memory."""
        if self.progress:
            print(
                f"[scale] {phase} done at {time.perf_counter() - self.started:.1f} s, "
                f"RSS {resident_mib():,.0f} MiB (peak "
                f"{resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:,.0f})",
                file=sys.stderr,
                flush=True,
            )


def resident_mib() -> float:
    """This process's resident memory now (Linux), else its peak."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def timed(action: Callable[..., Any], *args: Any) -> tuple[Any, float]:
    """`action(*args)` and its wall seconds."""
    started = clock()
    result = action(*args)
    return result, clock() - started


def unpickle_all(blobs: list[bytes]) -> list[Any]:
    """What the coordinator does with gathered objects: unpickle each rank's."""
    return [pickle.loads(blob) for blob in blobs]


def simulate_save(
    settings: Settings,
    tensors: list[SimTensor],
    layout: Layout,
    store: CountingStore,
    report: Report,
) -> tuple[str, Metadata, list[Any], list[SavePlan]]:
    """Local plans -> rank 0's gather and global plan -> key assignment -> per-rank results ->
    the gather of what `rank_phase` returns. Returns the attempt, the global metadata, the
    gathered outputs and the final plans (rank 0 keeps them through the save, as DCP does)."""
    step = settings.steps + 1
    mapping = {t.fqn: t.path for t in tensors} | {v: tuple(v.split(".", 1)) for v in VALUES}
    report.add(local_plan_items=layout.world * (len(tensors) + len(VALUES)))
    report.add(planner=settings.planner, dcp_validation=settings.dcp_validation)
    if settings.planner == "dcp":
        plans, metadata = dcp_global_plan(settings, store, step, tensors, layout, mapping, report)
    else:
        plans, metadata = spotckpt_global_plan(
            settings, store, step, tensors, layout, mapping, report
        )
    rng = random.Random(settings.seed)
    rank_s = 0.0
    with paused_gc():
        blobs = []
        for rank, plan in enumerate(plans):
            results = write_results(plan, rank, step, settings.block_size, rng)
            began = clock()
            output = rank_phase(store, step, rank, results, plan.items)
            rank_s = max(rank_s, clock() - began)
            blobs.append(pickle.dumps(output))
    report.add(rank_phase_max_s=rank_s, results_gather_bytes=sum(map(len, blobs)))
    report.mark("write results")
    gathered, unpickle_s = timed(unpickle_all, blobs)
    del blobs
    report.add(results_unpickle_s=unpickle_s)
    report.mark("results gathered")
    assignment = plans[0].storage_data
    attempt = assignment.attempt if isinstance(assignment, RankAssignment) else "unknown"
    return attempt, metadata, gathered, plans


def dcp_global_plan(
    settings: Settings,
    store: CountingStore,
    step: int,
    tensors: list[SimTensor],
    layout: Layout,
    mapping: dict[str, tuple[str, ...]],
    report: Report,
) -> tuple[list[SavePlan], Metadata]:
    """DCP's default planner: every rank's full plan gathered, planned and checked by DCP.
    Returns the final plans and the metadata."""
    with paused_gc():
        blobs = [
            pickle.dumps(local_save_plan(tensors, layout, rank, mapping))
            for rank in range(layout.world)
        ]
    report.add(dcp_plan_gather_bytes=sum(map(len, blobs)))
    report.mark("local plans")
    all_plans, unpickle_s = timed(unpickle_all, blobs)
    del blobs
    planner = TimedSavePlanner()
    with dcp_validation(settings.dcp_validation):
        (global_plans, metadata), global_s = timed(planner.create_global_plan, all_plans)
    report.mark("DCP global plan")
    del all_plans
    report.add(
        dcp_plan_unpickle_s=unpickle_s, dcp_global_plan_s=global_s, dcp_dedup_s=planner.dedup_s
    )
    plans, assign_s = timed(key_assignment_phase, store, step, global_plans)
    report.add(spotckpt_key_assignment_s=assign_s)
    return plans, metadata


def spotckpt_global_plan(
    settings: Settings,
    store: CountingStore,
    step: int,
    tensors: list[SimTensor],
    layout: Layout,
    mapping: dict[str, tuple[str, ...]],
    report: Report,
) -> tuple[list[SavePlan], Metadata]:
    """spotckpt's `ScalingSavePlanner`: each rank sends a compact summary; the coordinator plans
    and checks on arrays (timed, then once more under tracemalloc for its peak with the gathered
    bytes); then a second save whose plans did not change (each rank sends a digest). Returns
    the final plans of the first save and its metadata."""
    caches = [PlanCache() for _ in range(layout.world)]  # one per simulated process

    def gather() -> tuple[list[bytes], list[bytes]]:
        blobs, digests = [], []
        for rank in range(layout.world):
            summary = summarize(local_save_plan(tensors, layout, rank, mapping))
            sent = caches[rank].to_send(summary)
            blobs.append(pickle.dumps(SavePlan([], planner_data=sent)))
            digests.append(summary.digest)
        return blobs, digests

    with paused_gc():
        blobs, digests = gather()
    report.add(dcp_plan_gather_bytes=sum(map(len, blobs)))
    report.mark("local plans")
    all_plans, unpickle_s = timed(unpickle_all, blobs)
    planner = ScalingSavePlanner(caches[0])
    (global_plans, metadata), global_s = timed(planner.create_global_plan, all_plans)
    del all_plans
    report.add(dcp_plan_unpickle_s=unpickle_s, dcp_global_plan_s=global_s, dcp_dedup_s=None)
    report.mark("spotckpt global plan")
    gc.collect()
    tracemalloc.start()
    ScalingSavePlanner(PlanCache()).create_global_plan(unpickle_all(blobs))
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    report.add(peak_planning_mib=(peak + sum(map(len, blobs))) / MIB)
    report.mark("traced global plan")
    del blobs
    plans, assign_s = timed(key_assignment_phase, store, step, global_plans)
    report.add(spotckpt_key_assignment_s=assign_s)
    finals = []
    for rank, (central, digest) in enumerate(zip(plans, digests, strict=True)):
        finals.append(apply_global(local_save_plan(tensors, layout, rank, mapping), central))
        caches[rank].promote(digest)
    with paused_gc():
        blobs, _ = gather()
    all_plans, again_unpickle_s = timed(unpickle_all, blobs)
    (_, cached_metadata), again_s = timed(planner.create_global_plan, all_plans)
    report.add(
        cached_plan_gather_bytes=sum(map(len, blobs)),
        cached_plan_unpickle_s=again_unpickle_s,
        cached_global_plan_s=again_s,
        cached_plan_reused=cached_metadata is metadata,
    )
    report.mark("cached global plan")
    return finals, metadata


def measure_commit(
    settings: Settings,
    store: CountingStore,
    attempt: str,
    metadata: Metadata,
    gathered: list[Any],
    report: Report,
) -> None:
    """The commit phase once timed, then once more under tracemalloc (on a store of its own) for
    the peak of what it allocates, both with the root built in full (a first save); then once
    more timed with the layout's tensors cached (`ROOT_CACHE`), as a later save whose layout did
    not change commits."""
    step = settings.steps + 1
    ROOT_CACHE.clear()
    outcome = commit_phase(store, step, attempt, metadata, gathered)
    chunks = sum(len(getattr(e, "chunks", ())) for e in metadata.state_dict_metadata.values())
    report.add(
        chunks=chunks,
        commit_s=outcome.seconds,
        commit_build_s=outcome.build_s,
        commit_encode_s=outcome.encode_s,
        commit_put_s=outcome.put_s,
        commit_us_per_chunk=outcome.seconds / max(1, chunks) * 1e6,
        manifest_bytes=outcome.manifest_bytes,
        index_parts_bytes=outcome.index_bytes,
    )
    report.mark("commit")
    gc.collect()
    traced = CountingStore("traced")
    cached = CountingStore("cached")
    for key, size in indexed_references(gathered).items():
        traced.stand_in(step_key(step, key), size)
        cached.stand_in(step_key(step, key), size)
    ROOT_CACHE.clear()
    tracemalloc.start()
    commit_phase(traced, step, attempt, metadata, gathered)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    report.add(peak_coordinator_mib=peak / MIB)
    report.mark("traced commit")
    hits = ROOT_CACHE.hits
    again = commit_phase(cached, step, attempt, metadata, gathered)
    report.add(cached_commit_s=again.seconds, cached_commit_reused=ROOT_CACHE.hits > hits)
    report.mark("cached commit")
    values = report.values
    values["spotckpt_coordinator_s"] = round(
        values["spotckpt_key_assignment_s"] + outcome.seconds, 6
    )
    after_plan = values["spotckpt_key_assignment_s"] + values["results_unpickle_s"]
    after_plan += outcome.seconds
    values["first_save_coordinator_s"] = round(
        values["dcp_plan_unpickle_s"] + values["dcp_global_plan_s"] + after_plan, 6
    )
    if "cached_global_plan_s" in values:
        again_after_plan = values["spotckpt_key_assignment_s"] + values["results_unpickle_s"]
        values["cached_save_coordinator_s"] = round(
            values["cached_plan_unpickle_s"]
            + values["cached_global_plan_s"]
            + again_after_plan
            + again.seconds,
            6,
        )


def measure_restore(
    settings: Settings,
    tensors: list[SimTensor],
    layout: Layout,
    store: CountingStore,
    report: Report,
) -> None:
    """Rank 0 of the same layout restores: metadata read and parse, DCP's local load plan,
    spotckpt's byte ranges."""
    step = settings.steps + 1
    wanted = restore_state_dict(tensors, layout, 0)
    store.reset_counts()
    outcome = restore_phase(store, step, 0, wanted)
    report.add(
        restore_metadata_bytes_per_rank=outcome.metadata_bytes,
        restore_metadata_bytes_job=outcome.metadata_bytes * layout.world,
        restore_fetch_s=outcome.fetch_s,
        restore_parse_s=outcome.parse_s if outcome.reader else None,
        restore_requests=sum(v for k, v in store.counts().items() if k != "list_keys"),
        restore_error=outcome.error,
    )
    reader = outcome.reader
    if reader is None:
        report.add(dcp_load_plan_s=None, spotckpt_restore_plan_s=None, restore_read_items=None)
        return
    planner = DefaultLoadPlanner()

    def load_plan() -> LoadPlan:
        planner.set_up_planner(wanted, reader.read_metadata(), False)
        return planner.create_local_plan()

    report.mark("restore metadata")
    plan, load_s = timed(load_plan)
    ranges, ranges_s = timed(lambda: reader.byte_ranges(reader.prepare_local_plan(plan)))
    report.add(
        dcp_load_plan_s=load_s,
        spotckpt_restore_plan_s=ranges_s,
        restore_read_items=len(plan.items),
        restore_ranged_gets=sum(len(r) for r in ranges.values()),
    )
    report.mark("restore planning")


def measure_listing(settings: Settings, report: Report) -> None:
    """`latest` and one `retire(keep_last=3)` over `steps` committed steps."""
    store = CountingStore("history")
    populate_history(store, settings.steps, settings.objects_per_step)
    outcome = listing_phase(store, KEEP_LAST)
    report.add(
        objects_per_step=settings.objects_per_step,
        history_objects=settings.steps * (settings.objects_per_step + 1),
        list_requests_latest=outcome.latest_requests.get("list", 0),
        list_keys_latest=outcome.latest_requests.get("list_keys", 0),
        latest_s=outcome.latest_s,
        list_requests_retention=outcome.retention_requests.get("list", 0),
        list_keys_retention=outcome.retention_requests.get("list_keys", 0),
        delete_requests_retention=outcome.retention_requests.get("delete", 0),
        retention_s=outcome.retention_s,
        retired_steps=outcome.retired,
    )
    report.mark("listing")


class paused_gc:
    """Context: the cyclic garbage collector off inside, as it was before afterwards."""

    def __enter__(self) -> None:
        self.was_enabled = gc.isenabled()
        gc.disable()

    def __exit__(self, *exc: object) -> None:
        if self.was_enabled:
            gc.enable()


def run(settings: Settings, progress: bool = False) -> dict[str, Any]:
    """Simulate one configuration; every figure in one flat dict. The cyclic garbage collector
    is off throughout (a full collection runs between phases) unless `settings.gc`."""
    if settings.gc:
        return simulate(settings, progress)
    with paused_gc():
        return simulate(settings, progress)


def simulate(settings: Settings, progress: bool) -> dict[str, Any]:
    """The phases in order (see `run`)."""
    started = time.perf_counter()
    layout = make_layout(settings.layout, settings.ranks, settings.replicas)
    tensors = model_tensors(settings.tensors, settings.hidden)
    report = Report(progress=progress)
    report.add(baseline_rss_mib=resident_mib())
    report.add(
        ranks=settings.ranks,
        tensors=settings.tensors,
        values=len(VALUES),
        layout=settings.layout,
        shards=layout.shards,
        replicas=layout.replicas,
        hidden=settings.hidden,
        steps=settings.steps,
        checkpoint_bytes=sum(t.size.numel() * 4 for t in tensors) + sum(VALUES.values()),
    )
    store = CountingStore("checkpoint")
    attempt, metadata, gathered, plans = simulate_save(settings, tensors, layout, store, report)
    gc.collect()
    measure_commit(settings, store, attempt, metadata, gathered, report)
    del gathered, plans, metadata
    gc.collect()
    measure_restore(settings, tensors, layout, store, report)
    measure_listing(settings, report)
    report.add(
        peak_rss_mib=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        simulate_s=time.perf_counter() - started,
    )
    return report.values


# The sweep -------------------------------------------------------------------------------------


@dataclass
class Case:
    """One run of the sweep: its settings, then its figures or why it was skipped."""

    settings: Settings
    figures: dict[str, Any] | None = None
    skipped: str | None = None


def case_command(settings: Settings) -> list[str]:
    """The command line that runs one configuration."""
    return [
        sys.executable,
        str(Path(__file__).resolve()),
        f"--ranks={settings.ranks}",
        f"--tensors={settings.tensors}",
        f"--layout={settings.layout}",
        f"--steps={settings.steps}",
        f"--replicas={settings.replicas}",
        f"--hidden={settings.hidden}",
        f"--objects-per-step={settings.objects_per_step}",
        f"--planner={settings.planner}",
        "--json",
    ]


def estimate(case: Case, done: list[Case]) -> tuple[float, float] | None:
    """(peak RSS MiB, seconds) of `case`, scaled linearly in local plan items from the largest
    finished case of its layout (memory above the process's baseline); None when there is
    none."""
    same = [c for c in done if c.figures and c.settings.layout == case.settings.layout]
    if not same:
        return None
    base = max(same, key=lambda c: c.settings.ranks * c.settings.tensors)
    if base.figures is None:
        return None
    scale = (case.settings.ranks * case.settings.tensors) / (
        base.settings.ranks * base.settings.tensors
    )
    baseline = base.figures["baseline_rss_mib"]
    rss = baseline + (base.figures["peak_rss_mib"] - baseline) * scale
    return rss, base.figures["simulate_s"] * scale


def run_case(case: Case, done: list[Case], max_rss_mib: float, timeout_s: float) -> None:
    """Run one case in a child process unless its estimate exceeds the budgets."""
    guess = estimate(case, done)
    if guess is not None and guess[0] > max_rss_mib:
        case.skipped = (
            f"estimated peak RSS {guess[0] / 1024:.1f} GiB > {max_rss_mib / 1024:.0f} GiB"
        )
        return
    if guess is not None and guess[1] > timeout_s:
        case.skipped = f"estimated {guess[1] / 60:.0f} min > {timeout_s / 60:.0f} min"
        return
    try:
        proc = subprocess.run(
            case_command(case.settings), capture_output=True, text=True, timeout=timeout_s
        )
    except subprocess.TimeoutExpired:
        case.skipped = f"ran past {timeout_s / 60:.0f} min"
        return
    if proc.returncode != 0:
        last = proc.stderr.strip().splitlines()[-1:] or ["no message"]
        case.skipped = f"failed (exit status {proc.returncode}): {last[0][:200]}"
        return
    case.figures = json.loads(proc.stdout)
    print(
        f"  done: {case.settings.layout} N={case.settings.ranks} T={case.settings.tensors} "
        f"S={case.settings.steps} in {case.figures['simulate_s']:.0f} s",
        file=sys.stderr,
    )


def _mib(value: float | None) -> str:
    return "-" if value is None else f"{value / MIB:,.1f}"


def _s(value: float | None) -> str:
    return "-" if value is None else f"{value:,.3f}"


def save_table(cases: list[Case]) -> list[str]:
    """Markdown rows of the coordinator's save costs."""
    lines = [
        "| layout | N | T | stored chunks | plans gathered MiB | DCP unpickle s | "
        "DCP global plan s (dedup s) | spotckpt keys s | results gathered MiB | "
        "results unpickle s | commit s | commit us/chunk | manifest MiB | peak coordinator MiB |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for case in cases:
        s, f = case.settings, case.figures
        if f is None:
            lines.append(
                f"| {s.layout} | {s.ranks} | {s.tensors} | skipped: {case.skipped} |" + " |" * 10
            )
            continue
        lines.append(
            f"| {s.layout} | {s.ranks} | {s.tensors} | {f['chunks']:,} | "
            f"{_mib(f['dcp_plan_gather_bytes'])} | {_s(f['dcp_plan_unpickle_s'])} | "
            f"{_s(f['dcp_global_plan_s'])} ({_s(f['dcp_dedup_s'])}) | "
            f"{_s(f['spotckpt_key_assignment_s'])} | {_mib(f['results_gather_bytes'])} | "
            f"{_s(f['results_unpickle_s'])} | {_s(f['commit_s'])} | "
            f"{f['commit_us_per_chunk']:.1f} | {_mib(f['manifest_bytes'])} | "
            f"{f['peak_coordinator_mib']:,.0f} |"
        )
    return lines


def restore_table(cases: list[Case]) -> list[str]:
    """Markdown rows of one restoring rank's costs."""
    lines = [
        "| layout | N | T | metadata MiB per rank | all ranks GiB | fetch + parse s | "
        "DCP load plan s | spotckpt read plan s | read items |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for case in cases:
        s, f = case.settings, case.figures
        if f is None:
            lines.append(f"| {s.layout} | {s.ranks} | {s.tensors} | skipped |" + " |" * 5)
            continue
        parse = f["restore_parse_s"]
        total = None if parse is None else f["restore_fetch_s"] + parse
        error = f["restore_error"]
        lines.append(
            f"| {s.layout} | {s.ranks} | {s.tensors} | {_mib(f['restore_metadata_bytes_per_rank'])}"
            f" | {f['restore_metadata_bytes_job'] / (1 << 30):,.1f} | "
            + (f"refused: {error.split(';')[0]}" if error else _s(total))
            + f" | {_s(f['dcp_load_plan_s'])} | {_s(f['spotckpt_restore_plan_s'])} | "
            f"{f['restore_read_items'] if f['restore_read_items'] is not None else '-'} |"
        )
    return lines


def listing_table(cases: list[Case]) -> list[str]:
    """Markdown rows of the listing costs by history length."""
    lines = [
        "| committed steps | objects per step | keys | `latest()` list requests | `latest()` s | "
        "retention list requests | keys listed by retention | retention delete requests | "
        "retention s | retired |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for case in cases:
        s, f = case.settings, case.figures
        if f is None:
            lines.append(
                f"| {s.steps:,} | {s.objects_per_step:,} | skipped: {case.skipped} |" + " |" * 7
            )
            continue
        lines.append(
            f"| {f['steps']:,} | {f['objects_per_step']:,} | {f['history_objects']:,} | "
            f"{f['list_requests_latest']:,} | {_s(f['latest_s'])} | "
            f"{f['list_requests_retention']:,} | {f['list_keys_retention']:,} | "
            f"{f['delete_requests_retention']:,} | {_s(f['retention_s'])} | "
            f"{f['retired_steps']:,} |"
        )
    return lines


def sweep(args: argparse.Namespace) -> None:
    """Run the grid in child processes (smallest first) and print the markdown tables."""
    cases = [
        Case(
            Settings(
                n, t, layout, args.sweep_steps[0], args.replicas, args.hidden, args.objects_per_step
            )
        )
        for n, t, layout in itertools.product(args.sweep_ranks, args.sweep_tensors, args.layouts)
    ]
    cases.sort(key=lambda c: (c.settings.ranks * c.settings.tensors, c.settings.layout))
    done: list[Case] = []
    for case in cases:
        run_case(case, done, args.max_rss_mib, args.case_timeout_s)
        done.append(case)
    listings = [
        Case(Settings(8, 20, "fsdp", steps, objects_per_step=objects))
        for objects, steps in itertools.product(args.sweep_objects, args.sweep_steps)
    ]
    for case in listings:
        keys = case.settings.steps * (case.settings.objects_per_step + 1)
        if keys > MAX_HISTORY_KEYS:
            case.skipped = f"{keys:,} keys: more than {MAX_HISTORY_KEYS:,} held in memory"
        else:
            run_case(case, [], args.max_rss_mib, args.case_timeout_s)
    ordered = sorted(cases, key=lambda c: (c.settings.layout, c.settings.ranks, c.settings.tensors))
    if args.sweep_json:
        records = [dataclasses.asdict(case) for case in [*ordered, *listings]]
        Path(args.sweep_json).write_text(json.dumps(records, indent=1))
    print(
        "\n".join(
            [
                "### Save (coordinator, rank 0)",
                "",
                *save_table(ordered),
                "",
                "### Restore (one rank)",
                "",
                *restore_table(ordered),
                "",
                "### Listing",
                "",
                *listing_table(listings),
            ]
        )
    )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line (see the module docstring)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, default=64)
    parser.add_argument("--tensors", type=int, default=500)
    parser.add_argument("--layout", choices=("fsdp", "hsdp", "ddp"), default="fsdp")
    parser.add_argument("--steps", type=int, default=10, help="committed steps in the history")
    parser.add_argument("--replicas", type=int, default=8, help="HSDP replicas")
    parser.add_argument("--hidden", type=int, default=4096, help="model width d")
    parser.add_argument(
        "--objects-per-step",
        type=int,
        default=4,
        help="rank objects per committed step of the history",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument(
        "--no-dcp-validation",
        action="store_true",
        help="skip DCP's global-plan overlap check (quadratic in ranks for FSDP): for the "
        "largest cases, to measure everything else in minutes",
    )
    parser.add_argument(
        "--planner",
        choices=("spotckpt", "dcp"),
        default="spotckpt",
        help="the save planner: spotckpt's ScalingSavePlanner (compact plans, its own check, a "
        "second save with cached plans) or DCP's DefaultSavePlanner",
    )
    parser.add_argument("--progress", action="store_true", help="phase lines on stderr")
    parser.add_argument(
        "--gc", action="store_true", help="keep the cyclic garbage collector on in the phases"
    )
    parser.add_argument("--sweep", action="store_true", help="run the grid, print markdown")
    parser.add_argument("--sweep-ranks", type=int, nargs="+", default=[64, 512, 4096])
    parser.add_argument("--sweep-tensors", type=int, nargs="+", default=[500, 2000])
    parser.add_argument("--sweep-steps", type=int, nargs="+", default=[10, 1000, 10000])
    parser.add_argument("--layouts", nargs="+", default=["fsdp", "hsdp", "ddp"])
    parser.add_argument(
        "--sweep-objects",
        type=int,
        nargs="+",
        default=[4, 4097],
        help="sweep: rank objects per step of the listing histories",
    )
    parser.add_argument(
        "--max-rss-mib",
        type=float,
        default=10 * 1024,
        help="sweep: skip cases estimated to need more",
    )
    parser.add_argument("--case-timeout-s", type=float, default=1800)
    parser.add_argument("--sweep-json", help="sweep: also write every case's figures here")
    args = parser.parse_args(argv)
    if min(args.ranks, args.tensors, args.replicas, args.hidden) < 1 or args.steps < KEEP_LAST:
        parser.error(f"sizes must be positive and --steps at least {KEEP_LAST}")
    return args


def main(argv: list[str] | None = None) -> None:
    """Entry point."""
    args = parse_args(argv)
    if args.sweep:
        sweep(args)
        return
    figures = run(
        Settings(
            args.ranks,
            args.tensors,
            args.layout,
            args.steps,
            args.replicas,
            args.hidden,
            args.objects_per_step,
            gc=args.gc,
            dcp_validation=not args.no_dcp_validation,
            planner=args.planner,
        ),
        progress=args.progress,
    )
    if args.json:
        print(json.dumps(figures))
    else:
        for name, value in figures.items():
            print(f"{name}: {value}")


if __name__ == "__main__":
    main()
