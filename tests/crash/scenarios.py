"""The crash explorer's scenarios: what a job (or an operator) does to a checkpoint root, with
spotckpt's features switched on as the seam matrix switches them (`seam_cells.FEATURES`,
`seam_run.settings`, the same states `seam_run.state`).

A scenario runs on one rank in this process against a `RecordingStore`: its set-up is recorded
but not explored (`Trace.start_exploring`), then its operation is. The scenario marks what it
was told: ``saving`` before it asks for a step, ``committed`` once a bucket save returned (after
``wait()`` for asynchronous ones), ``tier`` once a fast-tier-only save returned. Errors the
operation meets are kept (spotckpt's own are expected under faults; any other is a violation).

The operations of `OWN_OPS` bring their set-up, expectation and recovery in a module of their
own (`own`): ``mirror`` (`mirror_op`: steps copied to a second root) and ``overwrite``
(`overwrite_op`: DCP saving twice into one step).
"""

from __future__ import annotations

import importlib
import itertools
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import seam_run
from recorder import Fault, RecordingStore, SimulatedCrash, TierRecorder, Trace
from seam_cells import Cell

from spotckpt import CheckpointManager
from spotckpt.errors import CheckpointError
from spotckpt.gc import collect_garbage
from spotckpt.layout import manifest_key
from spotckpt.storage import ObjectStore, open_store
from spotckpt.verify import verify_checkpoint

OPS = ("saves", "restore", "gc", "verify", "two_jobs")
OWN_OPS = {"mirror": "mirror_op", "overwrite": "overwrite_op"}
"""Operations with their own set-up, expectation and recovery: the module of each (`own`)."""
FEATURES = ("incremental", "signed", "compressed", "indexed", "fast_tier", "thread_async")
"""The seam matrix's features (`seam_cells.FEATURES`) that run in this process; process-mode
async and several nodes run in the killed-process sample."""
KEEP_LAST = 2
SETUP_STEPS = {
    "saves": (1,),
    "restore": (1, 2, 3),
    "gc": (1, 2, 3),
    "verify": (1, 2, 3),
    "two_jobs": (1,),
}
UPLOAD_LOG = "upload-calls.jsonl"
"""In a root's folder: the calls of the store's copy in DCP's upload process (`upload_process`)."""
SAVED_STEPS = (2, 3, 4)
"""The steps the ``saves`` operation saves (the fast tier saves 3 to itself only)."""


@dataclass(frozen=True)
class Scenario:
    """A set of features, an operation, and the store back end."""

    features: tuple[str, ...]
    op: str
    backend: str = "local"

    @property
    def id(self) -> str:
        return f"{self.op}-{'+'.join(self.features) or 'plain'}-{self.backend}"

    @property
    def cell(self) -> Cell:
        """The seam matrix's cell with the same features (its settings and keys)."""
        on = set(self.features)
        return Cell(
            incremental="incremental" in on,
            signed="signed" in on,
            compressed="compressed" in on,
            indexed="indexed" in on,
            fast_tier="fast_tier" in on,
            process_async=False,
            op="save",
            fault="none",
        )

    @property
    def tier(self) -> bool:
        return "fast_tier" in self.features

    @classmethod
    def parse(cls, text: str) -> Scenario:
        """The scenario named by its `id`."""
        op, features, backend = text.split("-")
        return cls(tuple(() if features == "plain" else features.split("+")), op, backend)


def scenarios(backends: tuple[str, ...] = ("local",)) -> list[Scenario]:
    """On the local folder: every operation with no feature, each feature alone, and the pairs
    that met at a seam before (incremental with signing, compression, the tier and async;
    signing with the tier); two jobs on one root with a few of them. On a server: the
    sets whose requests differ most (`CLOUD_SETS`), saving, restoring and collecting. The
    `OWN_OPS` on the local folder, with the feature sets of their modules."""
    sets: list[tuple[str, ...]] = [(), *((f,) for f in FEATURES), *PAIRS]
    found = []
    for backend in backends:
        local = backend == "local"
        for features, op in itertools.product(sets if local else CLOUD_SETS, OPS):
            if not local and op not in CLOUD_OPS:
                continue
            if op == "two_jobs" and features not in TWO_JOB_SETS:
                continue
            found.append(Scenario(features, op, backend))
        if local:
            for op, module in OWN_OPS.items():
                found += [
                    Scenario(features, op, backend)
                    for features in importlib.import_module(module).FEATURE_SETS
                ]
    return [s for s in found if not (s.tier and s.op in ("gc", "verify", "two_jobs"))]


