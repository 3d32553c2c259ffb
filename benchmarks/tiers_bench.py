"""Fast-tier benchmarks (issue 15): the tier against the object store, measured in one run.

    python benchmarks/run.py --only 'tiers/*'            # this section alone (3 repetitions)
    python benchmarks/run.py --quick --only 'tiers/*'    # a few MiB, 1 repetition

Three parts, each in processes of its own (this file is also their entry point, as
``python tiers_bench.py single ARGS`` and ``python tiers_bench.py node SCENARIO RANK ...``):

- ``tiers/single``, one process, per repetition: a raw write of the state's bytes to the same
  disk as `local_dir` (one ``write``, no fsync: the tier does not fsync either), a fast save
  (`maybe_save` with ``local_interval_steps=1``: the tier only), a durable save of the same step
  to the bucket (a manager without `local_dir`), a raw read, a fast restore and a restore from
  the bucket; then an ``async_save=True`` fast save: the time until `maybe_save` returns (the
  training loop's stall) and until the tier committed. ``os.sync()`` runs before each timed
  operation, so that none pays for the previous one's dirty pages.
- ``tiers/nodes/replicate:2`` (4 nodes) and ``tiers/nodes/ec:2+1`` (3 nodes): one gloo rank
  process per "node" (its own ``SPOTCKPT_NODE`` and folder), each with its own part of the
  state (different keys per rank, as FSDP shards are). Fast saves and durable saves of the same
  steps; then one rank is killed by SIGKILL and its folder deleted; a fresh job on as many
  nodes (the lost one comes back empty) restores from the surviving copies, then from the
  bucket (a manager without `local_dir`), each repetition after deleting that node's folder
  again. Times are job-wide (barrier to barrier); bytes per source are
  `mgr.last_restore_sources` (job-wide sums).

Every restore is checked against the saved values. Results are plain data for `bench_report`.
"""

from __future__ import annotations

import contextlib
import fnmatch
import json
import logging
import os
import shutil
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from datetime import timedelta
from functools import partial
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

from bench_servers import BUCKET, delete_prefix, free_port  # noqa: E402
from bench_units import GIB, MIB, StateSpec  # noqa: E402

SINGLE_ID = "tiers/single"
NODE_RUNS = (("replicate:2", 4, 2), ("ec:2+1", 3, 1))  # redundancy, nodes, index of the lost one
COLLECTIVE_TIMEOUT_S = 600
WORKER = Path(__file__).resolve()
"""The script the rank processes run (another benchmark may wrap these workers in its own)."""


@dataclass
class TierSettings:
    """Sizes and repetitions of the fast-tier section."""

    single_bytes: int
    node_bytes: int  # per rank
    reps: int
    part_size: int
    concurrency: int
    timeout_scale: float


def part_ids() -> list[str]:
    """Ids of the section's parts, for ``--only`` globs."""
    return [SINGLE_ID, *(f"tiers/nodes/{spec}" for spec, _, _ in NODE_RUNS)]


def wanted(only: list[str]) -> list[str]:
    """The parts that ``--only`` selects (all without a filter)."""
    ids = part_ids()
    return ids if not only else [i for i in ids if any(fnmatch.fnmatch(i, p) for p in only)]


# The parent: launching and collecting ----------------------------------------------------------


def run_tiers(
    settings: TierSettings,
    store: str,
    endpoint: str,
    prefix: str,
    workdir: Path,
    parts: list[str],
) -> dict[str, Any]:
    """Run the selected parts against the bucket at `endpoint`; their results as plain data."""
    began = time.monotonic()
    load_before = os.getloadavg()
    common = {
        "endpoint": endpoint,
        "bucket": BUCKET,
        "reps": settings.reps,
        "part_size": settings.part_size,
        "concurrency": settings.concurrency,
    }
    results = []
    if SINGLE_ID in parts:
        print(f"  {SINGLE_ID} ({settings.single_bytes / MIB:.0f} MiB)", flush=True)
        args = {**common, "bytes": settings.single_bytes, "prefix": f"{prefix}/single"}
        results.append(_with_load(partial(_single_part, settings, args, workdir / "single")))
    for spec, count, lost in NODE_RUNS:
        part_id = f"tiers/nodes/{spec}"
        if part_id not in parts:
            continue
        print(
            f"  {part_id} ({count} nodes x {settings.node_bytes / MIB:.0f} MiB, node{lost} lost)",
            flush=True,
        )
        name = "nodes-" + spec.replace(":", "-").replace("+", "-")
        args = {
            **common,
            "bytes_per_rank": settings.node_bytes,
            "redundancy": spec,
            "lost": lost,
            "prefix": f"{prefix}/{name}",
        }
        run = partial(_nodes_part, settings, part_id, args, count, workdir / name)
        results.append(_with_load(run))
    return {
        "store": store,
        "endpoint": endpoint,
        "settings": asdict(settings),
        "load_before": load_before,
        "load_after": os.getloadavg(),
        "duration_s": time.monotonic() - began,
        "parts": results,
    }


