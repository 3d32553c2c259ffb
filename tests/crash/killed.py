"""The crash explorer's killed-process sample (fault kind ``kill``): a point replayed in a real
process that SIGKILLs itself at the named call, on one rank or on one of 2 gloo ranks (whose
survivor must give up within a lowered `collective_timeout_s`); the root it leaves is then
recovered and checked in this process, as `explore` does for the in-process kinds.

``python tests/crash/killed.py child ARGS_JSON`` is the one-rank job; ``killed.py ranks RANK
WORLD PORT ARGS_JSON`` the rank script (`dist_worker.launch_ranks`). Both write every mark the
moment it happens (JSON lines, fsynced): what the job was told before it died is what the
recovery must honour. The parent starts them as forks of the preloaded rank server
(`preloaded.PreloadedProcess`): real processes, without paying torch's import each time.
"""

from __future__ import annotations

import json
import logging
import os
import random
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
for folder in (HERE, HERE.parent, HERE.parent / "seams", HERE.parents[1]):
    if str(folder) not in sys.path:
        sys.path.insert(0, str(folder))

import pytest  # noqa: E402
import scenarios  # noqa: E402
import seam_run  # noqa: E402
from explore import Verdict, Workspace, expectation, record, recover  # noqa: E402
from recorder import TIER, Call, Fault, Mark, RecordingStore, TierRecorder, Trace  # noqa: E402
from scenarios import Root, Scenario  # noqa: E402

from dist_worker import launch_ranks  # noqa: E402
from preloaded import PreloadedProcess  # noqa: E402

KIND = "kill"
RANKS_KIND = "kill-ranks"
"""The kind of a point killed on one of `WORLD` ranks (its reproducer differs)."""
COLLECTIVE_TIMEOUT_S = 20.0
"""The ranks' `collective_timeout_s`: a survivor gives up on its dead peer after this."""
CHILD_TIMEOUT_S = 180.0
"""A one-rank child that runs longer has hung (a whole fault-free run takes a few seconds)."""
RANKS_TIMEOUT_S = 240.0
"""A rank still running after this has hung: a survivor meets a few collectives that each
give up after `COLLECTIVE_TIMEOUT_S`."""
WORLD = 2


class MarkingTrace(Trace):
    """A trace that also writes each mark, and the kill, to `path` as they happen."""

    def __init__(self, fault: Fault | None, path: Path) -> None:
        super().__init__(fault)
        self._out = path.open("a", encoding="utf-8")

    def _write(self, line: dict[str, Any]) -> None:
        self._out.write(json.dumps(line) + "\n")
        self._out.flush()
        os.fsync(self._out.fileno())

    def mark(self, what: str, step: int) -> None:
        super().mark(what, step)
        self._write({"mark": what, "step": step, "seq": self.marks[-1].seq})

    def _apply(self, fault: Fault, call: Call) -> None:
        if fault.kind == KIND:  # the proof that the process died here, and not elsewhere
            self._write({"killing": call.name, "seq": call.seq})
        super()._apply(fault, call)


def read_marks(path: Path) -> tuple[list[Mark], str | None]:
    """The marks a job wrote, and the point it was killing itself at (None: it never did)."""
    marks: list[Mark] = []
    killing = None
    if not path.exists():
        return marks, killing
    for line in path.read_text(encoding="utf-8").splitlines():
        entry = json.loads(line)
        if "killing" in entry:
            killing = entry["killing"]
        else:
            marks.append(Mark(entry["seq"], entry["mark"], entry["step"]))
    return marks, killing


def save_point(name: str) -> bool:
    """A point where a save makes something visible: a data object's commit, a manifest put."""
    _, op, rest = name.split(":", 2)
    key = rest.rsplit("#", 1)[0]
    return key.startswith("step-") and (
        (op == "commit" and key.endswith(".safetensors"))
        or (op == "put" and key.endswith("/manifest.json"))
    )


# In the killed processes ----------------------------------------------------------------------


def _root(args: dict[str, Any]) -> Root:
    return Root(args["uri"], Path(args["folder"]), Path(args["key"]))


def child(raw: str) -> None:
    """The one-rank job: the scenario, killed at its point; what it saw if it was not."""
    args = json.loads(raw)
    job = Path(args["job"])
    trace = MarkingTrace(Fault(args["point"], KIND), job / "marks-0.jsonl")
    outcome = scenarios.run(Scenario.parse(args["scenario"]), _root(args), trace)
    (job / "rank-0.json").write_text(json.dumps(outcome.__dict__))


