"""Worker functions for multi-rank tests: each runs in its own process in a gloo group.

Spawned by `run_ranks`; results come back as files in the test's temporary folder.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
)
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader

import spotckpt.save
from spotckpt import (
    CheckpointError,
    CheckpointManager,
    PreemptionWatcher,
    ResumableSampler,
    SaveFailedError,
    TrainState,
    track_batches,
)
from spotckpt.engine.cancel import Cancellation
from spotckpt.state import RNGState
from spotckpt.storage import open_store

from preloaded import PreloadedProcess
from tests_support import FailingStore, HeldStore, free_port

FULL = StateDictOptions(full_state_dict=True, cpu_offload=True)


def launch_ranks(
    world: int,
    scenario: str,
    args: dict[str, Any],
    timeout: float = 240,
    worker: str = __file__,
) -> list[subprocess.CompletedProcess[str]]:
    """Run `scenario` of the rank script `worker` (this one by default) on `world` rank
    processes (like torchrun would, but forked with torch already imported: `preloaded`);
    returns each result."""
    port = str(free_port())
    here = Path(__file__).resolve().parent
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(here), str(here.parent)])}
    processes = [
        PreloadedProcess([worker, scenario, str(rank), str(world), port, json.dumps(args)], env)
        for rank in range(world)
    ]
    return [
        subprocess.CompletedProcess(process.args, status, output)
        for process, (status, output) in zip(processes, wait_all(processes, timeout), strict=True)
    ]


def wait_all(processes: list[PreloadedProcess], timeout: float) -> list[tuple[int, str]]:
    """Wait for every rank process; (exit status, output) each. Kills all on a timeout."""
    results = []
    for process in processes:
        try:
            output, _ = process.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            for other in processes:
                other.kill()
            raise
        results.append((process.returncode, output))
    return results


def run_ranks(world: int, scenario: str, args: dict[str, Any]) -> None:
    """Run `scenario` on `world` ranks; raises with the output if any rank failed."""
    for rank, result in enumerate(launch_ranks(world, scenario, args)):
        if result.returncode != 0:
            raise AssertionError(
                f"rank {rank} exited {result.returncode}:\n{result.stdout[-4000:]}"
            )


def main() -> None:
    scenario, rank, world, port, raw = sys.argv[1:6]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", rank=int(rank), world_size=int(world), timeout=timedelta(seconds=60)
    )
    args = json.loads(raw)
    if args.get("indexed"):  # the indexed manifest without a thousand ranks
        import spotckpt.engine.writer

        spotckpt.engine.writer.INDEX_MIN_RANKS = 1
    SCENARIOS[scenario](int(rank), int(world), args)
    dist.destroy_process_group()


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(512, 1024), nn.ReLU(), nn.Linear(1024, 384), nn.ReLU(), nn.Linear(384, 8)
    )


def fsdp(model: nn.Module) -> nn.Module:
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer)
    fully_shard(model)
    return model


def train(model: nn.Module, optimizer: torch.optim.Optimizer, steps: int, rank: int) -> None:
    for i in range(steps):
        x = torch.randn(4, 512, generator=torch.Generator().manual_seed(100 * i + rank))
        model(x).pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()


def full_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    return {
        "model": get_model_state_dict(model, options=FULL),
        "optim": get_optimizer_state_dict(model, optimizer, options=FULL),
    }


def _manager(args: dict[str, Any], **kwargs: Any) -> CheckpointManager:
    kwargs.setdefault("compression", args.get("compression", "off"))
    return CheckpointManager(
        args["uri"], preemption=False, storage_options=args.get("options", {}), **kwargs
    )


def fsdp_save(rank: int, world: int, args: dict[str, Any]) -> None:
    """Train FSDP2 model + AdamW, save, then restore on the same ranks and keep training."""
    out = Path(args["out"])
    model = fsdp(make_model())
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    train(model, optimizer, 2, rank)
    mgr = _manager(args, prefix_spread=args.get("prefix_spread", False))
    mgr.save(2, TrainState(model=model, optimizer=optimizer, rng=False))
    saved = full_state(model, optimizer)  # CPU tensors may alias live state: write at once
    if rank == 0:
        torch.save(saved, out / "saved.pt")
    train(model, optimizer, 2, rank)
    continued = full_state(model, optimizer)
    if rank == 0:
        torch.save(continued, out / "continued.pt")
    # restore into fresh, differently initialised shards and continue identically
    fresh = fsdp(_perturbed())
    fresh_optimizer = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
    assert mgr.restore(TrainState(model=fresh, optimizer=fresh_optimizer, rng=False)) == 2
    train(fresh, fresh_optimizer, 2, rank)
    again = full_state(fresh, fresh_optimizer)
    if rank == 0:
        torch.save(again, out / "resumed-continued.pt")
    mgr.close()


def _perturbed() -> nn.Module:
    model = make_model()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    return model


def fsdp_restore(rank: int, world: int, args: dict[str, Any]) -> None:
    """Restore an FSDP2 checkpoint on `world` ranks; write the gathered full state and stats."""
    out = Path(args["out"])
    model = fsdp(_perturbed())
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    mgr = _manager(args)
    assert mgr.restore(TrainState(model=model, optimizer=optimizer, rng=False)) == 2
    stats = mgr.last_read_stats
    assert stats is not None
    (out / f"stats-{world}-{rank}.json").write_text(
        json.dumps(
            {"read": stats.bytes_read, "needed": stats.bytes_needed, "requests": stats.requests}
        )
    )
    gathered = full_state(model, optimizer)
    if rank == 0:
        torch.save(gathered, out / f"restored-{world}.pt")
    mgr.close()


def fsdp_incremental_save(rank: int, world: int, args: dict[str, Any]) -> None:
    """Save FSDP2 + AdamW at step 1, change the last layer's shards in place, then save step 2
    incrementally: every other chunk is referenced in step 1's objects."""
    out = Path(args["out"])
    model = fsdp(make_model())
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    train(model, optimizer, 1, rank)
    mgr = _manager(args, incremental=True)
    mgr.save(1, TrainState(model=model, optimizer=optimizer, rng=False))
    with torch.no_grad():
        for p in model[4].parameters():
            p.to_local().add_(1.0)  # type: ignore[operator]
    mgr.save(2, TrainState(model=model, optimizer=optimizer, rng=False))
    saved = full_state(model, optimizer)
    if rank == 0:
        torch.save(saved, out / "saved.pt")
    mgr.close()


