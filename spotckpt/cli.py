"""The ``spotckpt`` command line: ls, inspect, verify, gc, export-hf, stats, launch.

The checkpoint URI argument may be left out when ``SPOTCKPT_URI`` or ``uri`` in ``spotckpt.toml``
(see `spotckpt.config.Config`) gives it. Storage options come from the config's
``storage_options``, overridden one by one with ``--storage-option key=value``.

Exit status: 0 success; 1 a checkpoint failed verification (``verify`` found problems, or another
command met corrupt data or an invalid manifest); 2 anything else that stops a command (bad
usage or URI, a checkpoint root that does not exist, missing step, unreadable config, storage
errors), with a one-line message on stderr. With ``--json`` every outcome is one JSON document on
stdout, errors included (``{"error": "...", "exit_code": 2}``), with the same exit status.
Progress bars appear on stderr only when it is a terminal; log records are one line each.
Credentials are never printed, and control characters in names read from a bucket are escaped.
Only ``verify``, ``export-hf`` and ``launch`` import torch.

``launch`` is the exception to the statuses above: it runs a training job under torch's elastic
launcher and exits with the job's status (0 done, 75 preempted, else the first failed worker's
status; 2 on bad usage); see `spotckpt.launch`.
"""

from __future__ import annotations

import json
import logging
import re
import sys
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, NoReturn
from urllib.parse import unquote, urlsplit

import click

from spotckpt.catalog import ATTEMPT_PREFIX, Catalog, Scan, attempt_folders, parse_step_folder
from spotckpt.config import Config
from spotckpt.cost import DEFAULT_PRICES, load_prices
from spotckpt.errors import (
    CheckpointError,
    ConfigError,
    CorruptCheckpointError,
    InvalidArgumentError,
    ManifestError,
    MissingDependencyError,
    MissingURIError,
    NoCheckpointError,
)
from spotckpt.format.dtypes import BY_NAME
from spotckpt.format.manifest import Manifest, TensorRecord
from spotckpt.format.signing import Keyring, keyring_of
from spotckpt.gc import collect_garbage
from spotckpt.goodput import load_stats
from spotckpt.redact import is_secret_key, printable, redact, secret_values
from spotckpt.policy import RetentionPolicy
from spotckpt.storage.base import ObjectNotFoundError, ObjectStore, StorageError, UploadInfo
from spotckpt.storage.registry import open_store, uri_scheme
from spotckpt.units import human_size
from spotckpt.version import __version__

EXIT_OK, EXIT_FAILED_VERIFICATION, EXIT_USAGE, EXIT_INTERRUPTED = 0, 1, 2, 130
_secrets: set[str] = set()
_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([smhd]?)\s*$", re.IGNORECASE)
_DURATION_UNITS = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(?:([kmgt])(i?))?b?\s*$", re.IGNORECASE)
_FLOAT_DTYPES = sorted(n for n, d in BY_NAME.items() if d.is_floating_point)


class _CommandFailed(CheckpointError):
    """A command ran and printed its result, which is a failure (exit status 1)."""


class _RootMissingError(StorageError):
    """The checkpoint root (a local folder, a bucket) does not exist."""


# Helpers: options, opening the store, formatting ------------------------------------------------


def _redact(text: str) -> str:
    return redact(text, _secrets)


def _resolve(uri: str | None, pairs: Sequence[tuple[str, str]]) -> tuple[str, dict[str, Any]]:
    """The checkpoint URI and storage options from the arguments over the config."""
    cli_options = dict(pairs)
    _secrets.update(secret_values(cli_options))
    try:
        config = Config.load(uri=uri or None)
    except MissingURIError:
        raise click.UsageError(
            "no checkpoint URI: pass the URI argument or set SPOTCKPT_URI "
            "(or put uri in spotckpt.toml)"
        ) from None
    _secrets.update(secret_values(config.storage_options))
    return config.uri, {**config.storage_options, **cli_options}


def _keyring(uri: str | None) -> Keyring | None:
    """The signing keys of the configuration (``SPOTCKPT_SIGNING_KEY``, ``SPOTCKPT_VERIFY_KEYS``,
    ``SPOTCKPT_ACCEPT_UNSIGNED`` or the config file): with any, unsigned and wrongly signed
    steps are refused."""
    return keyring_of(Config.load(uri=uri or None))


