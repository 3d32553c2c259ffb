"""``spotckpt ls``: committed checkpoints and, with ``--all``, unfinished attempts, attempts that
a kept step still references, quarantined manifests, open uploads and look-alike folders; with
``--mirrors``, each mirror's newest step and how far it is behind (`Mirror.lag`)."""

from __future__ import annotations

from datetime import datetime
from typing import Any

import click

from spotckpt.catalog import Catalog, Scan
from spotckpt.cli.common import (
    check_root,
    closing_store,
    emit_json,
    json_option,
    one_line,
    opened_root,
    plural,
    probe_root,
    redacted,
    register_secrets,
    storage_option,
    table,
    uri_argument,
    utc_time,
)
from spotckpt.config import Config
from spotckpt.errors import (
    CheckpointError,
    CorruptCheckpointError,
    ManifestError,
    NoCheckpointError,
)
from spotckpt.layout import ATTEMPT_PREFIX, attempt_folders, parse_step_folder
from spotckpt.mirror_spec import MirrorTarget, parse_mirrors
from spotckpt.mirroring import Mirror
from spotckpt.policy import RetentionPolicy
from spotckpt.redact import printable
from spotckpt.storage import ObjectStore, UploadInfo
from spotckpt.units import human_size


@click.command("ls")
@uri_argument
@click.option("--all", "show_all", is_flag=True, help="Also uncommitted attempts and uploads.")
@click.option(
    "--mirrors",
    "show_mirrors",
    is_flag=True,
    help="Also each mirror's newest step and lag (the config's mirrors, or --mirror).",
)
@click.option(
    "--mirror",
    "mirror_uris",
    multiple=True,
    metavar="URI",
    help="With --mirrors: this mirror instead of the config's (repeatable; no storage options).",
)
@storage_option
@json_option
def ls_command(
    uri: str | None,
    show_all: bool,
    show_mirrors: bool,
    mirror_uris: tuple[str, ...],
    storage_options: tuple[tuple[str, str], ...],
    as_json: bool,
) -> None:
    """List committed checkpoints (with --all, also unfinished attempts and uploads; with
    --mirrors, each mirror's newest step and how far it is behind)."""
    if mirror_uris and not show_mirrors:
        raise click.UsageError("--mirror needs --mirrors")
    with opened_root(uri, storage_options) as store:
        catalog = Catalog(store)
        scan = catalog.scan(with_uploads=show_all)
        rows = _committed_rows(catalog, scan)
        if show_all:
            rows += _uncommitted_rows(catalog, scan)
            rows += _quarantined_rows(catalog, scan)
            rows += [_upload_row(u) for u in scan.uploads]
            rows += [_ignored_row(name) for name in scan.look_alikes]
        rows.sort(key=lambda r: (r["step"] if r["step"] is not None else -1, r["status"]))
        mirrors = _mirror_rows(store, _mirror_targets(uri, mirror_uris)) if show_mirrors else None
        if as_json:
            document: dict[str, Any] = {"uri": store.uri, "checkpoints": rows}
            emit_json(document if mirrors is None else document | {"mirrors": mirrors})
            return
        if not rows:
            click.echo(printable(f"no committed checkpoints at {store.uri}"))
        else:
            click.echo(table(_LS_HEADERS, [_ls_cells(r) for r in rows]))
        if mirrors is not None:
            click.echo()
            if not mirrors:
                click.echo("no mirrors (set mirrors in the config, or pass --mirror URI)")
            else:
                click.echo(table(_MIRROR_HEADERS, [_mirror_cells(row) for row in mirrors]))


# Mirrors ------------------------------------------------------------------------------------------

_MIRROR_HEADERS = ("MIRROR", "NEWEST STEP", "BEHIND")


def _mirror_targets(uri: str | None, given: tuple[str, ...]) -> tuple[MirrorTarget, ...]:
    """The `given` mirrors (without storage options), else the config's `mirrors` setting, each
    with its own options (redacted from what is printed)."""
    if given:
        return parse_mirrors(list(given))
    targets = parse_mirrors(Config.load(uri=uri or None).mirrors)
    for target in targets:
        register_secrets(dict(target.storage_options))
    return targets


def _mirror_rows(store: ObjectStore, targets: tuple[MirrorTarget, ...]) -> list[dict[str, Any]]:
    """Per mirror: its URI (redacted), newest step and lag behind the root of `store`, or why it
    cannot be read (``error``)."""
    rows = []
    for target in targets:
        row: dict[str, Any] = {
            "mirror": redacted(target.uri),
            "step": None,
            "steps_behind": None,
            "seconds_behind": None,
        }
        try:
            with closing_store(target.uri, dict(target.storage_options)) as mirror_store:
                check_root(mirror_store)
                probe_root(mirror_store)
                mirror = Mirror(Catalog(store), Catalog(mirror_store))
                row["step"] = mirror.target.latest()
                row["steps_behind"], row["seconds_behind"] = mirror.lag()
        except CheckpointError as error:
            row["error"] = one_line(f"{type(error).__name__}: {error}")
        rows.append(row)
    return rows


