"""The crash explorer in DCP's upload process (``async_mode="process"``): a `RecordingStore` with a
child log pickles (`RecordingStore.__reduce__`) as `upload_recorder`, the store's copy in the
upload process, which names its calls as `Trace` does but with the rank written ``0u``, appends
each name (and each completed mutation's key and kind) to the log as a JSON line, and applies the
fault that travelled with it: ``kill`` (SIGKILL), ``crash`` (exit right before the call), ``lost``
(exit right after a mutating call took effect), ``transient`` or ``denied`` (the call fails, as
`Trace._apply` makes it).

A process-async scenario runs in this process, one rank in a gloo group of its own
(`process_group`); DCP starts the upload process once and keeps it, and spotckpt starts a new one
after it died. `upload_points` lists the upload process's points of a fault-free run;
`explore_upload_point` replays the scenario with the fault there, and the root it leaves is
recovered and checked as `explore` checks the in-process kinds.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
for folder in (HERE, HERE.parent, HERE.parent / "seams", HERE.parents[1]):
    if str(folder) not in sys.path:
        sys.path.insert(0, str(folder))

import pytest  # noqa: E402
import scenarios  # noqa: E402
from explore import Verdict, Workspace, expectation, recover  # noqa: E402
from recorder import MUTATING, Call, Fault, RecordingStore, Trace  # noqa: E402
from scenarios import UPLOAD_LOG, Root, Scenario  # noqa: E402

from spotckpt.storage import ObjectStore  # noqa: E402

UPLOAD = "u"
"""Written after the rank in the names of the upload process's calls: ``0u:commit:...#0``."""
KINDS = ("kill", "crash", "lost", "transient", "denied")
EXIT_CODE = 70
"""How the upload process ends at a ``crash`` or ``lost`` fault."""
SCENARIOS = (
    Scenario(("process_async",), "saves"),
    Scenario(("incremental", "process_async"), "saves"),
    Scenario(("signed", "process_async"), "saves"),
    Scenario(("compressed", "process_async"), "saves"),
)
"""Process-async scenarios (not in `scenarios.FEATURES`: the in-process explorer rebuilds states
from the job's own trace, which lacks the upload process's writes). The fast tier refuses
process mode; ``restore``, ``gc`` and ``verify`` make no call in the upload process."""


# In the upload process ------------------------------------------------------------------------


def upload_name(call: Call) -> str:
    """A call of the upload process as the explorer names it (the rank with `UPLOAD`)."""
    return f"{call.rank}{UPLOAD}:{call.op}:{call.key}#{call.nth}"


def _as_traced(point: str) -> str:
    """`point` (an upload process's name) as its `UploadTrace` names the call internally."""
    rank, rest = point.split(":", 1)
    return f"{rank.removesuffix(UPLOAD)}:{rest}"


class UploadTrace(Trace):
    """The upload process's trace: names its calls as the job's trace would, writes each to
    `log` the moment it starts, and applies its fault by ending or failing this process."""

    def __init__(self, log: Path, fault: tuple[str, str] | None) -> None:
        super().__init__(None if fault is None else Fault(_as_traced(fault[0]), fault[1]))
        self._out = log.open("a", encoding="utf-8")
        self._writing = threading.Lock()

    def _write(self, line: dict[str, Any]) -> None:
        with self._writing:
            self._out.write(json.dumps(line) + "\n")
            self._out.flush()

    def _faulted(self, call: Call) -> bool:
        return self.fault is not None and self.fault.point == call.name

    def begin(self, rank: int, op: str, key: str) -> Call:
        call = super().begin(rank, op, key)
        if not self._faulted(call):  # the faulted one was written by `_apply`
            self._write({"call": upload_name(call)})
        return call

    def _apply(self, fault: Fault, call: Call) -> None:
        self._write({"call": upload_name(call), "fault": fault.kind})
        if fault.kind == "crash":
            os._exit(EXIT_CODE)
        super()._apply(fault, call)  # kill: SIGKILL; transient, denied: raise

    def end(self, call: Call, key: str, data: bytes | None) -> None:
        self._write({"done": upload_name(call), "key": key, "write": data is not None})
        if self._faulted(call) and self.fault is not None and self.fault.kind == "lost":
            os._exit(EXIT_CODE)


_TRACES: dict[str, UploadTrace] = {}
"""One trace per log in this process: every save's copy of the store names calls in order."""
_TRACES_LOCK = threading.Lock()


def upload_recorder(
    inner: ObjectStore, rank: int, log: str, fault: tuple[str, str] | None
) -> RecordingStore:
    """What a `RecordingStore` with a child log becomes where it is unpickled."""
    with _TRACES_LOCK:
        trace = _TRACES.get(log)
        if trace is None:
            trace = _TRACES[log] = UploadTrace(Path(log), fault)
    return RecordingStore(inner, trace, rank)


# In the job's process -------------------------------------------------------------------------


