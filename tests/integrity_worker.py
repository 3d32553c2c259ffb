"""Rank processes of the integrity tests: replica agreement (tensors, and non-tensor values of
every kind: `value_matrix`), the health gate, an emergency save refused by the gate. Each runs
in its own process in a gloo group; results come back as files in the test's temporary folder
and as the exit status.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from spotckpt import PREEMPTED_EXIT_CODE, CheckpointManager, TrainState
from spotckpt.errors import HealthCheckError, ReplicaMismatchError
from spotckpt.layout import EVENTS_PREFIX, parse_event_key

from dist_worker import launch_ranks, make_model


def launch(
    world: int, scenario: str, args: dict[str, Any], timeout: float = 240
) -> list[subprocess.CompletedProcess[str]]:
    """Run `scenario` of this module on `world` rank processes; each one's result."""
    return launch_ranks(world, scenario, args, timeout, worker=__file__)


def events(manager: CheckpointManager) -> list[dict[str, Any]]:
    """Every event object of the manager's root, oldest first."""
    store = manager.store
    keys = sorted(i.key for i in store.list(EVENTS_PREFIX) if parse_event_key(i.key))
    return [json.loads(store.get(key)) for key in keys]


def _manager(args: dict[str, Any], **kwargs: Any) -> CheckpointManager:
    options = {"preemption": False, **kwargs}
    return CheckpointManager(args["uri"], storage_options=args.get("options", {}), **options)


def replica_flip(rank: int, world: int, args: dict[str, Any]) -> None:
    """DDP: a clean save commits; then one rank's copy of a weight is altered in memory (as a
    bad host would) and the save is refused on every rank naming the tensor and that rank; the
    next save after the copy is repaired commits."""
    model = DistributedDataParallel(make_model())
    state = TrainState(model=model, rng=False)
    manager = _manager(args, replica_check=args["mode"])
    manager.save(1, state)
    weight = model.module[2].weight
    original = weight.detach().clone()
    if rank == args["bad_rank"]:
        with torch.no_grad():
            weight.view(-1)[7] = float(weight.view(-1)[7]) + 2.0**-20  # one low bit flipped
    refused = ""
    bad_step = args.get("bad_step", 2)
    try:
        manager.save(bad_step, state)
    except ReplicaMismatchError as error:
        refused = str(error)
    steps_after_refusal = manager.steps()
    with torch.no_grad():
        weight.copy_(original)
    manager.save(bad_step + 1, state)
    result = {"refused": refused, "after_refusal": steps_after_refusal, "end": manager.steps()}
    if rank == 0:
        result["events"] = [e for e in events(manager) if e["kind"] == "refused"]
    (Path(args["out"]) / f"replica-{rank}.json").write_text(json.dumps(result))
    manager.close()


def nan_gate(rank: int, world: int, args: dict[str, Any]) -> None:
    """DDP with ``health_check="finite"``: a NaN on one rank refuses the save on every rank;
    the next clean save commits."""
    model = DistributedDataParallel(make_model())
    state = TrainState(model=model, rng=False)
    manager = _manager(args, health_check="finite")
    manager.save(1, state)
    bias = model.module[0].bias
    original = bias.detach().clone()
    if rank == 1:
        with torch.no_grad():
            bias[3] = float("nan")
    refused = ""
    try:
        manager.save(2, state)
    except HealthCheckError as error:
        refused = str(error)
    after = manager.steps()
    with torch.no_grad():
        bias.copy_(original)
    manager.save(3, state)
    result = {"refused": refused, "after_refusal": after, "end": manager.steps()}
    (Path(args["out"]) / f"nan-{rank}.json").write_text(json.dumps(result))
    manager.close()


def emergency_refused(rank: int, world: int, args: dict[str, Any]) -> None:
    """A real SIGTERM arrives while the state holds a NaN: the emergency save is refused by the
    gate, the loop stops and the process exits 75 like any preempted trainer. With ``float8``,
    the state also holds a float8 buffer, and the NaN is there."""
    model = DistributedDataParallel(make_model())
    if args.get("float8"):
        model.module.register_buffer("scales", torch.ones(16).to(torch.float8_e4m3fn))
    state = TrainState(model=model, rng=False)
    manager = CheckpointManager(args["uri"], health_check="finite", interval_steps=2)
    step = 0
    while not manager.should_stop():
        step += 1
        if step == 3:
            with torch.no_grad():
                if args.get("float8"):
                    model.module.scales[0] = float("nan")
                else:
                    model.module[0].weight[0, 0] = float("inf")
            os.kill(os.getpid(), signal.SIGTERM)
        manager.maybe_save(step, state)
        if step > 10:
            raise AssertionError("the loop never stopped")
    result = {"steps": manager.steps(), "events": events(manager) if rank == 0 else []}
    (Path(args["out"]) / f"emergency-{rank}.json").write_text(json.dumps(result))
    manager.close()
    dist.destroy_process_group()
    sys.exit(PREEMPTED_EXIT_CODE)