@contextmanager
def _opened(uri: str | None, pairs: Sequence[tuple[str, str]]) -> Iterator[ObjectStore]:
    """The checkpoint root's store; a root that does not exist is an error."""
    resolved, options = _resolve(uri, pairs)
    with _closing_store(resolved, options) as store:
        _check_root(store)
        yield store


def _check_root(store: ObjectStore) -> None:
    """Raise _RootMissingError for a local root that is not a folder.

    A missing bucket shows as ObjectNotFoundError from the first listing (see `_probe_root`)."""
    if uri_scheme(store.uri) != "file":
        return
    parts = urlsplit(store.uri)
    path = Path(unquote(parts.path) if parts.scheme == "file" else store.uri)
    if not path.is_dir():
        what = "is not a folder" if path.exists() else "does not exist"
        raise _RootMissingError(f"checkpoint root {path} {what}")


def _probe_root(store: ObjectStore) -> None:
    """List one object so that a missing bucket raises _RootMissingError."""
    try:
        next(iter(store.list()), None)
    except ObjectNotFoundError as error:  # S3 NoSuchBucket, GCS 404 on the bucket
        raise _RootMissingError(f"checkpoint root {store.uri} does not exist: {error}") from None


@contextmanager
def _closing_store(uri: str, options: dict[str, Any]) -> Iterator[ObjectStore]:
    store = open_store(uri, **options)
    try:
        yield store
    finally:
        store.close()


def _human_age(seconds: float | None) -> str:
    if seconds is None:
        return "age unknown"
    if seconds < 120:
        return f"{seconds:.0f} s old"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min old"
    return f"{seconds / 3600:.1f} h old"


def _when(text_or_time: str | datetime | None) -> str:
    """A UTC time to the second; a manifest's text that is not ISO 8601 is shown as it is."""
    if text_or_time is None:
        return "-"
    if isinstance(text_or_time, str):
        try:
            moment = datetime.fromisoformat(text_or_time)
        except ValueError:
            return text_or_time
    else:
        moment = text_or_time
    if moment.tzinfo is not None:
        moment = moment.astimezone(timezone.utc)
    return moment.strftime("%Y-%m-%d %H:%M:%S")


def _plural(count: int, noun: str) -> str:
    return f"{count} {noun}" if count == 1 else f"{count} {noun}s"


def _iso(moment: datetime | None) -> str | None:
    return moment.isoformat() if moment is not None else None


