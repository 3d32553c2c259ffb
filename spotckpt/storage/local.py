"""``file:///path`` and plain paths: a folder on local disk (a fast tier, and for tests).

Every object is written to a hidden temporary name beside its final one, fsynced, and then
renamed into place (or, for create-only writes, hard-linked, which fails when the name exists),
and the folder is fsynced, so a crash leaves either the whole object or nothing.
"""

from __future__ import annotations

import builtins
import os
import uuid
from collections.abc import Iterable, Iterator
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, BinaryIO
from urllib.parse import unquote, urlsplit

from spotckpt.storage.base import (
    AlreadyExistsError,
    ObjectInfo,
    ObjectNotFoundError,
    StorageError,
    UploadInfo,
    WriterBase,
    check_key,
)

TEMP_MARKER = ".spotckpt-tmp-"


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class LocalWriter(WriterBase):
    """Streams into a temporary file; commit fsyncs and publishes it atomically."""

    def __init__(self, final: Path, key: str, create_only: bool, fsync: bool) -> None:
        final.parent.mkdir(parents=True, exist_ok=True)
        self._final = final
        self._key = key
        self._create_only = create_only
        self._fsync = fsync
        self._temp = final.with_name(f"{TEMP_MARKER}{final.name}.{uuid.uuid4().hex}")
        self._file: BinaryIO | None = open(self._temp, "xb")  # noqa: SIM115 - closed in commit/abort
        self._size = 0

    @property
    def bytes_written(self) -> int:
        return self._size

    def write(self, data: bytes | bytearray | memoryview) -> None:
        if self._file is None:
            raise StorageError(f"write to {self._key!r} after commit or abort")
        self._file.write(data)
        self._size += len(data)

    def commit(self) -> ObjectInfo:
        if self._file is None:
            raise StorageError(f"commit of {self._key!r} after commit or abort")
        file, self._file = self._file, None
        try:
            file.flush()
            if self._fsync:
                os.fsync(file.fileno())
            file.close()
            if self._create_only:
                try:
                    os.link(self._temp, self._final)
                except FileExistsError:
                    raise AlreadyExistsError(f"{self._final} already exists") from None
                finally:
                    self._temp.unlink(missing_ok=True)
            else:
                os.replace(self._temp, self._final)
            if self._fsync:
                _fsync_dir(self._final.parent)
        except BaseException:
            file.close()
            self._temp.unlink(missing_ok=True)
            raise
        return ObjectInfo(self._key, self._size, datetime.now(timezone.utc))

    def abort(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
        self._temp.unlink(missing_ok=True)


class LocalStore:
    """Objects are files under `root`; keys map to relative paths."""

    def __init__(self, root: Path, fsync: bool = True) -> None:
        self._root = root.resolve()
        self._fsync = fsync

    @property
    def uri(self) -> str:
        return self._root.as_uri()

    def _path(self, key: str) -> Path:
        return self._root / check_key(key)

    def open_writer(self, key: str, *, create_only: bool = False) -> LocalWriter:
        return LocalWriter(self._path(key), key, create_only, self._fsync)

    def put(self, key: str, data: bytes, *, create_only: bool = False) -> ObjectInfo:
        with self.open_writer(key, create_only=create_only) as writer:
            writer.write(data)
        return ObjectInfo(key, len(data), datetime.now(timezone.utc))

    def get(self, key: str) -> bytes:
        try:
            return self._path(key).read_bytes()
        except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
            raise ObjectNotFoundError(f"{self.uri}/{key} does not exist") from None

    def get_range(self, key: str, start: int, length: int) -> bytes:
        if start < 0 or length < 0:
            raise ValueError("range start and length must be non-negative")
        try:
            with open(self._path(key), "rb") as file:
                file.seek(start)
                return file.read(length)
        except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
            raise ObjectNotFoundError(f"{self.uri}/{key} does not exist") from None

    def head(self, key: str) -> ObjectInfo | None:
        try:
            stat = self._path(key).stat()
        except (FileNotFoundError, NotADirectoryError):
            return None
        if not os.path.isfile(self._path(key)):
            return None
        return ObjectInfo(key, stat.st_size, datetime.fromtimestamp(stat.st_mtime, timezone.utc))

    def exists(self, key: str) -> bool:
        return self.head(key) is not None

    def list(self, prefix: str = "") -> Iterator[ObjectInfo]:
        found: builtins.list[ObjectInfo] = []
        for folder, _dirs, files in os.walk(self._root):
            for name in files:
                if name.startswith(TEMP_MARKER):
                    continue
                path = Path(folder, name)
                key = path.relative_to(self._root).as_posix()
                if key.startswith(prefix):
                    stat = path.stat()
                    when = datetime.fromtimestamp(stat.st_mtime, timezone.utc)
                    found.append(ObjectInfo(key, stat.st_size, when))
        yield from sorted(found, key=lambda info: info.key)

    def delete_many(self, keys: Iterable[str]) -> None:
        for key in keys:
            path = self._path(key)
            path.unlink(missing_ok=True)
            self._prune_empty_parents(path.parent)

    def _prune_empty_parents(self, folder: Path) -> None:
        while folder != self._root and folder.is_relative_to(self._root):
            try:
                folder.rmdir()
            except OSError:
                return
            folder = folder.parent

    def list_uploads(self, prefix: str = "") -> builtins.list[UploadInfo]:
        """Temporary files left by crashed writers, reported as unfinished uploads."""
        uploads = []
        for folder, _dirs, files in os.walk(self._root):
            for name in files:
                if not name.startswith(TEMP_MARKER):
                    continue
                key = Path(folder, name).relative_to(self._root).as_posix()
                if key.startswith(prefix):
                    when = datetime.fromtimestamp(Path(folder, name).stat().st_mtime, timezone.utc)
                    uploads.append(UploadInfo(key, upload_id=name, initiated=when))
        return uploads

    def abort_upload(self, upload: UploadInfo) -> None:
        self._path(upload.key).unlink(missing_ok=True)

    def close(self) -> None:
        return None


def open_local_store(uri: str, options: dict[str, Any]) -> LocalStore:
    """Factory for ``file:///path`` and plain paths; option ``fsync`` (default True)."""
    parts = urlsplit(uri)
    path = unquote(parts.path) if parts.scheme == "file" else uri
    if parts.scheme == "file" and parts.netloc not in ("", "localhost"):
        raise ValueError(f"file:// URI {uri!r} names a host; use file:///absolute/path")
    fsync = options.pop("fsync", True)
    if isinstance(fsync, str):
        fsync = fsync.strip().lower() not in ("0", "false", "no", "off")
    if options:
        raise ValueError(f"local store takes no options {sorted(options)}")
    return LocalStore(Path(path).expanduser(), fsync=bool(fsync))
