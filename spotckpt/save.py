"""Saving: the save counterpart of `spotckpt.restore`'s `StateLoader`.

A `Saver` carries every save of one rank from its start to its commit: when `maybe_save` saves
(`spotckpt.policy.SaveDecisionPolicy` decides; the preemption flag agreed by every rank, the
emergency save within the notice and its time checks), where to (the `SaveTarget`s: the fast
per-node tier first when there is one with room on every node, `TierTarget`, else the bucket,
`BucketTarget`), the one save in flight (`PendingSave`), and the commit with its hand-over
(`Committer`: the commit point, goodput events with the request counts of
`spotckpt.ledger.Ledger`, retention through `Catalog.retire`). How bytes move is the engine's
(`spotckpt.engine`); the tier's copies, records and drain are `spotckpt.tiers`'.

Nothing here calls back into `CheckpointManager`: the manager builds a `Saver` with what it needs
and delegates to it.
"""

from __future__ import annotations

import dataclasses
import logging
import time
import weakref
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_for
from typing import Any, Protocol, cast

import torch

from spotckpt.catalog import Catalog
from spotckpt.collector import collector_paused
from spotckpt.config import Settings
from spotckpt.deadline import EmergencyEstimate, first_measured, in_flight_allowance
from spotckpt.distributed import THIS_RANK, Collective, RankProgress
from spotckpt.engine.checkpointer import Checkpointer, is_save_failure
from spotckpt.engine.guards import Guard
from spotckpt.engine.writer import ObjectStoreWriter, WriterOptions
from spotckpt.errors import (
    CheckpointError,
    IntegrityRefusedError,
    ManifestError,
    PeerLostError,
    ReplicaMismatchError,
    SaveFailedError,
    StorageError,
    TierSaveError,
)
from spotckpt.format.compression import Compression
from spotckpt.format.signing import Keyring
from spotckpt.layout import new_attempt_id
from spotckpt.ledger import Ledger
from spotckpt.policy import SaveDecisionPolicy, SaveKind
from spotckpt.preemption import SIGNAL_WINDOW, NoticeWindow, PreemptionWatcher
from spotckpt.progress import ProgressLog, Sample
from spotckpt.state import State, as_dcp_state, release_worker_shields
from spotckpt.storage import ObjectStore
from spotckpt.tiers.fast_tier import FastTier, TierWriter, state_bytes
from spotckpt.units import human_rate, human_size
from spotckpt.version import __version__

log = logging.getLogger("spotckpt")


@dataclasses.dataclass
class PendingSave:
    """The one save in flight: its upload (and commit) running in the background.

    `durable` is False for a save to the fast tier only, whose failure costs the cached copy,
    never the training run. `stall_s` is how long the save held the training loop (staging).
    `progress` holds the save's rank markers (what names a dead rank when it fails).
    """

    step: int
    upload: Future[Any]
    writer: ObjectStoreWriter
    durable: bool
    started: float
    stall_s: float
    progress: RankProgress


@dataclasses.dataclass(frozen=True)
class SaveRequest:
    """One save as it was asked for: `durable` (committed in the bucket) or the fast tier only;
    `emergency` within a preemption notice that ends at `deadline` (`time.monotonic()`, None:
    unknown); `job` is this job's identity (None while the bucket has none); `progress` the
    save's rank markers."""

    step: int
    blocking: bool
    emergency: bool
    durable: bool
    deadline: float | None
    user_metadata: Mapping[str, Any] | None
    job: str | None
    progress: RankProgress


