"""Streaming safetensors: write a file without building it in memory, read it by byte ranges.

A safetensors file is an 8-byte little-endian header length, a JSON header that gives each
tensor's dtype, shape and ``data_offsets`` (relative to the end of the header), padded with spaces
to a multiple of 8, then the tensor bytes back to back. Because the header needs only dtypes and
shapes, the writer emits it first and then streams each tensor's bytes straight from CPU memory
into an `ObjectWriter`, computing CRC32C on the way: one pass, no whole-file copy.

CRC32C is kept per block of `block_size` bytes of each tensor, aligned to the tensor's first
byte, so a reader that needs only part of a tensor (resharding) can verify what it read by
widening its range to block boundaries instead of fetching the whole tensor.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterable
from dataclasses import dataclass
from math import prod
from typing import TYPE_CHECKING, Any

from spotckpt.checksum import crc32c
from spotckpt.errors import InvalidArgumentError, SafetensorsFormatError
from spotckpt.format import bounded_json
from spotckpt.format.dtypes import BY_CODE, MAX_DIMS, DType
from spotckpt.storage.base import ObjectStore, ObjectWriter

if TYPE_CHECKING:  # torch loads only where tensors are made or read
    import torch

MAX_HEADER_BYTES = 100 << 20
DEFAULT_BLOCK_SIZE = 64 << 10
_WRITE_SLICE = 8 << 20


@dataclass(frozen=True)
class TensorSpec:
    """What the header says of one tensor before its bytes exist."""

    name: str
    dtype: DType
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        """Size of the tensor's bytes."""
        return prod(self.shape) * self.dtype.itemsize


@dataclass(frozen=True)
class StoredRange:
    """Where a tensor's bytes lie in the object, with their per-block CRC32Cs; for a chunk stored
    encoded (`spotckpt.format.encodings`), its codec and each stored block's length and CRC32C."""

    offset: int
    length: int
    block_crc32c: tuple[int, ...]
    codec: str = ""
    stored_lengths: tuple[int, ...] = ()
    stored_crc32c: tuple[int, ...] = ()

    def codec_fields(self) -> dict[str, Any]:
        """The `ChunkLocation` fields that say how the chunk is stored (none: as it is)."""
        if not self.codec:
            return {}
        return {
            "codec": self.codec,
            "stored_lengths": self.stored_lengths,
            "stored_crc32c": self.stored_crc32c,
        }


def tensor_bytes(tensor: torch.Tensor) -> memoryview:
    """The raw bytes of a CPU tensor as a flat byte view (copies only if not contiguous)."""
    import torch

    flat = tensor.detach().contiguous().reshape(-1)
    if flat.dtype != torch.uint8:
        flat = flat.view(torch.uint8)
    return memoryview(flat.numpy()).cast("B")  # type: ignore[arg-type]


def block_crcs(data: memoryview | bytes, block_size: int) -> tuple[int, ...]:
    """CRC32C of each `block_size` block of `data`; an empty buffer has one block of CRC 0."""
    view = memoryview(data)
    if not view.nbytes:
        return (0,)
    return tuple(crc32c(view[i : i + block_size]) for i in range(0, view.nbytes, block_size))


def encode_header(specs: Iterable[TensorSpec], metadata: dict[str, str]) -> bytes:
    """The length prefix and padded JSON header for tensors stored in the given order."""
    header: dict[str, Any] = {"__metadata__": metadata} if metadata else {}
    position = 0
    for spec in specs:
        end = position + spec.nbytes
        header[spec.name] = {
            "dtype": spec.dtype.code,
            "shape": list(spec.shape),
            "data_offsets": [position, end],
        }
        position = end
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text


class SafetensorsStreamWriter:
    """Writes one safetensors object: the header at once, then each tensor in `specs` order."""

    def __init__(
        self,
        writer: ObjectWriter,
        specs: list[TensorSpec],
        metadata: dict[str, str],
        block_size: int = DEFAULT_BLOCK_SIZE,
        hasher: Any = None,
    ) -> None:
        """`hasher` (anything with ``update``, e.g. BLAKE3) sees every byte of the object as it
        is written: a strong hash at no extra pass."""
        names = [s.name for s in specs]
        if len(set(names)) != len(names):
            raise InvalidArgumentError("tensor names in one safetensors file must be unique")
        self._writer = writer
        self._pending = list(reversed(specs))
        self._block_size = block_size
        header = encode_header(specs, metadata)
        self._crc = crc32c(header)
        self._hasher = hasher
        if hasher is not None:
            hasher.update(header)
        self._position = len(header)
        self.total = len(header) + sum(spec.nbytes for spec in specs)  # the object's size
        self.written = 0  # bytes handed to the object writer so far (`spotckpt.progress`)
        writer.write(header)
        self.written = len(header)

    def write_tensor(self, name: str, data: memoryview) -> StoredRange:
        """Stream the bytes of the next tensor; returns where they landed and their CRCs."""
        if not self._pending or self._pending[-1].name != name:
            expected = self._pending[-1].name if self._pending else "nothing"
            raise InvalidArgumentError(f"expected tensor {expected!r} next, got {name!r}")
        spec = self._pending.pop()
        if data.nbytes != spec.nbytes:
            raise InvalidArgumentError(
                f"tensor {name!r} has {data.nbytes} bytes, header says {spec.nbytes}"
            )
        crcs = block_crcs(data, self._block_size)
        for start in range(0, data.nbytes, _WRITE_SLICE):
            piece = data[start : start + _WRITE_SLICE]
            self._crc = crc32c(piece, self._crc)
            if self._hasher is not None:
                self._hasher.update(piece)
            self._writer.write(piece)
            self.written += piece.nbytes
        stored = StoredRange(self._position, data.nbytes, crcs)
        self._position += data.nbytes
        return stored

    def finish(self) -> tuple[int, int]:
        """Check that every tensor was written; returns the object's size and CRC32C."""
        if self._pending:
            raise InvalidArgumentError(f"tensor {self._pending[-1].name!r} was never written")
        return self._position, self._crc


