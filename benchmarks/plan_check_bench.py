"""The global save plan's check alone: spotckpt's (`spotckpt.engine.plan_check`) against DCP's
``_validate_global_plan`` on the same metadata, for FSDP (``Shard(0)`` over N ranks) and FSDP x
TP (a grid of N / tp row pieces x tp column pieces) layouts of a Llama-like model's weights.

    python benchmarks/plan_check_bench.py --ranks 1024 --tensors 90 --tp 8

Prints CPU seconds of each check (`time.process_time`) and their ratio, measured in one run;
both must agree that the plan is valid.
"""

from __future__ import annotations

import argparse
import time

import torch
from torch.distributed.checkpoint.default_planner import _validate_global_plan
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import SavePlan

from spotckpt.engine.plan_check import global_plan_errors


def pieces(extent: int, count: int) -> list[tuple[int, int]]:
    """torch.chunk's pieces of one dimension, trailing empty ones placed at its end."""
    rows = -(-extent // count)
    out = []
    for i in range(count):
        length = max(0, min(rows, extent - i * rows))
        out.append((i * rows if length else extent, length))
    return out


def metadata(ranks: int, tensors: int, tp: int, hidden: int) -> Metadata:
    """The chunks of `tensors` weights ([d, d], [f, d], [d, f] in turn) on `ranks` ranks."""
    ffn = 256 * -(-int(8 * hidden / 3) // 256)
    shapes = [(hidden, hidden), (ffn, hidden), (hidden, ffn)]
    entries = {}
    for i in range(tensors):
        shape = shapes[i % 3]
        rows, cols = pieces(shape[0], ranks // tp), pieces(shape[1], tp)
        chunks = [
            ChunkStorageMetadata(torch.Size((r[0], c[0])), torch.Size((r[1], c[1])))
            for r in rows
            for c in cols
        ]
        entries[f"w{i}"] = TensorStorageMetadata(
            TensorProperties(dtype=torch.float32), torch.Size(shape), chunks
        )
    return Metadata(entries)  # type: ignore[arg-type]


def main() -> None:
    """Time both checks on one layout."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, default=1024)
    parser.add_argument("--tensors", type=int, default=90)
    parser.add_argument("--tp", type=int, default=1, help="1: FSDP; more: FSDP x TP")
    parser.add_argument("--hidden", type=int, default=4096)
    args = parser.parse_args()
    md = metadata(args.ranks, args.tensors, args.tp, args.hidden)
    started = time.process_time()
    ours = global_plan_errors(md, args.ranks)
    ours_s = time.process_time() - started
    started = time.process_time()
    theirs = _validate_global_plan([SavePlan([])] * args.ranks, md)
    dcp_s = time.process_time() - started
    assert ours == theirs == [], (ours[:3], theirs[:3])
    chunks = args.ranks * args.tensors
    print(
        f"layout={'fsdp' if args.tp == 1 else f'fsdp x tp{args.tp}'} ranks={args.ranks} "
        f"tensors={args.tensors} chunks={chunks} spotckpt_check_s={ours_s:.3f} "
        f"dcp_check_s={dcp_s:.3f} ratio={dcp_s / max(ours_s, 1e-9):.1f}x"
    )


if __name__ == "__main__":
    main()
