"""A standard DCP checkpoint's ``.metadata``, read without trusting it: `read_standard_metadata`.

The file is a pickle. Unpickling it with DCP's real classes would let it run code (any global it
names) or change the process (a pickle may BUILD attributes onto any class or function it names,
such as ``MetadataIndex.__hash__``). So the unpickler here never hands the pickle a real class,
function or shared object: each name DCP's metadata uses (its dataclasses, ``torch.Size``,
torch's dtypes and layouts, paths, ``OrderedDict``) resolves to a throwaway stand-in made for this
one load, and any other name is refused before anything is called. The tree of stand-ins is then
converted into DCP's real objects by explicit construction (`_Converter`), every field checked
for its type; objects the pickle shares between places are charged wherever they appear, so a
small pickle cannot expand into an unbounded tree (`EXPANSION_PER_BYTE`). What the converted
metadata describes is checked last (`_check_metadata`): DCP's own rules for each tensor's chunks
(inside it, disjoint, filling it: `spotckpt.engine.plan_check`), every item's object key valid, its
range non-negative and disjoint from every other item's in its object, each chunk's item long
enough for its data.
"""

from __future__ import annotations

import io
import itertools
import math
import pickle
from typing import Any

import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    _MEM_FORMAT_ENCODING,
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)

from spotckpt.engine.plan_check import chunk_arrays, tensor_errors
from spotckpt.errors import (
    CorruptCheckpointError,
    InvalidKeyError,
    ObjectMissingError,
    ObjectSizeError,
)
from spotckpt.storage.base import ObjectStore, check_key, join_key

METADATA_NAME = ".metadata"
"""The object that makes a folder a standard DCP checkpoint (written last by DCP's writers)."""
MAX_METADATA_BYTES = 512 << 20
"""The largest ``.metadata`` read: far above what a checkpoint of a million tensors needs."""
EXPANSION_PER_BYTE = 4
"""The converted metadata may hold at most this many values (containers' entries, fields) per
byte of the pickle, plus `EXPANSION_FLOOR`: shared objects are counted where they appear."""
EXPANSION_FLOOR = 1 << 20
MAX_CHUNKS = 1 << 16
"""Chunks one tensor may have (one per rank that held a piece: far more ranks than jobs run)."""

_METADATA_MODULE = "torch.distributed.checkpoint.metadata"
_CLASSES = frozenset(
    {
        (_METADATA_MODULE, name)
        for name in (
            "Metadata",
            "MetadataIndex",
            "StorageMeta",
            "TensorProperties",
            "TensorStorageMetadata",
            "BytesStorageMetadata",
            "ChunkStorageMetadata",
            "_MEM_FORMAT_ENCODING",
        )
    }
    | {("torch.distributed.checkpoint.filesystem", "_StorageInfo")}
)
"""Classes a DCP metadata pickles, each built as a `_Stand` and converted (`_Converter`)."""
_PATHS = frozenset(("PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath"))


class _Stand:
    """What the unpickler builds for one of DCP's classes: the arguments and state the pickle
    gave, nothing else (a class of its own per name and load)."""

    kind = ""
    args: tuple[Any, ...] = ()
    state: Any = None

    def __init__(self, *args: Any) -> None:
        self.args = args

    def __setstate__(self, state: Any) -> None:
        self.state = state


class _Leaf:
    """A torch dtype, layout, size or path the pickle named: its name or value, converted
    later."""

    def __init__(self, kind: str, value: Any) -> None:
        self.kind = kind
        self.value = value


class _Unpickler(pickle.Unpickler):
    """Resolves only the names of DCP's metadata, each to a stand-in of this load."""

    def __init__(self, data: bytes) -> None:
        super().__init__(io.BytesIO(data))
        self._made: dict[tuple[str, str], Any] = {}

    def find_class(self, module: str, name: str) -> Any:
        found = self._made.get((module, name))
        if found is None:
            found = self._made[(module, name)] = self._stand_in(module, name)
        return found

    def _stand_in(self, module: str, name: str) -> Any:
        if (module, name) in _CLASSES:
            return type(name, (_Stand,), {"kind": name})
        if module == "torch" and name == "Size":
            return lambda *args: _Leaf("size", args[0] if args else ())
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return _Leaf("dtype", name)
        if (module, name) == ("torch.serialization", "_get_layout"):
            return lambda *args: _Leaf("layout", args[0] if args else None)
        if module in ("pathlib", "pathlib._local") and name in _PATHS:  # 3.13 spells it so
            return lambda *args: _Leaf("path", args)
        if (module, name) == ("collections", "OrderedDict"):
            return lambda *args: dict(*args)
        raise pickle.UnpicklingError(f"it names {module}.{name}, which a DCP metadata never does")

    def persistent_load(self, pid: Any) -> Any:
        raise pickle.UnpicklingError("it holds a persistent id, which a DCP metadata never does")


