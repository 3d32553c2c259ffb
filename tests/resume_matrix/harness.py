"""The resume matrix: for each stack x loader set-up x preemption point, a reference run and a
preempted-then-resumed run, compared step by step (every loss bit for bit), then the final model
and optimizer state, and at every restore the restored state against what the saving run had.

    python -m tests.resume_matrix.harness --sample            # the seeded sample `make test` runs
    python -m tests.resume_matrix.harness --all               # everything (`make test-all`)
    python tests/resume_matrix/harness.py --all --stack ddp --case ddp-stateful-w0-eval-sigterm

It prints one line per case: configuration, exit codes, where it paused and restored, and the
first differing step (or ``exact``).

Worker contract (every ``stacks/<name>.py``; files starting with ``_`` are helpers, not stacks):

- ``python stacks/<name>.py --describe`` prints one JSON object without importing torch:
  ``{"ranks": [1] or [2], "loaders": [...], "points": [...], "world_change": bool}``, and may
  add ``"steps"`` (a case's total steps, default 20), ``"save_every"`` (default 4) and
  ``"run_s"`` (a rough time per run, for the sample's budget). Multi-rank stacks are launched
  here with ``spotckpt launch`` (when ``spotckpt launch --help`` works) or torchrun.
- Otherwise it reads ``MATRIX_CASE`` (JSON: ``uri``, ``out``, ``steps``, ``save_every``,
  ``loader``, ``workers``, ``pause``, ``seed``, ``async_save``), trains, and writes into ``out``:
  ``losses-rank{r}.jsonl`` (a line per completed step: ``step``, ``loss`` as ``float.hex``,
  ``epoch``, optionally ``eval``), ``restored-rank{r}-{pid}.json`` after its restore (``step``
  or null, and ``state``: a sha256 per state entry), ``final-rank{r}.json`` at a clean finish,
  and, optionally, ``saved-rank{r}-step{s}-{pid}.json`` (same form as restored) after each save,
  which lets the harness check each restore against what was saved. State entry names beginning
  with ``rng``, ``loader`` or ``extra`` are per-rank; the rest (``model/...``, ``optim/...``,
  ``scheduler``) are the same on every rank.
- ``pause`` is null or ``{"kind": ..., "at": K}``; K is always a step number and the worker
  pauses at the first such point at step K or later, once, and only when it did not restore a
  step at or past K: ``step`` (after step K, before its ``maybe_save``: the emergency save is of
  step K), ``epoch_end`` (the same; K is the last step of an epoch, picked from the reference
  run's ``epoch`` fields), ``eval`` (inside the first evaluation pass at step >= K), ``async``
  (right after the first asynchronous save started at step >= K). To pause it writes
  ``out/paused-rank{r}`` (JSON ``{"step": s, "pid": ...}``, or empty) and waits until its
  preemption flag is set (at most 300 s); then it goes on and its next ``maybe_save`` saves.
- It exits 0 after a clean finish and 75 after a preemption save.

Reference runs are cached per (stack, loader, workers, steps, ranks) within a session.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
STACKS = HERE / "stacks"
REPO = HERE.parents[1]

POINTS = (
    "mid-epoch",
    "epoch-boundary",
    "later-epoch",
    "async",
    "eval",
    "before-first-save",
    "twice",
    "finish-then-more",
)
# (workers, signal) pairs, rotated over points and loaders so that each loader meets every pair
# and each point meets several: a covering, not the cross product.
COMBOS = ((0, "sigterm"), (2, "sigkill"), (2, "sigterm"), (0, "sigkill"))
WORLD_CHANGE_LOADERS = ("resumable", "stateful", "distributed")
REFUSED = "shuffle-plain"
PER_RANK = ("rng", "loader", "extra")
SIGNALS = {"sigterm": signal.SIGTERM, "sigkill": signal.SIGKILL}
PREEMPTED = 75
TORCHRUN_SIGTERM_EXIT = 1  # torchrun exits 1 on SIGTERM whatever its workers returned
TRAIN_SEED = 7
DEFAULT_STEPS = 20
DEFAULT_SAVE_EVERY = 4
DESCRIBE_TIMEOUT_S = 60
PAUSE_TIMEOUT_S = 300
EXIT_TIMEOUT_S = 120  # after the signal
EXIT_GRACE_S = 20  # after the final state was written
RUN_TIMEOUT_S = 400
POLL_S = 0.05
HUNG = "hung at exit"
SAMPLE_BUDGET_S = 180.0
# The refusal a plain shuffled DataLoader must meet at TrainState construction.
REFUSAL = re.compile(r"Error: .*DataLoader.*(ResumableSampler|StatefulDataLoader)")


# Stacks ----------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Stack:
    """One worker script and what its ``--describe`` said."""

    name: str
    path: Path
    ranks: tuple[int, ...] = (1,)
    loaders: tuple[str, ...] = ()
    points: tuple[str, ...] = ()
    world_change: bool = False
    one_rank_loaders: tuple[str, ...] = ()  # set-ups the stack runs on one rank only
    steps: int = DEFAULT_STEPS
    save_every: int = DEFAULT_SAVE_EVERY
    run_s: float | None = None
    error: str | None = None


def discover(names: Iterable[str] | None = None) -> dict[str, Stack]:
    """Every ``stacks/*.py`` (or those named), described; a stack that cannot say is kept with
    its error, so that it fails as a case instead of disappearing."""
    wanted = set(names) if names else None
    stacks: dict[str, Stack] = {}
    for path in sorted(STACKS.glob("*.py")):
        name = path.stem
        if name.startswith("_") or (wanted is not None and name not in wanted):
            continue
        stacks[name] = describe(name, path)
    return stacks


def describe(name: str, path: Path) -> Stack:
    """Run ``--describe`` (which must not import torch) and parse its answer."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    try:
        done = subprocess.run(
            [sys.executable, str(path), "--describe"],
            capture_output=True,
            text=True,
            timeout=DESCRIBE_TIMEOUT_S,
            env=env,
            cwd=REPO,
        )
    except subprocess.TimeoutExpired:
        return Stack(name, path, error=f"--describe did not answer in {DESCRIBE_TIMEOUT_S} s")
    if done.returncode != 0:
        return Stack(name, path, error=f"--describe exited {done.returncode}: {tail(done.stderr)}")
    try:
        info = json.loads(done.stdout.strip().splitlines()[-1])
        return Stack(
            name,
            path,
            ranks=tuple(int(r) for r in info["ranks"]),
            loaders=tuple(str(x) for x in info["loaders"]),
            points=tuple(str(x) for x in info.get("points", POINTS)),
            world_change=bool(info.get("world_change", False)),
            one_rank_loaders=tuple(str(x) for x in info.get("one_rank_loaders", ())),
            steps=int(info.get("steps", DEFAULT_STEPS)),
            save_every=int(info.get("save_every", DEFAULT_SAVE_EVERY)),
            run_s=float(info["run_s"]) if info.get("run_s") is not None else None,
        )
    except (ValueError, KeyError, IndexError, TypeError) as error:
        return Stack(name, path, error=f"--describe answered {done.stdout[-300:]!r}: {error!r}")


# The matrix ------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Case:
    """One configuration: a stack, a loader set-up, a preemption point and a signal."""

    stack: str
    loader: str
    workers: int
    point: str
    signal: str  # "sigterm", "sigkill" or "none"
    world: int
    world_to: int | None = None  # the restart's rank count, for "world-change"

    @property
    def id(self) -> str:
        parts = [self.stack, self.loader, f"w{self.workers}", self.point]
        if self.world_to is not None:
            parts.append(f"{self.world}to{self.world_to}")
        if self.signal != "none":
            parts.append(self.signal)
        return "-".join(parts)


def matrix(stacks: dict[str, Stack]) -> list[Case]:
    """The full matrix: stack x loader x point. Workers (0/2) and signal (SIGTERM/SIGKILL) are
    rotated over the points, shifted per loader, so that each loader meets all four pairs and each
    point several (a covering, not the cross product); a stack with several rank counts runs each
    pair on each of them in turn. Then the refusal cases and the rank-count changes."""
    cases: list[Case] = []
    for stack in stacks.values():
        ranks = stack.ranks or (1,)
        if stack.error is not None:
            cases.append(Case(stack.name, "describe", 0, "describe", "none", max(ranks)))
            continue
        loaders = [name for name in stack.loaders if name != REFUSED]
        points = [point for point in POINTS if point in stack.points]
        for li, loader in enumerate(loaders):
            for pi, point in enumerate(points):
                workers, sig = COMBOS[(li + pi) % len(COMBOS)]
                world = ranks[((li + pi) // 2) % len(ranks)] if len(ranks) > 1 else ranks[0]
                if loader in stack.one_rank_loaders:
                    world = 1
                if point == "finish-then-more":
                    sig = "none"
                cases.append(Case(stack.name, loader, workers, point, sig, world))
        if REFUSED in stack.loaders:
            for workers in (0, 2):
                cases.append(Case(stack.name, REFUSED, workers, "refused", "none", max(ranks)))
        if stack.world_change:
            chosen = [name for name in WORLD_CHANGE_LOADERS if name in loaders] or loaders[:1]
            for li, loader in enumerate(chosen):
                for di, (a, b) in enumerate(((2, 1), (1, 2))):
                    workers = (0, 2)[(li + di) % 2]
                    cases.append(Case(stack.name, loader, workers, "world-change", "sigterm", a, b))
    return cases


def runs_of(case: Case) -> int:
    """How many worker runs a case takes, its reference not counted."""
    return {REFUSED: 1, "refused": 1, "describe": 0, "twice": 3}.get(case.point, 2)


def estimate(case: Case, stack: Stack) -> float:
    """Rough seconds per run on a loaded 2-core machine."""
    if stack.run_s is not None:
        return stack.run_s
    return 7.0 if max(case.world, case.world_to or 1) == 1 else 14.0


def sample(
    cases: list[Case], stacks: dict[str, Stack], seed: int, budget_s: float = SAMPLE_BUDGET_S
) -> list[Case]:
    """A reproducible sample within an estimated `budget_s` (reference runs counted once).

    First, per stack, one of its cheapest resume cases, cheapest stacks first, so that as many
    stacks as the budget allows are covered (those left out are covered by the full matrix);
    then more cases at random, those sharing a reference already paid for first, with at most
    one refusal case. Returned in matrix order.
    """
    rng = random.Random(seed)
    refs: set[tuple[Any, ...]] = set()
    chosen: list[Case] = []
    spent = 0.0

    def cost(case: Case) -> float:
        extra = 1 if needs_reference(case) and ref_key(case) not in refs else 0
        return (runs_of(case) + extra) * estimate(case, stacks[case.stack])

    def take(case: Case) -> None:
        nonlocal spent
        spent += cost(case)
        chosen.append(case)
        if needs_reference(case):
            refs.add(ref_key(case))

    picks: list[Case] = []
    for name in sorted({case.stack for case in cases}):
        mine = [case for case in cases if case.stack == name]
        options = [c for c in mine if c.point not in ("twice", "world-change", "refused")] or mine
        cheapest = min(cost(c) for c in options)
        picks.append(rng.choice([c for c in options if cost(c) == cheapest]))
    rng.shuffle(picks)
    for pick in sorted(picks, key=cost):
        if spent + cost(pick) <= budget_s:
            take(pick)
    rest = [case for case in cases if case not in chosen]
    rng.shuffle(rest)
    rest.sort(key=lambda case: needs_reference(case) and ref_key(case) not in refs)
    refusals = 0
    for case in rest:
        if case.point == "refused":
            if refusals:
                continue
            refusals += 1
        if spent + cost(case) <= budget_s:
            take(case)
    order = {case: index for index, case in enumerate(cases)}
    return sorted(chosen, key=order.__getitem__)


def needs_reference(case: Case) -> bool:
    return case.point not in ("refused", "world-change", "describe")


def ref_key(case: Case) -> tuple[Any, ...]:
    return (case.stack, case.loader, case.workers, case.world)


# Running ---------------------------------------------------------------------------------------


@dataclasses.dataclass
class RunSpec:
    """One start of a worker."""

    steps: int
    pause: dict[str, Any] | None
    signal: str  # what the harness sends at the pause: "sigterm", "sigkill" or "none"
    world: int
    async_save: bool = False
    expect: str = "finish"  # "finish", "preempted", "killed" or "refused"


@dataclasses.dataclass
class Outcome:
    """What one run did."""

    rc: int | None
    markers: list[dict[str, Any]]
    note: str
    seconds: float
    log: Path
    restored: dict[int, dict[str, Any]] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class Reference:
    """An uninterrupted run: its losses and final state per rank, and the epoch of each step."""

    error: str | None = None
    warning: str | None = None
    losses: dict[int, dict[int, dict[str, Any]]] = dataclasses.field(default_factory=dict)
    final: dict[int, dict[str, str]] = dataclasses.field(default_factory=dict)
    epochs: dict[int, Any] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class Result:
    """A case's verdict and the one line that reports it."""

    case: Case
    rcs: list[str] = dataclasses.field(default_factory=list)
    paused: list[str] = dataclasses.field(default_factory=list)
    restored: list[str] = dataclasses.field(default_factory=list)
    difference: str | None = None
    failures: list[str] = dataclasses.field(default_factory=list)
    details: list[str] = dataclasses.field(default_factory=list)
    seconds: float = 0.0
    folder: Path | None = None

    @property
    def ok(self) -> bool:
        return self.difference is None and not self.failures

    def fail(self, message: str) -> None:
        self.failures.append(message)

    @property
    def verdict(self) -> str:
        if self.difference is not None:
            return self.difference
        if self.failures:
            return "FAIL " + self.failures[0]
        if self.case.point == "refused":
            return "refused with a clear error"
        if self.case.point == "world-change":
            return "exact (restored state = saved rank r % saved ranks')"
        return "exact"

    @property
    def line(self) -> str:
        where = " ".join(
            part
            for part in (
                ("paused@" + ",".join(self.paused)) if self.paused else "",
                ("restored@" + ",".join(self.restored)) if self.restored else "",
            )
            if part
        )
        return (
            f"{self.case.id:<58} rc={','.join(self.rcs) or '-':<9} {where:<26} "
            f"{self.seconds:5.0f}s  {self.verdict}"
        )

    def report(self) -> str:
        lines = [self.line, *(f"  - {f}" for f in self.failures[1:]), *self.details]
        if self.folder is not None:
            lines.append(f"  files: {self.folder}")
        return "\n".join(lines)


SESSIONS: list[Session] = []
"""Every session of this process, for the pytest summary."""


class Session:
    """Runs cases in a working folder, caching reference runs, and keeps every result line."""

    def __init__(self, workdir: Path, stacks: dict[str, Stack] | None = None) -> None:
        self.workdir = Path(workdir)
        self.stacks = stacks if stacks is not None else discover()
        self.refs: dict[tuple[Any, ...], Reference] = {}
        self.results: list[Result] = []
        self._launcher: list[str] | None = None
        SESSIONS.append(self)

    # Launching ---------------------------------------------------------------------------

    def launcher(self) -> list[str]:
        """``spotckpt launch`` when its ``--help`` works, else torchrun (as a module)."""
        if self._launcher is None:
            exe = Path(sys.executable).with_name("spotckpt")
            works = False
            if exe.exists():
                try:
                    done = subprocess.run(
                        [str(exe), "launch", "--help"], capture_output=True, timeout=120
                    )
                    works = done.returncode == 0
                except (OSError, subprocess.TimeoutExpired):
                    works = False
            self._launcher = (
                [str(exe), "launch"] if works else [sys.executable, "-m", "torch.distributed.run"]
            )
        return self._launcher

    def uses_torchrun(self, stack: Stack, world: int) -> bool:
        return not self.direct(stack, world) and self.launcher()[-1] == "torch.distributed.run"

    @staticmethod
    def direct(stack: Stack, world: int) -> bool:
        return world == 1 and 1 in stack.ranks

    def command(self, stack: Stack, world: int) -> list[str]:
        if self.direct(stack, world):
            return [sys.executable, str(stack.path)]
        return [*self.launcher(), "--standalone", f"--nproc-per-node={world}", str(stack.path)]

    def launch(
        self, stack: Stack, folder: Path, spec: RunSpec, loader: str, workers: int, index: int
    ) -> Outcome:
        """Start one run, pause-and-signal it if asked, and wait for it to exit."""
        out = folder / "out"
        for stale in [*out.glob("paused-rank*"), *out.glob("final-rank*")]:
            stale.unlink()
        before = set(out.glob("restored-rank*.json"))
        case_env = {
            "uri": str(folder / "ckpt"),
            "out": str(out),
            "steps": spec.steps,
            "save_every": stack.save_every,
            "loader": loader,
            "workers": workers,
            "pause": spec.pause,
            "seed": TRAIN_SEED,
            "async_save": spec.async_save,
        }
        env = {k: v for k, v in os.environ.items() if not k.startswith("SPOTCKPT_")}
        env.update(MATRIX_CASE=json.dumps(case_env), PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
        env.setdefault("AWS_EC2_METADATA_DISABLED", "true")
        env.setdefault("AWS_EC2_METADATA_SERVICE_ENDPOINT", "http://127.0.0.1:9")
        env.setdefault("GCE_METADATA_HOST", "127.0.0.1:9")
        log_path = folder / f"run-{index}.log"
        started = time.monotonic()
        note = ""
        markers: list[dict[str, Any]] = []
        family: dict[int, str] = {}
        with open(log_path, "ab") as log:
            command = " ".join(self.command(stack, spec.world))
            log.write(f"$ MATRIX_CASE='{json.dumps(case_env)}' {command}\n".encode())
            log.flush()
            process = subprocess.Popen(
                self.command(stack, spec.world),
                cwd=REPO,
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
            try:
                if spec.pause is not None and spec.signal != "none":
                    found = wait_markers(process, out, spec.world, PAUSE_TIMEOUT_S)
                    if found is None:
                        note = (
                            "exited before pausing"
                            if process.poll() is not None
                            else f"never paused within {PAUSE_TIMEOUT_S} s"
                        )
                    else:
                        markers = found
                        family = descendants(process.pid)
                        signal_all(process, family, SIGNALS[spec.signal])
                if not note:
                    note = wait_exit(process, out, spec.world, signalled=bool(markers))
            finally:
                if process.poll() is None:
                    family.update(descendants(process.pid))
                signal_all(process, family, signal.SIGKILL)
                process.wait()
        restored: dict[int, dict[str, Any]] = {}
        for path in sorted(set(out.glob("restored-rank*.json")) - before):
            match = re.match(r"restored-rank(\d+)-", path.name)
            document = read_json(path)
            if match and isinstance(document, dict):
                restored[int(match[1])] = document
        return Outcome(
            process.returncode, markers, note, time.monotonic() - started, log_path, restored
        )

    # References --------------------------------------------------------------------------

    def reference(self, stack: Stack, loader: str, workers: int, world: int) -> Reference:
        """The uninterrupted run of this set-up (cached for the session)."""
        key = (stack.name, loader, workers, world)
        if key in self.refs:
            return self.refs[key]
        folder = self.workdir / "refs" / f"{stack.name}-{loader}-w{workers}-x{world}"
        shutil.rmtree(folder, ignore_errors=True)
        (folder / "out").mkdir(parents=True)
        outcome = self.launch(
            stack, folder, RunSpec(stack.steps, None, "none", world), loader, workers, 1
        )
        ref = Reference()
        if outcome.note.startswith(HUNG):
            ref.warning = outcome.note  # its state is complete: cases can still compare with it
        if outcome.rc != 0 and ref.warning is None:
            text = log_tail(outcome.log)
            ref.error = f"exited {outcome.rc}, {outcome.note}".strip(", ") + (
                f": {text}" if text else ""
            )
        else:
            losses = read_losses(folder / "out", world)
            for rank in range(world):
                entries = losses.get(rank, [])
                steps = [entry["step"] for entry in entries]
                if sorted(steps) != list(range(1, stack.steps + 1)):
                    ref.error = f"rank {rank} logged steps {compress(steps)}, not 1..{stack.steps}"
                ref.losses[rank] = {entry["step"]: entry for entry in entries}
                final = read_json(folder / "out" / f"final-rank{rank}.json")
                if not isinstance(final, dict):
                    ref.error = f"rank {rank} wrote no final-rank{rank}.json"
                else:
                    ref.final[rank] = final
            ref.epochs = {s: e.get("epoch") for s, e in ref.losses.get(0, {}).items()}
        self.refs[key] = ref
        return ref

    # Cases -------------------------------------------------------------------------------

    def run_case(self, case: Case) -> Result:
        """Run one case and judge it; the result's `line` is what the table prints."""
        result = Result(case)
        started = time.monotonic()
        try:
            self._run_case(case, result)
        except Exception as error:
            result.fail(f"harness error: {error!r}")
            result.details.append(traceback.format_exc())
        result.seconds = time.monotonic() - started
        self.results.append(result)
        return result

    def _run_case(self, case: Case, result: Result) -> None:
        stack = self.stacks[case.stack]
        if stack.error is not None:
            result.fail(f"stack {stack.name}: {stack.error}")
            return
        folder = self.workdir / "cases" / case.id
        result.folder = folder
        shutil.rmtree(folder, ignore_errors=True)
        (folder / "out").mkdir(parents=True)
        ref: Reference | None = None
        if needs_reference(case):
            ref = self.reference(stack, case.loader, case.workers, case.world)
            if ref.error is not None:
                result.fail(f"reference run failed: {ref.error}")
                return
            if ref.warning is not None:
                result.fail(f"reference run {ref.warning}")
        specs = plan(case, stack, ref)
        outcomes: list[Outcome] = []
        saved: dict[int, tuple[int, dict[int, dict[str, str]]]] = {}
        for index, spec in enumerate(specs, start=1):
            outcome = self.launch(stack, folder, spec, case.loader, case.workers, index)
            outcomes.append(outcome)
            result.rcs.append(str(outcome.rc))
            if outcome.markers:
                steps = {str(m.get("step", "?")) for m in outcome.markers}
                result.paused.append("/".join(sorted(steps)))
            if index > 1:
                steps = {str(d.get("step")) for d in outcome.restored.values()}
                result.restored.append("/".join(sorted(steps)) if steps else "?")
            self.check_run(
                case, stack, spec, specs[index - 2] if index > 1 else None, outcomes, saved, result
            )
            collect_saved(folder / "out", spec.world, saved)
            torchrun = self.uses_torchrun(stack, spec.world)
            if not expected_exit(outcome, spec, torchrun) and not outcome.note.startswith(HUNG):
                break  # a run that hung at exit had saved: the next one can still resume
        last = outcomes[-1] if outcomes else None
        complete = (
            len(outcomes) == len(specs)
            and last is not None
            and (last.rc == 0 or last.note.startswith(HUNG))
        )
        self.compare(case, stack, ref, folder / "out", complete, result)

    def check_run(
        self,
        case: Case,
        stack: Stack,
        spec: RunSpec,
        previous: RunSpec | None,
        outcomes: list[Outcome],
        saved: dict[int, tuple[int, dict[int, dict[str, str]]]],
        result: Result,
    ) -> None:
        """The exit status, the restored step and the restored state of the latest run."""
        outcome = outcomes[-1]
        index = len(outcomes)
        torchrun = self.uses_torchrun(stack, spec.world)
        if not expected_exit(outcome, spec, torchrun):
            note = f" ({outcome.note})" if outcome.note else ""
            error = last_error(outcome.log) if spec.expect != "refused" else None
            because = f": {error}" if error else ""
            result.fail(
                f"run {index} exited {outcome.rc}{note}, expected {wanted(spec, torchrun)}{because}"
            )
            text = log_tail(outcome.log, 25)
            if text:
                result.details.append(f"  run {index} log tail ({outcome.log}):\n{text}")
        if spec.expect == "refused":
            text = outcome.log.read_text(errors="replace")
            if not REFUSAL.search(text):
                result.fail("no clear refusal of the plain shuffled DataLoader in the output")
            if read_losses(outcome.log.parent / "out", spec.world):
                result.fail("it trained before refusing the loader")
            return
        if not expected_exit(outcome, spec, torchrun) and not outcome.note.startswith(HUNG):
            return  # a crash: its restore is not to be judged
        ranks = set(range(spec.world))
        if set(outcome.restored) != ranks:
            result.fail(
                f"run {index}: restored-rank files of ranks {sorted(outcome.restored)}, "
                f"not {sorted(ranks)}"
            )
            return
        steps = {d.get("step") for d in outcome.restored.values()}
        if len(steps) != 1:
            result.fail(f"run {index}: ranks restored different steps {sorted(map(str, steps))}")
            return
        step = steps.pop()
        if previous is None:
            if step is not None:
                result.fail(f"run {index} restored step {step} from an empty store")
            return
        paused = marker_step(outcomes[-2])
        if previous.expect == "finish" and step != previous.steps:
            result.fail(
                f"run {index} restored {step}, not the finished run's step {previous.steps}"
            )
        elif previous.expect == "preempted" and (
            step is None or (paused is not None and step < paused)
        ):
            result.fail(f"run {index} restored {step}, before the preemption at step {paused}")
        elif (
            previous.expect == "killed"
            and step is not None
            and paused is not None
            and step > paused
        ):
            result.fail(f"run {index} restored {step}, after the SIGKILL at step {paused}")
        if step is None:
            return
        if step not in saved:
            result.details.append(f"  run {index}: no saved digests of step {step} to compare")
            return
        saved_world, by_rank = saved[step]
        for rank, document in sorted(outcome.restored.items()):
            source = rank % saved_world
            mine = document.get("state") or {}
            theirs = by_rank.get(source)
            if theirs is None:
                continue
            differing = sorted(k for k in mine if k in theirs and mine[k] != theirs[k])
            if not differing:
                continue
            like = [
                other
                for other, state in sorted(by_rank.items())
                if other != source and all(mine[k] == state.get(k) for k in differing)
            ]
            hint = f" (they match saved rank {like[0]}'s)" if like else ""
            result.fail(
                f"run {index}: rank {rank} restored {', '.join(shorten(differing))} of step {step} "
                f"unlike saved rank {source}{hint}"
            )

    def compare(
        self,
        case: Case,
        stack: Stack,
        ref: Reference | None,
        out: Path,
        complete: bool,
        result: Result,
    ) -> None:
        """Every logged loss against the reference; when the last run finished (`complete`),
        that every step was logged and the final state."""
        if ref is None:
            return
        world = case.world
        losses = read_losses(out, world)
        first: tuple[int, int, str] | None = None
        for rank, entries in losses.items():
            expected = ref.losses.get(rank, {})
            for entry in entries:
                step = entry["step"]
                why = difference(entry, expected.get(step))
                if why is not None and (first is None or (step, rank) < first[:2]):
                    first = (step, rank, why)
        if first is not None:
            step, rank, why = first
            result.difference = f"DIFF at step {step} (rank {rank}: {why})"
        if not complete:
            return
        for rank in range(world):
            logged = {entry["step"] for entry in losses.get(rank, [])}
            missing = sorted(set(range(1, stack.steps + 1)) - logged)
            if missing:
                result.fail(f"rank {rank} never logged steps {compress(missing)}")
            final = read_json(out / f"final-rank{rank}.json")
            if not isinstance(final, dict):
                result.fail(f"rank {rank} wrote no final-rank{rank}.json")
                continue
            want = ref.final.get(rank, {})
            differing = sorted(
                k for k in final if k in want and final[k] != want[k] and not k.startswith("loader")
            )
            if differing:
                result.fail(f"rank {rank} final state differs: {', '.join(shorten(differing))}")


def plan(case: Case, stack: Stack, ref: Reference | None) -> list[RunSpec]:
    """The runs of a case, with the pause steps chosen from the reference's epochs."""
    steps, world = stack.steps, case.world
    expect = {"sigterm": "preempted", "sigkill": "killed", "none": "finish"}[case.signal]
    if case.point == "refused":
        return [RunSpec(steps, None, "none", world, expect="refused")]
    if case.point == "world-change":
        at = {"kind": "step", "at": stack.save_every + 1}
        return [
            RunSpec(steps, at, case.signal, world, expect=expect),
            RunSpec(steps, None, "none", case.world_to or world),
        ]
    assert ref is not None
    chosen = choose_steps(ref.epochs, steps, stack.save_every)
    pause = {
        "mid-epoch": {"kind": "step", "at": chosen["mid"]},
        "epoch-boundary": {"kind": "epoch_end", "at": chosen["boundary"]},
        "later-epoch": {"kind": "step", "at": chosen["later"]},
        "async": {"kind": "async", "at": steps // 2},
        "eval": {"kind": "eval", "at": steps // 3},
        "before-first-save": {"kind": "step", "at": max(1, stack.save_every // 2)},
    }
    if case.point == "twice":
        first = {"kind": "step", "at": chosen["mid"]}
        second = {"kind": "step", "at": chosen["later"]}
        return [
            RunSpec(steps, first, case.signal, world, expect=expect),
            RunSpec(steps, second, case.signal, world, expect=expect),
            RunSpec(steps, None, "none", world),
        ]
    if case.point == "finish-then-more":
        return [RunSpec(chosen["later"], None, "none", world), RunSpec(steps, None, "none", world)]
    asynchronous = case.point == "async"
    return [
        RunSpec(steps, pause[case.point], case.signal, world, asynchronous, expect),
        RunSpec(steps, None, "none", world, asynchronous),
    ]


def choose_steps(epochs: dict[int, Any], steps: int, save_every: int) -> dict[str, int]:
    """Pause steps from the reference's step -> epoch map: `mid` (inside one of the first two
    epochs, after the first periodic save, not on a save step), `later` (inside epoch 2 or
    later), `boundary` (the last step of the second epoch, or of the first)."""
    ends = [s for s in range(1, steps) if epochs.get(s + 1, epochs.get(s)) != epochs.get(s)]
    first = epochs.get(1)
    index = {epoch: n for n, epoch in enumerate(dict.fromkeys(epochs[s] for s in sorted(epochs)))}

    def inside(s: int) -> bool:
        return s not in ends and s > save_every and s % save_every != 0

    def pick(*conditions: Any) -> int | None:
        for condition in conditions:
            for s in range(1, steps):
                if condition(s):
                    return s
        return None

    mid = pick(
        lambda s: inside(s) and epochs.get(s) == first,
        lambda s: inside(s) and index.get(epochs.get(s), 0) <= 1,
        lambda s: s not in ends and s % save_every != 0,
    ) or max(1, steps // 3)
    later = pick(
        lambda s: inside(s) and index.get(epochs.get(s), 0) >= 2 and s > mid,
        lambda s: s > mid and s not in ends,
    ) or min(steps - 1, mid + 1)
    boundary = ends[1] if len(ends) > 1 else (ends[0] if ends else steps // 2)
    return {"mid": mid, "later": later, "boundary": boundary}


# Processes -------------------------------------------------------------------------------------


def wait_markers(
    process: subprocess.Popen[bytes], out: Path, world: int, timeout: float
) -> list[dict[str, Any]] | None:
    """Every rank's paused marker, or None when the run exits (or the bound passes) first."""
    deadline = time.monotonic() + timeout
    paths = [out / f"paused-rank{rank}" for rank in range(world)]
    while time.monotonic() < deadline:
        if all(path.exists() for path in paths):
            markers = [read_marker(path) for path in paths]
            if all(marker is not None for marker in markers):
                return [m for m in markers if m is not None]
        if process.poll() is not None:
            return None
        time.sleep(POLL_S)  # polling the marker files, not waiting for a guessed time
    return None


def wait_exit(process: subprocess.Popen[bytes], out: Path, world: int, signalled: bool) -> str:
    """Wait for the run to exit; a note when it does not (a hang at exit is told apart)."""
    limit = EXIT_TIMEOUT_S if signalled else RUN_TIMEOUT_S
    deadline = time.monotonic() + limit
    finals = [out / f"final-rank{rank}.json" for rank in range(world)]
    finished_at: float | None = None
    while process.poll() is None:
        now = time.monotonic()
        if finished_at is None and all(path.exists() for path in finals):
            finished_at = now
        if finished_at is not None and now - finished_at > EXIT_GRACE_S:
            return f"{HUNG}: still running {EXIT_GRACE_S} s after writing its final state"
        if now > deadline:
            return f"did not exit within {limit} s" + (" of the signal" if signalled else "")
        time.sleep(POLL_S)
    return ""


def read_marker(path: Path) -> dict[str, Any] | None:
    try:
        text = path.read_text()
    except OSError:
        return None
    if not text.strip():
        return {}
    try:
        value = json.loads(text)
    except ValueError:
        return None  # still being written
    return value if isinstance(value, dict) else {}


def marker_step(outcome: Outcome) -> int | None:
    steps = [m["step"] for m in outcome.markers if isinstance(m.get("step"), int)]
    return max(steps) if steps else None


def descendants(pid: int) -> dict[int, str]:
    """The processes below `pid` (from /proc), each with its start time, so that launched ranks
    in sessions of their own (torchrun starts each in a new session) get the signal too, as on a
    machine going down, and so that a pid reused later is never signalled."""
    parents: dict[int, tuple[int, str]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            stat = proc_stat(int(entry.name))
            if stat is not None:
                parents[int(entry.name)] = (int(stat[1]), stat[19])
    found: dict[int, str] = {}
    frontier = [pid]
    while frontier:
        parent = frontier.pop()
        for child, (ppid, started) in parents.items():
            if ppid == parent and child not in found:
                found[child] = started
                frontier.append(child)
    return found


def proc_stat(pid: int) -> list[str] | None:
    """The fields of /proc/PID/stat after the command name (state, ppid, ...), or None."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat[stat.rfind(")") + 2 :].split()


def signal_all(process: subprocess.Popen[bytes], family: dict[int, str], signum: int) -> None:
    """`signum` to the run's process group (its own session) and to each of its descendants
    that is still the process it was (same start time)."""
    if process.returncode is None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(process.pid, signum)
    for pid, started in sorted(family.items()):
        stat = proc_stat(pid)
        if stat is not None and stat[19] == started:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signum)


def expected_exit(outcome: Outcome, spec: RunSpec, torchrun: bool) -> bool:
    if outcome.note:
        return False
    if spec.expect == "finish":
        return outcome.rc == 0
    if spec.expect == "preempted":
        return outcome.rc == PREEMPTED or (torchrun and outcome.rc == TORCHRUN_SIGTERM_EXIT)
    if spec.expect == "killed":
        return outcome.rc == -signal.SIGKILL
    return outcome.rc not in (0, PREEMPTED, None)  # refused


def wanted(spec: RunSpec, torchrun: bool) -> str:
    return {
        "finish": "0",
        "preempted": "75" + (" (or torchrun's 1)" if torchrun else ""),
        "killed": "-9",
        "refused": "an error exit",
    }[spec.expect]


# Files -----------------------------------------------------------------------------------------


def read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def read_losses(out: Path, world: int) -> dict[int, list[dict[str, Any]]]:
    """Every logged step per rank, in order (a step redone after a restart appears twice)."""
    losses: dict[int, list[dict[str, Any]]] = {}
    for rank in range(max(world, 2)):
        path = out / f"losses-rank{rank}.jsonl"
        if not path.exists():
            continue
        entries = []
        for line in path.read_text().splitlines():
            try:
                entry = json.loads(line)
            except ValueError:
                continue  # a line cut short by SIGKILL
            if isinstance(entry, dict) and isinstance(entry.get("step"), int):
                entries.append(entry)
        if entries:
            losses[rank] = entries
    return losses


def collect_saved(
    out: Path, world: int, saved: dict[int, tuple[int, dict[int, dict[str, str]]]]
) -> None:
    """Digests written at saves (``saved-rank{r}-step{s}-{pid}.json``), by step; the first run
    to save a step is the one its checkpoint came from (a committed step is never re-saved)."""
    found: dict[int, dict[int, dict[str, str]]] = {}
    for path in sorted(out.glob("saved-rank*-step*.json"), key=lambda p: p.stat().st_mtime):
        match = re.match(r"saved-rank(\d+)-step(\d+)-", path.name)
        document = read_json(path)
        if match and isinstance(document, dict) and isinstance(document.get("state"), dict):
            found.setdefault(int(match[2]), {})[int(match[1])] = document["state"]
    for step, by_rank in found.items():
        saved.setdefault(step, (world, by_rank))


def difference(entry: dict[str, Any], want: dict[str, Any] | None) -> str | None:
    if want is None:
        return "a step the reference does not have"
    if entry.get("loss") != want.get("loss"):
        return f"loss {show(entry.get('loss'))} vs reference {show(want.get('loss'))}"
    if entry.get("epoch") != want.get("epoch"):
        return f"epoch {entry.get('epoch')} vs reference {want.get('epoch')}"
    if "eval" in entry and "eval" in want and entry["eval"] != want["eval"]:
        return f"eval loss {show(entry['eval'])} vs reference {show(want['eval'])}"
    return None


def show(value: Any) -> str:
    try:
        return f"{float.fromhex(value):.9g}"
    except (TypeError, ValueError):
        return repr(value)


def shorten(keys: list[str], limit: int = 4) -> list[str]:
    return keys if len(keys) <= limit else [*keys[:limit], f"... ({len(keys)} entries)"]


def compress(steps: Iterable[int]) -> str:
    """``[1, 2, 3, 7]`` as ``1-3,7``."""
    runs: list[list[int]] = []
    for step in sorted(set(steps)):
        if runs and step == runs[-1][1] + 1:
            runs[-1][1] = step
        else:
            runs.append([step, step])
    return ",".join(f"{a}-{b}" if a != b else str(a) for a, b in runs) or "none"


NOISE = re.compile(r"set_vital|^\$ MATRIX_CASE=")


def tail(text: str, lines: int = 6) -> str:
    """The last `lines` lines of a log, without known noise (torchdata's deprecation warning)."""
    kept = [line for line in text.strip().splitlines() if not NOISE.search(line)]
    return "\n".join(kept[-lines:])


ERROR_LINE = re.compile(r"^(?:\[rank\d+\]:)?\s*((?:[\w.]+\.)?\w*(?:Error|Exception|Exit)\b.*)$")


CONSEQUENCES = re.compile(r"ChildFailedError|Connection closed by peer|SignalException")


def last_error(path: Path) -> str | None:
    """The root error of a failed run: the first ``SomeError: message`` line of its log that is
    not a consequence of another rank's failure (a closed gloo connection, torchrun's report);
    marked ``(at exit)`` when Python reported it from an exit hook."""
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError:
        return None
    at_exit = False
    for line in lines:
        if "Exception ignored in atexit callback" in line:
            at_exit = True
            continue
        match = ERROR_LINE.match(line)
        if match and re.search(r":\s*\S", match[1]) and not CONSEQUENCES.search(match[1]):
            text = match[1].strip()
            text = text if len(text) <= 160 else text[:157] + "..."
            return f"{text} (at exit)" if at_exit else text
    return None


def log_tail(path: Path, lines: int = 6) -> str:
    try:
        return tail(path.read_text(errors="replace"), lines)
    except OSError:
        return "(no log)"


# Command line ----------------------------------------------------------------------------------


def select(args: argparse.Namespace, stacks: dict[str, Stack]) -> tuple[list[Case], int | None]:
    cases = matrix(stacks)
    seed: int | None = None
    if args.sample:
        seed = args.seed
        cases = sample(cases, stacks, seed)
    if args.case:
        cases = [case for case in cases if case.id in set(args.case)]
    return cases, seed


def header() -> str:
    return f"{'case':<58} {'exits':<12} {'pause/restore':<26} {'time':>6}  result"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    which = parser.add_mutually_exclusive_group(required=True)
    which.add_argument("--all", action="store_true", help="the full matrix")
    which.add_argument("--sample", action="store_true", help="the seeded sample")
    which.add_argument("--list", action="store_true", help="print the case ids and stop")
    parser.add_argument(
        "--seed", type=int, default=int(os.environ.get("SPOTCKPT_MATRIX_SEED", "0"))
    )
    parser.add_argument("--stack", action="append", help="only these stacks (repeatable)")
    parser.add_argument("--case", action="append", help="only these case ids (repeatable)")
    parser.add_argument("--workdir", type=Path, help="keep the runs' files here")
    args = parser.parse_args(argv)
    # A SIGTERM to the harness ends the run in progress too (its `finally` kills what it started).
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    stacks = discover(args.stack)
    if args.list:
        for case in matrix(stacks):
            print(case.id)
        return 0
    cases, seed = select(args, stacks)
    if seed is not None:
        print(f"resume matrix sample: SPOTCKPT_MATRIX_SEED={seed}, {len(cases)} cases")
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="resume-matrix-"))
    workdir.mkdir(parents=True, exist_ok=True)
    session = Session(workdir, stacks)
    names = [s.name if s.error is None else f"{s.name} ({s.error})" for s in stacks.values()]
    print(f"stacks: {', '.join(names)}")
    print(f"launcher: {' '.join(session.launcher())}; files under {workdir}")
    print(header(), flush=True)
    started = time.monotonic()
    for case in cases:
        result = session.run_case(case)
        print(result.line, flush=True)
    failed = [r for r in session.results if not r.ok]
    print()
    seconds = time.monotonic() - started
    print(f"{len(cases) - len(failed)} exact, {len(failed)} failed, {seconds:.0f} s")
    for result in failed:
        print(result.report())
    return 1 if failed else 0


def iter_lines(results: Iterable[Result]) -> Iterator[str]:
    yield header()
    for result in results:
        yield result.line


if __name__ == "__main__":
    sys.exit(main())
