"""The object-store protocol that every back end implements, and the pieces they share.

Call order for a streamed object: ``open_writer(key)`` -> ``write(chunk)`` any number of times ->
exactly one of ``commit()`` (the object becomes visible, atomically) or ``abort()`` (nothing becomes
visible and every resource held for it, such as a multipart upload, is released). A writer used as
a context manager aborts when the block raises and commits when it does not.

Keys are relative to the store's root (the path part of the URI), use ``/`` as separator and are
validated by :func:`check_key`: a store never reads or writes outside its root.

``list(prefix)`` yields every object under a prefix. ``list_delimited(prefix, delimiter)`` is the
folder-like listing of S3's ListObjectsV2 and GCS's objects.list with a delimiter: an object whose
key has no `delimiter` after `prefix` is listed; all the others are rolled up into their common
prefix, the key up to and including the first `delimiter` after `prefix`, named once however many
objects share it. Its cost is one request per 1,000 entries (objects plus prefixes), not per
1,000 objects, so ``list_delimited("step-", "/a-")`` finds every manifest of a checkpoint root in
about two entries per step. Any delimiter works (more than one character too); a server that
refuses one, or answers against these rules, is listed in full and rolled up client-side, with
one warning.

``get_range_into`` is ``get_range`` without an intermediate ``bytes`` object: a restore reads
each tensor's bytes from the socket or file into the tensor's own memory. Its scatter form,
`get_range_into_views`, fills several such buffers from one range, in one request where the store
offers it (`ScatterReads`).

Stores pickle as what rebuilds them (URI parts and options), so a storage writer can cross to
another process, such as the child of DCP's process-mode async save; a ``memory://`` store cannot.
Explicit credentials cross only inside `ProcessSecrets` (see there), never into a file.

Which store opens which URI is `spotckpt.storage.registry`'s business (`open_store`); this module
does not import it, nor any back end.

This layer knows nothing of torch, DCP or manifests.
"""

from __future__ import annotations

import abc
import builtins
import logging
import pickle
import re
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from multiprocessing.reduction import ForkingPickler
from types import TracebackType
from typing import Any, NoReturn, Protocol, cast, runtime_checkable

from typing_extensions import Self

from spotckpt.errors import (  # noqa: F401 (re-exported: the storage layer's errors)
    AlreadyExistsError,
    DelimiterNotHonouredError,
    InvalidArgumentError,
    InvalidKeyError,
    ObjectNotFoundError,
    PermissionDeniedError,
    StorageError,
)


@dataclass(frozen=True)
class ObjectInfo:
    """What a listing or a commit tells about one object."""

    key: str
    size: int
    last_modified: datetime | None = None
    crc32c: int | None = None
    """The provider's own CRC32C of the whole object, where an answer carried one (a GCS
    rewrite's): a copy checked against it needs no read-back."""


@dataclass(frozen=True)
class Listing:
    """What `ObjectStore.list_delimited` found: objects, and the prefixes standing for the rest.

    Both are in key order; each prefix ends with the delimiter and stands for at least one object.
    """

    objects: list[ObjectInfo]
    prefixes: list[str]


@dataclass(frozen=True)
class UploadInfo:
    """An unfinished multipart (or resumable) upload found under the store's root."""

    key: str
    upload_id: str
    initiated: datetime | None = None
    last_activity: datetime | None = None
    """When the upload last received data (its newest part), if the store can tell."""


@runtime_checkable
class ObjectWriter(Protocol):
    """A streamed object being written; see the module docstring for the call order."""

    @property
    def bytes_written(self) -> int:
        """Bytes accepted by `write` so far."""

    def write(self, data: bytes | bytearray | memoryview) -> None:
        """Append bytes; may block while earlier parts are still uploading (bounded memory)."""

    def commit(self) -> ObjectInfo:
        """Make the object visible under its key; raises AlreadyExistsError for create-only."""

    def abort(self) -> None:
        """Discard everything written; safe to call more than once and after a failed commit."""

    def __enter__(self) -> Self: ...

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None: ...


