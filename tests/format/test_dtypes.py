"""Every dtype safetensors can hold round-trips; the others are refused at save time."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from spotckpt import CheckpointManager, SaveFailedError
from spotckpt.export import export_hf
from spotckpt.format.dtypes import BY_NAME
from spotckpt.layout import manifest_key
from spotckpt.storage import open_store


def _tensor(dtype: torch.dtype) -> torch.Tensor:
    raw = torch.arange(64, dtype=torch.float32).reshape(8, 8) / 7 - 3
    if dtype.is_complex:
        return torch.complex(raw, -raw).to(dtype)
    return raw.to(dtype)


@pytest.mark.parametrize("name", sorted(BY_NAME))
def test_every_supported_dtype_round_trips(tmp_path: Path, name: str) -> None:
    dtype = BY_NAME[name].torch_dtype
    saved = {"x": _tensor(dtype)}
    with CheckpointManager(str(tmp_path), preemption=False) as mgr:
        mgr.save(1, saved)
        restored = {"x": torch.zeros(8, 8, dtype=dtype)}
        assert mgr.restore(restored) == 1
        assert mgr.verify(1).ok
    assert restored["x"].dtype == dtype
    assert torch.equal(restored["x"].view(torch.uint8), saved["x"].view(torch.uint8))


@pytest.mark.parametrize("name", ["float8_e4m3fnuz", "float8_e5m2fnuz", "float32"])
def test_exported_dtypes_load_with_safetensors(tmp_path: Path, name: str) -> None:
    dtype = BY_NAME[name].torch_dtype
    saved = {"model.w": _tensor(dtype)}
    with CheckpointManager(str(tmp_path / "ck"), preemption=False) as mgr:
        mgr.save(1, saved)
    export_hf(open_store(str(tmp_path / "ck")), 1, str(tmp_path / "out"), prefix="model.")
    loaded = load_file(tmp_path / "out" / "model.safetensors")
    assert loaded["w"].dtype == dtype
    assert torch.equal(loaded["w"].view(torch.uint8), saved["model.w"].view(torch.uint8))


def test_unrepresentable_dtype_is_refused_at_save(tmp_path: Path) -> None:
    with CheckpointManager(str(tmp_path), preemption=False) as mgr:
        with pytest.raises(SaveFailedError, match="complex128 cannot be stored"):
            mgr.save(1, {"x": torch.zeros(4, dtype=torch.complex128)})
        assert not open_store(str(tmp_path)).exists(manifest_key(1))
