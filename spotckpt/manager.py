"""`CheckpointManager`: the public front of checkpointing a training job.

Construction, wiring and the public methods only; each public call is delegated once to a
collaborator built here, which never calls back into the manager:

- saving (`spotckpt.save.Saver`): when to save (`spotckpt.policy.SaveDecisionPolicy`: the
  interval, the ``"auto"`` interval of `spotckpt.interval`, a preemption notice agreed by every
  rank, the fast tier's cadence), where (the fast per-node tier, `spotckpt.tiers`, or the
  bucket), the one save in flight, the commit, goodput events and retention;
- restoring (`spotckpt.restore.RestoreOrder`): which step a restore loads and from where;
- the bucket itself (`spotckpt.catalog.Catalog`), `verify` and `gc`.

How bytes move is the engine's (`spotckpt.engine`); the bucket layout is the catalog's.

One manager per process (per rank). All ranks call `save`, `maybe_save` and `restore` at the
same points; the coordinator (rank 0) alone lists the bucket, reads and validates manifests,
commits and applies retention, and shares its decisions with the other ranks.
"""

from __future__ import annotations

import dataclasses
import logging
import time
import warnings
from collections.abc import Mapping
from typing import Any

from spotckpt.catalog import Catalog
from spotckpt.config import Config, Settings
from spotckpt.deadline import EmergencyEstimate
from spotckpt.distributed import Collective
from spotckpt.engine.checkpointer import Checkpointer
from spotckpt.engine.reader import ReadStats
from spotckpt.errors import CheckpointError, ConfigError, KeyMismatchError
from spotckpt.format.compression import Compression
from spotckpt.format.manifest import Manifest
from spotckpt.format.signing import Keyring, keyring_of
from spotckpt.gc import GcReport, collect_garbage
from spotckpt.ledger import Ledger
from spotckpt.mirroring import follow_mirrors, nearest_copy, open_mirrors
from spotckpt.policy import SaveDecisionPolicy
from spotckpt.preemption import PreemptionWatcher
from spotckpt.redundancy import parse_redundancy
from spotckpt.restore import RestoreOrder, StateLoader
from spotckpt.save import Saver
from spotckpt.state import State
from spotckpt.storage import ObjectStore, open_store
from spotckpt.storage.base import check_portable
from spotckpt.tiers.fast_tier import FastTier
from spotckpt.tracker import GoodputTracker
from spotckpt.verify import VerifyReport, verify_checkpoint

__all__ = ["CheckpointManager", "KeyMismatchError"]

log = logging.getLogger("spotckpt")

_SETTING_NAMES = frozenset(field.name for field in dataclasses.fields(Settings))