@runtime_checkable
class ObjectStore(Protocol):
    """One bucket prefix or folder. Implementations are thread-safe."""

    @property
    def uri(self) -> str:
        """The root URI, without credentials."""

    def open_writer(self, key: str, *, create_only: bool = False) -> ObjectWriter:
        """Start a streamed write of `key`; see the module docstring."""

    def put(self, key: str, data: bytes, *, create_only: bool = False) -> ObjectInfo:
        """Write a small object in one request; create-only raises AlreadyExistsError."""

    def get(self, key: str) -> bytes:
        """Read a whole object; raises ObjectNotFoundError."""

    def get_range(self, key: str, start: int, length: int) -> bytes:
        """Read `length` bytes from `start`; a short result means the object is shorter."""

    def get_range_into(self, key: str, start: int, buffer: memoryview) -> int:
        """Read ``buffer.nbytes`` bytes from `start` straight into `buffer` (a writable byte
        view, such as a destination tensor's memory); returns how many arrived, fewer when the
        object is shorter. A retried attempt writes the buffer again from its start."""

    def head(self, key: str) -> ObjectInfo | None:
        """The object's size and time, or None when it does not exist."""

    def exists(self, key: str) -> bool:
        """Whether the object exists."""

    def list(self, prefix: str = "") -> Iterator[ObjectInfo]:
        """Every object whose key starts with `prefix`, in key order, across all pages."""

    def list_delimited(self, prefix: str, delimiter: str) -> Listing:
        """The objects under `prefix` with no `delimiter` after it, and the common prefixes that
        roll up all the others (see the module docstring); one request per 1,000 entries."""

    def delete_many(self, keys: Iterable[str]) -> None:
        """Delete the given objects; missing ones are ignored."""

    def list_uploads(self, prefix: str = "") -> builtins.list[UploadInfo]:
        """Unfinished uploads under `prefix` (empty for stores without multipart uploads)."""

    def abort_upload(self, upload: UploadInfo) -> None:
        """Abort one unfinished upload found by `list_uploads`."""

    def close(self) -> None:
        """Release thread pools and connections."""


class ScatterReads(Protocol):
    """A store that reads one range into several buffers with one request (the bucket stores).

    A restore reads neighbouring tensors with one request each; a store with per-request costs
    (an HTTP round trip, signing, a first-byte latency) offers this, and `get_range_into_views`
    uses it. An optional capability, so a store (or a wrapper around one) without it stays a
    complete `ObjectStore`.
    """

    def get_range_into_views(self, key: str, start: int, views: Sequence[memoryview]) -> int:
        """Read the bytes from `start` on into `views` in turn (back to back in the object);
        returns how many arrived, fewer when the object is shorter. A retried attempt writes
        every view again from its start."""


def reads_scattered(store: ObjectStore) -> bool:
    """Whether `store`'s class offers `ScatterReads`. The class, not the instance: a wrapper
    that forwards unknown attributes to the store it wraps (``__getattr__``) must still see each
    read through its own ``get_range_into``."""
    return callable(getattr(type(store), "get_range_into_views", None))


def get_range_into_views(
    store: ObjectStore, key: str, start: int, views: Sequence[memoryview]
) -> int:
    """`ScatterReads.get_range_into_views` where the store offers it (`reads_scattered`);
    otherwise one ``get_range_into`` per view, stopping at the first short one."""
    if reads_scattered(store):
        return cast(ScatterReads, store).get_range_into_views(key, start, views)
    placed = 0
    for view in views:
        arrived = store.get_range_into(key, start + placed, view)
        placed += arrived
        if arrived < view.nbytes:
            break
    return placed


class WriterBase(abc.ABC):
    """Context-manager behaviour shared by the writers: commit on success, abort on error."""

    @property
    @abc.abstractmethod
    def bytes_written(self) -> int:
        """Bytes accepted by `write` so far."""

    @abc.abstractmethod
    def write(self, data: bytes | bytearray | memoryview) -> None:
        """Append bytes."""

    @abc.abstractmethod
    def commit(self) -> ObjectInfo:
        """Publish the object."""

    @abc.abstractmethod
    def abort(self) -> None:
        """Discard the object."""

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if exc_type is None:
            self.commit()
        else:
            self.abort()


