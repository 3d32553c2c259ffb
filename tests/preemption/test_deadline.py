"""The emergency save against its notice window, told before an eviction: the estimate, the
window of the sources active here, the warning, its event and `spotckpt stats` figure; and the
early hint (AWS's rebalance recommendation from a fake metadata server) that makes an extra save.
"""

from __future__ import annotations

import json
import logging
import threading
from http.server import BaseHTTPRequestHandler
from pathlib import Path

import pytest
import torch
from test_preemption import Answer, FakeMetadata, _wait_for

from spotckpt import CheckpointManager, PreemptionWatcher
from spotckpt.deadline import estimate
from spotckpt.errors import ConfigError
from spotckpt.goodput import EventLog
from spotckpt.policy import SaveDecisionPolicy
from spotckpt.preemption import SIGNAL_WINDOW, Notice, NoticeWindow
from spotckpt.stats import load_stats
from spotckpt.storage import open_store

from dist_worker import launch_ranks


def _state(n: int = 1 << 16) -> dict[str, torch.Tensor]:
    return {"w": torch.arange(n, dtype=torch.float32)}


def _unfit_events(uri: str) -> list[dict[str, object]]:
    log = EventLog(open_store(uri))
    events = []
    for key in log.event_keys():
        event, _ = log._read_one(key)
        if event is not None and event.get("kind") == "unfit":
            events.append(event)
    return events


@pytest.mark.parametrize(
    ("seconds", "window", "fits"),
    [(None, 25.0, True), (10.0, 25.0, True), (20.0, 25.0, True), (21.0, 25.0, False)],
)
def test_an_estimate_fits_by_the_rule_the_notice_applies(
    seconds: float | None, window: float, fits: bool
) -> None:
    policy = SaveDecisionPolicy()
    now = estimate(policy, seconds, "bucket", NoticeWindow(window, SIGNAL_WINDOW))
    assert now.fits is fits
    assert now.fits is policy.fits(seconds, now=0.0, deadline=window)
    value, route = now
    assert (value, route) == (seconds, "bucket")
    if not fits:
        assert "save_budget_s (25 s)" in now.warning()
        assert "does not fit" in now.describe()


def test_a_cloud_window_is_named_by_its_source() -> None:
    now = estimate(SaveDecisionPolicy(), 40.0, "fast tier", NoticeWindow(30.0, "GCE"))
    assert not now.fits
    assert "the GCE notice (30 s)" in now.warning()
    assert "save_budget_s" in now.warning()  # among the fixes: a larger budget does not help here
    assert "fast tier" in now.describe()


class _Source:
    """A polled notice source with a window of its own; `absent` makes it find nobody there."""

    where = "loopback"

    def __init__(self, name: str, window_s: float, absent: bool = False) -> None:
        self.name = name
        self.window_s = window_s
        self.absent = absent
        self.looked = threading.Event()

    def poll_once(self) -> Notice | float:
        self.looked.set()
        if self.absent:
            raise ConnectionRefusedError("nobody there")
        return 0.05


def test_the_window_is_the_shortest_of_the_active_sources(
    watchers: list[PreemptionWatcher],
) -> None:
    short, absent = _Source("Short", 12.0), _Source("Gone", 5.0, absent=True)
    watcher = PreemptionWatcher(
        signals=(), aws=False, gce=False, azure=False, signal_budget_s=40.0, sources=[short, absent]
    )
    assert watcher.window() == NoticeWindow(5.0, "Gone")  # not polled yet: it may be there
    watchers.append(watcher.start())
    assert _wait_for(lambda: not watcher._threads[1].is_alive())  # "Gone" is switched off
    assert watcher.window() == NoticeWindow(12.0, "Short")
    alone = PreemptionWatcher(signals=(), aws=False, gce=False, azure=False, signal_budget_s=7.0)
    assert alone.window() == NoticeWindow(7.0, SIGNAL_WINDOW)


