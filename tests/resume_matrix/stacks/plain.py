"""Resume-matrix stack: one process, a plain model, `CheckpointManager` + `TrainState`.

The loop is docs/training-loop.md's loop (see ``_common.run``); the loader set-ups are the ones a
single process can have (no DistributedSampler, no per-rank seeds).
"""

from __future__ import annotations

import sys
from typing import Any

from _worker import REFUSED_LOADER, SHARED_SEED_LOADERS, serve

DESCRIBE = {
    "ranks": [1],
    "loaders": [*SHARED_SEED_LOADERS, REFUSED_LOADER],
    "world_change": False,
    "steps": 20,
    "save_every": 4,
}


def run(case: dict[str, Any]) -> int:
    import _common

    return _common.main(case)


if __name__ == "__main__":
    sys.exit(serve(DESCRIBE, run))
