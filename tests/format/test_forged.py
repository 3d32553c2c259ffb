"""Forged manifests, folders and headers in a real checkpoint: a clear error, never a crash.

Each test saves real checkpoints into a local folder, forges bytes on disk and checks that
reading refuses them with a ManifestError (or SafetensorsFormatError) that names the problem, and
that `CheckpointManager.restore` falls back to the older good step.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import random
import re
import struct
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from spotckpt import CheckpointManager, SaveFailedError
from spotckpt.catalog import Catalog
from spotckpt.format import manifest as manifest_module
from spotckpt.format.bounded_json import MAX_DEPTH, MAX_NUMBER_DIGITS
from spotckpt.format.manifest import (
    ChunkLocation,
    Manifest,
    ManifestError,
    ObjectRecord,
    TensorChunk,
    TensorRecord,
)
from spotckpt.format.safetensors_io import SafetensorsFormatError, block_crcs, read_header
from spotckpt.layout import manifest_key, parse_step_folder, step_folder
from spotckpt.storage import ObjectStore, open_store
from spotckpt.verify import verify_checkpoint

from tests_support import plain_manifest_document

Document = dict[str, Any]


def _state(step: int) -> dict[str, Any]:
    return {"w": torch.arange(16.0).reshape(4, 4) * step, "meta": {"epoch": step}}


def _empty() -> dict[str, Any]:
    return {"w": torch.zeros(4, 4), "meta": {"epoch": -1}}


class CountingStore:
    """A real store that records how many bytes each read asks for (or returns, for `get`)."""

    def __init__(self, inner: ObjectStore) -> None:
        self.inner = inner
        self.asked: list[int] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def get(self, key: str) -> bytes:
        data = self.inner.get(key)
        self.asked.append(len(data))
        return data

    def get_range(self, key: str, start: int, length: int) -> bytes:
        self.asked.append(length)
        return self.inner.get_range(key, start, length)

    def get_range_into(self, key: str, start: int, buffer: memoryview) -> int:
        self.asked.append(buffer.nbytes)
        return self.inner.get_range_into(key, start, buffer)


@pytest.fixture
def root(tmp_path: Path) -> Path:
    """A checkpoint folder with committed steps 1 and 2."""
    path = tmp_path / "ck"
    with CheckpointManager(str(path), preemption=False) as mgr:
        mgr.save(1, _state(1))
        mgr.save(2, _state(2))
    return path


@pytest.fixture
def mgr(root: Path) -> Iterator[CheckpointManager]:
    manager = CheckpointManager(str(root), preemption=False)
    yield manager
    manager.close()


def _document(root: Path, step: int = 2) -> Document:
    return dict(json.loads((root / manifest_key(step)).read_bytes()))


def _forge(root: Path, data: bytes, step: int = 2) -> None:
    (root / manifest_key(step)).write_bytes(data)


def _assert_refused_and_falls_back(mgr: CheckpointManager, match: str) -> None:
    with pytest.raises(ManifestError, match=match):
        Catalog(mgr.store).read_manifest(2)
    target = _empty()
    assert mgr.restore(target) == 1
    assert torch.equal(target["w"], _state(1)["w"]) and target["meta"]["epoch"] == 1


def _with_metadata_text(root: Path, text: bytes) -> bytes:
    raw = (root / manifest_key(2)).read_bytes()
    assert raw.count(b'"user_metadata":{}') == 1
    return raw.replace(b'"user_metadata":{}', b'"user_metadata":{"x":' + text + b"}")


# Raw forgeries: nesting and numbers that json.loads alone cannot parse with bounded cost ------


@pytest.mark.parametrize(
    ("text", "match"),
    [
        (b"[" * 100_000 + b"]" * 100_000, f"nests deeper than {MAX_DEPTH} levels"),
        (b"{" + b'"a":{' * 100_000 + b"}" * 100_001, f"nests deeper than {MAX_DEPTH} levels"),
        (b"[" * 100_000, f"nests deeper than {MAX_DEPTH} levels"),  # and never closed
        (b"9" * 50_000, f"more than {MAX_NUMBER_DIGITS} digits"),
        (b"-" + b"1" * 50_000 + b".5e3", f"more than {MAX_NUMBER_DIGITS} digits"),
    ],
    ids=["list-100000", "object-100000", "unclosed-100000", "int-50000-digits", "float"],
)
def test_unbounded_json_is_refused(
    root: Path, mgr: CheckpointManager, text: bytes, match: str
) -> None:
    _forge(root, _with_metadata_text(root, text))
    _assert_refused_and_falls_back(mgr, match)


def test_huge_integer_step_is_refused(root: Path, mgr: CheckpointManager) -> None:
    raw = (root / manifest_key(2)).read_bytes()
    forged = re.sub(rb'"step":2\b', b'"step":' + b"1" * 50_000, raw)
    assert forged != raw
    _forge(root, forged)
    _assert_refused_and_falls_back(mgr, "more than 20 digits")


def test_brackets_and_digits_inside_strings_are_data(tmp_path: Path) -> None:
    """Only structure counts: strings full of brackets, digits and escapes read back as saved."""
    metadata = {
        "brackets": "[{" * 5_000,
        "digits": "7" * 5_000,
        "escaped": '\\"[[[\\' + "]" * 100,
        "deep": {"a": [[[{"b": [1, 2, 18446744073709551615]}]]]},
    }
    with CheckpointManager(str(tmp_path), preemption=False) as mgr:
        mgr.save(5, _state(5), user_metadata=metadata)
        assert mgr.read_manifest(5).user_metadata == metadata
        target = _empty()
        assert mgr.restore(target) == 5 and torch.equal(target["w"], _state(5)["w"])


@pytest.mark.parametrize(
    "metadata",
    [{"seed": 2**70}, {"deep": json.loads("[" * (MAX_DEPTH + 1) + "]" * (MAX_DEPTH + 1))}],
    ids=["int-22-digits", "too-deep"],
)
def test_metadata_that_could_not_be_read_back_is_refused_on_save(
    tmp_path: Path, metadata: dict[str, Any]
) -> None:
    with CheckpointManager(str(tmp_path), preemption=False) as mgr:
        with pytest.raises(SaveFailedError, match=r"user_metadata (nests deeper|holds a number)"):
            mgr.save(3, _state(3), user_metadata=metadata)
        assert mgr.steps() == []


# Size: refused by the store's head() before a byte of the manifest is read -------------------


@pytest.mark.parametrize(
    ("size", "bound"),
    [(200_000_000, 64 << 20), (manifest_module.MAX_MANIFEST_BYTES + 1, None)],
    ids=["200MB-bound-64MiB", "default-bound-plus-one"],
)
def test_oversized_manifest_is_refused_before_reading(
    root: Path, monkeypatch: pytest.MonkeyPatch, size: int, bound: int | None
) -> None:
    if bound is not None:
        monkeypatch.setattr(manifest_module, "MAX_MANIFEST_BYTES", bound)
    with open(root / manifest_key(2), "wb") as file:  # whitespace, then a sparse tail: no disk used
        file.write(b" " * 4096)
        file.truncate(size)
    store = CountingStore(open_store(str(root)))
    with pytest.raises(ManifestError, match=f"is {size} bytes, more than"):
        Catalog(store).read_manifest(2)  # type: ignore[arg-type]
    with CheckpointManager(str(root), preemption=False, store=store) as mgr:  # type: ignore[arg-type]
        target = _empty()
        assert mgr.restore(target) == 1 and torch.equal(target["w"], _state(1)["w"])
    assert store.asked and max(store.asked) < 1 << 20


# Field-level forgeries -------------------------------------------------------------------------


def _w_chunk(document: Document) -> dict[str, Any]:
    chunks = document["tensors"]["w"]["chunks"]
    assert len(chunks) == 1 and chunks[0]["sizes"] == [4, 4]
    return dict(chunks[0])


def _pieces(root: Path, document: Document, boxes: list[tuple[list[int], list[int]]]) -> None:
    """Replace w's one chunk by `boxes` (offsets, sizes), each pointing at the bytes it would hold
    in row-major order with matching CRCs (right for row blocks; for others only the sizes)."""
    whole = _w_chunk(document)
    data = (root / step_folder(2) / whole["key"]).read_bytes()
    chunks = []
    for offsets, sizes in boxes:
        start = whole["offset"] + (offsets[0] * 4 + offsets[1]) * 4
        length = math.prod(sizes) * 4
        piece = data[start : start + length]
        crcs = list(block_crcs(piece, document["block_size"]))
        chunks.append(
            dict(
                whole, offsets=offsets, sizes=sizes, offset=start, length=length, block_crc32c=crcs
            )
        )
    document["tensors"]["w"]["chunks"] = chunks


def test_forged_row_split_is_valid_and_restores(root: Path, mgr: CheckpointManager) -> None:
    """The control for the chunk forgeries below: a correct split of w reads back exactly."""
    document = _document(root)
    _pieces(root, document, [([0, 0], [1, 4]), ([1, 0], [3, 4])])
    _forge(root, json.dumps(document).encode())
    assert len(Catalog(mgr.store).read_manifest(2).tensors["w"].chunks) == 2
    target = _empty()
    assert mgr.restore(target) == 2 and torch.equal(target["w"], _state(2)["w"])


def _set(path: str, value: Any) -> Callable[[Path, Document], None]:
    def mutate(_root: Path, document: Document) -> None:
        *parents, last = path.split(".")
        node: Any = document
        for name in parents:
            node = node[int(name)] if isinstance(node, list) else node[name]
        node[last] = value

    return mutate


def _boxes(*boxes: tuple[list[int], list[int]]) -> Callable[[Path, Document], None]:
    return lambda root, document: _pieces(root, document, list(boxes))


def _beyond_object(_root: Path, document: Document) -> None:
    chunk = document["tensors"]["w"]["chunks"][0]
    size = next(o["size"] for o in document["objects"] if o["key"] == chunk["key"])
    chunk["offset"] = size - 10


def _same_name_as_value(_root: Path, document: Document) -> None:
    document["values"]["w"] = document["values"]["meta.epoch"]


FORGERIES: dict[str, tuple[Callable[[Path, Document], None], str]] = {
    "world-size-0": (_set("world_size", 0), "world_size must be at least 1, got 0"),
    "world-size-minus-1": (_set("world_size", -1), "'world_size' must be a non-negative"),
    "rank-beyond-world": (_set("objects.0.rank", 1), "rank 1 is not below the world_size of 1"),
    "step-differs-from-folder": (_set("step", 3), "folder of step 2 claims step 3"),
    "overlap": (
        _boxes(([0, 0], [2, 4]), ([2, 0], [2, 2]), ([1, 2], [2, 2])),
        r"tensor 'w': chunks overlap \(and so leave a gap\)",
    ),
    "same-offsets": (
        _boxes(([0, 0], [4, 4]), ([0, 0], [0, 4])),
        "two chunks start at the same offsets",
    ),
    "gap": (_boxes(([0, 0], [2, 4]), ([3, 0], [1, 4])), "chunks hold 12 elements, shape needs 16"),
    "outside-shape": (
        _boxes(([0, 0], [3, 4]), ([3, 0], [2, 4])),
        r"chunk at \[3, 0\] of size \[2, 4\] reaches outside shape \[4, 4\]",
    ),
    "beyond-object": (_beyond_object, "lie beyond the"),
    "byte-length-mismatch": (_set("tensors.w.chunks.0.length", 60), "has 60 bytes"),
    "shape-too-many-elements": (
        _set("tensors.w.shape", [2**62, 4]),
        "has 2\\*\\*63 elements or more",
    ),
    "offset-beyond-int64": (_set("tensors.w.chunks.0.offsets", [2**63, 0]), "below 2\\*\\*63"),
    "too-many-dims": (_set("tensors.w.shape", [1] * 65), "65 dimensions, more than 64"),
    "tensor-and-value": (_same_name_as_value, "'w' both as a tensor and as a value"),
}


@pytest.mark.parametrize("name", list(FORGERIES))
def test_forged_field_is_refused_and_restore_falls_back(
    root: Path, mgr: CheckpointManager, name: str
) -> None:
    mutate, match = FORGERIES[name]
    document = _document(root)
    mutate(root, document)
    _forge(root, json.dumps(document).encode())
    _assert_refused_and_falls_back(mgr, match)


def test_tiling_work_is_bounded(
    root: Path, mgr: CheckpointManager, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(manifest_module, "MAX_TILING_CORNERS", 3)
    document = _document(root)
    _pieces(root, document, [([0, 0], [2, 4]), ([2, 0], [2, 4])])  # 2 chunks x 2 corners
    _forge(root, json.dumps(document).encode())
    _assert_refused_and_falls_back(mgr, "4 corners in all, more than 3")


def _with(values: tuple[int, ...], dim: int, value: int) -> tuple[int, ...]:
    return (*values[:dim], value, *values[dim + 1 :])


def _random_chunks(rng: random.Random, shape: tuple[int, ...]) -> list[tuple[tuple[int, ...], ...]]:
    """A random guillotine tiling of `shape`, then perhaps one chunk shifted by one."""
    boxes = [(tuple(0 for _ in shape), shape)]
    for _ in range(rng.randint(1, 6)):
        index = rng.randrange(len(boxes))
        offsets, sizes = boxes[index]
        dim = rng.randrange(len(shape))
        if sizes[dim] < 2:
            continue
        cut = rng.randrange(1, sizes[dim])
        first = (offsets, _with(sizes, dim, cut))
        second = (_with(offsets, dim, offsets[dim] + cut), _with(sizes, dim, sizes[dim] - cut))
        boxes[index : index + 1] = [first, second]
    if rng.random() < 0.6:
        index = rng.randrange(len(boxes))
        offsets, sizes = boxes[index]
        dim = rng.randrange(len(shape))
        moved = max(0, min(shape[dim] - sizes[dim], offsets[dim] + rng.choice((-1, 1))))
        boxes[index] = (_with(offsets, dim, moved), sizes)
    return boxes


def _covered_once(shape: tuple[int, ...], boxes: list[tuple[tuple[int, ...], ...]]) -> bool:
    cover: dict[tuple[int, ...], int] = {}
    for offsets, sizes in boxes:
        for point in itertools.product(
            *[range(o, o + n) for o, n in zip(offsets, sizes, strict=True)]
        ):
            cover[point] = cover.get(point, 0) + 1
    return len(cover) == math.prod(shape) and set(cover.values()) == {1}


def test_tiling_check_agrees_with_counting_every_element() -> None:
    """Random tilings of 1- to 3-D shapes, half of them broken by one shifted chunk."""
    rng = random.Random(7)
    verdicts = []
    for _ in range(400):
        shape = tuple(rng.randint(1, 4) for _ in range(rng.randint(1, 3)))
        boxes = _random_chunks(rng, shape)
        location = ChunkLocation(
            key="a-x/r00000-000.safetensors", offset=0, length=0, block_crc32c=(0,)
        )
        starts = itertools.accumulate((math.prod(n) for _o, n in boxes), initial=0)
        chunks = tuple(  # back to back, as a writer stores them
            TensorChunk(
                offsets=o,
                sizes=n,
                location=dataclasses.replace(location, offset=start, length=math.prod(n)),
            )
            for (o, n), start in zip(boxes, starts, strict=False)
        )
        manifest = Manifest(
            step=1,
            attempt="x",
            world_size=1,
            block_size=1 << 16,
            objects={location.key: ObjectRecord(key=location.key, size=64, crc32c=0, rank=0)},
            tensors={"t": TensorRecord(dtype="uint8", shape=shape, chunks=chunks)},
            values={},
        )
        try:
            Manifest.from_json(manifest.to_json())
            verdicts.append((True, _covered_once(shape, boxes)))
        except ManifestError as error:
            assert re.search("overlap|two chunks start|chunks hold", str(error))
            verdicts.append((False, _covered_once(shape, boxes)))
    assert all(accepted == expected for accepted, expected in verdicts)
    assert 50 < sum(accepted for accepted, _ in verdicts) < 350


# Byte ranges: no two stored items share a byte ------------------------------------------------

MEMBERS = 20  # small tensors, more than PACK_MIN_TENSORS: saved as one pack


def _packed_state(step: int) -> dict[str, Any]:
    model = {f"b{i}": torch.full((4,), 100.0 * step + i) for i in range(MEMBERS)}
    model["empty"] = torch.zeros(0)  # packed too: no bytes, where a neighbour's bytes end
    return {"model": model, "meta": {"epoch": step, "seen": step + 10}}


def _packed_target() -> dict[str, Any]:
    target = _packed_state(0)
    for tensor in target["model"].values():
        tensor.zero_()
    return target


@pytest.fixture
def packed_root(tmp_path: Path) -> Path:
    """Steps 1 and 2 of a state whose small tensors (an empty one among them) share one pack."""
    path = tmp_path / "packed"
    with CheckpointManager(str(path), preemption=False) as mgr:
        mgr.save(1, _packed_state(1))
        mgr.save(2, _packed_state(2))
    return path


def _entry(document: Document, name: str) -> dict[str, Any]:
    if name in document["values"]:
        return dict(document["values"][name])
    (chunk,) = document["tensors"][name]["chunks"]
    return dict(chunk)


def _point(root: Path, document: Document, name: str, offset: int) -> None:
    """Point `name`'s one location at `offset` of its object, CRC32Cs made right for the bytes
    found there (anyone who can read the object can compute them)."""
    entry = _entry(document, name)
    data = (root / step_folder(2) / entry["key"]).read_bytes()
    piece = data[offset : offset + entry["length"]]
    update = {"offset": offset, "block_crc32c": list(block_crcs(piece, document["block_size"]))}
    if name in document["values"]:
        document["values"][name].update(update)
    else:
        document["tensors"][name]["chunks"][0].update(update)


def _onto(name: str, other: str, shift: int = 0) -> Callable[[Path, Document], None]:
    return lambda root, document: _point(
        root, document, name, _entry(document, other)["offset"] + shift
    )


OVERLAPS: dict[str, Callable[[Path, Document], None]] = {
    "member-onto-member": _onto("model.b4", "model.b3"),
    "member-half-over-member": _onto("model.b4", "model.b3", shift=8),
    "value-onto-value": _onto("meta.seen", "meta.epoch"),
}


@pytest.mark.parametrize("name", list(OVERLAPS))
def test_an_item_pointed_at_another_items_bytes_is_refused_and_restore_falls_back(
    packed_root: Path, name: str
) -> None:
    """A forged location onto bytes that another tensor or value owns, its CRC32Cs copied, passes
    every checksum: the overlap itself is refused, by restore (which falls back) and verify.
    (Inside a packed record no member can be pointed elsewhere: offsets follow from lengths;
    tests/format/test_packed.py moves a whole record onto other bytes.)"""
    document = plain_manifest_document((packed_root / manifest_key(2)).read_bytes())
    assert _entry(document, "meta.seen")["length"] == _entry(document, "meta.epoch")["length"]
    OVERLAPS[name](packed_root, document)
    _forge(packed_root, json.dumps(document).encode())
    with pytest.raises(ManifestError, match=r"object '.+': bytes \d+\.\.\d+ of .+ overlap bytes"):
        Catalog(open_store(str(packed_root))).read_manifest(2)
    (problem,) = verify_checkpoint(open_store(str(packed_root)), 2).problems
    assert problem.kind == "manifest" and "overlap" in problem.message
    target = _packed_target()
    with CheckpointManager(str(packed_root), preemption=False) as mgr:
        assert mgr.restore(target) == 1
    assert all(torch.equal(target["model"][k], v) for k, v in _packed_state(1)["model"].items())
    assert target["meta"] == {"epoch": 1, "seen": 11}


def test_members_back_to_back_and_empty_ones_are_valid(packed_root: Path) -> None:
    """The control: the real pack's members touch, the empty one lies where a neighbour's bytes
    end, and the checkpoint verifies and restores."""
    manifest = Catalog(open_store(str(packed_root))).read_manifest(2)
    ranges = sorted(
        (t.chunks[0].location.offset, t.chunks[0].location.length)
        for t in manifest.tensors.values()
    )
    empty = [offset for offset, length in ranges if not length]
    held = [(offset, length) for offset, length in ranges if length]
    assert len(held) == MEMBERS and all(a + n == b for (a, n), (b, _) in itertools.pairwise(held))
    assert len(empty) == 1 and empty[0] in [offset + length for offset, length in held]
    assert verify_checkpoint(open_store(str(packed_root)), 2).ok
    target = _packed_target()
    with CheckpointManager(str(packed_root), preemption=False) as mgr:
        assert mgr.restore(target) == 2
    assert target["meta"] == {"epoch": 2, "seen": 12}


# Step folders: only the canonical spelling is a step ----------------------------------------


@pytest.mark.parametrize(
    ("name", "step"),
    [
        ("step-000000012", 12),
        ("step-000000000", 0),
        ("step-999999999", 999_999_999),
        ("step-1000000000", 1_000_000_000),  # past 9 digits the padding is simply none
        ("step-0000000012", None),  # one zero too many
        ("step-01000000000", None),
        ("step-00000001\uff12", None),  # fullwidth digit two
        ("step-\u0660\u0660\u0660\u0660\u0660\u0660\u0660\u0661\u0662", None),  # Arabic-Indic
        ("step-000000012\n", None),
        ("step-000000012 ", None),
        (" step-000000012", None),
        ("step-00000012", None),
        ("step-00000001_2", None),
        ("step-+00000012", None),
        ("step-" + "9" * 30, None),
        ("step-", None),
        ("Step-000000012", None),
    ],
)
def test_parse_step_folder_accepts_only_canonical_names(name: str, step: int | None) -> None:
    assert parse_step_folder(name) == step
    if step is not None:
        assert step_folder(step) == name


@pytest.mark.parametrize(
    "look_alike", ["step-0000000012", "step-00000001\uff12", "step-000000012\n"]
)
def test_look_alike_folder_is_never_restored(tmp_path: Path, look_alike: str) -> None:
    root = tmp_path / "ck"
    with CheckpointManager(str(root), preemption=False) as mgr:
        mgr.save(1, _state(1))
        mgr.save(12, _state(12))
    (root / step_folder(12)).rename(root / look_alike)  # a valid step-12 manifest inside
    assert Manifest.from_json((root / look_alike / "manifest.json").read_bytes()).step == 12
    with CheckpointManager(str(root), preemption=False) as mgr:
        assert mgr.steps() == [1] and mgr.latest_step() == 1
        target = _empty()
        assert mgr.restore(target) == 1
        assert torch.equal(target["w"], _state(1)["w"]) and target["meta"]["epoch"] == 1
        mgr.gc()
    assert (root / look_alike / "manifest.json").exists()  # not ours to judge, or to delete


# Random damage: only ManifestError, and whatever parses also converts to DCP metadata ------


def _damaged(raw: bytes, rng: random.Random) -> bytes:
    kind = rng.randrange(5)
    data = bytearray(raw)
    if kind == 0:  # flip bits of a few bytes
        for _ in range(rng.randint(1, 4)):
            data[rng.randrange(len(data))] ^= 1 << rng.randrange(8)
    elif kind == 1:  # truncate
        del data[rng.randrange(len(data)) :]
    elif kind == 2:  # bytes from elsewhere in the document, spliced in
        start, length = rng.randrange(len(data)), rng.randint(1, 40)
        at = rng.randrange(len(data))
        data[at:at] = data[start : start + length]
    elif kind == 3:  # one digit changed
        digits = [i for i, byte in enumerate(data) if 0x30 <= byte <= 0x39]
        data[rng.choice(digits)] = rng.choice(b"0123456789")
    else:  # one number replaced by a hostile token
        numbers = [m.span() for m in re.finditer(rb"-?[0-9]+", raw)]
        start, end = rng.choice(numbers)
        token = rng.choice(
            [
                *(b"-1", b"0", b"1e999", b"2.5", b"true", b"null", b'"7"', b"[]", b"{}"),
                *(b"9" * 25, b"9" * 5000, str(2**63).encode(), str(2**64).encode()),
                b"[" * 70 + b"]" * 70,
            ]
        )
        data[start:end] = token
    return bytes(data)


def test_random_damage_raises_only_manifest_error(root: Path) -> None:
    raw = (root / manifest_key(2)).read_bytes()
    rng = random.Random(20240611)
    outcomes = {"refused": 0, "parsed": 0}
    for _ in range(400):
        data = _damaged(raw, rng)
        try:
            manifest = Manifest.from_json(data, expected_step=2)
        except ManifestError:
            outcomes["refused"] += 1
            continue
        manifest.to_dcp()
        outcomes["parsed"] += 1
    assert outcomes["refused"] > 200 and outcomes["parsed"] > 10, outcomes


# Safetensors headers ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("body", "match"),
    [
        (struct.pack("<Q", 2**62) + b"{}", "header length 4611686018427387904 is absurd"),
        (struct.pack("<Q", 2**64 - 1) + b"{}" * 8, "is absurd"),
        (struct.pack("<Q", 2) + b"{", "is absurd"),  # claims more than the object holds
        (struct.pack("<Q", 16) + b"[" * 8 + b"]" * 8, "is not a JSON object"),
    ],
    ids=["2**62", "2**64-1", "longer-than-object", "not-an-object"],
)
def test_forged_safetensors_header_length(tmp_path: Path, body: bytes, match: str) -> None:
    store = CountingStore(open_store(str(tmp_path)))
    store.put("bad.safetensors", body)
    with pytest.raises(SafetensorsFormatError, match=match):
        read_header(store, "bad.safetensors")  # type: ignore[arg-type]
    assert max(store.asked) <= max(8, len(body) - 8)  # never a read sized by the claim


@pytest.mark.parametrize(
    ("header", "match"),
    [
        (b"[" * 100_000 + b"]" * 100_000, f"nests deeper than {MAX_DEPTH}"),
        (b'{"t":{"dtype":"F32","shape":[' + b"9" * 50_000 + b'],"data_offsets":[0,4]}}', "digits"),
        (b'{"t":{"dtype":"F32","shape":' + b"[1," * 65 + b"]", "nests deeper|not valid JSON"),
        (b'{"t":{"dtype":"F32","shape":[' + b"1," * 64 + b'1],"data_offsets":[0,4]}}', "65 dim"),
        (b'{"t":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}}', "data ends at byte"),
        (b'{"t":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}}', "overlap or leave gaps"),
        (b'{"a":1', "not valid JSON"),
        (b"\xff\xfe{}", "not UTF-8"),
    ],
    ids=["deep", "digits", "unclosed", "dims", "beyond-object", "gap", "truncated", "not-utf8"],
)
def test_forged_safetensors_header_json(tmp_path: Path, header: bytes, match: str) -> None:
    store = open_store(str(tmp_path))
    store.put("bad.safetensors", struct.pack("<Q", len(header)) + header + b"\0" * 4)
    with pytest.raises(SafetensorsFormatError, match=match):
        read_header(store, "bad.safetensors")
