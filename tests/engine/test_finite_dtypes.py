"""The finite health gate (`spotckpt.engine.guards.holds_non_finite`) on every dtype torch has:
each is either checked (a planted NaN or infinity is found, wherever it lies) or cannot hold
either and is skipped (docs/integrity.md lists them); none makes a save fail otherwise."""

from __future__ import annotations

import itertools
import json
import warnings
from pathlib import Path

import pytest
import torch

from spotckpt import CheckpointManager
from spotckpt.engine import guards
from spotckpt.engine.guards import Guard, holds_non_finite
from spotckpt.errors import HealthCheckError

from integrity_worker import launch

QUANTIZED = {torch.qint8, torch.quint8, torch.qint32, torch.quint4x2, torch.quint2x4}
FLOAT8 = [
    torch.float8_e4m3fn,
    torch.float8_e5m2,
    torch.float8_e4m3fnuz,
    torch.float8_e5m2fnuz,
    torch.float8_e8m0fnu,
]
CHECKED = {
    torch.float16,
    torch.bfloat16,
    torch.float32,
    torch.float64,
    torch.complex32,
    torch.complex64,
    torch.complex128,
    *FLOAT8,
}
"""The dtypes that can hold a NaN or an infinity; every other one is skipped."""


def every_dtype() -> list[torch.dtype]:
    found = {value for value in vars(torch).values() if isinstance(value, torch.dtype)}
    return sorted(found, key=str)


def finite_sample(dtype: torch.dtype) -> torch.Tensor:
    """A tensor of `dtype` holding ordinary (finite) values."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # complex32, quantized: "experimental", "deprecated"
        if dtype in QUANTIZED:
            return torch.quantize_per_tensor(torch.arange(8.0), 0.5, 0, dtype)
        if dtype in CHECKED:
            return (2.0 ** torch.arange(-8.0, 8.0)).reshape(4, 4).to(dtype)  # e8m0: >0 only
        return torch.arange(16, dtype=torch.uint8).view(dtype)


@pytest.mark.parametrize("dtype", every_dtype(), ids=str)
def test_every_dtype_is_checked_or_cannot_hold_a_nan(dtype: torch.dtype) -> None:
    sample = finite_sample(dtype)
    Guard(1, health_check="finite").check_health({"t": sample})  # never raises for finite
    if dtype not in CHECKED:
        assert dtype.is_floating_point is False or dtype in guards.FINITE_FLOATS
        assert not dtype.is_complex
        return
    for bad in (float("nan"), float("inf"), float("-inf")):
        tensor = sample.clone()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            tensor[2, 1] = complex(1.0, bad) if dtype.is_complex else bad
        if not holds_non_finite(tensor):  # only where conversion saturated an infinity
            assert dtype in FLOAT8 and bool(torch.isfinite(tensor.float()).all()), bad
            continue
        with pytest.raises(HealthCheckError, match="'t' holds NaN or infinite"):
            Guard(1, health_check="finite").check_health({"t": tensor})


def test_extreme_finite_float8_values_pass() -> None:
    for dtype in FLOAT8:
        largest = torch.full((5,), torch.finfo(dtype).max).to(dtype)
        assert not holds_non_finite(largest), dtype


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e8m0fnu])
def test_a_nan_is_found_anywhere_in_a_strided_tensor_converted_in_pieces(
    monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype
) -> None:
    monkeypatch.setattr(guards, "UPCAST_PIECE", 7)  # rows of 5 and 9, planes of 45: all cut
    base = torch.ones(3, 9, 5).to(dtype)
    assert not holds_non_finite(base.transpose(0, 2))
    for index in itertools.product(range(5), range(9), range(3)):
        tensor = torch.ones(3, 9, 5).to(dtype).transpose(0, 2)
        tensor[index] = float("nan")
        assert holds_non_finite(tensor), index


def test_float8_and_complex_states_save_and_a_nan_in_them_is_refused(tmp_path: Path) -> None:
    state = {
        **{str(dtype).removeprefix("torch."): torch.ones(64).to(dtype) for dtype in FLOAT8[:4]},
        "phases": torch.ones(64, dtype=torch.complex64),
    }
    with CheckpointManager(str(tmp_path), preemption=False, health_check="finite") as manager:
        manager.save(1, state)
        for name in ("float8_e4m3fn", "float8_e5m2fnuz", "phases"):
            poisoned = {key: value.clone() for key, value in state.items()}
            poisoned[name][3] = complex(0, float("nan")) if name == "phases" else float("nan")
            with pytest.raises(HealthCheckError, match=f"'{name}' holds NaN"):
                manager.save(2, poisoned)
        assert manager.steps() == [1]


@pytest.mark.process
def test_an_emergency_save_of_a_float8_state_refused_by_the_gate_exits_75(tmp_path: Path) -> None:
    args = {"uri": str(tmp_path / "ck"), "out": str(tmp_path), "float8": True}
    (result,) = launch(1, "emergency_refused", args)
    assert result.returncode == 75, result.stdout[-4000:]
    outcome = json.loads((tmp_path / "emergency-0.json").read_text())
    assert outcome["steps"] == [2]  # the periodic save of step 2 stays the newest
    [preemption] = [e for e in outcome["events"] if e["kind"] == "preemption"]
    assert "'model.scales' holds NaN" in preemption["emergency_save_refused"]
