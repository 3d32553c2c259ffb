"""The tensor dtypes a checkpoint may hold, by manifest name and safetensors code.

Names from a bucket are looked up in this table, never with ``getattr(torch, name)``. The table
itself needs no torch: `DType.torch_dtype` imports it on first use, so reading manifests (the
``ls``, ``inspect``, ``verify`` and ``gc`` commands) never loads torch.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING

from spotckpt.errors import InvalidArgumentError

if TYPE_CHECKING:
    import torch

MAX_DIMS = 64
"""The most dimensions a stored tensor may have (manifests and safetensors headers alike)."""


@dataclass(frozen=True)
class DType:
    """One supported dtype: its manifest name, safetensors code and size; torch's on demand."""

    name: str
    code: str
    itemsize: int
    is_floating_point: bool

    @property
    def torch_dtype(self) -> torch.dtype:
        """The torch dtype (imports torch)."""
        return _torch_dtypes()[self.name]


_ALL = [
    DType("float64", "F64", 8, True),
    DType("float32", "F32", 4, True),
    DType("float16", "F16", 2, True),
    DType("bfloat16", "BF16", 2, True),
    DType("int64", "I64", 8, False),
    DType("int32", "I32", 4, False),
    DType("int16", "I16", 2, False),
    DType("int8", "I8", 1, False),
    DType("uint8", "U8", 1, False),
    DType("uint16", "U16", 2, False),
    DType("uint32", "U32", 4, False),
    DType("uint64", "U64", 8, False),
    DType("bool", "BOOL", 1, False),
    DType("float8_e4m3fn", "F8_E4M3", 1, True),
    DType("float8_e5m2", "F8_E5M2", 1, True),
    DType("float8_e4m3fnuz", "F8_E4M3FNUZ", 1, True),
    DType("float8_e5m2fnuz", "F8_E5M2FNUZ", 1, True),
    DType("complex64", "C64", 8, False),
]
BY_NAME = {d.name: d for d in _ALL}
BY_CODE = {d.code: d for d in _ALL}


@functools.cache
def _torch_dtypes() -> dict[str, torch.dtype]:
    import torch

    return {
        "float64": torch.float64,
        "float32": torch.float32,
        "float16": torch.float16,
        "bfloat16": torch.bfloat16,
        "int64": torch.int64,
        "int32": torch.int32,
        "int16": torch.int16,
        "int8": torch.int8,
        "uint8": torch.uint8,
        "uint16": torch.uint16,
        "uint32": torch.uint32,
        "uint64": torch.uint64,
        "bool": torch.bool,
        "float8_e4m3fn": torch.float8_e4m3fn,
        "float8_e5m2": torch.float8_e5m2,
        "float8_e4m3fnuz": torch.float8_e4m3fnuz,
        "float8_e5m2fnuz": torch.float8_e5m2fnuz,
        "complex64": torch.complex64,
    }


@functools.cache
def _by_torch() -> dict[torch.dtype, DType]:
    return {_torch_dtypes()[d.name]: d for d in _ALL}


def dtype_of(tensor_dtype: torch.dtype) -> DType:
    """The table entry for a torch dtype; InvalidArgumentError (a ValueError) for the ones that
    safetensors cannot hold (complex128, quantized, sub-byte types)."""
    found = _by_torch().get(tensor_dtype)
    if found is None:
        raise InvalidArgumentError(
            f"dtype {tensor_dtype} cannot be stored in a safetensors checkpoint"
        )
    return found
