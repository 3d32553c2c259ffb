"""``spotckpt stats`` rejects events whose figures cannot be true, each field within its bounds:
planted next to a real run's events in a local folder, two such events turned the run's request
cost from $0.000073 into $4.98e13 and its overhead share above 100 %."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from spotckpt import CheckpointManager, TrainState
from spotckpt.cli import main
from spotckpt.goodput import MAX_COUNT, MAX_EVENT_SECONDS, EventLog
from spotckpt.layout import EVENT_SUMMARY_KEY
from spotckpt.storage import open_store

COUNTED = {  # a save as a run on S3 records it: $0.000073 of requests at the default prices
    "kind": "save",
    "step": 4,
    "stall_s": 0.2,
    "upload_s": 0.2,
    "train_s": 5.0,
    "write_requests": 12,
    "read_requests": 33,
    "delete_requests": 0,
    "bytes_sent": 4096,
    "bytes_received": 100,
}
FORGED = {
    "requests": {  # 2**63-1 requests of each class in 3 seconds
        "kind": "save",
        "step": 5,
        "stall_s": 0.1,
        "upload_s": 0.1,
        "train_s": 3.0,
        "write_requests": MAX_COUNT,
        "read_requests": MAX_COUNT,
    },
    "overhead": {  # a year-long restore within 10 seconds of training
        "kind": "restore",
        "step": 5,
        "restore_s": MAX_EVENT_SECONDS,
        "train_s": 10.0,
    },
}


@pytest.fixture
def spotckpt_logging() -> Iterator[None]:
    """The CLI points spotckpt's logger at its stderr; put it back for the tests after this."""
    logger = logging.getLogger("spotckpt")
    saved = (list(logger.handlers), logger.propagate, logger.level)
    yield
    logger.handlers, logger.propagate = saved[0], saved[1]
    logger.setLevel(saved[2])


def _stats(root: Path, capsys: pytest.CaptureFixture[str], *options: str) -> tuple[str, str]:
    with pytest.raises(SystemExit) as done:
        main(["stats", str(root), *options])
    captured = capsys.readouterr()
    assert done.value.code == 0, captured.err
    return captured.out, captured.err


def _real_run(root: Path) -> None:
    """Three saves, then a session that restores and saves once more."""
    state = TrainState(model=torch.nn.Linear(4, 2), rng=False)
    with CheckpointManager(str(root), preemption=False) as manager:
        for step in (1, 2, 3):
            manager.save(step, state)
    with CheckpointManager(str(root), preemption=False) as manager:
        manager.restore(state)
        manager.save(4, state)


def test_stats_rejects_planted_events_whose_figures_cannot_be_true(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], spotckpt_logging: None
) -> None:
    root = tmp_path / "run"
    _real_run(root)
    store = open_store(str(root))
    EventLog(store, writer="5e5e5e5e").record(dict(COUNTED))
    before = json.loads(_stats(root, capsys, "--json")[0])
    assert before["cost_requests_total"] == pytest.approx(7.32e-5)
    assert 0 < before["overhead_share"] < 1

    planted = [EventLog(store, writer="f0f0f0f0").record(dict(e)) for e in FORGED.values()]
    out, err = _stats(root, capsys, "--json")
    after = json.loads(out)
    assert after["cost_requests_total"] == pytest.approx(7.32e-5)
    assert after["overhead_share"] == pytest.approx(before["overhead_share"])
    assert (before["rejected_events"], after["rejected_events"]) == (0, 2)
    assert after["events"] == before["events"] and after["restores"] == before["restores"]
    (warning,) = [line for line in err.splitlines() if "cannot be true" in line]
    assert all(key in warning for key in planted) and "rejected 2 goodput event(s)" in warning
    assert "requests in" in warning and "share above 100 %" in warning

    text, _ = _stats(root, capsys)
    assert "rejected" in text and "2 events left out" in text


def test_a_summary_whose_sums_cannot_be_true_is_ignored(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], spotckpt_logging: None
) -> None:
    """Compaction keeps the count of rejected events; a summary claiming more overhead than
    training is malformed, like one with a field out of bounds."""
    root = tmp_path / "run"
    store = open_store(str(root))
    log = EventLog(store, max_events=4)
    log.record(dict(FORGED["requests"]))
    for _ in range(5):
        log.record({"kind": "save", "stall_s": 1.0, "train_s": 60.0})
    summary = json.loads(store.get(EVENT_SUMMARY_KEY))
    assert summary["rejected"] == 1
    stats = json.loads(_stats(root, capsys, "--json")[0])
    assert (stats["saves"], stats["rejected_events"]) == (5, 1)

    summary["sums"]["stall_s"] = summary["sums"]["train_s"] * 2
    store.put(EVENT_SUMMARY_KEY, json.dumps(summary).encode())
    out, err = _stats(root, capsys, "--json")
    assert "malformed goodput record events/summary.json" in err and "above 100 %" in err
    assert json.loads(out)["overhead_share"] <= 1
