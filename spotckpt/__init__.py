"""spotckpt: preemption-safe PyTorch checkpoints streamed to object stores through DCP."""

from __future__ import annotations

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
from spotckpt.version import __version__

PREEMPTED_EXIT_CODE = 75
"""Exit status of a job that stopped for preemption after committing a checkpoint (EX_TEMPFAIL):
launchers should start it again, and it resumes from that checkpoint."""

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