PAIRS: tuple[tuple[str, ...], ...] = (
    ("incremental", "signed"),
    ("incremental", "compressed"),
    ("incremental", "fast_tier"),
    ("incremental", "thread_async"),
    ("signed", "fast_tier"),
    ("indexed", "signed"),
    ("compressed", "thread_async"),
)
TWO_JOB_SETS: tuple[tuple[str, ...], ...] = (
    (),
    ("incremental",),
    ("incremental", "signed"),
    ("thread_async",),
)
CLOUD_SETS: tuple[tuple[str, ...], ...] = ((), ("incremental", "signed"), ("compressed",))
CLOUD_OPS = ("saves", "restore", "gc")


@dataclass
class Root:
    """Where a run writes: the bucket's URI, the fast tier's folder, the signing key."""

    uri: str
    folder: Path
    key: Path
    """The job's signing key (one per exploration: a rebuilt root is read with it)."""
    storage_options: dict[str, Any] = field(default_factory=dict)

    @property
    def paths(self) -> dict[str, str]:
        return {"bucket": self.uri, "fast": str(self.folder / "fast"), "key": str(self.key)}

    def open(self) -> ObjectStore:
        return open_store(self.uri, **self.storage_options)

    @contextmanager
    def opened(self) -> Iterator[ObjectStore]:
        """A store of the root, closed afterwards (a cloud store holds threads)."""
        store = self.open()
        try:
            yield store
        finally:
            store.close()


def settings(scenario: Scenario, root: Root, keep_last: int | None = KEEP_LAST) -> dict[str, Any]:
    """The manager settings of the scenario's features (the seam matrix's), and its own."""
    chosen = seam_run.settings(scenario.cell, root.paths, keep_last)
    if scenario.tier:
        chosen.update(interval_steps=2, local_interval_steps=1, local_keep_last=2)
    if "thread_async" in scenario.features:
        chosen["async_save"] = True
    if "process_async" in scenario.features:
        chosen.update(async_save=True, async_mode="process")
    if root.storage_options:
        chosen["storage_options"] = root.storage_options
    return chosen


@contextmanager
def features_on(scenario: Scenario) -> Iterator[None]:
    """Switch on what has no setting (index parts at one rank) while the scenario runs."""
    with pytest.MonkeyPatch.context() as patch:
        if "indexed" in scenario.features:
            import spotckpt.engine.writer

            patch.setattr(spotckpt.engine.writer, "INDEX_MIN_RANKS", 1)
        yield


@dataclass
class Outcome:
    """What a run saw: the error that stopped it (spotckpt's own, or raw), if any."""

    error: str | None = None
    raw: bool = False


def run(scenario: Scenario, root: Root, trace: Trace) -> Outcome:
    """Run `scenario` on `root` with every store call recorded in `trace` (and its fault)."""
    (root.folder / "fast").mkdir(parents=True, exist_ok=True)
    outcome = Outcome()
    with features_on(scenario), pytest.MonkeyPatch.context() as patch:
        TierRecorder(trace).install(patch)
        store = RecordingStore(root.open(), trace)
        if "process_async" in scenario.features:  # its copy in DCP's upload process records
            store.child_log = root.folder / UPLOAD_LOG
        try:
            module = own(scenario.op)
            (_setup if module is None else module.setup)(scenario, root, store, trace)
            trace.start_exploring()
            (OPERATIONS[scenario.op] if module is None else module.operate)(
                scenario, root, store, trace
            )
            store.close()
        except SimulatedCrash:
            pass  # the process died at its fault: what it left is for the recovery to judge
        except CheckpointError as error:
            outcome.error = f"{type(error).__name__}: {error}"
        except Exception as error:
            outcome.raw = not trace.dead
            outcome.error = "".join(traceback.format_exception(error))[-3000:]
    return outcome


