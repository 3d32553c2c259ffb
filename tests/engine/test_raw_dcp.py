"""spotckpt as a plain DCP storage back end: dcp_writer / dcp_reader without a manager."""

from __future__ import annotations

import io
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

import spotckpt
from spotckpt import CheckpointAlreadyCommittedError, NoCheckpointError
from spotckpt.catalog import Catalog
from spotckpt.layout import manifest_key
from spotckpt.storage import open_store

from dist_worker import run_ranks
from tests_support import Exploit, forge_value


def _state(value: float) -> dict[str, object]:
    model = torch.nn.Linear(8, 4)
    with torch.no_grad():
        model.weight.fill_(value)
        model.bias.fill_(-value)
    return {"model": model.state_dict(), "step": int(value), "note": f"v{value}"}


def _blank() -> dict[str, object]:
    return _state(0.0)


@pytest.fixture(params=["local", "s3"])
def uri(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    return str(tmp_path / "ck") if request.param == "local" else request.getfixturevalue("s3_uri")


@pytest.mark.process
def test_save_and_load_latest(uri: str) -> None:
    dcp.save(_state(1.0), storage_writer=spotckpt.dcp_writer(uri, 1), no_dist=True)
    dcp.save(_state(2.0), storage_writer=spotckpt.dcp_writer(uri, 2), no_dist=True)
    assert Catalog(open_store(uri)).steps() == [1, 2]
    latest = _blank()
    dcp.load(latest, storage_reader=spotckpt.dcp_reader(uri), no_dist=True)
    assert torch.equal(latest["model"]["weight"], torch.full((4, 8), 2.0))  # type: ignore[index]
    assert latest["step"] == 2 and latest["note"] == "v2.0"
    first = _blank()
    dcp.load(first, storage_reader=spotckpt.dcp_reader(uri, step=1), no_dist=True)
    assert torch.equal(first["model"]["bias"], torch.full((4,), -1.0))  # type: ignore[index]


@pytest.mark.process
def test_async_save_commits(uri: str) -> None:
    future = dcp.async_save(_state(3.0), storage_writer=spotckpt.dcp_writer(uri, 3), no_dist=True)
    result = future.upload_completion if hasattr(future, "upload_completion") else future
    result.result()
    assert Catalog(open_store(uri)).steps() == [3]


def test_a_committed_step_is_never_overwritten(tmp_path: Path) -> None:
    uri = str(tmp_path)
    dcp.save(_state(1.0), storage_writer=spotckpt.dcp_writer(uri, 1), no_dist=True)
    with pytest.raises(CheckpointException) as caught:
        dcp.save(_state(9.0), storage_writer=spotckpt.dcp_writer(uri, 1), no_dist=True)
    causes = [f[0] if isinstance(f, tuple) else f for f in caught.value.failures.values()]
    assert any(isinstance(c, CheckpointAlreadyCommittedError) for c in causes)
    again = _blank()
    dcp.load(again, storage_reader=spotckpt.dcp_reader(uri), no_dist=True)
    assert again["step"] == 1


def test_no_checkpoint_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(NoCheckpointError, match="no committed checkpoint"):
        spotckpt.dcp_reader(str(tmp_path))


def test_default_planner_never_unpickles_bucket_bytes(tmp_path: Path) -> None:
    """DCP's own planner unpickles value bytes unrestricted; the reader hands it only safe ones."""
    uri = str(tmp_path / "ck")
    dcp.save(_state(1.0), storage_writer=spotckpt.dcp_writer(uri, 1), no_dist=True)
    marker = tmp_path / "pwned"
    payload = io.BytesIO()
    torch.save(Exploit(marker), payload)
    forge_value(tmp_path / "ck", 1, "note", payload.getvalue())
    with pytest.raises((CheckpointException, spotckpt.CheckpointError)):
        dcp.load(_blank(), storage_reader=spotckpt.dcp_reader(uri), no_dist=True)
    assert not marker.exists()
    assert open_store(uri).exists(manifest_key(1))


def test_two_ranks_save_and_load(s3_uri: str, tmp_path: Path) -> None:
    run_ranks(2, "raw_dcp", {"uri": s3_uri, "out": str(tmp_path)})
    manifest = Catalog(open_store(s3_uri)).read_manifest(4)
    assert manifest.world_size == 2
    assert (tmp_path / "loaded-0").read_text() == (tmp_path / "loaded-1").read_text() == "ok"
