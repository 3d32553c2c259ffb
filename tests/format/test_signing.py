"""Signed manifests (`spotckpt.format.signing`): refused when forged, unsigned, replayed or
truncated while a key is configured; read exactly as before without one; the key never shows."""

from __future__ import annotations

import base64
import json
import logging
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from spotckpt import CheckpointManager
from spotckpt.catalog import Catalog
from spotckpt.errors import ConfigError, CorruptCheckpointError, SignatureError
from spotckpt.format.signing import Keyring
from spotckpt.layout import manifest_key
from spotckpt.storage import open_store
from spotckpt.verify import verify_checkpoint

from tests_support import flip_keeping_crc32c


def _write_key(path: Path) -> tuple[Path, list[str]]:
    """A PEM Ed25519 private key at `path`, and every spelling of its secret to grep for."""
    key = Ed25519PrivateKey.generate()
    pem = key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )
    raw = key.private_bytes(
        serialization.Encoding.Raw, serialization.PrivateFormat.Raw, serialization.NoEncryption()
    )
    path.write_bytes(pem)
    body = b"".join(pem.splitlines()[1:-1]).decode()
    return path, [body, raw.hex(), base64.b64encode(raw).decode(), repr(raw)[2:30]]


def _public_key(private: Path, path: Path) -> Path:
    key = serialization.load_pem_private_key(private.read_bytes(), password=None)
    path.write_bytes(
        key.public_key().public_bytes(
            serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
        )
    )
    return path


def _state(seed: int = 0) -> dict[str, Any]:
    torch.manual_seed(seed)
    return {"w": torch.randn(64, 64), "b": torch.randn(64), "step": torch.tensor(seed)}


def _manager(root: Path, **settings: Any) -> CheckpointManager:
    return CheckpointManager(str(root), preemption=False, keep_last=None, **settings)


def _manifest(root: Path, step: int) -> dict[str, Any]:
    return json.loads((root / manifest_key(step)).read_bytes())


def _rewrite(root: Path, step: int, document: dict[str, Any]) -> None:
    (root / manifest_key(step)).write_bytes(json.dumps(document).encode())


@pytest.fixture
def key(tmp_path: Path) -> tuple[Path, list[str]]:
    return _write_key(tmp_path / "signing.pem")


def test_a_signed_save_restores_with_the_key_and_without_one(
    tmp_path: Path, key: tuple[Path, list[str]]
) -> None:
    root = tmp_path / "ck"
    with _manager(root, signing_key=str(key[0])) as manager:
        manager.save(1, _state(1))
        document = _manifest(root, 1)
        assert document["format"] == "spotckpt/1+signed"
        assert document["job"] == manager.catalog.job().id  # type: ignore[union-attr]
        assert all(len(o["blake3"]) == 64 for o in document["objects"])
        assert len(base64.b64decode(document["signature"]["ed25519"])) == 64
        restored = _state(9)
        assert manager.restore(restored) == 1
        assert torch.equal(restored["w"], _state(1)["w"])
        assert manager.verify(1).ok
    with _manager(root) as reader:  # no key: read exactly as an unsigned step
        restored = _state(9)
        assert reader.restore(restored) == 1 and torch.equal(restored["b"], _state(1)["b"])
    public = _public_key(key[0], tmp_path / "public.pem")
    with _manager(root, verify_keys=str(public)) as verifier:  # readers need no private key
        assert verifier.restore(_state(9)) == 1


def test_steps_without_the_feature_keep_their_format(tmp_path: Path) -> None:
    with _manager(tmp_path) as manager:
        manager.save(1, _state())
    document = _manifest(tmp_path, 1)
    assert document["format"] == "spotckpt/1" and "signature" not in document
    assert all("blake3" not in o for o in document["objects"])


def test_an_unsigned_step_is_refused_with_a_key_unless_accepted(
    tmp_path: Path, key: tuple[Path, list[str]]
) -> None:
    root = tmp_path / "ck"
    with _manager(root) as manager:
        manager.save(1, _state(1))  # saved before the key was set
    with _manager(root, signing_key=str(key[0])) as manager:
        with pytest.raises(SignatureError, match="not signed"):
            manager.read_manifest(1)
        with pytest.raises(SignatureError):  # the last step left: raised, as a corrupt one
            manager.restore(_state(9))
        assert [p.kind for p in manager.verify(1).problems] == ["manifest"]
    with _manager(root) as manager:
        manager.save(2, _state(2))
    with _manager(root, signing_key=str(key[0]), accept_unsigned=True) as manager:
        assert manager.restore(_state(9)) == 2


def _signed_root(tmp_path: Path, key: Path, steps: tuple[int, ...] = (1, 2)) -> Path:
    root = tmp_path / "ck"
    with _manager(root, signing_key=str(key)) as manager:
        for step in steps:
            manager.save(step, _state(step))
    return root


