"""The goodput event log: the events that managers write (to a local folder and to the moto S3
server), their compaction, and malformed or forged objects read back from ``events/``.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from goodput_support import small_model

from spotckpt import CheckpointManager, PreemptionWatcher, TrainState
from spotckpt.errors import StorageError
from spotckpt.goodput import MAX_EVENT_BYTES, SUMMARY_FORMAT, EventLog
from spotckpt.interval import (
    STARTING_INTERVAL_STEPS,
)
from spotckpt.layout import EVENT_SUMMARY_KEY, EVENTS_PREFIX, parse_event_key
from spotckpt.stats import (
    load_stats,
)
from spotckpt.storage import ObjectInfo, ObjectStore, open_store

from tests_support import DEEP_JSON, FORGED_GOODPUT, HUGE_INT, forged_event_key

# Events -------------------------------------------------------------------------------------------


def _events(store: ObjectStore) -> list[dict[str, Any]]:
    keys = sorted(i.key for i in store.list(EVENTS_PREFIX) if parse_event_key(i.key))
    return [json.loads(store.get(k)) for k in keys]


@pytest.mark.process
def test_save_preemption_restore_write_the_expected_events(root: str) -> None:
    state = TrainState(model=small_model(), rng=False)
    watcher = PreemptionWatcher()
    with CheckpointManager(root, preemption=watcher, interval_steps=2) as manager:
        assert manager.restore(state) is None
        for step in range(1, 4):
            if step == 3:
                watcher.trigger("SIGTERM", deadline=time.monotonic() + 60)
            manager.maybe_save(step, state)
        assert manager.should_stop()
    with CheckpointManager(root, preemption=False, interval_steps=2) as manager:
        assert manager.restore(state) == 3
        store = manager.store
        events = _events(store)
        assert [e["kind"] for e in events] == ["save", "save", "preemption", "restore"]
        periodic, emergency, preemption, restore = events
        assert periodic["step"] == 2 and periodic["emergency"] is False
        assert periodic["stall_s"] > 0 and periodic["upload_s"] > 0 and periodic["bytes"] > 0
        assert periodic["throughput_bytes_per_s"] > 0 and periodic["interval_steps"] == 2
        assert emergency["step"] == 3 and emergency["emergency"] is True
        assert preemption["source"] == "SIGTERM"
        assert 0 < preemption["notice_left_s"] <= 60
        assert preemption["step_at_notice"] == 3 and preemption["step_saved"] == 3
        assert preemption["steps_lost"] == 0 and preemption["emergency_save_s"] > 0
        assert restore["step"] == 3 and restore["restore_s"] > 0
        assert len({e["writer"] for e in events}) == 2  # one id per session's coordinator
        stats = load_stats(store)
    assert (stats.saves, stats.evictions, stats.restores, stats.steps_lost) == (2, 1, 1, 0)
    assert stats.stall_median_s == periodic["stall_s"]  # the emergency save is not a periodic cost


def test_a_preemption_with_no_time_left_records_the_steps_lost(tmp_path: Path) -> None:
    state = TrainState(model=small_model(), rng=False)
    watcher = PreemptionWatcher()
    with CheckpointManager(str(tmp_path), preemption=watcher, interval_steps=2) as manager:
        for step in range(1, 6):
            if step == 5:
                watcher.trigger("aws:terminate", deadline=time.monotonic() - 1)
            manager.maybe_save(step, state)
        assert manager.steps() == [2, 4]
        (preemption,) = [e for e in _events(manager.store) if e["kind"] == "preemption"]
    assert preemption["source"] == "aws:terminate" and preemption["notice_left_s"] < 0
    assert (preemption["step_at_notice"], preemption["step_saved"]) == (5, 4)
    assert preemption["steps_lost"] == 1


def test_compaction_keeps_the_event_objects_bounded_and_the_counts_right(tmp_path: Path) -> None:
    store = open_store(str(tmp_path))
    log = EventLog(store, max_events=10)
    kinds = ["save", "save", "restore", "save", "preemption"]
    for number in range(47):
        log.record({"kind": kinds[number % 5], "stall_s": 1.0, "train_s": 2.0, "steps_lost": 1})
        assert len(log.event_keys()) <= 10
    assert store.exists(EVENT_SUMMARY_KEY)
    totals = log.totals()
    assert totals.counts == {"save": 29, "restore": 9, "preemption": 9}
    assert totals.sums["train_s"] == 94.0 and totals.sums["steps_lost"] == 9.0
    assert totals.sums["stall_s"] == 29.0 and totals.events == 47
    # A crash between the summary's write and the deletes leaves folded events behind: they are
    # not counted twice, and the next compaction removes them.
    summary = json.loads(store.get(EVENT_SUMMARY_KEY))
    through = summary["through"]
    store.put(through, json.dumps({"kind": "save", "train_s": 2.0}).encode())
    assert EventLog(store).totals().counts == totals.counts
    EventLog(store, max_events=4).compact()
    assert not store.exists(through) and EventLog(store).totals().counts == totals.counts


def test_a_manager_compacts_its_events(tmp_path: Path) -> None:
    state = TrainState(model=small_model(), rng=False)
    with CheckpointManager(str(tmp_path), preemption=False, max_events=6) as manager:
        for step in range(1, 16):
            manager.save(step, state)
            assert len(manager.goodput.events.event_keys()) <= 6  # type: ignore[union-attr]
        assert load_stats(manager.store).saves == 15


class EventsFailStore:
    """A real store whose puts under events/ fail (as an outage or a missing permission would)."""

    def __init__(self, inner: ObjectStore) -> None:
        self.inner = inner
        self.failed = 0

    def put(self, key: str, data: bytes, *, create_only: bool = False) -> ObjectInfo:
        if key.startswith(EVENTS_PREFIX):
            self.failed += 1
            raise StorageError(f"injected failure writing {key}")
        return self.inner.put(key, data, create_only=create_only)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


@pytest.fixture
def failing_store(tmp_path: Path) -> Iterator[EventsFailStore]:
    yield EventsFailStore(open_store(str(tmp_path / "ck")))


def test_an_event_write_failure_is_a_warning_and_the_save_stays_committed(
    failing_store: EventsFailStore, caplog: pytest.LogCaptureFixture
) -> None:
    state = TrainState(model=small_model(), rng=False)
    manager = CheckpointManager(
        failing_store.uri,
        store=failing_store,
        preemption=False,
        async_save=True,  # type: ignore[arg-type]
    )
    with caplog.at_level(logging.WARNING, logger="spotckpt"), manager:
        manager.save(1, state, blocking=True)
        manager.save(2, state)
        manager.wait()
        assert manager.steps() == [1, 2]
    assert failing_store.failed == 2
    warnings = [r.getMessage() for r in caplog.records if "could not record" in r.getMessage()]
    assert len(warnings) == 2 and "the checkpoint is not affected" in warnings[0]


# Forged events ------------------------------------------------------------------------------------

_MALFORMED_EVENTS = [
    b'{"kind": "save", "stall_s": ' + DEEP_JSON + b"}",
    b'{"kind": "save", "stall_s": ' + HUGE_INT + b"}",
    b'{"kind": "save", "bytes": 123456789012345678901}',  # 21 digits
    b'{"kind": "save", "stall_s": NaN}',
    b'{"kind": "save", "upload_s": Infinity}',
    b'{"kind": "save", "train_s": 1e309}',  # parses as infinity
    b'{"kind": "save", "stall_s": -1.0}',
    b'{"kind": "save", "step_time_s": 1e300}',  # longer than a year
    b'{"kind": "save", "train_s": true}',
    b'{"kind": "save", "step_time_s": "5"}',
    b'{"kind": "save", "interval_steps": 0}',
    b'{"kind": "save", "interval_steps": 2.5}',
    b'{"kind": "preemption", "steps_lost": -3}',
    b'{"kind": "preemption", "notice_left_s": -1e300}',
    b'{"kind": "save", "emergency": "yes"}',
    b'{"kind": 7}',
    b'[{"kind": "save"}]',
    b'{"kind": "save", "stall_s": 1.0',  # truncated
    b'\xff\xfe{"kind": "save"}',  # not UTF-8
    b'{"kind": "save", "pad": "' + b"x" * MAX_EVENT_BYTES + b'"}',  # too large
]


@pytest.mark.process
def test_malformed_events_are_skipped_with_one_warning_per_read(
    root: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A flood of malformed event objects (each a different break) beside two good ones: the
    figures count the good ones only, and each read warns once, naming the first bad object."""
    store = open_store(root)
    for number, data in enumerate(_MALFORMED_EVENTS):
        store.put(forged_event_key(number), data)
    good = {"kind": "save", "stall_s": 2.0, "train_s": 10.0, "step_time_s": 0.5}
    for number in (100, 101):
        store.put(forged_event_key(number), json.dumps(good).encode())
    first = sorted(forged_event_key(n) for n in range(len(_MALFORMED_EVENTS)))[0]
    with caplog.at_level(logging.WARNING, logger="spotckpt"):
        totals = EventLog(store).totals()
        stats = load_stats(store)
    assert totals.counts == {"save": 2} and totals.sums["train_s"] == 20.0
    assert totals.recent == {"stall_s": [2.0, 2.0]} and totals.last_number("step_time_s") == 0.5
    assert (stats.saves, stats.stall_median_s, stats.step_time_s) == (2, 2.0, 0.5)
    warnings = [r.getMessage() for r in caplog.records if "malformed goodput" in r.getMessage()]
    assert len(warnings) == 2, warnings  # one per read, not one per object
    assert all(first in w and f"and {len(_MALFORMED_EVENTS) - 1} more" in w for w in warnings)


