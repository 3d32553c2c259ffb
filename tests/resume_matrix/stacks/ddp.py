"""Resume-matrix stack: two gloo ranks (launched by the harness), `DistributedDataParallel`,
`CheckpointManager` + `TrainState`.

Every loader set-up applies: the shared-seed ones give both ranks the same batches, a
`DistributedSampler` splits the data, and ``per-rank-seed`` shuffles each rank its own way (as
examples/train.py does). A checkpoint restores on another rank count too (DDP's state is
replicated; each rank takes saved rank ``r % saved``'s own state).
"""

from __future__ import annotations

import sys
from typing import Any

from _worker import PER_RANK_LOADERS, REFUSED_LOADER, SHARED_SEED_LOADERS, serve

DESCRIBE = {
    "ranks": [2],
    "loaders": [*SHARED_SEED_LOADERS, *PER_RANK_LOADERS, REFUSED_LOADER],
    "world_change": True,
    "steps": 20,
    "save_every": 4,
}


def run(case: dict[str, Any]) -> int:
    import _common
    from torch.nn.parallel import DistributedDataParallel

    return _common.main(case, wrap=DistributedDataParallel, distributed=True)


if __name__ == "__main__":
    sys.exit(serve(DESCRIBE, run))
