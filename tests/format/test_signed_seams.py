"""Signed manifests where they meet incremental references and restores (issue 44, items 4, 5, 7).

What may enter a signed manifest: only records read under the job's keyring from a step whose
signature verified, each with a BLAKE3; an unsigned (planted, or older) newest step is never an
incremental base of a signed save, which then uploads everything. Reads of a signed step check
the BLAKE3 of every byte they return, so bytes replaced with their CRC32Cs kept (easy to make) are
refused by restore like any corruption (quarantine, fall back to the older step).

Every forgery here is real bytes in a real local store: a byte changes and four more are set so
that the CRC32C of the object and of the 64 KiB block around them stay the same.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, ReadItem

import spotckpt.engine.writer
from spotckpt import CheckpointManager, open_checkpoint
from spotckpt.catalog import Catalog
from spotckpt.engine.reader import ObjectStoreReader
from spotckpt.errors import ChecksumMismatchError
from spotckpt.export import export_hf
from spotckpt.format.manifest import ChunkLocation
from spotckpt.format.references import object_path
from spotckpt.format.signing import Keyring
from spotckpt.layout import manifest_key, step_folder
from spotckpt.storage import open_store

from tests_support import flip_keeping_crc32c, plain_manifest_document, write_signing_key

KIB = 1 << 10


def _state(seed: int) -> dict[str, Any]:
    generator = torch.Generator().manual_seed(seed)
    frozen = torch.Generator().manual_seed(1234)  # a frozen layer: the same bytes every step
    return {
        "model": {  # chunks of their own (a tensor over 1 MiB is never packed)
            "frozen": torch.randn(640, 512, generator=frozen),
            "w": torch.randn(640, 512, generator=generator),
            "u": torch.randint(0, 256, (1280 * KIB,), dtype=torch.uint8, generator=generator),
        },
        "small": {f"s{i}": torch.randn(64, generator=generator) for i in range(20)},  # a pack
        "extra": {"note": "x" * 200, "seed": seed},
    }


def _equal(restored: dict[str, Any], expected: dict[str, Any]) -> bool:
    for name, value in expected.items():
        got = restored[name]
        if isinstance(value, dict):
            if not _equal(got, value):
                return False
        elif isinstance(value, torch.Tensor):
            if not torch.equal(got, value):
                return False
        elif got != value:
            return False
    return True


def _manager(root: Path, **settings: Any) -> CheckpointManager:
    return CheckpointManager(str(root), preemption=False, keep_last=None, **settings)


def _document(root: Path, step: int) -> dict[str, Any]:
    """The manifest's JSON, one entry per tensor (packed records written out)."""
    return plain_manifest_document((root / manifest_key(step)).read_bytes())


def _location(root: Path, step: int, name: str) -> ChunkLocation:
    manifest = Catalog(open_store(str(root))).read_manifest(step)
    if name in manifest.values:
        return manifest.values[name]
    (chunk,) = manifest.tensors[name].chunks
    return chunk.location


