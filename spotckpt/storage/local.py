"""``file:///path`` and plain paths: a folder on local disk (a fast tier, and for tests).

Every object is written to a hidden temporary name beside its final one, fsynced, and then
renamed into place (or, for create-only writes, hard-linked, which fails when the name exists),
and the folder is fsynced, so a crash leaves either the whole object or nothing. A write that
fails (a full disk, an I/O error) removes its temporary file and raises a `StorageError` naming
the key; a full disk raises `DiskFullError`.

The store never leaves its root: the root is resolved once when the store is opened, and every
path below it is walked one folder at a time with descriptors opened ``O_NOFOLLOW``, so a symbolic
link inside the root is never followed, whatever it points at and even if it appears while the
store is in use. A link is not an object of the store: reads report it as missing, listings skip
it with a warning naming its key, deletes leave it (and whatever it points at) alone, and writes
refuse to pass through a linked folder.
"""

from __future__ import annotations

import builtins
import contextlib
import errno
import logging
import os
import stat
import uuid
from collections.abc import Iterable, Iterator, Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, BinaryIO
from urllib.parse import unquote, urlsplit

from spotckpt.errors import DiskFullError, InvalidArgumentError, SymlinkError
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
    rolled_up,
)

log = logging.getLogger("spotckpt.storage")
TEMP_MARKER = ".spotckpt-tmp-"
_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | _CLOEXEC
_READ_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | _CLOEXEC
_TEMP_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | _CLOEXEC
_ABSENT = frozenset({errno.ENOENT, errno.ENOTDIR, errno.ELOOP, errno.ENXIO, errno.EISDIR})
_FULL = frozenset({errno.ENOSPC, errno.EDQUOT})


def _is_link(folder: int, name: str) -> bool:
    try:
        return stat.S_ISLNK(os.stat(name, dir_fd=folder, follow_symlinks=False).st_mode)
    except OSError:
        return False


def _open_folder(parent: int, name: str, where: str, create: bool) -> int:
    """Open the folder `name` in `parent` without following a link (creating it if asked)."""
    try:
        return os.open(name, _DIR_FLAGS, dir_fd=parent)
    except FileNotFoundError:
        if not create:
            raise
    except OSError as error:
        if error.errno in (errno.ENOTDIR, errno.ELOOP) and _is_link(parent, name):
            raise SymlinkError(f"{where} is a symbolic link; links are never followed") from None
        raise
    with contextlib.suppress(FileExistsError):
        os.mkdir(name, dir_fd=parent)
    return _open_folder(parent, name, where, create=False)


def _close_all(fds: Iterable[int]) -> None:
    for fd in fds:
        os.close(fd)