def _written_by_compaction(store: ObjectStore) -> bool:
    """Whether the summary is one that compaction wrote (over a forged one)."""
    document = json.loads(store.get(EVENT_SUMMARY_KEY))
    through = document.get("through")
    return document.get("format") == SUMMARY_FORMAT and parse_event_key(through) is not None


_MALFORMED_SUMMARIES: list[dict[str, Any]] = [
    {"counts": {"preemption": -1}},
    {"counts": {"save": 1.5}},
    {"counts": [1, 2]},
    {"events": True},
    {"sums": {"train_s": "NaN"}},
    {"sums": {"stall_s": 1e300}},
    {"sums": {"steps_lost": -2.0}},
    {"recent": {"stall_s": 3.0}},
    {"recent": {"stall_s": [1.0, -1.0]}},
    {"last": {"interval_steps": 0}},
    {"last": {"step_time_s": 1e300}},
    {"through": "step-000000001/manifest.json"},
]


def test_a_malformed_summary_is_skipped_and_compaction_replaces_it(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    store = open_store(str(tmp_path))
    good = {"kind": "save", "stall_s": 1.0, "train_s": 4.0}
    for number in range(3):
        store.put(forged_event_key(number), json.dumps(good).encode())
    for summary in _MALFORMED_SUMMARIES:
        store.put(EVENT_SUMMARY_KEY, json.dumps({"events": 5, **summary}).encode())
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="spotckpt"):
            totals = EventLog(store).totals()
        assert (totals.events, totals.counts) == (3, {"save": 3}), summary  # the events only
        (warning,) = [r.getMessage() for r in caplog.records if "malformed" in r.getMessage()]
        assert EVENT_SUMMARY_KEY in warning, warning
    log = EventLog(store, max_events=4)
    assert log.compact() == 1  # folds the oldest event into a new, good summary
    assert _written_by_compaction(store)
    assert EventLog(store).totals().counts == {"save": 3}


