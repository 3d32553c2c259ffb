"""Restoring: which step a restore loads and from where (`RestoreOrder`), and one committed
checkpoint loaded into a training state on every rank (`StateLoader`).

`RestoreOrder.restore` is the one statement of the order: the fast tier's newest usable step, then
the bucket's committed steps newest first, with fallback and quarantine (`CheckpointManager.restore`
and `restorable_step` delegate to it).

What a load does once the step and its source are chosen (`StateLoader`): the manifest, only the
parts of an indexed one that locate this rank's shards; the load through the engine, with the key
rules of a training state (loader keys older checkpoints lack are optional, other ranks' per-rank
state may stay unread) and each rank's per-rank state read from its own keys
(`spotckpt.state.TrainState.restoring`); the decoded values written back into a plain dict; and
the job-wide bytes read.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import logging
import time
from collections.abc import Callable, Iterable, Mapping
from typing import cast

from spotckpt.catalog import Catalog
from spotckpt.collector import collector_paused
from spotckpt.distributed import Collective
from spotckpt.engine.checkpointer import Checkpointer
from spotckpt.engine.packing import Run
from spotckpt.engine.planners import CheckedLoadPlanner, local_plan, plain_state, wanted_boxes
from spotckpt.engine.reader import ObjectStoreReader, ReadStats
from spotckpt.errors import (
    CheckpointError,
    CorruptCheckpointError,
    IncompleteRestoreError,
    ManifestError,
    NoCheckpointError,
    StorageError,
    UnknownFormatError,
)
from spotckpt.format.index import Box, Root
from spotckpt.format.manifest import Manifest
from spotckpt.format.signing import Keyring
from spotckpt.goodput import EventLog
from spotckpt.progress import ProgressLog
from spotckpt.state import (
    State,
    TrainState,
    as_dcp_state,
    is_added_loader_key,
    is_per_rank_key,
    write_back,
)
from spotckpt.storage import ObjectStore
from spotckpt.tiers.fast_tier import FastTier
from spotckpt.tiers.recovery import Scope
from spotckpt.units import human_size
from spotckpt.verify import verify_checkpoint

log = logging.getLogger("spotckpt")


class StateLoader:
    """Loads checkpoints into states for one rank of a job (see the module docstring)."""

    def __init__(
        self,
        catalog: Catalog,
        collective: Collective,
        checkpointer: Checkpointer,
        *,
        progress_interval_s: float | None = None,
    ) -> None:
        self.catalog = catalog
        self.collective = collective
        self.checkpointer = checkpointer
        self.progress_interval_s = progress_interval_s  # the coordinator logs its own reads

    def manifest(self, state: State, step: int) -> Manifest:
        """The manifest of committed `step` as far as loading `state` needs it (the coordinator
        reads the bytes once for every rank).

        Each rank reads only the index parts its shards need, so one rank may find a part
        missing or forged where the others find nothing wrong. The ranks agree: when any
        fails, every rank raises the first failing rank's error, so that a restore's fallback
        moves all of them to the same older step (never a mix of two steps).
        """
        data = self.collective.run_on_coordinator(lambda: self.catalog.manifest_bytes(step))

        def wanted(root: Root) -> tuple[Mapping[str, list[Box]], Iterable[str]]:
            with self._restoring(state, root):
                return wanted_boxes(plain_state(as_dcp_state(state)))

        failure: CheckpointError | None = None
        try:
            manifest = self.catalog.read_manifest(step, wanted, data=data)
        except CheckpointError as error:  # raised below, on every rank alike
            failure = error
        first = next((f for f in self.collective.gather(failure) if f is not None), None)
        if first is not None:
            raise first
        return manifest

    def byte_ranges(
        self, state: State, manifest: Manifest, store: ObjectStore, strict: bool
    ) -> dict[str, list[tuple[int, int]]]:
        """The byte ranges of each object in `store` that loading `manifest` into `state` reads
        on this rank (before they are there: the fast tier fetches them from peers first)."""
        with self._restoring(state, manifest):
            plan = local_plan(as_dcp_state(state), manifest, planner(strict))
        return ObjectStoreReader(store, manifest).byte_ranges(plan)

    def load(self, state: State, manifest: Manifest, store: ObjectStore, strict: bool) -> ReadStats:
        """Load `manifest`'s checkpoint from `store` into `state`; returns job-wide read stats."""
        reader = ObjectStoreReader(store, manifest, group=self.collective.group, offer_runs=True)
        started = time.monotonic()
        loaded = as_dcp_state(state)
        interval = self.progress_interval_s if self.collective.rank == 0 else None
        with (
            self._restoring(state, manifest),
            ProgressLog(f"restoring step {manifest.step}", reader.progress, interval),
        ):
            self.checkpointer.load(loaded, reader, planner(strict, reader.runs), manifest.step)
        write_back(state, loaded)
        read, needed, requests = self.collective.sum(
            [reader.stats.bytes_read, reader.stats.bytes_needed, reader.stats.requests]
        )
        log.info(
            "restored step %d in %.2f s (%s read for %s needed, job-wide)",
            manifest.step,
            time.monotonic() - started,
            human_size(read),
            human_size(needed),
        )
        return ReadStats(read, needed, requests)

    def _restoring(
        self, state: State, saved: Manifest | Root
    ) -> contextlib.AbstractContextManager[None]:
        """Around a load: per-rank state read from the right rank's keys (`TrainState`)."""
        if not isinstance(state, TrainState):
            return contextlib.nullcontext()
        stored = itertools.chain(saved.tensors, saved.values)
        rank, world = self.collective.rank, self.collective.world_size
        return state.restoring(saved.step, saved.world_size, rank, world, stored)