def _table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """Aligned columns; cells (names read from a bucket among them) are made printable."""
    rows = [[printable(str(cell)) for cell in row] for row in rows]
    widths = [max(len(str(x)) for x in column) for column in zip(headers, *rows, strict=False)]
    lines = [
        "  ".join(str(cell).ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip()
        for row in [headers, *rows]
    ]
    return "\n".join(lines)


def _emit_json(document: Any) -> None:
    click.echo(json.dumps(document, indent=2, default=str))


def parse_duration(text: str) -> float:
    """Seconds in ``90``, ``90s``, ``30m``, ``1h``, ``2d``; ValueError otherwise."""
    match = _DURATION.match(text)
    if match is None:
        raise InvalidArgumentError(f"{text!r} is not a duration such as 90s, 30m, 1h or 2d")
    return float(match.group(1)) * _DURATION_UNITS[match.group(2).lower()]


def parse_size(text: str) -> int:
    """Bytes in ``5GB`` (decimal), ``2GiB`` (binary), ``500MB``, ``1000000``; ValueError
    otherwise."""
    match = _SIZE.match(text)
    if match is None:
        raise InvalidArgumentError(f"{text!r} is not a size such as 5GB, 500MB or 2GiB")
    prefix, binary = (match.group(2) or "").lower(), bool(match.group(3))
    power = " kmgt".index(prefix) if prefix else 0
    size = int(float(match.group(1)) * (1024 if binary else 1000) ** power)
    if size < 1:
        raise InvalidArgumentError(f"{text!r} is less than 1 byte")
    return size


class _Parsed(click.ParamType):
    """A click parameter type from a parse function that raises ValueError."""

    def __init__(self, name: str, parse: Callable[[str], Any]) -> None:
        self.name = name
        self.parse = parse

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        if not isinstance(value, str):
            return value
        try:
            return self.parse(value)
        except ValueError as error:
            self.fail(str(error), param, ctx)


def _storage_pair(text: str) -> tuple[str, str]:
    key, sep, value = text.partition("=")
    if not sep:
        shown = "text that names a credential" if is_secret_key(text) else repr(text.strip())
        raise InvalidArgumentError(f"expected KEY=VALUE, got {shown} without '='")
    if not key.strip():
        raise InvalidArgumentError("expected KEY=VALUE, got no KEY before '='")
    return key.strip(), value


@contextmanager
def _progress_bar(description: str, unit: str = "B") -> Iterator[Callable[[int, int], None]]:
    """A callback ``(done, total)`` that drives a tqdm bar on stderr when it is a terminal;
    in bytes (scaled to KiB, MiB, ...), or in another `unit` counted as it is."""
    from tqdm import tqdm  # only the commands with progress bars pay for importing it

    bar = tqdm(
        desc=description,
        total=0,
        unit=unit,
        unit_scale=unit == "B",
        unit_divisor=1024,
        file=sys.stderr,
        disable=not sys.stderr.isatty(),
        leave=False,
    )

    def update(done: int, total: int) -> None:
        if bar.total != total:
            bar.total = total
        bar.update(done - bar.n)

    try:
        yield update
    finally:
        bar.close()


def _resolve_step(store: ObjectStore, step: int | None) -> int:
    try:
        return Catalog(store).resolve(step)
    except NoCheckpointError:
        if step is not None:
            _probe_root(store)
        raise


# Shared options -----------------------------------------------------------------------------------

_uri_argument = click.argument("uri", required=False, metavar="[URI]")
_json_option = click.option("--json", "as_json", is_flag=True, help="Print JSON for scripts.")
_storage_option = click.option(
    "--storage-option",
    "-o",
    "storage_options",
    multiple=True,
    type=_Parsed("KEY=VALUE", _storage_pair),
    metavar="KEY=VALUE",
    help="Storage back-end option (repeatable), over the config's storage_options.",
)
_step_option = click.option(
    "--step", type=click.IntRange(min=0), default=None, help="Step (default: the latest)."
)


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="spotckpt")
@click.option("-v", "--verbose", is_flag=True, help="Log what is done on stderr.")
def cli(verbose: bool) -> None:
    """Inspect, verify, clean up and export spotckpt checkpoints; launch training jobs.

    URI is s3://bucket/prefix, gs://bucket/prefix, file:///path or a path; without it,
    SPOTCKPT_URI or uri in ./spotckpt.toml is used.
    """
    _configure_logging(verbose)


class _OneLineFormatter(logging.Formatter):
    """``spotckpt: warning: message (Error: text)``: one redacted, printable line per record."""

    def format(self, record: logging.LogRecord) -> str:
        text = record.getMessage()
        if record.exc_info is not None and record.exc_info[1] is not None:
            error = record.exc_info[1]
            text += f" ({type(error).__name__}: {error})"
        return f"spotckpt: {record.levelname.lower()}: {_one_line(text)}"


