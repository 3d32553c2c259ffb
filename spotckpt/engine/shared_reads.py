"""Shared reads: a tensor piece that several ranks load is read from the bucket once.

DDP replicas, and the replicated dimension of HSDP, load the same pieces on every replica. When
the coordinator plans the load (`plan_shared_reads`, from the reader's ``prepare_global_plan``),
each piece wanted by more than one rank goes to one of them (the least loaded so far, for
balance); in ``read_data`` that rank reads it and broadcasts it to the others (`exchange`), so a
restart reads the checkpoint about once, whatever the number of replicas. Every rank takes part
in every broadcast, in the same order: the plan lists them identically on all ranks. A rank whose
own reads failed still takes part in the agreement before them: then no rank broadcasts, every
rank returns, and DCP reports the failure on every rank (a source that left the broadcasts
would hold its peers until the group's timeout).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem

from spotckpt.format.dtypes import BY_NAME, dtype_of

Shape = tuple[str, tuple[int, ...]]
"""A stored chunk's dtype (manifest name) and sizes."""


class StoredShapes(Mapping[MetadataIndex, Shape]):
    """Each stored chunk's dtype and sizes by storage index, looked up in the load's metadata
    when a read needs them. Made for every chunk up front, the map cost a tenth of a restore of
    20,000 small tensors (a DCP index and a torch.Size each), most of which load as runs and
    never look theirs up."""

    def __init__(self, metadata: Metadata) -> None:
        self.metadata = metadata
        self._chunks: dict[str, dict[tuple[int, ...], tuple[int, ...]]] = {}

    def __getitem__(self, index: MetadataIndex) -> Shape:
        stored = self.metadata.state_dict_metadata.get(index.fqn)
        if not isinstance(stored, TensorStorageMetadata) or index.offset is None:
            raise KeyError(index)
        chunks = self._chunks.get(index.fqn)
        if chunks is None:  # once per tensor: a tensor's chunks may be thousands
            chunks = {tuple(c.offsets): tuple(c.sizes) for c in stored.chunks}
            self._chunks[index.fqn] = chunks
        return dtype_of(stored.properties.dtype).name, chunks[tuple(index.offset)]

    def __iter__(self) -> Iterator[MetadataIndex]:
        for fqn, stored in self.metadata.state_dict_metadata.items():
            if isinstance(stored, TensorStorageMetadata):
                yield from (MetadataIndex(fqn, chunk.offsets) for chunk in stored.chunks)

    def __len__(self) -> int:
        tensors = self.metadata.state_dict_metadata.values()
        return sum(len(s.chunks) for s in tensors if isinstance(s, TensorStorageMetadata))


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


def read_key(item: ReadItem) -> tuple[Any, ...]:
    """What names a read item's piece alike on every rank (the shared-read plan's key)."""
    index = item.storage_index
    return (
        index.fqn,
        tuple(index.offset or ()),
        tuple(item.storage_offsets),
        tuple(item.lengths),
    )


def plan_shared_reads(
    plans: list[LoadPlan], chunk_sizes: Mapping[MetadataIndex, Shape]
) -> list[LoadPlan]:
    """Every rank's plan with the pieces others read for it removed, and the shared-read plan
    as its storage data (`chunk_sizes`: each stored chunk's dtype and sizes)."""
    wanted: dict[tuple[Any, ...], list[tuple[int, ReadItem]]] = {}
    for rank, plan in enumerate(plans):
        for item in plan.items:
            if item.type != LoadItemType.BYTE_IO:
                wanted.setdefault(read_key(item), []).append((rank, item))
    load = [0] * len(plans)
    reads: list[SharedRead] = []
    dropped: list[set[int]] = [set() for _ in plans]  # id() of items others read for them
    for key in sorted(k for k, ranks in wanted.items() if len(ranks) > 1):
        holders = wanted[key]
        item = holders[0][1]
        dtype, _sizes = chunk_sizes[item.storage_index]
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
                {read_key(i): i for i in plan.items if id(i) in dropped[rank]},
            ),
        )
        for rank, plan in enumerate(plans)
    ]


def exchange(
    plan: LoadPlan, shared: SharedReads, planner: LoadPlanner, group: Any, *, failed: bool
) -> None:
    """Broadcast each shared piece from its reader; every rank takes part in every one, unless
    some rank's own reads `failed` (agreed first: then none does)."""
    if not shared.reads:
        return
    flag = torch.tensor([1 if failed else 0], dtype=torch.int32)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
    if flag.item():
        return
    rank = dist.get_rank(group)
    mine = {read_key(i): i for i in plan.items}
    for read in shared.reads:
        dtype = BY_NAME[read.dtype].torch_dtype
        if read.source == rank:
            buffer = planner.resolve_tensor(mine[read.key]).detach().contiguous()
        else:
            buffer = torch.empty(read.lengths, dtype=dtype)
        dist.broadcast(buffer, src=dist.get_global_rank(group, read.source), group=group)
        item = shared.receive.get(read.key)
        if item is not None:
            target = planner.resolve_tensor(item).detach()
            target.copy_(buffer.view(target.shape))
            planner.commit_tensor(item, target)