class LocalWriter(WriterBase):
    """Streams into a temporary file; commit fsyncs and publishes it atomically."""

    def __init__(self, store: LocalStore, key: str, create_only: bool, fsync: bool) -> None:
        self._key = key
        self._where = f"{key!r} in {store.uri}"
        self._create_only = create_only
        self._fsync = fsync
        self._name = key.rsplit("/", 1)[-1]
        self._temp = f"{TEMP_MARKER}{self._name}.{uuid.uuid4().hex}"
        self._size = 0
        self._file: BinaryIO | None = None
        try:
            self._folder = store.folder_for_write(key)
        except OSError as error:
            raise _write_error("creating the folder of", self._where, error) from error
        try:
            fd = os.open(self._temp, _TEMP_FLAGS, 0o666, dir_fd=self._folder)
        except OSError as error:
            os.close(self._folder)
            raise _write_error("creating", self._where, error) from error
        self._file = os.fdopen(fd, "wb")

    @property
    def bytes_written(self) -> int:
        return self._size

    def write(self, data: bytes | bytearray | memoryview) -> None:
        if self._file is None:
            raise StorageError(f"write to {self._key!r} after commit or abort")
        try:
            self._file.write(data)
        except OSError as error:
            self.abort()
            raise _write_error("writing", self._where, error) from error
        self._size += memoryview(data).nbytes

    def commit(self) -> ObjectInfo:
        if self._file is None:
            raise StorageError(f"commit of {self._key!r} after commit or abort")
        file, self._file = self._file, None
        try:
            self._publish(file)
        except AlreadyExistsError:
            self._discard(file)
            raise
        except OSError as error:
            self._discard(file)
            raise _write_error("committing", self._where, error) from error
        except BaseException:
            self._discard(file)
            raise
        os.close(self._folder)
        return ObjectInfo(self._key, self._size, datetime.now(timezone.utc))

    def _publish(self, file: BinaryIO) -> None:
        file.flush()
        if self._fsync:
            os.fsync(file.fileno())
        file.close()
        folder = self._folder
        if self._create_only:
            try:
                os.link(self._temp, self._name, src_dir_fd=folder, dst_dir_fd=folder)
            except FileExistsError:
                raise AlreadyExistsError(f"{self._where} already exists") from None
            finally:
                os.unlink(self._temp, dir_fd=folder)
        else:
            os.replace(self._temp, self._name, src_dir_fd=folder, dst_dir_fd=folder)
        if self._fsync:
            os.fsync(folder)

    def _discard(self, file: BinaryIO) -> None:
        """Close `file` (its buffer may not flush on a full disk), remove the temp, free the fd."""
        with contextlib.suppress(OSError):
            file.close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self._temp, dir_fd=self._folder)
        os.close(self._folder)

    def abort(self) -> None:
        if self._file is not None:
            file, self._file = self._file, None
            self._discard(file)


def _write_error(action: str, where: str, error: OSError) -> StorageError:
    code = errno.errorcode.get(error.errno or 0, str(error.errno))
    if error.errno in _FULL:
        return DiskFullError(
            f"disk full (errno {code}: {os.strerror(error.errno or 0)}) while {action} {where}; "
            "the partial temporary file was removed"
        )
    return StorageError(f"{action} {where} failed: {error.strerror} (errno {code})")


class _Delimited:
    """What one `LocalStore.list_delimited` has found so far."""

    def __init__(self, prefix: str, delimiter: str) -> None:
        self.prefix = prefix
        self.delimiter = delimiter
        self.objects: builtins.list[ObjectInfo] = []
        self.prefixes: set[str] = set()

    def add(self, info: ObjectInfo) -> None:
        """An object under the prefix: listed, or rolled up into its common prefix."""
        common = rolled_up(info.key, self.prefix, self.delimiter)
        if common is None:
            self.objects.append(info)
        else:
            self.prefixes.add(common)

    def listing(self) -> Listing:
        """Everything found, in key order."""
        return Listing(sorted(self.objects, key=lambda info: info.key), sorted(self.prefixes))


