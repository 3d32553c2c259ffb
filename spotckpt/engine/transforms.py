"""Per-object transforms of a save: what a rank's object goes through on its way to the bucket.

Chosen once per object (`ObjectTransforms`) and recorded in the manifest through what it already
records:

- the encoding (`EncodingChoice`: the `compression` setting's `spotckpt.format.compression.
  Compression`, or any other choice of a registered `spotckpt.format.encodings.Encoding`): each
  chunk's location names its codec, by which readers find the encoding again
  (`spotckpt.format.codecs`);
- the unchanged-chunk filter (`UnchangedFilter`, incremental saves): a chunk whose bytes the base
  step holds is referenced there (`spotckpt.engine.incremental`) instead of uploaded;
- the strong hasher (`ChunkHashing`): a signing save's BLAKE3 of the object and of every chunk and
  value it writes, an incremental save's of every tensor chunk (for the next save to compare with).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.planner import SavePlanner, WriteItem, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult

from spotckpt.checksum import chunk_hash
from spotckpt.engine.incremental import Base
from spotckpt.engine.manifests import WrittenItem
from spotckpt.engine.packing import PackedMember, members_of
from spotckpt.errors import InvalidArgumentError, InvalidTypeError
from spotckpt.format.codecs import ENCODINGS
from spotckpt.format.dtypes import dtype_of
from spotckpt.format.encodings import RAW, Encoding
from spotckpt.format.safetensors_io import tensor_bytes
from spotckpt.format.signing import new_hasher


class EncodingChoice(Protocol):
    """Picks the encoding of each object a save writes, and hears how its upload went."""

    def choose(self, samples: Iterable[tuple[memoryview, int]], block_size: int) -> Encoding:
        """The object's encoding; `samples` lazily yields its tensor bytes with their element
        sizes, for a choice that weighs them (resolving tensors costs: read only what helps)."""

    def uploaded(self, encoding: Encoding, nbytes: int, seconds: float) -> None:
        """The object, stored with `encoding`, took `seconds` to upload its `nbytes`."""


@dataclass(frozen=True)
class Always:
    """The choice of one encoding for every object."""

    encoding: Encoding

    def choose(self, samples: Iterable[tuple[memoryview, int]], block_size: int) -> Encoding:
        return self.encoding

    def uploaded(self, encoding: Encoding, nbytes: int, seconds: float) -> None:
        return None


@dataclass(frozen=True)
class ChunkHashing:
    """The strong hasher (BLAKE3): with `signing`, of the object and every chunk and value
    written (reads check them, `spotckpt.engine.chunks`); with `chunks` (incremental saves), of
    every tensor chunk written, for the next save to compare with."""

    signing: bool = False
    chunks: bool = False

    def object_hasher(self) -> Any:
        """A hasher that sees every stored byte of the object, or None."""
        return new_hasher() if self.signing else None

    def of(
        self, data: memoryview, members: tuple[PackedMember, ...] | None, value: bool
    ) -> tuple[str, ...]:
        """The hashes of an item's bytes (of each member's, for a pack), or none."""
        if not (self.signing or (self.chunks and not value)):
            return ()
        if members is None:
            return (chunk_hash(data),)
        return tuple(chunk_hash(data[m.offset : m.offset + m.nbytes]) for m in members)


@dataclass
class Unchanged:
    """What the unchanged-chunk filter made of an object's items."""

    reused: list[WriteResult] = field(default_factory=list)
    """Results that reference the base step's bytes."""
    skipped: set[MetadataIndex] = field(default_factory=set)
    """The items they stand for: not uploaded."""
    resolved: dict[MetadataIndex, memoryview] = field(default_factory=dict)
    """The bytes of the items to upload, resolved on the way (not resolved again)."""
    digests: dict[MetadataIndex, tuple[str, ...]] = field(default_factory=dict)
    """Their hashes, computed on the way (not computed again)."""


