"""The shared verified chunk reader: restore, export and verify refuse damage the same way.

Each test saves a real checkpoint into a local folder with `CheckpointManager`, damages real
bytes on disk (a flipped byte, a truncated or deleted object, a forged manifest) and checks the
errors that restore, export and verify give, and the reads that the store was asked for.
"""

from __future__ import annotations

import dataclasses
import re
import threading
from pathlib import Path
from typing import Any

import pytest
import torch

from spotckpt import CheckpointManager, CorruptCheckpointError
from spotckpt.engine.chunks import BlockCheck, ChunkReader
from spotckpt.errors import ChecksumMismatchError, ObjectSizeError
from spotckpt.export import export_hf
from spotckpt.format.manifest import ChunkLocation, Manifest
from spotckpt.format.safetensors_io import DEFAULT_BLOCK_SIZE, block_crcs
from spotckpt.layout import manifest_key, step_folder
from spotckpt.storage import ObjectInfo, ObjectStore, open_store
from spotckpt.verify import verify_checkpoint

WEIGHTS = 3 * DEFAULT_BLOCK_SIZE // 4 + 100  # float32 elements: model.w spans four CRC blocks
FORGED = 2**40
FORGED_BLOCK_SIZE = 1 << 30  # so that a 2**40-byte chunk needs only 1024 block CRCs


def _state(step: int) -> dict[str, Any]:
    return {
        "model": {"w": torch.arange(WEIGHTS, dtype=torch.float32) * step, "b": torch.ones(8)},
        "meta": {"epoch": step},
    }


def _empty() -> dict[str, Any]:
    return {"model": {"w": torch.zeros(WEIGHTS), "b": torch.zeros(8)}, "meta": {"epoch": -1}}


class RecordingStore:
    """A real store that records the length of every ranged read and every head asked of it."""

    def __init__(self, inner: ObjectStore) -> None:
        self.inner = inner
        self.lengths: list[int] = []
        self.heads: list[str] = []
        self.lock = threading.Lock()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def get_range(self, key: str, start: int, length: int) -> bytes:
        with self.lock:
            self.lengths.append(length)
        return self.inner.get_range(key, start, length)

    def get_range_into(self, key: str, start: int, buffer: memoryview) -> int:
        with self.lock:
            self.lengths.append(buffer.nbytes)
        return self.inner.get_range_into(key, start, buffer)

    def head(self, key: str) -> ObjectInfo | None:
        with self.lock:
            self.heads.append(key)
        return self.inner.head(key)


@pytest.fixture
def root(tmp_path: Path) -> Path:
    """A local checkpoint folder with committed steps 1 and 2, one object each."""
    path = tmp_path / "ck"
    with CheckpointManager(str(path), preemption=False) as mgr:
        mgr.save(1, _state(1))
        mgr.save(2, _state(2))
    return path


def _manifest(root: Path, step: int = 2) -> Manifest:
    return Manifest.from_json((root / manifest_key(step)).read_bytes())


def _object(root: Path, step: int = 2) -> tuple[Path, str]:
    """The single data object of `step`: its file and its key in the store."""
    (key,) = _manifest(root, step).objects
    return root / step_folder(step) / key, f"{step_folder(step)}/{key}"


def _restore(root: Path, store: ObjectStore | None = None) -> None:
    with CheckpointManager(str(root), preemption=False, store=store) as mgr:
        mgr.restore(_empty(), step=2)


def _export(root: Path, out: Path, store: ObjectStore | None = None) -> None:
    export_hf(store or open_store(str(root)), 2, str(out))


def _damage(root: Path, damage: str) -> None:
    path, _key = _object(root)
    location = _manifest(root).tensors["model.w"].chunks[0].location
    data = bytearray(path.read_bytes())
    if damage == "flip-one-byte":
        data[location.offset + DEFAULT_BLOCK_SIZE + 7] ^= 0x10  # in block 1 of model.w
        path.write_bytes(bytes(data))
    elif damage == "truncate":
        path.write_bytes(bytes(data[: location.offset + DEFAULT_BLOCK_SIZE]))
    else:
        path.unlink()


