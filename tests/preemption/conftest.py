"""Fixtures shared by the preemption tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from spotckpt import PreemptionWatcher


@pytest.fixture
def watchers() -> Iterator[list[PreemptionWatcher]]:
    started: list[PreemptionWatcher] = []
    yield started
    for watcher in started:
        watcher.stop()


@pytest.fixture
def watcher() -> Iterator[PreemptionWatcher]:
    """A watcher of no signal and no cloud: its notices are the test's `trigger` calls."""
    watcher = PreemptionWatcher(signals=(), aws=False, gce=False, azure=False)
    yield watcher
    watcher.stop()
