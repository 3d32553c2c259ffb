"""Rank processes for the fast-tier tests: each "node" is one gloo rank with its own local dir.

`launch_nodes` starts one process per rank with ``SPOTCKPT_NODE`` (and ``SPOTCKPT_ZONE``) of its
own, like torchrun on separate machines would; results come back as files in the test's folder.
Each rank (forked by `preloaded`) runs in a private mount namespace (what ``unshare -m`` makes)
in which the base of `local_dir` (the part before ``{node}``) is its machine's own folder,
``machines/<machine>`` beside it (or a disk of its own): a rank can never read another
machine's disk, and two machines that use the same node id see different folders (which the
tier refuses at start-up). The folders outlive the processes (`node_folder` finds them).
"""

from __future__ import annotations

import json
import os
import signal
import sys
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import spotckpt.targets
from spotckpt import CheckpointError, CheckpointManager, TrainState

from dist_worker import _perturbed, fsdp, full_state, make_model, train, wait_all
from preloaded import PreloadedProcess
from tests_support import free_port

HERE = Path(__file__).resolve().parent


def tier_base(args: dict[str, Any]) -> Path:
    """The folder that `local_dir` names before ``{node}`` (each rank sees its machine's)."""
    return Path(args["local_dir"].partition("{node}")[0])


def machine_folder(args: dict[str, Any], machine: str) -> Path:
    """The real folder that is `tier_base` on `machine`."""
    return tier_base(args).parent / "machines" / machine


def node_folder(args: dict[str, Any], node: str, machine: str | None = None) -> Path:
    """The real folder of `node`'s tier on `machine` (by default the machine named `node`)."""
    return machine_folder(args, machine or node) / node


def launch_nodes(
    nodes: list[str],
    scenario: str,
    args: dict[str, Any],
    *,
    zones: list[str] | None = None,
    machines: list[str] | None = None,
    disks: dict[str, Path] | None = None,
) -> list[PreloadedProcess]:
    """Start `scenario` on one rank per entry of `nodes` (the rank's node id), each on its
    machine (`machines`, by default the node id) whose tier base is its own folder, or the
    disk that `disks` gives for the machine."""
    port = str(free_port())
    base = tier_base(args)
    base.mkdir(parents=True, exist_ok=True)
    processes = []
    for rank, node in enumerate(nodes):
        machine = machines[rank] if machines is not None else node
        disk = (disks or {}).get(machine) or machine_folder(args, machine)
        disk.mkdir(parents=True, exist_ok=True)
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join([str(HERE), str(HERE.parent)]),
            "SPOTCKPT_NODE": node,
        }
        if zones is not None:
            env["SPOTCKPT_ZONE"] = zones[rank]
        command = [__file__, scenario, str(rank), str(len(nodes)), port, json.dumps(args)]
        processes.append(PreloadedProcess(command, env, new_session=True, bind=(disk, base)))
    return processes


def finish(processes: list[PreloadedProcess], timeout: float = 300) -> list[tuple[int, str]]:
    """Wait for every rank; (exit status, output) each. Kills all on a timeout."""
    return wait_all(processes, timeout)


def run_nodes(nodes: list[str], scenario: str, args: dict[str, Any], **kw: Any) -> list[str]:
    """Run `scenario` to its end on every rank; raises with the output if a rank failed."""
    results = finish(launch_nodes(nodes, scenario, args, **kw))
    for rank, (status, output) in enumerate(results):
        if status != 0:
            raise AssertionError(f"rank {rank} exited {status}:\n{output[-6000:]}")
    return [output for _, output in results]


def _manager(args: dict[str, Any], **kwargs: Any) -> CheckpointManager:
    return CheckpointManager(
        args["uri"],
        local_dir=args["local_dir"],
        redundancy=args.get("redundancy"),
        local_interval_steps=args.get("local_interval_steps"),
        interval_steps=args.get("interval_steps"),
        async_save=args.get("async_save", False),
        collective_timeout_s=args.get("collective_timeout_s", 120),
        **kwargs,
    )


def _snapshot(model: torch.nn.Module, optimizer: torch.optim.Optimizer, path: Path) -> None:
    state = full_state(model, optimizer)  # a collective: every rank calls it
    if dist.get_rank() == 0:
        torch.save(state, path)


def save_then_die(rank: int, world: int, args: dict[str, Any]) -> None:
    """FSDP2 training with durable and fast saves; snapshots at the save steps, then the
    ranks named in `kill` die by SIGKILL (no cleanup) and the others leave without a word."""
    out = Path(args["out"])
    model = fsdp(make_model())
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    mgr = _manager(args, preemption=False)
    state = TrainState(model=model, optimizer=optimizer, rng=False)
    for step in range(1, args["steps"] + 1):
        train(model, optimizer, 1, rank)
        if mgr.maybe_save(step, state):
            mgr.wait()
            _snapshot(model, optimizer, out / f"expected-{step}.pt")
    dist.barrier()
    if rank in args.get("kill", []):
        os.kill(os.getpid(), signal.SIGKILL)
    os._exit(0)