def ddp_save(rank: int, world: int, args: dict[str, Any]) -> None:
    """DDP replicas: the checkpoint must hold one copy of each parameter."""
    model = DistributedDataParallel(make_model())
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    train(model, optimizer, 1, rank)
    mgr = _manager(args)
    mgr.save(1, TrainState(model=model, optimizer=optimizer, rng=False))
    fresh = DistributedDataParallel(_perturbed())
    fresh_optimizer = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
    started = time.monotonic()
    assert mgr.restore(TrainState(model=fresh, optimizer=fresh_optimizer, rng=False)) == 1
    seconds = time.monotonic() - started
    for a, b in zip(model.parameters(), fresh.parameters(), strict=True):
        assert torch.equal(a, b)
    for key, value in fresh_optimizer.state_dict()["state"].items():
        for name, tensor in value.items():
            assert torch.equal(tensor, optimizer.state_dict()["state"][key][name]), (key, name)
    stats = mgr.last_read_stats
    assert stats is not None
    if rank == 0:
        (Path(args["out"]) / "ddp-restore-stats.json").write_text(
            json.dumps({"read": stats.bytes_read, "requests": stats.requests, "seconds": seconds})
        )
    mgr.close()


def ddp_save_twice(rank: int, world: int, args: dict[str, Any]) -> None:
    """DDP replicas save steps 1 and 2 (every piece is then read by one rank on restore)."""
    model = DistributedDataParallel(make_model())
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    mgr = _manager(args)
    for step in (1, 2):
        train(model, optimizer, 1, rank)
        mgr.save(step, TrainState(model=model, optimizer=optimizer, rng=False))
    mgr.close()


def ddp_restore_outcome(rank: int, world: int, args: dict[str, Any]) -> None:
    """Restore DDP replicas; write the step restored, or the CheckpointError, per rank."""
    model = DistributedDataParallel(_perturbed())
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    mgr = _manager(args)
    try:
        outcome: dict[str, Any] = {
            "step": mgr.restore(TrainState(model=model, optimizer=optimizer, rng=False))
        }
    except CheckpointError as error:
        outcome = {"error": type(error).__name__, "message": str(error)}
    (Path(args["out"]) / f"outcome-{rank}.json").write_text(json.dumps(outcome))
    mgr.close()


