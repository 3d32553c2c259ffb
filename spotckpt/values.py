"""Non-tensor values in a checkpoint: each one restores as it was saved, or the save fails.

DCP stores every non-tensor leaf of the state dict with ``torch.save``, and spotckpt reads them
back only with ``torch.load(weights_only=True)``, which refuses arbitrary classes. So before a
save, `encode` walks the state (the ``extra=`` dict of a TrainState, what every Stateful part
returns, the plain values of a user dict) and turns each value into one that loads safely;
`decode` turns it back on restore, so the caller gets the same types.

Passed through unchanged: ``None``, bools, ints, floats, complex numbers, strings, bytes and
bytearrays; lists, tuples and dicts (with str, int, float, bool or None keys) of values; tensors
(including DTensor and ShardedTensor, which DCP handles); and any other object that
``torch.load(weights_only=True)`` restores (``torch.dtype``, ``torch.Size``, sets, objects the
user registered with ``torch.serialization.add_safe_globals``, ...).

Encoded, and decoded on restore to the same type:

- numpy arrays and scalars of bool, integer, float and complex dtypes (any byte order and shape):
  a CPU tensor plus the dtype, so they come back as numpy with the same dtype and shape;
- ``datetime.datetime``, ``date``, ``time`` as ISO 8601 text, ``timedelta`` as its three fields
  (an aware datetime comes back with a fixed-offset tzinfo of the same UTC offset);
- ``io.BytesIO``: its bytes and stream position;
- Enum members of an allow-listed class, by value. The allow-list (`ALLOWED_ENUMS`) starts empty;
  extend it with ``spotckpt.values.allow_enum(MyEnum)`` (also usable as a class decorator) in
  every process that saves or restores the checkpoint.

Anything else (dataclasses, custom classes, Enums that are not allow-listed, numpy arrays of
objects, strings or datetimes, subclasses of the types above such as NamedTuples) is refused at
save time with `UnsupportedValueError`, naming the key path and the type; nothing is committed.

An encoded value is one tuple ``(TAG, kind, ...)``, which DCP stores as a single value; a tuple of
the caller's own that starts with `TAG` is refused. A stored value that does not load or decode
raises `ValueLoadError`, which is not a `CorruptCheckpointError`: its bytes passed their
checksums, so an older checkpoint would not help.
"""

from __future__ import annotations

import collections
import datetime
import enum
import io
import re
from collections.abc import Callable
from typing import Any, TypeVar

import numpy as np
import torch
from torch.distributed._shard.sharded_tensor import ShardedTensor

from spotckpt.errors import (
    InvalidArgumentError,
    InvalidTypeError,
    UnsupportedValueError,
    ValueLoadError,
)

TAG = "__spotckpt_value__"
PLAIN_TYPES: frozenset[type] = frozenset(
    {type(None), bool, int, float, complex, str, bytes, bytearray}
)
KEY_TYPES: frozenset[type] = frozenset({str, int, float, bool, type(None)})
_NUMPY_KINDS = "biufc"
_UNSUPPORTED_GLOBAL = re.compile(r"Unsupported global: GLOBAL (\S+)")
ALLOWED_ENUMS: dict[str, type[enum.Enum]] = {}
"""Enum classes stored by value, by ``module.qualname``; extend with `allow_enum`."""

EnumT = TypeVar("EnumT", bound=type[enum.Enum])


def allow_enum(cls: EnumT) -> EnumT:
    """Allow-list an Enum class so its members are stored by value; returns `cls`."""
    if not (isinstance(cls, type) and issubclass(cls, enum.Enum)):
        raise InvalidTypeError(f"allow_enum takes an Enum class, got {cls!r}")
    ALLOWED_ENUMS[_type_name(cls)] = cls
    return cls


def _type_name(cls: type) -> str:
    if cls.__module__ == "builtins":
        return cls.__qualname__
    return f"{cls.__module__}.{cls.__qualname__}"


def _child(path: str, key: Any) -> str:
    return f"{path}.{key}" if isinstance(key, str) else f"{path}[{key!r}]"


def _refuse(value: Any, path: str, why: str) -> UnsupportedValueError:
    return UnsupportedValueError(
        f"{path} is a {_type_name(type(value))}, {why}; the save is refused. Store None, bool, "
        "int, float, str, bytes, lists/tuples/dicts of them, tensors, numpy arrays or scalars, "
        "datetimes, io.BytesIO or allow-listed Enums (spotckpt.values.allow_enum)"
    )


