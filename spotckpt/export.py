"""`export_hf`: consolidate a checkpoint's model weights into a Hugging Face safetensors folder.

The tensors whose name starts with `prefix` (``model.``: where `TrainState` keeps the parameters
and buffers of its model) are assembled whole from however many ranks saved them (each stored
chunk is fetched with ranged reads and its per-block CRC32Cs verified, then copied into place by
its offsets) and written in the layout ``transformers`` and ``safetensors`` load:
``model.safetensors`` when everything fits in one shard of `max_shard_size` bytes, otherwise
``model-00001-of-0000K.safetensors`` ... plus ``model.safetensors.index.json``, written last:
``{"metadata": {"total_parameters": P, "total_size": N}, "weight_map": {name: file}}``, as
``save_pretrained`` writes it (a single file has no index, there as here). ``total_size`` is the
bytes and ``total_parameters`` the elements of the tensors written; a checkpoint does not tell
parameters from persistent buffers, so those count too (``save_pretrained`` counts parameters
only; the two agree for models whose buffers are not persistent, as most are).

Names: by default the prefix is stripped (``model.layers.0.weight`` is written as
``layers.0.weight``), as Hugging Face names parameters relative to the model. Only floating-point
tensors are cast when `dtype` is given; integer and boolean buffers keep their dtype. Each output
file is streamed through the output store's writer: memory holds the tensor being written, the
chunks read ahead (`read_ahead_bytes`), and the store's upload buffers, never a whole shard.

Tied weights. A model whose output projection is its input embeddings (``lm_head.weight`` *is*
``model.embed_tokens.weight``) is saved by DCP under both names, as two copies: a checkpoint keeps
no storage identity. ``save_pretrained`` writes such a tensor once, dropping the tied name
(``lm_head.weight``), and ``from_pretrained`` ties it again. `export_hf` drops a name when all of
these hold (`dedupe_tied=False` writes every name):

1. the names written form a pair that Hugging Face ties, listed in `TIED_NAMES`:
   ``lm_head.weight`` with the first present of ``model.shared.weight``, ``shared.weight``,
   ``model.embed_tokens.weight``, ``embed_tokens.weight``, ``transformer.wte.weight``,
   ``transformer.word_embeddings.weight``, ``model.decoder.embed_tokens.weight``, and the T5 and
   BART encoder and decoder embeddings with their ``shared.weight``. Only a name that
   ``from_pretrained`` ties again is ever dropped: equal values elsewhere (two zero biases) are
   all written.
2. an included ``config.json`` does not say ``"tie_word_embeddings": false`` (``save_pretrained``
   leaves the key out when it is true, the default);
3. the manifest promises equal bytes, compared before anything is read: the same dtype and shape,
   the same pieces, and equal CRC32Cs for every 64 KiB block;
4. the bytes are equal: the dropped copy is read after the kept one and compared byte for byte
   (one extra read of that tensor); a difference, which takes a CRC32C collision, stops the
   export with `TiedWeightsMismatchError`.

When an included ``config.json`` ties the embeddings but the checkpoint's two copies differ, both
are written and a warning says that ``from_pretrained`` will use one tensor for both.

Extra files (`include`): config, tokenizer and generation files are not part of a checkpoint (it
stores no user files); `include` copies them beside the weights from local paths, after the
weights and before the index. A file is copied under its own name (links are followed: a Hugging
Face cache snapshot is a folder of links); a folder contributes its top-level files, except hidden
ones and weights (``*.safetensors``, ``*.bin``, ``*.pt``, ... and ``*.index.json``: the export
writes its own), so a base model's snapshot folder can be given whole. A name is refused when it
is not a plain file name (``check_key``: no ``..``, separators, control characters), does not
print or has leading or trailing spaces, is not in NFKC form (full-width dots and other
look-alikes), or equals, ignoring case, a name the export writes or another included file's. A
file already in `out` is replaced only with `overwrite`.
"""

from __future__ import annotations

import json
import logging
import os
import re
import unicodedata
from collections import deque
from collections.abc import Callable, Generator, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from math import prod
from pathlib import Path
from typing import Any

