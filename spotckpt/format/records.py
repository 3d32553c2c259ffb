"""The records a manifest is made of: data objects, tensors, their chunks and where each chunk's
bytes lie. Every manifest form (one document, packed records, an indexed root and its parts)
parses into these, so nothing past the parsers knows which form a step was written in."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True)
class ObjectRecord:
    """One data object of the checkpoint; `key` is relative to the step folder."""

    key: str
    size: int
    crc32c: int
    rank: int
    blake3: str | None = None
    """The object's BLAKE3 (hex), in signed manifests only (`spotckpt.format.signing`)."""


@dataclass(frozen=True, kw_only=True)
class ChunkLocation:
    """Where one stored chunk's bytes lie, with a CRC32C per `block_size` block of its raw bytes;
    `blake3` (hex, incremental saves only) is the hash of the chunk's bytes that a later save
    compares with to reference them instead of uploading them again.

    An encoded chunk (`codec` set, `spotckpt.format.encodings`) has `length` raw bytes, and
    its blocks are stored one after another from `offset`, `stored_lengths` bytes each, with the
    CRC32Cs `stored_crc32c` of the stored bytes."""

    key: str
    offset: int
    length: int
    block_crc32c: tuple[int, ...]
    blake3: str = ""
    codec: str = ""
    stored_lengths: tuple[int, ...] = ()
    stored_crc32c: tuple[int, ...] = ()

    @property
    def stored_length(self) -> int:
        """Bytes the chunk takes in its object."""
        return sum(self.stored_lengths) if self.codec else self.length

    def stored_span(self, first_block: int, end_block: int, block_size: int) -> tuple[int, int]:
        """Object bytes that hold blocks `first_block` up to (not including) `end_block`."""
        if not self.codec:
            start = self.offset + min(self.length, first_block * block_size)
            return start, self.offset + min(self.length, end_block * block_size)
        start = self.offset + sum(self.stored_lengths[:first_block])
        return start, start + sum(self.stored_lengths[first_block:end_block])


@dataclass(frozen=True, kw_only=True)
class TensorChunk:
    """A rectangular piece of a tensor, as DCP's ChunkStorageMetadata, plus its location."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    location: ChunkLocation


@dataclass(frozen=True, kw_only=True)
class TensorRecord:
    """A tensor's dtype, global shape and stored chunks."""

    dtype: str
    shape: tuple[int, ...]
    chunks: tuple[TensorChunk, ...]
