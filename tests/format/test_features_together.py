"""Format features built apart, used together: incremental references in signed manifests, with
the health gate on. Every committed step must stay restorable alone, bit for bit, and a forged
reference must still be refused under a signature."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from spotckpt import CheckpointManager
from spotckpt.catalog import Catalog
from spotckpt.layout import manifest_key
from spotckpt.storage import open_store
from spotckpt.verify import verify_checkpoint


def _key(path: Path) -> Path:
    path.write_bytes(
        Ed25519PrivateKey.generate().private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    return path


def _state(step: int) -> dict[str, Any]:
    torch.manual_seed(0)
    frozen = torch.randn(256, 256)  # never changes: referenced after the first save
    torch.manual_seed(step)
    return {"frozen": frozen, "adapter": torch.randn(16, 256), "step": torch.tensor(step)}


def _manager(root: Path, key: Path, **settings: Any) -> CheckpointManager:
    return CheckpointManager(
        str(root),
        preemption=False,
        keep_last=2,
        incremental=True,
        signing_key=str(key),
        health_check="finite",
        **settings,
    )


@pytest.fixture
def saved(tmp_path: Path) -> tuple[Path, Path]:
    root, key = tmp_path / "ck", _key(tmp_path / "k.pem")
    with _manager(root, key) as mgr:
        for step in (1, 2, 3, 4):
            mgr.save(step, _state(step))
    return root, key


def test_signed_incremental_steps_restore_alone_and_verify(saved: tuple[Path, Path]) -> None:
    root, key = saved
    manifest = json.loads((root / manifest_key(4)).read_bytes())
    assert set(manifest["format"].split("+")[1:]) == {"references", "signed"}
    catalog = Catalog(open_store(str(root)))
    assert catalog.read_manifest(4).referenced_bytes > 0
    with _manager(root, key) as mgr:
        assert mgr.steps() == [3, 4]  # retention kept the referenced step 1 folder, not its step
        for step in (3, 4):
            target = {k: torch.zeros_like(v) for k, v in _state(step).items()}
            assert mgr.restore(target, step=step) == step
            assert all(torch.equal(target[k], v) for k, v in _state(step).items())
            assert mgr.verify(step).ok
    assert verify_checkpoint(open_store(str(root)), 4).ok


def test_a_reference_redirected_under_a_signature_is_refused(saved: tuple[Path, Path]) -> None:
    """Rewriting where a signed step's chunk lies breaks its signature: the step is refused and
    restore falls back to the older one."""
    root, key = saved
    path = root / manifest_key(4)
    text = path.read_text()
    referenced = json.loads(text)["tensors"]["frozen"]["chunks"][0]["key"]
    assert referenced.startswith("step-")
    path.write_text(
        text.replace(referenced, referenced.replace("step-000000001", "step-000000003"))
    )
    with _manager(root, key) as mgr:
        target = {k: torch.zeros_like(v) for k, v in _state(3).items()}
        assert mgr.restore(target) == 3
        assert all(torch.equal(target[k], v) for k, v in _state(3).items())
