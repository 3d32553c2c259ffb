"""Incremental saves: real saves and restores into a local folder, with adversarial changes
(the detector must never reference bytes that differ) and adversarial references (deleted,
damaged, forged outside the root, of another job, cyclic)."""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import spotckpt.engine.incremental
import spotckpt.format.features
from spotckpt import CheckpointManager, TrainState
from spotckpt.catalog import Catalog
from spotckpt.errors import ManifestError, UnknownFormatError
from spotckpt.format.manifest import Manifest
from spotckpt.format.references import is_reference
from spotckpt.gc import collect_garbage
from spotckpt.layout import manifest_key, step_folder
from spotckpt.storage import open_store
from spotckpt.verify import verify_checkpoint

from dist_worker import run_ranks
from tests_support import assert_equal, load_saved


def make_model(seed: int = 0) -> nn.Module:
    """Two weights above the packing bound (each its own item), small biases (packed)."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(512, 600), nn.Linear(600, 512))


def manager(root: Path, **kwargs: Any) -> CheckpointManager:
    options: dict[str, Any] = {"incremental": True, "preemption": False, "keep_last": None}
    return CheckpointManager(str(root), **(options | kwargs))


def manifest(root: Path, step: int) -> Manifest:
    return Catalog(open_store(str(root))).read_manifest(step)


def referenced(root: Path, step: int) -> set[str]:
    """The tensors of `step` whose bytes lie in an earlier step's objects."""
    tensors = manifest(root, step).tensors
    return {
        fqn for fqn, t in tensors.items() if all(is_reference(c.location.key) for c in t.chunks)
    }


def restored(root: Path, step: int, build: Callable[[], nn.Module] = make_model) -> dict[str, Any]:
    """The model state that restoring `step` into a differently initialised model gives."""
    model = build()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(7)
    with manager(root) as mgr:
        assert mgr.restore(TrainState(model=model, rng=False), step=step) == step
    return {k: v.clone() for k, v in model.state_dict().items()}


def snapshot(model: nn.Module) -> dict[str, Any]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def save(mgr: CheckpointManager, step: int, model: nn.Module, **parts: Any) -> None:
    mgr.save(step, TrainState(model=model, rng=False, **parts), blocking=True)


WEIGHTS = {"model.0.weight", "model.1.weight"}


def test_unchanged_tensors_are_referenced_and_restore_bit_exact(tmp_path: Path) -> None:
    model = make_model()
    with manager(tmp_path) as mgr:
        save(mgr, 1, model)
        save(mgr, 2, model)
    first, second = manifest(tmp_path, 1), manifest(tmp_path, 2)
    assert first.format == "spotckpt/1" and referenced(tmp_path, 1) == set()
    assert second.format == "spotckpt/1+references"
    assert referenced(tmp_path, 2) >= WEIGHTS | {"model.0.bias", "model.1.bias"}
    assert second.referenced_bytes >= 2 * 512 * 600 * 4
    assert second.written_bytes < first.written_bytes / 50  # values only
    assert_equal(snapshot(model), restored(tmp_path, 2))


MUTATIONS: dict[str, Callable[[nn.Module], None]] = {
    "in-place edit": lambda m: m[0].weight.data[3, 5].add_(1.0),
    ".data write": lambda m: setattr(m[0].weight, "data", m[0].weight.data * 2),
    "copy_ into storage": lambda m: m[0].weight.detach().copy_(torch.randn(600, 512)),
    "numpy view write": lambda m: m[0].weight.detach().numpy().__setitem__((599, 511), 0.25),
    "one bit flipped": lambda m: m[0].weight.detach().view(torch.int32)[0, 0].bitwise_xor_(1),
    "same bytes, other shape": lambda m: setattr(
        m[0], "weight", nn.Parameter(m[0].weight.detach().reshape(512, 600).clone())
    ),
    "same bytes, other dtype": lambda m: setattr(
        m[0], "weight", nn.Parameter(m[0].weight.detach().view(torch.int32), requires_grad=False)
    ),
}


@pytest.mark.parametrize("name", sorted(MUTATIONS))
def test_a_changed_tensor_is_written_never_referenced(tmp_path: Path, name: str) -> None:
    model = make_model()
    with manager(tmp_path) as mgr:
        save(mgr, 1, model)
        MUTATIONS[name](model)
        save(mgr, 2, model)
    assert "model.0.weight" not in referenced(tmp_path, 2)
    assert "model.1.weight" in referenced(tmp_path, 2)
    expected = snapshot(model)

    def build() -> nn.Module:
        fresh = make_model(seed=1)
        fresh[0].weight = nn.Parameter(
            torch.empty_like(expected["0.weight"]),
            requires_grad=expected["0.weight"].is_floating_point(),
        )
        return fresh

    assert_equal(expected, restored(tmp_path, 2, build))


