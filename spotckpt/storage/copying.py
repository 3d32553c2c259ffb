"""Copying one object from a store to another: server-side where the provider can, else streamed.

Mirroring a step to a second region or cloud copies every object of it. Where both sides are one
provider's and the target's credentials reach the source (two S3 buckets through one endpoint), the
provider copies the bytes itself and none pass through this process: a store class offers that as
the optional `ServerSideCopy` capability, as `ScatterReads` offers scattered reads. Everywhere else,
between providers or accounts, `copy_object` streams: one ranged read at a time into one reused
buffer, each piece written to the target's streamed writer before the next is read, so the copy
holds one piece besides what the target's writer buffers (a bucket store's parts in flight),
whatever the object's size. A streamed copy computes the CRC32C of every byte it writes and checks
it before the commit: against the caller's `Expected` size and CRC32C (a manifest's; and its BLAKE3
where a signed manifest records one), and told nothing, that the source ends where its listing said.
A server-side copy told what to expect (create-only) is checked by the CRC32C the provider
reported for it (a GCS rewrite's) or, where it reported none or a strong hash is expected, read
back from the target and checked there; it is deleted when it differs. Its bytes pass through this
process at most once instead of twice, and nothing that differs stays; told nothing, it returns no
CRC32C (the provider moved the bytes). Either way the target's rules hold: a create-only copy onto
an existing key raises `AlreadyExistsError`, and a copy that fails midway leaves no object at the
key (the target's writer aborts).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol, cast

import blake3

from spotckpt.checksum import crc32c
from spotckpt.errors import (
    CorruptCheckpointError,
    InvalidArgumentError,
    ObjectNotFoundError,
    StorageError,
)
from spotckpt.storage.base import ObjectInfo, ObjectStore

DEFAULT_PIECE_BYTES = 8 << 20
"""Bytes a streamed copy reads, and so holds, at a time."""


class ServerSideCopy(Protocol):
    """A store that can have its provider copy an object from another store into it."""

    def copy_within(
        self, source: ObjectStore, source_key: str, key: str, *, create_only: bool = False
    ) -> ObjectInfo | None:
        """Copy `source_key` of `source` to `key` of this store without the bytes passing through
        this process; None where the provider cannot (another provider, endpoint or account):
        the caller then streams."""


@dataclass(frozen=True)
class Expected:
    """What the object to copy must be: its size and CRC32C (as a manifest records them), and
    its BLAKE3 (hex) where a signed manifest records one: a CRC32C guards against accidents,
    only the strong hash against bytes made to match it."""

    size: int
    crc32c: int
    blake3: str | None = None


@dataclass(frozen=True)
class Copied:
    """What a copy did: the target's object, the CRC32C of the bytes streamed (None when the
    provider copied them server-side), and whether it did."""

    info: ObjectInfo
    crc32c: int | None
    server_side: bool


def copies_server_side(store: ObjectStore) -> bool:
    """Whether `store`'s class offers `ServerSideCopy` (the class, not the instance: a wrapper
    that forwards attributes must see the copy's reads and writes through its own methods)."""
    return callable(getattr(type(store), "copy_within", None))


def copy_object(
    source: ObjectStore,
    source_key: str,
    target: ObjectStore,
    key: str,
    *,
    create_only: bool = False,
    expected: Expected | None = None,
    piece_bytes: int = DEFAULT_PIECE_BYTES,
    on_piece: Callable[[int], None] | None = None,
) -> Copied:
    """Copy `source_key` of `source` to `key` of `target`: server-side where `target` offers it
    for this source, else streamed in pieces of `piece_bytes` (`on_piece` sees each piece's size
    before it is read or, server-side, read back: a bandwidth limit waits there). Raises
    ObjectNotFoundError when the source is missing, AlreadyExistsError when create-only finds
    the key taken; a failed copy leaves no object at `key`.

    With `expected` (a manifest's size and CRC32C of the object, and BLAKE3 where signed) only
    bytes that match stay at `key`: a streamed copy checks them before its commit; a server-side
    one reads what the provider wrote back from `target` and checks it there, deleting it when
    it differs (create-only, the object is this copy's own). Either way a source that differs
    raises CorruptCheckpointError and leaves nothing at `key`."""
    if piece_bytes < 1:
        raise InvalidArgumentError(f"a copy's piece must be at least 1 byte, got {piece_bytes}")
    if copies_server_side(target) and (expected is None or create_only):
        info = cast(ServerSideCopy, target).copy_within(
            source, source_key, key, create_only=create_only
        )
        if info is not None:
            if expected is None:
                return Copied(info, None, server_side=True)
            return _checked_at_target(target, key, info, expected, piece_bytes, on_piece)
    return _stream(source, source_key, target, key, create_only, expected, piece_bytes, on_piece)