def read_standard_metadata(store: ObjectStore, folder: str = "") -> Metadata:
    """The checked metadata of the standard DCP checkpoint in `folder` of `store`
    (ObjectMissingError when it has none; CorruptCheckpointError when it is unsafe or
    malformed)."""
    key = join_key(folder, METADATA_NAME) if folder else METADATA_NAME
    where = f"{store.uri.rstrip('/')}/{key}"
    info = store.head(key)
    if info is None:
        raise ObjectMissingError(f"{where}: no DCP metadata there")
    if info.size > MAX_METADATA_BYTES:
        raise ObjectSizeError(
            f"{where} is {info.size} bytes, more than the {MAX_METADATA_BYTES} a DCP metadata "
            "may be: refused unread"
        )
    data = store.get_range(key, 0, info.size)
    try:
        loaded = _Unpickler(data).load()
        metadata = _Converter(EXPANSION_PER_BYTE * len(data) + EXPANSION_FLOOR).metadata(loaded)
        _check_metadata(metadata)
    except (pickle.UnpicklingError, _Malformed) as error:
        raise CorruptCheckpointError(f"{where} is refused as a DCP metadata: {error}") from None
    except Exception as error:  # a malformed pickle fails in any way
        raise CorruptCheckpointError(
            f"{where} is refused as a DCP metadata: it is malformed ({type(error).__name__}: "
            f"{error})"
        ) from None
    return metadata


class _Malformed(CorruptCheckpointError):
    """What a metadata's conversion or check found wrong (the refusal's reason, raised again
    with where the metadata is)."""


def _natural(value: Any) -> bool:
    return type(value) is int and value >= 0


