"""The manager's goodput hooks: when ``"auto"`` saves, and the events and metrics of each save.

A module of its own because it is where the interval model (`spotckpt.interval`) and the event
log (`spotckpt.goodput`) meet the training loop: `CheckpointManager` holds one `GoodputTracker`
and calls it at every ``maybe_save``, save, preemption and restore; neither of the two parts
imports the other. No torch.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Any

from spotckpt.config import Settings
from spotckpt.errors import StorageError
from spotckpt.goodput import EventLog, event_problem
from spotckpt.interval import IntervalModel
from spotckpt.storage.base import ObjectStore
from spotckpt.storage.requests import RequestTally

log = logging.getLogger("spotckpt")


class GoodputTracker:
    """What `CheckpointManager` does for goodput: the interval, events and metrics.

    Every rank measures and decides (the manager makes the ranks agree on the coordinator's
    interval); only the coordinator writes events and calls `metrics`. Nothing here can fail a
    save: event writes that fail are warnings, a metrics callable that raises is logged once.
    """

    def __init__(self, store: ObjectStore, settings: Settings, *, is_coordinator: bool) -> None:
        self.auto = settings.interval_steps == "auto"
        self.fixed = None if settings.interval_steps == "auto" else settings.interval_steps
        self.model = IntervalModel(
            eviction_rate_per_hour=settings.eviction_rate_per_hour,
            min_interval_steps=settings.min_interval_steps,
            max_interval_steps=settings.max_interval_steps,
        )
        self.events = EventLog(store, settings.max_events) if is_coordinator else None
        self.metrics: Callable[[dict[str, Any]], Any] | None = settings.metrics
        self.last_started_step = 0
        self.last_committed_step: int | None = None
        self.emergency: Callable[[], Mapping[str, Any]] | None = None
        """The emergency estimate's figures (`spotckpt.deadline`), added to each save event."""
        self._metrics_failed = False

    @property
    def interval_steps(self) -> int | None:
        """The current interval: the fixed one, or the one ``"auto"`` chose."""
        return self.model.interval_steps if self.auto else self.fixed

    def observe_step(self, step: int) -> None:
        """At every `maybe_save`: measures the step time."""
        self.model.observe_step(step)

    def stalled(self, step: int, seconds: float, *, emergency: bool) -> None:
        """A save of `step` blocked the loop for `seconds` (staging, for an async save)."""
        self.last_started_step = step
        self.model.record_stall(seconds, periodic=not emergency)

    def recompute(self) -> None:
        """Recompute the ``"auto"`` interval from the current figures."""
        if self.auto:
            self.model.update()

    def adopt(self, interval: int) -> None:
        """Use the coordinator's choice (ranks must agree on when to save)."""
        self.model.interval_steps = interval

    def committed(
        self,
        step: int,
        *,
        stall_s: float,
        upload_s: float,
        size: int | None,
        asynchronous: bool,
        emergency: bool,
        referenced: int | None = None,
        requests: RequestTally | None = None,
        digest: str | None = None,
    ) -> None:
        """A save of `step` committed: record it (`size`: bytes it wrote; `referenced`: bytes
        an incremental save referenced in earlier steps instead; its `spotckpt.digest` when
        known), with the job's `requests` since the last event (None: its store does not count
        them)."""
        self.last_committed_step = step
        event: dict[str, Any] = {
            "kind": "save",
            "step": step,
            "stall_s": stall_s,
            "upload_s": upload_s,
            "bytes": size,
            "referenced_bytes": referenced,
            "throughput_bytes_per_s": size / upload_s if size and upload_s > 0 else None,
            "async": asynchronous,
            "emergency": emergency,
            "digest": digest,
        }
        figures = self.emergency() if self.emergency is not None else {}
        if event_problem(dict(figures)) is None:  # a window beyond an event's bounds: left out
            event.update(figures)
        self._publish(event | (requests.to_dict() if requests is not None else {}))

    def unfit(self, figures: Mapping[str, Any]) -> None:
        """An emergency save no longer fits its notice window (`spotckpt.deadline`): recorded
        once (kind ``unfit``), without the goodput figures (no save happened) and without a
        compaction (no listing between training steps)."""
        event: dict[str, Any] = {"kind": "unfit"}
        if event_problem(dict(figures)) is None:
            event.update(figures)
        self._publish(event, compact=False, figures=False)

    def preempted(
        self,
        *,
        source: str,
        notice_left_s: float | None,
        step: int,
        emergency_save_s: float,
        refused: str | None = None,
    ) -> None:
        """A preemption was handled at `step`: record what was saved and what was lost (and,
        when an integrity check refused the emergency save, why)."""
        saved = self.last_committed_step
        event: dict[str, Any] = {
            "kind": "preemption",
            "source": source,
            "notice_left_s": notice_left_s,
            "step_at_notice": step,
            "step_saved": saved,
            "steps_lost": step - (saved if saved is not None else 0),
            "emergency_save_s": emergency_save_s,
        }
        if refused is not None:
            event["emergency_save_refused"] = refused
        self._publish(event, compact=False)  # the deadline is near: no listing now

    def refused(self, step: int, check: str, reason: str, *, emergency: bool) -> None:
        """An integrity check (`check`: ``replicas`` or ``health``) refused the save of `step`:
        nothing was committed. Recorded without the goodput figures (no save happened)."""
        event = {
            "kind": "refused",
            "step": step,
            "check": check,
            "reason": reason[:2000],
            "emergency": emergency,
        }
        self._publish(event, figures=False)

    def restored(
        self, step: int | None, seconds: float, requests: RequestTally | None = None
    ) -> None:
        """`restore` finished (`step` None: nothing to restore); for ``"auto"`` the run's
        recorded events seed the model (the manager then recomputes the interval). `requests`:
        as for `committed`."""
        if step is not None:
            self.last_started_step = step
            self.last_committed_step = step
        self.model.restart_measurement()
        if self.auto and self.events is not None:
            try:
                self.model.seed(self.events.totals())
            except StorageError as error:
                log.warning(
                    "could not read the run's events (goodput figures start anew): %s", error
                )
        if step is not None:
            event: dict[str, Any] = {"kind": "restore", "step": step, "restore_s": seconds}
            self._publish(event | (requests.to_dict() if requests is not None else {}))

    def mirrored(self, event: dict[str, Any]) -> None:
        """A mirror caught up (a ``mirror`` event from `spotckpt.mirroring.MirrorReport.
        to_event`, in the mirror thread): recorded with its lag, without the goodput figures
        and without a compaction."""
        self._publish(event, compact=False, figures=False)

    def _publish(
        self, event: dict[str, Any], *, compact: bool = True, figures: bool = True
    ) -> None:
        """Add the common figures (unless not `figures`); write the event (coordinator) and
        pass it to `metrics`."""
        if self.events is None:
            return
        if figures:
            event.update(
                train_s=self.model.take_training_s(),
                step_time_s=self.model.step_time_s,
                interval_steps=self.interval_steps,
            )
        event["writer"] = self.events.writer
        try:
            self.events.record(event, compact=compact)
        except StorageError as error:
            log.warning(
                "could not record the %s event of step %s (the checkpoint is not affected): %s",
                event["kind"],
                event.get("step_at_notice", event.get("step")),
                error,
            )
        self._emit(event)

    def _emit(self, record: dict[str, Any]) -> None:
        if self.metrics is None:
            return
        try:
            self.metrics(dict(record))
        except Exception as error:  # a user's callable: never let it break training
            if not self._metrics_failed:
                self._metrics_failed = True
                log.warning("the metrics callable failed (reported once): %r", error)


__all__ = ["GoodputTracker"]
