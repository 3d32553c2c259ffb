"""Every exception spotckpt raises to its users, under one root: `CheckpointError`.

This module imports nothing of spotckpt, so every layer (storage included, which knows nothing
of torch or manifests) can raise these. The storage errors also derive from the matching
built-in ones (FileNotFoundError, FileExistsError, PermissionError) so that generic handlers work.
"""

from __future__ import annotations


class CheckpointError(Exception):
    """Root of every error spotckpt raises."""


class InvalidArgumentError(CheckpointError, ValueError):
    """A spotckpt function or setting was given a value it cannot work with."""


class InvalidTypeError(CheckpointError, TypeError):
    """A spotckpt function was given an object of a type it cannot work with."""


class ConfigError(CheckpointError, ValueError):
    """A configuration value is unknown, of the wrong type, or missing."""


class MissingURIError(ConfigError):
    """No source gives the checkpoint URI."""


class LaunchUsageError(InvalidArgumentError):
    """A setting the launcher reads (not a torchrun option) has a value it cannot use."""


class MissingDependencyError(CheckpointError, ImportError):
    """An optional part is used whose extra is not installed; the message names the extra."""


class StorageError(CheckpointError):
    """A storage operation failed for a reason that retrying will not fix."""


class ObjectNotFoundError(StorageError, FileNotFoundError):
    """The object does not exist."""


class AlreadyExistsError(StorageError, FileExistsError):
    """A create-only write found the object already there (HTTP 412 on object stores)."""


class PermissionDeniedError(StorageError, PermissionError):
    """The credentials in use may not perform this operation (HTTP 403)."""


class InvalidKeyError(StorageError, ValueError):
    """A key is not a plain relative path inside the store's root."""


class DelimiterNotHonouredError(StorageError):
    """A server refused a delimited listing or answered it against the rules (a prefix that does
    not end at the first delimiter, pages out of order, a continuation token seen twice).

    Stores catch it and fall back to `roll_up` over a full listing; it never reaches callers.
    """


class DeadlineExceededError(StorageError):
    """A storage operation did not finish within its `RetryPolicy.deadline_s`."""


class DiskFullError(StorageError):
    """A local write failed because the disk (or the user's quota) is full."""


class SymlinkError(StorageError):
    """A key is, or lies under, a symbolic link inside the root; links are never followed."""


class StoreClockError(StorageError):
    """The store gave no usable time for a probe object, so gc cannot tell how old anything
    is by the store's clock (the only one it trusts)."""


class CheckpointAlreadyCommittedError(AlreadyExistsError):
    """A manifest for this step exists already: the step was committed by an earlier save."""


class CorruptCheckpointError(StorageError):
    """Stored bytes disagree with the manifest: a CRC mismatch, a truncated or missing object."""


class ObjectMissingError(CorruptCheckpointError):
    """An object that the manifest lists does not exist."""


class ObjectSizeError(CorruptCheckpointError):
    """An object is shorter than a range asked of it, or its size differs from the manifest's."""


class ChecksumMismatchError(CorruptCheckpointError):
    """A block of a stored chunk does not match its CRC32C in the manifest."""


class CorruptBlockError(ChecksumMismatchError):
    """A stored block that does not decode to its raw length (only after its stored CRC32C
    matched: a forged manifest, or a bug); readers report it with the object and tensor."""


class TiedWeightsMismatchError(CheckpointError):
    """Two tensors the manifest shows as tied copies (equal CRC32Cs) hold different bytes."""


class ManifestError(CheckpointError, ValueError):
    """A manifest is malformed, inconsistent or of an unknown format."""


class BoundedJSONError(CheckpointError, ValueError):
    """JSON that is malformed, or nests or spells numbers beyond the bounds."""


class SafetensorsFormatError(CheckpointError, ValueError):
    """A safetensors header or body is malformed."""


class UnknownFormatError(ManifestError):
    """A manifest of a format this version does not read (perhaps written by a newer one).

    Unlike other manifest errors it says nothing about the checkpoint's health, so restore
    skips such a step without quarantining it.
    """


class MirrorConflictError(CheckpointError):
    """A mirror holds what its source does not: another job's identity, or another commit of
    a step; nothing there is overwritten."""


class NoCheckpointError(CheckpointError, LookupError):
    """The requested step has no committed checkpoint."""


class PlanningError(CheckpointError):
    """The coordinator cannot make the global plan from what the ranks sent."""


class SaveFailedError(CheckpointError):
    """A save did not commit; the message names the failed rank(s) and the cause."""


class SaveCancelledError(SaveFailedError):
    """An upload in flight was stopped at a preemption notice because the plan left it no time;
    nothing of it was committed, the previous checkpoint stays the newest."""


class IntegrityRefusedError(SaveFailedError):
    """A save was refused before its commit point because the state failed an integrity check
    (replicas disagree, or the health gate refused it); nothing was committed and the previous
    checkpoint stays the newest."""


class ReplicaMismatchError(IntegrityRefusedError):
    """Ranks holding the same replicated tensor hold different bytes (silent data corruption on
    a host, or diverged training); the message names the tensor and the ranks of each copy."""


class HealthCheckError(IntegrityRefusedError):
    """The health gate (`health_check`) refused the state: non-finite values, or the caller's
    check said no."""


class SignatureError(ManifestError):
    """A manifest's signature is missing, wrong, truncated, or made for another step or job,
    while a signing key is configured: the step is treated as corrupt (quarantined, never used),
    or a strong hash of an object disagrees with its signed manifest."""


class TierSaveError(CheckpointError):
    """A fast-tier save failed on some rank; nothing was committed in the tier."""


class PeerLostError(CheckpointError):
    """A rank of the job died or stopped answering while the others exchanged fast-tier bytes
    with it: the process group is broken, so the job must be restarted (it resumes from the
    newest step that survives). The message names the lost rank(s) where they can be told."""


class IncompleteRestoreError(CheckpointError):
    """A restore failed after it had written part of a checkpoint into the state, and no other
    source could complete it: the state is neither the old one nor a checkpoint's."""


class UnsupportedValueError(CheckpointError, TypeError):
    """A value in the state cannot be stored so that it restores; the save is refused."""


class ValueLoadError(CheckpointError):
    """A stored value does not load (weights_only) or decode; not corruption: no fallback."""


class KeyMismatchError(CheckpointError, KeyError):
    """The state to restore and the checkpoint disagree on which keys exist."""

    def __str__(self) -> str:
        return str(self.args[0])


class MetadataAnswerError(CheckpointError):
    """A cloud's metadata service answered, but not with anything usable (an HTTP error status,
    a malformed token or notice). The preemption watcher retries it with back-off, and logs it
    once per `kind`, the answer's class without its varying detail."""

    def __init__(self, kind: str, detail: str = "") -> None:
        super().__init__(f"{kind} {detail}".strip())
        self.kind = kind


class CommandFailedError(CheckpointError):
    """A command ran and printed its result, and that result is a failure (``spotckpt verify``
    found problems): the command line exits 1 without printing the result again."""


class RootMissingError(StorageError):
    """The checkpoint root (a local folder, a bucket) does not exist: a wrong URI, told apart
    from a root that exists but holds no checkpoint."""
