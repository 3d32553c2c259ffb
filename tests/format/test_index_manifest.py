"""The indexed manifest (``spotckpt/2``): a small root, per-rank index parts, partial reads.

Real saves use four gloo ranks with the threshold lowered to one rank; the read-cost tests build a
64-rank checkpoint's metadata directly and count what a restoring rank fetches.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from spotckpt.catalog import Catalog
from spotckpt.checksum import crc32c
from spotckpt.errors import CorruptCheckpointError, ManifestError
from spotckpt.format.index import (
    Cuts,
    IndexedTensor,
    PartRecord,
    Runs,
    parse_root,
    part_json,
    root_json,
    tiling_of,
)
from spotckpt.format.manifest import ChunkLocation, ObjectRecord
from spotckpt.layout import index_part_key, manifest_key, step_folder
from spotckpt.storage import open_store
from spotckpt.storage.memory import MemoryStore

from dist_worker import run_ranks
from tests_support import assert_equal, load_saved

OPTIONS = {"part_size": 5 << 20}


@pytest.fixture(scope="module")
def indexed_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path]:
    """An FSDP2 model + AdamW saved by 4 ranks with an indexed manifest, in a local folder."""
    out = tmp_path_factory.mktemp("indexed")
    uri = str(out / "bucket")
    run_ranks(4, "fsdp_save", {"uri": uri, "out": str(out), "indexed": True})
    return uri, out


@pytest.mark.process
def test_root_is_small_and_each_rank_wrote_its_part(indexed_checkpoint: tuple[str, Path]) -> None:
    uri, out = indexed_checkpoint
    assert_equal(load_saved(out / "continued.pt"), load_saved(out / "resumed-continued.pt"))
    store = open_store(uri)
    root = parse_root(store.get(manifest_key(2)), 2)
    assert sorted(root.parts) == [0, 1, 2, 3]
    assert all(p.key == index_part_key(root.attempt, p.rank) for p in root.parts.values())
    weight = root.tensors["model.0.weight"]
    assert weight.grid is not None and weight.grid[0] == Cuts(1024, every=256, intervals=4)
    assert weight.writers.to_json() == [[0, 4, 1]]  # chunk i by rank i: one run
    whole = Catalog(store).read_manifest(2)  # tools read every part
    assert len(whole.tensors["model.0.weight"].chunks) == 4 and len(whole.objects) == 4


@pytest.mark.process
@pytest.mark.parametrize("world", [1, 2, 3])
def test_indexed_checkpoint_restores_on_any_world_size(
    indexed_checkpoint: tuple[str, Path], world: int
) -> None:
    uri, out = indexed_checkpoint
    run_ranks(world, "fsdp_restore", {"uri": uri, "out": str(out)})
    assert_equal(load_saved(out / "saved.pt"), load_saved(out / f"restored-{world}.pt"))


# 64 ranks' metadata, built directly --------------------------------------------------------


class CountingStore(MemoryStore):
    """A memory store that records the keys it serves."""

    def __init__(self) -> None:
        super().__init__("memory://counting")
        self.reads: list[str] = []

    def get_range(self, key: str, start: int, length: int) -> bytes:
        self.reads.append(key)
        return super().get_range(key, start, length)

    def get_range_into(self, key: str, start: int, buffer: memoryview) -> int:
        self.reads.append(key)
        return super().get_range_into(key, start, buffer)


def _fsdp_checkpoint(ranks: int, tensors: int) -> tuple[CountingStore, bytes]:
    """Metadata of `tensors` [ranks*8, 16] float32 tensors sharded by rows over `ranks`."""
    store, step, attempt = CountingStore(), 5, "feed"
    rows, itemsize = ranks * 8, 4
    chunk_bytes = 8 * 16 * itemsize
    parts = []
    values_at = tensors * chunk_bytes  # the chunks, then 4 bytes for the value
    for rank in range(ranks):
        key = f"a-{attempt}/r{rank:05d}-000.safetensors"
        record = ObjectRecord(key=key, size=values_at + 4, crc32c=0, rank=rank)
        chunks = {
            f"t{t}": [
                (
                    (rank * 8, 0),
                    ChunkLocation(
                        key=key, offset=t * chunk_bytes, length=chunk_bytes, block_crc32c=(0,)
                    ),
                )
            ]
            for t in range(tensors)
        }
        if rank == 0:
            value = (record, ChunkLocation(key=key, offset=values_at, length=4, block_crc32c=(0,)))
        data = part_json(step, attempt, rank, record, chunks)
        part_key = index_part_key(attempt, rank)
        store.put(f"{step_folder(step)}/{part_key}", data)
        parts.append(PartRecord(part_key, len(data), crc32c(data), rank))
    grid = (Cuts(rows, every=8, intervals=ranks), Cuts(16, starts=(0,)))
    indexed = {
        f"t{t}": IndexedTensor("float32", (rows, 16), Runs.of(range(ranks)), grid=grid)
        for t in range(tensors)
    }
    root = root_json(
        step=step,
        attempt=attempt,
        created_at="now",
        world_size=ranks,
        block_size=1 << 16,
        parts=parts,
        tensors=indexed,
        values={"v": value},
        versions={},
        planner_data={},
        user_metadata={},
    )
    return store, root


def test_a_restoring_rank_reads_the_root_and_only_the_parts_it_needs() -> None:
    store, data = _fsdp_checkpoint(ranks=64, tensors=50)
    boxes = {f"t{t}": [((5 * 8, 0), (8, 16))] for t in range(50)}  # rank 5's shards
    catalog = Catalog(store)
    manifest = catalog.read_manifest(5, lambda root: (boxes, {"v"}), data=data)
    # its own part only: the value's location is in the root
    assert set(store.reads) == {f"step-000000005/{index_part_key('feed', 5)}"}
    assert manifest.values["v"].length == 4
    assert all(len(t.chunks) == 1 for t in manifest.tensors.values())
    assert manifest.tensors["t3"].chunks[0].offsets == (40, 0)
    # a shard straddling two ranks' rows (resharding) reads both of their parts
    store.reads.clear()
    catalog.read_manifest(5, lambda root: ({"t0": [((4, 0), (8, 16))]}, set()), data=data)
    assert sorted(set(store.reads)) == [
        f"step-000000005/{index_part_key('feed', r)}" for r in (0, 1)
    ]
    assert len(data) < 20_000  # the root grows with tensors, not with ranks x tensors


def test_a_part_that_does_not_match_the_root_is_refused() -> None:
    store, data = _fsdp_checkpoint(ranks=4, tensors=3)
    key = f"step-000000005/{index_part_key('feed', 2)}"
    part = bytearray(store.get(key))
    part[-3] ^= 1
    store.put(key, bytes(part))
    with pytest.raises(CorruptCheckpointError, match="does not match the manifest"):
        Catalog(store).read_manifest(5, data=data)


def test_a_forged_part_with_a_matching_checksum_is_still_checked() -> None:
    """An attacker who rewrites a part and the root's CRC of it cannot point outside the
    attempt's folder or past the object's end."""
    store, data = _fsdp_checkpoint(ranks=2, tensors=2)
    document = json.loads(data)
    key = f"step-000000005/{index_part_key('feed', 1)}"
    for forge in (
        lambda p: p["object"].update(key="a-feed/../../etc/passwd"),
        lambda p: p["object"].update(key="a-other/r00001-000.safetensors"),
        lambda p: p["chunks"]["t0"][0].__setitem__(1, 10**9),
    ):
        part: dict[str, Any] = json.loads(store.get(key))
        forge(part)
        forged = json.dumps(part).encode()
        store.put(key, forged)
        document["parts"][1].update(size=len(forged), crc32c=crc32c(forged))
        with pytest.raises(ManifestError):
            Catalog(store).read_manifest(5, data=json.dumps(document).encode())


@pytest.mark.parametrize(
    "change",
    [
        lambda d: d["tensors"]["t0"].update(writers=[[0, 1, 0]]),  # fewer writers than chunks
        lambda d: d["tensors"]["t0"].update(writers=[[7, 2, 1]]),  # a rank without a part
        lambda d: d["tensors"]["t0"].update(grid=[[0, 8, 4], [0]]),  # starts not ascending
        lambda d: d["tensors"]["t0"].update(grid=[{"every": 0, "count": 2}, [0]]),
        lambda d: d["tensors"]["t0"].update(grid=[{"every": 8, "count": 9}, [0]]),  # 2 rise
        lambda d: d["parts"][0].update(key="../x"),
        lambda d: d.update(step=6),
    ],
)
def test_forged_roots_are_refused(change: Any) -> None:
    _store, data = _fsdp_checkpoint(ranks=2, tensors=1)
    document = json.loads(data)
    change(document)
    with pytest.raises(ManifestError):
        parse_root(json.dumps(document).encode(), 5)


def _tiling(shape: tuple[int, ...], boxes: list[Any]) -> tuple[Any, list[Any] | None]:
    grid, order = tiling_of(shape, [o for o, _ in boxes], [s for _, s in boxes])
    return grid, None if order is None else [boxes[i] for i in order]


def test_grids_are_found_and_anything_else_is_kept_as_a_list() -> None:
    even = [((r * 4, 0), (4, 8)) for r in range(4)]
    grid, ordered = _tiling((16, 8), list(reversed(even)))
    assert grid == (Cuts(16, every=4, intervals=4), Cuts(8, starts=(0,))) and ordered == even
    uneven = [((0, 0), (3, 8)), ((3, 0), (13, 8))]
    grid, _ = _tiling((16, 8), uneven)
    assert grid is not None and [grid[0].length(i) for i in range(grid[0].count)] == [3, 13]
    three = [((0, 0), (3, 8)), ((3, 0), (10, 8)), ((13, 0), (3, 8))]
    assert _tiling((16, 8), three)[0] == (Cuts(16, starts=(0, 3, 13)), Cuts(8, starts=(0,)))
    ragged = [((0, 0), (8, 4)), ((0, 4), (8, 4)), ((8, 0), (8, 8))]  # not a product of cuts
    assert _tiling((16, 8), ragged) == (None, None)


def test_even_splits_with_an_empty_trailing_shard_stay_compact() -> None:
    """DTensor's Shard(0) of 11,008 rows over 512 ranks: 501 chunks of 22 rows or fewer, then
    empty shards at row 11,008 (deduplicated by DCP to one chunk)."""
    boxes = [((min(i * 22, 11008), 0), (min(22, max(0, 11008 - i * 22)), 4)) for i in range(502)]
    grid, ordered = _tiling((11008, 4), boxes)
    assert grid is not None and grid[0].to_json() == {"every": 22, "count": 502}
    tensor = IndexedTensor("float32", (11008, 4), Runs.of(range(502)), grid=grid)
    assert [tensor.chunk(n) for n in range(502)] == ordered == boxes
    assert tensor.overlapping(((10990, 0), (30, 4))) == [499, 500]
    assert tensor.overlapping(((11008, 0), (0, 4))) == [501]  # the empty one, as DCP asks
    assert tensor.overlapping(((5, 0), (0, 4))) == []


def test_writer_runs_round_trip() -> None:
    ranks = [0, 1, 2, 3, 8, 8, 8, 5, 3]
    runs = Runs.of(ranks)
    assert [runs.rank(i) for i in range(len(ranks))] == ranks
    assert Runs.of(range(4096)).to_json() == [[0, 4096, 1]]