def _timeout(settings: TierSettings, total_bytes: int) -> float:
    """A hang guard for one launch, never a performance bound."""
    return (240.0 + settings.reps * total_bytes / GIB * 900.0) * settings.timeout_scale


def _with_load(run: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """`run()`'s part, with the load averages before and after it; prints its medians."""
    before = os.getloadavg()
    part = run()
    part["load_before"], part["load_after"] = before, os.getloadavg()
    if part["status"] == "ok":
        medians = ", ".join(f"{k} {v:.3f}" for k, v in part["median"].items())
        print(f"  {part['id']}: medians {medians}", flush=True)
    else:
        print(f"  {part['id']}: {part['status']}: {part['error'][-1500:]}", flush=True)
    return part


def _single_part(settings: TierSettings, args: dict[str, Any], folder: Path) -> dict[str, Any]:
    folder.mkdir(parents=True, exist_ok=True)
    args = {**args, "workdir": str(folder), "out": str(folder / "single.json")}
    part: dict[str, Any] = {"id": SINGLE_ID, "kind": "single", "reps_planned": settings.reps}
    log = folder / "single.log"
    env = _environment("single")
    try:
        with open(log, "wb") as output:
            status = _wait_all(
                [_spawn(["single", json.dumps(args)], env, output)],
                _timeout(settings, settings.single_bytes),
            )[0]
        _finish_part(part, [status], [0], [log], Path(args["out"]))
    finally:
        _clean(folder, args["endpoint"], args["prefix"])
    return part


def _nodes_part(
    settings: TierSettings,
    part_id: str,
    args: dict[str, Any],
    count: int,
    folder: Path,
    worker: Path = WORKER,
) -> dict[str, Any]:
    nodes = [f"node{i}" for i in range(count)]
    (folder / "fast").mkdir(parents=True, exist_ok=True)
    args = {
        **args,
        "local_dir": str(folder / "fast" / "{node}"),
        "out": str(folder),
    }
    part: dict[str, Any] = {
        "id": part_id,
        "kind": "nodes",
        "redundancy": args["redundancy"],
        "nodes": count,
        "lost_node": nodes[args["lost"]],
        "reps_planned": settings.reps,
    }
    timeout = _timeout(settings, args["bytes_per_rank"] * count)
    try:
        logs = [folder / f"save-{node}.log" for node in nodes]
        statuses = _launch(nodes, "save", args, logs, timeout, worker)
        expected = [-signal.SIGKILL if i == args["lost"] else 0 for i in range(count)]
        if statuses != expected:
            _failed(part, statuses, expected, logs)
            return part
        shutil.rmtree(folder / "fast" / nodes[args["lost"]])  # the lost machine's disk
        logs = [folder / f"restore-{node}.log" for node in nodes]
        statuses = _launch(nodes, "restore", args, logs, timeout, worker)
        _finish_part(part, statuses, [0] * count, logs, folder / "restore.json")
        if part["status"] == "ok":
            saves = json.loads((folder / "save.json").read_text())
            part["reps"] = [
                {**save, **restore}
                for save, restore in zip(saves["reps"], part["reps"], strict=True)
            ]
            part["bytes_per_rank"] = saves["bytes_per_rank"]
            part["bytes"] = saves["bytes_per_rank"] * count
            part["tensors"] = saves["tensors"]
            part["median"] = _medians(part["reps"])
    finally:
        _clean(folder, args["endpoint"], args["prefix"])
    return part


def _environment(node: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPOTCKPT_")}
    return {**env, "SPOTCKPT_NODE": node}


def _spawn(
    argv: list[str], env: dict[str, str], output: Any, worker: Path = WORKER
) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, str(worker), *argv],
        env=env,
        stdout=output,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        start_new_session=True,
    )


def _launch(
    nodes: list[str],
    scenario: str,
    args: dict[str, Any],
    logs: list[Path],
    timeout: float,
    worker: Path = WORKER,
) -> list[int]:
    """One rank process per node, like torchrun on separate machines; their exit statuses."""
    port = str(free_port())
    processes = []
    with contextlib.ExitStack() as stack:
        for rank, node in enumerate(nodes):
            output = stack.enter_context(open(logs[rank], "wb"))
            argv = ["node", scenario, str(rank), str(len(nodes)), port, json.dumps(args)]
            processes.append(_spawn(argv, _environment(node), output, worker))
        return _wait_all(processes, timeout)


