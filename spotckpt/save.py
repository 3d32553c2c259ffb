"""Saving: the save counterpart of `spotckpt.restore`'s `StateLoader`.

A `Saver` carries every save of one rank from its start to its commit: when `maybe_save` saves
(`spotckpt.policy.SaveDecisionPolicy` decides; the preemption flag agreed by every rank), the
emergency save within a notice (the earliest deadline of any rank, the upload in flight given only
the time `spotckpt.deadline.in_flight_allowance` leaves it, the route that fits), and where each
save goes (`spotckpt.targets`: the fast per-node tier first when there is one with room on every
node, else the bucket; at a notice the tier's upload is skipped for lack of time only when its
copies outlive the evicted nodes). A save ends in `spotckpt.committer.Committer` (the commit
point, the one save in flight, goodput events, and retention). How bytes move is the engine's
(`spotckpt.engine`); the tier's copies, records and drain are `spotckpt.tiers`'.

Nothing here calls back into `CheckpointManager`: the manager builds a `Saver` with what it needs
and delegates to it.
"""

from __future__ import annotations

import logging
import time
import uuid
import weakref
from collections.abc import Callable, Mapping
from concurrent.futures import wait as wait_for
from typing import Any

from spotckpt.catalog import Catalog
from spotckpt.collector import collector_paused
from spotckpt.committer import Committer, PendingSave
from spotckpt.config import Settings
from spotckpt.deadline import (
    UNADAPTED,
    EmergencyEstimate,
    NoticeAdaptation,
    adapt_at_notice,
    first_measured,
    in_flight_allowance,
)
from spotckpt.distributed import Collective, NoticeBoard, RankProgress
from spotckpt.engine.checkpointer import Checkpointer
from spotckpt.errors import (
    IntegrityRefusedError,
    ManifestError,
    SaveFailedError,
    StorageError,
    TierSaveError,
)
from spotckpt.format.compression import Compression
from spotckpt.format.signing import Keyring
from spotckpt.ledger import Ledger
from spotckpt.policy import SaveDecisionPolicy, SaveKind
from spotckpt.preemption import SIGNAL_WINDOW, NoticeWindow, PreemptionWatcher
from spotckpt.state import State, as_dcp_state, release_worker_shields
from spotckpt.storage import ObjectStore
from spotckpt.storage.throttle import Throttle
from spotckpt.targets import BucketTarget, SaveRequest, SaveTarget, TierTarget, WriterSetup
from spotckpt.tiers.fast_tier import FastTier

log = logging.getLogger("spotckpt")
NOTICE_POLL_S = 0.1
"""How often a rank waiting for an upload in flight looks for a notice and its peers' uploads."""


