"""Where a save goes: the `SaveTarget`s tried in order, the fast per-node tier first when there is
one with room on every node (`TierTarget`: stage once, copy to peers, commit in the tier, then drain
to the bucket), else the bucket (`BucketTarget`). A `SaveRequest` is one save as it was asked for;
`WriterSetup` what every save's writer records and checks, whatever its target. Both targets end
their saves through `spotckpt.committer.Committer`.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Protocol, cast

import torch

from spotckpt.committer import Committer, PendingSave
from spotckpt.config import Settings
from spotckpt.deadline import UNADAPTED, NoticeAdaptation
from spotckpt.distributed import Collective, RankProgress
from spotckpt.engine.guards import Guard
from spotckpt.engine.writer import ObjectStoreWriter, WriterOptions
from spotckpt.errors import (
    TierSaveError,
)
from spotckpt.format.compression import Compression
from spotckpt.format.signing import Keyring
from spotckpt.layout import new_attempt_id
from spotckpt.policy import SaveDecisionPolicy
from spotckpt.storage import ObjectStore
from spotckpt.tiers.fast_tier import FastTier, TierWriter, state_bytes
from spotckpt.version import __version__

log = logging.getLogger("spotckpt")


@dataclasses.dataclass(frozen=True)
class SaveRequest:
    """One save as it was asked for: `durable` (committed in the bucket) or the fast tier only;
    `emergency` within a preemption notice that ends at `deadline` (`time.monotonic()`, None:
    unknown), which the `evicted` ranks got (their nodes go, with their disks), its writes to
    the bucket `adapted` as the notice's plan decided; `job` is this job's identity (None while
    the bucket has none); `progress` the save's rank markers."""

    step: int
    blocking: bool
    emergency: bool
    durable: bool
    deadline: float | None
    user_metadata: Mapping[str, Any] | None
    job: str | None
    progress: RankProgress
    evicted: frozenset[int] = frozenset()
    adapted: NoticeAdaptation = UNADAPTED


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
        """Write and commit in the bucket (blocking), or stage and upload in the background;
        with the keys and encodings the notice's plan adapted (`SaveRequest.adapted`)."""
        step, committer, adapted = save.step, self.committer, save.adapted
        writer = ObjectStoreWriter(
            self.store,
            step,
            WriterOptions(
                prefix_spread=self.settings.prefix_spread or adapted.spread,
                attempt=self._child_attempt(save.blocking),
                incremental=self.settings.incremental,
                encodings=self.link.at_notice() if adapted.compress else self.link,
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
                if saved.failure is None and tier.survives(save.evicted):
                    log.warning(
                        "no time left to upload step %d to the store; resuming will use the "
                        "fast-tier copies on the surviving nodes",
                        step,
                    )
                    return
                log.warning(  # the upload is its only way out: try, the deadline may cut it
                    "step %d has no fast-tier copy that outlives the evicted nodes: uploading "
                    "it to the store although the last upload's time does not fit",
                    step,
                )
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
