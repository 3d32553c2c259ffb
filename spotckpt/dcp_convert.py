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

Both stream: the state dict handed to DCP's save holds meta tensors (shapes and dtypes), and
each tensor is read from the source when the writer asks for its data, so memory holds about
the largest tensor (whole: a tensor saved sharded by many ranks is assembled once) plus the
values, not the checkpoint. Tensors come out whole (one chunk each); DCP reshards them on every
later load, onto any number of ranks. The nesting of the saved state
dict (``planner_data``) travels with it, so ``dcp_to_torch_save`` rebuilds the same tree.
"""

from __future__ import annotations

import contextlib
import io
import itertools
import logging
import re
import threading
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
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.planner import WriteItem, WriteItemType
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
from spotckpt.errors import (
    AlreadyExistsError,
    CheckpointError,
    InvalidArgumentError,
    InvalidTypeError,
    NoCheckpointError,
)
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
    if not overwrite:  # before anything is read
        catalog.check_not_committed(chosen)
    metadata = checkpoint.metadata
    tensors = _Source(StandardDcpReader(checkpoint), metadata)
    state = _nest(tensors.skeleton(), metadata.planner_data)
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
        dcp.save(state, storage_writer=writer, planner=_StreamingSavePlanner(tensors), no_dist=True)
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

    AlreadyExistsError when `out` holds a DCP checkpoint already, unless `overwrite`. An
    overwrite first deletes the old checkpoint's ``.metadata`` (so that an export that dies
    midway leaves no checkpoint, rather than the old ``.metadata`` over half-rewritten data
    files) and then its data files (those DCP's ``FileSystemWriter`` names
    ``__<rank>_<n>.distcp``, which the new checkpoint may not all rewrite); every other file in
    `out` stays. That happens once the step is read and verified, just before writing."""
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
    source = _Source(reader, metadata)
    state = _nest(source.skeleton(), metadata.planner_data)
    target.mkdir(parents=True, exist_ok=True)
    if overwrite:
        _remove_standard(target)
    with _single_process():
        dcp.save(
            state,
            # One file per item: DCP's writer holds every tensor of a file until the file
            # is done, so one file per rank would hold the whole state.
            storage_writer=FileSystemWriter(
                str(target), single_file_per_rank=False, thread_count=1
            ),
            planner=_StreamingSavePlanner(source),
            no_dist=True,
        )
    report = _report(store.uri, str(target), chosen, metadata, started)
    log.info("exported step %d of %s to %s", chosen, store.uri, target)
    return report


_DATA_FILE = re.compile(r"__\d+_\d+\.distcp")  # what DCP's FileSystemWriter names its files


def _remove_standard(folder: Path) -> None:
    """Delete the DCP checkpoint in `folder`: its ``.metadata`` first, then its data files."""
    (folder / METADATA_NAME).unlink(missing_ok=True)
    for entry in folder.iterdir():
        if _DATA_FILE.fullmatch(entry.name) and entry.is_file():
            entry.unlink()


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


class _StreamingSavePlanner(DefaultSavePlanner):
    """DCP's default save planner over a state dict whose tensors are meta tensors (shapes and
    dtypes only): the writer asks for each tensor's data when it writes it, and gets it read
    from the source then, so that a conversion holds about one tensor at a time."""

    def __init__(self, source: _Source) -> None:
        super().__init__()
        self._source = source

    def resolve_data(self, write_item: WriteItem) -> torch.Tensor | io.BytesIO:
        if write_item.type == WriteItemType.BYTE_IO:
            return super().resolve_data(write_item)
        whole = self._source.tensor(write_item.index.fqn)
        chunk = write_item.tensor_data.chunk if write_item.tensor_data is not None else None
        if chunk is None or tuple(chunk.sizes) == tuple(whole.shape):
            return whole
        return whole[
            tuple(slice(o, o + n) for o, n in zip(chunk.offsets, chunk.sizes, strict=True))
        ]