def own(op: str) -> ModuleType | None:
    """The module of an `OWN_OPS` operation (its ``setup``, ``operate``, ``expectation``,
    ``recover``, ``target`` root and trace key ``PREFIX``); None for the others."""
    return importlib.import_module(OWN_OPS[op]) if op in OWN_OPS else None


def _close(manager: CheckpointManager, trace: Trace) -> None:
    """Close as the process would; a dead one only releases its threads (its calls fail)."""
    try:
        manager.close()
    except (SimulatedCrash, CheckpointError):
        if not trace.dead:
            raise


def _manager(
    scenario: Scenario, root: Root, store: RecordingStore, **extra: Any
) -> CheckpointManager:
    """A manager on a store of its own (a manager closes its store), recorded in the same
    trace as `store`."""
    own = RecordingStore(
        root.open(),
        store.trace,
        store.rank,
        child_log=store.child_log,
        child_fault=store.child_fault,
    )
    return CheckpointManager(root.uri, store=own, **{**settings(scenario, root), **extra})


def _setup(scenario: Scenario, root: Root, store: RecordingStore, trace: Trace) -> None:
    manager = _manager(scenario, root, store)
    for step in SETUP_STEPS[scenario.op]:
        manager.save(step, seam_run.state(step))
        manager.wait()
        trace.mark("committed", step)
    _close(manager, trace)
    if scenario.op == "gc":  # leftovers of a save that died before its manifest
        dying = Trace()
        dead = RecordingStore(root.open(), dying)
        dying.fault = _manifest_crash(4)
        leftover = _manager(scenario, root, dead)
        try:
            leftover.save(4, seam_run.state(4))
            leftover.wait()
        except (SimulatedCrash, CheckpointError):
            if not dying.dead:  # it failed before its manifest: the set-up is not what it says
                raise
        _close(leftover, dying)
        dead.inner.close()


def _manifest_crash(step: int) -> Fault:
    """A crash right before the manifest of `step` is written (its objects are all there)."""
    return Fault(point=f"0:put:{manifest_key(step)}#0", kind="crash")


def _saves(scenario: Scenario, root: Root, store: RecordingStore, trace: Trace) -> None:
    """A job's saves with retention (with the fast tier: every other step to the bucket)."""
    manager = _manager(scenario, root, store)
    try:
        for step in SAVED_STEPS:
            trace.mark("saving", step)
            if scenario.tier:
                manager.maybe_save(step, seam_run.state(step))
            else:
                manager.save(step, seam_run.state(step))
            manager.wait()
            bucket = not scenario.tier or step % 2 == 0
            trace.mark("committed" if bucket else "tier", step)
    finally:
        _close(manager, trace)


def _two_jobs(scenario: Scenario, root: Root, store: RecordingStore, trace: Trace) -> None:
    """Two managers on one root take turns, each with retention."""
    first, second = _manager(scenario, root, store), _manager(scenario, root, store)
    try:
        for step, manager in zip((*SAVED_STEPS, 5), (first, second) * 2, strict=True):
            trace.mark("saving", step)
            manager.save(step, seam_run.state(step))
            manager.wait()
            trace.mark("committed", step)
    finally:
        _close(first, trace)
        _close(second, trace)


def _restore(scenario: Scenario, root: Root, store: RecordingStore, trace: Trace) -> None:
    with _manager(scenario, root, store) as manager:
        manager.restore(seam_run.blank())


def _gc(scenario: Scenario, root: Root, store: RecordingStore, trace: Trace) -> None:
    keys = seam_run.keyring(scenario.cell, root.paths)
    collect_garbage(store, keep_last=KEEP_LAST, safety_age_s=0, keyring=keys)


def _verify(scenario: Scenario, root: Root, store: RecordingStore, trace: Trace) -> None:
    keys = seam_run.keyring(scenario.cell, root.paths)
    for step in (2, 3):
        verify_checkpoint(store, step, keyring=keys)


OPERATIONS: dict[str, Callable[[Scenario, Root, RecordingStore, Trace], None]] = {
    "saves": _saves,
    "restore": _restore,
    "gc": _gc,
    "verify": _verify,
    "two_jobs": _two_jobs,
}
"""The explored operation of each op (its calls are the points; the set-up's are not)."""
