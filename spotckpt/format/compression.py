"""Compressed chunks: lossless, per CRC block, with each element's bytes grouped by significance.

Floating-point bytes compress badly as they lie: a value's exponent is followed by mantissa bits
that look random. Grouped into planes (the first byte of every element, then the second, ...),
the exponent planes compress well and the mantissa planes hardly at all, so each plane is
compressed on its own (Zstandard, level 1) and kept raw where that does not pay. On trained bf16
weights this gives about 1.45x, on AdamW's fp32 moments 1.15-1.25x (``benchmarks/
compression_bench.py``); zstd on the bytes as they are gives 1.3x and 1.07x.

A compressed chunk's location says which codec wrote it (``zstd-planes-K``, K the element
size); it is stored block by block as every `spotckpt.format.encodings.BlockEncoding` chunk is
(`ZSTD_PLANES`, registered in `spotckpt.format.codecs`).

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

This module also owns the `compression` setting: its values (`COMPRESSION_MODES`, read by
`parse_compression_mode`) and `Compression`, which picks each object's encoding from it, with
what ``"auto"`` decides from (the upload rate that earlier raw saves measured).
"""

from __future__ import annotations

import struct
import time
from collections.abc import Iterable
from typing import Any, Literal, get_args

import numpy as np
import zstandard

from spotckpt.errors import CorruptBlockError, InvalidArgumentError
from spotckpt.format.encodings import (
    ENCODE_THREADS,
    RAW,
    BlockEncoder,
    BlockEncoding,
    Encoding,
    encode_window,
)

CODECS: dict[str, int] = {f"zstd-planes-{size}": size for size in (1, 2, 4, 8)}
"""Every codec this spotckpt reads, by name, with its plane count (the element size)."""

LEVEL = 1
"""Zstandard level: higher levels gain about 1 % here at a third of the speed."""

CompressionMode = Literal["auto", "on", "off"]
"""The `compression` setting's type (`spotckpt.config.Settings` is annotated with it)."""
COMPRESSION_MODES: tuple[str, ...] = get_args(CompressionMode)
"""The values of the `compression` setting."""

MIN_CHUNK_BYTES = 64 << 10
"""Chunks smaller than this (one CRC block) are stored raw: too little to gain."""


def parse_compression_mode(value: object) -> str:
    """`value` as a `compression` setting; InvalidArgumentError unless it is one of
    `COMPRESSION_MODES`."""
    if value not in COMPRESSION_MODES:
        raise InvalidArgumentError(f"compression must be one of {COMPRESSION_MODES}, got {value!r}")
    return str(value)


def codec_for(itemsize: int) -> str:
    """The codec for elements of `itemsize` bytes (anything else: one plane)."""
    name = f"zstd-planes-{itemsize}"
    return name if name in CODECS else "zstd-planes-1"


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


class ZstdPlanes(BlockEncoding):
    """Each block's byte planes compressed on their own (see the module docstring)."""

    name = "zstd-planes"
    codecs = frozenset(CODECS)
    min_bytes = MIN_CHUNK_BYTES

    def codec_for(self, itemsize: int) -> str:
        return codec_for(itemsize)

    def block_encoder(self, codec: str) -> BlockEncoder:
        planes = CODECS[codec]
        compressor = zstandard.ZstdCompressor(
            level=LEVEL, write_content_size=False, write_checksum=False
        )
        return lambda block: encode_block(block, planes, compressor)

    def decode_block_into(self, stored: memoryview, out: memoryview, codec: str) -> None:
        decode_block_into(stored, out, CODECS[codec])


ZSTD_PLANES = ZstdPlanes()
"""The compression encoding (the `compression` setting's ``"on"``)."""

SAMPLE_BYTES = 2 << 20
"""Bytes of a save's tensors that ``"auto"`` compresses first to measure ratio and speed."""

OBSERVED_BYTES = 32 << 20
"""The smallest upload whose rate `Compression` believes."""

GAIN = 0.9
"""``"auto"`` compresses when the model says a save takes at most this share of its raw time."""


class Compression:
    """The `compression` setting of one manager's saves, as the encoding each object gets
    (`spotckpt.engine.transforms.EncodingChoice`): none with ``"off"``, `ZSTD_PLANES` with
    ``"on"``, and with ``"auto"`` compression when a sample of the object's tensors says that it
    makes the save faster on the upload rate (bytes per second of a rank's object upload) that
    its earlier raw saves measured (`pays_off`). The rate is unknown (None) until measured."""

    def __init__(self, mode: str = "off") -> None:
        self.mode = parse_compression_mode(mode)
        self.rate: float | None = None

    def observe(self, nbytes: int, seconds: float) -> None:
        """Account for one upload of `nbytes` that took `seconds`; one under `OBSERVED_BYTES`
        is not counted (its time is mostly latency, and compressing it would gain little)."""
        if nbytes >= OBSERVED_BYTES and seconds > 0:
            self.rate = nbytes / seconds

    def choose(self, samples: Iterable[tuple[memoryview, int]], block_size: int) -> Encoding:
        """The encoding of an object whose tensor bytes (and element sizes) `samples` yields,
        lazily: only ``"auto"`` with a measured link reads them."""
        if self.mode == "on":
            return ZSTD_PLANES
        if self.mode == "off" or self.rate is None:
            return RAW
        taken: list[tuple[memoryview, int]] = []
        sampled = 0
        for data, itemsize in samples:
            if data.nbytes >= MIN_CHUNK_BYTES:
                taken.append((data, itemsize))
                sampled += data.nbytes
                if sampled >= SAMPLE_BYTES:
                    break
        if not taken:
            return RAW
        ratio, rate = measure(taken, block_size, ENCODE_THREADS)
        return ZSTD_PLANES if pays_off(ratio, rate, self.rate) else RAW

    def at_notice(self) -> Compression:
        """The choice of an emergency save whose plan compresses (`spotckpt.deadline.
        NoticeAdaptation`): ``"auto"`` on the rate this link measured, so that an object is
        compressed only where its sample says that pays off. A copy: this link keeps its mode."""
        adapted = Compression("auto")
        adapted.rate = self.rate
        return adapted

    def uploaded(self, encoding: Encoding, nbytes: int, seconds: float) -> None:
        """An object of `nbytes` went up in `seconds`: the link's rate, when it was stored raw
        (a compressed upload's time says more of the codec than of the link)."""
        if encoding is RAW:
            self.observe(nbytes, seconds)


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
        blocks = encode_window(ZSTD_PLANES.block_encoder(codec_for(itemsize)), piece, block_size)
        raw += piece.nbytes
        stored += sum(len(block) for block, _raw_crc, _stored_crc in blocks)
        if raw >= SAMPLE_BYTES:
            break
    seconds = max(time.perf_counter() - started, 1e-9)
    return (raw / stored if stored else 0.0), raw * threads / seconds
