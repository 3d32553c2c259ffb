"""The seam test of issue 44: spotckpt's features crossed with its operations (`seam_cells`, a
2-way covering array), a damaged or planted object in the bucket where it applies.

Every cell saves steps 1-3 with its features on (real gloo ranks where it is indexed, resharded
or uploads from DCP's process), plants its fault in the real bucket folder, runs its operation,
then checks: the newest readable committed step restores bit-exact (a damaged newest one is
refused and the older one restored), no committed step loses an object (every committed step
the fault did not touch verifies), and nothing raises but spotckpt's own errors. A combination
spotckpt refuses (the fast tier with process-mode async) is a cell whose refusal is checked.

``SPOTCKPT_SEAMS_SEED`` picks `make test`'s sample (default 44): a few in-process cells and one
multi-rank cell; the rest is marked slow (`make test-all`). The table of cells:
``python tests/seams/seam_cells.py``.
"""

from __future__ import annotations

import json
import os
import random
import shutil
from pathlib import Path
from typing import Any

import pytest
import seam_run
from safetensors.torch import load_file
from seam_cells import Cell, covering_array, table, wide_cell
from seam_run import NEXT, NOTICE_STEP, phase, same, state

from spotckpt import CheckpointManager
from spotckpt.catalog import Catalog
from spotckpt.errors import CheckpointError, ConfigError
from spotckpt.export import export_hf
from spotckpt.format.references import object_path
from spotckpt.layout import manifest_key, step_folder
from spotckpt.storage import open_store
from spotckpt.verify import verify_checkpoint

from dist_worker import launch_ranks
from tests_support import flip_keeping_crc32c, write_signing_key

SEED = int(os.environ.get("SPOTCKPT_SEAMS_SEED", "44"))
CELLS = covering_array()
WIDE = wide_cell()
IN_PROCESS_SAMPLE = 7


def sample(cells: list[Cell], seed: int) -> list[Cell]:
    """`make test`'s share: in-process cells and one multi-rank cell (no upload process)."""
    rng = random.Random(seed)
    local = [c for c in cells if c.in_process]
    ranked = [c for c in cells if not c.in_process and not c.process_async and not c.refused]
    return [*rng.sample(local, IN_PROCESS_SAMPLE), rng.choice(ranked)]


SAMPLE = sample(CELLS, SEED)
SAMPLED = {cell.id for cell in SAMPLE}

XFAIL: dict[str, str] = {}
"""Cells failing on a known issue 44 item not fixed yet: cell id -> the item."""


def _param(cell: Cell, slow: bool) -> Any:
    marks: list[Any] = [] if cell.in_process else [pytest.mark.process]
    if slow:
        marks.append(pytest.mark.slow)
    if cell.id in XFAIL:
        marks.append(pytest.mark.xfail(reason=XFAIL[cell.id], strict=False))
    if cell.save_world >= 32:
        marks.append(pytest.mark.timeout(900))
    return pytest.param(cell, id=cell.id, marks=marks)


PARAMS = [_param(cell, cell.id not in SAMPLED) for cell in CELLS] + [_param(WIDE, True)]


# Running a phase -------------------------------------------------------------------------------


def _paths(tmp_path: Path, cell: Cell) -> dict[str, str]:
    (tmp_path / "fast").mkdir()
    key = tmp_path / "signing.pem"
    if cell.signed:
        write_signing_key(key)
    return {"bucket": str(tmp_path / "bucket"), "fast": str(tmp_path / "fast"), "key": str(key)}


def _run(cell: Cell, name: str, paths: dict[str, str], world: int, tmp: Path) -> list[dict]:
    """Phase `name` on `world` ranks (in this process where one needs no process group); what
    each rank saw. No raw exception anywhere."""
    if world == 1 and not cell.process_async:
        seen = [phase(cell, name, paths)]
    else:
        out = tmp / f"out-{name}"
        out.mkdir()
        args = {"cell": cell.__dict__, "phase": name, "paths": paths, "out": str(out)}
        timeout = 240 + 20 * world
        results = launch_ranks(world, "phase", args, timeout, worker=seam_run.__file__)
        for rank, result in enumerate(results):
            assert result.returncode == 0, (
                f"rank {rank} exited {result.returncode}:\n" + (result.stdout[-4000:])
            )
        seen = [json.loads((out / f"rank-{r}.json").read_text()) for r in range(world)]
    for rank in seen:
        assert not rank.get("raw"), f"raw exception on rank {rank['rank']}: {rank['traceback']}"
    return seen


def _ok(seen: list[dict]) -> None:
    errors = [f"rank {r['rank']}: {r['error_type']}: {r['error']}" for r in seen if "error" in r]
    assert not errors, "\n".join(errors)


# Faults ----------------------------------------------------------------------------------------


