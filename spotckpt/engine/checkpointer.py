"""`Checkpointer`: the one caller of DCP's ``save``, ``async_save`` and ``load``.

Every DCP call of a manager goes through here with the same arguments: the planner its writer
asks for, the saves' own process group (never the training thread's, see
`spotckpt.distributed.Collective.save_group`), ``no_dist`` without a group, the stager of
asynchronous saves (CPU staging; shared memory when the upload runs in a child process) and the
checkpointer type of ``async_mode="process"``. DCP reports a failure on any rank as one
`CheckpointException` (a `BaseException`) holding each rank's error; `save_failure` and the
restore path turn it into the spotckpt error that says what happened (`SaveFailedError` naming the
ranks and causes, or the rank's own `CheckpointAlreadyCommittedError`; on a restore the rank's own
corruption, key or value error), so that callers never see DCP's wrapper; this rank's own
interrupt (``KeyboardInterrupt``, ``SystemExit``), which DCP's wrapper catches too, is raised as
it is, so that Ctrl-C during a save or restore interrupts it. In process mode a save
whose upload process died fails naming it, and the next save starts a new one on every rank.

Call order of a manager's save: `save` (blocking) or `async_save` (returns when staged; the
upload's future completes later); when either fails, `save_failure` gives the error to raise.
Of a restore: `load`, with a `spotckpt.engine.reader.ObjectStoreReader` and a
`spotckpt.engine.planners.CheckedLoadPlanner`. All three hand DCP a big plain state dict under one
top-level key, with a planner that unwraps it (`spotckpt.engine.flat_state`: DCP's cost per
top-level key), writing and loading exactly what the unwrapped dict would.
"""

from __future__ import annotations

import logging
from concurrent.futures import Future
from typing import Any, cast

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import _async_process_executor
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.planner import LoadPlanner
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType
from torch.distributed.checkpoint.storage import StorageReader

from spotckpt.distributed import Collective, RankProgress
from spotckpt.engine.flat_state import for_load, for_save
from spotckpt.engine.global_plan import PlanCache
from spotckpt.engine.writer import ObjectStoreWriter
from spotckpt.errors import (
    CheckpointAlreadyCommittedError,
    CheckpointError,
    CorruptCheckpointError,
    IntegrityRefusedError,
    KeyMismatchError,
    ManifestError,
    ReplicaMismatchError,
    SaveCancelledError,
    SaveFailedError,
    ValueLoadError,
)

log = logging.getLogger("spotckpt")

_RESTORE_ERRORS = (CorruptCheckpointError, KeyMismatchError, ManifestError, ValueLoadError)
"""A rank's own errors that a failed load reports as they are (restore's fallback acts on them)."""


