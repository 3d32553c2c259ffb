"""A manifest of many small tensors: packed records (format feature ``packed``) against one JSON
record per tensor, on the same manifest, encoded and parsed in one run.

    python benchmarks/manifest_bench.py --tensors 20000 --reps 5

Builds the manifest a real save of `--tensors` small float32 tensors (1-2,000 elements, as the
``varied`` shape's spread) writes, into a temporary folder, then times `Manifest.to_json` and
`Manifest.from_json` of both forms with the cyclic garbage collector paused (as a save and a
restore run them, `spotckpt.collector`). Prints bytes, the best of `--reps` CPU seconds of each,
and the ratios; both forms must parse to the same tensors.
"""

from __future__ import annotations

import argparse
import gc
import os
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

from spotckpt import CheckpointManager
from spotckpt.format.manifest import Manifest
from spotckpt.layout import manifest_key


def saved_manifest(tensors: int) -> Manifest:
    """The manifest of a real save of `tensors` small tensors."""
    generator = torch.Generator().manual_seed(0)
    sizes = torch.randint(1, 2000, (tensors,), generator=generator).tolist()
    state = {f"layers.{n // 10:05d}.p{n % 10}": torch.rand(size) for n, size in enumerate(sizes)}
    with tempfile.TemporaryDirectory() as folder:
        with CheckpointManager(folder, preemption=False) as manager:
            manager.save(1, state)
        return Manifest.from_json(Path(folder, manifest_key(1)).read_bytes())


def best_cpu(work: Callable[[], object], reps: int) -> float:
    """The least CPU seconds of `reps` runs of `work`, the collector paused."""
    times = []
    gc.disable()
    try:
        for _ in range(reps):
            start = time.process_time()
            work()
            times.append(time.process_time() - start)
    finally:
        gc.enable()
    return min(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tensors", type=int, default=20_000)
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args()
    packed = saved_manifest(args.tensors)
    if "packed" not in packed.features:
        raise SystemExit(f"the save wrote {packed.format}, not packed records")
    plain = Manifest.from_json(packed.to_json())
    plain.format = "+".join(f for f in packed.format.split("+") if f != "packed")
    forms = {"packed": packed, "json": plain}
    data = {name: manifest.to_json() for name, manifest in forms.items()}
    if Manifest.from_json(data["json"]).tensors != Manifest.from_json(data["packed"]).tensors:
        raise SystemExit("the two forms do not parse to the same tensors")
    encode = {name: best_cpu(m.to_json, args.reps) for name, m in forms.items()}
    parse = {
        name: best_cpu(lambda d=d: Manifest.from_json(d), args.reps)  # type: ignore[misc]
        for name, d in data.items()
    }
    load = os.getloadavg()[0]
    print(f"manifest of {args.tensors} small tensors, best of {args.reps} (load {load:.2f})")
    print(f"{'form':8} {'bytes':>11} {'encode s':>9} {'parse s':>9} {'us/tensor parse':>16}")
    for name in forms:
        per = parse[name] / args.tensors * 1e6
        print(
            f"{name:8} {len(data[name]):>11,} {encode[name]:>9.3f} {parse[name]:>9.3f} {per:>16.1f}"
        )
    print(
        f"packed / json: bytes {len(data['packed']) / len(data['json']):.2f}x, encode "
        f"{encode['packed'] / encode['json']:.2f}x, parse {parse['packed'] / parse['json']:.2f}x"
    )


if __name__ == "__main__":
    main()
