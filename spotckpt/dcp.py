"""Raw DCP: spotckpt's storage writer and reader for ``torch.distributed.checkpoint`` itself.

    dcp.save(state_dict, storage_writer=spotckpt.dcp_writer("s3://bucket/runs/exp1", step=500))
    dcp.load(state_dict, storage_reader=spotckpt.dcp_reader("s3://bucket/runs/exp1"))

For users who call DCP without a `spotckpt.CheckpointManager`: the same streaming, create-only
commit and verified reads (`spotckpt.engine`), without retention or preemption handling.
"""

from __future__ import annotations

from typing import Any

import torch

from spotckpt.catalog import Catalog
from spotckpt.engine.dcp_standard import StandardCheckpoint, StandardDcpReader, find_standard
from spotckpt.engine.reader import ObjectStoreReader
from spotckpt.engine.writer import ObjectStoreWriter, WriterOptions
from spotckpt.errors import InvalidArgumentError, NoCheckpointError
from spotckpt.format.compression import Compression
from spotckpt.storage import open_store, uri_scheme
from spotckpt.version import __version__

BUCKET_SCHEMES = frozenset({"s3", "gs", "az"})
"""Stores whose uploads run on a pool of `max_concurrency` threads (DCP's `thread_count`)."""

_NOT_HERE = {
    "single_file_per_rank": "spotckpt always writes one object per rank; leave it out",
    "sync_files": "every object is durable once its store confirms it; leave it out",
    "per_thread_copy_ahead": "uploads stream in bounded parts; leave it out",
    "cache_staged_state_dict": "use CheckpointManager(async_save=True) for staging; leave it out",
    "_extensions": (
        "stream extensions such as DCP's ZStandard are not read back by every spotckpt reader; "
        'pass compression="on" (lossless, per block, read by dcp_reader) instead'
    ),
}
"""Options of DCP's own writers that mean nothing here, and what to do instead."""


def dcp_writer(
    uri: str,
    step: int,
    *,
    overwrite: bool = False,
    thread_count: int | None = None,
    compression: str = "off",
    **storage_options: Any,
) -> ObjectStoreWriter:
    """A StorageWriter for ``torch.distributed.checkpoint.save`` / ``async_save`` without a
    manager: it streams each rank's objects to `uri` and commits `step` with its manifest, like
    `CheckpointManager.save`: create-only, unless `overwrite` (DCP's own writers' default) lets
    a save replace a committed step, readers seeing the old step or the new one, never a mix
    (`spotckpt.catalog.Catalog.commit_bytes`). `thread_count` (as DCP's writers take it) is a
    bucket store's `max_concurrency`; `compression` is the manager's setting of that name.
    Options of DCP's writers that mean nothing here are refused, saying what to use instead."""
    refused = sorted(set(storage_options) & set(_NOT_HERE))
    if refused:
        raise InvalidArgumentError(
            "; ".join(f"dcp_writer(): {name}: {_NOT_HERE[name]}" for name in refused)
        )
    if thread_count is not None:
        if thread_count < 1:
            raise InvalidArgumentError(
                f"dcp_writer(): thread_count must be at least 1, got {thread_count}"
            )
        if uri_scheme(uri) in BUCKET_SCHEMES:
            storage_options.setdefault("max_concurrency", thread_count)
    return ObjectStoreWriter(
        open_store(uri, **storage_options),
        step,
        WriterOptions(
            versions={"spotckpt": __version__, "torch": torch.__version__},
            encodings=Compression(compression),
            overwrite=overwrite,
        ),
    )


def dcp_reader(
    uri: str, step: int | None = None, **storage_options: Any
) -> ObjectStoreReader | StandardDcpReader:
    """A StorageReader for ``torch.distributed.checkpoint.load``: committed `step`, or the latest
    committed one. Where the root has no committed step of spotckpt's, a standard DCP checkpoint
    is read instead (`spotckpt.engine.dcp_standard`): `uri` itself when it is one, else its
    ``step-<N>/`` folder (the newest for `step` None). NoCheckpointError when there is neither.
    Values are only ever unpickled with ``weights_only=True``, whatever load planner DCP is
    given, and a standard checkpoint's ``.metadata`` only by an unpickler that admits DCP's
    metadata classes."""
    catalog = Catalog(open_store(uri, **storage_options))
    try:
        found = catalog.resolve(step)
    except NoCheckpointError:
        folder = find_standard(catalog.store, step)
        if folder is None:
            raise
        return StandardDcpReader(StandardCheckpoint(catalog.store, folder))
    return ObjectStoreReader(catalog.store, catalog.read_manifest(found))
