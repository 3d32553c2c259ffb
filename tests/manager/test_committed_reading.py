"""Retention right after a commit takes the step's reading from the manifest it just committed
(`spotckpt.step_readings.StepReadings.committed`) instead of reading it back (issue 48: the read
and parse cost about a sixth of a 20,000-tensor save). The reading must be the one a fresh
reader of the bucket derives, for every feature that changes what a step needs: incremental
references to earlier steps, signing, compression; and retention must keep deleting nothing a
kept step needs."""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import pytest
import torch

from spotckpt import CheckpointManager
from spotckpt.catalog import Catalog
from spotckpt.layout import MANIFEST_NAME, manifest_key
from spotckpt.storage import registry
from spotckpt.storage.local import LocalStore
from spotckpt.verify import verify_checkpoint

from tests_support import write_signing_key

pytestmark = pytest.mark.timeout(240)

FEATURES = list(itertools.product([False, True], repeat=3))


class ManifestReads(LocalStore):
    """A local store (its listings give times, as the clouds' do) that records every read of a
    manifest, whole or ranged."""

    def __init__(self, root: Path) -> None:
        super().__init__(root)
        self.manifest_reads: list[str] = []

    def get(self, key: str) -> bytes:
        if key.endswith(MANIFEST_NAME):
            self.manifest_reads.append(key)
        return super().get(key)

    def get_range(self, key: str, start: int, length: int) -> bytes:
        if key.endswith(MANIFEST_NAME):
            self.manifest_reads.append(key)
        return super().get_range(key, start, length)


def _state(step: int) -> dict[str, torch.Tensor]:
    """Two tensors that never change (incremental saves reference them) and one that does."""
    g = torch.Generator().manual_seed(7)
    return {
        "still.a": torch.rand(3000, generator=g),
        "still.b": torch.zeros(2000),
        "moving": torch.full((4000,), float(step)),
    }


@pytest.mark.parametrize(
    ("incremental", "signed", "compressed"),
    FEATURES,
    ids=[f"inc{int(i)}-sig{int(s)}-zip{int(c)}" for i, s, c in FEATURES],
)
def test_retention_after_a_commit_reads_nothing_back_and_agrees_with_the_bucket(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    incremental: bool,
    signed: bool,
    compressed: bool,
) -> None:
    monkeypatch.setattr(registry, "_FACTORIES", dict(registry._FACTORIES))
    store = ManifestReads(tmp_path / "root")
    registry.register_store("readcount", lambda uri, options: store)
    settings: dict[str, Any] = {"incremental": incremental}
    if compressed:
        settings["compression"] = "on"
    if signed:
        settings["signing_key"] = str(write_signing_key(tmp_path / "signing.pem"))
    with CheckpointManager(
        "readcount://root", keep_last=2, preemption=False, **settings
    ) as manager:
        for step in range(1, 7):
            store.manifest_reads.clear()
            manager.save(step, _state(step), blocking=True)
            # An incremental save reads its base (the step before) to learn what it may reference.
            base = [manifest_key(step - 1)] if incremental and step > 1 else []
            assert store.manifest_reads == base, f"step {step}: a manifest was read back"
            fresh = {r.step: r for r in Catalog(store, manager.keyring).read_steps()}
            assert sorted(fresh) == list(range(max(1, step - 1), step + 1))
            seeded = {r.step: r for r in manager.catalog.read_steps()}
            assert seeded == fresh, f"step {step}: the committed reading differs from the bucket's"
        assert manager.steps() == [5, 6]
    for step in (5, 6):
        with CheckpointManager("readcount://root", preemption=False, **settings) as manager:
            restored = {k: torch.empty_like(v) for k, v in _state(step).items()}
            assert manager.restore(restored, step=step) == step
        for key, value in _state(step).items():
            assert torch.equal(restored[key], value), (step, key)
        assert verify_checkpoint(store, step, keyring=manager.keyring).problems == []


def test_a_step_committed_unsigned_under_a_verifying_keyring_takes_no_slot(tmp_path: Path) -> None:
    """A job that signed its steps restarts with only the public key (a reader's keyring): its
    writer cannot sign, so its new steps are unsigned and no reader with that keyring takes
    them. The retention after their commits must judge them as a reader would (unreadable: no
    slot of keep_last), not trust them because this process wrote them, or it deletes the only
    steps that still restore."""
    from cryptography.hazmat.primitives import serialization

    private = write_signing_key(tmp_path / "signing.pem")
    key = serialization.load_pem_private_key(private.read_bytes(), password=None)
    public = tmp_path / "public.pem"
    public.write_bytes(
        key.public_key().public_bytes(
            serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
        )
    )
    root = tmp_path / "root"
    with CheckpointManager(
        str(root), keep_last=2, preemption=False, signing_key=str(private)
    ) as manager:
        for step in (1, 2):
            manager.save(step, _state(step), blocking=True)
    with CheckpointManager(
        str(root), keep_last=2, preemption=False, verify_keys=str(public)
    ) as manager:
        for step in (3, 4):
            manager.save(step, _state(step), blocking=True)
    kept = sorted(
        int(p.parent.name.removeprefix("step-")) for p in root.glob("step-*/manifest.json")
    )
    assert kept == [1, 2, 3, 4]
    with CheckpointManager(str(root), preemption=False, signing_key=str(private)) as manager:
        restored = {k: torch.empty_like(v) for k, v in _state(2).items()}
        assert manager.restore(restored) == 2
    assert all(torch.equal(restored[k], v) for k, v in _state(2).items())