@pytest.mark.timeout(240)
def test_a_state_too_large_for_its_budget_is_told_before_any_eviction(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="spotckpt")
    uri = str(tmp_path / "ck")
    with CheckpointManager(uri, preemption=False, save_budget_s=0.001, keep_last=None) as mgr:
        assert mgr.emergency_estimate().seconds is None  # nothing measured: nothing to tell
        for step in (1, 2, 3):
            mgr.save(step, _state())
        seconds, route = mgr.emergency_estimate()
        assert route == "bucket" and seconds is not None and seconds > 0.001
        assert mgr.emergency_estimate().fits is False
    told = [r.getMessage() for r in caplog.records if "emergency save would now take" in r.message]
    assert len(told) == 1, told  # once, not at every save
    assert "save_budget_s (0.001 s)" in told[0] and "local_dir" in told[0]
    events = _unfit_events(uri)
    assert len(events) == 1
    assert events[0]["emergency_window_source"] == SIGNAL_WINDOW
    assert events[0]["emergency_route"] == "bucket"
    stats = load_stats(open_store(uri))
    assert stats.emergency_estimate_s is not None and stats.emergency_window_s == 0.001
    assert "does not fit" in stats.text()
    # The same state with a budget it fits: no warning, and stats says it fits.
    caplog.clear()
    roomy = str(tmp_path / "roomy")
    with CheckpointManager(roomy, preemption=False, save_budget_s=600.0) as mgr:
        for step in (1, 2):
            mgr.save(step, _state())
        assert mgr.emergency_estimate().fits
    assert not [r for r in caplog.records if "emergency save would now take" in r.message]
    assert _unfit_events(roomy) == []
    assert ": fits" in load_stats(open_store(roomy)).text()


@pytest.mark.timeout(240)
def test_with_a_fast_tier_the_estimate_is_the_fast_save(tmp_path: Path) -> None:
    (tmp_path / "fast").mkdir()
    with CheckpointManager(
        str(tmp_path / "ck"), preemption=False, local_dir=str(tmp_path / "fast")
    ) as mgr:
        mgr.save(1, _state())
        seconds, route = mgr.emergency_estimate()
    assert route == "fast tier" and seconds is not None


def _aws(rebalance: threading.Event) -> FakeMetadata:
    """IMDSv2 with no instance-action notice and, once `rebalance` is set, a recommendation."""

    def respond(request: BaseHTTPRequestHandler) -> Answer:
        if request.command == "PUT" and request.path == "/latest/api/token":
            return 200, {}, b"token"
        if request.path.endswith("/events/recommendations/rebalance") and rebalance.is_set():
            return 200, {}, b'{"noticeTime": "2026-12-05T00:00:00Z"}'
        return 404, {}, b"Not Found"

    return FakeMetadata(respond)


@pytest.mark.timeout(240)
def test_a_rebalance_hint_makes_one_extra_save(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    rebalance = threading.Event()
    server = _aws(rebalance)
    monkeypatch.setenv("AWS_EC2_METADATA_SERVICE_ENDPOINT", f"http://{server.address}")
    try:
        with CheckpointManager(str(tmp_path / "ck"), aws_rebalance=True, keep_last=None) as mgr:
            assert not any(mgr.maybe_save(step, _state()) for step in range(1, 4))
            rebalance.set()
            assert mgr.watcher is not None
            assert _wait_for(lambda: mgr.watcher is not None and mgr.watcher.hint is not None)
            saved = [step for step in range(4, 9) if mgr.maybe_save(step, _state())]
            assert saved == [4]  # once, at the first step after the hint
            assert mgr.steps() == [4]
            assert not mgr.should_stop()  # a hint is no notice: training goes on
    finally:
        server.close()


def test_the_rebalance_setting_needs_the_managers_own_watcher(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="aws_rebalance"):
        CheckpointManager(str(tmp_path / "a"), aws_rebalance=True, preemption=False)
    watcher = PreemptionWatcher(signals=(), aws=False, gce=False, azure=False)
    with pytest.raises(ConfigError, match="aws_rebalance"):
        CheckpointManager(str(tmp_path / "b"), aws_rebalance=True, preemption=watcher)


@pytest.mark.timeout(300)
def test_a_hint_seen_by_one_rank_saves_on_every_rank(tmp_path: Path) -> None:
    rebalance = threading.Event()
    rebalance.set()
    server = _aws(rebalance)
    try:
        args = {
            "uri": str(tmp_path / "ck"),
            "endpoint": f"http://{server.address}",
            "out": str(tmp_path),
        }
        results = launch_ranks(2, "rebalance_hint", args)
    finally:
        server.close()
    for rank, result in enumerate(results):
        assert result.returncode == 0, f"rank {rank}:\n{result.stdout[-4000:]}"
    saved = [json.loads((tmp_path / f"saved-{rank}.json").read_text()) for rank in (0, 1)]
    assert saved == [[1], [1]]
    assert len(_unfit_events(args["uri"])) == 1  # told by the coordinator only, once
