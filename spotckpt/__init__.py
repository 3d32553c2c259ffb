"""spotckpt: preemption-safe PyTorch checkpoints streamed to object stores through DCP.

The public names load on first use (PEP 562), so ``import spotckpt`` and the parts that need no
tensors (the storage layer, the command line) do not import torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from spotckpt.version import __version__

if TYPE_CHECKING:
    from spotckpt.config import Config, ConfigError
    from spotckpt.errors import (
        CheckpointAlreadyCommittedError,
        CheckpointError,
        CorruptCheckpointError,
        NoCheckpointError,
        SaveFailedError,
    )
    from spotckpt.manager import CheckpointManager, KeyMismatchError
    from spotckpt.preemption import PreemptionWatcher
    from spotckpt.state import ResumableSampler, TrainState, track_batches
    from spotckpt.storage import open_store

PREEMPTED_EXIT_CODE = 75
"""Exit status of a job that stopped for preemption after committing a checkpoint (EX_TEMPFAIL):
launchers should start it again, and it resumes from that checkpoint."""

_LAZY = {
    "CheckpointAlreadyCommittedError": "spotckpt.errors",
    "CheckpointError": "spotckpt.errors",
    "CheckpointManager": "spotckpt.manager",
    "Config": "spotckpt.config",
    "ConfigError": "spotckpt.config",
    "CorruptCheckpointError": "spotckpt.errors",
    "KeyMismatchError": "spotckpt.manager",
    "NoCheckpointError": "spotckpt.errors",
    "PreemptionWatcher": "spotckpt.preemption",
    "ResumableSampler": "spotckpt.state",
    "SaveFailedError": "spotckpt.errors",
    "TrainState": "spotckpt.state",
    "open_store": "spotckpt.storage",
    "track_batches": "spotckpt.state",
}


def __getattr__(name: str) -> Any:
    """Import a public name's module on first use and cache the name here."""
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    """The module's names, the lazy ones included."""
    return sorted({*globals(), *_LAZY})


__all__ = [
    "PREEMPTED_EXIT_CODE",
    "CheckpointAlreadyCommittedError",
    "CheckpointError",
    "CheckpointManager",
    "Config",
    "ConfigError",
    "CorruptCheckpointError",
    "KeyMismatchError",
    "NoCheckpointError",
    "PreemptionWatcher",
    "ResumableSampler",
    "SaveFailedError",
    "TrainState",
    "__version__",
    "open_store",
    "track_batches",
]
