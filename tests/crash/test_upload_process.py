"""The crash explorer in DCP's upload process (issue 46, ``async_mode="process"``): the store's
copy in the upload process really records its calls (rank ``0u``), and faults there (killed,
crashed, a failed call) at a data object's write and commit leave the job with spotckpt's own
error and a root that keeps every invariant (`upload_process`)."""

from __future__ import annotations

import logging
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from explore import Workspace
from recorder import Fault
from scenarios import SAVED_STEPS
from upload_process import SCENARIOS, explore_upload_point, process_group, run_with, upload_points

from spotckpt.layout import step_folder

pytestmark = pytest.mark.process

SCENARIO = SCENARIOS[0]
KINDS = ("kill", "transient", "crash")


@pytest.fixture
def space(tmp_path: Path) -> Iterator[Workspace]:
    """A workspace, and one process group (and upload process) for the whole test."""
    logging.getLogger("spotckpt").setLevel(logging.CRITICAL)  # faults make it warn on purpose
    with process_group():
        yield Workspace.create(tmp_path / "crash")
    logging.getLogger("spotckpt").setLevel(logging.NOTSET)


def _data_object(points: list[str], op: str) -> str:
    """The first point of `op` on a data object of the operation's second save."""
    folder = step_folder(SAVED_STEPS[1])
    return next(p for p in points if p.startswith(f"0u:{op}:{folder}/") and ".safetensors#" in p)


@pytest.mark.timeout(300)
def test_faults_in_the_upload_process_keep_every_invariant(space: Workspace) -> None:
    points = upload_points(SCENARIO, space)
    chosen = [_data_object(points, "write"), _data_object(points, "commit")]
    verdicts = [explore_upload_point(SCENARIO, p, kind, space) for p in chosen for kind in KINDS]
    bad = [f"{v.scenario} {v.point} {v.kind}: {v.violations}" for v in verdicts if v.violations]
    assert not bad, "\n".join(bad)
    assert len(verdicts) == 6


@pytest.mark.timeout(240)
def test_the_upload_process_records_its_calls(space: Workspace) -> None:
    points = upload_points(SCENARIO, space)
    assert points and all(p.startswith("0u:") for p in points), points
    assert any(p.startswith("0u:commit:step-") and ".safetensors#" in p for p in points), points
    assert any(p.startswith("0u:put:step-") and "/manifest.json#" in p for p in points), points
    killed = run_with(SCENARIO, Fault(_data_object(points, "commit"), "kill"), space)
    assert killed.outcome.error is not None and not killed.outcome.raw, killed.outcome
    assert killed.outcome.error.startswith("SaveFailedError: "), killed.outcome.error
    assert "upload process" in killed.outcome.error, killed.outcome.error