class CheckpointManager:
    """Saves and restores training state under one checkpoint root URI.

    The keyword arguments are the fields of `spotckpt.config.Settings` (`keep_last=3`,
    `interval_steps`, `async_save`, `preemption`, `storage_options`, ...), declared and validated
    there once for the manager and `Config` alike; `store` passes an already open store.
    Settings not passed come from ``SPOTCKPT_*`` variables, then ``spotckpt.toml``, then the
    defaults, and `uri` from ``SPOTCKPT_URI`` when None: `spotckpt.config.Config.load`, the one
    rule for every entry point (a keyword passed wins, None included).
    Goodput (`spotckpt.tracker`): `interval_steps="auto"`, events under ``events/``, `metrics`.
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
        self.mirrors = open_mirrors(self.settings, self.store, self.keyring)
        self.collective = Collective(self.settings.collective_timeout_s)
        self.rank = self.collective.rank
        self.world_size = self.collective.world_size
        self.group = self.collective.group
        if self.group is None:  # DCP warns on every single-process call, even in its threads
            warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
        self.watcher = _make_watcher(self.settings)
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
        self.tier = _open_tier(self.settings, self.collective, self.keyring)
        _check_async_mode(self.settings, self.collective, self.tier, self.store)
        self._link = Compression(self.settings.compression)  # each object's encoding
        self._ledger = Ledger(self.goodput, self.store, self.collective)
        self._saver = Saver(
            self.settings,
            self.store,
            self.catalog,
            self.collective,
            self.checkpointer,
            self._ledger,
            tier=self.tier,
            keyring=self.keyring,
            link=self._link,
            watcher=self.watcher,
            policy=SaveDecisionPolicy(
                self.settings.interval_steps,
                fast_interval_steps=None
                if self.tier is None
                else self.settings.local_interval_steps,
                agree_every=self.agree_every,
            ),
            uri=self.uri,
        )
        self._restorer = RestoreOrder(
            self.loader,
            self.store,
            mirrors=self.mirrors,
            nearest=nearest_copy(self.settings, self.store, self.mirrors),
            tier=self.tier,
            keyring=self.keyring,
            events=self.goodput.events,
            uri=self.uri,
        )
        self._mirrors = (
            follow_mirrors(
                self.settings,
                self.store,
                self.mirrors,
                self.keyring,
                self._preempted,
                on_report=lambda report: self.goodput.mirrored(report.to_event()),
            )
            if self.rank == 0 and self.mirrors
            else None
        )
        if self._mirrors is not None:
            self._saver.committer.on_commit(self._mirrors.committed)
        self._closed = False

    def _preempted(self) -> bool:
        return self.watcher is not None and self.watcher.preempted

    @classmethod
    def from_config(cls, config: Config | None = None, **overrides: Any) -> CheckpointManager:
        """Build from a `Config`, every setting of which counts as given; without one, the
        same as ``CheckpointManager(**overrides)`` (kwargs, env, spotckpt.toml, defaults)."""
        if config is None:
            return cls(**overrides)
        return cls(config.uri, **config.manager_kwargs())

    @property
    def interval_steps(self) -> int | None:
        """The `maybe_save` interval: the fixed one, or the current ``"auto"`` choice."""
        return self.goodput.interval_steps

    @property
    def is_coordinator(self) -> bool:
        """Whether this rank commits, lists and applies retention."""
        return self.rank == 0

    # Saving -----------------------------------------------------------------------------------

    def maybe_save(
        self,
        step: int,
        state: State,
        *,
        user_metadata: Mapping[str, Any] | None = None,
    ) -> bool:
        """Save on the interval, or at once (blocking) when a preemption notice arrived.

        With ``interval_steps="auto"`` a save is due once the chosen number of steps passed since
        the last save (see `spotckpt.interval`); the time between calls is the step time. With
        several ranks the preemption flag is agreed on (all-reduced) every `agree_every`
        steps so that all ranks save the same step. Returns True when a save was started.
        The decision: `spotckpt.policy.SaveDecisionPolicy`; the saves: `spotckpt.save.Saver`.
        """
        self._check_open()
        return self._saver.maybe_save(step, state, user_metadata)

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
        self._check_open()
        self._saver.save(step, state, blocking, user_metadata)

    def should_stop(self) -> bool:
        """True on every rank once a preemption save has committed: leave the training loop."""
        return self._saver.stopped

    def wait(self) -> None:
        """Block until an asynchronous save has committed (raising its error if it failed), and
        until its mirror copies are done (at most `mirror_wait_s`; see `spotckpt.mirroring`)."""
        self._saver.wait()
        if self._mirrors is not None:
            self._mirrors.wait(self.settings.mirror_wait_s)

    def emergency_estimate(self) -> EmergencyEstimate:
        """How long an emergency save would take now, and by which route: unpacks as
        ``seconds, route`` (seconds None before the first save); also `window` (the shortest
        notice here: `save_budget_s` or a cloud's) and `fits` (`spotckpt.deadline`). When it
        stops fitting, the manager warns once and records an event; `spotckpt stats` shows it."""
        return self._saver.emergency_estimate()

    @property
    def last_save_seconds(self) -> float | None:
        """How long the last committed save took (an asynchronous one: until its commit)."""
        return self._saver.last_save_seconds

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
        older one that loads, with a warning (the whole rule: `spotckpt.restore.RestoreOrder`).
        `strict=False` allows missing and extra keys.
        """
        self._check_open()
        self._saver.wait()  # a save in flight, not the mirror copies (a restart's catch-up)
        started = time.monotonic()
        restored = self._restorer.restore(state, step, fallback, strict)
        self._ledger.restored(restored, time.monotonic() - started)
        return restored

    def restorable_step(self) -> int | None:
        """The step that `restore` would load, chosen before there is a state to load it into:
        for a framework that fixes its starting step first (the Hugging Face Trainer), which
        then loads it with ``restore(state, step=...)``.

        The bucket's committed steps are checked newest first, every byte against the manifest
        (read once, on the coordinator); a corrupt step is quarantined and the next older one
        checked, with a warning, as `restore` does. The fast tier is not consulted. None when
        no committed step is left.
        """
        self._check_open()
        return self._restorer.restorable_step()

    @property
    def last_read_stats(self) -> ReadStats | None:
        """The job-wide bytes read (and needed) by the last restore's load."""
        return self._restorer.last_read_stats

    @property
    def last_restore_sources(self) -> dict[str, int]:
        """The last restore's job-wide bytes per source: ``local``, ``peer``, ``store``."""
        return self._restorer.last_restore_sources

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
        """Wait for pending uploads (raising their error) and mirror copies (at most
        `mirror_wait_s`), stop the watcher, free resources."""
        if self._closed:
            return
        try:
            self._saver.wait()
        finally:
            self._closed = True
            if self._mirrors is not None:
                self._mirrors.close()  # waits for the copies in flight, `mirror_wait_s` at most
            for mirror in self.mirrors:
                mirror.store.close()
            if self.watcher is not None:
                self.watcher.stop()
            self.checkpointer.close()
            self._saver.close()
            self.store.close()

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _make_watcher(settings: Settings) -> PreemptionWatcher | None:
    """The manager's watcher, or the one passed (`aws_rebalance` configures only its own:
    `Settings` refuses it with any other)."""
    preemption = settings.preemption
    if isinstance(preemption, PreemptionWatcher):
        return preemption
    if not preemption:
        return None
    return PreemptionWatcher(
        signal_budget_s=settings.save_budget_s, aws_rebalance=settings.aws_rebalance
    ).start()


def _open_tier(
    settings: Settings, collective: Collective, keyring: Keyring | None
) -> FastTier | None:
    if settings.local_dir is None:
        if settings.redundancy is not None or settings.local_interval_steps is not None:
            raise ConfigError("redundancy and local_interval_steps need a local_dir")
        return None
    return FastTier(
        settings.local_dir,
        redundancy=parse_redundancy(settings.redundancy),
        keep_last=settings.local_keep_last,
        collective=collective,
        prefix_spread=settings.prefix_spread,
        keyring=keyring,
    )


def _check_async_mode(
    settings: Settings, collective: Collective, tier: FastTier | None, store: ObjectStore
) -> None:
    """``async_mode="process"`` needs a process group and a store that can leave."""
    if settings.async_mode != "process":
        return
    if collective.group is None:
        raise ConfigError(
            'async_mode="process" needs torch.distributed initialised (even for one rank): '
            "DCP's upload process joins a process group of its own"
        )
    if tier is not None:
        raise ConfigError('async_mode="process" does not combine with local_dir')
    check_portable(store)
