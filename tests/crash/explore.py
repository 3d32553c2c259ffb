"""The crash explorer: every recorded store call of every scenario is a point; at each, the state
each fault kind would leave is built and recovered, and the invariants are checked.

``python tests/crash/explore.py`` runs the whole exploration (`make crash`); ``--sample N`` a
seeded sample of N points; ``--scenario ID --point NAME --kind KIND`` replays one point (the
reproducer each violation prints). The last line reads ``crash points explored: N, violations: V``.

How a point's state is built, by fault kind:

- ``crash`` and ``lost`` (the process dies just before the call, or just after it took effect
  with its answer lost): rebuilt from the scenario's recorded trace (the effects of the calls
  before it, and of the call itself for ``lost``), put into a fresh root of the same back end.
  Points whose rebuilt state is the same (every read between two writes) are recovered once.
  A fast-tier scenario replays instead (``replay-crash``; its tier folder is not in the trace),
  and ``host`` also drops the tier's unsynced objects (truncated, as after a power loss).
- ``transient`` and ``denied``: the scenario is replayed and that one call fails with what a
  store raises once its retries are spent, or with a refusal; the job sees the error.
- ``gc``, ``damaged`` and ``forged``: replayed; right before the call, gc runs with a safety
  age of 0, or the newest committed step's largest object gets a flipped byte, or a manifest of
  a higher step full of garbage appears.
- ``kill``: replayed in a child process that SIGKILLs itself at the call (`killed.py`).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import random
import shutil
import signal
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
for folder in (HERE, HERE.parent, HERE.parent / "seams", HERE.parents[1]):
    if str(folder) not in sys.path:
        sys.path.insert(0, str(folder))

import seam_run  # noqa: E402
from backends import NAMES, Backends, usable  # noqa: E402
from checker import Expectation, Recovery, check  # noqa: E402
from recorder import CRASH_KINDS, MUTATING, TIER, Call, Fault, Trace  # noqa: E402
from scenarios import (  # noqa: E402
    KEEP_LAST,
    Root,
    Scenario,
    features_on,
    own,
    run,
    scenarios,
    settings,
)

from spotckpt.catalog import Catalog  # noqa: E402
from spotckpt.format.references import is_reference, object_path  # noqa: E402
from spotckpt.gc import collect_garbage  # noqa: E402
from spotckpt.layout import manifest_key, step_folder  # noqa: E402
from spotckpt.storage import ObjectStore  # noqa: E402

from tests_support import write_signing_key  # noqa: E402

REPLAYED_KINDS = ("transient", "denied", "gc", "damaged", "forged")
TIER_CRASH_KINDS = ("replay-crash", "host")
SERVER_KINDS = (*CRASH_KINDS, "gc")
"""The kinds explored on the servers (S3, GCS, Azure): the replayed errors and damaged objects
run the same code as on the local folder, and each replay there costs seconds."""
FORGED_STEP = 99


@dataclass
class Verdict:
    """One explored point and fault kind."""

    scenario: str
    point: str
    kind: str
    violations: list[str]
    restored: int | None = None
    reached: bool = True
    """False when a replay never made the named call (one whose count varies between runs,
    such as a read of ``job.json`` by a background thread): not explored."""

    @property
    def reproducer(self) -> str:
        return (
            f"python tests/crash/explore.py --scenario {self.scenario} "
            f"--point '{self.point}' --kind {self.kind}"
        )


@dataclass
class Workspace:
    """Fresh roots for runs and rebuilt states, under one temporary folder."""

    folder: Path
    key: Path
    counter: int = 0
    backends: Backends | None = None
    """The started servers (without them, only the local folder)."""

    @classmethod
    def create(cls, folder: Path, backends: Backends | None = None) -> Workspace:
        folder.mkdir(parents=True, exist_ok=True)
        key = folder / "signing.pem"
        if not key.exists():
            write_signing_key(key)
        return cls(folder, key, backends=backends)

    def fresh(self, scenario: Scenario) -> Root:
        """An empty root of the scenario's back end (its own folder for the fast tier)."""
        self.counter += 1
        folder = self.folder / f"r{self.counter}"
        folder.mkdir()
        if self.backends is not None:
            return self.backends.fresh_root(scenario.backend, folder, self.key)
        if scenario.backend != "local":
            raise SystemExit(f"back end {scenario.backend!r} is not set up by this explorer")
        return Root(str(folder / "bucket"), folder, self.key)

    def discard(self, root: Root) -> None:
        if self.backends is not None:
            self.backends.discard(root)
        else:
            shutil.rmtree(root.folder, ignore_errors=True)


