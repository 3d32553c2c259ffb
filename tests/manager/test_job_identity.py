"""The job identity: ``job.json`` at the checkpoint root, created once at the first save."""

from __future__ import annotations

import json
import logging
import threading
from pathlib import Path

import pytest
import torch

from spotckpt import CheckpointManager
from spotckpt.catalog import Catalog
from spotckpt.errors import ManifestError
from spotckpt.layout import JOB_KEY, MAX_JOB_BYTES, JobIdentity, is_job_id
from spotckpt.storage import open_store


def test_it_is_created_once_then_read_back(tmp_path: Path) -> None:
    catalog = Catalog(open_store(str(tmp_path)))
    assert catalog.job() is None  # a root never saved to (or by an older version) has none
    job = catalog.ensure_job()
    assert is_job_id(job.id) and catalog.ensure_job() == catalog.job() == job
    document = json.loads((tmp_path / JOB_KEY).read_bytes())
    assert document == {"format": "spotckpt-job/1", "id": job.id, "created_at": job.created_at}


def test_two_creators_at_once_both_get_the_one_that_won(s3_uri: str) -> None:
    """Create-only (If-None-Match on S3): of two creators one wins, and both return it."""
    found: list[JobIdentity] = []
    start = threading.Barrier(2)

    def create() -> None:
        catalog = Catalog(open_store(s3_uri))
        start.wait()
        found.append(catalog.ensure_job())

    threads = [threading.Thread(target=create) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(found) == 2 and found[0] == found[1] == Catalog(open_store(s3_uri)).job()


@pytest.mark.parametrize(
    "content",
    [
        b"",
        b"{",
        json.dumps({"format": "spotckpt-job/1", "id": "../../x", "created_at": "t"}).encode(),
        json.dumps({"format": "spotckpt-job/9", "id": "0" * 32, "created_at": "t"}).encode(),
        b" " * (MAX_JOB_BYTES + 1),
    ],
    ids=["empty", "truncated", "bad-id", "unknown-format", "too-large"],
)
def test_a_damaged_identity_is_a_manifest_error_and_never_overwritten(
    tmp_path: Path, content: bytes
) -> None:
    (tmp_path / JOB_KEY).write_bytes(content)
    catalog = Catalog(open_store(str(tmp_path)))
    with pytest.raises(ManifestError, match="job identity"):
        catalog.job()
    with pytest.raises(ManifestError, match="job identity"):
        catalog.ensure_job()
    assert (tmp_path / JOB_KEY).read_bytes() == content


# The manager ----------------------------------------------------------------------------------


def _state() -> dict[str, torch.Tensor]:
    return {"w": torch.arange(16.0)}


def test_the_first_save_of_any_kind_creates_it_and_a_restore_never_does(tmp_path: Path) -> None:
    catalog = Catalog(open_store(str(tmp_path / "b")))
    with CheckpointManager(str(tmp_path / "b"), preemption=False) as mgr:
        assert mgr.restore(_state()) is None
        assert catalog.job() is None
        mgr.save(1, _state())
    job = catalog.job()
    assert job is not None
    with CheckpointManager(str(tmp_path / "b"), preemption=False) as again:
        again.save(2, _state())
    assert catalog.job() == job  # a restart of the job keeps its identity
    (tmp_path / "fast").mkdir()
    options = {"local_dir": str(tmp_path / "fast" / "{node}"), "local_interval_steps": 1}
    with CheckpointManager(str(tmp_path / "tier-only"), preemption=False, **options) as fast:
        fast.maybe_save(1, _state())  # a fast-tier save only
        assert fast.steps() == []
    assert Catalog(open_store(str(tmp_path / "tier-only"))).job() is not None


def test_saves_go_on_past_a_damaged_identity_without_the_fast_tier(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    root = tmp_path / "b"
    root.mkdir()
    (root / JOB_KEY).write_bytes(b"{")
    (tmp_path / "fast").mkdir()
    options = {"local_dir": str(tmp_path / "fast" / "{node}"), "preemption": False}
    with (
        caplog.at_level(logging.WARNING, logger="spotckpt"),
        CheckpointManager(str(root), **options) as mgr,
    ):
        mgr.save(1, _state())  # straight to the bucket: the fast tier needs the identity
        assert mgr.steps() == [1]
    assert "no job identity at" in caplog.text and "move a damaged job.json aside" in caplog.text
    assert (root / JOB_KEY).read_bytes() == b"{"
    assert not list((tmp_path / "fast").glob("*/step-*"))
