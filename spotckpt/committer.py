"""The end of a save: `Committer` runs a save to its commit point (a failure after it does not
undo it), hands an asynchronous one over to the background as the `PendingSave` and commits it at
`wait`, records the goodput events (with the requests that `spotckpt.ledger.Ledger` counted), and
applies retention through `Catalog.retire` on the coordinator.

Call order of a blocking save: `run_save` (`run_fast` for a fast-tier-only save) around the
engine's write, then `blocking_commit`. Of an asynchronous one: `hand_over` once it is staged;
later `wait` runs `run_save` (or `run_fast`) on its upload's result.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from spotckpt.catalog import Catalog
from spotckpt.distributed import THIS_RANK, Collective, RankProgress
from spotckpt.engine.checkpointer import Checkpointer, is_save_failure
from spotckpt.engine.writer import ObjectStoreWriter
from spotckpt.errors import (
    CheckpointError,
    IntegrityRefusedError,
    PeerLostError,
    ReplicaMismatchError,
    StorageError,
)
from spotckpt.ledger import Ledger
from spotckpt.progress import ProgressLog, Sample
from spotckpt.units import human_rate, human_size

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
        self._listeners: list[Callable[[int], None]] = []

    def on_commit(self, listener: Callable[[int], None]) -> None:
        """Call `listener` with each step this coordinator commits to the bucket, after its
        retention (mirroring starts there); it must return at once and never raise."""
        self._listeners.append(listener)

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
            self._apply_retention(writer)
            for listener in self._listeners:
                listener(step)

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

    def _apply_retention(self, writer: ObjectStoreWriter) -> None:
        """Retention after `writer`'s commit, taking the committed step's reading from the
        writer (in process-mode async the writer ran in the child: then it is read back); its
        failures are warnings (the commit stands)."""
        if self.keep_last is None:
            return
        if writer.manifest is not None and writer.manifest_data is not None:
            self.catalog.learn_committed(writer.manifest, writer.manifest_data)
        try:
            for step in self.catalog.retire(self.keep_last):
                log.info("retention: deleted checkpoint step %d", step)
        except StorageError as error:
            log.warning("retention failed (the new checkpoint is committed): %s", error)


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
