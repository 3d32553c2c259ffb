"""What the ranks of a seam cell do (`seam_cells`), in the test's process or in gloo rank
processes (this file as the rank script, started through `dist_worker.launch_ranks`).

A phase saves the steps a cell starts from, or runs its operation, with the cell's features on;
it returns what it saw (the restored step and whether it is bit-exact, or the error), so that
the test checks the same things wherever the ranks ran. An error a phase meets is reported, never
raised past it: the test tells a spotckpt error (`CheckpointError`) from a raw one.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from seam_cells import Cell

from spotckpt import CheckpointManager, PreemptionWatcher
from spotckpt.errors import CheckpointError
from spotckpt.format.signing import Keyring
from spotckpt.gc import collect_garbage
from spotckpt.storage import open_store

from tests_support import AfterWrite, HeldStore

STEPS = (1, 2, 3)
"""The steps every cell starts from; its operation saves `NEXT`."""
NEXT = 5


def state(step: int, world: int = 1, rank: int = 0, mesh: Any = None) -> dict[str, Any]:
    """A step's state: a frozen tensor (referenced by incremental saves), a changing one, one
    sharded over the ranks (a DTensor where there are several), a pack of small tensors and
    values; every bit depends on `step` only, whatever the world size."""
    generator = torch.Generator().manual_seed(step)
    frozen = torch.Generator().manual_seed(1234)
    sharded = torch.randn(256, 64, generator=generator)
    model: dict[str, Any] = {
        "frozen": torch.randn(640, 512, generator=frozen),  # over 1 MiB: a chunk of its own
        "w": torch.randn(640, 512, generator=generator),
        "sharded": _shard(sharded, world, rank, mesh),
    }
    small = {f"s{i}": torch.randn(64, generator=generator) for i in range(20)}  # a pack
    return {"model": model, "small": small, "extra": {"note": f"step {step}", "seed": step}}


def blank(world: int = 1, rank: int = 0, mesh: Any = None) -> dict[str, Any]:
    """A state of the same shapes with other bits, to restore into."""
    zeros = state(0, world, rank, mesh)
    for group in ("model", "small"):
        for tensor in zeros[group].values():
            (tensor.to_local() if hasattr(tensor, "to_local") else tensor).fill_(7.0)
    zeros["extra"] = {"note": "", "seed": -1}
    return zeros


def _shard(full: torch.Tensor, world: int, rank: int, mesh: Any) -> Any:
    if mesh is None:
        return full
    from torch.distributed.tensor import DTensor, Shard

    local = full.chunk(world)[rank].clone()
    return DTensor.from_local(local, mesh, [Shard(0)], run_check=False)


def same(got: Any, expected: Any) -> bool:
    """Bit for bit (a DTensor's own shard against the expected one's)."""
    if isinstance(expected, dict):
        return got.keys() == expected.keys() and all(same(got[k], expected[k]) for k in expected)
    if isinstance(expected, torch.Tensor):
        got = got.to_local() if hasattr(got, "to_local") else got
        expected = expected.to_local() if hasattr(expected, "to_local") else expected
        return got.dtype == expected.dtype and torch.equal(
            got.contiguous().view(torch.uint8), expected.contiguous().view(torch.uint8)
        )
    return bool(got == expected)


def settings(cell: Cell, paths: dict[str, str], keep_last: int | None = None) -> dict[str, Any]:
    """The manager settings that turn the cell's features on."""
    chosen: dict[str, Any] = {"preemption": False, "keep_last": keep_last}
    if cell.incremental:
        chosen["incremental"] = True
    if cell.signed:
        chosen["signing_key"] = paths["key"]
    if cell.compressed:
        chosen["compression"] = "on"
    if cell.fast_tier:
        chosen["local_dir"] = str(Path(paths["fast"]) / "{node}")
    if cell.process_async:
        chosen.update(async_save=True, async_mode="process")
    return chosen


def keyring(cell: Cell, paths: dict[str, str]) -> Keyring | None:
    return Keyring.from_files(paths["key"]) if cell.signed else None


def _gc(cell: Cell, paths: dict[str, str]) -> None:
    """gc as another process would run it: its own store, keep_last 2, the job's keys."""
    collect_garbage(open_store(paths["bucket"]), keep_last=2, keyring=keyring(cell, paths))


def phase(
    cell: Cell, name: str, paths: dict[str, str], world: int = 1, rank: int = 0, mesh: Any = None
) -> dict[str, Any]:
    """Run phase `name` ("setup", or the cell's operation) on this rank; what it saw."""
    seen: dict[str, Any] = {"rank": rank}
    try:
        seen.update(_phase(cell, name, paths, world, rank, mesh))
    except BaseException as error:  # reported: the test decides what may be raised
        wrapped = getattr(error, "failures", None)  # DCP's CheckpointException, if one leaked
        seen.update(
            error_type=type(error).__name__,
            error=str(error)[:2000],
            raw=not isinstance(error, CheckpointError),
            traceback="".join(traceback.format_exception(error))[-4000:],
            dcp_failures=repr(wrapped)[:1000] if wrapped else None,
        )
    return seen


