"""Object stores behind one small protocol; see `spotckpt.storage.base`."""

from __future__ import annotations

from spotckpt.storage.base import (
    AlreadyExistsError,
    InvalidKeyError,
    Listing,
    ObjectInfo,
    ObjectNotFoundError,
    ObjectStore,
    ObjectWriter,
    PermissionDeniedError,
    StorageError,
    UploadInfo,
    check_key,
    join_key,
    open_store,
)
from spotckpt.storage.retry import RetryPolicy

__all__ = [
    "AlreadyExistsError",
    "InvalidKeyError",
    "Listing",
    "ObjectInfo",
    "ObjectNotFoundError",
    "ObjectStore",
    "ObjectWriter",
    "PermissionDeniedError",
    "RetryPolicy",
    "StorageError",
    "UploadInfo",
    "check_key",
    "join_key",
    "open_store",
]
