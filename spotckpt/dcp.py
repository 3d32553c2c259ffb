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
from spotckpt.engine.reader import ObjectStoreReader
from spotckpt.engine.writer import ObjectStoreWriter, WriterOptions
from spotckpt.storage import open_store
from spotckpt.version import __version__


def dcp_writer(uri: str, step: int, **storage_options: Any) -> ObjectStoreWriter:
    """A StorageWriter for ``torch.distributed.checkpoint.save`` / ``async_save`` without a
    manager: it streams each rank's objects to `uri` and commits `step` with its manifest, like
    `CheckpointManager.save` (create-only; a committed step is never overwritten)."""
    return ObjectStoreWriter(
        open_store(uri, **storage_options),
        step,
        WriterOptions(versions={"spotckpt": __version__, "torch": torch.__version__}),
    )


def dcp_reader(uri: str, step: int | None = None, **storage_options: Any) -> ObjectStoreReader:
    """A StorageReader for ``torch.distributed.checkpoint.load``: `step`, or the latest
    committed one (NoCheckpointError when there is none). Values are only ever unpickled with
    ``weights_only=True``, whatever load planner DCP is given."""
    catalog = Catalog(open_store(uri, **storage_options))
    return ObjectStoreReader(catalog.store, catalog.read_manifest(catalog.resolve(step)))