def _plant(cell: Cell, paths: dict[str, str]) -> set[int]:
    """Plant the cell's fault in the bucket folder; the steps it damaged."""
    root = Path(paths["bucket"])
    if cell.fault == "damaged_object":  # the newest step's own bytes of model.w
        manifest = Catalog(open_store(str(root)), seam_run.keyring(cell, paths)).read_manifest(3)
        location = manifest.tensors["model.w"].chunks[0].location
        path = root / object_path(step_folder(3), location.key)
        data = bytearray(path.read_bytes())
        at = location.offset + min(16, location.stored_length // 2 - 8)
        if cell.signed:  # every CRC32C kept: the signature's hashes must tell
            flip_keeping_crc32c(data, at, at + 4)
        else:
            data[at] ^= 0xFF
        path.write_bytes(bytes(data))
        return {3}
    if cell.fault == "planted_step":  # a higher step nobody of this job committed
        if cell.signed:  # an unsigned copy of the newest step, as a writer without the key
            document = json.loads((root / manifest_key(3)).read_text())
            for field in ("signature", "job"):
                document.pop(field, None)
            document["step"] = 4
            shutil.copytree(root / step_folder(3), root / step_folder(4))
        else:  # a manifest of a format from the future
            document = {"format": "spotckpt/99", "step": 4, "features": ["from-the-future"]}
            (root / step_folder(4)).mkdir()
        (root / manifest_key(4)).write_text(json.dumps(document))
        return {4}
    if cell.fault == "damaged_old_manifest":  # the oldest step's manifest, cut in half
        path = root / manifest_key(1)
        path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
        return {1}
    return set()


# Checks ----------------------------------------------------------------------------------------


def _newest(cell: Cell) -> int:
    """The newest readable committed step once the operation ran (the bucket alone)."""
    if cell.op == "notice_during_upload":
        return NOTICE_STEP
    if cell.op in ("save", "retention_k1", "retention_k2", "gc_during_save"):
        return NEXT
    return 2 if cell.fault == "damaged_object" else 3


def _check_restored(cell: Cell, seen: list[dict]) -> None:
    allowed = {_newest(cell)}
    if cell.fault == "damaged_object" and cell.fast_tier:
        allowed.add(3)  # the tier's intact copy of the step the bucket lost
    _ok(seen)
    for rank in seen:
        assert rank["step"] in allowed and rank["exact"], rank


def _check_export(cell: Cell, paths: dict[str, str], tmp: Path) -> None:
    store, keys = open_store(paths["bucket"]), seam_run.keyring(cell, paths)
    if cell.fault == "damaged_object":
        with pytest.raises(CheckpointError):
            export_hf(store, 3, str(tmp / "hf-damaged"), keyring=keys)
    step = _newest(cell)
    export_hf(store, step, str(tmp / "hf"), keyring=keys)
    exported: dict[str, Any] = {}
    for path in sorted((tmp / "hf").glob("*.safetensors")):
        exported.update(load_file(str(path)))
    assert same(exported, state(step)["model"])


def _check_bucket(cell: Cell, paths: dict[str, str], damaged: set[int]) -> None:
    """No committed step lost an object; the newest readable one restores bit-exact."""
    store, keys = open_store(paths["bucket"]), seam_run.keyring(cell, paths)
    steps = Catalog(store, keys).steps()
    for step in steps:
        report = verify_checkpoint(store, step, keyring=keys)
        if step in damaged:
            assert cell.op != "verify" or not report.ok, f"step {step}: the fault went unseen"
        else:
            assert report.ok, f"step {step} of {steps}: {[str(p) for p in report.problems]}"
    if cell.op in ("retention_k1", "retention_k2") and cell.fault == "none":
        assert steps == [3, NEXT][-int(cell.op[-1]) :], steps
    signing = {"signing_key": paths["key"]} if cell.signed else {}
    with CheckpointManager(paths["bucket"], preemption=False, keep_last=None, **signing) as mgr:
        into = seam_run.blank()
        step = mgr.restore(into)
    assert step == _newest(cell) and same(into, state(step)), step
    if not cell.indexed:  # so every cell meets the packed form: the state's 20 small tensors
        assert "packed" in Catalog(store, keys).read_manifest(step).features, step


@pytest.mark.parametrize("cell", PARAMS)
def test_seam_cell(cell: Cell, tmp_path: Path) -> None:
    paths = _paths(tmp_path, cell)
    if cell.refused:
        (seen,) = _run(cell, "setup", paths, 1, tmp_path)
        assert seen.get("error_type") == ConfigError.__name__, seen
        assert "does not combine with local_dir" in seen["error"]
        assert Catalog(open_store(paths["bucket"])).steps() == []
        return
    _ok(_run(cell, "setup", paths, cell.save_world, tmp_path))
    damaged = _plant(cell, paths)
    if cell.op == "export_hf":
        _check_export(cell, paths, tmp_path)
    elif cell.op != "verify":
        seen = _run(cell, cell.op, paths, cell.op_world, tmp_path)
        if cell.op.endswith("restore"):
            _check_restored(cell, seen)
        else:
            _ok(seen)
            assert _newest(cell) in seen[0]["steps"], seen[0]
            if cell.op == "gc_during_save" and not cell.process_async:
                assert seen[0]["gc_fired"], "gc never ran between the write and the commit"
            if cell.op == "notice_during_upload":  # the held upload was cancelled everywhere
                assert all(rank["stopped"] for rank in seen), seen
                # held mid-object (the tier's upload of a small object is one write: it ends)
                cancelled = seen[0]["held"] and not cell.fast_tier
                assert not cancelled or NEXT not in seen[0]["steps"], seen[0]
    _check_bucket(cell, paths, damaged)


def test_the_cells_cover_every_pair() -> None:
    from seam_cells import missing_pairs

    assert missing_pairs(CELLS) == set()
    assert len({cell.id for cell in [*CELLS, WIDE]}) == len(CELLS) + 1
    assert any(cell.refused for cell in CELLS)
    assert covering_array() == CELLS  # deterministic


def test_the_sample_is_reproducible_and_small() -> None:
    assert [c.id for c in sample(CELLS, SEED)] == [c.id for c in SAMPLE]
    assert sum(not cell.in_process for cell in SAMPLE) <= 1
    assert table([*CELLS, WIDE], SAMPLED).count("*") == len(SAMPLE)