class LocalStore:
    """Objects are regular files under `root`; keys map to relative paths; links are not objects."""

    def __init__(self, root: Path, fsync: bool = True) -> None:
        self._root = root.resolve()
        self._fsync = fsync

    @property
    def uri(self) -> str:
        return self._root.as_uri()

    @contextlib.contextmanager
    def _folders(self, key: str, create: bool = False) -> Iterator[list[int]]:
        """Descriptors of the root and each folder down to `key`'s own, none reached via a link."""
        parts = check_key(key).split("/")
        if create:
            self._root.mkdir(parents=True, exist_ok=True)
        fds = [os.open(self._root, _DIR_FLAGS)]
        try:
            for depth, part in enumerate(parts[:-1], start=1):
                where = f"{self.uri}/{'/'.join(parts[:depth])}"
                fds.append(_open_folder(fds[-1], part, where, create))
            yield fds
        finally:
            _close_all(fds)

    def folder_for_write(self, key: str) -> int:
        """A descriptor of the folder to hold `key`, created as needed; the caller closes it."""
        with self._folders(key, create=True) as fds:
            return os.dup(fds[-1])

    def _open_object(self, key: str) -> BinaryIO:
        name = key.rsplit("/", 1)[-1]
        try:
            with self._folders(key) as fds:
                fd = os.open(name, _READ_FLAGS, dir_fd=fds[-1])
        except SymlinkError as error:
            raise ObjectNotFoundError(f"{self.uri}/{key} does not exist: {error}") from None
        except OSError as error:
            if error.errno not in _ABSENT:
                raise
            raise ObjectNotFoundError(f"{self.uri}/{key} does not exist") from None
        file = os.fdopen(fd, "rb")
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            file.close()
            raise ObjectNotFoundError(f"{self.uri}/{key} does not exist (not a regular file)")
        return file

    def open_writer(self, key: str, *, create_only: bool = False) -> LocalWriter:
        return LocalWriter(self, check_key(key), create_only, self._fsync)

    def put(self, key: str, data: bytes, *, create_only: bool = False) -> ObjectInfo:
        with self.open_writer(key, create_only=create_only) as writer:
            writer.write(data)
        return ObjectInfo(key, len(data), datetime.now(timezone.utc))

    def get(self, key: str) -> bytes:
        with self._open_object(key) as file:
            return file.read()

    def get_range(self, key: str, start: int, length: int) -> bytes:
        if start < 0 or length < 0:
            raise InvalidArgumentError("range start and length must be non-negative")
        with self._open_object(key) as file:
            file.seek(start)
            return file.read(length)

    def get_range_into(self, key: str, start: int, buffer: memoryview) -> int:
        return self.get_range_into_views(key, start, (buffer,))

    def get_range_into_views(self, key: str, start: int, views: Sequence[memoryview]) -> int:
        """The scatter read (`spotckpt.storage.base.ScatterReads`): ``preadv`` fills up to
        ``IOV_MAX`` views a system call."""
        if start < 0:
            raise InvalidArgumentError("range start must be non-negative")
        with self._open_object(key) as file:
            return _read_into_views(file.fileno(), views, start)

    def head(self, key: str) -> ObjectInfo | None:
        name = key.rsplit("/", 1)[-1]
        try:
            with self._folders(key) as fds:
                found = os.stat(name, dir_fd=fds[-1], follow_symlinks=False)
        except SymlinkError:
            return None
        except OSError as error:
            if error.errno in _ABSENT:
                return None
            raise
        if not stat.S_ISREG(found.st_mode):
            return None
        return ObjectInfo(key, found.st_size, _mtime(found))

    def exists(self, key: str) -> bool:
        return self.head(key) is not None

    def _files(self, prefix: str) -> builtins.list[tuple[str, os.stat_result]]:
        """(key, stat) of every regular file whose key starts with `prefix`, links skipped."""
        try:
            root = os.open(self._root, _DIR_FLAGS)
        except OSError as error:
            if error.errno in _ABSENT:
                return []
            raise
        found: builtins.list[tuple[str, os.stat_result]] = []
        self._scan(root, "", prefix, found)
        return found

    def _entries(
        self, folder: int, at: str, prefix: str
    ) -> builtins.list[tuple[str, str, os.stat_result]]:
        """(name, key, stat) of each entry of the open `folder` (key prefix `at`) that is, or may
        hold, a key under `prefix`; links are skipped with a warning."""
        with os.scandir(folder) as scan:
            entries = builtins.list(scan)
        found = []
        for entry in entries:
            key = at + entry.name
            if not (key.startswith(prefix) or prefix.startswith(f"{key}/")):
                continue
            try:
                info = entry.stat(follow_symlinks=False)
            except FileNotFoundError:
                continue
            if stat.S_ISLNK(info.st_mode):
                self._skip_link(key)
            else:
                found.append((entry.name, key, info))
        return found

    def _open_child(self, folder: int, name: str, at: str) -> int | None:
        """The folder `name` of the open `folder` (its keys start with `at`); None if it is gone
        or a link (skipped with a warning)."""
        try:
            return _open_folder(folder, name, f"{self.uri}/{at}", create=False)
        except SymlinkError:
            self._skip_link(at.rstrip("/"))
            return None
        except OSError as error:
            if error.errno in _ABSENT:
                return None
            raise

    def _scan(
        self, folder: int, at: str, prefix: str, found: builtins.list[tuple[str, os.stat_result]]
    ) -> None:
        """Add the files of the open `folder` (key prefix `at`) to `found`; closes `folder`."""
        try:
            for name, key, info in self._entries(folder, at, prefix):
                if stat.S_ISREG(info.st_mode) and key.startswith(prefix):
                    found.append((key, info))
                elif stat.S_ISDIR(info.st_mode):
                    child = self._open_child(folder, name, f"{key}/")
                    if child is not None:
                        self._scan(child, f"{key}/", prefix, found)
        finally:
            os.close(folder)

    def _scan_delimited(
        self, folder: int, at: str, prefix: str, delimiter: str, found: _Delimited
    ) -> None:
        """Add the objects and common prefixes of the open `folder` (key prefix `at`) to
        `found`, opening a folder whose keys all roll up into one prefix only as far as its first
        object, and not at all once that prefix is known; closes `folder`."""
        try:
            for name, key, info in self._entries(folder, at, prefix):
                if stat.S_ISREG(info.st_mode):
                    if key.startswith(prefix) and not name.startswith(TEMP_MARKER):
                        found.add(ObjectInfo(key, info.st_size, _mtime(info)))
                    continue
                if not stat.S_ISDIR(info.st_mode):
                    continue
                below = f"{key}/"
                common = rolled_up(below, prefix, delimiter)
                if common in found.prefixes:
                    continue
                child = self._open_child(folder, name, below)
                if child is None:
                    continue
                if common is None:
                    self._scan_delimited(child, below, prefix, delimiter, found)
                elif self._holds_object(child, below):
                    found.prefixes.add(common)
        finally:
            os.close(folder)

    def _holds_object(self, folder: int, at: str) -> bool:
        """Whether the open `folder` (key prefix `at`) holds an object at any depth, reading no
        further than the first one; closes `folder`."""
        try:
            below: builtins.list[str] = []
            with os.scandir(folder) as scan:
                for entry in scan:
                    if entry.is_symlink():
                        self._skip_link(at + entry.name)
                    elif entry.is_file(follow_symlinks=False):
                        if not entry.name.startswith(TEMP_MARKER):
                            return True
                    elif entry.is_dir(follow_symlinks=False):
                        below.append(entry.name)
            for name in below:
                child = self._open_child(folder, name, f"{at}{name}/")
                if child is not None and self._holds_object(child, f"{at}{name}/"):
                    return True
            return False
        finally:
            os.close(folder)

    def _skip_link(self, key: str) -> None:
        log.warning(
            "%s/%s is a symbolic link: it is not an object of this store and is skipped "
            "(links in a checkpoint root are never followed)",
            self.uri,
            key,
        )

    def list(self, prefix: str = "") -> Iterator[ObjectInfo]:
        found = [
            ObjectInfo(key, info.st_size, _mtime(info))
            for key, info in self._files(prefix)
            if not key.rsplit("/", 1)[-1].startswith(TEMP_MARKER)
        ]
        yield from sorted(found, key=lambda info: info.key)

    def list_delimited(self, prefix: str, delimiter: str) -> Listing:
        """Walks only the folders that the delimiter leaves apart: a folder whose path already
        holds `delimiter` after `prefix` is one common prefix, and is opened only as far as its
        first object (links and temporary files are not objects, as in `list`)."""
        check_delimiter(delimiter)
        found = _Delimited(prefix, delimiter)
        try:
            root = os.open(self._root, _DIR_FLAGS)
        except OSError as error:
            if error.errno in _ABSENT:
                return found.listing()
            raise
        self._scan_delimited(root, "", prefix, delimiter, found)
        return found.listing()

    def delete_many(self, keys: Iterable[str]) -> None:
        for key in keys:
            self._delete(key)

    def _delete(self, key: str) -> None:
        """Unlink the regular file `key` and prune emptied folders; links are left alone."""
        parts = check_key(key).split("/")
        try:
            with self._folders(key) as fds:
                found = os.stat(parts[-1], dir_fd=fds[-1], follow_symlinks=False)
                if stat.S_ISLNK(found.st_mode):
                    self._keep_link(key)
                elif stat.S_ISREG(found.st_mode):
                    os.unlink(parts[-1], dir_fd=fds[-1])
                    _prune(fds, parts)
        except SymlinkError as error:
            log.warning("%s/%s is not deleted: %s", self.uri, key, error)
        except OSError as error:
            if error.errno not in _ABSENT:
                raise

    def _keep_link(self, key: str) -> None:
        log.warning(
            "%s/%s is a symbolic link, not an object of this store: neither it nor its target is "
            "deleted",
            self.uri,
            key,
        )

    def list_uploads(self, prefix: str = "") -> builtins.list[UploadInfo]:
        """Temporary files left by crashed writers, reported as unfinished uploads."""
        uploads = []
        for key, info in self._files(prefix):
            name = key.rsplit("/", 1)[-1]
            if name.startswith(TEMP_MARKER):
                uploads.append(
                    UploadInfo(key, name, initiated=_mtime(info), last_activity=_mtime(info))
                )
        return sorted(uploads, key=lambda upload: upload.key)

    def abort_upload(self, upload: UploadInfo) -> None:
        self._delete(upload.key)

    def close(self) -> None:
        return None


