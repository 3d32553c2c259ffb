"""Resume-matrix stack: two gloo ranks on the CPU (launched by the harness), FSDP2
(``fully_shard`` on every linear layer and the root), `CheckpointManager` + `TrainState`.

The model and optimizer state are DTensor shards; the harness compares gathered (full) tensors.
DCP reshards a checkpoint for another rank count; each rank takes saved rank ``r % saved``'s
own state (RNGs, loader position, extras).
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


def shard(model: Any) -> Any:
    """``fully_shard`` each linear layer, then the whole model."""
    from torch import nn
    from torch.distributed.fsdp import fully_shard

    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer)
    fully_shard(model)
    return model


def run(case: dict[str, Any]) -> int:
    import _common

    return _common.main(case, wrap=shard, distributed=True)


if __name__ == "__main__":
    sys.exit(serve(DESCRIBE, run))
