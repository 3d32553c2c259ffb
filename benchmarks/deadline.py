"""The emergency-save campaign: does a preemption cost at most the step in flight where the
deadline model said the save fits, and was the user warned ahead where it said it does not?

    python benchmarks/deadline.py --quick          # a few runs, under 10 minutes
    python benchmarks/deadline.py                  # about 40 runs (make test-all's campaign)

Each run is a real training job of 2-4 rank processes in a gloo group, one per simulated node:
each node reaches moto's S3 server through its own `CloudProxy` (benchmarks/cloud_model.py)
whose per-node link is scaled down (a few MiB/s) so that the link, not the window, is what
binds, with per-rank states of several sizes: some fit the window, some do not. Saves are
asynchronous on an interval, so a notice may come during a periodic upload. Once the first save
committed, at a random moment a notice comes: SIGTERM to the ranks of one node, or of two at
once, with `save_budget_s` set to the run's real window (30 s, or 120 s without ``--quick``).
Exactly at the deadline every process still alive is SIGKILLed. Then the bucket is read:

- `fit`: rank 0's `CheckpointManager.emergency_estimate()` at the last step before the notice;
- `lost`: the newest step any rank had reached at the notice, less the newest committed step
  (0 or less: nothing lost beyond the step in flight);
- `warned`: an ``unfit`` event was recorded before the notice;
- `intact`: the newest committed step verifies (every byte against its manifest).

The last line reads ``runs: R, lost beyond the step in flight where it fit: L, warned ahead where
it did not fit: W of X, trusted half-written steps: H`` (targets: L = 0, W = X, H = 0).
Nothing here contacts a non-loopback address.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

from bench_servers import (  # noqa: E402
    BUCKET,
    FAKE_ENV,
    MotoServer,
    apply_fake_env,
    delete_prefix,
    free_port,
)
from cloud_model import MIB, CloudProxy, Profile  # noqa: E402

LINK_BYTES_PER_S = 2 * MIB
"""Each node's link to the bucket: low enough that a state of tens of MiB takes the window."""
STEP_S = 0.2
"""The training step's time (a sleep: the ranks share this machine's two cores)."""
INTERVAL_STEPS = 10
QUICK_RUNS = (  # (nodes, MiB per rank, window s, nodes noticed)
    (2, 6, 30.0, 1),
    (2, 20, 30.0, 2),
    (2, 64, 30.0, 1),
)


@dataclass
class Run:
    """One run's set-up and outcome."""

    number: int
    nodes: int
    mib: int
    window_s: float
    noticed: int
    estimate_s: float | None = None
    route: str = ""
    fit: bool | None = None
    warned: bool = False
    uploading: bool = False
    step_at_notice: int = 0
    committed: int | None = None
    lost: int = 0
    intact: bool = True
    exits: str = ""
    seconds: float = 0.0


def plan(quick: bool, seed: int) -> list[Run]:
    """The quick set, or about 40 seeded runs over node counts, sizes and both windows."""
    if quick:
        return [Run(i, *shape) for i, shape in enumerate(QUICK_RUNS, 1)]
    rng = random.Random(seed)
    runs = []
    for number in range(1, 41):
        window = 30.0 if number % 3 else 120.0
        nodes = rng.choice((2, 3, 4))
        budget_mib = int(LINK_BYTES_PER_S * window / MIB)  # what the link moves in the window
        mib = max(2, int(budget_mib * rng.choice((0.15, 0.4, 0.6, 1.3))))
        runs.append(Run(number, nodes, mib, window, rng.choice((1, 1, 2))))
    return runs


# The rank process -------------------------------------------------------------------------


