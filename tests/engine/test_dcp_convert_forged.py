"""A forged ``planner_data`` in a standard DCP checkpoint, and ``export-dcp --overwrite``:
docs/dcp.md's "Moving a run between DCP and spotckpt".

``planner_data`` (each entry's path in the saved state dict's tree) comes from the bucket with
the rest of the ``.metadata``. Paths that are not what DCP's flatten makes of the entries' FQNs
(one a prefix of another, a path renaming its entry, list indices with gaps or out of all
bounds) are ignored: the import commits the flat state dict, every entry under its FQN, and
allocates nothing for the indices. Legitimate paths still rebuild the tree, and an export shows
it. An export over an older checkpoint deletes that checkpoint's ``.metadata`` before writing
and its ``__<rank>_<n>.distcp`` files, and nothing else of the folder: an export that dies
midway leaves no checkpoint rather than the old metadata over half-rewritten files.
"""

from __future__ import annotations

import pickle
import tracemalloc
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

import spotckpt
from spotckpt.dcp_convert import export_dcp, import_dcp
from spotckpt.storage import open_store

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

DEEP = ".".join(["d"] * 3000)  # deeper than Python recursion (or any state dict) goes
FQNS = ["a", "b", "b.z", "l.0", "l.3", "m.0", "m.x", "t.True", "n.-1", DEEP]
FQNS += ["big.100000000000", "mid.1000000000"]

# Each case: paths that replace the flat ones ({fqn: (fqn,)}) in planner_data.
FORGED: dict[str, dict[str, tuple[Any, ...]]] = {
    "drops-an-entry": {"a": ("b", "z"), "b": ("b",)},
    "prefix-of-another": {"b": ("b",), "b.z": ("b", "z")},
    "renames": {"a": ("evil", "name")},
    "swaps": {"a": ("b",), "b": ("a",)},
    "list-gap": {"l.0": ("l", 0), "l.3": ("l", 3)},
    "dict-and-list": {"m.0": ("m", 0), "m.x": ("m", "x")},
    "bool-index": {"t.True": ("t", True)},
    "negative-index": {"n.-1": ("n", -1)},
    "too-deep": {DEEP: tuple(DEEP.split("."))},
    "index-10**11": {"big.100000000000": ("big", 10**11)},
    "index-10**9": {"mid.1000000000": ("mid", 10**9)},
    "not-a-path": {"a": "a"},  # type: ignore[dict-item]
}


def _flat(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {fqn: torch.randn(i + 1, generator=g) for i, fqn in enumerate(FQNS)}


def _forge(folder: Path, paths: dict[str, Any]) -> None:
    metadata = pickle.loads((folder / ".metadata").read_bytes())  # the test's own file
    metadata.planner_data = {**metadata.planner_data, **paths}
    (folder / ".metadata").write_bytes(pickle.dumps(metadata))


def _load_flat(uri: str, step: int) -> dict[str, torch.Tensor]:
    reader = spotckpt.dcp_reader(uri, step)
    loaded = {fqn: torch.zeros(i + 1) for i, fqn in enumerate(FQNS)}
    dcp.load(loaded, storage_reader=reader, no_dist=True)
    assert set(reader.read_metadata().state_dict_metadata) == set(FQNS)  # nothing added
    return loaded


@pytest.mark.parametrize("case", sorted(FORGED))
def test_forged_paths_are_ignored_and_every_entry_is_imported(tmp_path: Path, case: str) -> None:
    source = tmp_path / "dcp"
    dcp.save(_flat(1), storage_writer=FileSystemWriter(str(source)), no_dist=True)
    _forge(source, FORGED[case])
    root = str(tmp_path / "root")
    tracemalloc.start()
    try:
        report = import_dcp(open_store(str(source)), open_store(root), step=1)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 64 * 2**20  # a list grown to the index would be gigabytes
    assert report.tensors == len(FQNS)
    loaded = _load_flat(root, 1)
    assert all(torch.equal(loaded[fqn], want) for fqn, want in _flat(1).items())


def _nested(seed: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    return {
        "model": {"w": torch.randn(3, 2, generator=g), "layers.0.b": torch.randn(4, generator=g)},
        "blocks": [torch.randn(2, generator=g), {"k": torch.randn(5, generator=g)}],
        "optim": {"groups": [{"lr": 0.5, "params": [0, 1]}], "step": seed},
        "nested": [[torch.randn(1, generator=g), torch.randn(2, generator=g)]],
    }


def _same(got: Any, want: Any) -> bool:
    if isinstance(want, torch.Tensor):
        return isinstance(got, torch.Tensor) and torch.equal(got, want)
    if isinstance(want, list):
        return type(got) is list and len(got) == len(want) and all(map(_same, got, want))
    if isinstance(want, dict):
        return (
            type(got) is dict
            and got.keys() == want.keys()
            and all(_same(got[k], want[k]) for k in want)
        )
    return bool(got == want)


def test_legitimate_paths_still_rebuild_the_tree_through_import_and_export(tmp_path: Path) -> None:
    source = tmp_path / "dcp"
    dcp.save(_nested(1), storage_writer=FileSystemWriter(str(source)), no_dist=True)
    root = str(tmp_path / "root")
    import_dcp(open_store(str(source)), open_store(root), step=1)
    export_dcp(open_store(root), 1, tmp_path / "out")
    dcp_to_torch_save(str(tmp_path / "out"), str(tmp_path / "whole.pt"))
    assert _same(torch.load(tmp_path / "whole.pt", weights_only=True), _nested(1))


def _old_checkpoint(out: Path) -> None:
    """A checkpoint of several data files (one per writer thread) and a file of the user's."""
    writer = FileSystemWriter(str(out), thread_count=3)
    dcp.save(_flat(2), storage_writer=writer, no_dist=True)
    assert {p.name for p in out.glob("*.distcp")} == {
        "__0_0.distcp",
        "__0_1.distcp",
        "__0_2.distcp",
    }
    (out / "notes.txt").write_text("mine")
    (out / "__0_9.distcp.bak").write_text("mine too")


def test_an_overwrite_replaces_the_old_checkpoint_s_files_and_no_other(tmp_path: Path) -> None:
    root, out = str(tmp_path / "root"), tmp_path / "out"
    dcp.save(_flat(1), storage_writer=spotckpt.dcp_writer(root, 1), no_dist=True)
    _old_checkpoint(out)
    export_dcp(open_store(root), 1, out, overwrite=True)
    names = {p.name for p in out.iterdir()}
    written = {
        s.relative_path for s in FileSystemReader(str(out)).read_metadata().storage_data.values()
    }
    assert names == {".metadata", "notes.txt", "__0_9.distcp.bak", *written}  # no old file left
    loaded = {fqn: torch.zeros(i + 1) for i, fqn in enumerate(FQNS)}
    dcp.load(loaded, storage_reader=FileSystemReader(str(out)), no_dist=True)
    assert all(torch.equal(loaded[fqn], want) for fqn, want in _flat(1).items())


def test_an_overwrite_that_dies_midway_leaves_no_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root, out = str(tmp_path / "root"), tmp_path / "out"
    dcp.save(_flat(1), storage_writer=spotckpt.dcp_writer(root, 1), no_dist=True)
    _old_checkpoint(out)

    def dies(*_: Any, **__: Any) -> None:
        raise RuntimeError("killed before the metadata")

    monkeypatch.setattr(FileSystemWriter, "finish", dies)
    with pytest.raises(RuntimeError, match="killed before the metadata"):
        export_dcp(open_store(root), 1, out, overwrite=True)
    assert not (out / ".metadata").exists()
    assert (out / "notes.txt").read_text() == "mine"