class _Converter:
    """Converts the stand-ins of one load into DCP's real metadata objects, checking each
    field's type and charging every value it visits (shared ones each time) to `budget`."""

    def __init__(self, budget: int) -> None:
        self.budget = budget

    def _charge(self, count: int) -> None:
        self.budget -= count
        if self.budget < 0:
            raise _Malformed("it expands into far more values than its size holds")

    def _fields(self, found: Any, kind: str, names: tuple[str, ...]) -> dict[str, Any]:
        if not isinstance(found, _Stand) or found.kind != kind:
            raise _Malformed(f"a {kind} is expected, it holds {_named(found)}")
        state = found.state
        if isinstance(state, tuple) and len(state) == 2 and state[0] is None:
            state = state[1]  # (no __dict__, slots) as a dataclass with slots pickles
        if state is None:
            state = {}
        if not isinstance(state, dict) or found.args or not set(state) <= set(names):
            raise _Malformed(f"a {kind} holds fields other than {', '.join(names)}")
        self._charge(1 + len(state))
        return state

    def metadata(self, found: Any) -> Metadata:
        fields = self._fields(
            found,
            "Metadata",
            ("state_dict_metadata", "planner_data", "storage_data", "storage_meta", "version"),
        )
        entries = self._dict(fields.get("state_dict_metadata"), "its entries")
        stored = self._dict(fields.get("storage_data"), "its storage data")
        version = fields.get("version")
        return Metadata(
            state_dict_metadata={
                self._str(name, "an entry's name"): self._entry(entry)
                for name, entry in entries.items()
            },
            planner_data=self._plain(fields.get("planner_data")),
            storage_data={self._index(i): self._storage(s) for i, s in stored.items()},
            storage_meta=StorageMeta(),
            version=version if isinstance(version, str) else None,
        )

    def _dict(self, found: Any, what: str) -> dict[Any, Any]:
        if not isinstance(found, dict):
            raise _Malformed(f"{what} are not a dict")
        self._charge(len(found))
        return found

    def _str(self, found: Any, what: str) -> str:
        if not isinstance(found, str):
            raise _Malformed(f"{what} is {_named(found)}, not a string")
        return found

    def _ints(self, found: Any, what: str) -> torch.Size:
        value = found.value if isinstance(found, _Leaf) and found.kind == "size" else found
        if not isinstance(value, tuple | list) or not all(_natural(n) for n in value):
            raise _Malformed(f"{what} is {_named(found)}, not non-negative integers")
        self._charge(1 + len(value))
        return torch.Size(value)

    def _entry(self, found: Any) -> TensorStorageMetadata | BytesStorageMetadata:
        if isinstance(found, _Stand) and found.kind == "BytesStorageMetadata":
            self._fields(found, "BytesStorageMetadata", ())
            return BytesStorageMetadata()
        fields = self._fields(found, "TensorStorageMetadata", ("properties", "size", "chunks"))
        chunks = fields.get("chunks")
        if not isinstance(chunks, list) or len(chunks) > MAX_CHUNKS:
            raise _Malformed(f"a tensor has no list of at most {MAX_CHUNKS} chunks")
        self._charge(len(chunks))
        return TensorStorageMetadata(
            properties=self._properties(fields.get("properties")),
            size=self._ints(fields.get("size"), "a tensor's size"),
            chunks=[self._chunk(chunk) for chunk in chunks],
        )

    def _chunk(self, found: Any) -> ChunkStorageMetadata:
        fields = self._fields(found, "ChunkStorageMetadata", ("offsets", "sizes"))
        return ChunkStorageMetadata(
            offsets=self._ints(fields.get("offsets"), "a chunk's offsets"),
            sizes=self._ints(fields.get("sizes"), "a chunk's sizes"),
        )

    def _properties(self, found: Any) -> TensorProperties:
        if not isinstance(found, _Stand) or found.kind != "TensorProperties":
            raise _Malformed(f"a tensor's properties are {_named(found)}")
        state = found.state
        if not isinstance(state, tuple) or len(state) != 5:
            raise _Malformed("a tensor's properties are not DCP's five fields")
        dtype, layout, requires_grad, encoding, pin_memory = state
        self._charge(5)
        properties = TensorProperties.__new__(TensorProperties)
        properties.__setstate__(
            (
                self._dtype(dtype),
                self._layout(layout),
                bool(requires_grad),
                self._memory_format(encoding),
                bool(pin_memory),
            )
        )
        return properties

    def _dtype(self, found: Any) -> torch.dtype:
        value = getattr(found, "value", None) if isinstance(found, _Leaf) else None
        dtype = getattr(torch, value, None) if isinstance(value, str) else None
        if found.kind != "dtype" or not isinstance(dtype, torch.dtype):
            raise _Malformed(f"a dtype is {_named(found)}")
        return dtype

    def _layout(self, found: Any) -> torch.layout:
        layouts = {str(v): v for v in vars(torch).values() if isinstance(v, torch.layout)}
        if not isinstance(found, _Leaf) or found.kind != "layout" or found.value not in layouts:
            raise _Malformed(f"a layout is {_named(found)}")
        return layouts[found.value]

    def _memory_format(self, found: Any) -> _MEM_FORMAT_ENCODING:
        if not isinstance(found, _Stand) or found.kind != "_MEM_FORMAT_ENCODING":
            raise _Malformed(f"a memory format is {_named(found)}")
        if len(found.args) != 1 or found.args[0] not in {e.value for e in _MEM_FORMAT_ENCODING}:
            raise _Malformed("a memory format is not one of DCP's")
        return _MEM_FORMAT_ENCODING(found.args[0])

    def _index(self, found: Any) -> MetadataIndex:
        fields = self._fields(found, "MetadataIndex", ("fqn", "offset", "index"))
        offset = fields.get("offset")
        index = fields.get("index")
        return MetadataIndex(
            fqn=self._str(fields.get("fqn"), "an item's name"),
            offset=None if offset is None else self._ints(offset, "an item's offsets"),
            index=index if _natural(index) else None,
        )

    def _storage(self, found: Any) -> _StorageInfo:
        fields = self._fields(
            found, "_StorageInfo", ("relative_path", "offset", "length", "transform_descriptors")
        )
        offset, length = fields.get("offset"), fields.get("length")
        if not isinstance(offset, int) or not isinstance(length, int):
            raise _Malformed(f"an item has offset {offset!r} and length {length!r}")
        if not _natural(offset) or not _natural(length):
            raise _Malformed(f"an item has offset {offset!r} and length {length!r}")
        descriptors = self._plain(fields.get("transform_descriptors"))
        if descriptors is not None and not isinstance(descriptors, list | tuple):
            raise _Malformed("an item's transform descriptors are not a list")
        return _StorageInfo(
            relative_path=self._str(fields.get("relative_path"), "an item's object"),
            offset=offset,
            length=length,
            transform_descriptors=descriptors,
        )

    def _plain(self, found: Any) -> Any:
        """Plain data (planner data, descriptors): dicts, lists, tuples and scalars only."""
        if found is None or isinstance(found, bool | int | float | str):
            self._charge(1)
            return found
        if isinstance(found, tuple | list):
            self._charge(1 + len(found))
            return type(found)(self._plain(item) for item in found)
        if isinstance(found, dict):
            self._charge(1 + len(found))
            return {self._plain(key): self._plain(value) for key, value in found.items()}
        raise _Malformed(f"its plain data holds {_named(found)}")


