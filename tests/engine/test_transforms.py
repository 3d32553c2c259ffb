"""A new chunk encoding is one module and one registration (`spotckpt.format.codecs`): a toy one
(every byte XOR 0x5A), registered from this test module only, saves through the writer, restores
bit-exact, verifies (and a corrupted object does not), exports; a manifest naming an encoding
that is not registered is refused with a clear error; no registration outlives its test."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

import spotckpt
from spotckpt.catalog import Catalog
from spotckpt.dcp import dcp_reader
from spotckpt.engine.transforms import Always
from spotckpt.engine.writer import ObjectStoreWriter, WriterOptions
from spotckpt.errors import CorruptBlockError, InvalidArgumentError, ManifestError
from spotckpt.export import export_hf
from spotckpt.format.codecs import ENCODINGS, registered
from spotckpt.format.compression import ZSTD_PLANES
from spotckpt.format.encodings import BlockEncoder, BlockEncoding
from spotckpt.format.manifest import Manifest
from spotckpt.layout import manifest_key, step_folder
from spotckpt.storage import open_store
from spotckpt.verify import verify_checkpoint

from tests_support import assert_equal

CODEC = "xor-5a"


class XorEncoding(BlockEncoding):
    """Every stored byte is the raw byte XOR 0x5A: no gain, but nothing reads it as it lies."""

    name = "xor"
    codecs = frozenset({CODEC})
    min_bytes = 4096

    def codec_for(self, itemsize: int) -> str:
        return CODEC

    def block_encoder(self, codec: str) -> BlockEncoder:
        return lambda block: (np.frombuffer(block, dtype=np.uint8) ^ 0x5A).tobytes()

    def decode_block_into(self, stored: memoryview, out: memoryview, codec: str) -> None:
        if stored.nbytes != out.nbytes:
            raise CorruptBlockError(f"a stored block of {stored.nbytes} bytes, not {out.nbytes}")
        np.frombuffer(out, dtype=np.uint8)[:] = np.frombuffer(stored, dtype=np.uint8) ^ 0x5A


XOR = XorEncoding()


@pytest.fixture
def xor() -> Iterator[XorEncoding]:
    with registered(XOR) as encoding:
        yield encoding
    assert not ENCODINGS.knows(CODEC)


def _state() -> dict[str, Any]:
    torch.manual_seed(0)
    return {
        "model": {
            "w": torch.randn(300, 700),  # several CRC blocks: stored encoded
            "h": torch.arange(50_000, dtype=torch.int64).reshape(100, 500),
            "b": torch.randn(7),  # packed with its neighbours, under min_bytes: stored as is
        },
        "epoch": 3,
    }


def _save(root: Path) -> dict[str, Any]:
    state = _state()
    writer = ObjectStoreWriter(open_store(str(root)), 1, WriterOptions(encodings=Always(XOR)))
    dcp.save(state, storage_writer=writer, planner=writer.save_planner(1), no_dist=True)
    return state


def test_a_registered_encoding_saves_restores_verifies_and_exports(
    tmp_path: Path, xor: XorEncoding
) -> None:
    from safetensors.torch import load_file

    root = tmp_path / "ckpt"
    saved = _save(root)
    manifest = Catalog(open_store(str(root))).read_manifest(1)
    assert manifest.format == "spotckpt/1+compressed"
    location = manifest.tensors["model.w"].chunks[0].location
    assert location.codec == CODEC and location.key.endswith(".zblocks")
    assert manifest.tensors["model.b"].chunks[0].location.codec == ""
    [stored] = (root / "step-000000001").rglob("*.zblocks")
    raw = saved["model"]["w"].numpy().tobytes()
    assert raw[:4096] not in stored.read_bytes()  # the bytes lie encoded

    restored = {
        "model": {name: torch.zeros_like(t) for name, t in saved["model"].items()},
        "epoch": 0,
    }
    dcp.load(restored, storage_reader=dcp_reader(str(root), 1), no_dist=True)
    assert_equal(saved, restored)
    with spotckpt.open_checkpoint(str(root)) as ckpt:  # a partial read decodes some blocks
        assert torch.equal(ckpt.get_slice("model.w")[150:160], saved["model"]["w"][150:160])

    assert verify_checkpoint(open_store(str(root)), 1).ok
    export_hf(open_store(str(root)), 1, str(tmp_path / "hf"))
    exported = load_file(str(tmp_path / "hf" / "model.safetensors"))
    assert torch.equal(exported["w"], saved["model"]["w"])
    assert torch.equal(exported["h"], saved["model"]["h"])

    data = bytearray(stored.read_bytes())
    data[location.offset + 100] ^= 0x01  # one stored byte of model.w
    stored.write_bytes(bytes(data))
    report = verify_checkpoint(open_store(str(root)), 1)
    assert not report.ok and "model.w" in str(report.error)


def test_a_manifest_naming_an_unregistered_encoding_is_refused(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    with registered(XOR):
        _save(root)
    data = (root / manifest_key(1)).read_bytes()
    with pytest.raises(ManifestError, match=f"unknown codec '{CODEC}'"):
        Manifest.from_json(data)
    with pytest.raises(ManifestError, match=f"unknown codec '{CODEC}'"):
        Catalog(open_store(str(root))).read_manifest(1)
    assert not verify_checkpoint(open_store(str(root)), 1).ok
    with registered(XOR):  # the same bytes read again once the encoding is there
        assert Manifest.from_json(data).tensors["model.w"].chunks[0].location.codec == CODEC


def test_the_registry_refuses_a_codec_twice_or_none() -> None:
    class Thief(XorEncoding):
        codecs = frozenset({"zstd-planes-2"})

    class Nameless(XorEncoding):
        codecs = frozenset()

    with pytest.raises(InvalidArgumentError, match="registered to another encoding"):
        ENCODINGS.register(Thief())
    with pytest.raises(InvalidArgumentError, match="names no codec"):
        ENCODINGS.register(Nameless())
    assert ENCODINGS.of("zstd-planes-2") is ZSTD_PLANES
    with pytest.raises(InvalidArgumentError, match="unknown chunk codec 'xor-5a'"):
        ENCODINGS.of(CODEC)


def test_the_toy_manifest_is_plain_json(tmp_path: Path, xor: XorEncoding) -> None:
    """What the toy encoding records is what the manifest already records: a codec per chunk,
    stored lengths and CRC32Cs, no field of its own."""
    root = tmp_path / "ckpt"
    _save(root)
    document = json.loads((root / manifest_key(1)).read_text())
    entry = document["tensors"]["model.w"]["chunks"][0]
    fields = {"offsets", "sizes", "key", "offset", "length", "block_crc32c"}
    assert set(entry) == fields | {"codec", "stored_lengths", "stored_crc32c"}


def test_an_encoding_is_registered_once_and_a_scope_removes_only_what_it_added() -> None:
    """A scope around an encoding already there (the built-in zstd) is refused: leaving it
    must not take away what every compressed checkpoint needs."""
    with pytest.raises(InvalidArgumentError, match="already registered"), registered(ZSTD_PLANES):
        pass
    assert ENCODINGS.of("zstd-planes-2") is ZSTD_PLANES
    with registered(XOR):
        with pytest.raises(InvalidArgumentError, match="already registered"):
            ENCODINGS.register(XOR)
        assert ENCODINGS.knows(CODEC)
    assert not ENCODINGS.knows(CODEC)


def test_a_save_with_an_unregistered_encoding_is_refused_before_it_commits(
    tmp_path: Path,
) -> None:
    """Its manifest would name a codec no reader knows: the save fails, nothing commits."""
    root = tmp_path / "ckpt"
    with pytest.raises(CheckpointException) as failure:
        _save(root)
    [(error, _trace)] = failure.value.failures.values()
    assert isinstance(error, InvalidArgumentError)
    assert "encoding 'xor' is not registered" in str(error)
    assert Catalog(open_store(str(root))).steps() == []


def test_a_registered_encoding_meets_incremental_references_and_retention(
    tmp_path: Path, xor: XorEncoding
) -> None:
    """An unchanged tensor of a later save is referenced in the first step's encoded object;
    retention keeps that object, and the newest step verifies and restores bit-exactly."""
    root = tmp_path / "ckpt"
    root.mkdir()
    job = Catalog(open_store(str(root))).ensure_job().id
    torch.manual_seed(0)
    state = {"w": torch.randn(400, 700), "u": torch.randn(300, 500)}
    for step in (1, 2, 3):
        state = {"w": state["w"] + (step > 1), "u": state["u"]}
        options = WriterOptions(encodings=Always(XOR), incremental=True, job=job)
        writer = ObjectStoreWriter(open_store(str(root)), step, options)
        dcp.save(state, storage_writer=writer, planner=writer.save_planner(1), no_dist=True)
    catalog = Catalog(open_store(str(root)))
    location = catalog.read_manifest(3).tensors["u"].chunks[0].location
    assert location.key.startswith(step_folder(1)) and location.codec == CODEC
    catalog.retire(1)
    assert catalog.steps() == [3]
    assert verify_checkpoint(open_store(str(root)), 3).ok
    restored = {name: torch.zeros_like(tensor) for name, tensor in state.items()}
    dcp.load(restored, storage_reader=dcp_reader(str(root), 3), no_dist=True)
    assert_equal(state, restored)