def _phase(
    cell: Cell, name: str, paths: dict[str, str], world: int, rank: int, mesh: Any
) -> dict[str, Any]:
    bucket = paths["bucket"]
    if name == "setup":
        with CheckpointManager(bucket, **settings(cell, paths)) as manager:
            for step in STEPS:
                manager.save(step, state(step, world, rank, mesh))
            manager.wait()
            return {"steps": manager.steps()}
    if name in ("restore", "reshard_restore"):
        with CheckpointManager(bucket, **settings(cell, paths)) as manager:
            into = blank(world, rank, mesh)
            step = manager.restore(into)
            exact = step is not None and same(into, state(step, world, rank, mesh))
            return {"step": step, "exact": exact, "sources": manager.last_restore_sources}
    if name == "notice_during_upload":
        return _notice_during_upload(cell, paths, world, rank, mesh)
    keep = {"retention_k1": 1, "retention_k2": 2}.get(name)
    store = None
    interleaved = name == "gc_during_save"
    if interleaved and rank == 0 and not cell.process_async:  # gc between write and commit
        store = AfterWrite(open_store(bucket), ".safetensors", lambda key: _gc(cell, paths))
    with CheckpointManager(bucket, store=store, **settings(cell, paths, keep)) as manager:
        manager.save(NEXT, state(NEXT, world, rank, mesh))
        if interleaved and store is None and rank == 0:  # process mode: while it uploads
            _gc(cell, paths)
        manager.wait()
        fired = bool(store.fired) if store is not None else None
        return {"steps": manager.steps(), "gc_fired": fired}


NOTICE_S = 5.0
"""The notice's window: the plan lets the held upload run about 4 s, then cancels it."""
PROCESS_NOTICE_S = 60.0
"""The window where the upload in flight runs in an upload process, which no store can hold: it
finishes when it finishes (with compression on 2 loaded cores, sometimes past a 5 s window, and
the plan then rightly said "no time left" for the notice's step: 1 run in 5 failed so). Ample
time makes the notice's save the behaviour under test, not the machine's speed."""
NOTICE_STEP = NEXT + 1
"""The step saved at the notice (NEXT is the upload in flight)."""


def _notice_during_upload(
    cell: Cell, paths: dict[str, str], world: int, rank: int, mesh: Any
) -> dict[str, Any]:
    """Step NEXT uploads in the background, held mid-object, when rank 0 gets a notice: the plan
    at the notice cancels it (an upload process cannot be held: it commits), and `NOTICE_STEP`
    is saved within the notice on every rank."""
    watcher = PreemptionWatcher(signals=(), aws=False, gce=False, azure=False)
    chosen = {**settings(cell, paths), "preemption": watcher, "async_save": True}
    pending: list[Any] = []
    held = not cell.process_async  # the upload process gets a pickled copy of the store
    store = (
        HeldStore(open_store(paths["bucket"]), lambda: pending[0].writer.cancellation.cancelled)
        if held
        else None
    )
    try:
        with CheckpointManager(paths["bucket"], store=store, **chosen) as manager:
            if store is not None:
                store.hold = True
            manager.save(NEXT, state(NEXT, world, rank, mesh))
            pending.append(manager._saver.pending)
            if store is not None and rank == 0 and not store.waiting.wait(120):
                raise AssertionError("the upload of the held step never started")
            if rank == 0:
                window = NOTICE_S if held else PROCESS_NOTICE_S
                watcher.trigger("seam", deadline=time.monotonic() + window)
            manager.maybe_save(NOTICE_STEP, state(NOTICE_STEP, world, rank, mesh))
            return {"steps": manager.steps(), "held": held, "stopped": manager.should_stop()}
    finally:
        watcher.stop()


def main() -> None:
    """Rank script: ``seam_run.py phase RANK WORLD PORT ARGS`` (as `dist_worker.launch_ranks`)."""
    _, rank_text, world_text, port, raw = sys.argv[1:6]
    rank, world = int(rank_text), int(world_text)
    args = json.loads(raw)
    cell = Cell(**args["cell"])
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=120))
    if cell.indexed:  # index parts forced on below the 32 ranks that turn them on
        import spotckpt.engine.writer

        spotckpt.engine.writer.INDEX_MIN_RANKS = 1
    mesh = None
    if world > 1:
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (world,))
    seen = phase(cell, args["phase"], args["paths"], world, rank, mesh)
    Path(args["out"], f"rank-{rank}.json").write_text(json.dumps(seen, default=str))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