def _mirror_cells(row: dict[str, Any]) -> list[str]:
    step = "-" if row["step"] is None else str(row["step"])
    if "error" in row:
        behind = f"cannot be read: {row['error']}"
    elif row["steps_behind"] == 0:
        behind = "up to date"
    else:
        seconds = row["seconds_behind"]
        shown = "time unknown" if seconds is None else f"{seconds:.0f} s"
        behind = f"{plural(row['steps_behind'], 'step')}, {shown}"
    return [row["mirror"], step, behind]


_LS_HEADERS = (
    "STEP",
    "STATUS",
    "CREATED (UTC)",
    "SIZE",
    "REFERENCED",
    "WORLD",
    "OBJECTS",
    "ATTEMPT",
)


def _iso(moment: datetime | None) -> str | None:
    return moment.isoformat() if moment is not None else None


def _committed_rows(catalog: Catalog, scan: Scan) -> list[dict[str, Any]]:
    rows = []
    for step in scan.committed:
        try:
            manifest = catalog.read_manifest(step)
        except (ManifestError, CorruptCheckpointError) as error:  # an index part's too
            rows.append(_row(step, "invalid", None, None, None, None, None, redacted(str(error))))
            continue
        row = _row(
            step,
            "committed",
            manifest.created_at,
            manifest.written_bytes,
            manifest.world_size,
            len(manifest.objects),
            manifest.attempt,
        )
        rows.append(row | {"referenced_bytes": manifest.referenced_bytes})
    return rows


def _uncommitted_rows(catalog: Catalog, scan: Scan) -> list[dict[str, Any]]:
    """Attempt folders no manifest of their own step holds: an unfinished save's, or (status
    ``referenced``) a retired step's objects that a kept step still references."""
    rows = []
    held = RetentionPolicy(None).decide(catalog.read_steps()).needed
    for step, folder in sorted(scan.steps.items()):
        referenced: set[str] = set()
        if folder.has_manifest:
            try:
                referenced = attempt_folders(catalog.read_manifest(step))
            except (ManifestError, CorruptCheckpointError, NoCheckpointError):
                continue
        if folder.quarantined:
            referenced |= catalog.quarantined_attempts(step)
        for name, group in sorted(folder.attempts.items()):
            if name in referenced:
                continue
            newest = group.newest()
            rows.append(
                _row(
                    step,
                    "referenced" if f"{folder.folder}/{name}" in held else "uncommitted",
                    _iso(newest),
                    sum(o.size for o in group.objects),
                    None,
                    len(group.objects),
                    name.removeprefix(ATTEMPT_PREFIX),
                )
            )
    return rows


def _quarantined_rows(catalog: Catalog, scan: Scan) -> list[dict[str, Any]]:
    rows = []
    for step, folder in sorted(scan.steps.items()):
        for record in folder.quarantined:
            reason = catalog.quarantine_reason(step, record)
            row = _row(step, "quarantined", None, None, None, None, record)
            row["error"] = redacted(str(reason.get("reason", "reason unreadable")))
            rows.append(row)
    return rows


def _ignored_row(name: str) -> dict[str, Any]:
    row = _row(None, "ignored", None, None, None, None, None)
    row["key"] = name
    row["error"] = "not a canonical step folder name (look-alike); never read"
    return row


def _upload_row(upload: UploadInfo) -> dict[str, Any]:
    step = parse_step_folder(upload.key.partition("/")[0])
    row = _row(step, "upload", _iso(upload.initiated), None, None, None, None)
    row["key"] = upload.key
    return row


def _row(
    step: int | None,
    status: str,
    created: str | None,
    size: int | None,
    world: int | None,
    objects: int | None,
    attempt: str | None,
    error: str | None = None,
) -> dict[str, Any]:
    row: dict[str, Any] = {
        "step": step,
        "status": status,
        "created_at": created,
        "bytes": size,
        "world_size": world,
        "objects": objects,
        "attempt": attempt,
    }
    if error is not None:
        row["error"] = error
    return row


def _ls_cells(row: dict[str, Any]) -> list[str]:
    def text(value: Any) -> str:
        return "-" if value is None else str(value)

    attempt = row["attempt"] if row["status"] not in ("upload", "ignored") else row["key"]
    if row["status"] in ("invalid", "quarantined", "ignored"):
        attempt = f"{attempt}: {row['error']}" if attempt else row["error"]
    return [
        text(row["step"]),
        row["status"],
        utc_time(row["created_at"]),
        "-" if row["bytes"] is None else human_size(row["bytes"]),
        human_size(row["referenced_bytes"]) if row.get("referenced_bytes") else "-",
        text(row["world_size"]),
        text(row["objects"]),
        text(attempt),
    ]