# Encoding ---------------------------------------------------------------------------------


def encode(value: Any, path: str) -> Any:
    """`value` with every non-tensor leaf made loadable by weights_only; `path` names it in errors.

    Raises UnsupportedValueError for a value with no safe encoding. Tensors are never copied.
    """
    kind = type(value)
    if kind in PLAIN_TYPES or isinstance(value, (torch.Tensor, ShardedTensor)):
        return value
    if kind is dict or kind is collections.OrderedDict:
        return kind(
            (_check_key(key, path), encode(item, _child(path, key))) for key, item in value.items()
        )
    if kind is list:
        return [encode(item, f"{path}[{index}]") for index, item in enumerate(value)]
    if kind is tuple:
        if value and isinstance(value[0], str) and value[0] == TAG:
            raise _refuse(value, path, f"whose first item is the reserved marker {TAG!r}")
        return tuple(encode(item, f"{path}[{index}]") for index, item in enumerate(value))
    encoder = _ENCODERS.get(kind)
    if encoder is not None:
        return encoder(value, path)
    if isinstance(value, np.generic):
        return _encode_numpy(np.asarray(value), "npscalar", value, path)
    if isinstance(value, enum.Enum):
        return _encode_enum(value, path)
    return _probe(value, path)


def _check_key(key: Any, path: str) -> Any:
    if type(key) not in KEY_TYPES:
        raise UnsupportedValueError(
            f"{path} has a key {key!r} of type {_type_name(type(key))}; keys must be str, int, "
            "float, bool or None; the save is refused"
        )
    return key


def _encode_numpy(array: np.ndarray, kind: str, value: Any, path: str) -> tuple[Any, ...]:
    dtype = array.dtype
    if dtype.kind not in _NUMPY_KINDS or dtype.fields is not None:
        raise _refuse(value, path, f"of numpy dtype {dtype}, which has no tensor form")
    native = array.astype(dtype.newbyteorder("="), order="C", copy=True)
    try:
        tensor = torch.from_numpy(native)
    except TypeError:
        raise _refuse(value, path, f"of numpy dtype {dtype}, which torch cannot hold") from None
    return (TAG, kind, dtype.str, tensor)


def _encode_array(value: np.ndarray, path: str) -> tuple[Any, ...]:
    return _encode_numpy(value, "ndarray", value, path)


def _encode_enum(value: enum.Enum, path: str) -> tuple[Any, ...]:
    name = _type_name(type(value))
    if ALLOWED_ENUMS.get(name) is not type(value):
        raise _refuse(
            value,
            path,
            f"an Enum that is not allow-listed (call spotckpt.values.allow_enum({name}))",
        )
    return (TAG, "enum", name, encode(value.value, f"{path}.value"))


def _encode_bytesio(value: io.BytesIO, path: str) -> tuple[Any, ...]:
    if value.closed:
        raise _refuse(value, path, "which is closed")
    return (TAG, "bytesio", value.getvalue(), value.tell())


def _encode_timedelta(value: datetime.timedelta, path: str) -> tuple[Any, ...]:
    return (TAG, "timedelta", value.days, value.seconds, value.microseconds)


def _iso(kind: str) -> Callable[[Any, str], tuple[Any, ...]]:
    return lambda value, path: (TAG, kind, value.isoformat())


_ENCODERS: dict[type, Callable[[Any, str], Any]] = {
    np.ndarray: _encode_array,
    datetime.datetime: _iso("datetime"),
    datetime.date: _iso("date"),
    datetime.time: _iso("time"),
    datetime.timedelta: _encode_timedelta,
    io.BytesIO: _encode_bytesio,
}


def _probe(value: Any, path: str) -> Any:
    """Pass `value` through if torch.load(weights_only=True) restores it; refuse it otherwise."""
    buffer = io.BytesIO()
    try:
        torch.save(value, buffer)
    except Exception as error:
        raise _refuse(value, path, f"which cannot be pickled ({type(error).__name__})") from None
    try:
        load_plain(buffer.getbuffer(), path)
    except ValueLoadError:
        raise _refuse(value, path, "which torch.load(weights_only=True) cannot restore") from None
    return value


# Loading and decoding -----------------------------------------------------------------------