def _configure_logging(verbose: bool) -> None:
    """spotckpt's records (DEBUG and up with --verbose, else WARNING and up) and other libraries'
    warnings go to stderr, one line each; so do Python warnings."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(_OneLineFormatter())
    package = logging.getLogger("spotckpt")
    package.handlers = [handler]
    package.propagate = False
    package.setLevel(logging.DEBUG if verbose else logging.WARNING)
    logging.basicConfig(level=logging.WARNING, handlers=[handler])
    logging.captureWarnings(True)


# ls -----------------------------------------------------------------------------------------------


@cli.command("ls")
@_uri_argument
@click.option("--all", "show_all", is_flag=True, help="Also uncommitted attempts and uploads.")
@_storage_option
@_json_option
def ls_command(
    uri: str | None, show_all: bool, storage_options: tuple[tuple[str, str], ...], as_json: bool
) -> None:
    """List committed checkpoints (with --all, also unfinished attempts and uploads)."""
    with _opened(uri, storage_options) as store:
        catalog = Catalog(store)
        scan = catalog.scan(with_uploads=show_all)
        rows = _committed_rows(catalog, scan)
        if show_all:
            rows += _uncommitted_rows(catalog, scan)
            rows += _quarantined_rows(catalog, scan)
            rows += [_upload_row(u) for u in scan.uploads]
            rows += [_ignored_row(name) for name in scan.look_alikes]
        rows.sort(key=lambda r: (r["step"] if r["step"] is not None else -1, r["status"]))
        if as_json:
            _emit_json({"uri": store.uri, "checkpoints": rows})
            return
        if not rows:
            click.echo(printable(f"no committed checkpoints at {store.uri}"))
            return
        click.echo(_table(_LS_HEADERS, [_ls_cells(r) for r in rows]))


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


def _committed_rows(catalog: Catalog, scan: Scan) -> list[dict[str, Any]]:
    rows = []
    for step in scan.committed:
        try:
            manifest = catalog.read_manifest(step)
        except (ManifestError, CorruptCheckpointError) as error:  # an index part's too
            rows.append(_row(step, "invalid", None, None, None, None, None, _redact(str(error))))
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
            row["error"] = _redact(str(reason.get("reason", "reason unreadable")))
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
        _when(row["created_at"]),
        "-" if row["bytes"] is None else human_size(row["bytes"]),
        human_size(row["referenced_bytes"]) if row.get("referenced_bytes") else "-",
        text(row["world_size"]),
        text(row["objects"]),
        text(attempt),
    ]


# inspect ------------------------------------------------------------------------------------------


@cli.command("inspect")
@_uri_argument
@_step_option
@click.option("--filter", "name_filter", default="", help="Only tensors whose name starts so.")
@_storage_option
@_json_option
def inspect_command(
    uri: str | None,
    step: int | None,
    name_filter: str,
    storage_options: tuple[tuple[str, str], ...],
    as_json: bool,
) -> None:
    """Summarise a checkpoint's manifest: tensors, sharding, metadata."""
    with _opened(uri, storage_options) as store:
        manifest = Catalog(store).read_manifest(_resolve_step(store, step))
        tensors = {n: t for n, t in manifest.tensors.items() if n.startswith(name_filter)}
        if as_json:
            _emit_json(_inspect_json(store, manifest, tensors))
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
        _table(
            ("RANK", "SIZE", "CRC32C", "OBJECT"),
            [
                (str(o.rank), human_size(o.size), f"{o.crc32c:08x}", o.key)
                for o in manifest.objects.values()
            ],
        ),
        "",
        f"tensors: {shown}, {human_size(sum(map(_tensor_bytes, tensors.values())))}",
        _table(
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
        f"  created        {_when(manifest.created_at)} UTC",
        f"  world size     {manifest.world_size}",
        f"  size           {human_size(manifest.total_bytes)} in {_plural(objects, 'object')}",
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


# verify -------------------------------------------------------------------------------------------


@cli.command("verify")
@_uri_argument
@_step_option
@_storage_option
@_json_option
@click.option(
    "--digest",
    "with_digest",
    is_flag=True,
    help="Also print the step's digest: equal for every intact copy of the step.",
)
def verify_command(
    uri: str | None,
    step: int | None,
    storage_options: tuple[tuple[str, str], ...],
    as_json: bool,
    with_digest: bool,
) -> None:
    """Check every object of a checkpoint: presence, size, CRC32C (and BLAKE3 and signature
    when signed). Exit 1 on problems."""
    from spotckpt.verify import verify_checkpoint  # imports torch to load the stored values

    with _opened(uri, storage_options) as store:
        chosen = _resolve_step(store, step)
        with _progress_bar(f"verify step {chosen}") as progress:
            report = verify_checkpoint(
                store, chosen, progress=progress, keyring=_keyring(uri), digest=with_digest
            )
    if as_json:
        _emit_json(report.to_dict())
    elif report.ok:
        signature = "" if report.signature is None else f"; {report.signature.describe()}"
        click.echo(
            f"step {chosen}: OK ({_plural(report.objects_checked, 'object')}, "
            f"{human_size(report.bytes_checked)} checked{signature})"
        )
        if report.digest is not None:
            click.echo(f"digest {report.digest}")
    else:
        click.echo(f"step {chosen}: {_plural(len(report.problems), 'problem')}")
        for problem in report.problems:
            click.echo(printable(f"  {problem.kind}: {problem.message}"))
            if problem.tensors and problem.kind in ("missing", "size"):
                click.echo(printable(f"    holds: {_some(problem.tensors)}"))
    if not report.ok:
        problems = _plural(len(report.problems), "problem")
        raise _CommandFailed(f"step {chosen} failed verification: {problems}")


def _some(names: Sequence[str], limit: int = 6) -> str:
    shown = ", ".join(names[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")


# gc -----------------------------------------------------------------------------------------------


@cli.command("gc")
@_uri_argument
@click.option("--dry-run", is_flag=True, help="Report what would be deleted; delete nothing.")
@click.option(
    "--keep-last",
    type=click.IntRange(min=1),
    default=None,
    help="Also delete committed checkpoints but the newest N (default: keep all).",
)
@click.option(
    "--safety-age",
    type=_Parsed("DURATION", parse_duration),
    default="1h",
    show_default=True,
    help="Leave anything younger than this alone (90s, 30m, 1h, 2d).",
)
@click.option(
    "--delete-unreadable",
    is_flag=True,
    help=(
        "Also delete committed steps whose manifest cannot be read (damaged, unsigned under "
        "the key, or from a newer spotckpt); otherwise they and older steps' objects stay."
    ),
)
@_storage_option
@_json_option
def gc_command(
    uri: str | None,
    dry_run: bool,
    keep_last: int | None,
    safety_age: float,
    delete_unreadable: bool,
    storage_options: tuple[tuple[str, str], ...],
    as_json: bool,
) -> None:
    """Delete unreferenced attempts, uncommitted steps and stale uploads; apply retention."""
    with _opened(uri, storage_options) as store, _progress_bar("gc", unit="step") as progress:
        report = collect_garbage(
            store,
            keep_last=keep_last,
            safety_age_s=safety_age,
            dry_run=dry_run,
            progress=progress,
            keyring=_keyring(uri),
            delete_unreadable=delete_unreadable,
        )
    if as_json:
        _emit_json(report.to_dict())
        return
    for action in report.actions:
        verb = _gc_verb(action.kind, dry_run)
        details = (
            f"{_plural(action.objects, 'object')}, {human_size(action.bytes)}"
            if action.kind != "upload"
            else _human_age(action.age_s)
        )
        if action.kind in ("attempt", "uncommitted"):
            details += f", {_human_age(action.age_s)}"
        click.echo(printable(f"{verb} {action.kind} {action.target} ({details})"))
    for kept in report.kept:
        click.echo(printable(f"kept {kept}"))
    total = f"{_plural(report.objects_deleted, 'object')}, {human_size(report.bytes_freed)}"
    click.echo(
        f"{'would free' if dry_run else 'freed'} {total}" + (" (dry run)" if dry_run else "")
    )


def _gc_verb(kind: str, dry_run: bool) -> str:
    if kind == "upload":
        return "would abort" if dry_run else "aborted"
    return "would delete" if dry_run else "deleted"


# export-hf ----------------------------------------------------------------------------------------


@cli.command("export-hf")
@click.argument("locations", nargs=-1, metavar="[URI] OUT")
@_step_option
@click.option(
    "--max-shard-size",
    type=_Parsed("SIZE", parse_size),
    default="5GB",
    show_default=True,
    help="Largest output file (5GB, 500MB, 2GiB, bytes).",
)
@click.option(
    "--dtype",
    type=click.Choice(_FLOAT_DTYPES),
    default=None,
    help="Cast floating-point tensors to this dtype.",
)
@click.option("--prefix", default="model.", show_default=True, help="Export tensors under this.")
@click.option("--keep-prefix", is_flag=True, help="Keep the prefix in the output names.")
@click.option(
    "--include",
    "include",
    multiple=True,
    metavar="PATH",
    help="Copy this local file into OUT, or a folder's top-level files but weights and hidden "
    "ones (repeatable): config.json, tokenizer files.",
)
@click.option(
    "--keep-tied",
    is_flag=True,
    help="Write tied weights under every name (by default once, as save_pretrained does).",
)
@click.option("--overwrite", is_flag=True, help="Replace an export or included files in OUT.")
@_storage_option
@_json_option
def export_command(
    locations: tuple[str, ...],
    step: int | None,
    max_shard_size: int,
    dtype: str | None,
    prefix: str,
    keep_prefix: bool,
    include: tuple[str, ...],
    keep_tied: bool,
    overwrite: bool,
    storage_options: tuple[tuple[str, str], ...],
    as_json: bool,
) -> None:
    """Write a checkpoint's model weights as Hugging Face safetensors into OUT.

    OUT is a folder or a bucket URI. Storage options apply to OUT too when it is of the same
    kind (scheme) as URI. A weight tied to the input embeddings (lm_head.weight) is written once,
    as save_pretrained does; --include adds config and tokenizer files so that OUT loads with
    from_pretrained as it is.
    """
    if not 1 <= len(locations) <= 2:
        raise click.UsageError("export-hf takes [URI] OUT: one or two locations")
    uri, out = (None, locations[0]) if len(locations) == 1 else locations
    try:
        resolved, options = _resolve(uri, storage_options)
    except click.UsageError:  # one location, and no URI configured: OUT is what is missing
        raise click.UsageError(
            f"missing argument OUT: export-hf writes into a folder or bucket URI given after "
            f"the checkpoint URI (spotckpt export-hf {locations[0]} OUT); a single location is "
            "OUT when SPOTCKPT_URI or spotckpt.toml names the checkpoint, and neither does"
        ) from None
    from spotckpt.export import export_hf  # imports torch: only this command needs it

    cast = BY_NAME[dtype].torch_dtype if dtype is not None else None
    out_options = options if uri_scheme(out) == uri_scheme(resolved) else {}
    with _closing_store(resolved, options) as store:
        _check_root(store)
        chosen = _resolve_step(store, step)
        with (
            _closing_store(out, out_options) as out_store,
            _progress_bar(f"export step {chosen}") as progress,
        ):
            report = export_hf(
                store,
                chosen,
                out_store,
                keyring=_keyring(uri),
                max_shard_size=max_shard_size,
                dtype=cast,
                prefix=prefix,
                strip_prefix=not keep_prefix,
                overwrite=overwrite,
                include=include,
                dedupe_tied=not keep_tied,
                progress=progress,
            )
    if as_json:
        _emit_json(report.to_dict())
        return
    index = [report.index] if report.index is not None else []
    for name in [*report.files, *report.included, *index]:  # in the order they were written
        click.echo(printable(f"wrote {report.out_uri}/{name}"))
    for dropped, kept in report.tied.items():
        click.echo(printable(f"{dropped} is tied to {kept}: written once"))
    click.echo(
        f"step {chosen}: {report.tensors} tensors, {report.total_parameters:,} parameters, "
        f"{human_size(report.total_size)} in {_plural(len(report.files), 'file')}"
    )


# stats --------------------------------------------------------------------------------------------


@cli.command("stats")
@_uri_argument
@_storage_option
@_json_option
@click.option(
    "--prices",
    "prices_path",
    type=click.Path(exists=True, dir_okay=False),
    help="JSON object of prices replacing the defaults (S3 Standard, us-east-1): "
    "write_per_1000, read_per_1000, delete_per_1000, storage_per_gb_month, egress_per_gb, "
    "currency.",
)
def stats_command(
    uri: str | None,
    storage_options: tuple[tuple[str, str], ...],
    as_json: bool,
    prices_path: str | None,
) -> None:
    """Goodput from the run's events: evictions, steps lost, save costs, the interval; and the
    requests the saves and restores made, with their estimated price.

    Save stall is the time the training loop was blocked; the suggested interval is Daly's
    optimum for the measured save cost, step time and eviction rate. Prices are list prices
    (no free tier, no discounts): an estimate.
    """
    prices = load_prices(prices_path) if prices_path else DEFAULT_PRICES
    with _opened(uri, storage_options) as store:
        stats = load_stats(store, prices)
        if not stats.events:
            _probe_root(store)  # a missing bucket is an error, not "no events"
    if as_json:
        _emit_json(stats.to_dict())
        return
    click.echo("\n".join(printable(line) for line in stats.text().splitlines()))


# launch -------------------------------------------------------------------------------------------


@cli.command(
    "launch",
    context_settings={"ignore_unknown_options": True, "allow_interspersed_args": False},
    add_help_option=False,  # --help goes to torchrun's parser, which lists every option
)
@click.argument("torchrun_args", nargs=-1, type=click.UNPROCESSED)
def launch_command(torchrun_args: tuple[str, ...]) -> int:
    """Run a training script under torchrun; exit 75 when the job was preempted.

    spotckpt launch [TORCHRUN OPTIONS] SCRIPT.py [SCRIPT ARGS], e.g. spotckpt launch
    --standalone --nproc-per-node=2 train.py --steps 200. Exit status: 0 done; 75 preempted
    (the first failed worker exited 75, or the launcher got a stop signal, forwarded it to the
    workers and waited for their emergency save); else that worker's status; 2 bad usage.
    `spotckpt launch --help` lists torchrun's options.
    """
    from spotckpt.launch import main as launch  # imports torch: only this command needs it

    return launch(list(torchrun_args))


# Entry point --------------------------------------------------------------------------------------

_USAGE_ERRORS = (
    ConfigError,
    MissingDependencyError,  # names the extra to install
    NoCheckpointError,
    StorageError,
    ValueError,
    OSError,
    LookupError,
)


def _one_line(text: str) -> str:
    """`text` redacted, on one line, with control characters escaped."""
    return printable(" ".join(_redact(text).split()))


def _run(args: list[str]) -> tuple[int, str | None, bool]:
    """Run the command line: its exit status, the failure's message (None on success), and
    whether the command printed its own result before failing."""
    try:
        code = cli.main(args=args, prog_name="spotckpt", standalone_mode=False)
    except click.exceptions.NoArgsIsHelpError as error:
        click.echo(error.ctx.get_help() if error.ctx is not None else str(error), err=True)
        return EXIT_USAGE, None, True
    except click.UsageError as error:
        return EXIT_USAGE, error.format_message(), False
    except (click.Abort, KeyboardInterrupt):
        return EXIT_INTERRUPTED, "interrupted", False
    except _CommandFailed as error:
        return EXIT_FAILED_VERIFICATION, str(error), True
    except (CorruptCheckpointError, ManifestError) as error:
        return EXIT_FAILED_VERIFICATION, str(error), False
    except _USAGE_ERRORS as error:
        return EXIT_USAGE, str(error) or type(error).__name__, False
    except Exception as error:  # one line, never a traceback: this is the CLI's outermost frame
        return EXIT_USAGE, f"{type(error).__name__}: {error}", False
    return (code if isinstance(code, int) else EXIT_OK), None, False


def _wants_json(args: Sequence[str]) -> bool:
    """Whether ``--json`` is among the options (before any ``--``), even when parsing failed."""
    options = args[: args.index("--")] if "--" in args else args
    return "--json" in options


def _fail(code: int, message: str, *, as_json: bool) -> NoReturn:
    """The one-line error on stderr (and, for --json, as a document on stdout); exit `code`."""
    text = _one_line(message)
    if as_json:
        click.echo(json.dumps({"error": text, "exit_code": code}))
    click.echo(f"spotckpt: error: {text}", err=True)
    sys.exit(code)


def main(argv: Sequence[str] | None = None) -> None:
    """Console-script entry point; exits with 0, 1 or 2 (see the module docstring)."""
    args = list(sys.argv[1:] if argv is None else argv)
    code, message, printed = _run(args)
    if message is not None:
        _fail(code, message, as_json=_wants_json(args) and not printed)
    sys.exit(code)


__all__ = ["cli", "main", "parse_duration", "parse_size"]


if __name__ == "__main__":  # python -m spotckpt.cli, where the console script is not installed
    main()
