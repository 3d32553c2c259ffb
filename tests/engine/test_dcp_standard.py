"""Standard DCP checkpoints (``.metadata`` + ``.distcp``, as torch's FileSystemWriter leaves them)
read through spotckpt, and moved in and out: docs/dcp.md's "Reading standard DCP checkpoints"
and "Moving a run between DCP and spotckpt" sections.

The ``.metadata`` pickle is read by an unpickler that admits only DCP's metadata classes: forged
pickles that try to run code are refused with nothing executed, malformed metadata and items
are refused before anything is allocated for them. An imported run resumes and continues
bit-exact; an exported step (plain, incremental, compressed, signed) loads with DCP's own
FileSystemReader and ``dcp_to_torch_save``.
"""

from __future__ import annotations

import io
import os
import pickle
import shutil
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    MetadataIndex,
)
from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

import spotckpt
from spotckpt import CheckpointAlreadyCommittedError, CheckpointManager
from spotckpt.catalog import Catalog
from spotckpt.dcp_convert import export_dcp, import_dcp
from spotckpt.engine import dcp_metadata
from spotckpt.errors import (
    AlreadyExistsError,
    CorruptCheckpointError,
    InvalidArgumentError,
    NoCheckpointError,
    ObjectSizeError,
    SignatureError,
)
from spotckpt.format.signing import Keyring
from spotckpt.gc import collect_garbage
from spotckpt.storage import open_store
from spotckpt.verify import verify_checkpoint

