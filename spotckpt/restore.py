"""`StateLoader`: one committed checkpoint loaded into a training state, on every rank.

What a restore does once the step and its source are chosen (`CheckpointManager` chooses them):
the manifest, only the parts of an indexed one that locate this rank's shards; the load through
the engine, with the key rules of a training state (loader keys older checkpoints lack are
optional, other ranks' per-rank state may stay unread) and each rank's per-rank state read from
its own keys (`spotckpt.state.TrainState.restoring`); the decoded values written back into a
plain dict; and the job-wide bytes read.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import time
from collections.abc import Iterable, Mapping
from typing import Any

from spotckpt.catalog import Catalog
from spotckpt.distributed import Collective
from spotckpt.engine.checkpointer import Checkpointer
from spotckpt.engine.packing import Run
from spotckpt.engine.planners import CheckedLoadPlanner, local_plan, plain_state, wanted_boxes
from spotckpt.engine.reader import ObjectStoreReader, ReadStats
from spotckpt.errors import CheckpointError
from spotckpt.format.index import Box, Root
from spotckpt.format.manifest import Manifest
from spotckpt.progress import ProgressLog
from spotckpt.state import (
    TrainState,
    as_dcp_state,
    is_added_loader_key,
    is_per_rank_key,
    write_back,
)
from spotckpt.storage import ObjectStore
from spotckpt.units import human_size

log = logging.getLogger("spotckpt")

State = TrainState | Mapping[str, Any]
"""What a manager saves and restores: a `TrainState`, or a plain dict of state."""


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
