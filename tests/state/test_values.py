"""Non-tensor values round-trip through a real save and restore, or the save fails up front."""

from __future__ import annotations

import dataclasses
import datetime
import enum
import io
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch import nn

from spotckpt import CheckpointError, CheckpointManager, CorruptCheckpointError, TrainState
from spotckpt.engine.writer import ObjectStoreWriter
from spotckpt.layout import manifest_key
from spotckpt.storage import open_store
from spotckpt.values import ALLOWED_ENUMS, UnsupportedValueError, ValueLoadError, allow_enum
from spotckpt.verify import verify_checkpoint

from tests_support import Exploit, forge_value


@allow_enum
class Color(enum.Enum):
    RED = "red"
    GREEN = "green"


@allow_enum
class Level(enum.IntEnum):
    LOW = 1
    HIGH = 2


class Secret(enum.Enum):
    """Not allow-listed."""

    A = 1


@dataclasses.dataclass
class Config:
    lr: float = 0.1


class Custom:
    def __init__(self) -> None:
        self.x = 1


AWARE = datetime.datetime(
    2024, 5, 6, 7, 8, 9, 123456, tzinfo=datetime.timezone(datetime.timedelta(hours=2))
)
SUPPORTED: dict[str, Any] = {
    "np-float32": np.float32(1.25),
    "np-float64": np.float64(-3.5),
    "np-int64": np.int64(-(2**62)),
    "np-uint64": np.uint64(2**64 - 1),
    "np-bool": np.bool_(True),
    "np-complex": np.complex64(1 - 2j),
    "array-2d": np.arange(6, dtype=np.float64).reshape(2, 3),
    "array-big-endian": np.array([1, 2, 70000], dtype=">i4"),
    "array-0d": np.array(7, dtype=np.int16),
    "array-f16": np.linspace(0, 1, 5, dtype=np.float16),
    "array-bool": np.array([[True, False]]),
    "array-strided": np.arange(20, dtype=np.uint8)[::3],
    "datetime-naive": datetime.datetime(2024, 1, 2, 3, 4, 5, 6),
    "datetime-aware": AWARE,
    "date": datetime.date(1999, 12, 31),
    "time": datetime.time(23, 59, 58, 1),
    "timedelta": datetime.timedelta(days=-2, seconds=5, microseconds=7),
    "bytesio": io.BytesIO(b"\x00binary\xff"),
    "enum": Color.GREEN,
    "int-enum": Level.HIGH,
    "plain": [1, 2.5, True, None, "s", b"\x01", (3, "t"), {"k": [None]}],
    "nested": {"a": [np.float32(2.0), {"b": datetime.date(2000, 1, 1)}], "c": (Color.RED,)},
}


def _same(expected: Any, actual: Any) -> bool:
    """Equal and of exactly the same type, all the way down (numpy: dtype and shape too)."""
    if type(expected) is not type(actual):
        return False
    if isinstance(expected, (np.ndarray, np.generic)):
        return expected.dtype == actual.dtype and np.array_equal(expected, actual)
    if isinstance(expected, io.BytesIO):
        return expected.getvalue() == actual.getvalue() and expected.tell() == actual.tell()
    if isinstance(expected, dict):
        return expected.keys() == actual.keys() and all(
            _same(v, actual[k]) for k, v in expected.items()
        )
    if isinstance(expected, (list, tuple)):
        return len(expected) == len(actual) and all(map(_same, expected, actual))
    return bool(expected == actual)


