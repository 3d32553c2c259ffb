"""A process that saves checkpoints in a loop until it is killed (for kill -9 trials).

Usage: python kill_target.py URI. Prints "ready" once, then "committed N" after each save.
"""

from __future__ import annotations

import sys
from typing import Any

import torch

from spotckpt import CheckpointManager

MIB = 1 << 20


def state_for(step: int) -> dict[str, Any]:
    """The content saved at `step`: every value derives from the step."""
    g = torch.Generator().manual_seed(step)
    return {
        "big": torch.randn(2 * MIB, generator=g),
        "many": {f"t{i}": torch.full((257,), float(step * 1000 + i)) for i in range(40)},
        "step": step,
    }


def empty_state() -> dict[str, Any]:
    return {
        "big": torch.empty(2 * MIB),
        "many": {f"t{i}": torch.empty(257) for i in range(40)},
        "step": 0,
    }


def main() -> None:
    uri = sys.argv[1]
    options = {"part_size": 5 * MIB} if uri.startswith("s3://") else {}
    with CheckpointManager(uri, preemption=False, keep_last=2, storage_options=options) as mgr:
        step = (mgr.latest_step() or 0) + 1
        print("ready", flush=True)
        while True:
            mgr.save(step, state_for(step))
            print(f"committed {step}", flush=True)
            step += 1


if __name__ == "__main__":
    main()