def _prune(fds: builtins.list[int], parts: builtins.list[str]) -> None:
    """Remove the emptied folders of a deleted key, deepest first, never the root."""
    for depth in range(len(parts) - 1, 0, -1):
        try:
            os.rmdir(parts[depth - 1], dir_fd=fds[depth - 1])
        except OSError:
            return


def _mtime(info: os.stat_result) -> datetime:
    return datetime.fromtimestamp(info.st_mtime, timezone.utc)


def open_local_store(uri: str, options: dict[str, Any]) -> LocalStore:
    """Factory for ``file:///path`` and plain paths; option ``fsync`` (default True)."""
    parts = urlsplit(uri)
    path = unquote(parts.path) if parts.scheme == "file" else uri
    if parts.scheme == "file" and parts.netloc not in ("", "localhost"):
        raise InvalidArgumentError(f"file:// URI {uri!r} names a host; use file:///absolute/path")
    fsync = options.pop("fsync", True)
    if isinstance(fsync, str):
        fsync = fsync.strip().lower() not in ("0", "false", "no", "off")
    if options:
        raise InvalidArgumentError(f"local store takes no options {sorted(options)}")
    return LocalStore(Path(path).expanduser(), fsync=bool(fsync))


IOV_MAX = 1024
"""Views one ``preadv`` fills at most (Linux's and macOS's limit)."""


def _read_into_views(fd: int, views: Sequence[memoryview], offset: int) -> int:
    """Fill `views` in turn from byte `offset` of file `fd`; returns the bytes placed, fewer
    at the end of the file."""
    pending = [memoryview(view).cast("B") for view in views if view.nbytes]
    placed = 0
    first = 0
    while first < len(pending):
        got = os.preadv(fd, pending[first : first + IOV_MAX], offset + placed)
        if got == 0:
            break
        placed += got
        while got:  # past the views filled whole; the next keeps only what it still lacks
            size = pending[first].nbytes
            if got < size:
                pending[first] = pending[first][got:]
                break
            got -= size
            first += 1
    return placed
