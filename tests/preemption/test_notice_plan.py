"""The plan at a notice: an upload in flight gets only the time the plan leaves it, then is
cancelled; the newer step is saved instead; nothing half-written is ever trusted."""

from __future__ import annotations

import json
import os
import pickle
import signal
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch

import spotckpt.save
from spotckpt import CheckpointManager, PreemptionWatcher, SaveCancelledError
from spotckpt.deadline import CANCEL_RESERVE_S, in_flight_allowance
from spotckpt.engine.cancel import CancellableWriter, Cancellation
from spotckpt.policy import SaveDecisionPolicy
from spotckpt.storage import open_store

from dist_worker import launch_ranks
from tests_support import HeldStore

POLICY = SaveDecisionPolicy()
MARGIN = POLICY.margin


@pytest.mark.parametrize(
    ("in_flight_s", "save_s", "left_s", "newer", "allowed"),
    [
        # unknown deadline: the upload runs to its end, as without a plan
        (5.0, 5.0, None, True, None),
        # nothing newer to save: the upload runs until the deadline less the reserve
        (5.0, 5.0, 30.0, False, 30.0 - CANCEL_RESERVE_S),
        # both fit: the upload runs until the newer save must start (less the reserve)
        (5.0, 5.0, 30.0, True, 30.0 - MARGIN * 5.0 - CANCEL_RESERVE_S),
        # a long save: its reserve is the margin's share of it
        (1.0, 20.0, 60.0, True, 60.0 - MARGIN * 20.0 - (MARGIN - 1.0) * 20.0),
        # only the newer save fits: the upload is cancelled at once
        (20.0, 5.0, 30.0, True, 0.0),
        # the newer save does not fit: the upload is the only step within reach
        (5.0, 40.0, 30.0, True, 30.0 - CANCEL_RESERVE_S),
        # the newer save fits, but not with time to stop the upload first
        (5.0, 24.0, 30.0, True, 30.0 - CANCEL_RESERVE_S),
        # nothing measured yet: the newer save is taken to fit
        (50.0, None, 30.0, True, 0.0),
    ],
)
def test_the_in_flight_allowance(
    in_flight_s: float, save_s: float | None, left_s: float | None, newer: bool, allowed: float
) -> None:
    got = in_flight_allowance(
        POLICY, in_flight_s=in_flight_s, save_s=save_s, left_s=left_s, newer=newer
    )
    assert got == (None if allowed is None else pytest.approx(allowed))


def test_a_cancelled_writer_stops_at_its_next_write_and_leaves_nothing(tmp_path: Path) -> None:
    store = open_store(str(tmp_path / "root"))
    cancellation = Cancellation()
    writer = CancellableWriter(store.open_writer("a/object"), cancellation, 7)
    with pytest.raises(SaveCancelledError, match="step 7 cancelled: no time"), writer:
        writer.write(b"x" * 1000)
        cancellation.cancel("no time")
        writer.write(b"y" * 1000)
    assert not store.exists("a/object")
    assert list(store.list()) == []
    # An upload process's copy is its own, never set from here (it cannot be reached).
    assert not pickle.loads(pickle.dumps(cancellation)).cancelled


FLOATS = 5 << 20
"""20 MiB: more than one write of the bucket's object, and of the fast tier's upload of it."""


