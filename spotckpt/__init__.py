"""spotckpt: preemption-safe PyTorch checkpoints streamed to object stores through DCP.

The public names load on first use (PEP 562), so ``import spotckpt`` and the parts that need no
tensors (the storage layer, the command line) do not import torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from spotckpt.version import __version__

if TYPE_CHECKING:
    from spotckpt.config import Config
    from spotckpt.dcp import dcp_reader, dcp_writer
    from spotckpt.errors import (
        CheckpointAlreadyCommittedError,
        CheckpointError,
        ConfigError,
        CorruptCheckpointError,
        KeyMismatchError,
        NoCheckpointError,
        SaveCancelledError,
        SaveFailedError,
    )
    from spotckpt.manager import CheckpointManager
    from spotckpt.preemption import PreemptionWatcher
    from spotckpt.seeding import SampleKey, SeededDataset, sample_seed
    from spotckpt.state import ResumableSampler, TrainState, track_batches
    from spotckpt.storage import open_store
    from spotckpt.weights import load_weights, open_checkpoint

PREEMPTED_EXIT_CODE = 75
"""Exit status of a job that stopped for preemption after committing a checkpoint (EX_TEMPFAIL):
launchers should start it again, and it resumes from that checkpoint."""

_LAZY = {
    "CheckpointAlreadyCommittedError": "spotckpt.errors",
    "CheckpointError": "spotckpt.errors",
    "CheckpointManager": "spotckpt.manager",
    "Config": "spotckpt.config",
    "ConfigError": "spotckpt.errors",
    "CorruptCheckpointError": "spotckpt.errors",
    "KeyMismatchError": "spotckpt.errors",
    "NoCheckpointError": "spotckpt.errors",
    "PreemptionWatcher": "spotckpt.preemption",
    "ResumableSampler": "spotckpt.state",
    "SampleKey": "spotckpt.seeding",
    "SaveCancelledError": "spotckpt.errors",
    "SaveFailedError": "spotckpt.errors",
    "SeededDataset": "spotckpt.seeding",
    "TrainState": "spotckpt.state",
    "dcp_reader": "spotckpt.dcp",
    "dcp_writer": "spotckpt.dcp",
    "load_weights": "spotckpt.weights",
    "open_checkpoint": "spotckpt.weights",
    "open_store": "spotckpt.storage",
    "sample_seed": "spotckpt.seeding",
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
    "SampleKey",
    "SaveCancelledError",
    "SaveFailedError",
    "SeededDataset",
    "TrainState",
    "__version__",
    "dcp_reader",
    "dcp_writer",
    "load_weights",
    "open_checkpoint",
    "open_store",
    "sample_seed",
    "track_batches",
]
