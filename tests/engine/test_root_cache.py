"""Later roots of an unchanged layout: the tensors' encoding is reused, and the root written is
byte for byte the one a full rebuild writes; any change of layout builds it anew.

Ranks are simulated in one process: each rank's summary comes from `index_part`, as a rank's
writer makes it, from DCP's own write items and results; the end-to-end test saves through
`dcp.save` with spotckpt's writer and planner, restores, and verifies.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from datetime import datetime, timezone
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult

import spotckpt.format.manifest as manifest_module
from spotckpt.catalog import Catalog
from spotckpt.engine.global_plan import PlanCache
from spotckpt.engine.manifests import (
    ROOT_CACHE,
    LayoutCache,
    ManifestHeader,
    WrittenItem,
    build_root,
    index_part,
)
from spotckpt.engine.reader import ObjectStoreReader
from spotckpt.engine.writer import ObjectStoreWriter, WriterOptions
from spotckpt.format.index import parse_root
from spotckpt.format.manifest import ChunkLocation, ObjectRecord
from spotckpt.layout import index_part_key
from spotckpt.storage.memory import MemoryStore
from spotckpt.verify import verify_checkpoint

WORLD = 4
Boxes = dict[str, list[tuple[tuple[int, ...], tuple[int, ...]]]]
"""Per tensor, each rank's chunk (offsets, sizes), by rank."""


class _FixedClock(datetime):
    """`datetime` whose `now` is one fixed instant: two roots built apart in time compare."""

    @classmethod
    def now(cls, tz: Any = None) -> Any:
        return datetime(2026, 1, 2, 3, 4, 5, tzinfo=timezone.utc)