@pytest.mark.process
@pytest.mark.parametrize("forged", list(FORGED_GOODPUT))
def test_a_forged_goodput_object_never_stops_restore_or_save(
    root: str, forged: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A forged event or summary in the bucket: restore with "auto" and saves that compact go on
    as if it were not there (one warning at each read); compaction removes or replaces it."""
    store = open_store(root)
    key, data = FORGED_GOODPUT[forged]
    store.put(key, data)
    state = TrainState(model=small_model(), rng=False)
    manager = CheckpointManager(root, preemption=False, interval_steps="auto", max_events=4)
    with caplog.at_level(logging.WARNING, logger="spotckpt"), manager:
        assert manager.restore(state) is None
        assert manager.interval_steps == STARTING_INTERVAL_STEPS
        for step in range(1, 5):  # past max_events: the saves compact, reading the forged object
            manager.save(step, state)
        assert manager.steps() == [2, 3, 4]
    warnings = [r.getMessage() for r in caplog.records if "malformed goodput" in r.getMessage()]
    assert len(warnings) == 2 and all(key in w for w in warnings), warnings  # restore, compaction
    if key == EVENT_SUMMARY_KEY:
        assert _written_by_compaction(store)
    else:
        assert not store.exists(key)
    assert load_stats(store).saves == 4


def test_a_forged_object_never_stops_a_save_without_restore(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The first save of a run (no restore) compacts over forged events of every kind."""
    store = open_store(str(tmp_path))
    for number, data in enumerate(_MALFORMED_EVENTS):
        store.put(forged_event_key(number), data)
    state = TrainState(model=small_model(), rng=False)
    manager = CheckpointManager(str(tmp_path), preemption=False, max_events=4)
    with caplog.at_level(logging.WARNING, logger="spotckpt"), manager:
        manager.save(1, state)
        assert manager.steps() == [1]
    warnings = [r.getMessage() for r in caplog.records if "malformed goodput" in r.getMessage()]
    assert len(warnings) == 1, warnings
    assert len(EventLog(store).event_keys()) == 2  # folded down to max_events // 2
