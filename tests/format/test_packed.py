"""Packed tensor records (format feature ``packed``): the compact form of runs of small tensors.

The promise: a packed manifest says exactly what its one-record-per-tensor form says (every
record parses back equal, and re-encodes to the same bytes), a forged packed record is refused
with a clear error before anything is allocated from its numbers, a step without a run stays in
the form older versions read, and one with a run is skipped, never misread, by a version that
does not know the feature.
"""

from __future__ import annotations

import base64
import itertools
import json
import random
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from spotckpt import CheckpointManager
from spotckpt.errors import UnknownFormatError
from spotckpt.format import features as features_module
from spotckpt.format.dtypes import BY_NAME
from spotckpt.format.manifest import (
    MAX_INT,
    ChunkLocation,
    Incremental,
    Manifest,
    ManifestError,
    ObjectRecord,
    TensorChunk,
    TensorRecord,
)
from spotckpt.format.packed import MIN_MEMBERS
from spotckpt.layout import manifest_key
from spotckpt.storage import open_store
from spotckpt.verify import verify_checkpoint

BLOCK = 64
OBJECT = "a-x/r00000-000.safetensors"
EARLIER = "step-000000001/a-y/r00000-000.safetensors"
DTYPES = ("float32", "bfloat16", "int64", "bool", "float64")
SHAPES = ((), (0,), (3,), (0, 5), (2, 3, 4), (40,), (7, 1, 1, 2))


