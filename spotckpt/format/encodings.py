"""Chunk encodings: how a chunk's bytes lie in its object, one plug-in per encoding.

A save chooses one encoding per object (`spotckpt.engine.transforms`) and the manifest records it
per chunk: a chunk's location names its codec, or none when its bytes are stored as they are.
Readers find the encoding of a chunk by that codec in the registry (`spotckpt.format.codecs`), so
the writer, the readers, ``verify`` and ``export`` hold no branch of their own per encoding: a new
encoding is one module and one registration (DCP's ``_extension.ExtensionRegistry`` is the model).

`RAW` writes plain safetensors objects. A `BlockEncoding` writes objects without a header (the
header must come first and give every tensor's stored size, unknown until encoded: the manifest is
their only index), each chunk of `BlockEncoding.min_bytes` or more encoded block by block: each
``block_size`` block (the unit of its CRC32Cs) alone, so that a reader of part of a chunk fetches
and decodes only the blocks that hold it. Its location gives the stored length of every block and
a CRC32C of each block's stored bytes, next to the CRC32Cs of its raw bytes: a restore checks the
stored bytes before decoding them and the decoded bytes after (`spotckpt.engine.chunks`). Steps
with encoded chunks name the `FEATURE` manifest feature, which an older spotckpt refuses instead
of reading wrong bytes (its name is that of the first such encoding, compression).
"""

from __future__ import annotations

import os
import threading
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Protocol

from spotckpt.checksum import crc32c
from spotckpt.errors import InvalidArgumentError
from spotckpt.format.safetensors_io import (
    SafetensorsStreamWriter,
    StoredRange,
    TensorSpec,
    block_crcs,
)
from spotckpt.storage.base import ObjectWriter

FEATURE = "compressed"
"""The manifest feature (`spotckpt.format.features`) of a step holding encoded chunks."""

ENCODE_THREADS = min(4, os.cpu_count() or 1)
"""Threads that encode one rank's chunks."""

_WINDOW = 4 << 20
"""Bytes of a chunk handed to one encoding thread at a time."""

Member = tuple[int, int, int]
"""A member of a pack (`spotckpt.engine.packing`): its offset and size in the pack's bytes, and
its element size."""


class ObjectStream(Protocol):
    """One object being written through an encoding: each item in order, then `finish`."""

    written: int
    """Raw bytes handled so far (`spotckpt.progress`)."""
    total: int
    """Raw bytes to handle in all (progress only)."""

    def write_value(self, name: str, data: memoryview) -> StoredRange:
        """Store a value's bytes (a non-tensor item), always as they are."""

    def write_chunk(self, name: str, data: memoryview, itemsize: int) -> StoredRange:
        """Store one tensor chunk of elements of `itemsize` bytes."""

    def write_members(
        self, name: str, data: memoryview, members: Sequence[Member]
    ) -> list[StoredRange]:
        """Store a pack of small tensors; one range per member, each with its own CRC32Cs."""

    def finish(self) -> tuple[int, int]:
        """The object's size and CRC32C, once everything is written."""

    def close(self) -> None:
        """Release what the stream holds (after a failure too)."""


class Encoding(ABC):
    """How the chunks of an object are stored; registered by its codecs
    (`spotckpt.format.codecs`), the values a chunk's location names it by."""

    name: str = ""
    """The encoding's name in messages and in the registry."""
    codecs: frozenset[str] = frozenset()
    """Every codec value this encoding writes and reads."""
    plain: bool = False
    """Whether its objects are plain safetensors files (`spotckpt.layout.rank_object_key`)."""

    @abstractmethod
    def open(
        self,
        writer: ObjectWriter,
        specs: list[TensorSpec],
        metadata: dict[str, str],
        block_size: int,
        hasher: Any,
    ) -> ObjectStream:
        """A stream that writes the items `specs` describes, in that order, into `writer`;
        `hasher` (anything with ``update``), if any, sees every stored byte."""

    @abstractmethod
    def decode_block_into(self, stored: memoryview, out: memoryview, codec: str) -> None:
        """Decode one stored block into `out` (exactly its raw length, as the manifest
        promises), allocating no more than that whatever the stored bytes claim;
        `spotckpt.errors.CorruptBlockError` when they do not describe such a block."""