class UnchangedFilter:
    """Compares every tensor chunk with the base step first: what is unchanged never uploads."""

    def __init__(self, base: Base) -> None:
        self.base = base

    def split(self, items: list[WriteItem], planner: SavePlanner) -> Unchanged:
        """The items' references into the base, and the bytes of those that must upload."""
        kept = Unchanged()
        for item in items:
            if item.type == WriteItemType.BYTE_IO:
                continue
            data = resolved_bytes(planner, item)
            found = self._unchanged(item, planner, data, kept.digests)
            if found is None:
                kept.resolved[item.index] = data
            else:
                kept.reused += found
                kept.skipped.add(item.index)
        return kept

    def _unchanged(
        self,
        item: WriteItem,
        planner: SavePlanner,
        data: memoryview,
        digests: dict[MetadataIndex, tuple[str, ...]],
    ) -> list[WriteResult] | None:
        """The results that reference the base step's bytes instead of a tensor item (every
        member of a pack) when all of them are unchanged there, else None; the hashes computed
        on the way go into `digests` (the others are computed while the item uploads)."""
        members = members_of(planner, item.index.fqn)
        if members is None:
            tensor = item.tensor_data
            if tensor is None:
                raise InvalidTypeError(f"write item {item.index.fqn!r} has no tensor data")
            stored, digest = self.base.find(
                (item.index.fqn, tuple(tensor.chunk.offsets)),
                dtype_of(tensor.properties.dtype).name,
                tuple(tensor.size),
                tuple(tensor.chunk.sizes),
                data,
            )
            if digest:
                digests[item.index] = (digest,)
            if stored is None:
                return None
            written = WrittenItem(stored.location, stored.record)
            return [WriteResult(item.index, stored.location.length, written)]
        found = []
        for member in members:
            zeros = (0,) * len(member.shape)
            piece = data[member.offset : member.offset + member.nbytes]
            stored, _digest = self.base.find(
                (member.fqn, zeros), member.dtype, member.shape, member.shape, piece
            )
            if stored is None:
                return None
            index = MetadataIndex(member.fqn, torch.Size(zeros))
            written = WrittenItem(stored.location, stored.record, member)
            found.append(WriteResult(index, stored.location.length, written))
        return found


@dataclass(frozen=True)
class ObjectTransforms:
    """The transforms one rank's object goes through, chosen once for it."""

    encodings: EncodingChoice
    unchanged: UnchangedFilter | None = None
    hashing: ChunkHashing = ChunkHashing()
    encodable: bool = True
    """False where the manifest records no encoding (an indexed save's parts): stored raw."""

    def split(self, items: list[WriteItem], planner: SavePlanner) -> Unchanged:
        """The unchanged-chunk filter's verdict on `items` (nothing unchanged without one)."""
        return Unchanged() if self.unchanged is None else self.unchanged.split(items, planner)

    def encoding(self, samples: Iterable[tuple[memoryview, int]], block_size: int) -> Encoding:
        """The object's encoding (`EncodingChoice.choose`); one that no registered encoding
        reads is refused before anything is written (its manifest would not parse)."""
        if not self.encodable:
            return RAW
        encoding = self.encodings.choose(samples, block_size)
        if encoding is not RAW and not all(
            ENCODINGS.knows(c) and ENCODINGS.of(c) is encoding for c in encoding.codecs
        ):
            raise InvalidArgumentError(f"encoding {encoding.name!r} is not registered")
        return encoding

    def uploaded(self, encoding: Encoding, nbytes: int, seconds: float) -> None:
        """Tell the encoding choice how the object's upload went."""
        self.encodings.uploaded(encoding, nbytes, seconds)


def resolved_bytes(planner: SavePlanner, item: WriteItem) -> memoryview:
    """A tensor item's bytes, from a CPU copy when it lies elsewhere."""
    data = planner.resolve_data(item)
    if not isinstance(data, torch.Tensor):
        raise InvalidTypeError(f"DCP resolved a tensor item to {type(data).__name__}")
    return tensor_bytes(data.detach().cpu() if data.device.type != "cpu" else data.detach())
