"""Compressed chunks: lossless, per CRC block, with each element's bytes grouped by significance.

Floating-point bytes compress badly as they lie: a value's exponent is followed by mantissa bits
that look random. Grouped into planes (the first byte of every element, then the second, ...),
the exponent planes compress well and the mantissa planes hardly at all, so each plane is
compressed on its own (Zstandard, level 1) and kept raw where that does not pay. On trained bf16
weights this gives about 1.45x, on AdamW's fp32 moments 1.15-1.25x (``benchmarks/
compression_bench.py``); zstd on the bytes as they are gives 1.3x and 1.07x.

Each ``block_size`` block of a chunk (the unit of its CRC32Cs) is compressed alone, so a reader
that wants part of a chunk (resharding, lazy reads) still fetches and decodes only the blocks
that hold it. A compressed chunk's location says which codec wrote it (``zstd-planes-K``, K the
element size), the stored length of every block and a CRC32C of each block's stored bytes, next
to the CRC32Cs of its raw bytes: a restore checks the stored bytes before decoding them and the
decoded bytes after (`spotckpt.engine.chunks`).

A stored block is either the raw block, when compression would not make it shorter (the stored
length then equals the raw length), or: K little-endian uint32 plane lengths, then each plane
(a Zstandard frame when shorter than the plane, else the plane's raw bytes), then the block's
last ``raw_length % K`` bytes raw.

Decoding is bounded by the plane's length in the block the manifest promises, whatever the
stored bytes claim (`decode_block_into`, the one function every reader decodes with): a frame's
header is read first, and a frame that declares another content size, or a window larger than
the plane needs, is refused before the decoder allocates anything (python-zstandard allocates
a frame's declared content size whatever ``max_output_size`` says, and its decoder allocates
the declared window); a frame without a declared size is decoded into at most the plane's
length. Whatever does not decode is a `CorruptBlockError`, which readers report as corrupt data
(a `ChecksumMismatchError`), as they do a CRC32C mismatch.

Objects that hold compressed chunks have no safetensors header (the header must come first and
give every tensor's stored size, unknown until compressed): the manifest is their only index.
Steps that use them name the ``compressed`` manifest feature (`spotckpt.format.features`), which
an older spotckpt refuses instead of reading wrong bytes.
"""

from __future__ import annotations

import os
import struct
import time
from collections import deque
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np
import zstandard

from spotckpt.checksum import crc32c
from spotckpt.errors import ChecksumMismatchError, InvalidArgumentError
from spotckpt.storage.base import ObjectWriter

FEATURE = "compressed"
"""The manifest feature (`spotckpt.format.features`) of a step holding compressed chunks."""

CODECS: dict[str, int] = {f"zstd-planes-{size}": size for size in (1, 2, 4, 8)}
"""Every codec this spotckpt reads, by name, with its plane count (the element size)."""

LEVEL = 1
"""Zstandard level: higher levels gain about 1 % here at a third of the speed."""

COMPRESSION_MODES = ("auto", "on", "off")
"""The values of the `compression` setting."""

COMPRESS_THREADS = min(4, os.cpu_count() or 1)
"""Threads that compress one rank's chunks."""

MIN_CHUNK_BYTES = 64 << 10
"""Chunks smaller than this (one CRC block) are stored raw: too little to gain."""

_WINDOW = 4 << 20
"""Bytes of a chunk handed to one compressing thread at a time."""


class CorruptBlockError(ChecksumMismatchError):
    """A stored block that does not decode to its raw length (only after its stored CRC32C
    matched: a forged manifest, or a bug); readers report it with the object and tensor."""


def codec_for(itemsize: int) -> str:
    """The codec for elements of `itemsize` bytes (anything else: one plane)."""
    name = f"zstd-planes-{itemsize}"
    return name if name in CODECS else "zstd-planes-1"