class Committer:
    """A save's end: run it to its commit point (a failure after it does not undo it), hand an
    asynchronous one over to the background and commit it at `wait`, record goodput events, and
    apply retention (`Catalog.retire`) on the coordinator."""

    def __init__(
        self,
        catalog: Catalog,
        collective: Collective,
        checkpointer: Checkpointer,
        ledger: Ledger,
        *,
        keep_last: int | None,
        progress_interval_s: float | None,
    ) -> None:
        self.catalog = catalog
        self.collective = collective
        self.checkpointer = checkpointer
        self.ledger = ledger
        self.goodput = ledger.goodput
        self.keep_last = keep_last
        self.progress_interval_s = progress_interval_s
        self.is_coordinator = collective.rank == 0
        self.pending: PendingSave | None = None
        self.last_save_seconds: float | None = None

    def progress_log(self, what: str, sample: Sample) -> ProgressLog:
        """Progress of a transfer, logged by the coordinator only (its own rank's bytes)."""
        interval = self.progress_interval_s if self.is_coordinator else None
        return ProgressLog(what, sample, interval)

    def hand_over(self, pending: PendingSave, emergency: bool, where: str) -> None:
        """An asynchronous save is staged: it uploads in the background from here."""
        pending.stall_s = time.monotonic() - pending.started
        self.pending = pending
        log.info(
            "checkpoint step %d staged in %.3f s%s; uploading", pending.step, pending.stall_s, where
        )
        self.goodput.stalled(pending.step, pending.stall_s, emergency=emergency)

    def wait(self) -> None:
        """Block until an asynchronous save has committed; raise its error if it failed."""
        pending, self.pending = self.pending, None
        if pending is None:
            return
        if not pending.durable:
            self.run_fast(pending.step, pending.upload.result, pending.progress)
            return
        self.run_save(pending.step, pending.writer, pending.upload.result, pending.progress)
        self.last_save_seconds = time.monotonic() - pending.started
        log.info(
            "checkpoint step %d committed in %.2f s (async)%s",
            pending.step,
            self.last_save_seconds,
            _amount(pending.writer, self.last_save_seconds),
        )
        self.goodput.committed(
            pending.step,
            stall_s=pending.stall_s,
            upload_s=self.last_save_seconds - pending.stall_s,
            size=_size(pending.writer),
            referenced=_referenced(pending.writer),
            asynchronous=True,
            emergency=False,
            requests=self.ledger.requests(),
            digest=pending.writer.digest,
        )
        self.ledger.recorded()

    def _refused(self, step: int, failure: IntegrityRefusedError, emergency: bool) -> None:
        """An integrity check refused the save of `step`: log it and record the event."""
        check = "replicas" if isinstance(failure, ReplicaMismatchError) else "health"
        log.error("%s", failure)
        self.goodput.refused(step, check, str(failure), emergency=emergency)

    def run_save(
        self,
        step: int,
        writer: ObjectStoreWriter,
        run: Callable[[], Any],
        progress: RankProgress,
        emergency: bool = False,
    ) -> None:
        """Run a save to its end; after its commit point nothing can fail it any more.

        A failure is first checked against the bucket: if this attempt's manifest is there (a
        peer died after the commit, an answer was lost), the save is committed and the failure
        is only a warning. Otherwise the attempt is discarded and the error raised (as the
        engine describes it: the ranks that failed and why).
        """
        try:
            run()
        except BaseException as error:
            committed = self._committed(step, writer)
            if not (committed and is_save_failure(error)):
                if not committed:
                    self._discard_attempt(step, writer)
                failure = self.checkpointer.save_failure(step, error, progress)
                if isinstance(failure, IntegrityRefusedError):
                    self._refused(step, failure, emergency)
                if failure is None or failure is error:
                    raise
                raise failure from error
            log.warning(
                "checkpoint step %d is committed; what failed after its commit point does not "
                "undo it: %s",
                step,
                self.checkpointer.save_failure(step, error, None),
            )
        if self.is_coordinator:
            self._apply_retention()

    def run_fast(self, step: int, run: Callable[[], Any], progress: RankProgress) -> None:
        """A fast-only save: its failure costs the cached copy, never the training run.

        Except when the failure broke the process group (a rank died or hung): then every
        later collective would fail too, so the error is raised, naming the ranks
        (`PeerLostError`, or `SaveFailedError` from the rank markers), never a raw gloo one."""
        try:
            run()
        except BaseException as error:
            if (
                isinstance(error, (RuntimeError, TimeoutError))
                and self.collective.group is not None
            ):
                failure = self.checkpointer.save_failure(step, error, progress)
                if failure is None or failure is error:
                    raise
                raise failure from error
            if isinstance(error, PeerLostError) or not (
                is_save_failure(error) or isinstance(error, (CheckpointError, OSError))
            ):
                raise
            log.warning(
                "fast-tier save of step %d failed; training goes on, the tier keeps its older "
                "steps: %s",
                step,
                error,
            )

    def _committed(self, step: int, writer: ObjectStoreWriter) -> bool:
        """Whether this attempt's manifest is in the bucket (read back when unsure)."""
        if writer.manifest is not None:
            return True
        if writer.attempt is None:
            return False
        try:
            return self.catalog.committed_attempt(step) == writer.attempt
        except StorageError as error:
            log.warning(
                "could not read back the manifest of step %d: %s", step, error, extra=THIS_RANK
            )
            return False

    def _discard_attempt(self, step: int, writer: ObjectStoreWriter) -> None:
        """After a failed save: abort this attempt's uploads and delete its objects."""
        if self.is_coordinator and writer.attempt is not None:
            self.catalog.discard_attempt(step, writer.attempt)

    def blocking_commit(
        self, step: int, writer: ObjectStoreWriter, started: float, emergency: bool
    ) -> None:
        """After a blocking save: its time, goodput events, and (not in an emergency) the
        ``"auto"`` interval. A fast-tier emergency save with no time to upload has no commit."""
        self.last_save_seconds = time.monotonic() - started
        self.goodput.stalled(step, self.last_save_seconds, emergency=emergency)
        if not emergency:
            self.ledger.agree_interval()
        requests = self.ledger.requests(local=emergency)  # before: every rank must take part
        if writer.manifest is None:
            return
        log.info(
            "checkpoint step %d committed in %.2f s%s",
            step,
            self.last_save_seconds,
            _amount(writer, self.last_save_seconds),
        )
        self.goodput.committed(
            step,
            stall_s=self.last_save_seconds,
            upload_s=self.last_save_seconds,
            size=_size(writer),
            referenced=_referenced(writer),
            asynchronous=False,
            emergency=emergency,
            requests=requests,
            digest=writer.digest,
        )
        self.ledger.recorded()

    def _apply_retention(self) -> None:
        """Retention after a commit; its failures are warnings (the commit stands)."""
        if self.keep_last is None:
            return
        try:
            for step in self.catalog.retire(self.keep_last):
                log.info("retention: deleted checkpoint step %d", step)
        except StorageError as error:
            log.warning("retention failed (the new checkpoint is committed): %s", error)


