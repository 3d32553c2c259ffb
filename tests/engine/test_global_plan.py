"""The compact global save plan: the same outcome as DCP's default planner, refusals included,
and unchanged plans not sent again.

Ranks are simulated in one process with DCP's own objects (the local plans DCP's default planner
makes for FSDP, HSDP and DDP layouts); an end-to-end save and restore runs through `dcp.save`
with spotckpt's writer and planner.
"""

from __future__ import annotations

import random

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import (
    SavePlan,
    TensorWriteData,
    WriteItem,
    WriteItemType,
)

from spotckpt.catalog import Catalog
from spotckpt.engine.global_plan import (
    Kept,
    PlanCache,
    Unchanged,
    apply_global,
    plan_global,
    summarize,
)
from spotckpt.engine.planners import ScalingSavePlanner
from spotckpt.engine.reader import ObjectStoreReader
from spotckpt.engine.writer import ObjectStoreWriter, WriterOptions
from spotckpt.errors import PlanningError
from spotckpt.storage.memory import MemoryStore

VALUES = ("step", "rng")


def _chunk(shape: tuple[int, ...], shards: int, shard: int) -> ChunkStorageMetadata:
    rows = -(-shape[0] // shards)
    start = shard * rows
    length = max(0, min(rows, shape[0] - start))
    offsets = (start if length else shape[0], *([0] * (len(shape) - 1)))
    return ChunkStorageMetadata(torch.Size(offsets), torch.Size((length, *shape[1:])))


def _local_plans(
    world: int, shards: int, shapes: dict[str, tuple[int, ...]], broken: int | None = None
) -> list[SavePlan]:
    """What DCP's default planner makes on each rank of a (world / shards replicas x shards)
    layout; `broken`: that rank's chunks are shifted by one row (overlapping its neighbour)."""
    plans = []
    for rank in range(world):
        items = [WriteItem(index=MetadataIndex(v), type=WriteItemType.BYTE_IO) for v in VALUES]
        kind = WriteItemType.TENSOR if shards == 1 else WriteItemType.SHARD
        for fqn, shape in shapes.items():
            chunk = _chunk(shape, shards, rank % shards)
            if rank == broken and chunk.sizes[0]:
                chunk = ChunkStorageMetadata(
                    torch.Size((chunk.offsets[0] + 1, *chunk.offsets[1:])), chunk.sizes
                )
            items.append(
                WriteItem(
                    index=MetadataIndex(fqn, chunk.offsets),
                    type=kind,
                    tensor_data=TensorWriteData(
                        chunk=chunk,
                        properties=TensorProperties(dtype=torch.bfloat16),
                        size=torch.Size(shape),
                    ),
                )
            )
        mapping = {fqn: ("model", fqn) for fqn in shapes} | {v: (v,) for v in VALUES}
        plans.append(SavePlan(items, planner_data=mapping))
    return plans


def _shapes(rng: random.Random, count: int) -> dict[str, tuple[int, ...]]:
    return {
        f"layer{i}.w": tuple(rng.randint(1, 40) for _ in range(rng.choice([1, 2, 2, 3])))
        for i in range(count)
    }


def _written(plans: list[SavePlan]) -> dict[MetadataIndex, int]:
    written: dict[MetadataIndex, int] = {}
    for rank, plan in enumerate(plans):
        for item in plan.items:
            assert item.index not in written, f"{item.index} written twice"
            written[item.index] = rank
    return written


@pytest.mark.parametrize(("world", "shards"), [(8, 8), (12, 4), (6, 1), (1, 1), (40, 40)])
def test_same_outcome_as_dcp(world: int, shards: int) -> None:
    shapes = _shapes(random.Random(world * 100 + shards), 30)
    local = _local_plans(world, shards, shapes)
    dcp_plans, dcp_metadata = DefaultSavePlanner().create_global_plan(local)
    central, metadata = plan_global([summarize(p) for p in local], PlanCache())
    finals = [apply_global(plan, c) for plan, c in zip(local, central, strict=True)]
    ours, theirs = _written(finals), _written(dcp_plans)
    assert set(ours) == set(theirs)  # every item written once; replicas share the work
    assert len(set(ours.values())) == len(set(theirs.values()))
    assert metadata.planner_data == dcp_metadata.planner_data
    assert set(metadata.state_dict_metadata) == set(dcp_metadata.state_dict_metadata)
    for fqn, entry in dcp_metadata.state_dict_metadata.items():
        mine = metadata.state_dict_metadata[fqn]
        assert type(mine) is type(entry)
        if isinstance(entry, TensorStorageMetadata):
            assert isinstance(mine, TensorStorageMetadata)
            assert (mine.size, mine.properties) == (entry.size, entry.properties)
            key = lambda c: (tuple(c.offsets), tuple(c.sizes))  # noqa: E731
            assert sorted(map(key, mine.chunks)) == sorted(map(key, entry.chunks))


def test_a_plan_dcp_refuses_is_refused() -> None:
    local = _local_plans(8, 8, {"w": (32, 4)}, broken=3)
    with pytest.raises(ValueError, match="Failed to validate global plan") as dcp_error:
        DefaultSavePlanner().create_global_plan(local)
    with pytest.raises(ValueError, match="Failed to validate global plan") as ours:
        plan_global([summarize(p) for p in local], PlanCache())
    for kind in ("overlapping", "invalid fill"):
        assert (kind in str(ours.value)) == (kind in str(dcp_error.value))


def _round(local: list[SavePlan], caches: list[PlanCache]) -> tuple[list[object], list[SavePlan]]:
    """One save's planning: each rank sends (through its own cache), the coordinator (rank 0)
    plans, each rank finishes."""
    summaries = [summarize(p) for p in local]
    sent = [cache.to_send(s) for cache, s in zip(caches, summaries, strict=True)]
    central, _ = plan_global(sent, caches[0])
    finals = []
    for plan, answer, cache, summary in zip(local, central, caches, summaries, strict=True):
        finals.append(apply_global(plan, answer))
        cache.promote(summary.digest)
    return sent, finals


def test_unchanged_plans_are_sent_as_digests_and_reused() -> None:
    shapes = _shapes(random.Random(7), 20)
    caches = [PlanCache() for _ in range(4)]
    sent, first = _round(_local_plans(4, 2, shapes), caches)
    assert not any(isinstance(s, Unchanged) for s in sent)  # the first save plans in full
    sent, again = _round(_local_plans(4, 2, shapes), caches)
    assert all(isinstance(s, Unchanged) for s in sent)
    assert [p.items for p in again] == [p.items for p in first]
    changed = _local_plans(4, 2, shapes | {"extra": (6,)})
    sent, third = _round(changed, caches)
    assert not any(isinstance(s, Unchanged) for s in sent)
    assert any(i.index.fqn == "extra" for p in third for i in p.items)


def test_a_coordinator_without_the_cached_plan_fails_once_then_plans_in_full() -> None:
    shapes = _shapes(random.Random(3), 5)
    caches = [PlanCache() for _ in range(3)]
    _round(_local_plans(3, 3, shapes), caches)
    caches[0] = PlanCache()  # the coordinator restarted, the other ranks did not
    with pytest.raises(PlanningError, match="restarted"):
        _round(_local_plans(3, 3, shapes), caches)
    sent, _ = _round(_local_plans(3, 3, shapes), caches)
    assert not any(isinstance(s, Unchanged) for s in sent)


def test_a_rank_applies_its_mask() -> None:
    local = _local_plans(2, 1, {"w": (3,)})
    central, _ = plan_global([summarize(p) for p in local], PlanCache())
    kept = [c.planner_data for c in central]
    assert all(isinstance(k, Kept) for k in kept)
    finals = [apply_global(p, c) for p, c in zip(local, central, strict=True)]
    assert sum(len(p.items) for p in finals) == len(local[0].items)  # DDP: each item once


def test_saves_and_restores_through_dcp_twice_with_one_cache() -> None:
    store = MemoryStore("plans")
    cache = PlanCache()
    for step in (1, 2):
        state = {"w": torch.arange(12.0).reshape(3, 4) * step, "b": torch.ones(5) * step}
        writer = ObjectStoreWriter(store, step, WriterOptions(index_parts=True))
        planner = writer.save_planner(1, cache)
        assert isinstance(planner, ScalingSavePlanner)
        dcp.save(state, storage_writer=writer, planner=planner, no_dist=True)
        assert cache.accepted is not None and cache.outcome is not None
        manifest = Catalog(store).read_manifest(step)
        target = {"w": torch.zeros(3, 4), "b": torch.zeros(5)}
        dcp.load(target, storage_reader=ObjectStoreReader(store, manifest), no_dist=True)
        assert torch.equal(target["w"], state["w"]) and torch.equal(target["b"], state["b"])
