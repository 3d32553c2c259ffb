"""The coordinator's global save plan from compact local plans: bounded memory, cached plans.

DCP gathers every rank's `SavePlan` on the coordinator: a Python object per item, about 2 KiB
each, so 4,096 ranks x 2,000 tensors hold some 15 GiB on rank 0, and its default planner then
deduplicates, builds the metadata (an object per chunk) and checks the plan in Python.

Here a rank sends its plan as a `LocalSummary` instead: the part that ranks of one layout share
(item names, kinds, tensor properties and global shapes, the flattening mapping) as one
compressed blob, and its chunks' offsets and sizes as compressed int64 arrays. The coordinator
decodes each distinct shared blob once, works on arrays of all chunks of the job
(`plan_global`): DCP's deduplication of replicated items (each kept by the holder with the least
planned bytes so far), the metadata (`ChunkList`: the chunks of a tensor as arrays, read by
DCP's interface as a sequence), the plan's check (`spotckpt.engine.plan_check`), and for every
rank a `Kept` mask of its own items. The rank keeps its full plan and applies the mask
(`apply_global`).

`PlanCache` remembers, on each rank, the digest of the last plan the coordinator accepted, and on
the coordinator those plans and their outcome: a later save whose plans did not change sends
a digest per rank (`Unchanged`) and reuses the outcome without decoding or checking anything.
A cache lives as long as its process: the first save after a restart plans in full.
"""

from __future__ import annotations

import dataclasses
import hashlib
import pickle
import zlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, overload

import numpy as np
import torch
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import SavePlan, WriteItemType

from spotckpt.engine.plan_check import tensor_errors
from spotckpt.errors import PlanningError

_TYPES = (WriteItemType.TENSOR, WriteItemType.SHARD, WriteItemType.BYTE_IO)


@dataclass(frozen=True)
class LocalSummary:
    """A rank's local plan as it travels to the coordinator."""

    digest: bytes
    shared: bytes  # zlib(pickle): names, kinds, properties, global shapes, flattening mapping
    chunks: bytes  # zlib: int64 offsets then sizes, (tensor items, width) each
    width: int


@dataclass(frozen=True)
class Unchanged:
    """A rank's local plan, the same as the one the coordinator last accepted from it."""

    digest: bytes


@dataclass(frozen=True)
class Kept:
    """The coordinator's answer to one rank: which of its items it writes (None: all)."""

    mask: np.ndarray | None


class ChunkList(Sequence[ChunkStorageMetadata]):
    """The chunks of one tensor as arrays, readable as DCP's list of chunk objects."""

    def __init__(self, offsets: np.ndarray, sizes: np.ndarray) -> None:
        self.arrays = (offsets, sizes)

    def __len__(self) -> int:
        return len(self.arrays[0])

    @overload
    def __getitem__(self, index: int) -> ChunkStorageMetadata: ...
    @overload
    def __getitem__(self, index: slice) -> list[ChunkStorageMetadata]: ...
    def __getitem__(self, index: int | slice) -> Any:
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        offsets, sizes = self.arrays
        return ChunkStorageMetadata(
            torch.Size(offsets[index].tolist()), torch.Size(sizes[index].tolist())
        )

    def __iter__(self) -> Iterator[ChunkStorageMetadata]:
        return (self[i] for i in range(len(self)))


def summarize(plan: SavePlan) -> LocalSummary:
    """A rank's local plan (DCP's, with its flattening mapping as planner data) for the
    coordinator."""
    shared: list[tuple[str, int, Any, tuple[int, ...] | None]] = []
    boxes = []
    for item in plan.items:
        data = item.tensor_data
        if data is None:
            shared.append((item.index.fqn, _TYPES.index(item.type), None, None))
            continue
        shared.append((item.index.fqn, _TYPES.index(item.type), data.properties, tuple(data.size)))
        boxes.append((tuple(data.chunk.offsets), tuple(data.chunk.sizes)))
    width = max((len(o) for o, _ in boxes), default=0)
    offsets = np.zeros((len(boxes), width), dtype=np.int64)
    sizes = np.zeros((len(boxes), width), dtype=np.int64)
    for row, (start, length) in enumerate(boxes):
        offsets[row, : len(start)] = start
        sizes[row, : len(length)] = length
    names = zlib.compress(pickle.dumps((shared, plan.planner_data), protocol=5), 1)
    chunks = zlib.compress(offsets.tobytes() + sizes.tobytes(), 1)
    digest = hashlib.blake2b(names + chunks + width.to_bytes(4, "little"), digest_size=16)
    return LocalSummary(digest.digest(), names, chunks, width)