class _RawStream(SafetensorsStreamWriter):
    """A safetensors object (`RAW`): every item stored as it is, after the header."""

    def write_value(self, name: str, data: memoryview) -> StoredRange:
        return self.write_tensor(name, data)

    def write_chunk(self, name: str, data: memoryview, itemsize: int) -> StoredRange:
        return self.write_tensor(name, data)

    def write_members(
        self, name: str, data: memoryview, members: Sequence[Member]
    ) -> list[StoredRange]:
        """The pack as one tensor; each member where it lies, with its own block CRC32Cs, as
        if it had been written alone."""
        stored = self.write_tensor(name, data)
        return [
            StoredRange(
                stored.offset + offset,
                nbytes,
                block_crcs(data[offset : offset + nbytes], self._block_size),
            )
            for offset, nbytes, _itemsize in members
        ]

    def close(self) -> None:
        return None


class RawEncoding(Encoding):
    """Chunks stored as they are, in a plain safetensors object."""

    name = "raw"
    plain = True

    def open(
        self,
        writer: ObjectWriter,
        specs: list[TensorSpec],
        metadata: dict[str, str],
        block_size: int,
        hasher: Any,
    ) -> ObjectStream:
        return _RawStream(writer, specs, metadata, block_size, hasher)

    def decode_block_into(self, stored: memoryview, out: memoryview, codec: str) -> None:
        out[:] = stored


RAW = RawEncoding()
"""The encoding of every chunk whose location names no codec."""


_Encoded = list[tuple[bytes, int, int]]
"""A window's blocks: stored bytes, CRC32C of the raw block, CRC32C of the stored bytes."""

BlockEncoder = Callable[[memoryview], bytes]
"""Encodes one raw block into its stored bytes (never longer than the block)."""


def encode_window(encode: BlockEncoder, window: memoryview, block_size: int) -> _Encoded:
    """The stored blocks of `window`, each with its raw and stored CRC32C."""
    encoded = []
    for start in range(0, window.nbytes, block_size):
        block = window[start : start + block_size]
        stored = encode(block)
        encoded.append((stored, crc32c(block), crc32c(stored)))
    return encoded


class BlockEncoding(Encoding):
    """An encoding of each ``block_size`` block of a chunk alone, in an object without a header;
    a subclass says which codec suits elements of a size and how a block encodes and decodes."""

    min_bytes: int = 64 << 10
    """Chunks smaller than this (one CRC block) are stored as they are: too little to gain."""

    @abstractmethod
    def codec_for(self, itemsize: int) -> str:
        """The codec for elements of `itemsize` bytes."""

    @abstractmethod
    def block_encoder(self, codec: str) -> BlockEncoder:
        """A block encoder for `codec`, made once per window and used in one thread."""

    def open(
        self,
        writer: ObjectWriter,
        specs: list[TensorSpec],
        metadata: dict[str, str],
        block_size: int,
        hasher: Any,
    ) -> ObjectStream:
        total = sum(spec.nbytes for spec in specs)
        return BlockStreamWriter(writer, self, block_size, hasher, total=total)