def plane_count(codec: str) -> int:
    """The number of byte planes of `codec`; InvalidArgumentError for an unknown one."""
    planes = CODECS.get(codec)
    if planes is None:
        raise InvalidArgumentError(f"unknown chunk codec {codec[:40]!r}; known: {sorted(CODECS)}")
    return planes


def encode_block(block: memoryview, planes: int, compressor: Any) -> bytes:
    """The stored bytes of one raw block: its planes compressed, or the block itself when that
    is not shorter."""
    raw = np.frombuffer(block, dtype=np.uint8)
    whole = raw.size - raw.size % planes
    parts = []
    for plane in _split(raw[:whole], planes):
        plain = plane.data
        packed = compressor.compress(plain)
        parts.append(packed if len(packed) < plane.size else plain)
    lengths = struct.pack(f"<{planes}I", *(len(part) for part in parts))
    stored = b"".join([lengths, *parts, raw[whole:].tobytes()])
    return stored if len(stored) < raw.size else bytes(block)


def decode_block_into(stored: memoryview, out: memoryview, planes: int) -> None:
    """Decode one stored block into `out` (exactly its raw length, as the manifest promises),
    allocating no more than that length whatever the stored bytes claim; CorruptBlockError when
    they do not describe a block of that length."""
    size = out.nbytes
    if stored.nbytes == size:
        out[:] = stored
        return
    head = 4 * planes
    if stored.nbytes < head or stored.nbytes > size:
        raise CorruptBlockError(f"a stored block of {stored.nbytes} bytes cannot hold {size}")
    lengths = struct.unpack(f"<{planes}I", stored[:head])
    plane_size = size // planes
    tail = size - plane_size * planes
    if head + sum(lengths) + tail != stored.nbytes:
        raise CorruptBlockError("a stored block's plane lengths do not add up to its size")
    decompressor = zstandard.ZstdDecompressor()
    decoded = []
    at = head
    for length in lengths:
        piece = stored[at : at + length]
        at += length
        if length == plane_size:
            decoded.append(np.frombuffer(piece, dtype=np.uint8))
            continue
        plain = _decode_plane(decompressor, piece, plane_size)
        decoded.append(np.frombuffer(plain, dtype=np.uint8))
    target = np.frombuffer(out, dtype=np.uint8)
    _join(decoded, target[: plane_size * planes])
    target[plane_size * planes :] = np.frombuffer(stored[at:], dtype=np.uint8)


def _decode_plane(decompressor: Any, frame: memoryview, size: int) -> bytes:
    """The `size` bytes a plane's Zstandard frame holds. Its header is checked before the
    decoder runs: a declared content size other than `size`, or a window beyond what a frame of
    `size` bytes needs (``ZstdCompressor`` writes at most `_window_for` of it), is refused
    before anything is allocated for it."""
    try:
        header = zstandard.get_frame_parameters(frame)
    except zstandard.ZstdError as error:
        raise CorruptBlockError(f"a plane does not decode: {error}") from None
    declared = header.content_size
    if declared != zstandard.CONTENTSIZE_UNKNOWN and declared != size:
        raise CorruptBlockError(f"a plane's frame declares {declared} bytes, not {size}")
    if header.window_size > _window_for(size):
        raise CorruptBlockError(
            f"a plane's frame declares a window of {header.window_size} bytes, more than a "
            f"plane of {size} bytes needs"
        )
    try:
        plain: bytes = decompressor.decompress(frame, max_output_size=size)
    except zstandard.ZstdError as error:
        raise CorruptBlockError(f"a plane does not decode: {error}") from None
    if len(plain) != size:
        raise CorruptBlockError(f"a plane decodes to {len(plain)} bytes, not {size}")
    return plain


def _window_for(size: int) -> int:
    """The largest window a frame of `size` bytes has: Zstandard narrows the window of a
    frame whose size it knows to the power of two that holds it, never below 1 KiB."""
    return max(1 << 10, 1 << max(0, size - 1).bit_length())