def _hollow(value: Any) -> Any:
    """A restore target of the same nesting (DCP flattens dicts, and lists holding them)."""
    if isinstance(value, dict):
        return {key: _hollow(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_hollow(item) for item in value]
    return None


@pytest.fixture
def root(tmp_path: Path) -> Path:
    return tmp_path / "ck"


@pytest.fixture
def manager(root: Path) -> CheckpointManager:
    return CheckpointManager(str(root), preemption=False)


@pytest.mark.parametrize("name", sorted(SUPPORTED))
def test_value_round_trips_in_extras(manager: CheckpointManager, name: str) -> None:
    value = SUPPORTED[name]
    if isinstance(value, io.BytesIO):
        value.seek(3)
    manager.save(1, TrainState(extra={"v": value}, rng=False))
    extra: dict[str, Any] = {"v": _hollow(value)}
    assert manager.restore(TrainState(extra=extra, rng=False)) == 1
    assert _same(value, extra["v"]), (value, extra["v"])


@pytest.mark.parametrize(
    "name", ["np-uint64", "array-big-endian", "datetime-aware", "enum", "nested"]
)
def test_value_round_trips_in_a_plain_dict(manager: CheckpointManager, name: str) -> None:
    value = SUPPORTED[name]
    manager.save(2, {"w": torch.arange(4.0), "v": value, "deep": {"v": value}})
    weights = torch.zeros(4)
    deep: dict[str, Any] = {"v": _hollow(value)}
    state: dict[str, Any] = {"w": weights, "v": _hollow(value), "deep": deep}
    manager.restore(state)
    assert torch.equal(weights, torch.arange(4.0))
    assert _same(value, state["v"]) and _same(value, deep["v"])
    assert state["deep"] is deep  # nested dicts of the caller are filled in place


class Counter:
    """A user Stateful whose state holds numpy values."""

    def __init__(self) -> None:
        self.history = np.zeros(0)
        self.best = np.float64(0.0)

    def state_dict(self) -> dict[str, Any]:
        return {"history": self.history, "best": self.best}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.history, self.best = state["history"], state["best"]


def test_values_of_a_users_stateful_round_trip(manager: CheckpointManager) -> None:
    counter = Counter()
    counter.history, counter.best = np.array([0.5, 0.25], dtype=np.float32), np.float64(0.25)
    manager.save(1, {"counter": counter})
    restored = Counter()
    manager.restore({"counter": restored})
    assert _same(counter.history, restored.history) and _same(counter.best, restored.best)


def _assert_nothing_committed(manager: CheckpointManager, root: Path) -> None:
    assert manager.steps() == []
    assert list(root.rglob("manifest.json")) == []


@pytest.mark.parametrize(
    ("value", "path", "type_name"),
    [
        (Config(), "train.rank_00000.extra.v", "test_values.Config"),
        (Custom(), "train.rank_00000.extra.v", "test_values.Custom"),
        (Secret.A, "train.rank_00000.extra.v", "test_values.Secret"),
        ({"a": [1, {"b": Config()}]}, r"train.rank_00000.extra.v.a\[1\].b", "test_values.Config"),
        (np.array(["text"]), "train.rank_00000.extra.v", "numpy.ndarray"),
        (np.datetime64("2024-01-01"), "train.rank_00000.extra.v", "numpy.datetime64"),
        (("__spotckpt_value__", "enum"), "train.rank_00000.extra.v", "tuple"),
        ({Secret.A: 1}, "train.rank_00000.extra.v", "test_values.Secret"),
    ],
    ids=["dataclass", "custom", "enum", "nested", "str-array", "datetime64", "marker", "key"],
)
def test_unsupported_value_is_refused_at_save(
    manager: CheckpointManager, root: Path, value: Any, path: str, type_name: str
) -> None:
    with pytest.raises(
        UnsupportedValueError, match=rf"{path} (is a|has a key .* of type) {type_name}"
    ) as caught:
        manager.save(1, TrainState(model=nn.Linear(2, 2), extra={"v": value}, rng=False))
    assert isinstance(caught.value, CheckpointError)
    _assert_nothing_committed(manager, root)


def test_unsupported_value_in_a_plain_dict_or_stateful_is_refused(
    manager: CheckpointManager, root: Path
) -> None:
    with pytest.raises(UnsupportedValueError, match=r"meta\.cfg is a test_values\.Config"):
        manager.save(1, {"w": torch.ones(2), "meta": {"cfg": Config()}})
    counter = Counter()
    counter.best = Custom()  # type: ignore[assignment]
    with pytest.raises(UnsupportedValueError, match=r"counter\.best is a test_values\.Custom"):
        manager.save(1, {"counter": counter})
    _assert_nothing_committed(manager, root)


def test_writer_refuses_value_bytes_that_would_not_load(root: Path) -> None:
    """The last line, below TrainState: DCP stores a BytesIO raw, which weights_only cannot read."""
    store = open_store(str(root))
    with pytest.raises(BaseException, match=r"'buf' would not restore"):
        dcp.save(
            {"buf": io.BytesIO(b"raw bytes")},
            storage_writer=ObjectStoreWriter(store, 1),
            no_dist=True,
        )
    assert not store.exists(manifest_key(1))


def test_forged_value_is_a_clear_error_not_corruption(
    manager: CheckpointManager, root: Path, tmp_path: Path
) -> None:
    manager.save(1, TrainState(extra={"epoch": 1}, rng=False))
    manager.save(2, TrainState(extra={"epoch": 2}, rng=False))
    marker = tmp_path / "pwned"
    payload = io.BytesIO()
    torch.save(Exploit(marker), payload)
    forge_value(root, 2, "train.rank_00000.extra.epoch", payload.getvalue())

    extra = {"epoch": 0}
    state = TrainState(extra=extra, rng=False)
    with pytest.raises(
        CheckpointError, match=r"train\.rank_00000\.extra\.epoch.*weights_only"
    ) as caught:
        manager.restore(state)  # fallback allowed, yet step 1 must not silently replace step 2
    assert not isinstance(caught.value, CorruptCheckpointError)
    assert "corrupt" not in str(caught.value).lower()
    assert extra == {"epoch": 0} and state.step == -1
    assert not marker.exists()

    report = verify_checkpoint(manager.store, 2)
    assert [p.kind for p in report.problems] == ["value"]
    assert report.problems[0].tensors == ("value train.rank_00000.extra.epoch",)
    assert "weights_only" in report.problems[0].message
    assert verify_checkpoint(manager.store, 1).ok


def test_enum_not_allow_listed_at_restore_names_the_key(
    manager: CheckpointManager, monkeypatch: pytest.MonkeyPatch
) -> None:
    manager.save(1, TrainState(extra={"mode": Color.RED}, rng=False))
    monkeypatch.delitem(ALLOWED_ENUMS, f"{Color.__module__}.{Color.__qualname__}")
    with pytest.raises(
        ValueLoadError, match=r"train\.rank_00000\.extra\.mode.*allow_enum"
    ) as caught:
        manager.restore(TrainState(extra={"mode": None}, rng=False))
    assert not isinstance(caught.value, CorruptCheckpointError)


def test_verify_passes_every_supported_value(manager: CheckpointManager) -> None:
    manager.save(1, TrainState(model=nn.Linear(3, 2), extra=dict(SUPPORTED), rng=False))
    report = verify_checkpoint(manager.store, 1)
    assert report.ok, report.problems