class Saver:
    """Every save of one rank (see the module docstring): built once by `CheckpointManager`."""

    def __init__(
        self,
        settings: Settings,
        store: ObjectStore,
        catalog: Catalog,
        collective: Collective,
        checkpointer: Checkpointer,
        ledger: Ledger,
        *,
        tier: FastTier | None,
        keyring: Keyring | None,
        link: Compression,
        watcher: PreemptionWatcher | None,
        policy: SaveDecisionPolicy,
        uri: str,
    ) -> None:
        self.settings = settings
        self.catalog = catalog
        self.collective = collective
        self.goodput = ledger.goodput
        self.watcher = watcher
        self.policy = policy
        self.uri = uri
        self.link = link
        throttle = getattr(store, "throttle", None)  # a bucket store's; a local folder has none
        self.throttle = throttle if isinstance(throttle, Throttle) else None
        self.committer = Committer(
            catalog,
            collective,
            checkpointer,
            ledger,
            keep_last=settings.keep_last,
            progress_interval_s=settings.progress_interval_s,
        )
        options = WriterSetup(settings, keyring, collective)
        bucket = BucketTarget(store, settings, self.committer, options, link)
        self.targets: tuple[SaveTarget, ...] = (
            (TierTarget(tier, self.committer, options, policy), bucket)
            if tier is not None
            else (bucket,)
        )
        self.stopped = False  # a preemption save is in: the loop should stop
        self._saves = 0
        self._job: str | None = None
        self._warned_unfit = False  # "does not fit" was told (once per process)
        self._hint_saved = False  # the extra save an early hint asks for was made
        self._board: NoticeBoard | None = None  # see `_noticed_while_waiting`
        self._waits = 0  # waits for an upload in flight before a due save, on every rank
        me = weakref.ref(self)  # the events' estimate, without a cycle that keeps the saver
        self.goodput.emergency = lambda: (
            {} if (s := me()) is None else s.emergency_estimate().to_event()
        )

    @property
    def pending(self) -> PendingSave | None:
        """The save in flight, if any."""
        return self.committer.pending

    @property
    def last_save_seconds(self) -> float | None:
        """How long the last committed save took (for an asynchronous one: to its commit)."""
        return self.committer.last_save_seconds

    def maybe_save(self, step: int, state: State, user_metadata: Mapping[str, Any] | None) -> bool:
        """`CheckpointManager.maybe_save`: a save if the policy says so; True when one started."""
        self.goodput.observe_step(step)
        pending = self.committer.pending
        preempted, hinted, uploaded = self._agreed(
            step, pending is not None and pending.upload.done()
        )
        if uploaded:
            self.wait()  # commits it, or raises its upload error here and now
        decision = self.policy.decide(
            step,
            preempted=preempted,
            hinted=hinted and not self._hint_saved,
            auto_interval_steps=self.goodput.interval_steps,
            last_started_step=self.goodput.last_started_step,
            hint_active=hinted,
        )
        if decision in (SaveKind.DURABLE, SaveKind.FAST) and self._noticed_while_waiting():
            decision = SaveKind.EMERGENCY  # its plan gives the upload in flight its time
        if decision is SaveKind.EMERGENCY:
            self._emergency_save(step, state, user_metadata)
        elif decision is SaveKind.DURABLE:
            answered = hinted and not self._hint_saved
            if answered:  # so that a notice has less to do
                hint = (self.watcher.hint if self.watcher is not None else None) or "peer rank"
                log.warning("early preemption hint (%s): saving step %d now", hint, step)
            self.save(step, state, None, user_metadata)
            self._hint_saved = self._hint_saved or answered
        elif decision is SaveKind.FAST:
            self.save(step, state, None, user_metadata, durable=False)
        else:
            self._check_window()
        return decision is not SaveKind.NONE

    def save(
        self,
        step: int,
        state: State,
        blocking: bool | None,
        user_metadata: Mapping[str, Any] | None,
        *,
        emergency: bool = False,
        durable: bool = True,
        deadline: float | None = None,
        evicted: frozenset[int] = frozenset(),
        adapted: NoticeAdaptation = UNADAPTED,
    ) -> None:
        """A save from its start to its commit (blocking) or to its hand-over to the
        background (async), with the garbage collector paused (`spotckpt.collector`): to the
        first target that admits it (the fast tier when there is one with room on every node,
        else, `durable`, the bucket, its writes `adapted` as a notice's plan decided).
        """
        blocking = not self.settings.async_save if blocking is None else blocking
        self.wait()
        with collector_paused():
            self._saves += 1
            progress = RankProgress(
                f"spotckpt/save-{self._saves}-{step}", self.collective.world_size
            )
            state_dict = as_dcp_state(state, step)
            request = SaveRequest(
                step,
                blocking,
                emergency,
                durable,
                deadline,
                user_metadata,
                self._job_of_saves(),
                progress,
                evicted,
                adapted,
            )
            for target in self.targets:
                if target.admits(request, state_dict):
                    target.save(request, state_dict)
                    break
        if not emergency:
            self._check_window()

    def wait(self) -> None:
        """Block until an asynchronous save has committed; raise its error if it failed."""
        self.committer.wait()

    def emergency_estimate(self) -> EmergencyEstimate:
        """An emergency save now (see `spotckpt.deadline`): the last save's time to the first
        target that measured one (the fast tier's, when there is a tier), against the
        shortest notice window here."""
        window = (
            self.watcher.window()
            if self.watcher is not None
            else NoticeWindow(self.settings.save_budget_s, SIGNAL_WINDOW)
        )
        routes = [(target.route, target.predicted_s) for target in self.targets]
        cancellable = self.settings.async_mode != "process"  # else it must commit first
        in_flight = 0.0 if cancellable else self._in_flight_left()
        return first_measured(self.policy, routes, in_flight, window)

    def _in_flight_left(self) -> float:
        """What an upload in flight still needs, by the last save's time."""
        pending, last = self.committer.pending, self.committer.last_save_seconds
        if pending is None or not pending.durable or last is None:
            return 0.0
        return max(0.0, last - (time.monotonic() - pending.started))

    def _agreed_notice(self) -> tuple[float | None, frozenset[int], NoticeAdaptation]:
        """The earliest deadline any rank was given, on this rank's clock (a rank that got no
        notice of its own, on a node that stays, saves within its peer's), the ranks that got
        one (their nodes are evicted), and how the emergency save's writes to the bucket adapt
        to what every rank saw (`spotckpt.deadline.adapt_at_notice`), in one collective."""
        watcher, now = self.watcher, time.monotonic()
        mine = None if watcher is None or watcher.deadline is None else watcher.deadline - now
        noticed = watcher is not None and watcher.preempted
        throttled = 0 if self.throttle is None else self.throttle.stats().throttled
        shared = self.collective.gather((mine, noticed, throttled, self.link.rate is not None))
        known = [left for left, _, _, _ in shared if left is not None]
        evicted = frozenset(rank for rank, (_, got, _, _) in enumerate(shared) if got)
        adapted = adapt_at_notice(
            [(count, measured) for _, _, count, measured in shared],
            prefix_spread=self.settings.prefix_spread,
            compression=self.settings.compression,
        )
        return (now + min(known) if known else None), evicted, adapted

    def _settle_in_flight(self, step: int, deadline: float | None) -> int | None:
        """At a notice: the upload in flight runs for the time the plan leaves it
        (`spotckpt.deadline.in_flight_allowance`), then is cancelled; its step if it committed.
        A failed or cancelled one leaves the previous step the newest; the notice goes on."""
        pending = self.committer.pending
        if pending is None:
            return None
        if self.settings.async_mode != "process":  # an upload process cannot be reached
            allowance = in_flight_allowance(
                self.policy,
                in_flight_s=self._in_flight_left(),
                save_s=self.emergency_estimate().seconds,
                left_s=None if deadline is None else deadline - time.monotonic(),
                newer=pending.step != step,
            )
            if allowance is not None and not wait_for([pending.upload], allowance).done:
                pending.writer.cancellation.cancel(
                    f"the preemption notice's plan left it {allowance:.1f} s"
                )
        try:
            self.wait()
        except (SaveFailedError, TierSaveError) as error:
            log.warning("%s", error)
            return None
        return pending.step

    def _check_window(self) -> None:
        """Warn once, with an event, when an emergency save does not fit (not at a notice)."""
        if self._warned_unfit or (self.watcher is not None and self.watcher.preempted):
            return
        now = self.emergency_estimate()
        if now.fits:
            return
        self._warned_unfit = True
        if self.committer.is_coordinator:
            log.warning("%s", now.warning())
            self.goodput.unfit(now.to_event())

    def _agreed(self, step: int, uploaded: bool) -> tuple[bool, bool, bool]:
        """(a preemption notice on any rank, an early hint on any rank, the upload in flight
        done on every rank), in one collective: committing an upload runs collectives of its
        own (the job's request counts), so every rank must commit it at the same step."""
        watcher = self.watcher
        preempted = watcher is not None and watcher.preempted
        hinted = watcher is not None and watcher.hint is not None
        if self.collective.group is None:
            return preempted, hinted, uploaded
        if not self.policy.agrees_at(step):
            return False, False, False
        agreed = self.collective.sum([int(preempted), int(hinted), int(uploaded)])
        return agreed[0] > 0, agreed[1] > 0, agreed[2] == self.collective.world_size

    def _noticed_while_waiting(self) -> bool:
        """Before a due save that would first wait for the upload in flight: wait until every
        rank's upload is done or any rank got a notice; True on every rank if one did.

        Waiting in a collective, or in the save's own wait, would hold every rank (and its
        signal handlers) until the upload is done, and a notice then met a new save's upload
        as well as the old one: where uploads take longer than the interval, the step in
        flight and every step since the old upload's were lost. The ranks look at a
        `NoticeBoard` instead, every `NOTICE_POLL_S` (a store error counts as nothing seen).
        Once this rank's upload is done it waits for the others at most the collective
        timeout, as a collective would; every rank then takes part in one agreement, whose
        failure (a rank died) is reported as the upload's own error, naming the rank."""
        pending = self.committer.pending
        if pending is None:
            return False
        board = self._notice_board()
        self._waits += 1
        done_at: float | None = None
        counted = False
        while True:
            mine = self.watcher is not None and self.watcher.preempted
            if done_at is None and pending.upload.done():
                done_at = time.monotonic()
            if done_at is not None and not counted:  # again after a store error
                counted = self._on_board(lambda b: b.post_done(self._waits))
            if mine:
                self._on_board(NoticeBoard.post_notice)
                break
            if board is None and done_at is not None:
                break
            if self._on_board(NoticeBoard.noticed) or self._on_board(
                lambda b: b.all_done(self._waits)
            ):
                break
            if done_at is None:
                wait_for([pending.upload], NOTICE_POLL_S)
            elif time.monotonic() - done_at > self.settings.collective_timeout_s:
                break
            else:
                time.sleep(NOTICE_POLL_S)
        local = self.watcher is not None and self.watcher.preempted
        try:
            noticed = self.collective.any(local or self._on_board(NoticeBoard.noticed))
        except RuntimeError:  # a rank is gone: its upload's error names it
            self.wait()
            raise
        if board is not None and self.collective.rank == 0:  # every rank has left the loop
            board.clear_done(self._waits)
        return noticed

    def _on_board(self, look: Callable[[NoticeBoard], bool]) -> bool:
        """`look` at the notice board; False without one or when its store cannot answer now."""
        if self._board is None:
            return False
        try:
            return bool(look(self._board))
        except RuntimeError as error:
            log.debug("notice board not reachable now: %s", error)
            return False

    def _notice_board(self) -> NoticeBoard | None:
        """The job's `NoticeBoard` (None for a single process), its prefix drawn at the first
        wait, which every rank reaches at the same step."""
        if self.collective.group is None:
            return None
        if self._board is None:
            prefix = self.collective.broadcast(f"spotckpt/notices-{uuid.uuid4().hex}")
            self._board = NoticeBoard(prefix, self.collective.world_size)
        return self._board

    def _emergency_save(
        self, step: int, state: State, user_metadata: Mapping[str, Any] | None
    ) -> None:
        """Within the notice (the earliest deadline of any rank): the upload in flight gets the
        time the plan leaves it, then `step` is saved if its predicted time fits before the
        deadline by the first route that admits it; then the loop is told to stop."""
        watcher = self.watcher
        deadline, evicted, adapted = self._agreed_notice()
        remaining = None if deadline is None else deadline - time.monotonic()
        log.warning(
            "preemption (%s): emergency save of step %d; %s left; predicted save time %s",
            watcher.reason if watcher is not None else "peer rank",
            step,
            "unknown time" if remaining is None else f"{remaining:.1f} s",
            "unknown" if self.last_save_seconds is None else f"{self.last_save_seconds:.1f} s",
        )
        described = adapted.describe()
        if described is not None and self.committer.is_coordinator:
            log.warning("emergency save to the bucket: %s", described)
        started = time.monotonic()
        pending = self._settle_in_flight(step, deadline)
        refused: IntegrityRefusedError | None = None
        if pending != step and self.collective.all(self._time_for_another_save(deadline)):
            try:
                self.save(
                    step,
                    state,
                    True,
                    user_metadata,
                    emergency=True,
                    deadline=deadline,
                    evicted=evicted,
                    adapted=adapted,
                )
                committed: int | None = step
            except IntegrityRefusedError as error:  # the previous checkpoint stays the newest
                refused = error
                committed = self.goodput.last_committed_step
                log.error(
                    "emergency save of step %d refused by an integrity check; stopping without "
                    "it (resuming starts after step %s)",
                    step,
                    committed,
                )
        else:
            committed = pending if pending is not None else self.goodput.last_committed_step
            if pending != step:
                log.warning(
                    "no time left for a save of step %d; resuming will start after step %s",
                    step,
                    committed,
                )
        elapsed = time.monotonic() - started
        if refused is None and committed is not None:
            log.warning("emergency save of step %d committed in %.2f s", committed, elapsed)
        self.goodput.preempted(
            source=(watcher.reason if watcher is not None else None) or "peer rank",
            notice_left_s=remaining,
            step=step,
            emergency_save_s=elapsed,
            refused=None if refused is None else str(refused),
        )
        self.stopped = True
        release_worker_shields()  # the save is in: loader workers may now be shut down

    def _time_for_another_save(self, deadline: float | None) -> bool:
        """Whether the emergency estimate (plus 20 %) fits before `deadline`. With a fast tier
        that is the last fast save's: the upload comes after it, only if there is time left
        (`TierTarget`)."""
        predicted = self.emergency_estimate().seconds
        return self.policy.fits(predicted, now=time.monotonic(), deadline=deadline)

    def _job_of_saves(self) -> str | None:
        """This job's identity (`spotckpt.catalog.JobIdentity`), created by the coordinator at
        the first save and shared with every rank; None (and the fast tier skipped, with a
        warning) while the bucket's ``job.json`` cannot be read or created."""
        if self._job is None:
            self._job = self.collective.run_on_coordinator(self._ensure_job)
        return self._job

    def _ensure_job(self) -> str | None:
        try:
            return self.catalog.ensure_job().id
        except (ManifestError, StorageError) as error:
            log.warning(
                "no job identity at %s (%s): fast-tier saves are skipped until there is one; "
                "move a damaged job.json aside by hand (fast-tier copies written under it are "
                "then no longer used)",
                self.uri,
                error,
            )
            return None

    def close(self) -> None:
        """Free what the targets hold (after `wait`)."""
        for target in self.targets:
            target.close()