def failing_rank(rank: int, world: int, args: dict[str, Any]) -> None:
    """Rank 1's store fails mid-upload: every rank gets an error naming rank 1; the retry works."""
    out = Path(args["out"])
    inner = open_store(args["uri"], **args.get("options", {}))
    store = FailingStore(inner, fail_after_bytes=6 << 20 if rank == 1 else 1 << 62)
    mgr = CheckpointManager(args["uri"], preemption=False, store=store)
    state = {f"w{rank}": torch.full((4 << 20,), float(rank))}  # 16 MiB per rank: multipart
    try:
        mgr.save(5, state)
    except SaveFailedError as error:
        (out / f"error-{rank}.txt").write_text(str(error))
    store.budget = 1 << 62
    mgr.save(6, state)
    mgr.close()


def killed_rank(rank: int, world: int, args: dict[str, Any]) -> None:
    """Rank 2 is SIGKILLed mid-upload; the survivors must fail within the bound, naming it."""
    out = Path(args["out"])
    inner = open_store(args["uri"], **args.get("options", {}))

    def die() -> None:
        os.kill(os.getpid(), signal.SIGKILL)

    store = KillingStore(inner, 6 << 20, die) if rank == 2 else inner
    mgr = CheckpointManager(
        args["uri"], preemption=False, store=store, collective_timeout_s=args["timeout"]
    )
    state = {f"w{rank}": torch.full((4 << 20,), float(rank))}
    started = time.monotonic()
    try:
        mgr.save(5, state)
    except SaveFailedError as error:
        (out / f"error-{rank}.txt").write_text(
            json.dumps({"error": str(error), "seconds": time.monotonic() - started})
        )
        os._exit(0)  # the group is broken; leave without collective teardown
    os._exit(1)


def coordinator_dies_after_commit(rank: int, world: int, args: dict[str, Any]) -> None:
    """Rank 0 is SIGKILLed right after its manifest put: the survivor must report a commit."""
    out = Path(args["out"])
    inner = open_store(args["uri"], **args.get("options", {}))
    store = DieAfterCommitStore(inner) if rank == 0 else inner
    mgr = CheckpointManager(
        args["uri"], preemption=False, store=store, collective_timeout_s=args["timeout"]
    )
    state = {f"w{rank}": torch.full((1 << 18,), float(rank))}
    try:
        mgr.save(5, state)
    except SaveFailedError as error:
        (out / f"result-{rank}.txt").write_text(f"failed: {error}")
        os._exit(0)
    (out / f"result-{rank}.txt").write_text("committed")
    os._exit(0)  # the group is broken; leave without collective teardown


def async_saves(rank: int, world: int, args: dict[str, Any]) -> None:
    """Async saves on every rank while the training thread keeps agreeing on preemption."""
    mgr = CheckpointManager(args["uri"], preemption=False, async_save=True, interval_steps=2)
    state = {f"w{rank}": torch.zeros(1 << 16)}
    for step in range(1, 9):
        state[f"w{rank}"].fill_(float(step))
        mgr.maybe_save(step, state)
    mgr.close()
    if rank == 0:
        (Path(args["out"]) / "steps.json").write_text(json.dumps(mgr.steps()))


def raw_dcp(rank: int, world: int, args: dict[str, Any]) -> None:
    """Plain DCP on a gloo group with spotckpt's writer and reader: save step 4, load it back."""
    import torch.distributed.checkpoint as dcp

    import spotckpt

    state = {f"w{rank}": torch.full((1000,), float(rank)), "shared": torch.arange(10.0)}
    dcp.save(state, storage_writer=spotckpt.dcp_writer(args["uri"], 4))
    loaded = {f"w{rank}": torch.zeros(1000), "shared": torch.zeros(10)}
    dcp.load(loaded, storage_reader=spotckpt.dcp_reader(args["uri"]))
    same = all(torch.equal(loaded[k], state[k]) for k in state)
    (Path(args["out"]) / f"loaded-{rank}").write_text("ok" if same else "different")


class DieAfterCommitStore(FailingStore):
    """SIGKILLs its own process as soon as a manifest put has succeeded."""

    def __init__(self, inner: Any) -> None:
        super().__init__(inner, 1 << 62)

    def put(self, key: str, data: bytes, *, create_only: bool = False) -> Any:
        info = super().put(key, data, create_only=create_only)
        if key.endswith("/manifest.json"):
            os.kill(os.getpid(), signal.SIGKILL)
        return info