def _refused(root: Path, key: Path, step: int, match: str) -> None:
    with _manager(root, signing_key=str(key)) as manager:
        with pytest.raises(SignatureError, match=match):
            manager.read_manifest(step)
        report = manager.verify(step)
        assert [p.kind for p in report.problems] == ["manifest"]
        assert manager.restore(_state(9)) != step  # never used: an older step, or none
        assert step not in manager.steps()  # quarantined


def test_a_forged_manifest_is_refused(tmp_path: Path, key: tuple[Path, list[str]]) -> None:
    root = _signed_root(tmp_path, key[0])
    document = _manifest(root, 2)
    document["user_metadata"] = {"lr": 1000.0}  # any edit after signing
    _rewrite(root, 2, document)
    _refused(root, key[0], 2, "does not verify under any accepted key")
    with _manager(root) as manager:  # without a key: read as it always was
        assert manager.read_manifest(1).step == 1


def test_a_manifest_signed_with_another_key_is_refused(
    tmp_path: Path, key: tuple[Path, list[str]]
) -> None:
    root = _signed_root(tmp_path, key[0])
    forger = Keyring.generate()
    data = (root / manifest_key(2)).read_bytes()
    document = json.loads(data)
    del document["signature"]
    forged = forger.sign(json.dumps(document).encode(), document["job"])
    (root / manifest_key(2)).write_bytes(forged)
    _refused(root, key[0], 2, "does not verify under any accepted key")


def test_a_truncated_signature_is_refused(tmp_path: Path, key: tuple[Path, list[str]]) -> None:
    root = _signed_root(tmp_path, key[0])
    document = _manifest(root, 2)
    raw = base64.b64decode(document["signature"]["ed25519"])
    document["signature"]["ed25519"] = base64.b64encode(raw[:40]).decode()
    _rewrite(root, 2, document)
    _refused(root, key[0], 2, "truncated signature")


def test_a_stripped_signature_is_refused(tmp_path: Path, key: tuple[Path, list[str]]) -> None:
    root = _signed_root(tmp_path, key[0])
    document = _manifest(root, 2)
    del document["signature"]
    _rewrite(root, 2, document)
    _refused(root, key[0], 2, "missing or malformed signature")


def test_a_manifest_replayed_from_another_step_is_refused(
    tmp_path: Path, key: tuple[Path, list[str]]
) -> None:
    root = _signed_root(tmp_path, key[0], (1, 2, 3))
    # step 1's signed manifest and objects copied over step 3 (rolling training back)
    shutil.rmtree(root / "step-000000003")
    shutil.copytree(root / "step-000000001", root / "step-000000003")
    with _manager(root, signing_key=str(key[0])) as manager:
        with pytest.raises(SignatureError, match="signed for step 1, not 3"):
            manager.catalog.keyring.check(  # type: ignore[union-attr]
                (root / manifest_key(3)).read_bytes(),
                step=3,
                job=manager.catalog.job().id,
                what="m",
            )
        assert manager.restore(_state(9)) == 2
        assert 3 not in manager.steps()


def test_a_manifest_replayed_from_another_job_is_refused(
    tmp_path: Path, key: tuple[Path, list[str]]
) -> None:
    ours = _signed_root(tmp_path / "a", key[0], (1,))
    theirs = _signed_root(tmp_path / "b", key[0], (1, 2))  # same key, another job
    shutil.copytree(theirs / "step-000000002", ours / "step-000000002")
    _refused(ours, key[0], 2, "signed for another job")
    with _manager(ours, signing_key=str(key[0])) as manager:
        assert manager.restore(_state(9)) == 1


def test_rotation_accepts_the_old_public_key(tmp_path: Path, key: tuple[Path, list[str]]) -> None:
    root = _signed_root(tmp_path, key[0], (1,))
    new_key, _ = _write_key(tmp_path / "new.pem")
    old_public = _public_key(key[0], tmp_path / "old.pub.pem")
    with _manager(root, signing_key=str(new_key), verify_keys=str(old_public)) as manager:
        manager.save(2, _state(2))
        assert manager.restore(_state(9), step=1) == 1  # signed with the old key
        assert manager.restore(_state(9)) == 2
    with (
        _manager(root, signing_key=str(new_key)) as manager,  # old key dropped
        pytest.raises(SignatureError),
    ):
        manager.read_manifest(1)


