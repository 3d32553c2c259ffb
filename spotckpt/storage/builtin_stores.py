"""Registers the stores that ship with spotckpt; imported lazily by `open_store`."""

from __future__ import annotations

from typing import Any

from spotckpt.storage.base import ObjectStore, register_store
from spotckpt.storage.local import open_local_store
from spotckpt.storage.memory import open_memory_store


def _open_s3(uri: str, options: dict[str, Any]) -> ObjectStore:
    from spotckpt.storage.s3 import open_s3_store  # boto3 loads only when S3 is used

    return open_s3_store(uri, options)


def _open_gcs(uri: str, options: dict[str, Any]) -> ObjectStore:
    from spotckpt.storage.gcs import open_gcs_store  # google-cloud-storage loads only for GCS

    return open_gcs_store(uri, options)


register_store("file", open_local_store)
register_store("memory", open_memory_store)
register_store("s3", _open_s3)
register_store("gs", _open_gcs)
register_store("gcs", _open_gcs)