class KillingStore(FailingStore):
    """Calls `action` (which kills the process) once the byte budget is spent."""

    def __init__(self, inner: Any, fail_after_bytes: int, action: Callable[[], None]) -> None:
        super().__init__(inner, fail_after_bytes)
        self.action = action

    def open_writer(self, key: str, *, create_only: bool = False) -> Any:
        writer = super().open_writer(key, create_only=create_only)
        original = writer.write

        def write(data: Any) -> None:
            if self.budget - memoryview(data).nbytes < 0:
                self.action()
            original(data)

        writer.write = write  # type: ignore[method-assign]
        return writer


def _per_rank_state(
    rank: int, seed: int
) -> tuple[TrainState, Any, ResumableSampler, dict[str, Any]]:
    """A rank's state whose loader position, extras and RNGs differ by rank."""
    data = list(range(40))
    sampler = ResumableSampler(len(data), seed=seed)
    loader = DataLoader(data, batch_size=4, sampler=sampler)
    extra: dict[str, Any] = {"rank_value": -1, "shared": 0}
    torch.manual_seed(0)  # one model on every rank, as DDP keeps it: replicas must agree
    state = TrainState(model=nn.Linear(2, 2), dataloader=loader, extra=extra)
    return state, loader, sampler, extra


def _what_rank_has(sampler: ResumableSampler, extra: dict[str, Any]) -> dict[str, Any]:
    return {
        "sampler": sampler.state_dict(),
        "extra": dict(extra),
        "torch_rng": torch.get_rng_state().tolist()[:64],
        "draw": torch.rand(1).item(),
    }


def per_rank_state(rank: int, world: int, args: dict[str, Any]) -> None:
    """Save (each rank at its own position) or restore, then record what this rank holds.

    ``layout="legacy"`` saves a dict shaped as earlier releases stored a TrainState: loader
    position and extras once for the job, not keyed by rank.
    """
    legacy = args.get("layout") == "legacy"  # that release failed on per-rank seeds
    state, loader, sampler, extra = _per_rank_state(rank, seed=0 if legacy else rank)
    manager = CheckpointManager(
        args["uri"], preemption=False, compression=args.get("compression", "off")
    )
    out = Path(args["out"])
    if args["mode"] == "save":
        torch.manual_seed(1000 + rank)
        for _, _batch in zip(range(rank + 2), track_batches(loader), strict=False):
            pass
        extra.update(rank_value=10 * rank, shared=7)
        if legacy:
            old_layout = {
                "model": state.models["model"],
                "dataloader": sampler.state_dict(),
                "rng": RNGState(),
                "train": {"step": 5, "extra": dict(extra)},
            }
            manager.save(5, old_layout, blocking=True)
        else:
            manager.save(5, state, blocking=True)
        name = f"saved-rank{rank}.json"
    else:
        torch.manual_seed(99)  # restored over
        step = manager.restore(state)
        if step != 5:
            raise AssertionError(f"rank {rank} restored {step}")
        name = f"restored-world{world}-rank{rank}.json"
    (out / name).write_text(json.dumps(_what_rank_has(sampler, extra)))
    manager.close()


def distributed_sampler(rank: int, world: int, args: dict[str, Any]) -> None:
    """A StatefulDataLoader over a DistributedSampler in epoch 1: save after `taken` batches,
    or restore and record the batches left in the epoch (``rest-world{W}-rank{r}.json``)."""
    from torch.utils.data import DistributedSampler
    from torchdata.stateful_dataloader import StatefulDataLoader

    data = list(range(40))
    sampler = DistributedSampler(data, num_replicas=world, rank=rank, shuffle=True, seed=3)
    sampler.set_epoch(1)
    loader = StatefulDataLoader(data, batch_size=4, sampler=sampler)
    torch.manual_seed(0)  # one model on every rank, as DDP keeps it: replicas must agree
    state = TrainState(model=nn.Linear(2, 2), dataloader=loader)
    manager = CheckpointManager(args["uri"], preemption=False)
    out = Path(args["out"])
    if args["mode"] == "save":
        batches = iter(loader)
        for _ in range(int(args["taken"])):
            next(batches)
        manager.save(5, state, blocking=True)
        rest = [batch.tolist() for batch in batches]
        name = f"saved-world{world}-rank{rank}.json"
    else:
        if manager.restore(state) != 5:
            raise AssertionError(f"rank {rank} did not restore step 5")
        rest = [batch.tolist() for batch in loader]
        name = f"rest-world{world}-rank{rank}.json"
    (out / name).write_text(json.dumps(rest))
    manager.close()