@dataclass
class Recorded:
    """A scenario's fault-free run: its trace and points."""

    scenario: Scenario
    trace: Trace
    root: Root

    def points(self) -> list[Call]:
        return self.trace.points()


def record(scenario: Scenario, space: Workspace) -> Recorded:
    """Run the scenario without a fault; it must pass the checker as it is."""
    root = space.fresh(scenario)
    trace = Trace()
    outcome = run(scenario, root, trace)
    if outcome.error:
        raise RuntimeError(f"{scenario.id} fails without a fault: {outcome.error}")
    return Recorded(scenario, trace, root)


def expectation(scenario: Scenario, trace: Trace, seq: int) -> Expectation:
    """What a fault at the call numbered `seq` promises, from what the scenario was told."""
    module = own(scenario.op)
    if module is not None:
        return module.expectation(scenario, trace, seq)
    committed = trace.marked("committed", seq)
    tier = set(trace.marked("tier", seq))
    saving = set(trace.marked("saving", seq))
    in_flight = saving - set(committed) - tier
    if scenario.tier:  # the tier's copy of a step in flight may be whole: restored exactly
        tier |= in_flight
    return Expectation(committed, in_flight, tier, KEEP_LAST)


def recover(scenario: Scenario, root: Root, expect: Expectation) -> Recovery:
    """Check the root with the checker, as the job's restart would open it (an `OWN_OPS`
    operation with its own recovery)."""
    module = own(scenario.op)
    if module is not None:
        return module.recover(scenario, root, expect)
    chosen = settings(scenario, root, keep_last=None)
    chosen["preemption"] = False
    keys = seam_run.keyring(scenario.cell, root.paths)
    with features_on(scenario):
        return check(root.opened, {"uri": root.uri, **chosen}, keys, expect)


def rebuild(recorded: Recorded, call: Call, applied: bool, space: Workspace) -> Root:
    """A fresh root holding what a crash at `call` leaves in the bucket (and in the second root
    of an operation that writes one: its keys carry the module's ``PREFIX``)."""
    root = space.fresh(recorded.scenario)
    module = own(recorded.scenario.op)
    prefix = module.PREFIX if module is not None else ""
    objects = sorted(recorded.trace.objects_at(call.seq, applied).items())
    with root.opened() as store:
        for key, data in objects:
            if not (prefix and key.startswith(prefix)):
                store.put(key, data)
    if prefix and module is not None:
        with module.target(root).opened() as second:
            for key, data in objects:
                if key.startswith(prefix):
                    second.put(key[len(prefix) :], data)
    return root


def _state_key(recorded: Recorded, call: Call, applied: bool, expect: Expectation) -> str:
    digest = hashlib.blake2b(digest_size=16)
    for key, data in sorted(recorded.trace.objects_at(call.seq, applied).items()):
        digest.update(key.encode() + b"\0" + hashlib.blake2b(data, digest_size=16).digest())
    digest.update(repr(expect).encode())
    return digest.hexdigest()


def act(kind: str, scenario: Scenario, root: Root, trace: Trace) -> Callable[[], None] | None:
    """What another actor does right before the faulted call, for the actor kinds (on the root
    an `OWN_OPS` operation writes)."""
    keys = seam_run.keyring(scenario.cell, root.paths)
    module = own(scenario.op)
    root = root if module is None else module.target(root)

    def gc() -> None:
        with root.opened() as store:
            collect_garbage(store, keep_last=KEEP_LAST, safety_age_s=0, keyring=keys)

    def damaged() -> None:
        with root.opened() as store:
            _damage_newest(store, keys, trace)

    def forged() -> None:
        with root.opened() as store:
            store.put(manifest_key(FORGED_STEP), b'{"format": "spotckpt/1", "step"')

    return {"gc": gc, "damaged": damaged, "forged": forged}.get(kind)