def rank_main(args: dict[str, Any]) -> None:
    """One rank: train (a sleep per step), save on the interval, stop at a notice (exit 75)."""
    import torch
    import torch.distributed as dist

    from spotckpt import PREEMPTED_EXIT_CODE, CheckpointManager

    rank, out = int(os.environ["RANK"]), Path(args["out"])
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    manager = CheckpointManager(
        args["uri"],
        storage_options={
            "endpoint_url": args["endpoint"],
            "max_concurrency": 2,
            "part_size": 5 * MIB,
        },
        save_budget_s=args["window_s"],
        interval_steps=INTERVAL_STEPS,
        async_save=True,
        keep_last=None,
        # DCP's write phase ends in a collective: the ranks whose upload ended first wait there
        # for the slowest, which may take several times the link's time for the largest state.
        collective_timeout_s=60.0 + 3 * args["mib"] * MIB / LINK_BYTES_PER_S,
        progress_interval_s=None,
    )
    generator = torch.Generator().manual_seed(rank)
    state = {"w": torch.rand(args["mib"] * MIB // 4, generator=generator)}
    with open(out / f"rank-{rank}.jsonl", "a", buffering=1) as progress:
        for step in range(1, 100_000):
            time.sleep(STEP_S)
            state["w"][step % state["w"].numel()] += 1.0
            reached = time.time()
            manager.maybe_save(step, state)
            if manager.should_stop():
                manager.close()
                os._exit(PREEMPTED_EXIT_CODE)  # the gloo group is not torn down at an eviction
            seconds, route = estimate = manager.emergency_estimate()  # what a notice now meets
            line = {
                "step": step,
                "t": reached,
                "estimate_s": seconds,
                "route": route,
                "fits": estimate.fits,
                "uploading": manager._saver.pending is not None,
            }
            progress.write(json.dumps(line) + "\n")


# The campaign -----------------------------------------------------------------------------


def _lines(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    lines = []
    for text in path.read_text().splitlines():
        with contextlib.suppress(ValueError):
            lines.append(json.loads(text))
    return lines


def _wait_for_an_estimate(
    out: Path, processes: list[subprocess.Popen[bytes]], limit: float
) -> bool:
    """Until rank 0 has an emergency estimate (its first save committed), or a rank died."""
    end = time.monotonic() + limit
    while time.monotonic() < end:
        if any(line["estimate_s"] is not None for line in _lines(out / "rank-0.jsonl")):
            return True
        if any(p.poll() is not None for p in processes):
            return False
        time.sleep(0.2)
    return False


def run_one(run: Run, server: MotoServer, work: Path, rng: random.Random) -> Run:
    """Start the ranks, send the notice, SIGKILL at the deadline, read the bucket."""
    from spotckpt.catalog import Catalog
    from spotckpt.goodput import EventLog
    from spotckpt.storage.s3 import open_s3_store
    from spotckpt.verify import verify_checkpoint

    started = time.monotonic()
    out = work / f"run-{run.number}"
    out.mkdir()
    prefix = f"deadline/run-{run.number}-{os.urandom(4).hex()}"
    uri = f"s3://{BUCKET}/{prefix}"
    profile = Profile("deadline", None, LINK_BYTES_PER_S, 0.01, None, None)
    proxies = [CloudProxy(server.endpoint, profile) for _ in range(run.nodes)]
    port = free_port()
    processes = []
    for rank, proxy in enumerate(proxies):
        env = {
            **os.environ,
            **FAKE_ENV,
            "RANK": str(rank),
            "WORLD_SIZE": str(run.nodes),
            "LOCAL_RANK": "0",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "PYTHONPATH": os.pathsep.join([str(HERE), str(HERE.parent)]),
        }
        config = {**asdict(run), "uri": uri, "endpoint": proxy.endpoint, "out": str(out)}
        with open(out / f"rank-{rank}.log", "wb") as log:
            processes.append(
                subprocess.Popen(
                    [sys.executable, __file__, "--rank", json.dumps(config)],
                    env=env,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
            )
    store = open_s3_store(uri, {"endpoint_url": server.endpoint})
    try:
        if not _wait_for_an_estimate(out, processes, 240 + 3 * run.window_s):
            run.exits = "no first commit: " + _tail(out / "rank-0.log")
            return run
        # A random moment after the first commit: within the next interval or two, so that
        # some notices come during a periodic upload.
        time.sleep(rng.uniform(0.5, 2 * INTERVAL_STEPS * STEP_S))
        noticed = rng.sample(range(run.nodes), run.noticed)
        notice = time.time()
        deadline = time.monotonic() + run.window_s
        for rank in noticed:
            with contextlib.suppress(ProcessLookupError):
                os.kill(processes[rank].pid, signal.SIGTERM)
        while time.monotonic() < deadline and any(p.poll() is None for p in processes):
            time.sleep(0.05)
        for process in processes:  # exactly at the deadline: whatever is left dies
            if process.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(process.pid, signal.SIGKILL)
        codes = [process.wait(30) for process in processes]
        run.exits = ",".join(str(code) for code in codes)
        _read_outcome(run, out, notice, Catalog(store), EventLog(store), verify_checkpoint, store)
    finally:
        for process in processes:
            if process.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(process.pid, signal.SIGKILL)
                process.wait(30)
        for proxy in proxies:
            proxy.close()
        store.close()
        delete_prefix(server.endpoint, BUCKET, prefix)  # moto holds every object in memory
        run.seconds = time.monotonic() - started
    return run


def _read_outcome(
    run: Run,
    out: Path,
    notice: float,
    catalog: Any,
    events: Any,
    verify: Any,
    store: Any,
) -> None:
    before = [
        line
        for rank in range(run.nodes)
        for line in _lines(out / f"rank-{rank}.jsonl")
        if line["t"] < notice
    ]
    run.step_at_notice = max((line["step"] for line in before), default=0)
    mine = [line for line in _lines(out / "rank-0.jsonl") if line["t"] < notice]
    if mine:
        last = mine[-1]
        run.estimate_s, run.route, run.fit = last["estimate_s"], last["route"], last["fits"]
        run.uploading = last["uploading"]
    steps = catalog.steps()
    run.committed = steps[-1] if steps else None
    run.lost = run.step_at_notice - (run.committed or 0)
    run.intact = run.committed is None or verify(store, run.committed).ok
    run.warned = any(
        event.get("kind") == "unfit" and _epoch(event.get("time")) < notice
        for event in _events(events)
    )


def _events(log: Any) -> list[dict[str, Any]]:
    found = []
    for key in log.event_keys():
        event, _ = log._read_one(key)
        if event is not None:
            found.append(event)
    return found


def _epoch(stamp: Any) -> float:
    try:
        return datetime.fromisoformat(str(stamp).replace("Z", "+00:00")).timestamp()
    except ValueError:
        return float("inf")


def _tail(path: Path) -> str:
    return path.read_text(errors="replace")[-2000:] if path.exists() else ""


def report(runs: list[Run]) -> list[str]:
    """The table and the closing line."""
    lines = [
        "| run | nodes | MiB/rank | window | noticed | estimate | route | fit | warned | "
        "during upload | step at notice | committed | lost | intact | exits | s |",
        "|---:|---:|---:|---:|---:|---:|---|---|---|---|---:|---:|---:|---|---|---:|",
    ]
    for r in runs:
        estimate = "-" if r.estimate_s is None else f"{r.estimate_s:.1f}"
        lines.append(
            f"| {r.number} | {r.nodes} | {r.mib} | {r.window_s:g} | {r.noticed} | {estimate} | "
            f"{r.route} | {r.fit} | {r.warned} | {r.uploading} | {r.step_at_notice} | "
            f"{r.committed} | {r.lost} | {r.intact} | {r.exits} | {r.seconds:.0f} |"
        )
    failed = [r for r in runs if r.fit is None]
    if failed:
        lines.append(f"runs that never measured a save (failed): {[r.number for r in failed]}")
    lines.append(closing_line(runs))
    return lines


def closing_line(runs: list[Run]) -> str:
    """``runs: R, lost beyond ...: L, warned ahead ...: W of X, trusted half-written steps: H``."""
    fit = [r for r in runs if r.fit]
    unfit = [r for r in runs if r.fit is False]
    lost = sum(1 for r in fit if r.lost > 0)
    warned = sum(1 for r in unfit if r.warned)
    half = sum(1 for r in runs if not r.intact)
    return (
        f"runs: {len(runs)}, lost beyond the step in flight where it fit: {lost}, warned ahead "
        f"where it did not fit: {warned} of {len(unfit)}, trusted half-written steps: {half}"
    )


def missed(runs: list[Run]) -> bool:
    """Whether a target was missed: L > 0, W < X, H > 0, or a run that never measured."""
    return any(
        r.fit is None or (r.fit and r.lost > 0) or (r.fit is False and not r.warned) or not r.intact
        for r in runs
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a few runs, under 10 minutes")
    parser.add_argument("--seed", type=int, default=47)
    parser.add_argument("--json", help="write every run's figures to this file")
    parser.add_argument("--run", type=int, action="append", help="only these runs (repeatable)")
    parser.add_argument("--keep", help="keep the ranks' logs and progress under this folder")
    parser.add_argument("--rank", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.rank:
        rank_main(json.loads(args.rank))
        return 0
    apply_fake_env()
    runs = [r for r in plan(args.quick, args.seed) if not args.run or r.number in args.run]
    rng = random.Random(args.seed)
    with tempfile.TemporaryDirectory(prefix="spotckpt-deadline-") as folder:
        work = Path(args.keep or folder)
        work.mkdir(parents=True, exist_ok=True)
        server = MotoServer(work)
        server.start()
        try:
            for run in runs:
                run_one(run, server, work, rng)
                print(report([run])[2], flush=True)
        finally:
            server.stop()
    if args.json:
        Path(args.json).write_text(json.dumps([asdict(r) for r in runs], indent=1))
    for line in report(runs):
        print(line)
    return 1 if missed(runs) else 0


if __name__ == "__main__":
    sys.exit(main())
