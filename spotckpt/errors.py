"""Exceptions that spotckpt raises to its users."""

from __future__ import annotations

from spotckpt.storage.base import AlreadyExistsError, StorageError


class CheckpointError(Exception):
    """Base of the checkpoint-level errors."""


class CheckpointAlreadyCommittedError(CheckpointError, AlreadyExistsError):
    """A manifest for this step exists already: the step was committed by an earlier save."""


class CorruptCheckpointError(CheckpointError, StorageError):
    """Stored bytes disagree with the manifest: a CRC mismatch, a truncated or missing object."""


class NoCheckpointError(CheckpointError, LookupError):
    """The requested step has no committed checkpoint."""


class SaveFailedError(CheckpointError):
    """A save did not commit; the message names the failed rank(s) and the cause."""
