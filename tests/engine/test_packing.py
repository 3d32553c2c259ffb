"""Small tensors saved in packs: the manifest, restores, exports and verify cannot tell.

Saves go through `PackingSavePlanner`, which concatenates small plain tensors into a few DCP
items; the writer records each member as a tensor of its own. These tests save real states
(every stored dtype, scalars, empty tensors, a large tensor beside them), restore them bit for
bit on a moto server over HTTP and on a local folder, export and verify them, damage one
member's bytes, and check how packs are formed.
"""

from __future__ import annotations

import itertools
import json
import struct
import weakref
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

import spotckpt.engine.packing as packing
from spotckpt import CheckpointManager, CorruptCheckpointError
from spotckpt.engine.packing import PACK_PREFIX, PackingSavePlanner, pack_small_tensors
from spotckpt.export import export_hf
from spotckpt.format.manifest import Manifest
from spotckpt.layout import manifest_key, step_folder
from spotckpt.storage import open_store
from spotckpt.verify import verify_checkpoint

SMALL = 300  # small tensors per state: well above PACK_MIN_TENSORS


def _state(step: int) -> dict[str, Any]:
    generator = torch.Generator().manual_seed(step)
    model: dict[str, torch.Tensor] = {}
    for i in range(SMALL):
        model[f"experts.{i}.bias"] = torch.randn(17 + i % 50, generator=generator)
    model["norm.scale"] = torch.tensor(1.5 * step)  # a scalar
    model["empty"] = torch.zeros(0, 3)
    model["half"] = torch.randn(64, generator=generator).to(torch.bfloat16)
    model["mask"] = torch.rand(33, generator=generator) > 0.5
    model["ids"] = torch.arange(40, dtype=torch.int64) * step
    model["big"] = torch.randn(1 << 19, generator=generator)  # 2 MiB: saved as it is
    return {"model": model, "meta": {"epoch": step}}


def _zeros(state: dict[str, Any]) -> dict[str, Any]:
    return {
        "model": {k: torch.zeros_like(v) for k, v in state["model"].items()},
        "meta": {"epoch": -1},
    }


def _same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return all(
        a["model"][k].dtype == v.dtype and torch.equal(a["model"][k], v)
        for k, v in b["model"].items()
    )


def _manifest(root: Path, step: int) -> Manifest:
    return Manifest.from_json((root / manifest_key(step)).read_bytes())


def _header_names(path: Path) -> set[str]:
    data = path.read_bytes()
    (length,) = struct.unpack("<Q", data[:8])
    return set(json.loads(data[8 : 8 + length])) - {"__metadata__"}