def _named(found: Any) -> str:
    kind = getattr(found, "kind", "")
    return f"a {kind}" if kind else f"a {type(found).__name__}"


def _check_metadata(metadata: Metadata) -> None:
    """_Malformed unless `metadata` describes what DCP's writers write: a stored item for every
    chunk and value, chunks inside their tensors, disjoint, covering each exactly, each item
    long enough for its chunk's data, items of one object disjoint, keys plain."""
    spans: dict[str, list[tuple[int, int]]] = {}
    for index, stored in metadata.storage_data.items():
        try:
            check_key(stored.relative_path)
        except InvalidKeyError as error:
            raise _Malformed(f"{index.fqn!r}: {error}") from None
        if stored.transform_descriptors:
            raise _Malformed(
                f"{index.fqn!r} was written through DCP stream extensions "
                f"{list(stored.transform_descriptors)!r}, which spotckpt does not run; load it "
                "with DCP's own reader and save it again without _extensions"
            )
        spans.setdefault(stored.relative_path, []).append((stored.offset, stored.length))
    for path, ranges in spans.items():
        ranges.sort()
        for (start, length), (after, _) in itertools.pairwise(ranges):
            if start + length > after:
                raise _Malformed(f"items of {path!r} overlap at byte {after}")
    for fqn, entry in metadata.state_dict_metadata.items():
        if isinstance(entry, BytesStorageMetadata):
            if MetadataIndex(fqn) not in metadata.storage_data:
                raise _Malformed(f"value {fqn!r} has no stored item")
            continue
        _check_tensor(fqn, entry, metadata.storage_data)


def _check_tensor(fqn: str, entry: TensorStorageMetadata, stored: dict[Any, Any]) -> None:
    """DCP's own rules for a tensor's chunks (inside the tensor, disjoint, filling it:
    `spotckpt.engine.plan_check`, in O(n log n)), and a stored item long enough for each."""
    size = tuple(entry.size)
    if any(len(c.offsets) != len(size) or len(c.sizes) != len(size) for c in entry.chunks):
        raise _Malformed(f"tensor {fqn!r} has a chunk of another rank than its {size!r}")
    if size:
        offsets, sizes = chunk_arrays(entry.chunks, len(size))
        errors = tensor_errors(fqn, entry.size, offsets, sizes, True)
        if errors:
            raise _Malformed(errors[0])
    elif len(entry.chunks) != 1:
        raise _Malformed(f"scalar {fqn!r} has {len(entry.chunks)} chunks")
    itemsize = entry.properties.dtype.itemsize
    for chunk in entry.chunks:
        item = stored.get(MetadataIndex(fqn, chunk.offsets))
        if item is None:
            raise _Malformed(
                f"tensor {fqn!r}: chunk at {tuple(chunk.offsets)!r} has no stored item"
            )
        data = math.prod(chunk.sizes) * itemsize
        if item.length < data:  # the stored bytes bound what a read allocates
            raise _Malformed(
                f"tensor {fqn!r}: chunk at {tuple(chunk.offsets)!r} holds {data} bytes of data "
                f"in an item of {item.length}"
            )