from tests_support import write_signing_key

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def _state(seed: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    return {
        "w": torch.randn(7, 5, generator=g),
        "t": torch.randn(5, 7, generator=g).t(),  # not contiguous
        "half": torch.randn(6, generator=g).to(torch.bfloat16),
        "ints": torch.randint(-100, 100, (9,), generator=g, dtype=torch.int8),
        "scalar": torch.tensor(float(seed)),
        "layers": [torch.randn(3, generator=g), torch.randn(2, 2, generator=g)],
        "extra": {"step": seed, "name": f"run-{seed}", "sizes": [1, 2, 3]},
    }


def _blank(like: dict[str, Any]) -> dict[str, Any]:
    def blank(value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            return torch.zeros_like(value)
        if isinstance(value, list):
            return [blank(v) for v in value]
        if isinstance(value, dict):
            return {k: blank(v) for k, v in value.items()}
        return None

    return blank(like)


def _same(got: Any, want: Any) -> bool:
    if isinstance(want, torch.Tensor):
        return isinstance(got, torch.Tensor) and got.dtype == want.dtype and torch.equal(got, want)
    if isinstance(want, list):
        return len(got) == len(want) and all(_same(g, w) for g, w in zip(got, want, strict=True))
    if isinstance(want, dict):
        return got.keys() == want.keys() and all(_same(got[k], want[k]) for k in want)
    return bool(got == want)


def _write_standard(folder: Path, state: dict[str, Any]) -> Path:
    dcp.save(state, storage_writer=FileSystemWriter(str(folder)), no_dist=True)
    return folder


def _load(uri: str, like: dict[str, Any], step: int | None = None) -> dict[str, Any]:
    loaded = _blank(like)
    dcp.load(loaded, storage_reader=spotckpt.dcp_reader(uri, step), no_dist=True)
    return loaded


# Reading ---------------------------------------------------------------------------------------


def test_a_standard_folder_loads_bit_exact_through_dcp_reader(tmp_path: Path) -> None:
    folder = _write_standard(tmp_path / "ck", _state(1))
    assert _same(_load(str(folder), _state(1)), _state(1))


def test_a_root_of_step_folders_loads_the_step_asked_or_the_newest(tmp_path: Path) -> None:
    for step in (5, 12, 9):
        _write_standard(tmp_path / "root" / f"step-{step}", _state(step))
    root = str(tmp_path / "root")
    assert _same(_load(root, _state(5), 5), _state(5))
    assert _same(_load(root, _state(12)), _state(12))
    with pytest.raises(NoCheckpointError):
        spotckpt.dcp_reader(root, 6)


def test_a_folder_without_metadata_is_not_a_checkpoint(tmp_path: Path) -> None:
    folder = _write_standard(tmp_path / "root" / "step-3", _state(3))
    (folder / ".metadata").unlink()  # DCP writes it last: a save that died before it
    with pytest.raises(NoCheckpointError):
        spotckpt.dcp_reader(str(tmp_path / "root"))


def test_spotckpt_steps_come_before_standard_folders_of_a_root(tmp_path: Path) -> None:
    root = tmp_path / "root"
    _write_standard(root / "step-4", _state(4))
    dcp.save(_state(8), storage_writer=spotckpt.dcp_writer(str(root), 4), no_dist=True)
    assert _same(_load(str(root), _state(8), 4), _state(8))


def test_open_checkpoint_reads_tensors_and_slices_of_a_standard_folder(tmp_path: Path) -> None:
    _write_standard(tmp_path / "root" / "step-2", _state(2))
    want = _state(2)
    with spotckpt.open_checkpoint(str(tmp_path / "root"), 2) as opened:
        assert set(opened.keys()) == {"w", "t", "half", "ints", "scalar", "layers.0", "layers.1"}
        assert opened.metadata()["step"] == 2
        assert torch.equal(opened.get_tensor("t"), want["t"])
        assert torch.equal(opened.get_slice("w")[2:5, 1], want["w"][2:5, 1])
        assert opened.get_tensor("half").dtype == torch.bfloat16


def test_the_manager_restores_a_standard_step_and_continues_bit_exact(tmp_path: Path) -> None:
    root = tmp_path / "run"
    model, optimizer = _model()
    _train(model, optimizer, 0, 3)
    _write_standard(root / "step-3", _dcp_state(model, optimizer))
    _train(model, optimizer, 3, 3)
    fresh, fresh_optimizer = _model()
    with CheckpointManager(str(root), preemption=False) as manager:
        assert manager.restore({"model": fresh, "optim": fresh_optimizer}) is None  # asked only
        assert manager.restore({"model": fresh, "optim": fresh_optimizer}, step=3) == 3
        with pytest.raises(NoCheckpointError):
            manager.restore({"model": fresh, "optim": fresh_optimizer}, step=4)
    _train(fresh, fresh_optimizer, 3, 3)
    assert _same(fresh.state_dict(), model.state_dict())


def test_under_a_signing_key_a_standard_step_is_refused(tmp_path: Path) -> None:
    root = tmp_path / "run"
    model, optimizer = _model()
    _write_standard(root / "step-3", _dcp_state(model, optimizer))
    key = write_signing_key(tmp_path / "signing.pem")
    with (
        CheckpointManager(str(root), preemption=False, signing_key=str(key)) as manager,
        pytest.raises(SignatureError, match="import-dcp"),
    ):
        manager.restore({"model": model, "optim": optimizer}, step=3)


# Forged and malformed metadata -----------------------------------------------------------------


class _RunsCode:
    """Pickles as a call of `function` with `argument`: what a forged .metadata holds."""

    def __init__(self, function: Any, argument: Any) -> None:
        self.function, self.argument = function, argument

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        return self.function, (self.argument,)


def _forgeries(marker: Path) -> dict[str, bytes]:
    touch = f"open({str(marker)!r}, 'w').close()"
    return {
        "os.system": pickle.dumps(_RunsCode(os.system, f"touch {marker}")),
        "builtins.exec": pickle.dumps(_RunsCode(exec, touch)),
        "builtins.eval": pickle.dumps(_RunsCode(eval, touch)),
        "torch.load": pickle.dumps(_RunsCode(torch.load, str(marker))),
        "inside a Metadata": pickle.dumps(
            {"state": _RunsCode(exec, touch), "more": [1, 2, 3]}, protocol=2
        ),
    }


@pytest.mark.parametrize(
    "forgery", ["os.system", "builtins.exec", "builtins.eval", "torch.load", "inside a Metadata"]
)
def test_a_forged_metadata_pickle_is_refused_and_runs_nothing(tmp_path: Path, forgery: str) -> None:
    folder = _write_standard(tmp_path / "ck", _state(1))
    marker = tmp_path / "code-ran"
    (folder / ".metadata").write_bytes(_forgeries(marker)[forgery])
    with pytest.raises(CorruptCheckpointError, match="refused as a DCP metadata"):
        spotckpt.dcp_reader(str(folder))
    with pytest.raises(CorruptCheckpointError):
        spotckpt.open_checkpoint(str(folder))
    with pytest.raises(CorruptCheckpointError):
        import_dcp(open_store(str(folder)), open_store(str(tmp_path / "imported")), step=1)
    assert not marker.exists()


def test_a_persistent_id_in_the_metadata_is_refused(tmp_path: Path) -> None:
    folder = _write_standard(tmp_path / "ck", _state(1))

    class Persistent(pickle.Pickler):
        def persistent_id(self, obj: Any) -> Any:
            return "id" if isinstance(obj, str) and obj == "w" else None

    buffer = io.BytesIO()
    Persistent(buffer).dump(_metadata(folder))
    (folder / ".metadata").write_bytes(buffer.getvalue())
    with pytest.raises(CorruptCheckpointError, match="persistent id"):
        spotckpt.dcp_reader(str(folder))


def _metadata(folder: Path) -> Any:
    return pickle.loads((folder / ".metadata").read_bytes())  # the test's own file


def _forge(folder: Path, change: Any) -> None:
    metadata = _metadata(folder)
    change(metadata)
    (folder / ".metadata").write_bytes(pickle.dumps(metadata))


def _first_item(metadata: Any, fqn: str = "w") -> tuple[MetadataIndex, _StorageInfo]:
    return next((i, s) for i, s in metadata.storage_data.items() if i.fqn == fqn)


def _set_item(metadata: Any, fqn: str = "w", **fields: Any) -> None:
    index, stored = _first_item(metadata, fqn)
    values = {**vars(stored), **fields}
    metadata.storage_data[index] = _StorageInfo(**values)


MALFORMED = {
    "path outside the folder": (lambda m: _set_item(m, relative_path="../secret"), "'..'"),
    "absolute path": (lambda m: _set_item(m, relative_path="/etc/passwd"), "absolute"),
    "negative offset": (lambda m: _set_item(m, offset=-5), "offset"),
    "length not an int": (lambda m: _set_item(m, length="9"), "length"),
    "stream extension": (
        lambda m: _set_item(m, transform_descriptors=["zstandard"]),
        "stream extensions",
    ),
    "chunk outside its tensor": (
        lambda m: m.state_dict_metadata["w"].chunks.__setitem__(
            0, ChunkStorageMetadata(torch.Size([3, 0]), torch.Size([7, 5]))
        ),
        "out of bounds",
    ),
    "chunk without an item": (
        lambda m: m.storage_data.pop(_first_item(m)[0]),
        "no stored item",
    ),
    "value without an item": (
        lambda m: m.storage_data.pop(_first_item(m, "extra.name")[0]),
        "no stored item",
    ),
    "a tensor larger than its chunks": (
        lambda m: setattr(m.state_dict_metadata["w"], "size", torch.Size([7, 5_000_000_000])),
        "invalid fill",
    ),
    "an item shorter than its chunk's data": (lambda m: _set_item(m, length=8), "bytes of data"),
    "a Metadata without fields": (lambda m: m.__dict__.clear(), "malformed"),
    "a chunk without fields": (
        lambda m: m.state_dict_metadata["w"].chunks[0].__dict__.clear(),
        "malformed",
    ),
}


@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_malformed_metadata_is_refused_before_any_item_is_read(tmp_path: Path, case: str) -> None:
    folder = _write_standard(tmp_path / "ck", _state(1))
    change, says = MALFORMED[case]
    _forge(folder, change)
    with pytest.raises(CorruptCheckpointError, match="refused as a DCP metadata") as raised:
        spotckpt.dcp_reader(str(folder))
    assert says in str(raised.value)


def test_a_metadata_larger_than_the_bound_is_refused_unread(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    folder = _write_standard(tmp_path / "ck", _state(1))
    monkeypatch.setattr(dcp_metadata, "MAX_METADATA_BYTES", 64)
    with pytest.raises(ObjectSizeError, match="refused unread"):
        spotckpt.dcp_reader(str(folder))


def test_a_truncated_object_is_found_when_the_checkpoint_opens(tmp_path: Path) -> None:
    folder = _write_standard(tmp_path / "ck", _state(1))
    data = next(folder.glob("*.distcp"))
    data.write_bytes(data.read_bytes()[:-100])
    with pytest.raises(ObjectSizeError, match="reach"):
        spotckpt.dcp_reader(str(folder))  # when it opens, before DCP plans anything


def test_an_item_of_another_dtype_or_shape_than_its_metadata_is_refused(tmp_path: Path) -> None:
    folder = _write_standard(tmp_path / "ck", _state(1))
    other = _write_standard(tmp_path / "other", {"w": torch.randn(7, 5, dtype=torch.float64)})
    _, stored = _first_item(_metadata(other))
    shutil.copy(other / stored.relative_path, folder / "forged.distcp")
    _forge(
        folder,
        lambda m: _set_item(m, relative_path="forged.distcp", offset=0, length=stored.length),
    )
    with pytest.raises(CheckpointException, match=r"CorruptCheckpointError.*float64"):
        _load(str(folder), _state(1))


def test_a_value_item_that_would_run_code_is_refused(tmp_path: Path) -> None:
    folder = _write_standard(tmp_path / "ck", _state(1))
    marker = tmp_path / "code-ran"
    evil = pickle.dumps(_RunsCode(exec, f"open({str(marker)!r}, 'w').close()"))
    (folder / "evil.distcp").write_bytes(evil)
    _forge(
        folder,
        lambda m: _set_item(
            m, "extra.name", relative_path="evil.distcp", offset=0, length=len(evil)
        ),
    )
    with pytest.raises(CheckpointException, match="ValueLoadError"):
        _load(str(folder), _state(1))
    assert not marker.exists()


# Import and export -----------------------------------------------------------------------------


def _model() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    return model, torch.optim.AdamW(model.parameters(), lr=0.01)


def _train(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, first: int, steps: int
) -> None:
    for step in range(first, first + steps):
        batch = torch.randn(16, 4, generator=torch.Generator().manual_seed(step))
        loss = model(batch).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()


def _dcp_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """What DCP's own docs have a trainer save: FQN-keyed model and optimizer state."""
    return {
        "model": get_model_state_dict(model),
        "optim": get_optimizer_state_dict(model, optimizer),
    }


def test_an_imported_run_resumes_under_the_manager_and_continues_bit_exact(tmp_path: Path) -> None:
    model, optimizer = _model()
    _train(model, optimizer, 0, 3)
    _write_standard(tmp_path / "dcp-run" / "step-3", _dcp_state(model, optimizer))
    _train(model, optimizer, 3, 4)
    destination = str(tmp_path / "spot")
    report = import_dcp(open_store(str(tmp_path / "dcp-run")), open_store(destination))
    assert report.step == 3 and report.tensors > 4
    assert verify_checkpoint(open_store(destination), 3).ok
    assert Catalog(open_store(destination)).job() is not None
    fresh, fresh_optimizer = _model()
    with CheckpointManager(destination, preemption=False) as manager:
        assert manager.restore({"model": fresh, "optim": fresh_optimizer}) == 3
        _train(fresh, fresh_optimizer, 3, 4)
        manager.save(7, {"model": fresh, "optim": fresh_optimizer}, blocking=True)
    assert _same(fresh.state_dict(), model.state_dict())
    assert _same(fresh_optimizer.state_dict(), optimizer.state_dict())


def test_import_names_its_step_refuses_a_committed_one_and_overwrites_when_asked(
    tmp_path: Path,
) -> None:
    folder = _write_standard(tmp_path / "exported", _state(1))
    destination = open_store(str(tmp_path / "spot"))
    with pytest.raises(InvalidArgumentError, match="--step"):
        import_dcp(open_store(str(folder)), destination)
    import_dcp(open_store(str(folder)), destination, step=10)
    other = _write_standard(tmp_path / "other", _state(2))
    with pytest.raises(CheckpointAlreadyCommittedError):
        import_dcp(open_store(str(other)), destination, step=10)
    assert _same(_load(destination.uri, _state(1), 10), _state(1))
    import_dcp(open_store(str(other)), destination, step=10, overwrite=True)
    assert _same(_load(destination.uri, _state(2), 10), _state(2))
    with pytest.raises(NoCheckpointError):
        import_dcp(open_store(str(tmp_path / "spot")), open_store(str(tmp_path / "x")), step=3)


def test_an_import_under_a_signing_key_is_signed_and_restores_under_it(tmp_path: Path) -> None:
    folder = _write_standard(tmp_path / "dcp" / "step-4", _state(4))
    key = write_signing_key(tmp_path / "signing.pem")
    keyring = Keyring.from_files(str(key))
    destination = open_store(str(tmp_path / "spot"))
    import_dcp(open_store(str(folder.parent)), destination, keyring=keyring)
    assert verify_checkpoint(destination, 4, keyring=keyring).ok
    with CheckpointManager(destination.uri, preemption=False, signing_key=str(key)) as manager:
        state = _blank(_state(4))
        assert manager.restore(state) == 4
    assert _same(state, _state(4))


def test_gc_and_retention_leave_a_root_s_standard_folders_alone(tmp_path: Path) -> None:
    root = tmp_path / "root"
    _write_standard(root / "step-2", _state(2))
    with CheckpointManager(str(root), preemption=False, keep_last=1) as manager:
        for step in (3, 4, 5):
            manager.save(step, _state(step), blocking=True)
    collect_garbage(open_store(str(root)), keep_last=1)
    assert Catalog(open_store(str(root))).steps() == [5]
    assert _same(_load(str(root / "step-2"), _state(2)), _state(2))


FEATURES: dict[str, dict[str, Any]] = {
    "plain": {},
    "incremental": {"incremental": True},
    "compressed": {"compression": "on"},
    "signed": {"signing_key": "KEY"},
    "incremental+signed": {"incremental": True, "signing_key": "KEY"},
}


@pytest.mark.parametrize("features", sorted(FEATURES))
def test_an_exported_step_loads_with_dcp_s_own_reader_and_dcp_to_torch_save(
    tmp_path: Path, features: str
) -> None:
    key = write_signing_key(tmp_path / "signing.pem")
    settings = {k: (str(key) if v == "KEY" else v) for k, v in FEATURES[features].items()}
    root = str(tmp_path / "root")
    with CheckpointManager(root, preemption=False, keep_last=None, **settings) as manager:
        manager.save(1, _state(1), blocking=True)
        changed = {**_state(1), "w": _state(2)["w"]}  # an incremental step references the rest
        manager.save(2, changed, blocking=True)
    keyring = Keyring.from_files(str(key)) if "signing_key" in settings else None
    out = tmp_path / "exported"
    report = export_dcp(open_store(root), 2, out, keyring=keyring)
    assert report.step == 2
    loaded = _blank(changed)
    dcp.load(loaded, storage_reader=FileSystemReader(str(out)), no_dist=True)
    assert _same(loaded, changed)
    dcp_to_torch_save(str(out), str(tmp_path / "whole.pt"))
    whole = torch.load(tmp_path / "whole.pt", weights_only=True)
    assert _same(whole, changed)  # the nesting travels with it
    with pytest.raises(AlreadyExistsError):
        export_dcp(open_store(root), 2, out, keyring=keyring)
    export_dcp(open_store(root), 1, out, keyring=keyring, overwrite=True)
    assert _same(torch.load(_to_torch(out, tmp_path), weights_only=True), _state(1))


def _to_torch(folder: Path, tmp_path: Path) -> Path:
    target = tmp_path / "again.pt"
    dcp_to_torch_save(str(folder), str(target))
    return target


def test_an_unsigned_step_is_not_exported_under_a_key(tmp_path: Path) -> None:
    root = str(tmp_path / "root")
    dcp.save(_state(1), storage_writer=spotckpt.dcp_writer(root, 1), no_dist=True)
    keyring = Keyring.from_files(str(write_signing_key(tmp_path / "signing.pem")))
    with pytest.raises(SignatureError):
        export_dcp(open_store(root), 1, tmp_path / "out", keyring=keyring)
    assert not (tmp_path / "out" / ".metadata").exists()


def test_standard_to_spotckpt_and_back_is_the_same_checkpoint(tmp_path: Path) -> None:
    original = _write_standard(tmp_path / "dcp" / "step-6", _state(6))
    spot = open_store(str(tmp_path / "spot"))
    import_dcp(open_store(str(original.parent)), spot)
    export_dcp(spot, 6, tmp_path / "back")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        first = torch.load(_to_torch(original, tmp_path), weights_only=True)
        again = torch.load(_to_torch(tmp_path / "back", tmp_path), weights_only=True)
    assert _same(again, first) and _same(first, _state(6))


@pytest.mark.parametrize("direction", ["import", "export"])
def test_a_conversion_holds_about_one_tensor_at_a_time(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, direction: str
) -> None:
    """Each tensor is read when the writer asks for it: while the next is read, no more than
    the one before it is still alive (the writer may hold it until it is uploaded)."""
    import gc
    import weakref

    from spotckpt import dcp_convert

    state = {f"layer{i}": torch.full((64, 64), float(i)) for i in range(12)}
    alive: list[weakref.ref[torch.Tensor]] = []
    most = 0
    read = dcp_convert._Source.tensor

    def counted(self: Any, fqn: str) -> torch.Tensor:
        nonlocal most
        tensor = read(self, fqn)
        if not any(ref() is tensor for ref in alive):
            gc.collect()
            most = max(most, sum(ref() is not None for ref in alive))
            alive.append(weakref.ref(tensor))
        return tensor

    folder = _write_standard(tmp_path / "dcp" / "step-1", state)
    spot = open_store(str(tmp_path / "spot"))
    if direction == "export":
        import_dcp(open_store(str(folder.parent)), spot)
    monkeypatch.setattr(dcp_convert._Source, "tensor", counted)
    if direction == "import":
        import_dcp(open_store(str(folder.parent)), spot)
    else:
        export_dcp(spot, 1, tmp_path / "out")
    assert len(alive) == len(state)
    assert most <= 1, f"{most} earlier tensors were still alive when the next was read"
    assert _same(_load(spot.uri, state, 1), state)


def _build_on(module: str, name: str, attribute: str, value: bytes) -> bytes:
    """A pickle that names `module.name` and BUILDs `attribute` = `value` (pickled) onto it:
    how a forged metadata would change a class or function for the rest of the process."""
    key = attribute.encode()
    return (
        b"\x80\x04c"
        + f"{module}\n{name}\n".encode()
        + b"}X"
        + len(key).to_bytes(4, "little")
        + key
        + value
        + b"sb."
    )


@pytest.mark.parametrize(
    ("module", "name", "attribute"),
    [
        ("pathlib", "PurePosixPath", "__truediv__"),
        ("torch.distributed.checkpoint.metadata", "MetadataIndex", "__hash__"),
        ("torch.serialization", "_get_layout", "cache"),
        ("collections", "OrderedDict", "__len__"),
    ],
)
def test_a_metadata_that_builds_onto_an_admitted_name_changes_nothing(
    tmp_path: Path, module: str, name: str, attribute: str
) -> None:
    import collections
    import pathlib

    folder = _write_standard(tmp_path / "ck", _state(1))
    (folder / ".metadata").write_bytes(_build_on(module, name, attribute, b"N"))
    layouts = dict(torch.serialization._get_layout.cache)  # type: ignore[attr-defined]
    with pytest.raises(CorruptCheckpointError, match="refused as a DCP metadata"):
        spotckpt.dcp_reader(str(folder))
    assert str(pathlib.PurePosixPath("a") / "b") == "a/b"
    assert hash(MetadataIndex("w")) == hash(MetadataIndex("w"))
    assert len(collections.OrderedDict(a=1)) == 1
    assert torch.serialization._get_layout.cache in ({}, layouts)  # type: ignore[attr-defined]
    _write_standard(tmp_path / "again", _state(2))  # DCP itself still works in this process
    assert _same(_load(str(tmp_path / "again"), _state(2)), _state(2))


def test_a_deflated_tensor_item_is_refused_before_it_inflates(tmp_path: Path) -> None:
    import zipfile

    folder = _write_standard(tmp_path / "ck", _state(1))
    _, stored = _first_item(_metadata(folder))
    blob = (folder / stored.relative_path).read_bytes()[
        stored.offset : stored.offset + stored.length
    ]
    deflated = io.BytesIO()
    with zipfile.ZipFile(io.BytesIO(blob)) as source, zipfile.ZipFile(deflated, "w") as target:
        for record in source.infolist():
            target.writestr(record, source.read(record), compress_type=zipfile.ZIP_DEFLATED)
    (folder / "deflated.distcp").write_bytes(deflated.getvalue() + b"\0" * stored.length)
    _forge(
        folder,
        lambda m: _set_item(m, relative_path="deflated.distcp", offset=0, length=stored.length),
    )
    with pytest.raises(CheckpointException, match="compressed records"):
        _load(str(folder), _state(1))


def test_two_items_on_one_range_are_refused(tmp_path: Path) -> None:
    folder = _write_standard(tmp_path / "ck", _state(1))
    _, stored = _first_item(_metadata(folder), "w")
    _forge(folder, lambda m: _set_item(m, "half", **vars(stored)))
    with pytest.raises(CorruptCheckpointError, match=r"items of .* overlap"):
        spotckpt.dcp_reader(str(folder))


def test_overlapping_chunks_that_sum_to_the_tensor_are_refused(tmp_path: Path) -> None:
    folder = _write_standard(tmp_path / "ck", {"w": torch.randn(7, 5)})
    extra = io.BytesIO()
    torch.save(torch.randn(3, 5), extra)
    (folder / "extra.distcp").write_bytes(extra.getvalue())

    def overlap(metadata: Any) -> None:
        metadata.state_dict_metadata["w"].chunks = [
            ChunkStorageMetadata(torch.Size([0, 0]), torch.Size([4, 5])),
            ChunkStorageMetadata(torch.Size([3, 0]), torch.Size([3, 5])),
        ]
        metadata.storage_data[MetadataIndex("w", torch.Size([3, 0]))] = _StorageInfo(
            "extra.distcp", 0, len(extra.getvalue())
        )

    _forge(folder, overlap)
    with pytest.raises(CorruptCheckpointError, match="overlap"):
        spotckpt.dcp_reader(str(folder))


def test_a_metadata_pickled_by_python_3_13_with_pathlib_local_reads(tmp_path: Path) -> None:
    """Python 3.13 pickles a PosixPath as ``pathlib._local.PosixPath`` (DCP's FileSystemWriter
    keeps the checkpoint's path in the metadata)."""
    folder = _write_standard(tmp_path / "ck", _state(1))
    data = pickle.dumps(_metadata(folder), protocol=2)  # GLOBAL opcodes: names spelled out
    spelled = data.replace(b"cpathlib\nPosixPath\n", b"cpathlib._local\nPosixPath\n")
    assert spelled != data
    (folder / ".metadata").write_bytes(spelled)
    assert _same(_load(str(folder), _state(1)), _state(1))


def test_a_safetensors_serialized_checkpoint_is_named_as_such(tmp_path: Path) -> None:
    from torch.distributed.checkpoint.filesystem import SerializationFormat

    folder = tmp_path / "ck"
    writer = FileSystemWriter(str(folder), serialization_format=SerializationFormat.SAFETENSORS)
    dcp.save({"w": torch.randn(4, 4)}, storage_writer=writer, no_dist=True)
    with pytest.raises((CheckpointException, CorruptCheckpointError), match="SAFETENSORS"):
        _load(str(folder), {"w": torch.randn(4, 4)})


def test_spotckpt_s_own_folder_of_a_step_does_not_hide_a_dcp_folder_of_it(tmp_path: Path) -> None:
    root = tmp_path / "root"
    _write_standard(root / "step-5", _state(5))
    (root / "step-000000005" / "a-left").mkdir(parents=True)  # a failed save's leftovers
    (root / "step-000000005" / "a-left" / "r00000-000.safetensors").write_bytes(b"x")
    assert _same(_load(str(root), _state(5), 5), _state(5))


def test_many_chunks_are_checked_by_dcp_s_rules_without_comparing_every_pair() -> None:
    """A tensor saved by 4,096 ranks (one chunk each) passes; one more chunk inside another is
    an overlap, one fewer a gap (`spotckpt.engine.plan_check`, O(n log n))."""
    from torch.distributed.checkpoint.metadata import TensorProperties, TensorStorageMetadata

    from spotckpt.engine import dcp_metadata

    chunks = [ChunkStorageMetadata(torch.Size([r, 0]), torch.Size([1, 8])) for r in range(4096)]
    stored = {
        MetadataIndex("w", c.offsets): _StorageInfo("d", 64 * i, 64) for i, c in enumerate(chunks)
    }

    def check(some: list[ChunkStorageMetadata]) -> None:
        entry = TensorStorageMetadata(TensorProperties(torch.float32), torch.Size([4096, 8]), some)
        dcp_metadata._check_tensor("w", entry, stored)

    check(chunks)
    stray = ChunkStorageMetadata(torch.Size([7, 2]), torch.Size([1, 1]))
    stored[MetadataIndex("w", stray.offsets)] = _StorageInfo("d", 1 << 30, 64)
    with pytest.raises(Exception, match="overlap"):
        check([*chunks, stray])
    with pytest.raises(Exception, match="fill"):
        check(chunks[1:])


def test_a_checkpoint_made_by_torch_save_to_dcp_opens_imports_and_restores(
    tmp_path: Path,
) -> None:
    from torch.distributed.checkpoint.format_utils import torch_save_to_dcp

    saved = {"model": {"w": torch.randn(5, 3), "b": torch.arange(4)}, "step": 7, "opt": {"lr": 0.1}}
    torch.save(saved, tmp_path / "whole.pt")
    torch_save_to_dcp(str(tmp_path / "whole.pt"), str(tmp_path / "dcp" / "step-7"))
    with spotckpt.open_checkpoint(str(tmp_path / "dcp"), 7) as opened:
        assert torch.equal(opened.get_tensor("model.w"), saved["model"]["w"])
    import_dcp(open_store(str(tmp_path / "dcp")), open_store(str(tmp_path / "spot")))
    state = {"model": {"w": torch.zeros(5, 3), "b": torch.zeros(4, dtype=torch.int64)}}
    state |= {"step": 0, "opt": {"lr": 0.0}}
    with CheckpointManager(str(tmp_path / "spot"), preemption=False) as manager:
        assert manager.restore(state) == 7
    assert _same(state, saved)