_WORDS: dict[int, np.dtype[Any]] = {2: np.dtype("<u2"), 4: np.dtype("<u4"), 8: np.dtype("<u8")}
"""Elements as little-endian words, so that byte k of an element is bits 8k..8k+7 on any
machine: planes split and join with shifts, much faster than strided byte copies."""


def _split(raw: np.ndarray[Any, Any], planes: int) -> list[np.ndarray[Any, Any]]:
    """The byte planes of `raw` (a whole number of elements): plane k holds byte k of each."""
    if planes == 1:
        return [raw]
    words = raw.view(_WORDS[planes])
    return [(words >> (8 * k)).astype(np.uint8) for k in range(planes)]


def _join(planes: list[np.ndarray[Any, Any]], out: np.ndarray[Any, Any]) -> None:
    """Interleave byte planes back into elements, into `out`."""
    if len(planes) == 1:
        out[:] = planes[0]
        return
    word = _WORDS[len(planes)]
    words = out.view(word)
    words[:] = planes[0]
    for k, plane in enumerate(planes[1:], start=1):
        words |= plane.astype(word) << (8 * k)


@dataclass(frozen=True)
class CompressedRange:
    """Where a chunk's stored bytes lie in its object, and what a reader needs to check and
    decode them."""

    offset: int
    length: int
    block_crc32c: tuple[int, ...]
    codec: str = ""
    stored_lengths: tuple[int, ...] = ()
    stored_crc32c: tuple[int, ...] = ()

    def codec_fields(self) -> dict[str, Any]:
        """The `ChunkLocation` fields that say how a compressed chunk is stored (none: raw)."""
        if not self.codec:
            return {}
        return {
            "codec": self.codec,
            "stored_lengths": self.stored_lengths,
            "stored_crc32c": self.stored_crc32c,
        }


_Encoded = list[tuple[bytes, int, int]]
"""A window's blocks: stored bytes, CRC32C of the raw block, CRC32C of the stored bytes."""


def _encode_window(window: memoryview, block_size: int, planes: int) -> _Encoded:
    compressor = zstandard.ZstdCompressor(
        level=LEVEL, write_content_size=False, write_checksum=False
    )
    encoded = []
    for start in range(0, window.nbytes, block_size):
        block = window[start : start + block_size]
        stored = encode_block(block, planes, compressor)
        encoded.append((stored, crc32c(block), crc32c(stored)))
    return encoded