def async_commit_skew(rank: int, world: int, args: dict[str, Any]) -> None:
    """Rank 1 reaches each `maybe_save` a second later than rank 0, so an asynchronous upload
    is done when rank 1 looks and not yet when rank 0 does: the ranks must still commit it at
    the same step (its commit runs collectives), not hang or mix collectives."""
    manager = CheckpointManager(
        args["uri"], async_save=True, interval_steps=2, keep_last=None, collective_timeout_s=30
    )
    seen = []  # (step, the newest step this rank has committed once its maybe_save returned)
    for step in range(1, 8):
        if rank == 1:
            time.sleep(1.0)
        manager.maybe_save(step, {"w": torch.full((1 << 23,), float(step))})
        seen.append((step, manager.goodput.last_committed_step))
    manager.wait()
    result = {"steps": manager.steps(), "seen": seen}
    (Path(args["out"]) / f"steps-{rank}.json").write_text(json.dumps(result))
    manager.close()


def rebalance_hint(rank: int, world: int, args: dict[str, Any]) -> None:
    """Only rank 0 sees AWS's rebalance recommendation (a fake metadata server); every rank
    must make the same one extra save, at the same step. The budget is too small for any save:
    the coordinator alone records that it does not fit."""
    if rank == 0:
        os.environ["AWS_EC2_METADATA_SERVICE_ENDPOINT"] = args["endpoint"]
    manager = CheckpointManager(
        args["uri"], aws_rebalance=True, keep_last=None, save_budget_s=0.001
    )
    if rank == 0:
        end = time.monotonic() + 50  # within the other rank's barrier timeout (60 s)
        while manager.watcher is not None and manager.watcher.hint is None:
            if time.monotonic() > end:
                raise AssertionError("rank 0 never saw the rebalance recommendation")
            time.sleep(0.02)
    dist.barrier()
    saved = [
        step for step in range(1, 6) if manager.maybe_save(step, {"w": torch.full((4,), step)})
    ]
    manager.wait()
    (Path(args["out"]) / f"saved-{rank}.json").write_text(json.dumps(saved))
    manager.close()


def _uploading_step_two(
    store: HeldStore, watcher: PreemptionWatcher, uri: str, rank: int, interval_steps: int
) -> CheckpointManager:
    """An async manager whose step 1 is committed and whose upload of step 2 (an interval save)
    is held mid-object in `store`."""
    manager = CheckpointManager(
        uri,
        store=store,
        async_save=True,
        preemption=watcher,
        interval_steps=interval_steps,
        keep_last=None,
        collective_timeout_s=120,
    )
    manager.save(1, {f"w{rank}": torch.full((1 << 18,), 1.0 + rank)})
    manager.wait()
    store.hold = True
    manager.maybe_save(2, {f"w{rank}": torch.full((1 << 18,), 2.0 + rank)})
    if not store.waiting.wait(60):
        raise AssertionError("the upload of step 2 never started")
    return manager


def notice_cancels_upload(rank: int, world: int, args: dict[str, Any]) -> None:
    """Both ranks' uploads are held mid-object when rank 0 alone gets a notice: every rank takes
    its deadline, the ranks in ``args["cancel"]`` cancel at the plan's word (the others' uploads
    are released), and every rank then saves the newer step together."""
    store = HeldStore(open_store(args["uri"]))
    lefts: list[float | None] = []
    cancels = rank in args["cancel"]

    def allowance(*_: Any, **plan: Any) -> float:
        lefts.append(plan["left_s"])
        if not cancels:
            store.gate.set()
        return 0.0 if cancels else 120.0

    spotckpt.save.in_flight_allowance = allowance  # type: ignore[assignment]
    original = Cancellation.cancel

    def cancel(self: Cancellation, why: str) -> None:
        original(self, why)
        store.gate.set()

    Cancellation.cancel = cancel  # type: ignore[method-assign]
    watcher = PreemptionWatcher(signals=(), aws=False, gce=False, azure=False)
    manager = _uploading_step_two(store, watcher, args["uri"], rank, interval_steps=2)
    dist.barrier()
    if rank == 0:
        watcher.trigger("test", deadline=time.monotonic() + 60.0)
    dist.barrier()
    manager.maybe_save(3, {f"w{rank}": torch.full((1 << 18,), 3.0 + rank)})
    outcome = {"stop": manager.should_stop(), "lefts": lefts, "steps": manager.steps()}
    (Path(args["out"]) / f"outcome-{rank}.json").write_text(json.dumps(outcome))
    manager.close()
    watcher.stop()