def restore(rank: int, world: int, args: dict[str, Any]) -> None:
    """Restore into perturbed FSDP2 shards; write the gathered state and where bytes came from
    (or, when the restore raised a CheckpointError, which one, per rank)."""
    out = Path(args["out"])
    model = fsdp(_perturbed())
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    mgr = _manager(args, preemption=False)
    try:
        step = mgr.restore(TrainState(model=model, optimizer=optimizer, rng=False))
    except CheckpointError as error:
        _result(out, f"restore-{rank}", error=type(error).__name__, message=str(error))
        return
    _result(out, f"restore-{rank}", step=step)
    _snapshot(model, optimizer, out / f"restored-{world}.pt")
    if rank == 0:
        (out / f"sources-{world}.json").write_text(
            json.dumps({"step": step, "sources": mgr.last_restore_sources})
        )
    mgr.close()


def evicted(rank: int, world: int, args: dict[str, Any]) -> None:
    """Trains until SIGTERM; the emergency save goes to the tier first, then exit 75. With
    ``drain_never_fits`` the tier's upload to the bucket is predicted never to fit."""
    if args.get("drain_never_fits"):
        never: Any = lambda self, deadline: False  # noqa: E731
        spotckpt.targets.TierTarget._time_to_drain = never
    out = Path(args["out"])
    model = fsdp(make_model())
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    mgr = _manager(args)
    state = TrainState(model=model, optimizer=optimizer, rng=False)
    step = 0
    while step < 10_000:
        step += 1
        train(model, optimizer, 1, rank)
        mgr.maybe_save(step, state)
        if mgr.should_stop():
            _snapshot(model, optimizer, out / f"expected-{step}.pt")
            if rank == 0:
                (out / "evicted-at.txt").write_text(str(step))
            mgr.close()
            dist.destroy_process_group()
            sys.exit(75)
        if step == args["ready_at"] and rank == 0:
            (out / "ready").write_text(str(step))
    raise SystemExit("never evicted")


def _result(out: Path, name: str, **fields: Any) -> None:
    (out / f"{name}.json").write_text(json.dumps(fields))


def _die_on_open(name: str) -> None:
    """SIGKILL this process the moment it opens `name` for writing: a node lost at that point
    (for a fast-tier copy, mid copy phase), with no cleanup of any kind."""

    def hook(event: str, arguments: tuple[Any, ...]) -> None:
        writing = event == "open" and isinstance(arguments[2], int)
        if writing and arguments[0] == name and arguments[2] & (os.O_WRONLY | os.O_RDWR):
            os.kill(os.getpid(), signal.SIGKILL)

    sys.addaudithook(hook)


def save_loop(rank: int, world: int, args: dict[str, Any]) -> None:
    """`maybe_save` of a plain state every step (a tensor and, if asked, a text of `blob_bytes`
    that the free-space estimate does not count, both per rank: every rank writes an object of
    its own); writes what each step did or the
    CheckpointError that stopped the loop. `die` = {"rank", "name"}: that rank is lost when it
    opens that file for writing."""
    out = Path(args["out"])
    die = args.get("die")
    if die is not None and die["rank"] == rank:
        _die_on_open(die["name"])
    mgr = _manager(args, preemption=False)
    steps: list[int] = []
    try:
        for step in range(1, args["steps"] + 1):
            state: dict[str, Any] = {f"w{rank}": torch.full((64,), float(100 * step + rank))}
            if args.get("blob_bytes"):
                state[f"blob{rank}"] = "x" * args["blob_bytes"]
            mgr.maybe_save(step, state)
            mgr.wait()
            steps.append(step)
        mgr.close()
    except CheckpointError as error:
        _result(out, f"loop-{rank}", steps=steps, error=type(error).__name__, message=str(error))
        os._exit(0)  # the process group is broken: leave without its teardown
    _result(out, f"loop-{rank}", steps=steps)


def start(rank: int, world: int, args: dict[str, Any]) -> None:
    """Build a manager with a fast tier; write the CheckpointError it raised, if any."""
    try:
        _manager(args, preemption=False).close()
    except CheckpointError as error:
        _result(Path(args["out"]), f"start-{rank}", error=type(error).__name__, message=str(error))
        return
    _result(Path(args["out"]), f"start-{rank}")


SCENARIOS = {
    "save_then_die": save_then_die,
    "restore": restore,
    "evicted": evicted,
    "save_loop": save_loop,
    "start": start,
}


def main() -> None:
    scenario, rank, world, port, raw = sys.argv[1:6]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", rank=int(rank), world_size=int(world), timeout=timedelta(seconds=120)
    )
    SCENARIOS[scenario](int(rank), int(world), json.loads(raw))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