def _wait_all(processes: list[subprocess.Popen[bytes]], timeout: float) -> list[int]:
    """Wait for every process; on the timeout kill them all and report 124 for those."""
    deadline = time.monotonic() + timeout
    statuses = []
    try:
        for process in processes:
            try:
                statuses.append(process.wait(timeout=max(0.1, deadline - time.monotonic())))
            except subprocess.TimeoutExpired:
                statuses.append(124)
    finally:
        for process in processes:
            if process.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(process.pid, signal.SIGKILL)
                process.wait()
    return statuses


def _finish_part(
    part: dict[str, Any], statuses: list[int], expected: list[int], logs: list[Path], out: Path
) -> None:
    if statuses != expected or not out.exists():
        _failed(part, statuses, expected, logs)
        return
    data = json.loads(out.read_text())
    part.update(status="ok", **data)
    part["median"] = _medians(part["reps"])


def _failed(
    part: dict[str, Any], statuses: list[int], expected: list[int], logs: list[Path]
) -> None:
    timed_out = 124 in statuses
    part["status"] = "timeout" if timed_out else "error"
    part["reps"] = []
    wrong = [i for i, (s, e) in enumerate(zip(statuses, expected, strict=True)) if s != e]
    where = wrong[0] if wrong else 0
    tail = logs[where].read_text(errors="replace")[-3000:] if logs[where].exists() else ""
    part["error"] = f"exit statuses {statuses} (expected {expected}); process {where}: {tail}"


def _medians(reps: list[dict[str, Any]]) -> dict[str, float]:
    keys = [k for k, v in reps[0].items() if isinstance(v, (int, float))] if reps else []
    return {k: statistics.median(float(r[k]) for r in reps) for k in keys}


def _clean(folder: Path, endpoint: str, prefix: str) -> None:
    """After a part (its results and logs already read): its objects and folders go."""
    delete_prefix(endpoint, BUCKET, prefix)
    shutil.rmtree(folder, ignore_errors=True)


# Workers (the code below runs in the child processes; they import torch) -----------------------


def _storage_options(args: dict[str, Any]) -> dict[str, Any]:
    return {
        "endpoint_url": args["endpoint"],
        "part_size": args["part_size"],
        "max_concurrency": args["concurrency"],
    }


def _tier_manager(args: dict[str, Any], uri: str, local_dir: str, **kwargs: Any) -> Any:
    """A manager whose `maybe_save` saves every step to the fast tier only."""
    from spotckpt import CheckpointManager

    return CheckpointManager(
        uri,
        local_dir=local_dir,
        local_interval_steps=1,
        interval_steps=None,
        preemption=False,
        storage_options=_storage_options(args),
        collective_timeout_s=COLLECTIVE_TIMEOUT_S,
        **kwargs,
    )


def _bucket_manager(args: dict[str, Any], uri: str) -> Any:
    """A manager on the same bucket without a fast tier."""
    from spotckpt import CheckpointManager

    return CheckpointManager(
        uri,
        preemption=False,
        storage_options=_storage_options(args),
        collective_timeout_s=COLLECTIVE_TIMEOUT_S,
    )


def _uri(args: dict[str, Any], suffix: str = "") -> str:
    return f"s3://{args['bucket']}/{args['prefix']}{suffix}"


def _fast_save(manager: Any, step: int, state: dict[str, Any]) -> None:
    """A fast-only save of `step`, to its end (`maybe_save` turns failures into warnings)."""
    if not manager.maybe_save(step, state):
        raise RuntimeError(f"maybe_save({step}) did not save")
    manager.wait()


def _in_tier(manager: Any, step: int) -> bool:
    """Whether this node's tier committed `step` (only node leaders commit)."""
    return not manager.tier.is_leader or step in manager.tier.catalog.steps()


def _restore(manager: Any, dest: dict[str, Any]) -> tuple[int | None, dict[str, int]]:
    step = manager.restore(dest)
    return step, dict(manager.last_restore_sources)


def _zero(tensors: dict[str, Any]) -> None:
    for tensor in tensors.values():
        tensor.zero_()


# Worker: one process --------------------------------------------------------------------------


def _timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    """Seconds `fn` took (after an ``os.sync()``, outside the timing), and its result."""
    os.sync()
    started = time.perf_counter()
    value = fn()
    return time.perf_counter() - started, value


def _raw_write(path: Path, view: memoryview) -> None:
    with open(path, "wb", buffering=0) as file:
        file.write(view)


