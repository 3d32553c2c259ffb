"""Shared test helpers: the test tree's paths, comparing saved states, and wrappers of real stores
that inject failures (no mocks of the stores themselves)."""

from __future__ import annotations

import json
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch

from spotckpt.checksum import crc32c
from spotckpt.format.manifest import Manifest
from spotckpt.format.safetensors_io import block_crcs
from spotckpt.layout import EVENT_SUMMARY_KEY, event_key, event_stamp, manifest_key
from spotckpt.storage import ObjectInfo, ObjectStore, ObjectWriter, UploadInfo
from spotckpt.storage.base import Listing

TESTS = Path(__file__).resolve().parent
"""The tests folder: its support modules (workers, fakes, this file) are imported from here."""
REPO = TESTS.parent
SCRIPT = Path(sys.executable).with_name("spotckpt")
"""The ``spotckpt`` console script of the interpreter running the tests."""


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now (for a server or gloo's store)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def assert_equal(a: Any, b: Any, where: str = "") -> None:
    """Tensors bit-equal and everything else equal, through nested dicts, lists and tuples."""
    if isinstance(a, torch.Tensor):
        assert torch.equal(a, b), where
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for key in a:
            assert_equal(a[key], b[key], f"{where}.{key}")
    elif isinstance(a, (list, tuple)):
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_equal(x, y, f"{where}[{i}]")
    else:
        assert a == b, where


def load_saved(path: Path) -> Any:
    """A state a test worker wrote with ``torch.save``."""
    return torch.load(path, weights_only=True)


class InjectedFault(OSError):
    """The failure a test asked for."""


class FailingWriter:
    """Passes writes through to a real writer until the store's byte budget runs out."""

    def __init__(self, inner: ObjectWriter, store: FailingStore) -> None:
        self.inner = inner
        self.store = store

    @property
    def bytes_written(self) -> int:
        return self.inner.bytes_written

    def write(self, data: Any) -> None:
        self.store.budget -= memoryview(data).nbytes
        if self.store.budget < 0:
            raise InjectedFault("injected failure while writing a shard")
        self.inner.write(data)

    def commit(self) -> ObjectInfo:
        return self.inner.commit()

    def abort(self) -> None:
        self.inner.abort()

    def __enter__(self) -> FailingWriter:
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if exc_type is None:
            self.commit()
        else:
            self.abort()


class FailingStore:
    """Delegates to a real store; streamed writes fail once `fail_after_bytes` were written."""

    def __init__(self, inner: ObjectStore, fail_after_bytes: int) -> None:
        self.inner = inner
        self.budget = fail_after_bytes

    @property
    def uri(self) -> str:
        return self.inner.uri

    def open_writer(self, key: str, *, create_only: bool = False) -> FailingWriter:
        return FailingWriter(self.inner.open_writer(key, create_only=create_only), self)

    def put(self, key: str, data: bytes, *, create_only: bool = False) -> ObjectInfo:
        return self.inner.put(key, data, create_only=create_only)

    def get(self, key: str) -> bytes:
        return self.inner.get(key)

    def get_range(self, key: str, start: int, length: int) -> bytes:
        return self.inner.get_range(key, start, length)

    def get_range_into(self, key: str, start: int, buffer: memoryview) -> int:
        return self.inner.get_range_into(key, start, buffer)

    def head(self, key: str) -> ObjectInfo | None:
        return self.inner.head(key)

    def exists(self, key: str) -> bool:
        return self.inner.exists(key)

    def list(self, prefix: str = "") -> Iterator[ObjectInfo]:
        return self.inner.list(prefix)

    def list_delimited(self, prefix: str, delimiter: str) -> Listing:
        return self.inner.list_delimited(prefix, delimiter)

    def delete_many(self, keys: Iterable[str]) -> None:
        self.inner.delete_many(keys)

    def list_uploads(self, prefix: str = "") -> list[UploadInfo]:
        return self.inner.list_uploads(prefix)

    def abort_upload(self, upload: UploadInfo) -> None:
        self.inner.abort_upload(upload)

    def close(self) -> None:
        self.inner.close()


class HookedWriter(FailingWriter):
    """A writer that runs `hook` right after its object became visible in the store."""

    def __init__(self, inner: ObjectWriter, store: FailingStore, hook: Callable[[], None]) -> None:
        super().__init__(inner, store)
        self.hook = hook

    def commit(self) -> ObjectInfo:
        info = self.inner.commit()
        self.hook()
        return info


class AfterWrite(FailingStore):
    """A real store where something happens the moment a streamed object is written.

    The first streamed object whose key ends with `suffix` runs ``then(key)`` right after it
    became visible, before the writer returns: another process deleting or rewriting it, or
    a gc running, between a rank's write and the save's commit. `fired` keeps the key.
    """

    def __init__(self, inner: ObjectStore, suffix: str, then: Callable[[str], None]) -> None:
        super().__init__(inner, fail_after_bytes=1 << 62)
        self.suffix = suffix
        self.then = then
        self.fired: list[str] = []

    def open_writer(self, key: str, *, create_only: bool = False) -> FailingWriter:
        inner = self.inner.open_writer(key, create_only=create_only)
        if self.fired or not key.endswith(self.suffix):
            return FailingWriter(inner, self)
        return HookedWriter(inner, self, lambda: self._fire(key))

    def _fire(self, key: str) -> None:
        self.fired.append(key)
        self.then(key)


class HeldStore(FailingStore):
    """A real store whose streamed writes wait at `gate` while `hold` is set (`waiting` tells
    that one does), or until `released()` says so: an upload caught mid-object, for as long as
    a test needs."""

    def __init__(self, inner: ObjectStore, released: Callable[[], bool] = lambda: False) -> None:
        super().__init__(inner, fail_after_bytes=1 << 62)
        self.hold = False
        self.gate = threading.Event()
        self.waiting = threading.Event()
        self.released = released

    def open_writer(self, key: str, *, create_only: bool = False) -> FailingWriter:
        return _HeldWriter(self.inner.open_writer(key, create_only=create_only), self)


class _HeldWriter(FailingWriter):
    store: HeldStore

    def write(self, data: Any) -> None:
        if self.store.hold:
            self.store.waiting.set()
            end = time.monotonic() + 120
            while not self.store.gate.wait(0.02) and not self.store.released():
                if time.monotonic() > end:
                    raise InjectedFault("the held upload was never released")
        super().write(data)


PAGE = 1000
"""Entries per listing request (objects plus common prefixes), as S3 and GCS answer."""


class CountingStore(FailingStore):
    """A real store that counts the requests S3 would bill for what is asked of it.

    A listing costs one request per `PAGE` entries it hands out (at least one), fetched as the
    caller reads on, as S3's pages are; a delimited listing counts its objects and its common
    prefixes; `delete_many` costs one request per `PAGE` keys. `deleted` keeps every key deleted.
    """

    def __init__(self, inner: ObjectStore) -> None:
        super().__init__(inner, fail_after_bytes=1 << 62)
        self.list_requests = 0
        self.delete_requests = 0
        self.deleted: list[str] = []

    def list(self, prefix: str = "") -> Iterator[ObjectInfo]:
        self.list_requests += 1
        for index, info in enumerate(self.inner.list(prefix)):
            if index and index % PAGE == 0:
                self.list_requests += 1
            yield info

    def list_delimited(self, prefix: str, delimiter: str) -> Listing:
        listing = self.inner.list_delimited(prefix, delimiter)
        entries = len(listing.objects) + len(listing.prefixes)
        self.list_requests += max(1, -(-entries // PAGE))
        return listing

    def delete_many(self, keys: Iterable[str]) -> None:
        batch = list(keys)
        self.delete_requests += -(-len(batch) // PAGE)
        self.deleted += batch
        self.inner.delete_many(batch)


class Exploit:
    """A pickle payload that would create `path` when unpickled without weights_only."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self) -> tuple[Any, tuple[str]]:
        return (Path.touch, (str(self.path),))  # type: ignore[return-value]


def plain_manifest_document(data: bytes) -> dict[str, Any]:
    """A flat manifest's JSON with its packed records (`spotckpt.format.packed`) written out as
    one ``"tensors"`` entry per tensor: the form in which a test forges one tensor's location
    apart from its neighbours'. A signed manifest's ``job`` and ``signature`` are kept as they
    were (the signature no longer matches: tests that keep the step signed sign it again)."""
    original = json.loads(data)
    manifest = Manifest.from_json(data)
    manifest.format = "+".join(f for f in manifest.format.split("+") if f != "packed")
    document = dict(json.loads(manifest.to_json()))
    document.update({k: original[k] for k in ("job", "signature") if k in original})
    return document


def forge_value(root: Path, step: int, fqn: str, payload: bytes) -> None:
    """Replace one stored value with `payload`, fixing every checksum so only the value is bad."""
    document = json.loads((root / manifest_key(step)).read_text())
    entry = document["values"][fqn]
    record = next(o for o in document["objects"] if o["key"] == entry["key"])
    path = root / manifest_key(step).rsplit("/", 1)[0] / entry["key"]
    data = path.read_bytes()
    forged = data[: entry["offset"]] + payload + data[entry["offset"] + entry["length"] :]
    path.write_bytes(forged)
    entry["length"] = len(payload)
    entry["block_crc32c"] = list(block_crcs(payload, document["block_size"]))
    record["size"], record["crc32c"] = len(forged), crc32c(forged)
    (root / manifest_key(step)).write_text(json.dumps(document))


DEEP_JSON = b"[" * 30_000 + b"]" * 30_000
"""JSON nested 30,000 deep: `json.loads` raises RecursionError on it."""
HUGE_INT = b"9" * 400
"""A 400-digit JSON integer: converting it to a float raises OverflowError."""


def forged_event_key(number: int, kind: str = "save") -> str:
    """A well-formed event name stamped 2020, older than any real event (compaction folds it
    first)."""
    return event_key(event_stamp(datetime(2020, 1, 1, tzinfo=timezone.utc)), kind, "f0", number)


FORGED_GOODPUT: dict[str, tuple[str, bytes]] = {
    "deep event": (forged_event_key(1), b'{"kind": "save", "stall_s": ' + DEEP_JSON + b"}"),
    "huge int in an event": (
        forged_event_key(2, "preemption"),
        b'{"kind": "preemption", "train_s": 1.0, "steps_lost": ' + HUGE_INT + b"}",
    ),
    "deep summary": (EVENT_SUMMARY_KEY, b'{"counts": ' + DEEP_JSON + b"}"),
    "huge int in the summary": (
        EVENT_SUMMARY_KEY,
        b'{"events": 1, "counts": {"preemption": ' + HUGE_INT + b'}, "sums": {"train_s": 1}}',
    ),
}
"""One forged goodput object each (key, bytes) that broke a JSON parse or a float conversion."""


def corrupt_keeping_crc32c(path: Path, distance: int = 70_000) -> None:
    """Damage a stored object so that its whole CRC32C (what a node checks before it uses or
    serves a copy) stays the same while the CRC32Cs of two of its 64 KiB blocks (what a load
    checks) change: a byte in the middle is flipped, and four bytes `distance` further on are
    set to cancel it out of the object's CRC32C (`flip_keeping_crc32c`)."""
    data = bytearray(path.read_bytes())
    flip = len(data) // 2
    assert flip + distance + 4 <= len(data), f"{path} is too small to damage this way"
    flip_keeping_crc32c(data, flip, flip + distance)
    path.write_bytes(bytes(data))


def flip_keeping_crc32c(data: bytearray, flip: int, fix: int) -> None:
    """Flip byte `flip` of `data` and set the four bytes at `fix` so that the CRC32C of the
    whole stays the same (and of every range holding both, such as a block around them), while
    any strong hash changes. CRC32C is affine over GF(2), so those four bytes are the solution
    of a 32 x 32 linear system."""
    target = crc32c(bytes(data))
    data[flip] ^= 0xFF

    def crc_with(value: int) -> int:
        data[fix : fix + 4] = value.to_bytes(4, "little")
        return crc32c(bytes(data))

    base = crc_with(0)
    columns = [crc_with(1 << bit) ^ base for bit in range(32)]
    crc_with(_solve_gf2(columns, target ^ base))
    assert crc32c(bytes(data)) == target


def _solve_gf2(columns: list[int], target: int) -> int:
    """The bits x with the XOR of the columns[i] where bit i of x is set equal to `target`."""
    basis: list[tuple[int, int]] = []  # (value, which columns make it), distinct top bits
    for index, column in enumerate(columns):
        value, mask = column, 1 << index
        for pivot, combination in basis:
            if value ^ pivot < value:
                value, mask = value ^ pivot, mask ^ combination
        if value:
            basis = sorted([*basis, (value, mask)], reverse=True)
    solution = 0
    for pivot, combination in basis:
        if target ^ pivot < target:
            target, solution = target ^ pivot, solution ^ combination
    assert target == 0, "the columns do not span the target"
    return solution


class SignalledFlag:
    """Set by a signal handler, waited on by the main thread.

    A `threading.Event` cannot do this: its handler's ``set()`` takes the lock that the main
    thread's interrupted ``wait()`` holds, and the process hangs for good (it happened). The
    flag is a plain attribute, and `wait` looks at it every 10 ms, between which the handler
    runs.
    """

    def __init__(self) -> None:
        self.is_set = False

    def set(self) -> None:
        self.is_set = True

    def wait(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while not self.is_set and time.monotonic() < deadline:
            time.sleep(0.01)
        return self.is_set


def write_signing_key(path: Path) -> Path:
    """A fresh PEM Ed25519 private key at `path` (the `signing_key` setting's file)."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    path.write_bytes(
        Ed25519PrivateKey.generate().private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    return path
