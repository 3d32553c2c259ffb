"""``memory://name``: an in-process store for tests and the local tier of experiments.

Stores with the same name share their objects within one process, so a manager and a test that
opens the same URI see the same bytes. They live in that process only: pickling one (to send it to
another process) is refused with `InvalidArgumentError`.
"""

from __future__ import annotations

import builtins
import threading
from collections.abc import Iterable, Iterator
from datetime import datetime, timezone
from typing import Any, NoReturn
from urllib.parse import urlsplit

from spotckpt.errors import InvalidArgumentError
from spotckpt.storage.base import (
    AlreadyExistsError,
    Listing,
    ObjectInfo,
    ObjectNotFoundError,
    StorageError,
    UploadInfo,
    WriterBase,
    check_delimiter,
    check_key,
    roll_up,
)

_BUCKETS: dict[str, dict[str, tuple[bytes, datetime]]] = {}
_BUCKETS_LOCK = threading.Lock()


class MemoryWriter(WriterBase):
    """Buffers the object and publishes it on commit."""

    def __init__(self, store: MemoryStore, key: str, create_only: bool) -> None:
        self._store = store
        self._key = key
        self._create_only = create_only
        self._parts: list[bytes] = []
        self._size = 0
        self._done = False

    @property
    def bytes_written(self) -> int:
        return self._size

    def write(self, data: bytes | bytearray | memoryview) -> None:
        if self._done:
            raise StorageError(f"write to {self._key!r} after commit or abort")
        self._parts.append(bytes(data))
        self._size += len(data)

    def commit(self) -> ObjectInfo:
        if self._done:
            raise StorageError(f"commit of {self._key!r} after commit or abort")
        self._done = True
        data = b"".join(self._parts)
        self._parts = []
        return self._store.put(self._key, data, create_only=self._create_only)

    def abort(self) -> None:
        self._done = True
        self._parts = []


class MemoryStore:
    """A dict of bytes guarded by a lock, shared by name."""

    def __init__(self, name: str) -> None:
        self._name = name
        with _BUCKETS_LOCK:
            self._objects = _BUCKETS.setdefault(name, {})
        self._lock = threading.Lock()

    @property
    def uri(self) -> str:
        return f"memory://{self._name}"

    def open_writer(self, key: str, *, create_only: bool = False) -> MemoryWriter:
        return MemoryWriter(self, check_key(key), create_only)

    def put(self, key: str, data: bytes, *, create_only: bool = False) -> ObjectInfo:
        check_key(key)
        now = datetime.now(timezone.utc)
        with self._lock:
            if create_only and key in self._objects:
                raise AlreadyExistsError(f"{self.uri}/{key} already exists")
            self._objects[key] = (bytes(data), now)
        return ObjectInfo(key, len(data), now)

    def get(self, key: str) -> bytes:
        check_key(key)
        with self._lock:
            entry = self._objects.get(key)
        if entry is None:
            raise ObjectNotFoundError(f"{self.uri}/{key} does not exist")
        return entry[0]

    def get_range(self, key: str, start: int, length: int) -> bytes:
        if start < 0 or length < 0:
            raise InvalidArgumentError("range start and length must be non-negative")
        return self.get(key)[start : start + length]

    def get_range_into(self, key: str, start: int, buffer: memoryview) -> int:
        if start < 0:
            raise InvalidArgumentError("range start must be non-negative")
        data = memoryview(self.get(key))[start : start + buffer.nbytes]
        buffer[: data.nbytes] = data
        return data.nbytes

    def head(self, key: str) -> ObjectInfo | None:
        with self._lock:
            entry = self._objects.get(check_key(key))
        return None if entry is None else ObjectInfo(key, len(entry[0]), entry[1])

    def exists(self, key: str) -> bool:
        return self.head(key) is not None

    def list(self, prefix: str = "") -> Iterator[ObjectInfo]:
        with self._lock:
            items = sorted((k, len(v[0]), v[1]) for k, v in self._objects.items())
        for key, size, when in items:
            if key.startswith(prefix):
                yield ObjectInfo(key, size, when)

    def list_delimited(self, prefix: str, delimiter: str) -> Listing:
        return roll_up(self.list(prefix), prefix, check_delimiter(delimiter))

    def delete_many(self, keys: Iterable[str]) -> None:
        keys = [check_key(k) for k in keys]
        with self._lock:
            for key in keys:
                self._objects.pop(key, None)

    def list_uploads(self, prefix: str = "") -> builtins.list[UploadInfo]:
        return []

    def abort_upload(self, upload: UploadInfo) -> None:
        return None

    def close(self) -> None:
        return None

    def __reduce__(self) -> NoReturn:
        raise InvalidArgumentError(
            f"{self.uri} lives in this process only and cannot be rebuilt in another one (DCP's "
            "process-mode async save runs the writer in a child process); use a file:// folder "
            "or an object store, or save asynchronously in a thread instead of a process"
        )


def drop_memory_store(name: str) -> None:
    """Forget every object of the named memory store (tests call this between cases)."""
    with _BUCKETS_LOCK:
        _BUCKETS.pop(name, None)


def open_memory_store(uri: str, options: dict[str, Any]) -> MemoryStore:
    """Factory for ``memory://name``; it takes no options."""
    parts = urlsplit(uri)
    name = (parts.netloc + parts.path).strip("/") or "default"
    if options:
        raise InvalidArgumentError(f"memory:// store takes no options {sorted(options)}")
    return MemoryStore(name)