class ChunkedWriter(WriterBase):
    """A writer that cuts the byte stream into fixed-size chunks (S3 parts, GCS chunks).

    Subclasses set ``_buffer``, ``_chunk_limit``, ``_closed`` and ``_size`` in ``__init__`` and
    implement `_chunk_full` (hand the full ``_buffer`` off) and may override `_observe` (see every
    byte once, e.g. for a running checksum). Any error while writing aborts the object.
    """

    _buffer: bytearray
    _chunk_limit: int
    _closed: bool
    _size: int
    _key: str

    @property
    def bytes_written(self) -> int:
        return self._size

    def write(self, data: bytes | bytearray | memoryview) -> None:
        if self._closed:
            raise StorageError(f"write to {self._key!r} after commit or abort")
        view = memoryview(data).cast("B")
        size = view.nbytes
        try:
            self._observe(view)
            while view.nbytes:
                room = self._chunk_limit - len(self._buffer)
                self._buffer += view[:room]
                view = view[room:]
                if len(self._buffer) == self._chunk_limit:
                    self._chunk_full()
        except BaseException:
            self.abort()
            raise
        self._size += size

    def _observe(self, view: memoryview) -> None:
        """See each written piece once, before it is buffered."""

    @abc.abstractmethod
    def _chunk_full(self) -> None:
        """Hand off ``_buffer``, which holds exactly one chunk."""


log = logging.getLogger("spotckpt.storage")


def check_delimiter(delimiter: str) -> str:
    """Return `delimiter` if it is a non-empty string without control characters."""
    if not isinstance(delimiter, str) or not delimiter:
        raise InvalidArgumentError(f"a listing delimiter must be a non-empty string: {delimiter!r}")
    if len(delimiter) > MAX_KEY_LENGTH or any(ord(c) < 32 for c in delimiter):
        raise InvalidArgumentError(
            f"listing delimiter {delimiter!r} is too long or has a control character"
        )
    return delimiter


def rolled_up(key: str, prefix: str, delimiter: str) -> str | None:
    """The common prefix standing for `key` in a delimited listing under `prefix`: the key up to
    and including the first `delimiter` after `prefix`; None when there is none (it is listed)."""
    at = key.find(delimiter, len(prefix))
    return None if at < 0 else key[: at + len(delimiter)]


def roll_up(objects: Iterable[ObjectInfo], prefix: str, delimiter: str) -> Listing:
    """The delimited listing of `objects` (a full listing under `prefix`), computed here."""
    kept: list[ObjectInfo] = []
    prefixes: set[str] = set()
    for info in objects:
        if not info.key.startswith(prefix):
            continue
        common = rolled_up(info.key, prefix, delimiter)
        if common is None:
            kept.append(info)
        else:
            prefixes.add(common)
    return Listing(sorted(kept, key=lambda info: info.key), sorted(prefixes))


class ListingPages:
    """Gathers the pages of a server's delimited listing and checks them against the rules.

    An object whose key still holds the delimiter (a server that ignores it) is rolled up here;
    anything that cannot be repaired raises `DelimiterNotHonouredError`.
    """

    def __init__(self, prefix: str, delimiter: str) -> None:
        self.prefix = prefix
        self.delimiter = delimiter
        self.objects: list[ObjectInfo] = []
        self.prefixes: set[str] = set()
        self.tokens: set[str] = set()
        self.last: str | None = None

    def add(
        self, objects: Iterable[ObjectInfo], prefixes: Iterable[str], token: str | None
    ) -> None:
        """One page: its objects, its common prefixes (relative keys) and its next-page token."""
        found, rolled = list(objects), list(prefixes)
        for name in rolled:
            if (
                not name.startswith(self.prefix)
                or rolled_up(name, self.prefix, self.delimiter) != name
            ):
                raise DelimiterNotHonouredError(f"it answered with the common prefix {name!r}")
        names = [info.key for info in found] + rolled
        if names and self.last is not None and min(names) <= self.last:
            raise DelimiterNotHonouredError(f"a page went back to {min(names)!r}")
        if token is not None and token in self.tokens:
            raise DelimiterNotHonouredError("it sent the same continuation token twice")
        if token is not None:
            self.tokens.add(token)
        if names:
            self.last = max(names)
        self.prefixes.update(rolled)
        for info in found:
            common = rolled_up(info.key, self.prefix, self.delimiter)
            if common is None:
                self.objects.append(info)
            else:
                self.prefixes.add(common)

    def listing(self) -> Listing:
        """Everything gathered, in key order."""
        return Listing(sorted(self.objects, key=lambda info: info.key), sorted(self.prefixes))