@pytest.fixture(params=["s3", "local"])
def uri(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "s3":
        return str(request.getfixturevalue("s3_uri"))
    return str(tmp_path / "ck")


@pytest.mark.process
def test_packed_tensors_restore_bit_for_bit_as_tensors_of_their_own(uri: str) -> None:
    saved = _state(3)
    with CheckpointManager(uri, preemption=False) as mgr:
        mgr.save(3, saved)
        target = _zeros(saved)
        assert mgr.restore(target) == 3
    assert _same(target, saved) and target["meta"] == {"epoch": 3}
    manifest = Manifest.from_json(open_store(uri).get(manifest_key(3)))
    assert set(manifest.tensors) == {f"model.{k}" for k in saved["model"]}  # no pack listed
    for fqn, record in manifest.tensors.items():
        (chunk,) = record.chunks
        assert chunk.sizes == tuple(saved["model"][fqn.removeprefix("model.")].shape)


def test_the_object_holds_one_pack_and_each_member_its_own_location(tmp_path: Path) -> None:
    root = tmp_path / "ck"
    saved = _state(1)
    with CheckpointManager(str(root), preemption=False) as mgr:
        mgr.save(1, saved)
    manifest = _manifest(root, 1)
    (key,) = manifest.objects
    names = _header_names(root / step_folder(1) / key)
    packs = {n for n in names if n.startswith(PACK_PREFIX)}
    assert len(packs) == 1 and "model.big" in names and "model.experts.0.bias" not in names
    locations = sorted(
        (r.chunks[0].location.offset, r.chunks[0].location.length)
        for f, r in manifest.tensors.items()
        if f != "model.big"
    )
    # The members lie back to back inside the pack, without overlap.
    for (offset, length), (following, _length) in itertools.pairwise(locations):
        assert offset + length == following


def test_export_and_verify_see_every_packed_tensor(tmp_path: Path) -> None:
    root = tmp_path / "ck"
    saved = _state(2)
    with CheckpointManager(str(root), preemption=False) as mgr:
        mgr.save(2, saved)
    report = verify_checkpoint(open_store(str(root)), 2)
    assert report.ok, report.problems
    export_hf(open_store(str(root)), 2, str(tmp_path / "hf"))
    exported: dict[str, torch.Tensor] = {}
    for shard in (tmp_path / "hf").glob("*.safetensors"):
        exported.update(load_file(str(shard)))
    for name, tensor in saved["model"].items():
        assert torch.equal(exported[name], tensor), name


def test_a_flipped_byte_in_one_member_names_that_member(tmp_path: Path) -> None:
    root = tmp_path / "ck"
    with CheckpointManager(str(root), preemption=False) as mgr:
        mgr.save(1, _state(1))
        mgr.save(2, _state(2))
    location = _manifest(root, 2).tensors["model.experts.7.bias"].chunks[0].location
    path = root / step_folder(2) / location.key
    data = bytearray(path.read_bytes())
    data[location.offset + 3] ^= 0x40
    path.write_bytes(bytes(data))
    (problem,) = verify_checkpoint(open_store(str(root)), 2).problems
    assert problem.tensors == ("model.experts.7.bias",)
    target = _zeros(_state(1))
    match = r"CRC32C mismatch .*'model\.experts\.7\.bias'"
    with CheckpointManager(str(root), preemption=False) as mgr:
        with pytest.raises(CorruptCheckpointError, match=match):
            mgr.restore(target, step=2)
        assert mgr.restore(target) == 1  # the damaged step is skipped
    assert _same(target, _state(1))


def test_few_small_tensors_are_saved_as_they_are(tmp_path: Path) -> None:
    root = tmp_path / "ck"
    state = {"model": {f"b{i}": torch.ones(4) * i for i in range(packing.PACK_MIN_TENSORS - 1)}}
    with CheckpointManager(str(root), preemption=False) as mgr:
        mgr.save(1, state)
    (key,) = _manifest(root, 1).objects
    names = _header_names(root / step_folder(1) / key)
    assert not any(n.startswith(PACK_PREFIX) for n in names)


def test_packs_are_bounded_named_by_their_members_and_skip_large_and_odd_tensors(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(packing, "PACK_MAX_BYTES", 1000)
    flat: dict[str, Any] = {f"t{i:03d}": torch.full((50,), float(i)) for i in range(40)}  # 200 B
    flat["large"] = torch.zeros(packing.PACK_MAX_TENSOR_BYTES // 4 + 1)
    flat["value"] = 7
    packed, packs = pack_small_tensors(flat)
    assert len(packs) == 8  # 40 tensors of 200 bytes, 5 to a pack of at most 1000
    assert "large" in packed and packed["value"] == 7
    assert not any(name.startswith("t") for name in packed)
    members = [m for pack in packs.values() for m in pack.members]
    assert sorted(m.fqn for m in members) == sorted(f"t{i:03d}" for i in range(40))
    for name, pack in packs.items():
        assert packed[name].device.type == "meta"  # DCP plans with a placeholder
        data = pack.data()
        assert packed[name].shape == data.shape
        for member in pack.members:
            stored = data[member.offset : member.offset + member.nbytes]
            assert torch.equal(stored.view(torch.float32), flat[member.fqn])
    again, _packs = pack_small_tensors(
        {k: v.clone() if k != "value" else v for k, v in flat.items()}
    )
    assert set(again) == set(packed)  # the same members make the same pack names
    renamed = dict(flat)
    renamed["t000_renamed"] = renamed.pop("t000")
    assert set(pack_small_tensors(renamed)[1]) != set(packs)


def test_the_planner_packs_after_flattening_a_nested_state() -> None:
    planner = PackingSavePlanner()
    state = {"opt": {"state": {str(i): {"step": torch.tensor(float(i))} for i in range(40)}}}
    planner.set_up_planner(state, is_coordinator=True)
    (pack,) = planner.packs.values()
    members = pack.members
    assert {m.fqn for m in members} == {f"opt.state.{i}.step" for i in range(40)}
    assert all(m.shape == () and m.dtype == "float32" for m in members)


# Restoring through runs ------------------------------------------------------------------------


class CountingReads:
    """A real store that counts the ranged reads into buffers asked of it."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.lengths: list[int] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def get_range_into(self, key: str, start: int, buffer: memoryview) -> int:
        self.lengths.append(buffer.nbytes)
        return self.inner.get_range_into(key, start, buffer)


@pytest.mark.process
def test_a_restore_reads_packed_tensors_as_a_few_runs(uri: str) -> None:
    saved = _state(4)
    with CheckpointManager(uri, preemption=False) as mgr:
        mgr.save(4, saved)
    store = CountingReads(open_store(uri))
    target = _zeros(saved)
    with CheckpointManager(uri, preemption=False, store=store) as mgr:
        assert mgr.restore(target) == 4
    assert _same(target, saved)
    # model.big, one run of the ~300 small tensors, the value: not one read per tensor.
    assert len(store.lengths) <= 4, store.lengths


def test_a_destination_a_run_does_not_fit_loads_its_members_one_by_one(tmp_path: Path) -> None:
    root = tmp_path / "ck"
    saved = _state(5)
    with CheckpointManager(str(root), preemption=False) as mgr:
        mgr.save(5, saved)
    target = _zeros(saved)
    # 40 elements, the right shape, but strided: the run holding it cannot be adopted.
    target["model"]["experts.23.bias"] = torch.zeros(80)[::2]
    with CheckpointManager(str(root), preemption=False) as mgr:
        assert mgr.restore(target) == 5
    assert _same(target, saved)
    assert not target["model"]["experts.23.bias"].is_contiguous()


def test_strict_restores_still_name_missing_and_unexpected_members(tmp_path: Path) -> None:
    root = tmp_path / "ck"
    saved = _state(6)
    with CheckpointManager(str(root), preemption=False) as mgr:
        mgr.save(6, saved)
        target = _zeros(saved)
        del target["model"]["experts.9.bias"]
        with pytest.raises(KeyError, match=r"in the checkpoint but not in the state: .*9\.bias"):
            mgr.restore(target)
        target = _zeros(saved)
        target["model"]["experts.9999.bias"] = torch.zeros(3)
        with pytest.raises(KeyError, match=r"missing from the checkpoint: .*9999\.bias"):
            mgr.restore(target)
        target = _zeros(saved)
        del target["model"]["experts.9.bias"]
        assert mgr.restore(target, strict=False) == 6
    del saved["model"]["experts.9.bias"]
    assert _same(target, saved)


def test_checkpoints_without_packs_restore_through_runs_too(tmp_path: Path) -> None:
    """DCP's own safetensors entries lie back to back as well (a save without packing)."""
    import torch.distributed.checkpoint as dcp

    import spotckpt

    root = tmp_path / "ck"
    saved = _state(7)["model"]
    dcp.save(saved, storage_writer=spotckpt.dcp_writer(str(root), 7))
    (key,) = _manifest(root, 7).objects
    assert "experts.0.bias" in _header_names(root / step_folder(7) / key)  # no pack
    store = CountingReads(open_store(str(root)))
    target = {k: torch.zeros_like(v) for k, v in saved.items()}
    with CheckpointManager(str(root), preemption=False, store=store) as mgr:
        assert mgr.restore(target) == 7
    assert all(torch.equal(target[k], v) for k, v in saved.items())
    assert len(store.lengths) <= 3, store.lengths


def test_a_large_run_is_read_in_pieces_cut_between_members(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import functools

    import spotckpt.restore

    monkeypatch.setattr(
        spotckpt.restore,
        "ObjectStoreReader",
        functools.partial(spotckpt.restore.ObjectStoreReader, max_read_bytes=1 << 20),
    )
    root = tmp_path / "ck"
    state = {f"w{i:04d}": torch.randn(5000) for i in range(400)}  # 20,000 bytes each, 7.6 MiB
    with CheckpointManager(str(root), preemption=False) as mgr:
        mgr.save(1, state)
        mgr.save(2, {k: v * 2 for k, v in state.items()})
    location = _manifest(root, 2).tensors["w0321"].chunks[0].location
    path = root / step_folder(2) / location.key
    data = bytearray(path.read_bytes())
    data[location.offset + location.length - 1] ^= 0x01  # the last byte of a late member
    path.write_bytes(bytes(data))
    store = CountingReads(open_store(str(root)))
    target = {k: torch.zeros_like(v) for k, v in state.items()}
    with CheckpointManager(str(root), preemption=False, store=store) as mgr:
        with pytest.raises(CorruptCheckpointError, match=r"block 0 of 'w0321'"):
            mgr.restore(target, step=2)
        assert sum(1 for n in store.lengths if n >= 1 << 20) >= 6  # 1 MiB pieces, in parallel
        assert mgr.restore(target) == 1
    assert all(torch.equal(target[k], v) for k, v in state.items())


def test_a_save_builds_one_pack_at_a_time(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Packs are concatenated when written, and each is freed before the next is built, so a
    save never holds a second copy of all its small tensors."""
    monkeypatch.setattr(packing, "PACK_MAX_BYTES", 64 << 10)
    built: list[weakref.ref[torch.Tensor]] = []
    alive_at_build: list[int] = []
    original = packing.Pack.data

    def data(self: packing.Pack) -> torch.Tensor:
        alive_at_build.append(sum(ref() is not None for ref in built))
        tensor = original(self)
        built.append(weakref.ref(tensor))
        return tensor

    monkeypatch.setattr(packing.Pack, "data", data)
    state = {f"w{i:03d}": torch.full((4096,), float(i)) for i in range(64)}  # 16 KiB each
    with CheckpointManager(str(tmp_path / "ck"), preemption=False) as mgr:
        mgr.save(1, state)
        target = {k: torch.zeros_like(v) for k, v in state.items()}
        assert mgr.restore(target) == 1
    assert len(built) == 16  # 4 tensors to a 64 KiB pack
    assert alive_at_build == [0] * 16
    assert all(torch.equal(target[k], v) for k, v in state.items())