@dataclass
class PlanCache:
    """What a process remembers of its last accepted save plan (see the module docstring)."""

    accepted: bytes | None = None  # on a rank: the digest the coordinator last accepted
    summaries: list[LocalSummary] = field(default_factory=list)  # on the coordinator
    outcome: tuple[list[SavePlan], Metadata] | None = None
    pending: tuple[list[LocalSummary], tuple[list[SavePlan], Metadata]] | None = None

    def to_send(self, summary: LocalSummary) -> LocalSummary | Unchanged:
        """What a rank sends: only a digest when the coordinator accepted this plan last time
        (given up until this save's plan is accepted, so that a failed save plans in full)."""
        if self.accepted == summary.digest:
            self.accepted = None
            return Unchanged(summary.digest)
        self.accepted = None
        return summary

    def promote(self, digest: bytes) -> None:
        """The global plan came back: this rank's plan (and, on the coordinator, the job's) is
        the one to compare the next save with."""
        self.accepted = digest
        if self.pending is not None:
            self.summaries, self.outcome = self.pending
            self.pending = None


def plan_global(
    sent: Sequence[LocalSummary | Unchanged], cache: PlanCache
) -> tuple[list[SavePlan], Metadata]:
    """The coordinator's global plan: per rank a plan carrying `Kept`, and DCP's metadata; the
    outcome is cached (promoted by `PlanCache.promote` once the plans went out)."""
    summaries = _resolve(sent, cache)
    if cache.outcome is not None and all(isinstance(s, Unchanged) for s in sent):
        plans, metadata = cache.outcome
        cache.pending = (summaries, cache.outcome)
        return plans, metadata
    outcome = _plan(summaries)
    cache.pending = (summaries, outcome)
    return outcome


def apply_global(local: SavePlan, central: SavePlan) -> SavePlan:
    """A rank's final plan: its own items that the coordinator kept, with the coordinator's
    storage data."""
    kept = central.planner_data
    if not isinstance(kept, Kept):
        raise PlanningError("the coordinator's plan carries no item mask")
    items = local.items
    if kept.mask is not None:
        if len(kept.mask) != len(items):
            raise PlanningError("the coordinator's item mask does not match this rank's plan")
        items = [item for item, keep in zip(items, kept.mask.tolist(), strict=True) if keep]
    return dataclasses.replace(local, items=items, storage_data=central.storage_data)


def _resolve(sent: Sequence[LocalSummary | Unchanged], cache: PlanCache) -> list[LocalSummary]:
    summaries = []
    for rank, entry in enumerate(sent):
        if isinstance(entry, LocalSummary):
            summaries.append(entry)
            continue
        if not isinstance(entry, Unchanged):
            raise PlanningError(f"rank {rank} sent no plan summary ({type(entry).__name__})")
        cached = cache.summaries[rank] if rank < len(cache.summaries) else None
        if cached is None or cached.digest != entry.digest or len(cache.summaries) != len(sent):
            raise PlanningError(
                f"rank {rank} sent only the digest of a plan this coordinator has not cached "
                "(it restarted since): this save fails, the next one plans in full"
            )
        summaries.append(cached)
    return summaries


@dataclass
class _Items:
    """Every item of the job, as arrays in rank-major order."""

    rank: np.ndarray
    fqn: np.ndarray  # index into names
    kind: np.ndarray
    offsets: np.ndarray
    sizes: np.ndarray
    nbytes: np.ndarray
    names: list[str]
    properties: dict[str, Any]
    shapes: dict[str, tuple[int, ...]]
    mapping: dict[str, Any]


def _decode(summaries: list[LocalSummary]) -> _Items:
    numbers: dict[str, int] = {}
    properties: dict[str, Any] = {}
    shapes: dict[str, tuple[int, ...]] = {}
    decoded: dict[bytes, tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, Any]] = {}
    width = max((s.width for s in summaries), default=0)
    ranks, fqns, kinds, offsets, sizes, itemsizes = [], [], [], [], [], []
    mappings = []
    for rank, summary in enumerate(summaries):
        if summary.shared not in decoded:
            # A summary comes from a rank of this job over the process group (as DCP's own
            # gathered plans do, pickled), never from a bucket.
            shared, flattening = pickle.loads(zlib.decompress(summary.shared))
            ids, tensor_ids = [], []
            for fqn, _kind, props, shape in shared:
                number = numbers.setdefault(fqn, len(numbers))
                ids.append(number)
                if props is not None:
                    properties.setdefault(fqn, props)
                    shapes.setdefault(fqn, shape)
                    tensor_ids.append(len(ids) - 1)
            kind_array = np.array([k for _, k, _, _ in shared], dtype=np.int8)
            element = np.array(
                [
                    0 if p is None else torch.empty((), dtype=p.dtype).element_size()
                    for _, _, p, _ in shared
                ],
                dtype=np.int64,
            )
            decoded[summary.shared] = (
                np.array(ids, dtype=np.int64),
                kind_array,
                np.array(tensor_ids, dtype=np.int64),
                element,
                flattening,
            )
            mappings.append(flattening)
        ids_a, kind_a, tensor_rows, element, _ = decoded[summary.shared]
        raw = np.frombuffer(zlib.decompress(summary.chunks), dtype=np.int64)
        boxes = raw.reshape(2, len(tensor_rows), summary.width) if summary.width else None
        count = len(ids_a)
        item_offsets = np.zeros((count, width), dtype=np.int64)
        item_sizes = np.zeros((count, width), dtype=np.int64)
        if boxes is not None:
            item_offsets[tensor_rows, : summary.width] = boxes[0]
            item_sizes[tensor_rows, : summary.width] = boxes[1]
        ranks.append(np.full(count, rank, dtype=np.int32))
        fqns.append(ids_a)
        kinds.append(kind_a)
        offsets.append(item_offsets)
        sizes.append(item_sizes)
        itemsizes.append(element)
    mapping: dict[str, Any] = {}
    for one in reversed(mappings):  # the first rank's mapping wins, as DCP's ChainMap
        mapping.update(one or {})
    all_sizes = np.concatenate(sizes) if sizes else np.zeros((0, width), np.int64)
    element_sizes = np.concatenate(itemsizes) if itemsizes else np.zeros(0, np.int64)
    nbytes = np.where(element_sizes > 0, np.prod(all_sizes, axis=1) * element_sizes, 0)
    return _Items(
        rank=np.concatenate(ranks) if ranks else np.zeros(0, np.int32),
        fqn=np.concatenate(fqns) if fqns else np.zeros(0, np.int64),
        kind=np.concatenate(kinds) if kinds else np.zeros(0, np.int8),
        offsets=np.concatenate(offsets) if offsets else np.zeros((0, width), np.int64),
        sizes=all_sizes,
        nbytes=np.maximum(nbytes, 1),  # DCP counts a value, or an empty tensor, as 1 byte
        names=list(numbers),
        properties=properties,
        shapes=shapes,
        mapping=mapping,
    )