def _damage_newest(store: ObjectStore, keys: object, trace: Trace) -> None:
    """Flip one byte in the largest object of the newest committed step."""
    catalog = Catalog(store, keys)  # type: ignore[arg-type]
    steps = catalog.steps()
    if not steps:
        return
    manifest = catalog.read_manifest(steps[-1])
    own = [(record.size, key) for key, record in manifest.objects.items() if not is_reference(key)]
    if not own:
        return
    _, key = max(own)
    full = object_path(step_folder(steps[-1]), key)
    data = bytearray(store.get(full))
    data[len(data) // 2] ^= 0x5A
    store.put(full, bytes(data))
    trace.mark("damaged", steps[-1])


def replay(scenario: Scenario, point: str, kind: str, space: Workspace) -> tuple[Trace, Root, bool]:
    """Run the scenario again with the fault at `point`; the trace, the root, and whether the
    run let a raw exception out."""
    root = space.fresh(scenario)
    fault = Fault(point, kind)
    trace = Trace(fault)
    fault.act = act(kind, scenario, root, trace)
    outcome = run(scenario, root, trace)
    if kind == "host":
        _lose_unsynced(root)
    return trace, root, outcome.raw


def _lose_unsynced(root: Root) -> None:
    """A host crash: the tier's objects were never fsynced; each is left empty."""
    for path in (root.folder / "fast").rglob("*"):
        if path.is_file() and path.suffix in (".safetensors", ".zblocks", ".ec"):
            path.write_bytes(b"")


def explore_point(
    recorded: Recorded, call: Call, kind: str, space: Workspace, cache: dict[str, Recovery]
) -> Verdict:
    """Build the state a fault of `kind` at `call` leaves, recover it, check it."""
    scenario = recorded.scenario
    if kind in CRASH_KINDS:
        expect = expectation(scenario, recorded.trace, call.seq)
        key = _state_key(recorded, call, kind == "lost", expect)
        seen = cache.get(key)
        if seen is None:
            root = rebuild(recorded, call, kind == "lost", space)
            seen = cache[key] = recover(scenario, root, expect)
            space.discard(root)
        return Verdict(scenario.id, call.name, kind, list(seen.violations), seen.restored)
    trace, root, raw = replay(scenario, call.name, kind, space)
    violations = ["a raw exception reached the job"] if raw else []
    if trace.fault is not None and not trace.fault.fired:  # a call made a varying number of times
        space.discard(root)
        return Verdict(scenario.id, call.name, kind, [], None, reached=False)
    fault_seq = _fired_at(trace, call.name)
    ended = fault_seq if kind in ("replay-crash", "host") else len(trace.calls)
    expect = expectation(scenario, trace, ended)
    expect.damaged = set(trace.marked("damaged", len(trace.calls)))
    if kind == "forged":
        expect.damaged.add(FORGED_STEP)
    if kind == "host":
        expect.tier_only |= set(trace.marked("tier", ended))
    seen = recover(scenario, root, expect)
    space.discard(root)
    return Verdict(scenario.id, call.name, kind, violations + seen.violations, seen.restored)


def _fired_at(trace: Trace, name: str) -> int:
    for call in trace.calls:
        if call.name == name:
            return call.seq
    return len(trace.calls)


def kinds_for(scenario: Scenario, kinds: tuple[str, ...]) -> list[str]:
    """The fault kinds explored on a scenario (a tier's crashes replay; a server's, only
    `SERVER_KINDS`)."""
    chosen = []
    for kind in kinds:
        if scenario.backend != "local" and kind not in SERVER_KINDS:
            continue
        if kind in CRASH_KINDS and scenario.tier:
            kind = {"crash": "replay-crash", "lost": "host"}[kind]
        if (kind in TIER_CRASH_KINDS and not scenario.tier) or kind in chosen:
            continue
        chosen.append(kind)
    return chosen


@dataclass
class Plan:
    """Which (scenario, point, kind) triples to explore."""

    items: list[tuple[Recorded, Call, str]] = field(default_factory=list)


def plan(
    chosen: list[Scenario],
    kinds: tuple[str, ...],
    space: Workspace,
    sample: int | None,
    seed: int,
    server_sample: int | None = None,
) -> Plan:
    """Record each scenario without a fault; every call of its operation, with every kind
    that applies to it, or a seeded sample of `sample` of them; of a server's (where a replay
    costs seconds), at most a seeded `server_sample` per back end."""
    everything = Plan()
    for scenario in chosen:
        recorded = record(scenario, space)
        for call in recorded.points():
            if call.op == "write" and call.key.startswith(TIER):
                continue
            for kind in kinds_for(scenario, kinds):
                everything.items.append((recorded, call, kind))
    rng = random.Random(seed)
    if server_sample is not None:
        everything.items = _at_most_per_server(everything.items, server_sample, rng)
    if sample is not None and sample < len(everything.items):
        everything.items = rng.sample(everything.items, sample)
    return everything


def _at_most_per_server(
    items: list[tuple[Recorded, Call, str]], most: int, rng: random.Random
) -> list[tuple[Recorded, Call, str]]:
    """`items` with at most `most` of each server back end's, seeded, in their order."""
    by_backend: dict[str, list[int]] = {}
    for index, (recorded, _, _) in enumerate(items):
        by_backend.setdefault(recorded.scenario.backend, []).append(index)
    kept = set(by_backend.pop("local", []))
    for indices in by_backend.values():
        kept.update(rng.sample(indices, min(most, len(indices))))
    return [item for index, item in enumerate(items) if index in kept]


def explore(
    plan_: Plan,
    space: Workspace,
    progress: bool = False,
    verdicts: list[Verdict] | None = None,
) -> list[Verdict]:
    """Explore the planned points in order (states rebuilt alike are recovered once), into
    `verdicts` (so that an interrupted run still reports what it explored)."""
    cache: dict[str, Recovery] = {}
    verdicts = [] if verdicts is None else verdicts
    started = time.monotonic()
    for number, (recorded, call, kind) in enumerate(plan_.items, 1):
        verdicts.append(explore_point(recorded, call, kind, space, cache))
        if progress and number % 200 == 0:
            bad = sum(1 for v in verdicts if v.violations)
            print(
                f"  {number}/{len(plan_.items)} points, {time.monotonic() - started:.0f} s, "
                f"{bad} violations ({recorded.scenario.id})",
                file=sys.stderr,
                flush=True,
            )
    return verdicts


def report(verdicts: list[Verdict]) -> Iterator[str]:
    """The table of points per scenario and kind, the violations, and the closing line."""
    unreached = [v for v in verdicts if not v.reached]
    verdicts = [v for v in verdicts if v.reached]
    counts = Counter((v.scenario, v.kind) for v in verdicts)
    bad = Counter((v.scenario, v.kind) for v in verdicts if v.violations)
    kinds = sorted({v.kind for v in verdicts})
    yield "| scenario | " + " | ".join(kinds) + " |"
    yield "|---|" + "---:|" * len(kinds)
    for scenario in sorted({v.scenario for v in verdicts}):
        cells = [
            f"{counts[(scenario, k)]}"
            + (f" ({bad[(scenario, k)]} bad)" if bad[(scenario, k)] else "")
            for k in kinds
        ]
        yield f"| {scenario} | " + " | ".join(cells) + " |"
    violations = [v for v in verdicts if v.violations]
    for verdict in violations[:50]:
        first = verdict.violations[0]
        yield f"VIOLATION {verdict.scenario} {verdict.point} {verdict.kind}: {first}"
        yield f"  reproduce: {verdict.reproducer}"
    if unreached:
        yield f"points not reached on replay (their call's count varies): {len(unreached)}"
    yield f"crash points explored: {len(verdicts)}, violations: {len(violations)}"


ALL_KINDS = (*CRASH_KINDS, *REPLAYED_KINDS)
POINT_KINDS = (*ALL_KINDS, *TIER_CRASH_KINDS)
"""The kinds explored in this process (a tier scenario's crashes are its own two kinds)."""


def _killed_at(
    chosen: list[Scenario], point: str, kinds: tuple[str, ...], space: Workspace
) -> list[Verdict]:
    """One point SIGKILLed in a child (``kill``) or on one of two ranks (``kill-ranks``)."""
    import killed

    verdicts = []
    for scenario in chosen:
        if "kill" in kinds:
            verdicts.append(killed.explore_killed(scenario, point, space))
        if "kill-ranks" in kinds:
            verdicts.append(killed.explore_killed_ranks(scenario, point, space))
    return verdicts


def _killed_samples(
    chosen: list[Scenario], one: int, two: int, seed: int, space: Workspace
) -> list[Verdict]:
    """Seeded samples of points SIGKILLed in a child process, and on one of two ranks (saves
    on the local folder only: a data object's commit or a manifest's put)."""
    if not (one or two):
        return []
    import killed

    local = [s for s in chosen if s.backend == "local"]
    verdicts = killed.sample_killed(local, one, seed, space) if one else []
    if two:
        saves = [s for s in local if s.op == "saves"]
        verdicts += killed.sample_killed_ranks(saves, two, seed, space, among=killed.save_point)
    return verdicts


def _upload_at(
    chosen: list[Scenario], point: str, kinds: tuple[str, ...], space: Workspace
) -> list[Verdict]:
    """One point of DCP's upload process (rank ``0u``), for each kind asked."""
    import upload_process

    return [
        upload_process.explore_upload_point(scenario, point, kind, space)
        for scenario in chosen
        for kind in kinds
        if kind in upload_process.KINDS
    ]


def _upload_sample(n: int, seed: int, space: Workspace) -> list[Verdict]:
    """A seeded sample of `n` (scenario, point, kind) in the upload process of process-mode
    asynchronous saves (each replay restarts that process: seconds a point)."""
    if not n:
        return []
    import upload_process

    items = []
    for scenario in upload_process.SCENARIOS:
        for point in upload_process.upload_points(scenario, space):
            mutates = point.split(":")[1] in MUTATING
            kinds = [k for k in upload_process.KINDS if k != "lost" or mutates]
            items += [(scenario, point, kind) for kind in kinds]
    picked = random.Random(seed).sample(items, min(n, len(items)))
    return [upload_process.explore_upload_point(s, p, k, space) for s, p, k in picked]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sample", type=int, help="explore a seeded sample of N points")
    parser.add_argument("--seed", type=int, default=46)
    parser.add_argument("--scenario", action="append", help="scenario id (repeatable)")
    parser.add_argument("--point", help="one point's name (with --scenario and --kind)")
    parser.add_argument("--kind", action="append", choices=(*POINT_KINDS, "kill", "kill-ranks"))
    parser.add_argument("--workdir", help="where roots are built (default: a temporary folder)")
    parser.add_argument("--json", help="write every verdict to this file")
    parser.add_argument(
        "--backend", action="append", choices=NAMES, help="store back end (repeatable; local)"
    )
    parser.add_argument(
        "--kill-sample", type=int, default=0, help="also N points SIGKILLed in a child process"
    )
    parser.add_argument(
        "--kill-ranks-sample", type=int, default=0, help="also N points SIGKILLed on 1 of 2 ranks"
    )
    parser.add_argument(
        "--server-sample",
        type=int,
        help="at most N seeded points per server back end (all by default)",
    )
    parser.add_argument(
        "--upload-sample",
        type=int,
        default=0,
        help="also N points in the upload process of async_mode='process' saves",
    )
    args = parser.parse_args(argv)
    named = [Scenario.parse(s) for s in args.scenario or ()]
    backends = usable([*(args.backend or ["local"]), *(s.backend for s in named)])
    chosen = [s for s in named if s.backend in backends] if named else scenarios(backends)
    kinds = tuple(args.kind) if args.kind else ALL_KINDS
    with (
        Backends(backends) as started,
        tempfile.TemporaryDirectory(prefix="spotckpt-crash-", dir=args.workdir) as folder,
    ):
        space = Workspace.create(Path(folder), started)
        if args.point and args.point.split(":", 1)[0].endswith("u"):
            verdicts = _upload_at(chosen, args.point, kinds, space)
        elif args.point and set(kinds) & {"kill", "kill-ranks"}:
            verdicts = _killed_at(chosen, args.point, kinds, space)
        else:
            verdicts = []
            try:
                todo = plan(
                    chosen,
                    tuple(k for k in kinds if k in POINT_KINDS),
                    space,
                    args.sample,
                    args.seed,
                    args.server_sample,
                )
                if args.point:
                    todo.items = [item for item in todo.items if item[1].name == args.point]
                    if not todo.items:
                        parser.error(f"no point named {args.point!r} in {[s.id for s in chosen]}")
                explore(todo, space, progress=True, verdicts=verdicts)
                verdicts += _killed_samples(
                    chosen, args.kill_sample, args.kill_ranks_sample, args.seed, space
                )
                verdicts += _upload_sample(args.upload_sample, args.seed, space)
            except KeyboardInterrupt:  # SIGINT: report what was explored so far
                print(f"interrupted after {len(verdicts)} points", file=sys.stderr)
    if args.json:
        Path(args.json).write_text(json.dumps([v.__dict__ for v in verdicts], indent=1))
    for line in report(verdicts):
        print(line)
    return 1 if any(v.violations for v in verdicts) else 0


if __name__ == "__main__":
    logging.getLogger("spotckpt").setLevel(logging.CRITICAL)  # faults make it warn on purpose
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # a stopped run still reports
    sys.exit(main())