import torch

from spotckpt.catalog import Catalog
from spotckpt.engine.chunks import ChunkReader, strong_hashes
from spotckpt.errors import (
    InvalidArgumentError,
    InvalidKeyError,
    TiedWeightsMismatchError,
)
from spotckpt.format.dtypes import BY_NAME, DType, dtype_of
from spotckpt.format.manifest import (
    Manifest,
    TensorChunk,
    TensorRecord,
)
from spotckpt.format.safetensors_io import (
    SafetensorsStreamWriter,
    TensorSpec,
    bytes_to_tensor,
    tensor_bytes,
)
from spotckpt.format.signing import Keyring
from spotckpt.layout import step_folder
from spotckpt.redact import printable
from spotckpt.storage.base import AlreadyExistsError, ObjectStore, check_key
from spotckpt.storage.registry import open_store

log = logging.getLogger("spotckpt")

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
CONFIG_FILE = "config.json"
DEFAULT_MAX_SHARD_SIZE = 5 * 10**9
TIED_NAMES: dict[str, tuple[str, ...]] = {
    "encoder.embed_tokens.weight": ("shared.weight",),
    "decoder.embed_tokens.weight": ("shared.weight",),
    "model.encoder.embed_tokens.weight": ("model.shared.weight",),
    "model.decoder.embed_tokens.weight": ("model.shared.weight",),
    "lm_head.weight": (
        "model.shared.weight",
        "shared.weight",
        "model.embed_tokens.weight",
        "embed_tokens.weight",
        "transformer.wte.weight",
        "transformer.word_embeddings.weight",
        "model.decoder.embed_tokens.weight",
    ),
}
"""Names ``save_pretrained`` drops when tied -> the names they are tied to, first present wins.

Looked at in this order, so a name dropped earlier (BART's ``model.decoder.embed_tokens.weight``)
is never kept for a later one."""
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack", ".gguf")
"""Files a folder given to `include` does not contribute (nor ``*.index.json``)."""
_SHARD_NAME = re.compile(r"^model-\d{5}-of-\d{5}\.safetensors$")
_READ_PIECE = 16 << 20
_COPY_PIECE = 8 << 20
ProgressFn = Callable[[int, int], None]
"""Called as ``progress(bytes_written, bytes_total)`` after each tensor is written."""


@dataclass(frozen=True)
class _Item:
    """One exported tensor: where it comes from, what it becomes, the tied copies it stands for."""

    source: str
    record: TensorRecord
    spec: TensorSpec
    twins: tuple[_Item, ...] = ()


@dataclass(frozen=True)
class _Include:
    """A local file copied into the export under `name`."""

    name: str
    path: Path