MESSAGES = {
    "flip-one-byte": r"CRC32C mismatch in {key} at bytes \d+\.\.\d+ \(block 1 of 'model\.w'\)",
    "truncate": r"object {key} is truncated: bytes \d+\.\.\d+ \(.*'model\.w'.*\) are asked, "
    r"the object has \d+ bytes and the manifest says \d+",
    "delete": r"object {key} is missing: bytes \d+\.\.\d+ \(.*'model\.w'.*\) cannot be read",
}
VERIFY_KINDS = {"flip-one-byte": "crc32c", "truncate": "size", "delete": "missing"}


@pytest.mark.parametrize("damage", list(MESSAGES))
def test_damage_gives_the_same_clear_error_from_restore_export_and_verify(
    root: Path, tmp_path: Path, damage: str
) -> None:
    _damage(root, damage)
    _path, key = _object(root)
    message = MESSAGES[damage].format(key=re.escape(key))
    with pytest.raises(CorruptCheckpointError, match=message):
        _restore(root)
    with pytest.raises(CorruptCheckpointError, match=message):
        _export(root, tmp_path / "out")
    report = verify_checkpoint(open_store(str(root)), 2)
    (problem,) = report.problems
    assert (problem.kind, problem.key) == (VERIFY_KINDS[damage], key)
    assert "model.w" in problem.tensors and "model.w" in problem.message
    target = _empty()
    with CheckpointManager(str(root), preemption=False) as mgr:
        assert mgr.restore(target) == 1  # falls back to the intact step
    assert torch.equal(target["model"]["w"], _state(1)["model"]["w"])


