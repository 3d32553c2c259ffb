"""Save and restore through DCP on every store: values come back bit for bit."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open
from torch import nn

from spotckpt import (
    CheckpointAlreadyCommittedError,
    CheckpointManager,
    KeyMismatchError,
    NoCheckpointError,
    SaveFailedError,
)
from spotckpt.format.manifest import Manifest
from spotckpt.layout import manifest_key
from spotckpt.storage import ObjectStore, open_store

from tests_support import FailingStore

MIB = 1 << 20


@pytest.fixture(params=["memory", "local", "s3"])
def uri(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "memory":
        return str(request.getfixturevalue("memory_uri"))
    if request.param == "local":
        return str(tmp_path / "ckpt")
    return str(request.getfixturevalue("s3_uri"))


def _options(uri: str) -> dict[str, Any]:
    return {"part_size": 5 * MIB} if uri.startswith("s3://") else {}


@pytest.fixture
def manager(uri: str) -> Iterator[CheckpointManager]:
    mgr = CheckpointManager(uri, preemption=False, storage_options=_options(uri))
    yield mgr
    mgr.close()


def _model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))


def _train(model: nn.Module, optimizer: torch.optim.Optimizer, steps: int) -> None:
    for i in range(steps):
        x = torch.randn(8, 16, generator=torch.Generator().manual_seed(i))
        loss = model(x).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def _assert_same(a: Any, b: Any) -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape
        assert torch.equal(_bits(a), _bits(b))
    elif isinstance(a, dict):
        assert a.keys() == b.keys()
        for key in a:
            _assert_same(a[key], b[key])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            _assert_same(x, y)
    else:
        assert a == b and type(a) is type(b)


@pytest.mark.process
def test_model_and_adamw_round_trip(manager: CheckpointManager) -> None:
    model = _model(0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    _train(model, optimizer, 3)
    manager.save(3, {"model": model, "optim": optimizer})

    fresh = _model(1)
    fresh_optimizer = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
    assert manager.restore({"model": fresh, "optim": fresh_optimizer}) == 3
    _assert_same(model.state_dict(), fresh.state_dict())
    _assert_same(optimizer.state_dict(), fresh_optimizer.state_dict())
    # training continues identically
    _train(model, optimizer, 2)
    _train(fresh, fresh_optimizer, 2)
    _assert_same(model.state_dict(), fresh.state_dict())


def _all_kinds() -> dict[str, Any]:
    g = torch.Generator().manual_seed(7)
    base = torch.randn(6, 5, generator=g)
    return {
        "f32": base.clone(),
        "bf16": base.to(torch.bfloat16),
        "f16": base.to(torch.float16),
        "i64": torch.randint(-(2**40), 2**40, (7,), generator=g),
        "i8": torch.randint(-128, 127, (3, 3), dtype=torch.int8, generator=g),
        "u8": torch.randint(0, 255, (11,), dtype=torch.uint8, generator=g),
        "bool": torch.rand(5, generator=g) > 0.5,
        "scalar": torch.tensor(3.25),
        "empty": torch.empty(0, 4),
        "noncontig": base.t(),
        "count": 17,
        "ratio": 0.5,
        "name": "top-level",
        "nested": {"ints": 42, "float": 0.125, "text": "héllo", "deep": {"list": [1, 2, 3]}},
    }


def _zeros_like(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return torch.zeros_like(value)
    if isinstance(value, dict):
        return {k: _zeros_like(v) for k, v in value.items()}
    if isinstance(value, list):
        return [0 for _ in value]
    return type(value)()


@pytest.mark.process
def test_dtypes_and_shapes_round_trip(manager: CheckpointManager) -> None:
    original = _all_kinds()
    manager.save(1, original)
    target = _zeros_like(original)
    assert manager.restore(target) == 1
    _assert_same(original, target)


@pytest.mark.process
def test_no_checkpoint_returns_none(manager: CheckpointManager) -> None:
    assert manager.restore({"x": torch.zeros(2)}) is None
    assert manager.steps() == [] and manager.latest_step() is None
    with pytest.raises(NoCheckpointError):
        manager.restore({"x": torch.zeros(2)}, step=5)


@pytest.mark.process
def test_same_step_is_never_overwritten(manager: CheckpointManager) -> None:
    manager.save(4, {"x": torch.ones(3)})
    with pytest.raises(CheckpointAlreadyCommittedError, match="already committed"):
        manager.save(4, {"x": torch.zeros(3)})
    target = {"x": torch.empty(3)}
    manager.restore(target)
    assert torch.equal(target["x"], torch.ones(3))


@pytest.mark.process
def test_retention_keeps_newest(uri: str) -> None:
    with CheckpointManager(
        uri, keep_last=2, preemption=False, storage_options=_options(uri)
    ) as mgr:
        for step in (10, 20, 30, 40):
            mgr.save(step, {"x": torch.full((2,), float(step))})
        assert mgr.steps() == [30, 40]
        assert [i.key for i in mgr.store.list("step-000000010/")] == []
        target = {"x": torch.empty(2)}
        assert mgr.restore(target) == 40 and target["x"][0] == 40


@pytest.mark.process
def test_missing_and_extra_keys_are_named(manager: CheckpointManager) -> None:
    manager.save(1, {"a": torch.ones(2), "b": torch.ones(2)})
    with pytest.raises(KeyMismatchError, match=r"missing from the checkpoint: c"):
        manager.restore({"a": torch.zeros(2), "b": torch.zeros(2), "c": torch.zeros(2)})
    with pytest.raises(KeyMismatchError, match=r"not in the state: b"):
        manager.restore({"a": torch.zeros(2)})
    target = {"a": torch.zeros(2)}
    assert manager.restore(target, strict=False) == 1
    assert torch.equal(target["a"], torch.ones(2))


@pytest.mark.process
def test_shard_opens_with_safetensors(manager: CheckpointManager, tmp_path: Path) -> None:
    tensors = {"w": torch.randn(4, 4), "b": torch.arange(5)}
    manager.save(2, {"layer": tensors, "step": 2})
    manifest = manager.read_manifest(2)
    (key,) = manifest.objects
    local = tmp_path / "shard.safetensors"
    local.write_bytes(manager.store.get(f"step-000000002/{key}"))
    with safe_open(str(local), framework="pt") as handle:
        assert torch.equal(handle.get_tensor("layer.w"), tensors["w"])
        assert torch.equal(handle.get_tensor("layer.b"), tensors["b"])
        assert handle.metadata()["format"] == "pt"


@pytest.mark.process
def test_manifest_is_json_and_no_hint_is_written(manager: CheckpointManager) -> None:
    manager.save(7, {"x": torch.ones(1)})
    assert not manager.store.exists("latest.json")  # nothing reads a hint: none is written
    manifest = Manifest.from_json(manager.store.get(manifest_key(7)))
    assert manifest.step == 7 and manifest.world_size == 1 and manifest.format == "spotckpt/1"
    assert manifest.versions["torch"] == torch.__version__


def _failing_manager(store: ObjectStore) -> CheckpointManager:
    return CheckpointManager(store.uri, preemption=False, store=store)


def test_failed_save_leaves_no_visible_checkpoint(uri: str, s3_client: Any) -> None:
    inner = open_store(uri, **_options(uri))
    failing = FailingStore(inner, fail_after_bytes=6 * MIB)
    mgr = _failing_manager(failing)
    mgr.save(1, {"x": torch.ones(4)})
    big = {"x": torch.randn(4 * MIB)}  # 16 MiB: a multipart upload on S3
    with pytest.raises(SaveFailedError, match=r"rank\(s\) \[0\].*injected"):
        mgr.save(2, big)
    assert mgr.steps() == [1]
    target = {"x": torch.zeros(4)}
    assert mgr.restore(target) == 1 and torch.equal(target["x"], torch.ones(4))
    assert inner.list_uploads() == []
    assert [i.key for i in inner.list("step-000000002/")] == []
    if uri.startswith("s3://"):
        bucket = uri.split("/")[2]
        assert "Uploads" not in s3_client.list_multipart_uploads(Bucket=bucket)
    mgr.close()