def _dedup(items: _Items, ranks: int) -> np.ndarray:
    """Which items are written: of the items that several ranks hold (same name and offsets),
    the one of the holder with the least planned bytes so far (DCP's rule), in order of first
    appearance; items held once always."""
    count = len(items.fqn)
    keep = np.ones(count, dtype=bool)
    if not count:
        return keep
    order = np.lexsort([*items.offsets.T[::-1], items.fqn])
    keys = np.concatenate([items.fqn[order, None], items.offsets[order]], axis=1)
    starts = np.flatnonzero(np.r_[True, (keys[1:] != keys[:-1]).any(axis=1)])
    lengths = np.diff(np.r_[starts, count])
    planned = np.zeros(ranks, dtype=np.int64)
    single = order[starts[lengths == 1]]
    np.add.at(planned, items.rank[single], items.nbytes[single])
    shared = np.flatnonzero(lengths > 1)
    if not len(shared):
        return keep
    keep[:] = False
    keep[single] = True
    first = order[starts[shared]]  # stable sort: each group's first item in rank-major order
    for group in shared[np.argsort(first, kind="stable")].tolist():
        members = order[starts[group] : starts[group] + lengths[group]]
        holders = items.rank[members]
        chosen = members[int(np.argmin(planned[holders]))]
        keep[chosen] = True
        planned[items.rank[chosen]] += items.nbytes[chosen]
    return keep


def _plan(summaries: list[LocalSummary]) -> tuple[list[SavePlan], Metadata]:
    items = _decode(summaries)
    keep = _dedup(items, len(summaries))
    kept = np.flatnonzero(keep)
    by_name = kept[np.argsort(items.fqn[kept], kind="stable")]
    fqn_sorted = items.fqn[by_name]
    bounds = np.searchsorted(fqn_sorted, np.arange(len(items.names) + 1))
    entries: dict[str, Any] = {}
    errors: list[str] = []
    bytes_kind = _TYPES.index(WriteItemType.BYTE_IO)
    for number, fqn in enumerate(items.names):
        rows = by_name[bounds[number] : bounds[number + 1]]
        if len(rows) > 1 and (items.kind[rows] != _TYPES.index(WriteItemType.SHARD)).any():
            raise PlanningError(f"{fqn!r} is written by several ranks but is not a shard")
        if len(rows) and items.kind[rows[0]] == bytes_kind:
            entries[fqn] = BytesStorageMetadata()
            continue
        shape = items.shapes[fqn]
        dims = len(shape)
        offsets, sizes = items.offsets[rows, :dims], items.sizes[rows, :dims]
        entries[fqn] = TensorStorageMetadata(
            properties=items.properties[fqn],
            size=torch.Size(shape),
            chunks=ChunkList(offsets, sizes),  # type: ignore[arg-type]
        )
        errors += tensor_errors(fqn, torch.Size(shape), offsets, sizes, len(summaries) > 1)
    if errors:
        summary = "; ".join(errors)
        if len(summary) > 500:
            summary = summary[:500] + "... (truncated)"
        raise ValueError(f"Failed to validate global plan: {summary}")
    plans = []
    starts = np.searchsorted(items.rank, np.arange(len(summaries) + 1))
    for rank in range(len(summaries)):
        mask = keep[starts[rank] : starts[rank + 1]]
        plans.append(SavePlan([], planner_data=Kept(None if mask.all() else mask.copy())))
    metadata = Metadata(entries, planner_data=items.mapping)
    return plans, metadata