class Checkpointer:
    """DCP's save, asynchronous save and load for one manager (one process, one rank).

    `process_mode` uploads asynchronous saves from a child process that DCP starts once and keeps
    (``AsyncCheckpointerType.PROCESS``), and again when it died; it needs a process group.
    """

    def __init__(self, collective: Collective, *, process_mode: bool = False) -> None:
        self.collective = collective
        self.process_mode = process_mode
        self._stager: DefaultStager | None = None
        self.plan_cache = PlanCache()  # saves of unchanged plans send digests, not plans

    @property
    def _no_dist(self) -> bool:
        return self.collective.group is None

    def save(self, state_dict: dict[str, Any], writer: ObjectStoreWriter) -> None:
        """Write and commit `state_dict` through `writer` on every rank; returns when committed."""
        state, planner = for_save(
            state_dict, writer.save_planner(self.collective.world_size, self.plan_cache)
        )
        try:
            dcp.save(
                state,
                storage_writer=writer,
                planner=planner,
                process_group=self.collective.save_group,
                no_dist=self._no_dist,
            )
        except CheckpointException as error:
            interrupt = _interrupt(_failures(error), self.collective.rank)
            if interrupt is not None:
                raise interrupt from None
            raise

    def async_save(self, state_dict: dict[str, Any], writer: ObjectStoreWriter) -> Future[Any]:
        """Stage `state_dict` to CPU memory and return the future of its upload and commit."""
        kind = AsyncCheckpointerType.PROCESS if self.process_mode else AsyncCheckpointerType.THREAD
        if self.process_mode:
            self._renew_dead_upload_process()
        state, planner = for_save(
            state_dict, writer.save_planner(self.collective.world_size, self.plan_cache)
        )
        response = dcp.async_save(
            state,
            storage_writer=writer,
            planner=planner,
            process_group=self.collective.save_group,
            async_checkpointer_type=kind,
            async_stager=self._async_stager(),
            no_dist=self._no_dist,
        )
        return cast(Future[Any], getattr(response, "upload_completion", response))

    def load(
        self,
        state_dict: dict[str, Any],
        reader: StorageReader,
        planner: LoadPlanner,
        step: int,
    ) -> None:
        """Load `step` through `reader` into `state_dict` in place, on every rank.

        A rank's corruption, key mismatch or unloadable value is raised as it is (the restore's
        fallback acts on it); anything else as a `CheckpointError` naming each rank's cause.
        """
        state, planner = for_load(state_dict, planner)
        try:
            dcp.load(
                state,
                storage_reader=reader,
                planner=planner,
                process_group=self.collective.group,
                no_dist=self._no_dist,
            )
        except CheckpointException as error:
            raise _load_error(step, error, self.collective.rank) from None

    def save_failure(
        self, step: int, error: BaseException, progress: RankProgress | None
    ) -> BaseException | None:
        """The error to raise for a save that failed with `error` and did not commit; None when
        `error` is not a failure of the save itself (an interrupt, a bug: raise it as it is).

        A failed collective (a rank died or hung, so gloo timed out or lost its peer) names the
        ranks that never finished writing, from their `progress` markers.
        """
        dead = _dead_upload_process(UPLOAD_EXIT_GRACE_S) if self.process_mode else None
        if dead is not None and isinstance(error, (RuntimeError, OSError)):
            return SaveFailedError(
                f"save of step {step} failed: DCP's upload process ({dead}) died; nothing was "
                "committed; the next save starts a new upload process"
            )
        if isinstance(error, CheckpointException):
            return _save_error(step, error)
        if not isinstance(error, (RuntimeError, TimeoutError)):
            return None
        if self._no_dist or progress is None:
            return error
        silent = progress.silent_ranks()
        return SaveFailedError(
            f"save of step {step} failed: {_who_failed(silent)} did not finish writing "
            f"(process died or hung); nothing was committed"
        )

    def _renew_dead_upload_process(self) -> None:
        """Before a process-mode save: when DCP's upload process died on any rank, retire it on
        every rank, so that DCP starts new ones for this save.

        DCP starts that process once and keeps it: after it died, every save would write to
        its closed pipe (BrokenPipeError) for the rest of the run. Every rank must start its new
        one at the same save: the processes join a process group of their own, and starting one
        is a collective of the saves' group.
        """
        dead = _dead_upload_process()
        if self.collective.all(dead is None):
            return
        log.warning(
            "DCP's upload process %s; starting a new one for this save",
            f"({dead}) died" if dead is not None else "died on another rank",
        )
        _retire_upload_process()

    def _async_stager(self) -> DefaultStager:
        if self._stager is None:
            cuda = torch.cuda.is_available()
            # the child process of process mode maps the staged tensors from shared memory
            self._stager = DefaultStager(StagingOptions(cuda, self.process_mode, False, cuda))
        return self._stager

    def close(self) -> None:
        """Free the stager's buffers."""
        if self._stager is not None:
            self._stager.close()
            self._stager = None


UPLOAD_EXIT_GRACE_S = 2.0
"""How long a failed save waits for a dying upload process to be seen dead: its pipe breaks a
moment before its exit can be reaped."""


