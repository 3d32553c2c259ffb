"""Mirrors at the seams: every combination of what changes a step's objects (references,
signatures, compression, indexed roots) with each way a step is saved (blocking, asynchronous,
through the fast tier), and at the mirror each operation that meets those objects: retention,
gc with no safety age, verify, and a restore with the job's own root gone."""

from __future__ import annotations

import itertools
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

HERE = Path(__file__).resolve().parent
if str(HERE.parent / "seams") not in sys.path:
    sys.path.insert(0, str(HERE.parent / "seams"))

import seam_run  # noqa: E402

from spotckpt import CheckpointManager  # noqa: E402
from spotckpt.catalog import Catalog  # noqa: E402
from spotckpt.format.signing import Keyring  # noqa: E402
from spotckpt.gc import collect_garbage  # noqa: E402
from spotckpt.storage import open_store  # noqa: E402
from spotckpt.verify import verify_checkpoint  # noqa: E402

from tests_support import write_signing_key  # noqa: E402

FEATURES = ("incremental", "signed", "compressed", "indexed")
ROUTES = ("blocking", "thread_async", "fast_tier")


@dataclass(frozen=True)
class Cell:
    flags: tuple[bool, ...]
    route: str

    @property
    def id(self) -> str:
        on = [name for name, flag in zip(FEATURES, self.flags, strict=True) if flag]
        return "+".join([*on, self.route])

    def on(self, name: str) -> bool:
        return self.flags[FEATURES.index(name)]


CELLS = [
    Cell(flags, route)
    for flags in itertools.product((False, True), repeat=len(FEATURES))
    for route in ROUTES
]


def _settings(cell: Cell, tmp_path: Path, key: Path) -> dict[str, Any]:
    chosen: dict[str, Any] = {"preemption": False, "keep_last": 2}
    if cell.on("incremental"):
        chosen["incremental"] = True
    if cell.on("signed"):
        chosen["signing_key"] = str(key)
    if cell.on("compressed"):
        chosen["compression"] = "on"
    if cell.route == "thread_async":
        chosen["async_save"] = True
    if cell.route == "fast_tier":
        (tmp_path / "fast").mkdir(exist_ok=True)
        chosen.update(local_dir=str(tmp_path / "fast" / "{node}"), local_interval_steps=1)
    return chosen


@pytest.mark.parametrize("cell", CELLS, ids=lambda c: c.id)
def test_mirrors_with_every_feature_and_operation(
    tmp_path: Path, cell: Cell, monkeypatch: pytest.MonkeyPatch
) -> None:
    if cell.on("indexed"):
        import spotckpt.engine.writer

        monkeypatch.setattr(spotckpt.engine.writer, "INDEX_MIN_RANKS", 1)
    key = write_signing_key(tmp_path / "key")
    keyring = Keyring.from_files(str(key)) if cell.on("signed") else None
    primary, mirror = tmp_path / "primary", tmp_path / "mirror"
    settings = _settings(cell, tmp_path, key)
    with CheckpointManager(str(primary), mirrors=[str(mirror)], **settings) as job:
        for step in (1, 2, 3):
            job.save(step, seam_run.state(step))
            job.wait()
    store = open_store(str(mirror))
    catalog = Catalog(store, keyring)
    assert catalog.steps() == [2, 3], "the mirror keeps what the job's keep_last keeps"
    report = collect_garbage(store, keep_last=2, safety_age_s=0.0, keyring=keyring)
    assert report.bytes_freed == 0 or catalog.steps() == [2, 3]
    for step in (2, 3):
        verified = verify_checkpoint(store, step, keyring=keyring)
        assert verified.ok, (step, verified.to_dict())
    shutil.rmtree(primary)  # the job's own root is gone (the fast tier too: another machine)
    shutil.rmtree(tmp_path / "fast", ignore_errors=True)
    primary.mkdir()
    restore_settings = {k: v for k, v in settings.items() if k != "local_interval_steps"}
    restore_settings.pop("local_dir", None)
    with CheckpointManager(str(primary), mirrors=[str(mirror)], **restore_settings) as job:
        state = seam_run.blank()
        assert job.restore(state) == 3
        assert seam_run.same(state, seam_run.state(3))
        assert job._restorer.last_restore_uri == mirror.as_uri()
