"""Every field check of a manifest's tensors and chunks refuses what it refused before (issue 48).

Parsing takes shortcuts for the common entry (a plain int, a plain list, one chunk that is the
whole tensor); each forged field here lands just beside a shortcut and must still be refused with
a ManifestError that names the problem. `to_json` writes tuples as it wrote lists: byte for byte.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import pytest
import torch

from spotckpt import CheckpointManager
from spotckpt.format.manifest import (
    FORMAT_VERSION,
    ChunkLocation,
    Manifest,
    ManifestError,
    ObjectRecord,
    TensorChunk,
    TensorRecord,
)
from spotckpt.layout import manifest_key

Document = dict[str, Any]


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> bytes:
    """A real manifest: a 3x4 tensor, an empty one, a scalar and a value."""
    root = tmp_path_factory.mktemp("ck")
    state = {
        "w": torch.arange(12.0).reshape(3, 4),
        "empty": torch.zeros(0, 4),
        "scalar": torch.tensor(3.0),
        "meta": {"epoch": 2},
    }
    with CheckpointManager(str(root), preemption=False) as mgr:
        mgr.save(1, state)
        return mgr.store.get(manifest_key(1))


def _chunk(document: Document) -> Document:
    (chunk,) = document["tensors"]["w"]["chunks"]
    assert chunk["offsets"] == [0, 0] and chunk["sizes"] == [3, 4]
    return dict(chunk)


def _in_chunk(**fields: Any) -> Callable[[Document], None]:
    def mutate(document: Document) -> None:
        chunk = _chunk(document)
        chunk.update(fields)
        document["tensors"]["w"]["chunks"] = [chunk]

    return mutate


def _without(name: str) -> Callable[[Document], None]:
    def mutate(document: Document) -> None:
        chunk = _chunk(document)
        del chunk[name]
        document["tensors"]["w"]["chunks"] = [chunk]

    return mutate


def _in_tensor(**fields: Any) -> Callable[[Document], None]:
    return lambda document: document["tensors"]["w"].update(fields)


def _tensor_without(name: str) -> Callable[[Document], None]:
    return lambda document: document["tensors"]["w"].pop(name)


def _twice(document: Document) -> None:
    chunk = _chunk(document)
    document["tensors"]["w"]["chunks"] = [chunk, dict(chunk)]


LIST = "expected a list of non-negative integers below 2\\*\\*63"
FORGED: dict[str, tuple[Callable[[Document], None], str]] = {
    "offset-bool": (_in_chunk(offset=True), "field 'offset' has the wrong type"),
    "offset-float": (_in_chunk(offset=0.0), "field 'offset' has the wrong type"),
    "offset-string": (_in_chunk(offset="0"), "field 'offset' has the wrong type"),
    "offset-missing": (_without("offset"), "missing field 'offset'"),
    "length-negative": (_in_chunk(length=-1), "'length' must be a non-negative .* got -1$"),
    "length-2**63": (_in_chunk(length=2**63), f"'length' must be .* got {2**63}$"),
    "key-missing": (_without("key"), "missing field 'key'"),
    "key-int": (_in_chunk(key=7), "field 'key' has the wrong type"),
    "crcs-missing": (_without("block_crc32c"), "missing field 'block_crc32c'"),
    "crcs-dict": (_in_chunk(block_crc32c={"0": 1}), "field 'block_crc32c' has the wrong type"),
    "crcs-empty": (_in_chunk(block_crc32c=[]), "block_crc32c does not match its length of 48"),
    "crcs-two": (_in_chunk(block_crc32c=[1, 2]), "block_crc32c does not match"),
    "crc-2**32": (_in_chunk(block_crc32c=[2**32]), "block_crc32c does not match"),
    "crc-2**63": (_in_chunk(block_crc32c=[2**63]), LIST),
    "crc-bool": (_in_chunk(block_crc32c=[True]), LIST),
    "crc-negative": (_in_chunk(block_crc32c=[-1]), LIST),
    "offsets-missing": (_without("offsets"), "missing field 'offsets'"),
    "offsets-string": (_in_chunk(offsets="00"), "field 'offsets' has the wrong type"),
    "offsets-negative": (_in_chunk(offsets=[0, -1]), LIST),
    "offsets-float": (_in_chunk(offsets=[0, 0.0]), LIST),
    "sizes-2**63": (_in_chunk(sizes=[3, 2**63]), LIST),
    "sizes-null": (_in_chunk(sizes=None), "field 'sizes' has the wrong type"),
    "sizes-rank": (_in_chunk(sizes=[12]), "chunk rank differs from the tensor's 2 dimensions"),
    "whole-sizes-shifted": (
        _in_chunk(offsets=[1, 0]),
        r"chunk at \[1, 0\] of size \[3, 4\] reaches outside shape \[3, 4\]",
    ),
    "part-of-the-tensor": (
        _in_chunk(sizes=[3, 3], length=36),
        "chunks hold 9 elements, shape needs 12",
    ),
    "whole-twice": (_twice, "chunks hold 24 elements, shape needs 12"),
    "length-of-another-dtype": (_in_tensor(dtype="float16"), "has 48 bytes"),
    "chunk-not-object": (_in_tensor(chunks=[[0, 0]]), "chunk must be a JSON object"),
    "chunks-object": (_in_tensor(chunks={}), "field 'chunks' has the wrong type"),
    "shape-missing": (_tensor_without("shape"), "missing field 'shape'"),
    "shape-object": (_in_tensor(shape={"3": 4}), "field 'shape' has the wrong type"),
    "shape-bool": (_in_tensor(shape=[3, True]), LIST),
    "dtype-missing": (_tensor_without("dtype"), "missing field 'dtype'"),
    "dtype-list": (_in_tensor(dtype=["float32"]), "field 'dtype' has the wrong type"),
    "dtype-unknown": (_in_tensor(dtype="float33"), "unknown dtype 'float33'"),
}


@pytest.mark.parametrize("name", list(FORGED))
def test_a_forged_field_beside_a_shortcut_is_refused(saved: bytes, name: str) -> None:
    mutate, match = FORGED[name]
    document = json.loads(saved)
    mutate(document)
    with pytest.raises(ManifestError, match=match):
        Manifest.from_json(json.dumps(document).encode())


def test_the_saved_manifest_parses_and_is_written_back_byte_for_byte(saved: bytes) -> None:
    manifest = Manifest.from_json(saved, expected_step=1)
    assert manifest.tensors["empty"].shape == (0, 4)
    assert manifest.tensors["scalar"].chunks[0].sizes == ()
    assert manifest.to_json() == saved


def test_encoded_and_split_locations_are_written_as_lists() -> None:
    """What `to_json` writes is what json.dumps writes for the same document of lists."""
    key = "a-1/r00000-000.safetensors"
    encoded = ChunkLocation(
        key=key,
        offset=0,
        length=100,
        block_crc32c=(1, 2),
        blake3="ab" * 32,
        codec="zstd-planes-4",
        stored_lengths=(40, 20),
        stored_crc32c=(3, 4),
    )
    plain = ChunkLocation(key=key, offset=60, length=100, block_crc32c=(5, 6))
    manifest = Manifest(
        step=1,
        attempt="1",
        world_size=1,
        block_size=64,
        objects={key: ObjectRecord(key=key, size=200, crc32c=9, rank=0)},
        tensors={
            "w": TensorRecord(
                dtype="float32",
                shape=(10, 5),
                chunks=(
                    TensorChunk(offsets=(0, 0), sizes=(5, 5), location=encoded),
                    TensorChunk(offsets=(5, 0), sizes=(5, 5), location=plain),
                ),
            )
        },
        values={"v": ChunkLocation(key=key, offset=160, length=3, block_crc32c=(7,))},
        format=f"{FORMAT_VERSION}+compressed",
    )
    data = manifest.to_json()
    document = json.loads(data)
    assert json.dumps(document, separators=(",", ":")).encode() == data
    assert document["tensors"]["w"]["chunks"][0]["stored_lengths"] == [40, 20]
    assert Manifest.from_json(data) == manifest