class _ExploringTrace(Trace):
    """The job's trace, which also writes into the upload log where the operation starts."""

    def __init__(self, fault: Fault | None, log: Path) -> None:
        super().__init__(fault)
        self.log = log

    def start_exploring(self) -> None:
        super().start_exploring()  # the set-up's saves were waited for: no upload is running
        with self.log.open("a", encoding="utf-8") as out:
            out.write(json.dumps({"exploring": True}) + "\n")


def read_log(log: Path) -> tuple[list[str], list[str], str | None]:
    """The upload process's calls before and after the operation started, and the point a
    fault was applied at (None: never)."""
    setup: list[str] = []
    points: list[str] = []
    faulted = None
    current = setup
    if not log.exists():
        return setup, points, faulted
    for line in log.read_text(encoding="utf-8").splitlines():
        entry = json.loads(line)
        if "exploring" in entry:
            current = points
        elif "call" in entry:
            current.append(entry["call"])
            if "fault" in entry:
                faulted = entry["call"]
    return setup, points, faulted


@contextmanager
def process_group() -> Iterator[None]:
    """A one-rank gloo group for process mode (unless one exists); at the end, DCP's upload
    process is stopped and the group destroyed."""
    import torch.distributed as dist

    from spotckpt.engine.checkpointer import _retire_upload_process

    if dist.is_initialized():
        yield
        return
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("MASTER_ADDR", "127.0.0.1")  # where DCP's upload process meets itself
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
        try:
            yield
        finally:
            _retire_upload_process()
            dist.destroy_process_group()


@dataclass
class Replayed:
    """One run of a process-async scenario: the job's trace, the upload log, what it saw."""

    scenario: Scenario
    trace: Trace
    root: Root
    outcome: scenarios.Outcome

    @property
    def log(self) -> Path:
        return self.root.folder / UPLOAD_LOG


def run_with(scenario: Scenario, fault: Fault | None, space: Workspace) -> Replayed:
    """Run `scenario` on a fresh root with `fault` (an upload process's point) travelling with
    the store into the upload process."""
    if "process_async" not in scenario.features:
        raise ValueError(f"{scenario.id} does not save from an upload process")
    root = space.fresh(scenario)
    trace = _ExploringTrace(None, root.folder / UPLOAD_LOG)

    def store(inner: ObjectStore, trace: Trace, *args: Any, **kwargs: Any) -> RecordingStore:
        return RecordingStore(inner, trace, *args, **{**kwargs, "child_fault": fault})

    with process_group(), pytest.MonkeyPatch.context() as patch:
        patch.setattr(scenarios, "RecordingStore", store)
        outcome = scenarios.run(scenario, root, trace)
    return Replayed(scenario, trace, root, outcome)


def upload_points(scenario: Scenario, space: Workspace) -> list[str]:
    """The calls the upload process made during the scenario's operation (fault-free run)."""
    done = run_with(scenario, None, space)
    if done.outcome.error:
        raise RuntimeError(f"{scenario.id} fails without a fault: {done.outcome.error}")
    _, points, _ = read_log(done.log)
    space.discard(done.root)
    return points


def explore_upload_point(
    scenario: Scenario | Replayed, point: str, kind: str, space: Workspace
) -> Verdict:
    """Replay the scenario with a fault of `kind` at the upload process's `point`; the job must
    get a spotckpt error (never a raw one), and the root it leaves keep every invariant."""
    if kind not in KINDS:
        raise ValueError(f"{kind!r} is not one of {KINDS}")
    if kind == "lost" and point.split(":")[1] not in MUTATING:
        raise ValueError(f"{point} changes nothing: lost there is a crash at the next call")
    chosen = scenario.scenario if isinstance(scenario, Replayed) else scenario
    with process_group():
        done = run_with(chosen, Fault(point, kind), space)
        _, _, faulted = read_log(done.log)
        violations = []
        if done.outcome.raw:
            violations.append(f"a raw exception reached the job: {done.outcome.error}")
        if faulted != point:  # a call made a varying number of times: not explored
            space.discard(done.root)
            return Verdict(chosen.id, point, kind, [], None, reached=False)
        expect = expectation(chosen, done.trace, len(done.trace.calls))
        seen = recover(chosen, done.root, expect)
    space.discard(done.root)
    return Verdict(chosen.id, point, kind, violations + seen.violations, seen.restored)


if __name__ == "__main__":  # ``upload_process.py SCENARIO POINT KIND``: one point's verdict
    import tempfile

    logging.getLogger("spotckpt").setLevel(logging.CRITICAL)  # faults make it warn on purpose
    with tempfile.TemporaryDirectory(prefix="spotckpt-upload-") as folder:
        verdict = explore_upload_point(
            Scenario.parse(sys.argv[1]), sys.argv[2], sys.argv[3], Workspace.create(Path(folder))
        )
    print(json.dumps(verdict.__dict__))
    sys.exit(1 if verdict.violations else 0)
