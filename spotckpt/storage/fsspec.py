"""``fsspec+<protocol>://...``: any filesystem fsspec speaks (HDFS, OCI, HF buckets, SFTP, ...)
as a store, promising what that filesystem guarantees and no more.

The commit point of a save is a create-only write (`ObjectStore.put` with ``create_only``), so
how a filesystem can create a file exclusively decides what this store does with one:

- ``file``/``local``: every object is written to a hidden temporary name beside its final one
  and then renamed into place, or, create-only, hard-linked (``os.link`` fails when the name
  exists: exclusive and atomic), the temporary name removed after.
- ``s3``/``s3a`` (s3fs): the object is streamed with s3fs's ``"xb"`` mode for create-only writes,
  which sends ``If-None-Match: *`` on the PUT or on the multipart completion (S3 answers 412);
  an aborted write discards its multipart upload. (gcsfs sends no precondition, so ``gs`` is not
  in this list.)
- ``memory``: the object is buffered and published on commit with ``"xb"``, which refuses an
  existing name; create-only commits are serialised in this process, the memory filesystem's
  only one.
- any other protocol: objects are streamed with ``"wb"``, and a create-only write is refused
  with `InvalidArgumentError` unless the store is opened with ``unsafe_create_only=True``, the
  documented weaker mode: the name is checked, then written, so two writers racing for one step
  can both "win" and the later one's manifest replaces the earlier's.

Keys map to ``<root>/<key>``; listings walk the folder above the prefix (``find``) and filter,
and ``list_delimited`` rolls that listing up here (fsspec has no delimiter parameter). Filesystem
instances come from ``fsspec.filesystem(protocol, **storage_options)``; the storage options of
the store (other than ``unsafe_create_only``) go to it. A store pickles as its URI and options;
options that name credentials (`spotckpt.redact.is_secret_key`) cross only inside
`ProcessSecrets`. Retries are the filesystem's own (s3fs and gcsfs retry inside themselves).
"""

from __future__ import annotations

import builtins
import contextlib
import threading
import uuid
from collections.abc import Iterable, Iterator
from datetime import datetime, timezone
from typing import Any
from urllib.parse import urlsplit

import fsspec

from spotckpt.errors import InvalidArgumentError
from spotckpt.redact import is_secret_key
from spotckpt.storage.base import (
    AlreadyExistsError,
    Listing,
    ObjectInfo,
    ObjectNotFoundError,
    PermissionDeniedError,
    ProcessSecrets,
    StorageError,
    UploadInfo,
    WriterBase,
    check_delimiter,
    check_key,
    roll_up,
)

PREFIX = "fsspec+"
LINKED = frozenset({"file", "local"})
"""Protocols on a local disk: temporary file, then rename, or hard link for create-only."""
STREAMED_EXCLUSIVE = frozenset({"s3", "s3a"})
"""Protocols whose ``"xb"`` mode is a server-side create-only write (s3fs: If-None-Match)."""
BUFFERED = frozenset({"memory"})
"""Protocols whose ``"xb"`` refuses an existing name in this process."""
EXCLUSIVE = LINKED | STREAMED_EXCLUSIVE | BUFFERED
TEMPORARY_MARK = ".spotckpt-tmp-"
TEMPORARY = "temporary-file"
"""The `UploadInfo.upload_id` of a leftover temporary file of a local filesystem."""
_MEMORY_COMMITS = threading.Lock()