def _forge(root: Path, name: str) -> int:
    """Claim 2**40 bytes for the chunk of `name`, past the object's real bytes (where it
    overlaps nothing), and an object of step 2 that large; returns the claimed object size.

    Every other CRC is recomputed for a 1 GiB block size, so that only the sizes are forged.
    """
    path, _key = _object(root)
    data = path.read_bytes()
    start, size = len(data), len(data) + FORGED
    manifest = _manifest(root)

    def honest(location: ChunkLocation) -> ChunkLocation:
        chunk = data[location.offset : location.offset + location.length]
        return dataclasses.replace(location, block_crc32c=block_crcs(chunk, FORGED_BLOCK_SIZE))

    forged_crcs = (0,) * (FORGED // FORGED_BLOCK_SIZE)
    for fqn, record in manifest.tensors.items():
        chunks = tuple(dataclasses.replace(c, location=honest(c.location)) for c in record.chunks)
        manifest.tensors[fqn] = dataclasses.replace(record, chunks=chunks)
    manifest.values = {fqn: honest(location) for fqn, location in manifest.values.items()}
    if name in manifest.values:
        manifest.values[name] = dataclasses.replace(
            manifest.values[name], offset=start, length=FORGED, block_crc32c=forged_crcs
        )
    else:
        record = manifest.tensors[name]
        location = dataclasses.replace(
            record.chunks[0].location, offset=start, length=FORGED, block_crc32c=forged_crcs
        )
        elements = FORGED // 4
        chunk = dataclasses.replace(record.chunks[0], sizes=(elements,), location=location)
        manifest.tensors[name] = dataclasses.replace(record, shape=(elements,), chunks=(chunk,))
    (record,) = manifest.objects.values()
    manifest.objects[record.key] = dataclasses.replace(record, size=size)
    manifest.block_size = FORGED_BLOCK_SIZE
    (root / manifest_key(2)).write_bytes(manifest.to_json())
    return size


FORGED_MESSAGE = (
    r"object {key} is truncated: bytes {start}\.\.{size} \({name}\) are asked, "
    r"the object has {start} bytes and the manifest says {size}"
)


def test_forged_sizes_are_refused_by_restore_before_reading(root: Path) -> None:
    size = _forge(root, "meta.epoch")  # restore reads a value whole: its length is the read
    _path, key = _object(root)
    store = RecordingStore(open_store(str(root)))
    # Every read of the object is refused; which one's error surfaces first depends on threads.
    message = (
        rf"object {re.escape(key)} is truncated: bytes \d+\.\.\d+ \(.+\) are asked, the object "
        rf"has \d+ bytes and the manifest says {size}"
    )
    with pytest.raises(CorruptCheckpointError, match=message):
        _restore(root, store)  # type: ignore[arg-type]
    assert store.lengths and max(store.lengths) < 1 << 20


def test_forged_sizes_are_refused_by_export_before_allocating(root: Path, tmp_path: Path) -> None:
    size = _forge(root, "model.w")
    _path, key = _object(root)
    store = RecordingStore(open_store(str(root)))
    start = size - FORGED
    message = FORGED_MESSAGE.format(key=re.escape(key), name=r"'model\.w'", start=start, size=size)
    with pytest.raises(CorruptCheckpointError, match=message):
        _export(root, tmp_path / "out", store)  # type: ignore[arg-type]
    assert max(store.lengths, default=0) < 1 << 20


@pytest.mark.parametrize("name", ["meta.epoch", "model.w"])
def test_forged_sizes_are_a_verify_problem(root: Path, name: str) -> None:
    size = _forge(root, name)
    _path, key = _object(root)
    store = RecordingStore(open_store(str(root)))
    report = verify_checkpoint(store, 2)  # type: ignore[arg-type]
    (problem,) = report.problems
    assert (problem.kind, problem.key) == ("size", key)
    assert f"the manifest says {size}" in problem.message
    assert max(store.lengths) < 1 << 20


# The reader itself ------------------------------------------------------------------------------


def _reader(root: Path, store: ObjectStore) -> tuple[ChunkReader, ChunkLocation]:
    manifest = _manifest(root)
    sizes = {key: record.size for key, record in manifest.objects.items()}
    reader = ChunkReader(store, step_folder(2), manifest.block_size, sizes)
    return reader, manifest.tensors["model.w"].chunks[0].location


def test_ranges_widen_to_blocks_and_come_back_verified(root: Path) -> None:
    reader, location = _reader(root, open_store(str(root)))
    block = DEFAULT_BLOCK_SIZE
    data, span = reader.read_chunk(location, "model.w", block + 5, 2 * block + 1)
    assert (span.start, span.end, span.first_block) == (block, 3 * block, 1)
    want = torch.arange(WEIGHTS, dtype=torch.float32) * 2
    assert data == want.numpy().tobytes()[block : 3 * block]
    tail, span = reader.read_chunk(location, "model.w", 3 * block + 1, location.length)
    assert (span.start, span.end) == (3 * block, location.length)  # the short last block
    assert tail == want.numpy().tobytes()[3 * block :]


def test_each_object_is_headed_once_across_threads(root: Path) -> None:
    store = RecordingStore(open_store(str(root)))
    reader, location = _reader(root, store)  # type: ignore[arg-type]
    start = threading.Barrier(8)

    def read() -> None:
        start.wait()
        for _ in range(5):
            reader.read_chunk(location, "model.w")

    threads = [threading.Thread(target=read) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert store.heads == [reader.path(location.key)]
    assert len(store.lengths) == 40


def test_a_range_past_the_real_end_is_refused_without_a_read(root: Path) -> None:
    path, _key = _object(root)
    location = _manifest(root).tensors["model.w"].chunks[0].location
    path.write_bytes(path.read_bytes()[: location.offset + 10])
    store = RecordingStore(open_store(str(root)))
    reader, location = _reader(root, store)  # type: ignore[arg-type]
    with pytest.raises(ObjectSizeError, match=r"'model\.w'"):
        reader.read_chunk(location, "model.w", 0, 4)  # inside what is left, but the size differs
    with pytest.raises(ObjectSizeError, match="is truncated"):
        reader.check_chunk(location, "model.w")
    assert store.lengths == []


@pytest.mark.parametrize("piece", [1, 7, DEFAULT_BLOCK_SIZE - 1, DEFAULT_BLOCK_SIZE, 1 << 20])
def test_block_check_fed_in_pieces_finds_the_damaged_block(root: Path, piece: int) -> None:
    reader, location = _reader(root, open_store(str(root)))
    data, _span = reader.read_chunk(location, "model.w")
    damaged = bytearray(data)
    damaged[2 * DEFAULT_BLOCK_SIZE + 3] ^= 1
    for content, bad in ((data, None), (bytes(damaged), 2)):
        check = BlockCheck(location, DEFAULT_BLOCK_SIZE)
        view = memoryview(content)
        for start in range(0, len(content), piece):
            check.feed(view[start : start + piece])
        assert check.finish() is bad
    with pytest.raises(ChecksumMismatchError, match=r"block 2 of 'model\.w'"):
        reader.verify(bytes(damaged), location, 0, "model.w")
    with pytest.raises(ValueError, match="more than"):
        BlockCheck(location, DEFAULT_BLOCK_SIZE).feed(memoryview(data + b"x"))
