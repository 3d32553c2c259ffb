"""Copying one object from a store to another: server-side where the provider can, else streamed.

Mirroring a step to a second region or cloud copies every object of it. Where both sides are one
provider's and the target's credentials reach the source (two S3 buckets through one endpoint),
the provider copies the bytes itself and none pass through this process: a store class offers
that as the optional `ServerSideCopy` capability, as `ScatterReads` offers scattered reads.
Everywhere else, between providers or accounts, `copy_object` streams: one ranged read at a time
into one reused buffer, each piece written to the target's streamed writer before the next is
read, so memory stays at one piece whatever the object's size. A streamed copy computes the
CRC32C of every byte it wrote, which a caller compares with what the source's manifest records;
a server-side copy returns none (the provider moved the bytes), and a caller that must know reads
the copy back. Either way the target's rules hold: a create-only copy onto an existing key raises
`AlreadyExistsError`, and a copy that fails midway leaves no object at the key (the target's
writer aborts).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol, cast

from spotckpt.checksum import crc32c
from spotckpt.errors import InvalidArgumentError, ObjectNotFoundError, StorageError
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
    piece_bytes: int = DEFAULT_PIECE_BYTES,
    on_piece: Callable[[int], None] | None = None,
) -> Copied:
    """Copy `source_key` of `source` to `key` of `target`: server-side where `target` offers it
    for this source, else streamed in pieces of `piece_bytes` (`on_piece` sees each piece's size
    before it is read: a bandwidth limit waits there). Raises ObjectNotFoundError when the source
    is missing, AlreadyExistsError when create-only finds the key taken; a failed copy leaves no
    object at `key`."""
    if piece_bytes < 1:
        raise InvalidArgumentError(f"a copy's piece must be at least 1 byte, got {piece_bytes}")
    if copies_server_side(target):
        info = cast(ServerSideCopy, target).copy_within(
            source, source_key, key, create_only=create_only
        )
        if info is not None:
            return Copied(info, None, server_side=True)
    return _stream(source, source_key, target, key, create_only, piece_bytes, on_piece)


def _stream(
    source: ObjectStore,
    source_key: str,
    target: ObjectStore,
    key: str,
    create_only: bool,
    piece_bytes: int,
    on_piece: Callable[[int], None] | None,
) -> Copied:
    head = source.head(source_key)  # the size first: a missing source creates nothing
    if head is None:
        raise ObjectNotFoundError(f"copy of {source_key!r}: no such object in {source.uri}")
    piece = memoryview(bytearray(min(piece_bytes, max(1, head.size))))
    checksum = 0
    with target.open_writer(key, create_only=create_only) as writer:
        while writer.bytes_written < head.size:
            wanted = piece[: min(piece.nbytes, head.size - writer.bytes_written)]
            if on_piece is not None:
                on_piece(wanted.nbytes)
            arrived = source.get_range_into(source_key, writer.bytes_written, wanted)
            if arrived < wanted.nbytes:  # objects are written once: it changed or was cut
                raise StorageError(
                    f"copy of {source_key!r}: the source ended at byte "
                    f"{writer.bytes_written + arrived}, its listing said {head.size}"
                )
            writer.write(wanted)
            checksum = crc32c(wanted, checksum)
        written = writer.bytes_written
    return Copied(ObjectInfo(key, written), checksum, server_side=False)