def _checked_at_target(
    target: ObjectStore,
    key: str,
    info: ObjectInfo,
    expected: Expected,
    piece_bytes: int,
    on_piece: Callable[[int], None] | None,
) -> Copied:
    """A server-side copy at `key` checked against `expected`: by the CRC32C the provider
    reported for it where it did and no strong hash is expected (the bytes do not cross the
    network again), else read back; deleted (and CorruptCheckpointError) when it differs."""
    try:
        if info.size != expected.size:
            raise CorruptCheckpointError(
                f"copy of {key!r}: the provider copied {info.size} bytes, not the "
                f"{expected.size} expected"
            )
        if info.crc32c is not None and expected.blake3 is None:
            _check_whole(target, key, expected.size, info.crc32c, None, expected)
            return Copied(info, info.crc32c, server_side=True)
        checksum, digest = _read_back(target, key, expected, piece_bytes, on_piece)
        _check_whole(target, key, expected.size, checksum, digest, expected)
    except BaseException:
        target.delete_many([key])  # created by this copy (create-only): no one else's
        raise
    return Copied(info, checksum, server_side=True)


def check_object(
    store: ObjectStore,
    key: str,
    expected: Expected,
    piece_bytes: int = DEFAULT_PIECE_BYTES,
    on_piece: Callable[[int], None] | None = None,
) -> None:
    """CorruptCheckpointError unless the object at `key` of `store` is what `expected` says
    (read in pieces: its CRC32C, and BLAKE3 when given)."""
    checksum, digest = _read_back(store, key, expected, piece_bytes, on_piece)
    _check_whole(store, key, expected.size, checksum, digest, expected)


def _read_back(
    target: ObjectStore,
    key: str,
    expected: Expected,
    piece_bytes: int,
    on_piece: Callable[[int], None] | None,
) -> tuple[int, str | None]:
    """The CRC32C (and BLAKE3 when `expected` has one) of the object at `key`, read in pieces."""
    piece = memoryview(bytearray(min(piece_bytes, max(1, expected.size))))
    strong = blake3.blake3() if expected.blake3 is not None else None
    checksum = done = 0
    while done < expected.size:
        wanted = piece[: min(piece.nbytes, expected.size - done)]
        if on_piece is not None:
            on_piece(wanted.nbytes)
        if target.get_range_into(key, done, wanted) != wanted.nbytes:
            raise CorruptCheckpointError(f"copy of {key!r}: the copy ended at byte {done}")
        checksum = crc32c(wanted, checksum)
        if strong is not None:
            strong.update(wanted)
        done += wanted.nbytes
    return checksum, strong.hexdigest() if strong is not None else None


def _stream(
    source: ObjectStore,
    source_key: str,
    target: ObjectStore,
    key: str,
    create_only: bool,
    expected: Expected | None,
    piece_bytes: int,
    on_piece: Callable[[int], None] | None,
) -> Copied:
    head = source.head(source_key)  # the size first: a missing source creates nothing
    if head is None:
        raise ObjectNotFoundError(f"copy of {source_key!r}: no such object in {source.uri}")
    size = head.size if expected is None else expected.size
    if head.size != size:
        raise CorruptCheckpointError(
            f"copy of {source_key!r}: the source holds {head.size} bytes, not the {size} expected"
        )
    piece = memoryview(bytearray(min(piece_bytes, max(1, size))))
    checksum = copied = 0
    strong = blake3.blake3() if expected is not None and expected.blake3 is not None else None
    with target.open_writer(key, create_only=create_only) as writer:
        while copied < size:
            wanted = piece[: min(piece.nbytes, size - copied)]
            if on_piece is not None:
                on_piece(wanted.nbytes)
            arrived = source.get_range_into(source_key, copied, wanted)
            if arrived != wanted.nbytes:  # objects are written once: it changed or was cut
                raise StorageError(
                    f"copy of {source_key!r}: the source ended at byte {copied + arrived}, its "
                    f"listing said {size}"
                )
            writer.write(wanted)
            checksum = crc32c(wanted, checksum)
            if strong is not None:
                strong.update(wanted)
            copied += arrived
        digest = strong.hexdigest() if strong is not None else None
        _check_whole(source, source_key, size, checksum, digest, expected)  # before the commit
    return Copied(ObjectInfo(key, copied), checksum, server_side=False)


def _check_whole(
    source: ObjectStore,
    source_key: str,
    size: int,
    checksum: int,
    digest: str | None,
    expected: Expected | None,
) -> None:
    """The bytes copied are the object the caller expects (its CRC32C, and BLAKE3 when given),
    or, told nothing, the whole of the source (it ends where its listing said): else the copy
    must not commit."""
    if expected is not None:
        if checksum != expected.crc32c:
            raise CorruptCheckpointError(
                f"copy of {source_key!r}: its bytes have CRC32C {checksum:08x}, not the "
                f"{expected.crc32c:08x} expected; nothing was written"
            )
        if expected.blake3 is not None and digest != expected.blake3:
            raise CorruptCheckpointError(
                f"copy of {source_key!r}: its bytes' BLAKE3 is not the one its signed manifest "
                "records; nothing was written"
            )
        return
    if source.get_range_into(source_key, size, memoryview(bytearray(1))):
        raise StorageError(f"copy of {source_key!r}: the source grew past its {size} bytes")