@contextmanager
def _as_rank(rank: int, world: int, mesh: Any, timeout_s: float) -> Iterator[None]:
    """Make `scenarios.run` one rank of the job: its calls named by its rank, its own shard of
    each state, and collectives that give up after `timeout_s` (one scenario definition for
    every world size; this process is the rank's own)."""
    state, chosen = seam_run.state, scenarios.settings

    def ranked_store(inner: Any, trace: Trace, *rest: Any, **extra: Any) -> RecordingStore:
        if not rest:  # a store made without a rank: the scenario's own, on this rank
            extra.setdefault("rank", rank)
        return RecordingStore(inner, trace, *rest, **extra)

    def ranked_tier(trace: Trace, *rest: Any, **extra: Any) -> TierRecorder:
        if not rest:
            extra.setdefault("rank", rank)
        return TierRecorder(trace, *rest, **extra)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(seam_run, "state", lambda step, *_: state(step, world, rank, mesh))
        patch.setattr(scenarios, "RecordingStore", ranked_store)
        patch.setattr(scenarios, "TierRecorder", ranked_tier)
        patch.setattr(
            scenarios,
            "settings",
            lambda *a, **k: {**chosen(*a, **k), "collective_timeout_s": timeout_s},
        )
        yield


def ranks(rank: int, world: int, port: str, raw: str) -> None:
    """One rank of the job: the scenario (recorded, or killed on the point's rank)."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    args = json.loads(raw)
    job = Path(args["job"])
    timeout_s = float(args["timeout_s"])
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", rank=rank, world_size=world, timeout=timedelta(seconds=timeout_s)
    )
    mesh = init_device_mesh("cpu", (world,))
    point = args["point"]
    fault = Fault(point, KIND) if point and point.startswith(f"{rank}:") else None
    trace = MarkingTrace(fault, job / f"marks-{rank}.jsonl")
    started = time.monotonic()
    with _as_rank(rank, world, mesh, timeout_s):
        outcome = scenarios.run(Scenario.parse(args["scenario"]), _root(args), trace)
    seen = {
        **outcome.__dict__,
        "seconds": time.monotonic() - started,
        "points": [call.name for call in trace.points()],
    }
    (job / f"rank-{rank}.json").write_text(json.dumps(seen))
    dist.destroy_process_group()


def main() -> None:
    logging.getLogger("spotckpt").setLevel(logging.CRITICAL)  # faults make it warn on purpose
    if sys.argv[1] == "child":
        child(sys.argv[2])
    else:  # the rank script: ``killed.py ranks RANK WORLD PORT ARGS_JSON``
        _, rank, world, port, raw = sys.argv[1:6]
        ranks(int(rank), int(world), port, raw)


# In the explorer's process --------------------------------------------------------------------


def _job(root: Root, scenario: Scenario, point: str | None) -> dict[str, Any]:
    job = root.folder / "job"
    job.mkdir()
    return {
        "scenario": scenario.id,
        "point": point,
        "uri": root.uri,
        "folder": str(root.folder),
        "key": str(root.key),
        "job": str(job),
        "timeout_s": COLLECTIVE_TIMEOUT_S,
    }


def _env() -> dict[str, str]:
    paths = [str(HERE.parent), str(HERE.parents[1])]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(paths)}


def _killed_by_sigkill(status: int | None, point: str, killing: str | None, log: str) -> list[str]:
    if status == -signal.SIGKILL and killing == point:
        return []
    if status == -signal.SIGKILL:
        return [f"the job died by SIGKILL at {killing or 'no point'}, not at {point}"]
    return [f"the job exited {status}, not by SIGKILL at {point}: {log[-1500:]}"]


def _judge(
    scenario: Scenario, point: str, root: Root, marks: list[Mark], found: list[str]
) -> Verdict:
    """Recover the root against what the job was told before it died."""
    told = Trace()
    told.marks = sorted(marks, key=lambda mark: mark.seq)
    expect = expectation(scenario, told, sys.maxsize)
    seen = recover(scenario, root, expect)
    return Verdict(scenario.id, point, KIND, found + seen.violations, seen.restored)


@dataclass
class Killed:
    """How a killed one-rank job ended."""

    status: int | None
    log: str
    marks: list[Mark]
    killing: str | None
    """The point it was SIGKILLing itself at (None: it never reached one)."""
    hung: bool


def kill_child(
    scenario: Scenario, root: Root, point: str, timeout_s: float = CHILD_TIMEOUT_S
) -> Killed:
    """Run the scenario on `root` in a child that SIGKILLs itself at `point`; killed if it runs
    past `timeout_s`."""
    args = _job(root, scenario, point)
    process = PreloadedProcess([__file__, "child", json.dumps(args)], _env())
    hung = False
    try:
        log, _ = process.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        process.kill()
        log, _ = process.communicate(timeout=timeout_s)
        hung = True
    marks, killing = read_marks(Path(args["job"], "marks-0.jsonl"))
    return Killed(process.returncode, log, marks, killing, hung)


def explore_killed(
    scenario: Scenario, point: str, space: Workspace, timeout_s: float = CHILD_TIMEOUT_S
) -> Verdict:
    """Kill a one-rank job at `point` (`kill_child`); recover what it left and check it."""
    root = space.fresh(scenario)
    ended = kill_child(scenario, root, point, timeout_s)
    found = [f"the job was still running after {timeout_s:.0f} s"] if ended.hung else []
    found += _killed_by_sigkill(ended.status, point, ended.killing, ended.log)
    verdict = _judge(scenario, point, root, ended.marks, found)
    space.discard(root)
    return verdict


def _launch(
    scenario: Scenario, root: Root, point: str | None, timeout_s: float
) -> tuple[list[subprocess.CompletedProcess[str]] | None, dict[str, Any]]:
    if scenario.op != "saves":
        raise ValueError(f"{scenario.id}: only the saves operation runs on {WORLD} ranks")
    args = _job(root, scenario, point)
    try:
        results = launch_ranks(WORLD, "ranks", args, timeout_s, worker=__file__)
    except subprocess.TimeoutExpired:  # launch_ranks killed every rank
        return None, args
    return results, args


def record_ranks(scenario: Scenario, space: Workspace) -> list[str]:
    """The points of a fault-free run on `WORLD` ranks (every rank's, rank by rank)."""
    root = space.fresh(scenario)
    results, args = _launch(scenario, root, None, RANKS_TIMEOUT_S)
    if results is None:
        raise RuntimeError(f"{scenario.id} on {WORLD} ranks hung without a fault")
    points = []
    for rank, result in enumerate(results):
        seen_path = Path(args["job"], f"rank-{rank}.json")
        if result.returncode != 0 or not seen_path.exists():
            raise RuntimeError(
                f"{scenario.id} rank {rank} exited {result.returncode}: {result.stdout[-3000:]}"
            )
        seen = json.loads(seen_path.read_text())
        if seen["error"]:
            raise RuntimeError(f"{scenario.id} rank {rank} fails without a fault: {seen['error']}")
        points += [name for name in seen["points"] if not _tier_write(name)]
    space.discard(root)
    return points


def explore_killed_ranks(
    scenario: Scenario, point: str, space: Workspace, timeout_s: float = RANKS_TIMEOUT_S
) -> Verdict:
    """Run the scenario's saves on `WORLD` ranks, the point's rank SIGKILLing itself at it; the
    survivor must give up (a spotckpt error, no hang); recover what they left."""
    root = space.fresh(scenario)
    results, args = _launch(scenario, root, point, timeout_s)
    job = Path(args["job"])
    killed = int(point.split(":", 1)[0])
    found = []
    if results is None:
        found.append(f"a rank was still running after {timeout_s:.0f} s (the survivor hung)")
    marks: list[Mark] = []
    for rank in range(WORLD):
        rank_marks, killing = read_marks(job / f"marks-{rank}.jsonl")
        marks += rank_marks
        if results is None:
            continue
        result = results[rank]
        if rank == killed:
            found += _killed_by_sigkill(result.returncode, point, killing, result.stdout)
            continue
        seen_path = job / f"rank-{rank}.json"
        if result.returncode != 0 or not seen_path.exists():
            found.append(
                f"surviving rank {rank} exited {result.returncode}: {result.stdout[-1500:]}"
            )
            continue
        seen = json.loads(seen_path.read_text())
        if seen["raw"]:
            found.append(f"a raw exception reached surviving rank {rank}: {seen['error']}")
    verdict = _judge(scenario, point, root, marks, found)
    verdict.kind = RANKS_KIND
    space.discard(root)
    return verdict


def _tier_write(name: str) -> bool:
    _, op, key = name.split(":", 2)
    return op == "write" and key.startswith(TIER)


def sample_killed(
    chosen: list[Scenario],
    n: int,
    seed: int,
    space: Workspace,
    among: Callable[[str], bool] | None = None,
) -> list[Verdict]:
    """A seeded sample of `n` (scenario, point) pairs of the scenarios' fault-free recordings
    (`among` narrows the points by name), each run in a killed child."""
    pairs = []
    for scenario in chosen:
        recorded = record(scenario, space)
        names = [call.name for call in recorded.points()]
        pairs += [(scenario, name) for name in names if _eligible(name, among)]
        space.discard(recorded.root)
    picked = random.Random(seed).sample(pairs, min(n, len(pairs)))
    return [explore_killed(scenario, point, space) for scenario, point in picked]


def sample_killed_ranks(
    chosen: list[Scenario],
    n: int,
    seed: int,
    space: Workspace,
    among: Callable[[str], bool] | None = None,
) -> list[Verdict]:
    """The same on `WORLD` ranks: the points of the scenarios' saves from fault-free runs on
    `WORLD` ranks (each scenario's operation becomes ``saves``)."""
    pairs = []
    for saves in dict.fromkeys(Scenario(s.features, "saves", s.backend) for s in chosen):
        names = record_ranks(saves, space)
        pairs += [(saves, name) for name in names if _eligible(name, among)]
    picked = random.Random(seed).sample(pairs, min(n, len(pairs)))
    return [explore_killed_ranks(scenario, point, space) for scenario, point in picked]


def _eligible(name: str, among: Callable[[str], bool] | None) -> bool:
    return not _tier_write(name) and (among is None or among(name))


if __name__ == "__main__":
    main()
