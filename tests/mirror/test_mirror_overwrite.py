"""A step saved again with ``dcp_writer(overwrite=True)`` after it was mirrored (docs/mirrors.md,
"What a mirror does not protect"): the mirror never overwrites it, the conflict is reported by
every catch-up, and a restore reads the root's save while the root can be read (the mirror's
only when it cannot), whichever copy is nearest."""

from __future__ import annotations

import shutil
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

import spotckpt
from spotckpt.catalog import Catalog
from spotckpt.mirroring import Mirror
from spotckpt.storage import open_store

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def _save(root: Path, value: float, *, overwrite: bool = False) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(
            {"w": torch.full((64,), value)},
            storage_writer=spotckpt.dcp_writer(str(root), 5, overwrite=overwrite),
            no_dist=True,
        )


def _restore(root: Path, mirror: Path) -> float:
    state = {"w": torch.zeros(64)}
    with spotckpt.CheckpointManager(
        str(root), mirrors=[str(mirror)], nearest_copy=str(mirror), preemption=False
    ) as manager:
        assert manager.restore(state) == 5
    assert torch.equal(state["w"], torch.full((64,), float(state["w"][0])))
    return float(state["w"][0])


def test_a_step_saved_again_after_it_was_mirrored_is_reported_and_never_restored_stale(
    tmp_path: Path,
) -> None:
    root, mirror_root = tmp_path / "root", tmp_path / "mirror"
    _save(root, 1.0)
    mirror = Mirror(Catalog(open_store(str(root))), Catalog(open_store(str(mirror_root))))
    assert not mirror.catch_up().failed
    assert _restore(root, mirror_root) == 1.0
    _save(root, 2.0, overwrite=True)
    for _ in range(2):  # reported at every catch-up, never copied over the mirror's step
        report = mirror.catch_up()
        assert list(report.failed) == [5] and "saved again" in report.failed[5]
        assert report.copied == []
    assert _restore(root, mirror_root) == 2.0  # the root's save, though the mirror is nearest
    shutil.rmtree(root)
    root.mkdir()  # the root lost (a new, empty one): the mirror's save is the one there is
    assert _restore(root, mirror_root) == 1.0


def test_a_step_saved_again_with_the_same_bytes_is_not_a_conflict(tmp_path: Path) -> None:
    """An unchanged source manifest is read once: later catch-ups only look at its size and time."""
    root, mirror_root = tmp_path / "root", tmp_path / "mirror"
    _save(root, 1.0)
    mirror = Mirror(Catalog(open_store(str(root))), Catalog(open_store(str(mirror_root))))
    mirror.catch_up()
    assert not mirror.catch_up().failed
    assert mirror._same_save.keys() == {5}