def test_optimizer_steps_on_a_subset_write_only_that_subset(tmp_path: Path) -> None:
    model = make_model()
    model[0].requires_grad_(False)  # frozen base; the second layer trains
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=0.1)

    def step() -> None:
        model(torch.randn(4, 512)).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()

    with manager(tmp_path) as mgr:
        for number in range(1, 4):
            step()
            save(mgr, number, model, optimizer=optimizer)
    refs = referenced(tmp_path, 3)
    assert {"model.0.weight", "model.0.bias"} <= refs
    assert not any(name.startswith("optimizer.") for name in refs)
    assert "model.1.weight" not in refs
    # chains never go through a manifest: step 3 names step 1's object for the frozen weight
    location = manifest(tmp_path, 3).tensors["model.0.weight"].chunks[0].location
    assert location.key.startswith(f"{step_folder(1)}/")
    fresh = make_model(seed=2)
    fresh[0].requires_grad_(False)
    fresh_optimizer = torch.optim.AdamW([p for p in fresh.parameters() if p.requires_grad])
    with manager(tmp_path) as mgr:
        assert mgr.restore(TrainState(model=fresh, optimizer=fresh_optimizer, rng=False)) == 3
    assert_equal(snapshot(model), snapshot(fresh))
    assert_equal(optimizer.state_dict(), fresh_optimizer.state_dict())


def test_a_restored_state_saved_again_is_referenced_whole(tmp_path: Path) -> None:
    model = make_model()
    with manager(tmp_path) as mgr:
        save(mgr, 1, model)
    fresh = make_model(seed=3)
    with manager(tmp_path) as mgr:
        assert mgr.restore(TrainState(model=fresh, rng=False)) == 1
        save(mgr, 2, fresh)
    assert referenced(tmp_path, 2) >= WEIGHTS
    assert_equal(snapshot(model), restored(tmp_path, 2))


def test_two_tensors_sharing_storage_are_each_checked(tmp_path: Path) -> None:
    model = make_model()
    model.register_buffer("alias", model[1].weight.detach()[:300])  # a view of a parameter
    with manager(tmp_path) as mgr:
        save(mgr, 1, model)
        with torch.no_grad():
            model[1].weight[10, 10] = 123.0  # changes both through one storage
        save(mgr, 2, model)
    refs = referenced(tmp_path, 2)
    assert "model.1.weight" not in refs and "model.alias" not in refs
    assert "model.0.weight" in refs

    def build() -> nn.Module:
        fresh = make_model(seed=4)
        fresh.register_buffer("alias", torch.zeros(300, 600))
        return fresh

    assert_equal(snapshot(model), restored(tmp_path, 2, build))


def test_a_tensor_changed_back_to_old_bytes_is_written_and_restores_exactly(
    tmp_path: Path,
) -> None:
    model = make_model()
    original = model[0].weight.detach().clone()
    with manager(tmp_path) as mgr:
        save(mgr, 1, model)
        with torch.no_grad():
            model[0].weight.add_(1.0)
        save(mgr, 2, model)
        with torch.no_grad():
            model[0].weight.copy_(original)
        save(mgr, 3, model)
        save(mgr, 4, model)
    assert "model.0.weight" not in referenced(tmp_path, 2)
    assert "model.0.weight" not in referenced(tmp_path, 3)  # the base (2) holds other bytes
    # hashed while it uploaded (its first block differed), so the next save can reference it
    assert "model.0.weight" in referenced(tmp_path, 4)
    assert torch.equal(restored(tmp_path, 3)["0.weight"], original)
    assert torch.equal(restored(tmp_path, 2)["0.weight"], original + 1.0)


def test_off_by_default_writes_the_old_format_and_a_later_incremental_save_writes_all(
    tmp_path: Path,
) -> None:
    model = make_model()
    with CheckpointManager(str(tmp_path), preemption=False) as mgr:
        save(mgr, 1, model)
    document = json.loads((tmp_path / manifest_key(1)).read_bytes())
    assert document["format"] == "spotckpt/1" and "incremental" not in document
    assert "blake3" not in json.dumps(document)
    with manager(tmp_path) as mgr:
        save(mgr, 2, model)  # the base has no hashes: nothing can be referenced
        save(mgr, 3, model)
    assert referenced(tmp_path, 2) == set() and referenced(tmp_path, 3) >= WEIGHTS
    assert_equal(snapshot(model), restored(tmp_path, 1))


