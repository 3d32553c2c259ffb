"""`CheckpointManager`: the policy of checkpointing a training job.

When to save (`maybe_save`: the interval, the ``"auto"`` interval of `spotckpt.goodput`, a
preemption notice agreed by every rank), where (the fast per-node tier, `spotckpt.tiers`, or the
bucket), the one save in flight (`PendingSave`), retention, and which step a restore loads
(`CheckpointManager._restore_in_order`, the one statement of that rule). How bytes move is the
engine's (`spotckpt.engine`); the bucket layout is the catalog's (`spotckpt.catalog`).

One manager per process (per rank). All ranks call `save`, `maybe_save` and `restore` at the
same points; the coordinator (rank 0) alone lists the bucket, reads and validates manifests,
commits and applies retention, and shares its decisions with the other ranks.
"""

from __future__ import annotations

import dataclasses
import logging
import time
import warnings
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, cast

import torch

from spotckpt.catalog import Catalog, new_attempt_id
from spotckpt.collector import collector_paused
from spotckpt.config import Config, Settings
from spotckpt.distributed import THIS_RANK, Collective, RankProgress
from spotckpt.engine.checkpointer import Checkpointer, is_save_failure
from spotckpt.engine.guards import Guard
from spotckpt.engine.reader import ReadStats
from spotckpt.engine.writer import ObjectStoreWriter
from spotckpt.errors import (
    CheckpointError,
    ConfigError,
    CorruptCheckpointError,
    IncompleteRestoreError,
    IntegrityRefusedError,
    KeyMismatchError,
    ManifestError,
    NoCheckpointError,
    PeerLostError,
    ReplicaMismatchError,
    StorageError,
    TierSaveError,
    UnknownFormatError,
)
from spotckpt.format.compression import LinkRate
from spotckpt.format.manifest import Manifest
from spotckpt.format.signing import keyring_of
from spotckpt.gc import GcReport, collect_garbage
from spotckpt.goodput import GoodputTracker
from spotckpt.preemption import PreemptionWatcher
from spotckpt.progress import ProgressLog, Sample
from spotckpt.restore import State, StateLoader
from spotckpt.state import (
    as_dcp_state,
    release_worker_shields,
)
from spotckpt.storage import ObjectStore, open_store
from spotckpt.storage.base import check_portable
from spotckpt.storage.requests import RequestTally, store_tally
from spotckpt.tiers.fast_tier import FastTier, TierWriter, state_bytes
from spotckpt.tiers.recovery import Scope
from spotckpt.tiers.redundancy import parse_redundancy
from spotckpt.units import human_rate, human_size
from spotckpt.verify import VerifyReport, verify_checkpoint
from spotckpt.version import __version__

__all__ = ["CheckpointManager", "KeyMismatchError", "PendingSave"]

log = logging.getLogger("spotckpt")

_SETTING_NAMES = frozenset(field.name for field in dataclasses.fields(Settings))


@dataclasses.dataclass
class PendingSave:
    """The one save in flight: its upload (and commit) running in the background.

    `durable` is False for a save to the fast tier only, whose failure costs the cached copy,
    never the training run. `stall_s` is how long the save held the training loop (staging).
    """

    step: int
    upload: Future[Any]
    writer: ObjectStoreWriter
    durable: bool
    started: float
    stall_s: float


@dataclasses.dataclass
class _Restoring:
    """One restore's progress: whether a load has written into the caller's state yet, and
    the last failure (what an incomplete restore reports)."""

    written: bool = False
    failure: str = ""