class WriterSetup:
    """What every save's writer records and checks, whatever its target."""

    def __init__(self, settings: Settings, keyring: Keyring | None, collective: Collective):
        self.settings = settings
        self.keyring = keyring
        self.collective = collective

    def of(self, save: SaveRequest) -> dict[str, Any]:
        """The caller's metadata, versions, and (where it can be set: not from a process-mode
        upload's child) this rank's progress marker; and what the writer checks before its
        commit point (`spotckpt.engine.guards`)."""
        settings = self.settings
        marks = self.collective.group is not None and (
            save.blocking or settings.async_mode != "process"
        )
        return {
            "user_metadata": dict(save.user_metadata or {}),
            "versions": {"spotckpt": __version__, "torch": torch.__version__},
            "on_written": save.progress.mark_written if marks else None,
            "keyring": self.keyring,
            "job": save.job,
            "guard": Guard(
                save.step,
                replica_check=settings.replica_check,
                health_check=settings.health_check,
                world_size=self.collective.world_size,
            ),
        }


class SaveTarget(Protocol):
    """Where a save's bytes go: the bucket, or the fast tier (which then drains to the bucket)."""

    route: str
    """What estimates and logs call it: ``bucket`` or ``fast tier``."""

    @property
    def predicted_s(self) -> float | None:
        """How long the next save to this target is expected to hold the loop (None: unknown)."""
        ...

    def admits(self, save: SaveRequest, state_dict: dict[str, Any]) -> bool:
        """Whether this target takes `save` (agreed by every rank)."""
        ...

    def save(self, save: SaveRequest, state_dict: dict[str, Any]) -> None:
        """Write `state_dict` and commit it (blocking), or hand it over (asynchronous)."""
        ...

    def close(self) -> None:
        """Free what the target holds (after the last save)."""
        ...