def _state(step: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(step)
    return {"w": torch.randn(FLOATS, generator=g), "b": torch.randn(64, generator=g)}


def _empty() -> dict[str, Any]:
    return {"w": torch.empty(FLOATS), "b": torch.empty(64)}


@pytest.mark.timeout(240)
@pytest.mark.parametrize("plan", ["cancel", "let it commit"])
@pytest.mark.parametrize("route", ["bucket", "fast tier"])
def test_an_upload_in_flight_gets_the_time_the_plan_leaves_it(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    watcher: PreemptionWatcher,
    plan: str,
    route: str,
) -> None:
    """An upload held mid-object at a notice (to the bucket, or the fast tier's upload to it):
    cancelled (its step never appears in the bucket, the newer step is saved and restores
    bit-exact) or, when the plan leaves it time, committed first."""
    uri = str(tmp_path / "ck")
    tier: dict[str, Any] = {}
    if route == "fast tier":
        (tmp_path / "tier").mkdir()
        tier = {"local_dir": str(tmp_path / "tier")}
    store = HeldStore(open_store(uri))
    allowances: list[float | None] = []

    def allowance(*args: Any, **kwargs: Any) -> float:
        allowances.append(kwargs["left_s"])
        if plan == "let it commit":
            store.gate.set()  # the upload ends within what the plan gives it
            return 120.0
        return 0.0

    monkeypatch.setattr(spotckpt.save, "in_flight_allowance", allowance)
    original = Cancellation.cancel

    def cancel(self: Cancellation, why: str) -> None:
        original(self, why)
        store.gate.set()  # the held write returns; the next one sees the cancellation

    monkeypatch.setattr(Cancellation, "cancel", cancel)
    with CheckpointManager(
        uri,
        store=store,
        async_save=True,
        preemption=watcher,
        interval_steps=2,
        keep_last=None,
        **tier,
    ) as mgr:
        mgr.save(1, _state(1))
        mgr.wait()
        store.hold = True
        assert mgr.maybe_save(2, _state(2))  # the interval: uploads in the background
        assert store.waiting.wait(60)
        watcher.trigger("test", deadline=time.monotonic() + 60.0)
        assert mgr.maybe_save(3, _state(3))
        assert mgr.should_stop()
        assert allowances and allowances[0] is not None and 0 < allowances[0] <= 60.0
        expected = [1, 2, 3] if plan == "let it commit" else [1, 3]
        assert mgr.steps() == expected
        restored = _empty()
        assert mgr.restore(restored) == 3
        assert all(torch.equal(restored[k], _state(3)[k]) for k in restored)
    # A cancelled upload leaves no object of its attempt behind in the bucket.
    if plan == "cancel":
        assert not [o.key for o in open_store(uri).list("step-000000002/")]


@pytest.mark.process
@pytest.mark.timeout(300)
@pytest.mark.parametrize("cancel", [[0, 1], [0]], ids=["every rank cancels", "one rank cancels"])
def test_ranks_take_the_earliest_deadline_and_cancel_together(
    tmp_path: Path, cancel: list[int]
) -> None:
    """Rank 1 gets no notice of its own: it plans with rank 0's deadline. A cancellation on any
    rank fails the upload on every rank (its step never appears), and both save the newer step."""
    out = tmp_path / "out"
    out.mkdir()
    uri = str(tmp_path / "ck")
    results = launch_ranks(
        2, "notice_cancels_upload", {"uri": uri, "out": str(out), "cancel": cancel}
    )
    for result in results:
        assert result.returncode == 0, result.stdout[-4000:]
    for rank in (0, 1):
        outcome = json.loads((out / f"outcome-{rank}.json").read_text())
        assert outcome["stop"] is True
        assert outcome["steps"] == [1, 3]
        (left,) = outcome["lefts"]
        assert left is not None and 0 < left <= 60.0


def _notice_once_waiting(mgr: CheckpointManager, notify: Any) -> threading.Thread:
    """A thread that gives the notice once the manager waits for its upload in flight before
    a due save (and not before: a notice before the step is agreed at the step itself)."""

    def give() -> None:
        end = time.monotonic() + 60
        while mgr._saver._waits == 0 and time.monotonic() < end:
            time.sleep(0.01)
        notify()

    thread = threading.Thread(target=give, daemon=True)
    thread.start()
    return thread


@pytest.mark.timeout(240)
@pytest.mark.parametrize("route", ["bucket", "fast tier"])
def test_a_notice_while_a_due_save_waits_for_the_upload_is_acted_on_at_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, watchers: list[PreemptionWatcher], route: str
) -> None:
    """Uploads slower than the interval: the next due save waits for the upload in flight. A
    real SIGTERM then reaches the plan at once (the upload gets the time the plan leaves it),
    instead of after the upload, when a new save's upload would stand in the way too. With a
    fast tier the upload held is the tier's drain to the bucket."""
    uri = str(tmp_path / "ck")
    tier: dict[str, Any] = {}
    if route == "fast tier":
        (tmp_path / "tier").mkdir()
        tier = {"local_dir": str(tmp_path / "tier")}
    store = HeldStore(open_store(uri))
    planned: list[bool] = []

    def allowance(*args: Any, **kwargs: Any) -> float:
        planned.append(store.gate.is_set())  # the upload was still held when the plan ran
        store.gate.set()
        return 120.0

    monkeypatch.setattr(spotckpt.save, "in_flight_allowance", allowance)
    watcher = PreemptionWatcher(signals=(signal.SIGTERM,), aws=False, gce=False, azure=False)
    watchers.append(watcher.start())
    with CheckpointManager(
        uri,
        store=store,
        async_save=True,
        preemption=watcher,
        interval_steps=1,
        keep_last=None,
        **tier,
    ) as mgr:
        mgr.save(1, _state(1))
        mgr.wait()
        store.hold = True
        assert mgr.maybe_save(2, _state(2))
        assert store.waiting.wait(60)
        giver = _notice_once_waiting(mgr, lambda: os.kill(os.getpid(), signal.SIGTERM))
        assert mgr.maybe_save(3, _state(3))  # due, behind the held upload of step 2
        giver.join(60)
        assert planned == [False]
        assert mgr.should_stop()
        assert mgr.steps() == [1, 2, 3]
        restored = _empty()
        assert mgr.restore(restored) == 3
        assert all(torch.equal(restored[k], _state(3)[k]) for k in restored)


@pytest.mark.process
@pytest.mark.timeout(300)
def test_a_peers_notice_reaches_a_rank_waiting_for_its_upload(tmp_path: Path) -> None:
    """Both ranks wait for their held uploads before a due save; rank 1 alone gets a notice:
    rank 0 learns of it from the notice board, not from its upload's end, and both make the
    emergency save together."""
    out = tmp_path / "out"
    out.mkdir()
    uri = str(tmp_path / "ck")
    results = launch_ranks(2, "notice_while_waiting", {"uri": uri, "out": str(out)})
    for result in results:
        assert result.returncode == 0, result.stdout[-4000:]
    for rank in (0, 1):
        outcome = json.loads((out / f"outcome-{rank}.json").read_text())
        assert outcome["stop"] is True
        assert outcome["held_at_plan"] == [True]
        assert outcome["steps"] == [1, 2, 3]