class BlockStreamWriter:
    """Streams one object of stored chunks, encoded or as they are, with no header: the manifest
    is its index. Encoding runs on a few threads (Zstandard releases the GIL), a bounded number
    of windows ahead of the upload, in order."""

    def __init__(
        self,
        writer: ObjectWriter,
        encoding: BlockEncoding,
        block_size: int,
        hasher: Any = None,
        threads: int | None = None,
        total: int = 0,
    ) -> None:
        """`hasher` (anything with ``update``) sees every stored byte; `total` is the raw size
        of everything to be written (progress only)."""
        self._writer = writer
        self._encoding = encoding
        self._block_size = block_size
        self._hasher = hasher
        self._position = 0
        self._crc = 0
        self._threads = threads or ENCODE_THREADS
        self._pool = ThreadPoolExecutor(self._threads, thread_name_prefix="spotckpt-compress")
        self.total = total
        self.written = 0  # raw bytes handled so far (`spotckpt.progress`)

    def _emit(self, data: bytes | memoryview) -> None:
        self._crc = crc32c(data, self._crc)
        if self._hasher is not None:
            self._hasher.update(data)
        self._writer.write(data)
        self._position += len(data)

    def write_value(self, name: str, data: memoryview) -> StoredRange:
        """Store bytes as they are (values, small chunks: `name` is not stored), with their
        block CRC32Cs, as `SafetensorsStreamWriter` does."""
        offset = self._position
        self._emit(data)
        self.written += data.nbytes
        return StoredRange(offset, data.nbytes, block_crcs(data, self._block_size))

    def write_chunk(self, name: str, data: memoryview, itemsize: int) -> StoredRange:
        """A chunk of `min_bytes` or more encoded, a smaller one as it is."""
        if data.nbytes >= self._encoding.min_bytes:
            return self.write_encoded(data, itemsize)
        return self.write_value(name, data)

    def write_members(
        self, name: str, data: memoryview, members: Sequence[Member]
    ) -> list[StoredRange]:
        """A pack member by member (each encoded or not by its own size and element size), so
        that every member keeps a location of its own."""
        return [
            self.write_chunk("", data[offset : offset + nbytes], itemsize)
            for offset, nbytes, itemsize in members
        ]

    def write_encoded(self, data: memoryview, itemsize: int) -> StoredRange:
        """Store a chunk block by block through its codec; returns where and how it lies."""
        codec = self._encoding.codec_for(itemsize)
        offset = self._position
        raw_crcs: list[int] = []
        lengths: list[int] = []
        crcs: list[int] = []
        for raw_bytes, blocks in self._encoded(data, codec):
            for stored, raw_crc, stored_crc in blocks:
                raw_crcs.append(raw_crc)
                lengths.append(len(stored))
                crcs.append(stored_crc)
                self._emit(stored)
            self.written += raw_bytes
        if not data.nbytes:
            raw_crcs, lengths, crcs = [0], [0], [0]
        return StoredRange(offset, data.nbytes, tuple(raw_crcs), codec, tuple(lengths), tuple(crcs))

    def _encode_window(self, window: memoryview, codec: str) -> _Encoded:
        return encode_window(self._encoding.block_encoder(codec), window, self._block_size)

    def _encoded(self, data: memoryview, codec: str) -> Iterator[tuple[int, _Encoded]]:
        """Each window's raw size and encoded blocks, in order, with at most two windows per
        thread in flight (bounded memory)."""
        window = _WINDOW - _WINDOW % self._block_size or self._block_size
        pending: deque[tuple[int, Future[_Encoded]]] = deque()
        for start in range(0, data.nbytes, window):
            piece = data[start : start + window]
            encoding = self._pool.submit(self._encode_window, piece, codec)
            pending.append((piece.nbytes, encoding))
            if len(pending) >= 2 * self._threads:
                size, done = pending.popleft()
                yield size, done.result()
        while pending:
            size, done = pending.popleft()
            yield size, done.result()

    def finish(self) -> tuple[int, int]:
        """The object's size and CRC32C, once everything is written."""
        self._pool.shutdown()
        return self._position, self._crc

    def close(self) -> None:
        """Stop the encoding threads (after a failure too)."""
        self._pool.shutdown(cancel_futures=True)


class EncodingRegistry:
    """The encodings a spotckpt reads, by codec (DCP's ``ExtensionRegistry`` is the model)."""

    def __init__(self, encodings: Iterable[Encoding] = ()) -> None:
        # Replaced whole on each change (under `_changing`), so readers need no lock.
        self._by_codec: dict[str, Encoding] = {}
        self._changing = threading.Lock()
        for encoding in encodings:
            self.register(encoding)

    def register(self, encoding: Encoding) -> None:
        """Read (and allow writing) `encoding`'s codecs; InvalidArgumentError for a codec that
        an encoding already holds (this one included: a registration is undone by one
        `unregister`, so it must not stack), or none at all."""
        if not encoding.codecs or "" in encoding.codecs:
            raise InvalidArgumentError(f"encoding {encoding.name!r} names no codec of its own")
        with self._changing:
            held = self._by_codec
            if any(held.get(codec) is encoding for codec in encoding.codecs):
                raise InvalidArgumentError(f"encoding {encoding.name!r} is already registered")
            taken = sorted(codec for codec in encoding.codecs if codec in held)
            if taken:
                raise InvalidArgumentError(f"codecs {taken} are registered to another encoding")
            self._by_codec = {**self._by_codec, **dict.fromkeys(encoding.codecs, encoding)}

    def unregister(self, encoding: Encoding) -> None:
        """Forget `encoding`'s codecs (a test's, or a plug-in's being unloaded)."""
        with self._changing:
            self._by_codec = {
                codec: held for codec, held in self._by_codec.items() if held is not encoding
            }

    def knows(self, codec: str) -> bool:
        """Whether chunks stored with `codec` can be read."""
        return codec in self._by_codec

    def known(self) -> list[str]:
        """Every registered codec, sorted (for messages)."""
        return sorted(self._by_codec)

    def of(self, codec: str) -> Encoding:
        """The encoding of chunks stored with `codec` (`RAW` for none); InvalidArgumentError
        naming the codec for one that no registered encoding reads."""
        if not codec:
            return RAW
        encoding = self._by_codec.get(codec)
        if encoding is None:
            raise InvalidArgumentError(
                f"unknown chunk codec {codec[:40]!r}; known: {self.known()} (an encoding this "
                "spotckpt does not have registered wrote it)"
            )
        return encoding