def _location(key: str, offset: int, length: int, draw: random.Random, digest: bool) -> Any:
    blocks = max(1, -(-length // BLOCK))
    return ChunkLocation(
        key=key,
        offset=offset,
        length=length,
        block_crc32c=tuple(draw.randrange(1 << 32) for _ in range(blocks)),
        blake3=draw.randbytes(32).hex() if digest else "",
    )


def _synthetic(count: int, digest: bool, reference: bool, extras: bool, seed: int) -> Manifest:
    """A manifest whose `count` small tensors lie back to back in one object (in an earlier
    step's, with `reference`), with tensors that never pack around them (`extras`)."""
    draw = random.Random(seed)
    key = EARLIER if reference else OBJECT
    tensors: dict[str, TensorRecord] = {}
    offset = 16
    for n in range(count):
        dtype, shape = draw.choice(DTYPES), draw.choice(SHAPES)
        length = int(np.prod(shape, dtype=np.int64)) * BY_NAME[dtype].itemsize
        location = _location(key, offset, length, draw, digest)
        chunk = TensorChunk(offsets=(0,) * len(shape), sizes=shape, location=location)
        tensors[f"layer.{n % 7}.small.{n}"] = TensorRecord(
            dtype=dtype, shape=shape, chunks=(chunk,)
        )
        offset += length
    if extras:  # a tensor of two chunks, a gap, then another run
        half = _location(key, offset, 64, draw, digest)
        other = _location(key, offset + 64, 64, draw, digest)
        tensors["sharded"] = TensorRecord(
            dtype="float32",
            shape=(32,),
            chunks=(
                TensorChunk(offsets=(0,), sizes=(16,), location=half),
                TensorChunk(offsets=(16,), sizes=(16,), location=other),
            ),
        )
        offset += 128 + 8  # a gap: what follows is another run
        for n in range(MIN_MEMBERS):
            location = _location(key, offset, 4, draw, digest)
            tensors[f"after.{n}"] = TensorRecord(
                dtype="float32",
                shape=(1,),
                chunks=(TensorChunk(offsets=(0,), sizes=(1,), location=location),),
            )
            offset += 4
    objects = {key: ObjectRecord(key=key, size=offset + 32, crc32c=7, rank=0)}
    features = ["packed", *(["references"] if reference else [])]
    manifest = Manifest(
        step=3,
        attempt="x",
        world_size=1,
        block_size=BLOCK,
        objects=objects,
        tensors=tensors,
        values={"meta.epoch": _location(OBJECT if not reference else key, 0, 8, draw, False)},
        format="+".join(["spotckpt/1", *sorted(features)]),
    )
    if reference:
        manifest.objects[OBJECT] = ObjectRecord(key=OBJECT, size=16, crc32c=1, rank=0)
        manifest.values["meta.epoch"] = _location(OBJECT, 0, 8, draw, False)
        manifest.incremental = Incremental(job="job", depth=1)
    return manifest


CASES = list(
    itertools.product(
        (MIN_MEMBERS - 1, MIN_MEMBERS, 200), (False, True), (False, True), (False, True)
    )
)


@pytest.mark.parametrize(("count", "digest", "reference", "extras"), CASES)
def test_packed_records_say_what_the_json_form_says(
    count: int, digest: bool, reference: bool, extras: bool
) -> None:
    manifest = _synthetic(
        count, digest, reference, extras, seed=count * 8 + digest * 4 + reference * 2 + extras
    )
    data = manifest.to_json()
    document = json.loads(data)
    packed_members = sum(len(record["names"]) for record in document.get("packs", []))
    runs = (count >= MIN_MEMBERS) + extras
    assert len(document.get("packs", [])) == runs
    assert packed_members == (count if count >= MIN_MEMBERS else 0) + (MIN_MEMBERS if extras else 0)
    assert len(document["tensors"]) == len(manifest.tensors) - packed_members
    parsed = Manifest.from_json(data, expected_step=3)
    assert parsed.tensors == manifest.tensors
    assert parsed.values == manifest.values
    assert parsed.to_json() == data  # the same record, the same bytes
    plain = Manifest.from_json(data)
    plain.format = "+".join(f for f in plain.format.split("+") if f != "packed")
    assert "packs" not in json.loads(plain.to_json())
    assert Manifest.from_json(plain.to_json()).tensors == manifest.tensors
    if runs:
        assert len(data) < len(plain.to_json())


# Forged packed records: refused with a message, nothing allocated from their numbers ------------


@pytest.fixture(scope="module")
def packed_document() -> dict[str, Any]:
    return json.loads(_synthetic(40, True, False, True, seed=5).to_json())


def _b64(array: np.ndarray) -> str:
    return base64.b64encode(array.tobytes()).decode()


def _set(field: str, value: Any, record: int = 0) -> Any:
    return lambda d: d["packs"][record].__setitem__(field, value)


def _arr(field: str, change: Any) -> Any:
    """Decode a numeric field, change it, encode it back."""

    def mutate(d: dict[str, Any]) -> None:
        record = d["packs"][0]
        dtype = {"dtype": np.uint8, "ndims": np.uint8, "dims": "<i8", "crc32c": "<u4"}[field]
        array = np.frombuffer(base64.b64decode(record[field]), dtype).copy()
        record[field] = _b64(change(array))

    return mutate


def _first_dims(values: list[int]) -> Any:
    """The first member made a tensor of `values` dimensions (others keep theirs)."""

    def mutate(d: dict[str, Any]) -> None:
        record = d["packs"][0]
        ndims = np.frombuffer(base64.b64decode(record["ndims"]), np.uint8).copy()
        dims = np.frombuffer(base64.b64decode(record["dims"]), "<i8")
        rest = dims[int(ndims[0]) :]
        ndims[0] = len(values)
        record["ndims"] = _b64(ndims)
        record["dims"] = _b64(np.concatenate([np.array(values, "<i8"), rest]))

    return mutate


FORGERIES: list[tuple[str, Any, str]] = [
    ("not a list", lambda d: d.update(packs={}), "'packs' must be a list"),
    ("record not an object", lambda d: d["packs"].__setitem__(0, [1]), "must be a JSON object"),
    ("no feature", lambda d: d.update(format="spotckpt/1"), "does not name the feature"),
    ("unknown key", _set("key", "a-x/other"), "does not list"),
    ("missing key", lambda d: d["packs"][0].pop("key"), "'key' is missing"),
    ("negative offset", _set("offset", -1), "non-negative"),
    ("huge offset", _set("offset", 1 << 63), "non-negative"),
    ("offset past the object", _set("offset", 1 << 40), "beyond its object"),
    ("bool offset", _set("offset", True), "wrong type"),
    ("no names", _set("names", []), "holds no tensor"),
    ("a name not a string", lambda d: d["packs"][0]["names"].__setitem__(2, 5), "must be strings"),
    (
        "a name twice",
        lambda d: d["packs"][0]["names"].__setitem__(1, d["packs"][0]["names"][0]),
        "listed twice",
    ),
    (
        "a name in two records",
        lambda d: d["packs"][1]["names"].__setitem__(0, d["packs"][0]["names"][0]),
        "listed twice",
    ),
    (
        "a name also a tensor",
        lambda d: d["packs"][0]["names"].__setitem__(0, "sharded"),
        "both in a packed record",
    ),
    (
        "a name also a value",
        lambda d: d["packs"][0]["names"].__setitem__(0, "meta.epoch"),
        "both in a packed record",
    ),
    ("unknown dtype", _set("dtypes", ["object"]), "known dtypes"),
    ("empty dtype table", _set("dtypes", []), "known dtypes"),
    ("dtype index out of range", _arr("dtype", lambda a: np.full_like(a, 200)), "out of range"),
    ("one dtype short", _arr("dtype", lambda a: a[:-1]), "items expected"),
    ("too many dimensions", _first_dims([1] * 65), "out of range"),
    ("negative dimension", _first_dims([3, -1]), "negative"),
    ("dims short", _arr("dims", lambda a: a[:-1]), "items expected"),
    ("shape past the object", _first_dims([1 << 20, 1 << 10]), "beyond its object"),
    ("overflowing shape", _first_dims([1 << 62] * 4), "beyond its object"),
    (
        "overflowing shape of many dimensions",
        _first_dims([1 << 62] * 40 + [3]),
        "beyond its object",
    ),
    ("crc short", _arr("crc32c", lambda a: a[:-1]), "items expected"),
    ("crc long", _arr("crc32c", lambda a: np.concatenate([a, a[:1]])), "items expected"),
    ("not base64", _set("crc32c", "@@@@"), "not base64"),
    ("dims not whole items", _set("dims", base64.b64encode(bytes(7)).decode()), "items expected"),
    ("crcs not whole items", _set("crc32c", base64.b64encode(bytes(3)).decode()), "items expected"),
    ("blake3 short", _set("blake3", base64.b64encode(b"x" * 31).decode()), "32 bytes per tensor"),
    ("bytes of another tensor", _set("offset", 0), "overlap"),
]


@pytest.mark.parametrize(("name", "forge", "match"), FORGERIES, ids=[f[0] for f in FORGERIES])
def test_forged_packed_records_are_refused(
    packed_document: dict[str, Any], name: str, forge: Any, match: str
) -> None:
    document = json.loads(json.dumps(packed_document))
    forge(document)
    with pytest.raises(ManifestError, match=match):
        Manifest.from_json(json.dumps(document).encode())


def test_a_zero_dimension_makes_an_empty_member_whatever_the_others(
    packed_document: dict[str, Any],
) -> None:
    """An empty tensor may have huge other dimensions (the JSON form allows any shape of no
    element): its length is 0, not a wrapped product."""
    document = json.loads(json.dumps(packed_document))
    shape = [MAX_INT] * 30 + [0]  # a running product in floating point is inf, then nan
    _first_dims(shape)(document)
    crcs = np.frombuffer(base64.b64decode(document["packs"][0]["crc32c"]), "<u4")
    first = json.loads(json.dumps(packed_document))
    original = Manifest.from_json(json.dumps(first).encode())
    name = first["packs"][0]["names"][0]
    blocks = len(original.tensors[name].chunks[0].location.block_crc32c)
    document["packs"][0]["crc32c"] = _b64(np.concatenate([crcs[:1], crcs[blocks:]]))
    document["packs"][0]["offset"] += original.tensors[name].chunks[0].location.length
    parsed = Manifest.from_json(json.dumps(document).encode())
    assert parsed.tensors[name].shape == tuple(shape)
    assert parsed.tensors[name].chunks[0].location.length == 0


def test_more_packed_members_than_the_bound_are_refused(
    packed_document: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Packed members cost far more memory than manifest bytes: their own bound, below the
    manifest's bound on entries."""
    from spotckpt.format import packed as packed_module

    monkeypatch.setattr(packed_module, "MAX_MEMBERS", 45)  # the first record holds 40, then 16
    with pytest.raises(ManifestError, match="packed records hold more than 45 tensors"):
        Manifest.from_json(json.dumps(packed_document).encode())


def test_too_many_members_are_refused(
    packed_document: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    from spotckpt.format import manifest as manifest_module

    monkeypatch.setattr(manifest_module, "MAX_ENTRIES", 30)
    with pytest.raises(ManifestError, match="more than 30 tensors and values"):
        Manifest.from_json(json.dumps(packed_document).encode())


# Real saves ---------------------------------------------------------------------------------------


def _small(count: int, step: int) -> dict[str, Any]:
    generator = torch.Generator().manual_seed(step)
    state: dict[str, Any] = {
        f"experts.{n}.bias": torch.randn(n % 5 + 1, generator=generator) for n in range(count)
    }
    state["big"] = torch.randn(300_000, generator=generator)  # over 1 MiB: a chunk of its own
    state["half"] = torch.randn(9, generator=generator).to(torch.bfloat16)
    state["scalar"] = torch.tensor(float(step))
    state["epoch"] = step
    return state


def _format(root: Path, step: int) -> str:
    return str(json.loads(open_store(str(root)).get(manifest_key(step)))["format"])


def test_a_step_packs_only_where_a_run_is(tmp_path: Path) -> None:
    root = tmp_path / "ck"
    with CheckpointManager(str(root), preemption=False) as mgr:
        mgr.save(1, _small(10, 1))  # 13 whole tensors with big, half and scalar: no run
        mgr.save(2, _small(200, 2))
    assert _format(root, 1) == "spotckpt/1"  # readable by versions before the feature
    assert _format(root, 2) == "spotckpt/1+packed"
    restored = {
        key: torch.zeros_like(v) if isinstance(v, torch.Tensor) else 0
        for key, v in _small(200, 0).items()
    }
    with CheckpointManager(str(root), preemption=False) as mgr:
        assert mgr.restore(restored) == 2
    expected = _small(200, 2)
    assert all(
        torch.equal(restored[k], expected[k])
        for k in expected
        if isinstance(expected[k], torch.Tensor)
    )
    assert restored["epoch"] == 2
    assert verify_checkpoint(open_store(str(root)), 2).ok


def test_a_version_without_the_feature_skips_the_step(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An older spotckpt (no ``packed`` in its features) restores the step before, and leaves the
    packed step alone: skipped with a clear error, never quarantined, never misread."""
    root = tmp_path / "ck"
    with CheckpointManager(str(root), preemption=False) as mgr:
        mgr.save(1, _small(3, 1))
        mgr.save(2, _small(100, 2))
    monkeypatch.setattr(
        features_module, "KNOWN_FEATURES", frozenset({"compressed", "references", "signed"})
    )
    data = open_store(str(root)).get(manifest_key(2))
    with pytest.raises(UnknownFormatError, match="upgrade spotckpt"):
        Manifest.from_json(data)
    restored = _small(100, 0)
    with CheckpointManager(str(root), preemption=False) as mgr:
        assert mgr.restore(restored, strict=False) == 1  # step 1 had 3 of the 100 small ones
    assert torch.equal(restored["experts.2.bias"], _small(3, 1)["experts.2.bias"])
    monkeypatch.undo()
    with CheckpointManager(str(root), preemption=False) as mgr:
        assert mgr.steps() == [1, 2]
        assert mgr.restore(_small(100, 0)) == 2


def test_a_damaged_member_is_named_and_passed_over(tmp_path: Path) -> None:
    root = tmp_path / "ck"
    with CheckpointManager(str(root), preemption=False) as mgr:
        mgr.save(1, _small(64, 1))
        mgr.save(2, _small(64, 2))
    manifest = Manifest.from_json(open_store(str(root)).get(manifest_key(2)))
    location = manifest.tensors["experts.40.bias"].chunks[0].location
    path = root / "step-000000002" / location.key
    data = bytearray(path.read_bytes())
    data[location.offset] ^= 0x20
    path.write_bytes(bytes(data))
    report = verify_checkpoint(open_store(str(root)), 2)
    assert not report.ok
    assert any("experts.40.bias" in problem.tensors for problem in report.problems)
    restored = _small(64, 0)
    with CheckpointManager(str(root), preemption=False) as mgr:
        assert mgr.restore(restored) == 1
    assert torch.equal(restored["experts.40.bias"], _small(64, 1)["experts.40.bias"])
