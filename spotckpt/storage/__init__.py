"""Object stores behind one small protocol (`spotckpt.storage.base`), opened by URI through
`spotckpt.storage.registry`."""

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
)
from spotckpt.storage.registry import open_store, register_store, uri_scheme
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
    "register_store",
    "uri_scheme",
]