@dataclass
class ExportReport:
    """What `export_hf` wrote."""

    step: int
    out_uri: str
    files: list[str] = field(default_factory=list)
    index: str | None = None
    tensors: int = 0
    total_size: int = 0
    total_parameters: int = 0
    tied: dict[str, str] = field(default_factory=dict)
    """Names not written -> the name written for both."""
    included: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready form."""
        return {
            "step": self.step,
            "out": self.out_uri,
            "files": list(self.files),
            "index": self.index,
            "tensors": self.tensors,
            "total_size": self.total_size,
            "total_parameters": self.total_parameters,
            "tied": dict(self.tied),
            "included": list(self.included),
        }


def export_hf(
    store: ObjectStore,
    step: int,
    out: ObjectStore | str,
    *,
    max_shard_size: int = DEFAULT_MAX_SHARD_SIZE,
    dtype: torch.dtype | None = None,
    prefix: str = "model.",
    strip_prefix: bool = True,
    overwrite: bool = False,
    include: Sequence[str | os.PathLike[str]] = (),
    dedupe_tied: bool = True,
    progress: ProgressFn | None = None,
    read_ahead_bytes: int = 256 << 20,
    max_parallel_reads: int = 8,
    keyring: Keyring | None = None,
) -> ExportReport:
    """Write the model weights of checkpoint `step` to `out` (a store or a URI) in HF layout,
    tied weights once, and copy the local files or folders in `include` beside them.

    Raises NoCheckpointError for a step without a manifest, InvalidArgumentError when no tensor
    matches `prefix` or an include is missing or badly named, AlreadyExistsError when `out` holds
    an export or an included file's name and `overwrite` is off, CorruptCheckpointError when a
    stored object is missing, truncated or fails its CRC32Cs, and TiedWeightsMismatchError when
    tied copies differ despite equal CRC32Cs. With a `keyring`, a step that is not signed for
    this job is refused (SignatureError), as a restore refuses it.
    """
    if max_shard_size < 1:
        raise InvalidArgumentError("max_shard_size must be positive")
    if dtype is not None and not dtype.is_floating_point:
        raise InvalidArgumentError(f"export dtype must be a floating-point type, got {dtype}")
    includes = plan_includes(include)
    tie_setting = _tie_setting(includes)
    manifest = Catalog(store, keyring).read_manifest(step)
    items = select_tensors(manifest, prefix, strip_prefix, dtype)
    ties = find_ties(items, tie_setting) if dedupe_tied else {}
    items = _attach_twins(items, ties)
    shards = plan_shards([i.spec for i in items], max_shard_size)
    out_store = open_store(out) if isinstance(out, str) else out
    try:
        stale = _existing_export(out_store, overwrite)
        _check_targets(out_store, includes, overwrite)
        names = shard_names(len(shards))
        report = ExportReport(step=step, out_uri=out_store.uri, tensors=len(items), tied=ties)
        report.total_size = sum(i.spec.nbytes for i in items)
        report.total_parameters = sum(prod(i.spec.shape) for i in items)
        reader = _TensorStream(store, manifest, read_ahead_bytes, max_parallel_reads)
        tensors = reader.tensors(items)
        done = 0
        try:
            for name, specs in zip(names, shards, strict=True):
                done = _write_shard(out_store, name, specs, tensors, done, report, progress)
                report.files.append(name)
        finally:
            tensors.close()
        for extra in includes:
            _copy_file(out_store, extra)
            report.included.append(extra.name)
        if len(shards) > 1:
            report.index = INDEX_FILE
            out_store.put(INDEX_FILE, _index_json(names, shards, report))
        out_store.delete_many(sorted(set(stale) - set(report.files) - {report.index}))
    finally:
        if isinstance(out, str):
            out_store.close()
    return report


def select_tensors(
    manifest: Manifest, prefix: str, strip_prefix: bool, dtype: torch.dtype | None
) -> list[_Item]:
    """The tensors under `prefix` in manifest order, with their output names and dtypes."""
    items = []
    for fqn, record in manifest.tensors.items():
        if not fqn.startswith(prefix):
            continue
        name = fqn[len(prefix) :] if strip_prefix else fqn
        if not name:
            raise InvalidArgumentError(
                f"tensor {fqn!r} has an empty name once {prefix!r} is stripped"
            )
        stored = BY_NAME[record.dtype]
        cast = dtype if dtype is not None and stored.torch_dtype.is_floating_point else None
        out_dtype = dtype_of(cast) if cast is not None else stored
        items.append(_Item(fqn, record, TensorSpec(name, out_dtype, record.shape)))
    if not items:
        tops = sorted({fqn.split(".")[0] + "." for fqn in manifest.tensors})
        raise InvalidArgumentError(
            f"no tensor of step {manifest.step} starts with {prefix!r}; "
            f"tensor names start with: {', '.join(tops) or 'nothing (no tensors)'}"
        )
    return items


def find_ties(items: Sequence[_Item], tie_setting: bool | None) -> dict[str, str]:
    """Output names to leave out -> the output name written for both (rules 1-3 of the module
    docstring; rule 4 is checked while reading). `tie_setting` is an included config's
    ``tie_word_embeddings`` (None without a config.json)."""
    if tie_setting is False:
        return {}
    by_name = {item.spec.name: item for item in items}
    ties: dict[str, str] = {}
    for dropped, candidates in TIED_NAMES.items():
        item = by_name.get(dropped)
        if item is None or dropped in ties.values():
            continue
        present = [name for name in candidates if name in by_name and name not in ties]
        kept = next(
            (n for n in present if _same_stored_bytes(item.record, by_name[n].record)), None
        )
        if kept is not None:
            ties[dropped] = kept
        elif present and tie_setting:
            log.warning(
                "config.json ties the word embeddings, but %s differs from %s in the checkpoint: "
                "both are written, and from_pretrained will use one tensor for both",
                dropped,
                present[0],
            )
    return ties


def _same_stored_bytes(a: TensorRecord, b: TensorRecord) -> bool:
    """Whether the manifest promises equal bytes: dtype, shape, pieces and every block CRC32C."""

    def pieces(record: TensorRecord) -> list[tuple[Any, ...]]:
        return sorted(
            (c.offsets, c.sizes, c.location.length, c.location.block_crc32c) for c in record.chunks
        )

    return (a.dtype, a.shape) == (b.dtype, b.shape) and pieces(a) == pieces(b)


def _attach_twins(items: list[_Item], ties: dict[str, str]) -> list[_Item]:
    """The items written: the dropped ones ride along with the one kept for them."""
    by_name = {item.spec.name: item for item in items}
    twins: dict[str, list[_Item]] = {}
    for dropped, kept in ties.items():
        twins.setdefault(kept, []).append(by_name[dropped])
    return [
        replace(item, twins=tuple(twins.get(item.spec.name, ())))
        for item in items
        if item.spec.name not in ties
    ]


def plan_shards(specs: list[TensorSpec], max_shard_size: int) -> list[list[TensorSpec]]:
    """Greedy split in order: a shard closes when the next tensor would overflow it.

    A tensor larger than `max_shard_size` gets a shard of its own.
    """
    shards: list[list[TensorSpec]] = [[]]
    size = 0
    for spec in specs:
        if shards[-1] and size + spec.nbytes > max_shard_size:
            shards.append([])
            size = 0
        shards[-1].append(spec)
        size += spec.nbytes
    return shards


def shard_names(count: int) -> list[str]:
    """``model.safetensors`` for one shard, else ``model-0000i-of-0000K.safetensors``."""
    if count == 1:
        return [SINGLE_FILE]
    return [f"model-{i:05d}-of-{count:05d}.safetensors" for i in range(1, count + 1)]


def _index_json(names: list[str], shards: list[list[TensorSpec]], report: ExportReport) -> bytes:
    weight_map = {
        spec.name: name for name, specs in zip(names, shards, strict=True) for spec in specs
    }
    metadata = {"total_parameters": report.total_parameters, "total_size": report.total_size}
    document = {"metadata": metadata, "weight_map": weight_map}
    return (json.dumps(document, indent=2, sort_keys=True) + "\n").encode()


def _existing_export(out: ObjectStore, overwrite: bool) -> list[str]:
    """Names of a previous export in `out`; raises unless `overwrite` allows replacing them."""
    found = [
        info.key
        for info in out.list("model")
        if info.key in (SINGLE_FILE, INDEX_FILE) or _SHARD_NAME.match(info.key)
    ]
    if found and not overwrite:
        raise AlreadyExistsError(
            f"{out.uri} already holds an export ({found[0]}); pass overwrite=True (--overwrite) "
            "to replace it"
        )
    return found


# Included files -----------------------------------------------------------------------------------


def plan_includes(paths: Sequence[str | os.PathLike[str]]) -> list[_Include]:
    """The local files to copy for `paths` (files, or folders' top-level files), each under its
    own name; InvalidArgumentError for a missing path, a refused name or two files of one name."""
    chosen: dict[str, _Include] = {}
    for given in paths:
        for path in _include_members(Path(given)):
            name = _include_name(path)
            clash = chosen.get(name.casefold())
            if clash is not None:
                raise InvalidArgumentError(
                    f"include {printable(str(path))} and {printable(str(clash.path))} would both "
                    f"be written as {printable(clash.name)!r}"
                )
            chosen[name.casefold()] = _Include(name, path)
    return list(chosen.values())


def _include_members(path: Path) -> list[Path]:
    """`path` itself, or a folder's top-level files without hidden ones and weights."""
    if path.is_dir():
        files = sorted(p for p in path.iterdir() if p.is_file() and not p.name.startswith("."))
        weights = [p.name for p in files if _is_weights(p.name)]
        if weights:
            log.info("include %s: weights not copied: %s", path, ", ".join(weights))
        return [p for p in files if not _is_weights(p.name)]
    if path.is_file():
        return [path]
    raise InvalidArgumentError(f"include {printable(str(path))}: no such file or folder")


def _is_weights(name: str) -> bool:
    folded = name.casefold()
    return folded.endswith(WEIGHT_SUFFIXES) or folded.endswith(".index.json")


def _include_name(path: Path) -> str:
    """`path`'s name if it is safe as a file name of the export (see the module docstring)."""
    name = path.name
    where = f"include {printable(str(path))}"
    try:
        check_key(name)
    except InvalidKeyError as error:
        raise InvalidArgumentError(f"{where}: {error}") from None
    if not name.isprintable() or name != name.strip():
        raise InvalidArgumentError(
            f"{where}: the name {printable(name)!r} has characters that do not print, or spaces "
            "at an end"
        )
    if unicodedata.normalize("NFKC", name) != name:
        raise InvalidArgumentError(
            f"{where}: the name {name!r} has characters that stand for others (it is not in "
            "NFKC form)"
        )
    folded = name.casefold()
    if folded in (SINGLE_FILE, INDEX_FILE) or _SHARD_NAME.match(folded):
        raise InvalidArgumentError(f"{where}: {name!r} is a name the export writes itself")
    return name


def _tie_setting(includes: Sequence[_Include]) -> bool | None:
    """``tie_word_embeddings`` of the included config.json (True where it leaves the key out, as
    save_pretrained does for the default); None without one."""
    config = next((extra for extra in includes if extra.name == CONFIG_FILE), None)
    if config is None:
        return None
    where = f"include {printable(str(config.path))}"
    try:
        document = json.loads(config.path.read_bytes())
    except ValueError as error:
        raise InvalidArgumentError(f"{where}: not a JSON model config ({error})") from None
    if not isinstance(document, dict):
        raise InvalidArgumentError(f"{where}: not a JSON model config (not an object)")
    value = document.get("tie_word_embeddings", True)
    if not isinstance(value, bool):
        raise InvalidArgumentError(f"{where}: tie_word_embeddings is {value!r}, not true or false")
    return value


def _check_targets(out: ObjectStore, includes: Sequence[_Include], overwrite: bool) -> None:
    """Refuse to replace a file already in `out` unless `overwrite` is on."""
    if overwrite:
        return
    for extra in includes:
        if out.head(extra.name) is not None:
            raise AlreadyExistsError(
                f"{out.uri} already holds {extra.name}; pass overwrite=True (--overwrite) to "
                "replace it"
            )


def _copy_file(out: ObjectStore, extra: _Include) -> None:
    with extra.path.open("rb") as source, out.open_writer(extra.name) as writer:
        while piece := source.read(_COPY_PIECE):
            writer.write(piece)


# Writing ------------------------------------------------------------------------------------------


def _write_shard(
    out: ObjectStore,
    name: str,
    specs: list[TensorSpec],
    tensors: Iterator[torch.Tensor],
    done: int,
    report: ExportReport,
    progress: ProgressFn | None,
) -> int:
    """Stream one output file; returns the running count of bytes written."""
    with out.open_writer(name) as writer:
        stream = SafetensorsStreamWriter(writer, specs, {"format": "pt"})
        for spec in specs:
            tensor = next(tensors)
            stream.write_tensor(spec.name, tensor_bytes(tensor.to(spec.dtype.torch_dtype)))
            done += spec.nbytes
            if progress is not None:
                progress(done, report.total_size)
        stream.finish()
    return done


class _TensorStream:
    """Assembles whole tensors in export order from verified chunks, with a bounded read-ahead."""

    def __init__(
        self, store: ObjectStore, manifest: Manifest, read_ahead_bytes: int, workers: int
    ) -> None:
        self.chunks = ChunkReader(
            store,
            step_folder(manifest.step),
            manifest.block_size,
            {key: record.size for key, record in manifest.objects.items()},
            strong=strong_hashes(manifest),
        )
        self.read_ahead_bytes = read_ahead_bytes
        self.workers = workers

    def tensors(self, items: list[_Item]) -> Generator[torch.Tensor, None, None]:
        """Yield each item's whole tensor, in its stored dtype, in order, after comparing it with
        the tied copies it stands for."""
        jobs = [
            (part, chunk)
            for item in items
            for part in (item, *item.twins)
            for chunk in part.record.chunks
        ]
        pool = ThreadPoolExecutor(self.workers, thread_name_prefix="spotckpt-export")
        fetched = self._prefetch(pool, jobs)
        try:
            for item in items:
                whole = self._assemble(item, fetched)
                for twin in item.twins:
                    self._compare(twin, item, whole, fetched)
                yield whole
        finally:
            fetched.close()
            pool.shutdown(wait=True, cancel_futures=True)

    def _assemble(self, item: _Item, fetched: Iterator[torch.Tensor]) -> torch.Tensor:
        for chunk in item.record.chunks:  # a forged shape is refused, not allocated
            self.chunks.check_chunk(chunk.location, item.source)
        stored = BY_NAME[item.record.dtype]
        whole = torch.empty(item.record.shape, dtype=stored.torch_dtype)
        for chunk in item.record.chunks:
            whole[_slices(chunk)].copy_(next(fetched))
        return whole

    def _compare(
        self, twin: _Item, item: _Item, whole: torch.Tensor, fetched: Iterator[torch.Tensor]
    ) -> None:
        """Raise TiedWeightsMismatchError unless every stored piece of `twin` equals `whole`'s."""
        for chunk in twin.record.chunks:
            if not torch.equal(_bits(next(fetched)), _bits(whole[_slices(chunk)])):
                raise TiedWeightsMismatchError(
                    f"{twin.source!r} and {item.source!r} have equal CRC32Cs but different bytes, "
                    "so they are not one tied tensor; export with dedupe_tied=False (--keep-tied)"
                )

    def _prefetch(
        self, pool: ThreadPoolExecutor, jobs: list[tuple[_Item, TensorChunk]]
    ) -> Generator[torch.Tensor, None, None]:
        pending: deque[tuple[int, Future[torch.Tensor]]] = deque()
        in_flight = 0
        for item, chunk in jobs:
            size = chunk.location.length
            while pending and in_flight + size > self.read_ahead_bytes:
                length, future = pending.popleft()
                in_flight -= length
                yield future.result()
            stored = BY_NAME[item.record.dtype]
            pending.append((size, pool.submit(self._read_chunk, item.source, chunk, stored)))
            in_flight += size
        while pending:
            yield pending.popleft()[1].result()

    def _read_chunk(self, source: str, chunk: TensorChunk, stored: DType) -> torch.Tensor:
        """One chunk as a tensor, read in verified pieces of whole blocks."""
        location = chunk.location
        self.chunks.check_chunk(location, source)
        buffer = bytearray(location.length)
        block_size = self.chunks.block_size
        step = max(1, _READ_PIECE // block_size) * block_size
        if self.chunks.hashed(location):  # its BLAKE3 is checked over the whole chunk
            step = max(1, location.length)
        for start in range(0, location.length, step):
            piece, _ = self.chunks.read_chunk(
                location, source, start, min(start + step, location.length)
            )
            buffer[start : start + len(piece)] = piece
        if not location.length:
            self.chunks.verify(b"", location, 0, source)
        return bytes_to_tensor(buffer, stored, chunk.sizes)


def _slices(chunk: TensorChunk) -> tuple[slice, ...]:
    return tuple(slice(o, o + s) for o, s in zip(chunk.offsets, chunk.sizes, strict=True))


def _bits(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes, so that equal NaNs and signed zeros compare as stored."""
    return tensor.contiguous().reshape(-1).view(torch.uint8)