@dataclass(frozen=True)
class HeaderEntry:
    """One tensor as a safetensors header describes it; offsets are absolute in the object."""

    dtype: DType
    shape: tuple[int, ...]
    start: int
    end: int


@dataclass(frozen=True)
class SafetensorsHeader:
    """A parsed, validated header."""

    entries: dict[str, HeaderEntry]
    metadata: dict[str, str]
    data_start: int


def parse_header(raw: bytes, object_size: int) -> SafetensorsHeader:
    """Validate a header's JSON (without its 8-byte prefix) against the object's size."""
    if len(raw) > MAX_HEADER_BYTES:
        raise SafetensorsFormatError(f"safetensors header of {len(raw)} bytes is absurd")
    try:
        decoded = bounded_json.loads(raw, "safetensors header")
    except bounded_json.BoundedJSONError as error:
        raise SafetensorsFormatError(str(error)) from None
    if not isinstance(decoded, dict):
        raise SafetensorsFormatError("safetensors header is not a JSON object")
    metadata = decoded.pop("__metadata__", {}) or {}
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise SafetensorsFormatError("safetensors __metadata__ must map strings to strings")
    data_start = 8 + len(raw)
    entries = {name: _parse_entry(name, value, data_start) for name, value in decoded.items()}
    ends = sorted((e.start, e.end) for e in entries.values())
    position = data_start
    for start, end in ends:
        if start != position:
            raise SafetensorsFormatError("safetensors tensors overlap or leave gaps")
        position = end
    if position != object_size:
        raise SafetensorsFormatError(
            f"safetensors data ends at byte {position} but the object has {object_size} bytes"
        )
    return SafetensorsHeader(entries, metadata, data_start)


def _parse_entry(name: str, value: Any, data_start: int) -> HeaderEntry:
    if not isinstance(value, dict):
        raise SafetensorsFormatError(f"header entry {name!r} is not an object")
    dtype = BY_CODE.get(value.get("dtype"))  # type: ignore[arg-type]
    if dtype is None:
        raise SafetensorsFormatError(f"tensor {name!r} has unknown dtype {value.get('dtype')!r}")
    shape, offsets = value.get("shape"), value.get("data_offsets")
    if not isinstance(shape, list) or not isinstance(offsets, list):
        raise SafetensorsFormatError(f"tensor {name!r} has a malformed shape or data_offsets")
    if not _int_list(shape) or not _int_list(offsets) or len(offsets) != 2:
        raise SafetensorsFormatError(f"tensor {name!r} has a malformed shape or data_offsets")
    if len(shape) > MAX_DIMS:
        raise SafetensorsFormatError(f"tensor {name!r} has {len(shape)} dimensions")
    begin, end = offsets
    if begin > end or (end - begin) != prod(shape) * dtype.itemsize:
        raise SafetensorsFormatError(f"tensor {name!r}: data_offsets disagree with dtype and shape")
    return HeaderEntry(dtype, tuple(shape), data_start + begin, data_start + end)


def _int_list(value: Any) -> bool:
    return isinstance(value, list) and all(
        isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in value
    )


def read_header(store: ObjectStore, key: str, object_size: int | None = None) -> SafetensorsHeader:
    """Fetch and validate a header with two ranged reads (length, then JSON).

    The claimed length is checked against the bound and the object's size before it is read.
    """
    if object_size is None:
        info = store.head(key)
        if info is None:
            raise SafetensorsFormatError(f"{store.uri}/{key} does not exist")
        object_size = info.size
    prefix = store.get_range(key, 0, 8)
    if len(prefix) < 8:
        raise SafetensorsFormatError(f"{key}: shorter than a safetensors length prefix")
    (length,) = struct.unpack("<Q", prefix)
    if length > min(MAX_HEADER_BYTES, object_size - 8):
        raise SafetensorsFormatError(
            f"{key}: header length {length} is absurd for an object of {object_size} bytes"
        )
    raw = store.get_range(key, 8, length)
    if len(raw) != length:
        raise SafetensorsFormatError(f"{key}: truncated header, {len(raw)} of {length} bytes")
    return parse_header(raw, object_size)


def bytes_to_tensor(
    data: bytearray | memoryview, dtype: DType, shape: tuple[int, ...]
) -> torch.Tensor:
    """A tensor viewing (not copying) the writable buffer `data`."""
    import torch

    if not len(data):
        return torch.empty(shape, dtype=dtype.torch_dtype)
    flat = torch.frombuffer(data, dtype=torch.uint8)
    return flat.view(dtype.torch_dtype).reshape(shape)