@pytest.fixture
def fixed_clock(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(manifest_module, "datetime", _FixedClock)


def _rows(extent: int, cuts: list[int]) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """Row shards of a [extent, 6] tensor starting at `cuts`, one per rank."""
    ends = [*cuts[1:], extent]
    return [((start, 0), (end - start, 6)) for start, end in zip(cuts, ends, strict=True)]


def _layout() -> tuple[dict[str, torch.dtype], Boxes, dict[str, tuple[int, ...]]]:
    dtypes = {"a": torch.float32, "b": torch.float32, "c": torch.bfloat16}
    boxes: Boxes = {"a": _rows(8, [0, 2, 4, 6]), "b": _rows(12, [0, 3, 6, 9])}
    whole: tuple[tuple[int, ...], tuple[int, ...]] = ((0,), (5,))
    empty: tuple[tuple[int, ...], tuple[int, ...]] = ((5,), (0,))
    boxes["c"] = [whole] + [empty] * (WORLD - 1)  # rank 0 holds all of it
    shapes: dict[str, tuple[int, ...]] = {"a": (8, 6), "b": (12, 6), "c": (5,)}
    return dtypes, boxes, shapes


def _save(
    step: int,
    seed: int,
    dtypes: dict[str, torch.dtype],
    boxes: Boxes,
    shapes: dict[str, tuple[int, ...]],
    order: Callable[[list[str]], list[str]] = list,
) -> tuple[ManifestHeader, Metadata, list[list[WriteResult]]]:
    """What the coordinator holds at the commit of a save of this layout: its header, DCP's
    metadata, and each rank's summary (the data, and so every size, CRC and key, from `seed`)."""
    rng = random.Random(seed)
    attempt = f"{rng.getrandbits(32):08x}"
    header = ManifestHeader(step, attempt, 1 << 16, {"spotckpt": "test"}, {"seed": seed})
    results = []
    for rank in range(WORLD):
        key = f"a-{attempt}/r{rank:05d}-000.safetensors"
        items, written, position = [], [], rng.randrange(100, 200)
        for fqn in order(list(boxes)):
            offsets, sizes = boxes[fqn][rank]
            chunk = ChunkStorageMetadata(torch.Size(offsets), torch.Size(sizes))
            properties = TensorProperties(dtype=dtypes[fqn])
            data = TensorWriteData(chunk=chunk, properties=properties, size=torch.Size(shapes[fqn]))
            items.append(
                WriteItem(
                    index=MetadataIndex(fqn, chunk.offsets),
                    type=WriteItemType.SHARD,
                    tensor_data=data,
                )
            )
            length = torch.Size(sizes).numel() * dtypes[fqn].itemsize
            written.append((items[-1].index, position, length))
            position += length
        if rank == 1:
            items.append(WriteItem(MetadataIndex("v"), WriteItemType.BYTE_IO))
            written.append((items[-1].index, position, 7))
            position += 7
        record = ObjectRecord(key=key, size=position, crc32c=rng.getrandbits(32), rank=rank)
        rank_results = [
            WriteResult(
                index=index,
                size_in_bytes=length,
                storage_data=WrittenItem(
                    ChunkLocation(
                        key=key, offset=offset, length=length, block_crc32c=(rng.getrandbits(32),)
                    ),
                    record,
                ),
            )
            for index, offset, length in written
        ]
        part = index_part(header, rank, rank_results, items, index_part_key(attempt, rank))[1]
        results.append([part])
    entries: dict[str, Any] = {
        fqn: TensorStorageMetadata(
            TensorProperties(dtype=dtypes[fqn]),
            torch.Size(shapes[fqn]),
            [ChunkStorageMetadata(torch.Size(o), torch.Size(s)) for o, s in boxes[fqn]],
        )
        for fqn in boxes
    }
    entries["v"] = BytesStorageMetadata()
    planner_data = {fqn: [fqn] for fqn in entries}
    return header, Metadata(entries, planner_data=planner_data), results


def _both_ways(
    cache: LayoutCache, save: tuple[ManifestHeader, Metadata, list[list[WriteResult]]]
) -> tuple[bytes, bytes]:
    """The root built with `cache`, and built in full."""
    return build_root(*save, cache=cache)[1], build_root(*save, cache=None)[1]


@pytest.mark.usefixtures("fixed_clock")
def test_a_later_root_of_the_same_layout_is_the_full_rebuild_byte_for_byte() -> None:
    cache = LayoutCache()
    first, rebuilt = _both_ways(cache, _save(1, 1, *_layout()))
    assert first == rebuilt and (cache.hits, cache.misses) == (0, 1)
    for step, seed in ((2, 2), (3, 3), (2, 4)):  # other data, steps, attempts
        reused, rebuilt = _both_ways(cache, _save(step, seed, *_layout()))
        assert reused == rebuilt
        assert reused != first
        root = parse_root(reused, step)
        assert root.user_metadata == {"seed": seed}
        assert root.tensors["a"].writers.to_json() == [[0, 4, 1]]
        assert root.tensors["c"].writers.total == WORLD  # rank 0's chunk and 3 empty ones
    assert (cache.hits, cache.misses) == (3, 1)
    # the pieces spliced are one compact json.dumps of the whole document
    assert json.dumps(json.loads(reused), separators=(",", ":")).encode() == reused


def _reshaped(dtypes: Any, boxes: Boxes, shapes: Any) -> Any:
    shapes["b"], boxes["b"] = (16, 6), _rows(16, [0, 4, 8, 12])
    return dtypes, boxes, shapes


def _rank_shard_moved(dtypes: Any, boxes: Boxes, shapes: Any) -> Any:
    boxes["a"] = _rows(8, [0, 2, 4, 7])  # ranks 2 and 3 split the last rows otherwise
    return dtypes, boxes, shapes


def _other_dtype(dtypes: Any, boxes: Boxes, shapes: Any) -> Any:
    dtypes["c"] = torch.float16
    return dtypes, boxes, shapes


def _tensor_dropped(dtypes: Any, boxes: Boxes, shapes: Any) -> Any:
    del boxes["b"], shapes["b"]
    return dtypes, boxes, shapes


@pytest.mark.usefixtures("fixed_clock")
@pytest.mark.parametrize(
    "change",
    [_reshaped, _rank_shard_moved, _other_dtype, _tensor_dropped],
    ids=lambda c: c.__name__,
)
def test_a_changed_layout_is_built_anew(change: Callable[..., Any]) -> None:
    cache = LayoutCache()
    before, _ = _both_ways(cache, _save(1, 1, *_layout()))
    changed, rebuilt = _both_ways(cache, _save(2, 2, *change(*_layout())))
    assert changed == rebuilt and (cache.hits, cache.misses) == (0, 2)
    assert parse_root(changed).tensors != parse_root(before).tensors
    again, _ = _both_ways(cache, _save(3, 3, *change(*_layout())))  # the new layout is kept
    assert again == _both_ways(LayoutCache(), _save(3, 3, *change(*_layout())))[1]
    assert (cache.hits, cache.misses) == (1, 2)


@pytest.mark.usefixtures("fixed_clock")
def test_the_same_chunks_in_another_order_on_one_rank_are_another_layout() -> None:
    cache = LayoutCache()
    _both_ways(cache, _save(1, 1, *_layout()))
    swapped, rebuilt = _both_ways(cache, _save(2, 2, *_layout(), order=lambda n: n[::-1]))
    assert swapped == rebuilt and cache.misses == 2


def _state(step: int, rows: int = 6) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(step)
    return {
        "w": torch.randn(rows, 4, generator=generator),
        "b": torch.randn(5, generator=generator).to(torch.bfloat16),
    }


def test_saves_of_an_unchanged_layout_reuse_the_root_restore_and_verify() -> None:
    store = MemoryStore("root-cache")
    cache = PlanCache()
    saved = {}
    for step, rows in ((1, 6), (2, 6), (3, 6), (4, 7)):  # step 4: "w" reshaped
        hits, misses = ROOT_CACHE.hits, ROOT_CACHE.misses
        saved[step] = _state(step, rows)
        writer = ObjectStoreWriter(store, step, WriterOptions(index_parts=True))
        dcp.save(
            saved[step], storage_writer=writer, planner=writer.save_planner(1, cache), no_dist=True
        )
        reused = ROOT_CACHE.hits - hits
        assert (reused, ROOT_CACHE.misses - misses) == ((0, 1) if step in (1, 4) else (1, 0))
    for step, state in saved.items():
        manifest = Catalog(store).read_manifest(step)
        target = {k: torch.zeros_like(v) for k, v in state.items()}
        dcp.load(target, storage_reader=ObjectStoreReader(store, manifest), no_dist=True)
        assert all(torch.equal(target[k], v) for k, v in state.items())
        report = verify_checkpoint(store, step)
        assert report.ok, report
    assert not torch.equal(saved[2]["w"], saved[3]["w"])