def notice_while_waiting(rank: int, world: int, args: dict[str, Any]) -> None:
    """Both ranks' uploads of step 2 are held when step 3's save comes due, so both wait for
    them; rank 1 then gets a notice. Each rank records whether its upload was still held when
    the plan at the notice ran (it is released then, and commits)."""
    store = HeldStore(open_store(args["uri"]))
    held: list[bool] = []

    def allowance(*_: Any, **plan: Any) -> float:
        held.append(not store.gate.is_set())
        store.gate.set()
        return 120.0

    spotckpt.save.in_flight_allowance = allowance  # type: ignore[assignment]
    watcher = PreemptionWatcher(signals=(), aws=False, gce=False, azure=False)
    manager = _uploading_step_two(store, watcher, args["uri"], rank, interval_steps=1)
    if rank == 1:

        def notice_once_waiting() -> None:
            while manager._saver._waits == 0:
                time.sleep(0.01)
            watcher.trigger("test", deadline=time.monotonic() + 60.0)

        threading.Thread(target=notice_once_waiting, daemon=True).start()
    manager.maybe_save(3, {f"w{rank}": torch.full((1 << 18,), 3.0 + rank)})
    outcome = {"stop": manager.should_stop(), "held_at_plan": held, "steps": manager.steps()}
    (Path(args["out"]) / f"outcome-{rank}.json").write_text(json.dumps(outcome))
    manager.close()
    watcher.stop()


def replicated_state(rank: int) -> dict[str, torch.Tensor]:
    """40 small tensors every rank holds (a DDP model's), and one of this rank's own, too large
    to be packed with them (so every rank's destination holds the whole run)."""
    generator = torch.Generator().manual_seed(5)
    state = {f"model.p{i:02d}": torch.randn(100 + i, generator=generator) for i in range(40)}
    state[f"rank{rank}.seen"] = torch.full((1 << 20,), float(rank))
    return state


def replicated_run(rank: int, world: int, args: dict[str, Any]) -> None:
    """One rank (tests/engine/test_scatter_reads.py): save, then restore into a blank state;
    records whether it came back exact, and the job's bytes read."""
    with CheckpointManager(args["uri"], preemption=False) as manager:
        manager.save(1, replicated_state(rank))
        state = {
            name: torch.full_like(tensor, -1.0) for name, tensor in replicated_state(rank).items()
        }
        manager.restore(state)
        stats = manager.last_read_stats
    exact = all(torch.equal(state[k], v) for k, v in replicated_state(rank).items())
    result = {"exact": exact, "read": stats.bytes_read if stats else None}
    (Path(args["out"]) / f"rank{rank}.json").write_text(json.dumps(result))


SCENARIOS: dict[str, Callable[[int, int, dict[str, Any]], None]] = {
    "fsdp_incremental_save": fsdp_incremental_save,
    "notice_while_waiting": notice_while_waiting,
    "per_rank_state": per_rank_state,
    "distributed_sampler": distributed_sampler,
    "fsdp_save": fsdp_save,
    "fsdp_restore": fsdp_restore,
    "ddp_save": ddp_save,
    "ddp_save_twice": ddp_save_twice,
    "ddp_restore_outcome": ddp_restore_outcome,
    "failing_rank": failing_rank,
    "killed_rank": killed_rank,
    "coordinator_dies_after_commit": coordinator_dies_after_commit,
    "raw_dcp": raw_dcp,
    "async_saves": async_saves,
    "rebalance_hint": rebalance_hint,
    "async_commit_skew": async_commit_skew,
    "notice_cancels_upload": notice_cancels_upload,
    "replicated_run": replicated_run,
}


if __name__ == "__main__":
    main()
