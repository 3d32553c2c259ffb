"""The crash explorer's ``overwrite`` operation: DCP's habit of saving twice into one step
(docs/dcp.md, "Saving twice into one step"), a fault at any store call of the second save.

The set-up commits `STEP` with ``spotckpt.dcp_writer(uri, STEP)`` through
``torch.distributed.checkpoint.save`` (one process, no process group) holding `OLD`; the
operation saves it again holding `NEW` with ``overwrite=True``. Both go through the public
`spotckpt.dcp_writer`, whose store is recorded (`recorded_writers`). A recovery checks that the
step is listed, verifies and loads wholly old or wholly new (new once the save returned); that
gc (safety age 0) changes none of it; and that a fault-free retry of the save loads new.
"""

from __future__ import annotations

import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from checker import Expectation, Recovery
from recorder import RecordingStore, SimulatedCrash, Trace
from scenarios import Root, Scenario
from torch.distributed.checkpoint.api import CheckpointException

import spotckpt
import spotckpt.dcp
from spotckpt.catalog import Catalog
from spotckpt.errors import CheckpointError
from spotckpt.gc import collect_garbage
from spotckpt.storage import ObjectStore, open_store
from spotckpt.verify import verify_checkpoint

PREFIX = ""
"""The operation writes the job's root only."""
STEP = 5
OLD, NEW = 1.0, 2.0
FEATURE_SETS: tuple[tuple[str, ...], ...] = ((), ("compressed",))
"""DCP's writer has no signing or incremental saves; compression it has."""


def target(root: Root) -> Root:
    """The root the actor kinds act on: the job's own."""
    return root


def state(value: float) -> dict[str, Any]:
    """A save's state: every value derived from `value`, so a mix of two saves shows."""
    return {
        "w": torch.full((256, 256), value),
        "small": {f"s{i}": torch.full((8,), value + i) for i in range(12)},
        "note": f"v{value}",
    }


@contextmanager
def recorded_writers(trace: Trace) -> Iterator[None]:
    """`spotckpt.dcp_writer` opens its store through a recorder of `trace` meanwhile."""

    def recording(uri: str, **options: Any) -> RecordingStore:
        return RecordingStore(open_store(uri, **options), trace)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(spotckpt.dcp, "open_store", recording)
        yield


def _save(scenario: Scenario, uri: str, value: float, overwrite: bool) -> None:
    """DCP's save of `state(value)` into `STEP`; a failure raises spotckpt's own error (or the
    simulated crash) out of DCP's CheckpointException, anything else as it is."""
    compression = "on" if "compressed" in scenario.features else "off"
    writer = spotckpt.dcp_writer(uri, STEP, overwrite=overwrite, compression=compression)
    try:
        dcp.save(state(value), storage_writer=writer, no_dist=True)
    except CheckpointException as error:
        causes = [f[0] if isinstance(f, tuple) else f for f in error.failures.values()]
        for cause in causes:
            if isinstance(cause, SimulatedCrash | CheckpointError):
                raise cause from error
        raise


def setup(scenario: Scenario, root: Root, store: RecordingStore, trace: Trace) -> None:
    """Commit `STEP` holding `OLD`, create-only."""
    with recorded_writers(trace):
        _save(scenario, root.uri, OLD, overwrite=False)
    trace.mark("committed", STEP)


def operate(scenario: Scenario, root: Root, store: RecordingStore, trace: Trace) -> None:
    """Save `STEP` again holding `NEW`, overwriting."""
    trace.mark("saving", STEP)
    with recorded_writers(trace):
        _save(scenario, root.uri, NEW, overwrite=True)
    trace.mark("resaved", STEP)


def expectation(scenario: Scenario, trace: Trace, seq: int) -> Expectation:
    """`STEP` committed; in flight (old or new) until the re-save returned, new after
    (``committed`` twice)."""
    resaved = trace.marked("resaved", seq)
    in_flight = set(trace.marked("saving", seq)) - set(resaved)
    return Expectation([STEP, *resaved], in_flight)


def recover(scenario: Scenario, root: Root, expect: Expectation) -> Recovery:
    """Check the step as the fault left it, after gc, and after a fault-free retry."""
    seen = Recovery()
    allowed = {NEW} if expect.committed.count(STEP) > 1 else {OLD, NEW}
    try:
        with root.opened() as store:
            value = _check_step(store, root.uri, allowed, expect, seen, "left by the fault")
            collect_garbage(store, safety_age_s=0)
            again = _check_step(store, root.uri, allowed, expect, seen, "after gc")
            if value is not None and again is not None and again != value:
                seen.fail(f"gc changed step {STEP} from {value} to {again}")
        _save(scenario, root.uri, NEW, overwrite=True)
        with root.opened() as store:
            retried = Expectation([STEP], damaged=expect.damaged - {STEP})  # the new is whole
            _check_step(store, root.uri, {NEW}, retried, seen, "after a retry")
    except CheckpointError as error:
        seen.fail(f"overwrite recovery failed: {type(error).__name__}: {error}")
    except Exception as error:
        seen.fail(
            "raw exception in overwrite recovery: " + "".join(traceback.format_exception(error))
        )
    seen.restored = STEP if not seen.violations else None
    return seen


def _check_step(
    store: ObjectStore,
    uri: str,
    allowed: set[float],
    expect: Expectation,
    seen: Recovery,
    when: str,
) -> float | None:
    """`STEP` listed (and nothing else but what the fault forged), verifying, loading wholly
    as one of `allowed`; the value loaded (None when the fault damaged it)."""
    listed = Catalog(store).steps()
    if [s for s in listed if s == STEP or s not in expect.damaged] != [STEP]:
        seen.fail(f"{when}: the steps listed are {listed}, not [{STEP}]")
        return None
    damaged = STEP in expect.damaged
    report = verify_checkpoint(store, STEP)
    if not report.ok and not damaged:
        problems = "; ".join(str(p) for p in report.problems[:3])
        seen.fail(f"{when}: step {STEP} does not verify: {problems}")
        return None
    loaded = state(0.0)
    try:
        dcp.load(loaded, storage_reader=spotckpt.dcp_reader(uri, STEP), no_dist=True)
    except (CheckpointException, CheckpointError) as error:
        if not damaged:
            seen.fail(f"{when}: step {STEP} does not load: {error}"[:2000])
        return None
    value = _value(loaded)
    if value not in allowed:
        what = "a mix of two saves" if value is None else f"holding {value}"
        seen.fail(f"{when}: step {STEP} loads {what}, not one of {sorted(allowed)}")
    return value


def _value(loaded: dict[str, Any]) -> float | None:
    """The one value a loaded state holds; None for a mix of two saves."""
    value = float(loaded["w"][0, 0])
    whole = state(value)
    same = torch.equal(loaded["w"], whole["w"]) and loaded["note"] == whole["note"]
    small = loaded["small"]
    same = same and all(torch.equal(small[k], t) for k, t in whole["small"].items())
    return value if same else None