def test_a_full_rewrite_follows_after_the_bound_and_retention_frees_the_old_objects(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(spotckpt.engine.incremental, "FULL_REWRITE_AFTER", 3)
    model = make_model()
    with manager(tmp_path, keep_last=2) as mgr:
        for step in range(1, 4):
            save(mgr, step, model)
        # steps 1 and 2 are retired, but the objects step 1 wrote are referenced by step 3
        assert mgr.steps() == [2, 3]
        assert list((tmp_path / step_folder(1)).glob("a-*/*.safetensors"))
        assert not (tmp_path / manifest_key(1)).exists()
        assert_equal(snapshot(model), restored(tmp_path, 3))
        save(mgr, 4, model)
        depths = [manifest(tmp_path, s).incremental for s in (3, 4)]
        assert [d.depth for d in depths if d] == [2, 3]
        save(mgr, 5, model)  # after 3 incremental saves in a row, everything is written again
        assert referenced(tmp_path, 5) == set()
        save(mgr, 6, model)
    assert not (tmp_path / step_folder(1)).exists()  # no kept step references it any more
    assert referenced(tmp_path, 6) >= WEIGHTS
    location = manifest(tmp_path, 6).tensors["model.0.weight"].chunks[0].location
    assert location.key.startswith(step_folder(5))
    assert_equal(snapshot(model), restored(tmp_path, 6))


def test_gc_and_delete_step_keep_what_kept_steps_reference(tmp_path: Path) -> None:
    model = make_model()
    with manager(tmp_path) as mgr:
        for step in range(1, 4):
            save(mgr, step, model)
        mgr.delete_step(1)
    store = open_store(str(tmp_path))
    report = collect_garbage(store, keep_last=1, safety_age_s=0)
    assert Catalog(store).steps() == [3]
    assert list((tmp_path / step_folder(1)).glob("a-*/*.safetensors"))
    assert any("referenced by a kept step" in kept for kept in report.kept)
    assert verify_checkpoint(store, 3).ok
    assert_equal(snapshot(model), restored(tmp_path, 3))


def _three_steps(tmp_path: Path) -> nn.Module:
    """Step 1 without hashes (incremental off), step 2 full with hashes, step 3 referencing 2."""
    model = make_model()
    with CheckpointManager(str(tmp_path), preemption=False, keep_last=None) as mgr:
        save(mgr, 1, model)
    with manager(tmp_path) as mgr:
        save(mgr, 2, model)
        save(mgr, 3, model)
    assert referenced(tmp_path, 3) >= WEIGHTS
    return model


def _step2_object(tmp_path: Path) -> Path:
    (found,) = (tmp_path / step_folder(2)).glob("a-*/*.safetensors")
    return found


def test_a_deleted_referenced_object_fails_clearly_and_restore_falls_back(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    model = _three_steps(tmp_path)
    _step2_object(tmp_path).unlink()
    report = verify_checkpoint(open_store(str(tmp_path)), 3)
    assert not report.ok and report.problems[0].kind == "missing"
    assert step_folder(2) in report.problems[0].key
    fresh = make_model(seed=5)
    with caplog.at_level(logging.WARNING), manager(tmp_path) as mgr:
        assert mgr.restore(TrainState(model=fresh, rng=False)) == 1
    assert "falling back" in caplog.text and step_folder(2) in caplog.text
    assert_equal(snapshot(model), snapshot(fresh))


def test_a_damaged_referenced_object_fails_clearly_and_restore_falls_back(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    model = _three_steps(tmp_path)
    path = _step2_object(tmp_path)
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    report = verify_checkpoint(open_store(str(tmp_path)), 3)
    assert not report.ok and {p.kind for p in report.problems} >= {"crc32c"}
    fresh = make_model(seed=5)
    with caplog.at_level(logging.WARNING), manager(tmp_path) as mgr:
        assert mgr.restore(TrainState(model=fresh, rng=False)) == 1
    assert "falling back" in caplog.text
    assert_equal(snapshot(model), snapshot(fresh))
    assert Catalog(open_store(str(tmp_path))).steps() == [1]  # 3 and 2 quarantined


def _forge(tmp_path: Path, step: int, change: Callable[[dict[str, Any]], None]) -> None:
    path = tmp_path / manifest_key(step)
    document = json.loads(path.read_bytes())
    change(document)
    path.write_bytes(json.dumps(document).encode())


def _rekey(document: dict[str, Any], new: Callable[[str], str]) -> None:
    """Point every referenced object (and the chunks in it) at key `new(old)`."""
    renamed = {}
    for entry in document["objects"]:
        if entry["key"].startswith("step-"):
            renamed[entry["key"]] = entry["key"] = new(entry["key"])
    for tensor in document["tensors"].values():
        for chunk in tensor["chunks"]:
            chunk["key"] = renamed.get(chunk["key"], chunk["key"])


FORGERIES: dict[str, tuple[Callable[[dict[str, Any]], None], str]] = {
    "outside the root": (lambda d: _rekey(d, lambda k: "../other/" + k), "unsafe object key"),
    "dot-dot inside": (
        lambda d: _rekey(d, lambda k: k.replace("/a-", "/../step-000000001/a-", 1)),
        "unsafe object key",
    ),
    "not canonical": (lambda d: _rekey(d, lambda k: "step-2/" + k.split("/", 1)[1]), "earlier"),
    "its own manifest": (lambda d: _rekey(d, lambda k: "step-000000002/manifest.json"), "earlier"),
    "cycle: itself": (lambda d: _rekey(d, lambda k: k.replace("000000002", "000000003")), "cycle"),
    "cycle: a later step": (
        lambda d: _rekey(d, lambda k: k.replace("000000002", "000000009")),
        "cycle",
    ),
    "another job": (lambda d: d["incremental"].update(job="0" * 32), "another job"),
    "without the feature": (lambda d: d.update(format="spotckpt/1"), "without references"),
}


@pytest.mark.parametrize("name", sorted(FORGERIES))
def test_a_forged_reference_is_refused_clearly_and_restore_falls_back(
    tmp_path: Path, name: str
) -> None:
    model = _three_steps(tmp_path)
    change, message = FORGERIES[name]
    _forge(tmp_path, 3, change)
    with pytest.raises(ManifestError, match=message.replace("another job", "belongs to job")):
        Catalog(open_store(str(tmp_path))).read_manifest(3)
    fresh = make_model(seed=6)
    with manager(tmp_path) as mgr:
        assert mgr.restore(TrainState(model=fresh, rng=False)) == 2
    assert_equal(snapshot(model), snapshot(fresh))


def test_a_reader_that_does_not_know_references_refuses_the_step(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = _three_steps(tmp_path)
    monkeypatch.setattr(spotckpt.format.features, "KNOWN_FEATURES", frozenset())
    with pytest.raises(UnknownFormatError, match="references"):
        Catalog(open_store(str(tmp_path))).read_manifest(3)
    fresh = make_model(seed=6)
    with manager(tmp_path) as mgr:  # skipped, not quarantined; step 2 has no references
        assert mgr.restore(TrainState(model=fresh, rng=False)) == 2
    assert (tmp_path / manifest_key(3)).exists()
    assert_equal(snapshot(model), snapshot(fresh))


@pytest.mark.process
def test_two_ranks_save_incrementally_and_restore_on_other_world_sizes(tmp_path: Path) -> None:
    root, out = tmp_path / "ckpt", tmp_path / "out"
    out.mkdir()
    run_ranks(2, "fsdp_incremental_save", {"uri": str(root), "out": str(out)})
    second = manifest(root, 2)
    assert second.format == "spotckpt/1+references" and second.world_size == 2
    refs = referenced(root, 2)
    assert "model.0.weight" in refs and "model.2.weight" in refs
    assert not any(name.startswith("model.4.") for name in refs)
    for world in (1, 3):
        run_ranks(world, "fsdp_restore", {"uri": str(root), "out": str(out)})
        assert_equal(load_saved(out / "saved.pt"), load_saved(out / f"restored-{world}.pt"))


def test_verify_and_export_hf_read_referenced_chunks(tmp_path: Path) -> None:
    from safetensors.torch import load_file

    from spotckpt.export import export_hf

    model = make_model()
    with manager(tmp_path / "ckpt") as mgr:
        save(mgr, 1, model)
        save(mgr, 2, model)
    store = open_store(str(tmp_path / "ckpt"))
    report = verify_checkpoint(store, 2)
    assert report.ok and report.objects_checked == 2  # its own object and step 1's
    export_hf(store, 2, str(tmp_path / "hf"))
    exported: dict[str, torch.Tensor] = {}
    for shard in (tmp_path / "hf").glob("*.safetensors"):
        exported |= load_file(str(shard))
    assert_equal(snapshot(model), exported)


def test_an_indexed_save_writes_everything_in_its_own_format(tmp_path: Path) -> None:
    import torch.distributed.checkpoint as dcp

    from spotckpt.engine.writer import ObjectStoreWriter, WriterOptions
    from spotckpt.format.index import INDEXED_FORMAT

    store = open_store(str(tmp_path))
    job = Catalog(store).ensure_job().id
    for step in (1, 2):
        writer = ObjectStoreWriter(
            store, step, WriterOptions(index_parts=True, incremental=True, job=job)
        )
        state = {"w": torch.arange(300_000.0)}
        dcp.save(state, storage_writer=writer, planner=writer.save_planner(1), no_dist=True)
    second = Catalog(store).read_manifest(2)
    assert second.format == INDEXED_FORMAT
    assert not any(is_reference(key) for key in second.objects)