def _forge(root: Path, step: int, location: ChunkLocation) -> None:
    """Change a chunk's stored bytes in place, every CRC32C kept."""
    assert location.stored_length == location.length  # raw, or blocks stored as they are
    path = root / object_path(step_folder(step), location.key)
    data = bytearray(path.read_bytes())
    at = location.offset + min(16, location.length // 2 - 8)
    flip_keeping_crc32c(data, at, at + 4)
    path.write_bytes(bytes(data))


# Item 4: a planted unsigned step is never a base ------------------------------------------------


def _plant_unsigned(root: Path, step: int, source: int, name: str) -> None:
    """What a writer without the key can do: copy signed step `source` as an unsigned step
    `step` whose chunk `name` holds bytes of its choosing, with the CRC32Cs forged to match and
    the real BLAKE3 claimed (the job's next save of the same bytes would reference them)."""
    document = _document(root, source)
    for field in ("signature", "job"):
        del document[field]
    document["format"] = "spotckpt/1"
    document["step"] = step
    for record in document["objects"]:
        del record["blake3"]
    shutil.copytree(root / step_folder(source), root / step_folder(step))
    (root / manifest_key(step)).write_text(json.dumps(document))
    location = _location(root, step, name)
    assert location.blake3  # the real hash, claimed
    _forge(root, step, location)


@pytest.mark.parametrize("accept_unsigned", [False, True])
def test_a_planted_unsigned_step_is_never_the_base_of_a_signed_save(
    tmp_path: Path, accept_unsigned: bool
) -> None:
    root = tmp_path / "ck"
    key = write_signing_key(tmp_path / "signing.pem")
    settings = {"signing_key": str(key), "incremental": True, "accept_unsigned": accept_unsigned}
    with _manager(root, **settings) as manager:
        manager.save(1, _state(1))
    _plant_unsigned(root, 2, 1, "model.frozen")
    with _manager(root, **settings) as manager:
        manager.save(3, _state(3))
        document = _document(root, 3)
        assert not any(o["key"].startswith("step-") for o in document["objects"])  # all written
        restored = _state(9)
        assert manager.restore(restored) == 3
        assert _equal(restored, _state(3))  # the job's real values, not the planted ones
        assert manager.verify(3).ok
        if not accept_unsigned:
            assert [p.kind for p in manager.verify(2).problems] == ["manifest"]


def test_a_signed_base_is_still_referenced(tmp_path: Path) -> None:
    root = tmp_path / "ck"
    key = write_signing_key(tmp_path / "signing.pem")
    with _manager(root, signing_key=str(key), incremental=True) as manager:
        manager.save(1, _state(1))
        manager.save(2, _state(2))
    document = _document(root, 2)
    assert any(o["key"].startswith("step-000000001/") for o in document["objects"])
    assert all(len(o["blake3"]) == 64 for o in document["objects"])


# Item 5: signing turned on mid-run --------------------------------------------------------------


def _all_hashed(document: dict[str, Any]) -> bool:
    chunks = [c for t in document["tensors"].values() for c in t["chunks"]]
    locations = [*chunks, *document["values"].values()]
    return all(len(o.get("blake3", "")) == 64 for o in [*document["objects"], *locations])


def test_signing_turned_on_mid_run_references_nothing_unsigned(tmp_path: Path) -> None:
    root = tmp_path / "ck"
    key = write_signing_key(tmp_path / "signing.pem")
    with _manager(root, incremental=True) as manager:  # before the key was set
        manager.save(1, _state(1))
        manager.save(2, _state(2))
    assert any(o["key"].startswith("step-000000001/") for o in _document(root, 2)["objects"])
    settings = {"signing_key": str(key), "incremental": True, "accept_unsigned": True}
    with _manager(root, **settings) as manager:
        manager.save(3, _state(3))  # the first signed save uploads every chunk
        manager.save(4, _state(4))  # the next references the signed step 3
    first = _document(root, 3)
    assert not any(o["key"].startswith("step-") for o in first["objects"])
    assert _all_hashed(first)
    second = _document(root, 4)
    assert any(o["key"].startswith("step-000000003/") for o in second["objects"])
    assert _all_hashed(second)
    _forge(root, 3, _location(root, 3, "model.frozen"))  # the object step 4 references
    with _manager(root, **settings) as manager:
        assert [p.kind for p in manager.verify(4).problems] == ["blake3"]
        restored = _state(9)
        assert manager.restore(restored) == 2  # steps 4 and 3 refused; the unsigned 2 accepted
        assert _equal(restored, _state(2))


def _resign(root: Path, key: Path, step: int, document: dict[str, Any]) -> None:
    job = document.pop("job")
    del document["signature"]
    keyring = Keyring.from_files(str(key))
    assert keyring is not None
    (root / manifest_key(step)).write_bytes(keyring.sign(json.dumps(document).encode(), job))


def test_a_signed_record_without_a_strong_hash_is_reported_and_refused(tmp_path: Path) -> None:
    """A signed step from before the rule, referencing an object written unsigned: its record
    has no BLAKE3, so the signature covers nothing but CRC32Cs of those bytes."""
    root = tmp_path / "ck"
    key = write_signing_key(tmp_path / "signing.pem")
    with _manager(root, signing_key=str(key)) as manager:
        manager.save(1, _state(1))
        manager.save(2, _state(2))
    document = _document(root, 2)
    (record,) = document["objects"]
    del record["blake3"]
    for tensor in document["tensors"].values():
        for chunk in tensor["chunks"]:
            chunk.pop("blake3", None)
    for value in document["values"].values():
        value.pop("blake3", None)
    _resign(root, key, 2, document)
    with _manager(root, signing_key=str(key)) as manager:
        assert [p.kind for p in manager.verify(2).problems] == ["blake3"]
        restored = _state(9)
        assert manager.restore(restored) == 1
        assert _equal(restored, _state(1))


# Item 7: reads of a signed step check BLAKE3 ----------------------------------------------------

LAYOUTS: dict[str, tuple[str, dict[str, Any]]] = {  # layout: (forged entry, settings)
    "flat": ("model.w", {}),
    "indexed": ("model.w", {}),  # a root and an index part (`INDEX_MIN_RANKS` lowered to 1)
    "packed": ("small.s3", {}),  # a member of a pack of small tensors
    "compressed": ("model.u", {"compression": "on"}),  # random bytes: blocks stored as they are
    "value": ("extra.note", {}),
}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_restore_with_a_key_refuses_bytes_replaced_with_their_crc32c_kept(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, layout: str
) -> None:
    name, settings = LAYOUTS[layout]
    if layout == "indexed":
        monkeypatch.setattr(spotckpt.engine.writer, "INDEX_MIN_RANKS", 1)
    root = tmp_path / "ck"
    key = write_signing_key(tmp_path / "signing.pem")
    with _manager(root, signing_key=str(key), **settings) as manager:
        manager.save(1, _state(1))
        manager.save(2, _state(2))
    _forge(root, 2, _location(root, 2, name))
    with _manager(root, signing_key=str(key)) as manager:
        restored = _state(9)
        assert manager.restore(restored) == 1  # step 2 quarantined, the older one restored
        assert _equal(restored, _state(1))
        assert manager.steps() == [1]


def test_restore_refuses_a_forged_reference_of_an_incremental_step(tmp_path: Path) -> None:
    root = tmp_path / "ck"
    key = write_signing_key(tmp_path / "signing.pem")
    settings = {"signing_key": str(key), "incremental": True}
    with _manager(root, **settings) as manager:
        for step in (1, 2, 3):
            manager.save(step, _state(step))
    location = _location(root, 3, "model.frozen")
    assert location.key.startswith("step-000000001/")  # step 3 references step 1's bytes
    _forge(root, 3, location)
    with (
        _manager(root, signing_key=str(key)) as manager,
        pytest.raises(ChecksumMismatchError, match="BLAKE3 mismatch"),
    ):
        manager.restore(_state(9))  # every step holds the forged bytes: the last one raises


class _Into:
    """The smallest load planner: read items land in given tensors (a partial read's)."""

    def __init__(self, targets: dict[str, torch.Tensor]) -> None:
        self.targets = targets
        self.committed: list[str] = []

    def resolve_tensor(self, item: ReadItem) -> torch.Tensor:
        return self.targets[item.dest_index.fqn]

    def commit_tensor(self, item: ReadItem, tensor: torch.Tensor) -> None:
        self.committed.append(item.dest_index.fqn)


def _read(reader: str, root: Path, step: int) -> torch.Tensor:
    """Tensor ``model.w`` (rows 100..102 for the partial readers) of `step` as `reader` reads it."""
    store = open_store(str(root))
    manifest = Catalog(store).read_manifest(step)
    if reader == "dcp-pieces":  # in place, in pieces of 128 KiB: checked once all landed
        dest = {"model.w": torch.zeros(640, 512)}
        storage = ObjectStoreReader(store, manifest, max_read_bytes=128 * KIB)
        try:
            dcp.load(dest, storage_reader=storage, no_dist=True)
        except CheckpointException as error:  # DCP wraps each rank's failure
            raise error.failures[0][0] from None
        return dest["model.w"]
    if reader == "partial":  # two rows only: the whole chunk is read for its hash
        index = MetadataIndex("model.w", torch.Size([0, 0]))
        item = ReadItem(
            type=LoadItemType.TENSOR,
            dest_index=index,
            dest_offsets=torch.Size([0, 0]),
            storage_index=index,
            storage_offsets=torch.Size([100, 0]),
            lengths=torch.Size([2, 512]),
        )
        planner = _Into({"model.w": torch.zeros(2, 512)})
        ObjectStoreReader(store, manifest).read_data(LoadPlan([item]), planner)  # type: ignore[arg-type]
        assert planner.committed == ["model.w"]
        return planner.targets["model.w"]
    if reader == "lazy-slice":
        with open_checkpoint(store, step) as checkpoint:
            return checkpoint.get_slice("model.w")[100:102]
    out = root.parent / f"hf-{step}"
    export_hf(store, step, str(out), overwrite=True)
    with open_checkpoint(store, step) as checkpoint:  # exported: read it back plainly
        return checkpoint.get_tensor("model.w")


@pytest.mark.parametrize("reader", ["dcp-pieces", "partial", "lazy-slice", "export"])
def test_every_read_of_a_signed_step_checks_blake3(tmp_path: Path, reader: str) -> None:
    root = tmp_path / "ck"
    key = write_signing_key(tmp_path / "signing.pem")
    with _manager(root, signing_key=str(key)) as manager:
        manager.save(1, _state(1))
    expected = _state(1)["model"]["w"]
    if reader in ("partial", "lazy-slice"):
        expected = expected[100:102]
    assert torch.equal(_read(reader, root, 1), expected)  # intact: bit-exact
    _forge(root, 1, _location(root, 1, "model.w"))
    with pytest.raises(ChecksumMismatchError, match="BLAKE3"):
        _read(reader, root, 1)


def test_a_step_signed_without_chunk_hashes_is_checked_object_by_object(tmp_path: Path) -> None:
    """Signed steps of spotckpt versions that recorded only the objects' BLAKE3: a read checks
    each object it reads from whole, once."""
    root = tmp_path / "ck"
    key = write_signing_key(tmp_path / "signing.pem")
    with _manager(root, signing_key=str(key)) as manager:
        manager.save(1, _state(1))
        manager.save(2, _state(2))
    for step in (1, 2):
        document = _document(root, step)
        for tensor in document["tensors"].values():
            for chunk in tensor["chunks"]:
                chunk.pop("blake3", None)
        for value in document["values"].values():
            value.pop("blake3", None)
        _resign(root, key, step, document)
    assert _location(root, 2, "model.w").blake3 == ""
    with _manager(root, signing_key=str(key)) as manager:
        restored = _state(9)
        assert manager.restore(restored) == 2 and _equal(restored, _state(2))
    _forge(root, 2, _location(root, 2, "model.w"))
    with _manager(root, signing_key=str(key)) as manager:
        restored = _state(9)
        assert manager.restore(restored) == 1 and _equal(restored, _state(1))
