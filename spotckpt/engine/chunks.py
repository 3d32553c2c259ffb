"""Verified reads of stored chunks: the one place where checkpoint bytes are fetched and checked.

The manifest describes each stored chunk (a tensor piece or a value) by a `ChunkLocation`: the
object holding it, its byte offset and length there, and one CRC32C per ``block_size`` block of
the chunk. `ChunkReader` turns such a location into bytes that are known to be intact:

- a range of a chunk is widened to block boundaries (`ChunkReader.span`), as a block's CRC can
  only be checked whole;
- before a byte is read (or a buffer is allocated for it), the range is checked against the
  object's real size, learned once per object with ``store.head()`` and compared with the size the
  manifest claims, so a forged size never makes a store allocate what the object does not hold;
- every block is compared with the manifest's CRC32C (`BlockCheck`, which also follows a chunk fed
  in pieces, as ``verify`` streams whole objects);
- in a signed step (`strong_hashes`), every byte returned is also covered by a BLAKE3 that the
  signature covers, since a CRC32C is easy to keep while replacing bytes: a chunk whose entry
  has a BLAKE3 (every chunk and value a signed save writes) is compared with it whole
  (`check_strong`), so every read of such a chunk covers all of it (`span`), however little of
  it the caller wants; a chunk without one (a signed step of a spotckpt that recorded only the
  objects' hashes) is served only once the whole object it lies in matched its record's BLAKE3,
  streamed once per object and reader (`check_object`), and an object whose record has none is
  refused.

Every failure is a `CorruptCheckpointError` subclass whose message names the object, the byte
range and the tensors or values stored there: `ObjectMissingError`, `ObjectSizeError` (truncated,
or larger than the manifest says) and `ChecksumMismatchError`.

The caller names the step folder the object keys are relative to (``step-000000012``); this
module knows nothing of the bucket layout.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass

from spotckpt.checksum import Buffer, chunk_hash, crc32c
from spotckpt.errors import (
    ChecksumMismatchError,
    CorruptBlockError,
    InvalidArgumentError,
    ObjectMissingError,
    ObjectSizeError,
)
from spotckpt.format.codecs import encoding_of
from spotckpt.format.manifest import ChunkLocation, Manifest, ObjectRecord
from spotckpt.format.references import object_path
from spotckpt.format.signing import SIGNED, new_hasher
from spotckpt.storage.base import ObjectNotFoundError, ObjectStore, get_range_into_views

_NAMES_SHOWN = 3
_OBJECT_PIECE = 16 << 20
"""Bytes of an object read at a time when it is checked whole (`ChunkReader.check_object`)."""


def strong_hashes(manifest: Manifest) -> dict[str, str | None] | None:
    """Each object's BLAKE3 (None where its record has none) when reads of `manifest`'s chunks
    check strong hashes: in a signed step, whose signature covers them. None for an unsigned
    step (an incremental save's chunk hashes prove nothing there that its CRC32Cs do not)."""
    if SIGNED not in manifest.features:
        return None
    return {key: record.blake3 for key, record in manifest.objects.items()}


@dataclass(frozen=True)
class BlockSpan:
    """A byte range within a chunk, widened to CRC block boundaries."""

    start: int
    end: int
    first_block: int


class BlockCheck:
    """Compares one chunk's bytes, fed in order from a block boundary, with its block CRC32Cs.

    `feed` may be called with pieces of any size (a block may span several); each block is
    compared as soon as its last byte arrived. `bad` is the index of the first mismatching block.
    """

    def __init__(self, location: ChunkLocation, block_size: int, first_block: int = 0) -> None:
        self.location = location
        self.block_size = block_size
        self.block = first_block
        self.position = first_block * block_size
        self.crc = 0
        self.bad: int | None = None

    def feed(self, data: memoryview) -> None:
        """Account for the next bytes of the chunk; ValueError past the chunk's end."""
        done = 0
        while done < data.nbytes:
            block_end = min(self.location.length, (self.block + 1) * self.block_size)
            if block_end <= self.position:
                raise InvalidArgumentError(
                    f"fed more than the {self.location.length} bytes of the chunk"
                )
            take = min(data.nbytes - done, block_end - self.position)
            self.crc = crc32c(data[done : done + take], self.crc)
            done += take
            self.position += take
            if self.position == block_end:
                self._close()

    def finish(self) -> int | None:
        """Check an empty chunk's single block; the index of the first bad block, or None."""
        if self.location.length == 0 and self.block == 0:
            self._close()
        return self.bad

    def _close(self) -> None:
        expected = self.location.block_crc32c
        if self.bad is None and (self.block >= len(expected) or self.crc != expected[self.block]):
            self.bad = self.block
        self.block += 1
        self.crc = 0


class StoredBlockCheck:
    """`BlockCheck` for an encoded chunk fed its stored bytes (as ``verify`` streams objects):
    each stored block is compared with its stored CRC32C, decoded by the chunk's encoding
    (`spotckpt.format.codecs`), and the decoded bytes with the raw CRC32Cs. `finish` gives the
    first bad block, whichever check found it."""

    def __init__(self, location: ChunkLocation, block_size: int) -> None:
        self.location = location
        self.block_size = block_size
        self.raw = BlockCheck(location, block_size)
        self.encoding = encoding_of(location.codec)
        self.block = 0
        self.pending = bytearray()
        self.bad: int | None = None

    def feed(self, data: memoryview) -> None:
        """Account for the next stored bytes of the chunk; ValueError past its end."""
        lengths = self.location.stored_lengths
        done = 0
        while done < data.nbytes:
            if self.block >= len(lengths):
                raise InvalidArgumentError("fed more than the stored bytes of the chunk")
            take = min(data.nbytes - done, lengths[self.block] - len(self.pending))
            self.pending += data[done : done + take]
            done += take
            if len(self.pending) == lengths[self.block]:
                self._close()

    def finish(self) -> int | None:
        """Check blocks stored in no bytes (an empty chunk's); the first bad block, or None."""
        lengths = self.location.stored_lengths
        while self.block < len(lengths) and lengths[self.block] == 0:
            self._close()
        raw_bad = self.raw.finish()
        return self.bad if self.bad is not None else raw_bad

    def _close(self) -> None:
        number = self.block
        size = max(0, min(self.block_size, self.location.length - number * self.block_size))
        out = bytearray(size)
        intact = crc32c(self.pending) == self.location.stored_crc32c[number]
        if intact:
            try:
                stored = memoryview(self.pending)
                self.encoding.decode_block_into(stored, memoryview(out), self.location.codec)
            except CorruptBlockError:
                intact = False
        if not intact and self.bad is None:
            self.bad = number
        if size:
            self.raw.feed(memoryview(out))
        self.block += 1
        self.pending = bytearray()


def block_check(location: ChunkLocation, block_size: int) -> BlockCheck | StoredBlockCheck:
    """The check that follows a chunk's stored bytes, fed in order from its first byte."""
    return (
        StoredBlockCheck(location, block_size)
        if location.codec
        else BlockCheck(location, block_size)
    )


def describe(names: Iterable[str]) -> str:
    """Names for a message: the first few, quoted, and how many more."""
    distinct = sorted(set(names))
    shown = ", ".join(repr(n) for n in distinct[:_NAMES_SHOWN])
    if not distinct:
        return "nothing listed"
    more = len(distinct) - _NAMES_SHOWN
    return shown + (f" and {more} more" if more > 0 else "")


class ChunkReader:
    """Verified ranged reads of the objects of one checkpoint step; thread-safe.

    `folder` is the step folder that the manifest's object keys are relative to; `object_sizes`
    maps each object key to the size the manifest claims for it; `strong`, a signed step's
    object hashes (`strong_hashes`): check BLAKE3 as well as CRC32C.
    """

    def __init__(
        self,
        store: ObjectStore,
        folder: str,
        block_size: int,
        object_sizes: Mapping[str, int],
        *,
        strong: Mapping[str, str | None] | None = None,
    ) -> None:
        self.store = store
        self.folder = folder
        self.block_size = block_size
        self.object_sizes = object_sizes
        self.strong = strong
        self._sizes: dict[str, Future[int | None]] = {}
        self._whole: dict[str, Future[None]] = {}
        self._lock = threading.Lock()

    def learn(self, objects: Mapping[str, ObjectRecord]) -> None:
        """Objects of the step read after this reader was made (index parts read lazily)."""
        self.object_sizes = {**self.object_sizes, **{k: r.size for k, r in objects.items()}}
        if self.strong is not None:
            self.strong = {**self.strong, **{k: r.blake3 for k, r in objects.items()}}

    def hashed(self, location: ChunkLocation) -> bool:
        """Whether reads of this chunk check its own BLAKE3 (and so cover it whole)."""
        return self.strong is not None and bool(location.blake3)

    def path(self, key: str) -> str:
        """The store key of object `key` (in the step folder, or referenced in an earlier one)."""
        return object_path(self.folder, key)

    def span(self, location: ChunkLocation, start: int, end: int) -> BlockSpan:
        """Bytes `start`..`end` of a chunk, widened to the blocks that hold them (to the whole
        chunk when its BLAKE3 is checked)."""
        if end <= start:
            return BlockSpan(start, start, start // self.block_size)
        if self.hashed(location):
            return BlockSpan(0, location.length, 0)
        first_block = start // self.block_size
        last_block = -(-end // self.block_size)
        return BlockSpan(
            first_block * self.block_size,
            min(location.length, last_block * self.block_size),
            first_block,
        )

    def check_range(self, key: str, start: int, end: int, names: Iterable[str]) -> None:
        """Refuse bytes `start`..`end` of object `key` unless the object exists, has the size the
        manifest says, and holds them; costs one ``head`` per object, then nothing."""
        path = self.path(key)
        size = self._real_size(key)
        if size is None:
            raise ObjectMissingError(
                f"object {path} is missing: bytes {start}..{end} ({describe(names)}) cannot be read"
            )
        claimed = self.object_sizes[key]
        if end > size or size < claimed:
            raise ObjectSizeError(
                f"object {path} is truncated: bytes {start}..{end} ({describe(names)}) are asked, "
                f"the object has {size} bytes and the manifest says {claimed}"
            )
        if size != claimed:
            raise ObjectSizeError(
                f"object {path} has {size} bytes, more than the {claimed} the manifest says "
                f"(reading bytes {start}..{end}: {describe(names)})"
            )

    def check_chunk(self, location: ChunkLocation, name: str) -> None:
        """Refuse a chunk that its object does not hold, before anything is allocated for it."""
        end = location.offset + location.stored_length
        self.check_range(location.key, location.offset, end, (name,))

    def read(self, key: str, start: int, end: int, names: Iterable[str]) -> bytearray:
        """Bytes `start`..`end` of object `key` in a new buffer; see `read_into`."""
        data = bytearray(end - start)
        self.read_into(key, start, memoryview(data), names)
        return data

    def read_into(self, key: str, start: int, buffer: memoryview, names: Iterable[str]) -> None:
        """Bytes `start`.. of object `key` into `buffer` (all of it), checked by `check_range`
        first and then for a short answer; `names` (what the bytes hold) only serve the error
        messages."""
        self.read_into_views(key, start, (buffer,), names)

    def read_into_views(
        self, key: str, start: int, views: Sequence[memoryview], names: Iterable[str]
    ) -> None:
        """`read_into` for several buffers filled in turn from one range (one request where the
        store can: `spotckpt.storage.base.get_range_into_views`)."""
        end = start + sum(view.nbytes for view in views)
        self.check_range(key, start, end, names)
        path = self.path(key)
        try:
            placed = get_range_into_views(self.store, path, start, views)
        except ObjectNotFoundError:
            raise ObjectMissingError(
                f"object {path} disappeared: bytes {start}..{end} ({describe(names)}) cannot be "
                "read"
            ) from None
        if placed != end - start:
            raise ObjectSizeError(
                f"object {path} is truncated: bytes {start}..{end} ({describe(names)}) were "
                f"asked, {placed} returned"
            )

    def read_chunk(
        self, location: ChunkLocation, name: str, start: int = 0, end: int | None = None
    ) -> tuple[bytearray, BlockSpan]:
        """Verified bytes of a chunk's range `start`..`end` (default: all of it), widened to
        block boundaries; returns them with the widened span."""
        span = self.span(location, start, location.length if end is None else end)
        data = bytearray(span.end - span.start)
        self.read_chunk_into(location, span.first_block, memoryview(data), (name,))
        self.verify(data, location, span.first_block, name)
        return data, span

    def read_chunk_into(
        self, location: ChunkLocation, first_block: int, out: memoryview, names: Iterable[str]
    ) -> None:
        """The chunk's raw bytes from block `first_block` on into `out` (whole blocks, or up to
        the chunk's end), decoded if it is stored encoded; not yet checked (`verify`)."""
        if location.codec:
            self.read_decoded_into(location, first_block, out, names)
        else:
            self.read_into(
                location.key, location.offset + first_block * self.block_size, out, names
            )

    def read_decoded_into(
        self, location: ChunkLocation, first_block: int, out: memoryview, names: Iterable[str]
    ) -> None:
        """Fill `out` with the raw bytes of an encoded chunk from block `first_block` on
        (whole blocks, or up to the chunk's end): its stored blocks are read in one ranged read,
        each checked against its stored CRC32C and decoded (`decode_into`). The caller checks
        the raw bytes (`verify`) as for any chunk."""
        names = list(names)
        end_block = first_block + -(-out.nbytes // self.block_size)
        start, end = location.stored_span(first_block, end_block, self.block_size)
        stored = memoryview(self.read(location.key, start, end, names))
        self.decode_into(location, first_block, stored, start, out, describe(names))

    def decode_into(
        self,
        location: ChunkLocation,
        first_block: int,
        stored: memoryview,
        stored_start: int,
        out: memoryview,
        name: str,
    ) -> None:
        """Decode blocks of an encoded chunk from block `first_block` on into `out` (whole
        blocks, or up to the chunk's end), from `stored`: bytes of its object read from
        `stored_start` on that hold them, by the chunk's encoding (`spotckpt.format.codecs`).
        Each stored block is checked against its stored CRC32C before it is decoded;
        ChecksumMismatchError names the first bad one."""
        end_block = first_block + -(-out.nbytes // self.block_size)
        at = location.stored_span(first_block, end_block, self.block_size)[0] - stored_start
        encoding = encoding_of(location.codec)
        for number in range(first_block, end_block):
            length = location.stored_lengths[number]
            block = stored[at : at + length]
            raw_at = (number - first_block) * self.block_size
            first = stored_start + at
            where = f"{self.path(location.key)} at bytes {first}..{first + length}"
            if block.nbytes != length or crc32c(block) != location.stored_crc32c[number]:
                raise ChecksumMismatchError(
                    f"CRC32C mismatch in {where} (stored block {number} of {name}): the stored "
                    "data is corrupt"
                )
            try:
                piece = out[raw_at : raw_at + self.block_size]
                encoding.decode_block_into(block, piece, location.codec)
            except CorruptBlockError as error:
                raise ChecksumMismatchError(
                    f"{where} (block {number} of {name}) does not decode: {error}"
                ) from None
            at += length

    def verify(self, data: Buffer, location: ChunkLocation, first_block: int, name: str) -> None:
        """Raise ChecksumMismatchError unless `data`, the chunk's bytes from block `first_block`
        on (whole blocks, or up to the chunk's end), match the manifest's CRC32Cs and, in a
        signed step, its BLAKE3: checked here when `data` is the whole chunk (a caller that
        reads a hashed chunk in pieces calls `check_strong` once they all landed), or its
        object's, checked whole (`check_object`), when the chunk has none of its own."""
        view = memoryview(data)
        check = BlockCheck(location, self.block_size, first_block)
        check.feed(view)
        bad = check.finish()
        if bad is None:
            if not self.hashed(location):
                self.check_object(location.key, name)
            elif first_block == 0 and view.nbytes == location.length:
                self.check_strong(view, location, name)
            return
        start = location.offset + bad * self.block_size
        end = location.offset + min(location.length, (bad + 1) * self.block_size)
        raise ChecksumMismatchError(
            f"CRC32C mismatch in {self.path(location.key)} at bytes {start}..{end} (block {bad} "
            f"of {name!r}): the stored data is corrupt"
        )

    def check_strong(self, data: Buffer, location: ChunkLocation, name: str) -> None:
        """ChecksumMismatchError unless `data`, the whole chunk, has the BLAKE3 of its signed
        manifest (a no-op where none is checked, `hashed`)."""
        if not self.hashed(location) or chunk_hash(data) == location.blake3:
            return
        end = location.offset + location.stored_length
        raise ChecksumMismatchError(
            f"BLAKE3 mismatch in {self.path(location.key)} at bytes {location.offset}..{end} "
            f"({name!r}): the bytes differ from what the signed manifest holds (replaced, or "
            "corrupt with their CRC32Cs kept)"
        )

    def check_object(self, key: str, name: str) -> None:
        """In a signed step: ChecksumMismatchError unless object `key`, streamed whole once (by
        the first caller; the others wait for it), has its record's BLAKE3. A no-op in an
        unsigned step. Between this read and the chunk's own, the object could still be replaced:
        only a chunk's own BLAKE3 (every signed save since records it) closes that."""
        if self.strong is None:
            return
        with self._lock:
            known = self._whole.get(key)
            owner = known is None
            if known is None:
                known = self._whole[key] = Future()
        if owner:
            try:
                self._hash_object(key, name)
            except BaseException as error:
                known.set_exception(error)
                raise
            known.set_result(None)
        known.result()

    def _hash_object(self, key: str, name: str) -> None:
        path = self.path(key)
        expected = (self.strong or {}).get(key)
        if expected is None:
            raise ChecksumMismatchError(
                f"object {path} ({name!r}) has no BLAKE3 in its signed manifest: its bytes are "
                "not covered by the signature, and are refused"
            )
        hasher = new_hasher()
        size = self.object_sizes[key]
        for start in range(0, size, _OBJECT_PIECE):
            hasher.update(self.read(key, start, min(size, start + _OBJECT_PIECE), (name,)))
        if hasher.hexdigest() != expected:
            raise ChecksumMismatchError(
                f"BLAKE3 mismatch in object {path} ({name!r}): its bytes differ from what the "
                "signed manifest holds (replaced, or corrupt with their CRC32Cs kept)"
            )

    def _real_size(self, key: str) -> int | None:
        """The object's size from one ``head`` (shared by concurrent callers), None if absent."""
        with self._lock:
            known = self._sizes.get(key)
            if known is None:
                known = self._sizes[key] = Future()
                owner = True
            else:
                owner = False
        if owner:
            try:
                info = self.store.head(self.path(key))
            except BaseException as error:
                with self._lock:
                    del self._sizes[key]
                known.set_exception(error)
                raise
            known.set_result(None if info is None else info.size)
        return known.result()