@dataclasses.dataclass
class _Restoring:
    """One restore's progress: whether a load has written into the caller's state yet, and
    the last failure (what an incomplete restore reports)."""

    written: bool = False
    failure: str = ""


class RestoreOrder:
    """Which step a restore loads, and from where: the one statement of that rule (`restore`).

    Built once per manager with what it reads from (the bucket's catalog and store, the fast
    tier if any); the loads go through `loader`. Every rank calls it at the same points.
    `last_read_stats` and `last_restore_sources` describe the last load (job-wide).
    """

    def __init__(
        self,
        loader: StateLoader,
        store: ObjectStore,
        *,
        tier: FastTier | None,
        keyring: Keyring | None,
        events: EventLog | None,
        uri: str,
    ) -> None:
        self.loader = loader
        self.catalog = loader.catalog
        self.collective = loader.collective
        self.store = store
        self.tier = tier
        self.keyring = keyring
        self.events = events  # the coordinator's event log (tier set-asides); None elsewhere
        self.uri = uri
        self.last_read_stats: ReadStats | None = None
        self.last_restore_sources: dict[str, int] = {}

    def restore(self, state: State, step: int | None, fallback: bool, strict: bool) -> int | None:
        """Load a step into `state` (with the collector paused) and return it, or None; then the
        fast tier lets go of steps newer than it."""
        with collector_paused():
            restored = self._restore_in_order(state, step, fallback, strict)
        if self.tier is not None:
            self.tier.discard_newer(restored)
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
        """The step that `restore` would load, each byte checked in place of the load (see
        `CheckpointManager.restorable_step`)."""
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
        if self.collective.rank != 0 or isinstance(error, UnknownFormatError):
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
        if self.events is None:  # only the coordinator records events
            return
        try:
            event = {"kind": "quarantine", "tier": True, "step": step, "reason": reason[:2000]}
            self.events.record(event)
        except StorageError as failure:
            log.warning("could not record the set-aside of fast-tier step %d: %s", step, failure)


def planner(strict: bool, runs: Mapping[str, Run] | None = None) -> CheckedLoadPlanner:
    """The load planner of a training state's restore (`strict=False`: keys may be missing from
    either side)."""
    return CheckedLoadPlanner(
        allow_missing=not strict,
        allow_unexpected=not strict,
        runs=runs,
        optional=is_added_loader_key,
        unread_ok=is_per_rank_key,
    )
