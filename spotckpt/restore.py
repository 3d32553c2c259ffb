"""Restoring: which step a restore loads and from where (`RestoreOrder`), and one committed
checkpoint loaded into a training state on every rank (`StateLoader`).

`RestoreOrder.restore` is the one statement of the order: the fast tier's newest usable step, then
the committed steps of the bucket and its mirrors newest first, with fallback and quarantine
(`CheckpointManager.restore` and `restorable_step` delegate to it).

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
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import cast

from spotckpt.catalog import Catalog
from spotckpt.collector import collector_paused
from spotckpt.distributed import Collective
from spotckpt.engine.checkpointer import Checkpointer
from spotckpt.engine.dcp_standard import StandardCheckpoint, StandardDcpReader, find_standard
from spotckpt.engine.packing import Run
from spotckpt.engine.planners import CheckedLoadPlanner, local_plan, plain_state, wanted_boxes
from spotckpt.engine.reader import ObjectStoreReader, ReadStats
from spotckpt.errors import (
    CheckpointError,
    CorruptCheckpointError,
    IncompleteRestoreError,
    ManifestError,
    NoCheckpointError,
    SignatureError,
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

    def load_standard(
        self, state: State, checkpoint: StandardCheckpoint, step: int, strict: bool
    ) -> None:
        """Load `step`, the standard DCP checkpoint `checkpoint`, into `state` (the manager's key
        rules; a TrainState's per-rank parts are read from the keys DCP saved them under)."""
        loaded = as_dcp_state(state)
        self.checkpointer.load(loaded, StandardDcpReader(checkpoint), planner(strict), step)
        write_back(state, loaded)

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


@dataclasses.dataclass(frozen=True)
class Copy:
    """One root a restore may read a committed step from: the job's own, or one of its mirrors
    (`spotckpt.mirroring`), with the loader that reads it."""

    catalog: Catalog
    loader: StateLoader

    @property
    def uri(self) -> str:
        """The root's URI."""
        return self.catalog.uri

    @property
    def store(self) -> ObjectStore:
        """The root's store."""
        return self.catalog.store


Candidate = tuple[int, int]
"""A step a restore may load, and the index in `RestoreOrder.copies` of the root it reads."""


class RestoreOrder:
    """Which step a restore loads, and from where: the one statement of that rule (`restore`).

    Built once per manager with what it reads from (the bucket's catalog and store, its
    mirrors, the fast tier if any); the loads go through `loader`. Every rank calls it at the
    same points. `last_read_stats`, `last_restore_sources` and `last_restore_uri` describe the
    last load (job-wide).
    """

    def __init__(
        self,
        loader: StateLoader,
        store: ObjectStore,
        *,
        mirrors: Sequence[Catalog] = (),
        nearest: int | None = None,
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
        self.last_restore_uri: str | None = None
        self._root_steps: set[int] | None = None
        """The job's root's steps as the coordinator's last listing of every copy found them;
        None when it could not be read then (or there are no mirrors)."""
        self.nearest = nearest
        """The copy a restore reads first (the `nearest_copy` setting); None: the fastest."""
        self.copies = [Copy(self.catalog, loader)] + [
            Copy(
                mirror,
                StateLoader(
                    mirror,
                    loader.collective,
                    loader.checkpointer,
                    progress_interval_s=loader.progress_interval_s,
                ),
            )
            for mirror in mirrors
        ]

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
        3. Then the committed steps of the bucket and of its mirrors (`spotckpt.mirroring`),
           newest first, each from its nearest copy first (`_bucket_candidates`): a root that
           cannot be read is a warning while another can. A step that turns out corrupt (bad
           bytes or a bad manifest, an unsigned one under a key among them) is quarantined
           where it was read and the next candidate tried (the same step at another copy, or
           an older one), with a warning, unless `fallback` is off or none is left; a step
           deleted meanwhile (retention by another job) means the next one.
        4. None when no committed step is left, if nothing was written into the state. Once a
           load has written into it (a tier or bucket step that then failed), the restore either
           completes from another source or raises `IncompleteRestoreError`: never None over a
           modified state. Every rank takes the same path (the coordinator's listing and scope,
           collective verdicts on the tier, DCP's load raising on every rank).

        `restorable_step` follows 3 and 4 with a check of every byte in place of the load.
        """
        try:
            plan = self.collective.run_on_coordinator(lambda: self._restore_plan(step))
        except NoCheckpointError as missing:
            if step is None:
                raise
            return self._restore_standard(state, step, strict, missing)
        candidates, scope = plan
        restoring = _Restoring()
        if scope is not None:
            restored = self._restore_from_tier(state, scope, strict, restoring)
            if restored is not None:
                return restored

        def load(candidate: Candidate) -> None:
            try:
                self._restore_from_bucket(state, candidate, strict, restoring)
            except (CorruptCheckpointError, ManifestError) as error:
                where = f" at {self.copies[candidate[1]].uri}" if candidate[1] else ""
                restoring.failure = f"step {candidate[0]}{where}: {type(error).__name__}: {error}"
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
        self,
        candidates: list[Candidate],
        use: Callable[[Candidate], None],
        *,
        explicit: bool,
        fallback: bool,
    ) -> int | None:
        """Steps 3 and 4 of `_restore_in_order`: the step of the first of `candidates` that
        `use` takes.

        A step deleted meanwhile means the next one; a corrupt one is quarantined (in the root
        it was read from), with a warning, before the next one is tried: the same step at a
        mirror, or an older one. An `explicit` step's error is raised as it is when no other
        root holds it.
        """
        for index, candidate in enumerate(candidates):
            step, copy = candidate
            try:
                use(candidate)
                return step
            except NoCheckpointError:
                if explicit and not candidates[index + 1 :]:
                    raise
                log.info("checkpoint step %d was deleted while restoring; trying older", step)
            except (CorruptCheckpointError, ManifestError) as error:
                rest = candidates[index + 1 :]
                if not rest or not (fallback or explicit):  # explicit: rest is the same step
                    raise
                self._set_aside(candidate, error)
                log.warning(
                    "checkpoint step %d%s is unusable (%s); falling back to step %d%s",
                    step,
                    self._at(copy),
                    error,
                    rest[0][0],
                    self._at(rest[0][1]),
                )
            except StorageError as error:  # a copy that cannot be read now: another may
                rest = candidates[index + 1 :]
                if len(self.copies) == 1 or not rest or not (fallback or explicit):
                    raise
                log.warning(
                    "reading step %d%s failed (%s); trying step %d%s",
                    step,
                    self._at(copy),
                    error,
                    rest[0][0],
                    self._at(rest[0][1]),
                )
        return None

    def _at(self, copy: int) -> str:
        """`` at URI`` for a mirror, nothing for the job's own root."""
        return f" at mirror {self.copies[copy].uri}" if copy else ""

    def restorable_step(self) -> int | None:
        """The step that `restore` would load, each byte checked in place of the load (see
        `CheckpointManager.restorable_step`)."""
        candidates = self.collective.run_on_coordinator(lambda: self._bucket_candidates(None))
        return self._first_usable(candidates, self._check_whole, explicit=False, fallback=True)

    def _check_whole(self, candidate: Candidate) -> None:
        """Raise, on every rank, the error a restore of `candidate` would meet in its manifest
        or its bytes (the coordinator reads them all, the manifest once: `verify_checkpoint`
        reports a damaged one as its first problem)."""
        step, copy = candidate

        def check() -> None:
            store = self.copies[copy].store
            error = verify_checkpoint(store, step, keyring=self.keyring).error()
            if error is not None:
                raise error

        self.collective.run_on_coordinator(check)

    def _restore_plan(self, step: int | None) -> tuple[list[Candidate], Scope | None]:
        """On the coordinator: the committed steps a restore may load, in the order it tries
        them, and which fast-tier steps it may use (None: not the tier)."""
        candidates = self._bucket_candidates(step)
        if self.tier is None or step is not None:
            return candidates, None
        durable, copy = candidates[0] if candidates else (None, 0)
        catalog = self.copies[copy].catalog
        attempt = catalog.committed_attempt(durable) if durable is not None else None
        return candidates, Scope(self._bucket_job(catalog), durable, attempt)

    def _bucket_job(self, catalog: Catalog) -> str | None:
        """The job identity of the root `catalog` reads (a mirror holds the same), read (never
        created) for a restore; None if it has none or it is damaged (then no fast-tier step is
        used, with a warning)."""
        try:
            job = catalog.job()
        except ManifestError as error:
            log.warning("%s; fast-tier copies are not used", error)
            return None
        return job.id if job is not None else None

    def _bucket_candidates(self, step: int | None) -> list[Candidate]:
        """The committed steps a restore may load, each with the root it reads, in the order
        it tries them: newest first (`step` alone when given); of each step, the copies
        nearest first (`_nearest_first`: by how fast their listing answered).

        Without mirrors this is the job's root alone, and its errors are raised as they are.
        With mirrors, a root that cannot be listed is a warning, and a mirror whose job
        identity is not the job's (that of the first root that answers) is left out: no other
        job's step is ever restored."""
        if len(self.copies) == 1:
            steps = [self.catalog.resolve(step)] if step is not None else self.catalog.steps()
            return [(s, 0) for s in reversed(steps)]
        listed = self._listed_copies()
        if step is not None:
            holding = [
                index for index, steps in _nearest_first(listed, self.nearest) if step in steps
            ]
            if not holding:
                raise NoCheckpointError(
                    f"step {step} has no committed checkpoint at {self.uri} or its mirrors"
                )
            return [(step, index) for index in holding]
        everywhere = sorted({s for _latency, _index, steps in listed for s in steps}, reverse=True)
        nearest = _nearest_first(listed, self.nearest)
        return [(s, index) for s in everywhere for index, steps in nearest if s in steps]

    def _listed_copies(self) -> list[tuple[float, int, set[int]]]:
        """Each root that answers: how long its listing took, its index, its steps."""
        listed: list[tuple[float, int, set[int]]] = []
        job: str | None = None
        for index, copy in enumerate(self.copies):
            started = time.monotonic()
            try:
                steps = set(copy.catalog.steps())
                found = copy.catalog.job()
            except (StorageError, ManifestError) as error:
                log.warning(
                    "checkpoint root %s cannot be read (%s); restoring from the other copies",
                    copy.uri,
                    error,
                )
                continue
            if job is not None and steps and (found is None or found.id != job):
                log.warning(
                    "mirror %s belongs to job %s, not to this job (%s): its steps are not used",
                    copy.uri,
                    found.id if found is not None else None,
                    job,
                )
                continue
            job = job or (found.id if found is not None else None)
            listed.append((time.monotonic() - started, index, steps))
        self._root_steps = next((steps for _, index, steps in listed if index == 0), None)
        if not listed:
            raise StorageError(f"neither {self.uri} nor any of its mirrors can be read")
        return listed

    def _set_aside(self, candidate: Candidate, error: Exception) -> None:
        """Quarantine a step that failed to restore in the root it was read from, so that it
        can be saved (or mirrored) again.

        A manifest of an unknown (newer) format says nothing about the checkpoint: left alone.
        """
        if self.collective.rank != 0 or isinstance(error, UnknownFormatError):
            return
        step, copy = candidate
        try:
            self.copies[copy].catalog.quarantine(step, f"{type(error).__name__}: {error}")
        except StorageError as failure:
            log.warning("could not quarantine step %d%s: %s", step, self._at(copy), failure)

    def _restore_from_bucket(
        self, state: State, candidate: Candidate, strict: bool, restoring: _Restoring
    ) -> None:
        step, index = candidate
        copy = self.copies[index]
        if index:
            self.collective.run_on_coordinator(lambda: self._check_same_save(step, copy))
        manifest = copy.loader.manifest(state, step)
        restoring.written = True  # from here on, a failure may leave part of it in `state`
        self.last_read_stats = stats = copy.loader.load(state, manifest, copy.store, strict)
        self.last_restore_sources = {"local": 0, "peer": 0, "store": stats.bytes_read}
        self.last_restore_uri = copy.uri
        if index:
            log.info("restored step %d from mirror %s", step, copy.uri)
            if self.collective.rank == 0:
                self._adopt_identity(copy)

    def _restore_standard(
        self, state: State, step: int, strict: bool, missing: NoCheckpointError
    ) -> int:
        """An explicit `step` that the root holds only as a standard DCP checkpoint (a
        ``step-<N>/`` folder with DCP's ``.metadata``, as DCP's own writers leave it), loaded as
        it is (`spotckpt.engine.dcp_standard`). Such a checkpoint carries no signature: under a
        configured key it is refused, as any unsigned step is (import it, signed, first).
        Without one, `missing` (why no committed step was found) is raised."""
        try:
            folder = self.collective.run_on_coordinator(
                lambda: find_standard(self.catalog.store, step)
            )
        except StorageError:
            raise missing from None  # the root cannot be read: why no step was found stands
        if folder is None:
            raise missing  # no spotckpt step, and no standard one either
        if self.catalog.keyring is not None:
            raise SignatureError(
                f"step {step} at {self.uri} is a standard DCP checkpoint, which carries no "
                "signature, and a signing key is configured: import it with "
                "`spotckpt import-dcp`, which signs it, and restore the imported step"
            )
        store = self.catalog.store
        checked = self.collective.run_on_coordinator(  # read once; every rank fails alike
            lambda: StandardCheckpoint(store, folder).metadata
        )
        checkpoint = StandardCheckpoint(store, folder, metadata=checked)
        self.loader.load_standard(state, checkpoint, step, strict)
        self.last_restore_uri = self.uri
        log.info("restored step %d from the standard DCP checkpoint %s/%s", step, self.uri, folder)
        return step

    def _check_same_save(self, step: int, copy: Copy) -> None:
        """NoCheckpointError (the next candidate: the job's own root's) when the job's root
        holds `step` as another save than mirror `copy` does: saved again with overwrite after
        it was mirrored. The root is the source of truth while it can be read."""
        if self._root_steps is None or step not in self._root_steps:
            return  # the root could not be read, or lacks the step: the mirror's is the one
        try:
            own = self.catalog.committed_attempt(step)
        except StorageError:
            return  # the root cannot be read now: the mirror's copy is the one there is
        if own is not None and copy.catalog.committed_attempt(step) != own:
            log.warning(
                "step %d at mirror %s is another save than at %s (saved again after it was "
                "mirrored): reading the root's",
                step,
                copy.uri,
                self.uri,
            )
            raise NoCheckpointError(f"step {step} at {copy.uri} is not the root's save of it")

    def _adopt_identity(self, copy: Copy) -> None:
        """After a restore from mirror `copy` into a job's root without a job identity (a new
        root for a region that was lost), the root takes the mirror's: the job goes on as the
        same job, and its mirrors keep accepting its steps."""
        try:
            identity = copy.catalog.job()
            if identity is not None and self.catalog.job() is None:
                self.catalog.adopt_job(identity)
        except CheckpointError as error:
            log.warning("%s keeps its own job identity: %s", self.uri, error)

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


NEAR_S = 0.02
"""A root whose listing answered within this many seconds of the fastest (or in under twice its
time) counts as near: among near roots the job's own comes first, then the mirrors in the order
configured; the others follow, fastest first. One listing's time tells a root in another region
(tens of milliseconds more, every request) from one close by, not two close ones apart."""


def _nearest_first(
    listed: list[tuple[float, int, set[int]]], preferred: int | None = None
) -> list[tuple[int, set[int]]]:
    """The roots of `listed` (listing time, index, steps) nearest first: `preferred` (the
    `nearest_copy` setting's) when it answered, then as `NEAR_S` says."""
    fastest = min(latency for latency, _index, _steps in listed)
    limit = max(2 * fastest, fastest + NEAR_S)
    ordered = sorted(
        listed,
        key=lambda entry: (
            entry[1] != preferred,
            entry[0] > limit,
            entry[1] if entry[0] <= limit else entry[0],
        ),
    )
    return [(index, steps) for _latency, index, steps in ordered]


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
