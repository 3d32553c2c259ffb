"""An imported DCP run at every seam it meets (docs/dcp.md, "Moving a run between DCP and
spotckpt"): the imported step is a step of the job like any other, so the manager's later saves
(incremental ones reference its objects; compressed; signed) restore bit-exact, retention and gc
never delete an object a kept step references, verify passes, a mirror copies it and restores
from it, and an export of a later step (which references the imported bytes) is whole.

A generated matrix: every combination of incremental, signed and compressed later saves, with
every operation after them.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

from spotckpt import CheckpointManager
from spotckpt.catalog import Catalog
from spotckpt.dcp_convert import export_dcp, import_dcp
from spotckpt.format.signing import Keyring
from spotckpt.gc import collect_garbage
from spotckpt.mirroring import Mirror
from spotckpt.storage import open_store
from spotckpt.verify import verify_checkpoint

from tests_support import write_signing_key

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

FEATURES = ("incremental", "signed", "compressed")
OPERATIONS = ("retention_gc_verify", "mirror", "export")


@dataclass(frozen=True)
class Cell:
    flags: tuple[bool, ...]
    op: str

    @property
    def id(self) -> str:
        on = [name for name, flag in zip(FEATURES, self.flags, strict=True) if flag]
        return "+".join(on or ["plain"]) + "-" + self.op

    def on(self, name: str) -> bool:
        return self.flags[FEATURES.index(name)]


CELLS = [
    Cell(flags, op)
    for flags in itertools.product((False, True), repeat=len(FEATURES))
    for op in OPERATIONS
]


def _model() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))
    return model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)


def _train(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, first: int, steps: int
) -> None:
    for step in range(first, first + steps):
        batch = torch.randn(8, 6, generator=torch.Generator().manual_seed(step))
        loss = model(batch).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()


def _settings(cell: Cell, key: Path) -> dict[str, Any]:
    chosen: dict[str, Any] = {"preemption": False, "keep_last": 1}
    if cell.on("incremental"):
        chosen["incremental"] = True
    if cell.on("signed"):
        chosen["signing_key"] = str(key)
    if cell.on("compressed"):
        chosen["compression"] = "on"
    return chosen


def _equal(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("cell", CELLS, ids=lambda c: c.id)
def test_an_imported_step_at_every_seam(tmp_path: Path, cell: Cell) -> None:
    key = write_signing_key(tmp_path / "signing.pem")
    keyring = Keyring.from_files(str(key)) if cell.on("signed") else None
    model, optimizer = _model()
    _train(model, optimizer, 0, 2)
    state = {
        "model": get_model_state_dict(model),
        "optim": get_optimizer_state_dict(model, optimizer),
    }
    dcp.save(state, storage_writer=FileSystemWriter(str(tmp_path / "dcp" / "step-2")), no_dist=True)
    root = str(tmp_path / "root")
    import_dcp(open_store(str(tmp_path / "dcp")), open_store(root), keyring=keyring)

    settings = _settings(cell, key)
    with CheckpointManager(root, **settings) as manager:
        assert manager.restore({"model": model, "optim": optimizer}) == 2
        manager.save(3, {"model": model, "optim": optimizer}, blocking=True)  # unchanged
        _train(model, optimizer, 3, 1)
        frozen = model[0].weight.detach().clone()
        model[0].weight.requires_grad_(False)  # this tensor stays as imported from now on
        manager.save(4, {"model": model, "optim": optimizer}, blocking=True)
    model[0].weight.requires_grad_(True)
    want = {k: v.clone() for k, v in model.state_dict().items()}
    store = open_store(root)
    catalog = Catalog(store, keyring)
    assert catalog.steps() == [4]  # retention kept one step: the imported one is gone

    if cell.op == "retention_gc_verify":
        collect_garbage(store, keep_last=1, keyring=keyring, safety_age_s=0)
        assert verify_checkpoint(store, 4, keyring=keyring).ok
    elif cell.op == "mirror":
        mirror_root = str(tmp_path / "mirror")
        report = Mirror(catalog, Catalog(open_store(mirror_root), keyring)).catch_up(None)
        assert not report.failed
        assert verify_checkpoint(open_store(mirror_root), 4, keyring=keyring).ok
        root = mirror_root
    else:
        out = tmp_path / "exported"
        export_dcp(store, 4, out, keyring=keyring)
        loaded = {k: torch.zeros_like(v) for k, v in want.items()}
        dcp.load({"model": loaded}, storage_reader=FileSystemReader(str(out)), no_dist=True)
        assert _equal(loaded, want)

    fresh, fresh_optimizer = _model()
    with CheckpointManager(root, **settings) as manager:
        assert manager.restore({"model": fresh, "optim": fresh_optimizer}) == 4
    assert _equal(fresh.state_dict(), want)
    assert torch.equal(fresh[0].weight, frozen)
    assert fresh_optimizer.state_dict()["state"].keys() == optimizer.state_dict()["state"].keys()