class DelimiterSupport:
    """The delimiters a server did not honour; a store lists those in full from then on."""

    def __init__(self) -> None:
        self.refused: set[str] = set()

    def listing(
        self,
        uri: str,
        prefix: str,
        delimiter: str,
        native: Callable[[], Listing],
        full: Callable[[], Iterable[ObjectInfo]],
    ) -> Listing:
        """`native()`, the server's own delimited listing; when it raises
        `DelimiterNotHonouredError` (warned about once) or did before, `roll_up` of `full()`."""
        check_delimiter(delimiter)
        if delimiter not in self.refused:
            try:
                return native()
            except DelimiterNotHonouredError as error:
                self.refused.add(delimiter)
                log.warning(
                    "%s: the server does not list by the delimiter %r (%s); listing every object "
                    "instead, which costs one request per 1000 objects",
                    uri,
                    delimiter,
                    error,
                )
        return roll_up(full(), prefix, delimiter)


_SCHEME = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:")
MAX_KEY_LENGTH = 1024


def check_key(key: str) -> str:
    """Return `key` if it is a plain relative path; raise InvalidKeyError naming the problem."""
    if not isinstance(key, str) or not key:
        raise InvalidKeyError(f"object key must be a non-empty string, got {key!r}")
    if len(key) > MAX_KEY_LENGTH:
        raise InvalidKeyError(f"object key is longer than {MAX_KEY_LENGTH} characters")
    if key.startswith("/") or key.startswith("\\"):
        raise InvalidKeyError(f"object key {key!r} is absolute")
    if _SCHEME.match(key):
        raise InvalidKeyError(f"object key {key!r} carries a URL scheme")
    if "\\" in key or "\x00" in key or any(ord(c) < 32 for c in key):
        raise InvalidKeyError(f"object key {key!r} has a backslash or control character")
    parts = key.split("/")
    if any(p in ("", ".", "..") for p in parts[:-1]) or parts[-1] in (".", ".."):
        raise InvalidKeyError(f"object key {key!r} has an empty, '.' or '..' path segment")
    return key


def join_key(*parts: str) -> str:
    """Join key segments with single slashes."""
    return "/".join(p.strip("/") for p in parts if p.strip("/"))


class ProcessSecrets:
    """Explicit credentials of a store that may cross to another process, never into a file.

    multiprocessing pickles what it sends through its pipes and queues (DCP's process-mode async
    save sends its storage writer to its child over a `multiprocessing.Pipe`) with
    `ForkingPickler`, for which this class registers a reducer: the values travel in memory
    through the pipe. Every other pickling (``pickle.dump`` to a file, ``torch.save``) is refused
    with `InvalidArgumentError`, so the credentials never land on a disk. Copies share the values.
    """

    __slots__ = ("_values",)

    def __init__(self, values: Mapping[str, str]) -> None:
        self._values = dict(values)

    @property
    def values(self) -> dict[str, str]:
        """The credentials by option name."""
        return dict(self._values)

    def __repr__(self) -> str:
        return f"ProcessSecrets({', '.join(sorted(self._values))}: hidden)"

    def __reduce__(self) -> NoReturn:
        raise InvalidArgumentError(
            f"a store opened with explicit credentials ({', '.join(sorted(self._values))} in its "
            "storage options) is only sent to a child process through multiprocessing, never "
            "pickled otherwise, so the credentials cannot end up in a file; let the store take "
            "them from the environment, a profile or an instance role instead"
        )

    def __copy__(self) -> ProcessSecrets:
        return self

    def __deepcopy__(self, memo: dict[int, Any]) -> ProcessSecrets:
        return self


def _reduce_secrets(secrets: ProcessSecrets) -> tuple[type[ProcessSecrets], tuple[dict[str, str]]]:
    return ProcessSecrets, (secrets.values,)


ForkingPickler.register(ProcessSecrets, _reduce_secrets)


def check_portable(store: ObjectStore) -> None:
    """Raise InvalidArgumentError unless `store` can be rebuilt in another process (a child of
    DCP's process-mode async save, say); ``memory://`` stores and unpicklable stores cannot."""
    try:
        ForkingPickler.dumps(store)
    except InvalidArgumentError:
        raise
    except (pickle.PicklingError, TypeError, AttributeError) as error:
        raise InvalidArgumentError(
            f"the store {store.uri} cannot be rebuilt in another process ({error}); open it from "
            "its URI with open_store, or save asynchronously in a thread instead of a process"
        ) from None
