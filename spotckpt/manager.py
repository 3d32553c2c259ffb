"""`CheckpointManager`: save, restore, list, retention, preemption handling.

One manager per process (per rank). All ranks call `save`, `maybe_save` and `restore` at the
same points; the coordinator (rank 0) alone lists the bucket, reads and validates manifests,
commits and applies retention, and shares its decisions with the other ranks.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import itertools
import logging
import time
import warnings
from collections.abc import Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, cast

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import (
    DefaultLoadPlanner,
    create_default_local_load_plan,
)
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import LoadPlan, ReadItem
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType
from torch.distributed.checkpoint.stateful import Stateful

from spotckpt.catalog import Catalog, step_folder
from spotckpt.collector import collector_paused
from spotckpt.config import Config, ConfigError, Settings
from spotckpt.dcp import ObjectStoreReader, ObjectStoreWriter, ReadStats, wanted_boxes
from spotckpt.distributed import THIS_RANK, Collective, RankProgress
from spotckpt.errors import (
    CheckpointAlreadyCommittedError,
    CheckpointError,
    CorruptCheckpointError,
    InvalidArgumentError,
    ManifestError,
    NoCheckpointError,
    SaveFailedError,
    UnknownFormatError,
)
from spotckpt.format.index import (
    INDEXED_FORMAT,
    Root,
    manifest_format,
    parse_root,
    partial_manifest,
)
from spotckpt.format.manifest import Manifest
from spotckpt.gc import GcReport, collect_garbage
from spotckpt.goodput import GoodputTracker
from spotckpt.packing import RUN_PREFIX, Run, Unpack, adopt_runs
from spotckpt.preemption import PreemptionWatcher
from spotckpt.state import (
    ADDED_LOADER_KEYS,
    TrainState,
    as_dcp_state,
    is_per_rank_key,
    release_worker_shields,
    write_back,
)
from spotckpt.storage.base import ObjectStore, StorageError, check_portable
from spotckpt.storage.registry import open_store
from spotckpt.tiers.fast_tier import FastTier, TierWriter, state_bytes
from spotckpt.tiers.redundancy import parse_redundancy
from spotckpt.values import ValueLoadError
from spotckpt.verify import VerifyReport, verify_checkpoint
from spotckpt.version import __version__

log = logging.getLogger("spotckpt")


class KeyMismatchError(CheckpointError, KeyError):
    """The state to restore and the checkpoint disagree on which keys exist."""

    def __str__(self) -> str:
        return str(self.args[0])


class CheckedLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner, plus clear errors naming missing and unexpected keys.

    Missing keys are checked on each rank; unexpected ones on the coordinator against the union
    of what all ranks asked for (ranks may legitimately own different keys). Per-rank RNG keys
    are never unexpected: a restore on fewer ranks leaves some unread.

    With the reader's `runs` (`spotckpt.packing`), small tensors stored back to back are loaded
    as one item each run, where every member's destination fits, and unpacked when committed.
    """

    def __init__(
        self, allow_missing: bool, allow_unexpected: bool, runs: Mapping[str, Run] | None = None
    ) -> None:
        super().__init__(allow_partial_load=allow_missing)
        self.allow_unexpected = allow_unexpected
        self.runs = dict(runs or {})
        self.wanted: list[str] = []
        self.unpacks: dict[str, Unpack] = {}

    def set_up_planner(
        self,
        state_dict: dict[str, Any],
        metadata: Metadata | None = None,
        is_coordinator: bool = False,
    ) -> None:
        """DCP's set-up, then runs of small tensors (`spotckpt.packing`) adopted where the
        destination can take them whole."""
        super().set_up_planner(state_dict, metadata, is_coordinator)
        # What spotckpt adds to a data loader's state (its randomness record, Accelerate's epoch
        # count) is absent from checkpoints of earlier releases: then there is nothing to load
        # (the loader keeps what it offered, its own).
        stored = metadata.state_dict_metadata if metadata else {}
        added = tuple(f".{key}" for key in ADDED_LOADER_KEYS)
        for fqn in [k for k in self.state_dict if k.endswith(added)]:
            if fqn not in stored:
                del self.state_dict[fqn]
        self.wanted = sorted(self.state_dict)
        self.state_dict, self.unpacks = adopt_runs(self.state_dict, self.runs)

    def commit_tensor(self, read_item: ReadItem, tensor: torch.Tensor) -> None:
        """A loaded run goes to its members' destinations."""
        unpack = self.unpacks.get(read_item.dest_index.fqn)
        if unpack is not None:
            unpack(tensor)

    def create_local_plan(self) -> LoadPlan:
        stored = set(self.metadata.state_dict_metadata) if self.metadata else set()
        missing = sorted(set(self.wanted) - stored)
        if missing and not self.allow_partial_load:
            raise KeyMismatchError(
                f"missing from the checkpoint: {_some(missing)} (pass strict=False to restore() "
                "to allow this)"
            )
        # DCP's own create_local_plan re-flattens the whole state when checkpoint keys are not
        # in the state (for checkpoints of torch < 2.4, which spotckpt never wrote): that would
        # undo the adopted runs, whose members are such keys.
        if self.metadata is None:
            raise InvalidArgumentError("the load planner was not set up with metadata")
        plan = create_default_local_load_plan(
            self.state_dict, self.metadata, not self.allow_partial_load
        )
        return dataclasses.replace(plan, planner_data=self.wanted)

    def create_global_plan(self, global_plan: list[LoadPlan]) -> list[LoadPlan]:
        wanted = {key for plan in global_plan for key in (plan.planner_data or ())}
        stored = set(self.metadata.state_dict_metadata) if self.metadata else set()
        unexpected = sorted(
            k for k in stored - wanted if not (is_per_rank_key(k) or k.startswith(RUN_PREFIX))
        )
        if unexpected and not self.allow_unexpected:
            raise KeyMismatchError(
                f"in the checkpoint but not in the state: {_some(unexpected)} (pass "
                "strict=False to restore() to allow this)"
            )
        return super().create_global_plan(global_plan)


