"""Save and restore throughput of one state split over WORLD ranks, against an S3 endpoint.

Each rank holds SIZE_MIB / WORLD of 16 MiB float32 tensors and saves them through
CheckpointManager; rank 0 prints one JSON line (throughput of the whole state, peak RSS of rank 0).

    AWS_ENDPOINT_URL=http://127.0.0.1:5000 URI=s3://bucket/run \\
        python benchmarks/sharded_save_restore.py
    AWS_ENDPOINT_URL=... URI=s3://bucket/run4 torchrun --standalone --nproc-per-node=4 \\
        benchmarks/sharded_save_restore.py
"""

from __future__ import annotations

import json
import os
import resource
import time

import torch
import torch.distributed as dist

from spotckpt import CheckpointManager

MIB = 1 << 20


def barrier(world: int) -> None:
    if world > 1:
        dist.barrier()


def main() -> None:
    size_mib = int(os.environ.get("SIZE_MIB", "512"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:
        dist.init_process_group("gloo")
    rank = dist.get_rank() if world > 1 else 0
    per_rank = size_mib // world
    state = {f"r{rank}.t{i}": torch.randn(4 * MIB) for i in range(per_rank // 16)}
    options = {"part_size": 16 * MIB, "max_concurrency": 8}
    manager = CheckpointManager(os.environ["URI"], preemption=False, storage_options=options)
    barrier(world)
    started = time.perf_counter()
    manager.save(1, state)
    barrier(world)
    save_s = time.perf_counter() - started
    peak_rss_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    target = {key: torch.empty_like(value) for key, value in state.items()}
    barrier(world)
    started = time.perf_counter()
    manager.restore(target)
    barrier(world)
    restore_s = time.perf_counter() - started
    identical = all(torch.equal(state[key], target[key]) for key in state)
    if rank == 0:
        print(
            json.dumps(
                {
                    "world": world,
                    "MiB": size_mib,
                    "save_s": round(save_s, 2),
                    "save_MiBps": round(size_mib / save_s, 1),
                    "restore_s": round(restore_s, 2),
                    "restore_MiBps": round(size_mib / restore_s, 1),
                    "peak_rss_MiB_rank0": round(peak_rss_mib),
                    "state_MiB_rank0": per_rank,
                    "bit_identical": identical,
                }
            )
        )
    manager.close()
    if world > 1:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