class CheckpointManager:
    """Saves and restores training state under one checkpoint root URI.

    The keyword arguments are the fields of `spotckpt.config.Settings` (`keep_last=3`,
    `interval_steps`, `async_save`, `preemption`, `storage_options`, ...), declared and validated
    there once for the manager and `Config` alike; `store` passes an already open store.
    Settings not passed come from ``SPOTCKPT_*`` variables, then ``spotckpt.toml``, then the
    defaults, and `uri` from ``SPOTCKPT_URI`` when None: `spotckpt.config.Config.load`, the one
    rule for every entry point (a keyword passed wins, None included).
    Goodput (`spotckpt.goodput`): `interval_steps="auto"`, events under ``events/``, `metrics`.
    """

    def __init__(
        self, uri: str | None = None, *, store: ObjectStore | None = None, **settings: Any
    ) -> None:
        unknown = sorted(set(settings) - _SETTING_NAMES)
        if unknown:
            raise TypeError(
                f"CheckpointManager() got unexpected keyword arguments {', '.join(unknown)}; "
                f"the settings are those of spotckpt.config.Settings"
            )
        config = Config.load(uri=uri, **settings)
        self.settings = Settings(**config.manager_kwargs())
        self.uri = config.uri
        self.keep_last = self.settings.keep_last
        self.async_save = self.settings.async_save
        self.prefix_spread = self.settings.prefix_spread
        self.agree_every = self.settings.agree_every
        storage_options = self.settings.storage_options
        self.store = (
            store if store is not None else open_store(self.uri, **dict(storage_options or {}))
        )
        self.keyring = keyring_of(self.settings)
        self.catalog = Catalog(self.store, self.keyring)
        self.collective = Collective(self.settings.collective_timeout_s)
        self.rank = self.collective.rank
        self.world_size = self.collective.world_size
        self.group = self.collective.group
        if self.group is None:  # DCP warns on every single-process call, even in its threads
            warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
        self.watcher = self._make_watcher(self.settings.preemption, self.settings.save_budget_s)
        self.goodput = GoodputTracker(self.store, self.settings, is_coordinator=self.rank == 0)
        self.checkpointer = Checkpointer(
            self.collective, process_mode=self.settings.async_mode == "process"
        )
        self.loader = StateLoader(
            self.catalog,
            self.collective,
            self.checkpointer,
            progress_interval_s=self.settings.progress_interval_s,
        )
        self.tier = self._open_tier()
        self._check_async_mode()
        self._pending: PendingSave | None = None
        self._progress = RankProgress("spotckpt/none", self.world_size)
        self._stop = False
        self._closed = False
        self._saves = 0
        self.last_save_seconds: float | None = None
        self.last_read_stats: ReadStats | None = None
        self.last_restore_sources: dict[str, int] = {}
        self._fast_save_seconds: float | None = None
        self._drain_seconds: float | None = None
        self._deadline: float | None = None
        self._continuation_pool: ThreadPoolExecutor | None = None
        self._job: str | None = None
        self._link = LinkRate()  # this rank's upload rate, for compression="auto"
        self._requests_mark = store_tally(self.store)

    def _open_tier(self) -> FastTier | None:
        settings = self.settings
        if settings.local_dir is None:
            if settings.redundancy is not None or settings.local_interval_steps is not None:
                raise ConfigError("redundancy and local_interval_steps need a local_dir")
            return None
        return FastTier(
            settings.local_dir,
            redundancy=parse_redundancy(settings.redundancy),
            keep_last=settings.local_keep_last,
            collective=self.collective,
            prefix_spread=self.prefix_spread,
            keyring=self.keyring,
        )

    def _check_async_mode(self) -> None:
        """``async_mode="process"`` needs a process group and a store that can leave."""
        if self.settings.async_mode != "process":
            return
        if self.group is None:
            raise ConfigError(
                'async_mode="process" needs torch.distributed initialised (even for one rank): '
                "DCP's upload process joins a process group of its own"
            )
        if self.tier is not None:
            raise ConfigError('async_mode="process" does not combine with local_dir')
        check_portable(self.store)

    @classmethod
    def from_config(cls, config: Config | None = None, **overrides: Any) -> CheckpointManager:
        """Build from a `Config`, every setting of which counts as given; without one, the
        same as ``CheckpointManager(**overrides)`` (kwargs, env, spotckpt.toml, defaults)."""
        if config is None:
            return cls(**overrides)
        return cls(config.uri, **config.manager_kwargs())

    @staticmethod
    def _make_watcher(
        preemption: bool | PreemptionWatcher, save_budget_s: float
    ) -> PreemptionWatcher | None:
        if isinstance(preemption, PreemptionWatcher):
            return preemption
        if not preemption:
            return None
        return PreemptionWatcher(signal_budget_s=save_budget_s).start()

    @property
    def interval_steps(self) -> int | None:
        """The `maybe_save` interval: the fixed one, or the current ``"auto"`` choice."""
        return self.goodput.interval_steps

    @property
    def is_coordinator(self) -> bool:
        """Whether this rank commits, lists and applies retention."""
        return self.rank == 0

    # When to save -----------------------------------------------------------------------------

    def maybe_save(
        self,
        step: int,
        state: State,
        *,
        user_metadata: Mapping[str, Any] | None = None,
    ) -> bool:
        """Save on the interval, or at once (blocking) when a preemption notice arrived.

        With ``interval_steps="auto"`` a save is due once the chosen number of steps passed since
        the last save (see `spotckpt.goodput`); the time between calls is the step time. With
        several ranks the preemption flag is agreed on (all-reduced) every `agree_every`
        steps so that all ranks save the same step. Returns True when a save was started.
        """
        self._check_open()
        self.goodput.observe_step(step)
        if self._pending is not None and self._pending.upload.done():
            self.wait()  # commits it, or raises its upload error here and now
        if self._preemption_agreed(step):
            self._emergency_save(step, state, user_metadata)
            return True
        if self.goodput.due(step):
            self.save(step, state, user_metadata=user_metadata)
            return True
        local = self.settings.local_interval_steps
        if self.tier is not None and local is not None and step % local == 0:
            self._save(step, state, None, user_metadata, emergency=False, durable=False)
            return True
        return False

    def save(
        self,
        step: int,
        state: State,
        *,
        blocking: bool | None = None,
        user_metadata: Mapping[str, Any] | None = None,
    ) -> None:
        """Checkpoint `state` as `step` on every rank; commits once all ranks wrote.

        Blocking by default unless the manager was built with ``async_save=True``. A new save
        first waits for the previous one and raises its error, if any.
        """
        self._save(step, state, blocking, user_metadata, emergency=False)

    def should_stop(self) -> bool:
        """True on every rank once a preemption save has committed: leave the training loop."""
        return self._stop

    def _preemption_agreed(self, step: int) -> bool:
        local = self.watcher is not None and self.watcher.preempted
        if self.group is None:
            return local
        if step % self.agree_every != 0:
            return False
        return self.collective.any(local)

    def _emergency_save(
        self, step: int, state: State, user_metadata: Mapping[str, Any] | None
    ) -> None:
        """Within the notice: let an upload in flight commit, then save `step` if the predicted
        save time fits before the deadline, and tell the loop to stop."""
        watcher = self.watcher
        deadline = watcher.deadline if watcher is not None else None
        remaining = None if deadline is None else deadline - time.monotonic()
        log.warning(
            "preemption (%s): emergency save of step %d; %s left; predicted save time %s",
            watcher.reason if watcher is not None else "peer rank",
            step,
            "unknown time" if remaining is None else f"{remaining:.1f} s",
            "unknown" if self.last_save_seconds is None else f"{self.last_save_seconds:.1f} s",
        )
        started = time.monotonic()
        pending = self._pending.step if self._pending is not None else None
        self._deadline = deadline
        self.wait()  # an in-flight upload is closest to done: let it commit first
        refused: IntegrityRefusedError | None = None
        if pending != step and self.collective.all(self._time_for_another_save(deadline)):
            try:
                self._save(step, state, True, user_metadata, emergency=True)
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
            committed = pending if pending is not None else step
            if pending != step:
                log.warning(
                    "no time left for a save of step %d; resuming will start after step %s",
                    step,
                    pending,
                )
        elapsed = time.monotonic() - started
        if refused is None:
            log.warning("emergency save of step %d committed in %.2f s", committed, elapsed)
        self.goodput.preempted(
            source=(watcher.reason if watcher is not None else None) or "peer rank",
            notice_left_s=remaining,
            step=step,
            emergency_save_s=elapsed,
            refused=None if refused is None else str(refused),
        )
        self._stop = True
        release_worker_shields()  # the save is in: loader workers may now be shut down

    def _time_for_another_save(self, deadline: float | None) -> bool:
        """Whether the predicted save time (the last one's, plus 20 %) fits before `deadline`.

        With a fast tier the prediction is the last fast save's: the upload comes after it,
        only if there is time left (`_time_for`).
        """
        predicted = self._fast_save_seconds if self.tier is not None else self.last_save_seconds
        if deadline is None or predicted is None:
            return True
        return time.monotonic() + 1.2 * predicted < deadline

    def _time_for(self, seconds: float | None) -> bool:
        """Whether `seconds` (plus 20 %) fit before the emergency deadline (unknown: yes)."""
        if self._deadline is None or seconds is None:
            return True
        return time.monotonic() + 1.2 * seconds < self._deadline

    # Where to save ----------------------------------------------------------------------------

    def _save(
        self,
        step: int,
        state: State,
        blocking: bool | None,
        user_metadata: Mapping[str, Any] | None,
        *,
        emergency: bool,
        durable: bool = True,
    ) -> None:
        """A save from its start to its commit (blocking) or to its hand-over to the
        background (async), with the garbage collector paused (`spotckpt.collector`): through
        the fast tier when there is one with room on every node, else (`durable`) to the bucket.
        """
        self._check_open()
        blocking = not self.async_save if blocking is None else blocking
        self.wait()
        with collector_paused():
            self._saves += 1
            self._progress = RankProgress(f"spotckpt/save-{self._saves}-{step}", self.world_size)
            state_dict = as_dcp_state(state, step)
            job = self._job_of_saves()
            if (
                self.tier is not None
                and job is not None
                and self._tier_has_room(step, state_dict, job)
            ):
                self._tier_save(step, state_dict, user_metadata, blocking, durable, emergency, job)
            elif durable:
                writer = ObjectStoreWriter(
                    self.store,
                    step,
                    prefix_spread=self.prefix_spread,
                    attempt=self._child_attempt(blocking),
                    incremental=self.settings.incremental,
                    compression=self.settings.compression,
                    link=self._link,
                    **self._writer_options(step, user_metadata, blocking),
                )
                self._bucket_save(step, state_dict, writer, blocking, emergency)

    def _progress_log(self, what: str, sample: Sample) -> ProgressLog:
        """Progress of a transfer, logged by the coordinator only (its own rank's bytes)."""
        interval = self.settings.progress_interval_s if self.is_coordinator else None
        return ProgressLog(what, sample, interval)

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

    def _writer_options(
        self, step: int, user_metadata: Mapping[str, Any] | None, blocking: bool
    ) -> dict[str, Any]:
        """What every save's writer records: the caller's metadata, versions, and (where it can
        be set: not from a process-mode upload's child) this rank's progress marker; and what it
        checks before its commit point (`spotckpt.engine.guards`)."""
        marks = self.group is not None and (blocking or self.settings.async_mode != "process")
        return {
            "user_metadata": dict(user_metadata or {}),
            "versions": {"spotckpt": __version__, "torch": torch.__version__},
            "on_written": self._progress.mark_written if marks else None,
            "keyring": self.keyring,
            "job": self._job,
            "guard": Guard(
                step,
                replica_check=self.settings.replica_check,
                health_check=self.settings.health_check,
                world_size=self.world_size,
            ),
        }

    def _child_attempt(self, blocking: bool) -> str | None:
        """The attempt id of a save uploaded by DCP's child process (``async_mode="process"``),
        drawn here and shared by every rank: the child never hands it back, and a save that
        fails there must still be known (read back, or discarded). None: the writer draws it."""
        if blocking or self.settings.async_mode != "process":
            return None
        return cast(str, self.collective.broadcast(new_attempt_id()))

    def _bucket_save(
        self,
        step: int,
        state_dict: dict[str, Any],
        writer: ObjectStoreWriter,
        blocking: bool,
        emergency: bool,
    ) -> None:
        started = time.monotonic()
        if blocking:
            with self._progress_log(f"saving step {step}", writer.progress):
                save = lambda: self.checkpointer.save(state_dict, writer)  # noqa: E731
                self._run_save(step, writer, save, emergency)
            self._blocking_commit(step, writer, started, emergency)
            return
        upload = self.checkpointer.async_save(state_dict, writer)
        progress = self._progress_log(f"uploading step {step}", writer.progress).start()
        upload.add_done_callback(lambda _: progress.stop())
        self._hand_over(PendingSave(step, upload, writer, True, started, 0.0), emergency, "")
        self._agree_interval()  # safe during the upload: saves use a group of their own

    def _hand_over(self, pending: PendingSave, emergency: bool, where: str) -> None:
        """An asynchronous save is staged: it uploads in the background from here."""
        pending.stall_s = time.monotonic() - pending.started
        self._pending = pending
        log.info(
            "checkpoint step %d staged in %.3f s%s; uploading", pending.step, pending.stall_s, where
        )
        self.goodput.stalled(pending.step, pending.stall_s, emergency=emergency)

    def _tier_has_room(self, step: int, state_dict: dict[str, Any], job: str) -> bool:
        """Whether every node's tier has room for this save (agreed), once each has let go of
        what it need not keep (`FastTier.prune`); warns when not."""
        tier = cast(FastTier, self.tier)
        tier.prune(job)
        room = self.collective.all(tier.has_room(state_bytes(state_dict)))
        if not room:
            log.warning(
                "fast tier: not enough free space under %s on some node for step %d; skipping "
                "the fast save (durable saves go straight to the store)",
                tier.root,
                step,
            )
        return room

    def _tier_save(
        self,
        step: int,
        state_dict: dict[str, Any],
        user_metadata: Mapping[str, Any] | None,
        blocking: bool,
        durable: bool,
        emergency: bool,
        job: str,
    ) -> None:
        """A save through the fast tier: stage once, copy to peers, then (`durable`) drain."""
        tier = cast(FastTier, self.tier)
        writer = tier.writer(step, **self._writer_options(step, user_metadata, blocking))
        started = time.monotonic()

        def finish() -> None:
            self._finish_tier_save(step, writer, durable, emergency, started, job)

        if not blocking:
            upload = self.checkpointer.async_save(state_dict, writer)

            def upload_then_finish() -> None:
                upload.result()
                finish()

            continued = self._continuations().submit(upload_then_finish)
            pending = PendingSave(step, continued, writer, durable, started, 0.0)
            self._hand_over(pending, emergency, " (fast tier)")
            return

        def run() -> None:
            self.checkpointer.save(state_dict, writer)
            finish()

        if durable:
            self._run_save(step, writer, run)
            self._blocking_commit(step, writer, started, emergency)
        else:
            self._run_fast(step, run)

    def _finish_tier_save(
        self,
        step: int,
        writer: TierWriter,
        durable: bool,
        emergency: bool,
        started: float,
        job: str,
    ) -> None:
        """After DCP wrote the tier: copies and commit on every node, then the drain.

        When the copies fail (a full disk, a read error on some node: every rank learns it
        from the collective), nothing is committed in the tier; a durable save still uploads
        each rank's own object from its tier and commits in the bucket, a fast-only one fails
        (`_run_fast` warns)."""
        tier = cast(FastTier, self.tier)
        saves = self.collective.for_saves()
        saved = tier.complete(step, writer, saves, job)
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
            if emergency and not saves.all(self._time_for(self._drain_seconds)):
                log.warning(
                    "no time left to upload step %d to the store; %s",
                    step,
                    "resuming will use the fast-tier copies on the surviving nodes"
                    if saved.failure is None
                    else "it has no copy anywhere: resuming starts from an older step",
                )
                return
            drain_started = time.monotonic()
            tier.drain(saved.manifest, self.catalog, saves, saved.data)
            writer.manifest = saved.manifest
            self._drain_seconds = time.monotonic() - drain_started
        finally:
            if saved.failure is not None:
                tier.discard(step)

    def _run_fast(self, step: int, run: Callable[[], Any]) -> None:
        """A fast-only save: its failure costs the cached copy, never the training run.

        Except when the failure broke the process group (a rank died or hung): then every
        later collective would fail too, so the error is raised, naming the ranks
        (`PeerLostError`, or `SaveFailedError` from the rank markers), never a raw gloo one."""
        try:
            run()
        except BaseException as error:
            if isinstance(error, (RuntimeError, TimeoutError)) and self.group is not None:
                failure = self.checkpointer.save_failure(step, error, self._progress)
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

    def _continuations(self) -> ThreadPoolExecutor:
        if self._continuation_pool is None:
            self._continuation_pool = ThreadPoolExecutor(1, thread_name_prefix="spotckpt-tier")
        return self._continuation_pool

    # The commit -------------------------------------------------------------------------------

    def wait(self) -> None:
        """Block until an asynchronous save has committed; raise its error if it failed."""
        pending, self._pending = self._pending, None
        if pending is None:
            return
        if not pending.durable:
            self._run_fast(pending.step, pending.upload.result)
            return
        self._run_save(pending.step, pending.writer, pending.upload.result)
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
            requests=self._job_requests(),
            digest=pending.writer.digest,
        )
        self._requests_recorded()

    def _refused(self, step: int, failure: IntegrityRefusedError, emergency: bool) -> None:
        """An integrity check refused the save of `step`: log it and record the event."""
        check = "replicas" if isinstance(failure, ReplicaMismatchError) else "health"
        log.error("%s", failure)
        self.goodput.refused(step, check, str(failure), emergency=emergency)

    def _run_save(
        self,
        step: int,
        writer: ObjectStoreWriter,
        run: Callable[[], Any],
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
                failure = self.checkpointer.save_failure(step, error, self._progress)
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

    def _blocking_commit(
        self, step: int, writer: ObjectStoreWriter, started: float, emergency: bool
    ) -> None:
        """After a blocking save: its time, goodput events, and (not in an emergency) the
        ``"auto"`` interval. A fast-tier emergency save with no time to upload has no commit."""
        self.last_save_seconds = time.monotonic() - started
        self.goodput.stalled(step, self.last_save_seconds, emergency=emergency)
        if not emergency:
            self._agree_interval()
        requests = self._job_requests(local=emergency)  # before: every rank must take part
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
        self._requests_recorded()

    def _job_requests(self, local: bool = False) -> RequestTally | None:
        """The requests every rank's store counted since the last call, summed over the job
        (a collective: every rank calls it at the same point); `local`: this rank's alone (an
        emergency, where no extra collective should stand between the save and the deadline).
        None for a store that does not count. The event's own PUT is counted in it, and
        `_requests_recorded` leaves it out of the next."""
        now = store_tally(self.store)
        if now is None or self._requests_mark is None:
            return None
        since, self._requests_mark = now.minus(self._requests_mark), now
        if self.is_coordinator:  # the event about to be written: one PUT, counted in it
            since = since.plus(RequestTally(write=1))
        if local or self.group is None:
            return since
        fields = list(since.to_dict().values())
        try:
            totals = self.collective.sum(fields)
        except RuntimeError as error:  # a rank died after the commit: the save stands regardless
            log.warning("request counts of the other ranks are lost (%s): this rank's only", error)
            return since
        return RequestTally.from_dict(dict(zip(since.to_dict(), totals, strict=True)))

    def _requests_recorded(self) -> None:
        """After an event with requests was written: its PUT, counted in it already, is left
        out of the next one (see `_job_requests`)."""
        if self._requests_mark is not None and self.is_coordinator:
            self._requests_mark = self._requests_mark.plus(RequestTally(write=1))

    def _agree_interval(self) -> None:
        """Recompute the ``"auto"`` interval; every rank takes the coordinator's choice."""
        if not self.goodput.auto:
            return
        self.goodput.recompute()
        if self.group is not None:
            self.goodput.adopt(self.collective.broadcast(self.goodput.interval_steps))

    # Retention --------------------------------------------------------------------------------

    def _apply_retention(self) -> None:
        """Retention after a commit; its failures are warnings (the commit stands)."""
        if self.keep_last is None:
            return
        try:
            for step in self.catalog.retire(self.keep_last):
                log.info("retention: deleted checkpoint step %d", step)
        except StorageError as error:
            log.warning("retention failed (the new checkpoint is committed): %s", error)

    def delete_step(self, step: int) -> None:
        """Delete a committed checkpoint (manifest first); never the newest one."""
        self.catalog.delete_step(step)
        log.info("deleted checkpoint step %d", step)

    # Restoring --------------------------------------------------------------------------------

    def steps(self) -> list[int]:
        """Committed steps, ascending (a step is committed exactly when its manifest exists)."""
        return self.catalog.steps()

    def latest_step(self) -> int | None:
        """The newest committed step, or None."""
        return self.catalog.latest()

    def read_manifest(self, step: int) -> Manifest:
        """Fetch and validate the manifest of a committed step."""
        return self.catalog.read_manifest(step)

    def restore(
        self,
        state: State,
        step: int | None = None,
        *,
        fallback: bool = True,
        strict: bool = True,
    ) -> int | None:
        """Load the latest committed checkpoint (or `step`) into `state` in place.

        Returns the restored step, or None when there is no checkpoint. When a checkpoint turns
        out corrupt and `fallback` is set (and no `step` was asked for), falls back to the newest
        older one that loads, with a warning (the whole rule: `_restore_in_order`).
        `strict=False` allows missing and extra keys.
        """
        self._check_open()
        self.wait()
        started = time.monotonic()
        with collector_paused():
            restored = self._restore_in_order(state, step, fallback, strict)
        if self.tier is not None:
            self.tier.discard_newer(restored)
        self.goodput.restored(restored, time.monotonic() - started, self._job_requests())
        self._requests_recorded()
        self._agree_interval()
        return restored

    def _restore_in_order(
        self, state: State, step: int | None, fallback: bool, strict: bool
    ) -> int | None:
        """Which step a restore loads, and from where, in this order:

        1. An explicit `step` is loaded from the bucket only (never the fast tier); if it does
           not load, its error is raised: no fallback.
        2. Otherwise the fast tier comes first, with the newest step its nodes can give whole
           among those a `Scope` admits: written by this job (its tier record names the job
           identity in the bucket's ``job.json``; no identity in the bucket or none in the
           record: not used) and newer than the newest step committed in the bucket, or that
           very step only when it is the same commit (the bucket's manifest names its attempt).
           The bucket is the source of truth for "committed": a tier step never shadows a
           committed step of another save. A tier step that does not load is set aside on
           every node (never chosen again, by this restore or a later one) and the next newest
           tried; with none left, the bucket.
        3. Then the bucket's committed steps, newest first. A step that turns out corrupt (bad
           bytes or a bad manifest) is quarantined and the next older one tried, with a warning,
           unless `fallback` is off or none is older; a step deleted meanwhile (retention by
           another job) means the next older one.
        4. None when no committed step is left, if nothing was written into the state. Once a
           load has written into it (a tier or bucket step that then failed), the restore either
           completes from another source or raises `IncompleteRestoreError`: never None over a
           modified state. Every rank takes the same path (the coordinator's listing and scope,
           collective verdicts on the tier, DCP's load raising on every rank).

        `restorable_step` follows 3 and 4 with a check of every byte in place of the load.
        """
        candidates, scope = self.collective.run_on_coordinator(lambda: self._restore_plan(step))
        restoring = _Restoring()
        if scope is not None:
            restored = self._restore_from_tier(state, scope, strict, restoring)
            if restored is not None:
                return restored

        def load(candidate: int) -> None:
            try:
                self._restore_from_bucket(state, candidate, strict, restoring)
            except (CorruptCheckpointError, ManifestError) as error:
                restoring.failure = f"step {candidate}: {type(error).__name__}: {error}"
                raise

        restored = self._first_usable(
            candidates, load, explicit=step is not None, fallback=fallback
        )
        if restored is None and restoring.written:
            raise IncompleteRestoreError(
                f"restore failed after part of a checkpoint was loaded into the state "
                f"({restoring.failure}), and {self.uri} holds no committed step to complete it "
                "from: the state is neither what it was nor a checkpoint. Rebuild the model and "
                "optimizer before training from scratch, or repair the checkpoint and restore "
                "again"
            )
        return restored

    def _first_usable(
        self, candidates: list[int], use: Callable[[int], None], *, explicit: bool, fallback: bool
    ) -> int | None:
        """Steps 3 and 4 of `_restore_in_order`: the first of `candidates` that `use` takes.

        A step deleted meanwhile means the next one; a corrupt one is quarantined, with a
        warning, before the next one is tried. An `explicit` step's error is raised as it is.
        """
        for index, candidate in enumerate(candidates):
            try:
                use(candidate)
                return candidate
            except NoCheckpointError:
                if explicit:
                    raise
                log.info("checkpoint step %d was deleted while restoring; trying older", candidate)
            except (CorruptCheckpointError, ManifestError) as error:
                older = candidates[index + 1 :]
                if explicit or not fallback or not older:
                    raise
                self._set_aside(candidate, error)
                log.warning(
                    "checkpoint step %d is unusable (%s); falling back to step %d",
                    candidate,
                    error,
                    older[0],
                )
        return None

    def restorable_step(self) -> int | None:
        """The step that `restore` would load, chosen before there is a state to load it into:
        for a framework that fixes its starting step first (the Hugging Face Trainer), which
        then loads it with ``restore(state, step=...)``.

        The bucket's committed steps are checked newest first, every byte against the manifest
        (read once, on the coordinator); a corrupt step is quarantined and the next older one
        checked, with a warning, as `restore` does (`_first_usable`). The fast tier is not
        consulted. None when no committed step is left.
        """
        self._check_open()
        candidates = self.collective.run_on_coordinator(lambda: self._bucket_candidates(None))
        return self._first_usable(candidates, self._check_whole, explicit=False, fallback=True)

    def _check_whole(self, step: int) -> None:
        """Raise, on every rank, the error a restore of `step` would meet in its manifest or
        its bytes (the coordinator reads them all, the manifest once: `verify_checkpoint`
        reports a damaged one as its first problem)."""

        def check() -> None:
            error = verify_checkpoint(self.store, step, keyring=self.keyring).error()
            if error is not None:
                raise error

        self.collective.run_on_coordinator(check)

    def _restore_plan(self, step: int | None) -> tuple[list[int], Scope | None]:
        """On the coordinator: the committed steps a restore may load, in the order it tries
        them, and which fast-tier steps it may use (None: not the tier)."""
        candidates = self._bucket_candidates(step)
        if self.tier is None or step is not None:
            return candidates, None
        durable = candidates[0] if candidates else None
        attempt = self.catalog.committed_attempt(durable) if durable is not None else None
        return candidates, Scope(self._bucket_job(), durable, attempt)

    def _bucket_job(self) -> str | None:
        """The bucket's job identity, read (never created) for a restore; None if it has none
        or it is damaged (then no fast-tier step is used, with a warning)."""
        try:
            job = self.catalog.job()
        except ManifestError as error:
            log.warning("%s; fast-tier copies are not used", error)
            return None
        return job.id if job is not None else None

    def _bucket_candidates(self, step: int | None) -> list[int]:
        """The committed steps a restore may load, in the order it tries them."""
        if step is not None:
            return [self.catalog.resolve(step)]
        return list(reversed(self.catalog.steps()))

    def _set_aside(self, step: int, error: Exception) -> None:
        """Quarantine a step that failed to restore, so that it can be saved again.

        A manifest of an unknown (newer) format says nothing about the checkpoint: left alone.
        """
        if not self.is_coordinator or isinstance(error, UnknownFormatError):
            return
        try:
            self.catalog.quarantine(step, f"{type(error).__name__}: {error}")
        except StorageError as failure:
            log.warning("could not quarantine step %d: %s", step, failure)

    def _restore_from_bucket(
        self, state: State, step: int, strict: bool, restoring: _Restoring
    ) -> None:
        manifest = self.loader.manifest(state, step)
        restoring.written = True  # from here on, a failure may leave part of it in `state`
        self.last_read_stats = stats = self.loader.load(state, manifest, self.store, strict)
        self.last_restore_sources = {"local": 0, "peer": 0, "store": stats.bytes_read}

    def _restore_from_tier(
        self, state: State, scope: Scope, strict: bool, restoring: _Restoring
    ) -> int | None:
        """Restore the newest step of `scope` the fast tiers can give whole; None if none can
        (then `restoring` tells whether the state was written). A step that does not load is
        set aside on every node (`FastTier.set_aside`: a warning and a ``quarantine`` event)
        and the next newest one tried."""
        tier = cast(FastTier, self.tier)

        def needs(manifest: Manifest) -> dict[str, list[tuple[int, int]]]:
            return self.loader.byte_ranges(state, manifest, tier.store, strict)

        while (found := tier.recover(self.collective, scope, needs)) is not None:
            manifest, moved = found
            restoring.written = True
            try:
                self.last_read_stats = stats = self.loader.load(state, manifest, tier.store, strict)
                break
            except (CorruptCheckpointError, ManifestError) as error:
                self._set_aside_tier_step(manifest.step, error, restoring)
        else:
            return None
        self.last_restore_sources = {
            "local": max(0, stats.bytes_read - moved),
            "peer": moved,
            "store": 0,
        }
        log.info(
            "restored step %d from the fast tier: %s", manifest.step, self.last_restore_sources
        )
        return manifest.step

    def _set_aside_tier_step(self, step: int, error: Exception, restoring: _Restoring) -> None:
        """A fast-tier step failed to load (on every rank): set it aside, loudly."""
        reason = f"{type(error).__name__}: {error}"
        restoring.failure = f"fast-tier step {step}: {reason}"
        log.warning(
            "the fast-tier copy of step %d did not load (%s); it is set aside on every node and "
            "the restore goes on with older steps",
            step,
            error,
        )
        cast(FastTier, self.tier).set_aside(step, reason)
        if self.goodput.events is None:  # only the coordinator records events
            return
        try:
            event = {"kind": "quarantine", "tier": True, "step": step, "reason": reason[:2000]}
            self.goodput.events.record(event)
        except StorageError as failure:
            log.warning("could not record the set-aside of fast-tier step %d: %s", step, failure)

    # Maintenance ------------------------------------------------------------------------------

    def verify(self, step: int | None = None, *, progress: Any = None) -> VerifyReport:
        """Check every byte of a committed checkpoint (default: the latest) against its manifest."""
        step = self.catalog.resolve(step)
        return verify_checkpoint(self.store, step, progress=progress, keyring=self.keyring)

    def gc(
        self,
        *,
        keep_last: int | None = None,
        safety_age_s: float = 3600.0,
        dry_run: bool = False,
    ) -> GcReport:
        """Delete what failed saves left (older than `safety_age_s`) and apply `keep_last`.

        Runs on the coordinator only; other ranks get an empty report.
        """
        if not self.is_coordinator:
            return GcReport(dry_run=dry_run)
        return collect_garbage(
            self.store,
            keep_last=keep_last,
            safety_age_s=safety_age_s,
            dry_run=dry_run,
            keyring=self.keyring,
        )

    # Lifecycle --------------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise CheckpointError("this CheckpointManager is closed")

    def close(self) -> None:
        """Wait for pending uploads (raising their error), stop the watcher, free resources."""
        if self._closed:
            return
        try:
            self.wait()
        finally:
            self._closed = True
            if self.watcher is not None:
                self.watcher.stop()
            self.checkpointer.close()
            if self._continuation_pool is not None:
                self._continuation_pool.shutdown()
            self.store.close()

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


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