class _Source:
    """A checkpoint read one tensor at a time through a DCP storage reader (each read verified
    as that reader verifies), the latest tensor kept for the writer's repeated asks."""

    def __init__(self, reader: StorageReader, metadata: Metadata) -> None:
        self.reader = reader
        self.metadata = metadata
        self._lock = threading.Lock()
        self._held: tuple[str, torch.Tensor] | None = None

    def tensor(self, fqn: str) -> torch.Tensor:
        """The whole tensor `fqn`, read now unless it was the last one read."""
        with self._lock:
            if self._held is None or self._held[0] != fqn:
                self._held = None  # let the previous one go before reading the next
                entry = self.metadata.state_dict_metadata[fqn]
                if not isinstance(entry, TensorStorageMetadata):
                    raise InvalidTypeError(f"{fqn!r} is a value, not a tensor")
                target = torch.zeros(tuple(entry.size), dtype=entry.properties.dtype)
                self._load({fqn: target})
                self._held = (fqn, target)
            return self._held[1]

    def skeleton(self) -> dict[str, Any]:
        """Every entry, flat by its DCP name: each tensor as a meta tensor of its shape and
        dtype, each value loaded (values are small; unpickled with ``weights_only=True``)."""
        values: dict[str, Any] = {}
        skeleton: dict[str, Any] = {}
        for fqn, entry in self.metadata.state_dict_metadata.items():
            if isinstance(entry, TensorStorageMetadata):
                size = tuple(entry.size)
                skeleton[fqn] = torch.empty(size, dtype=entry.properties.dtype, device="meta")
            else:
                values[fqn] = skeleton[fqn] = None
        if values:
            self._load(values)
            skeleton.update(values)
        return skeleton

    def _load(self, state: dict[str, Any]) -> None:
        with _single_process():
            dcp.load(state, storage_reader=self.reader, planner=DefaultLoadPlanner(), no_dist=True)


_MAX_DEPTH = 64  # far deeper than any state dict's; a deeper tree would overflow DCP's recursion


def _nest(flat: dict[str, Any], paths: Any) -> dict[str, Any]:
    """The state dict's own tree, rebuilt from each entry's path (``planner_data``, which a
    forged checkpoint may set to anything): the flat dict, which holds every entry under its
    FQN, unless the paths are what DCP's flatten makes of one tree of dicts and lists. That is:
    each path's str keys and int list indices (each below the number of entries) joined by dots
    are its FQN, no path is a prefix of another or deeper than `_MAX_DEPTH`, and every list is
    dense (no gap to fill with None). So no entry is dropped or renamed, and nothing is
    allocated beyond the entries."""
    try:
        if not _dcp_paths(flat, paths):
            raise _NotATree("a path that DCP's flatten does not make")
        return _plain(_tree(flat, paths))
    except _NotATree as why:
        log.debug("planner_data is not the tree of the checkpoint's entries (%s): kept flat", why)
        return flat


class _NotATree(CheckpointError):
    """The paths of ``planner_data`` do not describe one tree of the checkpoint's entries."""


class _Keyed(dict[str, Any]):
    """A dict being rebuilt (apart from the entries' own values, which may be dicts)."""


class _Indexed(dict[int, Any]):
    """A list being rebuilt: its items by index, made a list once every item is in."""


def _dcp_paths(flat: dict[str, Any], paths: Any) -> bool:
    """Whether each entry's path is one that DCP's flatten makes, of its FQN."""
    if not isinstance(paths, dict) or paths.keys() != flat.keys():
        return False
    return all(
        isinstance(path, tuple | list)
        and 0 < len(path) <= _MAX_DEPTH
        and all(type(key) is str or (type(key) is int and 0 <= key < len(flat)) for key in path)
        and ".".join(map(str, path)) == fqn
        for fqn, path in paths.items()
    )


def _tree(flat: dict[str, Any], paths: dict[str, Any]) -> _Keyed:
    root = _Keyed()
    for fqn, value in flat.items():
        path = paths[fqn]
        node: _Keyed | _Indexed = root
        for key, after in itertools.pairwise(path):
            _check_key(node, key)
            if key not in node:
                node[key] = _Indexed() if type(after) is int else _Keyed()
            node = node[key]
            if not isinstance(node, _Keyed | _Indexed):
                raise _NotATree(f"{fqn!r} runs through another entry")
        _check_key(node, path[-1])
        if path[-1] in node:
            raise _NotATree(f"{fqn!r} ends on another entry's path")
        node[path[-1]] = value
    return root


def _check_key(node: _Keyed | _Indexed, key: Any) -> None:
    if isinstance(node, _Indexed) != (type(key) is int):
        raise _NotATree(f"{key!r} under both a dict's keys and a list's indices")


def _plain(node: _Keyed | _Indexed) -> Any:
    """`node` as plain dicts and lists; _NotATree when a list would have a gap."""
    items = {k: _plain(v) if isinstance(v, _Keyed | _Indexed) else v for k, v in node.items()}
    if isinstance(node, _Keyed):
        return items
    if sorted(items) != list(range(len(items))):
        raise _NotATree("a list with a gap")
    return [items[index] for index in range(len(items))]


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