def _some(keys: list[str], limit: int = 8) -> str:
    shown = ", ".join(keys[:limit])
    return shown + (f" and {len(keys) - limit} more" if len(keys) > limit else "")


class CheckpointManager:
    """Saves and restores training state under one checkpoint root URI.

    The keyword arguments are the fields of `spotckpt.config.Settings` (`keep_last=3`,
    `interval_steps`, `async_save`, `preemption`, `storage_options`, ...), declared and validated
    there once for the manager and `Config` alike; `store` passes an already open store.
    Goodput (`spotckpt.goodput`): `interval_steps="auto"`, events under ``events/``, `metrics`.
    """

    def __init__(self, uri: str, *, store: ObjectStore | None = None, **settings: Any) -> None:
        self.settings = Settings(**settings)
        self.uri = uri
        self.keep_last = self.settings.keep_last
        self.async_save = self.settings.async_save
        self.prefix_spread = self.settings.prefix_spread
        self.agree_every = self.settings.agree_every
        storage_options = self.settings.storage_options
        self.store = store if store is not None else open_store(uri, **dict(storage_options or {}))
        self.catalog = Catalog(self.store)
        self.collective = Collective(self.settings.collective_timeout_s)
        self.rank = self.collective.rank
        self.world_size = self.collective.world_size
        self.group = self.collective.group
        if self.group is None:  # DCP warns on every single-process call, even in its threads
            warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
        self.watcher = self._make_watcher(self.settings.preemption, self.settings.save_budget_s)
        self.goodput = GoodputTracker(self.store, self.settings, is_coordinator=self.rank == 0)
        self._pending: Future[Any] | None = None
        self._pending_step: int | None = None
        self._pending_writer: ObjectStoreWriter | None = None
        self._pending_started = 0.0
        self._pending_stall = 0.0
        self._progress = RankProgress("spotckpt/none", self.world_size)
        self._stager: DefaultStager | None = None
        self._stop = False
        self._closed = False
        self._saves = 0
        self.last_save_seconds: float | None = None
        self.last_read_stats: ReadStats | None = None
        self.last_restore_sources: dict[str, int] = {}
        self.tier = self._open_tier()
        self._check_async_mode()
        self._pending_durable = True
        self._fast_save_seconds: float | None = None
        self._drain_seconds: float | None = None
        self._deadline: float | None = None
        self._continuation_pool: ThreadPoolExecutor | None = None

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
        )

    def _marks_progress(self, blocking: bool) -> bool:
        """Rank markers name dead ranks; a process-mode upload's child cannot set them."""
        if self.group is None:
            return False
        return blocking or self.settings.async_mode != "process"

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
        """Build from a `Config` (by default loaded from kwargs, env and spotckpt.toml)."""
        config = config if config is not None else Config.load(**overrides)
        return cls(config.uri, **config.manager_kwargs())

    def _make_watcher(
        self, preemption: bool | PreemptionWatcher, save_budget_s: float
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

    # Saving -------------------------------------------------------------------------------

    def save(
        self,
        step: int,
        state: TrainState | Mapping[str, Any],
        *,
        blocking: bool | None = None,
        user_metadata: Mapping[str, Any] | None = None,
    ) -> None:
        """Checkpoint `state` as `step` on every rank; commits once all ranks wrote.

        Blocking by default unless the manager was built with ``async_save=True``. A new save
        first waits for the previous one and raises its error, if any.
        """
        self._save(step, state, blocking, user_metadata, emergency=False)

    def _save(
        self,
        step: int,
        state: TrainState | Mapping[str, Any],
        blocking: bool | None,
        user_metadata: Mapping[str, Any] | None,
        *,
        emergency: bool,
        durable: bool = True,
    ) -> None:
        self._check_open()
        blocking = not self.async_save if blocking is None else blocking
        self.wait()
        with collector_paused():
            self._start_save(step, state, blocking, user_metadata, emergency, durable)

    def _start_save(
        self,
        step: int,
        state: TrainState | Mapping[str, Any],
        blocking: bool,
        user_metadata: Mapping[str, Any] | None,
        emergency: bool,
        durable: bool,
    ) -> None:
        """A save from its start to its commit (blocking) or to its hand-over to the
        background (async), with the garbage collector paused (`spotckpt.collector`)."""
        self._saves += 1
        progress = RankProgress(f"spotckpt/save-{self._saves}-{step}", self.world_size)
        self._progress = progress
        options: dict[str, Any] = {
            "user_metadata": dict(user_metadata or {}),
            "versions": {"spotckpt": __version__, "torch": torch.__version__},
            "on_written": progress.mark_written if self._marks_progress(blocking) else None,
        }
        state_dict = as_dcp_state(state, step)
        if self.tier is not None and self._tier_has_room(step, state_dict):
            self._tier_save(step, state_dict, options, blocking, durable, emergency)
            return
        if not durable:
            return
        writer = ObjectStoreWriter(self.store, step, prefix_spread=self.prefix_spread, **options)
        started = time.monotonic()
        if blocking:
            self._run_save(step, writer, lambda: self._dcp_save(state_dict, writer))
            self._blocking_commit(step, writer, started, emergency)
            return
        response = dcp.async_save(
            state_dict,
            storage_writer=writer,
            planner=writer.save_planner(self.collective.world_size),
            process_group=self.collective.save_group,
            async_stager=self._async_stager(),
            no_dist=self.group is None,
            **self._checkpointer_type(),
        )
        upload = response.upload_completion if hasattr(response, "upload_completion") else response
        self._pending, self._pending_step = upload, step
        self._pending_writer, self._pending_durable = writer, True
        self._pending_started = started
        self._pending_stall = time.monotonic() - started
        log.info("checkpoint step %d staged in %.3f s; uploading", step, self._pending_stall)
        self.goodput.stalled(step, self._pending_stall, emergency=emergency)
        self._agree_interval()  # safe during the upload: saves use a group of their own

    # The fast tier ---------------------------------------------------------------------------

    def _tier_has_room(self, step: int, state_dict: dict[str, Any]) -> bool:
        """Whether every node's tier has room for this save (agreed); warns when not."""
        tier = self.tier
        if tier is None:
            return False
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
        options: dict[str, Any],
        blocking: bool,
        durable: bool,
        emergency: bool,
    ) -> None:
        """A save through the fast tier: stage once, copy to peers, then (`durable`) drain."""
        tier = cast(FastTier, self.tier)
        writer = tier.writer(step, **options)
        started = time.monotonic()
        finish = functools.partial(
            self._finish_tier_save, step, writer, durable, emergency, started
        )
        if blocking:

            def run() -> None:
                self._dcp_save(state_dict, writer)
                finish()

        else:
            response = dcp.async_save(
                state_dict,
                storage_writer=writer,
                planner=writer.save_planner(self.collective.world_size),
                process_group=self.collective.save_group,
                async_stager=self._async_stager(),
                no_dist=self.group is None,
            )
            upload = cast(Future[Any], getattr(response, "upload_completion", response))
            self._pending = self._continuations().submit(lambda: (upload.result(), finish())[1])
            self._pending_step, self._pending_writer = step, writer
            self._pending_durable = durable
            self._pending_started = started
            self._pending_stall = time.monotonic() - started
            self.goodput.stalled(step, self._pending_stall, emergency=emergency)
            log.info("checkpoint step %d staged in %.3f s (fast tier)", step, self._pending_stall)
            return
        if durable:
            self._run_save(step, writer, run)
            self._blocking_commit(step, writer, started, emergency)
        else:
            self._run_fast(step, run)

    def _finish_tier_save(
        self, step: int, writer: TierWriter, durable: bool, emergency: bool, started: float
    ) -> None:
        """After DCP wrote the tier: copies and commit on every node, then the drain."""
        tier = cast(FastTier, self.tier)
        saves = self.collective.for_saves()
        manifest, data = tier.complete(step, writer, saves)
        self._fast_save_seconds = time.monotonic() - started
        log.info(
            "fast tier: step %d committed on every node in %.2f s", step, self._fast_save_seconds
        )
        if not durable:
            return
        if emergency and not saves.all(self._time_for(self._drain_seconds)):
            log.warning(
                "no time left to upload step %d to the store; resuming will use the fast-tier "
                "copies on the surviving nodes",
                step,
            )
            return
        drain_started = time.monotonic()
        tier.drain(manifest, self.catalog, saves, data)
        writer.manifest = manifest
        self._drain_seconds = time.monotonic() - drain_started

    def _run_fast(self, step: int, run: Any) -> None:
        """A fast-only save: its failure costs the cached copy, never the training run."""
        try:
            run()
        except (CheckpointError, CheckpointException, StorageError, OSError) as error:
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

    def _blocking_commit(
        self, step: int, writer: ObjectStoreWriter, started: float, emergency: bool
    ) -> None:
        """After a blocking save: its time, goodput events, and (not in an emergency) the
        ``"auto"`` interval. A fast-tier emergency save with no time to upload has no commit."""
        self.last_save_seconds = time.monotonic() - started
        self.goodput.stalled(step, self.last_save_seconds, emergency=emergency)
        if not emergency:
            self._agree_interval()
        if writer.manifest is None:
            return
        log.info("checkpoint step %d committed in %.2f s", step, self.last_save_seconds)
        self.goodput.committed(
            step,
            stall_s=self.last_save_seconds,
            upload_s=self.last_save_seconds,
            size=_size(writer),
            asynchronous=False,
            emergency=emergency,
        )

    def _agree_interval(self) -> None:
        """Recompute the ``"auto"`` interval; every rank takes the coordinator's choice."""
        if not self.goodput.auto:
            return
        self.goodput.recompute()
        if self.group is not None:
            self.goodput.adopt(self.collective.broadcast(self.goodput.interval_steps))

    def _async_stager(self) -> DefaultStager:
        if self._stager is None:
            cuda = torch.cuda.is_available()
            process = self.settings.async_mode == "process"  # the child maps shared memory
            self._stager = DefaultStager(StagingOptions(cuda, process, False, cuda))
        return self._stager

    def _checkpointer_type(self) -> dict[str, Any]:
        if self.settings.async_mode != "process":
            return {}
        return {"async_checkpointer_type": AsyncCheckpointerType.PROCESS}

    def _dcp_save(self, state_dict: dict[str, Any], writer: ObjectStoreWriter) -> None:
        dcp.save(
            state_dict,
            storage_writer=writer,
            planner=writer.save_planner(self.collective.world_size),
            process_group=self.collective.save_group,
            no_dist=self.group is None,
        )

    def _run_save(self, step: int, writer: ObjectStoreWriter, run: Any) -> None:
        """Run a save to its end; after its commit point nothing can fail it any more.

        A failure is first checked against the bucket: if this attempt's manifest is there (a
        peer died after the commit, an answer was lost), the save is committed and the failure
        is only a warning. Otherwise the attempt is discarded and the error raised.
        """
        try:
            run()
        except CheckpointException as error:
            self._after_failure(step, writer, _save_error(step, error), error)
        except (RuntimeError, TimeoutError) as error:
            self._after_failure(step, writer, self._collective_failure(step, writer, error), error)
        except BaseException:
            if not self._committed(step, writer):
                self._discard_attempt(step, writer)
            raise
        if self.is_coordinator:
            self._apply_retention()

    def _after_failure(
        self, step: int, writer: ObjectStoreWriter, failure: BaseException, cause: BaseException
    ) -> None:
        if self._committed(step, writer):
            log.warning(
                "checkpoint step %d is committed; what failed after its commit point does not "
                "undo it: %s",
                step,
                failure,
            )
            return
        self._discard_attempt(step, writer)
        raise failure from (None if failure is cause else cause)

    def _collective_failure(
        self, step: int, writer: ObjectStoreWriter, error: BaseException
    ) -> BaseException:
        """The error to raise for a failed collective: names the ranks that died or hung."""
        if self.group is None or self._committed(step, writer):
            return error
        silent = self._progress.silent_ranks()
        log.debug("save of step %d: collective failed: %r", step, error)
        return SaveFailedError(
            f"save of step {step} failed: {_who_failed(silent)} did not finish writing "
            f"(process died or hung); nothing was committed"
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

    def wait(self) -> None:
        """Block until an asynchronous save has committed; raise its error if it failed."""
        pending, step, writer = self._pending, self._pending_step, self._pending_writer
        if pending is None or step is None or writer is None:
            return
        self._pending = self._pending_step = self._pending_writer = None
        if not self._pending_durable:
            self._run_fast(step, pending.result)
            return
        self._run_save(step, writer, pending.result)
        self.last_save_seconds = time.monotonic() - self._pending_started
        log.info("checkpoint step %d committed in %.2f s (async)", step, self.last_save_seconds)
        self.goodput.committed(
            step,
            stall_s=self._pending_stall,
            upload_s=self.last_save_seconds - self._pending_stall,
            size=_size(writer),
            asynchronous=True,
            emergency=False,
        )

    def _discard_attempt(self, step: int, writer: ObjectStoreWriter) -> None:
        """After a failed save: abort this attempt's uploads and delete its objects."""
        if self.is_coordinator and writer.attempt is not None:
            self.catalog.discard_attempt(step, writer.attempt)

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

    # Preemption ---------------------------------------------------------------------------

    def maybe_save(
        self,
        step: int,
        state: TrainState | Mapping[str, Any],
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
        if self._pending is not None and self._pending.done():
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

    def _preemption_agreed(self, step: int) -> bool:
        local = self.watcher is not None and self.watcher.preempted
        if self.group is None:
            return local
        if step % self.agree_every != 0:
            return False
        return self.collective.any(local)

    def _emergency_save(
        self,
        step: int,
        state: TrainState | Mapping[str, Any],
        user_metadata: Mapping[str, Any] | None,
    ) -> None:
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
        pending = self._pending_step
        self._deadline = deadline
        self.wait()  # an in-flight upload is closest to done: let it commit first
        if pending != step and self.collective.all(self._time_for_another_save(deadline)):
            self._save(step, state, True, user_metadata, emergency=True)
            committed = step
        else:
            committed = pending if pending is not None else step
            if pending != step:
                log.warning(
                    "no time left for a save of step %d; resuming will start after step %s",
                    step,
                    pending,
                )
        elapsed = time.monotonic() - started
        log.warning("emergency save of step %d committed in %.2f s", committed, elapsed)
        self.goodput.preempted(
            source=(watcher.reason if watcher is not None else None) or "peer rank",
            notice_left_s=remaining,
            step=step,
            emergency_save_s=elapsed,
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

    def should_stop(self) -> bool:
        """True on every rank once a preemption save has committed: leave the training loop."""
        return self._stop

    # Restoring ----------------------------------------------------------------------------

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
        state: TrainState | Mapping[str, Any],
        step: int | None = None,
        *,
        fallback: bool = True,
        strict: bool = True,
    ) -> int | None:
        """Load the latest committed checkpoint (or `step`) into `state` in place.

        Returns the restored step, or None when there is no checkpoint. When a checkpoint turns
        out corrupt and `fallback` is set (and no `step` was asked for), falls back to the newest
        older one that loads, with a warning. `strict=False` allows missing and extra keys.
        """
        self._check_open()
        self.wait()
        started = time.monotonic()
        with collector_paused():
            restored = self._restore_any(state, step, fallback, strict)
        if self.tier is not None:
            self.tier.discard_newer(restored)
        self.goodput.restored(restored, time.monotonic() - started)
        self._agree_interval()
        return restored

    def _restore_any(
        self, state: TrainState | Mapping[str, Any], step: int | None, fallback: bool, strict: bool
    ) -> int | None:
        candidates = self.collective.run_on_coordinator(lambda: self._restore_candidates(step))
        if self.tier is not None and step is None:
            restored = self._restore_from_tier(state, candidates[0] if candidates else None, strict)
            if restored is not None:
                return restored
        for index, candidate in enumerate(candidates):
            try:
                self._restore_step(state, candidate, strict)
                return candidate
            except NoCheckpointError:
                if step is not None:
                    raise
                log.info("checkpoint step %d was deleted while restoring; trying older", candidate)
            except (CorruptCheckpointError, ManifestError) as error:
                older = candidates[index + 1 :]
                if step is not None or not fallback or not older:
                    raise
                self._set_aside(candidate, error)
                log.warning(
                    "checkpoint step %d is unusable (%s); falling back to step %d",
                    candidate,
                    error,
                    older[0],
                )
        return None

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

    def _restore_candidates(self, step: int | None) -> list[int]:
        if step is not None:
            return [self.catalog.resolve(step)]
        return list(reversed(self.catalog.steps()))

    def _restore_step(self, state: TrainState | Mapping[str, Any], step: int, strict: bool) -> None:
        data = self.collective.run_on_coordinator(lambda: self.catalog.manifest_bytes(step))
        if manifest_format(data) == INDEXED_FORMAT:
            manifest = self._partial_manifest(state, parse_root(data, step))
        else:
            manifest = Manifest.from_json(data, expected_step=step)
        stats = self._load(state, manifest, self.store, strict)
        self.last_restore_sources = {"local": 0, "peer": 0, "store": stats.bytes_read}

    def _partial_manifest(self, state: TrainState | Mapping[str, Any], root: Root) -> Manifest:
        """What this rank's shards need of an indexed checkpoint: the root plus their parts."""
        with self._restoring(state, root):
            plain = _plain(as_dcp_state(state))
        boxes, values = wanted_boxes(plain)
        return partial_manifest(self.store, step_folder(root.step), root, boxes, values)

    def _load(
        self,
        state: TrainState | Mapping[str, Any],
        manifest: Manifest,
        store: ObjectStore,
        strict: bool,
    ) -> ReadStats:
        """Load `manifest`'s checkpoint from `store` into `state`; returns job-wide read stats."""
        step = manifest.step
        reader = ObjectStoreReader(store, manifest, group=self.group, offer_runs=True)
        started = time.monotonic()
        loaded = as_dcp_state(state)
        try:
            with self._restoring(state, manifest):
                dcp.load(
                    loaded,
                    storage_reader=reader,
                    planner=self._planner(strict, reader.runs),
                    process_group=self.group,
                    no_dist=self.group is None,
                )
        except CheckpointException as error:
            raise _load_error(step, error) from None
        write_back(state, loaded)
        read, needed, requests = self.collective.sum(
            [reader.stats.bytes_read, reader.stats.bytes_needed, reader.stats.requests]
        )
        self.last_read_stats = ReadStats(read, needed, requests)  # job-wide
        log.info(
            "restored step %d in %.2f s (%d bytes read for %d needed, job-wide)",
            step,
            time.monotonic() - started,
            read,
            needed,
        )
        return self.last_read_stats

    def _restoring(
        self, state: TrainState | Mapping[str, Any], saved: Manifest | Root
    ) -> contextlib.AbstractContextManager[None]:
        if not isinstance(state, TrainState):
            return contextlib.nullcontext()
        stored = itertools.chain(saved.tensors, saved.values)
        return state.restoring(saved.step, saved.world_size, self.rank, self.world_size, stored)

    @staticmethod
    def _planner(strict: bool, runs: Mapping[str, Run] | None = None) -> CheckedLoadPlanner:
        return CheckedLoadPlanner(allow_missing=not strict, allow_unexpected=not strict, runs=runs)

    def _restore_from_tier(
        self, state: TrainState | Mapping[str, Any], durable: int | None, strict: bool
    ) -> int | None:
        """Restore the newest step the fast tiers can give whole (not older than `durable`)."""
        tier = cast(FastTier, self.tier)

        def needs(manifest: Manifest) -> dict[str, list[tuple[int, int]]]:
            with self._restoring(state, manifest):
                plan = _local_plan(as_dcp_state(state), manifest, self._planner(strict))
            return ObjectStoreReader(tier.store, manifest).byte_ranges(plan)

        found = tier.recover(self.collective, durable, needs)
        if found is None:
            return None
        manifest, moved = found
        try:
            stats = self._load(state, manifest, tier.store, strict)
        except (CorruptCheckpointError, ManifestError) as error:
            log.warning(
                "the fast-tier copy of step %d did not load (%s); restoring from the store",
                manifest.step,
                error,
            )
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

    # Maintenance --------------------------------------------------------------------------

    def verify(self, step: int | None = None, *, progress: Any = None) -> VerifyReport:
        """Check every byte of a committed checkpoint (default: the latest) against its manifest."""
        return verify_checkpoint(self.store, self.catalog.resolve(step), progress=progress)

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
            self.store, keep_last=keep_last, safety_age_s=safety_age_s, dry_run=dry_run
        )

    # Lifecycle ----------------------------------------------------------------------------

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
            if self._stager is not None:
                self._stager.close()
            if self._continuation_pool is not None:
                self._continuation_pool.shutdown()
            self.store.close()

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _local_plan(
    state_dict: dict[str, Any], manifest: Manifest, planner: CheckedLoadPlanner
) -> LoadPlan:
    """This rank's load plan of `manifest`, as DCP's own local planning makes it."""
    metadata, _ = manifest.to_dcp()
    planner.set_up_planner(_plain(state_dict), metadata, False)
    return planner.create_local_plan()


def _plain(state_dict: dict[str, Any]) -> dict[str, Any]:
    """The dict DCP plans a load of: each Stateful replaced by its state_dict()."""
    return {k: v.state_dict() if isinstance(v, Stateful) else v for k, v in state_dict.items()}


def _size(writer: ObjectStoreWriter) -> int | None:
    """Bytes of a committed save (known on the coordinator)."""
    return writer.manifest.total_bytes if writer.manifest is not None else None


def _who_failed(silent: list[int] | None) -> str:
    if silent:
        return f"rank(s) {silent}"
    return "a rank (which one could not be told: the rank markers were unreachable)"


def _failures(error: CheckpointException) -> dict[int, BaseException]:
    failures = getattr(error, "failures", {}) or {}
    # DCP wraps each rank's failure as (exception, traceback summary).
    return {rank: f[0] if isinstance(f, tuple) else f for rank, f in failures.items()}


def _save_error(step: int, error: CheckpointException) -> BaseException:
    failures = _failures(error)
    for cause in failures.values():
        if isinstance(cause, CheckpointAlreadyCommittedError):
            return cause
    described = "; ".join(
        f"rank {rank}: {type(cause).__name__}: {cause}" for rank, cause in sorted(failures.items())
    )
    return SaveFailedError(
        f"save of step {step} failed on rank(s) {sorted(failures)}: {described or error}; "
        "nothing was committed"
    )


def _load_error(step: int, error: CheckpointException) -> BaseException:
    failures = _failures(error)
    for cause in failures.values():
        if isinstance(
            cause, (CorruptCheckpointError, KeyMismatchError, ManifestError, ValueLoadError)
        ):
            return cause
    described = "; ".join(
        f"rank {rank}: {type(cause).__name__}: {cause}" for rank, cause in sorted(failures.items())
    )
    return CheckpointError(f"restore of step {step} failed: {described or error}")
