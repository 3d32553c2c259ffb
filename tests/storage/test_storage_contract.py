"""One contract, every store: memory, local disk, S3 on a moto server, GCS on an emulator, Azure
on Azurite, and fsspec's local, memory and S3 (s3fs on moto) filesystems through the fsspec
store.

A new back end joins by adding a fixture parameter to `store`.
"""

from __future__ import annotations

import dataclasses
import os
import threading
import uuid
from collections.abc import Iterator
from datetime import datetime, timezone
from pathlib import Path

import pytest
import torch

from spotckpt.checksum import chunk_hash, crc32c
from spotckpt.errors import CorruptCheckpointError, InvalidArgumentError, StorageError
from spotckpt.storage import (
    AlreadyExistsError,
    InvalidKeyError,
    ObjectNotFoundError,
    ObjectStore,
    open_store,
)
from spotckpt.storage.base import get_range_into_views, roll_up
from spotckpt.storage.copying import Expected, copy_object

from gcs_emulator import EMULATOR_IGNORES_PRECONDITIONS

MIB = 1 << 20
PART = 5 * MIB


def _payload(size: int, seed: int = 0) -> bytes:
    return (bytes(range(256)) * (size // 256 + 1))[seed : seed + size] if size else b""


@pytest.fixture(
    params=[
        "memory",
        "local",
        "local-linked-root",
        pytest.param("s3", marks=pytest.mark.process),
        pytest.param("gcs", marks=pytest.mark.process),
        pytest.param("azure", marks=pytest.mark.process),
        "fsspec-local",
        "fsspec-memory",
        pytest.param("fsspec-s3", marks=pytest.mark.process),
    ]
)
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[ObjectStore]:
    kind = request.param
    if kind == "memory":
        uri = request.getfixturevalue("memory_uri")
        opened = open_store(uri)
    elif kind == "local":
        opened = open_store(str(tmp_path / "root"))
    elif kind == "local-linked-root":
        # the root itself may be a symbolic link: it is resolved once, when the store opens
        (tmp_path / "real-root").mkdir()
        (tmp_path / "root").symlink_to(tmp_path / "real-root", target_is_directory=True)
        opened = open_store((tmp_path / "root").as_uri())
    elif kind == "gcs":
        if request.node.originalname in EMULATOR_IGNORES_PRECONDITIONS:
            request.applymarker(
                pytest.mark.xfail(
                    strict=True,
                    reason="gcp-storage-emulator ignores ifGenerationMatch=0 and overwrites; "
                    "tests/storage/test_gcs.py covers create-only against a server that "
                    "answers 412",
                )
            )
        uri = request.getfixturevalue("gcs_uri")
        opened = open_store(uri, chunk_size=PART, max_concurrency=4, list_page_size=7)
    elif kind == "fsspec-local":
        opened = open_store(f"fsspec+file://{tmp_path}/root")
    elif kind == "fsspec-memory":
        opened = open_store(f"fsspec+memory://contract-{uuid.uuid4().hex[:8]}/root")
    elif kind == "fsspec-s3":
        # s3fs finds moto through AWS_ENDPOINT_URL, which the s3_uri fixture sets
        uri = request.getfixturevalue("s3_uri")
        opened = open_store(uri.replace("s3://", "fsspec+s3://", 1))
    elif kind == "azure":
        uri = request.getfixturevalue("az_uri")
        opened = open_store(uri, block_size=PART, max_concurrency=4, list_page_size=7)
    else:
        uri = request.getfixturevalue("s3_uri")
        opened = open_store(uri, part_size=PART, max_concurrency=4, list_page_size=7)
    yield opened
    opened.close()


def test_put_get_head_exists(store: ObjectStore) -> None:
    store.put("a/b.bin", b"hello")
    assert store.get("a/b.bin") == b"hello"
    info = store.head("a/b.bin")
    assert info is not None and info.size == 5 and info.key == "a/b.bin"
    assert store.exists("a/b.bin")
    assert not store.exists("a/missing.bin")
    assert store.head("a/missing.bin") is None
    with pytest.raises(ObjectNotFoundError):
        store.get("a/missing.bin")


def test_head_tells_when_the_store_wrote_the_object(store: ObjectStore) -> None:
    """gc judges ages by these times, and learns "now" from one (its clock probe)."""
    before = datetime.now(timezone.utc)
    store.put("stamped", b"x")
    written = store.head("stamped").last_modified  # type: ignore[union-attr]
    assert written is not None
    written = written if written.tzinfo is not None else written.replace(tzinfo=timezone.utc)
    assert abs((written - before).total_seconds()) < 60  # the servers share this host's clock


def test_empty_object(store: ObjectStore) -> None:
    store.put("empty", b"")
    assert store.get("empty") == b""
    with store.open_writer("empty-streamed") as writer:
        writer.write(b"")
    assert store.get("empty-streamed") == b""
    assert store.head("empty-streamed").size == 0  # type: ignore[union-attr]


def test_streamed_object_larger_than_three_parts(store: ObjectStore) -> None:
    data = os.urandom(3 * PART + 12345)
    with store.open_writer("big/object.bin") as writer:
        # uneven chunks so part boundaries fall inside writes
        for start in range(0, len(data), 3 * MIB + 7):
            writer.write(memoryview(data)[start : start + 3 * MIB + 7])
    assert writer.bytes_written == len(data)
    assert store.get("big/object.bin") == data


def test_streamed_object_of_exactly_one_part(store: ObjectStore) -> None:
    data = os.urandom(PART)
    with store.open_writer("one-part") as writer:
        writer.write(data)
    assert store.get("one-part") == data


def test_ranged_reads_at_edges(store: ObjectStore) -> None:
    data = _payload(1000)
    store.put("r", data)
    assert store.get_range("r", 0, 1) == data[:1]
    assert store.get_range("r", 999, 1) == data[999:]
    assert store.get_range("r", 10, 0) == b""
    assert store.get_range("r", 0, 1000) == data
    assert store.get_range("r", 990, 50) == data[990:]
    assert store.get_range("r", 1000, 10) == b""
    with pytest.raises(ObjectNotFoundError):
        store.get_range("nope", 0, 10)


def _read_into(store: ObjectStore, key: str, start: int, length: int) -> tuple[int, bytes]:
    """`get_range_into` into a buffer one byte longer than asked, which must stay untouched."""
    buffer = bytearray(b"\xee" * (length + 1))
    placed = store.get_range_into(key, start, memoryview(buffer)[:length])
    assert buffer[length:] == b"\xee"  # nothing written past the view
    return placed, bytes(buffer[:placed])


def test_ranged_reads_into_a_buffer_at_edges(store: ObjectStore) -> None:
    data = _payload(1000)
    store.put("r", data)
    assert _read_into(store, "r", 0, 1) == (1, data[:1])
    assert _read_into(store, "r", 999, 1) == (1, data[999:])
    assert _read_into(store, "r", 10, 0) == (0, b"")
    assert _read_into(store, "r", 0, 1000) == (1000, data)
    assert _read_into(store, "r", 990, 50) == (10, data[990:])
    assert _read_into(store, "r", 1000, 10) == (0, b"")
    with pytest.raises(ObjectNotFoundError):
        store.get_range_into("nope", 0, memoryview(bytearray(10)))


@pytest.mark.parametrize(
    ("start", "sizes"),
    [(0, [1000]), (3, [10, 0, 500, 7]), (900, [50, 50]), (990, [4, 30, 6]), (1000, [5, 5])],
)
def test_a_scatter_read_fills_its_views_in_turn(
    store: ObjectStore, start: int, sizes: list[int]
) -> None:
    """`get_range_into_views`: one request where the store can (`ScatterReads`), a read per view
    otherwise; either way the views hold the range's bytes back to back, short at the end, and
    nothing is written past them."""
    data = _payload(1000, seed=3)
    store.put("r", data)
    buffer = bytearray(b"\xee" * (sum(sizes) + len(sizes)))
    views, at = [], 0
    for size in sizes:  # one guard byte after each view
        views.append(memoryview(buffer)[at : at + size])
        at += size + 1
    placed = get_range_into_views(store, "r", start, views)
    expected = data[start : start + sum(sizes)]
    assert placed == len(expected)
    joined = b"".join(bytes(view) for view in views)
    assert joined[:placed] == expected
    at = 0
    for size in sizes:
        assert buffer[at + size] == 0xEE  # the guard after each view is untouched
        at += size + 1
    with pytest.raises(ObjectNotFoundError):
        get_range_into_views(store, "nope", 0, [memoryview(bytearray(10))])


def test_ranged_read_into_a_tensor_of_a_streamed_object(store: ObjectStore) -> None:
    data = os.urandom(2 * PART + 123)
    with store.open_writer("big") as writer:
        writer.write(data)
    target = torch.zeros(PART + 7, dtype=torch.uint8)
    memory = target.numpy().data
    assert store.get_range_into("big", PART - 5, memory) == PART + 7
    assert bytes(memory) == data[PART - 5 : 2 * PART + 2]


def test_create_only_put_conflicts(store: ObjectStore) -> None:
    store.put("m.json", b"first", create_only=True)
    with pytest.raises(AlreadyExistsError):
        store.put("m.json", b"second", create_only=True)
    assert store.get("m.json") == b"first"
    store.put("m.json", b"overwrite")
    assert store.get("m.json") == b"overwrite"


def test_create_only_streamed_conflicts_small_and_multipart(store: ObjectStore) -> None:
    for size in (10, 2 * PART + 1):
        key = f"c-{size}"
        with store.open_writer(key, create_only=True) as writer:
            writer.write(_payload(size))
        writer2 = store.open_writer(key, create_only=True)
        writer2.write(os.urandom(size))
        with pytest.raises(AlreadyExistsError):
            writer2.commit()
        assert store.get(key) == _payload(size)
    assert store.list_uploads() == []


def test_concurrent_create_only_has_one_winner(store: ObjectStore) -> None:
    results: list[str] = []
    lock = threading.Lock()

    def attempt(i: int) -> None:
        try:
            store.put("race", f"writer-{i}".encode(), create_only=True)
            outcome = "won"
        except AlreadyExistsError:
            outcome = "lost"
        with lock:
            results.append(outcome)

    threads = [threading.Thread(target=attempt, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(results) == ["lost"] * 5 + ["won"]


def test_abort_leaves_nothing(store: ObjectStore) -> None:
    writer = store.open_writer("aborted/obj")
    writer.write(os.urandom(2 * PART + 3))
    writer.abort()
    writer.abort()  # idempotent
    assert not store.exists("aborted/obj")
    assert list(store.list("aborted/")) == []
    assert store.list_uploads() == []


def test_error_inside_writer_block_aborts(store: ObjectStore) -> None:
    with pytest.raises(RuntimeError, match="boom"), store.open_writer("x/y") as writer:
        writer.write(os.urandom(PART + 1))
        raise RuntimeError("boom")
    assert not store.exists("x/y")
    assert store.list_uploads() == []


def test_list_paginates_and_filters(store: ObjectStore) -> None:
    keys = [f"step-{i:03d}/obj" for i in range(23)] + ["other/file"]
    for key in keys:
        store.put(key, key.encode())
    listed = [info.key for info in store.list("step-")]
    assert listed == sorted(k for k in keys if k.startswith("step-"))
    assert [i.size for i in store.list("step-001/")] == [len(b"step-001/obj")]
    assert sorted(i.key for i in store.list()) == sorted(keys)


DELIMITED_KEYS = [
    "step-000000001/manifest.json",
    "step-000000001/tier.json",
    "step-000000001/a-x/r0",
    "step-000000001/a-x/r1",
    "step-000000001/a-y/abc/r0",
    "step-000000001/quarantined-1/manifest.json",
    "step-000000002/a-z/r0",
    "step-000000002/b-a-c",
    "step-000000003/manifest.json",
    "step-0001x/a-q/z",
    "step-a-b",
    "step-/a-x",
    "other/a-file",
]


def test_list_delimited_rolls_up_like_s3(
    store: ObjectStore, caplog: pytest.LogCaptureFixture
) -> None:
    for key in DELIMITED_KEYS:
        store.put(key, key.encode())
    listing = store.list_delimited("step-", "/a-")
    assert [(o.key, o.size) for o in listing.objects] == [
        (key, len(key))
        for key in [
            "step-000000001/manifest.json",
            "step-000000001/quarantined-1/manifest.json",
            "step-000000001/tier.json",
            "step-000000002/b-a-c",
            "step-000000003/manifest.json",
            "step-a-b",
        ]
    ]
    assert listing.prefixes == [
        "step-/a-",
        "step-000000001/a-",
        "step-000000002/a-",
        "step-0001x/a-",
    ]
    slash = store.list_delimited("step-000000001/", "/")
    assert [o.key for o in slash.objects] == [
        "step-000000001/manifest.json",
        "step-000000001/tier.json",
    ]
    assert slash.prefixes == [
        "step-000000001/a-x/",
        "step-000000001/a-y/",
        "step-000000001/quarantined-1/",
    ]
    # the delimiter is looked for after the prefix only, never inside it
    assert store.list_delimited("step-000000001/a-", "/").prefixes == [
        "step-000000001/a-x/",
        "step-000000001/a-y/",
    ]
    for prefix, delimiter in [("", "/"), ("", "/a-"), ("step-0", "-"), ("none-", "/")]:
        expected = roll_up(store.list(prefix), prefix, delimiter)
        found = store.list_delimited(prefix, delimiter)
        assert [o.key for o in found.objects] == [o.key for o in expected.objects]
        assert found.prefixes == expected.prefixes
    with pytest.raises(InvalidArgumentError):
        store.list_delimited("step-", "")
    if store.uri.startswith("az://"):
        # Azurite mislists a delimiter of more than one character (Azure takes any string), so
        # only that one falls back to a full listing
        warned = [r.getMessage() for r in caplog.records if "does not list by" in r.getMessage()]
        assert len(warned) == 1 and "delimiter '/a-'" in warned[0]
    else:
        assert "does not list by the delimiter" not in caplog.text  # the server did the rolling up


def test_delete_many(store: ObjectStore) -> None:
    for i in range(5):
        store.put(f"d/{i}", b"x")
    store.delete_many([f"d/{i}" for i in range(3)] + ["d/never-existed"])
    assert [i.key for i in store.list("d/")] == ["d/3", "d/4"]
    store.delete_many([])


@pytest.mark.parametrize(
    "key", ["../escape", "a/../../b", "/abs", "s3://other/key", "a//b", "a\\b", "", "a/./b"]
)
def test_bad_keys_are_rejected(store: ObjectStore, key: str) -> None:
    with pytest.raises(InvalidKeyError):
        store.put(key, b"x")
    with pytest.raises(InvalidKeyError):
        store.get(key)


def test_stores_with_same_uri_share_objects(store: ObjectStore) -> None:
    key = f"shared-{uuid.uuid4().hex}"
    store.put(key, b"seen")
    options = {"part_size": PART} if store.uri.startswith("s3://") else {}
    other = open_store(store.uri, **options)
    try:
        assert other.get(key) == b"seen"
    finally:
        other.close()


# Copies between stores (`spotckpt.storage.copying`): into every store, from another and itself --


class FailingSource:
    """A source whose ranged reads fail after `pieces` of them (a connection lost mid-copy)."""

    def __init__(self, inner: ObjectStore, pieces: int) -> None:
        self.inner, self.pieces = inner, pieces

    def __getattr__(self, name: str) -> object:
        return getattr(self.inner, name)

    def get_range_into(self, key: str, start: int, buffer: memoryview) -> int:
        if self.pieces == 0:
            raise ConnectionResetError("lost mid-copy")
        self.pieces -= 1
        return self.inner.get_range_into(key, start, buffer)


@pytest.mark.parametrize("size", [0, 1, 3 * PART + 7])
@pytest.mark.parametrize("origin", ["memory", "itself"])
def test_a_copy_lands_every_byte(
    store: ObjectStore, memory_uri: str, origin: str, size: int
) -> None:
    source = store if origin == "itself" else open_store(memory_uri)
    payload = _payload(size, seed=size % 200)
    source.put(f"from/{size}", payload)
    pieces: list[int] = []
    copied = copy_object(
        source, f"from/{size}", store, f"to/{size}", piece_bytes=2 * MIB, on_piece=pieces.append
    )
    assert store.get(f"to/{size}") == payload
    assert copied.info.size == size
    # only S3 and GCS copy inside themselves without the bytes passing through; the rest stream
    inside = store.uri.startswith(("s3://", "gs://"))
    assert copied.server_side == (origin == "itself" and inside)
    if copied.server_side:
        assert copied.crc32c is None and pieces == []
    else:
        assert copied.crc32c == crc32c(payload)
        assert sum(pieces) == size and all(0 < p <= 2 * MIB for p in pieces)


def test_a_create_only_copy_never_replaces(store: ObjectStore, memory_uri: str) -> None:
    source = open_store(memory_uri)
    source.put("new", _payload(PART + 3, seed=1))
    store.put("taken", b"first")
    store.put("new", _payload(PART + 3, seed=1))
    for origin in (source, store):  # streamed, and (on S3) server-side
        with pytest.raises(AlreadyExistsError):
            copy_object(origin, "new", store, "taken", create_only=True)
        assert store.get("taken") == b"first"
    copy_object(source, "new", store, "fresh", create_only=True)
    assert store.get("fresh") == _payload(PART + 3, seed=1)


def test_a_copy_of_a_missing_object_creates_nothing(store: ObjectStore, memory_uri: str) -> None:
    for origin in (open_store(memory_uri), store):
        with pytest.raises(ObjectNotFoundError):
            copy_object(origin, "never-written", store, "copy-of-nothing")
        assert not store.exists("copy-of-nothing")


def test_a_copy_that_fails_midway_leaves_nothing(store: ObjectStore, memory_uri: str) -> None:
    source = open_store(memory_uri)
    source.put("big", _payload(3 * PART, seed=2))
    with pytest.raises(ConnectionResetError):
        copy_object(FailingSource(source, 2), "big", store, "half", piece_bytes=PART)  # type: ignore[arg-type]
    assert not store.exists("half")
    assert [u for u in store.list_uploads() if u.key == "half"] == []


class ShortHead:
    """A source whose listing says `less` bytes fewer than the object holds (it grew since)."""

    def __init__(self, inner: ObjectStore, less: int) -> None:
        self.inner, self.less = inner, less

    def __getattr__(self, name: str) -> object:
        return getattr(self.inner, name)

    def head(self, key: str) -> object:
        found = self.inner.head(key)
        return None if found is None else dataclasses.replace(found, size=found.size - self.less)


def test_a_copy_commits_only_what_the_caller_expects(store: ObjectStore, memory_uri: str) -> None:
    """Told the object's size and CRC32C (a manifest's), and BLAKE3 where signed, a copy keeps
    only bytes that match: streamed, checked before it commits (always, unless create-only); a
    create-only copy the provider makes server-side is read back and checked at the target, and
    deleted when it differs. Told nothing, it checks that the source ends where its listing
    said."""
    payload = _payload(PART + 17, seed=3)
    for origin in (open_store(memory_uri), store):
        origin.put("src", payload)
        good = Expected(len(payload), crc32c(payload), chunk_hash(payload))
        copied = copy_object(origin, "src", store, "ok", expected=good)
        assert not copied.server_side and copied.crc32c == good.crc32c
        assert store.get("ok") == payload
        store.delete_many(["ok"])
        copied = copy_object(origin, "src", store, "ok", expected=good, create_only=True)
        assert copied.crc32c == good.crc32c and store.get("ok") == payload
        store.delete_many(["ok"])
        for wrong in (
            Expected(len(payload), good.crc32c ^ 1),
            Expected(len(payload) - 1, good.crc32c),
            Expected(len(payload), good.crc32c, "0" * 64),
        ):
            with pytest.raises(CorruptCheckpointError):
                copy_object(origin, "src", store, "bad", expected=wrong, create_only=True)
            assert not store.exists("bad")
        with pytest.raises(StorageError, match="grew past"):
            copy_object(ShortHead(origin, 5), "src", store, "grown", piece_bytes=PART)  # type: ignore[arg-type]
        assert not store.exists("grown")
    assert [u for u in store.list_uploads() if u.key in ("bad", "grown")] == []