def test_the_key_never_appears_in_logs_errors_or_manifests(
    tmp_path: Path, key: tuple[Path, list[str]], caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    root = tmp_path / "ck"
    texts: list[str] = []
    with _manager(root) as manager:
        manager.save(1, _state(1))
    with _manager(root, signing_key=str(key[0])) as manager:
        texts += [repr(manager.settings), repr(manager.keyring)]
        manager.save(2, _state(2))
        document = _manifest(root, 2)
        del document["signature"]
        _rewrite(root, 2, document)
        for step in (1, 2):
            try:
                manager.read_manifest(step)
            except SignatureError as error:
                texts.append(str(error))
        with pytest.raises(SignatureError) as refused:
            manager.restore(_state(9))
        texts.append(str(refused.value))
    bad = tmp_path / "bad.pem"
    bad.write_bytes(key[0].read_bytes()[:-40])
    with pytest.raises(ConfigError) as error:
        Keyring.from_files(str(bad))
    texts.append(str(error.value))
    texts += [r.getMessage() for r in caplog.records]
    texts += [p.read_bytes().decode(errors="replace") for p in root.rglob("*.json")]
    everything = "\n".join(texts)
    assert "not signed" in everything and "bad.pem" in everything  # the texts were captured
    for secret in key[1]:
        assert secret not in everything


def test_bytes_replaced_with_their_crc32c_kept_fail_the_strong_hash(
    tmp_path: Path, key: tuple[Path, list[str]]
) -> None:
    root = _signed_root(tmp_path, key[0], (1,))
    (path,) = (root / "step-000000001").rglob("*.safetensors")
    data = bytearray(path.read_bytes())
    flip_keeping_crc32c(data, len(data) - 64, len(data) - 60)
    path.write_bytes(bytes(data))
    for keyring in (None, Keyring.from_files(str(key[0]))):
        report = verify_checkpoint(open_store(str(root)), 1, keyring=keyring)
        assert [p.kind for p in report.problems] == ["blake3"]  # every CRC32C still matches
        assert isinstance(report.error(), CorruptCheckpointError)
    with (
        _manager(root, signing_key=str(key[0])) as manager,
        pytest.raises(CorruptCheckpointError, match="BLAKE3"),
    ):
        manager.restorable_step()  # checked whole: the forgery is seen


def test_a_fast_tier_step_must_be_signed_like_a_bucket_step(
    tmp_path: Path,
    key: tuple[Path, list[str]],
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A node's disk is trusted no more than the bucket: with a key, a tier-only step whose
    manifest lost its signature is refused and the restore falls back to the older signed step;
    without a key the same step restores from the tier, as before."""
    monkeypatch.setenv("SPOTCKPT_NODE", "node-a")
    root, tier = tmp_path / "ck", tmp_path / "tier"
    tier.mkdir()
    settings = {"local_dir": str(tier), "local_interval_steps": 1, "interval_steps": 100}
    with _manager(root, signing_key=str(key[0]), **settings) as manager:
        manager.save(1, _state(1))  # the bucket (and the tier)
        assert manager.maybe_save(2, _state(2))  # the tier only
        assert manager.steps() == [1]
    (copy,) = tier.rglob(manifest_key(2))
    document = json.loads(copy.read_bytes())
    assert document["format"] == "spotckpt/1+signed"  # the tier's copies are signed too

    def restore(**keys: Any) -> tuple[int | None, dict[str, int], dict[str, Any]]:
        restored = _state(9)
        with _manager(root, **keys, **settings) as manager:
            return manager.restore(restored), manager.last_restore_sources, restored

    step, sources, restored = restore(signing_key=str(key[0]))
    assert (step, sources["store"]) == (2, 0) and sources["local"] > 0  # signed: used
    assert torch.equal(restored["w"], _state(2)["w"])
    del document["signature"]
    document["format"] = "spotckpt/1"
    copy.write_bytes(json.dumps(document).encode())
    step, sources, _ = restore()  # no key: used as before
    assert (step, sources["store"]) == (2, 0)
    with caplog.at_level(logging.WARNING, logger="spotckpt"):
        step, _, restored = restore(signing_key=str(key[0]))
    assert step == 1 and torch.equal(restored["w"], _state(1)["w"])  # step 1's copy is signed
    assert "tier step 2's manifest has a missing or malformed signature" in caplog.text


def test_catalog_without_keyring_reads_signed_steps(
    tmp_path: Path, key: tuple[Path, list[str]]
) -> None:
    root = _signed_root(tmp_path, key[0], (1,))
    manifest = Catalog(open_store(str(root))).read_manifest(1)
    assert manifest.features == frozenset({"signed"})
    assert all(record.blake3 for record in manifest.objects.values())


@pytest.mark.process
def test_an_indexed_manifest_is_signed_root_and_parts(
    tmp_path: Path, key: tuple[Path, list[str]]
) -> None:
    from integrity_worker import launch

    args = {"uri": str(tmp_path / "ck"), "out": str(tmp_path), "key": str(key[0])}
    for rank, result in enumerate(launch(2, "signed_indexed", args)):
        assert result.returncode == 0, f"rank {rank}:\n{result.stdout[-4000:]}"
    root = json.loads((tmp_path / "ck" / manifest_key(1)).read_bytes())
    assert root["format"] == "spotckpt/2+signed" and "signature" in root
    for rank in range(2):
        outcome = json.loads((tmp_path / f"indexed-{rank}.json").read_text())
        assert outcome == {"restored": 1, "steps": [1]}  # the tampered step 2 set aside
