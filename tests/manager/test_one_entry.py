"""`CheckpointManager` is the public front: a save or a restore enters manager.py once.

Followed from a public call to its commit (or its load), no collaborator calls back into the
manager: no bound method, closure or lambda of manager.py is handed down and run from another
module, in this thread or in the background threads of an asynchronous save. Every frame of
manager.py whose caller is outside manager.py must be one of this test's public calls.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import FrameType
from typing import Any

import torch

import spotckpt.manager
from spotckpt import CheckpointManager, PreemptionWatcher

MANAGER = spotckpt.manager.__file__
PACKAGE = str(Path(MANAGER).parent)
HERE = __file__


class _Entries:
    """Frames of manager.py entered from outside it: (caller's file, function name)."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str]] = []
        self.threads: set[str] = set()  # background threads seen running spotckpt's code
        self._lock = threading.Lock()

    def profile(self, frame: FrameType, event: str, arg: Any) -> None:
        if event != "call":
            return
        filename = frame.f_code.co_filename
        thread = threading.current_thread()
        if filename.startswith(PACKAGE) and thread is not threading.main_thread():
            with self._lock:
                self.threads.add(thread.name)
        if filename != MANAGER:
            return
        caller = frame.f_back
        where = caller.f_code.co_filename if caller is not None else "<no caller>"
        if where != MANAGER:
            with self._lock:
                self.calls.append((where, frame.f_code.co_name))

    def callbacks(self) -> list[tuple[str, str]]:
        """Entries that are not this test's own calls: calls back into the manager."""
        return [(where, name) for where, name in self.calls if where != HERE]


@contextmanager
def _recording() -> Iterator[_Entries]:
    entries = _Entries()
    threading.setprofile(entries.profile)  # threads started from here on (async uploads)
    sys.setprofile(entries.profile)
    try:
        yield entries
    finally:
        sys.setprofile(None)
        threading.setprofile(None)


def _state(seed: float) -> dict[str, Any]:
    return {"w": torch.full((64, 64), seed), "b": torch.arange(16.0) + seed, "note": f"s{seed}"}


def _watcher() -> PreemptionWatcher:
    return PreemptionWatcher(signals=(), aws=False, gce=False, azure=False)


def _options(tmp_path: Path, tier: bool) -> dict[str, Any]:
    if not tier:
        return {}
    (tmp_path / "fast").mkdir(exist_ok=True)
    return {"local_dir": str(tmp_path / "fast" / "{node}"), "local_interval_steps": 1}


def _run(tmp_path: Path, *, async_save: bool, tier: bool) -> _Entries:
    """Saves of every kind (interval, explicit, fast-only, emergency) and restores, recorded."""
    watcher = _watcher()
    uri = str(tmp_path / "bucket")
    with _recording() as entries:
        mgr = CheckpointManager(
            uri,
            interval_steps=2,
            keep_last=2,
            async_save=async_save,
            preemption=watcher,
            **_options(tmp_path, tier),
        )
        for step in range(1, 6):
            mgr.maybe_save(step, _state(step))
        mgr.save(6, _state(6))
        mgr.wait()
        watcher.trigger("test", deadline=time.monotonic() + 600)
        mgr.maybe_save(7, _state(7))
        stop = mgr.should_stop()
        target = _state(0)
        restored = mgr.restore(target)
        restorable = mgr.restorable_step()
        steps = mgr.steps()
        mgr.close()
    assert stop
    assert restored == 7 and torch.equal(target["w"], _state(7)["w"])
    assert restorable == 7 and steps == [6, 7]
    public_calls = 5 + 1 + 1 + 1 + 1 + 1 + 1 + 1 + 1 + 1  # as written above, __init__ included
    assert len([call for call in entries.calls if call[0] == HERE]) == public_calls
    return entries


def test_a_blocking_save_enters_the_manager_once(tmp_path: Path) -> None:
    assert _run(tmp_path, async_save=False, tier=False).callbacks() == []


def test_an_asynchronous_save_enters_the_manager_once(tmp_path: Path) -> None:
    entries = _run(tmp_path, async_save=True, tier=False)
    assert entries.threads, "the profiler saw no background upload: nothing was checked there"
    assert entries.callbacks() == []


def test_a_save_through_the_fast_tier_enters_the_manager_once(tmp_path: Path) -> None:
    assert _run(tmp_path, async_save=False, tier=True).callbacks() == []


def test_an_asynchronous_save_through_the_fast_tier_enters_the_manager_once(
    tmp_path: Path,
) -> None:
    entries = _run(tmp_path, async_save=True, tier=True)
    assert entries.threads, "the profiler saw no background upload: nothing was checked there"
    assert entries.callbacks() == []
