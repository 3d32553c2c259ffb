"""Asynchronous saves: the loop stalls only for staging; errors surface, never swallowed."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from spotckpt import CheckpointManager, SaveFailedError
from spotckpt.storage import open_store

from dist_worker import launch_ranks
from tests_support import FailingStore

MIB = 1 << 20


@pytest.fixture(params=["local", "s3"])
def uri(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    return str(tmp_path / "ck") if request.param == "local" else request.getfixturevalue("s3_uri")


def _options(uri: str) -> dict[str, Any]:
    return {"part_size": 5 * MIB} if uri.startswith("s3://") else {}


@pytest.mark.process
def test_async_save_snapshots_state_and_commits_on_wait(uri: str) -> None:
    state = {"w": torch.randn(2 * MIB), "step": 1}
    expected = state["w"].clone()
    with CheckpointManager(
        uri, async_save=True, preemption=False, storage_options=_options(uri)
    ) as mgr:
        mgr.save(1, state)
        state["w"].add_(1.0)  # training goes on while the upload runs
        mgr.wait()
        assert mgr.steps() == [1]
        target = {"w": torch.empty(2 * MIB), "step": 0}
        assert mgr.restore(target) == 1
        assert torch.equal(target["w"], expected)


@pytest.mark.process
def test_a_new_save_waits_for_the_previous(uri: str) -> None:
    with CheckpointManager(
        uri, async_save=True, preemption=False, storage_options=_options(uri)
    ) as mgr:
        for step in range(1, 4):
            mgr.save(step, {"w": torch.full((MIB,), float(step))})
        mgr.wait()
        assert mgr.steps() == [1, 2, 3]


@pytest.mark.process
def test_upload_error_is_raised_on_next_call_and_at_close(uri: str) -> None:
    store = FailingStore(open_store(uri, **_options(uri)), fail_after_bytes=MIB)
    mgr = CheckpointManager(uri, async_save=True, preemption=False, store=store, interval_steps=100)
    mgr.save(1, {"w": torch.randn(2 * MIB)})
    if mgr._saver.pending is not None:
        mgr._saver.pending.upload.exception()  # let the background upload fail before the next call
    with pytest.raises(SaveFailedError, match="injected"):
        mgr.maybe_save(2, {"w": torch.randn(2 * MIB)})
    assert mgr.steps() == []
    mgr.save(3, {"w": torch.randn(2 * MIB)})
    with pytest.raises(SaveFailedError, match="injected"):
        mgr.close()


@pytest.mark.process
@pytest.mark.timeout(300)
def test_ranks_that_see_an_upload_done_at_different_steps_commit_it_together(
    tmp_path: Path,
) -> None:
    """One rank looks a second later than the other at every step: an upload is done for it and
    not yet for the other. The commit (which runs collectives) waits until both see it done."""
    args = {"uri": str(tmp_path / "ck"), "out": str(tmp_path)}
    results = launch_ranks(2, "async_commit_skew", args)
    for rank, result in enumerate(results):
        assert result.returncode == 0, f"rank {rank}:\n{result.stdout[-4000:]}"
    ranks = [json.loads((tmp_path / f"steps-{rank}.json").read_text()) for rank in (0, 1)]
    assert [r["steps"] for r in ranks] == [[2, 4, 6], [2, 4, 6]]
    assert ranks[0]["seen"] == ranks[1]["seen"]  # each commit at the same step on both ranks
