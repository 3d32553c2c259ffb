"""Manifest and safetensors validation: bad input from a bucket is a clear error, never a crash."""

from __future__ import annotations

import io
import json
import struct
from pathlib import Path
from typing import Any

import pytest
import torch

from spotckpt import CheckpointError, CheckpointManager, CorruptCheckpointError
from spotckpt.format.manifest import Manifest, ManifestError
from spotckpt.format.safetensors_io import SafetensorsFormatError, read_header
from spotckpt.layout import manifest_key
from spotckpt.storage import open_store


@pytest.fixture
def saved(tmp_path: Path) -> tuple[CheckpointManager, dict[str, Any]]:
    mgr = CheckpointManager(str(tmp_path / "ck"), preemption=False)
    mgr.save(1, {"w": torch.arange(12.0).reshape(3, 4), "meta": {"epoch": 2}})
    return mgr, json.loads(mgr.store.get(manifest_key(1)))


def _reject(document: dict[str, Any], match: str) -> None:
    with pytest.raises(ManifestError, match=match):
        Manifest.from_json(json.dumps(document).encode())


def test_valid_manifest_parses(saved: tuple[CheckpointManager, dict[str, Any]]) -> None:
    _, document = saved
    manifest = Manifest.from_json(json.dumps(document).encode(), expected_step=1)
    assert set(manifest.tensors) == {"w"} and set(manifest.values) == {"meta.epoch"}


@pytest.mark.parametrize(
    ("bad_key", "match"),
    [
        ("../../etc/passwd", r"unsafe object key.*'\.\.'"),
        ("/abs/path", "unsafe object key.*absolute"),
        ("https://evil.example/x", "unsafe object key.*scheme"),
        ("s3://other-bucket/x", "unsafe object key.*scheme"),
    ],
)
def test_escaping_keys_are_rejected(
    saved: tuple[CheckpointManager, dict[str, Any]], bad_key: str, match: str
) -> None:
    _, document = saved
    old = document["objects"][0]["key"]
    document["objects"][0]["key"] = bad_key
    for entry in document["tensors"]["w"]["chunks"]:
        entry["key"] = bad_key
    assert old != bad_key
    _reject(document, match)


def test_wrong_sizes_are_rejected(saved: tuple[CheckpointManager, dict[str, Any]]) -> None:
    _, document = saved
    document["tensors"]["w"]["chunks"][0]["length"] += 4
    _reject(document, "block_crc32c does not match|has 52 bytes|beyond")


def test_object_smaller_than_its_chunks_is_rejected(
    saved: tuple[CheckpointManager, dict[str, Any]],
) -> None:
    _, document = saved
    document["objects"][0]["size"] = 10
    _reject(document, "lie beyond the 10-byte object")


def test_negative_and_unknown_are_rejected(saved: tuple[CheckpointManager, dict[str, Any]]) -> None:
    _, document = saved
    for mutate, match in [
        (lambda d: d.update(format="spotckpt/99"), "unknown manifest format"),
        (lambda d: d.update(step=-1), "non-negative"),
        (lambda d: d["tensors"]["w"].update(dtype="object"), "unknown dtype"),
        (lambda d: d["tensors"]["w"].update(shape=[3, -4]), "non-negative integers"),
        (lambda d: d["tensors"]["w"].update(shape=[3, 5]), "chunks hold 12 elements"),
        (lambda d: d.pop("objects"), "missing field 'objects'"),
        (lambda d: d["values"]["meta.epoch"].update(key="nope"), "does not list"),
    ]:
        copy = json.loads(json.dumps(document))
        mutate(copy)
        _reject(copy, match)


def test_malformed_and_truncated_json(saved: tuple[CheckpointManager, dict[str, Any]]) -> None:
    _, document = saved
    raw = json.dumps(document).encode()
    for data in (raw[: len(raw) // 2], b"\xff\xfe", b"[1,2]", b""):
        with pytest.raises(ManifestError):
            Manifest.from_json(data)


def test_step_mismatch_is_rejected(saved: tuple[CheckpointManager, dict[str, Any]]) -> None:
    _, document = saved
    with pytest.raises(ManifestError, match="claims step 1"):
        Manifest.from_json(json.dumps(document).encode(), expected_step=2)


def test_forged_manifest_in_bucket_fails_restore_clearly(
    saved: tuple[CheckpointManager, dict[str, Any]],
) -> None:
    mgr, document = saved
    document["step"] = 2
    document["objects"][0]["key"] = "../step-000000001/" + document["objects"][0]["key"]
    mgr.store.put(manifest_key(2), json.dumps(document).encode())
    with pytest.raises(ManifestError, match="unsafe object key"):
        mgr.restore({"w": torch.zeros(3, 4), "meta": {"epoch": 0}}, step=2)


def test_absurd_safetensors_header_length(tmp_path: Path) -> None:
    store = open_store(str(tmp_path))
    store.put("bad.safetensors", struct.pack("<Q", 1 << 62) + b"{}")
    with pytest.raises(SafetensorsFormatError, match="absurd"):
        read_header(store, "bad.safetensors")
    store.put("gap.safetensors", struct.pack("<Q", 2) + b"{}" + b"xx")
    with pytest.raises(SafetensorsFormatError, match="data ends at byte"):
        read_header(store, "gap.safetensors")


def test_pickle_payload_in_values_is_never_executed(
    saved: tuple[CheckpointManager, dict[str, Any]], tmp_path: Path
) -> None:
    """A value replaced by a pickle that would create a file is refused, and nothing runs."""
    mgr, document = saved
    marker = tmp_path / "pwned"

    class Exploit:
        def __reduce__(self) -> tuple[Any, tuple[str]]:
            return (Path.touch, (str(marker),))  # type: ignore[return-value]

    payload = io.BytesIO()
    torch.save({"x": Exploit()}, payload)
    manifest = Manifest.from_json(json.dumps(document).encode())
    location = manifest.values["meta.epoch"]
    key = f"step-000000001/{location.key}"
    data = bytearray(mgr.store.get(key))
    evil = payload.getvalue()
    # splice the payload in place of the value and fix up the manifest so only the pickle is bad
    new_data = (
        bytes(data[: location.offset]) + evil + bytes(data[location.offset + location.length :])
    )
    from spotckpt.checksum import crc32c
    from spotckpt.format.safetensors_io import block_crcs

    mgr.store.put(key, new_data)
    entry = document["values"]["meta.epoch"]
    entry["length"] = len(evil)
    entry["block_crc32c"] = list(block_crcs(evil, document["block_size"]))
    for tensor in document["tensors"].values():  # the tensors after the value moved with it
        for chunk in tensor["chunks"]:
            if chunk["offset"] > location.offset:
                chunk["offset"] += len(evil) - location.length
    document["objects"][0]["size"] = len(new_data)
    document["objects"][0]["crc32c"] = crc32c(new_data)
    mgr.store.put(manifest_key(1), json.dumps(document).encode())
    with pytest.raises(CheckpointError, match="weights_only") as caught:
        mgr.restore({"w": torch.zeros(3, 4), "meta": {"epoch": 0}}, step=1)
    assert not isinstance(caught.value, CorruptCheckpointError)  # not corruption: no fallback
    assert not marker.exists()