def _dead_upload_process(grace_s: float = 0.0) -> str | None:
    """``pid N, exit code C`` of DCP's process-mode upload process when it died (within
    `grace_s`); None when it is alive or was not started.

    torch 2.13 keeps that process in the private module global
    ``_async_process_executor._CHECKPOINT_PROCESS`` and offers no public way to see or replace
    it (`dcp.async_save` takes no executor, and every executor it builds uses that global).
    """
    kept = _async_process_executor._CHECKPOINT_PROCESS
    if kept is None:
        return None
    if grace_s > 0:
        kept._save_process.join(grace_s)
    if kept._save_process.is_alive():
        return None
    return f"pid {kept._save_process.pid}, exit code {kept._save_process.exitcode}"


def _retire_upload_process() -> None:
    """Stop DCP's upload process if it still runs (its peers' died: its process group is
    broken) and forget it, so that DCP's next process-mode save starts a new one (the private
    global of `_dead_upload_process`, cleared as DCP would find it before its first save)."""
    kept = _async_process_executor._CHECKPOINT_PROCESS
    _async_process_executor._CHECKPOINT_PROCESS = None
    if kept is not None and kept._save_process.is_alive():
        kept._save_process.kill()
        kept._save_process.join()


def is_save_failure(error: BaseException) -> bool:
    """Whether `error` is how a save fails (DCP's wrapper or a failed collective), as opposed
    to an interrupt or a bug."""
    return isinstance(error, (CheckpointException, RuntimeError, TimeoutError))


def _who_failed(silent: list[int] | None) -> str:
    if silent:
        return f"rank(s) {silent}"
    return "a rank (which one could not be told: the rank markers were unreachable)"


def _failures(error: CheckpointException) -> dict[int, BaseException]:
    failures = getattr(error, "failures", {}) or {}
    # DCP wraps each rank's failure as (exception, traceback summary).
    return {rank: f[0] if isinstance(f, tuple) else f for rank, f in failures.items()}


def first_cause(error: CheckpointException) -> BaseException:
    """What the lowest failing rank raised inside DCP's wrapper (`error` itself when it holds
    none): for single-process DCP calls, whose one cause is the error to show."""
    failures = _failures(error)
    return failures[min(failures)] if failures else error


def _described(failures: dict[int, BaseException]) -> str:
    return "; ".join(
        f"rank {rank}: {type(cause).__name__}: {cause}" for rank, cause in sorted(failures.items())
    )


def _interrupt(failures: dict[int, BaseException], rank: int) -> BaseException | None:
    """This rank's own Ctrl-C or exit, which DCP's wrapper caught with every other failure:
    raised as it is, so that an interrupted save interrupts instead of failing quietly."""
    cause = failures.get(rank)
    return cause if isinstance(cause, (KeyboardInterrupt, SystemExit)) else None


def _save_error(step: int, error: CheckpointException) -> BaseException:
    failures = _failures(error)
    for cause in failures.values():
        if isinstance(cause, CheckpointAlreadyCommittedError):
            return cause
    cancelled = {r: c for r, c in failures.items() if isinstance(c, SaveCancelledError)}
    if cancelled:  # the plan at a notice stopped it: not a failure of the ranks
        rank, cause = min(cancelled.items())
        return SaveCancelledError(f"save of step {step} on rank {rank}: {cause}")
    refused = {r: c for r, c in failures.items() if isinstance(c, IntegrityRefusedError)}
    if refused:  # the guards' own error, naming the rank whose state was refused
        rank, cause = min(refused.items())
        where = "the coordinator" if isinstance(cause, ReplicaMismatchError) else f"rank {rank}"
        return type(cause)(f"save of step {step} refused on {where}: {cause}")
    return SaveFailedError(
        f"save of step {step} failed on rank(s) {sorted(failures)}: "
        f"{_described(failures) or error}; nothing was committed"
    )


def _load_error(step: int, error: CheckpointException, rank: int) -> BaseException:
    failures = _failures(error)
    interrupt = _interrupt(failures, rank)
    if interrupt is not None:
        return interrupt
    for cause in failures.values():
        if isinstance(cause, _RESTORE_ERRORS):
            return cause
    return CheckpointError(f"restore of step {step} failed: {_described(failures) or error}")