def signed_indexed(rank: int, world: int, args: dict[str, Any]) -> None:
    """An indexed manifest (a root and one index part per rank) saved with a signing key:
    restores with the key; then rank 1's part is re-signed by a forger and the step is refused."""
    import spotckpt.engine.writer

    spotckpt.engine.writer.INDEX_MIN_RANKS = 1
    model = DistributedDataParallel(make_model())
    state = TrainState(model=model, rng=False)
    manager = _manager(args, signing_key=args["key"])
    manager.save(1, state)
    manager.save(2, state)
    assert manager.restore(state) == 2
    dist.barrier()
    if rank == 0:
        import spotckpt.format.signing as signing
        from spotckpt.layout import index_part_key, step_key

        root = manager.catalog._parse(manager.catalog.manifest_bytes(2), 2)
        part = step_key(2, index_part_key(root.attempt, 1))
        document = json.loads(manager.store.get(part))
        assert document["job"] == manager.catalog.job().id and "signature" in document
        document.pop("signature")
        forged = signing.Keyring.generate().sign(json.dumps(document).encode(), document["job"])
        manager.store.put(part, forged)  # refused: by the root's CRC32C, or else its signature
    dist.barrier()
    outcome = {"restored": manager.restore(state), "steps": manager.steps()}
    (Path(args["out"]) / f"indexed-{rank}.json").write_text(json.dumps(outcome))
    manager.close()


def ddp_batchnorm(rank: int, world: int, args: dict[str, Any]) -> None:
    """A healthy DDP job with BatchNorm, one step on each rank's own batch: its running statistics
    differ by rank (DDP broadcasts buffers before each forward pass, which then updates them with
    the local batch). The default setting commits the save; ``replica_check="all"`` refuses it,
    naming a running statistic: why the default is off."""
    torch.manual_seed(0)
    model = DistributedDataParallel(
        torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 1))
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    torch.manual_seed(100 + rank)  # each rank's own batch
    model(torch.randn(16, 8)).pow(2).mean().backward()
    optimizer.step()
    state = TrainState(model=model, optimizer=optimizer, rng=False)
    default = _manager(args)
    default.save(1, state)
    checked = _manager(args, replica_check="all")
    refused = ""
    try:
        checked.save(2, state)
    except ReplicaMismatchError as error:
        refused = str(error)
    result = {"default_steps": default.steps(), "refused": refused, "steps": checked.steps()}
    (Path(args["out"]) / f"batchnorm-{rank}.json").write_text(json.dumps(result))
    checked.close()
    default.close()


VALUE_KINDS: dict[str, Callable[[int], Any]] = {
    "int": lambda r: 1000 + r,
    "float": lambda r: 0.25 + r / 8,
    "numpy_array": lambda r: np.arange(6, dtype=np.float32).reshape(2, 3) + r,
    "numpy_scalar": lambda r: np.float64(1.5 + r),
    "str": lambda r: f"host-{r}",
    "nested": lambda r: {"a": [1, 2, {"b": r}], "c": ("x", r * 0.5), "d": "same"},
    "bytes": lambda r: bytes([1, 2, 3, r]),
}
"""Each kind's value as rank r holds it (r = 0 on every rank: the agreeing case)."""
VALUE_KEY = "stat"
"""The shared name every value is saved under."""


def same_value(a: Any, b: Any) -> bool:
    """Whether a restored value equals the saved one, type included (numpy compared as arrays)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, (np.ndarray, np.generic)):
        return bool(a.dtype == b.dtype and a.shape == b.shape and np.array_equal(a, b))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same_value(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same_value(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)


def value_matrix(rank: int, world: int, args: dict[str, Any]) -> None:
    """For each kind: a differing value is refused on every rank and nothing is committed; an
    agreeing one commits and restores on every rank."""
    results: dict[str, dict[str, Any]] = {}
    manager = CheckpointManager(args["uri"], preemption=False, replica_check="all")
    for index, (kind, make) in enumerate(VALUE_KINDS.items()):
        differing, agreeing = 2 * index + 1, 2 * index + 2
        refused = ""
        try:
            manager.save(differing, {"w": torch.ones(8), VALUE_KEY: make(rank)})
        except ReplicaMismatchError as error:
            refused = str(error)
        steps_after_refusal = manager.steps()
        manager.save(agreeing, {"w": torch.ones(8), VALUE_KEY: make(0)})
        state = {"w": torch.zeros(8), VALUE_KEY: make(7)}  # same structure, other values
        restored = manager.restore(state, agreeing)
        results[kind] = {
            "refused": refused,
            "committed_after_refusal": differing in steps_after_refusal,
            "restored_step": restored,
            "restored_equal": same_value(state[VALUE_KEY], make(0))
            and bool(state["w"].eq(1).all()),
        }
    (Path(args["out"]) / f"values-{rank}.json").write_text(json.dumps(results))
    manager.close()


SCENARIOS: dict[str, Callable[[int, int, dict[str, Any]], None]] = {
    "replica_flip": replica_flip,
    "ddp_batchnorm": ddp_batchnorm,
    "nan_gate": nan_gate,
    "emergency_refused": emergency_refused,
    "signed_indexed": signed_indexed,
    "value_matrix": value_matrix,
}


def main() -> None:
    scenario, rank, world, port, raw = sys.argv[1:6]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", rank=int(rank), world_size=int(world), timeout=timedelta(seconds=60)
    )
    SCENARIOS[scenario](int(rank), int(world), json.loads(raw))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