def _raw_read(path: Path, into: memoryview) -> int:
    with open(path, "rb", buffering=0) as file:
        return int(file.readinto(into) or 0)


@dataclass
class _Single:
    """What the single-process repetitions work on (built once)."""

    tensors: dict[str, Any]
    state: dict[str, Any]
    raw: Any  # the tensors' bytes back to back (a uint8 tensor)
    readback: Any
    dest: dict[str, Any]


def single(args: dict[str, Any]) -> None:
    """Part ``tiers/single`` (see the module docstring); its results go to ``args["out"]``."""
    import torch
    from bench_cases import build_state, flat_bytes, zeros_like_state

    torch.set_num_threads(max(1, os.cpu_count() or 1))
    tensors = build_state(StateSpec("large", size_bytes=args["bytes"]))
    raw = flat_bytes(tensors)
    work = _Single(
        tensors, {"model": tensors}, raw, torch.zeros_like(raw), zeros_like_state(tensors)
    )
    workdir = Path(args["workdir"])
    (workdir / "stall").mkdir(parents=True, exist_ok=True)
    stall = _tier_manager(
        args, _uri(args, "/stall"), str(workdir / "stall" / "{node}"), async_save=True
    )
    reps = []
    try:
        for rep in range(args["reps"]):
            measured = _single_rep(args, work, workdir / f"r{rep}", _uri(args, f"/r{rep}"))
            measured.update(_async_rep(stall, rep + 1, work.state))
            reps.append(measured)
            print(f"rep {rep}: {json.dumps(measured)}", flush=True)
    finally:
        stall.close()
    result = {"bytes": int(raw.numel()), "tensors": len(tensors), "reps": reps}
    Path(args["out"]).write_text(json.dumps(result))


def _single_rep(args: dict[str, Any], work: _Single, root: Path, uri: str) -> dict[str, Any]:
    """Raw write, fast save, bucket save, raw read, fast restore, bucket restore: seconds each."""
    import torch
    from bench_cases import same_state

    (root / "fast").mkdir(parents=True)
    local_dir, raw_path = str(root / "fast" / "{node}"), root / "raw.bin"
    m: dict[str, Any] = {}
    m["raw_write_s"], _ = _timed(partial(_raw_write, raw_path, memoryview(work.raw.numpy())))
    # The bucket's step 1 first, then the same state as step 2 in the fast tier only: a tier
    # step is used only when it is newer than the bucket's newest commit (or that very commit).
    with contextlib.closing(_bucket_manager(args, uri)) as bucket:
        m["bucket_save_s"], _ = _timed(partial(bucket.save, 1, work.state, blocking=True))
    with contextlib.closing(_tier_manager(args, uri, local_dir)) as tier:
        m["fast_save_s"], _ = _timed(partial(_fast_save, tier, 2, work.state))
        _check(_in_tier(tier, 2), "the fast save did not commit in the tier")
    into = memoryview(work.readback.numpy())
    m["raw_read_s"], got = _timed(partial(_raw_read, raw_path, into))
    _check(got == work.raw.numel() and torch.equal(work.readback, work.raw), "raw read differs")
    makers = {
        "fast": partial(_tier_manager, args, uri, local_dir),
        "bucket": partial(_bucket_manager, args, uri),
    }
    for source, make in makers.items():
        _zero(work.dest)
        with contextlib.closing(make()) as manager:
            seconds, (step, sources) = _timed(partial(_restore, manager, {"model": work.dest}))
        expected = 2 if source == "fast" else 1
        _check(
            step == expected and same_state(work.dest, work.tensors), f"{source} restore differs"
        )
        m[f"{source}_restore_s"], m[f"{source}_restore_sources"] = seconds, sources
    shutil.rmtree(root)
    return m


def _async_rep(manager: Any, step: int, state: dict[str, Any]) -> dict[str, float]:
    """An ``async_save=True`` fast save: until `maybe_save` returns, and until committed."""
    os.sync()
    started = time.perf_counter()
    _check(manager.maybe_save(step, state), "the async fast save did not start")
    stall = time.perf_counter() - started
    manager.wait()
    done = time.perf_counter() - started
    _check(_in_tier(manager, step), "the async fast save did not commit in the tier")
    return {"async_stall_s": stall, "async_done_s": done}


def _check(ok: bool, what: str) -> None:
    if not ok:
        raise RuntimeError(what)


# Worker: one rank of a multi-node job --------------------------------------------------------


def _rank_state(rank: int, nbytes: int) -> dict[str, Any]:
    """This rank's own part of the state: keys and values of its own (like FSDP shards)."""
    from bench_cases import build_state

    built = build_state(StateSpec("large", size_bytes=nbytes), seed=1234 + rank)
    return {f"rank{rank}.{key}": value for key, value in built.items()}


