"""Moving a run between standard DCP checkpoints and spotckpt: `import_dcp` and `export_dcp`.

A team that checkpointed with DCP's own writers (or s3torchconnector's) switches by importing
its newest checkpoint as a committed spotckpt step, and continues the run from it; a team that
leaves, or a tool that only opens DCP folders (``dcp_to_torch_save``, ``FileSystemReader``),
gets a standard checkpoint back out.

- `import_dcp` reads the standard checkpoint through `spotckpt.engine.dcp_standard` (its
  ``.metadata`` through the restricted unpickler, every item's range checked against its
  object's size, values unpickled with ``weights_only=True``) and saves it through spotckpt's
  own writer: CRC32Cs computed, signed when the destination's configuration holds a signing
  key, and committed create-only under the destination's job identity (created if the root has
  none), unless `overwrite` replaces a committed step as ``dcp_writer(overwrite=True)`` does.
- `export_dcp` reads a committed step through spotckpt's verified reader (under the root's keys:
  an unsigned or forged step is refused as a restore refuses it) and writes it with DCP's own
  ``FileSystemWriter`` into a local folder, whose ``.metadata`` DCP renames into place last.

Both hold the whole state in memory once (as ``dcp_to_torch_save`` does): convert on a machine
with at least the checkpoint's size of RAM. Tensors come out whole (one chunk each); DCP
reshards them on every later load, onto any number of ranks. The nesting of the saved state
dict (``planner_data``) travels with it, so ``dcp_to_torch_save`` rebuilds the same tree.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import re
import time
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.storage import StorageReader

from spotckpt.catalog import Catalog
from spotckpt.engine.checkpointer import first_cause
from spotckpt.engine.dcp_standard import (
    METADATA_NAME,
    STANDARD_STEP,
    StandardCheckpoint,
    StandardDcpReader,
    find_standard,
)
from spotckpt.engine.reader import ObjectStoreReader
from spotckpt.engine.writer import ObjectStoreWriter, WriterOptions
from spotckpt.errors import AlreadyExistsError, InvalidArgumentError, NoCheckpointError
from spotckpt.format.signing import Keyring
from spotckpt.storage.base import ObjectStore
from spotckpt.storage.registry import uri_scheme
from spotckpt.version import __version__

log = logging.getLogger("spotckpt")


@dataclass(frozen=True)
class ConversionReport:
    """What a conversion moved: where from and to, the step, and how much."""

    source: str
    destination: str
    step: int
    tensors: int
    values: int
    tensor_bytes: int
    seconds: float

    def to_dict(self) -> dict[str, Any]:
        """The report as plain JSON-able values (``--json``)."""
        return {
            "source": self.source,
            "destination": self.destination,
            "step": self.step,
            "tensors": self.tensors,
            "values": self.values,
            "tensor_bytes": self.tensor_bytes,
            "seconds": round(self.seconds, 3),
        }


def import_dcp(
    source: ObjectStore,
    destination: ObjectStore,
    *,
    step: int | None = None,
    keyring: Keyring | None = None,
    overwrite: bool = False,
) -> ConversionReport:
    """Commit the standard DCP checkpoint at `source` as step `step` of the spotckpt root
    `destination` (see the module docstring).

    `source` is the checkpoint folder itself, or a root of ``step-<N>/`` folders (`step` picks
    one, else the newest). The step committed is `step`, else the N of the folder's name
    (``step-<N>``, the source URI's last part included); InvalidArgumentError when neither
    says, NoCheckpointError when `source` holds no standard checkpoint (of `step`)."""
    started = time.monotonic()
    folder = find_standard(source, step)
    if folder is None and step is not None:
        folder = find_standard(source, None)
        if folder != "":
            folder = None
    if folder is None:
        wanted = f" of step {step}" if step is not None else ""
        raise NoCheckpointError(
            f"no standard DCP checkpoint{wanted} at {source.uri} (a folder with a "
            f"{METADATA_NAME} object, or step-<N>/ folders holding one)"
        )
    checkpoint = StandardCheckpoint(source, folder)
    chosen = step if step is not None else _named_step(checkpoint.uri)
    catalog = Catalog(destination, keyring)
    if not overwrite:  # before the whole state is read
        catalog.check_not_committed(chosen)
    metadata = checkpoint.metadata
    state = _nest(_read_whole(StandardDcpReader(checkpoint), metadata), metadata.planner_data)
    job = catalog.ensure_job().id
    writer = ObjectStoreWriter(
        destination,
        chosen,
        WriterOptions(
            versions={"spotckpt": __version__, "torch": torch.__version__},
            keyring=keyring,
            job=job,
            overwrite=overwrite,
            user_metadata={"imported_from": _without_secrets(checkpoint.uri)},
        ),
    )
    with _single_process():
        dcp.save(state, storage_writer=writer, no_dist=True)
    report = _report(checkpoint.uri, destination.uri, chosen, metadata, started)
    log.info("imported %s as step %d of %s", checkpoint.uri, chosen, destination.uri)
    return report


def export_dcp(
    store: ObjectStore,
    step: int | None,
    out: str | Path,
    *,
    keyring: Keyring | None = None,
    overwrite: bool = False,
) -> ConversionReport:
    """Write committed step `step` (default: the latest) of the spotckpt root `store` as a
    standard DCP checkpoint into the local folder `out` (see the module docstring).

    AlreadyExistsError when `out` holds a DCP checkpoint already, unless `overwrite`."""
    started = time.monotonic()
    target = _local_folder(str(out))
    if (target / METADATA_NAME).exists() and not overwrite:
        raise AlreadyExistsError(
            f"{target} holds a DCP checkpoint already; pass overwrite (--overwrite) to replace it"
        )
    if target.exists() and not target.is_dir():
        raise InvalidArgumentError(f"{target} is not a folder")
    catalog = Catalog(store, keyring)
    chosen = catalog.resolve(step)
    reader = ObjectStoreReader(store, catalog.read_manifest(chosen))
    metadata = reader.read_metadata()
    state = _nest(_read_whole(reader, metadata), metadata.planner_data)
    target.mkdir(parents=True, exist_ok=True)
    with _single_process():
        dcp.save(state, storage_writer=FileSystemWriter(str(target)), no_dist=True)
    report = _report(store.uri, str(target), chosen, metadata, started)
    log.info("exported step %d of %s to %s", chosen, store.uri, target)
    return report


def _local_folder(out: str) -> Path:
    """`out` as a local path: DCP's ``FileSystemReader`` and ``dcp_to_torch_save`` read folders."""
    if uri_scheme(out) != "file":
        raise InvalidArgumentError(
            f"{out}: export-dcp writes a local folder (what FileSystemReader and "
            "dcp_to_torch_save read); copy the folder to a bucket afterwards if it must go there"
        )
    return Path(out.removeprefix("file://"))


@contextlib.contextmanager
def _single_process() -> Iterator[None]:
    """DCP without a process group, without its warning on every call, raising what failed
    rather than DCP's wrapper of it."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
        try:
            yield
        except CheckpointException as error:
            raise first_cause(error) from None


def _read_whole(reader: StorageReader, metadata: Metadata) -> dict[str, Any]:
    """Every entry of a checkpoint, flat by its DCP name: tensors whole, values unpickled."""
    flat: dict[str, Any] = {
        fqn: torch.empty(tuple(entry.size), dtype=entry.properties.dtype)
        if isinstance(entry, TensorStorageMetadata)
        else None
        for fqn, entry in metadata.state_dict_metadata.items()
    }
    with _single_process():
        dcp.load(flat, storage_reader=reader, planner=DefaultLoadPlanner(), no_dist=True)
    return flat


def _nest(flat: dict[str, Any], paths: Any) -> dict[str, Any]:
    """The state dict's own tree, rebuilt from each entry's path (``planner_data``): the flat
    dict when the paths do not describe one tree of dicts and lists."""
    if not isinstance(paths, dict) or set(paths) != set(flat):
        return flat
    root: dict[Any, Any] = {}
    try:
        for fqn, value in flat.items():
            path = paths[fqn]
            if not isinstance(path, tuple | list) or not path:
                return flat
            node: Any = root
            for key, after in itertools.pairwise(path):
                node = _child(node, key, [] if type(after) is int else {})
            _put(node, path[-1], value)
    except (TypeError, IndexError, KeyError):
        return flat
    return root


def _child(node: Any, key: Any, empty: dict[Any, Any] | list[Any]) -> Any:
    if _put(node, key, empty, keep=True) is None:
        return empty
    return node[key]


def _put(node: Any, key: Any, value: Any, *, keep: bool = False) -> Any:
    """Set `node[key]` (growing a list), unless `keep` and it is set: returns what was there."""
    if isinstance(node, list) and type(key) is int:
        node.extend([None] * (key + 1 - len(node)))
    elif not (isinstance(node, dict) and type(key) in (str, int)):
        raise TypeError(f"path element {key!r} under a {type(node).__name__}")
    found = node[key] if isinstance(node, list) else node.get(key)
    if found is None or not keep:
        node[key] = value
    return found


def _named_step(uri: str) -> int:
    match = STANDARD_STEP.fullmatch(re.split(r"[/\\]", uri.rstrip("/"))[-1])
    if match is None:
        raise InvalidArgumentError(
            f"{uri} does not name its step (a step-<N> folder): say which step it is (--step)"
        )
    return int(match.group(1))


def _without_secrets(uri: str) -> str:
    """The URI without a query or credentials (a SAS token, a user:password)."""
    plain = uri.split("?", 1)[0]
    return re.sub(r"//[^/@]*@", "//", plain)


def _report(
    source: str, destination: str, step: int, metadata: Metadata, started: float
) -> ConversionReport:
    tensors = [
        entry
        for entry in metadata.state_dict_metadata.values()
        if isinstance(entry, TensorStorageMetadata)
    ]
    size = sum(
        torch.Size(entry.size).numel() * entry.properties.dtype.itemsize for entry in tensors
    )
    return ConversionReport(
        source=_without_secrets(source),
        destination=_without_secrets(destination),
        step=step,
        tensors=len(tensors),
        values=len(metadata.state_dict_metadata) - len(tensors),
        tensor_bytes=size,
        seconds=time.monotonic() - started,
    )