class CompressedStreamWriter:
    """Streams one object of stored chunks, compressed or raw, with no header: the manifest is
    its index. Compression runs on a few threads (Zstandard releases the GIL), a bounded number
    of windows ahead of the upload, in order."""

    def __init__(
        self,
        writer: ObjectWriter,
        block_size: int,
        hasher: Any = None,
        threads: int | None = None,
        total: int = 0,
    ) -> None:
        """`hasher` (anything with ``update``) sees every stored byte; `total` is the raw size
        of everything to be written (progress only)."""
        self._writer = writer
        self._block_size = block_size
        self._hasher = hasher
        self._position = 0
        self._crc = 0
        self._threads = threads or COMPRESS_THREADS
        self._pool = ThreadPoolExecutor(self._threads, thread_name_prefix="spotckpt-compress")
        self.total = total
        self.written = 0  # raw bytes handled so far (`spotckpt.progress`)

    def _emit(self, data: bytes | memoryview) -> None:
        self._crc = crc32c(data, self._crc)
        if self._hasher is not None:
            self._hasher.update(data)
        self._writer.write(data)
        self._position += len(data)

    def write_tensor(self, name: str, data: memoryview) -> CompressedRange:
        """Store bytes as they are (values, packs, small chunks: `name` is not stored), with
        their block CRC32Cs, as `spotckpt.format.safetensors_io.SafetensorsStreamWriter` does."""
        offset = self._position
        self._emit(data)
        self.written += data.nbytes
        crcs = tuple(
            crc32c(data[start : start + self._block_size])
            for start in range(0, data.nbytes, self._block_size)
        )
        return CompressedRange(offset, data.nbytes, crcs or (0,))

    def write_compressed(self, data: memoryview, itemsize: int) -> CompressedRange:
        """Store a chunk block by block through its codec; returns where and how it lies."""
        codec = codec_for(itemsize)
        planes = CODECS[codec]
        offset = self._position
        raw_crcs: list[int] = []
        lengths: list[int] = []
        crcs: list[int] = []
        for raw_bytes, blocks in self._encoded(data, planes):
            for stored, raw_crc, stored_crc in blocks:
                raw_crcs.append(raw_crc)
                lengths.append(len(stored))
                crcs.append(stored_crc)
                self._emit(stored)
            self.written += raw_bytes
        if not data.nbytes:
            raw_crcs, lengths, crcs = [0], [0], [0]
        return CompressedRange(
            offset, data.nbytes, tuple(raw_crcs), codec, tuple(lengths), tuple(crcs)
        )

    def _encoded(self, data: memoryview, planes: int) -> Iterator[tuple[int, _Encoded]]:
        """Each window's raw size and encoded blocks, in order, with at most two windows per
        thread in flight (bounded memory)."""
        window = _WINDOW - _WINDOW % self._block_size or self._block_size
        pending: deque[tuple[int, Future[_Encoded]]] = deque()
        for start in range(0, data.nbytes, window):
            piece = data[start : start + window]
            encoding = self._pool.submit(_encode_window, piece, self._block_size, planes)
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
        """Stop the compressing threads (after a failure too)."""
        self._pool.shutdown(cancel_futures=True)


SAMPLE_BYTES = 2 << 20
"""Bytes of a save's tensors that ``"auto"`` compresses first to measure ratio and speed."""

OBSERVED_BYTES = 32 << 20
"""The smallest upload whose rate `LinkRate` believes."""

GAIN = 0.9
"""``"auto"`` compresses when the model says a save takes at most this share of its raw time."""


class LinkRate:
    """The upload rate of a rank's recent bucket saves (bytes per second of its object's
    upload), which ``compression="auto"`` weighs compression against; shared by the writers of
    one manager. Unknown (None) until a save has measured it."""

    def __init__(self) -> None:
        self.rate: float | None = None

    def observe(self, nbytes: int, seconds: float) -> None:
        """Account for one upload of `nbytes` that took `seconds`; one under `OBSERVED_BYTES`
        is not counted (its time is mostly latency, and compressing it would gain little)."""
        if nbytes >= OBSERVED_BYTES and seconds > 0:
            self.rate = nbytes / seconds


def pays_off(ratio: float, compress_rate: float, link_rate: float | None) -> bool:
    """Whether compressing makes a save faster: with compression pipelined with the upload, a
    save takes ``max(S / compress_rate, S / (ratio * link_rate))`` against ``S / link_rate``;
    it must come to at most `GAIN` of that. Never without a measured link."""
    if link_rate is None or ratio <= 0:
        return False
    raw = 1 / link_rate
    return max(1 / compress_rate, 1 / (ratio * link_rate)) <= GAIN * raw


def measure(
    samples: list[tuple[memoryview, int]], block_size: int, threads: int
) -> tuple[float, float]:
    """Compression ratio and rate (bytes per second on `threads` threads) of the first
    `SAMPLE_BYTES` of `samples` (tensor bytes and element size)."""
    raw = stored = 0
    started = time.perf_counter()
    for data, itemsize in samples:
        piece = data[: max(0, SAMPLE_BYTES - raw)]
        blocks = _encode_window(piece, block_size, CODECS[codec_for(itemsize)])
        raw += piece.nbytes
        stored += sum(len(block) for block, _raw_crc, _stored_crc in blocks)
        if raw >= SAMPLE_BYTES:
            break
    seconds = max(time.perf_counter() - started, 1e-9)
    return (raw / stored if stored else 0.0), raw * threads / seconds