class FsspecWriter(WriterBase):
    """One object: streamed into a file of the filesystem, published as its protocol allows."""

    def __init__(self, store: FsspecStore, key: str, create_only: bool) -> None:
        self._store = store
        self._key = key
        self._create_only = create_only
        self._size = 0
        self._done = False
        self._path = store.path(key)
        self._parts: list[bytes] = []
        self._file: Any = None
        self._temporary: str | None = None
        protocol = store.protocol
        if protocol in LINKED:
            folder, _, name = self._path.rpartition("/")
            self._temporary = f"{folder}/.{name}{TEMPORARY_MARK}{uuid.uuid4().hex}"
            self._file = store.run(f"open {key}", lambda: _open(store, self._temporary, "wb"))
        elif protocol not in BUFFERED:
            mode = "xb" if create_only and protocol in STREAMED_EXCLUSIVE else "wb"
            self._file = store.run(f"open {key}", lambda: _open(store, self._path, mode))

    @property
    def bytes_written(self) -> int:
        return self._size

    def write(self, data: bytes | bytearray | memoryview) -> None:
        if self._done:
            raise StorageError(f"write to {self._key!r} after commit or abort")
        try:
            if self._file is None:
                self._parts.append(bytes(data))
            else:
                self._store.run(f"write {self._key}", lambda: self._file.write(data))
        except BaseException:
            self.abort()
            raise
        self._size += memoryview(data).nbytes

    def commit(self) -> ObjectInfo:
        if self._done:
            raise StorageError(f"commit of {self._key!r} after commit or abort")
        try:
            self._publish()
        except BaseException:
            self.abort()
            raise
        self._done = True
        return ObjectInfo(self._key, self._size)

    def _publish(self) -> None:
        store = self._store
        what = f"commit {store.where(self._key)}"
        if self._file is None:  # buffered: publish in one step
            data = b"".join(self._parts)
            if not self._create_only:
                store.run(what, lambda: store.fs.pipe_file(self._path, data))
                return
            with _MEMORY_COMMITS:
                store.run(what, lambda: store.fs.pipe_file(self._path, data, mode="create"))
            return
        if self._temporary is None:  # streamed straight to its name: visible on close
            store.run(what, self._file.close)
            return
        store.run(what, self._file.close)
        if self._create_only:
            store.run(what, lambda: store.fs.link(self._temporary, self._path))
            store.run(what, lambda: store.fs.rm_file(self._temporary))
        else:
            store.run(what, lambda: store.fs.mv(self._temporary, self._path))

    def abort(self) -> None:
        if self._done:
            return
        self._done = True
        self._parts = []
        if self._file is not None and not self._file.closed:
            discard = getattr(self._file, "discard", None)
            try:
                if discard is not None and self._temporary is None:
                    discard()  # s3fs: aborts the multipart upload; nothing is published
                    self._file.closed = True  # so that its finaliser publishes nothing either
                else:
                    self._file.close()
            except Exception:  # the original error, if any, is what the caller sees
                pass
        if self._temporary is not None:
            with contextlib.suppress(OSError):
                self._store.fs.rm_file(self._temporary)


def _open(store: FsspecStore, path: str, mode: str) -> Any:
    """A file of the filesystem opened for writing, its folder made first where folders exist
    (S3 has none; a filesystem that cannot make one says so when the file is opened)."""
    if store.protocol not in STREAMED_EXCLUSIVE:
        with contextlib.suppress(NotImplementedError):
            store.fs.makedirs(path.rpartition("/")[0], exist_ok=True)
    return store.fs.open(path, mode)