class BucketTarget:
    """Saves straight to the bucket, committed there (durable saves only)."""

    route = "bucket"

    def __init__(
        self,
        store: ObjectStore,
        settings: Settings,
        committer: Committer,
        options: WriterSetup,
        link: Compression,
    ) -> None:
        self.store = store
        self.settings = settings
        self.committer = committer
        self.checkpointer = committer.checkpointer
        self.collective = committer.collective
        self.options = options
        self.link = link  # each object's encoding (with compression="auto", the link's rate)

    @property
    def predicted_s(self) -> float | None:
        """The last save's time."""
        return self.committer.last_save_seconds

    def admits(self, save: SaveRequest, state_dict: dict[str, Any]) -> bool:
        """Every durable save."""
        return save.durable

    def save(self, save: SaveRequest, state_dict: dict[str, Any]) -> None:
        """Write and commit in the bucket (blocking), or stage and upload in the background."""
        step, committer = save.step, self.committer
        writer = ObjectStoreWriter(
            self.store,
            step,
            WriterOptions(
                prefix_spread=self.settings.prefix_spread,
                attempt=self._child_attempt(save.blocking),
                incremental=self.settings.incremental,
                encodings=self.link,
                **self.options.of(save),
            ),
        )
        started = time.monotonic()
        if save.blocking:
            with committer.progress_log(f"saving step {step}", writer.progress):
                run = lambda: self.checkpointer.save(state_dict, writer)  # noqa: E731
                committer.run_save(step, writer, run, save.progress, save.emergency)
            committer.blocking_commit(step, writer, started, save.emergency)
            return
        upload = self.checkpointer.async_save(state_dict, writer)
        progress = committer.progress_log(f"uploading step {step}", writer.progress).start()
        upload.add_done_callback(lambda _: progress.stop())
        pending = PendingSave(step, upload, writer, True, started, 0.0, save.progress)
        committer.hand_over(pending, save.emergency, "")
        committer.ledger.agree_interval()  # safe during the upload: saves use a group of their own

    def _child_attempt(self, blocking: bool) -> str | None:
        """The attempt id of a save uploaded by DCP's child process (``async_mode="process"``),
        drawn here and shared by every rank: the child never hands it back, and a save that
        fails there must still be known (read back, or discarded). None: the writer draws it."""
        if blocking or self.settings.async_mode != "process":
            return None
        return cast(str, self.collective.broadcast(new_attempt_id()))

    def close(self) -> None:
        """Nothing to free: the store is the manager's."""