def load_plain(data: bytes | bytearray | memoryview, path: str) -> Any:
    """Unpickle stored value bytes with ``torch.load(weights_only=True)``; ValueLoadError if not."""
    try:
        return torch.load(io.BytesIO(data), weights_only=True)
    except Exception as error:
        raise ValueLoadError(
            f"value {path!r} does not load with torch.load(weights_only=True) "
            f"({type(error).__name__}: {_reason(error)}); its bytes are intact (they match their "
            "checksums): it was written by another tool or version, or forged"
        ) from None


def _reason(error: Exception) -> str:
    text = str(error)
    found = _UNSUPPORTED_GLOBAL.search(text)
    if found:
        return f"unsupported global {found.group(1)}"
    lines = text.strip().splitlines()
    return lines[0][:200] if lines else "no message"


def decode(value: Any, path: str) -> Any:
    """The inverse of `encode`; raises ValueLoadError naming `path` for a malformed encoding."""
    kind = type(value)
    if kind is dict or kind is collections.OrderedDict:
        return kind((key, decode(item, _child(path, key))) for key, item in value.items())
    if kind is list:
        return [decode(item, f"{path}[{index}]") for index, item in enumerate(value)]
    if kind is tuple:
        if len(value) >= 2 and isinstance(value[0], str) and value[0] == TAG:
            return _decode_tagged(value, path)
        return tuple(decode(item, f"{path}[{index}]") for index, item in enumerate(value))
    return value


def _decode_tagged(value: tuple[Any, ...], path: str) -> Any:
    decoder = _DECODERS.get(value[1]) if isinstance(value[1], str) else None
    if decoder is None:
        raise ValueLoadError(
            f"value {path!r} has an encoding this version does not know: {value[1]!r}"
        )
    try:
        return decoder(value[2:], path)
    except ValueLoadError:
        raise
    except (TypeError, ValueError, IndexError, OverflowError) as error:
        raise ValueLoadError(
            f"value {path!r} is a malformed {value[1]} encoding: {type(error).__name__}: {error}"
        ) from None


def _decode_numpy(fields: tuple[Any, ...], path: str) -> np.ndarray:
    dtype_text, tensor = fields
    dtype = np.dtype(dtype_text)
    if not isinstance(tensor, torch.Tensor):
        raise InvalidTypeError(f"expected a tensor, found {type(tensor).__name__}")
    array = tensor.numpy()
    if array.dtype != dtype.newbyteorder("="):
        raise InvalidTypeError(f"the tensor holds {array.dtype}, the stored dtype is {dtype}")
    return array if array.dtype == dtype else array.astype(dtype)


def _decode_npscalar(fields: tuple[Any, ...], path: str) -> Any:
    array = _decode_numpy(fields, path)
    if array.ndim != 0:
        raise InvalidArgumentError(f"a numpy scalar needs a 0-d tensor, found shape {array.shape}")
    return array[()]


def _decode_enum(fields: tuple[Any, ...], path: str) -> enum.Enum:
    name, stored = fields
    cls = ALLOWED_ENUMS.get(name)
    if cls is None:
        raise ValueLoadError(
            f"value {path!r} is a member of the Enum {name}, which is not allow-listed in this "
            f"process: call spotckpt.values.allow_enum({name}) before restoring"
        )
    return cls(decode(stored, f"{path}.value"))


def _decode_bytesio(fields: tuple[Any, ...], path: str) -> io.BytesIO:
    data, position = fields
    stream = io.BytesIO(bytes(data))
    stream.seek(int(position))
    return stream


def _decode_iso(cls: type[datetime.date] | type[datetime.time]) -> Callable[..., Any]:
    def decode_text(fields: tuple[Any, ...], path: str) -> Any:
        (text,) = fields
        if not isinstance(text, str):
            raise InvalidTypeError(f"expected ISO text, found {type(text).__name__}")
        return cls.fromisoformat(text)

    return decode_text


def _decode_timedelta(fields: tuple[Any, ...], path: str) -> datetime.timedelta:
    days, seconds, microseconds = (int(field) for field in fields)
    return datetime.timedelta(days=days, seconds=seconds, microseconds=microseconds)


_DECODERS: dict[str, Callable[[tuple[Any, ...], str], Any]] = {
    "ndarray": _decode_numpy,
    "npscalar": _decode_npscalar,
    "enum": _decode_enum,
    "bytesio": _decode_bytesio,
    "datetime": _decode_iso(datetime.datetime),
    "date": _decode_iso(datetime.date),
    "time": _decode_iso(datetime.time),
    "timedelta": _decode_timedelta,
}
