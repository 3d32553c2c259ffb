"""``spotckpt inspect``: a committed step's manifest as the catalog reads it (objects, tensors
and their sharding, values, metadata), without loading torch."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

import click

from spotckpt.catalog import Catalog
from spotckpt.cli.common import (
    emit_json,
    json_option,
    opened_root,
    plural,
    resolve_step,
    step_option,
    storage_option,
    table,
    uri_argument,
    utc_time,
)
from spotckpt.redact import printable
from spotckpt.storage import ObjectStore
from spotckpt.units import human_size

if TYPE_CHECKING:  # the types `Catalog.read_manifest` returns; nothing of the format is used
    from spotckpt.format.manifest import Manifest, TensorRecord


@click.command("inspect")
@uri_argument
@step_option
@click.option("--filter", "name_filter", default="", help="Only tensors whose name starts so.")
@storage_option
@json_option
def inspect_command(
    uri: str | None,
    step: int | None,
    name_filter: str,
    storage_options: tuple[tuple[str, str], ...],
    as_json: bool,
) -> None:
    """Summarise a checkpoint's manifest: tensors, sharding, metadata."""
    with opened_root(uri, storage_options) as store:
        manifest = Catalog(store).read_manifest(resolve_step(store, step))
        tensors = {n: t for n, t in manifest.tensors.items() if n.startswith(name_filter)}
        if as_json:
            emit_json(_inspect_json(store, manifest, tensors))
            return
        click.echo(_inspect_text(store, manifest, tensors, name_filter))


def describe_sharding(tensor: TensorRecord) -> str:
    """``whole`` for one chunk, else how many chunks split which dimensions."""
    if len(tensor.chunks) == 1:
        return "whole"
    dims = sorted(
        {
            d
            for c in tensor.chunks
            for d, (o, s) in enumerate(zip(c.offsets, c.sizes, strict=True))
            if o != 0 or s != tensor.shape[d]
        }
    )
    where = "dim" if len(dims) == 1 else "dims"
    return f"{len(tensor.chunks)} chunks on {where} {','.join(map(str, dims))}"


def _tensor_bytes(tensor: TensorRecord) -> int:
    return sum(c.location.length for c in tensor.chunks)


def _inspect_json(
    store: ObjectStore, manifest: Manifest, tensors: dict[str, TensorRecord]
) -> dict[str, Any]:
    return {
        "uri": store.uri,
        "step": manifest.step,
        "attempt": manifest.attempt,
        "created_at": manifest.created_at,
        "world_size": manifest.world_size,
        "bytes": manifest.total_bytes,
        "written_bytes": manifest.written_bytes,
        "referenced_bytes": manifest.referenced_bytes,
        "format": manifest.format,
        "versions": manifest.versions,
        "user_metadata": manifest.user_metadata,
        "objects": [
            {"key": o.key, "rank": o.rank, "bytes": o.size, "crc32c": f"{o.crc32c:08x}"}
            for o in manifest.objects.values()
        ],
        "tensors": {
            name: {
                "dtype": t.dtype,
                "shape": list(t.shape),
                "bytes": _tensor_bytes(t),
                "sharding": describe_sharding(t),
                "chunks": [
                    {"offsets": list(c.offsets), "sizes": list(c.sizes), "object": c.location.key}
                    for c in t.chunks
                ],
            }
            for name, t in tensors.items()
        },
        "values": sorted(manifest.values),
    }


def _inspect_text(
    store: ObjectStore, manifest: Manifest, tensors: dict[str, TensorRecord], name_filter: str
) -> str:
    shown = f"{len(tensors)} of {len(manifest.tensors)}" if name_filter else str(len(tensors))
    lines = [
        *map(printable, _inspect_header(store, manifest)),
        "",
        table(
            ("RANK", "SIZE", "CRC32C", "OBJECT"),
            [
                (str(o.rank), human_size(o.size), f"{o.crc32c:08x}", o.key)
                for o in manifest.objects.values()
            ],
        ),
        "",
        f"tensors: {shown}, {human_size(sum(map(_tensor_bytes, tensors.values())))}",
        table(
            ("NAME", "DTYPE", "SHAPE", "SHARDING"),
            [
                (name, t.dtype, "x".join(map(str, t.shape)) or "scalar", describe_sharding(t))
                for name, t in tensors.items()
            ],
        ),
        "",
        _values_text(list(manifest.values), name_filter),
    ]
    return "\n".join(lines)


def _inspect_header(store: ObjectStore, manifest: Manifest) -> list[str]:
    versions = ", ".join(f"{k} {v}" for k, v in sorted(manifest.versions.items())) or "-"
    objects = len(manifest.objects)
    return [
        f"checkpoint step {manifest.step} at {store.uri}",
        f"  attempt        {manifest.attempt}",
        f"  created        {utc_time(manifest.created_at)} UTC",
        f"  world size     {manifest.world_size}",
        f"  size           {human_size(manifest.total_bytes)} in {plural(objects, 'object')}",
        f"  written        {human_size(manifest.written_bytes)}, referenced in earlier steps "
        f"{human_size(manifest.referenced_bytes)}",
        f"  format         {manifest.format}",
        f"  versions       {versions}",
        f"  user metadata  {json.dumps(manifest.user_metadata, sort_keys=True)}",
    ]


def _values_text(names: list[str], name_filter: str) -> str:
    """Non-tensor values: their names under a filter, else counts per top-level key."""
    if name_filter:
        matching = [n for n in names if n.startswith(name_filter)]
        return "\n".join(
            [f"values: {len(matching)} of {len(names)}", *(f"  {printable(n)}" for n in matching)]
        )
    counts: dict[str, int] = {}
    for name in names:
        top = name.split(".")[0]
        counts[top] = counts.get(top, 0) + 1
    groups = ", ".join(f"{printable(top)} {count}" for top, count in counts.items())
    return f"values: {len(names)} ({groups or 'none'}; --filter PREFIX lists them)"