def job_timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    """Job-wide seconds of `fn`: from a barrier before it to a barrier after it."""
    import torch.distributed as dist

    os.sync()
    dist.barrier()
    started = time.perf_counter()
    value = fn()
    dist.barrier()
    return time.perf_counter() - started, value


def agree(ok: bool, what: str) -> None:
    """Raise on every rank when `ok` is false on any (no rank waits for a failed one)."""
    import torch.distributed as dist

    flags: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(flags, ok)
    bad = [rank for rank, flag in enumerate(flags) if not flag]
    if bad:
        raise RuntimeError(f"{what} on rank(s) {bad}")


def node_save(rank: int, world: int, args: dict[str, Any]) -> None:
    """Durable saves of steps 1..reps, fast saves of steps reps+1..2*reps; then the lost rank
    dies by SIGKILL."""
    import torch.distributed as dist
    from bench_cases import state_bytes

    tensors = _rank_state(rank, args["bytes_per_rank"])
    state = {"model": tensors}
    tier = _tier_manager(args, _uri(args), args["local_dir"], redundancy=args["redundancy"])
    bucket = _bucket_manager(args, _uri(args))
    reps = []
    for step in range(1, args["reps"] + 1):
        # The bucket's step first, then the same state as a newer step in the fast tier only:
        # a tier step is used only when it is newer than the bucket's newest commit.
        durable, _ = job_timed(partial(bucket.save, step, state, blocking=True))
        fast_step = args["reps"] + step
        fast, _ = job_timed(partial(_fast_save, tier, fast_step, state))
        agree(_in_tier(tier, fast_step), f"the fast save of step {fast_step} is not in the tier")
        reps.append({"fast_save_s": fast, "bucket_save_s": durable})
        print(f"step {step}: {json.dumps(reps[-1])}", flush=True)
    tier.close()
    bucket.close()
    if rank == 0:
        saved = {"reps": reps, "bytes_per_rank": state_bytes(tensors), "tensors": len(tensors)}
        (Path(args["out"]) / "save.json").write_text(json.dumps(saved))
    dist.barrier()
    sys.stdout.flush()
    if rank == args["lost"]:
        os.kill(os.getpid(), signal.SIGKILL)  # no cleanup, like a machine that went away
    os._exit(0)  # the process group has a dead member now: leave without a word


def node_restore(rank: int, world: int, args: dict[str, Any]) -> None:
    """After the loss: restore from the surviving copies, then from the bucket, `reps` times."""
    from bench_cases import same_state, zeros_like_state

    tensors = _rank_state(rank, args["bytes_per_rank"])
    dest = zeros_like_state(tensors)
    node_dir = Path(args["local_dir"].replace("{node}", os.environ["SPOTCKPT_NODE"]))
    makers = {
        "peer": partial(
            _tier_manager, args, _uri(args), args["local_dir"], redundancy=args["redundancy"]
        ),
        "bucket": partial(_bucket_manager, args, _uri(args)),
    }
    reps = []
    for rep in range(args["reps"]):
        if rep > 0 and rank == args["lost"]:
            shutil.rmtree(node_dir)  # lost again: the previous restore filled it back
        measured: dict[str, Any] = {}
        for source, make in makers.items():
            _zero(dest)
            with contextlib.closing(make()) as manager:
                seconds, (step, sources) = job_timed(partial(_restore, manager, {"model": dest}))
            expected = args["reps"] if source == "bucket" else 2 * args["reps"]
            agree(step == expected and same_state(dest, tensors), f"{source} restore differs")
            measured[f"{source}_restore_s"] = seconds
            measured[f"{source}_restore_sources"] = sources
        reps.append(measured)
        print(f"rep {rep}: {json.dumps(measured)}", flush=True)
    if rank == 0:
        (Path(args["out"]) / "restore.json").write_text(json.dumps({"reps": reps}))


NODE_SCENARIOS = {"save": node_save, "restore": node_restore}


def main(argv: list[str]) -> None:
    """Worker entry: ``single ARGS`` or ``node SCENARIO RANK WORLD PORT ARGS``."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    if argv[0] == "single":
        single(json.loads(argv[1]))
        return
    import torch
    import torch.distributed as dist

    scenario, rank, world, port, raw = argv[1:6]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        rank=int(rank),
        world_size=int(world),
        timeout=timedelta(seconds=COLLECTIVE_TIMEOUT_S),
    )
    NODE_SCENARIOS[scenario](int(rank), int(world), json.loads(raw))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1:])