class TierTarget:
    """Saves through the fast tier: stage once on this node, copy to peers, commit in the tier,
    then (durable saves) drain each rank's objects to the bucket and commit there."""

    route = "fast tier"

    def __init__(
        self,
        tier: FastTier,
        committer: Committer,
        options: WriterSetup,
        policy: SaveDecisionPolicy,
    ) -> None:
        self.tier = tier
        self.committer = committer
        self.checkpointer = committer.checkpointer
        self.collective = committer.collective
        self.catalog = committer.catalog
        self.options = options
        self.policy = policy
        self._fast_save_seconds: float | None = None
        self._drain_seconds: float | None = None
        self._continuation_pool: ThreadPoolExecutor | None = None

    @property
    def predicted_s(self) -> float | None:
        """The last fast save's time: the upload comes after it, only if there is time left."""
        return self._fast_save_seconds

    def admits(self, save: SaveRequest, state_dict: dict[str, Any]) -> bool:
        """Whether every node's tier has room for this save (agreed), once each has let go of
        what it need not keep (`FastTier.prune`); warns when not. Never without a job
        identity."""
        if save.job is None:
            return False
        tier = self.tier
        tier.prune(save.job)
        room = self.collective.all(tier.has_room(state_bytes(state_dict)))
        if not room:
            log.warning(
                "fast tier: not enough free space under %s on some node for step %d; skipping "
                "the fast save (durable saves go straight to the store)",
                tier.root,
                save.step,
            )
        return room

    def save(self, save: SaveRequest, state_dict: dict[str, Any]) -> None:
        """A save through the fast tier: stage once, copy to peers, then (`durable`) drain."""
        step, committer = save.step, self.committer
        writer = self.tier.writer(step, **self.options.of(save))
        started = time.monotonic()

        def finish() -> None:
            self._finish(save, writer, started)

        if not save.blocking:
            upload = self.checkpointer.async_save(state_dict, writer)

            def upload_then_finish() -> None:
                upload.result()
                finish()

            continued = self._continuations().submit(upload_then_finish)
            pending = PendingSave(
                step, continued, writer, save.durable, started, 0.0, save.progress
            )
            committer.hand_over(pending, save.emergency, " (fast tier)")
            return

        def run() -> None:
            self.checkpointer.save(state_dict, writer)
            finish()

        if save.durable:
            committer.run_save(step, writer, run, save.progress, save.emergency)
            committer.blocking_commit(step, writer, started, save.emergency)
        else:
            committer.run_fast(step, run, save.progress)

    def _finish(self, save: SaveRequest, writer: TierWriter, started: float) -> None:
        """After DCP wrote the tier: copies and commit on every node, then the drain.

        When the copies fail (a full disk, a read error on some node: every rank learns it
        from the collective), nothing is committed in the tier; a durable save still uploads
        each rank's own object from its tier and commits in the bucket, a fast-only one fails
        (`Committer.run_fast` warns)."""
        step, durable, tier = save.step, save.durable, self.tier
        saves = self.collective.for_saves()
        saved = tier.complete(step, writer, saves, cast(str, save.job))
        if saved.failure is None:
            self._fast_save_seconds = time.monotonic() - started
            log.info(
                "fast tier: step %d committed on every node in %.2f s",
                step,
                self._fast_save_seconds,
            )
        elif not durable:
            tier.discard(step)
            raise TierSaveError(saved.failure)
        else:
            log.warning("%s; uploading it to the store from each rank's own copy", saved.failure)
        if not durable:
            return
        try:
            if save.emergency and not saves.all(self._time_to_drain(save.deadline)):
                log.warning(
                    "no time left to upload step %d to the store; %s",
                    step,
                    "resuming will use the fast-tier copies on the surviving nodes"
                    if saved.failure is None
                    else "it has no copy anywhere: resuming starts from an older step",
                )
                return
            drain_started = time.monotonic()
            tier.drain(saved.manifest, self.catalog, saves, saved.data, writer.cancellation)
            writer.manifest = saved.manifest
            self._drain_seconds = time.monotonic() - drain_started
        finally:
            if saved.failure is not None:
                tier.discard(step)

    def _time_to_drain(self, deadline: float | None) -> bool:
        """Whether the last drain's time fits before the emergency `deadline` (unknown: yes)."""
        return self.policy.fits(self._drain_seconds, now=time.monotonic(), deadline=deadline)

    def _continuations(self) -> ThreadPoolExecutor:
        if self._continuation_pool is None:
            self._continuation_pool = ThreadPoolExecutor(1, thread_name_prefix="spotckpt-tier")
        return self._continuation_pool

    def close(self) -> None:
        """Stop the thread that finishes asynchronous tier saves."""
        if self._continuation_pool is not None:
            self._continuation_pool.shutdown()


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
    ) -> None:
        """A save from its start to its commit (blocking) or to its hand-over to the
        background (async), with the garbage collector paused (`spotckpt.collector`): to the
        first target that admits it (the fast tier when there is one with room on every node,
        else, `durable`, the bucket).
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

    def _agreed_deadline(self) -> float | None:
        """The earliest deadline any rank was given, on this rank's clock: a rank that got no
        notice of its own (a peer's node is evicted) saves within the peer's."""
        watcher, now = self.watcher, time.monotonic()
        mine = None if watcher is None or watcher.deadline is None else watcher.deadline - now
        known = [left for left in self.collective.gather(mine) if left is not None]
        return now + min(known) if known else None

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
                    f"a preemption notice left it {allowance:.1f} s, and step {step} is saved "
                    "instead"
                    if pending.step != step
                    else f"a preemption notice left it {allowance:.1f} s"
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

    def _emergency_save(
        self, step: int, state: State, user_metadata: Mapping[str, Any] | None
    ) -> None:
        """Within the notice (the earliest deadline of any rank): the upload in flight gets the
        time the plan leaves it, then `step` is saved if its predicted time fits before the
        deadline by the first route that admits it; then the loop is told to stop."""
        watcher = self.watcher
        deadline = self._agreed_deadline()
        remaining = None if deadline is None else deadline - time.monotonic()
        log.warning(
            "preemption (%s): emergency save of step %d; %s left; predicted save time %s",
            watcher.reason if watcher is not None else "peer rank",
            step,
            "unknown time" if remaining is None else f"{remaining:.1f} s",
            "unknown" if self.last_save_seconds is None else f"{self.last_save_seconds:.1f} s",
        )
        started = time.monotonic()
        pending = self._settle_in_flight(step, deadline)
        refused: IntegrityRefusedError | None = None
        if pending != step and self.collective.all(self._time_for_another_save(deadline)):
            try:
                self.save(step, state, True, user_metadata, emergency=True, deadline=deadline)
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


def _size(writer: ObjectStoreWriter) -> int | None:
    """Bytes a committed save wrote (known on the coordinator)."""
    return writer.manifest.written_bytes if writer.manifest is not None else None


def _referenced(writer: ObjectStoreWriter) -> int | None:
    """Bytes a committed save referenced in earlier steps instead of writing them."""
    return writer.manifest.referenced_bytes if writer.manifest is not None else None


def _amount(writer: ObjectStoreWriter, seconds: float) -> str:
    """``", 256.0 MiB at 30.1 MiB/s"`` for a committed save's log line (where its size is
    known: on the coordinator)."""
    size = _size(writer)
    if size is None:
        return ""
    return f", {human_size(size)} at {human_rate(size / max(seconds, 1e-9))}"