class FsspecStore:
    """A folder of an fsspec filesystem; see the module docstring for what create-only means."""

    def __init__(self, uri: str, options: dict[str, Any]) -> None:
        parts = urlsplit(uri)
        if not parts.scheme.startswith(PREFIX) or len(parts.scheme) == len(PREFIX):
            raise InvalidArgumentError(f"an fsspec URI reads fsspec+<protocol>://..., not {uri!r}")
        if parts.username or parts.password or "?" in uri or "#" in uri:
            raise InvalidArgumentError(
                "an fsspec URI must not carry credentials, a query or a fragment; they go in "
                "the storage options"
            )
        self.protocol = parts.scheme[len(PREFIX) :]
        options = dict(options)
        unsafe = options.pop("unsafe_create_only", False)
        if isinstance(unsafe, str):  # from a command line or a config file
            unsafe = unsafe.strip().lower() in ("1", "true", "yes", "on")
        self.unsafe_create_only = bool(unsafe)
        self._options = options
        try:
            self.fs = fsspec.filesystem(self.protocol, **options)
        except (ImportError, ValueError) as error:
            raise InvalidArgumentError(
                f"fsspec has no usable {self.protocol!r} filesystem here: {error}"
            ) from None
        root = self.fs._strip_protocol(f"{self.protocol}://{parts.netloc}{parts.path}")
        self.root = str(root).rstrip("/")
        if not self.root and self.protocol not in BUFFERED:
            raise InvalidArgumentError(f"fsspec URI {uri!r} names no folder")
        self._uri = f"{PREFIX}{self.protocol}://{parts.netloc}{parts.path}".rstrip("/")

    # Names ----------------------------------------------------------------------------------

    @property
    def uri(self) -> str:
        """The root URI."""
        return self._uri

    def path(self, key: str) -> str:
        """The filesystem path of a key (checked)."""
        check_key(key)
        return f"{self.root}/{key}"

    def where(self, key: str) -> str:
        """The object's URI, for messages."""
        return f"{self._uri}/{key}"

    def run(self, what: str, fn: Any) -> Any:
        """Call the filesystem; its errors leave as the storage layer's, naming `what`."""
        try:
            return fn()
        except StorageError:
            raise
        except FileExistsError:
            raise AlreadyExistsError(f"{what}: the object already exists") from None
        except FileNotFoundError:
            raise ObjectNotFoundError(f"{what}: not found") from None
        except PermissionError as error:
            raise PermissionDeniedError(f"{what}: {error}") from None
        except (OSError, ValueError, RuntimeError) as error:
            raise StorageError(f"{what}: {type(error).__name__}: {error}") from error

    # Writes ---------------------------------------------------------------------------------

    def _check_create_only(self) -> None:
        if self.protocol in EXCLUSIVE or self.unsafe_create_only:
            return
        raise InvalidArgumentError(
            f"the fsspec {self.protocol!r} filesystem cannot create a file exclusively, so "
            "spotckpt cannot commit a checkpoint there without risking two jobs overwriting "
            "each other's manifest; open the store with unsafe_create_only=True to accept "
            "that (check, then write), or use a store that can (s3://, gs://, az://, a folder)"
        )

    def open_writer(self, key: str, *, create_only: bool = False) -> FsspecWriter:
        """Start a write of `key` (see the module docstring)."""
        check_key(key)
        if create_only:
            self._check_create_only()
            if self.protocol not in EXCLUSIVE and self.exists(key):  # the weaker mode
                raise AlreadyExistsError(f"put {self.where(key)}: the object already exists")
        return FsspecWriter(self, key, create_only)

    def put(self, key: str, data: bytes, *, create_only: bool = False) -> ObjectInfo:
        """Write a small object; create-only raises AlreadyExistsError."""
        with self.open_writer(key, create_only=create_only) as writer:
            writer.write(data)
        return ObjectInfo(key, len(data))

    # Reads ----------------------------------------------------------------------------------

    def get(self, key: str) -> bytes:
        """Read a whole object; raises ObjectNotFoundError."""
        path = self.path(key)
        return bytes(self.run(f"get {self.where(key)}", lambda: self.fs.cat_file(path)))

    def get_range(self, key: str, start: int, length: int) -> bytes:
        """Read `length` bytes from `start`; short or empty past the object's end."""
        if start < 0 or length < 0:
            raise InvalidArgumentError("range start and length must be non-negative")
        path = self.path(key)
        if length == 0:
            return b""
        what = f"get bytes {start}-{start + length - 1} of {self.where(key)}"
        try:
            return bytes(
                self.run(what, lambda: self.fs.cat_file(path, start=start, end=start + length))
            )
        except ObjectNotFoundError:
            raise
        except StorageError:
            info = self.head(key)  # s3fs refuses a range past the end (416); others return b""
            if info is not None and start >= info.size:
                return b""
            raise

    def get_range_into(self, key: str, start: int, buffer: memoryview) -> int:
        """Read into `buffer` from `start`; fewer bytes past the object's end."""
        data = self.get_range(key, start, buffer.nbytes)
        buffer[: len(data)] = data
        return len(data)

    def head(self, key: str) -> ObjectInfo | None:
        """The object's size and time, or None when it does not exist."""
        path = self.path(key)
        try:
            info = self.run(f"head {self.where(key)}", lambda: self.fs.info(path))
        except ObjectNotFoundError:
            return None
        if info.get("type") == "directory":
            return None
        return ObjectInfo(key, int(info.get("size") or 0), _modified(info))

    def exists(self, key: str) -> bool:
        """Whether the object exists."""
        return self.head(key) is not None

    # Listings -------------------------------------------------------------------------------

    def _find(self, prefix: str) -> dict[str, dict[str, Any]]:
        folder = prefix.rpartition("/")[0]
        base = f"{self.root}/{folder}".rstrip("/") if folder else self.root
        self.fs.invalidate_cache(base)
        try:
            return dict(self.fs.find(base, detail=True, withdirs=False))
        except FileNotFoundError:
            return {}

    def list(self, prefix: str = "") -> Iterator[ObjectInfo]:
        """Every object whose key starts with `prefix`, in key order."""
        if prefix:
            check_key(prefix)
        found = self.run(f"list {self._uri}/{prefix}", lambda: self._find(prefix))
        skip = len(self.fs._strip_protocol(self.root).rstrip("/")) + 1 if self.root else 0
        objects = []
        for path, info in found.items():
            key = str(self.fs._strip_protocol(path))[skip:].lstrip("/")
            if key.startswith(prefix) and TEMPORARY_MARK not in key.rpartition("/")[2]:
                objects.append(ObjectInfo(key, int(info.get("size") or 0), _modified(info)))
        yield from sorted(objects, key=lambda info: info.key)

    def list_delimited(self, prefix: str, delimiter: str) -> Listing:
        """The delimited listing, rolled up here from a full one (see the module docstring)."""
        check_delimiter(delimiter)
        return roll_up(self.list(prefix), prefix, delimiter)

    # Deletes and leftovers ------------------------------------------------------------------

    def delete_many(self, keys: Iterable[str]) -> None:
        """Delete the given objects; missing ones are ignored."""
        for key in keys:
            path = self.path(key)
            try:
                self.run(f"delete {self.where(key)}", lambda path=path: self.fs.rm_file(path))
            except ObjectNotFoundError:
                continue

    def list_uploads(self, prefix: str = "") -> builtins.list[UploadInfo]:
        """Leftover temporary files of a local filesystem (a writer that died); none elsewhere
        (s3fs's unfinished multipart uploads are the bucket's lifecycle rule's)."""
        if self.protocol not in LINKED:
            return []
        found = self.run(f"list {self._uri}/{prefix}", lambda: self._find(prefix))
        skip = len(self.root) + 1
        leftovers = []
        for path, info in found.items():
            key = str(self.fs._strip_protocol(path))[skip:]
            if key.startswith(prefix) and TEMPORARY_MARK in key.rpartition("/")[2]:
                moment = _modified(info)
                leftovers.append(UploadInfo(key, TEMPORARY, moment, moment))
        return leftovers

    def abort_upload(self, upload: UploadInfo) -> None:
        """Remove one leftover temporary file."""
        if upload.upload_id != TEMPORARY or TEMPORARY_MARK not in upload.key:
            raise InvalidArgumentError(f"{upload.key!r} is not a leftover of this store")
        path = self.path(upload.key)
        try:
            self.run(f"delete {self.where(upload.key)}", lambda: self.fs.rm_file(path))
        except ObjectNotFoundError:
            return

    def close(self) -> None:
        """Nothing to release: fsspec keeps its filesystem instances."""

    def __reduce__(self) -> tuple[Any, ...]:
        """Pickle as URI and options; credentials cross a multiprocessing pipe only. A memory
        filesystem lives in this process only and is refused, as ``memory://`` is."""
        if self.protocol in BUFFERED:
            raise InvalidArgumentError(
                f"{self._uri} lives in this process only and cannot be rebuilt in another one; "
                "use a folder or an object store, or save asynchronously in a thread"
            )
        options = {**self._options, "unsafe_create_only": self.unsafe_create_only}
        secrets = {k: v for k, v in options.items() if is_secret_key(k) and isinstance(v, str)}
        public = {k: v for k, v in options.items() if k not in secrets}
        carried = ProcessSecrets(secrets) if secrets else None
        return _reopen, (self._uri, public, carried)


def _reopen(uri: str, options: dict[str, Any], secrets: ProcessSecrets | None) -> FsspecStore:
    """Rebuild a pickled store in this process."""
    return FsspecStore(uri, {**options, **(secrets.values if secrets else {})})


def _modified(info: dict[str, Any]) -> datetime | None:
    """When the filesystem says the object was written: s3fs's LastModified, a local mtime, the
    memory filesystem's created."""
    for name in ("LastModified", "last_modified", "mtime", "updated", "created"):
        value = info.get(name)
        if isinstance(value, datetime):
            return value if value.tzinfo else value.replace(tzinfo=timezone.utc)
        if isinstance(value, (int, float)):
            return datetime.fromtimestamp(value, timezone.utc)
        if isinstance(value, str) and value:
            try:
                moment = datetime.fromisoformat(value.replace("Z", "+00:00"))
            except ValueError:
                continue
            return moment if moment.tzinfo else moment.replace(tzinfo=timezone.utc)
    return None


def open_fsspec_store(uri: str, options: dict[str, Any]) -> FsspecStore:
    """Factory for ``fsspec+<protocol>://...``; options go to ``fsspec.filesystem``, except
    ``unsafe_create_only`` (see the module docstring)."""
    return FsspecStore(uri, options)
