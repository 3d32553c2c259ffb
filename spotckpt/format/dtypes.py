"""The tensor dtypes a checkpoint may hold, by manifest name and safetensors code.

Names from a bucket are looked up in this table, never with ``getattr(torch, name)``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class DType:
    """One supported dtype: its manifest name, safetensors code and torch dtype."""

    name: str
    code: str
    torch_dtype: torch.dtype

    @property
    def itemsize(self) -> int:
        """Bytes per element."""
        return self.torch_dtype.itemsize


_ALL = [
    DType("float64", "F64", torch.float64),
    DType("float32", "F32", torch.float32),
    DType("float16", "F16", torch.float16),
    DType("bfloat16", "BF16", torch.bfloat16),
    DType("int64", "I64", torch.int64),
    DType("int32", "I32", torch.int32),
    DType("int16", "I16", torch.int16),
    DType("int8", "I8", torch.int8),
    DType("uint8", "U8", torch.uint8),
    DType("uint16", "U16", torch.uint16),
    DType("uint32", "U32", torch.uint32),
    DType("uint64", "U64", torch.uint64),
    DType("bool", "BOOL", torch.bool),
    DType("float8_e4m3fn", "F8_E4M3", torch.float8_e4m3fn),
    DType("float8_e5m2", "F8_E5M2", torch.float8_e5m2),
]
BY_NAME = {d.name: d for d in _ALL}
BY_CODE = {d.code: d for d in _ALL}
BY_TORCH = {d.torch_dtype: d for d in _ALL}


def dtype_of(tensor_dtype: torch.dtype) -> DType:
    """The table entry for a torch dtype; ValueError for unsupported ones (complex, quantized)."""
    found = BY_TORCH.get(tensor_dtype)
    if found is None:
        raise ValueError(f"dtype {tensor_dtype} cannot be stored in a safetensors checkpoint")
    return found
